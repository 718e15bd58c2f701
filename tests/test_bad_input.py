"""Bad input, everywhere public: each gets its typed ``OffloadError``, and nothing changes.

Hypothesis throws generated garbage at every public method of the manager (the spec's
model gets the same call and must refuse it alike), of the ``Offloader`` facade and of the
transfer engine, and at every constructor. Each case knows the exact error class its
garbage must get; afterwards the manager's every field, the offloader's job tables, the
engine's job counter and queue, the CPU pool's bytes and the KV cache's bytes must be what
they were. docs/reliability.md lists every case by its label (a test keeps it complete).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvoffload import Offloader
from kvoffload.checking.lockstep import Divergence, Lockstep, StandIn
from kvoffload.manager import OffloadManager
from kvoffload.policies.base import EvictionPolicy
from kvoffload.transfer import (
    CpuBlockPool,
    EngineClosedError,
    KVLayout,
    PoolTooLargeError,
    TransferEngine,
)
from kvoffload_spec import OffloadModel
from kvoffload_spec.errors import (
    BlockNotFoundError,
    BlockPendingError,
    ForeignPlanError,
    InvalidArgumentError,
    OffloadError,
    PlanAlreadyAbandonedError,
    PlanAlreadyCompletedError,
    UnknownPolicyError,
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
from kvoffload_spec.refinement import abstract
from kvoffload_spec.surface import LoadPlan, Lookup, Plan, PlanT, StorePlan
from tests.helpers import every_field
from tests.planted import REFUSALS, ManagerBug, Planted, share

DOCS = Path(__file__).resolve().parent.parent / "docs" / "reliability.md"


class Call(NamedTuple):
    method: str
    args: tuple[object, ...]
    kwargs: dict[str, object]


def call(method: str, *args: st.SearchStrategy[Any], **kwargs: st.SearchStrategy[Any]) -> Any:
    """A strategy of ``Call(method, args, kwargs)`` drawing each argument from its own."""
    return st.tuples(st.tuples(*args), st.fixed_dictionaries(kwargs)).map(
        lambda drawn: Call(method, drawn[0], drawn[1])
    )


# -- garbage ----------------------------------------------------------------------------------

JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=3),
    st.binary(max_size=3),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.integers(), st.integers(), max_size=2),
    st.builds(object),
)
UNHASHABLE = st.one_of(
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.integers(), st.integers(), max_size=2),
    st.sets(st.integers(), max_size=2),
    st.binary(max_size=2).map(bytearray),
)
# A lone str or bytes is refused too: it is nearly always a missing [...].
NOT_A_KEY_LIST = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=3),
    st.binary(max_size=3),
    st.binary(max_size=3).map(bytearray),
    st.dictionaries(st.integers(), st.integers(), max_size=2),
    st.frozensets(st.integers(), max_size=2),
    st.builds(object),
)


@st.composite
def with_unhashable(draw: st.DrawFn) -> list[object]:
    keys: list[object] = draw(st.lists(st.sampled_from(["a", b"h", 3, (4, "t")]), max_size=3))
    keys.insert(draw(st.integers(0, len(keys))), draw(UNHASHABLE))
    return keys


BAD_COUNT = st.one_of(
    st.integers(max_value=0),
    st.floats(),
    st.booleans(),
    st.text(max_size=2),
    st.none(),
    st.builds(object),
)
BAD_FLAG = st.one_of(st.integers(), st.none(), st.text(max_size=2), st.floats())
BAD_SECONDS = st.one_of(
    st.floats(max_value=0.0),
    st.sampled_from([math.nan, math.inf, -math.inf]),
    st.integers(max_value=0),
    st.booleans(),
    st.text(max_size=2),
    st.lists(st.integers(), max_size=1),
    st.builds(object),
)


@st.composite
def out_of_range(draw: st.DrawFn, limit: int, count: int) -> list[int]:
    ids = draw(st.lists(st.integers(0, limit - 1), min_size=count, max_size=count))
    wrong = st.one_of(st.integers(max_value=-1), st.integers(min_value=limit))
    ids[draw(st.integers(0, count - 1))] = draw(wrong)
    return ids


def not_ints(count: int) -> st.SearchStrategy[object]:
    """Block ids of the wrong type: containers of other things, or not a container."""
    other = st.one_of(
        st.floats(), st.booleans(), st.text(max_size=2), st.none(), st.lists(st.integers(0, 1))
    )
    return st.one_of(
        st.lists(st.integers(0, 1), min_size=count - 1, max_size=count - 1).flatmap(
            lambda ids: st.tuples(st.integers(0, len(ids)), other).map(
                lambda at: [*ids[: at[0]], at[1], *ids[at[0] :]]
            )
        ),
        st.one_of(st.none(), st.integers(), st.text(max_size=2), st.builds(object)),
        st.sets(st.integers(0, 1), min_size=1, max_size=1),
        st.just(np.zeros(count, dtype=np.float32)),
        st.just(np.zeros((count, 1), dtype=np.int64)),
        st.just(np.array([True] * count)),
        st.just(np.array([None] * count, dtype=object)),
        st.builds(lambda: torch.zeros(count)),
        st.builds(lambda: torch.zeros(count, 1, dtype=torch.int64)),
        st.builds(lambda: torch.zeros(count, dtype=torch.bool)),
        st.just([2**70] * count),
    )


def wrong_count(limit: int, count: int) -> st.SearchStrategy[list[int]]:
    sizes = st.integers(0, limit).filter(lambda size: size != count)
    return sizes.flatmap(lambda size: st.permutations(range(limit)).map(lambda ids: ids[:size]))


# -- the manager and the spec, in lockstep, with plans in every state ------------------------


class Ref(NamedTuple):
    """A plan of the offloader's world by name; ``foreign`` makes it another owner's."""

    name: str
    foreign: bool = False
    changes: tuple[tuple[str, object], ...] = ()  # fields forged into a copy


READY, PENDING, ABSENT = ("a", "b"), ("p",), ("q", "s", "t", "u", "z")
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


def must(plan: PlanT | None) -> PlanT:
    assert plan is not None
    return plan


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


def plan_refs(names: Sequence[str], **options: Any) -> st.SearchStrategy[Ref]:
    return st.sampled_from(names).map(lambda name: Ref(name, **options))


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


def invoke(target: object, made: Call, resolve_value: Callable[[object], object]) -> None:
    args = [resolve_value(value) for value in made.args]
    kwargs = {name: resolve_value(value) for name, value in made.kwargs.items()}
    getattr(target, made.method)(*args, **kwargs)


def refused(
    expected: type[OffloadError], function: Callable[..., object], *args: object, **kwargs: object
) -> OffloadError:
    """What ``function(*args, **kwargs)`` raised, which must be exactly ``expected``."""
    with pytest.raises(OffloadError) as raised:
        function(*args, **kwargs)
    assert type(raised.value) is expected, f"{raised.value!r} instead of {expected.__name__}"
    return raised.value


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


# -- the Offloader -------------------------------------------------------------------------


@dataclass
class OffloaderWorld:
    """An offloader with ready, pending, pinned and abandoned keys, and completed plans."""

    offloader: Offloader
    tensors: list[torch.Tensor]
    plans: dict[str, Plan] = field(default_factory=dict)

    @staticmethod
    def build(factor: int) -> OffloaderWorld:
        tensors, block_dim = make_tensors(8)
        offloader = Offloader(
            tensors, num_cpu_blocks=6, block_dim=block_dim, block_size_factor=factor
        )
        world = OffloaderWorld(offloader, tensors)
        ids = itertools.count()

        def blocks(keys: int) -> list[int]:
            return [next(ids) % 8 for _ in range(keys * factor)]

        world.plans["completed store"] = must(offloader.store(["a", "b", "c"], blocks(3)))
        offloader.poll()
        world.plans["completed load"] = offloader.load(["c"], blocks(1))
        offloader.poll()
        world.plans["open store"] = must(offloader.store(["p"], blocks(1)))  # not polled
        world.plans["open load"] = offloader.load(["b"], blocks(1))
        world.plans["abandoned store"] = must(offloader.store(["q"], [7] * factor))
        offloader.abandon(world.plans["abandoned store"])
        return world

    def snapshot(self) -> tuple[object, ...]:
        offloader = self.offloader
        engine = offloader.engine
        return (
            every_field(offloader.manager),
            repr(abstract(offloader.manager)),  # the policy's order too (it has no slots)
            dict(offloader._plans),
            dict(offloader._job_of),
            set(offloader._abandoned),
            dict(offloader._submitted_at),
            engine._issued,
            engine.closed,
            list(engine._backend._done),  # type: ignore[attr-defined]
            engine.pool.flat.numpy().tobytes(),
            [t.view(torch.uint8).numpy().tobytes() for t in self.tensors],
            threading.active_count(),
        )

    def resolve(self, value: object) -> object:
        if not isinstance(value, Ref):
            return value
        plan = self.plans[value.name]
        changes: dict[str, Any] = dict(value.changes)
        return dataclasses.replace(plan, **changes, owner=-1 if value.foreign else plan.owner)


def make_tensors(num_blocks: int) -> tuple[list[torch.Tensor], int]:
    generator = torch.Generator().manual_seed(num_blocks)
    tensors = [
        torch.randint(0, 256, (2, num_blocks, 3, 4), dtype=torch.uint8, generator=generator)
        for _ in range(2)
    ]
    return tensors, 1


def ids_for(keys: int, factor: int) -> st.SearchStrategy[list[int]]:
    return st.permutations(range(8)).map(lambda ids: ids[: keys * factor])


def load_of(keys: st.SearchStrategy[list[str]], factor: int) -> st.SearchStrategy[Call]:
    """``load(keys, ids)`` with valid device ids: only the keys are wrong."""
    return keys.flatmap(lambda chosen: call("load", st.just(chosen), ids_for(len(chosen), factor)))


def offloader_cases(factor: int) -> dict[str, tuple[type[OffloadError], st.SearchStrategy[Call]]]:
    """Every case for an offloader whose keys hold ``factor`` device blocks each."""
    one = ids_for(1, factor)
    not_in_flight = st.one_of(JUNK, plan_refs(["completed store", "completed load"]))
    few = st.lists(st.sampled_from(READY), max_size=1)
    return {
        "keys: not a list or tuple": (
            InvalidArgumentError,
            st.one_of(
                call("store", NOT_A_KEY_LIST, one),
                call("load", NOT_A_KEY_LIST, one),
                call("touch", NOT_A_KEY_LIST),
            ),
        ),
        "keys: one is not hashable": (
            InvalidArgumentError,
            st.one_of(
                call("store", with_unhashable(), one),
                call("touch", with_unhashable()),
                call("lookup", UNHASHABLE),
            ),
        ),
        "block ids: out of range": (
            InvalidArgumentError,
            st.one_of(
                call("store", st.just(["n"]), out_of_range(8, factor)),
                call("load", st.just(["a"]), out_of_range(8, factor)),
            ),
        ),
        "block ids: not ints": (
            InvalidArgumentError,
            st.one_of(
                call("store", st.just(["n"]), not_ints(factor)),
                call("load", st.just(["a"]), not_ints(factor)),
            ),
        ),
        "block ids: the wrong count": (
            InvalidArgumentError,
            st.one_of(
                call("store", st.just(["n"]), wrong_count(8, factor)),
                call("load", st.just(["a"]), wrong_count(8, factor)),
            ),
        ),
        "block ids: a load writes one twice": (
            InvalidArgumentError,
            call("load", st.just(["a", "b"]), st.integers(0, 7).map(lambda b: [b] * 2 * factor)),
        ),
        "load: a key is absent": (
            BlockNotFoundError,
            load_of(st.tuples(few, st.sampled_from(ABSENT)).map(lambda x: [*x[0], x[1]]), factor),
        ),
        "load: a key is pending": (
            BlockPendingError,
            load_of(st.tuples(few, st.sampled_from(PENDING)).map(lambda x: [*x[0], x[1]]), factor),
        ),
        "plans: not a list": (
            InvalidArgumentError,
            call(
                "wait", JUNK.filter(lambda value: value is not None and not isinstance(value, list))
            ),
        ),
        "plan: not in flight here": (
            InvalidArgumentError,
            st.one_of(
                call("wait", st.lists(not_in_flight, min_size=1, max_size=2)),
                call("stream_wait", not_in_flight),
                call("abandon", not_in_flight),
            ),
        ),
        "plan: abandoned already": (
            PlanAlreadyAbandonedError,
            call("abandon", plan_refs(["abandoned store"])),
        ),
        # Plans compare equal whoever issued them (the spec's and the manager's are the
        # same plan): waiting on an equal plan is waiting on its job; its manager refuses
        # to abandon it.
        "plan: another manager's": (
            ForeignPlanError,
            call("abandon", plan_refs(["open store", "open load"], foreign=True)),
        ),
        "seconds: not a finite number > 0": (
            InvalidArgumentError,
            st.one_of(
                call("wait", st.none(), BAD_SECONDS),
                call("reset", BAD_SECONDS),
                call("close", BAD_SECONDS),
                call("stalled", BAD_SECONDS),
            ),
        ),
    }


OFFLOADER_LABELS = sorted(offloader_cases(1))


@given(data=st.data(), label=st.sampled_from(OFFLOADER_LABELS), factor=st.integers(1, 2))
def test_the_offloader_refuses_garbage_before_touching_anything(
    data: st.DataObject, label: str, factor: int
) -> None:
    expected, calls = offloader_cases(factor)[label]
    made = data.draw(calls, label="call")
    world = OffloaderWorld.build(factor)
    before = world.snapshot()
    refused(expected, invoke, world.offloader, made, world.resolve)
    assert world.snapshot() == before, f"{made} changed the offloader"
    world.offloader.close()


# -- the transfer engine -------------------------------------------------------------------


def engine_cases() -> dict[str, tuple[type[OffloadError], st.SearchStrategy[Call]]]:
    """Every case for an engine of 8 device blocks and 4 CPU blocks (one device block each)."""
    pairs = st.integers(1, 4).flatmap(lambda n: st.tuples(ids_for(n, 1), ids_for(n, 1)))
    cpu = st.permutations(range(4)).map(lambda ids: ids[:1])
    return {
        "block ids: out of range": (
            InvalidArgumentError,
            st.one_of(
                call("submit_store", out_of_range(8, 1), cpu),
                call("submit_store", st.just([0]), out_of_range(4, 1)),
                call("submit_load", out_of_range(4, 1), st.just([0])),
            ),
        ),
        "block ids: not ints": (
            InvalidArgumentError,
            st.one_of(
                call("submit_store", not_ints(1), cpu),
                call("submit_load", not_ints(1), st.just([0])),
            ),
        ),
        "block ids: the wrong count": (
            InvalidArgumentError,
            call("submit_store", wrong_count(8, 1).filter(bool), st.just([])),
        ),
        "block ids: a store writes one twice": (
            InvalidArgumentError,
            call("submit_store", st.just([0, 1]), st.integers(0, 3).map(lambda b: [b, b])),
        ),
        "block ids: a load writes one twice": (
            InvalidArgumentError,
            call("submit_load", st.just([0, 1]), st.integers(0, 7).map(lambda b: [b, b])),
        ),
        "hook: not a function": (
            InvalidArgumentError,
            JUNK.filter(lambda value: value is not None).map(
                lambda hook: Call("__setattr__", ("fault_hook", hook), {})
            ),
        ),
        "jobs: never submitted": (
            InvalidArgumentError,
            st.one_of(
                call(
                    "wait",
                    st.lists(st.one_of(st.integers(1), st.integers(max_value=-1)), min_size=1),
                ),
                call("wait", st.one_of(st.integers(), st.text(max_size=2), st.builds(object))),
                call(
                    "wait", st.lists(st.one_of(st.booleans(), st.floats(), st.text()), min_size=1)
                ),
                call("stream_wait", st.one_of(st.integers(1), st.none(), st.text(max_size=2))),
            ),
        ),
        "seconds: not a finite number > 0": (
            InvalidArgumentError,
            call("wait", st.none(), BAD_SECONDS),
        ),
        "engine: closed": (EngineClosedError, pairs.map(lambda ids: Call("submit_store", ids, {}))),
    }


ENGINE_LABELS = sorted(engine_cases())


@given(data=st.data(), label=st.sampled_from(ENGINE_LABELS))
def test_the_engine_refuses_garbage_before_queuing_anything(
    data: st.DataObject, label: str
) -> None:
    expected, calls = engine_cases()[label]
    made = data.draw(calls, label="call")
    tensors, block_dim = make_tensors(8)
    engine = TransferEngine.for_cache(tensors, num_cpu_blocks=4, block_dim=block_dim)
    engine.submit_store([0], [0])  # job 0: done, not polled
    if expected is EngineClosedError:
        engine.close()

    def snapshot() -> tuple[object, ...]:
        return (
            engine._issued,
            engine.fault_hook,
            list(engine._backend._done),  # type: ignore[attr-defined]
            engine.pool.flat.numpy().tobytes(),
            [t.numpy().tobytes() for t in tensors],
        )

    before = snapshot()
    refused(expected, invoke, engine, made, lambda value: value)
    assert snapshot() == before, f"{made} changed the engine"
    engine.close()


# -- constructors ----------------------------------------------------------------------------


def tensors_of(*shapes: tuple[int, ...], device: str = "cpu") -> list[torch.Tensor]:
    return [torch.zeros(shape, device=device) for shape in shapes]


def bad_caches() -> dict[str, st.SearchStrategy[tuple[object, object]]]:
    """(kv_caches, block_dim) that no layout accepts, by case label."""

    def built(*makers: Callable[[], object]) -> st.SearchStrategy[tuple[object, object]]:
        return (
            st.sampled_from(makers)
            .map(lambda make: make())
            .map(lambda made: made if isinstance(made, tuple) else (made, 0))
        )

    return {
        "kv_caches: not a list of tensors": built(
            lambda: None,
            lambda: [],
            lambda: torch.zeros(4, 8),
            lambda: [np.zeros((4, 8))],
            lambda: [torch.zeros(4, 8), "layer 2"],
            lambda: {0: torch.zeros(4, 8)},
            lambda: (t for t in tensors_of((4, 8))),
        ),
        "kv_caches: no usable block dimension": built(
            lambda: [torch.tensor(1.0)],
            lambda: tensors_of((0, 8)),
            lambda: tensors_of((4, 0)),
            lambda: (tensors_of((4, 8)), 2),
            lambda: (tensors_of((4, 8)), -1),
        ),
        "kv_caches: sparse or nested": built(
            lambda: [torch.eye(4).to_sparse()],
            lambda: [torch.eye(4).to_sparse_csr()],
            lambda: [torch.nested.nested_tensor([torch.zeros(2, 3), torch.zeros(3, 3)])],
        ),
        "kv_caches: blocks overlap or are not contiguous": built(
            lambda: [torch.zeros(1, 8).expand(4, 8)],
            lambda: [torch.zeros(40).as_strided((4, 8), (2, 1))],
            lambda: [torch.zeros(4, 8, 2).transpose(1, 2)],
            lambda: [torch.zeros(4, 1).expand(4, 8)],
        ),
        "kv_caches: tensors disagree on the number of blocks": built(
            lambda: tensors_of((4, 8), (5, 8)),
            lambda: (tensors_of((4, 8), (2, 5, 8)), [0, 1]),
        ),
        "kv_caches: on different or unsupported devices": built(
            lambda: [torch.zeros(4, 8), torch.zeros(4, 8, device="meta")],
            lambda: [torch.zeros(4, 8, device="meta"), torch.zeros(4, 8)],
        ),
        "block_dim: not an int, or one per tensor": built(
            lambda: (tensors_of((4, 8)), True),
            lambda: (tensors_of((4, 8)), "0"),
            lambda: (tensors_of((4, 8)), 0.0),
            lambda: (tensors_of((4, 8), (4, 8)), [0]),
            lambda: (tensors_of((4, 8)), [0, 0]),
            lambda: (tensors_of((4, 8)), None),
        ),
    }


class _ValidCache:
    """Stands for a valid KV cache in a constructor call (garbage goes elsewhere)."""

    def __repr__(self) -> str:
        return "<a valid KV cache>"


VALID_CACHE = _ValidCache()


def constructor_cases() -> dict[str, tuple[type[OffloadError], st.SearchStrategy[Call]]]:
    huge = st.integers(2**50, 2**62)
    policies = st.one_of(
        st.text(max_size=4).filter(lambda text: ":" not in text and text not in ("lru", "arc")),
        st.sampled_from(
            [
                "no.such.module:Policy",
                "kvoffload:Offloader",
                "kvoffload.policies.base:EvictionPolicy",
                "collections:nothing",
            ]
        ),
        st.sampled_from([int, EvictionPolicy, None, 3]),
    )

    def replacing(target: str, **garbage: st.SearchStrategy[Any]) -> st.SearchStrategy[Call]:
        bases: dict[str, dict[str, object]] = {
            "OffloadManager": {"num_blocks": 4},
            "OffloadModel": {"num_blocks": 4},
            "Offloader": {"kv_caches": VALID_CACHE, "num_cpu_blocks": 4},
            "CpuBlockPool": {"block_bytes": 64, "num_blocks": 4},
            "TransferEngine.for_cache": {"kv_caches": VALID_CACHE, "num_cpu_blocks": 4},
        }
        base = bases[target]
        return st.sampled_from(sorted(garbage)).flatmap(
            lambda name: garbage[name].map(lambda value: Call(target, (), {**base, name: value}))
        )

    meta = st.builds(
        lambda: Call(
            "Offloader", (), {"kv_caches": tensors_of((4, 8), device="meta"), "num_cpu_blocks": 2}
        )
    )
    caches = {
        label: strategy.map(
            lambda made: Call(
                "Offloader", (), {"kv_caches": made[0], "block_dim": made[1], "num_cpu_blocks": 2}
            )
        )
        | strategy.map(lambda made: Call("KVLayout", made, {}))
        for label, strategy in bad_caches().items()
    }
    return {
        **{label: (InvalidArgumentError, strategy) for label, strategy in caches.items()},
        # A layout of meta tensors is fine (it sizes a pool without memory); copies are not.
        "kv_caches: on different or unsupported devices": (
            InvalidArgumentError,
            caches["kv_caches: on different or unsupported devices"] | meta,
        ),
        "counts: not an int >= 1": (
            InvalidArgumentError,
            st.one_of(
                replacing(
                    "OffloadManager",
                    num_blocks=BAD_COUNT,
                    store_threshold=BAD_COUNT,
                    max_tracker_size=BAD_COUNT,
                ),
                replacing(
                    "OffloadModel",
                    num_blocks=BAD_COUNT,
                    store_threshold=BAD_COUNT,
                    max_tracker_size=BAD_COUNT,
                ),
                replacing("Offloader", num_cpu_blocks=BAD_COUNT, block_size_factor=BAD_COUNT),
                replacing(
                    "TransferEngine.for_cache",
                    num_cpu_blocks=BAD_COUNT,
                    block_size_factor=BAD_COUNT,
                ),
                replacing("CpuBlockPool", block_bytes=BAD_COUNT, num_blocks=BAD_COUNT),
            ),
        ),
        "policy: unknown": (
            UnknownPolicyError,
            st.one_of(
                replacing("OffloadManager", policy=policies),
                replacing("OffloadModel", policy=policies),
                replacing("Offloader", policy=policies),
            ),
        ),
        "flags: not a bool": (
            InvalidArgumentError,
            st.one_of(
                replacing("OffloadManager", enable_events=BAD_FLAG),
                replacing("OffloadModel", enable_events=BAD_FLAG),
                replacing("Offloader", threaded=BAD_FLAG, prefault=BAD_FLAG),
                replacing("TransferEngine.for_cache", threaded=BAD_FLAG, prefault=BAD_FLAG),
                replacing("CpuBlockPool", pin=BAD_FLAG, prefault=BAD_FLAG),
            ),
        ),
        "seconds: not a finite number > 0": (
            InvalidArgumentError,
            st.one_of(
                replacing("OffloadManager", stall_after=BAD_SECONDS),
                replacing("Offloader", stall_after=BAD_SECONDS),
            ),
        ),
        "clock: not a function": (
            InvalidArgumentError,
            replacing("OffloadManager", clock=JUNK),
        ),
        "pool size: neither or both of count and bytes": (
            InvalidArgumentError,
            st.one_of(
                st.just(Call("Offloader", (), {"kv_caches": VALID_CACHE})),
                st.just(
                    Call(
                        "Offloader",
                        (),
                        {"kv_caches": VALID_CACHE, "num_cpu_blocks": 2, "cpu_bytes": 4096},
                    )
                ),
                st.just(Call("CpuBlockPool", (64,), {})),
                st.just(Call("CpuBlockPool", (64, 2), {"budget_bytes": 4096})),
            ),
        ),
        "pool size: a byte budget below one block": (
            InvalidArgumentError,
            st.one_of(
                st.integers(1, 95).map(
                    lambda b: Call("Offloader", (), {"kv_caches": VALID_CACHE, "cpu_bytes": b})
                ),
                st.integers(1, 63).map(lambda b: Call("CpuBlockPool", (64,), {"budget_bytes": b})),
            ),
        ),
        "pool size: larger than memory": (
            PoolTooLargeError,
            st.one_of(
                replacing("Offloader", num_cpu_blocks=huge),
                huge.map(
                    lambda b: Call("Offloader", (), {"kv_caches": VALID_CACHE, "cpu_bytes": b})
                ),
                replacing("CpuBlockPool", num_blocks=huge),
            ),
        ),
        "manager: another size or not a manager": (
            InvalidArgumentError,
            st.one_of(
                st.sampled_from([3, 5]).map(
                    lambda n: Call(
                        "Offloader",
                        (),
                        {
                            "kv_caches": VALID_CACHE,
                            "num_cpu_blocks": 4,
                            "manager": OffloadManager(n),
                        },
                    )
                ),
                JUNK.filter(lambda value: value is not None).map(
                    lambda junk: Call("Offloader", (), {"kv_caches": VALID_CACHE, "manager": junk})
                ),
            ),
        ),
        "engine: the pool does not fit the layout": (
            InvalidArgumentError,
            st.one_of(
                st.sampled_from([48, 192]).map(lambda b: Call("TransferEngine", (b,), {})),
                st.just(Call("TransferEngine", (96,), {"block_size_factor": 2})),
                JUNK.filter(lambda v: v is not None).map(
                    lambda c: Call("TransferEngine", (96,), {"copier": c})
                ),
                BAD_FLAG.map(lambda flag: Call("TransferEngine", (96,), {"threaded": flag})),
            ),
        ),
    }


def construct(made: Call) -> object:
    """Build what ``made`` names; ``VALID_CACHE`` and engines get a valid cache."""
    kwargs = dict(made.kwargs)
    if kwargs.get("kv_caches") is VALID_CACHE:
        kwargs["kv_caches"] = tensors_of((4, 2, 3, 4))  # 96-byte blocks
    if made.method == "TransferEngine":
        layout = KVLayout(tensors_of((4, 2, 3, 4)))
        (block_bytes,) = made.args
        return TransferEngine(layout, CpuBlockPool(block_bytes, 2), **kwargs)  # type: ignore[arg-type]
    constructors: dict[str, Callable[..., object]] = {
        "OffloadManager": OffloadManager,
        "OffloadModel": OffloadModel,
        "Offloader": Offloader,
        "CpuBlockPool": CpuBlockPool,
        "KVLayout": KVLayout,
        "TransferEngine.for_cache": TransferEngine.for_cache,
    }
    return constructors[made.method](*made.args, **kwargs)


CONSTRUCTOR_LABELS = sorted(constructor_cases())


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@given(data=st.data(), label=st.sampled_from(CONSTRUCTOR_LABELS))
def test_constructors_refuse_garbage_before_starting_anything(
    data: st.DataObject, label: str
) -> None:
    expected, calls = constructor_cases()[label]
    made = data.draw(calls, label="call")
    threads = threading.active_count()
    refused(expected, construct, made)
    assert threading.active_count() == threads, "a refused constructor left a thread running"


# -- the list in docs/reliability.md ---------------------------------------------------------


def test_the_docs_list_every_case() -> None:
    documented = DOCS.read_text()
    labels = {case.label for case in MANAGER_CASES}
    labels |= {*OFFLOADER_LABELS, *ENGINE_LABELS, *CONSTRUCTOR_LABELS}
    missing = sorted(label for label in labels if f"`{label}`" not in documented)
    assert not missing, f"docs/reliability.md does not list {missing}"
