"""The manager as it behaved before vLLM PR #45757, for the benchmark to compare against.

Two changes, both by subclassing, so that the product carries neither:

- :class:`UnguardedManager` has no evictable counter guard: every ``prepare_store`` that
  needs room asks the policy for victims, even when nothing is evictable;
- :class:`WalkEveryBlockLru` finds victims the way vLLM's LRU did: it walks every resident
  block, least recent first, and skips the pinned, pending and protected ones.

Together they give the same answers as ``OffloadManager(n, "lru")`` (the smoke test checks
this against the spec), only slower when few blocks are evictable.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterator, Sequence

from kvoffload.manager import OffloadManager
from kvoffload.policies.lru import LruPolicy
from kvoffload_spec.surface import Key


class WalkEveryBlockLru(LruPolicy):
    """LRU whose victim search costs O(resident blocks), however few are evictable.

    Recency is the insertion order of a plain dict, ``_recency`` (a touch moves the key to
    the end), and evictability a plain set, so that each step of the walk is as cheap as
    vLLM's ``ref_cnt == 0`` test: the cost measured is the walk, not the per-step check.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._recency: dict[Key, None] = {}
        self._evictable_keys: set[Key] = set()

    def insert(self, key: Key) -> None:
        super().insert(key)
        self._recency[key] = None

    def remove(self, key: Key) -> None:
        super().remove(key)
        del self._recency[key]

    def mark_evictable(self, key: Key) -> None:
        super().mark_evictable(key)
        self._evictable_keys.add(key)

    def mark_unevictable(self, key: Key) -> None:
        super().mark_unevictable(key)
        self._evictable_keys.discard(key)

    def evict(self, victims: Sequence[Key]) -> None:
        super().evict(victims)
        self._evictable_keys.difference_update(victims)
        for key in victims:
            del self._recency[key]

    def clear(self) -> None:
        super().clear()
        self._evictable_keys.clear()
        self._recency.clear()

    def _candidates(self, protected: Container[Key]) -> Iterator[Key]:
        evictable = self._evictable_keys
        return (key for key in self._recency if key in evictable and key not in protected)

    def touch(self, keys: Sequence[Key], is_ready: Callable[[Key], bool]) -> None:
        super().touch(keys, is_ready)
        recency = self._recency
        for key in reversed(keys):
            if key in recency:  # resident: re-inserted at the end, the dict's order is recency
                del recency[key]
                recency[key] = None


class UnguardedManager(OffloadManager):
    """``OffloadManager`` without the O(1) fast-fail: the policy is always asked."""

    def _make_room(self, count: int, protected: Container[Key]) -> list[Key] | None:
        need = count - self.num_free_blocks
        if need <= 0:
            return []
        victims = self._policy.choose_victims(need, protected)
        if victims is not None:
            self._check_victims(victims, need, protected)
        return victims


def naive_manager(num_blocks: int) -> UnguardedManager:
    """An LRU manager with neither the counter guard nor the evictable-only walk."""
    return UnguardedManager(num_blocks, WalkEveryBlockLru)
