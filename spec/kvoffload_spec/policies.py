"""Eviction order: which resident blocks leave first. LRU and ARC, written plainly.

A policy only keeps an *order* of resident keys (and, for ARC, ghosts of evicted ones). It
never decides on its own which blocks may go: the state passes ``can_evict``, which is false
for pinned, pending and protected blocks. A policy's ``choose_victims`` changes nothing; the
state commits the choice with ``evicted`` once the whole store is known to succeed, so a
failed ``prepare_store`` leaves the order exactly as it was.

Lists are in recency order: index 0 is the least recent. Recency comes from insertion and
``touch`` alone; loads and pinning never move a key.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from kvoffload_spec.surface import Key


@dataclass
class LruOrder:
    """Least recently used first."""

    order: list[Key] = field(default_factory=list)

    def insert(self, key: Key) -> None:
        self.order.append(key)

    def remove(self, key: Key) -> None:
        """``key`` left without being evicted (its store failed)."""
        self.order.remove(key)

    def evicted(self, key: Key) -> None:
        self.order.remove(key)

    def on_store_miss(self, keys: Sequence[Key]) -> None:
        """``prepare_store`` is about to place ``keys`` (absent, admitted): LRU learns nothing
        from a miss."""

    def touch(self, keys: Sequence[Key], is_ready: Callable[[Key], bool]) -> None:
        # Reversed, so that the first key ends up most recent: a prefix's tail is evicted
        # before its head, which a later request sharing the prefix needs first.
        for key in reversed(keys):
            if key in self.order:
                self.order.remove(key)
                self.order.append(key)

    def choose_victims(self, need: int, can_evict: Callable[[Key], bool]) -> list[Key] | None:
        candidates = [key for key in self.order if can_evict(key)]
        return candidates[:need] if len(candidates) >= need else None

    def resident(self) -> list[Key]:
        return list(self.order)

    def fingerprint(self) -> tuple[Hashable, Hashable]:
        """The order's state, split in two: what only a successful call may change, and what
        a refused ``prepare_store`` may change too (its observations; LRU has none)."""
        return tuple(self.order), ()

    def clear(self) -> None:
        self.order.clear()


@dataclass
class ArcOrder:
    """Adaptive Replacement Cache (Megiddo & Modha, FAST'03), as adapted in vLLM.

    T1 holds keys seen once, T2 keys touched again while ready; B1 and B2 are ghosts of keys
    evicted from T1 and T2. A *ghost hit* moves the target size ``p`` of T1: towards recency
    after a B1 ghost, towards frequency after a B2 ghost. A ghost is hit when a store is
    about to place its key again (``on_store_miss``, before ``insert`` drops the ghost: in
    an engine's order that is where a returning key shows up), or by a touch.
    """

    capacity: int
    t1: list[Key] = field(default_factory=list)
    t2: list[Key] = field(default_factory=list)
    b1: list[Key] = field(default_factory=list)
    b2: list[Key] = field(default_factory=list)
    p: float = 0.0

    def insert(self, key: Key) -> None:
        self.t1.append(key)
        if key in self.b1:
            self.b1.remove(key)
        if key in self.b2:
            self.b2.remove(key)

    def remove(self, key: Key) -> None:
        """``key`` left without being evicted (its store failed): it leaves no ghost."""
        if key in self.t1:
            self.t1.remove(key)
        else:
            self.t2.remove(key)

    def evicted(self, key: Key) -> None:
        if key in self.t1:
            self.t1.remove(key)
            self.b1.append(key)
        else:
            self.t2.remove(key)
            self.b2.append(key)
        # Ghosts are bounded by the capacity: the least recent ghost is forgotten first.
        del self.b1[: max(0, len(self.b1) - self.capacity)]
        del self.b2[: max(0, len(self.b2) - self.capacity)]

    def on_store_miss(self, keys: Sequence[Key]) -> None:
        """``prepare_store`` is about to place ``keys`` (distinct, absent, admitted): each
        ghost among them is a ghost hit. Last key first, as a touch. It is an observation of
        the request stream, made also when the store is then refused (as in vLLM 0.33).
        """
        for key in reversed(keys):
            self._ghost_hit(key)

    def touch(self, keys: Sequence[Key], is_ready: Callable[[Key], bool]) -> None:
        for key in reversed(keys):
            if key in self.t1:
                self.t1.remove(key)
                # A pending block was only just inserted: that is not a second access.
                (self.t2 if is_ready(key) else self.t1).append(key)
            elif key in self.t2:
                self.t2.remove(key)
                self.t2.append(key)
            else:
                self._ghost_hit(key)

    def _ghost_hit(self, key: Key) -> None:
        """A ghost of ``key`` moves ``p`` and becomes its list's most recent ghost."""
        if key in self.b1:
            self.p = min(self.p + max(1.0, len(self.b2) / len(self.b1)), self.capacity)
            self.b1.remove(key)
            self.b1.append(key)
        elif key in self.b2:
            self.p = max(self.p - max(1.0, len(self.b1) / len(self.b2)), 0.0)
            self.b2.remove(key)
            self.b2.append(key)

    def choose_victims(self, need: int, can_evict: Callable[[Key], bool]) -> list[Key] | None:
        t1_candidates = [key for key in self.t1 if can_evict(key)]
        t2_candidates = [key for key in self.t2 if can_evict(key)]
        t1_size = len(self.t1)  # as it will be once the victims chosen so far are gone
        victims: list[Key] = []
        while len(victims) < need:
            preferred, other = (
                (t1_candidates, t2_candidates)
                if t1_size >= int(self.p)
                else (t2_candidates, t1_candidates)
            )
            # Fall back to the other list when the preferred one has nothing evictable
            # (vLLM fell back only from T1 to T2 until PR #55461).
            source = preferred if preferred else other
            if not source:
                return None
            victims.append(source.pop(0))
            if source is t1_candidates:
                t1_size -= 1
        return victims

    def resident(self) -> list[Key]:
        return self.t1 + self.t2

    def fingerprint(self) -> tuple[Hashable, Hashable]:
        """As ``LruOrder.fingerprint``: a refused store's ghost hits move ``p`` and the
        ghosts' order, never which keys are ghosts."""
        ghosts = (frozenset(self.b1), frozenset(self.b2))
        return (tuple(self.t1), tuple(self.t2), ghosts), (tuple(self.b1), tuple(self.b2), self.p)

    def clear(self) -> None:
        self.t1.clear()
        self.t2.clear()
        self.b1.clear()
        self.b2.clear()
        self.p = 0.0


PolicyOrder = LruOrder | ArcOrder

POLICY_NAMES = ("lru", "arc")


def new_order(policy: str, capacity: int) -> PolicyOrder:
    return LruOrder() if policy == "lru" else ArcOrder(capacity)
