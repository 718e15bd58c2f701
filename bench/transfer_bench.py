"""Bandwidth of the transfer engine next to a plain ``copy_`` of the same bytes, in one run.

Cases: 2 MiB cross-layer blocks (one ``[N, 2 MiB]`` tensor), 64 KiB per-layer blocks
(8 tensors ``[N, 64 KiB]``; a device block is 8 segments) and the same 64 KiB layers as
per-layer views of one ``[N, 8, 64 KiB]`` tensor (layer-views: the engine merges a block's
adjacent segments into one run), on CUDA also 4, 16 and 256 KiB per-layer blocks (the
engine's default on CUDA sends runs under 256 KiB through one staging buffer); stores and
loads; batches of 1, 8, 64 and 512 device blocks per job; random or contiguous block
ids, on both sides. Each sample submits enough jobs to move ~16 MiB (one job when it is
bigger) and waits for them. The engine's and the baseline's samples
alternate (which goes first alternates too) and each figure is the median of its 16
samples: on the shared 2-core machine a neighbour's burst can cut a copy from 20 to 3 GB/s
for a few milliseconds, and the median of interleaved samples ignores such bursts on
both sides alike. Read each row's ratio rather than its absolute figures.
Every sample reads and writes other blocks than the one before (the ids and the baseline's
offsets rotate through buffers of 256 MiB and more), so neither side runs from the cache.

The baseline is one ``copy_`` of the same number of bytes between a contiguous region of
the device tensors and the pool: ``memcpy`` on the CPU, ``cudaMemcpyAsync`` from or to the
pinned pool on CUDA.

``python bench/transfer_bench.py`` prints a table and writes bench/results/transfer.json;
``--json`` prints the JSON instead; ``--quick`` is a smoke run of a few seconds;
``--copier tensor`` measures with one ``copy_`` per run (on CUDA: the path without the
staging buffer), ``--copier gather`` always through the staging buffer;
``--overlap`` (CUDA) times a matmul loop alone and while stores run, of 2 MiB blocks and of
4 KiB per-layer blocks (written to bench/results/overlap.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from kvoffload.transfer import CpuBlockPool, KVLayout, TransferEngine
from kvoffload.transfer.engine import CopierName
from kvoffload.transfer.runs import IdArray

RESULTS = Path(__file__).resolve().parent / "results"
KiB, MiB = 1 << 10, 1 << 20
BATCHES = (1, 8, 64, 512)
SAMPLE_BYTES = 16 * MiB
TARGETS = {  # (device kind, block bytes at least) -> fraction of the baseline to reach
    ("cpu", 2 * MiB): 0.90,
    ("cpu", 64 * KiB): 0.80,
    ("cuda", 4 * KiB): 0.50,
    ("cuda", 256 * KiB): 0.80,
}

Direction = Literal["store", "load"]
IdsKind = Literal["random", "contiguous"]
DIRECTIONS: tuple[Direction, ...] = ("store", "load")
IDS: tuple[IdsKind, ...] = ("random", "contiguous")


@dataclass(frozen=True)
class Case:
    name: str
    block_bytes: int  # bytes of one segment of one block
    layers: int  # segments per device block


@dataclass(frozen=True)
class Result:
    layout: str
    direction: Direction
    block_bytes: int
    batch: int
    ids: IdsKind
    gbps: float
    memcpy_gbps: float


def target(device: str, block_bytes: int, ids: IdsKind) -> float | None:
    """The issue's target for this row, if it sets one (CPU 64 KiB: random ids only)."""
    if device == "cpu" and block_bytes == 64 * KiB and ids != "random":
        return None
    met = [f for (kind, size), f in TARGETS.items() if kind == device and block_bytes >= size]
    return max(met) if met else None


