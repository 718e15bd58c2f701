"""Threads: the Offloader shared by scheduler threads, a polling thread and a resetting one.

Several threads store, load, touch and look up keys while another polls and a third resets
now and then, on a threaded engine whose jobs sometimes fail. The manager behind the
offloader is wrapped in a recorder that notices two calls inside it at once (it yields the
GIL mid-call to invite one) and logs every call in the order the offloader's lock let them
through. Afterwards: no overlap, the manager's invariants hold, replaying the log on the
spec's model gives the same answer to every call, every plan was reported exactly once,
every load delivered its key's bytes and every readable key's CPU block holds them. The
same hammering of an offloader without its lock is caught, so the check can fail.

Ordering races need more than fast thread switching: a race whose window is a few bytecodes
wide (a job handed to its worker thread before it is registered as running; a reset that
waits for jobs outside the lock, so one can start before the reset) almost never shows. So
``Jitter`` injects seeded random pauses at the hand-off points (taking and releasing the
offloader's lock, right after a wait for jobs returns, right after a job is queued for its
worker, and inside the copies), from the test side only, and the checks look at ordering
directly: ``reset_cache`` must never run with a job in flight, and a job ``poll`` reported
must no longer count as running. Many seeds, each a short run; each planted race is caught.
Each race is also replayed under a fixed schedule that makes its hand-off go the bad way
(the worker finishing a job before ``submit`` returns; a store running between a reset's
wait and its reset), where the real code passes and the planted bug fails every time.
"""

from __future__ import annotations

import contextlib
import queue
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import pytest
import torch

from kvoffload import Finished, Offloader
from kvoffload.manager import OffloadManager
from kvoffload.transfer import engine as engine_module
from kvoffload.transfer.cpu import CpuBackend
from kvoffload.transfer.jobs import Job
from kvoffload_spec import OffloadModel
from kvoffload_spec.errors import BlockNotReadyError, OffloadError
from kvoffload_spec.surface import Key, LoadPlan, Lookup, Plan, StorePlan
from tests.jitter import Jitter
from tests.planted import RACES, Planted, share
from tests.planted.races import PlantedRace, RegistersAfterTheHandOff, ResetWaitsOutsideTheLock

WORKERS = 3
BLOCKS_EACH = 4  # device blocks a worker owns
KEYS = range(12)
HOLD = 60.0  # seconds a thread waits at most for a completion, so nothing hangs
OPERATIONS = 1000  # per worker: about a second on 2 cores


class Recorder:
    """The manager surface, logging each call and noticing calls that overlap."""

    def __init__(self, inner: OffloadManager) -> None:
        self.inner = inner
        self.log: list[tuple[str, tuple[object, ...], object]] = []
        self.overlaps = 0
        self.resets_with_jobs_in_flight = 0
        self.offloader: Offloader | None = None  # set once the offloader is built
        self._inside = False

    @property
    def num_blocks(self) -> int:
        return self.inner.num_blocks

    def _call(self, name: str, *args: object) -> object:
        if self._inside:
            self.overlaps += 1
        self._inside = True
        time.sleep(0)  # hand the GIL over: a second caller gets in here unless locked out
        try:
            outcome: object = getattr(self.inner, name)(*args)
        except OffloadError as error:
            outcome = error
        self._inside = False
        self.log.append((name, args, outcome))
        if isinstance(outcome, OffloadError):
            raise outcome
        return outcome

    def lookup(self, key: Key) -> Lookup:
        found = self._call("lookup", key)
        assert isinstance(found, Lookup)
        return found

    def prepare_store(self, keys: Sequence[Key]) -> StorePlan | None:
        plan = self._call("prepare_store", keys)
        assert plan is None or isinstance(plan, StorePlan)
        return plan

    def complete_store(self, plan: StorePlan, success: bool = True) -> None:
        self._call("complete_store", plan, success)

    def prepare_load(self, keys: Sequence[Key]) -> LoadPlan:
        plan = self._call("prepare_load", keys)
        assert isinstance(plan, LoadPlan)
        return plan

    def complete_load(self, plan: LoadPlan) -> None:
        self._call("complete_load", plan)

    def abandon(self, plan: Plan) -> None:
        self._call("abandon", plan)

    def is_abandoned(self, plan: Plan) -> bool:
        # A query that changes nothing: not logged (the log replays the changes).
        return self.inner.is_abandoned(plan)

    def touch(self, keys: Sequence[Key]) -> None:
        self._call("touch", keys)

    def reset_cache(self) -> None:
        # The offloader waits for every job (but the abandoned ones) before it resets: one
        # still running here would copy into a block id the manager is about to hand out again.
        if self.offloader is not None and self.offloader._unabandoned():
            self.resets_with_jobs_in_flight += 1
        self._call("reset_cache")


