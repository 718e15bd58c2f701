"""Adaptive Replacement Cache eviction, with no cost for pinned or pending blocks."""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from itertools import islice
from typing import TYPE_CHECKING, ClassVar

from kvoffload.policies.base import EvictionPolicy
from kvoffload.policies.recency import StampOrder, unprotected
from kvoffload.sharded import ShardedDict
from kvoffload_spec.surface import Key

if TYPE_CHECKING:
    from kvoffload_spec.policies import ArcOrder

# The bits of a code below its stamp:
_SECOND = 1  # in T2 (resident) or B2 (ghost): the key was used again while ready
_STORED = 2  # resident and its store has completed (it is ready)
_GHOST = 4  # evicted, remembered in B1 or B2
_LOW_BITS = 3


class ArcPolicy(EvictionPolicy):
    """Adaptive Replacement Cache (Megiddo & Modha, FAST'03), as the spec adapts it.

    T1 holds keys seen once, T2 keys touched again while ready; B1 and B2 are ghosts of keys
    evicted from T1 and T2, and a ghost hit (a store about to place a ghost's key again, or
    a touch of it) moves the target size ``p`` of T1.
    Victims come from T1 when ``|T1| >= p``, else from T2, falling back to the other list
    when the preferred one has no candidate.

    One table, ``_codes``, holds every key the policy knows, resident or ghost, with a code
    ``8 * stamp + 4 * ghost + 2 * stored + second``: its recency stamp, whether it is a
    ghost, whether its store has completed (only a touch of a ready key is a second use)
    and whether it is in the second list (T2 or B2). So one lookup tells a key's list, and
    a ghost hit, a store over a ghost or an eviction into a ghost list rewrites one entry.
    Four ``StampOrder``s keep the order: the evictable keys of T1 and T2 (choosing k
    victims walks k keys, plus the protected ones, however many blocks are pinned) and the
    ghosts of B1 and B2 (trimmed from the oldest). The list sizes are counters. No table
    is one large dict (``kvoffload.sharded``), so no call pauses to rebuild one.
    """

    touch_counts_reuse = True
    #: Whether a victim comes from T1 when T2 is preferred but has no candidate left (vLLM
    #: fell back only from T1 to T2 until PR #55461).
    falls_back_to_t1: ClassVar[bool] = True

    __slots__ = (
        "_b1",
        "_b1_size",
        "_b2",
        "_b2_size",
        "_clock",
        "_codes",
        "_t1",
        "_t1_size",
        "_t2",
        "_t2_size",
        "p",
    )

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._codes: ShardedDict[Key, int] = ShardedDict(capacity)
        self._t1 = StampOrder(_LOW_BITS)  # the evictable keys of T1, by code
        self._t2 = StampOrder(_LOW_BITS)  # the evictable keys of T2, by code
        self._b1 = StampOrder(_LOW_BITS)  # the ghosts of T1, by code
        self._b2 = StampOrder(_LOW_BITS)  # the ghosts of T2, by code
        self._t1_size = self._t2_size = self._b1_size = self._b2_size = 0
        self.p: float = 0.0
        self._clock = 0

    # The per-key methods call ARC's own batch forms by class, not through ``self``: a
    # subclass that overrides ``insert`` (say) gets the base class's ``insert_each``, a loop
    # over ``self.insert``, and its ``super().insert`` would otherwise come back to itself.
    def insert(self, key: Key) -> None:
        ArcPolicy.insert_each(self, (key,))

    def insert_each(self, keys: Sequence[Key]) -> None:
        shards, count = self._codes.layout()
        clock = self._clock
        for key in keys:
            shard = shards[hash(key) % count]  # one shard for the lookup and the write
            ghost = shard.get(key)  # a key being inserted is not resident: any code is a ghost's
            if ghost is not None:
                self._unlink_ghost(key, ghost)
            clock += 1
            shard[key] = clock << _LOW_BITS
        self._clock = clock
        self._t1_size += len(keys)

    def remove(self, key: Key) -> None:
        if self._codes.pop(key) & _SECOND:
            self._t2_size -= 1
        else:
            self._t1_size -= 1

    def mark_evictable(self, key: Key) -> None:
        ArcPolicy.mark_evictable_each(self, (key,))

    def mark_evictable_each(self, keys: Sequence[Key]) -> None:
        shards, count = self._codes.layout()
        into_t1: list[tuple[Key, int]] = []
        into_t2: list[tuple[Key, int]] = []
        for key in keys:
            shard = shards[hash(key) % count]
            code = shard[key]
            if not code & _STORED:  # its store completed (else it was unpinned)
                code |= _STORED
                shard[key] = code
            (into_t2 if code & _SECOND else into_t1).append((key, code))
        self._t1.add_each(into_t1)
        self._t2.add_each(into_t2)

    def mark_unevictable(self, key: Key) -> None:
        ArcPolicy.mark_unevictable_each(self, (key,))

    def mark_unevictable_each(self, keys: Sequence[Key]) -> None:
        shards, count = self._codes.layout()
        out_of_t1: list[tuple[Key, int]] = []
        out_of_t2: list[tuple[Key, int]] = []
        for key in keys:
            code = shards[hash(key) % count][key]
            (out_of_t2 if code & _SECOND else out_of_t1).append((key, code))
        self._t1.remove_each(out_of_t1)
        self._t2.remove_each(out_of_t2)

    def touch(self, keys: Sequence[Key], is_ready: Callable[[Key], bool]) -> None:
        # ``is_ready`` is not needed: a key is ready once its store completed (_STORED).
        t1, t2 = self._t1, self._t2
        shards, count = self._codes.layout()
        clock = self._clock
        for key in reversed(keys):
            shard = shards[hash(key) % count]
            code = shard.get(key)
            if code is None:
                continue
            if code & _GHOST:
                self._clock = clock
                self._ghost_hit(key, code)  # it moves the clock
                clock = self._clock
                continue
            clock += 1
            if not code & _STORED:
                # Pending: only just inserted, which is not a second use. It stays in T1,
                # as the most recent, and sits in no evictable order.
                shard[key] = clock << _LOW_BITS
                continue
            # A ready key moves to (or within) T2, as the most recent.
            new_code = clock << _LOW_BITS | _STORED | _SECOND
            shard[key] = new_code
            if not code & _SECOND:
                self._t1_size -= 1
                self._t2_size += 1
                if t1.discard(key, code):
                    t2.add(key, new_code)
            elif t2.discard(key, code):
                t2.add(key, new_code)
        self._clock = clock

    def on_store_miss(self, keys: Sequence[Key]) -> None:
        # Before insert drops the ghost: in an engine's order a returning key is stored
        # again before it is touched, so this is where ARC sees it come back. The keys are
        # absent, so any code found is a ghost's.
        shards, count = self._codes.layout()
        for key in reversed(keys):
            code = shards[hash(key) % count].get(key)
            if code is not None:
                self._ghost_hit(key, code)

    def choose_victims(self, need: int, protected: Container[Key]) -> list[Key] | None:
        # Victim by victim, T1 is preferred while its size, less the victims taken from it
        # so far, is at least int(p); the preferred list's first candidate is taken, or
        # the other list's when it has none. T1's size only falls as T1 gives victims, so
        # that is at most three runs: T1 while preferred (the rest from T2 if T1 runs out,
        # as it is still preferred), then T2, then T1 again once T2 has no candidate.
        t1_keys = self._candidates(self._t1, protected)
        t2_keys = self._candidates(self._t2, protected)
        victims = list(islice(t1_keys, max(0, min(need, self._t1_size - int(self.p) + 1))))
        victims += islice(t2_keys, need - len(victims))
        if len(victims) < need and self.falls_back_to_t1:
            victims += islice(t1_keys, need - len(victims))
        return victims if len(victims) == need else None

    def evict(self, victims: Sequence[Key]) -> None:
        codes, b1, b2 = self._codes, self._b1, self._b2
        shards, count = codes.layout()
        clock = self._clock
        out_of_t1: list[tuple[Key, int]] = []
        out_of_t2: list[tuple[Key, int]] = []
        into_b1: list[tuple[Key, int]] = []
        into_b2: list[tuple[Key, int]] = []
        for key in victims:
            shard = shards[hash(key) % count]
            code = shard[key]
            clock += 1
            if code & _SECOND:
                ghost = clock << _LOW_BITS | _GHOST | _SECOND
                out_of_t2.append((key, code))
                into_b2.append((key, ghost))
            else:
                ghost = clock << _LOW_BITS | _GHOST
                out_of_t1.append((key, code))
                into_b1.append((key, ghost))
            shard[key] = ghost
        self._clock = clock
        self._t1.remove_each(out_of_t1)
        self._t2.remove_each(out_of_t2)
        b1.extend(into_b1)  # the newest ghosts, in eviction order
        b2.extend(into_b2)
        self._t1_size -= len(into_b1)
        self._t2_size -= len(into_b2)
        # The ghost lists keep only the last ``capacity`` keys evicted from each list.
        self._b1_size += len(into_b1)
        if self._b1_size > self.capacity:
            codes.pop_each(b1.pop_oldest_each(self._b1_size - self.capacity))
            self._b1_size = self.capacity
        self._b2_size += len(into_b2)
        if self._b2_size > self.capacity:
            codes.pop_each(b2.pop_oldest_each(self._b2_size - self.capacity))
            self._b2_size = self.capacity

    def clear(self) -> None:
        for order in (self._t1, self._t2, self._b1, self._b2):
            order.clear()
        self._codes.clear()
        self._t1_size = self._t2_size = self._b1_size = self._b2_size = 0
        self.p = 0.0

    def resident(self) -> list[Key]:
        t1, t2, _, _ = self.lists()
        return t1 + t2

    def lists(self) -> tuple[list[Key], list[Key], list[Key], list[Key]]:
        """T1, T2, B1 and B2, each least recent first (O(n log n): for checks and tests).
        T1 and T2 are read from the table, B1 and B2 from their orders.
        """
        codes = self._codes
        by_code = sorted(codes, key=codes.__getitem__)
        resident = [key for key in by_code if not codes[key] & _GHOST]
        return (
            [key for key in resident if not codes[key] & _SECOND],
            [key for key in resident if codes[key] & _SECOND],
            list(self._b1),
            list(self._b2),
        )

    def check_invariants(self, is_evictable: Callable[[Key], bool]) -> list[str]:
        stamp_of = self._codes.get
        problems: list[str] = []
        for order in (self._t1, self._t2, self._b1, self._b2):
            problems += order.problems(stamp_of)
        t1, t2, b1, b2 = self.lists()
        if (len(t1), len(t2)) != (self._t1_size, self._t2_size):
            problems.append(f"ARC sizes {self._t1_size}, {self._t2_size} but T1={t1}, T2={t2}")
        if (len(b1), len(b2)) != (self._b1_size, self._b2_size):
            problems.append(
                f"ARC ghost sizes {self._b1_size}, {self._b2_size} but B1={b1}, B2={b2}"
            )
        for resident, run, name in ((t1, self._t1, "T1"), (t2, self._t2, "T2")):
            listed = list(run)
            evictable = [key for key in resident if is_evictable(key)]
            if listed != evictable:
                problems.append(f"ARC's evictable {name} is {listed}, the manager's {evictable}")
        codes = self._codes
        ghosts = [key for key in codes if codes[key] & _GHOST]
        if set(ghosts) != {*b1, *b2}:
            problems.append(f"ARC's table holds ghosts {ghosts}, its ghost lists {b1 + b2}")
        if len(set(codes.values())) != len(codes):
            problems.append("ARC stamps repeat")
        everything = t1 + t2 + b1 + b2
        if len(set(everything)) != len(everything):
            problems.append(f"ARC lists overlap: T1={t1} T2={t2} B1={b1} B2={b2}")
        if max(len(b1), len(b2)) > self.capacity or not 0 <= self.p <= self.capacity:
            problems.append(f"ARC ghosts {len(b1)}, {len(b2)} or p={self.p} exceed {self.capacity}")
        return problems

    def _candidates(self, run: Iterable[Key], protected: Container[Key]) -> Iterator[Key]:
        """Victim candidates of one list (``_t1`` or ``_t2``), best first: a subclass may
        walk differently.
        """
        return unprotected(run, protected)

    def _ghost_hit(self, key: Key, code: int) -> None:
        """``key``, a ghost with ``code``, came back: adapt ``p``, and make it the most
        recent ghost of its list.
        """
        self._adapt(in_b1=not code & _SECOND)
        order = self._b2 if code & _SECOND else self._b1
        order.remove(key, code)
        self._clock += 1
        code = self._clock << _LOW_BITS | (code & (_GHOST | _SECOND))
        order.add(key, code)
        self._codes[key] = code

    def _adapt(self, in_b1: bool) -> None:
        """Move the target ``p`` after a ghost hit in B1 (towards T1) or B2 (towards T2),
        by the ratio of the ghost lists' sizes, at least 1.
        """
        b1, b2 = self._b1_size, self._b2_size
        if in_b1:
            self.p = min(self.p + max(1.0, b2 / b1), self.capacity)
        else:
            self.p = max(self.p - max(1.0, b1 / b2), 0.0)

    def _unlink_ghost(self, key: Key, code: int) -> None:
        """Take the ghost ``key`` out of its ghost list (its table entry is the caller's)."""
        if code & _SECOND:
            self._b2.remove(key, code)
            self._b2_size -= 1
        else:
            self._b1.remove(key, code)
            self._b1_size -= 1

    def abstract_order(self) -> ArcOrder:
        from kvoffload_spec.policies import ArcOrder

        t1, t2, b1, b2 = self.lists()
        return ArcOrder(self.capacity, t1, t2, b1, b2, self.p)
