"""The object an engine integrates: the manager's bookkeeping plus the transfer engine.

``store`` and ``load`` ask the manager for a plan and submit its copy job; ``poll``
completes in the manager the plans whose jobs finished (a failed store completes with
``success=False``, so its keys never become readable); ``reset`` waits for every job in
flight before the manager forgets the pool, so no old copy can land in a reused block. A job
that seems never to finish can be ``abandon``-ed: the manager releases what its plan held
without reusing a block id the job may still write (see docs/reliability.md).

With ``tiers=[...]`` (:class:`~kvoffload.tiers.RemoteStore` s: a ``DiskStore``, a
``ValkeyStore``; ``remote=store`` is ``tiers=[store]``), tiers behind the pool, in order:
blocks the pool evicts are written to them (write-back; or every stored block,
write-through), and ``fetch`` reads absent keys from the first tier that has them into CPU
blocks, as store plans that ``poll`` reports (:mod:`kvoffload.tier_path`). The tiers are
called on worker threads only (docs/remote.md, docs/disk.md).

Every method may be called from any thread: one lock serializes them, so an engine's
scheduler thread and the thread that polls may share an offloader. See docs/integration.md.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from kvoffload.tier_path import (
    REMOTE_MODES,
    NoRemoteTierError,
    RemoteMode,
    RemoteOffloadStats,
    TierPath,
    check_tiers,
    stop_workers,
)
from kvoffload.transfer.engine import (
    TransferEngine,
    TransferTimeoutError,
    as_block_ids,
    require_distinct,
    require_pairs,
)
from kvoffload.transfer.jobs import Direction, JobResult
from kvoffload.transfer.runs import IdArray
from kvoffload_spec.defaults import DEFAULT_POLICY, DEFAULT_STALL_AFTER
from kvoffload_spec.errors import InvalidArgumentError, PlanAlreadyAbandonedError
from kvoffload_spec.surface import Key, LoadPlan, Lookup, ManagerOperations, Plan, StorePlan
from kvoffload_spec.validation import check_keys, check_seconds

if TYPE_CHECKING:
    import torch

    from kvoffload.policies.base import EvictionPolicy
    from kvoffload.stats import TransferStats
    from kvoffload.tiers import RemoteJob, RemoteStore
    from kvoffload.transfer.engine import BlockIds

# Defined with the tier path; importable from here as they always were.
__all__ = [
    "REMOTE_MODES",
    "Finished",
    "NoRemoteTierError",
    "Offloader",
    "PlanAges",
    "RemoteMode",
    "RemoteOffloadStats",
]


@runtime_checkable
class PlanAges(Protocol):
    """A manager that keeps the age of its open plans (``OffloadManager`` does): the
    offloader's ``stalled()`` reads them there rather than keeping a second ledger."""

    def stalled_plans(self, older_than: float | None = None) -> list[Plan]: ...


@dataclass(frozen=True)
class Finished:
    """A plan whose copy job finished; the manager has completed it already.

    ``abandoned``: the plan was abandoned before its job finished (late). Its keys were
    dropped (a store) or its pins released (a load) at ``abandon``; from now on the job can
    no longer touch its device blocks, which may be reused.
    ``fetched``: the plan is a ``fetch`` from the tiers (a store plan whose job read a
    tier, not the device); ``ok`` says whether the key is ready now, ``tier`` which tier
    (its index in ``tiers``) served it: None for a copy job or a fetch no tier served.
    """

    plan: Plan
    result: JobResult
    abandoned: bool = False
    fetched: bool = False
    tier: int | None = None

    @property
    def ok(self) -> bool:
        """False when the copy failed or the plan was abandoned: a store's keys were
        dropped, a load's device blocks hold undefined bytes and must be recomputed.
        """
        return self.result.ok and not self.abandoned