@dataclass
class Hammering:
    """What the threads saw; ``problems`` stays empty when all went right."""

    offloader: Offloader
    recorder: Recorder
    tensors: list[torch.Tensor]
    content: dict[Key, torch.Tensor]
    finished: dict[int, Finished] = field(default_factory=dict)  # plan id -> its report
    reported_twice: list[int] = field(default_factory=list)
    submitted: list[int] = field(default_factory=list)  # plan ids, any thread
    problems: list[str] = field(default_factory=list)
    done: threading.Condition = field(default_factory=threading.Condition)
    counts: dict[str, int] = field(default_factory=dict)
    hold: float = HOLD  # seconds a thread waits at most for a completion

    def report(self, finished: list[Finished]) -> None:
        with self.done:
            for each in finished:
                if each.plan.plan_id in self.finished:
                    self.reported_twice.append(each.plan.plan_id)
                self.finished[each.plan.plan_id] = each
            self.done.notify_all()

    def outcome(self, plan: Plan) -> Finished:
        with self.done:
            self.submitted.append(plan.plan_id)
            if not self.done.wait_for(lambda: plan.plan_id in self.finished, self.hold):
                raise TimeoutError(f"{plan} was never reported")
            return self.finished[plan.plan_id]

    def count(self, what: str) -> None:
        with self.done:
            self.counts[what] = self.counts.get(what, 0) + 1

    def block(self, block: int) -> torch.Tensor:
        return torch.cat([t[:, block].reshape(-1) for t in self.tensors])

    def write(self, block: int, data: torch.Tensor) -> None:
        offset = 0
        for tensor in self.tensors:
            part = tensor[:, block]
            part.copy_(data[offset : offset + part.numel()].reshape(part.shape))
            offset += part.numel()


def worker(state: Hammering, index: int, operations: int, seed: int) -> None:
    """A scheduler thread: stores its keys from, and loads keys into, its own blocks."""
    rng = random.Random(seed)
    offloader = state.offloader
    own = list(range(index * BLOCKS_EACH, (index + 1) * BLOCKS_EACH))
    for _ in range(operations):
        action = rng.choice(["store", "store", "load", "load", "touch", "lookup", "stalled"])
        keys = rng.sample(KEYS, rng.randint(1, 2))
        blocks = rng.sample(own, len(keys))
        if action == "store":
            for key, block in zip(keys, blocks, strict=True):
                state.write(block, state.content[key])
            plan = offloader.store(keys, blocks)
            state.count("store refused" if plan is None else "store")
            if plan is not None:
                state.outcome(plan)  # its device blocks may be reused only then
        elif action == "load":
            try:
                load = offloader.load(keys, blocks)
            except BlockNotReadyError:  # another thread evicted or reset it meanwhile
                state.count("load of a key not ready")
                continue
            done = state.outcome(load)
            state.count("load ok" if done.ok else "load failed")
            for key, block in zip(keys, blocks, strict=True):
                if done.ok and not torch.equal(state.block(block), state.content[key]):
                    state.problems.append(f"a load of {key!r} delivered other bytes")
        elif action == "touch":
            offloader.touch(keys)
        elif action == "lookup":
            offloader.lookup(keys[0])
        else:
            offloader.stalled(older_than=HOLD)


def guarded(state: Hammering, target: Callable[..., None], *args: object) -> None:
    """Run a thread's body; whatever it raises is a problem the test reports."""
    try:
        target(state, *args)
    except Exception as error:  # a thread's crash must fail the test, not just print
        state.problems.append(f"{target.__name__} raised {error!r}")


