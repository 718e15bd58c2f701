"""Where each block of a disk tier lies: a compact map from a block's digest to its slot.

A disk tier holds millions of blocks, and the RAM it needs per block is a budget (under 200
bytes, the eviction order included). A dict of int to int costs about 70 bytes per entry,
its keys and values being objects; this table costs 12 bytes per entry of two flat arrays
(a 64-bit digest, a 32-bit slot), 16 to 32 bytes per block at a load factor kept between
3/8 and 3/4. Open addressing with linear probing, and deletion by backward shift, so no
tombstone ever slows a lookup down.

A digest is a uniformly random integer in ``[1, 2**60)`` (0 marks an empty entry), so its
low bits are its home position. Two keys with one digest are one entry here: the values
check themselves against their full key when read, so the second key's value is refused
under the first key (a miss), never returned.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator

DIGEST_BITS = 60  # a Python int under 2**60 is 32 bytes, one over it 36


class SlotIndex:
    """``digest -> slot`` for at most ``capacity`` digests."""

    __slots__ = ("_count", "_digests", "_mask", "_slots")

    def __init__(self, capacity: int) -> None:
        size = 1 << max(4, (capacity * 4 // 3).bit_length())
        self._mask = size - 1
        self._digests = array("Q", [0]) * size
        self._slots = array("i", [0]) * size
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def get(self, digest: int) -> int:
        """The slot of ``digest``, or -1."""
        digests, mask = self._digests, self._mask
        at = digest & mask
        while True:
            found = digests[at]
            if found == digest:
                return self._slots[at]
            if not found:
                return -1
            at = (at + 1) & mask

    def set(self, digest: int, slot: int) -> None:
        """Map ``digest`` to ``slot`` (replacing what it mapped to)."""
        digests, mask = self._digests, self._mask
        at = digest & mask
        while True:
            found = digests[at]
            if found == digest:
                self._slots[at] = slot
                return
            if not found:
                digests[at] = digest
                self._slots[at] = slot
                self._count += 1
                return
            at = (at + 1) & mask

    def pop(self, digest: int) -> int:
        """Remove ``digest``; its slot, or -1 if it was not there."""
        digests, slots, mask = self._digests, self._slots, self._mask
        at = digest & mask
        while True:
            found = digests[at]
            if found == digest:
                break
            if not found:
                return -1
            at = (at + 1) & mask
        slot = slots[at]
        # Backward shift: every entry after the hole that may live there moves into it.
        hole = at
        while True:
            at = (at + 1) & mask
            found = digests[at]
            if not found:
                break
            home = found & mask
            # The entry may move to the hole unless its home lies after the hole, up to it.
            if (hole - home) & mask < (at - home) & mask:
                digests[hole] = found
                slots[hole] = slots[at]
                hole = at
        digests[hole] = 0
        self._count -= 1
        return slot

    def items(self) -> Iterator[tuple[int, int]]:
        """Every ``(digest, slot)``, in no particular order."""
        for at, digest in enumerate(self._digests):
            if digest:
                yield digest, self._slots[at]
