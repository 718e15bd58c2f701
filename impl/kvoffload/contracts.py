"""Contract-checked managers, for CrossHair: each operation between asserts.

``OffloadManager`` itself carries no contracts (they would cost every call O(n)). Here
each operation is wrapped in a ``check_*`` function whose leading asserts are its
preconditions and whose trailing asserts are its postconditions (CrossHair's "asserts"
analysis), bound as a method of ``LruChecks`` and ``ArcChecks``. Every check states, among
others:

- the invariants of docs/spec.md hold before and after (``check_invariants``),
  among them the evictable counter of vLLM PR #45757;
- the counter moves by exactly what the call made or stopped being evictable;
- a call that fails (``prepare_store`` returning None, an ``OffloadError``) changes no cache
  state, and a completion of a plan made before ``reset_cache`` or abandoned changes
  nothing else.

CrossHair builds ``self`` through ``__init__`` from symbolic arguments. A manager's state
cannot be written down field by field without duplicating the manager, so the constructor
*replays* a short history, given as the fate of each key, through the public operations
instead: every state it builds is one a caller can reach, and none is junk that the
invariants would have to filter out (a vacuous pass). Check one method at a time, with
tiny capacities::

    crosshair check --analysis_kind=asserts --per_condition_timeout=5 \\
        kvoffload.contracts.LruChecks.check_prepare_store
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import ClassVar

from kvoffload.manager import OffloadManager
from kvoffload.policies.arc import ArcPolicy
from kvoffload.policies.base import EvictionPolicy
from kvoffload.policies.lru import LruPolicy
from kvoffload_spec.errors import OffloadError, SpecViolation
from kvoffload_spec.surface import Key, LoadPlan, Lookup, StorePlan

MAX_BLOCKS = 3
KEYS = 4  # the keys a history uses: one more than fits, so that stores must evict

CHECKS = (
    "check_prepare_store",
    "check_complete_store",
    "check_prepare_load",
    "check_complete_load",
    "check_abandon",
    "check_touch",
    "check_reset_cache",
)
"""The methods to hand to ``crosshair check``, one target each, on both classes below."""


def plain(value: int, bound: int) -> int:
    """``value`` (which lies in ``range(bound)``) as a plain int.

    Under CrossHair each comparison forks the path, so that every state holds plain ints:
    CrossHair copies each state it builds, and a sorted list cannot be rebuilt from
    symbolic keys outside the analysis.
    """
    return next(choice for choice in range(bound) if choice == value)


def plain_keys(keys: list[int]) -> list[Key]:
    """``keys`` mapped onto the history's keys and one key it never uses."""
    return [plain(key % (KEYS + 1), KEYS + 1) for key in keys]


def frozen_clock() -> float:
    """The checked managers' clock: CrossHair treats ``time.monotonic`` as a symbolic input
    and then sees the same decisions take different paths; no check depends on time.
    """
    return 0.0


class Fate(enum.IntEnum):
    """What the history does with one key (see :class:`CheckedManager`)."""

    ABSENT = 0
    READY = 1
    TOUCHED = 2  # ready, then touched: ARC moves it to T2
    PENDING = 3
    PINNED = 4  # ready, then loaded by a plan left open
    STALE_STORE = 5  # stored before the reset by a plan left open
    STORED_AGAIN = 6  # STALE_STORE, then pending again on a new plan (the ABA hazard)
    STALE_LOAD = 7  # stored and loaded before the reset by a plan left open, then ready
    ABANDONED_STORE = 8  # stored by a plan then abandoned: absent, its slot quarantined
    ABANDONED_LOAD = 9  # ready, then loaded by a plan then abandoned: unpinned again


STALE_FATES = (Fate.STALE_STORE, Fate.STORED_AGAIN, Fate.STALE_LOAD)


