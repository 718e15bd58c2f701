"""The transfer engine's bad input: each case gets its typed ``OffloadError``, and nothing changes.

Each bad call is made on an engine with one job done and not yet polled; afterwards its job
counter, fault hook, unreported results, CPU pool bytes and KV cache bytes must be what they
were. docs/reliability.md lists every case by its label (a test keeps it complete).
"""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from kvoffload.transfer import EngineClosedError, TransferEngine
from kvoffload_spec.errors import InvalidArgumentError, OffloadError
from tests.garbage import (
    BAD_SECONDS,
    JUNK,
    Call,
    call,
    ids_for,
    invoke,
    make_tensors,
    not_ints,
    out_of_range,
    refused,
    undocumented,
    wrong_count,
)


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


def test_the_docs_list_every_engine_case() -> None:
    missing = undocumented(ENGINE_LABELS, Path(__file__).name)
    assert not missing, f"docs/reliability.md does not list {missing} for {Path(__file__).name}"
