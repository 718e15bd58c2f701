"""The ways of executing a job's runs: ``memmove`` between addresses, numpy rows, ``copy_``.

Each takes every byte range from :class:`~kvoffload.transfer.runs.CopyRuns`.
``MemmoveCopier`` is the CPU path of large runs: one C call per run, without building a
tensor view per run, which is what holds 64 KiB runs near memcpy speed (docs/data_path.md);
ctypes releases the GIL during the call, so a worker thread copies while the caller runs
Python. ``RowCopier`` is the CPU path of small runs: per storage, one numpy gather and one
scatter of whole rows, so that a job of thousands of 4 KiB runs costs a few calls instead of
one Python-level call per run. ``TensorCopier`` issues ``copy_(non_blocking=True)`` per run:
on CUDA that is ``cudaMemcpyAsync`` on the current stream; on CPU it is the reference the
tests compare the fast paths against.
"""

from __future__ import annotations

import ctypes
import math
from collections import deque
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from kvoffload.transfer.jobs import Direction, FaultHook, Job
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.pool import CpuBlockPool
from kvoffload.transfer.runs import CopyRuns, IdArray, RunPairs, expand_runs, pool_spans

if TYPE_CHECKING:
    import torch

# Jobs whose runs average under this go through numpy rows on the CPU (RowCopier), larger
# ones through one memmove per run. Measured on our 2-core machines, 8 separate layers x 64
# random blocks, whole jobs: rows ~15% less CPU time at 4 KiB, even at 8 and 16 KiB,
# ~20% more at 32 KiB and 1.2-1.5x at 64 KiB (the gather's temporary is copied twice).
ROWS_BELOW = 8 * 1024
# Rows narrower than this would make numpy move a run in many tiny items: such layouts
# (odd byte sizes or offsets) keep memmove for every job.
ROWS_AT_LEAST = 512
# SpanCopier's items narrower than this cost numpy more per byte than a memmove per run
# (4 KiB items measured as fast as 64 KiB ones, 64-byte ones many times slower).
SPAN_UNIT_AT_LEAST = 4096
# Jobs of fewer runs, or of runs averaging this or more, go one memmove per run: at batch
# 1 and 8 (8 and 64 runs of 64 KiB) the span path measured 5-13 points slower, at batch 64
# 5-10 points faster; a 1 MiB memmove spends well under 1% of its time on the call.
SPAN_RUNS_AT_LEAST = 128
SPAN_BELOW = 1 << 20
# A store's span gathers rows of SpanCopier.unit bytes, and numpy's take spends one memmove
# on each: where the storages share only a 4 KiB grid (separate allocations), a 64 KiB run
# is 16 of them, which cost more than one Python-level memmove call for the whole run.
# Stores of runs averaging this many rows or more therefore go one memmove per run.
# Measured on our 2-core machines, 8 separate layers x 64 random blocks (storages 4 KiB
# apart modulo 64 KiB), CPU time against the plain copy, span against memmove, two engines
# side by side: 16 KiB runs (4 rows) 52-56% against 47%, 32 KiB (8 rows) 65-68% against
# 58-64%, 64 KiB (16 rows) 79-86% against 87-90% (three runs); 256 KiB (64 rows) even or
# better (docs/performance.md).
SPAN_GATHER_ROWS_BELOW = 16

# ``ctypes.memmove`` returns the destination as a new Python int; the same C function
# declared to return nothing saves ~0.12 us of its ~0.5 us per call, which 64 KiB runs
# (~3 us each) notice. The size is declared ``c_void_p`` where a pointer and a ``size_t``
# have the same size (C calling conventions then pass the two alike): ctypes
# converts an int to a pointer directly, to a ``c_size_t`` through its generic path, which
# measured ~0.07-0.19 us more per call (512 calls of 8 bytes, two runs: 0.30 and 0.45 us
# against 0.37 and 0.64). CFUNCTYPE prototypes release the GIL during the call.
_memmove_address = ctypes.cast(ctypes.memmove, ctypes.c_void_p).value
if _memmove_address is None:  # a ctypes without its own memmove: calling 0 would crash
    raise ImportError("ctypes.memmove has no address")
_size_t = (
    ctypes.c_void_p
    if ctypes.sizeof(ctypes.c_void_p) == ctypes.sizeof(ctypes.c_size_t)
    else ctypes.c_size_t
)
_memmove = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, _size_t)(_memmove_address)