def poller(state: Hammering, stop: threading.Event) -> None:
    engine = state.offloader.engine
    while not stop.is_set():
        finished = state.offloader.poll()
        for each in finished:  # reported, so no wait may still be held up by it
            if not engine.wait([each.result.job_id], timeout=1e-6):
                state.problems.append(f"job {each.result.job_id} counts as running, reported")
        state.report(finished)
        time.sleep(0.0002)


def resetter(state: Hammering, stop: threading.Event, resets: int, every: float) -> None:
    for done in range(resets):
        # The first reset is made even when the workers finished first (a loaded machine
        # may not run this thread before they end): every run then holds at least one.
        if stop.wait(every) and done:
            return
        state.report(state.offloader.reset(timeout=state.hold))
        state.count("reset")


def hammer(
    policy: str,
    *,
    operations: int,
    lock: bool = True,
    seed: int = 0,
    hold: float = HOLD,
    jitter: Jitter | None = None,
    resets: int = 3,
    reset_every: float = 0.02,
    offloader_class: type[Offloader] = Offloader,
    backend_class: type[CpuBackend] = CpuBackend,
) -> Hammering:
    """Run the threads to the end; returns what they saw (``problems`` lists what broke).
    ``jitter`` pauses at the hand-off points; ``offloader_class`` and ``backend_class``
    replace the real ones (to plant bugs).
    """
    generator = torch.Generator().manual_seed(seed)
    tensors = [
        torch.randint(
            0, 256, (2, WORKERS * BLOCKS_EACH, 16), dtype=torch.uint8, generator=generator
        )
        for _ in range(2)
    ]
    recorder = Recorder(OffloadManager(6, policy))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine_module, "CpuBackend", backend_class)
        offloader = offloader_class(tensors, block_dim=1, manager=recorder, threaded=True)
    recorder.offloader = offloader
    if jitter is not None:
        jitter.install(offloader)
    if not lock:
        offloader._lock = contextlib.nullcontext()  # type: ignore[assignment]
    pause = jitter.pause if jitter is not None else None

    def hook(job: int, run: int) -> None:
        if pause is not None:
            pause()
        fail_some(job, run)

    offloader.engine.fault_hook = hook
    block_bytes = offloader.engine.layout.bytes_per_block
    content: dict[Key, torch.Tensor] = {
        key: torch.randint(0, 256, (block_bytes,), dtype=torch.uint8, generator=generator)
        for key in KEYS
    }
    state = Hammering(offloader, recorder, tensors, content, hold=hold)
    stop = threading.Event()
    threads = [
        threading.Thread(target=guarded, args=(state, worker, index, operations, seed * 10 + index))
        for index in range(WORKERS)
    ]
    helpers = [
        threading.Thread(target=guarded, args=(state, poller, stop)),
        threading.Thread(target=guarded, args=(state, resetter, stop, resets, reset_every)),
    ]
    with fast_switching():
        for thread in threads + helpers:
            thread.start()
        for thread in threads:
            thread.join(hold * 4)
        stop.set()
        for thread in helpers:
            thread.join(hold)
    if any(thread.is_alive() for thread in threads + helpers):
        state.problems.append("a thread never finished")
        return state
    if offloader.wait(timeout=hold):
        guarded(state, lambda state: state.report(offloader.poll()))
    else:
        state.problems.append("jobs never finished")
    if not offloader.engine.wait(timeout=1.0):  # all finished: no time should be needed
        state.problems.append("the engine counts jobs as running after every job finished")
    if recorder.resets_with_jobs_in_flight:
        state.problems.append(f"{recorder.resets_with_jobs_in_flight} resets with jobs in flight")
    return state


def fail_some(job: int, run: int) -> None:
    if job % 13 == 5 and run == 1:
        raise RuntimeError(f"injected into job {job}")


