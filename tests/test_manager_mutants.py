"""Tests written against the mutants that survived the rest of the suite (docs/mutation.md).

The differential test drives the policies only through the manager, which never reaches
some of their states (a ghost hit that moves ARC's target to exactly |T1|, a key removed
from T2) and never looks at what ``check_invariants`` says about a state it did not reach.
So here: each built-in policy against the spec's order directly, on any history the
policy interface allows, compared through the policy's part of the refinement mapping
(``abstract_order``, what the lockstep driver compares inside a manager's abstract state);
and the invariant checker against corrupted managers.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Callable, Container, Sequence

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    rule,
    run_state_machine_as_test,
)

from kvoffload.manager import OffloadManager
from kvoffload.policies.arc import ArcPolicy
from kvoffload.policies.base import EvictionPolicy, PolicyContractError
from kvoffload.policies.loading import resolve_policy
from kvoffload.policies.lru import LruPolicy
from kvoffload_spec.errors import (
    BlockNotFoundError,
    BlockPendingError,
    ForeignPlanError,
    InvalidArgumentError,
    SpecViolation,
    UnknownPolicyError,
)
from kvoffload_spec.policies import ArcOrder, LruOrder, PolicyOrder
from kvoffload_spec.surface import Key, LoadPlan, StorePlan
from tests.policy_machine import CAPACITY, PolicyAgainstSpec, stands_for


class LruAgainstSpec(PolicyAgainstSpec):
    def __init__(self) -> None:
        super().__init__()
        self.policy = LruPolicy(CAPACITY)
        self.order = LruOrder()


class ArcAgainstSpec(PolicyAgainstSpec):
    def __init__(self) -> None:
        super().__init__()
        self.arc = self.policy = ArcPolicy(CAPACITY)
        self.arc_order = self.order = ArcOrder(CAPACITY)

    @rule(target_size=st.integers(0, CAPACITY))
    def set_target(self, target_size: int) -> None:
        """``p`` set outright, to reach every target (ghost hits move it step by step)."""
        self.arc.p = self.arc_order.p = float(target_size)


def test_lru_policy_is_the_spec_order() -> None:
    run_state_machine_as_test(LruAgainstSpec)


def test_arc_policy_is_the_spec_order() -> None:
    run_state_machine_as_test(ArcAgainstSpec)


# -- victims in every small state, against the spec -------------------------------------------

FATES = ("absent", "pending", "T1", "T1 pinned", "T2", "T2 pinned")


def built(policy: EvictionPolicy, order: PolicyOrder, fates: tuple[str, ...]) -> set[Key]:
    """Give each key ``k`` the state ``fates[k]`` through the interface (inserted in key
    order, T2 by a touch while ready); returns the evictable keys.
    """
    resident = [key for key, fate in enumerate(fates) if fate != "absent"]
    for key in resident:
        policy.insert(key)
        order.insert(key)
        if fates[key] != "pending":
            policy.mark_evictable(key)
    for key in resident:
        if fates[key].startswith("T2"):
            policy.touch([key], lambda _: True)
            order.touch([key], lambda _: True)
    for key in resident:
        if fates[key].endswith("pinned"):
            policy.mark_unevictable(key)
    return {key for key, fate in enumerate(fates) if fate in ("T1", "T2")}


def spec_victims(order: PolicyOrder, need: int, candidates: set[Key]) -> list[Key] | None:
    return order.choose_victims(need, candidates.__contains__)


@pytest.mark.parametrize("name", ["lru", "arc"])
def test_victims_in_every_small_state_are_the_spec_victims(name: str) -> None:
    """Every state of 4 keys, every ARC target: the boundaries (``|T1| == p``, a list
    with nothing evictable) come up by construction, not by luck.
    """
    targets = range(CAPACITY + 1) if name == "arc" else [0]
    for fates in itertools.product(FATES, repeat=4):
        for target in targets:
            policy: EvictionPolicy = ArcPolicy(CAPACITY) if name == "arc" else LruPolicy(CAPACITY)
            order: PolicyOrder = ArcOrder(CAPACITY) if name == "arc" else LruOrder()
            evictable = built(policy, order, fates)
            if isinstance(policy, ArcPolicy) and isinstance(order, ArcOrder):
                policy.p = order.p = float(target)
            for need, protected in itertools.product((1, 2, 3), ((), (0,), (1, 3))):
                expected = spec_victims(order, need, evictable - set(protected))
                assert policy.choose_victims(need, protected) == expected, (fates, target)


# -- ARC's target after ghost hits, against the spec -------------------------------------------


def ghosts(policy: ArcPolicy, order: ArcOrder, in_b1: int, in_b2: int) -> tuple[Key, Key]:
    """Make ``in_b2`` ghosts of T2 keys, then ``in_b1`` of T1 keys, through the interface;
    returns a key of each list (or -1).
    """
    keys = iter(range(100))

    def store(count: int, *, twice: bool) -> list[Key]:
        stored: list[Key] = [next(keys) for _ in range(count)]
        for key in stored:
            policy.insert(key)
            order.insert(key)
            policy.mark_evictable(key)
        if twice:
            policy.touch(stored, lambda _: True)
            order.touch(stored, lambda _: True)
        victims = policy.choose_victims(count, ())
        assert victims is not None and victims == order.choose_victims(count, lambda _: True)
        policy.evict(victims)
        order.evict(victims)
        return stored

    from_t2 = store(in_b2, twice=True)
    from_t1 = store(in_b1, twice=False)
    return (from_t1[0] if from_t1 else -1), (from_t2[0] if from_t2 else -1)


@pytest.mark.parametrize(("in_b1", "in_b2"), itertools.product(range(CAPACITY + 1), repeat=2))
def test_ghost_hits_move_the_target_as_the_spec_does(in_b1: int, in_b2: int) -> None:
    for start in range(CAPACITY + 1):
        for hit_b1 in (True, False):
            policy, order = ArcPolicy(CAPACITY), ArcOrder(CAPACITY)
            b1_key, b2_key = ghosts(policy, order, in_b1, in_b2)
            policy.p = order.p = float(start)
            ghost = b1_key if hit_b1 else b2_key
            policy.touch([ghost], lambda _: False)
            order.touch([ghost], lambda _: False)
            stands_for(policy, order)


def reported(problems: list[str], pattern: str) -> bool:
    """Whether one of ``problems`` is, word for word, the message ``pattern`` describes."""
    return any(re.fullmatch(pattern, problem) for problem in problems)


# -- what check_invariants says about a broken policy --------------------------------------------


def arc_with(fates: dict[Key, str]) -> ArcPolicy:
    policy = ArcPolicy(CAPACITY)
    built(policy, ArcOrder(CAPACITY), tuple(fates.get(key, "absent") for key in range(4)))
    return policy


def evictable_in(fates: dict[Key, str]) -> Callable[[Key], bool]:
    return lambda key: fates.get(key) in ("T1", "T2")


def test_arc_reports_its_list_sizes() -> None:
    fates: dict[Key, str] = {0: "T1", 1: "T2"}
    policy = arc_with(fates)
    policy._t1_size += 1
    problems = policy.check_invariants(evictable_in(fates))
    assert reported(problems, r"ARC sizes 2, 1 but T1=\[0\], T2=\[1\]")


@pytest.mark.parametrize(
    ("fates", "wrong", "named"),
    [
        ({0: "T1 pinned", 1: "T2"}, 0, "evictable T1"),
        ({0: "T1", 1: "T2 pinned"}, 1, "evictable T2"),
    ],
)
def test_arc_names_the_list_whose_evictable_keys_disagree(
    fates: dict[Key, str], wrong: Key, named: str
) -> None:
    policy = arc_with(fates)
    claims = evictable_in({**fates, wrong: "T1"})  # the manager thinks ``wrong`` is evictable
    problems = policy.check_invariants(claims)
    assert reported(problems, rf"ARC's {named} is \[.*\], the manager's \[.*\]")


def test_repeated_stamps_are_reported() -> None:
    fates: dict[Key, str] = {0: "T1", 1: "T1"}
    arc = arc_with(fates)
    arc._codes[1] = arc._codes[0]
    assert "ARC stamps repeat" in arc.check_invariants(evictable_in(fates))
    lru = LruPolicy(CAPACITY)
    built(lru, LruOrder(), ("T1", "T1", "absent", "absent"))
    lru._stamps[1] = lru._stamps[0]
    assert "LRU stamps repeat" in lru.check_invariants(evictable_in(fates))


# -- what resolve_policy says when it cannot ---------------------------------------------------


class Incomplete(EvictionPolicy):
    """Implements nothing: abstract."""


@pytest.mark.parametrize(
    ("policy", "says"),
    [
        (
            "fifo",
            "unknown policy 'fifo': choose one of lru, arc, duel, an EvictionPolicy subclass, or "
            "'module:Class'",
        ),
        (
            "kvoffload.no_such_module:Policy",
            "policy 'kvoffload.no_such_module:Policy': cannot import 'kvoffload.no_such_module': "
            "no module 'kvoffload.no_such_module' in the current directory or on PYTHONPATH",
        ),
        (
            "kvoffload.policies:NoSuchPolicy",
            "policy 'kvoffload.policies:NoSuchPolicy': 'kvoffload.policies' has no 'NoSuchPolicy'",
        ),
        (
            "kvoffload.policies:LruPolicy:extra",
            "policy 'kvoffload.policies:LruPolicy:extra': 'kvoffload.policies' has no "
            "'LruPolicy:extra'",
        ),
        (
            "kvoffload.policies:BUILTIN_POLICIES",
            "policy 'kvoffload.policies:BUILTIN_POLICIES' is not an EvictionPolicy subclass",
        ),
        (Incomplete, "policy 'Incomplete' leaves abstract methods unimplemented"),
    ],
)
def test_an_unusable_policy_is_refused_with_the_reason(policy: object, says: str) -> None:
    with pytest.raises(UnknownPolicyError) as raised:
        resolve_policy(policy)
    assert str(raised.value) == says


def test_arc_reports_overlapping_lists_and_oversized_ghosts_or_target() -> None:
    fates: dict[Key, str] = {0: "T1", 1: "T2"}
    evictable = evictable_in(fates)
    overlap = arc_with(fates)
    overlap._b1.append(0)  # a resident key that is also a ghost
    assert reported(overlap.check_invariants(evictable), r"ARC lists overlap: T1=.* B2=.*")
    too_many = arc_with(fates)
    for ghost in range(10, 11 + CAPACITY):
        too_many._b2.append(ghost)
    too_far = arc_with(fates)
    too_far.p = CAPACITY + 1.0
    below = arc_with(fates)
    below.p = -1.0
    for broken in (too_many, too_far, below):  # each alone: ghosts, or the target
        problems = broken.check_invariants(evictable)
        assert reported(problems, r"ARC ghosts \d+, \d+ or p=.* exceed 3")


# -- the manager's counters ------------------------------------------------------------------


def test_stats_count_every_completed_load_and_the_stalled_plans_of_this_generation() -> None:
    now = [0.0]
    manager = OffloadManager(4, "lru", stall_after=10.0, clock=lambda: now[0])
    stored = manager.prepare_store([1, 2])
    assert stored is not None
    manager.complete_store(stored)
    for keys in ([1], [1, 2]):
        manager.complete_load(manager.prepare_load(keys))
    assert manager.stats().blocks_loaded == 3  # one per key of each completed plan
    pending = manager.prepare_store([3, 4])
    pinned = manager.prepare_load([1])
    assert pending is not None and pinned is not None
    now[0] = 11.0
    stats = manager.stats()
    assert (stats.stalled_plans, stats.stalled_pins, stats.stalled_pending) == (2, 1, 2)
    manager.reset_cache()  # still open and stalled, but holding nothing now
    stats = manager.stats()
    assert (stats.stalled_plans, stats.stalled_pins, stats.stalled_pending) == (2, 0, 0)


class Clock:
    """A clock the test sets: ``now`` seconds."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_stalled_plans_are_the_open_ones_older_than_the_cutoff_not_abandoned() -> None:
    clock = Clock()
    manager = OffloadManager(4, "lru", stall_after=300.0, clock=clock)
    old = manager.prepare_store([1])
    clock.now = 8.0
    young = manager.prepare_store([2])
    clock.now = 10.0
    assert manager.stalled_plans() == []  # nothing is 300 s old
    assert manager.stalled_plans(older_than=5.0) == [old]  # 8 > 10 - 5: young is not
    assert manager.stalled_plans(older_than=2.0) == [old, young]  # opened at the cutoff
    assert old is not None and young is not None
    manager.abandon(old)
    assert manager.stalled_plans(older_than=2.0) == [young]
    assert manager.stats().abandoned_open == 1
    manager.complete_store(old)
    assert manager.stats().abandoned_open == 0


