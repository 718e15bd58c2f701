"""The reference model, call by call, as a user reads the spec: each operation, each error
(raised before anything changes), events, ARC's fallback, the offer tracker, reset and
stale plans."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from kvoffload_spec import (
    BlockNotFoundError,
    BlockNotReadyError,
    BlockPendingError,
    BlocksRemoved,
    BlocksStored,
    ForeignPlanError,
    InvalidArgumentError,
    LoadPlan,
    Lookup,
    OffloadError,
    OffloadModel,
    PlanAlreadyAbandonedError,
    PlanAlreadyCompletedError,
    RemovalReason,
    StorePlan,
    UnknownPolicyError,
)
from kvoffload_spec.policies import ArcOrder
from kvoffload_spec.surface import Key

POLICIES = ["lru", "arc"]
UNHASHABLE: Any = ["a list"]


def stored(model: OffloadModel, keys: list[Key]) -> StorePlan:
    """Store ``keys`` and complete the store."""
    plan = model.prepare_store(keys)
    assert plan is not None
    model.complete_store(plan)
    return plan


@contextmanager
def unchanged(model: OffloadModel) -> Iterator[None]:
    before = model.state.snapshot()
    yield
    assert model.state.snapshot() == before
    model.check_invariants()


@contextmanager
def only_closes(model: OffloadModel, plan: StorePlan | LoadPlan) -> Iterator[None]:
    """Nothing changes but ``plan`` being closed (what a stale completion may do)."""
    state = model.state
    assert plan.plan_id in state.open_plans
    before = repr((state.blocks, state.free_block_ids, state.num_evictable, state.order))
    yield
    assert repr((state.blocks, state.free_block_ids, state.num_evictable, state.order)) == before
    assert plan.plan_id not in state.open_plans
    model.check_invariants()


# -- prepare_store / complete_store ---------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_a_store_is_pending_until_it_completes(policy: str) -> None:
    model = OffloadModel(4, policy)
    plan = model.prepare_store(["a", "b"])
    assert plan is not None
    assert (plan.keys, plan.block_ids, plan.evicted_keys) == (("a", "b"), (0, 1), ())
    assert [model.lookup(k) for k in "abc"] == [Lookup.PENDING, Lookup.PENDING, Lookup.MISS]
    assert (model.num_free_blocks, model.num_evictable_blocks) == (2, 0)
    model.complete_store(plan)
    assert model.lookup("a") is Lookup.HIT
    assert (model.num_free_blocks, model.num_evictable_blocks) == (2, 2)


def test_a_failed_store_never_becomes_readable_and_frees_its_slots() -> None:
    model = OffloadModel(2, enable_events=True)
    plan = model.prepare_store(["a", "b"])
    assert plan is not None
    model.complete_store(plan, success=False)
    assert model.lookup("a") is Lookup.MISS and model.num_free_blocks == 2
    assert model.take_events() == [BlocksRemoved(("a", "b"), RemovalReason.STORE_FAILED)]
    with pytest.raises(BlockNotFoundError):
        model.prepare_load(["a"])
    assert model.prepare_store(["c"]) == StorePlan(("c",), (0,), (), 1, 0, 0)


def test_duplicates_count_once_and_resident_keys_are_not_stored_again() -> None:
    model = OffloadModel(3)
    stored(model, ["a"])
    plan = model.prepare_store(["b", "a", "b", "c"])
    assert plan is not None and plan.keys == ("b", "c") and plan.block_ids == (1, 2)


def test_nothing_to_store_is_an_empty_plan_not_a_failure() -> None:
    model = OffloadModel(1)
    stored(model, ["a"])
    plan = model.prepare_store(["a"])
    assert plan is not None and plan.keys == () and plan.block_ids == ()
    model.complete_store(plan)  # an empty plan must still be completed once
    with pytest.raises(PlanAlreadyCompletedError):
        model.complete_store(plan)


@pytest.mark.parametrize("policy", POLICIES)
def test_victims_are_evictable_and_outside_the_call(policy: str) -> None:
    model = OffloadModel(3, policy)
    stored(model, ["a", "b", "c"])
    model.prepare_load(["a"])  # pinned
    plan = model.prepare_store(["b", "d", "e"])  # b is protected: only c can go
    assert plan is None
    plan = model.prepare_store(["b", "d"])
    assert plan is not None and plan.evicted_keys == ("c",) and plan.block_ids == (2,)
    assert model.lookup("c") is Lookup.MISS and model.lookup("d") is Lookup.PENDING


def test_pending_blocks_are_never_evicted() -> None:
    model = OffloadModel(2)
    model.prepare_store(["a", "b"])
    with unchanged(model):
        assert model.prepare_store(["c"]) is None


def test_the_fast_fail_guard_refuses_only_what_cannot_fit() -> None:
    model = OffloadModel(2)
    stored(model, ["a", "b"])
    with unchanged(model):
        assert model.prepare_store(["c", "d", "e"]) is None  # 3 needed, 2 evictable
    plan = model.prepare_store(["c", "d"])  # exactly fits
    assert plan is not None and plan.evicted_keys == ("a", "b")


def test_freed_slots_are_reused_lowest_first_in_call_order() -> None:
    model = OffloadModel(4)
    stored(model, ["a", "b", "c", "d"])
    model.touch(["b", "d"])  # a and c are now least recent: they go first
    plan = model.prepare_store(["y", "x"])
    assert plan is not None and plan.evicted_keys == ("a", "c") and plan.block_ids == (0, 2)


# -- prepare_load / complete_load -----------------------------------------------------------


def test_a_load_pins_each_occurrence_until_it_completes() -> None:
    model = OffloadModel(2)
    stored(model, ["a", "b"])
    first = model.prepare_load(["a", "a"])
    second = model.prepare_load(["a"])
    assert (first.keys, first.block_ids) == (("a", "a"), (0, 0))
    assert model.state.blocks["a"].refs == 3 and model.num_evictable_blocks == 1
    model.complete_load(first)
    assert model.num_evictable_blocks == 1  # still read by the second load
    model.complete_load(second)
    assert model.num_evictable_blocks == 2


@pytest.mark.parametrize(
    ("keys", "error"),
    [
        (["a", "x"], BlockNotFoundError),
        (["a", "p"], BlockPendingError),
        (["p", "x"], BlockPendingError),
    ],
)
def test_a_load_of_a_key_not_ready_is_refused_and_pins_nothing(
    keys: list[str], error: type[BlockNotReadyError]
) -> None:
    model = OffloadModel(3)
    stored(model, ["a"])
    model.prepare_store(["p"])
    with unchanged(model), pytest.raises(error):
        model.prepare_load(keys)


# -- touch -----------------------------------------------------------------------------------


def test_touch_makes_the_first_key_most_recent_so_prefix_tails_go_first() -> None:
    model = OffloadModel(3)
    stored(model, ["a", "b", "c"])
    model.touch(["a", "b"])  # a most recent, then b; c least recent
    evicted: list[Key] = []
    for key in ["d", "e", "f"]:
        plan = model.prepare_store([key])
        assert plan is not None
        evicted += plan.evicted_keys
        model.complete_store(plan)
    assert evicted == ["c", "b", "a"]


@pytest.mark.parametrize("policy", POLICIES)
def test_pinning_does_not_change_recency(policy: str) -> None:
    model = OffloadModel(3, policy)
    stored(model, ["a", "b", "c"])
    load = model.prepare_load(["a"])
    plan = model.prepare_store(["d"])
    assert plan is not None and plan.evicted_keys == ("b",)
    model.complete_load(load)
    plan = model.prepare_store(["e"])
    assert plan is not None and plan.evicted_keys == ("a",)  # still the least recent


def test_touching_an_absent_key_changes_nothing() -> None:
    model = OffloadModel(2)
    stored(model, ["a"])
    with unchanged(model):
        model.touch(["x", "y"])


# -- ARC -------------------------------------------------------------------------------------


def arc_of(model: OffloadModel) -> ArcOrder:
    assert isinstance(model.state.order, ArcOrder)
    return model.state.order


def test_arc_moves_a_key_touched_while_ready_to_t2_and_remembers_ghosts() -> None:
    model = OffloadModel(2, "arc")
    model.prepare_store(["a"])
    model.touch(["a"])  # pending: inserting is not a second access
    assert arc_of(model).t1 == ["a"]
    model = OffloadModel(2, "arc")
    stored(model, ["a", "b"])
    model.touch(["b"])
    assert (arc_of(model).t1, arc_of(model).t2) == (["a"], ["b"])
    stored(model, ["c"])  # T1 is at least its target: its oldest goes, leaving a ghost
    assert arc_of(model).b1 == ["a"]


def test_arc_ghost_hits_move_the_target() -> None:
    model = OffloadModel(2, "arc")
    stored(model, ["a", "b"])
    stored(model, ["c"])  # a becomes a B1 ghost
    model.touch(["a"])
    assert arc_of(model).p == 1.0
    model.touch(["a"])
    assert arc_of(model).p == 2.0  # never beyond the capacity
    model.touch(["a"])
    assert arc_of(model).p == 2.0


def test_arc_falls_back_to_t2_when_t1_has_nothing_evictable() -> None:
    model = OffloadModel(2, "arc")
    stored(model, ["a", "b"])
    model.touch(["b"])  # T1 [a], T2 [b]; p = 0 prefers T1
    model.prepare_load(["a"])
    plan = model.prepare_store(["c"])
    assert plan is not None and plan.evicted_keys == ("b",)


def test_arc_falls_back_to_t1_when_t2_has_nothing_evictable() -> None:
    """The other direction, which vLLM lacked until PR #55461."""
    model = OffloadModel(2, "arc")
    stored(model, ["a", "b"])
    stored(model, ["c"])  # a: a B1 ghost
    model.touch(["a"])
    model.touch(["a"])  # p = 2 prefers T2 while |T1| < 2
    model.touch(["b"])  # T1 [c], T2 [b]
    model.prepare_load(["b"])
    plan = model.prepare_store(["d"])
    assert plan is not None and plan.evicted_keys == ("c",)


