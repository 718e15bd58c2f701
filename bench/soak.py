"""Soak: millions of randomized operations, each checked against the spec; memory watched.

Lanes run interleaved, each an ``OffloadManager`` with the spec's ``OffloadModel`` in
lockstep (LRU and ARC, small and larger pools, one with a store threshold) over a simulated
data path, plus one lane of the real ``Offloader`` over KV tensors. Every call goes to both
sides and must get the same answer (plan, error, lookup, events). The simulated data path
is as hostile as a real one may be: copies fail half-way, jobs run and report in any order,
some stall until they are abandoned and then write their slots late, resets come while
jobs are in flight. Each CPU slot holds a label (key, version) written by the job that
copied into it, so a load that would read another key's bytes, or a late write into a
reused slot, is a divergence. At sampled points both sides' invariants are checked and
their whole observable state compared; the process's memory is sampled there too.

The spec's transitions assert their contracts (O(n) each); the soak checks the invariants
at sampled points instead, so it re-runs itself under ``python -O`` (``--contracts`` keeps
the asserts, at a fifth of the speed).

``python bench/soak.py`` runs 5,000,000 operations (about a minute and a half on 2 cores),
prints a table and writes bench/results/soak.json; ``--quick`` runs 100,000; ``--json``
prints the JSON instead; ``--trace-memory`` adds tracemalloc's count of live Python bytes.
Exit status 1 on any divergence.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import sys
import time
import tracemalloc
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvoffload.checking.lockstep import Divergence, Lockstep
from kvoffload.manager import OffloadManager
from kvoffload_spec import OffloadModel
from kvoffload_spec.operations import (
    ABANDON,
    COMPLETE_LOAD,
    COMPLETE_STORE,
    LOOKUP,
    PREPARE_LOAD,
    PREPARE_STORE,
    RESET,
    TOUCH,
    Operation,
)
from kvoffload_spec.surface import Key, LoadPlan, Lookup, Plan, StorePlan

RESULTS = Path(__file__).resolve().parent / "results"
Label = tuple[Key, int]  # what a CPU slot holds: the key and the version of its store

FAIL = 0.05  # of jobs fail at some key
STALL = 0.03  # of jobs stall until released or abandoned
WARM_UP = 0.2  # of the operations, before memory is expected to stay flat
BLOCK_BYTES = 256  # of the offloader lane's KV blocks: 2 layers x (K, V) x 64


KEEP = 40  # calls each lane's driver keeps for a divergence's history


@dataclass
class Job:
    """A simulated copy job: it runs (copies) and reports at moments the soak chooses."""

    plan: Plan  # the manager's (the driver holds the spec's twin)
    version: int
    fails_at: int | None  # the key at which the copy fails: the ones before it are copied
    stalled: bool
    ran: bool = False
    ok: bool = True
    abandoned: bool = False


@dataclass
class Lane:
    """A manager and the spec in lockstep (the driver) over a simulated pool of labelled
    slots: the lane only chooses operations; ``Lockstep`` makes each on both and compares.
    """

    name: str
    policy: str
    num_blocks: int
    num_keys: int
    rng: random.Random
    store_threshold: int = 1
    make_manager: type[OffloadManager] = OffloadManager
    driver: Lockstep = field(init=False)
    slots: list[Label | None] = field(init=False)
    jobs: dict[int, Job] = field(default_factory=dict)  # plan id -> job, in flight
    stored: dict[Key, Label] = field(default_factory=dict)  # what a ready key's slot holds
    version: int = 0
    counts: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        threshold, tracked = self.store_threshold, 4 * self.num_keys
        manager = self.make_manager(
            self.num_blocks,
            self.policy,
            store_threshold=threshold,
            max_tracker_size=tracked,
            enable_events=True,
        )
        model = OffloadModel(
            self.num_blocks,
            self.policy,
            store_threshold=threshold,
            max_tracker_size=tracked,
            enable_events=True,
        )
        self.driver = Lockstep(
            manager,
            model,
            setting=f"lane {self.name}: {self.num_blocks} blocks, {self.policy}, "
            f"store_threshold={threshold}, max_tracker_size={tracked}, events on",
            watched=tuple(range(self.num_keys)),
            label="manager",
            keep=KEEP,
        )
        self.slots = [None] * self.num_blocks

    # -- one operation ---------------------------------------------------------------------

    def step(self) -> None:
        rng = self.rng
        roll = rng.random()
        if len(self.jobs) >= 2 * self.num_blocks or roll < 0.45:
            self.advance()
        elif roll < 0.70:
            self.prepare(PREPARE_STORE, rng.sample(range(self.num_keys), rng.randint(1, 3)))
        elif roll < 0.85:
            blocks = self.driver.model.state.blocks
            ready = [key for key, block in blocks.items() if block.ready]
            if ready and rng.random() < 0.9:  # else keys at random: mostly refused
                self.prepare(PREPARE_LOAD, [rng.choice(ready) for _ in range(rng.randint(1, 3))])
            else:
                keys = [rng.randrange(self.num_keys) for _ in range(rng.randint(1, 3))]
                self.prepare(PREPARE_LOAD, keys)
        elif roll < 0.93:
            keys = [rng.randrange(self.num_keys) for _ in range(rng.randint(0, 3))]
            self.driver.apply(Operation(TOUCH, tuple(keys)))
        elif roll < 0.99:
            self.driver.apply(Operation(LOOKUP, (rng.randrange(self.num_keys),)))
        elif roll < 0.9995:
            self.unstall_or_abandon()
        else:
            self.reset()

    def prepare(self, name: str, keys: Sequence[Key]) -> None:
        """A store or a load: a plan opens a job; a refusal (None, or an error) does not."""
        got, _ = self.driver.apply(Operation(name, tuple(keys)))
        kind = "stores" if name == PREPARE_STORE else "loads"
        if isinstance(got, (StorePlan, LoadPlan)):
            self.open(got)
            self.counts[kind] += 1
        else:
            self.counts[f"{kind} refused"] += 1

    def open(self, plan: Plan) -> None:
        rng = self.rng
        self.version += 1
        fails_at = rng.randrange(len(plan.keys)) if plan.keys and rng.random() < FAIL else None
        stalled = rng.random() < STALL
        self.jobs[plan.plan_id] = Job(plan, self.version, fails_at, stalled)
        self.counts["stalled jobs"] += stalled

    def advance(self) -> None:
        """A job that may move does: it copies if it has not, else it reports."""
        movable = [job for job in self.jobs.values() if not job.stalled]
        if not movable:
            self.unstall_or_abandon()
            return
        job = self.rng.choice(movable)
        if job.ran:
            self.report(job)
        else:
            self.run(job)

    def run(self, job: Job) -> None:
        """Copy: a store labels its slots (up to a failure), a load reads and checks them."""
        job.ran = True
        for index, (key, slot) in enumerate(zip(job.plan.keys, job.plan.block_ids, strict=True)):
            if index == job.fails_at:
                job.ok = False
                return
            if isinstance(job.plan, StorePlan):
                self.slots[slot] = (key, job.version)
            elif not job.abandoned and self.slots[slot] != self.stored.get(key):
                raise self.driver.failure(
                    f"a load of {key!r} read slot {slot} = {self.slots[slot]}, "
                    f"stored {self.stored.get(key)}"
                )

    def report(self, job: Job) -> None:
        """The data path reports the job; the driver completes its plan on both sides."""
        del self.jobs[job.plan.plan_id]
        plan, driver = job.plan, self.driver
        if isinstance(plan, StorePlan):
            driver.apply(Operation(COMPLETE_STORE, plan=driver.index(plan), success=job.ok))
            current = plan.generation == driver.model.state.generation
            if job.ok and not job.abandoned and current:
                for key in plan.keys:
                    self.stored[key] = (key, job.version)
        else:
            driver.apply(Operation(COMPLETE_LOAD, plan=driver.index(plan)))
        self.counts["abandoned, reported late" if job.abandoned else "reported"] += 1
        self.counts["failed copies"] += not job.ok

    def unstall_or_abandon(self) -> None:
        stalled = [job for job in self.jobs.values() if job.stalled]
        if not stalled:
            return
        job = self.rng.choice(stalled)
        if job.abandoned or self.rng.random() < 0.5:
            job.stalled = False  # it goes on, late: an abandoned store writes its slots now
        else:
            self.abandon(job)

    def abandon(self, job: Job) -> None:
        self.driver.apply(Operation(ABANDON, plan=self.driver.index(job.plan)))
        job.abandoned = True
        self.counts["abandoned"] += 1

    def reset(self) -> None:
        """As ``Offloader.reset``: every job in flight finishes first, but for the stalled
        ones, which are abandoned (they may still write their quarantined slots later).
        """
        for job in list(self.jobs.values()):
            if job.abandoned:
                continue
            if job.stalled:
                self.abandon(job)
                continue
            if not job.ran:
                self.run(job)
            self.report(job)
        self.driver.apply(Operation(RESET))
        self.counts["resets"] += 1

    # -- at sampled points -----------------------------------------------------------------

    def check(self) -> None:
        """Everything the driver compares (invariants of both sides, every key's lookup,
        the counters, events, stats and the whole abstract state), and every ready slot."""
        self.driver.check()
        for key, block in self.driver.model.state.blocks.items():
            if block.ready and self.slots[block.block_id] != self.stored.get(key):
                raise self.driver.failure(
                    f"slot {block.block_id} of ready {key!r} holds {self.slots[block.block_id]}"
                )
        self.counts["checks"] += 1


class OffloaderLane:
    """The real ``Offloader`` over KV tensors (jobs fail half-way now and then): the driver
    follows each manager call the offloader made on the spec; a load's bytes must be those
    its key was stored with.
    """

    def __init__(self, rng: random.Random, num_blocks: int = 6, num_keys: int = 16) -> None:
        import torch

        from kvoffload import Offloader

        self.torch = torch
        self.rng = rng
        self.name, self.policy = "offloader", "arc"
        self.num_keys = num_keys
        self.tensors = [torch.zeros(2, 8, 64, dtype=torch.uint8) for _ in range(2)]
        self.offloader = Offloader(
            self.tensors, block_dim=1, num_cpu_blocks=num_blocks, policy="arc"
        )
        self.offloader.engine.fault_hook = self.faults
        manager = self.offloader.manager
        assert isinstance(manager, OffloadManager)
        self.driver = Lockstep(
            manager,
            OffloadModel(num_blocks, "arc"),
            setting=f"the offloader lane: {num_blocks} blocks, arc",
            watched=tuple(range(num_keys)),
            label="offloader's manager",
            keep=KEEP,
        )
        self.armed = False  # the next job's copy fails half-way (jobs run inside submit)
        self.plans: dict[int, tuple[list[int], list[bytes]]] = {}  # plan id -> blocks, bytes
        self.stored: dict[Key, bytes] = {}
        self.counts: Counter[str] = Counter()

    def faults(self, job: int, run: int) -> None:
        if self.armed and run == 1:
            self.armed = False
            raise RuntimeError("injected")

    def step(self) -> None:
        rng = self.rng
        roll = rng.random()
        offloader, driver = self.offloader, self.driver
        busy = {block for blocks, _ in self.plans.values() for block in blocks}
        idle = [block for block in range(8) if block not in busy]
        keys = rng.sample(range(self.num_keys), rng.randint(1, 2))
        if roll < 0.5 or len(idle) < 2:
            self.poll()
        elif roll < 0.75:
            blocks = idle[: len(keys)]
            contents = [rng.randbytes(BLOCK_BYTES) for _ in keys]
            for block, data in zip(blocks, contents, strict=True):
                self.write(block, data)
            self.armed = rng.random() < FAIL
            plan = offloader.store(keys, blocks)
            self.armed = False
            driver.follow(Operation(PREPARE_STORE, tuple(keys)), plan)
            if plan is not None:
                given: dict[Key, bytes] = dict(zip(keys, contents, strict=True))
                self.plans[plan.plan_id] = (blocks, [given[key] for key in plan.keys])
        elif roll < 0.95:
            keys = [key for key in keys if driver.model.lookup(key) is Lookup.HIT]
            if keys:
                self.armed = rng.random() < FAIL
                load = offloader.load(keys, idle[: len(keys)])
                self.armed = False
                driver.follow(Operation(PREPARE_LOAD, tuple(keys)), load)
                expected = [self.stored[key] for key in keys]
                self.plans[load.plan_id] = (idle[: len(keys)], expected)
        elif roll < 0.999:
            offloader.touch(keys)
            driver.follow(Operation(TOUCH, tuple(keys)), None)
        else:
            self.complete(offloader.reset())
            driver.follow(Operation(RESET), None)
            self.counts["resets"] += 1

    def write(self, block: int, data: bytes) -> None:
        flat = self.torch.frombuffer(bytearray(data), dtype=self.torch.uint8).view(2, 2, 64)
        for index, tensor in enumerate(self.tensors):
            tensor[:, block].copy_(flat[index])

    def read(self, block: int) -> bytes:
        return b"".join(tensor[:, block].numpy().tobytes() for tensor in self.tensors)

    def poll(self) -> None:
        self.complete(self.offloader.poll())

    def complete(self, finished: Sequence[object]) -> None:
        """The offloader completed these plans in its manager: the driver follows."""
        from kvoffload import Finished

        driver = self.driver
        for done in finished:
            assert isinstance(done, Finished)
            plan = done.plan
            blocks, contents = self.plans.pop(plan.plan_id)
            if isinstance(plan, StorePlan):
                operation = Operation(COMPLETE_STORE, plan=driver.index(plan), success=done.ok)
                driver.follow(operation, None)
                if done.ok and plan.generation == driver.model.state.generation:
                    self.stored.update(zip(plan.keys, contents, strict=True))
                self.counts["stores" if done.ok else "failed copies"] += 1
            else:
                driver.follow(Operation(COMPLETE_LOAD, plan=driver.index(plan)), None)
                self.counts["loads" if done.ok else "failed copies"] += 1
                for block, data in zip(blocks, contents, strict=True):
                    if done.ok and self.read(block) != data:
                        raise driver.failure(f"a load into device block {block} got other bytes")

    def check(self) -> None:
        self.driver.check()
        self.driver.same("num_in_flight", self.offloader.num_in_flight, len(self.plans))
        self.counts["checks"] += 1


def build_lanes(
    seed: int, with_offloader: bool, manager: type[OffloadManager] = OffloadManager
) -> list[Lane | OffloaderLane]:
    """The simulated lanes, each with ``manager``; and the offloader lane (a real manager)."""
    rng = random.Random(seed)
    lanes: list[Lane | OffloaderLane] = [
        Lane("lru-8", "lru", 8, 20, random.Random(rng.random()), make_manager=manager),
        Lane("arc-8", "arc", 8, 20, random.Random(rng.random()), make_manager=manager),
        Lane("lru-64-t2", "lru", 64, 160, random.Random(rng.random()), 2, manager),
        Lane("arc-64", "arc", 64, 160, random.Random(rng.random()), make_manager=manager),
    ]
    if with_offloader:
        lanes.append(OffloaderLane(random.Random(rng.random())))
    return lanes


def rss_bytes() -> int:
    """Resident memory now (Linux), else the peak so far."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def soak(
    operations: int,
    seed: int = 0,
    check_every: int = 5_000,
    trace_memory: bool = False,
    manager: type[OffloadManager] = OffloadManager,
    with_offloader: bool = True,
) -> dict[str, object]:
    """Run ``operations`` across the lanes; the report (see the module's docstring)."""
    lanes = build_lanes(seed, with_offloader, manager)
    # The offloader lane costs ~10x a simulated one per step: give it a tenth of the steps.
    weights = [1.0 if isinstance(lane, Lane) else 0.1 for lane in lanes]
    picker = random.Random(seed)
    if trace_memory:
        tracemalloc.start()
    samples: list[dict[str, float]] = []
    divergence: str | None = None
    started = time.perf_counter()
    done = 0
    try:
        while done < operations:
            batch = min(check_every, operations - done)
            for lane in picker.choices(lanes, weights, k=batch):
                lane.step()
            done += batch
            for lane in lanes:
                lane.check()
            sample = {"operations": done, "rss_mib": rss_bytes() / 2**20}
            if trace_memory:
                sample["traced_mib"] = tracemalloc.get_traced_memory()[0] / 2**20
            samples.append(sample)
    except (Divergence, AssertionError) as error:
        divergence = f"after {done} operations: {error}"
    seconds = time.perf_counter() - started
    if trace_memory:
        tracemalloc.stop()
    return {
        "operations": done,
        "seconds": round(seconds, 2),
        "operations_per_second": round(done / seconds),
        "seed": seed,
        "contracts": sys.flags.optimize == 0,
        "divergences": 0 if divergence is None else 1,
        "divergence": divergence,
        "lanes": [lane_row(lane) for lane in lanes],
        "memory": memory_summary(samples),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
    }


