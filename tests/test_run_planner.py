"""The run planner: which (source, destination) runs a job's block ids become, on both
planner paths."""

from __future__ import annotations

import inspect
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from kvoffload.transfer import (
    CpuBlockPool,
    KVLayout,
)
from kvoffload.transfer import copiers as copiers_module
from kvoffload.transfer import runs as runs_module
from kvoffload.transfer.copiers import (
    MemmoveCopier,
)
from kvoffload.transfer.engine import CopierName
from kvoffload.transfer.runs import BlockMapping, CopyRuns, IdArray, RunPairs
from tests.caches import KINDS, MIXED_STYLES, make_cache, styled_cache
from tests.planted import PLANNER, Planted, share
from tests.planted.planner import PlannerBug
from tests.transfer_support import (
    CPU_PATHS,
    FailAt,
    RoundTrip,
    blocks_of,
    build_engine,
    check_round_trip,
    finish,
    ids,
    mapping_for,
    round_trips,
    same,
)

# -- coalescing ----------------------------------------------------------------------------


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


# -- layouts mixing packed and strided rows, against a plain reference -----------------------


def reference_bytes(layout: KVLayout, factor: int, device: IdArray, cpu: IdArray) -> np.ndarray:
    """Every byte a job copies, as (storage address, device byte, pool byte) rows sorted,
    made segment by segment and pair by pair with no merging at all: device block
    ``device[j]``'s bytes of segment ``s`` go to sub-block ``j % factor`` of CPU block
    ``cpu[j // factor]``, in segment ``s``'s part of it."""
    storage = [layout.storages[s.tensor_index].data_ptr() for s in layout.segments]
    cpu_block_bytes = factor * layout.bytes_per_block
    rows = []
    part = 0  # where segment s's sub-blocks start inside a CPU block
    for s, segment in enumerate(layout.segments):
        size = np.arange(segment.nbytes, dtype=np.int64)
        for j, block in enumerate(device.tolist()):
            sub = int(cpu[j // factor]) * factor + j % factor
            at = sub // factor * cpu_block_bytes + part + sub % factor * segment.nbytes
            device_at = segment.base + block * segment.stride
            rows.append(np.stack([np.full_like(size, storage[s]), device_at + size, at + size], 1))
        part += factor * segment.nbytes
    return sort_rows(np.concatenate(rows) if rows else np.empty((0, 3), dtype=np.int64))


def planned_bytes(layout: KVLayout, runs: CopyRuns) -> np.ndarray:
    """The same rows for what a planner's runs copy."""
    storage = [layout.storages[s.tensor_index].data_ptr() for s in layout.segments]
    rows = [
        np.stack([np.full(size, storage[s]), np.arange(d, d + size), np.arange(c, c + size)], 1)
        for s, d, c, size in zip(
            runs.segment.tolist(),
            runs.device_offset.tolist(),
            runs.cpu_offset.tolist(),
            runs.nbytes.tolist(),
            strict=True,
        )
    ]
    return sort_rows(np.concatenate(rows) if rows else np.empty((0, 3), dtype=np.int64))


def sort_rows(rows: np.ndarray) -> np.ndarray:
    return rows[np.lexsort(rows.T[::-1])].astype(np.int64)


SMALL_JOB: int = inspect.signature(BlockMapping).parameters["small_job"].default


@dataclass(frozen=True)
class MixedJob:
    """A job over per-layer tensors whose rows are packed or strided (``styles``)."""

    styles: tuple[str, ...]
    dtype: torch.dtype
    factor: int
    cpu_blocks: int
    cpu_ids: list[int]
    device_ids: list[int]
    to_cpu: bool

    @property
    def num_blocks(self) -> int:
        return self.factor * self.cpu_blocks + 3


@st.composite
def mixed_jobs(draw: st.DrawFn) -> MixedJob:
    """Layouts of 1-4 rows in any mix of styles, factors 1-4, jobs from one pair to a few
    hundred (segment, block) pairs (both planner paths), ids consecutive on both sides
    (runs merge), in consecutive stretches, or anywhere."""
    styles = tuple(draw(st.lists(st.sampled_from(MIXED_STYLES), min_size=1, max_size=4)))
    factor = draw(st.integers(1, 4))
    if draw(st.booleans()):  # a small job: any size
        cpu_blocks = draw(st.integers(1, 12))
        batch = draw(st.integers(1, cpu_blocks))
    else:  # a large one: more pairs than the plain planner takes
        least = SMALL_JOB // (factor * len(styles)) + 1
        cpu_blocks = draw(st.integers(least, least + 8))
        batch = draw(st.integers(least, cpu_blocks))
    order = draw(st.sampled_from(("consecutive", "stretches", "anywhere")))
    if order == "consecutive":
        first = draw(st.integers(0, cpu_blocks - batch))
        cpu_ids = list(range(first, first + batch))
    else:
        cpu_ids = draw(st.permutations(range(cpu_blocks)))[:batch]
        if order == "stretches":  # sorted within stretches of a few: runs of some length
            stretch = draw(st.integers(2, 6))
            cpu_ids.sort(key=lambda c: (c // stretch, c))
    shift = draw(st.integers(0, 3))
    subs = [c * factor + j for c in cpu_ids for j in range(factor)]
    if draw(st.booleans()):  # device ids follow the pool's: consecutive where the pool's are
        device_ids = [sub + shift for sub in subs]
    else:
        device_ids = draw(st.permutations(range(factor * cpu_blocks + 3)))[: len(subs)]
    return MixedJob(
        styles=styles,
        dtype=draw(st.sampled_from((torch.uint8, torch.bfloat16))),
        factor=factor,
        cpu_blocks=cpu_blocks,
        cpu_ids=cpu_ids,
        device_ids=device_ids,
        to_cpu=draw(st.booleans()),
    )


PLANNERS = {"plain Python": 10**9, "numpy": 0, "as the engine picks": None}


def planner_problems(job: MixedJob, mapping_class: type[BlockMapping] = BlockMapping) -> list[str]:
    """Where each planner's runs copy other bytes than the reference, or address bytes
    outside a segment's storage or the pool."""
    tensors = styled_cache(list(job.styles), num_blocks=job.num_blocks, dtype=job.dtype)
    layout = KVLayout(tensors, 0)
    device, cpu = ids(*job.device_ids), ids(*job.cpu_ids)
    expected = reference_bytes(layout, job.factor, device, cpu)
    pool_bytes = job.cpu_blocks * job.factor * layout.bytes_per_block
    problems = []
    for name, small_job in PLANNERS.items():
        options = {} if small_job is None else {"small_job": small_job}
        runs = mapping_class(layout, job.factor, **options).runs(device, cpu, to_cpu=job.to_cpu)
        sizes = [layout.storages[layout.segments[s].tensor_index].numel() for s in runs.segment]
        if any(
            d < 0 or d + n > size or c < 0 or c + n > pool_bytes
            for d, c, n, size in zip(
                runs.device_offset.tolist(),
                runs.cpu_offset.tolist(),
                runs.nbytes.tolist(),
                sizes,
                strict=True,
            )
        ):
            problems.append(f"{name}: a run outside its buffer")
        if not np.array_equal(planned_bytes(layout, runs), expected):
            problems.append(f"{name}: copies other bytes than the reference")
    return problems


MIXED_JOBS = settings(max_examples=200, deadline=None)
"""How many jobs the mixed-layout property draws (the catalogue's test skips shrinking)."""


def check_mixed_layouts(mapping_class: type[BlockMapping] = BlockMapping) -> None:
    @MIXED_JOBS
    @given(job=mixed_jobs())
    def every_planner_matches_the_reference(job: MixedJob) -> None:
        assert planner_problems(job, mapping_class) == [], job

    every_planner_matches_the_reference()


def test_every_planner_copies_the_reference_bytes_on_mixed_layouts() -> None:
    check_mixed_layouts()


def test_the_mixed_jobs_reach_both_planner_paths_and_merge_runs() -> None:
    """The property's ground: a mixed layout with a factor > 1 and a large consecutive
    job takes the numpy path and merges the packed rows' runs, not the strided ones'."""
    tensors = styled_cache(["packed", "padded", "every_other"], num_blocks=2 * 20 + 3)
    layout = KVLayout(tensors, 0)
    mapping = BlockMapping(layout, 2)
    device, cpu = np.arange(2 * 20, dtype=np.int64), np.arange(20, dtype=np.int64)
    assert len(device) * len(mapping.rows) > mapping.small_job  # the numpy path
    runs = mapping.runs(device, cpu, to_cpu=True)
    assert runs.pairs is None
    per_row = {row: int((runs.segment == row).sum()) for row in range(3)}
    assert per_row == {0: 20, 1: 40, 2: 40}  # packed: one run per CPU block; strided: per pair
    assert np.array_equal(planned_bytes(layout, runs), reference_bytes(layout, 2, device, cpu))


def mixed_round_trip(factor: int, batch: int) -> RoundTrip:
    """Consecutive ids stored, loaded back in reversed stretches of three."""
    cpu_blocks = batch + 2
    cpu_ids = list(range(1, 1 + batch))
    loaded = [c for start in range(0, batch, 3) for c in cpu_ids[start : start + 3]][::-1]
    num_blocks = factor * cpu_blocks + 2
    return RoundTrip(
        kind="mixed",
        dtype=torch.bfloat16,
        factor=factor,
        num_blocks=num_blocks,
        cpu_blocks=cpu_blocks,
        cpu_ids=cpu_ids,
        sources=list(range(1, 1 + factor * batch)),
        loaded=loaded,
        targets=list(range(num_blocks - factor * batch, num_blocks)),
    )


@pytest.mark.parametrize("batch", [2, 20])  # pairs below and above the small-job planner's
@pytest.mark.parametrize("factor", [1, 2, 3])
@pytest.mark.parametrize(("copier", "threaded"), CPU_PATHS)
def test_mixed_layouts_round_trip_byte_exact_on_both_planner_paths(
    copier: CopierName | None, threaded: bool, factor: int, batch: int
) -> None:
    check_round_trip(mixed_round_trip(factor, batch), "cpu", copier, threaded)


RUNS_SOURCE = Path(runs_module.__file__).read_text()


def broken_mapping(bug: PlannerBug) -> type[BlockMapping]:
    """``BlockMapping`` of a copy of runs.py with ``bug``'s edit (which must match once)."""
    old, new = bug.edit
    assert RUNS_SOURCE.count(old) == 1, f"{bug.name}: {old!r} no longer in runs.py"
    module = types.ModuleType("kvoffload_runs_planted")
    sys.modules[module.__name__] = module  # dataclasses and NamedTuple look their module up
    exec(compile(RUNS_SOURCE.replace(old, new), "<planted runs>", "exec"), module.__dict__)
    mapping: type[BlockMapping] = module.BlockMapping
    return mapping


@pytest.mark.parametrize("entry", share(PLANNER), ids=lambda bug: bug.name)
def test_the_planner_checks_find_their_share_of_the_catalogue(
    entry: Planted, monkeypatch: pytest.MonkeyPatch
) -> None:
    bug = entry.subject
    assert isinstance(bug, PlannerBug)
    # Stop at the first failing job: shrinking it would only cost time here.
    found_only = settings(MIXED_JOBS, phases=(Phase.generate,), database=None)
    monkeypatch.setitem(globals(), "MIXED_JOBS", found_only)
    with pytest.raises(AssertionError, match="copies other bytes than the reference"):
        check_mixed_layouts(broken_mapping(bug))