# -- the offer tracker ------------------------------------------------------------------------


def test_a_key_is_stored_only_once_offered_threshold_times() -> None:
    model = OffloadModel(2, store_threshold=2)
    first = model.prepare_store(["a"])
    assert first is not None and first.keys == ()
    second = model.prepare_store(["a", "b"])
    assert second is not None and second.keys == ("a",)


def test_offers_are_recorded_even_when_the_store_fails() -> None:
    model = OffloadModel(1, store_threshold=2)
    stored(model, ["x"])
    stored(model, ["x"])  # resident now
    model.prepare_load(["x"])  # pinned: nothing can be evicted
    model.prepare_store(["a"])  # first offer: not yet a candidate, an empty plan
    assert model.prepare_store(["a"]) is None  # a candidate now, but there is no room
    assert model.state.offers["a"] == 2


def test_the_tracker_forgets_the_least_recently_offered_key() -> None:
    model = OffloadModel(4, store_threshold=2, max_tracker_size=2)
    model.prepare_store(["a"])
    model.prepare_store(["b"])
    model.prepare_store(["c"])  # forgets a
    assert list(model.state.offers) == ["b", "c"]
    plan = model.prepare_store(["b"])
    assert plan is not None and plan.keys == ("b",)
    plan = model.prepare_store(["a"])  # a first offer again
    assert plan is not None and plan.keys == ()