def lane_row(lane: Lane | OffloaderLane) -> dict[str, object]:
    return {"lane": lane.name, "policy": lane.policy, **lane.counts}


def memory_summary(samples: list[dict[str, float]]) -> dict[str, object]:
    """Memory after the warm-up and at the end; flat means no leak."""
    if not samples:
        return {}
    warm = samples[min(len(samples) - 1, int(len(samples) * WARM_UP))]
    last = samples[-1]
    summary: dict[str, object] = {
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "rss_after_warm_up_mib": round(warm["rss_mib"], 1),
        "rss_at_end_mib": round(last["rss_mib"], 1),
        "rss_growth_mib": round(last["rss_mib"] - warm["rss_mib"], 2),
        "samples": len(samples),
    }
    if "traced_mib" in last:
        # Jobs in flight come and go (up to 2 per block and lane): compare the highest
        # level of the first and of the second half after the warm-up, not two instants.
        after = [sample["traced_mib"] for sample in samples[samples.index(warm) :]]
        half = len(after) // 2
        summary["traced_after_warm_up_mib"] = round(after[0], 3)
        summary["traced_at_end_mib"] = round(after[-1], 3)
        summary["traced_growth_mib"] = round(max(after[half:]) - max(after[: half or 1]), 3)
    return summary


