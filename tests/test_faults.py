"""Faults: copies that fail, fail half-way, finish out of order or never; resets while jobs
are in flight; a pool where every block is pinned.

The data path here runs every job on its own thread (``AnyOrder``): a later job may finish
before an earlier one, as on several CUDA streams, and a stalled job holds up no other. That
is the data path under which abandoning a stalled job is most dangerous, so the tests can
show the quarantine of its slots matters (a planted manager without it corrupts bytes).
The end-to-end machine at the bottom injects every fault at random, mirrored in the spec.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Container, Sequence
from dataclasses import dataclass

import pytest
import torch
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvoffload import Finished, Offloader, TransferTimeoutError
from kvoffload.manager import OffloadManager
from kvoffload.policies.lru import LruPolicy
from kvoffload.transfer import EngineClosedError
from kvoffload.transfer.copiers import MemmoveCopier
from kvoffload.transfer.cpu import run_job
from kvoffload.transfer.jobs import FaultHook, Job, JobResult
from kvoffload_spec import OffloadModel
from kvoffload_spec.errors import PlanAlreadyCompletedError
from kvoffload_spec.surface import Key, LoadPlan, Lookup, StorePlan
from tests.caches import make_cache, reference_block
from tests.helpers import every_field
from tests.planted import FAULTS, ManagerBug, Planted, share

HOLD = 60.0  # seconds a stalled job waits at most, so a broken test cannot hang forever


class AnyOrder:
    """A CPU data path running each job on its own thread: jobs finish in any order."""

    def __init__(self, copier: MemmoveCopier) -> None:
        self._copier = copier
        self.hook: FaultHook | None = None
        self._done: dict[int, JobResult] = {}
        self._running: set[int] = set()
        self._changed = threading.Condition()

    def submit(self, job: Job) -> None:
        with self._changed:
            self._running.add(job.job_id)
        threading.Thread(target=self._run, args=(job, self.hook), daemon=True).start()

    def _run(self, job: Job, hook: FaultHook | None) -> None:
        result = run_job(self._copier, job, hook)
        with self._changed:
            self._done[job.job_id] = result
            self._running.discard(job.job_id)
            self._changed.notify_all()

    def poll(self) -> list[JobResult]:
        with self._changed:
            finished = list(self._done.values())
            self._done.clear()
        return finished

    def wait(self, job_ids: Sequence[int], timeout: float | None = None) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self._running.isdisjoint(job_ids), timeout)

    def wait_all(self, timeout: float | None = None) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: not self._running, timeout)

    def close(self) -> None:
        self.wait_all()


class Faults:
    """The fault hook: holds a job before its run ``at`` until released, or fails it there."""

    def __init__(self) -> None:
        self.gates: dict[int, tuple[int, threading.Event]] = {}  # job -> (run, gate)
        self.failing: dict[int, int] = {}  # job -> the run that raises
        self.failed: set[int] = set()

    def stall(self, job: int, at: int = 0) -> threading.Event:
        gate = threading.Event()
        self.gates[job] = (at, gate)
        return gate

    def fail(self, job: int, at: int) -> None:
        self.failing[job] = at

    def release_all(self) -> None:
        for _, gate in self.gates.values():
            gate.set()

    def __call__(self, job: int, run: int) -> None:
        at, gate = self.gates.get(job, (-1, None))
        if run == at and gate is not None and not gate.wait(HOLD):
            raise RuntimeError(f"job {job} was held for {HOLD} s: a test forgot to release it")
        if self.failing.get(job) == run:
            self.failed.add(job)
            raise RuntimeError(f"injected into job {job} at run {run}")


@dataclass
class Rig:
    """An offloader over a KV cache of 8 device blocks, on the any-order data path."""

    offloader: Offloader
    tensors: list[torch.Tensor]
    block_dim: int
    faults: Faults

    @staticmethod
    def build(cpu_blocks: int, manager: OffloadManager | None = None) -> Rig:
        tensors, block_dim = make_cache("kv_split", num_blocks=8, dtype=torch.uint8)
        offloader = Offloader(
            tensors, num_cpu_blocks=cpu_blocks, block_dim=block_dim, manager=manager
        )
        engine = offloader.engine
        engine._backend = AnyOrder(MemmoveCopier(engine.layout, engine.pool))
        faults = Faults()
        engine.fault_hook = faults
        return Rig(offloader, tensors, block_dim, faults)

    @property
    def manager(self) -> OffloadManager:
        manager = self.offloader.manager
        assert isinstance(manager, OffloadManager)
        return manager

    def block(self, block: int) -> torch.Tensor:
        return reference_block(self.tensors, self.block_dim, block)

    def write(self, block: int, data: torch.Tensor) -> None:
        """Write ``data`` (the block's bytes, in layout order) into device ``block``."""
        offset = 0
        for tensor in self.tensors:
            raw = tensor.select(self.block_dim, block)
            raw.copy_(data[offset : offset + raw.numel()].reshape(raw.shape))
            offset += raw.numel()

    def fill(self, block: int, value: int) -> torch.Tensor:
        """Write ``value`` into every byte of device ``block``; returns its bytes."""
        for tensor in self.tensors:
            tensor.select(self.block_dim, block).fill_(value)
        return self.block(block)

    def settle(self, *abandoned: StorePlan | LoadPlan) -> list[Finished]:
        """Wait for every job in flight (``wait`` leaves out abandoned ones unless named),
        then poll.
        """
        assert self.offloader.wait(timeout=HOLD)
        assert self.offloader.wait(list(abandoned), timeout=HOLD)
        return self.offloader.poll()

    def loaded(self, key: Key, into: int) -> torch.Tensor:
        """The bytes ``key`` loads into device block ``into`` (the load must succeed)."""
        load = self.offloader.load([key], [into])
        assert self.offloader.wait([load], timeout=HOLD)
        assert all(done.ok for done in self.offloader.poll())
        return self.block(into)

    def close(self) -> None:
        self.faults.release_all()
        self.offloader.close(timeout=HOLD)


def next_job(rig: Rig) -> int:
    return rig.offloader.engine._issued


def must(plan: StorePlan | None) -> StorePlan:
    assert plan is not None
    return plan


# -- failures --------------------------------------------------------------------------------


@pytest.mark.parametrize("run", [0, 1, 3])
def test_a_store_failing_half_way_is_never_readable_and_harms_no_other_block(run: int) -> None:
    rig = Rig.build(cpu_blocks=2)
    kept = rig.fill(0, 11)
    rig.offloader.store(["kept"], [0])
    rig.settle()
    rig.fill(1, 22)
    rig.faults.fail(next_job(rig), at=run)  # each block is 4 runs: K and V of 2 layers
    rig.offloader.store(["torn"], [1])
    (done,) = rig.settle()
    assert not done.ok and rig.offloader.lookup("torn") is Lookup.MISS
    fresh = rig.fill(2, 33)
    again = rig.offloader.store(["fresh"], [2])
    assert again is not None and again.block_ids == done.plan.block_ids  # the torn slot
    rig.settle()
    assert torch.equal(rig.loaded("fresh", 5), fresh)
    assert torch.equal(rig.loaded("kept", 6), kept)
    copies = rig.offloader.transfer_stats()
    assert (copies.stores, copies.stores_failed, copies.loads, copies.loads_failed) == (3, 1, 2, 0)
    rig.close()


def test_a_load_failing_half_way_releases_its_pins_and_is_reported() -> None:
    rig = Rig.build(cpu_blocks=1)
    stored = rig.fill(0, 7)
    rig.offloader.store(["a"], [0])
    rig.settle()
    rig.faults.fail(next_job(rig), at=2)
    rig.offloader.load(["a"], [4])
    (done,) = rig.settle()
    assert not done.ok and rig.manager.stats().pinned == 0
    assert torch.equal(rig.loaded("a", 5), stored)  # the CPU block is intact
    copies = rig.offloader.transfer_stats()
    assert (copies.stores, copies.stores_failed, copies.loads, copies.loads_failed) == (1, 0, 2, 1)
    rig.close()


def test_jobs_finishing_out_of_order_complete_in_the_order_they_finish() -> None:
    rig = Rig.build(cpu_blocks=4)
    first, second = rig.fill(0, 1), rig.fill(1, 2)
    gate = rig.faults.stall(next_job(rig))
    slow = must(rig.offloader.store(["slow"], [0]))
    fast = must(rig.offloader.store(["fast"], [1]))
    assert rig.offloader.wait([fast], timeout=HOLD)
    assert [done.plan for done in rig.offloader.poll()] == [fast]
    assert rig.offloader.lookup("fast") is Lookup.HIT
    assert rig.offloader.lookup("slow") is Lookup.PENDING
    gate.set()
    assert [done.plan for done in rig.settle()] == [slow]
    assert torch.equal(rig.loaded("slow", 6), first)
    assert torch.equal(rig.loaded("fast", 7), second)
    rig.manager.check_invariants()
    rig.close()


# -- stalled jobs: reported, then abandoned safely -------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_stalled_plans_are_reported_by_age() -> None:
    clock = Clock()
    manager = OffloadManager(4, stall_after=300, clock=clock)
    ready = manager.prepare_store(["a", "b"])
    assert ready is not None
    manager.complete_store(ready)
    stale = manager.prepare_store(["s"])
    manager.reset_cache()
    ready = manager.prepare_store(["a", "b"])
    assert ready is not None
    manager.complete_store(ready)
    clock.now += 100
    load = manager.prepare_load(["a", "b", "a"])
    store = manager.prepare_store(["c"])
    clock.now += 250
    young = manager.prepare_load(["b"])
    stats = manager.stats()
    assert manager.stalled_plans() == [stale] and stats.stalled_plans == 1
    assert (stats.stalled_pins, stats.stalled_pending) == (0, 0)  # a stale plan holds nothing
    assert manager.stalled_plans(older_than=200) == [stale, load, store]
    clock.now += 100
    assert manager.stalled_plans() == [stale, load, store]
    stats = manager.stats()
    assert (stats.stalled_plans, stats.stalled_pins, stats.stalled_pending) == (3, 3, 1)
    manager.abandon(load)
    assert manager.stalled_plans() == [stale, store] and young not in manager.stalled_plans()
    stats = manager.stats()
    assert (stats.stalled_pins, stats.abandoned_open, stats.abandoned_plans) == (0, 1, 1)
    assert stats.pinned == 1  # the young load's pin on b
    manager.check_invariants()


def test_the_offloader_passes_stall_after_on_and_reports_by_it() -> None:
    tensors, block_dim = make_cache("kv_split", num_blocks=8, dtype=torch.uint8)
    offloader = Offloader(tensors, num_cpu_blocks=2, block_dim=block_dim, stall_after=0.01)
    engine = offloader.engine
    engine._backend = AnyOrder(MemmoveCopier(engine.layout, engine.pool))
    faults = Faults()
    engine.fault_hook = faults
    gate = faults.stall(engine._issued)
    plan = must(offloader.store(["a"], [0]))
    assert offloader.stalled(older_than=HOLD) == []
    time.sleep(0.05)
    assert offloader.stalled() == [plan]
    manager = offloader.manager
    assert isinstance(manager, OffloadManager) and manager.stats().stalled_pending == 1
    gate.set()
    offloader.close(timeout=HOLD)


def test_an_abandoned_stalled_load_unpins_its_blocks_at_once() -> None:
    """vLLM #46019: a load that never reports must not pin its blocks forever."""
    rig = Rig.build(cpu_blocks=2)
    rig.fill(0, 1)
    rig.fill(1, 2)
    rig.offloader.store(["a", "b"], [0, 1])
    rig.settle()
    gate = rig.faults.stall(next_job(rig))
    load = rig.offloader.load(["a"], [5])
    assert rig.offloader.stalled(older_than=1e-9) == [load]
    assert rig.offloader.store(["c", "d"], [2, 3]) is None  # "a" is pinned: no room
    rig.offloader.abandon(load)
    assert rig.manager.stats().pinned == 0 and rig.offloader.stalled(older_than=1e-9) == []
    fresh = rig.fill(2, 3)
    plan = rig.offloader.store(["c", "d"], [2, 3])  # now "a" and "b" are evicted
    assert plan is not None and set(plan.evicted_keys) == {"a", "b"}
    gate.set()  # the stalled job ends late: reported as abandoned, changing nothing
    finished = {done.plan.plan_id: done for done in rig.settle(load)}
    late = finished[load.plan_id]
    assert late.abandoned and not late.ok
    assert torch.equal(rig.loaded("c", 6), fresh)
    with pytest.raises(PlanAlreadyCompletedError):
        rig.manager.complete_load(load)
    rig.manager.check_invariants()
    rig.close()


def abandon_a_stalled_store_then_reuse_the_pool(rig: Rig) -> bool:
    """A store stalls before it copies; it is abandoned, two keys are stored and
    completed, then the stalled job ends. True if both keys still load their own bytes.
    """
    rig.fill(0, 0xAA)
    gate = rig.faults.stall(next_job(rig))
    stalled = rig.offloader.store(["a"], [0])
    assert stalled is not None
    rig.offloader.abandon(stalled)
    assert rig.offloader.lookup("a") is Lookup.MISS
    expected = {"b": rig.fill(1, 0xBB), "c": rig.fill(2, 0xCC)}
    later = rig.offloader.store(["b", "c"], [1, 2])
    assert later is not None and rig.offloader.wait([later], timeout=HOLD)
    rig.offloader.poll()
    gate.set()  # the stalled job now copies into its slot, late
    (late,) = rig.settle(stalled)
    assert late.plan == stalled and late.abandoned
    return all(torch.equal(rig.loaded(key, 5), data) for key, data in expected.items())


def test_an_abandoned_store_keeps_its_slot_until_its_job_ends() -> None:
    rig = Rig.build(cpu_blocks=3)
    assert abandon_a_stalled_store_then_reuse_the_pool(rig)
    assert rig.manager.stats().quarantined == 0 and rig.manager.num_free_blocks == 1
    assert rig.offloader.transfer_stats().finished_abandoned == 1
    rig.close()


@pytest.mark.parametrize("bug", share(FAULTS), ids=lambda bug: bug.name)
def test_the_fault_scenario_finds_its_share_of_the_catalogue(bug: Planted) -> None:
    """The same history with the slot freed at abandon: the late write lands in a block
    that now holds another key. This is what the quarantine prevents.
    """
    assert isinstance(bug.subject, ManagerBug)
    rig = Rig.build(cpu_blocks=3, manager=bug.subject.make(3))
    assert not abandon_a_stalled_store_then_reuse_the_pool(rig)
    rig.close()


def test_a_reset_does_not_wait_for_abandoned_jobs_and_keeps_their_slots() -> None:
    """vLLM #48090: a reset while a job is stalled neither hangs nor lets the old job
    corrupt a key stored again after it (the ABA hazard).
    """
    rig = Rig.build(cpu_blocks=2)
    rig.fill(0, 0x11)
    gate = rig.faults.stall(next_job(rig))
    stalled = must(rig.offloader.store(["k"], [0]))
    with pytest.raises(TransferTimeoutError):
        rig.offloader.reset(timeout=0.05)
    assert rig.offloader.lookup("k") is Lookup.PENDING and rig.offloader.num_in_flight == 1
    rig.offloader.abandon(stalled)
    assert rig.offloader.reset(timeout=HOLD) == []
    stats = rig.manager.stats()
    assert (stats.free, stats.quarantined, stats.resets) == (1, 1, 1)  # it survives the reset
    new = rig.fill(1, 0x22)
    again = must(rig.offloader.store(["k"], [1]))  # the same key, stored anew
    assert again.block_ids != stalled.block_ids
    assert rig.offloader.wait([again], timeout=HOLD) and rig.offloader.poll()
    gate.set()
    (late,) = rig.settle(stalled)
    assert late.abandoned and rig.offloader.lookup("k") is Lookup.HIT
    assert torch.equal(rig.loaded("k", 5), new)
    assert rig.manager.stats().quarantined == 0 and rig.manager.num_free_blocks == 1
    rig.manager.check_invariants()
    rig.close()


def test_close_with_a_stalled_job_times_out_and_stays_open() -> None:
    rig = Rig.build(cpu_blocks=2)
    gate = rig.faults.stall(next_job(rig))
    rig.offloader.store(["a"], [0])
    with pytest.raises(TransferTimeoutError):
        rig.offloader.close(timeout=0.05)
    assert not rig.offloader.engine.closed and rig.offloader.lookup("a") is Lookup.PENDING
    gate.set()
    rig.offloader.close(timeout=HOLD)
    assert rig.offloader.lookup("a") is Lookup.HIT
    with pytest.raises(EngineClosedError):
        rig.offloader.store(["b"], [1])


class CountingLru(LruPolicy):
    """LRU that counts how often it is asked for victims."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.asked = 0

    def choose_victims(self, need: int, protected: Container[Key]) -> list[Key] | None:
        self.asked += 1
        return super().choose_victims(need, protected)


@pytest.mark.parametrize("held_by", ["loads", "stores"])
def test_a_pool_held_by_stalled_jobs_refuses_a_store_at_once(held_by: str) -> None:
    """LMCache #2942: with every block pinned (or pending) by jobs that do not finish, a
    store fails fast, in O(1) without asking the policy, and waits for nothing.
    """
    rig = Rig.build(cpu_blocks=3, manager=OffloadManager(3, CountingLru))
    if held_by == "loads":
        rig.offloader.store(["a", "b", "c"], [0, 1, 2])
        rig.settle()
    for index, key in enumerate("abc"):
        rig.faults.stall(next_job(rig))
        if held_by == "loads":
            rig.offloader.load([key], [3 + index])
        else:
            rig.offloader.store([key], [index])
    answers: list[StorePlan | None] = []
    storing = threading.Thread(target=lambda: answers.append(rig.offloader.store(["x"], [7])))
    storing.start()
    storing.join(HOLD)
    assert not storing.is_alive() and answers == [None]
    stats = rig.manager.stats()
    assert (stats.evictable, stats.fast_fail_rejections) == (0, 1)
    policy = rig.manager.policy
    assert isinstance(policy, CountingLru) and policy.asked == 0
    rig.close()


# -- end to end: every fault at random, mirrored in the spec ---------------------------------

KEYS = range(5)
keys_lists = st.lists(st.sampled_from(KEYS), min_size=1, max_size=3)
fail_at = st.integers(0, 15).map(lambda n: n if n < 4 else None)  # a run of 4, 1 job in 4


@dataclass
class Flight:
    """A plan in flight, and what the test expects of its job."""

    model_plan: StorePlan | LoadPlan
    job: int
    blocks: list[int]  # device blocks the job reads (store) or writes (load)
    contents: list[torch.Tensor]  # store: each key's bytes; load: the bytes that must land
    gate: threading.Event | None  # set when the job may go on; None if never held
    abandoned: bool = False

    @property
    def held(self) -> bool:
        return self.gate is not None and not self.gate.is_set()


class FaultyOffloader(RuleBasedStateMachine):
    """Stores and loads whose jobs fail (half-way), stall, are released out of order or
    abandoned; polls and resets in between. The spec's model gets every manager call; after
    every step each readable key's CPU block and each idle device block hold their bytes.
    """

    @initialize(cpu_blocks=st.integers(1, 4), policy=st.sampled_from(["lru", "arc"]))
    def build(self, cpu_blocks: int, policy: str) -> None:
        self.rig = Rig.build(cpu_blocks, manager=OffloadManager(cpu_blocks, policy))
        self.model = OffloadModel(cpu_blocks, policy)
        self.flights: dict[int, Flight] = {}  # plan id ->
        self.stored: dict[Key, tuple[int, torch.Tensor]] = {}  # readable key -> slot, bytes
        self.device: dict[int, torch.Tensor | None] = {b: self.rig.block(b) for b in range(8)}
        self.noise = torch.randint(0, 256, (self.rig.block(0).numel(),), dtype=torch.int32)
        self.version = 0

    # -- helpers ---------------------------------------------------------------------------

    def idle_blocks(self, count: int, start: int) -> list[int] | None:
        """``count`` device blocks no job uses, from ``start`` on (wrapping around)."""
        busy = {block for flight in self.flights.values() for block in flight.blocks}
        idle = [block for block in range(start, start + 8) if block % 8 not in busy]
        idle = [block % 8 for block in idle]
        return idle[:count] if len(idle) >= count else None

    def arm(
        self, plan: StorePlan | LoadPlan | None, stall: bool, fail: int | None
    ) -> tuple[int, threading.Event | None]:
        """Faults for the job the next submission gets (one with runs: the hook needs one)."""
        job = next_job(self.rig)
        if plan is None or not plan.keys:
            return job, None
        if fail is not None:
            self.rig.faults.fail(job, fail)
        return job, self.rig.faults.stall(job) if stall else None

    def ready(self) -> list[int]:
        return [key for key in KEYS if self.model.lookup(key) is Lookup.HIT]

    # -- rules -----------------------------------------------------------------------------

    @rule(
        keys=keys_lists,
        start=st.integers(0, 7),
        stall=st.booleans(),
        fail=fail_at,
        now=st.booleans(),
    )
    def store(self, keys: list[int], start: int, stall: bool, fail: int | None, now: bool) -> None:
        """Store keys from idle device blocks; ``now``: then poll what can finish."""
        blocks = self.idle_blocks(len(keys), start)
        if blocks is None:
            return
        self.version += 1
        contents = []
        for key, block in zip(keys, blocks, strict=True):
            data = ((self.noise + key * 131 + self.version * 29) % 256).to(torch.uint8)
            self.rig.write(block, data)
            self.device[block] = data
            contents.append(data)
        model_plan = self.model.prepare_store(keys)
        job, gate = self.arm(model_plan, stall, fail)
        plan = self.rig.offloader.store(keys, blocks)
        assert plan == model_plan, f"offloader planned {plan}, the spec {model_plan}"
        if plan is None or model_plan is None:
            return
        first: dict[Key, int] = {key: index for index, key in reversed(list(enumerate(keys)))}
        kept = [contents[first[key]] for key in plan.keys]
        self.flights[plan.plan_id] = Flight(model_plan, job, blocks, kept, gate)
        event(f"store of {len(plan.keys)} keys{', held' if gate else ''}")
        if now:
            self.poll()

    @precondition(lambda self: bool(self.ready()))
    @rule(
        data=st.data(),
        start=st.integers(0, 7),
        stall=st.booleans(),
        fail=fail_at,
        now=st.booleans(),
    )
    def load(
        self, data: st.DataObject, start: int, stall: bool, fail: int | None, now: bool
    ) -> None:
        keys = data.draw(st.lists(st.sampled_from(self.ready()), min_size=1, max_size=3))
        blocks = self.idle_blocks(len(keys), start)
        if blocks is None:
            return
        model_plan = self.model.prepare_load(keys)
        job, gate = self.arm(model_plan, stall, fail)
        plan = self.rig.offloader.load(keys, blocks)
        assert plan == model_plan, f"offloader planned {plan}, the spec {model_plan}"
        landing = [self.stored[key][1] for key in keys]
        self.flights[plan.plan_id] = Flight(model_plan, job, blocks, landing, gate)
        event(f"load of {len(keys)} keys{', held' if gate else ''}")
        if now:
            self.poll()

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        """A held job goes on: it may finish long after jobs submitted after it."""
        held = [flight for flight in self.flights.values() if flight.held]
        if not held:
            return
        flight = data.draw(st.sampled_from(held))
        assert flight.gate is not None
        flight.gate.set()

    @rule(data=st.data(), now=st.integers(0, 2))
    def abandon(self, data: st.DataObject, now: int) -> None:
        """Give up on a plan in flight, held or not: its job may still end, late."""
        candidates = [flight for flight in self.flights.values() if not flight.abandoned]
        if now or not candidates:  # now and then: abandoning every plan would leave no hits
            return
        flight = data.draw(st.sampled_from(candidates))
        plan = self.rig.offloader._plans[flight.job]
        self.rig.offloader.abandon(plan)
        self.model.abandon(flight.model_plan)
        flight.abandoned = True
        event(f"abandoned a {'held' if flight.held else 'running'} {type(plan).__name__}")

    @rule()
    def poll(self) -> None:
        """Wait for every job that can finish, then complete what finished."""
        plans = self.rig.offloader._plans
        movable = [plans[f.job] for f in self.flights.values() if not f.held]
        assert self.rig.offloader.wait(movable, timeout=HOLD)
        self.complete(self.rig.offloader.poll())

    @rule(now=st.integers(0, 3))
    def reset(self, now: int) -> None:
        if now:  # resets are rare: a reset every few steps would hide longer histories
            return
        if any(flight.held and not flight.abandoned for flight in self.flights.values()):
            before = (self.rig.offloader.num_in_flight, every_field(self.rig.manager))
            with pytest.raises(TransferTimeoutError):
                self.rig.offloader.reset(timeout=0.01)
            assert (self.rig.offloader.num_in_flight, every_field(self.rig.manager)) == before
            return
        # A reset does not wait for abandoned jobs, so whether a running one is among its
        # finished plans would be the threads' timing; Hypothesis needs each step to be
        # repeatable. Let every job that can end, end: only held jobs remain in flight.
        plans = self.rig.offloader._plans
        assert self.rig.offloader.wait(
            [plans[f.job] for f in self.flights.values() if not f.held], timeout=HOLD
        )
        self.complete(self.rig.offloader.reset(timeout=HOLD))
        self.model.reset_cache()
        self.stored.clear()

    @rule(keys=keys_lists)
    def touch(self, keys: list[int]) -> None:
        self.rig.offloader.touch(keys)
        self.model.touch(keys)

    def complete(self, finished: list[Finished]) -> None:
        for done in finished:
            flight = self.flights.pop(done.plan.plan_id)
            assert done.abandoned == flight.abandoned
            assert done.result.ok == (flight.job not in self.rig.faults.failed), done.result
            event(f"finished {'abandoned' if done.abandoned else 'ok' if done.ok else 'failed'}")
            plan = flight.model_plan
            if isinstance(plan, StorePlan):
                self.model.complete_store(plan, success=done.result.ok)
                if done.ok and plan.generation == self.model.state.generation:
                    kept = zip(plan.keys, plan.block_ids, flight.contents, strict=True)
                    for key, slot, data in kept:
                        self.stored[key] = (slot, data)
            else:
                self.model.complete_load(plan)
                for block, data in zip(flight.blocks, flight.contents, strict=True):
                    self.device[block] = data if done.ok else None  # else: undefined bytes

    # -- after every step ------------------------------------------------------------------

    @invariant()
    def agrees_with_the_spec(self) -> None:
        manager, model = self.rig.manager, self.model
        manager.check_invariants()
        model.check_invariants()
        assert [manager.lookup(key) for key in KEYS] == [model.lookup(key) for key in KEYS]
        counts = (manager.num_free_blocks, manager.num_evictable_blocks)
        assert counts == (model.num_free_blocks, model.num_evictable_blocks)
        assert manager.num_quarantined_blocks == model.num_quarantined_blocks
        assert self.rig.offloader.num_in_flight == len(self.flights)

    @invariant()
    def bytes_are_where_they_belong(self) -> None:
        pool = self.rig.offloader.engine.pool.tensor
        for key, (slot, data) in self.stored.items():
            if self.model.lookup(key) is Lookup.HIT:  # else evicted, dropped or stored anew
                assert torch.equal(pool[slot], data), f"CPU block {slot} of {key!r} changed"
        busy = {block for flight in self.flights.values() for block in flight.blocks}
        for block, expected in self.device.items():
            if block not in busy and expected is not None:
                assert torch.equal(self.rig.block(block), expected), f"device block {block}"

    def teardown(self) -> None:
        if hasattr(self, "rig"):
            self.rig.close()


TestFaultyOffloader = pytest.mark.slow(FaultyOffloader.TestCase)
