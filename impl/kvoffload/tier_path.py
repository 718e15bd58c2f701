"""The path from the CPU pool through the tiers behind it: write-back, fetch, promotion.

An :class:`~kvoffload.offloader.Offloader` made with ``tiers=[first, second, ...]`` (or
``remote=store``, one tier) hands this path its stores, in order, and calls it at the
points where the pool meets them (docs/spec.md, "Tiers in order"):

- **write-back** (or write-through): the bytes of the blocks the pool evicts (stores) are
  copied once into a staging buffer of the write's own, before anything may write their
  block ids again, and written to *every* tier;
- **fetch**: a CPU miss becomes a store plan whose job asks the tiers in order, each only
  for the keys the tiers before it did not have, reading straight into the plan's CPU
  block; the plan completes (in ``poll``) successful if some tier held a valid value;
- **promotion**: a block a lower tier served is written to the tiers above it, from its
  CPU block while the plan still holds it, so that the next miss finds it higher up.

So the tiers are inclusive by intent and independent in fact: each bounds and evicts its
blocks on its own, none ever drops a block because another holds it, and a block may be in
any of them. Each tier has a worker thread (a :class:`~kvoffload.tiers.RemoteTier`) for
its writes; a fetch runs on the first tier's worker, asking the next tiers from there.
Nothing here ever waits on a tier on the caller's thread.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Literal

from kvoffload.transfer.jobs import Direction, JobResult
from kvoffload_spec.errors import InvalidArgumentError
from kvoffload_spec.surface import Key, Lookup, ManagerOperations, StorePlan

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvoffload.tiers import RemoteJob, RemoteStats, RemoteStore, RemoteTier
    from kvoffload.tiers.store import Payload, WritableBuffer
    from kvoffload.tiers.values import Namespace
    from kvoffload.transfer.pool import CpuBlockPool

RemoteMode = Literal["write-back", "write-through"]
REMOTE_MODES: tuple[RemoteMode, ...] = ("write-back", "write-through")


class NoRemoteTierError(InvalidArgumentError):
    """``fetch`` was called on an offloader made without ``remote=`` or ``tiers=``."""


@dataclass(frozen=True)
class RemoteOffloadStats:
    """What an offloader did with a tier (a snapshot), and its store's counters.

    Keys fetched: ``fetch_hits + fetch_misses == fetch_keys`` once every fetch reported (a
    miss: the tier had no valid value, was down or slow, or the queue was full). Keys
    written: ``written + not_written == write_keys`` once every write reported.
    """

    mode: RemoteMode
    fetch_calls: int = 0
    fetch_keys: int = 0  # keys sent to the tier (absent locally, and a CPU block found)
    fetch_hits: int = 0  # accepted: the CPU block holds the exact bytes, the key is ready
    fetch_misses: int = 0
    fetch_bytes: int = 0
    fetch_skipped: int = 0  # asked for, but resident or pending here already: not sent
    fetch_no_room: int = 0  # asked for, but no CPU block could be freed for it
    write_keys: int = 0  # evicted (write-back) or stored (write-through) keys submitted
    written: int = 0  # acknowledged by the tier
    not_written: int = 0  # failed, timed out, refused, or dropped (the queue was full)
    written_bytes: int = 0
    jobs_dropped: int = 0  # jobs that found the queue full
    in_flight: int = 0  # jobs not reported yet
    promoted: int = 0  # of write_keys: blocks a lower tier served, written up to this one
    store: RemoteStats | None = None  # the store's own counters (failures, timeouts, ...)

    @property
    def failures(self) -> int:
        """Failures the store met (timeouts, connection errors, error replies, I/O)."""
        return 0 if self.store is None else self.store.failures


class Served(list[bool]):
    """A fetch's answers, per key, and the tier that served each one (-1: none)."""

    def __init__(self, tiers: list[int]) -> None:
        super().__init__(tier >= 0 for tier in tiers)
        self.tiers = tiers


