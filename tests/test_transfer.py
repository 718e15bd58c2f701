"""The transfer engine: byte-exact round trips, coalescing, failures, validation, pools."""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvoffload.transfer import (
    CpuBlockPool,
    Direction,
    EngineClosedError,
    KVLayout,
    PoolTooLargeError,
    TransferEngine,
)
from kvoffload.transfer import copiers as copiers_module
from kvoffload.transfer import pool as pool_module
from kvoffload.transfer.copiers import (
    ROWS_BELOW,
    SPAN_BELOW,
    SPAN_GATHER_ROWS_BELOW,
    SPAN_RUNS_AT_LEAST,
    SPAN_UNIT_AT_LEAST,
    MemmoveCopier,
    RowCopier,
    SpanCopier,
)
from kvoffload.transfer.engine import CopierName
from kvoffload.transfer.gather import ThresholdCopier
from kvoffload.transfer.jobs import FaultHook, Job
from kvoffload.transfer.runs import BlockMapping, CopyRuns, IdArray, RunPairs
from kvoffload_spec.errors import InvalidArgumentError
from tests.caches import CUDA, DEVICES, DTYPES, KINDS, make_cache, reference_block

# (copier, threaded): the CPU default, its two paths alone (memmove, numpy rows), the two
# paths CUDA uses (per-run copies, and the staging buffer of small runs), worker threads
CPU_PATHS: list[tuple[CopierName | None, bool]] = [
    (None, False),
    ("memmove", False),
    ("rows", False),
    ("span", False),
    ("tensor", False),
    ("gather", False),
    (None, True),
]
needs_cuda = [pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="needs CUDA")]


def build_engine(
    kind: str,
    *,
    num_blocks: int = 8,
    cpu_blocks: int = 6,
    factor: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    copier: CopierName | None = None,
    threaded: bool = False,
) -> tuple[TransferEngine, list[torch.Tensor], int]:
    tensors, block_dim = make_cache(kind, num_blocks=num_blocks, dtype=dtype, device=device)
    layout = KVLayout(tensors, block_dim)
    pool = CpuBlockPool(factor * layout.bytes_per_block, cpu_blocks, pin=device == "cuda")
    engine = TransferEngine(
        layout, pool, block_size_factor=factor, threaded=threaded, copier=copier
    )
    return engine, tensors, block_dim


def blocks_of(tensors: list[torch.Tensor], block_dim: int) -> list[torch.Tensor]:
    count = tensors[0].shape[block_dim]
    return [reference_block(tensors, block_dim, block) for block in range(count)]


def same(left: list[torch.Tensor], right: list[torch.Tensor]) -> bool:
    return len(left) == len(right) and all(map(torch.equal, left, right))


def finish(engine: TransferEngine, job: int) -> None:
    engine.wait([job])
    (result,) = engine.poll()
    assert result.job_id == job and result.ok, result


# -- round trips ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RoundTrip:
    """Store ``sources`` into ``cpu_ids``, then load ``loaded`` (the same CPU blocks, in
    another order) into ``targets``.
    """

    kind: str
    dtype: torch.dtype
    factor: int
    num_blocks: int
    cpu_blocks: int
    cpu_ids: list[int]
    sources: list[int]
    loaded: list[int]
    targets: list[int]


@st.composite
def round_trips(draw: st.DrawFn) -> RoundTrip:
    factor = draw(st.integers(1, 3))
    cpu_blocks = draw(st.integers(1, 5))
    num_blocks = draw(st.integers(factor * cpu_blocks, factor * cpu_blocks + 4))
    batch = draw(st.integers(0, cpu_blocks))
    if draw(st.booleans()):  # contiguous ids: the runs coalesce
        first_cpu = draw(st.integers(0, cpu_blocks - batch))
        cpu_ids = list(range(first_cpu, first_cpu + batch))
        first = draw(st.integers(0, num_blocks - factor * batch))
        sources = list(range(first, first + factor * batch))
    else:  # random ids; a store may read one device block twice
        cpu_ids = draw(st.permutations(range(cpu_blocks)))[:batch]
        size = factor * batch
        sources = draw(st.lists(st.integers(0, num_blocks - 1), min_size=size, max_size=size))
    return RoundTrip(
        kind=draw(st.sampled_from(KINDS)),
        dtype=draw(st.sampled_from(DTYPES)),
        factor=factor,
        num_blocks=num_blocks,
        cpu_blocks=cpu_blocks,
        cpu_ids=cpu_ids,
        sources=sources,
        loaded=draw(st.permutations(cpu_ids)),
        targets=draw(st.permutations(range(num_blocks)))[: factor * batch],
    )


