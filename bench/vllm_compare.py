"""kvoffload's manager against vLLM 0.33.0's ``CPUOffloadingManager``, in one run.

Two measurements, printed as tables and written as JSON (docs/performance.md, "Against
vLLM"):

1. ``replay``: each bundled Mooncake trace through both managers, LRU and ARC, at 4,096
   and 16,384 CPU blocks, with the same calls per request: ``lookup`` of the prefix until
   the first miss, ``prepare_load`` + ``complete_load`` of the hits, ``prepare_store`` of
   the rest, ``touch`` of the request, ``complete_store``. vLLM's manager is driven as its
   scheduler drives it: ``on_new_request`` first and ``on_request_finished`` last, with a
   ``ReqContext`` per request (those two calls count among its calls). The keys are the
   same ``bytes`` objects for both (vLLM's ``OffloadKey`` is bytes). Calls per second for
   each, and the ratio of the times (vLLM's time / ours: > 1 means ours is faster).
2. ``floor``: the same replay through ``FloorManager`` (bench/floor_manager.py), our
   manager with a policy that keeps no order: the manager's own cost, which every policy
   pays before its own work. vLLM's time over it is the most any policy of ours could
   reach on that row.
3. ``one_victim``: ``prepare_store`` + ``complete_store`` of one new key into a full pool
   with 99% of its blocks pinned (the least recent ones, which a walk meets first), at
   10k, 100k and 400k blocks: microseconds per call, median and maximum.

Replays are timed in thread CPU time (``time.thread_time``), the least of two rounds;
one-victim calls in wall-clock time.
Without vLLM installed this prints why and exits 0 without measuring anything; install it
next to kvoffload with ``pip install --no-deps vllm==0.33.0`` plus what its
``vllm.v1.kv_offload`` import asks for (psutil, pyzmq, transformers, ...).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import importlib
import json
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy

from floor_manager import FloorManager
from kvoffload.manager import OffloadManager
from kvoffload.replay.traces import BUNDLED_TRACES, bundled_trace
from manager_bench import replay

RESULTS = Path(__file__).resolve().parent / "results"
POLICIES = ("lru", "arc")
VLLM_VERSION = "0.33.0"
TARGET_RATIO = 2.0


@dataclass(frozen=True)
class Sizes:
    capacities: tuple[int, ...]
    requests: int | None  # None: the whole trace
    rounds: int
    one_victim: tuple[int, ...]
    one_victim_calls: int
    vllm_calls_budget_s: float  # vLLM's ARC takes ~0.1 s per call at 400k: fewer calls


FULL = Sizes((4_096, 16_384), None, 2, (10_000, 100_000, 400_000), 2_000, 3.0)
QUICK = Sizes((1_024,), 300, 1, (2_000,), 100, 0.5)


@dataclass(frozen=True)
class ReplayRow:
    trace: str
    blocks: int
    policy: str
    requests: int
    ours_calls: int
    ours_s: float
    ours_calls_per_s: float
    vllm_calls: int
    vllm_s: float
    vllm_calls_per_s: float
    ratio: float  # vLLM's time / ours
    ours_hits: int
    vllm_hits: int


@dataclass(frozen=True)
class FloorRow:
    trace: str
    blocks: int
    calls: int
    floor_s: float  # our manager with a policy that keeps no order
    vllm_s: dict[str, float]  # by policy, from the replay rows
    ceiling: dict[str, float]  # vLLM's time / the floor: the most any policy could reach


@dataclass(frozen=True)
class OneVictimRow:
    blocks: int
    policy: str
    ours_calls: int
    ours_median_us: float
    ours_max_us: float
    vllm_calls: int
    vllm_median_us: float
    vllm_max_us: float


@dataclass(frozen=True)
class Result:
    quick: bool
    vllm_version: str
    python: str
    platform: str
    command: str
    replay: list[ReplayRow]
    floor: list[FloorRow]
    one_victim: list[OneVictimRow]
    ratio_met: bool

    def to_json(self) -> dict[str, object]:
        return {"benchmark": "vllm_compare", **dataclasses.asdict(self)}


def load_vllm() -> tuple[Any, Any] | str:
    """vLLM's manager class and ``ReqContext``, or why they cannot be had."""
    # importlib, not import statements: mypy must pass where vLLM is not installed.
    try:
        version = importlib.import_module("vllm").__version__
        base = importlib.import_module("vllm.v1.kv_offload.base")
        manager = importlib.import_module("vllm.v1.kv_offload.cpu.manager")
    except ImportError as error:
        return f"vLLM is not importable here ({error}): nothing measured"
    if version != VLLM_VERSION:
        return f"vLLM {version} is installed; this compares against {VLLM_VERSION}"
    return manager.CPUOffloadingManager, base.ReqContext


