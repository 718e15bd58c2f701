"""Eviction policies of your own, as the README and docs/user_guide.md use them.

Run the commands from this directory, so that ``mypolicies`` is importable::

    cd docs/examples
    kvoffload verify --policy mypolicies:SlruPolicy --budget 10
    kvoffload sweep --trace synthetic --policies lru,mypolicies:SlruPolicy,belady
    kvoffload simulate --policy mypolicies:SlruPolicy

``SlruPolicy`` is a complete, working policy. ``GivesUpOnProtected`` is broken on purpose:
``kvoffload verify`` shows the shortest history that catches it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Container, Iterator, Sequence

from kvoffload.policies import EvictionPolicy, LruPolicy
from kvoffload_spec.surface import Key


class SlruPolicy(EvictionPolicy):
    """Segmented LRU: a block used again while resident is kept longer than a new one.

    A new block enters the *probation* segment. A touch of a ready block in probation
    promotes it to the *hot* segment (SLRU's "protected" segment; named otherwise here so
    as not to be confused with the keys a store protects). The hot segment holds at most
    ``hot_share`` of the capacity; a promotion beyond that demotes the hot segment's least
    recent block back to probation, as its most recent. Victims are the least recent
    evictable blocks of probation first, then of the hot segment.

    Each segment is a dict in recency order (least recent first), so every operation is
    O(1) per key but ``choose_victims``, which walks past blocks that cannot go: plain code
    for an example, not the built-in policies' O(log n) structures.
    """

    hot_share = 0.8

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.probation: dict[Key, None] = {}
        self.hot: dict[Key, None] = {}
        self.evictable: set[Key] = set()
        self.hot_limit = max(1, int(capacity * self.hot_share))

    def insert(self, key: Key) -> None:
        self.probation[key] = None

    def remove(self, key: Key) -> None:
        self._segment(key).pop(key)

    def mark_evictable(self, key: Key) -> None:
        self.evictable.add(key)

    def mark_unevictable(self, key: Key) -> None:
        self.evictable.discard(key)

    def touch(self, keys: Sequence[Key], is_ready: Callable[[Key], bool]) -> None:
        for key in reversed(keys):  # the first key ends up the most recent
            if key in self.hot:
                self.hot[key] = self.hot.pop(key)
            elif key in self.probation:
                del self.probation[key]
                if is_ready(key):  # used again after its store completed: promote it
                    self._promote(key)
                else:  # its store is still in flight: that is not a second use
                    self.probation[key] = None

    def choose_victims(self, need: int, protected: Container[Key]) -> list[Key] | None:
        victims = list(itertools.islice(self._candidates(protected), need))
        return victims if len(victims) == need else None

    def evict(self, victims: Sequence[Key]) -> None:
        for key in victims:
            self._segment(key).pop(key)
            self.evictable.discard(key)

    def clear(self) -> None:
        self.probation.clear()
        self.hot.clear()
        self.evictable.clear()

    def resident(self) -> list[Key]:
        return [*self.probation, *self.hot]

    def check_invariants(self, is_evictable: Callable[[Key], bool]) -> list[str]:
        problems = []
        if self.probation.keys() & self.hot.keys():
            problems.append(f"in both segments: {self.probation.keys() & self.hot.keys()}")
        if len(self.hot) > self.hot_limit:
            problems.append(f"the hot segment holds {len(self.hot)} > {self.hot_limit} blocks")
        if self.evictable != {key for key in self.resident() if is_evictable(key)}:
            problems.append(f"evictable set {self.evictable} disagrees with the manager")
        return problems

    def _segment(self, key: Key) -> dict[Key, None]:
        return self.hot if key in self.hot else self.probation

    def _promote(self, key: Key) -> None:
        self.hot[key] = None
        if len(self.hot) > self.hot_limit:
            demoted = next(iter(self.hot))
            del self.hot[demoted]
            self.probation[demoted] = None

    def _candidates(self, protected: Container[Key]) -> Iterator[Key]:
        for key in itertools.chain(self.probation, self.hot):
            if key in self.evictable and key not in protected:
                yield key


class GivesUpOnProtected(LruPolicy):
    """BROKEN ON PURPOSE: gives up when its least recent block is part of the store (it
    should skip that block), so a store that has room is refused."""

    def choose_victims(self, need: int, protected: Container[Key]) -> list[Key] | None:
        victims = list(itertools.islice(self._evictable, need))
        if any(key in protected for key in victims):
            return None
        return victims if len(victims) == need else None
