"""The object an engine integrates: the manager's bookkeeping plus the transfer engine.

``store`` and ``load`` ask the manager for a plan and submit its copy job; ``poll``
completes in the manager the plans whose jobs finished (a failed store completes with
``success=False``, so its keys never become readable); ``reset`` waits for every job in
flight before the manager forgets the pool, so no old copy can land in a reused block. A job
that seems never to finish can be ``abandon``-ed: the manager releases what its plan held
without reusing a block id the job may still write (see docs/reliability.md).

Every method may be called from any thread: one lock serializes them, so an engine's
scheduler thread and the thread that polls may share an offloader. See docs/integration.md.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

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
    from kvoffload.transfer.engine import BlockIds


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
    """

    plan: Plan
    result: JobResult
    abandoned: bool = False

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
    ) -> None:
        self._stall_after = check_seconds("stall_after", stall_after)
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
        self._abandoned: set[int] = set()  # job ids in flight whose plans were abandoned
        # Plan ages: the manager's own ledger where it keeps one; else, and only then, the
        # offloader's: job id -> time.monotonic() at submission, in flight.
        self._ages: PlanAges | None = manager if isinstance(manager, PlanAges) else None
        self._submitted_at: dict[int, float] = {}

    @property
    def block_size_factor(self) -> int:
        return self.engine.block_size_factor

    @property
    def num_in_flight(self) -> int:
        """Plans submitted whose jobs ``poll`` has not reported yet."""
        return len(self._plans)

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
        plan = self.manager.prepare_store(keys)
        if plan is None:
            return None
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
            abandoned = job in self._abandoned
            self._abandoned.discard(job)
            if isinstance(plan, StorePlan):
                self.manager.complete_store(plan, success=result.ok)
            else:
                self.manager.complete_load(plan)
            finished.append(Finished(plan, result, abandoned))
        return finished

    def wait(self, plans: Sequence[Plan] | None = None, timeout: float | None = None) -> bool:
        """Block until the jobs of ``plans`` (default: all in flight but the abandoned ones)
        finished, or ``timeout`` seconds passed; True if they all finished. ``poll`` then
        completes them. Other threads may use the offloader meanwhile.
        """
        if plans is not None and not isinstance(plans, (list, tuple)):
            raise InvalidArgumentError(f"plans must be a list of plans, got {plans!r}")
        with self._lock:
            jobs = self._unabandoned() if plans is None else [self._job(p) for p in plans]
        return self.engine.wait(jobs, timeout)

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
                return [
                    self._plans[job]
                    for job, submitted in self._submitted_at.items()
                    if submitted <= cutoff and job not in self._abandoned
                ]
            # The manager's open plans by age, its abandoned ones left out; of those, the
            # ones in flight here (a plan made on the manager directly has no job here).
            in_flight = self._job_of
            return [
                plan
                for plan in self._ages.stalled_plans(age)
                if (job := in_flight.get(plan.plan_id)) is not None and job not in self._abandoned
            ]

    def abandon(self, plan: Plan) -> None:
        """Give up waiting for the job of ``plan`` (it stalled): the manager releases what
        the plan holds now, safely (see ``OffloadManager.abandon``: a store's block ids stay
        quarantined until the job reports). ``poll`` reports the job when it ends, as
        ``Finished(..., abandoned=True)``; until then a load's device blocks may still be
        written: do not reuse them before. ``reset`` no longer waits for the job.
        """
        with self._lock:
            job = self._job(plan)
            if job in self._abandoned:
                raise PlanAlreadyAbandonedError(f"{plan!r} was abandoned already")
            self.manager.abandon(plan)
            self._abandoned.add(job)

    def reset(self, timeout: float | None = None) -> list[Finished]:
        """Wait for every job in flight but the abandoned ones, complete their plans, then
        empty the pool (abandoned stores' block ids stay quarantined until their jobs end).

        Returns the plans that finished meanwhile, so that no completion is lost. Raises
        ``TransferTimeoutError``, having changed nothing, if the jobs did not finish within
        ``timeout`` seconds: ``abandon`` the ``stalled()`` ones and reset again. No job
        starts while a reset waits.
        """
        with self._lock:
            if not self.engine.wait(self._unabandoned(), timeout):
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
            if not self.engine.wait(list(self._plans), timeout):
                raise TransferTimeoutError(
                    f"jobs in flight did not finish within {timeout} s: the offloader is "
                    "still open (a job that never ends keeps the pool alive)"
                )
            self._poll()
            self.engine.close()

    def __enter__(self) -> Offloader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

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
        return [job for job in self._plans if job not in self._abandoned]

    def _job(self, plan: Plan) -> int:
        job = self._job_of.get(plan.plan_id) if isinstance(plan, Plan) else None
        if job is None or self._plans[job] != plan:
            raise InvalidArgumentError(
                f"{plan!r} is not in flight in this offloader: pass a plan its store or load "
                "returned that poll has not reported yet"
            )
        return job