class CheckedManager(OffloadManager):
    """A manager built by a short history (see the module's docstring), with checked
    operations.

    ``fates`` gives each of the ``KEYS`` keys its :class:`Fate` (any int: it is taken
    modulo the number of fates): one symbolic int per key forks only into states a history
    reaches, where free-form lists of operations drown CrossHair in redundant ones. The
    history, in order: the stale plans are made and the cache is reset (if there are
    any); the keys to be ready are stored one plan each and completed, in key order (a
    small pool evicts the first ones again); the TOUCHED keys are touched; the PENDING
    and STORED_AGAIN keys are stored in one plan, left open; the PINNED keys still
    resident are loaded, one plan each, left open; the ABANDONED_LOAD keys are stored,
    loaded and their load plans abandoned; the ABANDONED_STORE keys are stored in one plan,
    which is abandoned.

    The manager keeps every plan it issued, completed or not, so that a check can complete
    an open plan, a stale one, or one completed already (which must fail).
    """

    POLICY: ClassVar[type[EvictionPolicy]]

    def __init__(self, num_blocks: int, fates: tuple[int, int, int, int]) -> None:
        size = 1 + plain(num_blocks % MAX_BLOCKS, MAX_BLOCKS)
        super().__init__(size, self.POLICY, clock=frozen_clock)
        self.store_plans: list[StorePlan] = []
        self.load_plans: list[LoadPlan] = []
        fate = [Fate(plain(value % len(Fate), len(Fate))) for value in fates]

        def keys(*wanted: Fate) -> list[Key]:
            return [key for key in range(KEYS) if fate[key] in wanted]

        self._store(keys(Fate.STALE_STORE, Fate.STORED_AGAIN))
        for key in keys(Fate.STALE_LOAD):
            self._store([key], complete=True)
            self._load([key])
        if keys(*STALE_FATES):
            self.reset_cache()
        for key in keys(
            Fate.READY, Fate.TOUCHED, Fate.PINNED, Fate.STALE_LOAD, Fate.ABANDONED_LOAD
        ):
            self._store([key], complete=True)
        self.touch(keys(Fate.TOUCHED))
        self._store(keys(Fate.PENDING, Fate.STORED_AGAIN))
        for key in keys(Fate.PINNED):
            self._load([key])
        for key in keys(Fate.ABANDONED_LOAD):
            if self._load([key]):
                self.abandon(self.load_plans[-1])
        if self._store(keys(Fate.ABANDONED_STORE)):
            self.abandon(self.store_plans[-1])

    def __repr__(self) -> str:
        return f"{super().__repr__()} after plans {[*self.store_plans, *self.load_plans]}"

    def _store(self, keys: list[Key], *, complete: bool = False) -> bool:
        plan = self.prepare_store(keys)
        if plan is None or not plan.keys:
            return False
        self.store_plans.append(plan)
        if complete:
            self.complete_store(plan)
        return True

    def _load(self, keys: list[Key]) -> bool:
        if not all(self.lookup(key) is Lookup.HIT for key in keys):
            return False
        self.load_plans.append(self.prepare_load(keys))
        return True

    # -- what the checks read --------------------------------------------------------------

    def invariants_hold(self) -> bool:
        try:
            self.check_invariants()
        except SpecViolation:
            return False
        return True

    def cache_state(self) -> CacheState:
        """Everything a failed call must leave as it was (counters of calls excepted)."""
        return CacheState(
            slots=dict(self._slot_of.items()),
            storing=dict(self._storing),
            refs=tuple(self._refs),
            free=(tuple(sorted(self._freed)), self._fresh),
            num_evictable=self._num_evictable,
            open_plans=dict(self._open_plans),
            opened_at=dict(self._opened_at),
            abandoned=dict(self._abandoned),
            next_plan_id=self._next_plan_id,
            generation=self._generation,
            order=policy_state(self._policy),
            observations=policy_observations(self._policy),
        )


@dataclass(frozen=True)
class CacheState:
    """A snapshot of a manager's cache state: what a failed call must leave as it was."""

    slots: dict[Key, int]
    storing: dict[Key, int]
    refs: tuple[int, ...]
    free: tuple[tuple[int, ...], int]
    num_evictable: int
    open_plans: dict[int, StorePlan | LoadPlan]
    opened_at: dict[int, float]
    abandoned: dict[int, tuple[int, ...]]
    next_plan_id: int
    generation: int
    order: tuple[object, ...]
    observations: tuple[object, ...]  # what a refused store may change too (ARC's ghost hits)

    def without_plan(self, plan_id: int) -> CacheState:
        """This state once the plan ``plan_id`` was closed and nothing else changed."""
        return dataclasses.replace(
            self,
            open_plans={key: plan for key, plan in self.open_plans.items() if key != plan_id},
            opened_at={key: at for key, at in self.opened_at.items() if key != plan_id},
            abandoned={key: at for key, at in self.abandoned.items() if key != plan_id},
        )

    def blocks_only(self) -> CacheState:
        """This state without the policy's order (what ``touch`` may change)."""
        return dataclasses.replace(self, order=(), observations=())

    def without_observations(self) -> CacheState:
        """This state without what a refused ``prepare_store`` may change (docs/spec.md)."""
        return dataclasses.replace(self, observations=())


