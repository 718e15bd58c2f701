"""Moving slots between the disk and the caller's memory: gathered system calls, no copy.

A run of adjacent slots is one ``pwritev`` (``preadv``) of their pieces: for each slot its
header page (from memory of the store's own), then its payload straight from (into) the
caller's buffer, then the padding to the next page. Where the file system takes
``O_DIRECT`` and every piece of a call is page-aligned in memory and in length (a CPU pool
of blocks that are multiples of 4 KiB is), the call goes through a descriptor opened with
``O_DIRECT``: the bytes move between the pool and the device, past the page cache (host RAM
is the scarce tier: the disk's blocks should not take it over). Anything else goes through
an ordinary descriptor of the same file; the kernel keeps the two coherent.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final

from kvoffload.tiers.disk_layout import ALIGN

# Buffers one pwritev/preadv takes (the kernel's limit, 1024 on Linux).
IOV_MAX: Final = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
_O_DIRECT: Final = getattr(os, "O_DIRECT", 0)


# A call's runs are cut into parts of at least this many bytes for the helper threads.
PART_BYTES: Final = 1 << 20


class IoThreads:
    """The calling thread and up to ``count - 1`` helpers (started at first need), sharing
    one call's parts: system calls release the GIL, so a call's runs overlap."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._executor: ThreadPoolExecutor | None = None

    def split(self, slots: list[int], nbytes: int) -> list[list[int]]:
        """Cut a sorted list of slots into at most ``count`` parts of adjacent slots, each
        of at least ``PART_BYTES`` (a run is never cut where it need not be)."""
        parts = max(1, min(self.count, nbytes // PART_BYTES))
        size = -(-len(slots) // parts)
        return [slots[i : i + size] for i in range(0, len(slots), size)]

    def run(self, parts: list[Any], work: Callable[[Any], Any]) -> list[Any]:
        """``work(part)`` for every part, on the helper threads and this one."""
        if len(parts) == 1:
            return [work(parts[0])]
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.count - 1, thread_name_prefix="kvoffload-disk")
        later = [self._executor.submit(work, part) for part in parts[1:]]
        return [work(parts[0]), *(future.result() for future in later)]

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)


def page_aligned(nbytes: int) -> memoryview:
    """Zeroed memory of ``nbytes`` (at least one page), page-aligned (an anonymous map)."""
    return memoryview(mmap.mmap(-1, max(nbytes, ALIGN)))


def address(view: memoryview) -> int:
    """Where ``view``'s first byte lies in memory."""
    import numpy as np

    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0


def aligned(view: memoryview) -> bool:
    return view.nbytes % ALIGN == 0 and address(view) % ALIGN == 0


class SlotFile:
    """The slot file, open twice: buffered, and with ``O_DIRECT`` where allowed."""

    def __init__(self, path: str, *, direct: bool | None) -> None:
        """``direct``: None uses ``O_DIRECT`` where the file system takes it, True requires
        it (``OSError`` if refused), False never uses it."""
        self.path = path
        self.buffered = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self.direct: int | None = None
        if direct is not False and _O_DIRECT:
            try:
                self.direct = os.open(path, os.O_RDWR | _O_DIRECT)
            except OSError:
                if direct:
                    os.close(self.buffered)
                    raise
        elif direct:
            os.close(self.buffered)
            raise OSError("O_DIRECT is not available on this system")

    def close(self) -> None:
        for descriptor in (self.buffered, self.direct):
            if descriptor is not None:
                os.close(descriptor)
        self.direct = None

    def _descriptor(self, pieces: Sequence[memoryview]) -> int:
        if self.direct is not None and all(map(aligned, pieces)):
            return self.direct
        return self.buffered

    def write(self, offset: int, pieces: list[memoryview]) -> None:
        """Write the concatenation of ``pieces`` at ``offset``, all of it (``OSError``: the
        file system is full or failing; part of it may be written)."""
        descriptor = self._descriptor(pieces)
        for start in range(0, len(pieces), IOV_MAX):
            chunk = pieces[start : start + IOV_MAX]
            offset = _all(os.pwritev, descriptor, self.buffered, chunk, offset)

    def read(self, offset: int, pieces: list[memoryview]) -> int:
        """Read into ``pieces`` from ``offset``; how many bytes came (fewer at the end of the
        file: one cut short behind the store's back)."""
        descriptor = self._descriptor(pieces)
        done = 0
        for start in range(0, len(pieces), IOV_MAX):
            chunk = pieces[start : start + IOV_MAX]
            moved = _all(os.preadv, descriptor, self.buffered, chunk, offset + done) - (
                offset + done
            )
            done += moved
            if moved < sum(piece.nbytes for piece in chunk):
                break
        return done


_Move = Callable[[int, Sequence[memoryview], int], int]  # os.pwritev or os.preadv


def _all(move: _Move, descriptor: int, fallback: int, pieces: list[memoryview], offset: int) -> int:
    """Call ``move`` until every piece moved (or, reading, the file ended); the offset after
    the last byte moved. What is left after a short call goes through ``fallback`` (the
    buffered descriptor: the rest of a piece cut anywhere is no longer aligned)."""
    left = list(pieces)
    while left:
        moved = move(descriptor, left, offset)
        if moved == 0:  # the end of the file (a read); a write of 0 bytes does not happen
            return offset
        offset += moved
        # A short call stops anywhere: drop the pieces done whole, cut the one done in part.
        while left and moved >= left[0].nbytes:
            moved -= left[0].nbytes
            left.pop(0)
        if moved:
            left[0] = left[0][moved:]
        descriptor = fallback
    return offset