def as_keys(requests: Sequence[Sequence[int | str]]) -> list[list[bytes]]:
    """The trace's block ids as vLLM-style keys: the id's bytes and 4 of group index."""
    cache: dict[int | str, bytes] = {}
    out: list[list[bytes]] = []
    for request in requests:
        row = []
        for block in request:
            key = cache.get(block)
            if key is None:
                named = block.encode() if isinstance(block, str) else block.to_bytes(8, "big")
                key = cache[block] = named + bytes(4)
            row.append(key)
        out.append(row)
    return out


def replay_vllm(
    manager: Any, context: Callable[[str], Any], requests: Sequence[Sequence[bytes]]
) -> tuple[int, int]:
    hit = importlib.import_module("vllm.v1.kv_offload.base").LookupResult.HIT
    calls = hits = 0
    for index, request in enumerate(requests):
        ctx = context(str(index))
        manager.on_new_request(ctx)
        found = 0
        for key in request:
            calls += 1
            if manager.lookup(key, ctx) is not hit:
                break
            found += 1
        hits += found
        if found:
            manager.prepare_load(request[:found], ctx)
            manager.complete_load(request[:found], ctx)
            calls += 2
        output = manager.prepare_store(request[found:], ctx)
        manager.touch(request, ctx)
        calls += 2
        if output is not None:
            manager.complete_store(output.keys_to_store, ctx)
            calls += 1
        manager.on_request_finished(ctx)
        calls += 2
    return calls, hits


def replay_fresh_ours(
    blocks: int, policy: str, requests: Sequence[Sequence[bytes]]
) -> tuple[int, int]:
    return replay(OffloadManager(blocks, policy), requests)


def replay_floor(blocks: int, requests: Sequence[Sequence[bytes]]) -> tuple[int, int]:
    return replay(FloorManager(blocks), requests)


def replay_fresh_vllm(
    manager_class: Any, blocks: int, policy: str, context: Any, requests: Sequence[Sequence[bytes]]
) -> tuple[int, int]:
    return replay_vllm(manager_class(blocks, policy), context, requests)


def timed(run: Callable[[], tuple[int, int]], rounds: int) -> tuple[float, int, int]:
    """The least thread CPU time of ``rounds`` runs: on a shared machine the wall clock
    also counts the time the neighbours had the core, which differs from run to run.
    """
    best, calls, hits = float("inf"), 0, 0
    for _ in range(rounds):
        gc.collect()
        started = time.thread_time()
        calls, hits = run()
        best = min(best, time.thread_time() - started)
    return best, calls, hits