class Offloader:
    """Offloads KV blocks of ``kv_caches`` to a CPU pool and loads them back, by key.

    A key names one CPU block, which holds ``block_size_factor`` device blocks: ``store``
    and ``load`` take ``block_size_factor`` device block ids per key, in order. The pool has
    ``num_cpu_blocks`` blocks, or as many as ``cpu_bytes`` holds, or as many as ``manager``
    manages. Without ``manager``, an ``OffloadManager(num_blocks, policy)`` is built (the
    pool first: ``TransferEngine.for_cache`` builds it, and the engine).
    ``threaded`` runs CPU jobs on worker threads (CUDA jobs always run on streams).
    ``stall_after`` (seconds) is the age from which ``stalled()`` (and the built manager's
    ``stats()``) counts a plan in flight as stalled; its age is the manager's (by the
    manager's clock) where the manager keeps ages, as ``OffloadManager`` does.

    ``tiers``: stores behind the pool, in order (a ``DiskStore``, then a ``ValkeyStore``,
    say); ``remote``: one store, the same as ``tiers=[remote]`` (None and None: no tier,
    nothing else changes). ``remote_mode``: ``"write-back"`` writes each block the pool
    evicts to every tier, with the bytes it held when it was evicted; ``"write-through"``
    writes each block once its store succeeded (and nothing at eviction).
    ``remote_max_pending``: jobs queued at most per tier (a job that finds the queue full
    is dropped and counted, never waited for).
    """

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        *,
        num_cpu_blocks: int | None = None,
        cpu_bytes: int | None = None,
        block_dim: int | Sequence[int] = 0,
        block_size_factor: int = 1,
        policy: str | type[EvictionPolicy] = DEFAULT_POLICY,
        manager: ManagerOperations | None = None,
        prefault: bool = False,
        threaded: bool = False,
        stall_after: float = DEFAULT_STALL_AFTER,
        remote: RemoteStore | None = None,
        remote_mode: RemoteMode = "write-back",
        remote_max_pending: int = 64,
        tiers: Sequence[RemoteStore] | None = None,
    ) -> None:
        self._stall_after = check_seconds("stall_after", stall_after)
        stores = check_tiers(remote, tiers, remote_mode, remote_max_pending)
        if manager is not None and not isinstance(manager, ManagerOperations):
            raise InvalidArgumentError(
                f"manager must be an OffloadManager (or have its methods), got {manager!r}"
            )
        if manager is None:
            # Resolved first: an unknown policy fails before the pool is allocated.
            from kvoffload.policies.loading import resolve_policy

            policy_class = resolve_policy(policy)
        elif num_cpu_blocks is None and cpu_bytes is None:
            num_cpu_blocks = manager.num_blocks
        # The pool checks its size against this machine's memory before it allocates, and
        # before the manager, which allocates per block, is built.
        self.engine = TransferEngine.for_cache(
            kv_caches,
            num_cpu_blocks=num_cpu_blocks,
            cpu_bytes=cpu_bytes,
            block_dim=block_dim,
            block_size_factor=block_size_factor,
            prefault=prefault,
            threaded=threaded,
        )
        count = self.engine.pool.num_blocks
        try:
            if manager is None:
                from kvoffload.manager import OffloadManager

                manager = OffloadManager(count, policy_class, stall_after=stall_after)
            elif manager.num_blocks != count:
                raise InvalidArgumentError(
                    f"the manager manages {manager.num_blocks} blocks but the pool has {count}"
                )
        except BaseException:  # e.g. a policy's own constructor failed: release the pool
            self.engine.close()
            raise
        self.manager = manager
        # Every method runs under this lock (waits excepted): the manager and the job tables
        # are not safe to share between threads, and a reset must not let a job start.
        self._lock = threading.Lock()
        # The job handles, which only the offloader knows (docs/data_path.md, "One ledger"):
        self._plans: dict[int, Plan] = {}  # job id -> its plan, in flight
        self._job_of: dict[int, int] = {}  # plan id -> job id, in flight
        # Which of them were abandoned is the manager's ledger alone (``is_abandoned``).
        # Plan ages: the manager's own ledger where it keeps one; else, and only then, the
        # offloader's: job id -> time.monotonic() at submission, in flight.
        self._ages: PlanAges | None = manager if isinstance(manager, PlanAges) else None
        self._submitted_at: dict[int, float] = {}
        # The tiers' jobs, which the transfer engine does not know:
        self._tiers: TierPath | None = None
        if stores:
            self._tiers = TierPath(
                stores, self.engine.pool, mode=remote_mode, max_pending=remote_max_pending
            )
            # Dropped without close(): the workers are stopped all the same (each holds its
            # tier, the tier its store; once they end, the stores' own finalizers close
            # their sockets and files).
            weakref.finalize(self, stop_workers, list(self._tiers.workers))
        self._transfer_counts: Counter[str] = Counter()  # TransferStats' fields
        self._transfer_seconds: defaultdict[str, float] = defaultdict(float)

    @property
    def block_size_factor(self) -> int:
        return self.engine.block_size_factor

    @property
    def num_in_flight(self) -> int:
        """Plans submitted (fetches too) whose jobs ``poll`` has not reported yet."""
        return len(self._plans) + (0 if self._tiers is None else self._tiers.fetch_count())

    def lookup(self, key: Key) -> Lookup:
        with self._lock:
            return self.manager.lookup(key)

    def touch(self, keys: Sequence[Key]) -> None:
        """Mark ``keys`` recently used (the first key ends up the most recent)."""
        with self._lock:
            self.manager.touch(keys)

    def store(self, keys: Sequence[Key], device_block_ids: BlockIds) -> StorePlan | None:
        """Offload: plan to store ``keys`` and submit the copy of their device blocks.

        Returns the plan (its ``keys`` are those actually stored: absent ones, once each),
        or None when the pool cannot make room, and then nothing changed. The device blocks
        must not be overwritten until ``poll`` reports the plan finished.
        """
        with self._lock:
            return self._store(keys, device_block_ids)

    def _store(self, keys: Sequence[Key], device_block_ids: BlockIds) -> StorePlan | None:
        self.engine.require_open()
        keys = check_keys(keys)
        device = self._device_ids(device_block_ids, len(keys))
        if self._tiers is not None:
            self._tiers.check_keys(keys)
        plan = self.manager.prepare_store(keys)
        if plan is None:
            return None
        # Before the job is submitted: it may write a victim's block id at once.
        self._write_back([plan])
        try:
            position = {key: index for index, key in reversed(list(enumerate(keys)))}
            rows = [position[key] for key in plan.keys]
            source = device.reshape(-1, self.block_size_factor)[rows].ravel()
            cpu = self._pool_ids(plan, source)
            job = self.engine._submit_trusted(Direction.STORE, source, cpu)
        except BaseException:
            self.manager.complete_store(plan, success=False)
            raise
        self._track(plan, job)
        return plan

    def load(self, keys: Sequence[Key], device_block_ids: BlockIds) -> LoadPlan:
        """Load ``keys`` into ``device_block_ids`` (distinct), pinning their CPU blocks until
        the job finishes. Raises ``BlockNotFoundError``/``BlockPendingError`` when a key is
        not ready, and then nothing changed.
        """
        with self._lock:
            return self._load(keys, device_block_ids)

    def _load(self, keys: Sequence[Key], device_block_ids: BlockIds) -> LoadPlan:
        self.engine.require_open()
        keys = check_keys(keys)
        device = self._device_ids(device_block_ids, len(keys))
        require_distinct("device_block_ids", device)
        plan = self.manager.prepare_load(keys)
        try:
            cpu = self._pool_ids(plan, device)
            job = self.engine._submit_trusted(Direction.LOAD, device, cpu)
        except BaseException:
            self.manager.complete_load(plan)
            raise
        self._track(plan, job)
        return plan

    def poll(self) -> list[Finished]:
        """Complete, in the manager, every plan whose job finished since the last poll."""
        with self._lock:
            return self._poll()

    def _poll(self) -> list[Finished]:
        finished = []
        for result in self.engine.poll():
            job = result.job_id
            plan = self._plans.pop(job)
            del self._job_of[plan.plan_id]
            self._submitted_at.pop(job, None)
            abandoned = self.manager.is_abandoned(plan)  # asked before the completion ends it
            self._count_transfer(result, abandoned)
            if isinstance(plan, StorePlan):
                self.manager.complete_store(plan, success=result.ok)
                if result.ok and not abandoned and self._tiers is not None:
                    self._tiers.write_through(self.manager, plan)
            else:
                self.manager.complete_load(plan)
            finished.append(Finished(plan, result, abandoned))
        if self._tiers is not None:
            finished += [
                Finished(
                    done.plan,
                    done.result,
                    done.abandoned,
                    True,
                    done.tier if done.tier >= 0 else None,
                )
                for done in self._tiers.poll(self.manager, self._complete_fetch)
            ]
        return finished

    def wait(self, plans: Sequence[Plan] | None = None, timeout: float | None = None) -> bool:
        """Block until the jobs of ``plans`` (default: all in flight but the abandoned ones,
        and the remote tier's writes) finished, or ``timeout`` seconds passed; True if they
        all finished. ``poll`` then completes them. Other threads may use the offloader
        meanwhile.
        """
        if plans is not None and not isinstance(plans, (list, tuple)):
            raise InvalidArgumentError(f"plans must be a list of plans, got {plans!r}")
        with self._lock:
            if plans is None:  # the tiers' writes too: they are in flight as well
                jobs = self._unabandoned()
                fetches = self._unabandoned_fetches() + self._tier_writes()
            else:
                jobs, fetches = [], []
                for plan in plans:
                    fetch = self._fetch_job(plan)
                    if fetch is None:
                        jobs.append(self._job(plan))
                    else:
                        fetches.append(fetch)
        return self._wait_all(jobs, fetches, timeout)

    def _wait_all(self, jobs: list[int], fetches: list[RemoteJob], timeout: float | None) -> bool:
        started = time.monotonic()
        if not self.engine.wait(jobs, timeout):  # which checks ``timeout``
            return False
        deadline = None if timeout is None else started + timeout
        for fetch in fetches:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not fetch.wait(left):
                return False
        return True

    def stream_wait(self, plan: LoadPlan, stream: torch.cuda.Stream | None = None) -> None:
        """Make later work on ``stream`` (default: current) wait for ``plan``'s copy, so a
        forward pass can read loaded blocks without the host waiting (CUDA); on the CPU
        this waits for the job.
        """
        with self._lock:
            job = self._job(plan)
        self.engine.stream_wait(job, stream)

    def stalled(self, older_than: float | None = None) -> list[Plan]:
        """The plans in flight, not abandoned, submitted more than ``older_than`` seconds
        ago (default: ``stall_after``), oldest first: the candidates for ``abandon``.
        """
        age = self._stall_after if older_than is None else check_seconds("older_than", older_than)
        with self._lock:
            if self._ages is None:
                cutoff = time.monotonic() - age
                fetches: list[tuple[float, Plan]] = (
                    [] if self._tiers is None else list(self._tiers.stalled(self.manager, cutoff))
                )
                copies = [
                    (submitted, self._plans[job])
                    for job, submitted in self._submitted_at.items()
                    if submitted <= cutoff and not self.manager.is_abandoned(self._plans[job])
                ]
                return [plan for _, plan in sorted(copies + fetches, key=lambda pair: pair[0])]
            # The manager's open plans by age, its abandoned ones left out; of those, the
            # ones in flight here (a plan made on the manager directly has no job here).
            return [
                plan
                for plan in self._ages.stalled_plans(age)
                if (plan.plan_id in self._job_of or self._is_fetch(plan.plan_id))
                and not self.manager.is_abandoned(plan)
            ]

    def abandon(self, plan: Plan) -> None:
        """Give up waiting for the job of ``plan`` (it stalled): the manager releases what
        the plan holds now, safely (see ``OffloadManager.abandon``: a store's block ids stay
        quarantined until the job reports). ``poll`` reports the job when it ends, as
        ``Finished(..., abandoned=True)``; until then a load's device blocks may still be
        written: do not reuse them before. ``reset`` no longer waits for the job.
        """
        with self._lock:
            # A fetch's block id stays quarantined until its job reports, as a store's
            # does: the job may still write it.
            fetch = self._fetch_job(plan)
            if fetch is None:
                mine = self._plans[self._job(plan)]
            else:
                assert self._tiers is not None and isinstance(plan, StorePlan)
                mine = self._tiers.held(fetch, plan)
            # Asked of the plan held here: the caller's may be another manager's equal twin.
            if self.manager.is_abandoned(mine):
                raise PlanAlreadyAbandonedError(f"{plan!r} was abandoned already")
            self.manager.abandon(plan)

    def reset(self, timeout: float | None = None) -> list[Finished]:
        """Wait for every job in flight but the abandoned ones, complete their plans, then
        empty the pool (abandoned stores' block ids stay quarantined until their jobs end).

        Returns the plans that finished meanwhile, so that no completion is lost. Raises
        ``TransferTimeoutError``, having changed nothing, if the jobs did not finish within
        ``timeout`` seconds: ``abandon`` the ``stalled()`` ones and reset again. No job
        starts while a reset waits.
        """
        with self._lock:
            if not self._wait_all(self._unabandoned(), self._unabandoned_fetches(), timeout):
                raise TransferTimeoutError(
                    f"jobs in flight did not finish within {timeout} s: nothing was reset; "
                    "abandon the stalled() plans, then reset again"
                )
            finished = self._poll()
            self.manager.reset_cache()
            return finished

    def close(self, timeout: float | None = None) -> None:
        """Wait for and complete every job (abandoned ones too: their copies address the
        pool), then release the engine and its pool. Raises ``TransferTimeoutError``, having
        changed nothing, if the jobs did not finish within ``timeout`` seconds.
        """
        with self._lock:
            fetches = [] if self._tiers is None else self._tiers.fetch_jobs()
            if not self._wait_all(list(self._plans), fetches, timeout):
                raise TransferTimeoutError(
                    f"jobs in flight did not finish within {timeout} s: the offloader is "
                    "still open (a job that never ends keeps the pool alive)"
                )
            if self._tiers is not None:
                # Writes hold copies of their own, not the pool: let them go out (each
                # bounded by the store's timeout), then stop the workers.
                self._tiers.close(lambda writes: self._wait_all([], writes, timeout))
            self._poll()
            self.engine.close()

    def __enter__(self) -> Offloader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- the tiers -------------------------------------------------------------------------

    def fetch(self, keys: Sequence[Key]) -> list[StorePlan]:
        """Start reading the absent ``keys`` from the tiers into CPU blocks; returns at once,
        with one store plan per key sent (keys resident or pending here are skipped; the keys
        after the first one no CPU block can be freed for are not sent).

        Each key is pending until ``poll`` reports its plan (``Finished.fetched``): ready
        if a tier held a valid value (``ok``; ``tier`` says which), absent again otherwise.
        The tiers are asked in order, each for what the ones before it did not have; a
        block a lower tier served is written to the tiers above it. A tier down, slow or
        failing is a miss, counted in ``remote_stats()``, never an exception. Raises
        ``NoRemoteTierError`` without tiers, ``InvalidArgumentError`` for bad keys, before
        anything changed.
        """
        with self._lock:
            self.engine.require_open()
            if self._tiers is None:
                raise NoRemoteTierError("this offloader has no tier: pass tiers= or remote=")
            keys = check_keys(keys)
            self._tiers.check_keys(keys)
            return self._tiers.fetch(self.manager, keys, self._write_back)

    def remote_stats(self) -> RemoteOffloadStats | None:
        """The tiers' counters as one (None without tiers): with one tier, that tier's,
        its store's counters included; with more, a key fetched counts once, a hit if
        some tier served it, and the writes add up (``tier_stats`` has each tier's)."""
        with self._lock:
            return None if self._tiers is None else self._tiers.stats()

    def tier_stats(self) -> list[RemoteOffloadStats]:
        """Each tier's counters, in the order of ``tiers`` (empty without tiers)."""
        with self._lock:
            return [] if self._tiers is None else self._tiers.tier_stats()

    def transfer_stats(self) -> TransferStats:
        """The copy jobs' counters per direction, as ``poll`` reported them."""
        from kvoffload.stats import TransferStats

        with self._lock:
            seconds = self._transfer_seconds
            return TransferStats(
                **self._transfer_counts,
                load_seconds=seconds["load_seconds"],
                store_seconds=seconds["store_seconds"],
            )

    def _count_transfer(self, result: JobResult, abandoned: bool) -> None:
        side = "load" if result.direction is Direction.LOAD else "store"
        counts = self._transfer_counts
        counts[f"{side}s"] += 1
        counts[f"{side}s_failed"] += not result.ok
        counts[f"{side}_bytes"] += result.nbytes
        counts["finished_abandoned"] += abandoned
        self._transfer_seconds[f"{side}_seconds"] += result.seconds

    def _write_back(self, plans: Sequence[StorePlan]) -> None:
        """Send the victims of ``plans`` to the tiers with the bytes their block ids hold
        now: call before anything may write those block ids (the plans' own jobs)."""
        if self._tiers is not None:
            self._tiers.write_back(plans)

    def _complete_fetch(self, plan: StorePlan, accepted: bool) -> None:
        """A fetch's job reported: the key becomes ready only if its value was accepted."""
        self.manager.complete_store(plan, success=accepted)

    def _fetch_job(self, plan: object) -> RemoteJob | None:
        return None if self._tiers is None else self._tiers.fetch_job(plan)

    def _is_fetch(self, plan_id: int) -> bool:
        return self._tiers is not None and self._tiers.is_fetch(plan_id)

    def _unabandoned_fetches(self) -> list[RemoteJob]:
        """The fetch jobs in flight with a plan not abandoned."""
        return [] if self._tiers is None else self._tiers.unabandoned_fetches(self.manager)

    def _tier_writes(self) -> list[RemoteJob]:
        return [] if self._tiers is None else self._tiers.writes()

    def _device_ids(self, ids: BlockIds, num_keys: int) -> IdArray:
        device = as_block_ids("device_block_ids", ids, self.engine.layout.num_blocks)
        if len(device) != self.block_size_factor * num_keys:
            raise InvalidArgumentError(
                f"{num_keys} keys need {self.block_size_factor * num_keys} device blocks "
                f"(block_size_factor={self.block_size_factor}), got {len(device)}"
            )
        return device

    def _pool_ids(self, plan: Plan, device: IdArray) -> IdArray:
        """The CPU side of ``plan``, checked as ``submit_*`` would check it against the
        ``device`` ids it pairs with: a manager of the caller's own may hand out block ids
        outside this pool, too few, or one block twice for a store. The device ids were
        checked before the manager planned; this is each id's only check, the engine
        trusts both.
        """
        cpu = as_block_ids("cpu_block_ids", plan.block_ids, self.engine.pool.num_blocks)
        require_pairs(device, cpu, self.block_size_factor)
        if isinstance(plan, StorePlan):
            require_distinct("cpu_block_ids", cpu)
        return cpu

    def _track(self, plan: Plan, job: int) -> None:
        self._plans[job] = plan
        self._job_of[plan.plan_id] = job
        if self._ages is None:
            self._submitted_at[job] = time.monotonic()

    def _unabandoned(self) -> list[int]:
        """The copy jobs in flight whose plans are not abandoned."""
        abandoned = self.manager.is_abandoned
        return [job for job, plan in self._plans.items() if not abandoned(plan)]

    def _job(self, plan: Plan) -> int:
        job = self._job_of.get(plan.plan_id) if isinstance(plan, Plan) else None
        if job is None or self._plans[job] != plan:
            raise InvalidArgumentError(
                f"{plan!r} is not in flight in this offloader: pass a plan its store or load "
                "returned that poll has not reported yet"
            )
        return job