class Cascade:
    """The first tier's store, as its worker sees it: its writes are the first store's, its
    reads go on down the tiers, each asked only for what the ones before it missed."""

    def __init__(self, stores: Sequence[RemoteStore]) -> None:
        self.stores = list(stores)

    @property
    def namespace(self) -> Namespace:
        return self.stores[0].namespace

    def get_into(self, keys: Sequence[Hashable], buffers: Sequence[WritableBuffer]) -> Served:
        served = [-1] * len(keys)
        left = list(range(len(keys)))
        for tier, store in enumerate(self.stores):
            if not left:
                break
            try:
                found = store.get_into([keys[i] for i in left], [buffers[i] for i in left])
            except Exception:  # a store must not raise; if one does, the next tiers still answer
                found = [False] * len(left)
            for i, ok in zip(left, found, strict=True):
                if ok:
                    served[i] = tier
            left = [i for i in left if served[i] < 0]
        return Served(served)

    def put(self, keys: Sequence[Hashable], values: Sequence[Payload]) -> list[bool]:
        return self.stores[0].put(keys, values)

    def get(self, keys: Sequence[Hashable]) -> list[memoryview | None]:
        return self.stores[0].get(keys)

    def contains(self, keys: Sequence[Hashable]) -> list[bool]:
        return self.stores[0].contains(keys)

    def delete(self, keys: Sequence[Hashable]) -> list[bool]:
        return self.stores[0].delete(keys)

    def stats(self) -> RemoteStats:
        return self.stores[0].stats()

    def close(self) -> None:
        """The stores are the caller's: nothing to close here."""


def stop_workers(workers: Sequence[RemoteTier]) -> None:
    """Stop each worker thread (a second call does nothing)."""
    for worker in workers:
        worker.close()


@dataclass(frozen=True)
class FetchDone:
    """A fetch plan whose job reported: ``tier`` served it (-1: none did)."""

    plan: StorePlan
    result: JobResult
    abandoned: bool
    tier: int


def check_tiers(
    remote: object, tiers: object, mode: object, max_pending: object
) -> list[RemoteStore]:
    """The stores behind the pool, in order (``remote`` is ``tiers=[remote]``)."""
    if mode not in REMOTE_MODES:
        raise InvalidArgumentError(f"remote_mode must be one of {REMOTE_MODES}, got {mode!r}")
    if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
        raise InvalidArgumentError(f"remote_max_pending must be an int >= 1, got {max_pending!r}")
    if remote is not None and tiers is not None:
        raise InvalidArgumentError("give remote= or tiers=, not both (remote=s is tiers=[s])")
    if tiers is None:
        given: list[object] = [] if remote is None else [remote]
    elif isinstance(tiers, (list, tuple)):
        given = list(tiers)
    else:
        raise InvalidArgumentError(f"tiers must be a list of stores, got {tiers!r}")
    if not given:
        return []
    from kvoffload.tiers.store import RemoteStore

    stores: list[RemoteStore] = []
    for store in given:
        if not isinstance(store, RemoteStore):
            name = "remote" if tiers is None else "each of tiers"
            raise InvalidArgumentError(
                f"{name} must be a RemoteStore (a kvoffload.tiers.ValkeyStore or DiskStore), "
                f"got {store!r}"
            )
        stores.append(store)
    if len({id(store) for store in stores}) != len(stores):
        raise InvalidArgumentError("a store is named twice in tiers")
    return stores