def policy_state(policy: EvictionPolicy) -> tuple[object, ...]:
    """The order of a built-in policy: its resident and evictable keys, in order."""
    if isinstance(policy, ArcPolicy):
        t1, t2, b1, b2 = policy.lists()
        return (t1, t2, frozenset(b1), frozenset(b2), tuple(policy._t1), tuple(policy._t2))
    if isinstance(policy, LruPolicy):
        return (tuple(policy.resident()), tuple(policy._evictable))
    return (tuple(policy.resident()),)


def policy_observations(policy: EvictionPolicy) -> tuple[object, ...]:
    """What a built-in policy learns even from a refused store: ARC's target ``p`` and the
    order of its ghosts (which keys are ghosts is in ``policy_state``)."""
    if isinstance(policy, ArcPolicy):
        *_, b1, b2 = policy.lists()
        return (tuple(b1), tuple(b2), policy.p)
    return ()


# -- the checks --------------------------------------------------------------------------
#
# Functions, bound as methods by the classes at the end: CrossHair analyses a method once
# for its class and once more for each base class that defines it with conditions, so
# checks defined on CheckedManager and re-bound in a subclass (which CrossHair needs: it
# finds a target only in the class's own namespace) would each be analysed twice.


def check_prepare_store(manager: CheckedManager, raw_keys: list[int]) -> None:
    """Post: on None nothing changed; else the victims were evictable and not among
    ``keys``, the candidates are pending, and the counter fell by the number of victims.
    """
    assert manager.invariants_hold()
    keys = plain_keys(raw_keys)
    before, evictable = manager.cache_state(), manager.num_evictable_blocks
    plan = manager.prepare_store(keys)
    if plan is None:
        # A refused store changes no cache state; ARC's ghost hits are observations.
        assert manager.cache_state().without_observations() == before.without_observations()
    else:
        assert manager.num_evictable_blocks == evictable - len(plan.evicted_keys)
        assert not set(plan.evicted_keys) & set(keys)  # a key of the call is protected
        assert all(manager.lookup(key) is Lookup.PENDING for key in plan.keys)
        assert all(manager.lookup(key) is Lookup.MISS for key in plan.evicted_keys)
    assert manager.invariants_hold()


def check_complete_store(manager: CheckedManager, which: int, success: bool) -> None:
    """Post: a plan completed twice raises and changes nothing; an abandoned plan frees
    its quarantined slots and changes nothing else; a stale plan only closes; a current
    one makes its blocks ready (the counter rises by each) or absent.
    """
    assert manager.store_plans
    assert manager.invariants_hold()
    plan = manager.store_plans[which % len(manager.store_plans)]
    before, evictable = manager.cache_state(), manager.num_evictable_blocks
    free, states = manager.num_free_blocks, [manager.lookup(key) for key in plan.keys]
    try:
        manager.complete_store(plan, success)
    except OffloadError:
        assert plan.plan_id not in before.open_plans  # completed already
        assert manager.cache_state() == before
    else:
        closed = before.without_plan(plan.plan_id)
        if plan.plan_id in before.abandoned:  # its job is over: the quarantine ends
            assert manager.num_free_blocks == free + len(before.abandoned[plan.plan_id])
            assert dataclasses.replace(manager.cache_state(), free=closed.free) == closed
        elif plan.generation != before.generation:  # made before a reset: the ABA guard
            assert manager.cache_state() == closed
        else:
            outcome = Lookup.HIT if success else Lookup.MISS
            assert all(manager.lookup(key) is outcome for key in plan.keys)
            stored = sum(state is Lookup.PENDING for state in states) if success else 0
            assert manager.num_evictable_blocks == evictable + stored
    assert manager.invariants_hold()


def check_prepare_load(manager: CheckedManager, raw_keys: list[int]) -> None:
    """Post: a key not ready raises and changes nothing; else the counter fell by the
    number of distinct keys that had no loads.
    """
    assert manager.invariants_hold()
    keys = plain_keys(raw_keys)
    before, evictable = manager.cache_state(), manager.num_evictable_blocks
    newly_pinned = sum(manager._is_evictable(key) for key in set(keys))
    try:
        plan = manager.prepare_load(keys)
    except OffloadError:
        assert any(manager.lookup(key) is not Lookup.HIT for key in keys)
        assert manager.cache_state() == before
    else:
        assert plan.keys == tuple(keys)
        assert manager.num_evictable_blocks == evictable - newly_pinned
    assert manager.invariants_hold()