def table(report: dict[str, object]) -> str:
    lanes = report["lanes"]
    assert isinstance(lanes, list)
    columns = [
        "lane",
        "stores",
        "loads",
        "failed copies",
        "stalled jobs",
        "abandoned",
        "resets",
        "checks",
    ]
    lines = ["  ".join(f"{name:>14}" for name in columns)]
    for row in lanes:
        lines.append("  ".join(f"{row.get(name, 0)!s:>14}" for name in columns))
    memory = report["memory"]
    assert isinstance(memory, dict)
    lines.append("")
    lines.append(
        f"{report['operations']:,} operations in {report['seconds']} s "
        f"({report['operations_per_second']:,}/s), contracts "
        f"{'on' if report['contracts'] else 'off (python -O)'}, divergences: "
        f"{report['divergences']}"
    )
    lines.append(
        f"memory: RSS {memory.get('rss_after_warm_up_mib')} MiB after warm-up, "
        f"{memory.get('rss_at_end_mib')} MiB at the end (growth "
        f"{memory.get('rss_growth_mib')} MiB), peak {memory.get('peak_rss_mib')} MiB"
    )
    if "traced_growth_mib" in memory:
        lines.append(
            f"live Python bytes (tracemalloc): {memory['traced_after_warm_up_mib']} MiB after "
            f"warm-up, {memory['traced_at_end_mib']} MiB at the end (growth of the highest "
            f"level from the first half to the second: {memory['traced_growth_mib']} MiB)"
        )
    if report["divergence"]:
        lines.append(f"DIVERGENCE {report['divergence']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--ops", type=int, default=5_000_000, help="operations in all")
    parser.add_argument("--quick", action="store_true", help="100,000 operations")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check-every", type=int, default=5_000, help="operations between checks")
    parser.add_argument("--trace-memory", action="store_true", help="count live Python bytes")
    parser.add_argument("--contracts", action="store_true", help="keep the spec's asserts")
    parser.add_argument("--json", action="store_true", help="print the JSON instead")
    parser.add_argument("--out", type=Path, default=None, help="where to write the JSON")
    args = parser.parse_args(argv)
    if sys.flags.optimize == 0 and not args.contracts and argv is None:
        os.execv(sys.executable, [sys.executable, "-O", *sys.argv])
    operations = 100_000 if args.quick else args.ops
    report = soak(operations, args.seed, args.check_every, args.trace_memory)
    text = json.dumps(report, indent=2)
    out = args.out or RESULTS / ("soak-quick.json" if args.quick else "soak.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    print(text if args.json else table(report))
    return 1 if report["divergences"] else 0


if __name__ == "__main__":
    sys.exit(main())
