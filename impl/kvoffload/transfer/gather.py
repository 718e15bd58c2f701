"""Small runs through one staging buffer: gather on the device, few large copies across.

A job of small blocks has thousands of runs of a few KiB; one ``cudaMemcpyAsync`` each
costs microseconds of fixed overhead, so 4 KiB blocks crawl at under 1 GB/s. The
:class:`GatherCopier` instead moves a job in three steps:

- store: per device storage, one ``index_select`` gathers the job's rows into a temporary
  and one ``index_copy_`` puts them into a staging buffer on the device, in pool order;
  then one copy per *span* (runs that are contiguous in the pool, e.g. a whole CPU block)
  from the staging buffer into the pinned pool;
- load: the reverse; one copy per pool span into the staging buffer, then per storage one
  ``index_select`` + ``index_copy_`` scatters the rows into place.

Everything is addressed in rows of ``unit`` bytes, the greatest common divisor of every
segment's base, stride and size, so that every run is whole rows. The same code runs on
CPU tensors (the tests check it byte for byte there); on CUDA every step is queued on the
current stream (the job's), and the staging buffer comes from torch's caching allocator
on that stream, so it is not reused before the job's copies are done.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvoffload.transfer.copiers import Copier, distinct_storages, fault_up_front, row_unit
from kvoffload.transfer.jobs import Direction, FaultHook, Job
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.pool import CpuBlockPool
from kvoffload.transfer.runs import CopyRuns, IdArray, expand_runs, pool_spans

if TYPE_CHECKING:
    import torch

# Runs shorter than this on average go through the staging buffer on CUDA: below it one
# copy's fixed cost is a large part of moving its bytes across PCIe.
GATHER_BELOW = 256 * 1024


class GatherCopier:
    """Copies a job's runs through one contiguous staging buffer (module docstring)."""

    def __init__(self, layout: KVLayout, pool: CpuBlockPool) -> None:
        self.unit = row_unit(layout, pool)
        self._storage_of_segment, distinct = distinct_storages(layout)
        # Kernels move one element per thread: 8-byte elements where every row allows them
        pointers = (*(storage.data_ptr() for storage in distinct), pool.flat.data_ptr())
        wide = self.unit % 8 == 0 and all(pointer % 8 == 0 for pointer in pointers)
        self._rows = [_rows_of(storage, self.unit, wide) for storage in distinct]
        self._pool = _rows_of(pool.flat, self.unit, wide)
        self._device = layout.device

    def copy(self, job: Job, hook: FaultHook | None) -> None:
        runs = job.runs
        if not len(runs):
            return
        fault_up_front(job, hook)
        move_through_staging(
            runs,
            self._storage_of_segment,
            self._rows,
            self._pool,
            self.unit,
            store=job.direction is Direction.STORE,
        )


def move_through_staging(
    runs: CopyRuns,
    storage_of_segment: IdArray,
    storage_rows: list[torch.Tensor],
    pool_rows: torch.Tensor,
    unit: int,
    *,
    store: bool,
) -> None:
    """Copy ``runs`` between the storages (``[rows, unit]`` views) and the pool's rows
    through one staging buffer on the storages' device (see the module docstring).
    """
    import torch

    order = np.argsort(runs.cpu_offset, kind="stable")
    rows = runs.nbytes[order] // unit
    cpu_row = runs.cpu_offset[order] // unit
    device_row = runs.device_offset[order] // unit
    storage = storage_of_segment[runs.segment[order]]
    staged_at = np.cumsum(rows) - rows  # where each run lies in the staging buffer
    total = int(rows.sum())
    device = storage_rows[0].device
    staging = pool_rows.new_empty((total, pool_rows.shape[1]), device=device)
    firsts, lasts = pool_spans(cpu_row, rows)
    spans = list(zip(firsts.tolist(), lasts.tolist(), strict=True))
    if not store:
        for first, last in spans:
            begin, end = int(staged_at[first]), int(staged_at[last] + rows[last])
            at = int(cpu_row[first])
            staging[begin:end].copy_(pool_rows[at : at + end - begin], non_blocking=True)
    for index, rows_view in enumerate(storage_rows):
        mine = np.flatnonzero(storage == index)
        if not len(mine):
            continue
        source = expand_runs(device_row[mine], rows[mine])
        staged = expand_runs(staged_at[mine], rows[mine])
        at_device = torch.from_numpy(source).to(device)
        at_staging = torch.from_numpy(staged).to(device)
        if store:
            staging.index_copy_(0, at_staging, rows_view.index_select(0, at_device))
        else:
            rows_view.index_copy_(0, at_device, staging.index_select(0, at_staging))
    if store:
        for first, last in spans:
            begin, end = int(staged_at[first]), int(staged_at[last] + rows[last])
            at = int(cpu_row[first])
            pool_rows[at : at + end - begin].copy_(staging[begin:end], non_blocking=True)


def _rows_of(flat: torch.Tensor, unit: int, wide: bool) -> torch.Tensor:
    """A flat byte tensor as whole rows of ``unit`` bytes, of 8-byte elements when
    ``wide`` (a tail shorter than one row, which no run reaches, is left out).
    """
    import torch

    rows = flat[: flat.numel() // unit * unit]
    return (rows.view(torch.int64) if wide else rows).view(-1, unit // 8 if wide else unit)


class ThresholdCopier:
    """Sends each job to ``small`` when its runs average under ``below`` bytes, else to
    ``large``: coalesced runs of contiguous blocks keep their direct copies.
    """

    def __init__(self, small: Copier, large: Copier, below: int = GATHER_BELOW) -> None:
        self.small, self.large, self.below = small, large, below

    def copy(self, job: Job, hook: FaultHook | None) -> None:
        # job.nbytes is what the runs add up to, without a numpy sum: after the previous
        # job's copy has flushed the caches, each numpy call costs ~5-10 us
        chosen = self.small if job.nbytes < self.below * len(job.runs) else self.large
        chosen.copy(job, hook)