@pytest.mark.parametrize("older_than", [0, -1.0, float("inf"), "5", True])
def test_stalled_plans_refuses_a_bad_age_and_names_it(older_than: object) -> None:
    manager = OffloadManager(4, "lru")
    with pytest.raises(InvalidArgumentError, match=r"^older_than must be"):
        manager.stalled_plans(older_than=older_than)  # type: ignore[arg-type]


def stored_plan(manager: OffloadManager, keys: Sequence[Key]) -> StorePlan:
    plan = manager.prepare_store(keys)
    assert plan is not None
    return plan


def test_every_counter_counts_each_event() -> None:
    """Two or more of each event, so that a counter set rather than raised shows."""
    manager = OffloadManager(4, "lru")
    manager.complete_store(stored_plan(manager, [1, 2]))  # slots 0 and 1
    for keys in ([5, 6], [7]):
        manager.complete_store(stored_plan(manager, keys), success=False)  # 3 blocks failed
    stored_plan(manager, [3])  # pending in slot 2: one slot left
    for key in (1, 2, 1, 3, 3, 9, 8, 8):  # 3 hits, 2 pending, 3 misses
        manager.lookup(key)
    for plan in (manager.prepare_load([1]), manager.prepare_load([2])):
        manager.abandon(plan)
    manager.complete_store(stored_plan(manager, [10, 11]))  # evicts 1
    manager.complete_store(stored_plan(manager, [12, 13]))  # evicts 2 and 10
    for keys in ([20, 21, 22, 23, 24], [30, 31, 32, 33, 34]):
        assert manager.prepare_store(keys) is None  # more than the pool: refused at once
    manager.reset_cache()
    manager.reset_cache()
    stats = manager.stats()
    assert (stats.lookup_hits, stats.lookup_pending, stats.lookup_misses) == (3, 2, 3)
    assert (stats.blocks_stored, stats.failed_stores, stats.evictions) == (6, 3, 3)
    assert (stats.rejected_stores, stats.fast_fail_rejections) == (2, 2)
    assert (stats.abandoned_plans, stats.resets) == (2, 2)


