"""``OffloadManager.check_invariants``: each corruption of its tables is reported on its own,
in words, whether its representation checks or the spec's invariants of its abstraction
find it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from kvoffload.manager import OffloadManager
from kvoffload_spec.errors import (
    SpecViolation,
)
from kvoffload_spec.surface import LoadPlan, StorePlan
from tests.helpers import reported

# -- what check_invariants says about a corrupted manager -------------------------------------


def healthy() -> tuple[OffloadManager, StorePlan, LoadPlan]:
    """Keys 0 and 1 ready, 2 pinned by an open load plan, 3 pending on an open store plan
    (block id 3); block ids 4 and 5, the last of the pool, free again after a failed store.
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
    m._block_id_of[1] = m._block_id_of[0]


def corrupt_slot_leaked(m: OffloadManager, store: StorePlan, load: LoadPlan) -> None:
    m._freed.pop()


def corrupt_slot_negative(m: OffloadManager, store: StorePlan, load: LoadPlan) -> None:
    m._block_id_of[0] = -1


def corrupt_slot_beyond_pool(m: OffloadManager, store: StorePlan, load: LoadPlan) -> None:
    m._freed.append(m._fresh)  # a seventh block id in a pool of six
    m._fresh += 1


def corrupt_slot_at_the_top(m: OffloadManager, store: StorePlan, load: LoadPlan) -> None:
    m._freed.remove(5)  # block id 5 was never handed out: fresh is 5 ...
    m._fresh = 5
    m._block_id_of[0] = 5  # ... yet key 0 sits there


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
    m._block_id_of[3] = 3


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


def test_a_repeated_free_slot_is_an_overlap_not_a_heap_disorder() -> None:
    """The heap property is parent <= child: equal entries are in order."""
    manager, _, _ = healthy()
    manager._freed[:] = [4, 4]  # block id 5 leaked, block id 4 listed twice
    with pytest.raises(SpecViolation) as raised:
        manager.check_invariants()
    problems = str(raised.value).split("; ")
    assert reported(problems, r"resident block ids .* overlap or leak")
    assert not reported(problems, r"the free heap .*")