# -- reset and stale plans --------------------------------------------------------------------


def test_a_reset_drops_everything_and_makes_open_plans_stale() -> None:
    model = OffloadModel(2, enable_events=True)
    stored(model, ["b", "a"])
    load = model.prepare_load(["a"])
    model.take_events()
    model.reset_cache()
    assert model.take_events() == [BlocksRemoved(("b", "a"), RemovalReason.RESET)]  # by slot
    assert (model.num_free_blocks, model.num_evictable_blocks) == (2, 0)
    assert model.lookup("a") is Lookup.MISS
    with only_closes(model, load):
        model.complete_load(load)  # stale
    with pytest.raises(PlanAlreadyCompletedError):
        model.complete_load(load)


@pytest.mark.parametrize("success", [True, False])
def test_a_stale_store_completion_cannot_touch_a_key_stored_again(success: bool) -> None:
    """The ABA hazard: the old job must not mark the new store of the same key ready."""
    model = OffloadModel(1)
    old = model.prepare_store(["a"])
    assert old is not None
    model.reset_cache()
    new = model.prepare_store(["a"])
    assert new is not None and new.block_ids == old.block_ids
    with only_closes(model, old):
        model.complete_store(old, success)
    assert model.lookup("a") is Lookup.PENDING
    model.complete_store(new)
    assert model.lookup("a") is Lookup.HIT