def test_misused_calls_name_the_argument_and_the_key() -> None:
    manager = OffloadManager(4, "lru")
    plan = manager.prepare_store([1, 2])
    assert plan is not None
    with pytest.raises(InvalidArgumentError, match=r"^success "):
        manager.complete_store(plan, success="yes")  # type: ignore[arg-type]
    with pytest.raises(BlockPendingError, match=r"cannot load 1: its store has not completed"):
        manager.prepare_load([1])
    with pytest.raises(BlockNotFoundError, match=r"cannot load 7: it is not in the CPU pool"):
        manager.prepare_load([7])


class ChoosesPinned(LruPolicy):
    """Chooses the least recent key, pinned or not: a policy that breaks its contract."""

    def choose_victims(self, need: int, protected: Container[Key]) -> list[Key] | None:
        return sorted(self._stamps, key=self._stamps.__getitem__)[:need]


def test_a_broken_policy_is_named_in_the_refusal() -> None:
    manager = OffloadManager(2, ChoosesPinned)
    plan = manager.prepare_store([1, 2])
    assert plan is not None
    manager.complete_store(plan)
    manager.prepare_load([1])  # the least recent key, pinned: 2 is the one evictable
    with pytest.raises(PolicyContractError, match=r"^ChoosesPinned\.choose_victims\(1\) chose"):
        manager.prepare_store([3])


