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

from operator import itemgetter
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from kvoffload.transfer.layout import KVLayout

IdArray = npt.NDArray[np.int64]


class CopyRuns:
    """Run ``i`` copies ``nbytes[i]`` bytes between segment ``segment[i]``'s storage at
    ``device_offset[i]`` and the pool at ``cpu_offset[i]`` (direction is the job's).

    A job in which no pair continues another may be given as :class:`RunPairs` instead
    (``pairs``: one run per row of the layout and pair of ids), which the memmove copier
    turns into addresses with no numpy call but one ``tolist`` per side; the columns are
    then computed on first use, for the copiers that need them. Built from columns,
    ``pairs`` is None.
    """

    # The columns are plain slots, read at C speed; for runs given as pairs they stay unset
    # until the first read, which falls through to __getattr__ and computes all four.
    __slots__ = ("_count", "cpu_offset", "device_offset", "nbytes", "pairs", "segment")
    segment: IdArray
    device_offset: IdArray
    cpu_offset: IdArray
    nbytes: IdArray

    def __init__(
        self, segment: IdArray, device_offset: IdArray, cpu_offset: IdArray, nbytes: IdArray
    ) -> None:
        self.segment, self.device_offset = segment, device_offset
        self.cpu_offset, self.nbytes = cpu_offset, nbytes
        self._count = len(nbytes)
        self.pairs: RunPairs | None = None

    @classmethod
    def of_pairs(cls, pairs: RunPairs) -> CopyRuns:
        runs = cls.__new__(cls)
        runs._count = len(pairs.device) * len(pairs.mapping.rows)
        runs.pairs = pairs
        return runs

    def __getattr__(self, name: str) -> IdArray:
        if name not in _COLUMNS or self.pairs is None:  # "pairs" itself never recurses
            raise AttributeError(name)
        pairs = self.pairs
        columns = pairs.mapping.unmerged_columns(pairs.device, pairs.sub)
        self.segment, self.device_offset, self.cpu_offset, self.nbytes = columns
        return columns[_COLUMNS.index(name)]

    def __len__(self) -> int:
        return self._count

    @property
    def total_bytes(self) -> int:
        if self.pairs is not None:
            return len(self.pairs.device) * self.pairs.mapping.bytes_per_block
        return int(self.nbytes.sum())


_COLUMNS = ("segment", "device_offset", "cpu_offset", "nbytes")


class RunPairs:
    """The runs of a job in which no pair of ids continues another: for each row of
    ``mapping`` in order, one run per pair, pairs in copy order (sorted by the side that is
    written). ``device[j]`` is pair ``j``'s device block, ``sub[j]`` its CPU sub-block
    (``cpu_id * factor + j % factor``).
    """

    __slots__ = ("_lists", "device", "mapping", "sub")

    def __init__(self, mapping: BlockMapping, device: IdArray, sub: IdArray) -> None:
        self.mapping, self.device, self.sub = mapping, device, sub
        self._lists: tuple[list[int], list[int]] | None = None

    def lists(self) -> tuple[list[int], list[int]]:
        """``device`` and ``sub`` as lists of ints (made once)."""
        if self._lists is None:
            self._lists = (self.device.tolist(), self.sub.tolist())
        return self._lists


class BlockMapping:
    """Turns (device block ids, CPU block ids) into :class:`CopyRuns` for one layout.

    Jobs of up to ``small_job`` (segment, block) pairs are planned in plain Python, larger
    ones with numpy: numpy's per-call cost (a few dozen calls, ~20 us) would otherwise be
    most of the cost of a one-block job. Both give the same runs (a test checks it). A
    numpy-planned job in which no pair continues another (random ids; always, for separate
    per-layer tensors with k = 1) is returned as :class:`RunPairs`, its columns computed
    only if a copier asks for them.
    """

    def __init__(self, layout: KVLayout, factor: int, small_job: int = 32) -> None:
        rows = _rows_of(layout, factor)
        self.factor = factor
        self.small_job = small_job
        self.bytes_per_block = layout.bytes_per_block
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
        self.rows = tuple(rows)  # the copiers that take RunPairs read the rows too

    def runs(self, device_ids: IdArray, cpu_ids: IdArray, *, to_cpu: bool) -> CopyRuns:
        """The runs of one job; ids are validated already (``len(device_ids) == factor *
        len(cpu_ids)``, destinations distinct).
        """
        if len(device_ids) * len(self.rows) <= self.small_job or not len(device_ids):
            return self._small_runs(device_ids.tolist(), cpu_ids.tolist(), to_cpu)
        return self._vector_runs(device_ids, cpu_ids, to_cpu)

    def _small_runs(self, device_ids: list[int], cpu_ids: list[int], to_cpu: bool) -> CopyRuns:
        k, block_bytes, cross = self.factor, self.cpu_block_bytes, self._runs_cross_cpu_blocks
        subs = [c * k + j for c in cpu_ids for j in range(k)]  # CPU sub-block of each pair
        pairs = sorted(zip(device_ids, subs, strict=True), key=itemgetter(1 if to_cpu else 0))
        columns: tuple[list[int], list[int], list[int], list[int]] = ([], [], [], [])
        segment, device_offset, cpu_offset, nbytes = columns
        for index, base, stride, size, offset, packed in self.rows:
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
            return CopyRuns.of_pairs(RunPairs(self, device, sub))
        follows = np.zeros(n, dtype=bool)
        follows[1:] = (device[1:] == device[:-1] + 1) & (sub[1:] == sub[:-1] + 1)
        if not self._runs_cross_cpu_blocks:
            follows[1:] &= sub[1:] % k != 0
        if not follows.any():  # random ids: one run per (row, pair), in that order
            return CopyRuns.of_pairs(RunPairs(self, device, sub))
        starts = np.flatnonzero(~(follows & self._packed[:, None]))  # over [segment, block]
        row, block = starts // n, starts % n
        lengths = np.empty_like(starts)
        lengths[:-1] = starts[1:] - starts[:-1]
        lengths[-1] = n * len(self.rows) - starts[-1]
        first_sub = sub[block]
        return CopyRuns(
            segment=self._segment[row],
            device_offset=self._base[row] + device[block] * self._stride[row],
            cpu_offset=(first_sub // k) * self.cpu_block_bytes
            + self._cpu_offset[row]
            + (first_sub % k) * self._nbytes[row],
            nbytes=lengths * self._nbytes[row],
        )

    def unmerged_columns(
        self, device: IdArray, sub: IdArray
    ) -> tuple[IdArray, IdArray, IdArray, IdArray]:
        """The columns of the runs when no pair of (``device``, ``sub``), in copy order,
        continues another: what the general case gives, in fewer calls."""
        k, n = self.factor, len(device)
        if k == 1:
            within = self._cpu_offset[:, None] + sub * self.cpu_block_bytes
        else:
            within = self._cpu_offset[:, None] + (sub // k * self.cpu_block_bytes)
            within += (sub % k) * self._nbytes[:, None]
        return (
            np.repeat(self._segment, n),
            (self._base[:, None] + device * self._stride[:, None]).ravel(),
            within.ravel(),
            np.repeat(self._nbytes, n),
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
