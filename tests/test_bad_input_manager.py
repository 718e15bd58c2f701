"""The manager's bad input: each case gets its typed ``OffloadError``, and nothing changes.

The lockstep driver makes every bad call on a manager and on the spec's model alike, after a
history that leaves plans in every state: both must raise the case's exact error class,
neither may change (the abstraction, the policy's order included), and then they agree in
everything. docs/reliability.md lists every case by its label (a test keeps it complete).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvoffload.checking.lockstep import Divergence, Lockstep, StandIn
from kvoffload.manager import OffloadManager
from kvoffload_spec import OffloadModel
from kvoffload_spec.errors import (
    BlockNotFoundError,
    BlockPendingError,
    ForeignPlanError,
    InvalidArgumentError,
    OffloadError,
    PlanAlreadyAbandonedError,
    PlanAlreadyCompletedError,
)
from kvoffload_spec.operations import (
    ABANDON,
    AGAIN,
    COMPLETE_LOAD,
    COMPLETE_STORE,
    KEYED,
    LOOKUP,
    PREPARE_LOAD,
    PREPARE_STORE,
    RESET,
    TOUCH,
    Operation,
)
from kvoffload_spec.surface import LoadPlan, Lookup, Plan, StorePlan
from tests.garbage import (
    ABSENT,
    BAD_FLAG,
    BAD_SECONDS,
    JUNK,
    NOT_A_KEY_LIST,
    PENDING,
    READY,
    UNHASHABLE,
    refused,
    undocumented,
    with_unhashable,
)
from tests.planted import REFUSALS, ManagerBug, Planted, share

OPEN = ("open store", "open load", "stale store", "stale load")
ABANDONED = ("abandoned store", "abandoned load")


def world(
    policy: str, manager: type[OffloadManager] = OffloadManager
) -> tuple[Lockstep, dict[str, int]]:
    """A manager and the spec in lockstep through a history that leaves plans in every
    state: stale (made before a reset), completed, open, abandoned. Returns the driver and
    each plan's index in its ``held + closed``, by name.
    """
    driver = Lockstep(
        manager(8, policy),
        OffloadModel(8, policy),
        setting=f"8 blocks, {policy}",
        watched=READY + PENDING + ABSENT,
        label="manager",
    )
    named: dict[str, Plan] = {}

    def prepare(name: str, keys: tuple[str, ...], label: str = "") -> None:
        plan, _ = driver.step(Operation(name, keys))
        assert isinstance(plan, (StorePlan, LoadPlan))
        named[label or f"{len(named)}"] = plan

    def on(name: str, label: str, **options: Any) -> None:
        plans = [mine for mine, _ in driver.held]
        driver.step(Operation(name, plan=plans.index(named[label]), **options))

    prepare(PREPARE_STORE, ("s",), "stale store")
    prepare(PREPARE_STORE, ("t",), "t")
    on(COMPLETE_STORE, "t")
    prepare(PREPARE_LOAD, ("t",), "stale load")
    prepare(PREPARE_STORE, ("u",), "stale completed")
    driver.step(Operation(RESET))
    on(COMPLETE_STORE, "stale completed")  # a stale plan's first completion: a no-op
    prepare(PREPARE_STORE, ("a", "b"), "completed store")
    on(COMPLETE_STORE, "completed store")
    prepare(PREPARE_LOAD, ("a", "a"), "completed load")
    on(COMPLETE_LOAD, "completed load")
    prepare(PREPARE_STORE, ("p",), "open store")
    prepare(PREPARE_LOAD, ("b",), "open load")
    prepare(PREPARE_STORE, ("q",), "abandoned store")
    prepare(PREPARE_LOAD, ("a",), "abandoned load")
    on(ABANDON, "abandoned store")
    on(ABANDON, "abandoned load")
    plans = [mine for mine, _ in driver.held + driver.closed]
    return driver, {name: plans.index(plan) for name, plan in named.items()}


class Bad(NamedTuple):
    """A bad call: an operation and, for one on a plan, the plan its ``StandIn`` names."""

    operation: Operation
    plan: str = ""


def keyed(name: str, arguments: st.SearchStrategy[object]) -> st.SearchStrategy[Bad]:
    """``name`` called with a bad argument in place of its keys."""
    return arguments.map(lambda argument: Bad(Operation(name, argument=argument)))


def on_plans(name: str, names: Sequence[str], **options: Any) -> st.SearchStrategy[Bad]:
    """``name`` called on one of the plans ``names`` (``foreign``: the other side's)."""
    return st.sampled_from(names).map(
        lambda plan: Bad(Operation(name, argument=StandIn(**options)), plan)
    )


def forged(name: str, names: Sequence[str]) -> st.SearchStrategy[Bad]:
    """``name`` called on copies of plans with an id never issued, or other fields changed."""
    change = st.one_of(
        st.tuples(st.just("plan_id"), st.one_of(st.integers(max_value=-1), st.integers(1000))),
        st.tuples(st.just("generation"), st.integers(2, 9)),
        st.tuples(st.just("keys"), st.just(("x",))),
        st.tuples(st.just("block_ids"), st.just((7,))),
    )
    return st.tuples(st.sampled_from(names), change).map(
        lambda x: Bad(Operation(name, argument=StandIn(changes=(x[1],))), x[0])
    )


def loads_failing_on(bad: Sequence[str]) -> st.SearchStrategy[list[str]]:
    """Ready keys, then the first key that is not ready (one of ``bad``), then anything."""
    anything = st.lists(st.sampled_from(READY + PENDING + ABSENT), max_size=2)
    ready = st.lists(st.sampled_from(READY), max_size=2)
    return st.tuples(ready, st.sampled_from(bad), anything).map(lambda x: [*x[0], x[1], *x[2]])


def loads_of(keys: st.SearchStrategy[list[str]]) -> st.SearchStrategy[Bad]:
    return keys.map(lambda chosen: Bad(Operation(PREPARE_LOAD, tuple(chosen))))


def flagged(flags: st.SearchStrategy[object]) -> st.SearchStrategy[Bad]:
    """``complete_store`` of an open store plan with ``success`` one of ``flags``."""
    return st.tuples(st.sampled_from(OPEN_OF["store"]), flags).map(
        lambda x: Bad(Operation(COMPLETE_STORE, argument=StandIn(), success=x[1]), x[0])  # type: ignore[arg-type]
    )


COMPLETES = ((COMPLETE_STORE, "store"), (COMPLETE_LOAD, "load"))
OPEN_OF = {kind: [n for n in (*OPEN, *ABANDONED) if n.endswith(kind)] for kind in ("store", "load")}


@dataclass(frozen=True)
class Case:
    """Garbage (a strategy of bad calls) and the one error class every such call must get."""

    label: str
    expected: type[OffloadError]
    calls: st.SearchStrategy[Bad]


MANAGER_CASES = [
    Case(
        "keys: not a list or tuple",
        InvalidArgumentError,
        st.one_of(*(keyed(m, NOT_A_KEY_LIST) for m in KEYED)),
    ),
    Case(
        "keys: one is not hashable",
        InvalidArgumentError,
        st.one_of(*(keyed(m, with_unhashable()) for m in KEYED), keyed(LOOKUP, UNHASHABLE)),
    ),
    Case("load: a key is absent", BlockNotFoundError, loads_of(loads_failing_on(ABSENT))),
    Case("load: a key is pending", BlockPendingError, loads_of(loads_failing_on(PENDING))),
    Case(
        "plan: completed already",
        PlanAlreadyCompletedError,
        st.one_of(
            on_plans(COMPLETE_STORE, ["completed store", "stale completed"]),
            on_plans(COMPLETE_LOAD, ["completed load"]),
            on_plans(ABANDON, ["completed store", "completed load", "stale completed"]),
        ),
    ),
    Case("plan: abandoned already", PlanAlreadyAbandonedError, on_plans(ABANDON, ABANDONED)),
    Case(
        "plan: another manager's",
        ForeignPlanError,
        st.one_of(
            *(on_plans(m, OPEN_OF[kind], foreign=True) for m, kind in COMPLETES),
            on_plans(ABANDON, (*OPEN, *ABANDONED), foreign=True),
        ),
    ),
    Case(
        "plan: of the other kind",
        ForeignPlanError,
        st.one_of(
            on_plans(COMPLETE_STORE, OPEN_OF["load"]), on_plans(COMPLETE_LOAD, OPEN_OF["store"])
        ),
    ),
    Case(
        "plan: forged or altered",
        ForeignPlanError,
        st.one_of(
            *(forged(m, OPEN_OF[kind]) for m, kind in COMPLETES),
            forged(ABANDON, (*OPEN, *ABANDONED)),
        ),
    ),
    Case(
        "plan: not a plan at all",
        ForeignPlanError,
        st.one_of(*(keyed(m, JUNK) for m in (COMPLETE_STORE, COMPLETE_LOAD, ABANDON))),
    ),
    Case("success: not a bool", InvalidArgumentError, flagged(BAD_FLAG)),
]


@given(data=st.data(), case=st.sampled_from(MANAGER_CASES), policy=st.sampled_from(["lru", "arc"]))
def test_the_manager_and_the_spec_refuse_garbage_alike(
    data: st.DataObject, case: Case, policy: str
) -> None:
    """The driver makes the call on both; both must raise ``case.expected`` and change
    nothing (``Lockstep.refuse``), and then agree in everything (``Lockstep.check``)."""
    driver, index = world(policy)
    bad = data.draw(case.calls, label="call")
    operation = bad.operation
    if bad.plan:
        operation = dataclasses.replace(operation, plan=index[bad.plan])
    error = driver.refuse(operation)
    assert type(error) is case.expected, f"{error!r} instead of {case.expected.__name__}"
    driver.check()


@given(seconds=BAD_SECONDS, policy=st.sampled_from(["lru", "arc"]))
def test_the_manager_refuses_a_bad_age_of_stalled_plans_alike(seconds: object, policy: str) -> None:
    """``stalled_plans`` is the manager's own (the spec has no clock): refused, and then the
    manager still agrees with the spec in everything, its stats unchanged."""
    driver, _ = world(policy)
    manager = driver.system
    assert isinstance(manager, OffloadManager)
    before = manager.stats()
    refused(InvalidArgumentError, manager.stalled_plans, seconds)
    assert manager.stats() == before
    driver.check()


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("bug", share(REFUSALS), ids=lambda bug: bug.name)
def test_refusals_find_their_share_of_the_catalogue(bug: Planted, policy: str) -> None:
    """What a walk over the manager's fields missed (a policy has no slots to walk): the
    driver compares the abstraction, the policy's order included."""
    assert isinstance(bug.subject, ManagerBug) and issubclass(bug.subject.broken, OffloadManager)
    driver, _ = world(policy, bug.subject.broken)
    with pytest.raises(Divergence, match="the refused call changed the manager's abstract"):
        driver.refuse(Operation(TOUCH, argument=["a", []]))


def test_a_stale_plan_is_completed_once_and_changes_nothing() -> None:
    """Not an error: the first completion of a plan made before a reset is accepted and
    changes nothing (the ABA guard); only the second is refused.
    """
    driver = Lockstep(OffloadManager(2), OffloadModel(2), watched=("k",), label="manager")
    driver.step(Operation(PREPARE_STORE, ("k",)))
    driver.step(Operation(RESET))
    driver.step(Operation(PREPARE_STORE, ("k",)))  # the same key, stored anew
    driver.step(Operation(COMPLETE_STORE, plan=0))  # the stale one
    assert driver.system.lookup("k") is Lookup.PENDING and driver.system.num_free_blocks == 1
    again = driver.refuse(Operation(COMPLETE_STORE, plan=1, misuse=AGAIN))
    assert type(again) is PlanAlreadyCompletedError
    driver.step(Operation(COMPLETE_STORE, plan=0))
    assert driver.system.lookup("k") is Lookup.HIT


def test_the_docs_list_every_manager_case() -> None:
    missing = undocumented({case.label for case in MANAGER_CASES}, Path(__file__).name)
    assert not missing, f"docs/reliability.md does not list {missing} for {Path(__file__).name}"
