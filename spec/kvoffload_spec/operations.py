"""The manager's operations as data: one :class:`Operation` is one call on the surface.

Every checker speaks this one type: the explorer enumerates operations, the lockstep driver
(:mod:`kvoffload.checking.lockstep`) applies each to a system under test and to the model, the
conformance kit and the soak test draw them at random. :func:`perform` is the one place that
turns an operation into a call, so a new operation is taught to every checker here.

An operation names a plan by an index into the list of plans its checker holds; the checker
resolves it and passes the plan to :func:`perform`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvoffload_spec.surface import Key, LoadPlan, ManagerSurface, Plan, StorePlan

PREPARE_STORE, PREPARE_LOAD, TOUCH = "prepare_store", "prepare_load", "touch"
COMPLETE_STORE, COMPLETE_LOAD, RESET = "complete_store", "complete_load", "reset_cache"
ABANDON, LOOKUP, IS_ABANDONED = "abandon", "lookup", "is_abandoned"

KEYED = (PREPARE_STORE, PREPARE_LOAD, TOUCH)
"""The operations that take a list of keys."""

ON_PLANS = (COMPLETE_STORE, COMPLETE_LOAD, ABANDON, IS_ABANDONED)
"""The operations that take a held plan."""

OPERATIONS = (*KEYED, *ON_PLANS, RESET, LOOKUP)

# Ways to misuse a held plan; each must raise the same error class on every system and
# change nothing.
AGAIN = "again"  # complete a plan already completed
ABANDON_AGAIN = "abandon again"  # abandon a plan already abandoned
FOREIGN = "foreign"  # complete another system's plan (its owner differs)
OTHER_KIND = "other kind"  # complete a store plan as a load, or the reverse
FORGED_ID = "forged id"  # the plan with an id never issued
ALTERED = "altered"  # the plan with another generation
BAD_FLAG = "flag"  # complete_store with a success flag that is not a bool
JUNK = "junk"  # complete_store of something that is not a plan
ABANDON_JUNK = "abandon junk"  # abandon something that is not a plan

PLAN_MISUSES = (FOREIGN, OTHER_KIND, FORGED_ID, ALTERED, BAD_FLAG, JUNK, ABANDON_JUNK)
"""Misuses of a plan that is open or closed."""

CLOSED_MISUSES = (AGAIN, ABANDON_AGAIN)
"""Misuses of a plan that was completed already."""

_NO_ARGUMENT = object()


@dataclass(frozen=True)
class Operation:
    """One call on the manager's surface.

    ``name`` is one of :data:`OPERATIONS`. ``keys`` are the keys of a keyed call or a
    lookup (its first key). ``plan`` is the index of a held plan (completions, ``abandon``,
    ``is_abandoned`` and misuses; ``is_abandoned`` may name a completed plan too).
    ``success`` is a store completion's flag. ``malformed`` appends an unhashable key to
    ``keys``; ``argument``, when given, is passed instead of the keys (a bad argument).
    ``misuse`` (one of :data:`PLAN_MISUSES` or :data:`CLOSED_MISUSES`) turns the call into
    that misuse of the plan.
    """

    name: str
    keys: tuple[Key, ...] = ()
    plan: int = -1
    success: bool = True
    malformed: bool = False
    argument: object = _NO_ARGUMENT
    misuse: str = ""

    @property
    def replaces_argument(self) -> bool:
        """Whether ``argument`` was given: it is passed instead of the keys (or the plan)."""
        return self.argument is not _NO_ARGUMENT

    def arguments(self) -> object:
        """What the call passes for its keys."""
        if self.replaces_argument:
            return self.argument
        return [*self.keys, []] if self.malformed else list(self.keys)

    def describe(self, plan_name: str = "") -> str:
        """The call as a person reads it in a counterexample; ``plan_name`` names the plan."""
        if self.misuse:
            return _misuse_call(self.misuse, self.name, plan_name)
        if self.name == LOOKUP:
            argument = self.arguments() if self.replaces_argument else self.keys[0]
            return f"lookup({argument!r})"
        if self.name in KEYED:
            return f"{self.name}({self.arguments()!r})"
        if self.name == COMPLETE_STORE:
            return f"complete_store({plan_name}, success={self.success})"
        if self.name in ON_PLANS:
            return f"{self.name}({plan_name})"
        return f"{self.name}()"


def perform(
    system: ManagerSurface, op: Operation, plan: Plan | None = None, other: Plan | None = None
) -> object:
    """Make the call ``op`` on ``system`` and return its result.

    ``plan`` is the held plan ``op`` names (resolved by the checker), ``other`` its twin on
    another system (what a ``foreign`` misuse completes).
    """
    if op.misuse:
        _misuse(system, op, plan, other)
        return None
    if op.name == PREPARE_STORE:
        return system.prepare_store(op.arguments())  # type: ignore[arg-type]
    if op.name == PREPARE_LOAD:
        return system.prepare_load(op.arguments())  # type: ignore[arg-type]
    if op.name == TOUCH:
        return system.touch(op.arguments())  # type: ignore[arg-type, func-returns-value]
    if op.name == LOOKUP:
        key = op.arguments() if op.replaces_argument else op.keys[0]
        return system.lookup(key)
    if op.name == RESET:
        return system.reset_cache()  # type: ignore[func-returns-value]
    if op.name == ABANDON:
        return system.abandon(plan)  # type: ignore[arg-type, func-returns-value]
    if op.name == IS_ABANDONED:
        return system.is_abandoned(plan)  # type: ignore[arg-type]
    if op.name == COMPLETE_STORE:
        return system.complete_store(plan, op.success)  # type: ignore[arg-type, func-returns-value]
    if op.name == COMPLETE_LOAD:
        return system.complete_load(plan)  # type: ignore[arg-type, func-returns-value]
    raise ValueError(f"unknown operation {op.name!r}")


def complete(system: ManagerSurface, plan: object, success: bool = True) -> None:
    """Complete ``plan`` with the method its kind calls for (a non-plan goes to stores)."""
    if isinstance(plan, LoadPlan):
        system.complete_load(plan)
    else:
        system.complete_store(plan, success)  # type: ignore[arg-type]


def _misuse(system: ManagerSurface, op: Operation, plan: Plan | None, other: Plan | None) -> None:
    kind = op.misuse
    if kind == ABANDON_AGAIN:
        system.abandon(plan)  # type: ignore[arg-type]
    elif kind == ABANDON_JUNK:
        system.abandon("not a plan")  # type: ignore[arg-type]
    elif kind == FOREIGN:
        complete(system, other)
    elif kind == OTHER_KIND and isinstance(plan, StorePlan):
        system.complete_load(plan)  # type: ignore[arg-type]
    elif kind == OTHER_KIND:
        system.complete_store(plan)  # type: ignore[arg-type]
    elif kind == FORGED_ID and plan is not None:
        complete(system, dataclasses.replace(plan, plan_id=plan.plan_id + 1000))
    elif kind == ALTERED and plan is not None:
        complete(system, dataclasses.replace(plan, generation=plan.generation + 1))
    elif kind == BAD_FLAG and isinstance(plan, StorePlan):
        system.complete_store(plan, success="yes")  # type: ignore[arg-type]
    elif kind == AGAIN:
        complete(system, plan)
    else:  # JUNK, and a bad flag on a load plan
        complete(system, "not a plan")


def _misuse_call(kind: str, name: str, plan: str) -> str:
    complete_call = "complete_load" if name == COMPLETE_LOAD else "complete_store"
    other_call = "complete_store" if name == COMPLETE_LOAD else "complete_load"
    return {
        AGAIN: f"{complete_call}({plan})  # again",
        ABANDON_AGAIN: f"abandon({plan})  # again",
        ABANDON_JUNK: "abandon('not a plan')",
        FOREIGN: f"{complete_call}(the other system's twin of {plan})  # another owner's plan",
        OTHER_KIND: f"{other_call}({plan})  # the wrong kind of plan",
        FORGED_ID: f"{complete_call}({plan} with plan_id + 1000)",
        ALTERED: f"{complete_call}({plan} with generation + 1)",
        BAD_FLAG: f"complete_store({plan}, success='yes')"
        if name == COMPLETE_STORE
        else "complete_store('not a plan')",
    }.get(kind, "complete_store('not a plan')")


def misuse_of(kind: str, plan: Plan, index: int) -> Operation:
    """The operation that misuses ``plan`` (held at ``index``) in the way ``kind`` names."""
    name = COMPLETE_LOAD if isinstance(plan, LoadPlan) else COMPLETE_STORE
    return Operation(name, plan=index, misuse=kind)
