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
        column = np.array  # every per-segment constant is a column: it broadcasts over blocks
        self._base = column([[s.base] for s in segments], dtype=np.int64)
        self._stride = column([[s.stride] for s in segments], dtype=np.int64)
        self._nbytes = column([[s.nbytes] for s in segments], dtype=np.int64)
        starts = np.cumsum([0] + [s.nbytes for s in segments[:-1]], dtype=np.int64)
        self._cpu_offset = (factor * starts)[:, None]

    def runs(self, device_ids: IdArray, cpu_ids: IdArray, *, to_cpu: bool) -> CopyRuns:
        """The runs of one job; ids are validated already (``len(device_ids) == factor *
        len(cpu_ids)``, destinations distinct).
        """
        k = self.factor
        cpu_sub = np.repeat(cpu_ids * k, k) + np.arange(len(device_ids), dtype=np.int64) % k
        order = np.argsort(cpu_sub if to_cpu else device_ids, kind="stable")
        device_off = self._base + device_ids[order] * self._stride
        sorted_sub = cpu_sub[order]
        cpu_off = (sorted_sub // k) * self.cpu_block_bytes + self._cpu_offset
        cpu_off += (sorted_sub % k) * self._nbytes
        starts = np.ones(device_off.shape, dtype=bool)
        starts[:, 1:] = (device_off[:, 1:] != device_off[:, :-1] + self._nbytes) | (
            cpu_off[:, 1:] != cpu_off[:, :-1] + self._nbytes
        )
        first = np.flatnonzero(starts)
        segment = first // max(len(device_ids), 1)
        lengths = np.diff(first, append=starts.size)
        return CopyRuns(
            segment=segment,
            device_offset=device_off.ravel()[first],
            cpu_offset=cpu_off.ravel()[first],
            nbytes=lengths * self._nbytes[segment, 0],
        )