class Copier(Protocol):
    def copy(self, job: Job, hook: FaultHook | None) -> None:
        """Copy every run of ``job`` in order, calling ``hook`` before each when set."""


class MemmoveCopier:
    """Copies runs with ``memmove`` between raw addresses (host memory only)."""

    def __init__(self, layout: KVLayout, pool: CpuBlockPool) -> None:
        storages = [layout.storages[s.tensor_index] for s in layout.segments]
        self._segment_addresses = [s.data_ptr() for s in storages]
        self._segment_sizes = [s.numel() for s in storages]
        self._segment_address = np.array(self._segment_addresses, dtype=np.int64)
        self._segment_end = np.array(self._segment_sizes, dtype=np.int64)
        self._pool_address = pool.flat.data_ptr()
        self._pool_end = pool.flat.numel()

    def check_bounds(self, runs: CopyRuns) -> None:
        """:func:`require_in_bounds` (:func:`require_pairs_in_bounds` for runs planned as
        pairs, which this copier copies from the pairs) against this layout's storages and
        this pool."""
        if runs.pairs is not None:
            require_pairs_in_bounds(runs.pairs, self._segment_sizes, self._pool_end)
        else:
            self.check_columns(runs)

    def check_columns(self, runs: CopyRuns) -> None:
        """:func:`require_in_bounds` on the columns, for a copier that copies by them."""
        require_in_bounds(runs, self._segment_end, self._pool_end)

    def copy(self, job: Job, hook: FaultHook | None) -> None:
        runs = job.runs
        self.check_bounds(runs)
        device: Iterable[int]
        cpu: Iterable[int]
        sizes: Iterable[int]
        if runs.pairs is not None:
            device, cpu, sizes = self._addresses(runs.pairs)
        else:
            device = (self._segment_address[runs.segment] + runs.device_offset).tolist()
            cpu = (runs.cpu_offset + self._pool_address).tolist()
            sizes = runs.nbytes.tolist()
        src, dst = (device, cpu) if job.direction is Direction.STORE else (cpu, device)
        if hook is None:
            deque(map(_memmove, dst, src, sizes), maxlen=0)
            return
        for index, (to, frm, size) in enumerate(zip(dst, src, sizes, strict=True)):
            hook(job.job_id, index)
            _memmove(to, frm, size)

    def _addresses(self, pairs: RunPairs) -> tuple[Iterator[int], Iterator[int], list[int]]:
        """The device and pool addresses of the runs, in run order, as iterators that
        compute each address when the copy loop asks for it, and the runs' sizes. Right
        after the previous job's copy has flushed the caches, building the addresses as
        lists first costs ~100 ns per new int (a job of 512 runs: ~90-150 us more than a
        loop over lists built beforehand, measured so); made one at a time, each int is
        freed by the time the next is made, in memory the loop keeps warm, and the loop
        costs what it costs over ready lists. (numpy's arithmetic and ``tolist`` pay the
        first-call costs of their functions too: ~80 us for the same job.)
        """
        (device, sub), k = pairs.lists(), pairs.mapping.factor
        block = pairs.mapping.cpu_block_bytes
        count = len(device)
        scaled: dict[int, list[int]] = {}  # device offset of each pair, per stride
        within: dict[int, list[int]] = {}  # pool offset of each pair, per row size
        if k == 1:
            within[0] = [s * block for s in sub]
        device_rows: list[tuple[int, list[int]]] = []
        pool_rows: list[tuple[int, list[int]]] = []
        sizes: list[int] = []
        for segment, base, stride, nbytes, cpu_offset, _ in pairs.mapping.rows:
            offsets = scaled.get(stride)
            if offsets is None:
                offsets = scaled[stride] = [d * stride for d in device]
            device_rows.append((self._segment_addresses[segment] + base, offsets))
            step = 0 if k == 1 else nbytes  # sub-block j of a segment: j * nbytes further
            at = within.get(step)
            if at is None:
                at = within[step] = [s // k * block + s % k * nbytes for s in sub]
            pool_rows.append((self._pool_address + cpu_offset, at))
            sizes += [nbytes] * count  # the same int object over and over: nothing is made
        return (
            (start + offset for start, offsets in device_rows for offset in offsets),
            (start + offset for start, offsets in pool_rows for offset in offsets),
            sizes,
        )


def require_pairs_in_bounds(pairs: RunPairs, segment_size: list[int], pool_end: int) -> None:
    """:func:`require_in_bounds` for runs planned as :class:`RunPairs`: a run's offsets grow
    with its ids (strides are not negative; a sub-block's offset within its CPU block is
    below the block's size), so each row's runs lie in their buffers when those of its
    lowest and highest ids do. ``segment_size[s]`` is the byte size of segment ``s``'s
    storage.
    """
    device, sub = pairs.lists()
    if not device:
        return
    low, high = min(device), max(device)
    first, last = min(sub), max(sub)
    k, block = pairs.mapping.factor, pairs.mapping.cpu_block_bytes
    for segment, base, stride, nbytes, cpu_offset, _ in pairs.mapping.rows:
        lowest = first // k * block + cpu_offset + first % k * nbytes
        highest = last // k * block + cpu_offset + last % k * nbytes
        if (
            base + low * stride < 0
            or base + high * stride + nbytes > segment_size[segment]
            or lowest < 0
            or highest + nbytes > pool_end
        ):
            raise RuntimeError("a copy run lies outside its buffer: refusing to copy")


def require_in_bounds(runs: CopyRuns, segment_end: IdArray, pool_end: int) -> None:
    """A raw copy outside its buffers would corrupt memory silently: a planning bug must
    fail the job instead (ids were validated, so this never fires on bad input).
    ``segment_end[s]`` is the byte size of segment ``s``'s storage.
    """
    if not len(runs):
        return
    device_end = runs.device_offset + runs.nbytes
    if (device_end > segment_end[runs.segment]).any() or int(
        (runs.cpu_offset + runs.nbytes).max()
    ) > pool_end:
        raise RuntimeError("a copy run lies outside its buffer: refusing to copy")


class SpanCopier:
    """Copies a job in one numpy call per pool span (host memory only), with no temporary.

    Separate per-layer tensors make a 64 KiB block 8 runs of 64 KiB in 8 storages, and one
    Python-level call per run (``MemmoveCopier``) costs ~1 us with the caches its previous
    copy flushed: ~12 points of a plain copy's speed at batch 64 (docs/data_path.md). Here
    every storage of the layout is seen through one array that spans the address range
    holding them all, so the runs of every layer that meet in one stretch of the pool (a
    CPU block's layers, or consecutive CPU blocks) are copied by one numpy call that moves
    item after item in a C loop, with the GIL released, directly between the two buffers.
    The bytes between the storages are never read or written: every index comes from a
    run that ``require_in_bounds`` has checked against its own storage.

    - A load scatters a pool span with one fancy assignment into ``width``-byte items
      (:func:`row_unit`: every run is whole items) that start at every ``unit`` bytes of the
      span, ``unit`` being ``width`` divided down by the storages' distances from the lowest
      one. The items overlap when ``unit < width``, which numpy's assignment allows: the
      storages' alignment to each other (the allocator's) does not matter.
    - A store gathers with ``ndarray.take(out=)``, which needs items that tile the array:
      rows of ``unit`` bytes. Storages placed at distances that share no 4 KiB factor give
      rows too narrow to pay, and stores are better off one ``memmove`` per run.

    A direction whose items would be narrower than ``narrowest`` bytes goes one
    ``memmove`` per run instead (``gathers`` and ``scatters`` tell which take the span), and
    so do jobs of fewer than ``fewest_runs`` runs or of runs averaging ``below`` bytes or
    more: there the ~20 numpy calls of planning the spans cost more than the memmove calls
    they save. So do stores whose runs average ``gather_rows_below`` rows of ``unit`` bytes
    or more: numpy's take moves each row with a memmove of its own, so a run of many rows
    costs more that way than by one memmove call (the engine's default copier sets all four,
    SPAN_*). So does every job when the pool lies inside the storages' address range:
    numpy's overlap checks go by bounds, and would copy through a temporary.
    """

    def __init__(
        self,
        layout: KVLayout,
        pool: CpuBlockPool,
        *,
        narrowest: int = 1,
        fewest_runs: int = 1,
        below: int | None = None,
        gather_rows_below: int | None = None,
    ) -> None:
        storage_of_segment, distinct = distinct_storages(layout)
        pointers = [storage.data_ptr() for storage in distinct]
        low = min(pointers)
        high = max(p + storage.numel() for p, storage in zip(pointers, distinct, strict=True))
        self.width = row_unit(layout, pool)
        self.unit = math.gcd(self.width, *(p - low for p in pointers))
        pool_low = pool.flat.data_ptr()
        apart = pool_low + pool.flat.numel() <= low or pool_low >= high
        self.fewest_runs, self.below = fewest_runs, below
        self.gather_rows_below = gather_rows_below
        self.gathers = apart and self.unit >= narrowest
        self.scatters = apart and self.width >= narrowest
        memory = memoryview((ctypes.c_char * (high - low)).from_address(low))
        rows = (high - low) // self.unit
        self._rows = np.frombuffer(memory[: rows * self.unit], dtype=np.uint8).view(
            np.dtype((np.void, self.unit))
        )
        self._items = np.ndarray(
            ((high - low - self.width) // self.unit + 1,),
            dtype=np.dtype((np.void, self.width)),
            buffer=memory,
            strides=(self.unit,),
        )
        storage_at = np.array([(p - low) // self.unit for p in pointers], dtype=np.int64)
        self._segment_at = storage_at[storage_of_segment]  # in units from the span's start
        self._pool_rows = _void_rows(pool.flat, self.unit)
        self._pool_items = _void_rows(pool.flat, self.width)
        self._memmove = MemmoveCopier(layout, pool)  # its fallback, and its bounds check

    @property
    def usable(self) -> bool:
        """Whether either direction is faster here than one memmove per run."""
        return self.gathers or self.scatters

    def copy(self, job: Job, hook: FaultHook | None) -> None:
        runs = job.runs
        if not len(runs):
            return
        fault_up_front(job, hook)  # either way, as for every batched copier
        store = job.direction is Direction.STORE
        rows_below = self.gather_rows_below if store else None
        if (
            not (self.gathers if store else self.scatters)
            or len(runs) < self.fewest_runs
            or (self.below is not None and job.nbytes >= self.below * len(runs))
            or (rows_below is not None and job.nbytes >= rows_below * self.unit * len(runs))
        ):
            self._memmove.copy(job, None)
            return
        self._memmove.check_columns(runs)  # what the indexes below are made from
        # Every numpy call here costs ~5-10 us, not ~1: the previous job's copy has flushed
        # the caches. So the usual job, runs of one size (one per layer and block), takes
        # the path of fewest calls; mixed sizes (merged runs of consecutive ids) the general.
        size = self.unit if store else self.width  # bytes per item
        step = size // self.unit  # units from one item of a run to the next
        order = np.argsort(runs.cpu_offset, kind="stable")
        pool_at = runs.cpu_offset[order] // size
        device_at = (self._segment_at[runs.segment] + runs.device_offset // self.unit)[order]
        nbytes = int(runs.nbytes[0])
        if (runs.nbytes == nbytes).all():
            count = nbytes // size
            items = (device_at[:, None] + np.arange(0, count * step, step)).ravel()
            breaks = np.flatnonzero(pool_at[1:] != pool_at[:-1] + count).tolist()
            firsts, lasts = [0, *(b + 1 for b in breaks)], [*breaks, len(runs) - 1]
            starts = [first * count for first in firsts]
            ends = [(last + 1) * count for last in lasts]
        else:
            counts = runs.nbytes[order] // size
            within = expand_runs(np.zeros_like(counts), counts)
            items = np.repeat(device_at, counts) + within * step  # in pool order
            begin = np.cumsum(counts) - counts
            first_runs, last_runs = pool_spans(pool_at, counts)
            firsts = first_runs.tolist()
            starts = begin[first_runs].tolist()
            ends = (begin[last_runs] + counts[last_runs]).tolist()
        at = pool_at.tolist()
        # pool span i: the pool's items from at[firsts[i]] on <-> items[starts[i]:ends[i]]
        if store:
            rows, pool = self._rows, self._pool_rows
            for first, start, end in zip(firsts, starts, ends, strict=True):
                # the method, not np.take: its dispatch costs ~3x the call (~2.7 us here).
                # "clip" (never reached: rows were checked) because "raise" buffers ``out``
                rows.take(items[start:end], 0, pool[at[first] : at[first] + end - start], "clip")
        else:
            spread, pool = self._items, self._pool_items
            for first, start, end in zip(firsts, starts, ends, strict=True):
                spread[items[start:end]] = pool[at[first] : at[first] + end - start]


class RowCopier:
    """Copies runs as rows of ``unit`` bytes with numpy fancy indexing (host memory only).

    ``unit`` is the greatest common divisor of every segment's base, stride and size and of
    the CPU block size, so every run is whole rows of both its storage and the pool. Per
    storage, a store gathers the job's rows (one temporary of their bytes) and scatters
    them into the pool; a load the reverse. numpy moves each row with one ``memcpy`` in a
    C loop, and checks every row index, so a planning bug raises instead of writing outside
    a buffer.
    """

    def __init__(self, layout: KVLayout, pool: CpuBlockPool) -> None:
        self.unit = row_unit(layout, pool)
        self._storage_of_segment, distinct = distinct_storages(layout)
        self._rows = [_void_rows(storage, self.unit) for storage in distinct]
        self._pool = _void_rows(pool.flat, self.unit)

    def copy(self, job: Job, hook: FaultHook | None) -> None:
        runs = job.runs
        if not len(runs):
            return
        fault_up_front(job, hook)
        unit = self.unit
        device_row, cpu_row = runs.device_offset // unit, runs.cpu_offset // unit
        storage = self._storage_of_segment[runs.segment]
        if job.nbytes != len(runs) * unit:  # some runs are several rows long
            lengths = runs.nbytes // unit
            device_row = expand_runs(device_row, lengths)
            cpu_row = expand_runs(cpu_row, lengths)
            storage = np.repeat(storage, lengths)
        store = job.direction is Direction.STORE
        if len(self._rows) == 1:
            self._move(self._rows[0], device_row, cpu_row, store)
            return
        order = np.argsort(storage, kind="stable")
        ends = np.cumsum(np.bincount(storage, minlength=len(self._rows))).tolist()
        device_row, cpu_row = device_row[order], cpu_row[order]
        begin = 0
        for rows, end in zip(self._rows, ends, strict=True):
            if end > begin:
                self._move(rows, device_row[begin:end], cpu_row[begin:end], store)
            begin = end

    def _move(
        self,
        rows: npt.NDArray[Any],
        device_row: npt.NDArray[Any],
        cpu_row: npt.NDArray[Any],
        store: bool,
    ) -> None:
        if store:
            self._pool[cpu_row] = rows[device_row]
        else:
            rows[device_row] = self._pool[cpu_row]


def fault_up_front(job: Job, hook: FaultHook | None) -> None:
    """Ask ``hook`` about every run of ``job`` before any byte moves: for the copiers that
    move a job in a few batched calls, not run by run, a fault fails the job up front."""
    if hook is not None:
        for index in range(len(job.runs)):
            hook(job.job_id, index)


def row_unit(layout: KVLayout, pool: CpuBlockPool) -> int:
    """The widest rows that every run of ``layout`` <-> ``pool`` consists of, in bytes."""
    segments = layout.segments
    return math.gcd(
        *(value for s in segments for value in (s.base, s.stride, s.nbytes)), pool.block_bytes
    )


def distinct_storages(layout: KVLayout) -> tuple[IdArray, list[torch.Tensor]]:
    """The distinct storages under ``layout``'s segments, and for each segment the index of
    its own among them: several segments (a layer's K and V, layers as views) may share one."""
    storages = [layout.storages[segment.tensor_index] for segment in layout.segments]
    distinct: dict[int, torch.Tensor] = {}
    for storage in storages:
        distinct.setdefault(storage.data_ptr(), storage)
    place = {pointer: index for index, pointer in enumerate(distinct)}
    of_segment = np.array([place[storage.data_ptr()] for storage in storages], dtype=np.int64)
    return of_segment, list(distinct.values())


def _void_rows(flat: torch.Tensor, unit: int) -> npt.NDArray[Any]:
    """A flat CPU byte tensor as a numpy array of ``unit``-byte items (a tail shorter than
    one row, which no run reaches, is left out)."""
    array = flat.numpy()
    return array[: array.size // unit * unit].view(np.dtype((np.void, unit)))


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
