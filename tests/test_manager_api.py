"""The manager's counters, stalled plans, error messages, constructor arguments, defaults and
plan ownership."""

from __future__ import annotations

import re
from collections.abc import Container, Sequence

import pytest

from kvoffload.manager import OffloadManager
from kvoffload.policies.base import PolicyContractError
from kvoffload.policies.lru import LruPolicy
from kvoffload_spec.errors import (
    BlockNotFoundError,
    BlockPendingError,
    ForeignPlanError,
    InvalidArgumentError,
)
from kvoffload_spec.surface import Key, StorePlan

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
