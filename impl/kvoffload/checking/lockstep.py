"""The one lockstep driver: an operation applied to a system under test and to the model.

:class:`Lockstep` holds a system (any object with the manager's surface) and an
:class:`~kvoffload_spec.model.OffloadModel` configured alike. :meth:`Lockstep.apply` makes one
:class:`~kvoffload_spec.operations.Operation` on both, the system first, and compares what
they returned or raised (plans field by field, errors by class); :meth:`Lockstep.check`
then compares everything observable: both sides' invariants, the counts, the lookups of the
watched keys, whether each open plan is abandoned (``is_abandoned``), the events, the stats
of a manager that has them, and, when the system states its abstraction
(:mod:`kvoffload_spec.refinement`), the whole abstract state. Every call is recorded, so
a failure (:class:`Divergence`) reads as a numbered history ending in the two things that
differed.

For a policy the spec does not know, ``dictated=True`` makes the model evict exactly what
the system evicted, once checked legal (:class:`DictatedOrder`); everything else (block ids,
states, counters, events, errors) must still be exactly the spec's.

The conformance kit, the soak test, the Offloader's state machine, the bad-input suite and
the CrossHair contracts all drive systems through this class (the policy-level machines of
the mutant hunts, which call a bare policy, compare through the same abstraction).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvoffload_spec.errors import OffloadError
from kvoffload_spec.model import OffloadModel
from kvoffload_spec.operations import (
    ABANDON,
    COMPLETE_LOAD,
    COMPLETE_STORE,
    IS_ABANDONED,
    ON_PLANS,
    PREPARE_LOAD,
    PREPARE_STORE,
    Operation,
    perform,
)
from kvoffload_spec.policies import LruOrder
from kvoffload_spec.refinement import abstract, copy_state, state_differences
from kvoffload_spec.surface import Key, LoadPlan, ManagerSurface, Plan, StorePlan

_T = TypeVar("_T")

VIEWS = ("num_blocks", "num_free_blocks", "num_evictable_blocks", "num_quarantined_blocks")


class Divergence(AssertionError):
    """The system did something the spec would not have done (the message is the history)."""


@dataclass
class DictatedOrder(LruOrder):
    """A spec order whose victims are dictated by the system under test, once checked.

    ``answer`` is what the system's ``prepare_store`` evicted (None if it returned None).
    The spec asks for victims only when it needs some and its O(1) guard passed; the answer
    must then be exactly ``need`` distinct keys the spec may evict, or None only when fewer
    than ``need`` keys could be.
    """

    answer: tuple[Key, ...] | None = None

    def choose_victims(self, need: int, can_evict: Callable[[Key], bool]) -> list[Key] | None:
        if self.answer is None:
            room = sum(1 for key in self.order if can_evict(key))
            if room >= need:
                raise Divergence(f"a store needing {need} was refused; {room} could go")
            return None
        victims = list(self.answer)
        illegal = [key for key in victims if not can_evict(key)]
        if illegal or len(victims) != need or len(set(victims)) != need:
            raise Divergence(
                f"evicted {victims} to make room for {need}: {illegal} are pinned, pending, "
                "protected or absent, or the count is wrong"
            )
        return victims


@dataclass
class Lockstep:
    """A system and the model, driven call by call (see the module's docstring).

    ``held`` are the open plans, each as (the system's, the model's), in the order they
    were issued, ``closed`` the completed ones; an operation's ``plan`` indexes ``held``
    (for a misuse and for ``is_abandoned``, which may ask of a completed plan,
    ``held + closed``).
    ``setting`` describes the configuration in the failure's first line; ``watched`` are
    the keys whose lookups :meth:`check` compares. ``keep`` bounds the record for a long
    run: only the last ``keep`` calls (and completed plans) are kept, numbered as made.
    """

    system: ManagerSurface
    model: OffloadModel
    setting: str = ""
    watched: tuple[Key, ...] = ()
    dictated: bool = False
    label: str = "system"  # what a failure calls the system under test
    held: list[tuple[Plan, Plan]] = field(default_factory=list)
    closed: list[tuple[Plan, Plan]] = field(default_factory=list)
    history: list[tuple[str, object]] = field(default_factory=list)
    plan_names: dict[int, str] = field(default_factory=dict)  # id() of a system's plan
    keep: int | None = None
    forgotten: int = 0  # calls dropped from the front of ``history`` (see ``keep``)

    def __post_init__(self) -> None:
        if self.dictated:
            self.model.state.order = DictatedOrder(self.model.state.order.resident())

    @classmethod
    def mirror(
        cls,
        system: ManagerSurface,
        policy: str = "lru",
        *,
        closed: Sequence[Plan] = (),
        watched: tuple[Key, ...] = (),
        label: str = "system",
    ) -> Lockstep:
        """A lockstep that carries on from ``system``'s present state: the model starts
        from a copy of its abstraction, so the next step checks one commuting square of
        :mod:`kvoffload_spec.refinement` from wherever the system is.

        The abstraction holds the system's own open plans and owner, so each plan is valid
        on both sides: ``held`` pairs each open plan with itself, in the order issued, and
        ``closed`` (plans the system completed already, for misuses) likewise.
        """
        state = abstract(system)
        if state is None:
            raise TypeError(f"{type(system).__name__} states no abstraction (abstract_state)")
        model = OffloadModel.from_state(copy_state(state), policy)
        opened = sorted(state.open_plans.values(), key=lambda plan: plan.plan_id)
        return cls(
            system,
            model,
            setting=f"the {policy} policy, from the state it was in",
            watched=watched,
            label=label,
            held=[(plan, plan) for plan in opened],
            closed=[(plan, plan) for plan in closed],
        )

    # -- one call --------------------------------------------------------------------------

    def apply(self, op: Operation) -> tuple[object, object]:
        """Make ``op`` on the system, then on the model; both must return equal results or
        raise errors of one class. Returns (the system's result, the model's)."""
        stand_in = op.name in ON_PLANS and op.replaces_argument
        if stand_in:  # the plan argument replaced: each side gets its own (see StandIn)
            mine, spec, plan_name = self._stand_ins(op)
            op = Operation(op.name, plan=op.plan, success=op.success)
        else:
            mine, spec = self._plans_of(op)
            plan_name = self.name(mine) if mine is not None else ""
        got, expected = self._both(
            op.describe(plan_name),
            lambda: perform(self.system, op, mine, spec),
            lambda: perform(self.model, op, spec, mine),
            between=self._dictate if op.name == PREPARE_STORE and not op.misuse else None,
        )
        if not stand_in:
            self._account(op, got, expected)
        return got, expected

    def follow(self, op: Operation, got: object) -> tuple[object, object]:
        """The system made ``op`` already (a facade over it did, say an ``Offloader``) and
        it gave ``got`` (its result, or the ``OffloadError`` it raised): make ``op`` on the
        model alone and compare, record and account as :meth:`apply` does."""
        mine, spec = self._plans_of(op)
        got, expected = self._both(
            op.describe(self.name(mine) if mine is not None else ""),
            lambda: got,
            lambda: perform(self.model, op, spec, mine),
            between=self._dictate if op.name == PREPARE_STORE and not op.misuse else None,
        )
        self._account(op, got, expected)
        return got, expected

    def index(self, plan: Plan) -> int:
        """Where the system's ``plan`` is in ``held`` (what an operation on it names)."""
        for number, (mine, _) in enumerate(self.held):
            if mine is plan:
                return number
        raise self.failure(f"{self.name(plan)} is not open")

    def refuse(self, op: Operation) -> OffloadError:
        """:meth:`apply` ``op``, which both sides must refuse with one error class and no
        change: neither side's abstract state (the model's state, the system's abstraction)
        nor the system's ``stats()`` may differ from before. Returns the system's error.
        """
        model_before, mine_before = copy_state(self.model.state), abstract(self.system)
        stats_before = _stats_of(self.system)
        got, _ = self.apply(op)
        if not isinstance(got, OffloadError):
            raise self.failure("both accepted a call that must be refused")
        for side, before, after in (
            ("the spec's state", model_before, self.model.state),
            (f"the {self.label}'s abstract state", mine_before, abstract(self.system)),
        ):
            changed = [] if before is None or after is None else state_differences(after, before)
            if changed:
                raise self.failure(
                    f"the refused call changed {side} (now, before):\n     "
                    + "\n     ".join(changed)
                )
        if _stats_of(self.system) != stats_before:
            raise self.failure(
                f"the refused call changed stats():\n     now    {_stats_of(self.system)}"
                f"\n     before {stats_before}"
            )
        return got

    def step(self, op: Operation) -> tuple[object, object]:
        """:meth:`apply`, then :meth:`check`."""
        outcome = self.apply(op)
        self.check()
        return outcome

    def clone(self) -> None:
        """Carry on with deep copies: plans issued before must still complete on them."""
        self._record("copy.deepcopy(system): the calls go on on the copy", None)
        self.system = copy.deepcopy(self.system)
        # The model's state by copy_state, a deep copy that shares only the immutable plans,
        # events and keys: ~20x faster than deepcopy, and only the system's copy is on test.
        model = copy.copy(self.model)  # its class (a broken model's too) and its settings
        model.state = copy_state(self.model.state)
        self.model = model

    # -- after every call ------------------------------------------------------------------

    def check(self) -> None:
        """Both sides' invariants hold and everything observable agrees (see the module's
        docstring); raise :class:`Divergence` if not."""
        try:
            self.system.check_invariants()
        except Exception as error:  # a broken invariant is whatever the system raises
            raise self.failure(f"the system's check_invariants() raised {error!r}") from error
        self.model.check_invariants()
        for view in VIEWS:
            self.same(view, getattr(self.system, view), getattr(self.model, view))
        for key in self.watched:
            self.same(f"lookup({key!r})", self.system.lookup(key), self.model.lookup(key))
        for open_plan, twin in self.held:
            self.same(
                f"is_abandoned({self.name(open_plan)})",
                self.system.is_abandoned(open_plan),
                self.model.is_abandoned(twin),
            )
        self.same("take_events()", self.system.take_events(), self.model.take_events())
        self._agree_on_stats()
        mine = abstract(self.system)
        if mine is not None:
            differences = state_differences(mine, self.model.state, compare_order=not self.dictated)
            if differences:
                raise self.failure(
                    "then the abstract states differ:\n     " + "\n     ".join(differences)
                )

    def _agree_on_stats(self) -> None:
        stats = getattr(self.system, "stats", None)
        if not callable(stats):
            return
        got = stats()
        model = self.model
        blocks = model.state.blocks.values()
        pending = sum(1 for block in blocks if not block.ready)
        pinned = sum(1 for block in blocks if block.ready and block.refs)
        self.same(
            "stats() (resident, pending, pinned, evictable, free, quarantined)",
            (got.resident, got.pending, got.pinned, got.evictable, got.free, got.quarantined),
            (
                len(blocks),
                pending,
                pinned,
                model.num_evictable_blocks,
                model.num_free_blocks,
                model.num_quarantined_blocks,
            ),
        )

    # -- the record, and failures that read as histories -----------------------------------

    def same(self, what: str, got: object, expected: object) -> None:
        """What both report after the last call must agree."""
        if not agree(got, expected):
            raise self.failure(f"then {what} differs:\n{self._pair(got, expected)}")

    def failure(self, what: str, last_result: bool = True) -> Divergence:
        """``what`` went wrong, after the history so far: numbered calls with the system's
        results (the last call's result is in ``what`` unless ``last_result``)."""
        lines = [f"a failing history, on a {self.label} with {self.setting}:"]
        if self.forgotten:
            lines.append(f"  ... {self.forgotten} earlier calls, not kept")
        last = self.forgotten + len(self.history)
        for number, (call, result) in enumerate(self.history, start=self.forgotten + 1):
            shown_result = last_result or number < last
            returned = f" -> {shown(result)}" if shown_result and "deepcopy" not in call else ""
            lines.append(f"  {number}. {call}{returned}")
        lines.append(f"  -> {what}")
        return Divergence("\n".join(lines))

    def name(self, plan: Plan) -> str:
        """A plan by the call that made it, as the history numbers calls."""
        return self.plan_names.get(id(plan)) or repr(plan)  # repr only when unnamed: hot

    def resident(self, among: Sequence[Key] | None = None) -> list[Key]:
        """The keys of ``among`` (default: the watched ones) the model holds."""
        return [key for key in (among or self.watched) if key in self.model.state.blocks]

    # -- helpers ---------------------------------------------------------------------------

    def _both(
        self,
        call: str,
        on_system: Callable[[], object],
        on_model: Callable[[], object],
        between: Callable[[object], None] | None = None,
    ) -> tuple[object, object]:
        try:
            got = _attempt(on_system)
            if between is not None:
                between(got)
            expected = _attempt(on_model)
        except AssertionError as failure:  # a crash, or victims the spec cannot accept
            self._record(call, None)
            raise self.failure(str(failure), last_result=False) from failure
        self._record(call, got)
        if not agree(got, expected):
            raise self.failure(
                f"the results differ:\n{self._pair(got, expected)}", last_result=False
            )
        return got, expected

    def _record(self, call: str, result: object) -> None:
        self.history.append((call, result))
        keep = self.keep
        if keep is not None and len(self.history) > 2 * keep:  # trimmed now and then: O(1)
            self.forgotten += len(self.history) - keep
            del self.history[:-keep]
            del self.closed[:-keep]
            live = {id(mine) for mine, _ in (*self.held, *self.closed)}
            self.plan_names = {ident: n for ident, n in self.plan_names.items() if ident in live}

    def _stand_ins(self, op: Operation) -> tuple[Any, Any, str]:
        """What each side's call passes for the plan, and its name in the history."""
        argument = op.argument
        if not isinstance(argument, StandIn):
            return argument, argument, repr(argument)
        mine, spec = (self.held + self.closed)[op.plan]
        if argument.foreign:
            mine, spec = spec, mine
        changes: dict[str, Any] = dict(argument.changes)
        described = ", ".join(f"{name}={value!r}" for name, value in argument.changes)
        name = f"the other side's {self.name(spec)}" if argument.foreign else self.name(mine)
        return (
            dataclasses.replace(mine, **changes),
            dataclasses.replace(spec, **changes),
            f"{name} with {described}" if described else name,
        )

    def _pair(self, got: object, expected: object) -> str:
        width = max(len(self.label), len("spec")) + 1
        return (
            f"     {'the ' + self.label + ':':<{width + 4}} {shown(got)}\n"
            f"     {'the spec:':<{width + 4}} {shown(expected)}"
        )

    def _dictate(self, got: object) -> None:
        order = self.model.state.order
        if isinstance(order, DictatedOrder):
            order.answer = got.evicted_keys if isinstance(got, StorePlan) else None

    def _plans_of(self, op: Operation) -> tuple[Plan | None, Plan | None]:
        if op.plan < 0:
            return None, None
        any_issued = op.misuse or op.name == IS_ABANDONED
        return (self.held + self.closed if any_issued else self.held)[op.plan]

    def _account(self, op: Operation, got: object, expected: object) -> None:
        """Keep ``held`` and ``closed`` as the call left them."""
        if op.misuse or isinstance(got, OffloadError):
            return
        if op.name in (PREPARE_STORE, PREPARE_LOAD):
            if isinstance(got, (StorePlan, LoadPlan)) and isinstance(
                expected, (StorePlan, LoadPlan)
            ):
                self.plan_names[id(got)] = f"plan {self.forgotten + len(self.history)}"
                self.held.append((got, expected))
        elif op.name in (COMPLETE_STORE, COMPLETE_LOAD):
            self.closed.append(self.held.pop(op.plan))
        elif op.name == ABANDON:
            pass  # still open: its completion is due


@dataclass(frozen=True)
class StandIn:
    """In the ``argument`` of a plan operation (a completion or ``abandon``): what each
    side passes instead of the plan ``op.plan`` names (an index into ``held + closed``):
    its own plan, or the other side's (``foreign``), with ``changes`` made to its fields (a
    forgery). Any other ``argument`` of a plan operation goes to both sides as it is (junk).
    """

    changes: tuple[tuple[str, object], ...] = ()
    foreign: bool = False


def _stats_of(system: object) -> object:
    stats = getattr(system, "stats", None)
    return stats() if callable(stats) else None


def agree(got: object, expected: object) -> bool:
    """Two results agree: errors by class, anything else by equality."""
    if isinstance(got, OffloadError) or isinstance(expected, OffloadError):
        return type(got) is type(expected)
    return got == expected


def shown(result: object) -> str:
    """A result as a person reads it: a plan's fields by name, an error by its class."""
    if isinstance(result, OffloadError):
        return f"raised {type(result).__name__}"
    if isinstance(result, StorePlan):
        return (
            f"StorePlan(keys={list(result.keys)!r}, block_ids={list(result.block_ids)!r}, "
            f"evicted={list(result.evicted_keys)!r}, "
            f"evicted_block_ids={list(result.evicted_block_ids)!r}, plan_id={result.plan_id}, "
            f"generation={result.generation})"
        )
    if isinstance(result, LoadPlan):
        return (
            f"LoadPlan(keys={list(result.keys)!r}, block_ids={list(result.block_ids)!r}, "
            f"plan_id={result.plan_id}, generation={result.generation})"
        )
    if result is None:
        return "None"
    return repr(result)


def _attempt(call: Callable[[], _T]) -> _T | OffloadError:
    """What ``call`` returned, or the ``OffloadError`` it raised; any other error is a bug."""
    try:
        return call()
    except OffloadError as error:
        return error
    except AssertionError:
        raise
    except Exception as error:
        raise Divergence(f"crashed: {error!r}") from error
