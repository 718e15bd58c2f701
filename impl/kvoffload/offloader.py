"""The object an engine integrates: the manager's bookkeeping plus the transfer engine.

``store`` and ``load`` ask the manager for a plan and submit its copy job; ``poll``
completes in the manager the plans whose jobs finished (a failed store completes with
``success=False``, so its keys never become readable); ``reset`` waits for every job in
flight before the manager forgets the pool, so no old copy can land in a reused slot.
See docs/integration.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvoffload.transfer.engine import TransferEngine, as_block_ids, require_distinct
from kvoffload.transfer.jobs import JobResult
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.pool import CpuBlockPool, pool_size
from kvoffload.transfer.runs import IdArray
from kvoffload_spec.errors import InvalidArgumentError
from kvoffload_spec.surface import Key, LoadPlan, Lookup, StorePlan
from kvoffload_spec.validation import check_count, check_keys

if TYPE_CHECKING:
    import torch

    from kvoffload.transfer.engine import BlockIds


class BlockManager(Protocol):
    """The manager surface the facade drives (``OffloadManager`` and the spec's model)."""

    @property
    def num_blocks(self) -> int: ...
    def lookup(self, key: Key) -> Lookup: ...
    def prepare_store(self, keys: Sequence[Key]) -> StorePlan | None: ...
    def complete_store(self, plan: StorePlan, success: bool = True) -> None: ...
    def prepare_load(self, keys: Sequence[Key]) -> LoadPlan: ...
    def complete_load(self, plan: LoadPlan) -> None: ...
    def touch(self, keys: Sequence[Key]) -> None: ...
    def reset_cache(self) -> None: ...


@dataclass(frozen=True)
class Finished:
    """A plan whose copy job finished; the manager has completed it already."""

    plan: StorePlan | LoadPlan
    result: JobResult

    @property
    def ok(self) -> bool:
        """False when the copy failed: a store's keys were dropped, a load's device blocks
        hold undefined bytes and must be recomputed.
        """
        return self.result.ok


class Offloader:
    """Offloads KV blocks of ``kv_caches`` to a CPU pool and loads them back, by key.

    A key names one CPU block, which holds ``block_size_factor`` device blocks: ``store``
    and ``load`` take ``block_size_factor`` device block ids per key, in order. The pool has
    ``num_cpu_blocks`` blocks, or as many as ``cpu_bytes`` holds, or as many as ``manager``
    manages. Without ``manager``, an ``OffloadManager(num_blocks, policy)`` is built.
    ``threaded`` runs CPU jobs on worker threads (CUDA jobs always run on streams).
    """

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        *,
        num_cpu_blocks: int | None = None,
        cpu_bytes: int | None = None,
        block_dim: int | Sequence[int] = 0,
        block_size_factor: int = 1,
        policy: str = "lru",
        manager: BlockManager | None = None,
        prefault: bool = False,
        threaded: bool = False,
    ) -> None:
        layout = KVLayout(kv_caches, block_dim)
        factor = check_count("block_size_factor", block_size_factor)
        block_bytes = factor * layout.bytes_per_block
        if manager is not None and num_cpu_blocks is None and cpu_bytes is None:
            num_cpu_blocks = manager.num_blocks
        count = pool_size(block_bytes, num_cpu_blocks, cpu_bytes)
        if manager is None:
            from kvoffload.manager import OffloadManager

            manager = OffloadManager(count, policy)
        elif manager.num_blocks != count:
            raise InvalidArgumentError(
                f"the manager manages {manager.num_blocks} blocks but the pool has {count}"
            )
        pool = CpuBlockPool(block_bytes, count, pin=layout.device.type == "cuda", prefault=prefault)
        self.engine = TransferEngine(layout, pool, block_size_factor=factor, threaded=threaded)
        self.manager = manager
        self._plans: dict[int, StorePlan | LoadPlan] = {}  # job id -> its plan, in flight
        self._job_of: dict[int, int] = {}  # plan id -> job id, in flight

    @property
    def block_size_factor(self) -> int:
        return self.engine.block_size_factor

    @property
    def num_in_flight(self) -> int:
        """Plans submitted whose jobs ``poll`` has not reported yet."""
        return len(self._plans)

    def lookup(self, key: Key) -> Lookup:
        return self.manager.lookup(key)

    def touch(self, keys: Sequence[Key]) -> None:
        """Mark ``keys`` recently used (the first key ends up the most recent)."""
        self.manager.touch(keys)

    def store(self, keys: Sequence[Key], device_block_ids: BlockIds) -> StorePlan | None:
        """Offload: plan to store ``keys`` and submit the copy of their device blocks.

        Returns the plan (its ``keys`` are those actually stored: absent ones, once each),
        or None when the pool cannot make room, and then nothing changed. The device blocks
        must not be overwritten until ``poll`` reports the plan finished.
        """
        self.engine.require_open()
        keys = check_keys(keys)
        device = self._device_ids(device_block_ids, len(keys))
        plan = self.manager.prepare_store(keys)
        if plan is None:
            return None
        position = {key: index for index, key in reversed(list(enumerate(keys)))}
        rows = [position[key] for key in plan.keys]
        try:
            source = device.reshape(-1, self.block_size_factor)[rows].ravel()
            job = self.engine.submit_store(source, plan.block_ids)
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
        self.engine.require_open()
        keys = check_keys(keys)
        device = self._device_ids(device_block_ids, len(keys))
        require_distinct("device_block_ids", device)
        plan = self.manager.prepare_load(keys)
        try:
            job = self.engine.submit_load(plan.block_ids, device)
        except BaseException:
            self.manager.complete_load(plan)
            raise
        self._track(plan, job)
        return plan

    def poll(self) -> list[Finished]:
        """Complete, in the manager, every plan whose job finished since the last poll."""
        finished = []
        for result in self.engine.poll():
            plan = self._plans.pop(result.job_id)
            del self._job_of[plan.plan_id]
            if isinstance(plan, StorePlan):
                self.manager.complete_store(plan, success=result.ok)
            else:
                self.manager.complete_load(plan)
            finished.append(Finished(plan, result))
        return finished

    def wait(self, plans: Sequence[StorePlan | LoadPlan] | None = None) -> None:
        """Block until the jobs of ``plans`` (default: all in flight) finished; ``poll``
        then completes them.
        """
        if plans is None:
            self.engine.wait()
            return
        self.engine.wait([self._job(plan) for plan in plans])

    def stream_wait(self, plan: LoadPlan, stream: torch.cuda.Stream | None = None) -> None:
        """Make later work on ``stream`` (default: current) wait for ``plan``'s copy, so a
        forward pass can read loaded blocks without the host waiting (CUDA); on the CPU
        this waits for the job.
        """
        self.engine.stream_wait(self._job(plan), stream)

    def reset(self) -> list[Finished]:
        """Wait for every job in flight, complete their plans, then empty the pool.

        Returns the plans that finished meanwhile, so that no completion is lost.
        """
        self.engine.wait()
        finished = self.poll()
        self.manager.reset_cache()
        return finished

    def close(self) -> None:
        """Wait for and complete every job, then release the engine and its pool."""
        self.engine.wait()
        self.poll()
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

    def _track(self, plan: StorePlan | LoadPlan, job: int) -> None:
        self._plans[job] = plan
        self._job_of[plan.plan_id] = job

    def _job(self, plan: StorePlan | LoadPlan) -> int:
        job = self._job_of.get(getattr(plan, "plan_id", -1))
        if job is None or self._plans[job] != plan:
            raise InvalidArgumentError(f"{plan!r} is not in flight in this offloader")
        return job