class Bench:
    """One case: its device tensors, pool and engine, and the measurements on them."""

    def __init__(
        self,
        case: Case,
        num_blocks: int,
        device: str,
        reps: int,
        copier: CopierName | None = None,
    ) -> None:
        self.case, self.num_blocks, self.device, self.reps = case, num_blocks, device, reps
        views = case.name == "layer-views"
        shape = (num_blocks, case.layers) if views else (case.layers, num_blocks)
        cache = torch.empty(*shape, case.block_bytes, dtype=torch.uint8)
        self.cache = cache.to(device).fill_(1)  # one buffer, so the baseline has a region
        layout = KVLayout(list(self.cache.unbind(1 if views else 0)))
        pool = CpuBlockPool(layout.bytes_per_block, num_blocks, pin=device == "cuda", prefault=True)
        self.engine = TransferEngine(layout, pool, copier=copier)
        self.device_flat = self.cache.view(-1)
        self.rng = np.random.default_rng(0)

    def close(self) -> None:
        self.engine.close()

    def measure(self, direction: Direction, batch: int, ids: IdsKind) -> Result:
        nbytes = batch * self.case.layers * self.case.block_bytes
        jobs = max(1, SAMPLE_BYTES // nbytes)
        id_sets = self._id_sets(batch, ids, jobs * self.reps)
        engine_seconds: list[float] = []
        copy_seconds: list[float] = []
        for rep in range(self.reps):
            sample = id_sets[rep * jobs : (rep + 1) * jobs]
            offsets = [(rep * jobs + j) * nbytes for j in range(jobs)]
            engine = partial(self._submit, direction, sample)
            copy = partial(self._copy, direction, offsets, nbytes)
            if rep % 2:
                engine_seconds.append(self._time(engine))
                copy_seconds.append(self._time(copy))
            else:
                copy_seconds.append(self._time(copy))
                engine_seconds.append(self._time(engine))
        moved = jobs * nbytes / 1e9
        return Result(
            self.case.name,
            direction,
            self.case.block_bytes,
            batch,
            ids,
            moved / statistics.median(engine_seconds),
            moved / statistics.median(copy_seconds),
        )

    def _id_sets(self, batch: int, ids: IdsKind, count: int) -> list[tuple[IdArray, IdArray]]:
        n = self.num_blocks
        if ids == "random":
            return [
                (self.rng.permutation(n)[:batch], self.rng.permutation(n)[:batch])
                for _ in range(count)
            ]
        starts = [(i * batch) % (n - batch + 1) for i in range(count)]
        return [(np.arange(s, s + batch), np.arange(s, s + batch)) for s in starts]

    def _submit(self, direction: Direction, id_sets: list[tuple[IdArray, IdArray]]) -> None:
        engine = self.engine
        for device_ids, cpu_ids in id_sets:
            if direction == "store":
                engine.submit_store(device_ids, cpu_ids)
            else:
                engine.submit_load(cpu_ids, device_ids)
        engine.wait()
        assert all(result.ok for result in engine.poll())

    def _copy(self, direction: Direction, offsets: list[int], nbytes: int) -> None:
        total = self.device_flat.numel()
        device, pool = self.device_flat, self.engine.pool.flat
        for offset in offsets:
            # half a buffer away from the blocks the engine's contiguous ids just moved,
            # so that neither side reads what the other left in the cache
            at = (offset + total // 2) % (total - nbytes + 1) // 4096 * 4096
            if direction == "store":
                pool[at : at + nbytes].copy_(device[at : at + nbytes], non_blocking=True)
            else:
                device[at : at + nbytes].copy_(pool[at : at + nbytes], non_blocking=True)
        self._sync()

    def _time(self, work: Callable[[], None]) -> float:
        self._sync()
        start = time.perf_counter()
        work()
        return time.perf_counter() - start

    def _sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()


def cases(device: str) -> list[Case]:
    found = [
        Case("cross-layer", 2 * MiB, 1),
        Case("per-layer", 64 * KiB, 8),
        Case("layer-views", 64 * KiB, 8),
    ]
    if device == "cuda":
        found += [Case("per-layer", size * KiB, 8) for size in (4, 16, 256)]
    return found


def run(device: str, quick: bool, copier: CopierName | None) -> Iterator[Result]:
    batches = BATCHES[:3] if quick else BATCHES
    for case in cases(device):
        reps = 2 if quick else 16
        bench = Bench(case, max(batches), device, reps, copier)
        try:
            for direction in DIRECTIONS:
                for batch in batches:
                    for ids in IDS:
                        yield bench.measure(direction, batch, ids)
        finally:
            bench.close()


def overlap(quick: bool, case: Case) -> dict[str, float]:
    """A bf16 matmul loop alone, then while stores of ``case`` run on the store stream
    (random ids, so that small blocks take the staging path and its kernels).
    """
    size, loops = (2048, 20) if quick else (8192, 100)
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    bench = Bench(case, 512, "cuda", reps=1)
    blocks = np.random.default_rng(0).permutation(512)

    def matmuls() -> float:
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        for _ in range(loops):
            torch.mm(a, a)
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end))

    matmuls()  # warm-up
    alone = statistics.median(matmuls() for _ in range(3))
    stores_started = time.perf_counter()
    jobs = [bench.engine.submit_store(blocks, blocks) for _ in range(8)]
    during = matmuls()
    bench.engine.wait(jobs)
    stores_seconds = time.perf_counter() - stores_started
    results = bench.engine.poll()
    bench.close()
    moved = sum(r.nbytes for r in results)
    return {
        "matmul_ms_alone": alone,
        "matmul_ms_with_stores": during,
        "slowdown": during / alone - 1.0,
        "store_gbps": moved / stores_seconds / 1e9,
        "stores_ms": stores_seconds * 1e3,
    }


