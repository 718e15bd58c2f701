"""Which bytes a job copies: device blocks <-> CPU blocks, coalesced into contiguous runs.

A CPU block holds ``factor`` consecutive device blocks (vLLM's block size factor): device
block ``device_ids[j]`` goes to sub-block ``j % factor`` of CPU block ``cpu_ids[j // factor]``.
Inside a CPU block the bytes are segment-major (``[segment][sub-block][bytes]``), so all the
layers of a CPU block are contiguous and the ``factor`` sub-blocks of a segment form one run.
Pairs are sorted by destination and neighbours that are contiguous on both sides merge into
one run: on our 2-core machines coalesced runs measured at ~100% of memcpy where per-block
copies of 64 KiB reach ~55%.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import itemgetter
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from kvoffload.transfer.layout import KVLayout

IdArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class CopyRuns:
    """Run ``i`` copies ``nbytes[i]`` bytes between segment ``segment[i]``'s storage at
    ``device_offset[i]`` and the pool at ``cpu_offset[i]`` (direction is the job's).
    """

    segment: IdArray
    device_offset: IdArray
    cpu_offset: IdArray
    nbytes: IdArray

    def __len__(self) -> int:
        return len(self.nbytes)

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum())


class BlockMapping:
    """Turns (device block ids, CPU block ids) into :class:`CopyRuns` for one layout.

    Jobs of up to ``small_job`` (segment, block) pairs are planned in plain Python, larger
    ones with numpy: numpy's per-call cost (a few dozen calls, ~20 us) would otherwise be
    most of the cost of a one-block job. Both give the same runs (a test checks it).
    """

    def __init__(self, layout: KVLayout, factor: int, small_job: int = 32) -> None:
        rows = _rows_of(layout, factor)
        self.factor = factor
        self.small_job = small_job
        self.cpu_block_bytes = factor * layout.bytes_per_block
        self._segment = np.array([r.segment for r in rows], dtype=np.int64)
        self._base = np.array([r.base for r in rows], dtype=np.int64)
        self._stride = np.array([r.stride for r in rows], dtype=np.int64)
        self._nbytes = np.array([r.nbytes for r in rows], dtype=np.int64)
        self._cpu_offset = np.array([r.cpu_offset for r in rows], dtype=np.int64)
        self._sub_blocks = np.arange(factor, dtype=np.int64)
        # Where block i may continue the run of block i-1 (consecutive ids on both sides):
        # on the device, only in rows whose blocks are packed; in the pool, within a
        # CPU block, and across CPU blocks only when a CPU block is a single row.
        self._packed = self._stride == self._nbytes
        self._runs_cross_cpu_blocks = len(rows) == 1
        # Per-layer tensors with k = 1 (a CPU block's layers back to back): a pair never
        # continues the previous one's run in the pool, so the search for runs is skipped.
        self._can_merge = bool(self._packed.any()) and (self._runs_cross_cpu_blocks or factor > 1)
        self._rows = rows

    def runs(self, device_ids: IdArray, cpu_ids: IdArray, *, to_cpu: bool) -> CopyRuns:
        """The runs of one job; ids are validated already (``len(device_ids) == factor *
        len(cpu_ids)``, destinations distinct).
        """
        if len(device_ids) * len(self._rows) <= self.small_job or not len(device_ids):
            return self._small_runs(device_ids.tolist(), cpu_ids.tolist(), to_cpu)
        return self._vector_runs(device_ids, cpu_ids, to_cpu)

    def _small_runs(self, device_ids: list[int], cpu_ids: list[int], to_cpu: bool) -> CopyRuns:
        k, block_bytes, cross = self.factor, self.cpu_block_bytes, self._runs_cross_cpu_blocks
        subs = [c * k + j for c in cpu_ids for j in range(k)]  # CPU sub-block of each pair
        pairs = sorted(zip(device_ids, subs, strict=True), key=itemgetter(1 if to_cpu else 0))
        columns: tuple[list[int], list[int], list[int], list[int]] = ([], [], [], [])
        segment, device_offset, cpu_offset, nbytes = columns
        for index, base, stride, size, offset, packed in self._rows:
            previous = (-2, -2)
            for device, sub in pairs:
                if packed and previous == (device - 1, sub - 1) and (cross or sub % k):
                    nbytes[-1] += size
                else:
                    segment.append(index)
                    device_offset.append(base + device * stride)
                    cpu_offset.append(sub // k * block_bytes + offset + sub % k * size)
                    nbytes.append(size)
                previous = (device, sub)
        return CopyRuns(*(np.array(column, dtype=np.int64) for column in columns))

    def _vector_runs(self, device_ids: IdArray, cpu_ids: IdArray, to_cpu: bool) -> CopyRuns:
        k, n = self.factor, len(device_ids)
        cpu_sub = cpu_ids if k == 1 else (cpu_ids[:, None] * k + self._sub_blocks).ravel()
        order = np.argsort(cpu_sub if to_cpu else device_ids, kind="stable")
        device, sub = device_ids[order], cpu_sub[order]
        if not self._can_merge:
            return self._unmerged_runs(device, sub)
        follows = np.zeros(n, dtype=bool)
        follows[1:] = (device[1:] == device[:-1] + 1) & (sub[1:] == sub[:-1] + 1)
        if not self._runs_cross_cpu_blocks:
            follows[1:] &= sub[1:] % k != 0
        if not follows.any():  # random ids: one run per (row, pair), in that order
            return self._unmerged_runs(device, sub)
        starts = np.flatnonzero(~(follows & self._packed[:, None]))  # over [segment, block]
        row, block = starts // n, starts % n
        lengths = np.empty_like(starts)
        lengths[:-1] = starts[1:] - starts[:-1]
        lengths[-1] = n * len(self._rows) - starts[-1]
        first_sub = sub[block]
        return CopyRuns(
            segment=self._segment[row],
            device_offset=self._base[row] + device[block] * self._stride[row],
            cpu_offset=(first_sub // k) * self.cpu_block_bytes
            + self._cpu_offset[row]
            + (first_sub % k) * self._nbytes[row],
            nbytes=lengths * self._nbytes[row],
        )

    def _unmerged_runs(self, device: IdArray, sub: IdArray) -> CopyRuns:
        """What the general case gives when no pair continues another, in fewer calls."""
        k, n = self.factor, len(device)
        if k == 1:
            within = self._cpu_offset[:, None] + sub * self.cpu_block_bytes
        else:
            within = self._cpu_offset[:, None] + (sub // k * self.cpu_block_bytes)
            within += (sub % k) * self._nbytes[:, None]
        return CopyRuns(
            segment=np.repeat(self._segment, n),
            device_offset=(self._base[:, None] + device * self._stride[:, None]).ravel(),
            cpu_offset=within.ravel(),
            nbytes=np.repeat(self._nbytes, n),
        )


def expand_runs(starts: IdArray, lengths: IdArray) -> IdArray:
    """``concat(arange(s, s + n) for s, n in zip(starts, lengths))`` in numpy calls."""
    ends = np.cumsum(lengths)
    shifted = np.repeat(starts - (ends - lengths), lengths)
    return shifted + np.arange(int(ends[-1]), dtype=np.int64)


def pool_spans(cpu_row: IdArray, rows: IdArray) -> tuple[IdArray, IdArray]:
    """The first and the last run of each stretch of runs (sorted by ``cpu_row``, each
    ``rows`` long) that follow each other in the pool."""
    breaks = np.flatnonzero(cpu_row[1:] != cpu_row[:-1] + rows[:-1]) + 1
    firsts = np.concatenate(([0], breaks))
    lasts = np.concatenate((breaks - 1, [len(rows) - 1]))
    return firsts, lasts


class _Row(NamedTuple):
    """Consecutive segments copied as one: ``nbytes`` from ``base + block * stride`` of
    ``segment``'s storage, to ``cpu_offset`` inside the (first sub-block of a) CPU block.
    """

    segment: int
    base: int
    stride: int
    nbytes: int
    cpu_offset: int
    packed: bool


def _rows_of(layout: KVLayout, factor: int) -> list[_Row]:
    """The layout's segments, with neighbours merged where a block's bytes of segment
    ``s + 1`` follow those of segment ``s`` both on the device (same storage, same stride,
    adjacent) and in the pool (``factor == 1``: a CPU block is then the device block's
    segments back to back). Per-layer views of one cross-layer tensor (``cache[:, layer]``)
    merge so into one row of whole blocks, which also coalesces across blocks.
    """
    storage = [layout.storages[s.tensor_index].data_ptr() for s in layout.segments]
    rows: list[_Row] = []
    cpu_offset = 0
    for index, segment in enumerate(layout.segments):
        last = rows[-1] if rows else None
        if (
            last is not None
            and factor == 1
            and storage[last.segment] == storage[index]
            and last.stride == segment.stride
            and last.base + last.nbytes == segment.base
        ):
            nbytes = last.nbytes + segment.nbytes
            rows[-1] = last._replace(nbytes=nbytes, packed=segment.stride == nbytes)
        else:
            packed = segment.stride == segment.nbytes
            rows.append(
                _Row(index, segment.base, segment.stride, segment.nbytes, cpu_offset, packed)
            )
        cpu_offset += factor * segment.nbytes
    return rows
