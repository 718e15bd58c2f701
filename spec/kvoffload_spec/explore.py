"""Exhaustive exploration: every state the manager reaches in a few calls, each one checked.

Breadth first from a fresh system, :func:`explore` applies every operation with every
argument from a small alphabet: ``prepare_store``, ``prepare_load`` and ``touch`` of every
ordering of every subset of the keys (and of the empty list, the first key twice, and a
list with an unhashable key), ``reset_cache``, and, for every plan still held (stale ones
after a reset included), its completion, successful or failed and tried a second time at
once, and ``abandon``, which gives up on a stalled job. States are canonicalised (plan ids
and generations renamed, since only "current or stale" of a plan matters), so each is
expanded once. After every call it checks, by families (see :data:`CHECKS`):

``invariants``
    the system's own ``check_invariants()``.
``model``
    what the plans handed out so far predict, whatever the eviction policy: each key's
    lookup, the free, evictable and quarantined counts, whether each plan held is
    abandoned (``is_abandoned``); a refused ``prepare_store`` only
    when the candidates cannot fit in the free blocks plus the blocks that are ready,
    unpinned and outside the call; a store plan's candidates in call order, its victims
    evictable and not in the call, its block ids the lowest free ones; a load of a key that is
    not ready refused with the right error, else planned on the key's own block id.
``events``
    the events emitted are those of the call.
``unchanged``
    a call that raised, a refused store (its offer tracker aside) and a stale completion
    change nothing; a second completion of a plan raises ``PlanAlreadyCompletedError``, a
    second ``abandon`` ``PlanAlreadyAbandonedError``.
``data``
    a shadow of the CPU pool records whose bytes each block id holds (written when a store job
    completes; a reset fences the jobs issued before it, all but the abandoned ones, whose
    block ids stay quarantined); every load reads its own key's bytes, at the start and at the
    end of the read; no store takes a block id being read, nor one an abandoned job may write.

An argument list with an unhashable key must raise ``InvalidArgumentError``, always. The
first violation stops the search; breadth first makes its counterexample a shortest one.

>>> from kvoffload_spec import OffloadModel
>>> report = explore(lambda: OffloadModel(1, enable_events=True), keys=("a",), depth=3)
>>> report.ok, report.complete, report.states
(True, True, 54)

From the command line: ``python -m kvoffload_spec.explore --policy arc --blocks 2 --keys 3
--depth 4``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import inspect
import itertools
import sys
import time
import traceback
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, Protocol, TypeVar, cast

from kvoffload_spec.errors import (
    BlockNotFoundError,
    BlockNotReadyError,
    BlockPendingError,
    InvalidArgumentError,
    PlanAlreadyAbandonedError,
    PlanAlreadyCompletedError,
)
from kvoffload_spec.model import OffloadModel
from kvoffload_spec.operations import (
    ABANDON,
    COMPLETE_LOAD,
    COMPLETE_STORE,
    PREPARE_LOAD,
    PREPARE_STORE,
    RESET,
    TOUCH,
    Operation,
    perform,
)
from kvoffload_spec.policies import POLICY_NAMES
from kvoffload_spec.refinement import Fingerprint, abstract, copy_state, fingerprint
from kvoffload_spec.state import SpecState
from kvoffload_spec.surface import (
    BlocksRemoved,
    BlocksStored,
    Event,
    Key,
    LoadPlan,
    Lookup,
    ManagerSurface,
    RemovalReason,
    StorePlan,
)
from kvoffload_spec.validation import check_count, check_keys, check_seconds

CHECKS = frozenset({"invariants", "model", "events", "unchanged", "data"})
"""The families of checks (see the module's docstring); :func:`explore` runs them all."""


System = ManagerSurface
"""What the explorer drives: the manager's surface. It must also be deep-copyable."""


S = TypeVar("S", bound=System)


FingerprintFn = Callable[[S, Mapping[int, int]], Fingerprint]
"""``fingerprint(system, plan_names)``: ``plan_names`` renames the ids of the plans the
explorer holds to small numbers; a fingerprint must name plans only through it."""


def model_fingerprint(system: object, plan_names: Mapping[int, int]) -> Fingerprint:
    """The fingerprint of any system that states its abstraction (the reference model, the
    production manager): that of its spec state (:func:`kvoffload_spec.refinement.fingerprint`).

    Plan ids and generations are left out (a pending block names its plan by its renamed
    number), and so are the open plans: the explorer holds them, and its second
    completions show whether the system agrees.
    """
    return fingerprint(_abstraction(system), plan_names)


def _abstraction(system: object) -> SpecState:
    state = abstract(system)
    if state is None:
        raise InvalidArgumentError(
            f"explore needs a fingerprint for {type(system).__name__}: it states no "
            "abstraction (abstract_state())"
        )
    return state


def clone_model(model: OffloadModel) -> OffloadModel:
    """A deep copy of the reference model, several times faster than ``copy.deepcopy``
    (see :func:`kvoffload_spec.refinement.copy_state`)."""
    return OffloadModel.from_state(copy_state(model.state), model.policy)


# -- operations ----------------------------------------------------------------------------


def key_sequences(keys: Sequence[Key]) -> list[tuple[Key, ...]]:
    """The key lists passed to ``prepare_*`` and ``touch``: the empty list, every ordering
    of every subset of ``keys``, and the first key twice."""
    sequences: list[tuple[Key, ...]] = [()]
    for size in range(1, len(keys) + 1):
        sequences.extend(itertools.permutations(keys, size))
    return [*sequences, (keys[0], keys[0])]


def _keyed_operations(keys: Sequence[Key]) -> list[Operation]:
    names = (PREPARE_STORE, PREPARE_LOAD, TOUCH)
    calls = [Operation(name, sequence) for name in names for sequence in key_sequences(keys)]
    malformed = [Operation(name, (keys[0],), malformed=True) for name in names]
    return [*calls, Operation(RESET), *malformed]


# -- what the explorer knows besides the system ----------------------------------------------


@dataclass(frozen=True)
class _Held:
    """A plan handed out and not completed yet; ``current`` until the next reset. Once
    abandoned, a store plan made current holds its block ids in ``quarantine`` until it is
    completed: its stalled job may still write them."""

    plan: StorePlan | LoadPlan
    current: bool
    abandoned: bool = False
    quarantine: tuple[int, ...] = ()

    def content(self) -> tuple[object, ...]:
        plan = self.plan
        evicted = repr(plan.evicted_keys) if isinstance(plan, StorePlan) else None
        fate = (self.current, self.abandoned, self.quarantine)
        return (type(plan).__name__, *fate, repr(plan.keys), plan.block_ids, evicted)


@dataclass
class _Node(Generic[S]):
    """A system and the explorer's account of it: the plans it holds, where each resident
    key is and whether it is pending, and whose bytes each block id holds (None: garbage)."""

    system: S
    held: tuple[_Held, ...]
    resident: dict[Key, tuple[int, bool]]  # key -> (block id, pending)
    memory: tuple[Key | None, ...]
    fingerprint: Fingerprint = field(default=Fingerprint(()))

    def plan_names(self) -> dict[int, int]:
        return {held.plan.plan_id: n for n, held in enumerate(self.held)}

    def reads(self) -> list[LoadPlan]:
        """The loads in flight: their blocks are pinned, their block ids being read."""
        return [
            h.plan
            for h in self.held
            if h.current and not h.abandoned and isinstance(h.plan, LoadPlan)
        ]

    def quarantined(self) -> list[int]:
        return [block_id for held in self.held for block_id in held.quarantine]

    def lookup(self, key: Key) -> Lookup:
        found = self.resident.get(key)
        if found is None:
            return Lookup.MISS
        return Lookup.PENDING if found[1] else Lookup.HIT

    def free_block_ids(self) -> list[int]:
        taken = {block_id for block_id, _ in self.resident.values()} | set(self.quarantined())
        return sorted(set(range(len(self.memory))) - taken)

    def evictable(self) -> set[Key]:
        pinned = {key for plan in self.reads() for key in plan.keys}
        return {k for k, (_, pending) in self.resident.items() if not pending} - pinned

    def key(self, with_memory: bool) -> Hashable:
        """The node's identity in the search: everything that decides its future."""
        resident = sorted(
            (repr(k), block_id, pending) for k, (block_id, pending) in self.resident.items()
        )
        held = tuple(held.content() for held in self.held)
        memory = tuple(map(repr, self.memory)) if with_memory else ()
        return (self.fingerprint, held, tuple(resident), memory)


class Violation(Exception):
    """A check failed; the message says which, in words."""


class _ChecksAbstraction(Protocol):
    """A system whose invariant check takes its abstraction, when built already."""

    def check_invariants(self, abstraction: SpecState | None = None) -> None: ...


# -- the report -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Counterexample:
    """A shortest sequence of calls from a fresh system to a failed check."""

    steps: tuple[str, ...]
    message: str

    def __str__(self) -> str:
        lines = [f"  {n}. {step}" for n, step in enumerate(self.steps, 1)]
        return "\n".join([*lines, f"  -> {self.message}"])


@dataclass(frozen=True)
class Report:
    """What an exploration covered and the first violation it found, if any."""

    states: int
    transitions: int
    seconds: float
    depth: int  # the deepest level whose states were all expanded
    complete: bool  # every state within the depth bound was expanded
    violation: Counterexample | None

    @property
    def ok(self) -> bool:
        return self.violation is None

    def summary(self) -> str:
        verdict = "ok" if self.ok else "VIOLATION"
        cover = "all states" if self.complete else f"complete to depth {self.depth}"
        head = (
            f"{verdict}: {self.states} states, {self.transitions} transitions, "
            f"{self.seconds:.1f} s ({cover})"
        )
        if self.violation is None:
            return head
        count = len(self.violation.steps)
        return f"{head}\nshortest counterexample ({count} calls):\n{self.violation}"


# -- one call, checked ----------------------------------------------------------------------


class _Checker(Generic[S]):
    def __init__(
        self,
        fingerprint: FingerprintFn[S] | None,
        clone: Callable[[S], S],
        keys: Sequence[Key],
        store_threshold: int,
        checks: frozenset[str],
    ) -> None:
        self.fingerprint = fingerprint  # None: that of the system's abstraction
        self._takes_abstraction: dict[type, bool] = {}
        self.clone = clone
        self.keys = list(keys)
        self.store_threshold = store_threshold
        self.checks = checks

    def root(self, system: S) -> _Node[S]:
        node = _Node(system, (), {}, (None,) * system.num_blocks)
        self._observe(node, [])
        return node

    def operations(self, node: _Node[S], keyed: list[Operation]) -> list[Operation]:
        on_plans = []
        for n, held in enumerate(node.held):
            if isinstance(held.plan, StorePlan):
                on_plans += [Operation(COMPLETE_STORE, plan=n, success=b) for b in (True, False)]
            else:
                on_plans.append(Operation(COMPLETE_LOAD, plan=n))
            on_plans.append(Operation(ABANDON, plan=n))
        return keyed + on_plans

    def apply(self, node: _Node[S], op: Operation) -> _Node[S] | None:
        """The node after ``op``, or None when it raised as it had to. Raises Violation."""
        allowed, required = self._error_due(node, op)
        # A call that must fail runs on the node's own system, which it must leave as it was.
        in_place = required and "unchanged" in self.checks
        system = node.system if in_place else self.clone(node.system)
        try:
            result = self._call(system, node, op)
        except Exception as error:  # any exception is an outcome to judge
            if allowed is None or not isinstance(error, allowed):
                raise Violation(f"raised {_described(error)}") from error
            self._unchanged(node, system, "a call that raised")
            return None
        if required and allowed is not None:
            raise Violation(f"returned {result!r} where {allowed.__name__} was due")
        child, events = self._advance(node, system, op, result)
        if op.name == PREPARE_STORE and result is None:
            self._unchanged(node, system, "a refused prepare_store", tracker=False)
        held = node.held[op.plan] if op.plan >= 0 else None
        if op.name != ABANDON and held and not (held.current or held.abandoned):
            self._unchanged(node, system, "a stale completion")
        self._observe(child, events)
        return child

    def complete_again(self, node: _Node[S], op: Operation, plan: StorePlan | LoadPlan) -> None:
        """Completing a plan a second time must raise and change nothing."""
        if "unchanged" not in self.checks:
            return
        try:
            if isinstance(plan, StorePlan):
                node.system.complete_store(plan, op.success)
            else:
                node.system.complete_load(plan)
        except PlanAlreadyCompletedError:
            self._unchanged(node, node.system, "a second completion")
            return
        except Exception as error:
            raise Violation(
                f"a second completion raised {_described(error)}, not PlanAlreadyCompletedError"
            ) from error
        raise Violation("a second completion of the same plan was accepted")

    # -- the call and the explorer's account of it ---------------------------------------------

    def _error_due(self, node: _Node[S], op: Operation) -> tuple[type[Exception] | None, bool]:
        """The error ``op`` may raise, and whether it must."""
        if op.malformed:
            return InvalidArgumentError, True
        if op.name == ABANDON and node.held[op.plan].abandoned:
            return PlanAlreadyAbandonedError, True
        if op.name != PREPARE_LOAD:
            return None, False
        if "model" not in self.checks:
            return BlockNotReadyError, False
        for key in op.keys:
            found = node.lookup(key)
            if found is not Lookup.HIT:
                return (BlockNotFoundError if found is Lookup.MISS else BlockPendingError), True
        return None, False

    def _call(self, system: S, node: _Node[S], op: Operation) -> StorePlan | LoadPlan | None:
        plan = node.held[op.plan].plan if op.plan >= 0 else None
        result = perform(system, op, plan)
        return result if isinstance(result, (StorePlan, LoadPlan)) else None

    def _advance(
        self, node: _Node[S], system: S, op: Operation, result: StorePlan | LoadPlan | None
    ) -> tuple[_Node[S], list[Event]]:
        """The explorer's account of the call, checking the plan it returned, and the events
        due. The account follows the plans; :meth:`_observe` settles it with the lookups."""
        held = list(node.held)
        resident = dict(node.resident)
        memory = list(node.memory)
        events: list[Event] = []
        if op.name == PREPARE_STORE and result is not None:
            plan = self._check_store_plan(node, op.keys, result)
            read = {block_id for load in node.reads() for block_id in load.block_ids}
            quarantined = set(node.quarantined())
            for key in plan.evicted_keys:
                resident.pop(key, None)
            for key, block_id in zip(plan.keys, plan.block_ids, strict=True):
                if "data" in self.checks and block_id in read | quarantined:
                    writer = (
                        "a load reads it" if block_id in read else "an abandoned job may write it"
                    )
                    raise Violation(
                        f"data: the store of {key!r} takes block id {block_id}: {writer}"
                    )
                resident[key] = (block_id, True)
                memory[block_id] = None  # being written: garbage until the job completes
            held.append(_Held(plan, True))
            events = _removed(plan.evicted_keys, RemovalReason.EVICTED)
        elif op.name == PREPARE_STORE:
            self._check_refusal(node, op.keys)
        elif op.name == PREPARE_LOAD:
            load = self._check_load_plan(node, op.keys, result)
            self._check_reads(node, load, "starts")
            held.append(_Held(load, True))
        elif op.name == RESET:
            ready = [k for k, (_, pending) in resident.items() if not pending]
            ready.sort(key=lambda k: resident[k][0])  # reported by block id
            events = _removed(tuple(ready), RemovalReason.RESET)
            resident.clear()
            held = [dataclasses.replace(h, current=False) for h in held]  # quarantines last
        elif op.name == ABANDON:
            gone = held[op.plan]
            quarantine: tuple[int, ...] = ()
            if gone.current and isinstance(gone.plan, StorePlan):
                for key in gone.plan.keys:
                    resident.pop(key, None)
                quarantine = gone.plan.block_ids
                events = _removed(gone.plan.keys, RemovalReason.STORE_FAILED)
            held[op.plan] = _Held(gone.plan, gone.current, abandoned=True, quarantine=quarantine)
        elif op.plan >= 0:
            done = held.pop(op.plan)
            if done.abandoned:
                pass  # its job is over: a quarantine ends, nothing else changes
            elif done.current and isinstance(done.plan, StorePlan):
                for key, block_id in zip(done.plan.keys, done.plan.block_ids, strict=True):
                    if op.success:
                        resident[key] = (block_id, False)
                        memory[block_id] = key
                    else:
                        resident.pop(key, None)
                if not op.success:
                    events = _removed(done.plan.keys, RemovalReason.STORE_FAILED)
                elif done.plan.keys:
                    events = [BlocksStored(done.plan.keys)]
            elif done.current:
                self._check_reads(node, cast(LoadPlan, done.plan), "ends")
        held.sort(key=_Held.content)
        return _Node(system, tuple(held), resident, tuple(memory)), events

    def _check_store_plan(self, node: _Node[S], keys: tuple[Key, ...], plan: object) -> StorePlan:
        if not isinstance(plan, StorePlan):
            raise Violation(f"prepare_store returned {plan!r}, not a StorePlan")
        n = len(node.memory)
        if len(plan.block_ids) != len(plan.keys) or not all(0 <= s < n for s in plan.block_ids):
            raise Violation(f"store plan block ids {plan.block_ids} do not fit {plan.keys}")
        if "model" not in self.checks:
            return plan
        absent = [k for k in dict.fromkeys(keys) if k not in node.resident]
        offered = iter(absent)
        if len(set(plan.keys)) != len(plan.keys) or not all(k in offered for k in plan.keys):
            raise Violation(f"plan keys {plan.keys} are not absent keys of the call in order")
        if self.store_threshold == 1 and list(plan.keys) != absent:
            raise Violation(f"plan keys {plan.keys} are not the absent keys {tuple(absent)}")
        evictable = node.evictable() - set(keys)
        wrong = [k for k in plan.evicted_keys if k not in evictable]
        if wrong or len(set(plan.evicted_keys)) != len(plan.evicted_keys):
            raise Violation(f"evicted {plan.evicted_keys}: {wrong} not evictable outside the call")
        free = node.free_block_ids()
        need = max(0, len(plan.keys) - len(free))
        if len(plan.evicted_keys) != need:
            raise Violation(f"evicted {len(plan.evicted_keys)} blocks where {need} were needed")
        freed = sorted(free + [node.resident[k][0] for k in plan.evicted_keys])
        if plan.block_ids != tuple(freed[: len(plan.keys)]):
            raise Violation(
                f"block ids {plan.block_ids} are not the lowest free ones {tuple(freed)}"
            )
        return plan

    def _check_refusal(self, node: _Node[S], keys: tuple[Key, ...]) -> None:
        if "model" not in self.checks:
            return
        absent = [k for k in dict.fromkeys(keys) if k not in node.resident]
        free = len(node.free_block_ids())
        evictable = len(node.evictable() - set(keys))
        if len(absent) > free + evictable:
            return
        raise Violation(
            f"prepare_store refused {len(absent)} absent keys with {free} free blocks and "
            f"{evictable} evictable outside the call"
        )

    def _check_load_plan(self, node: _Node[S], keys: tuple[Key, ...], plan: object) -> LoadPlan:
        if not isinstance(plan, LoadPlan):
            raise Violation(f"prepare_load returned {plan!r}, not a LoadPlan")
        n = len(node.memory)
        if len(plan.block_ids) != len(plan.keys) or not all(0 <= s < n for s in plan.block_ids):
            raise Violation(f"load plan block ids {plan.block_ids} do not fit {plan.keys}")
        if "model" in self.checks:
            block_ids = tuple(node.resident[key][0] for key in keys)
            if plan.keys != keys or plan.block_ids != block_ids:
                raise Violation(
                    f"load plan {plan.keys} @ {plan.block_ids} is not {keys} @ {block_ids}"
                )
        return plan

    def _check_reads(self, node: _Node[S], plan: LoadPlan, moment: str) -> None:
        if "data" not in self.checks:
            return
        for key, block_id in zip(plan.keys, plan.block_ids, strict=True):
            holds = node.memory[block_id]
            if holds != key:
                what = "garbage" if holds is None else f"the bytes of {holds!r}"
                raise Violation(
                    f"data: a load of {key!r} {moment} reading block id {block_id}: {what}"
                )

    # -- what must hold after every call -------------------------------------------------------

    def _observe(self, node: _Node[S], events_due: list[Event]) -> None:
        """Checks the system after a call, settles the account with its lookups and takes
        its fingerprint."""
        system = node.system
        # The abstraction of a state is built once, for both its invariants and its
        # fingerprint (before the lookups below, which change nothing in it).
        state = _abstraction(system) if self.fingerprint is None else None
        if "invariants" in self.checks:
            try:
                if state is not None and self._hands_abstraction(system):
                    cast(_ChecksAbstraction, system).check_invariants(abstraction=state)
                else:
                    system.check_invariants()
            except Exception as error:
                raise Violation(f"invariant broken: {error}") from error
        try:
            self._look(node, events_due)
        except Violation:
            raise
        except Exception as error:  # a surface that crashes when asked is a finding too
            raise Violation(
                f"asking the system how it stands raised {_described(error)}"
            ) from error
        node.fingerprint = self._fingerprint(system, node.plan_names(), state)

    def _fingerprint(
        self, system: S, plan_names: Mapping[int, int], state: SpecState | None = None
    ) -> Fingerprint:
        if self.fingerprint is not None:
            return self.fingerprint(system, plan_names)
        return fingerprint(_abstraction(system) if state is None else state, plan_names)

    def _hands_abstraction(self, system: S) -> bool:
        """Whether ``system.check_invariants`` takes the abstraction built already (the
        manager's and the model's do; a wrapper's may not): asked once per class."""
        kind = type(system)
        takes = self._takes_abstraction.get(kind)
        if takes is None:
            try:
                parameters = inspect.signature(system.check_invariants).parameters
            except (TypeError, ValueError):  # no signature to read: do not guess
                parameters = inspect.Signature().parameters
            takes = self._takes_abstraction[kind] = "abstraction" in parameters
        return takes

    def _look(self, node: _Node[S], events_due: list[Event]) -> None:
        system = node.system
        for key in self.keys:
            found, due = system.lookup(key), node.lookup(key)
            if "model" in self.checks and found is not due:
                raise Violation(f"lookup({key!r}) is {found.name}, the plans say {due.name}")
            if found is Lookup.MISS:
                node.resident.pop(key, None)
            elif found is not due:
                block_id = node.resident.get(key, (-1, True))[0]
                node.resident[key] = (block_id, found is Lookup.PENDING)
        if "model" in self.checks:
            free, evictable = system.num_free_blocks, system.num_evictable_blocks
            counts = (free, evictable, system.num_quarantined_blocks)
            predicted = (len(node.free_block_ids()), len(node.evictable()), len(node.quarantined()))
            if counts != predicted:
                raise Violation(
                    f"free/evictable/quarantined blocks are {counts}, the plans say {predicted}"
                )
            for number, held in enumerate(node.held):
                answer = system.is_abandoned(held.plan)
                if answer is not held.abandoned:
                    raise Violation(
                        f"is_abandoned(held plan {number}) is {answer!r}, "
                        f"the plans say {held.abandoned}"
                    )
        events = system.take_events()
        if "events" in self.checks and events != events_due:
            raise Violation(f"events {events} where {events_due} were due")

    def _unchanged(self, node: _Node[S], system: S, what: str, *, tracker: bool = True) -> None:
        if "unchanged" not in self.checks:
            return
        after = self._fingerprint(system, node.plan_names())
        if after.cache != node.fingerprint.cache or (tracker and after != node.fingerprint):
            raise Violation(f"{what} changed the state")
        if system.take_events():
            raise Violation(f"{what} emitted events")


def _described(error: BaseException) -> str:
    """The error and where it was raised: a bare ``assert`` has no message of its own."""
    where = traceback.extract_tb(error.__traceback__)[-1]
    place = f"{Path(where.filename).name}:{where.lineno}"
    return f"{type(error).__name__}({error}) at {place}: {where.line}"


def _removed(keys: tuple[Key, ...], reason: RemovalReason) -> list[Event]:
    return [BlocksRemoved(keys, reason)] if keys else []


# -- the search -----------------------------------------------------------------------------


def explore(
    make_system: Callable[[], S],
    *,
    keys: Sequence[Key],
    depth: int,
    fingerprint: FingerprintFn[S] | None = None,
    clone: Callable[[S], S] | None = None,
    store_threshold: int = 1,
    checks: Collection[str] = CHECKS,
    max_seconds: float | None = None,
) -> Report:
    """Explore every state ``make_system()`` reaches in at most ``depth`` calls on ``keys``.

    ``fingerprint`` defaults to :func:`model_fingerprint`, the fingerprint of the system's
    abstraction, which works for every system that states one (``abstract_state()``: the
    reference model, ``OffloadManager``); give one for any other system. By default the
    abstraction of each state is built once: a system whose ``check_invariants`` takes
    ``abstraction=`` (both of those) is handed the one built for the fingerprint. ``clone``
    defaults to :func:`clone_model` for the model, else ``copy.deepcopy``.
    ``store_threshold`` is the system's: with 1, a store's candidates are checked exactly.
    ``checks`` picks families from :data:`CHECKS`: leave out ``"events"`` for a system
    built without events.
    ``max_seconds`` stops the search early; the report then says how deep it was complete.
    Raises :class:`InvalidArgumentError` on a bad argument, before exploring.
    """
    check_count("depth", depth, minimum=0)
    check_count("store_threshold", store_threshold)
    alphabet = list(check_keys(keys))
    if not alphabet or len(set(alphabet)) != len(alphabet):
        raise InvalidArgumentError(f"keys must be distinct and at least one, got {keys!r}")
    unknown = set(checks) - CHECKS
    if unknown:
        raise InvalidArgumentError(
            f"unknown checks {sorted(unknown)}: choose from {sorted(CHECKS)}"
        )
    if max_seconds is not None:
        check_seconds("max_seconds", max_seconds)
    if clone is None:
        clone = cast(Callable[[S], S], _clone)
    checker = _Checker(fingerprint, clone, alphabet, store_threshold, frozenset(checks))
    return _Search(checker, make_system, _keyed_operations(alphabet)).run(depth, max_seconds)


def _clone(system: object) -> object:
    return clone_model(system) if type(system) is OffloadModel else copy.deepcopy(system)


class _Search(Generic[S]):
    def __init__(
        self, checker: _Checker[S], make_system: Callable[[], S], keyed: list[Operation]
    ) -> None:
        self.checker = checker
        self.make_system = make_system
        self.keyed = keyed
        self.with_memory = "data" in checker.checks
        self.parents: dict[Hashable, tuple[Hashable, Operation] | None] = {}
        self.transitions = 0

    def run(self, depth: int, max_seconds: float | None) -> Report:
        start = time.perf_counter()
        deadline = None if max_seconds is None else start + max_seconds

        def report(level: int, complete: bool, violation: Counterexample | None) -> Report:
            seconds = time.perf_counter() - start
            return Report(len(self.parents), self.transitions, seconds, level, complete, violation)

        try:
            root = self.checker.root(self.make_system())
        except Violation as violation:
            return report(0, False, Counterexample((), f"a fresh system: {violation}"))
        self.parents[root.key(self.with_memory)] = None
        frontier = [root]
        for level in range(depth):
            following: list[_Node[S]] = []
            for node in frontier:
                if deadline is not None and time.perf_counter() > deadline:
                    return report(level, False, None)
                found = self._expand(node, following)
                if found is not None:
                    return report(level, False, found)
            frontier = following
        return report(depth, True, None)

    def _expand(self, node: _Node[S], following: list[_Node[S]]) -> Counterexample | None:
        here = node.key(self.with_memory)
        for op in self.checker.operations(node, self.keyed):
            self.transitions += 1
            try:
                child = self.checker.apply(node, op)
            except Violation as violation:
                return self._counterexample(here, op, str(violation))
            if child is None:
                continue
            if op.name in (COMPLETE_STORE, COMPLETE_LOAD):
                self.transitions += 1
                try:
                    self.checker.complete_again(child, op, node.held[op.plan].plan)
                except Violation as violation:
                    return self._counterexample(here, op, str(violation), again=True)
            key = child.key(self.with_memory)
            if key not in self.parents:
                self.parents[key] = (here, op)
                following.append(child)
        return None

    def _counterexample(
        self, last: Hashable, op: Operation, message: str, *, again: bool = False
    ) -> Counterexample:
        """Replays the path to ``last``, then ``op``, naming plans in the order issued."""
        path = [op]
        entry = self.parents[last]
        while entry is not None:
            last, step = entry
            path.append(step)
            entry = self.parents[last]
        path.reverse()
        node = self.checker.root(self.make_system())
        names: dict[int, int] = {}
        steps = []
        for step in path[:-1]:
            steps.append(_describe(step, node, names))
            child = self.checker.apply(node, step)
            assert child is not None, "the search records only calls that made a new state"
            for held in child.held:
                names.setdefault(held.plan.plan_id, len(names) + 1)
            node = child
        steps.append(_describe(op, node, names))
        if again:
            steps.append(f"{steps[-1]} again")
        return Counterexample(tuple(steps), message)


def _describe(op: Operation, node: _Node[S], names: Mapping[int, int]) -> str:
    if op.plan >= 0:
        held = node.held[op.plan]
        fate = ("" if held.current else " stale") + (" abandoned" if held.abandoned else "")
        plan = f"plan {names.get(held.plan.plan_id, '?')}" + (f" ({fate[1:]})" if fate else "")
        if op.name == ABANDON:
            return f"abandon({plan})"
        if op.name == COMPLETE_STORE:
            return f"complete_store({plan}, success={op.success})"
        return f"complete_load({plan})"
    if op.name == RESET:
        return "reset_cache()"
    return f"{op.name}({op.arguments()!r})"


# -- command line ---------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvoffload_spec.explore``: explore the reference model, print the report."""
    parser = argparse.ArgumentParser(
        prog="python -m kvoffload_spec.explore",
        description="Explore every state of the reference model within a number of calls.",
    )
    parser.add_argument("--policy", choices=POLICY_NAMES, default="lru")
    parser.add_argument("--blocks", type=int, default=2, help="CPU blocks (default 2)")
    parser.add_argument("--keys", type=int, default=3, help="distinct keys, 1-26 (default 3)")
    parser.add_argument("--depth", type=int, default=4, help="calls per path (default 4)")
    parser.add_argument("--threshold", type=int, default=1, help="store_threshold (default 1)")
    parser.add_argument("--max-seconds", type=float, default=None, help="time budget")
    args = parser.parse_args(argv)
    if not 1 <= args.keys <= 26 or args.blocks < 1 or args.depth < 0 or args.threshold < 1:
        parser.error("need 1 <= --keys <= 26, --blocks >= 1, --depth >= 0, --threshold >= 1")
    if args.max_seconds is not None and not args.max_seconds > 0:
        parser.error("--max-seconds must be positive")
    keys = tuple("abcdefghijklmnopqrstuvwxyz"[: args.keys])
    print(
        f"exploring {args.policy} with {args.blocks} blocks, keys {', '.join(keys)}, "
        f"depth {args.depth}, store_threshold {args.threshold}"
    )
    report = explore(
        lambda: OffloadModel(
            args.blocks, args.policy, store_threshold=args.threshold, enable_events=True
        ),
        keys=keys,
        depth=args.depth,
        store_threshold=args.threshold,
        max_seconds=args.max_seconds,
    )
    print(report.summary())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
