"""Which bytes a job copies: device blocks <-> CPU blocks, coalesced into contiguous runs.

A CPU block holds ``factor`` consecutive device blocks (vLLM's block size factor): device
block ``device_ids[j]`` goes to sub-block ``j % factor`` of CPU block ``cpu_ids[j // factor]``.
Inside a CPU block the bytes are segment-major (``[segment][sub-block][bytes]``), so all the
layers of a CPU block are contiguous and the ``factor`` sub-blocks of a segment form one run.
Pairs are sorted by destination and neighbours that are contiguous on both sides merge into
one run: DESIGN.md section 4 measured coalesced runs at ~100% of memcpy where per-block
copies of 64 KiB reach ~55%.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    """Turns (device block ids, CPU block ids) into :class:`CopyRuns` for one layout."""

    def __init__(self, layout: KVLayout, factor: int) -> None:
        segments = layout.segments
        self.factor = factor
        self.cpu_block_bytes = factor * layout.bytes_per_block
        self._base = np.array([s.base for s in segments], dtype=np.int64)
        self._stride = np.array([s.stride for s in segments], dtype=np.int64)
        self._nbytes = np.array([s.nbytes for s in segments], dtype=np.int64)
        self._cpu_offset = factor * (np.cumsum(self._nbytes) - self._nbytes)
        self._sub_blocks = np.arange(factor, dtype=np.int64)
        # Where block i may continue the run of block i-1 (consecutive ids on both sides):
        # on the device, only in segments whose blocks are packed; in the pool, within a
        # CPU block, and across CPU blocks only when a CPU block is a single segment.
        self._packed = (self._stride == self._nbytes)[:, None]
        self._runs_cross_cpu_blocks = len(segments) == 1

    def runs(self, device_ids: IdArray, cpu_ids: IdArray, *, to_cpu: bool) -> CopyRuns:
        """The runs of one job; ids are validated already (``len(device_ids) == factor *
        len(cpu_ids)``, destinations distinct). Each numpy call here works on the whole job,
        so a job costs a few dozen calls whatever its size.
        """
        k, n = self.factor, len(device_ids)
        if n == 0:
            empty = np.empty(0, dtype=np.int64)
            return CopyRuns(empty, empty, empty, empty)
        cpu_sub = cpu_ids if k == 1 else (cpu_ids[:, None] * k + self._sub_blocks).ravel()
        order = np.argsort(cpu_sub if to_cpu else device_ids, kind="stable")
        device, sub = device_ids[order], cpu_sub[order]
        follows = np.zeros(n, dtype=bool)
        follows[1:] = (device[1:] == device[:-1] + 1) & (sub[1:] == sub[:-1] + 1)
        if not self._runs_cross_cpu_blocks:
            follows[1:] &= sub[1:] % k != 0
        starts = np.flatnonzero(~(follows & self._packed))  # row-major over [segment, block]
        segment, block = starts // n, starts % n
        lengths = np.empty_like(starts)
        lengths[:-1] = starts[1:] - starts[:-1]
        lengths[-1] = follows.size * len(self._nbytes) - starts[-1]
        first_sub = sub[block]
        return CopyRuns(
            segment=segment,
            device_offset=self._base[segment] + device[block] * self._stride[segment],
            cpu_offset=(first_sub // k) * self.cpu_block_bytes
            + self._cpu_offset[segment]
            + (first_sub % k) * self._nbytes[segment],
            nbytes=lengths * self._nbytes[segment],
        )