class TierPath:
    """The tiers behind one CPU pool (see the module docstring). Not thread-safe: the
    offloader calls it under its lock."""

    def __init__(
        self,
        stores: Sequence[RemoteStore],
        pool: CpuBlockPool,
        *,
        mode: RemoteMode,
        max_pending: int,
    ) -> None:
        from kvoffload.tiers.background import RemoteTier

        self.stores = list(stores)
        self.mode: RemoteMode = mode
        self._pool = pool
        names = [f"kvoffload-tier-{n}" for n in range(len(stores))] if len(stores) > 1 else None
        self.workers: list[RemoteTier] = [
            RemoteTier(
                Cascade(stores) if n == 0 else store,
                max_pending=max_pending,
                name=names[n] if names else "kvoffload-remote",
            )
            for n, store in enumerate(stores)
        ]
        self._fetch_of: dict[int, RemoteJob] = {}  # fetch plan id -> its job, in flight
        self._fetch_plans: dict[int, list[StorePlan]] = {}  # fetch job id -> its plans
        self._fetch_started: dict[int, float] = {}  # fetch plan id -> time.monotonic()
        self._puts: dict[tuple[int, int], RemoteJob] = {}  # (tier, job id) -> write job
        self._path: Counter[str] = Counter()  # fetch_calls, fetch_skipped, fetch_no_room
        self._tier: list[Counter[str]] = [Counter() for _ in stores]

    # -- keys ------------------------------------------------------------------------------

    @staticmethod
    def check_keys(keys: Sequence[Key]) -> None:
        """Keys a tier cannot hold are refused before the manager sees them: a key's
        write-back, later, must not fail for its type."""
        from kvoffload.tiers.values import encode_key

        for key in keys:
            encode_key(key)

    # -- writes ----------------------------------------------------------------------------

    def write_back(self, plans: Sequence[StorePlan]) -> None:
        """Send the victims of ``plans`` to every tier in one write each, with the bytes
        their block ids hold now: call before anything may write those block ids (the
        plans' own jobs)."""
        if self.mode != "write-back":
            return
        keys: list[Key] = []
        block_ids: list[int] = []
        for plan in plans:
            if len(plan.evicted_block_ids) != len(plan.evicted_keys):
                # A manager of the caller's that does not say where its victims were: their
                # bytes cannot be found, so they are not written (counted as not written).
                for counts in self._tier:
                    counts["not_written"] += len(plan.evicted_keys)
                continue
            keys += plan.evicted_keys
            block_ids += plan.evicted_block_ids
        if keys:
            self._put(range(len(self.workers)), keys, block_ids)

    def write_through(self, manager: ManagerOperations, plan: StorePlan) -> None:
        if self.mode != "write-through":
            return
        ready = [
            (key, block_id)
            for key, block_id in zip(plan.keys, plan.block_ids, strict=True)
            if manager.lookup(key) is Lookup.HIT
        ]
        if ready:
            keys, block_ids = zip(*ready, strict=True)
            self._put(range(len(self.workers)), keys, block_ids)

    def _put(self, tiers: Sequence[int], keys: Sequence[Key], block_ids: Sequence[int]) -> None:
        """Copy the CPU blocks ``block_ids`` (a staging copy the write jobs own: the pool's
        block ids are reused at once), and submit their write under ``keys`` to ``tiers``."""
        import torch

        ids = torch.as_tensor(list(block_ids), dtype=torch.int64)
        staging = self._pool.tensor.index_select(0, ids).numpy()
        values = [staging[i] for i in range(len(keys))]
        for tier in tiers:
            job = self.workers[tier].submit_put(list(keys), values)
            self._puts[(tier, job.job_id)] = job
            self._tier[tier]["write_keys"] += len(keys)

    # -- fetches ---------------------------------------------------------------------------

    def fetch(
        self,
        manager: ManagerOperations,
        keys: Sequence[Key],
        write_back: Callable[[Sequence[StorePlan]], None],
    ) -> list[StorePlan]:
        """Plan a CPU block for each absent key (``write_back`` their victims first) and
        queue one read of them all down the tiers; the plans."""
        self._path["fetch_calls"] += 1
        plans: list[StorePlan] = []
        try:
            for key in dict.fromkeys(keys):
                if manager.lookup(key) is not Lookup.MISS:
                    self._path["fetch_skipped"] += 1
                    continue
                plan = manager.prepare_store([key])
                if plan is None:
                    self._path["fetch_no_room"] += 1
                    break
                if not plan.keys:  # a store_threshold not reached yet: nothing to fetch
                    manager.complete_store(plan, success=False)
                    continue
                plans.append(plan)
                self._check_fetch_plan(plan)
            if plans:  # one job writes them all: no block id twice
                from kvoffload.transfer.engine import as_block_ids, require_distinct

                ids = [plan.block_ids[0] for plan in plans]
                require_distinct(
                    "cpu_block_ids", as_block_ids("cpu_block_ids", ids, self._pool.num_blocks)
                )
        except BaseException:
            # A manager of the caller's planned a bad block id: nothing is sent, and every
            # plan made so far ends, or its key would stay pending for ever.
            try:
                write_back(plans)  # their victims' bytes: nothing wrote them yet
            finally:
                for plan in plans:
                    manager.complete_store(plan, success=False)
            raise
        if plans:
            # The victims of them all in one write, queued (and copied) before the fetch
            # that may write their block ids.
            write_back(plans)
            rows = self._pool.tensor.numpy()
            buffers = [memoryview(rows[plan.block_ids[0]]) for plan in plans]
            job = self.workers[0].submit_get([plan.keys[0] for plan in plans], buffers)
            self._fetch_plans[job.job_id] = plans
            started = time.monotonic()
            for plan in plans:
                self._fetch_of[plan.plan_id] = job
                self._fetch_started[plan.plan_id] = started
        return plans

    def _check_fetch_plan(self, plan: StorePlan) -> None:
        """A fetch plan stores one key: one block id, in the pool (the store path checks
        its plans so in the Offloader's ``_pool_ids``)."""
        from kvoffload.transfer.engine import as_block_ids

        if len(plan.block_ids) != len(plan.keys):
            raise InvalidArgumentError(
                f"a fetch plan of {len(plan.keys)} key needs as many block ids, got "
                f"{len(plan.block_ids)}"
            )
        as_block_ids("cpu_block_ids", plan.block_ids, self._pool.num_blocks)

    def poll(
        self, manager: ManagerOperations, complete: Callable[[StorePlan, bool], None]
    ) -> list[FetchDone]:
        """Account for the writes that reported; ``complete`` each fetch plan whose job
        reported (``accepted``: some tier served it), promoting what a lower tier served."""
        finished: list[FetchDone] = []
        block_bytes = self._pool.block_bytes
        now = time.monotonic()
        for tier, worker in enumerate(self.workers):
            for job in worker.poll():
                if job.kind == "put":
                    if self._puts.pop((tier, job.job_id), None) is None:
                        continue
                    stored = sum(job.result)
                    counts = self._tier[tier]
                    counts["written"] += stored
                    counts["not_written"] += len(job.keys) - stored
                    counts["written_bytes"] += stored * block_bytes
                    continue
                plans = self._fetch_plans.pop(job.job_id)
                served = getattr(job.result, "tiers", None)
                answers: list[int] = list(served) if served is not None else [-1] * len(plans)
                self._count_fetch(answers, ran=served is not None)
                self._promote(plans, answers)
                for plan, by in zip(plans, answers, strict=True):
                    del self._fetch_of[plan.plan_id]
                    started = self._fetch_started.pop(plan.plan_id)
                    abandoned = manager.is_abandoned(plan)  # before the completion ends it
                    accepted = by >= 0
                    complete(plan, accepted)
                    nbytes = block_bytes if accepted else 0
                    result = JobResult(job.job_id, Direction.STORE, accepted, nbytes, now - started)
                    finished.append(FetchDone(plan, result, abandoned, by))
        return finished

    def _count_fetch(self, answers: list[int], *, ran: bool) -> None:
        block_bytes = self._pool.block_bytes
        last = len(self.workers) - 1
        for by in answers:
            # The tiers asked: down to the one that served, or all of them (a dropped or
            # failed job asked only the first, in vain).
            asked = by if by >= 0 else (last if ran else 0)
            for tier in range(asked + 1):
                counts = self._tier[tier]
                counts["fetch_keys"] += 1
                hit = tier == by
                counts["fetch_hits" if hit else "fetch_misses"] += 1
                counts["fetch_bytes"] += block_bytes if hit else 0

    def _promote(self, plans: list[StorePlan], answers: list[int]) -> None:
        """Write each block a lower tier served to the tiers above it, from its CPU block
        (still held by its plan: nothing else can have written it)."""
        below = sorted({by for by in answers if by > 0})
        for by in below:
            chosen = [plan for plan, got in zip(plans, answers, strict=True) if got == by]
            self._put(range(by), [p.keys[0] for p in chosen], [p.block_ids[0] for p in chosen])
            for tier in range(by):
                self._tier[tier]["promoted"] += len(chosen)

    # -- what is in flight -----------------------------------------------------------------

    def fetch_job(self, plan: object) -> RemoteJob | None:
        """The job of ``plan`` if it is a fetch in flight here."""
        if not isinstance(plan, StorePlan):
            return None
        job = self._fetch_of.get(plan.plan_id)
        if job is None or plan not in self._fetch_plans.get(job.job_id, ()):
            return None
        return job

    def held(self, job: RemoteJob, plan: StorePlan) -> StorePlan:
        """The plan object held here equal to ``plan`` (the caller's may be a twin)."""
        return next(held for held in self._fetch_plans[job.job_id] if held == plan)

    def is_fetch(self, plan_id: int) -> bool:
        return plan_id in self._fetch_of

    def fetch_count(self) -> int:
        return len(self._fetch_of)

    def fetch_jobs(self) -> list[RemoteJob]:
        """Every fetch job in flight, once each."""
        return list({id(job): job for job in self._fetch_of.values()}.values())

    def unabandoned_fetches(self, manager: ManagerOperations) -> list[RemoteJob]:
        """The fetch jobs in flight with a plan not abandoned."""
        jobs = {
            job_id: self._fetch_of[plans[0].plan_id]
            for job_id, plans in self._fetch_plans.items()
            if not all(map(manager.is_abandoned, plans))
        }
        return list(jobs.values())

    def writes(self) -> list[RemoteJob]:
        return list(self._puts.values())

    def stalled(self, manager: ManagerOperations, cutoff: float) -> list[tuple[float, StorePlan]]:
        """Fetch plans started at or before ``cutoff``, not abandoned, with their start."""
        return [
            (started, plan)
            for job in self._fetch_plans.values()
            for plan in job
            if (started := self._fetch_started[plan.plan_id]) <= cutoff
            and not manager.is_abandoned(plan)
        ]

    # -- counters and the end --------------------------------------------------------------

    def tier_stats(self) -> list[RemoteOffloadStats]:
        """Each tier's counters, in order; the path's own (calls, keys skipped, no room)
        are the first tier's."""
        found = []
        for tier, (worker, store) in enumerate(zip(self.workers, self.stores, strict=True)):
            counts = self._tier[tier] + (self._path if tier == 0 else Counter())
            in_flight = sum(1 for (at, _) in self._puts if at == tier) + (
                len(self._fetch_plans) if tier == 0 else 0
            )
            found.append(
                RemoteOffloadStats(
                    mode=self.mode,
                    jobs_dropped=worker.stats().dropped,
                    in_flight=in_flight,
                    store=store.stats(),
                    **counts,
                )
            )
        return found

    def stats(self) -> RemoteOffloadStats:
        """The path as one tier: a key fetched counts once (a hit if some tier served it),
        writes add up over the tiers; the store's counters where there is one store."""
        each = self.tier_stats()
        if len(each) == 1:
            return each[0]
        first = each[0]
        summed = {
            field.name: sum(getattr(tier, field.name) for tier in each)
            for field in fields(RemoteOffloadStats)
            if field.name
            in ("fetch_hits", "fetch_bytes", "write_keys", "written", "not_written",
                "written_bytes", "jobs_dropped", "in_flight", "promoted")
        }  # fmt: skip
        return RemoteOffloadStats(
            mode=self.mode,
            fetch_calls=first.fetch_calls,
            fetch_keys=first.fetch_keys,
            fetch_misses=first.fetch_keys - summed["fetch_hits"],
            fetch_skipped=first.fetch_skipped,
            fetch_no_room=first.fetch_no_room,
            **summed,
        )

    def close(self, wait: Callable[[list[RemoteJob]], object]) -> None:
        """Let the queued writes go out (``wait`` for them: each is bounded by its store's
        timeout), then stop the workers. The stores stay open: they are the caller's."""
        wait(self.writes())
        stop_workers(self.workers)
