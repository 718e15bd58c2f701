"""The two ways of executing a job's runs: ``memmove`` between addresses, or ``copy_``.

Both take every byte range from :class:`~kvoffload.transfer.runs.CopyRuns` and allocate
nothing the size of the data. ``MemmoveCopier`` is the CPU path: one C call per run,
without building a tensor view per run, which is what holds 64 KiB runs near memcpy speed
(docs/data_path.md); ctypes releases the GIL during the call, so a worker thread copies
while the caller runs Python. ``TensorCopier`` issues ``copy_(non_blocking=True)`` per run:
on CUDA that is ``cudaMemcpyAsync`` on the current stream; on CPU it is the reference the
tests compare the fast path against.
"""

from __future__ import annotations

import ctypes
from collections import deque
from typing import Protocol

import numpy as np

from kvoffload.transfer.jobs import Direction, FaultHook, Job
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.pool import CpuBlockPool
from kvoffload.transfer.runs import CopyRuns

# ``ctypes.memmove`` returns the destination as a new Python int; the same C function
# declared to return nothing saves ~0.12 us of its ~0.5 us per call, which 64 KiB runs
# (~3 us each) notice. CFUNCTYPE prototypes release the GIL during the call.
_memmove_address = ctypes.cast(ctypes.memmove, ctypes.c_void_p).value
if _memmove_address is None:  # a ctypes without its own memmove: calling 0 would crash
    raise ImportError("ctypes.memmove has no address")
_memmove = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(
    _memmove_address
)


class Copier(Protocol):
    def copy(self, job: Job, hook: FaultHook | None) -> None:
        """Copy every run of ``job`` in order, calling ``hook`` before each when set."""


class MemmoveCopier:
    """Copies runs with ``memmove`` between raw addresses (host memory only)."""

    def __init__(self, layout: KVLayout, pool: CpuBlockPool) -> None:
        storages = [layout.storages[s.tensor_index] for s in layout.segments]
        self._segment_address = np.array([s.data_ptr() for s in storages], dtype=np.int64)
        self._segment_end = np.array([s.numel() for s in storages], dtype=np.int64)
        self._pool_address = pool.flat.data_ptr()
        self._pool_end = pool.flat.numel()

    def copy(self, job: Job, hook: FaultHook | None) -> None:
        runs = job.runs
        self._require_in_bounds(runs)
        device = (self._segment_address[runs.segment] + runs.device_offset).tolist()
        cpu = (runs.cpu_offset + self._pool_address).tolist()
        src, dst = (device, cpu) if job.direction is Direction.STORE else (cpu, device)
        sizes = runs.nbytes.tolist()
        if hook is None:
            deque(map(_memmove, dst, src, sizes), maxlen=0)
            return
        for index, (to, frm, size) in enumerate(zip(dst, src, sizes, strict=True)):
            hook(job.job_id, index)
            _memmove(to, frm, size)

    def _require_in_bounds(self, runs: CopyRuns) -> None:
        """A raw copy outside its buffers would corrupt memory silently: a planning bug
        must fail the job instead (ids were validated, so this never fires on bad input).
        """
        if not len(runs):
            return
        device_end = runs.device_offset + runs.nbytes
        if (device_end > self._segment_end[runs.segment]).any() or int(
            (runs.cpu_offset + runs.nbytes).max()
        ) > self._pool_end:
            raise RuntimeError("a copy run lies outside its buffer: refusing to copy")


class TensorCopier:
    """Copies runs with ``Tensor.copy_(non_blocking=True)`` between byte views."""

    def __init__(self, layout: KVLayout, pool: CpuBlockPool) -> None:
        self._storages = [layout.storages[s.tensor_index] for s in layout.segments]
        self._pool = pool.flat

    def copy(self, job: Job, hook: FaultHook | None) -> None:
        runs = job.runs
        store = job.direction is Direction.STORE
        columns = (runs.segment, runs.device_offset, runs.cpu_offset, runs.nbytes)
        for index, (segment, device_at, cpu_at, size) in enumerate(
            zip(*(c.tolist() for c in columns), strict=True)
        ):
            if hook is not None:
                hook(job.job_id, index)
            device = self._storages[segment][device_at : device_at + size]
            cpu = self._pool[cpu_at : cpu_at + size]
            if store:
                cpu.copy_(device, non_blocking=True)
            else:
                device.copy_(cpu, non_blocking=True)
