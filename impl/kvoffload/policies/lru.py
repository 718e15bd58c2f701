"""Least recently used eviction, with no cost for pinned or pending blocks."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Container, Iterator, Sequence
from typing import TYPE_CHECKING

from kvoffload.policies.base import EvictionPolicy
from kvoffload.policies.recency import stamp_ordered, unprotected
from kvoffload.sharded import ShardedDict
from kvoffload_spec.surface import Key

if TYPE_CHECKING:
    from kvoffload_spec.policies import LruOrder


class LruPolicy(EvictionPolicy):
    """Least recently used first; recency comes from insertion and ``touch`` only.

    ``_stamps`` holds every resident key's recency stamp; ``_evictable`` only the evictable
    keys, sorted by stamp. Every operation is O(log n) per key.
    """

    __slots__ = ("_clock", "_evictable", "_stamps")

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._stamps: ShardedDict[Key, int] = ShardedDict(capacity)
        self._evictable = stamp_ordered(self._stamps)
        self._clock = 0

    def insert(self, key: Key) -> None:
        self._stamps[key] = self._tick()

    def remove(self, key: Key) -> None:
        del self._stamps[key]

    def mark_evictable(self, key: Key) -> None:
        self._evictable.add(key)

    def mark_unevictable(self, key: Key) -> None:
        self._evictable.remove(key)

    def touch(self, keys: Sequence[Key], is_ready: Callable[[Key], bool]) -> None:
        for key in reversed(keys):
            if key in self._stamps:
                self._restamp(key)

    def choose_victims(self, need: int, protected: Container[Key]) -> list[Key] | None:
        victims = list(itertools.islice(self._candidates(protected), need))
        return victims if len(victims) == need else None

    def evict(self, victims: Sequence[Key]) -> None:
        for key in victims:
            self._evictable.remove(key)
            del self._stamps[key]

    def clear(self) -> None:
        self._evictable.clear()
        self._stamps.clear()

    def resident(self) -> list[Key]:
        return sorted(self._stamps, key=self._stamps.__getitem__)

    def check_invariants(self, is_evictable: Callable[[Key], bool]) -> list[str]:
        problems: list[str] = []
        listed = list(self._evictable)
        expected = [key for key in self.resident() if is_evictable(key)]
        if listed != expected:
            problems.append(f"LRU's evictable list is {listed}, the manager's {expected}")
        if len(set(self._stamps.values())) != len(self._stamps):
            problems.append("LRU stamps repeat")
        return problems

    def _candidates(self, protected: Container[Key]) -> Iterator[Key]:
        """Victim candidates, best first: a subclass may walk differently."""
        return unprotected(self._evictable, protected)

    def _restamp(self, key: Key) -> None:
        evictable = key in self._evictable
        if evictable:
            self._evictable.remove(key)
        self._stamps[key] = self._tick()
        if evictable:
            self._evictable.add(key)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def abstract_order(self) -> LruOrder:
        from kvoffload_spec.policies import LruOrder

        return LruOrder(self.resident())