def check_complete_load(manager: CheckedManager, which: int) -> None:
    """Post: a plan completed twice raises and changes nothing; an abandoned or stale plan
    only closes; a current one frees its blocks (the counter rises by each block left
    unread).
    """
    assert manager.load_plans
    assert manager.invariants_hold()
    plan = manager.load_plans[which % len(manager.load_plans)]
    before, evictable = manager.cache_state(), manager.num_evictable_blocks
    try:
        manager.complete_load(plan)
    except OffloadError:
        assert plan.plan_id not in before.open_plans
        assert manager.cache_state() == before
    else:
        if plan.plan_id in before.abandoned or plan.generation != before.generation:
            assert manager.cache_state() == before.without_plan(plan.plan_id)
        else:
            released = sum(manager._is_evictable(key) for key in set(plan.keys))
            assert manager.num_evictable_blocks == evictable + released
    assert manager.invariants_hold()


def check_abandon(manager: CheckedManager, which: int) -> None:
    """Post: a plan not open or abandoned already raises and changes nothing; a stale plan
    is marked abandoned, holding nothing; a current load plan's blocks are unpinned (the
    counter rises by each block left unread); a current store plan's pending blocks are
    absent and their slots quarantined, neither free nor resident.
    """
    assert manager.store_plans or manager.load_plans
    assert manager.invariants_hold()
    plans: list[StorePlan | LoadPlan] = [*manager.store_plans, *manager.load_plans]
    plan = plans[which % len(plans)]
    before, evictable = manager.cache_state(), manager.num_evictable_blocks
    free, quarantined = manager.num_free_blocks, manager.num_quarantined_blocks
    pending = [key for key in plan.keys if before.storing.get(key) == plan.plan_id]
    try:
        manager.abandon(plan)
    except OffloadError:
        assert plan.plan_id not in before.open_plans or plan.plan_id in before.abandoned
        assert manager.cache_state() == before
    else:
        assert plan.plan_id in manager.cache_state().abandoned
        assert plan.plan_id in manager.cache_state().open_plans  # completed once, later
        assert manager.num_free_blocks == free
        if plan.generation != before.generation or isinstance(plan, StorePlan):
            assert manager.num_evictable_blocks == evictable
        if isinstance(plan, StorePlan):
            assert all(manager.lookup(key) is Lookup.MISS for key in pending)
            assert manager.num_quarantined_blocks == quarantined + len(pending)
        else:
            released = sum(manager._is_evictable(key) for key in set(plan.keys))
            if plan.generation == before.generation:
                assert manager.num_evictable_blocks == evictable + released
    assert manager.invariants_hold()


def check_touch(manager: CheckedManager, raw_keys: list[int]) -> None:
    """Post: only the policy's order changed."""
    assert manager.invariants_hold()
    before = manager.cache_state()
    manager.touch(plain_keys(raw_keys))
    assert manager.cache_state().blocks_only() == before.blocks_only()
    assert manager.invariants_hold()


def check_reset_cache(manager: CheckedManager) -> None:
    """Post: everything is absent and free; the open plans are still open."""
    assert manager.invariants_hold()
    before = manager.cache_state()
    manager.reset_cache()
    after = manager.cache_state()
    assert not after.slots and manager.num_evictable_blocks == 0
    assert manager.num_free_blocks == manager.num_blocks - manager.num_quarantined_blocks
    assert after.open_plans == before.open_plans  # still open: each completes once
    assert after.abandoned == before.abandoned  # their jobs may still write those slots
    assert manager.invariants_hold()


class LruChecks(CheckedManager):
    """A checked manager with the LRU policy."""

    POLICY = LruPolicy
    check_prepare_store = check_prepare_store
    check_complete_store = check_complete_store
    check_prepare_load = check_prepare_load
    check_complete_load = check_complete_load
    check_abandon = check_abandon
    check_touch = check_touch
    check_reset_cache = check_reset_cache


class ArcChecks(CheckedManager):
    """A checked manager with the ARC policy."""

    POLICY = ArcPolicy
    check_prepare_store = check_prepare_store
    check_complete_store = check_complete_store
    check_prepare_load = check_prepare_load
    check_complete_load = check_complete_load
    check_abandon = check_abandon
    check_touch = check_touch
    check_reset_cache = check_reset_cache