def bench_replay(
    sizes: Sizes, vllm_manager: Any, context: Any
) -> tuple[list[ReplayRow], list[FloorRow]]:
    rows: list[ReplayRow] = []
    floors: list[FloorRow] = []
    for name in BUNDLED_TRACES:
        trace = bundled_trace(name)
        requests = as_keys(trace.requests[: sizes.requests])
        for blocks in sizes.capacities:
            floor = functools.partial(replay_floor, blocks, requests)
            floor_s, floor_calls, _ = timed(floor, sizes.rounds)
            vllm_s: dict[str, float] = {}
            for policy in POLICIES:
                ours = functools.partial(replay_fresh_ours, blocks, policy, requests)
                ours_s, ours_calls, ours_hits = timed(ours, sizes.rounds)
                theirs = functools.partial(
                    replay_fresh_vllm, vllm_manager, blocks, policy, context, requests
                )
                theirs_s, vllm_calls, vllm_hits = timed(theirs, sizes.rounds)
                vllm_s[policy] = theirs_s
                rows.append(
                    ReplayRow(
                        name,
                        blocks,
                        policy,
                        len(requests),
                        ours_calls,
                        ours_s,
                        ours_calls / ours_s,
                        vllm_calls,
                        theirs_s,
                        vllm_calls / theirs_s,
                        theirs_s / ours_s,
                        ours_hits,
                        vllm_hits,
                    )
                )
            ceiling = {policy: seconds / floor_s for policy, seconds in vllm_s.items()}
            floors.append(FloorRow(name, blocks, floor_calls, floor_s, vllm_s, ceiling))
    return rows, floors


def key(index: int) -> bytes:
    return index.to_bytes(8, "big") + bytes(4)


def one_victim_ours(blocks: int, policy: str, calls: int) -> list[float]:
    manager = OffloadManager(blocks, policy)
    keys = [key(i) for i in range(blocks)]
    for start in range(0, blocks, 64):
        plan = manager.prepare_store(keys[start : start + 64])
        assert plan is not None
        manager.complete_store(plan)
    pinned = keys[: int(blocks * 0.99)]
    for start in range(0, len(pinned), 64):
        manager.prepare_load(pinned[start : start + 64])
    latencies = []
    for index in range(calls):
        started = time.perf_counter()
        plan = manager.prepare_store([key(blocks + index)])
        if plan is None or len(plan.evicted_keys) != 1:
            raise RuntimeError("kvoffload did not evict exactly one block")
        manager.complete_store(plan)
        latencies.append(time.perf_counter() - started)
    return latencies


def one_victim_vllm(
    blocks: int, policy: str, calls: int, budget_s: float, manager_class: Any, context: Any
) -> list[float]:
    manager = manager_class(blocks, policy)
    ctx = context("fill")
    keys = [key(i) for i in range(blocks)]
    for start in range(0, blocks, 64):
        output = manager.prepare_store(keys[start : start + 64], ctx)
        assert output is not None
        manager.complete_store(output.keys_to_store, ctx)
    pinned = keys[: int(blocks * 0.99)]
    for start in range(0, len(pinned), 64):
        manager.prepare_load(pinned[start : start + 64], ctx)
    latencies: list[float] = []
    spent = 0.0
    for index in range(calls):
        started = time.perf_counter()
        output = manager.prepare_store([key(blocks + index)], ctx)
        if output is None or len(output.evicted_keys) != 1:
            raise RuntimeError("vLLM did not evict exactly one block")
        manager.complete_store(output.keys_to_store, ctx)
        latencies.append(time.perf_counter() - started)
        spent += latencies[-1]
        if spent > budget_s and len(latencies) >= 3:
            break
    return latencies


def bench_one_victim(sizes: Sizes, manager_class: Any, context: Any) -> list[OneVictimRow]:
    rows: list[OneVictimRow] = []
    for blocks in sizes.one_victim:
        for policy in POLICIES:
            ours = numpy.array(one_victim_ours(blocks, policy, sizes.one_victim_calls)) * 1e6
            theirs = one_victim_vllm(
                blocks,
                policy,
                sizes.one_victim_calls,
                sizes.vllm_calls_budget_s,
                manager_class,
                context,
            )
            vllm_us = numpy.array(theirs) * 1e6
            rows.append(
                OneVictimRow(
                    blocks,
                    policy,
                    len(ours),
                    float(numpy.median(ours)),
                    float(ours.max()),
                    len(vllm_us),
                    float(numpy.median(vllm_us)),
                    float(vllm_us.max()),
                )
            )
            gc.collect()
    return rows