# -- abandon: a stalled job -------------------------------------------------------------------


def test_abandoning_a_load_releases_its_pins_and_its_late_completion_does_nothing() -> None:
    model = OffloadModel(1)
    stored(model, ["a"])
    load = model.prepare_load(["a"])
    model.abandon(load)
    assert model.num_evictable_blocks == 1
    plan = model.prepare_store(["b"])
    assert plan is not None and plan.evicted_keys == ("a",)
    with only_closes(model, load):
        model.complete_load(load)


def test_abandoning_a_store_drops_its_keys_and_quarantines_its_slots() -> None:
    model = OffloadModel(2, enable_events=True)
    stalled = model.prepare_store(["a"])
    assert stalled is not None
    model.abandon(stalled)
    assert model.take_events() == [BlocksRemoved(("a",), RemovalReason.STORE_FAILED)]
    assert model.lookup("a") is Lookup.MISS
    assert (model.num_free_blocks, model.num_quarantined_blocks) == (1, 1)
    plan = model.prepare_store(["b", "c"])  # one slot is free, the other may still be written
    assert plan is None
    model.reset_cache()  # the job may still write: the quarantine outlives a reset
    assert (model.num_free_blocks, model.num_quarantined_blocks) == (1, 1)
    model.complete_store(stalled, success=True)  # the job is over
    assert (model.num_free_blocks, model.num_quarantined_blocks) == (2, 0)
    assert model.lookup("a") is Lookup.MISS and model.take_events() == []


def test_abandoning_a_stale_plan_changes_nothing_else() -> None:
    model = OffloadModel(1)
    stale = model.prepare_store(["a"])
    assert stale is not None
    model.reset_cache()
    model.abandon(stale)
    assert (model.num_free_blocks, model.num_quarantined_blocks) == (1, 0)


def test_a_plan_is_abandoned_once_and_completed_once() -> None:
    model = OffloadModel(2)
    stalled = model.prepare_store(["a"])
    assert stalled is not None
    model.abandon(stalled)
    with unchanged(model), pytest.raises(PlanAlreadyAbandonedError):
        model.abandon(stalled)
    model.complete_store(stalled)
    with unchanged(model), pytest.raises(PlanAlreadyCompletedError):
        model.abandon(stalled)
    with unchanged(model), pytest.raises(ForeignPlanError):
        model.abandon(loaded_model()[1])
    with unchanged(model), pytest.raises(ForeignPlanError):
        model.abandon("plan")  # type: ignore[arg-type]


# -- events ----------------------------------------------------------------------------------


def test_events_report_stores_evictions_and_failures_in_order() -> None:
    model = OffloadModel(2, enable_events=True)
    stored(model, ["a", "b"])
    plan = model.prepare_store(["c"])
    assert plan is not None
    model.complete_store(plan, success=False)
    assert model.take_events() == [
        BlocksStored(("a", "b")),
        BlocksRemoved(("a",), RemovalReason.EVICTED),
        BlocksRemoved(("c",), RemovalReason.STORE_FAILED),
    ]
    assert model.take_events() == []


def test_events_are_off_unless_enabled() -> None:
    model = OffloadModel(1)
    stored(model, ["a"])
    model.reset_cache()
    assert model.take_events() == []


# -- errors: typed, and raised before anything changes ----------------------------------------