# -- what check_invariants says about a corrupted manager -------------------------------------


def healthy() -> tuple[OffloadManager, StorePlan, LoadPlan]:
    """Keys 0 and 1 ready, 2 pinned by an open load plan, 3 pending on an open store plan
    (slot 3); slots 4 and 5, the last of the pool, free again after a failed store.
    """
    manager = OffloadManager(6, "lru")
    ready = manager.prepare_store([0, 1, 2])
    assert ready is not None
    manager.complete_store(ready)
    store = manager.prepare_store([3])
    failed = manager.prepare_store([4, 5])
    assert store is not None and failed is not None
    manager.complete_store(failed, success=False)
    load = manager.prepare_load([2])
    manager.check_invariants()
    assert sorted(manager._freed) == [4, 5] and manager._fresh == manager.num_blocks
    return manager, store, load


def corrupt_slot_shared(m: OffloadManager, store: StorePlan, load: LoadPlan) -> None:
    m._slot_of[1] = m._slot_of[0]


def corrupt_slot_leaked(m: OffloadManager, store: StorePlan, load: LoadPlan) -> None:
    m._freed.pop()


def corrupt_slot_negative(m: OffloadManager, store: StorePlan, load: LoadPlan) -> None:
    m._slot_of[0] = -1


def corrupt_slot_beyond_pool(m: OffloadManager, store: StorePlan, load: LoadPlan) -> None:
    m._freed.append(m._fresh)  # a seventh slot in a pool of six
    m._fresh += 1


