"""``is_abandoned(plan)``: the one ledger of abandoned plans, on the manager and the spec alike.

The query is True from ``abandon(plan)`` until the plan's (late) completion, across resets,
and False otherwise (a completed plan included); it changes nothing, and anything but a plan
the system issued raises ``ForeignPlanError``. The lockstep driver compares it for every open
plan after every step, and the explorer for every plan it holds: both must catch a manager
whose ledger is wrong.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable

import pytest

from kvoffload import Offloader
from kvoffload.checking.lockstep import Divergence, Lockstep, StandIn
from kvoffload.manager import OffloadManager
from kvoffload_spec import ForeignPlanError, OffloadModel, PlanAlreadyAbandonedError
from kvoffload_spec.explore import explore
from kvoffload_spec.operations import (
    ABANDON,
    COMPLETE_LOAD,
    COMPLETE_STORE,
    IS_ABANDONED,
    PREPARE_LOAD,
    PREPARE_STORE,
    RESET,
    Operation,
)
from kvoffload_spec.surface import LoadPlan, ManagerOperations, StorePlan
from tests.caches import make_cache

POLICIES = ["lru", "arc", "duel"]


def driver_for(policy: str = "lru", manager: OffloadManager | None = None) -> Lockstep:
    return Lockstep(
        manager or OffloadManager(3, policy, enable_events=True),
        OffloadModel(3, policy, enable_events=True),
        setting=f"3 blocks, {policy}",
        watched=("a", "b", "c"),
        label="manager",
    )


def ask(driver: Lockstep, index: int) -> bool:
    """``is_abandoned`` of the plan ``index`` names in ``held + closed``, on both sides."""
    got, expected = driver.step(Operation(IS_ABANDONED, plan=index))
    assert got is expected and isinstance(got, bool)
    return got


@pytest.mark.parametrize("policy", POLICIES)
def test_true_from_abandon_until_the_completion_across_a_reset(policy: str) -> None:
    driver = driver_for(policy)
    driver.step(Operation(PREPARE_STORE, ("a",)))
    driver.step(Operation(COMPLETE_STORE, plan=0))  # closed[0]: a completed store
    driver.step(Operation(PREPARE_STORE, ("b",)))  # held[0]
    driver.step(Operation(PREPARE_LOAD, ("a",)))  # held[1]
    assert not ask(driver, 0) and not ask(driver, 1)
    driver.step(Operation(ABANDON, plan=0))
    assert ask(driver, 0) and not ask(driver, 1)
    driver.step(Operation(ABANDON, plan=1))
    assert ask(driver, 0) and ask(driver, 1)
    driver.step(Operation(RESET))  # stale now, and still abandoned: their jobs are due
    assert ask(driver, 0) and ask(driver, 1)
    driver.step(Operation(COMPLETE_STORE, plan=0, success=True))  # the late completion
    assert driver.system.num_quarantined_blocks == 0
    # held: the load; closed: the first store, then the abandoned one, completed
    assert ask(driver, 0) and not ask(driver, 1) and not ask(driver, 2)
    driver.step(Operation(COMPLETE_LOAD, plan=0))
    assert [ask(driver, index) for index in range(3)] == [False, False, False]


def test_a_stale_plan_never_abandoned_is_not_abandoned() -> None:
    driver = driver_for()
    driver.step(Operation(PREPARE_STORE, ("a",)))
    driver.step(Operation(RESET))
    assert not ask(driver, 0)


def random_history(driver: Lockstep, rng: random.Random, steps: int) -> None:
    """``steps`` random calls, abandons frequent, each checked (``is_abandoned`` of every
    open plan included)."""
    for _ in range(steps):
        held, roll = driver.held, rng.random()
        if held and roll < 0.45:
            index = rng.randrange(len(held))
            mine, _ = held[index]
            if rng.random() < 0.4:
                op = Operation(ABANDON, plan=index)
            elif isinstance(mine, StorePlan):
                op = Operation(COMPLETE_STORE, plan=index, success=rng.random() < 0.8)
            else:
                op = Operation(COMPLETE_LOAD, plan=index)
        elif roll < 0.75:
            op = Operation(PREPARE_STORE, tuple(rng.sample(driver.watched, rng.randint(1, 2))))
        elif roll < 0.95:
            op = Operation(PREPARE_LOAD, tuple(driver.resident()[:2]))
        else:
            op = Operation(RESET)
        driver.step(op)


@pytest.mark.parametrize("policy", POLICIES)
def test_the_driver_compares_it_for_every_open_plan_after_random_histories(policy: str) -> None:
    rng = random.Random(f"is_abandoned {policy}")
    for _ in range(10):
        driver = driver_for(policy)
        random_history(driver, rng, 40)
        for index in range(len(driver.held) + len(driver.closed)):
            ask(driver, index)


class ForgetsAbandonmentAtReset(OffloadManager):
    """Answers is_abandoned from the current generation's plans only: a plan abandoned and
    then made stale by a reset is reported as not abandoned, though its job is still due
    (an offloader asking it would wait at the next reset for a job that stalled)."""

    def is_abandoned(self, plan: StorePlan | LoadPlan) -> bool:
        return super().is_abandoned(plan) and plan.generation == self._generation


def test_the_driver_catches_a_ledger_that_forgets_at_a_reset() -> None:
    driver = driver_for(manager=ForgetsAbandonmentAtReset(3, "lru", enable_events=True))
    driver.step(Operation(PREPARE_STORE, ("a",)))
    driver.step(Operation(ABANDON, plan=0))
    with pytest.raises(Divergence, match=r"is_abandoned\(plan 1\) differs"):
        driver.step(Operation(RESET))


def test_the_explorer_catches_a_ledger_that_forgets_at_a_reset() -> None:
    found = explore(
        lambda: ForgetsAbandonmentAtReset(1, "lru", enable_events=True), keys=("a",), depth=3
    )
    assert found.violation is not None
    assert "is_abandoned(held plan 0) is False, the plans say True" in found.violation.message
    # the shortest: a plan (an empty one will do) made stale by a reset, then abandoned
    assert found.violation.steps[1:] == ("reset_cache()", "abandon(plan 1 (stale))")
    fine = explore(lambda: OffloadManager(1, "lru", enable_events=True), keys=("a",), depth=3)
    assert fine.ok and fine.complete


# -- bad input: the errors of the other plan calls, and nothing changed ----------------------


def with_plans() -> Lockstep:
    """Open, abandoned and completed plans of both kinds."""
    driver = driver_for()
    for op in (
        Operation(PREPARE_STORE, ("a", "b")),
        Operation(COMPLETE_STORE, plan=0),
        Operation(PREPARE_LOAD, ("a",)),
        Operation(PREPARE_STORE, ("c",)),
        Operation(ABANDON, plan=1),
    ):
        driver.step(op)
    return driver


REFUSED = {
    "not a plan": "not a plan",
    "another manager's plan": StandIn(foreign=True),
    "an id never issued": StandIn((("plan_id", 1000),)),
}
ALTERED = {
    "another generation": StandIn((("generation", 7),)),
    "other block ids": StandIn((("block_ids", (1,)),)),
}


@pytest.mark.parametrize("argument", REFUSED.values(), ids=REFUSED.keys())
@pytest.mark.parametrize("index", [0, 1, 2], ids=["open load", "abandoned store", "completed"])
def test_anything_but_an_issued_plan_raises_foreign_plan_error(
    argument: object, index: int
) -> None:
    driver = with_plans()  # held: the load, the abandoned store; closed: the first store
    error = driver.refuse(Operation(IS_ABANDONED, plan=index, argument=argument))
    assert isinstance(error, ForeignPlanError)


@pytest.mark.parametrize("argument", ALTERED.values(), ids=ALTERED.keys())
@pytest.mark.parametrize("index", [0, 1], ids=["open load", "abandoned store"])
def test_an_open_plan_altered_raises_foreign_plan_error(argument: object, index: int) -> None:
    driver = with_plans()
    error = driver.refuse(Operation(IS_ABANDONED, plan=index, argument=argument))
    assert isinstance(error, ForeignPlanError)


def test_a_completed_plan_cannot_be_told_from_a_forgery_of_it() -> None:
    """No record of a closed plan is kept: an altered copy of one is answered, not refused
    (False, as for the plan itself), on both sides alike."""
    driver = with_plans()
    got, expected = driver.apply(
        Operation(IS_ABANDONED, plan=2, argument=StandIn((("generation", 7),)))
    )
    assert got is expected is False


def test_every_manager_and_the_model_offer_the_query() -> None:
    manager, model = OffloadManager(2), OffloadModel(2)
    for system in (manager, model):
        assert isinstance(system, ManagerOperations)
        plan = system.prepare_store(["a"])
        assert plan is not None and not system.is_abandoned(plan)
        system.abandon(plan)
        assert system.is_abandoned(plan) and system.is_abandoned(plan)  # it changes nothing
        system.complete_store(plan, success=True)
        assert not system.is_abandoned(plan)


# -- the Offloader reads this one ledger ---------------------------------------------------


@pytest.mark.parametrize("manager", [OffloadManager, OffloadModel], ids=["manager", "model"])
def test_the_offloader_keeps_no_ledger_of_its_own(
    manager: Callable[[int], ManagerOperations],
) -> None:
    """A plan abandoned on the offloader's manager directly is abandoned for the offloader
    too: no stall candidate, nothing to wait for, reported abandoned when its job ends."""
    tensors, block_dim = make_cache("kv_split", num_blocks=8)
    offloader = Offloader(tensors, block_dim=block_dim, manager=manager(4), threaded=True)
    gate = threading.Event()

    def stall(job: int, run: int) -> None:
        gate.wait(10)

    offloader.engine.fault_hook = stall
    try:
        plan = offloader.store(["a"], [0])
        assert plan is not None and offloader.stalled(older_than=1e-9) == [plan]
        assert not offloader.wait(timeout=0.01)  # its job is stalled
        offloader.manager.abandon(plan)
        assert offloader.stalled(older_than=1e-9) == []
        assert offloader.wait(timeout=0.01)  # nothing left to wait for
        with pytest.raises(PlanAlreadyAbandonedError):
            offloader.abandon(plan)
    finally:
        gate.set()
    assert offloader.wait([plan], timeout=10)
    (late,) = offloader.poll()
    assert late.plan == plan and late.abandoned and not late.ok
    assert not offloader.manager.is_abandoned(plan) and offloader.num_in_flight == 0
    offloader.close()
