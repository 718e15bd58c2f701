"""Benchmark of ``OffloadManager``: the costs that must not grow with the pool.

Four measurements, printed as tables and written as JSON (docs/performance.md, "Manager"):

1. ``fast_fail``: ``prepare_store`` of one new key into a full pool whose every block is
   pinned, at 1k to 1M blocks, against the naive manager of ``naive_manager.py`` (no
   evictable counter, a victim search that walks every block: vLLM before PR #45757).
2. ``one_victim``: ``prepare_store`` + ``complete_store`` of one new key into a full pool,
   evicting one block, with 0%, 50% or 99% of the blocks pinned, LRU and ARC: median,
   99th percentile and maximum per call, wall-clock and thread CPU time.
3. ``memory``: bookkeeping bytes per resident block at the largest size (tracemalloc; the
   keys belong to the caller and are not counted).
4. ``replay``: the bundled Mooncake conversation trace through the manager with the
   engine's call sequence: manager calls per second.

Each pool is built, collected once and frozen (``gc.freeze()``, as a server does after
start-up): collections in the measured loops do not rescan the setup; the collector stays on.
A few minutes on 2 cores; ``--quick``: a smoke run of seconds; ``--json``: the JSON.

``--long`` runs the stall test instead: 2.5M one-victim calls into 1M blocks, 99% pinned,
for each policy, every call timed in wall-clock and thread CPU time: median, p99.99, max,
each call's cause (collection, a big dict's rebuild, or steady), bytes per block; ~10 min.
How calls are timed: ``manager_timing.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import sys
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy

from kvoffload.manager import OffloadManager
from kvoffload.replay.traces import Trace, bundled_trace
from kvoffload_spec.surface import Key, Lookup
from manager_timing import (
    CallTimer,
    fill,
    frozen_heap,
    pin,
    seconds_per_call,
    watched_dicts,
)
from naive_manager import naive_manager

RESULTS = Path(__file__).resolve().parent / "results"
POLICIES = ("lru", "arc")
PINNED_FRACTIONS = (0.0, 0.5, 0.99)

TARGET_FAST_FAIL_GROWTH = 1.5  # time at the largest size / time at the smallest
TARGET_NAIVE_SPEEDUP = 100.0  # naive / manager, at the largest size
TARGET_US = 100.0  # the most one call may take
TARGET_BYTES_PER_BLOCK = 200.0
TARGET_LONG_CPU_MAX_US = 1_000.0  # --long: the most CPU time one call may take
TARGET_LONG_CPU_P9999_US = 150.0


@dataclass(frozen=True)
class Sizes:
    fast_fail: tuple[int, ...]
    one_victim: tuple[int, ...]
    memory: int
    replay_capacities: tuple[int, ...]
    replay_requests: int | None  # None: the whole trace
    calls: int  # measured one-victim calls per configuration
    long_calls: int  # one-victim calls of the long runs
    rounds: int  # identical runs of each one-victim configuration
    warmup: int
    long_pinned: float = 0.0  # of the long runs
    long_rounds: int = 2


FULL = Sizes(
    fast_fail=(1_000, 10_000, 100_000, 1_000_000),
    one_victim=(10_000, 100_000, 400_000, 1_000_000),
    memory=1_000_000,
    replay_capacities=(16_384, 65_536),
    replay_requests=None,
    calls=10_000,
    long_calls=2_000_000,
    rounds=3,
    warmup=1_000,
)
LONG = Sizes(
    fast_fail=(),
    one_victim=(1_000_000,),
    memory=1_000_000,
    replay_capacities=(),
    replay_requests=None,
    calls=0,
    long_calls=2_500_000,
    rounds=1,
    warmup=1_000,
    long_pinned=0.99,
    long_rounds=2,
)
LONG_QUICK = dataclasses.replace(LONG, one_victim=(10_000,), memory=10_000, long_calls=20_000)
QUICK = Sizes(
    fast_fail=(1_000, 10_000),
    one_victim=(1_000, 10_000),
    memory=10_000,
    replay_capacities=(1_024,),
    replay_requests=300,
    calls=300,
    long_calls=30_000,
    rounds=2,
    warmup=30,
)


@dataclass(frozen=True)
class FastFailRow:
    blocks: int
    manager_us: float
    naive_us: float
    speedup: float


@dataclass(frozen=True)
class FastFail:
    rows: list[FastFailRow]
    growth: float
    speedup_at_largest: float
    growth_met: bool
    speedup_met: bool


@dataclass(frozen=True)
class OneVictimRow:
    """Latencies of one configuration, in microseconds.

    The same calls are made on identically built pools ``rounds`` times; a call's latency
    is its fastest round. The work of call i is the same in every round (even collections
    and dict rebuilds come at the same calls), but a neighbour's interruption rarely hits
    the same call twice: this separates what the manager costs from what the shared machine
    adds. ``raw_max_us`` is the slowest single observation, interruptions included.

    A call is *steady* when no garbage collection and no dict rebuild happened during it.
    The ``cpu_`` figures are the same calls in thread CPU time (``time.thread_time_ns``):
    what the call itself computed, without the time the machine gave to others.
    """

    blocks: int
    policy: str
    pinned: float
    calls: int
    rounds: int
    median_us: float
    p99_us: float
    p999_us: float
    max_us: float
    max_cause: str  # of the slowest call: "collection", "dict rebuild" or "steady"
    steady_max_us: float
    raw_max_us: float
    slow_calls: dict[str, int]  # calls over the target, by cause
    collections: int  # calls during which the collector ran
    dict_rebuilds: int  # calls during which a dict of the manager or its policy was rebuilt
    p9999_us: float
    cpu_median_us: float
    cpu_p9999_us: float
    cpu_max_us: float
    cpu_max_cause: str
    cpu_raw_p9999_us: float  # over every single observation, interruptions included
    cpu_raw_max_us: float


@dataclass(frozen=True)
class OneVictim:
    """``rows`` are the configurations (3 rounds each); ``long_runs`` last long enough for
    the largest dicts to rebuild, in 2 rounds, too few to screen out the neighbours on
    millions of calls: their steady maximum is not held to the target.
    """

    rows: list[OneVictimRow]
    long_runs: list[OneVictimRow]
    worst_max_us: float  # over rows and long runs
    worst_steady_max_us: float  # over rows
    max_met: bool
    steady_max_met: bool


@dataclass(frozen=True)
class MemoryRow:
    blocks: int
    policy: str
    bytes_per_block: float


@dataclass(frozen=True)
class Memory:
    rows: list[MemoryRow]
    met: bool


@dataclass(frozen=True)
class ReplayRow:
    blocks: int
    policy: str
    requests: int
    calls: int
    seconds: float
    calls_per_s: float
    requests_per_s: float
    hit_ratio: float
    evictions: int


@dataclass(frozen=True)
class Replay:
    trace: str
    rows: list[ReplayRow]


@dataclass(frozen=True)
class Machine:
    python: str
    implementation: str
    platform: str
    cpus: int | None

    @staticmethod
    def this() -> Machine:
        return Machine(
            platform.python_version(),
            platform.python_implementation(),
            platform.platform(),
            os.cpu_count(),
        )


@dataclass(frozen=True)
class Result:
    quick: bool
    machine: Machine
    command: str
    fast_fail: FastFail
    one_victim: OneVictim
    memory: Memory
    replay: Replay

    def to_json(self) -> dict[str, object]:
        return {"benchmark": "manager", **dataclasses.asdict(self)}


# -- 1. fast fail --------------------------------------------------------------------------


def fully_pinned(manager: OffloadManager) -> OffloadManager:
    keys = range(manager.num_blocks)
    fill(manager, keys)
    pin(manager, keys)
    if manager.num_evictable_blocks or manager.num_free_blocks:
        raise RuntimeError(f"{manager!r} is not full of pinned blocks")
    return manager


def time_refused_store(manager: OffloadManager, calls: int) -> float:
    new_key = [manager.num_blocks]  # absent: it needs a victim, and none is evictable
    if manager.prepare_store(new_key) is not None:
        raise RuntimeError(f"{type(manager).__name__} stored into a pool with no room")
    with frozen_heap():
        return seconds_per_call(lambda: manager.prepare_store(new_key), calls)


def bench_fast_fail(sizes: Sequence[int]) -> FastFail:
    rows: list[FastFailRow] = []
    for n in sizes:
        fast = time_refused_store(fully_pinned(OffloadManager(n, "lru")), calls=2_000)
        naive_calls = max(2, 20_000 // n)
        naive = time_refused_store(fully_pinned(naive_manager(n)), calls=naive_calls)
        rows.append(FastFailRow(n, fast * 1e6, naive * 1e6, naive / fast))
    growth = rows[-1].manager_us / rows[0].manager_us
    speedup = rows[-1].speedup
    return FastFail(
        rows,
        growth,
        speedup,
        growth_met=growth <= TARGET_FAST_FAIL_GROWTH,
        speedup_met=speedup >= TARGET_NAIVE_SPEEDUP,
    )


# -- 2. one victim -------------------------------------------------------------------------


def time_one_victim(n: int, policy: str, pinned: float, calls: int, warmup: int) -> CallTimer:
    """One round: build the pool, then store one new key at a time, each evicting one."""
    manager = OffloadManager(n, policy)
    fill(manager, range(n))
    pin(manager, range(int(n * pinned)))  # the least recent blocks: a walk meets them first
    next_key = n

    def store_one() -> None:
        nonlocal next_key
        plan = manager.prepare_store([next_key])
        if plan is None or len(plan.evicted_keys) != 1:
            raise RuntimeError(f"one new key into {manager!r} did not evict exactly one")
        manager.complete_store(plan)
        next_key += 1

    timer = CallTimer(watched_dicts(manager), calls)
    with frozen_heap():
        for _ in range(warmup):
            store_one()
        timer.run(store_one)
    return timer


def one_victim_row(
    n: int, policy: str, pinned: float, calls: int, warmup: int, rounds: int
) -> OneVictimRow:
    timers = [time_one_victim(n, policy, pinned, calls, warmup) for _ in range(rounds)]
    rounds_us = [numpy.frombuffer(timer.wall_ns, dtype=numpy.int64) / 1e3 for timer in timers]
    wall = numpy.minimum.reduce(rounds_us)
    cpu_rounds = [numpy.frombuffer(timer.cpu_ns, dtype=numpy.int64) / 1e3 for timer in timers]
    cpu = numpy.minimum.reduce(cpu_rounds)
    cpu_observed = numpy.concatenate(cpu_rounds)
    causes: dict[int, str] = {}
    for timer in timers:
        causes.update(timer.causes)
    steady = numpy.ones(calls, dtype=bool)
    steady[list(causes)] = False
    slowest = int(wall.argmax())
    cpu_slowest = int(cpu.argmax())
    slow = [causes.get(int(i), "steady") for i in numpy.flatnonzero(wall > TARGET_US)]
    return OneVictimRow(
        blocks=n,
        policy=policy,
        pinned=pinned,
        calls=calls,
        rounds=rounds,
        median_us=float(numpy.median(wall)),
        p99_us=float(numpy.percentile(wall, 99)),
        p999_us=float(numpy.percentile(wall, 99.9)),
        max_us=float(wall[slowest]),
        max_cause=causes.get(slowest, "steady"),
        steady_max_us=float(wall[steady].max()),
        raw_max_us=float(max(observed.max() for observed in rounds_us)),
        slow_calls={cause: slow.count(cause) for cause in sorted(set(slow))},
        collections=list(causes.values()).count("collection"),
        dict_rebuilds=list(causes.values()).count("dict rebuild"),
        p9999_us=float(numpy.percentile(wall, 99.99)),
        cpu_median_us=float(numpy.median(cpu)),
        cpu_p9999_us=float(numpy.percentile(cpu, 99.99)),
        cpu_max_us=float(cpu[cpu_slowest]),
        cpu_max_cause=causes.get(cpu_slowest, "steady"),
        cpu_raw_p9999_us=float(numpy.percentile(cpu_observed, 99.99)),
        cpu_raw_max_us=float(cpu_observed.max()),
    )


def bench_one_victim(sizes: Sizes) -> OneVictim:
    rows = [
        one_victim_row(n, policy, pinned, sizes.calls, sizes.warmup, sizes.rounds)
        for n in sizes.one_victim
        for policy in POLICIES
        for pinned in PINNED_FRACTIONS
    ]
    long_runs = long_one_victim(sizes)
    worst = max(row.max_us for row in rows + long_runs)
    worst_steady = max(row.steady_max_us for row in rows)
    return OneVictim(
        rows,
        long_runs,
        worst,
        worst_steady,
        max_met=worst <= TARGET_US,
        steady_max_met=worst_steady <= TARGET_US,
    )


def long_one_victim(sizes: Sizes) -> list[OneVictimRow]:
    n, calls, rounds = sizes.one_victim[-1], sizes.long_calls, sizes.long_rounds
    return [
        one_victim_row(n, policy, sizes.long_pinned, calls, sizes.warmup, rounds)
        for policy in POLICIES
    ]


@dataclass(frozen=True)
class LongResult:
    """``--long``: the stall test. Targets on CPU time, for every policy: the slowest call
    <= 1 ms and the 99.99th percentile <= 150 us; memory < 200 bytes per resident block.
    """

    quick: bool
    machine: Machine
    command: str
    long_runs: list[OneVictimRow]
    memory: Memory
    cpu_max_met: bool
    cpu_p9999_met: bool

    def to_json(self) -> dict[str, object]:
        return {"benchmark": "manager-long", **dataclasses.asdict(self)}


def run_long(sizes: Sizes, *, quick: bool, command: str, log: Callable[[str], None]) -> LongResult:
    log(
        f"1/2 {sizes.long_calls:,} one-victim calls per policy at {sizes.one_victim[-1]:,} "
        "blocks ..."
    )
    rows = long_one_victim(sizes)
    log("2/2 memory per resident block ...")
    memory = bench_memory(sizes.memory)
    return LongResult(
        quick,
        Machine.this(),
        command,
        rows,
        memory,
        cpu_max_met=all(row.cpu_max_us <= TARGET_LONG_CPU_MAX_US for row in rows),
        cpu_p9999_met=all(row.cpu_p9999_us <= TARGET_LONG_CPU_P9999_US for row in rows),
    )


# -- 3. memory -----------------------------------------------------------------------------


def bytes_per_block(n: int, policy: str) -> float:
    keys = list(range(10**9, 10**9 + n))  # the caller's keys, allocated before tracing
    gc.collect()
    tracemalloc.start()
    try:
        baseline = tracemalloc.get_traced_memory()[0]
        manager = OffloadManager(n, policy)
        fill(manager, keys)
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - baseline
    finally:
        tracemalloc.stop()
    if manager.stats().resident != n:
        raise RuntimeError(f"{manager!r} should hold {n} blocks")
    return used / n


def bench_memory(n: int) -> Memory:
    rows = [MemoryRow(n, policy, bytes_per_block(n, policy)) for policy in POLICIES]
    return Memory(rows, met=all(row.bytes_per_block < TARGET_BYTES_PER_BLOCK for row in rows))


# -- 4. replay -----------------------------------------------------------------------------


def conversation_trace() -> Trace:
    return bundled_trace("conversation")


def replay(manager: OffloadManager, requests: Sequence[Sequence[Key]]) -> tuple[int, int]:
    """The engine's calls per request (the order of ``kvoffload.replay.sweep``): look the prefix
    up, load the hits, store the rest, touch the request, complete the store. Returns the
    number of manager calls and of prefix hits.
    """
    calls = hits = 0
    for request in requests:
        found = 0
        for key in request:
            calls += 1
            if manager.lookup(key) is not Lookup.HIT:
                break
            found += 1
        hits += found
        if found:
            manager.complete_load(manager.prepare_load(request[:found]))
            calls += 2
        plan = manager.prepare_store(request[found:])
        manager.touch(request)
        calls += 2
        if plan is not None:
            manager.complete_store(plan)
            calls += 1
    return calls, hits


def bench_replay(capacities: Sequence[int], limit: int | None, rounds: int) -> Replay:
    """Each configuration replayed ``rounds`` times on a fresh manager; the fastest counts."""
    trace = conversation_trace()
    requests = trace.requests[:limit]
    refs = sum(len(request) for request in requests)
    rows: list[ReplayRow] = []
    for capacity in capacities:
        for policy in POLICIES:
            elapsed = float("inf")
            for _ in range(rounds):
                manager = OffloadManager(capacity, policy)
                gc.collect()
                started = time.perf_counter()
                calls, hits = replay(manager, requests)
                elapsed = min(elapsed, time.perf_counter() - started)
            rows.append(
                ReplayRow(
                    blocks=capacity,
                    policy=policy,
                    requests=len(requests),
                    calls=calls,
                    seconds=elapsed,
                    calls_per_s=calls / elapsed,
                    requests_per_s=len(requests) / elapsed,
                    hit_ratio=hits / refs,
                    evictions=manager.stats().evictions,
                )
            )
    return Replay(trace.name, rows)


# -- output --------------------------------------------------------------------------------


def run(sizes: Sizes, *, quick: bool, command: str, log: Callable[[str], None]) -> Result:
    log("1/4 refused prepare_store, manager and naive ...")
    fast_fail = bench_fast_fail(sizes.fast_fail)
    log("2/4 one-victim prepare_store + complete_store ...")
    one_victim = bench_one_victim(sizes)
    log("3/4 memory per resident block ...")
    memory = bench_memory(sizes.memory)
    log("4/4 trace replay ...")
    replayed = bench_replay(sizes.replay_capacities, sizes.replay_requests, sizes.rounds)
    return Result(quick, Machine.this(), command, fast_fail, one_victim, memory, replayed)


def table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    cells = [list(header), *[list(row) for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = [
        "  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True))
        for row in cells
    ]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join([title, *lines])


def verdict(met: bool) -> str:
    return "met" if met else "MISSED"


def render_fast_fail(ff: FastFail) -> str:
    rows = [
        [f"{r.blocks:,}", f"{r.manager_us:.2f}", f"{r.naive_us:,.1f}", f"{r.speedup:,.0f}x"]
        for r in ff.rows
    ]
    return (
        table(
            "1. prepare_store refused: full pool, every block pinned (us per call)",
            ["blocks", "manager", "naive", "speedup"],
            rows,
        )
        + f"\ngrowth {ff.growth:.2f}x (target <= {TARGET_FAST_FAIL_GROWTH}: "
        f"{verdict(ff.growth_met)}); {ff.speedup_at_largest:,.0f}x the naive manager at the "
        f"largest size (target >= {TARGET_NAIVE_SPEEDUP:.0f}x: {verdict(ff.speedup_met)})"
    )


def render_one_victim(ov: OneVictim) -> str:
    header = ["blocks", "policy", "pinned", "calls", "median", "p99", "p99.9", "max", "cause"]
    header += ["steady max", "raw max", "gc calls", "rebuild calls"]
    rows = [
        [
            f"{r.blocks:,}",
            r.policy,
            f"{r.pinned:.0%}",
            f"{r.calls:,}",
            f"{r.median_us:.1f}",
            f"{r.p99_us:.1f}",
            f"{r.p999_us:.1f}",
            f"{r.max_us:,.0f}",
            r.max_cause,
            f"{r.steady_max_us:,.0f}",
            f"{r.raw_max_us:,.0f}",
            str(r.collections),
            str(r.dict_rebuilds),
        ]
        for r in ov.rows + ov.long_runs
    ]
    title = "2. prepare_store + complete_store evicting one block (us per call, fastest round)"
    return (
        table(title, header, rows)
        + f"\nworst max {ov.worst_max_us:,.0f} us ({verdict(ov.max_met)}); worst steady max "
        f"{ov.worst_steady_max_us:,.0f} us, long runs aside ({verdict(ov.steady_max_met)}); "
        f"target <= {TARGET_US:.0f} us. Steady: no collection and no dict rebuild during "
        "the call."
    )


def render_memory(mem: Memory) -> str:
    rows = [[f"{r.blocks:,}", r.policy, f"{r.bytes_per_block:.0f}"] for r in mem.rows]
    return (
        table(
            "3. bookkeeping per resident block (tracemalloc)", ["blocks", "policy", "bytes"], rows
        )
        + f"\ntarget < {TARGET_BYTES_PER_BLOCK:.0f} bytes: {verdict(mem.met)}"
    )


def render_replay(rp: Replay) -> str:
    rows = [
        [
            f"{r.blocks:,}",
            r.policy,
            f"{r.requests:,}",
            f"{r.calls:,}",
            f"{r.calls_per_s:,.0f}",
            f"{r.requests_per_s:,.0f}",
            f"{r.hit_ratio:.3f}",
        ]
        for r in rp.rows
    ]
    header = ["blocks", "policy", "requests", "calls", "calls/s", "requests/s", "hit ratio"]
    return table(f"4. replay of the {rp.trace} trace (fastest round)", header, rows)


def render_long(result: LongResult) -> str:
    header = ["blocks", "policy", "pinned", "calls", "clock", "median", "p99.99", "max"]
    header += ["cause of max", "raw p99.99", "raw max", "gc calls", "rebuild calls"]
    rows: list[list[str]] = []
    for r in result.long_runs:
        for clock, figures, cause, raw in (
            ("wall", (r.median_us, r.p9999_us, r.max_us), r.max_cause, (r.raw_max_us,)),
            (
                "CPU",
                (r.cpu_median_us, r.cpu_p9999_us, r.cpu_max_us),
                r.cpu_max_cause,
                (r.cpu_raw_p9999_us, r.cpu_raw_max_us),
            ),
        ):
            raw_cells = [f"{value:,.0f}" for value in raw]
            rows.append(
                [f"{r.blocks:,}", r.policy, f"{r.pinned:.0%}", f"{r.calls:,}", clock]
                + [f"{value:,.1f}" for value in figures]
                + [cause, *(["-"] * (2 - len(raw_cells))), *raw_cells]
                + [str(r.collections), str(r.dict_rebuilds)]
            )
    machine = result.machine
    return "\n\n".join(
        [
            table(
                "prepare_store + complete_store evicting one block (us per call; fastest of "
                f"{result.long_runs[0].rounds} rounds, raw: every observation)",
                header,
                rows,
            )
            + f"\nCPU max <= {TARGET_LONG_CPU_MAX_US:,.0f} us: {verdict(result.cpu_max_met)}; "
            f"CPU p99.99 <= {TARGET_LONG_CPU_P9999_US:.0f} us: {verdict(result.cpu_p9999_met)}",
            render_memory(result.memory),
            f"Python {machine.python} ({machine.implementation}), {machine.cpus} CPUs, "
            f"{machine.platform}\n",
        ]
    )


def render(result: Result) -> str:
    machine = result.machine
    return "\n\n".join(
        [
            render_fast_fail(result.fast_fail),
            render_one_victim(result.one_victim),
            render_memory(result.memory),
            render_replay(result.replay),
            f"Python {machine.python} ({machine.implementation}), {machine.cpus} CPUs, "
            f"{machine.platform}\n",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Benchmark of OffloadManager.")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    parser.add_argument("--json", action="store_true", help="print the JSON, not the tables")
    parser.add_argument("--out", type=Path, help="where to write the JSON")
    parser.add_argument(
        "--long",
        action="store_true",
        help="the stall test: 2.5M one-victim calls at 1M blocks, 99%% pinned (~10 min)",
    )
    args = parser.parse_args(argv)
    quick: bool = args.quick
    name = "manager-long" if args.long else "manager"
    out: Path = args.out or RESULTS / (f"{name}-quick.json" if quick else f"{name}.json")
    command = " ".join(["python bench/manager_bench.py", *(argv or sys.argv[1:])])

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    if args.long:
        long = run_long(LONG_QUICK if quick else LONG, quick=quick, command=command, log=log)
        payload, report = json.dumps(long.to_json(), indent=2), render_long(long)
    else:
        result = run(QUICK if quick else FULL, quick=quick, command=command, log=log)
        payload, report = json.dumps(result.to_json(), indent=2), render(result)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(payload + "\n", encoding="utf-8")
    print(payload if args.json else report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
