"""The manager's own cost, for the vLLM comparison: ``OffloadManager`` with a policy that
keeps no order.

``UnorderedPolicy`` holds two plain dicts (resident keys, evictable keys) and evicts the
evictable keys in the order they became evictable, skipping the protected ones: the least
work any correct policy can do. ``FloorManager`` also skips the check of a plugged-in
policy's victims, as the manager does for its built-ins. What a replay through it costs
is what every policy pays before its own bookkeeping; no policy can make the manager
faster than that. The smoke test holds the pair to the spec with the conformance kit.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from itertools import filterfalse, islice
from typing import Any

from kvoffload.manager import OffloadManager
from kvoffload.policies.base import EvictionPolicy
from kvoffload_spec.surface import Key


class UnorderedPolicy(EvictionPolicy):
    """Victims in the order the keys became evictable; ``touch`` changes nothing."""

    __slots__ = ("_evictable", "_resident")

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._resident: dict[Key, None] = {}
        self._evictable: dict[Key, None] = {}

    def insert(self, key: Key) -> None:
        self._resident[key] = None

    def insert_each(self, keys: Sequence[Key]) -> None:
        self._resident.update(dict.fromkeys(keys))

    def remove(self, key: Key) -> None:
        del self._resident[key]

    def mark_evictable(self, key: Key) -> None:
        self._evictable[key] = None

    def mark_evictable_each(self, keys: Sequence[Key]) -> None:
        self._evictable.update(dict.fromkeys(keys))

    def mark_unevictable(self, key: Key) -> None:
        del self._evictable[key]

    def mark_unevictable_each(self, keys: Sequence[Key]) -> None:
        evictable = self._evictable
        for key in keys:
            del evictable[key]

    def touch(self, keys: Sequence[Key], is_ready: Callable[[Key], bool]) -> None:
        return

    def choose_victims(self, need: int, protected: Container[Key]) -> list[Key] | None:
        victims = list(islice(filterfalse(protected.__contains__, self._evictable), need))
        return victims if len(victims) == need else None

    def evict(self, victims: Sequence[Key]) -> None:
        evictable, resident = self._evictable, self._resident
        for key in victims:
            del evictable[key], resident[key]

    def clear(self) -> None:
        self._resident.clear()
        self._evictable.clear()

    def resident(self) -> list[Key]:
        return list(self._resident)

    def check_invariants(self, is_evictable: Callable[[Key], bool]) -> list[str]:
        expected = {key for key in self._resident if is_evictable(key)}
        if set(self._evictable) != expected:
            return [f"evictable {list(self._evictable)}, the manager's {list(expected)}"]
        return []


class FloorManager(OffloadManager):
    """``OffloadManager`` driving ``UnorderedPolicy``, its victims unchecked (as for the
    built-in policies: they are tested, not checked on every call).
    """

    def __init__(self, num_blocks: int, **options: Any) -> None:
        """``options``: ``OffloadManager``'s keyword arguments (the conformance kit's)."""
        super().__init__(num_blocks, UnorderedPolicy, **options)

    def _check_victims(self, victims: list[Key], need: int, protected: Container[Key]) -> None:
        return
