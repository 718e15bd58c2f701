"""One call of an explored system, checked: what the explorer holds besides the system (the
plans handed out, what each block id's bytes are), and :class:`Checker`, which makes a call,
then runs every family of checks of :mod:`kvoffload_spec.explore` on what it did.

The search itself (breadth first, states canonicalised) is :func:`kvoffload_spec.explore.explore`.
"""

from __future__ import annotations

import dataclasses
import inspect
import traceback
from collections.abc import Callable, Hashable, Mapping, Sequence
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
from kvoffload_spec.operations import (
    ABANDON,
    COMPLETE_LOAD,
    COMPLETE_STORE,
    PREPARE_LOAD,
    PREPARE_STORE,
    RESET,
    Operation,
    perform,
)
from kvoffload_spec.refinement import Fingerprint, abstract, fingerprint
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


# -- what the explorer knows besides the system ----------------------------------------------


@dataclass(frozen=True)
class Held:
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
class Node(Generic[S]):
    """A system and the explorer's account of it: the plans it holds, where each resident
    key is and whether it is pending, and whose bytes each block id holds (None: garbage)."""

    system: S
    held: tuple[Held, ...]
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


# -- one call, checked ----------------------------------------------------------------------


class Checker(Generic[S]):
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

    def root(self, system: S) -> Node[S]:
        node = Node(system, (), {}, (None,) * system.num_blocks)
        self._observe(node, [])
        return node

    def operations(self, node: Node[S], keyed: list[Operation]) -> list[Operation]:
        on_plans = []
        for n, held in enumerate(node.held):
            if isinstance(held.plan, StorePlan):
                on_plans += [Operation(COMPLETE_STORE, plan=n, success=b) for b in (True, False)]
            else:
                on_plans.append(Operation(COMPLETE_LOAD, plan=n))
            on_plans.append(Operation(ABANDON, plan=n))
        return keyed + on_plans

    def apply(self, node: Node[S], op: Operation) -> Node[S] | None:
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

    def complete_again(self, node: Node[S], op: Operation, plan: StorePlan | LoadPlan) -> None:
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

    def _error_due(self, node: Node[S], op: Operation) -> tuple[type[Exception] | None, bool]:
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

    def _call(self, system: S, node: Node[S], op: Operation) -> StorePlan | LoadPlan | None:
        plan = node.held[op.plan].plan if op.plan >= 0 else None
        result = perform(system, op, plan)
        return result if isinstance(result, (StorePlan, LoadPlan)) else None

    def _advance(
        self, node: Node[S], system: S, op: Operation, result: StorePlan | LoadPlan | None
    ) -> tuple[Node[S], list[Event]]:
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
            held.append(Held(plan, True))
            events = _removed(plan.evicted_keys, RemovalReason.EVICTED)
        elif op.name == PREPARE_STORE:
            self._check_refusal(node, op.keys)
        elif op.name == PREPARE_LOAD:
            load = self._check_load_plan(node, op.keys, result)
            self._check_reads(node, load, "starts")
            held.append(Held(load, True))
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
            held[op.plan] = Held(gone.plan, gone.current, abandoned=True, quarantine=quarantine)
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
        held.sort(key=Held.content)
        return Node(system, tuple(held), resident, tuple(memory)), events

    def _check_store_plan(self, node: Node[S], keys: tuple[Key, ...], plan: object) -> StorePlan:
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

    def _check_refusal(self, node: Node[S], keys: tuple[Key, ...]) -> None:
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

    def _check_load_plan(self, node: Node[S], keys: tuple[Key, ...], plan: object) -> LoadPlan:
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

    def _check_reads(self, node: Node[S], plan: LoadPlan, moment: str) -> None:
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

    def _observe(self, node: Node[S], events_due: list[Event]) -> None:
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

    def _look(self, node: Node[S], events_due: list[Event]) -> None:
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

    def _unchanged(self, node: Node[S], system: S, what: str, *, tracker: bool = True) -> None:
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
