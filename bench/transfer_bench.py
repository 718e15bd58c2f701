"""Bandwidth of the transfer engine next to a plain copy of the same bytes, in one run.

Layouts, on the same bytes: ``cross-layer`` (one ``[N, 2 MiB]`` tensor), ``per-layer`` (8
separately allocated tensors ``[N, block]``: a device block is 8 segments, the vLLM-like
layout) and ``layer-views`` (the same 8 layers as views of one ``[N, 8, block]`` tensor: the
engine merges a block's adjacent segments into one run). Stores and loads; batches of 1, 8,
64 and 512 device blocks per job (``--sizes``: 4 KiB to 2 MiB per-layer blocks at batch
64, the issue's table); random or contiguous block ids, on both sides.

The baseline is one copy of the same number of bytes between a contiguous region of the
device buffer and the pool. On the CPU it is measured two ways, ``copy_`` and one
``memmove`` (the function the engine copies with), and each row's ratio is against the
faster of the two: on our machines torch's ``copy_`` loop is 5-15% slower than glibc's
``memmove`` of the same bytes, which flattered the engine when ``copy_`` alone was the
baseline. On CUDA it is ``cudaMemcpyAsync`` (``copy_``) from or to the pinned pool.

Every contender of a row (the baselines, each layout's engine, and with ``--compare`` the
engines of another checkout) shares the row's buffers and pool and is sampled in the same
loop: the contenders alternate, in a new random order for each sample (a fixed rotation had
each follow nearly always the same one, whose copy flushed the caches it then paid for), and
each figure is the median of its 16 samples, so that a neighbour's burst on the shared
2-core machine hits all alike. Every sample moves other blocks than the one before (ids and
the baseline's offsets rotate through buffers of 256 MiB and more), so nothing runs from
the cache. Each sample submits enough jobs to move ~16 MiB (one job when it is bigger)
and waits for them. Read each row's ratio rather than its absolute figures. Each ratio is
given twice: by wall time (``ratio``) and by the measuring thread's CPU time (``cpu``,
``thread_time``): on the CPU the jobs run on the calling thread, so the two differ by the
time the neighbours took the core, which the CPU-time ratio leaves out. A target counts as
met when both reach it (on CUDA, where the host's CPU time says nothing about the copies,
when the wall-time one does).

``python bench/transfer_bench.py`` prints a table and writes bench/results/transfer.json;
``--json`` prints the JSON instead; ``--quick`` is a smoke run of a few seconds;
``--sizes`` measures the per-layer block sizes at batch 64 instead;
``--compare DIR`` also measures the engine of the checkout at DIR (its ``impl/``) on the
same buffers, in the same loop: before and after a change, side by side;
``--copier tensor`` measures with one ``copy_`` per run (on CUDA: the path without the
staging buffer), ``--copier gather`` always through the staging buffer;
``--overlap`` (CUDA) times a matmul loop alone and while stores run, of 2 MiB blocks and of
4 KiB per-layer blocks (written to bench/results/overlap.json).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import importlib.abc
import importlib.machinery
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import numpy as np
import torch

from kvoffload.transfer import CpuBlockPool, KVLayout, TransferEngine
from kvoffload.transfer.engine import CopierName
from kvoffload.transfer.runs import IdArray

RESULTS = Path(__file__).resolve().parent / "results"
KiB, MiB = 1 << 10, 1 << 20
BATCHES = (1, 8, 64, 512)
SIZES = (4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 2 * MiB)  # --sizes: per-layer blocks
SIZES_BATCH = 64
LAYERS = 8
SAMPLE_BYTES = 16 * MiB
BUFFER_BYTES = 256 * MiB  # at least, per buffer: 8x the last-level cache
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

# the baseline calls memmove as the engine's copier does (a prototype that returns nothing)
_memmove = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(
    ctypes.cast(ctypes.memmove, ctypes.c_void_p).value or 0
)


@dataclass(frozen=True)
class Case:
    block_bytes: int  # bytes of one segment of one block
    layers: int  # segments per device block
    layouts: tuple[str, ...]  # measured on the same buffers


@dataclass(frozen=True)
class Result:
    layout: str
    engine: str  # "this", or the --compare checkout's name
    direction: Direction
    block_bytes: int
    layers: int
    batch: int
    ids: IdsKind
    gbps: float
    cpu_gbps: float  # bytes per second of the measuring thread's CPU time
    memcpy_gbps: float  # the baseline: the faster of copy_ and memmove
    memcpy_cpu_gbps: float  # the same by CPU time
    copy_gbps: float
    memmove_gbps: float | None  # CPU only

    @property
    def ratio(self) -> float:
        return self.gbps / self.memcpy_gbps

    @property
    def cpu_ratio(self) -> float:
        return self.cpu_gbps / self.memcpy_cpu_gbps


def target(device: str, block_bytes: int, ids: IdsKind) -> float | None:
    """The issue's target for this row, if it sets one (CPU 64 KiB: random ids only)."""
    if device == "cpu" and block_bytes == 64 * KiB and ids != "random":
        return None
    met = [f for (kind, size), f in TARGETS.items() if kind == device and block_bytes >= size]
    return max(met) if met else None