def corrupt_slot_at_the_top(m: OffloadManager, store: StorePlan, load: LoadPlan) -> None:
    m._freed.remove(5)  # slot 5 was never handed out: fresh is 5 ...
    m._fresh = 5
    m._slot_of[0] = 5  # ... yet key 0 sits there


def corrupt_heap(m: OffloadManager, store: StorePlan, load: LoadPlan) -> None:
    m._freed.sort(reverse=True)


def corrupt_heap_deeper(m: OffloadManager, store: StorePlan, load: LoadPlan) -> None:
    m._freed[:] = [4, 7, 5, 6]  # only the fourth entry is smaller than its parent


def corrupt_counter(m: OffloadManager, store: StorePlan, load: LoadPlan) -> None:
    m._num_evictable += 1


def corrupt_opening_times(m: OffloadManager, store: StorePlan, load: LoadPlan) -> None:
    del m._opened_at[store.plan_id]


def corrupt_abandoned_unknown(m: OffloadManager, store: StorePlan, load: LoadPlan) -> None:
    m._abandoned[99] = ()


def corrupt_abandoned_load_quarantines(m: OffloadManager, store: StorePlan, load: LoadPlan) -> None:
    m._abandoned[load.plan_id] = (5,)


def corrupt_quarantine_outside_plan(m: OffloadManager, store: StorePlan, load: LoadPlan) -> None:
    m.abandon(store)
    m._abandoned[store.plan_id] = (4,)


