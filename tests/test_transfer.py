"""The transfer engine: byte-exact round trips, failures, threads, validation, pools, CUDA."""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given

from kvoffload.transfer import (
    CpuBlockPool,
    Direction,
    EngineClosedError,
    KVLayout,
    PoolTooLargeError,
    TransferEngine,
)
from kvoffload.transfer import pool as pool_module
from kvoffload.transfer.engine import CopierName
from kvoffload.transfer.runs import CopyRuns, IdArray
from kvoffload_spec.errors import InvalidArgumentError
from tests.caches import CUDA, DEVICES, make_cache
from tests.transfer_support import (
    CPU_PATHS,
    FailAt,
    RoundTrip,
    blocks_of,
    build_engine,
    check_round_trip,
    finish,
    round_trips,
    same,
)


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


# -- failures ------------------------------------------------------------------------------


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