@dataclass(frozen=True)
class Implementation:
    """The data path of one checkout: the classes a case builds its engines from."""

    name: str
    engine: Any
    layout: Any


THIS = Implementation("this", TransferEngine, KVLayout)


class _CheckoutFinder(importlib.abc.MetaPathFinder):
    """Resolves ``kvoffload`` and its submodules from another checkout's ``impl/``, ahead of
    the editable install's own finder."""

    def __init__(self, impl: Path) -> None:
        self.impl = impl

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != "kvoffload" and not fullname.startswith("kvoffload."):
            return None
        parent = fullname.rpartition(".")[0]
        where = self.impl / parent.replace(".", "/") if parent else self.impl
        return importlib.machinery.PathFinder.find_spec(fullname, [str(where)])


def load_checkout(root: Path) -> Implementation:
    """Another checkout's ``kvoffload.transfer``, imported beside this one's: its modules are
    loaded under the usual names, kept by the classes taken from them, then this checkout's
    modules are put back. (``kvoffload_spec`` stays this checkout's.)
    """
    ours = {n: m for n, m in sys.modules.items() if n.split(".")[0] == "kvoffload"}
    for name in ours:
        del sys.modules[name]
    finder = _CheckoutFinder(root.resolve() / "impl")
    sys.meta_path.insert(0, finder)
    try:
        module = importlib.import_module("kvoffload.transfer")
        loaded = Implementation(root.resolve().name, module.TransferEngine, module.KVLayout)
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n.split(".")[0] == "kvoffload"]:
            del sys.modules[name]
        sys.modules.update(ours)
    return loaded