def corrupt_plan_never_issued(m: OffloadManager, store: StorePlan, load: LoadPlan) -> None:
    m._next_plan_id = load.plan_id


def corrupt_plan_from_the_future(m: OffloadManager, store: StorePlan, load: LoadPlan) -> None:
    m._open_plans[load.plan_id] = dataclasses.replace(load, generation=1)


def corrupt_pending_elsewhere(m: OffloadManager, store: StorePlan, load: LoadPlan) -> None:
    m._storing[3] = 99


def corrupt_load_slot(m: OffloadManager, store: StorePlan, load: LoadPlan) -> None:
    m._open_plans[load.plan_id] = dataclasses.replace(load, block_ids=(0,))


def corrupt_refs(m: OffloadManager, store: StorePlan, load: LoadPlan) -> None:
    m._refs[0] = 1


def corrupt_policy(m: OffloadManager, store: StorePlan, load: LoadPlan) -> None:
    m._policy.remove(3)


def corrupt_policy_same_size(m: OffloadManager, store: StorePlan, load: LoadPlan) -> None:
    m._policy.remove(3)
    m._policy.insert(99)


def corrupt_pending_on_abandoned(m: OffloadManager, store: StorePlan, load: LoadPlan) -> None:
    m.abandon(store)
    m._storing[3] = store.plan_id  # as if the abandoned store still held its key
    m._slot_of[3] = 3


def corrupt_lru_stamps(m: OffloadManager, store: StorePlan, load: LoadPlan) -> None:
    m._policy._stamps[1] = m._policy._stamps[0]  # type: ignore[attr-defined]


def corrupt_offers(m: OffloadManager, store: StorePlan, load: LoadPlan) -> None:
    m._offers.update(dict.fromkeys(range(100, 100 + m._max_tracker_size + 1), 1))


CORRUPTIONS = [
    (corrupt_slot_shared, r"resident block ids .* overlap or leak"),
    (corrupt_slot_leaked, r"resident block ids .* overlap or leak"),
    (corrupt_slot_negative, r"a block id lies outside \[0, 6\) or beyond the pool"),
    (corrupt_slot_beyond_pool, r"a block id lies outside \[0, 7\) or beyond the pool"),
    (corrupt_slot_at_the_top, r"a block id lies outside \[0, 5\) or beyond the pool"),
    (corrupt_heap, r"the free heap \[5, 4\] is out of order"),
    (corrupt_heap_deeper, r"the free heap \[4, 7, 5, 6\] is out of order"),
    (corrupt_counter, r"evictable counter is 3 but 2 blocks are ready with no refs"),
    (corrupt_opening_times, r"the open plans and their opening times disagree"),
    (corrupt_abandoned_unknown, r"abandoned plan 99 is not an open store plan: None"),
    (
        corrupt_abandoned_load_quarantines,
        r"abandoned plan \d+ is not an open store plan: LoadPlan\(.*\)",
    ),
    (
        corrupt_quarantine_outside_plan,
        r"abandoned plan StorePlan\(.*\) quarantines block ids \[4\]",
    ),
    (corrupt_plan_never_issued, r"an open plan has an id that was never issued"),
    (corrupt_plan_from_the_future, r"an open plan belongs to a future generation"),
    (corrupt_pending_elsewhere, r"3 is pending on plan 99, which is not open now"),
    (corrupt_load_slot, r"2 in block id 0 does not match open plan LoadPlan\(.*\)"),
    (corrupt_refs, r"0 has refs 1 but current load plans read it 0 times"),
    (corrupt_policy, r"policy order \[.*\] does not hold exactly the resident keys"),
    (corrupt_policy_same_size, r"policy order \[.*\] does not hold exactly the resident keys"),
    (corrupt_pending_on_abandoned, r"3 is pending on plan \d+, which is not open now"),
    (corrupt_lru_stamps, r"LRU stamps repeat"),
    (corrupt_offers, r"offer tracker holds \d+ > \d+"),
]