def check_round_trip(
    case: RoundTrip, device: str, copier: CopierName | None, threaded: bool
) -> None:
    engine, tensors, block_dim = build_engine(
        case.kind,
        num_blocks=case.num_blocks,
        cpu_blocks=case.cpu_blocks,
        factor=case.factor,
        dtype=case.dtype,
        device=device,
        copier=copier,
        threaded=threaded,
    )
    before = blocks_of(tensors, block_dim)
    pool_before = engine.pool.tensor.clone()

    finish(engine, engine.submit_store(case.sources, case.cpu_ids))
    assert same(blocks_of(tensors, block_dim), before), "a store changed its source"
    untouched = [c for c in range(case.cpu_blocks) if c not in case.cpu_ids]
    assert torch.equal(engine.pool.tensor[untouched], pool_before[untouched])
    pool_stored = engine.pool.tensor.clone()

    finish(engine, engine.submit_load(case.loaded, case.targets))
    assert torch.equal(engine.pool.tensor, pool_stored), "a load changed the pool"
    k = case.factor
    origin = {
        target: case.sources[case.cpu_ids.index(case.loaded[j // k]) * k + j % k]
        for j, target in enumerate(case.targets)
    }
    after = blocks_of(tensors, block_dim)
    for block, content in enumerate(after):
        expected = before[origin.get(block, block)]
        assert torch.equal(content, expected), f"device block {block}"
    engine.close()


@pytest.mark.parametrize(("copier", "threaded"), CPU_PATHS)
@given(case=round_trips())
def test_round_trip_is_byte_exact_on_cpu(
    case: RoundTrip, copier: CopierName | None, threaded: bool
) -> None:
    check_round_trip(case, "cpu", copier, threaded)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("copier", [None, "tensor"])  # the default stages these small runs
@given(case=round_trips())
def test_round_trip_is_byte_exact_on_cuda(case: RoundTrip, copier: CopierName | None) -> None:
    check_round_trip(case, "cuda", copier, False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_large_batches_round_trip(device: str, batch: int) -> None:
    engine, tensors, block_dim = build_engine(
        "kv_split", num_blocks=2 * batch, cpu_blocks=batch, device=device
    )
    before = blocks_of(tensors, block_dim)
    order = np.random.default_rng(batch).permutation(2 * batch)
    sources, targets = order[:batch], order[batch:]
    cpu_ids = np.random.default_rng(7).permutation(batch)
    finish(engine, engine.submit_store(torch.from_numpy(sources), cpu_ids))
    finish(engine, engine.submit_load(cpu_ids, targets))
    after = blocks_of(tensors, block_dim)
    for source, target in zip(sources, targets, strict=True):
        assert torch.equal(after[target], before[source])
    assert same([after[s] for s in sources], [before[s] for s in sources])


# -- coalescing ----------------------------------------------------------------------------


def mapping_for(kind: str, factor: int, layers: int = 3) -> BlockMapping:
    tensors, block_dim = make_cache(kind, num_blocks=16, layers=layers)
    return BlockMapping(KVLayout(tensors, block_dim), factor)


def ids(*values: int) -> np.ndarray[tuple[int], np.dtype[np.int64]]:
    return np.array(values, dtype=np.int64)


@pytest.mark.parametrize("factor", [1, 2, 4])
def test_contiguous_blocks_of_one_segment_copy_in_one_run(factor: int) -> None:
    mapping = mapping_for("cross_layer", factor)
    device = np.arange(3, 3 + 2 * factor, dtype=np.int64)
    for to_cpu in (True, False):
        runs = mapping.runs(device, ids(4, 5), to_cpu=to_cpu)
        assert len(runs) == 1
        assert runs.total_bytes == 2 * factor * mapping.cpu_block_bytes // factor


def test_ids_given_out_of_order_still_coalesce() -> None:
    mapping = mapping_for("cross_layer", 1)
    runs = mapping.runs(ids(7, 5, 6), ids(2, 0, 1), to_cpu=True)
    assert len(runs) == 1 and runs.device_offset[0] == 5 * mapping.cpu_block_bytes


def test_runs_of_many_segments_stop_at_cpu_block_boundaries() -> None:
    mapping = mapping_for("kv_split", factor=2, layers=3)  # 6 segments
    runs = mapping.runs(np.arange(6, dtype=np.int64), ids(0, 1, 2), to_cpu=True)
    assert len(runs) == 6 * 3  # each segment: one run of 2 sub-blocks per CPU block
    assert set(runs.nbytes.tolist()) == {2 * mapping.cpu_block_bytes // (2 * 6)}


def test_random_ids_do_not_merge() -> None:
    mapping = mapping_for("per_layer", factor=1, layers=2)
    runs = mapping.runs(ids(5, 1, 9), ids(0, 1, 2), to_cpu=True)
    assert len(runs) == 2 * 3


@pytest.mark.parametrize("factor", [1, 2])
def test_runs_that_merge_nowhere_are_planned_alike_by_both_planners(factor: int) -> None:
    tensors, block_dim = make_cache("kv_split", num_blocks=16, layers=2)
    layout = KVLayout(tensors, block_dim)
    device, cpu = ids(9, 2, 14, 5)[: 2 * factor], ids(3, 0)
    for to_cpu in (True, False):
        small = BlockMapping(layout, factor, small_job=10**9).runs(device, cpu, to_cpu=to_cpu)
        large = BlockMapping(layout, factor, small_job=0).runs(device, cpu, to_cpu=to_cpu)
        assert len(small) == 4 * len(device)  # 4 segments, one run per (segment, block)
        for column in ("segment", "device_offset", "cpu_offset", "nbytes"):
            assert getattr(small, column).tolist() == getattr(large, column).tolist()


@pytest.mark.parametrize("small_job", [0, 10**9])
def test_adjacent_segments_of_one_storage_merge_across_layers(small_job: int) -> None:
    tensors, block_dim = make_cache("layer_views", num_blocks=16, layers=3)
    layout = KVLayout(tensors, block_dim)
    mapping = BlockMapping(layout, 1, small_job=small_job)
    random = mapping.runs(ids(5, 1, 9), ids(0, 1, 2), to_cpu=True)
    assert len(random) == 3 and set(random.nbytes.tolist()) == {layout.bytes_per_block}
    contiguous = mapping.runs(ids(4, 5, 6), ids(0, 1, 2), to_cpu=False)
    assert len(contiguous) == 1 and contiguous.total_bytes == 3 * layout.bytes_per_block
    # a CPU block of two device blocks holds each segment's sub-blocks together: no merge
    split = BlockMapping(layout, 2, small_job=small_job).runs(ids(5, 1), ids(0), to_cpu=True)
    assert len(split) == 2 * 3


def test_segments_of_separate_storages_never_merge() -> None:
    whole = torch.zeros(16, 2, 24, dtype=torch.uint8)
    first, second = whole[:, 0].clone(), whole[:, 1].clone()  # adjacent by chance at most
    mapping = BlockMapping(KVLayout([first, second]), 1)
    assert len(mapping.runs(ids(3), ids(0), to_cpu=True)) == 2


@given(case=round_trips(), to_cpu=st.booleans())
def test_small_and_vectorized_planning_agree(case: RoundTrip, to_cpu: bool) -> None:
    tensors, block_dim = make_cache(case.kind, num_blocks=case.num_blocks, dtype=case.dtype)
    layout = KVLayout(tensors, block_dim)
    python = BlockMapping(layout, case.factor, small_job=10**9)
    vector = BlockMapping(layout, case.factor, small_job=0)
    device = np.array(case.sources if to_cpu else case.targets, dtype=np.int64)
    cpu = np.array(case.cpu_ids if to_cpu else case.loaded, dtype=np.int64)
    small, large = python.runs(device, cpu, to_cpu=to_cpu), vector.runs(device, cpu, to_cpu=to_cpu)
    for column in ("segment", "device_offset", "cpu_offset", "nbytes"):
        assert getattr(small, column).tolist() == getattr(large, column).tolist(), column
    assert small.total_bytes == len(device) * layout.bytes_per_block


# -- jobs planned as pairs (no pair continues another) --------------------------------------


def spread_ids(count: int, limit: int, seed: int) -> list[int]:
    """``count`` distinct ids below ``limit``, no two consecutive in either order (so that
    no pair can continue another, whatever the sort)."""
    chosen = np.random.default_rng(seed).permutation(limit // 2)[:count] * 2
    return [int(i) for i in chosen]


def pairs_case(kind: str, factor: int, seed: int = 0) -> RoundTrip:
    """A round trip of 34 CPU blocks of random, never adjacent ids: more (segment, block)
    pairs than the plain-Python planner takes, so the numpy planner plans it as pairs."""
    cpu_blocks, batch = 80, 34
    num_blocks = 2 * factor * cpu_blocks + 2
    return RoundTrip(
        kind=kind,
        dtype=torch.float16,
        factor=factor,
        num_blocks=num_blocks,
        cpu_blocks=cpu_blocks,
        cpu_ids=spread_ids(batch, cpu_blocks, seed),
        sources=spread_ids(factor * batch, num_blocks, seed + 1),
        loaded=spread_ids(batch, cpu_blocks, seed)[::-1],
        targets=spread_ids(factor * batch, num_blocks, seed + 2),
    )


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("factor", [1, 2, 3])
def test_jobs_of_ids_that_never_continue_are_planned_as_pairs(kind: str, factor: int) -> None:
    case = pairs_case(kind, factor)
    tensors, block_dim = make_cache(kind, num_blocks=case.num_blocks)
    layout = KVLayout(tensors, block_dim)
    pool = CpuBlockPool(factor * layout.bytes_per_block, case.cpu_blocks)
    python = BlockMapping(layout, factor, small_job=10**9)
    vector = BlockMapping(layout, factor)
    copier = MemmoveCopier(layout, pool)
    device, cpu = ids(*case.sources), ids(*case.cpu_ids)
    for to_cpu in (True, False):
        runs = vector.runs(device, cpu, to_cpu=to_cpu)
        assert runs.pairs is not None, "no pair continues another: planned as pairs"
        reference = python.runs(device, cpu, to_cpu=to_cpu)
        assert len(runs) == len(reference) and runs.total_bytes == reference.total_bytes
        # the memmove copier's addresses, made from the pairs, are those of the columns
        addresses = [list(column) for column in copier._addresses(runs.pairs)]
        storage = [layout.storages[s.tensor_index].data_ptr() for s in layout.segments]
        expected = [
            [
                storage[s] + offset
                for s, offset in zip(
                    reference.segment.tolist(), reference.device_offset.tolist(), strict=True
                )
            ],
            (reference.cpu_offset + pool.flat.data_ptr()).tolist(),
            reference.nbytes.tolist(),
        ]
        assert addresses == expected
        for column in ("segment", "device_offset", "cpu_offset", "nbytes"):
            assert getattr(runs, column).tolist() == getattr(reference, column).tolist()
        assert runs.segment is runs.segment  # computed once, on first use


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("factor", [1, 2])
@pytest.mark.parametrize(("copier", "threaded"), CPU_PATHS)
def test_jobs_planned_as_pairs_round_trip_byte_exact(
    kind: str, factor: int, copier: CopierName | None, threaded: bool
) -> None:
    check_round_trip(pairs_case(kind, factor, seed=factor), "cpu", copier, threaded)


@pytest.mark.parametrize("side", ["pool", "device"])
@pytest.mark.parametrize("copier", [None, "memmove", "span"])
def test_pairs_planned_outside_their_buffers_fail_their_job_instead_of_copying(
    side: str, copier: CopierName | None
) -> None:
    engine, tensors, block_dim = build_engine(
        "per_layer", num_blocks=96, cpu_blocks=48, copier=copier
    )
    plan = engine._mapping.runs
    mapping = engine._mapping

    def beyond(device: IdArray, cpu: IdArray, *, to_cpu: bool) -> CopyRuns:
        pairs = plan(device, cpu, to_cpu=to_cpu).pairs
        assert pairs is not None
        if side == "pool":  # the last pair one CPU block past the pool
            sub = pairs.sub.copy()
            sub[-1] = engine.pool.num_blocks
            return CopyRuns.of_pairs(RunPairs(mapping, pairs.device, sub))
        device_ids = pairs.device.copy()
        device_ids[-1] = engine.layout.num_blocks
        return CopyRuns.of_pairs(RunPairs(mapping, device_ids, pairs.sub))

    engine._mapping.runs = beyond  # type: ignore[method-assign,assignment]
    before, pool_before = blocks_of(tensors, block_dim), engine.pool.tensor.clone()
    cpu_ids, device_ids = spread_ids(20, 48, 0), spread_ids(20, 96, 1)
    engine.submit_store(device_ids, cpu_ids)
    engine.submit_load(cpu_ids, device_ids)
    for result in engine.poll():
        assert not result.ok and "outside its buffer" in str(result.error)
    assert torch.equal(engine.pool.tensor, pool_before)
    assert same(blocks_of(tensors, block_dim), before)


def test_the_pairs_bounds_check_takes_the_last_block_and_refuses_one_past_it() -> None:
    engine, _, _ = build_engine("kv_split", num_blocks=12, cpu_blocks=6, factor=2)
    mapping, copier = engine._mapping, MemmoveCopier(engine.layout, engine.pool)
    last_device, last_sub = engine.layout.num_blocks - 1, 2 * engine.pool.num_blocks - 1
    segment_sizes = [engine.layout.storages[s.tensor_index].numel() for s in engine.layout.segments]
    check = copiers_module.require_pairs_in_bounds
    check(
        RunPairs(mapping, ids(0, last_device), ids(0, last_sub)), segment_sizes, engine.pool.nbytes
    )
    for device, sub in (
        (ids(0, last_device + 1), ids(0, 1)),
        (ids(0, 1), ids(0, last_sub + 1)),
        (ids(-1, 1), ids(0, 1)),
        (ids(0, 1), ids(-1, 1)),
    ):
        with pytest.raises(RuntimeError, match="outside its buffer"):
            copier.check_bounds(CopyRuns.of_pairs(RunPairs(mapping, device, sub)))
        with pytest.raises(RuntimeError, match="outside its buffer"):
            check(RunPairs(mapping, device, sub), segment_sizes, engine.pool.nbytes)


def test_a_store_planned_as_pairs_is_checked_before_it_copies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a check that refuses a run ending exactly at the end of the pool, a store of
    pairs into the last CPU block fails (and copies nothing): the pairs path runs it."""
    engine, _, _ = build_engine("per_layer", num_blocks=96, cpu_blocks=48, copier="memmove")
    cpu_ids, device_ids = [*spread_ids(19, 46, 0), 47], spread_ids(20, 96, 1)
    finish(engine, engine.submit_store(device_ids, cpu_ids))  # the real check takes it

    real = copiers_module.require_pairs_in_bounds

    def off_by_one(pairs: RunPairs, segment_size: list[int], pool_end: int) -> None:
        real(pairs, segment_size, pool_end - 1)

    monkeypatch.setattr(copiers_module, "require_pairs_in_bounds", off_by_one)
    pool_before = engine.pool.tensor.clone()
    engine.submit_store(device_ids[::-1], cpu_ids)
    (result,) = engine.poll()
    assert not result.ok and "outside its buffer" in str(result.error)
    assert torch.equal(engine.pool.tensor, pool_before)


@pytest.mark.parametrize("copier", [None, "memmove"])
def test_a_fault_half_way_through_pairs_stops_the_copy_at_that_run(
    copier: CopierName | None,
) -> None:
    engine, _, _ = build_engine("per_layer", num_blocks=96, cpu_blocks=48, copier=copier)
    cpu_ids, device_ids = spread_ids(20, 48, 0), spread_ids(20, 96, 1)
    runs = engine._mapping.runs(ids(*device_ids), ids(*cpu_ids), to_cpu=True)
    assert runs.pairs is not None
    failing = len(runs) // 2 + 3
    engine.fault_hook = FailAt(job=0, run=failing)
    pool_before = engine.pool.flat.clone()
    engine.submit_store(device_ids, cpu_ids)
    (result,) = engine.poll()
    assert not result.ok
    storages = [engine.layout.storages[s.tensor_index] for s in engine.layout.segments]
    columns = zip(
        runs.segment.tolist(),
        runs.device_offset.tolist(),
        runs.cpu_offset.tolist(),
        runs.nbytes.tolist(),
        strict=True,
    )
    for index, (segment, device_at, cpu_at, size) in enumerate(columns):
        landed = engine.pool.flat[cpu_at : cpu_at + size]
        source = storages[segment][device_at : device_at + size]
        expected = source if index < failing else pool_before[cpu_at : cpu_at + size]
        assert torch.equal(landed, expected), index


def test_an_empty_job_has_no_runs() -> None:
    mapping = mapping_for("per_layer", factor=2)
    runs = mapping.runs(ids(), ids(), to_cpu=False)
    assert len(runs) == 0 and runs.total_bytes == 0


# -- failures ------------------------------------------------------------------------------


class FailAt:
    """A fault hook that raises once, at run ``run`` of job ``job``."""

    def __init__(self, job: int, run: int) -> None:
        self.job, self.run = job, run
        self.raised: list[Exception] = []

    def __call__(self, job: int, run: int) -> None:
        if (job, run) == (self.job, self.run):
            error = RuntimeError(f"injected into job {job} at run {run}")
            self.raised.append(error)
            raise error


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("threaded", [False, True])
def test_a_job_failing_half_way_is_reported_and_isolated(device: str, threaded: bool) -> None:
    engine, tensors, block_dim = build_engine(
        "per_layer", num_blocks=8, cpu_blocks=4, device=device, threaded=threaded
    )
    before = blocks_of(tensors, block_dim)
    hook = FailAt(job=1, run=1)
    engine.fault_hook = hook
    first = engine.submit_store([0, 1], [0, 1])
    failing = engine.submit_store([2, 3], [2, 3])
    engine.wait([first])  # directions run concurrently: a load may read only finished stores
    last = engine.submit_load([0, 1], [6, 7])
    engine.wait()
    results = {result.job_id: result for result in engine.poll()}
    assert engine.poll() == []  # each job is reported exactly once
    assert [results[j].ok for j in (first, failing, last)] == [True, False, True]
    assert results[failing].error is hook.raised[0]
    assert results[failing].nbytes == 0
    assert results[first].nbytes == 2 * engine.layout.bytes_per_block
    after = blocks_of(tensors, block_dim)
    assert same(after[6:], before[:2]) and same(after[:6], before[:6])
    engine.fault_hook = None
    finish(engine, engine.submit_store([4, 5], [2, 3]))  # the failed job's CPU blocks reused
    finish(engine, engine.submit_load([2, 3], [0, 1]))
    assert same(blocks_of(tensors, block_dim)[:2], before[4:6])


def test_a_failure_in_the_copy_itself_fails_only_its_job() -> None:
    engine, _, _ = build_engine("cross_layer", cpu_blocks=2)
    original = engine._backend._copier.copy  # type: ignore[attr-defined]

    def broken(job: object, hook: object) -> None:
        raise MemoryError("the copy itself failed")

    engine._backend._copier.copy = broken  # type: ignore[attr-defined]
    bad = engine.submit_store([0], [0])
    engine._backend._copier.copy = original  # type: ignore[attr-defined]
    good = engine.submit_store([1], [1])
    results = {r.job_id: r for r in engine.poll()}
    assert not results[bad].ok and isinstance(results[bad].error, MemoryError)
    assert results[good].ok


@pytest.mark.parametrize("copier", ["memmove", "rows", "span"])
def test_a_run_outside_its_buffers_fails_its_job_instead_of_copying(copier: CopierName) -> None:
    engine, _, _ = build_engine("cross_layer", cpu_blocks=2, copier=copier)
    plan = engine._mapping.runs

    def beyond_the_pool(device: IdArray, cpu: IdArray, *, to_cpu: bool) -> CopyRuns:
        runs = plan(device, cpu, to_cpu=to_cpu)
        shifted = runs.cpu_offset + engine.pool.nbytes
        return CopyRuns(runs.segment, runs.device_offset, shifted, runs.nbytes)

    engine._mapping.runs = beyond_the_pool  # type: ignore[method-assign,assignment]
    pool_before = engine.pool.tensor.clone()
    engine.submit_load([1], [0])
    (result,) = engine.poll()
    message = str(result.error)  # the memmove backstop's, or numpy's own index check
    assert not result.ok and ("outside its buffer" in message or "out of bounds" in message)
    assert torch.equal(engine.pool.tensor, pool_before)


# -- threads -------------------------------------------------------------------------------


def test_worker_threads_run_jobs_off_the_calling_thread() -> None:
    engine, _, _ = build_engine("per_layer", threaded=True)
    seen: list[str] = []
    engine.fault_hook = lambda job, run: seen.append(threading.current_thread().name)
    store = engine.submit_store([0], [0])
    engine.wait([store])
    load = engine.submit_load([0], [1])
    engine.wait([load])
    assert set(seen) == {"kvoffload-store", "kvoffload-load"}
    results = engine.poll()
    assert [(r.job_id, r.direction) for r in results] == [
        (store, Direction.STORE),
        (load, Direction.LOAD),
    ]
    engine.close()
    engine.close()  # idempotent


def test_jobs_of_one_direction_finish_in_submission_order() -> None:
    engine, _, _ = build_engine("cross_layer", num_blocks=16, cpu_blocks=16, threaded=True)
    jobs = [engine.submit_store([i], [i]) for i in range(16)]
    engine.wait()
    assert [r.job_id for r in engine.poll()] == jobs


# -- validation ----------------------------------------------------------------------------

BAD_STORES: list[tuple[object, object, str]] = [
    ([8], [0], "lie in"),
    ([-1], [0], "lie in"),
    ([0], [6], "lie in"),
    ([0, 1], [0], "block_size_factor"),
    ([0.0], [0], "flat list of ints"),
    ([True], [0], "bool"),
    (["a"], [0], "flat list of ints"),
    ([[0]], [0], "flat list of ints"),
    ("0", [0], "list, array or tensor"),
    ({0}, [0], "list, array or tensor"),
    ([0, 1], [3, 3], "must not repeat"),
]


@pytest.mark.parametrize(("device_ids", "cpu_ids", "message"), BAD_STORES)
def test_bad_store_ids_raise_before_any_job(
    device_ids: object, cpu_ids: object, message: str
) -> None:
    engine, _, _ = build_engine("per_layer")
    pool_before = engine.pool.tensor.clone()
    with pytest.raises(InvalidArgumentError, match=message):
        engine.submit_store(device_ids, cpu_ids)  # type: ignore[arg-type]
    assert engine.poll() == [] and torch.equal(engine.pool.tensor, pool_before)
    assert engine.submit_store([0], [0]) == 0  # no job id was spent on the bad call


def test_loads_may_repeat_cpu_blocks_but_not_device_blocks() -> None:
    engine, tensors, block_dim = build_engine("kv_split")
    finish(engine, engine.submit_store([3], [2]))
    with pytest.raises(InvalidArgumentError, match="device_block_ids are written"):
        engine.submit_load([2, 2], [5, 5])
    finish(engine, engine.submit_load([2, 2], [5, 6]))
    blocks = blocks_of(tensors, block_dim)
    assert torch.equal(blocks[5], blocks[3]) and torch.equal(blocks[6], blocks[3])


def test_wait_rejects_jobs_it_never_issued() -> None:
    engine, _, _ = build_engine("per_layer")
    job = engine.submit_store([0], [0])
    for bad in ([job + 1], [-1], [True], ["0"]):
        with pytest.raises(InvalidArgumentError):
            engine.wait(bad)  # type: ignore[arg-type]
    engine.wait([job])
    engine.stream_wait(job)  # on the CPU: waits; the job is done already
    engine.poll()
    engine.wait([job])  # a finished, polled job is nothing to wait for


def test_a_closed_engine_refuses_jobs() -> None:
    with build_engine("per_layer")[0] as engine:
        engine.submit_store([0], [0])
    with pytest.raises(EngineClosedError):
        engine.submit_load([0], [1])


def test_engine_arguments_are_checked() -> None:
    tensors, block_dim = make_cache("per_layer", num_blocks=4)
    layout = KVLayout(tensors, block_dim)
    pool = CpuBlockPool(2 * layout.bytes_per_block, 2)
    with pytest.raises(InvalidArgumentError, match="cannot hold 1 device blocks"):
        TransferEngine(layout, pool)
    with pytest.raises(InvalidArgumentError, match="copier"):
        TransferEngine(layout, pool, block_size_factor=2, copier="dma")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="threaded"):
        TransferEngine(layout, pool, block_size_factor=2, threaded=1)  # type: ignore[arg-type]
    meta = KVLayout([torch.empty(4, 8, device="meta")])
    with pytest.raises(InvalidArgumentError, match="not supported"):
        TransferEngine(meta, CpuBlockPool(meta.bytes_per_block, 2))


# -- the benchmark -------------------------------------------------------------------------


@pytest.mark.slow  # a benchmark run, ~7 s
def test_the_benchmark_prints_the_agreed_json(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = Path(__file__).resolve().parent.parent / "bench" / "transfer_bench.py"
    spec = importlib.util.spec_from_file_location("transfer_bench", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "transfer_bench", bench)  # its dataclasses look it up
    spec.loader.exec_module(bench)
    threads = torch.get_num_threads()
    try:
        assert bench.main(["--quick", "--json", "--device", "cpu"]) == 0
    finally:
        torch.set_num_threads(threads)
    rows = json.loads(capsys.readouterr().out)["results"]
    fields = {
        *("layout", "engine", "direction", "block_bytes", "layers", "batch", "ids"),
        *("gbps", "cpu_gbps", "memcpy_gbps", "memcpy_cpu_gbps", "copy_gbps", "memmove_gbps"),
    }
    assert rows and all(set(row) == fields for row in rows)
    assert {r["layout"] for r in rows} == {"cross-layer", "per-layer", "layer-views"}
    assert {(r["direction"], r["ids"]) for r in rows} == {
        (d, i) for d in ("store", "load") for i in ("random", "contiguous")
    }
    assert {r["block_bytes"] for r in rows} == {2 << 20, 64 << 10}
    # the baseline is the faster of the two plain copies, measured in the same loop
    assert all(r["memcpy_gbps"] == max(r["copy_gbps"], r["memmove_gbps"]) for r in rows)
    assert all(r["gbps"] > 0 and r["memcpy_gbps"] > 0 for r in rows)


# -- the pool ------------------------------------------------------------------------------


def test_the_pool_is_sized_exactly_and_page_aligned() -> None:
    pool = CpuBlockPool(3000, 7)
    assert pool.nbytes == pool.flat.numel() == 21_000
    assert pool.tensor.shape == (7, 3000) and pool.tensor.is_contiguous()
    assert pool.flat.data_ptr() % 4096 == 0
    assert pool.tensor.data_ptr() == pool.flat.data_ptr()
    assert "7 x 3000 bytes, pageable" in repr(pool)


def test_a_byte_budget_holds_whole_blocks() -> None:
    assert CpuBlockPool(1000, budget_bytes=10_999).num_blocks == 10
    with pytest.raises(InvalidArgumentError, match="cannot hold one CPU block"):
        CpuBlockPool(1000, budget_bytes=999)
    with pytest.raises(InvalidArgumentError, match="exactly one"):
        CpuBlockPool(1000)
    with pytest.raises(InvalidArgumentError, match="exactly one"):
        CpuBlockPool(1000, 4, budget_bytes=4000)
    with pytest.raises(InvalidArgumentError, match="num_cpu_blocks"):
        CpuBlockPool(1000, 0)


def test_a_pool_larger_than_the_machine_fails_before_allocating(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def must_not_allocate(nbytes: int) -> torch.Tensor:
        raise AssertionError(f"allocated {nbytes} bytes")

    monkeypatch.setattr(pool_module, "_allocate_aligned", must_not_allocate)
    too_much = pool_module.machine_memory_bytes() + 1
    with pytest.raises(PoolTooLargeError, match="exceeds this machine's memory"):
        CpuBlockPool(1 << 20, budget_bytes=too_much + (1 << 20))


def test_prefault_writes_every_page(monkeypatch: pytest.MonkeyPatch) -> None:
    def dirty(nbytes: int) -> torch.Tensor:
        return torch.full((nbytes,), 0xAB, dtype=torch.uint8)

    monkeypatch.setattr(pool_module, "_allocate_aligned", dirty)
    assert bool((CpuBlockPool(4096, 3).flat == 0xAB).all())
    assert bool((CpuBlockPool(4096, 3, prefault=True).flat == 0).all())


@pytest.mark.skipif(CUDA, reason="checks the error raised without CUDA")
def test_pinning_without_cuda_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="needs CUDA"):
        CpuBlockPool(4096, 2, pin=True)


# -- CUDA ----------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_pool_is_pinned_without_rounding_up() -> None:
    pool = CpuBlockPool(3 << 20, 5, pin=True)  # 15 MiB: pin_memory=True would take 16
    assert pool.flat.is_pinned() and pool.nbytes == 15 << 20
    pool.close()
    assert not pool.flat.is_pinned()
    pool.close()  # idempotent


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_a_store_waits_for_the_compute_stream() -> None:
    cache = torch.zeros(4, 16 << 20, dtype=torch.uint8, device="cuda")
    engine = TransferEngine.for_cache([cache], num_cpu_blocks=4)
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):  # keeps the compute stream busy well past the store's submission
        busy = busy @ busy / 64
    cache[2].fill_(7)  # queued behind the matmuls: the store must see it
    finish(engine, engine.submit_store([2], [1]))
    assert bool((engine.pool.tensor[1] == 7).all())


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_a_consumer_stream_can_wait_for_a_load() -> None:
    cache = torch.zeros(4, 64 << 20, dtype=torch.uint8, device="cuda")
    engine = TransferEngine.for_cache([cache], num_cpu_blocks=2)
    engine.pool.tensor[0].fill_(5)
    job = engine.submit_load([0], [3])
    engine.stream_wait(job)  # the current stream waits on the GPU, the host does not
    total = cache[3].sum(dtype=torch.int64)
    assert int(total) == 5 * (64 << 20)
    engine.wait([job])
    (result,) = engine.poll()
    assert result.ok and result.seconds > 0 and result.nbytes == 64 << 20


# -- the staging path for small runs (CUDA's default below GATHER_BELOW) -------------------


class Recorder:
    def __init__(self) -> None:
        self.jobs: list[int] = []

    def copy(self, job: Job, hook: FaultHook | None) -> None:
        self.jobs.append(job.job_id)


def test_small_runs_go_through_the_staging_buffer_and_large_ones_do_not() -> None:
    small, large = Recorder(), Recorder()
    chooser = ThresholdCopier(small, large, below=1024)
    mapping = mapping_for("per_layer", factor=1, layers=2)  # 48-byte segments (bf16)
    random = mapping.runs(ids(5, 1, 9), ids(0, 1, 2), to_cpu=True)
    chooser.copy(Job(1, Direction.STORE, random, random.total_bytes), None)
    wide = ThresholdCopier(small, large, below=48)  # 48-byte runs are not under 48
    wide.copy(Job(2, Direction.LOAD, random, random.total_bytes), None)
    assert small.jobs == [1] and large.jobs == [2]


@pytest.mark.parametrize("kind", KINDS)
def test_the_staging_and_rows_paths_move_exactly_the_runs_bytes(kind: str) -> None:
    """Against the per-run reference: same pool after a store, same cache after a load
    (block_size_factor 2: runs of several rows, split into rows and back)."""
    results = []
    copiers: tuple[CopierName, ...] = ("tensor", "gather", "rows", "span")
    for copier in copiers:
        engine, tensors, block_dim = build_engine(
            kind, num_blocks=12, cpu_blocks=5, factor=2, copier=copier
        )
        finish(engine, engine.submit_store([7, 2, 3, 4, 11, 0], [4, 0, 2]))
        finish(engine, engine.submit_load([2, 4], [1, 9, 5, 6]))
        stored = engine.pool.tensor[[0, 2, 4]].clone()  # the other CPU blocks were never written
        results.append((stored, blocks_of(tensors, block_dim)))
        engine.close()
    (pool_reference, blocks_reference), *others = results
    for pool_other, blocks_other in others:
        assert torch.equal(pool_reference, pool_other) and same(blocks_reference, blocks_other)


@pytest.mark.parametrize("copier", ["gather", "rows", "span"])
def test_a_fault_fails_a_staged_job_before_it_copies_anything(copier: CopierName) -> None:
    engine, _, _ = build_engine("per_layer", num_blocks=4, cpu_blocks=2, copier=copier)
    engine.fault_hook = FailAt(job=0, run=1)
    pool_before = engine.pool.tensor.clone()
    engine.submit_store([0, 1], [0, 1])
    (result,) = engine.poll()
    assert not result.ok and torch.equal(engine.pool.tensor, pool_before)


def test_the_staging_path_handles_rows_of_odd_bytes() -> None:
    """5-byte blocks: rows of single bytes, no 8-byte elements."""
    cache = torch.arange(30, dtype=torch.uint8).view(6, 5)
    original = cache.clone()
    layout = KVLayout([cache])
    engine = TransferEngine(layout, CpuBlockPool(5, 4), copier="gather")
    finish(engine, engine.submit_store([4, 0, 5], [2, 0, 3]))
    cache.zero_()
    finish(engine, engine.submit_load([3, 2, 0], [1, 2, 3]))
    assert torch.equal(cache[[1, 2, 3]], original[[5, 4, 0]])
    assert not cache[[0, 4, 5]].any()


# -- the CPU default: numpy rows for small runs, memmove for large ones ---------------------


def test_the_cpu_default_copies_small_runs_as_rows_and_large_ones_by_memmove() -> None:
    layers = [torch.randint(0, 256, (16, 4096), dtype=torch.uint8) for _ in range(3)]
    original = [layer.clone() for layer in layers]
    engine = TransferEngine(KVLayout(layers), CpuBlockPool(3 * 4096, 12))
    chooser = engine._backend._copier  # type: ignore[attr-defined]
    assert isinstance(chooser, ThresholdCopier)
    assert isinstance(chooser.small, RowCopier) and chooser.small.unit == 4096
    # the separate layers' alignment to each other (the allocator's) picks the large path
    wide = SpanCopier(engine.layout, engine.pool, narrowest=SPAN_UNIT_AT_LEAST).usable
    assert isinstance(chooser.large, SpanCopier if wide else MemmoveCopier)
    assert chooser.below == ROWS_BELOW
    used: list[str] = []
    for side in ("small", "large"):
        inner = getattr(chooser, side)
        copy = inner.copy

        def record(job: Job, hook: FaultHook | None, copy: Any = copy, side: str = side) -> None:
            used.append(side)
            copy(job, hook)

        inner.copy = record
    # 4 KiB runs (one per layer and block) take the rows path
    finish(engine, engine.submit_store([9, 2, 14, 5], [3, 0, 11, 7]))
    for layer in layers:
        layer.zero_()
    finish(engine, engine.submit_load([11, 0, 7, 3], [1, 2, 3, 4]))
    for layer, before in zip(layers, original, strict=True):
        assert torch.equal(layer[[1, 2, 3, 4]], before[[14, 2, 5, 9]])
        assert not layer[[0, *range(5, 16)]].any()
    chooser.below = 1024  # every run is now "large": the same jobs through memmove
    finish(engine, engine.submit_store([1, 2], [5, 6]))
    assert torch.equal(engine.pool.tensor[5].view(3, 4096)[1], layers[1][1])
    assert used == ["small", "small", "large"]


def span_of(engine: TransferEngine) -> SpanCopier:
    """The default CPU copier's span path, made to take every job: by default a job of
    fewer than SPAN_RUNS_AT_LEAST runs goes by memmove, and these tests' jobs are small."""
    span = engine._backend._copier.large  # type: ignore[attr-defined]
    assert isinstance(span, SpanCopier)
    assert (span.fewest_runs, span.below) == (SPAN_RUNS_AT_LEAST, SPAN_BELOW)
    assert span.gather_rows_below == SPAN_GATHER_ROWS_BELOW
    span.fewest_runs = 1
    return span


def count_takes(span: SpanCopier) -> list[int]:
    """Rows per numpy gather (its span array's ``take`` method), appended as they come."""
    taken: list[int] = []

    class Counted:
        def __init__(self, rows: Any) -> None:
            self.rows = rows

        def take(self, indices: Any, *args: Any) -> Any:
            taken.append(len(indices))
            return self.rows.take(indices, *args)

    span._rows = Counted(span._rows)  # type: ignore[assignment]
    return taken


def store_zero_and_load_back(engine: TransferEngine, layers: list[torch.Tensor]) -> None:
    """Device blocks 19, 3, 7, 0 into CPU blocks 8, 1, 2, 5; every layer zeroed; the CPU
    blocks back into device blocks 10-13: byte-exact, and nothing else written."""
    original = [layer.clone() for layer in layers]
    finish(engine, engine.submit_store([19, 3, 7, 0], [8, 1, 2, 5]))
    for layer in layers:
        layer.zero_()
    finish(engine, engine.submit_load([2, 8, 5, 1], [10, 11, 12, 13]))
    for layer, before in zip(layers, original, strict=True):
        assert torch.equal(layer[[10, 11, 12, 13]], before[[7, 19, 0, 3]])
        assert not layer[[*range(10), *range(14, 20)]].any()


def test_layers_of_one_storage_take_the_span_path_one_call_per_pool_span() -> None:
    """Layers cut from one buffer at page-aligned offsets: 16 KiB rows across all of them,
    so a store of random blocks is one numpy call per CPU block, byte-exact both ways."""
    buffer = torch.randint(0, 256, (5 * 20 * 16384,), dtype=torch.uint8)
    layers = [buffer[i * 20 * 16384 : (i + 1) * 20 * 16384].view(20, 16384) for i in (4, 0, 2)]
    engine = TransferEngine(KVLayout(layers), CpuBlockPool(3 * 16384, 10))
    span = span_of(engine)
    assert span.gathers and span.scatters
    assert span.unit == span.width == 16384
    taken = count_takes(span)
    store_zero_and_load_back(engine, layers)
    # the store: CPU blocks 1 and 2 are one stretch of the pool, 5 and 8 two more
    assert taken == [6, 3, 3]


def test_layers_64_bytes_apart_load_through_overlapping_items_and_store_by_memmove() -> None:
    """Storages whose distances share only 64 bytes: loads still scatter 16 KiB items (one
    starts at every 64 bytes of the span, so they overlap), stores fall back to memmove."""
    size = 20 * 16384 + 64  # each layer 64 bytes further off the 16 KiB grid
    buffer = np.random.default_rng(3).integers(0, 256, 4 * size, dtype=np.uint8)
    # from_numpy: each layer its own storage, at a chosen address inside one buffer
    layers = [
        torch.from_numpy(buffer[i * size : i * size + 20 * 16384]).view(20, 16384)
        for i in (3, 0, 1)
    ]
    engine = TransferEngine(KVLayout(layers), CpuBlockPool(3 * 16384, 10))
    span = span_of(engine)
    assert span.scatters and not span.gathers
    assert (span.unit, span.width) == (64, 16384)
    store_zero_and_load_back(engine, layers)


def test_stores_of_runs_of_many_rows_go_by_memmove_and_loads_still_by_span() -> None:
    """Layers that share only a 4 KiB grid (as separate allocations do): a 64 KiB run would
    be 16 rows of a store's gather, so stores go one memmove per run; loads still scatter
    one 64 KiB item per run. Byte-exact both ways, and again with every store by span."""
    block = 16 * 4096
    size = 20 * block + 4096  # each layer one page further off the 64 KiB grid
    buffer = np.random.default_rng(4).integers(0, 256, 3 * size, dtype=np.uint8)
    layers = [
        torch.from_numpy(buffer[i * size : i * size + 20 * block]).view(20, block)
        for i in (2, 0, 1)
    ]
    engine = TransferEngine(KVLayout(layers), CpuBlockPool(3 * block, 10))
    span = span_of(engine)
    assert span.gathers and span.scatters
    assert (span.unit, span.width) == (4096, block)
    assert block // span.unit >= SPAN_GATHER_ROWS_BELOW
    taken = count_takes(span)
    moved: list[Direction] = []
    memmove = span._memmove.copy

    def record(job: Job, hook: FaultHook | None) -> None:
        moved.append(job.direction)
        memmove(job, hook)

    span._memmove.copy = record  # type: ignore[method-assign]
    store_zero_and_load_back(engine, layers)
    assert taken == [] and moved == [Direction.STORE]
    span.gather_rows_below = None  # every store by span: 16 rows per run, one call per span
    for layer in layers:
        layer.copy_(torch.randint(0, 256, layer.shape, dtype=torch.uint8))
    store_zero_and_load_back(engine, layers)
    assert taken == [16 * 6, 16 * 3, 16 * 3] and moved == [Direction.STORE]


def test_the_default_copier_sends_few_or_large_runs_by_memmove_and_many_by_span() -> None:
    """A job of fewer than SPAN_RUNS_AT_LEAST runs, or of runs of SPAN_BELOW bytes and more,
    costs the span's planning more than it saves: it goes one memmove per run."""
    buffer = torch.randint(0, 256, (2 * 400 * 16384,), dtype=torch.uint8)
    layers = [buffer[i * 400 * 16384 : (i + 1) * 400 * 16384].view(400, 16384) for i in (1, 0)]
    engine = TransferEngine(KVLayout(layers), CpuBlockPool(2 * 16384, 400))
    span = engine._backend._copier.large  # type: ignore[attr-defined]
    assert isinstance(span, SpanCopier) and span.gathers
    taken = count_takes(span)
    blocks = SPAN_RUNS_AT_LEAST // 2  # two layers: one run per layer and block
    few = list(range(0, 2 * (blocks - 1), 2))  # every other block: no two runs coalesce
    finish(engine, engine.submit_store(few, few))
    assert taken == []
    many = list(range(0, 2 * blocks, 2))
    finish(engine, engine.submit_store(many, many))
    assert sum(taken) == 2 * blocks  # one row per run, each in a span's gather
    for block in many:
        assert torch.equal(engine.pool.tensor[block].view(2, 16384)[0], layers[0][block])
    span.below = 16384  # every run now counts as large
    taken.clear()
    finish(engine, engine.submit_store(many, [block + 1 for block in many]))
    assert taken == []
    assert torch.equal(engine.pool.tensor[many[-1] + 1].view(2, 16384)[1], layers[1][many[-1]])


def test_layouts_of_narrow_rows_keep_memmove_for_every_job() -> None:
    cache = torch.zeros(6, 5, dtype=torch.uint8)  # 5-byte blocks: rows of one byte
    engine = TransferEngine(KVLayout([cache]), CpuBlockPool(5, 4))
    assert isinstance(engine._backend._copier, MemmoveCopier)  # type: ignore[attr-defined]
