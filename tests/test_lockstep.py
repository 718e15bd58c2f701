"""The checking core: operations as data, the refinement mapping and the lockstep driver.

Each of these is what the other checkers stand on, so each must be able to fail: a state
difference in any field is reported, the driver stops at the first call where a system
departs from the spec, and the manager's abstraction is the model's state after any
history.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

import pytest

from kvoffload.checking.lockstep import DictatedOrder, Divergence, Lockstep
from kvoffload.manager import OffloadManager
from kvoffload_spec import InvalidArgumentError, OffloadModel, PlanAlreadyCompletedError, StorePlan
from kvoffload_spec.operations import (
    ABANDON,
    AGAIN,
    COMPLETE_LOAD,
    COMPLETE_STORE,
    FOREIGN,
    LOOKUP,
    PREPARE_LOAD,
    PREPARE_STORE,
    RESET,
    TOUCH,
    Operation,
    misuse_of,
)
from kvoffload_spec.refinement import abstract, copy_state, fingerprint, state_differences
from kvoffload_spec.state import Block, SpecState
from tests.planted.manager import CountsATouchAsAnOffer, ForgetsAFailedStoresEvent

POLICIES = ["lru", "arc", "duel"]


def random_history(driver: Lockstep, rng: random.Random, steps: int) -> None:
    """``steps`` random operations through ``driver``, checked after each."""
    keys = driver.watched
    for _ in range(steps):
        chosen = rng.sample(keys, rng.randint(0, 3))
        held = driver.held
        roll = rng.random()
        if held and roll < 0.35:
            index = rng.randrange(len(held))
            mine, _ = held[index]
            if rng.random() < 0.15:
                op = Operation(ABANDON, plan=index)
            elif isinstance(mine, StorePlan):
                op = Operation(COMPLETE_STORE, plan=index, success=rng.random() < 0.8)
            else:
                op = Operation(COMPLETE_LOAD, plan=index)
        elif roll < 0.65:
            op = Operation(PREPARE_STORE, tuple(chosen))
        elif roll < 0.8:
            op = Operation(PREPARE_LOAD, tuple(driver.resident()[:2]))
        elif roll < 0.97:
            op = Operation(TOUCH, tuple(chosen))
        else:
            op = Operation(RESET)
        driver.step(op)


def driver_for(policy: str, *, blocks: int = 3, manager: OffloadManager | None = None) -> Lockstep:
    return Lockstep(
        manager or OffloadManager(blocks, policy, enable_events=True),
        OffloadModel(blocks, policy, enable_events=True),
        setting=f"{blocks} blocks, {policy}",
        watched=tuple(range(6)),
    )


@pytest.mark.parametrize("policy", POLICIES)
def test_the_managers_abstraction_is_the_models_state_after_any_history(policy: str) -> None:
    rng = random.Random(policy)
    for _ in range(20):
        driver = driver_for(policy)
        random_history(driver, rng, 40)  # check() compares the abstract states every step
        mine = abstract(driver.system)
        assert mine is not None
        assert state_differences(mine, driver.model.state) == []
        assert fingerprint(mine, {}) == fingerprint(driver.model.state, {})


def test_every_field_of_a_state_is_compared() -> None:
    model = OffloadModel(3, "arc", enable_events=True, store_threshold=2)
    for keys in (["a", "b"], ["a", "b"], ["c"], ["c"]):
        plan = model.prepare_store(keys)
        if plan is not None and plan.keys:
            model.complete_store(plan)
    model.touch(["a"])
    base = model.state
    changes: dict[str, Callable[[SpecState], object]] = {
        "blocks": lambda s: s.blocks.__setitem__("a", Block(s.blocks["a"].block_id, refs=1)),
        "free block ids": lambda s: s.free_block_ids.append(9),
        "evictable counter": lambda s: setattr(s, "num_evictable", 0),
        "generation": lambda s: setattr(s, "generation", 5),
        "open plans": lambda s: s.open_plans.__setitem__(99, next(iter(base.open_plans.values()))),
        "next plan id": lambda s: setattr(s, "next_plan_id", 99),
        "abandoned plans": lambda s: s.abandoned.__setitem__(1, [2]),
        "settings": lambda s: setattr(s, "max_tracker_size", 7),
        "offer tracker": lambda s: s.offers.update({"z": 1}),
        "events not taken yet": lambda s: setattr(s, "events", None),
        "eviction order": lambda s: setattr(s.order, "p", 1.0),
    }
    model.prepare_store(["d"])  # leaves a plan open, for the open-plans change
    base = model.state
    assert state_differences(copy_state(base), base) == []
    for field, change in changes.items():
        twin = copy_state(base)
        change(twin)
        found = state_differences(twin, base)
        assert len(found) == 1 and found[0].startswith(field), (field, found)
    twin = copy_state(base)
    twin.order.p = 2.0  # type: ignore[union-attr]
    assert state_differences(twin, base, compare_order=False) == []
    assert state_differences(dataclasses.replace(base, owner=123), base) == []  # identity


def test_the_driver_reports_the_first_call_that_departs_from_the_spec() -> None:
    driver = driver_for("lru", manager=ForgetsAFailedStoresEvent(3, "lru", enable_events=True))
    driver.step(Operation(PREPARE_STORE, (0, 1)))
    with pytest.raises(Divergence) as failed:
        driver.step(Operation(COMPLETE_STORE, plan=0, success=False))
    lines = str(failed.value).splitlines()
    assert lines[0] == "a failing history, on a system with 3 blocks, lru:"
    assert lines[1].startswith("  1. prepare_store([0, 1]) -> StorePlan(keys=[0, 1]")
    assert lines[2] == "  2. complete_store(plan 1, success=False) -> None"
    assert lines[3] == "  -> then take_events() differs:"


def test_only_the_abstract_state_shows_an_observation_made_by_the_wrong_call() -> None:
    model = OffloadModel(3, "lru", store_threshold=2, enable_events=True)
    manager = CountsATouchAsAnOffer(3, "lru", store_threshold=2, enable_events=True)
    driver = Lockstep(manager, model, watched=(0, 1))
    with pytest.raises(Divergence, match="offer tracker"):
        driver.step(Operation(TOUCH, (0,)))


def test_errors_agree_by_class_and_misuses_change_nothing() -> None:
    driver = driver_for("arc")
    driver.step(Operation(PREPARE_STORE, (0,)))
    driver.step(Operation(COMPLETE_STORE, plan=0))
    got, expected = driver.step(misuse_of(AGAIN, driver.closed[0][0], 0))
    assert type(got) is type(expected) is PlanAlreadyCompletedError
    got, _ = driver.step(misuse_of(FOREIGN, driver.closed[0][0], 0))
    assert type(got).__name__ == "ForeignPlanError"
    got, _ = driver.step(Operation(PREPARE_STORE, (0,), malformed=True))
    assert isinstance(got, InvalidArgumentError)
    got, _ = driver.step(Operation(LOOKUP, argument=[[0]]))
    assert isinstance(got, InvalidArgumentError)


def test_a_dictated_model_follows_legal_victims_and_refuses_illegal_ones() -> None:
    # ARC evicts the T1 key 1 where LRU would evict the least recent key 0: the model follows.
    driver = Lockstep(
        OffloadManager(2, "arc"), OffloadModel(2, "lru"), watched=(0, 1, 2), dictated=True
    )
    driver.step(Operation(PREPARE_STORE, (0,)))
    driver.step(Operation(COMPLETE_STORE, plan=0))
    driver.step(Operation(TOUCH, (0,)))  # 0 moves to T2
    driver.step(Operation(PREPARE_STORE, (1,)))
    driver.step(Operation(COMPLETE_STORE, plan=0))
    plan, _ = driver.step(Operation(PREPARE_STORE, (2,)))
    assert isinstance(plan, StorePlan) and plan.evicted_keys == (1,)
    order = driver.model.state.order
    assert isinstance(order, DictatedOrder)
    order.answer = (0,)
    with pytest.raises(Divergence, match="pinned, pending, protected or absent"):
        order.choose_victims(1, lambda key: key != 0)
    order.answer = None
    with pytest.raises(Divergence, match="was refused; 1 could go"):
        order.choose_victims(1, lambda key: key == 0)
