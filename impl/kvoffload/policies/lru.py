"""Least recently used eviction, with no cost for pinned or pending blocks."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Container, Iterator, Sequence
from typing import TYPE_CHECKING

from kvoffload.policies.base import EvictionPolicy
from kvoffload.policies.recency import StampOrder, unprotected
from kvoffload.sharded import ShardedDict
from kvoffload_spec.surface import Key

if TYPE_CHECKING:
    from kvoffload_spec.policies import LruOrder


class LruPolicy(EvictionPolicy):
    """Least recently used first; recency comes from insertion and ``touch`` only.

    ``_stamps`` holds every resident key's recency stamp; ``_evictable`` only the evictable
    keys, ordered by stamp (``StampOrder``). Every operation costs a few small-dict
    operations per key, however many blocks are pinned.
    """

    __slots__ = ("_clock", "_evictable", "_stamps")

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._stamps: ShardedDict[Key, int] = ShardedDict(capacity)
        self._evictable = StampOrder()
        self._clock = 0

    def insert(self, key: Key) -> None:
        self._clock += 1
        self._stamps[key] = self._clock

    def remove(self, key: Key) -> None:
        del self._stamps[key]

    def insert_each(self, keys: Sequence[Key]) -> None:
        clock = self._clock
        self._clock = clock + len(keys)
        self._stamps.set_each(keys, range(clock + 1, self._clock + 1))

    def mark_evictable(self, key: Key) -> None:
        self._evictable.add(key, self._stamps[key])

    def mark_evictable_each(self, keys: Sequence[Key]) -> None:
        self._evictable.add_each(list(zip(keys, self._stamps.values_of(keys), strict=True)))

    def mark_unevictable(self, key: Key) -> None:
        self._evictable.remove(key, self._stamps[key])

    def mark_unevictable_each(self, keys: Sequence[Key]) -> None:
        self._evictable.remove_each(zip(keys, self._stamps.values_of(keys), strict=True))

    def touch(self, keys: Sequence[Key], is_ready: Callable[[Key], bool]) -> None:
        # Each resident key becomes the most recent, in reverse, so the first key ends newest.
        shards, count = self._stamps.layout()
        evictable = self._evictable
        clock = self._clock
        for key in reversed(keys):
            shard = shards[hash(key) % count]
            stamp = shard.get(key)
            if stamp is not None:
                clock += 1
                shard[key] = clock
                if evictable.discard(key, stamp):
                    evictable.add(key, clock)
        self._clock = clock

    def choose_victims(self, need: int, protected: Container[Key]) -> list[Key] | None:
        victims = list(itertools.islice(self._candidates(protected), need))
        return victims if len(victims) == need else None

    def evict(self, victims: Sequence[Key]) -> None:
        self._evictable.remove_each(zip(victims, self._stamps.pop_each(victims), strict=True))

    def clear(self) -> None:
        self._evictable.clear()
        self._stamps.clear()

    def resident(self) -> list[Key]:
        return sorted(self._stamps, key=self._stamps.__getitem__)

    def check_invariants(self, is_evictable: Callable[[Key], bool]) -> list[str]:
        problems = self._evictable.problems(self._stamps.get)
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

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def abstract_order(self) -> LruOrder:
        from kvoffload_spec.policies import LruOrder

        return LruOrder(self.resident())