@pytest.mark.parametrize(
    ("corrupt", "says"), CORRUPTIONS, ids=[corrupt.__name__ for corrupt, _ in CORRUPTIONS]
)
def test_check_invariants_reports_each_corruption_on_its_own(
    corrupt: Callable[[OffloadManager, StorePlan, LoadPlan], None], says: str
) -> None:
    manager, store, load = healthy()
    corrupt(manager, store, load)
    with pytest.raises(SpecViolation) as raised:
        manager.check_invariants()
    assert reported(str(raised.value).split("; "), says), raised.value


def test_check_invariants_lists_every_problem_apart() -> None:
    manager, store, load = healthy()
    corrupt_counter(manager, store, load)
    corrupt_heap(manager, store, load)
    with pytest.raises(SpecViolation) as raised:
        manager.check_invariants()
    problems = str(raised.value).split("; ")
    assert reported(problems, r"evictable counter is \d+ but \d+ blocks are ready with no refs")
    assert reported(problems, r"the free heap \[.*\] is out of order")


# -- constructor arguments, defaults and plan ownership -----------------------------------------


@pytest.mark.parametrize(
    ("arguments", "says"),
    [
        ({"num_blocks": 0}, r"num_blocks must be >= 1, got 0"),
        ({"store_threshold": 0}, r"store_threshold must be >= 1, got 0"),
        ({"max_tracker_size": 0}, r"max_tracker_size must be >= 1, got 0"),
        ({"enable_events": 1}, r"enable_events must be True or False, got 1"),
        ({"stall_after": 0}, r"stall_after must be a finite number of seconds > 0, got 0"),
        ({"clock": 5}, r"clock must be a function returning seconds, like time.monotonic, got 5"),
    ],
)
def test_a_bad_constructor_argument_is_named(arguments: dict[str, object], says: str) -> None:
    given: dict[str, object] = {"num_blocks": 4, **arguments}
    with pytest.raises(InvalidArgumentError) as raised:
        OffloadManager(**given)  # type: ignore[arg-type]
    assert re.fullmatch(says, str(raised.value))


def test_a_plan_open_for_300_seconds_is_stalled_by_default() -> None:
    clock = Clock()
    manager = OffloadManager(4, "lru", clock=clock)
    plan = manager.prepare_store([1])
    clock.now = 299.5
    assert manager.stalled_plans() == []
    clock.now = 300.5
    assert manager.stalled_plans() == [plan]


def test_the_offer_tracker_remembers_64000_keys_by_default() -> None:
    manager = OffloadManager(4, "lru", store_threshold=2)
    assert stored_plan(manager, ["first"]).keys == ()  # offered once: not stored yet
    assert stored_plan(manager, range(64_000)).keys == ()  # pushes "first" out
    assert stored_plan(manager, ["first"]).keys == ()  # offered once again, as if new
    assert stored_plan(manager, ["first"]).keys == ("first",)


def test_a_plan_of_another_manager_is_foreign() -> None:
    first, second = OffloadManager(4, "lru"), OffloadManager(4, "lru")
    second.prepare_store([1])
    plan = first.prepare_store([1])
    assert plan is not None
    with pytest.raises(ForeignPlanError):
        second.complete_store(plan)


def test_a_repeated_free_slot_is_an_overlap_not_a_heap_disorder() -> None:
    """The heap property is parent <= child: equal entries are in order."""
    manager, _, _ = healthy()
    manager._freed[:] = [4, 4]  # slot 5 leaked, slot 4 listed twice
    with pytest.raises(SpecViolation) as raised:
        manager.check_invariants()
    problems = str(raised.value).split("; ")
    assert reported(problems, r"resident block ids .* overlap or leak")
    assert not reported(problems, r"the free heap .*")
