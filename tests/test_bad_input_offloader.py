"""The ``Offloader``'s bad input: each case gets its typed ``OffloadError``, and nothing changes.

Each bad call is made on an offloader with ready, pending, pinned and abandoned keys and
completed plans; afterwards its manager's every field and order, its job tables, the
engine's job counter and unreported results, the CPU pool's bytes, the KV cache's bytes and
the number of threads must be what they were. docs/reliability.md lists every case by its
label (a test keeps it complete).
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from hypothesis import given
from hypothesis import strategies as st

from kvoffload import Offloader
from kvoffload_spec.errors import (
    BlockNotFoundError,
    BlockPendingError,
    ForeignPlanError,
    InvalidArgumentError,
    OffloadError,
    PlanAlreadyAbandonedError,
)
from kvoffload_spec.refinement import abstract
from kvoffload_spec.surface import Plan, PlanT
from tests.garbage import (
    ABSENT,
    BAD_SECONDS,
    JUNK,
    NOT_A_KEY_LIST,
    PENDING,
    READY,
    UNHASHABLE,
    Call,
    call,
    ids_for,
    invoke,
    make_tensors,
    not_ints,
    out_of_range,
    refused,
    undocumented,
    with_unhashable,
    wrong_count,
)
from tests.helpers import every_field


class Ref(NamedTuple):
    """A plan of the offloader's world by name; ``foreign`` makes it another owner's."""

    name: str
    foreign: bool = False
    changes: tuple[tuple[str, object], ...] = ()  # fields forged into a copy


def must(plan: PlanT | None) -> PlanT:
    assert plan is not None
    return plan


def plan_refs(names: Sequence[str], **options: Any) -> st.SearchStrategy[Ref]:
    return st.sampled_from(names).map(lambda name: Ref(name, **options))


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
            every_field(offloader.manager),  # its ledger of abandoned plans too
            repr(abstract(offloader.manager)),  # the policy's order too (it has no slots)
            dict(offloader._plans),
            dict(offloader._job_of),
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


def test_the_docs_list_every_offloader_case() -> None:
    missing = undocumented(OFFLOADER_LABELS, Path(__file__).name)
    assert not missing, f"docs/reliability.md does not list {missing} for {Path(__file__).name}"