@contextlib.contextmanager
def fast_switching() -> Iterator[None]:
    """Switch threads every 10 us instead of 5 ms: far more interleavings per second."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def replay_on_the_spec(state: Hammering, policy: str) -> list[str]:
    """Replay the recorded manager calls on the spec: each answer must be the same."""
    model = OffloadModel(state.recorder.num_blocks, policy)
    plans: dict[int, Plan] = {}  # plan id -> the spec's plan
    mismatches = []
    for name, args, outcome in state.recorder.log:
        spec_args = [plans[arg.plan_id] if isinstance(arg, Plan) else arg for arg in args]
        try:
            expected: object = getattr(model, name)(*spec_args)
        except OffloadError as error:
            expected = error
        if isinstance(expected, Plan):
            plans[expected.plan_id] = expected
        same = (
            type(outcome) is type(expected)
            if isinstance(expected, OffloadError)
            else outcome == expected
        )
        if not same:
            mismatches.append(
                f"{name}{tuple(args)}: the manager gave {outcome!r}, the spec {expected!r}"
            )
    return mismatches


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_an_offloader_shared_by_threads_stays_consistent(policy: str) -> None:
    state = hammer(policy, operations=OPERATIONS)
    offloader, manager = state.offloader, state.recorder.inner
    assert state.problems == [] and state.recorder.overlaps == 0
    manager.check_invariants()
    assert replay_on_the_spec(state, policy) == []
    assert state.reported_twice == [] and offloader.num_in_flight == 0
    assert set(state.submitted) <= set(state.finished)
    offloader.engine.fault_hook = None
    for key in KEYS:  # every readable key's CPU block holds its bytes
        if manager.lookup(key) is Lookup.HIT:
            load = offloader.load([key], [0])
            assert offloader.wait([load], timeout=HOLD)
            (done,) = offloader.poll()
            assert done.ok and torch.equal(state.block(0), state.content[key]), key
    # the threads really did contend: stores, loads, failures and resets all happened
    counts = state.counts
    assert counts.get("store", 0) > 20 and counts.get("load ok", 0) > 20, counts
    assert (
        counts.get("reset", 0) >= 1
        and counts.get("load failed", 0) + len([f for f in state.finished.values() if not f.ok]) > 0
    ), counts
    offloader.close()


def test_without_its_lock_the_offloader_is_caught() -> None:
    state = hammer("lru", operations=60, lock=False, hold=2.0)
    broken = state.problems or state.recorder.overlaps or replay_on_the_spec(state, "lru")
    assert broken, "two threads used the manager at once and nothing noticed"
    with contextlib.suppress(OffloadError):
        state.offloader.close(timeout=HOLD)


# -- ordering races: jittered hand-offs, many seeds, and planted races they must catch ---------

SEEDS = 30
JITTERED_OPERATIONS = 60  # per worker and seed


def jittered(seed: int, hold: float = 5.0, **planted: object) -> Hammering:
    return hammer(
        "lru" if seed % 2 else "arc",
        operations=JITTERED_OPERATIONS,
        seed=seed,
        hold=hold,
        jitter=Jitter(seed),
        resets=8,
        reset_every=0.002,  # the first reset comes before the workers are done
        **planted,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("seed", range(SEEDS))
def test_jittered_hand_offs_keep_the_offloader_consistent(seed: int) -> None:
    state = jittered(seed)
    policy = "lru" if seed % 2 else "arc"
    assert state.problems == [] and state.recorder.overlaps == 0
    assert replay_on_the_spec(state, policy) == []
    assert state.reported_twice == [] and set(state.submitted) <= set(state.finished)
    assert state.counts.get("reset", 0) >= 1, state.counts
    state.offloader.close()


@pytest.mark.parametrize("entry", share(RACES), ids=lambda bug: bug.name)
def test_the_race_checks_find_their_share_of_the_catalogue(entry: Planted) -> None:
    race = entry.subject
    assert isinstance(race, PlantedRace)
    seen: list[str] = []
    for seed in range(SEEDS):  # stops at the first seed that catches it
        state = jittered(seed, hold=1.0, **race.planted)  # a planted race may stall jobs
        with contextlib.suppress(OffloadError):
            state.offloader.close(timeout=1.0)
        seen = [problem for problem in state.problems if race.caught_as in problem]
        if seen:
            break
    assert seen, f"{race.name}: not caught in {SEEDS} seeds"


# -- the same two races under a fixed schedule: each hand-off made to go the bad way ----------


def small_offloader(
    offloader_class: type[Offloader] = Offloader, backend_class: type[CpuBackend] = CpuBackend
) -> tuple[Offloader, Recorder]:
    tensors = [torch.zeros((2, 4, 16), dtype=torch.uint8) for _ in range(2)]
    recorder = Recorder(OffloadManager(4, "lru"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine_module, "CpuBackend", backend_class)
        offloader = offloader_class(tensors, block_dim=1, manager=recorder, threaded=True)
    recorder.offloader = offloader
    return offloader, recorder


class WorkerFirstQueue:
    """Queues a job, then holds the submitting thread until the worker has finished it:
    the schedule in which the worker wins the race against the rest of ``submit``."""

    def __init__(self, backend: CpuBackend, jobs: queue.SimpleQueue[Job | None]) -> None:
        self._backend = backend
        self._jobs = jobs

    def put(self, job: Job | None) -> None:
        self._jobs.put(job)
        if job is not None:
            with self._backend._changed:
                self._backend._changed.wait_for(lambda: job.job_id in self._backend._done, 5.0)


def worker_first_problems(backend_class: type[CpuBackend]) -> list[str]:
    offloader, _ = small_offloader(backend_class=backend_class)
    backend = offloader.engine._backend
    assert isinstance(backend, CpuBackend)
    backend._queues = {
        direction: WorkerFirstQueue(backend, jobs)  # type: ignore[misc]
        for direction, jobs in backend._queues.items()
    }
    problems = []
    plan = offloader.store(["a"], [0])
    assert plan is not None
    if not offloader.wait([plan], timeout=0.2):  # it finished: no time should be needed
        problems.append("a job the worker finished at once still counts as running")
    offloader.poll()
    if not offloader.engine.wait(timeout=0.2):
        problems.append("the engine counts a reported job as running")
    offloader.close(timeout=1.0)
    return problems


def store_during_reset_problems(offloader_class: type[Offloader]) -> list[str]:
    """A reset and a store on two threads, in the order: the reset's wait for jobs returns;
    the store runs as far as it can (to the end, unless the lock keeps it out); its job
    stays running; then the reset goes on. The reset must not run with that job in flight.
    """
    offloader, recorder = small_offloader(offloader_class)
    waited, store_stuck_or_done, release_job = (threading.Event() for _ in range(3))
    real_wait = offloader.engine.wait

    def wait_then_let_the_store_in(*args: object, **kwargs: object) -> bool:
        finished = real_wait(*args, **kwargs)  # type: ignore[arg-type]
        if threading.current_thread().name == "resetter":
            waited.set()
            store_stuck_or_done.wait(5.0)
        return finished

    offloader.engine.wait = wait_then_let_the_store_in  # type: ignore[method-assign]

    def hold_the_job(job: int, run: int) -> None:
        release_job.wait(5.0)

    offloader.engine.fault_hook = hold_the_job
    lock = offloader._lock

    class ReportingLock:
        """The offloader's lock, telling the schedule when the storer must wait for it."""

        def __enter__(self) -> None:
            if not lock.acquire(blocking=False):
                if threading.current_thread().name == "storer":
                    store_stuck_or_done.set()
                lock.acquire()

        def __exit__(self, *exc_info: object) -> None:
            lock.release()

    offloader._lock = ReportingLock()  # type: ignore[assignment]

    def store() -> None:
        waited.wait(5.0)
        offloader.store(["a"], [0])
        store_stuck_or_done.set()

    threads = [
        threading.Thread(target=offloader.reset, name="resetter"),
        threading.Thread(target=store, name="storer"),
    ]
    for thread in threads:
        thread.start()
    threads[0].join(10.0)
    release_job.set()
    threads[1].join(10.0)
    problems = [
        f"{n} resets with jobs in flight" for n in [recorder.resets_with_jobs_in_flight] if n
    ]
    offloader.wait(timeout=5.0)
    offloader.poll()
    offloader.close(timeout=5.0)
    return problems


def test_a_worker_that_wins_the_hand_off_leaves_nothing_running() -> None:
    assert worker_first_problems(CpuBackend) == []
    assert worker_first_problems(RegistersAfterTheHandOff) != []


def test_a_store_racing_a_reset_waits_for_it() -> None:
    assert store_during_reset_problems(Offloader) == []
    assert store_during_reset_problems(ResetWaitsOutsideTheLock) == ["1 resets with jobs in flight"]
