"""The copiers: which path a job's runs take (staging, numpy rows, memmove, spans), and
that each moves exactly the runs' bytes."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from kvoffload.transfer import (
    CpuBlockPool,
    Direction,
    KVLayout,
    TransferEngine,
)
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
from tests.caches import KINDS
from tests.transfer_support import (
    FailAt,
    blocks_of,
    build_engine,
    finish,
    ids,
    mapping_for,
    same,
)

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