def table(results: list[Result], device: str) -> str:
    lines = [
        f"{'layout':11} {'direction':9} {'block':>8} {'batch':>5} {'ids':10} {'GB/s':>7} "
        f"{'copy_ GB/s':>10} {'ratio':>6} {'target':>6}",
    ]
    for r in results:
        goal = target(device, r.block_bytes, r.ids)
        verdict = (
            ""
            if goal is None
            else f"{goal:.0%} " + ("ok" if r.gbps >= goal * r.memcpy_gbps else "MISS")
        )
        lines.append(
            f"{r.layout:11} {r.direction:9} {r.block_bytes // KiB:>5}KiB {r.batch:>5} {r.ids:10} "
            f"{r.gbps:7.2f} {r.memcpy_gbps:10.2f} {r.gbps / r.memcpy_gbps:6.0%} {verdict}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--json", action="store_true", help="print the JSON instead")
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None)
    parser.add_argument("--overlap", action="store_true", help="CUDA: matmul vs stores")
    parser.add_argument("--out", type=Path, default=None, help="where to write the JSON")
    parser.add_argument(
        "--copier",
        choices=("memmove", "tensor", "gather"),
        default=None,
        help="memmove (CPU default), copy_ per run, or the staging buffer for every job "
        "(CUDA default: the staging buffer below 256 KiB runs, copy_ per run above)",
    )
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    # The engine copies on one thread; so does the baseline. On a shared 2-core machine a
    # multi-threaded copy_ stalls on busy cores (0.13 GB/s for 2 MiB was measured so).
    torch.set_num_threads(1)
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    if args.overlap and device != "cuda":
        parser.error("--overlap needs CUDA")
    if args.overlap:
        measured = overlap(args.quick, Case("cross-layer", 2 * MiB, 1))
        small = overlap(args.quick, Case("per-layer", 4 * KiB, 8))
        report: dict[str, object] = {"overlap": measured, "overlap_4kib_per_layer": small}
        shown = "\n".join(
            f"{name:22} {value:10.3f} {small[name]:10.3f}" for name, value in measured.items()
        )
        shown = f"{'':22} {'2 MiB':>10} {'4 KiB x 8':>10}\n" + shown
    else:
        results = list(run(device, args.quick, args.copier))
        report = {"results": [asdict(r) for r in results]}
        shown = table(results, device)
    text = json.dumps(report, indent=2)
    if args.json:
        print(text)
        return 0
    out = args.out or RESULTS / ("overlap.json" if args.overlap else "transfer.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    print(shown)
    print(f"\nwritten to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