def table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    cells = [list(header), *[list(row) for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join([title, *lines])


def render(result: Result) -> str:
    replay = table(
        "1. trace replay, the same calls through both managers (calls per CPU second, best round)",
        ["trace", "blocks", "policy", "ours calls/s", "vLLM calls/s", "ratio", "hits (ours/vLLM)"],
        [
            [
                r.trace,
                f"{r.blocks:,}",
                r.policy,
                f"{r.ours_calls_per_s:,.0f}",
                f"{r.vllm_calls_per_s:,.0f}",
                f"{r.ratio:.2f}x",
                f"{r.ours_hits:,} / {r.vllm_hits:,}",
            ]
            for r in result.replay
        ],
    )
    floor = table(
        "2. the manager's own floor: ours with a policy that keeps no order (CPU seconds)",
        [
            "trace",
            "blocks",
            "floor s",
            *(f"vLLM {policy.upper()} s" for policy in POLICIES),
            *(f"ceiling {policy.upper()}" for policy in POLICIES),
        ],
        [
            [
                r.trace,
                f"{r.blocks:,}",
                f"{r.floor_s:.3f}",
                *(f"{r.vllm_s[policy]:.3f}" for policy in POLICIES),
                *(f"{r.ceiling[policy]:.2f}x" for policy in POLICIES),
            ]
            for r in result.floor
        ],
    )
    victims = table(
        "3. one-victim prepare_store + complete_store, 99% pinned (us per call)",
        ["blocks", "policy", "ours median", "ours max", "vLLM median", "vLLM max", "vLLM calls"],
        [
            [
                f"{r.blocks:,}",
                r.policy,
                f"{r.ours_median_us:,.1f}",
                f"{r.ours_max_us:,.0f}",
                f"{r.vllm_median_us:,.1f}",
                f"{r.vllm_max_us:,.0f}",
                str(r.vllm_calls),
            ]
            for r in result.one_victim
        ],
    )
    verdict = "met" if result.ratio_met else "MISSED"
    return (
        f"{replay}\nratio = vLLM's time / ours; target >= {TARGET_RATIO:.0f}x for every row: "
        f"{verdict}\n\n{floor}\nceiling = vLLM's time / the floor: the most any policy "
        f"could reach\n\n{victims}\n\nvLLM {result.vllm_version}, Python {result.python}, "
        f"{result.platform}\n"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="kvoffload's manager against vLLM's.")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    parser.add_argument("--json", action="store_true", help="print the JSON, not the tables")
    parser.add_argument("--out", type=Path, help="where to write the JSON")
    args = parser.parse_args(argv)
    found = load_vllm()
    if isinstance(found, str):
        print(f"vllm_compare: skipped: {found}")
        return 0
    manager_class, context = found
    sizes = QUICK if args.quick else FULL
    command = " ".join(["python bench/vllm_compare.py", *(argv or sys.argv[1:])])
    print("1/2 trace replays ...", file=sys.stderr, flush=True)
    replay, floor = bench_replay(sizes, manager_class, context)
    print("2/2 one-victim stores ...", file=sys.stderr, flush=True)
    one_victim = bench_one_victim(sizes, manager_class, context)
    result = Result(
        args.quick,
        VLLM_VERSION,
        platform.python_version(),
        platform.platform(),
        command,
        replay,
        floor,
        one_victim,
        ratio_met=all(row.ratio >= TARGET_RATIO for row in replay),
    )
    payload = json.dumps(result.to_json(), indent=2)
    out: Path = args.out or RESULTS / ("vllm_compare-quick.json" if args.quick else "vllm.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(payload + "\n", encoding="utf-8")
    print(payload if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
