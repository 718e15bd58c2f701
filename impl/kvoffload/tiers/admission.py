"""Which blocks a full disk tier lets in: a block displaces another on its second offer.

A CPU pool evicts every block it ever held, the blocks of a one-off scan as much as those of
a system prompt; written to a full disk tier as they come, a scan of cold blocks would push
the disk's whole warm set out (and wear the drive for blocks never read again). So, once
the disk is full, a block is admitted only if it was offered once before, recently: the
first offer is remembered, the second is written. (Dynamo's KVBM gates its disk writes by a
frequency count; TinyLFU calls this filter a doorkeeper.) A block that comes back after its
first eviction is, by then, known to be reused. While the disk has free room, a first offer
is written at once (the store decides that: it pushes nothing out).

"Recently" is the last ``window`` offers: two Bloom filters, the current one and the one
before it, each of ``8 * window`` bits with 3 probes (a false admission rate of about 3% at
a full window), the older dropped whenever the current one has taken ``window`` offers. So
the filter costs 2 bytes per block of the tier, whatever it has seen.
"""

from __future__ import annotations

_PROBES = 3
_BITS_PER_OFFER = 8


class SecondOffer:
    """Admit a digest offered before within about the last ``window`` offers."""

    __slots__ = ("_bits", "_current", "_previous", "_taken", "window")

    def __init__(self, window: int) -> None:
        self.window = max(1, window)
        self._bits = max(1024, _BITS_PER_OFFER * self.window)
        self._current = bytearray(self._bits // 8 + 1)
        self._previous = bytearray(self._bits // 8 + 1)
        self._taken = 0

    def offer(self, digest: int) -> bool:
        """Whether ``digest`` (a uniformly random int) may be written now; remembers it."""
        positions = self._positions(digest)
        if all(self._current[p >> 3] >> (p & 7) & 1 for p in positions) or all(
            self._previous[p >> 3] >> (p & 7) & 1 for p in positions
        ):
            return True
        current = self._current
        for p in positions:
            current[p >> 3] |= 1 << (p & 7)
        self._taken += 1
        if self._taken >= self.window:
            self._previous, self._current = current, bytearray(len(current))
            self._taken = 0
        return False

    def _positions(self, digest: int) -> tuple[int, ...]:
        # Double hashing from two independent halves of the digest (its low bits are the
        # index's home position: the filter reads the high ones first).
        first, step = digest >> 30, (digest & 0x3FFFFFFF) | 1
        return tuple((first + i * step) % self._bits for i in range(_PROBES))


class AdmitAll:
    """Every offer is written (``admission="every-offer"``)."""

    __slots__ = ()

    def offer(self, digest: int) -> bool:
        return True