class Bench:
    """One case: its device buffers and pool, an engine per (implementation, layout), and
    the measurements of all of them, side by side."""

    def __init__(
        self,
        case: Case,
        num_blocks: int,
        device: str,
        reps: int,
        implementations: Sequence[Implementation] = (THIS,),
        copier: CopierName | None = None,
    ) -> None:
        self.case, self.num_blocks, self.device, self.reps = case, num_blocks, device, reps
        n, layers, size = num_blocks, case.layers, case.block_bytes
        # the layer-views layout and the baseline's region: one buffer
        self.cache = torch.empty(n, layers, size, dtype=torch.uint8, device=device).fill_(1)
        tensors = {
            "cross-layer": lambda: [self.cache.view(n, layers * size)],
            "layer-views": lambda: list(self.cache.unbind(1)),
            # each layer its own allocation, as an engine that allocates per layer has them
            "per-layer": lambda: [
                torch.empty(n, size, dtype=torch.uint8, device=device).fill_(1)
                for _ in range(layers)
            ],
        }
        built = {name: tensors[name]() for name in case.layouts}
        self.pool = CpuBlockPool(layers * size, n, pin=device == "cuda", prefault=True)
        self.engines: dict[tuple[str, str], Any] = {}
        for impl in implementations:
            for name in case.layouts:
                layout = impl.layout(built[name])
                # the pool is shared: engines are closed by close(), the pool after them
                self.engines[impl.name, name] = impl.engine(layout, self.pool, copier=copier)
        self.device_flat = self.cache.view(-1)
        self.rng = np.random.default_rng(0)
        self.order_rng = np.random.default_rng(1)  # apart: the ids stay as they were

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()
        self.pool.close()

    def measure(self, direction: Direction, batch: int, ids: IdsKind) -> list[Result]:
        nbytes = batch * self.case.layers * self.case.block_bytes
        jobs = max(1, SAMPLE_BYTES // nbytes)
        baselines: dict[str, Callable[[Direction, list[int], int], None]] = {"copy_": self._copy}
        if self.device == "cpu":
            baselines["memmove"] = self._memmove
        names: list[str | tuple[str, str]] = [*baselines, *self.engines]
        # each contender's own ids and offsets, so that none reads what another just left
        id_sets = self._id_sets(batch, ids, jobs * self.reps * len(names))
        seconds: dict[str | tuple[str, str], list[tuple[float, float]]] = {n: [] for n in names}
        for rep in range(self.reps):
            # A new order for each sample: in a rotation each contender nearly always follows
            # the same one, and a job right after another's copy of other bytes pays for the
            # caches that copy flushed (a store after the memmove baseline measured 220-270
            # us more than after another store), which biased the rows it follows.
            order = self.order_rng.permutation(len(names))
            for slot, name in enumerate(names[int(index)] for index in order):
                first = (rep * len(names) + slot) * jobs
                if isinstance(name, str):
                    starts = self._starts([(first + j) * nbytes for j in range(jobs)], nbytes)
                    work = partial(baselines[name], direction, starts, nbytes)
                else:
                    sample = id_sets[first : first + jobs]
                    work = partial(self._submit, self.engines[name], direction, sample)
                seconds[name].append(self._time(work))
        moved = jobs * nbytes / 1e9

        def gbps(name: str | tuple[str, str], clock: int = 0) -> float:
            return moved / statistics.median(s[clock] for s in seconds[name])

        copy_gbps = gbps("copy_")
        memmove_gbps = gbps("memmove") if "memmove" in baselines else None
        best = max(copy_gbps, memmove_gbps or 0.0)
        best_cpu = max(gbps(name, 1) for name in baselines)
        return [
            Result(
                layout,
                impl,
                direction,
                self.case.block_bytes,
                self.case.layers,
                batch,
                ids,
                gbps((impl, layout)),
                gbps((impl, layout), 1),
                best,
                best_cpu,
                copy_gbps,
                memmove_gbps,
            )
            for impl, layout in self.engines
        ]

    def _id_sets(self, batch: int, ids: IdsKind, count: int) -> list[tuple[IdArray, IdArray]]:
        n = self.num_blocks
        if ids == "random":
            return [
                (self.rng.permutation(n)[:batch], self.rng.permutation(n)[:batch])
                for _ in range(count)
            ]
        starts = [(i * batch) % (n - batch + 1) for i in range(count)]
        return [(np.arange(s, s + batch), np.arange(s, s + batch)) for s in starts]

    @staticmethod
    def _submit(engine: Any, direction: Direction, id_sets: list[tuple[IdArray, IdArray]]) -> None:
        for device_ids, cpu_ids in id_sets:
            if direction == "store":
                engine.submit_store(device_ids, cpu_ids)
            else:
                engine.submit_load(cpu_ids, device_ids)
        engine.wait()
        assert all(result.ok for result in engine.poll())

    def _starts(self, offsets: list[int], nbytes: int) -> list[int]:
        total = self.device_flat.numel()
        # half a buffer away from the blocks the engines' contiguous ids just moved, so
        # that neither side reads what another left in the cache
        return [(offset + total // 2) % (total - nbytes + 1) // 4096 * 4096 for offset in offsets]

    def _copy(self, direction: Direction, starts: list[int], nbytes: int) -> None:
        device, pool = self.device_flat, self.pool.flat
        for at in starts:
            if direction == "store":
                pool[at : at + nbytes].copy_(device[at : at + nbytes], non_blocking=True)
            else:
                device[at : at + nbytes].copy_(pool[at : at + nbytes], non_blocking=True)
        self._sync()

    def _memmove(self, direction: Direction, starts: list[int], nbytes: int) -> None:
        device, pool = self.device_flat.data_ptr(), self.pool.flat.data_ptr()
        for at in starts:
            if direction == "store":
                _memmove(pool + at, device + at, nbytes)
            else:
                _memmove(device + at, pool + at, nbytes)

    def _time(self, work: Callable[[], None]) -> tuple[float, float]:
        self._sync()
        start, cpu = time.perf_counter(), time.thread_time()
        work()
        return time.perf_counter() - start, time.thread_time() - cpu

    def _sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()


def cases(device: str) -> list[Case]:
    found = [
        Case(2 * MiB, 1, ("cross-layer",)),
        Case(64 * KiB, LAYERS, ("per-layer", "layer-views")),
    ]
    if device == "cuda":
        found += [Case(size * KiB, LAYERS, ("per-layer",)) for size in (4, 16, 256)]
    return found


def blocks_for(case: Case, batch: int) -> int:
    """Enough blocks for random ids and for buffers of ``BUFFER_BYTES`` or more."""
    return max(batch + batch // 8, -(-BUFFER_BYTES // (case.layers * case.block_bytes)))


def run(
    device: str,
    quick: bool,
    copier: CopierName | None,
    implementations: Sequence[Implementation],
    sizes: bool,
) -> Iterator[Result]:
    reps = 2 if quick else 16
    plan: list[tuple[Case, tuple[int, ...], tuple[IdsKind, ...]]]
    if sizes:
        plan = [
            (Case(size, LAYERS, ("per-layer", "layer-views")), (SIZES_BATCH,), ("random",))
            for size in (SIZES[1:3] if quick else SIZES)
        ]
    else:
        plan = [(case, BATCHES[:3] if quick else BATCHES, IDS) for case in cases(device)]
    for case, batches, kinds in plan:
        bench = Bench(case, blocks_for(case, max(batches)), device, reps, implementations, copier)
        try:
            for direction in DIRECTIONS:
                for batch in batches:
                    for ids in kinds:
                        yield from bench.measure(direction, batch, ids)
        finally:
            bench.close()


def overlap(quick: bool, case: Case) -> dict[str, float]:
    """A bf16 matmul loop alone, then while stores of ``case`` run on the store stream
    (random ids, so that small blocks take the staging path and its kernels).
    """
    size, loops = (2048, 20) if quick else (8192, 100)
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    bench = Bench(case, 512, "cuda", reps=1)
    engine = bench.engines[THIS.name, case.layouts[0]]
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
    jobs = [engine.submit_store(blocks, blocks) for _ in range(8)]
    during = matmuls()
    engine.wait(jobs)
    stores_seconds = time.perf_counter() - stores_started
    results = engine.poll()
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
        f"{'layout':11} {'engine':8} {'direction':9} {'block':>8} {'batch':>5} {'ids':10} "
        f"{'GB/s':>6} {'copy_':>6} {'memmove':>7} {'ratio':>6} {'cpu':>5} {'target':>7}",
    ]
    for r in results:
        goal = target(device, r.block_bytes, r.ids)
        # on CUDA the host's CPU time says nothing about the copies: wall time only
        shown = r.ratio if device == "cuda" else min(r.ratio, r.cpu_ratio)
        met = goal is not None and shown >= goal
        verdict = "" if goal is None else f"{goal:.0%} " + ("ok" if met else "MISS")
        memmove = "-" if r.memmove_gbps is None else f"{r.memmove_gbps:.2f}"
        block = (
            f"{r.block_bytes // KiB}KiB" if r.block_bytes < MiB else f"{r.block_bytes // MiB}MiB"
        )
        lines.append(
            f"{r.layout:11} {r.engine[:8]:8} {r.direction:9} {block:>8} {r.batch:>5} {r.ids:10} "
            f"{r.gbps:6.2f} {r.copy_gbps:6.2f} {memmove:>7} {r.ratio:6.0%} {r.cpu_ratio:5.0%} "
            f"{verdict:>7}"
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
        "--sizes", action="store_true", help="per-layer blocks of 4 KiB to 2 MiB, batch 64"
    )
    parser.add_argument(
        "--compare",
        type=Path,
        action="append",
        default=[],
        metavar="DIR",
        help="also measure the engine of the checkout at DIR, side by side (repeatable)",
    )
    parser.add_argument(
        "--copier",
        choices=("memmove", "rows", "span", "tensor", "gather"),
        default=None,
        help="memmove per run, numpy rows, copy_ per run, or the staging buffer for every "
        "job (CPU default: rows below 8 KiB runs, memmove above; CUDA default: the staging "
        "buffer below 256 KiB runs, copy_ per run above)",
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
    for root in args.compare:
        if not (root / "impl" / "kvoffload" / "transfer").is_dir():
            parser.error(f"--compare {root}: no impl/kvoffload/transfer there")
    if args.overlap:
        measured = overlap(args.quick, Case(2 * MiB, 1, ("cross-layer",)))
        small = overlap(args.quick, Case(4 * KiB, LAYERS, ("per-layer",)))
        report: dict[str, object] = {"overlap": measured, "overlap_4kib_per_layer": small}
        shown = "\n".join(
            f"{name:22} {value:10.3f} {small[name]:10.3f}" for name, value in measured.items()
        )
        shown = f"{'':22} {'2 MiB':>10} {'4 KiB x 8':>10}\n" + shown
    else:
        implementations = [THIS, *(load_checkout(root) for root in args.compare)]
        results = list(run(device, args.quick, args.copier, implementations, args.sizes))
        report = {"results": [asdict(r) for r in results]}
        shown = table(results, device)
    text = json.dumps(report, indent=2)
    if args.json:
        print(text)
        return 0
    name = "overlap" if args.overlap else "transfer_sizes" if args.sizes else "transfer"
    out = args.out or RESULTS / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    print(shown)
    print(f"\nwritten to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
