"""The transfer engine: submit stores and loads of blocks, poll for finished jobs.

One interface whatever the device: ``submit_store`` / ``submit_load`` validate their ids
(raising a typed error before anything is queued), plan the job's coalesced runs and hand
it to the backend; ``poll`` reports every job exactly once, failed ones with ``ok=False``.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np
import numpy.typing as npt

from kvoffload.transfer.copiers import (
    ROWS_AT_LEAST,
    ROWS_BELOW,
    SPAN_BELOW,
    SPAN_GATHER_ROWS_BELOW,
    SPAN_RUNS_AT_LEAST,
    SPAN_UNIT_AT_LEAST,
    Copier,
    MemmoveCopier,
    RowCopier,
    SpanCopier,
    TensorCopier,
    row_unit,
)
from kvoffload.transfer.cpu import CpuBackend
from kvoffload.transfer.gather import GatherCopier, ThresholdCopier
from kvoffload.transfer.jobs import Direction, FaultHook, Job, JobResult
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.pool import CpuBlockPool
from kvoffload.transfer.runs import BlockMapping, IdArray
from kvoffload_spec.errors import InvalidArgumentError, OffloadError
from kvoffload_spec.validation import check_count, check_flag, check_seconds

if TYPE_CHECKING:
    import torch

    BlockIds = Sequence[int] | IdArray | torch.Tensor

CopierName = Literal["memmove", "rows", "span", "tensor", "gather"]
SMALL = 256  # ids: where plain Python beats numpy (see as_block_ids)


class EngineClosedError(OffloadError):
    """The engine was closed; it accepts no more jobs."""


class TransferTimeoutError(OffloadError):
    """Jobs did not finish in the time given (stalled?): nothing was changed."""


class Backend(Protocol):
    hook: FaultHook | None

    def submit(self, job: Job) -> None: ...
    def poll(self) -> list[JobResult]: ...
    def wait(self, job_ids: Sequence[int], timeout: float | None = None) -> bool: ...
    def wait_all(self, timeout: float | None = None) -> bool: ...
    def close(self) -> None: ...


class TransferEngine:
    """Copies blocks between a device KV cache (``layout``) and a CPU ``pool``.

    A CPU block holds ``block_size_factor`` device blocks, so ``pool.block_bytes`` must be
    ``block_size_factor * layout.bytes_per_block``. On CUDA, jobs run on one stream per
    direction; on the CPU they complete inside ``submit_*`` or, with ``threaded=True``, on
    one worker thread per direction. ``fault_hook`` (tests only) is consulted before every
    run copy; what it raises fails that job.
    """

    def __init__(
        self,
        layout: KVLayout,
        pool: CpuBlockPool,
        *,
        block_size_factor: int = 1,
        threaded: bool = False,
        copier: CopierName | None = None,
    ) -> None:
        factor = check_count("block_size_factor", block_size_factor)
        check_flag("threaded", threaded)
        if pool.block_bytes != factor * layout.bytes_per_block:
            raise InvalidArgumentError(
                f"a CPU block of {pool.block_bytes} bytes cannot hold {factor} device blocks "
                f"of {layout.bytes_per_block} bytes"
            )
        self.layout = layout
        self.pool = pool
        self.block_size_factor = factor
        self._mapping = BlockMapping(layout, factor)
        self._backend = _backend_for(layout, pool, threaded, copier)
        self._issued = 0
        self._closed = False
        self._finalizer = weakref.finalize(self, self._backend.close)

    @classmethod
    def for_cache(
        cls,
        kv_caches: Sequence[torch.Tensor],
        *,
        num_cpu_blocks: int | None = None,
        cpu_bytes: int | None = None,
        block_dim: int | Sequence[int] = 0,
        block_size_factor: int = 1,
        prefault: bool = False,
        threaded: bool = False,
    ) -> TransferEngine:
        """An engine with its own CPU pool (pinned when the cache is on CUDA), sized by
        ``num_cpu_blocks`` or by the byte budget ``cpu_bytes``.
        """
        layout = KVLayout(kv_caches, block_dim)
        factor = check_count("block_size_factor", block_size_factor)
        pool = CpuBlockPool(
            factor * layout.bytes_per_block,
            num_cpu_blocks,
            budget_bytes=cpu_bytes,
            pin=layout.device.type == "cuda",
            prefault=prefault,
        )
        return cls(layout, pool, block_size_factor=factor, threaded=threaded)

    # -- jobs ------------------------------------------------------------------------------

    def submit_store(self, device_block_ids: BlockIds, cpu_block_ids: BlockIds) -> int:
        """Copy device blocks into CPU blocks; returns the job id. CPU ids must be distinct;
        ``device_block_ids[j]`` lands in sub-block ``j % factor`` of ``cpu_block_ids[j //
        factor]``. The device blocks must not change until the job has finished.
        """
        device, cpu = self._pairs(device_block_ids, cpu_block_ids)
        require_distinct("cpu_block_ids", cpu)
        return self._submit_trusted(Direction.STORE, device, cpu)

    def submit_load(self, cpu_block_ids: BlockIds, device_block_ids: BlockIds) -> int:
        """Copy CPU blocks into device blocks; returns the job id. Device ids must be
        distinct; a CPU id may repeat (one block loaded into two places).
        """
        device, cpu = self._pairs(device_block_ids, cpu_block_ids)
        require_distinct("device_block_ids", device)
        return self._submit_trusted(Direction.LOAD, device, cpu)

    def _submit_trusted(self, direction: Direction, device: IdArray, cpu: IdArray) -> int:
        """Submit a job whose ids its caller has validated already, checking nothing: the
        entry of a caller that must check ids before it changes state of its own (the
        ``Offloader`` checks them before its manager plans), so that no id is checked twice.

        The caller guarantees what ``submit_store`` / ``submit_load`` would check: the engine
        is open; ``device`` and ``cpu`` are int64 arrays of ids in range (``as_block_ids``),
        ``block_size_factor`` device ids per CPU id; the side that is written holds no id
        twice (``require_distinct``). Ids that break this can make the job copy the wrong
        blocks (a raw copy outside the buffers is still refused, failing the job).
        """
        runs = self._mapping.runs(device, cpu, to_cpu=direction is Direction.STORE)
        job_id = self._issued
        self._issued += 1
        nbytes = len(device) * self.layout.bytes_per_block
        self._backend.submit(Job(job_id, direction, runs, nbytes))
        return job_id

    def poll(self) -> list[JobResult]:
        """The jobs that finished since the last poll, each reported once."""
        return self._backend.poll()

    def wait(self, job_ids: Iterable[int] | None = None, timeout: float | None = None) -> bool:
        """Block until these jobs (default: all submitted) have finished, or ``timeout``
        seconds passed; True if they all finished. ``poll`` still reports them.
        """
        seconds = None if timeout is None else check_seconds("timeout", timeout)
        if job_ids is None:
            return self._backend.wait_all(seconds)
        return self._backend.wait(self._issued_ids(job_ids), seconds)

    def stream_wait(self, job_id: int, stream: torch.cuda.Stream | None = None) -> None:
        """Make work queued later on ``stream`` (default: the current one) start after the
        job finished, without blocking the host. On the CPU this waits for the job.
        """
        (job,) = self._issued_ids([job_id])
        from kvoffload.transfer.cuda import CudaBackend

        if isinstance(self._backend, CudaBackend):
            import torch

            self._backend.stream_wait(job, stream or torch.cuda.current_stream(self.layout.device))
        else:
            self._backend.wait([job])

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def fault_hook(self) -> FaultHook | None:
        return self._backend.hook

    @fault_hook.setter
    def fault_hook(self, hook: FaultHook | None) -> None:
        if hook is not None and not callable(hook):
            raise InvalidArgumentError(f"fault_hook must be a function(job, run) or None: {hook!r}")
        self._backend.hook = hook

    def require_open(self) -> None:
        if self._closed:
            raise EngineClosedError("this transfer engine is closed")

    def close(self) -> None:
        """Wait for every job, stop the workers and release the pool (idempotent)."""
        self._closed = True
        self._finalizer()
        self.pool.close()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- helpers ---------------------------------------------------------------------------

    def _pairs(
        self, device_block_ids: BlockIds, cpu_block_ids: BlockIds
    ) -> tuple[IdArray, IdArray]:
        self.require_open()
        device = as_block_ids("device_block_ids", device_block_ids, self.layout.num_blocks)
        cpu = as_block_ids("cpu_block_ids", cpu_block_ids, self.pool.num_blocks)
        require_pairs(device, cpu, self.block_size_factor)
        return device, cpu

    def _issued_ids(self, job_ids: Iterable[int]) -> list[int]:
        if not isinstance(job_ids, (list, tuple, range, set, frozenset)):
            raise InvalidArgumentError(f"job ids must be a list of ints, got {job_ids!r}")
        ids = list(job_ids)
        for job_id in ids:
            if isinstance(job_id, bool) or not isinstance(job_id, int):
                raise InvalidArgumentError(f"job ids are ints, got {job_id!r}")
            if not 0 <= job_id < self._issued:
                raise InvalidArgumentError(f"job {job_id} was never submitted to this engine")
        return ids


def _backend_for(
    layout: KVLayout, pool: CpuBlockPool, threaded: bool, copier: CopierName | None
) -> Backend:
    kind = layout.device.type
    if copier not in (None, "memmove", "rows", "span", "tensor", "gather"):
        raise InvalidArgumentError(
            f"copier must be 'memmove', 'rows', 'span', 'tensor' or 'gather', got {copier!r}"
        )
    if kind == "cuda":
        if copier in ("memmove", "rows", "span"):
            raise InvalidArgumentError(f"the {copier} copier needs the KV cache in host memory")
        from kvoffload.transfer.cuda import CudaBackend

        if copier is None:  # small runs through a staging buffer, large ones copied directly
            chosen: Copier = ThresholdCopier(GatherCopier(layout, pool), TensorCopier(layout, pool))
        else:
            chosen = _named_copier(copier, layout, pool)
        return CudaBackend(chosen, layout.device)
    if kind != "cpu":
        raise InvalidArgumentError(f"KV caches on {kind!r} are not supported (cpu or cuda)")
    if copier is None and row_unit(layout, pool) >= ROWS_AT_LEAST:
        # small runs as numpy rows; large ones one numpy call per pool span where the
        # layout's rows are wide enough (SpanCopier), else one memmove each
        span = SpanCopier(
            layout,
            pool,
            narrowest=SPAN_UNIT_AT_LEAST,
            fewest_runs=SPAN_RUNS_AT_LEAST,
            below=SPAN_BELOW,
            gather_rows_below=SPAN_GATHER_ROWS_BELOW,
        )
        large: Copier = span if span.usable else MemmoveCopier(layout, pool)
        cpu: Copier = ThresholdCopier(RowCopier(layout, pool), large, below=ROWS_BELOW)
    else:
        cpu = _named_copier(copier or "memmove", layout, pool)
    return CpuBackend(cpu, threaded=threaded)


def _named_copier(name: CopierName, layout: KVLayout, pool: CpuBlockPool) -> Copier:
    if name == "tensor":
        return TensorCopier(layout, pool)
    if name == "rows":
        return RowCopier(layout, pool)
    if name == "span":
        return SpanCopier(layout, pool)
    if name == "gather":
        return GatherCopier(layout, pool)
    return MemmoveCopier(layout, pool)


def as_block_ids(name: str, ids: object, limit: int) -> IdArray:
    """``ids`` as int64 block ids in ``[0, limit)``, or a typed error."""
    if type(ids) is np.ndarray and ids.dtype == np.int64 and ids.ndim == 1:
        array: npt.NDArray[np.integer[Any]] = ids  # the usual case: no conversion at all
    else:
        array = _int_array(name, ids)
    if array.size == 0:
        return np.empty(0, dtype=np.int64)
    # Up to a few hundred ids, Python's min and max over ``tolist()`` cost less than numpy's
    # reductions: a job's checks run right after the previous job's copy has flushed the
    # caches, where each numpy function's first call costs tens of us (64 ids: ~60 us for a
    # job's checks in Python, ~160 us in numpy, measured so). Above, one reduction checks
    # both bounds: as unsigned, a negative int64 id is huge.
    if array.size <= SMALL:
        values = array.tolist()
        in_range = min(values) >= 0 and max(values) < limit
    elif array.dtype == np.int64:
        in_range = int(array.view(np.uint64).max()) < limit
    else:
        in_range = int(array.min()) >= 0 and int(array.max()) < limit
    if not in_range:
        low, high = int(array.min()), int(array.max())
        raise InvalidArgumentError(f"{name} must lie in [0, {limit}), got ids {low} to {high}")
    return array.astype(np.int64, copy=False)


def _int_array(name: str, ids: object) -> npt.NDArray[np.integer[Any]]:
    """``ids`` (a list, range, array or tensor) as a flat integer array, or a typed error."""
    import torch

    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu().numpy()
    elif isinstance(ids, (list, tuple)) and any(isinstance(i, bool) for i in ids):
        raise InvalidArgumentError(f"{name} must be integers, got a bool")
    elif not isinstance(ids, (list, tuple, range, np.ndarray)):
        raise InvalidArgumentError(f"{name} must be a list, array or tensor of ints")
    try:
        array = np.asarray(ids)
    except (TypeError, ValueError) as error:
        raise InvalidArgumentError(f"{name} must be a flat list of ints: {error}") from None
    if array.size and (array.ndim != 1 or array.dtype.kind not in "iu"):
        raise InvalidArgumentError(f"{name} must be a flat list of ints, got {array.dtype}")
    return array


def require_pairs(device: IdArray, cpu: IdArray, factor: int) -> None:
    """``factor`` device block ids for each CPU block id, or a typed error."""
    if len(device) != factor * len(cpu):
        raise InvalidArgumentError(
            f"{len(cpu)} CPU blocks hold {factor * len(cpu)} device blocks "
            f"(block_size_factor={factor}), got {len(device)}"
        )


def require_distinct(name: str, ids: IdArray) -> None:
    if len(ids) <= SMALL:
        repeats = len(set(ids.tolist())) != len(ids)
    else:
        ordered = np.sort(ids)
        repeats = bool((ordered[1:] == ordered[:-1]).any())
    if repeats:
        raise InvalidArgumentError(f"{name} are written to and must not repeat")