@pytest.mark.parametrize(
    ("arguments", "error"),
    [
        ({"num_blocks": 0}, InvalidArgumentError),
        ({"num_blocks": True}, InvalidArgumentError),
        ({"num_blocks": 2.0}, InvalidArgumentError),
        ({"policy": "fifo"}, UnknownPolicyError),
        ({"policy": None}, UnknownPolicyError),
        ({"store_threshold": 0}, InvalidArgumentError),
        ({"max_tracker_size": 0}, InvalidArgumentError),
        ({"enable_events": 1}, InvalidArgumentError),
    ],
)
def test_bad_constructor_arguments(arguments: dict[str, Any], error: type[OffloadError]) -> None:
    with pytest.raises(error):
        OffloadModel(**{"num_blocks": 2, **arguments})


def test_unknown_policy_is_also_a_value_error() -> None:
    with pytest.raises(ValueError, match="choose one of lru, arc"):
        OffloadModel(2, "fifo")


def loaded_model() -> tuple[OffloadModel, StorePlan, LoadPlan]:
    model = OffloadModel(3, enable_events=True)
    stored(model, ["a"])
    store = model.prepare_store(["b"])
    assert store is not None
    return model, store, model.prepare_load(["a"])


BAD_CALLS: list[tuple[str, Callable[[OffloadModel, StorePlan, LoadPlan], object], type]] = [
    ("store a string", lambda m, s, ld: m.prepare_store("ab"), InvalidArgumentError),
    ("store unhashable", lambda m, s, ld: m.prepare_store(["c", UNHASHABLE]), InvalidArgumentError),
    ("store not a list", lambda m, s, ld: m.prepare_store(7), InvalidArgumentError),  # type: ignore[arg-type]
    ("load bytes", lambda m, s, ld: m.prepare_load(b"a"), InvalidArgumentError),
    ("load unhashable", lambda m, s, ld: m.prepare_load(["a", UNHASHABLE]), InvalidArgumentError),
    ("touch a string", lambda m, s, ld: m.touch("a"), InvalidArgumentError),
    ("lookup unhashable", lambda m, s, ld: m.lookup(UNHASHABLE), InvalidArgumentError),
    ("success not a bool", lambda m, s, ld: m.complete_store(s, 1), InvalidArgumentError),  # type: ignore[arg-type]
    ("load plan as store", lambda m, s, ld: m.complete_store(ld), ForeignPlanError),  # type: ignore[arg-type]
    ("store plan as load", lambda m, s, ld: m.complete_load(s), ForeignPlanError),  # type: ignore[arg-type]
    ("not a plan", lambda m, s, ld: m.complete_load("plan"), ForeignPlanError),  # type: ignore[arg-type]
    ("another model's", lambda m, s, ld: m.complete_load(loaded_model()[2]), ForeignPlanError),
    (
        "forged id",
        lambda m, s, ld: m.complete_load(LoadPlan(("a",), (0,), 99, 0, m.state.owner)),
        ForeignPlanError,
    ),
    (
        "forged keys",
        lambda m, s, ld: m.complete_load(LoadPlan(("b",), (1,), ld.plan_id, 0, m.state.owner)),
        ForeignPlanError,
    ),
]


@pytest.mark.parametrize(
    ("call", "error"), [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS]
)
def test_bad_calls_raise_a_typed_error_and_change_nothing(
    call: Callable[[OffloadModel, StorePlan, LoadPlan], object], error: type[OffloadError]
) -> None:
    model, store, load = loaded_model()
    model.take_events()
    with unchanged(model), pytest.raises(error):
        call(model, store, load)
    assert model.take_events() == []


@pytest.mark.parametrize("kind", ["store", "load"])
def test_completing_a_plan_twice_is_an_error_that_changes_nothing(kind: str) -> None:
    model, store, load = loaded_model()
    plan: StorePlan | LoadPlan = store if kind == "store" else load
    complete = model.complete_store if isinstance(plan, StorePlan) else model.complete_load
    complete(plan)  # type: ignore[arg-type]
    with unchanged(model), pytest.raises(PlanAlreadyCompletedError):
        complete(plan)  # type: ignore[arg-type]


def test_check_invariants_names_what_is_broken() -> None:
    model = OffloadModel(2)
    stored(model, ["a"])
    model.state.num_evictable = 5
    with pytest.raises(AssertionError, match="evictable counter is 5 but 1 blocks"):
        model.check_invariants()
