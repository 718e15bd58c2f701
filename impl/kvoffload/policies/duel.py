"""Dueling eviction: LRU, the reuse order or LRU-2, whichever would have served the most
prefix hits.

The orders win in different regimes. When the pool is small against the reuse distances of
a workload, LRU flushes every block before its next use, while the scan-resistant orders
evict the blocks used once first and keep the reused ones: the reuse order (segmented LRU)
then evicts the reused blocks by last use, LRU-2 by their second most recent use, so that
the prefixes of the conversations that come back least often go first. When the pool is
large, both hold on to blocks reused long ago and LRU wins. Which regime holds depends on
the workload and the pool, so the policy measures it: three *shadows*, keys-only
simulations of a pool in each order with the same capacity, replay every touched request
and count the prefix hits each would have served (a request reuses only a prefix of its
blocks, so a block counts only if every block before it is resident too). The real pool
evicts in the order of the shadow with the highest score; scores decay, so the choice
follows the workload as it changes.

See the spec's ``DuelOrder`` (``kvoffload_spec.policies``) for the rules written plainly.

The shadows are sampled (SHARDS): each simulates only the keys whose ``stable_hash`` is 0
modulo ``sample_rate(capacity)``, in a pool of ``capacity // rate`` blocks, so that they
cost a thirty-second of the pool at most sizes while pools under 2,048 blocks are
simulated whole.

Every order comes from one stamp per key: twice its last use, plus one once the key was
reused. The evictable keys sit in two sorted lists by stamp, the keys used once and the
reused ones: the reuse order reads the first list and then the second, LRU merges the two
by stamp. LRU-2 reads the first list and then a third one, of the evictable reused keys by
``second``: their second most recent use, shifted up, plus the last use (a key used once
has none). A pool that follows LRU-2 keeps that in the stamp itself, and lists its reused
keys by last use in buckets of stamps (``_ByLast``) rather than in a sorted list with a
derived key, which would hold one more int per key. Every operation is O(k log n) for
k keys (the shadows' included), and finding victims walks only evictable keys. The
histories of evicted keys (bounded, like ARC's ghosts) hold keys, and the last use where
LRU-2 reads it: up to ``HISTORY`` times the pool for the real pool and the scan-resistant
shadows.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from bisect import bisect_left, insort
from collections.abc import Callable, Container, Iterator, Sequence
from typing import TYPE_CHECKING, Any
from zlib import crc32

from kvoffload.policies.base import EvictionPolicy
from kvoffload.policies.recency import STAMPS_PER_BUCKET_BITS, stamp_ordered, unprotected
from kvoffload.sharded import OrderedKeys, ShardedDict
from kvoffload_spec.policies import (
    DUEL_DECAY,
    DUEL_HISTORY,
    DUEL_ORDERS,
    DUEL_SAMPLE,
    DUEL_SAMPLE_MIN,
)
from kvoffload_spec.surface import Key

if TYPE_CHECKING:
    from kvoffload_spec.policies import DuelOrder, KeyUses

HISTORY = DUEL_HISTORY
_FIBONACCI = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


def sample_rate(capacity: int) -> int:
    """One key in how many the shadows simulate: a power of two up to ``DUEL_SAMPLE``, as
    long as a shadow keeps ``DUEL_SAMPLE_MIN`` blocks (so small pools are not sampled)."""
    rate = 1
    while rate < DUEL_SAMPLE and capacity >= 2 * rate * DUEL_SAMPLE_MIN:
        rate <<= 1
    return rate


def stable_hash(key: Key) -> int:
    """A hash every process agrees on (``hash`` salts str and bytes): see the spec's
    ``sample_hash``."""
    if isinstance(key, int):
        return (key * _FIBONACCI & _MASK64) >> 32
    if isinstance(key, bytes):
        return crc32(key)
    if isinstance(key, str):
        return crc32(key.encode("utf-8", "surrogatepass"))
    return crc32(repr(key).encode("utf-8", "backslashreplace"))


_SECOND_SHIFT = 41  # a stamp is second use << 41 | last use << 1 | reused
_RECENCY = (1 << _SECOND_SHIFT) - 1  # the last use and the reused bit


def _recency(stamps: ShardedDict[Key, int], key: Key) -> int:
    """The part of ``key``'s stamp that orders by last use (a sort key of ``reused``)."""
    return stamps[key] & _RECENCY


class _ByLast:
    """The evictable reused keys of one pool by last use: its stamps' low 41 bits.

    A sorted list ordered by a derived key would hold one new int per entry; this holds
    none. Keys sit in buckets of 256 consecutive last uses, plain dicts ``key -> stamp``
    (the stamp table's own int), and ``_ids`` lists the non-empty buckets in ascending
    order, as ``StampOrder`` does. A key nearly always arrives as the most recent, so a
    bucket's insertion order is its order; one that arrives older (a key unpinned, or
    stored again) marks its bucket unsorted, sorted when next read. As with a sorted
    list's key, a key's stamp must not change while it is listed here.
    """

    __slots__ = ("_buckets", "_ids", "_newest", "_size", "_stamps", "_unsorted")

    _BITS = STAMPS_PER_BUCKET_BITS + 1  # the reused bit is not time

    def __init__(self, stamps: ShardedDict[Key, int]) -> None:
        self._stamps = stamps
        self._buckets: dict[int, dict[Key, int]] = {}
        self._ids: list[int] = []
        self._unsorted: set[int] = set()
        self._newest = -1
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __contains__(self, key: object) -> bool:
        stamp = self._stamps.get(key)
        return stamp is not None and key in self._buckets.get((stamp & _RECENCY) >> self._BITS, ())

    def __iter__(self) -> Iterator[Key]:
        """By last use, least recent first; nothing may change while it runs."""
        return itertools.chain.from_iterable(map(self._bucket, self._ids))

    def add(self, key: Key) -> None:
        stamp = self._stamps[key]
        last = stamp & _RECENCY
        at = last >> self._BITS
        bucket = self._buckets.get(at)
        self._size += 1
        if last > self._newest:
            self._newest = last
        elif bucket is not None and last < next(reversed(bucket.values())) & _RECENCY:
            self._unsorted.add(at)
        if bucket is not None:
            bucket[key] = stamp
            return
        self._buckets[at] = {key: stamp}
        ids = self._ids
        if not ids or ids[-1] < at:
            ids.append(at)
        else:
            insort(ids, at)

    def remove(self, key: Key) -> None:
        at = (self._stamps[key] & _RECENCY) >> self._BITS
        bucket = self._buckets[at]
        del bucket[key]
        self._size -= 1
        if not bucket:
            del self._buckets[at]
            del self._ids[bisect_left(self._ids, at)]
            self._unsorted.discard(at)

    def clear(self) -> None:
        self._buckets.clear()
        self._ids.clear()
        self._unsorted.clear()
        self._newest = -1
        self._size = 0

    def _bucket(self, at: int) -> dict[Key, int]:
        bucket = self._buckets[at]
        if at in self._unsorted:
            ordered = sorted(bucket.items(), key=lambda item: item[1] & _RECENCY)
            bucket.clear()
            bucket.update(ordered)
            self._unsorted.discard(at)
        return bucket


class _Uses:
    """The keys of one pool (the real one or a shadow) and its orders over them.

    ``stamps[key]`` is twice the key's last use, plus one once it was reused, and, in a
    pool that follows LRU-2 (``lru2``), the reused key's second most recent use shifted
    above both: ``second << 41 | last << 1 | reused``. Its low 41 bits are unique and
    order by last use (LRU order); the low bit says which of the two sorted lists
    (``once``, ``reused``) holds the key while it is evictable; and the whole stamp orders
    the reused keys of ``paired`` (LRU-2) by second use, then by last. Such a pool lists
    its reused keys by last use in ``_ByLast``, which holds the stamps' own ints: LRU-2
    costs a reused key one more sorted-list entry and a bucket entry, not a table and no
    int per list. ``history`` holds
    the last ``limit`` evicted keys, oldest first, each with its last use when ``lru2``
    (else 0): one stored again is reused at once, its last use before it left being its
    second most recent.

    A pool that reads only LRU-2 (``by_last`` False: the LRU-2 shadow) leaves ``reused``
    empty, since no order it reads lists the reused keys by last use: a reused key then
    costs it one sorted-list entry, as under LRU (it gets to the reused keys by last use
    only through ``everything``, for checks).
    """

    __slots__ = (
        "by_last",
        "history",
        "limit",
        "lru2",
        "once",
        "paired",
        "recency",
        "reused",
        "stamps",
    )

    def __init__(
        self, capacity: int, history_limit: int, *, lru2: bool, by_last: bool = True
    ) -> None:
        self.stamps: ShardedDict[Key, int] = ShardedDict(capacity)
        self.lru2 = lru2
        self.by_last = by_last or not lru2
        self.once = stamp_ordered(self.stamps)  # a once-used key's stamp has no second use
        self.paired = stamp_ordered(self.stamps) if lru2 else None
        if lru2:
            self.recency: Callable[[Key], int] = functools.partial(_recency, self.stamps)
            self.reused: Any = _ByLast(self.stamps)
        else:
            self.recency = self.stamps.__getitem__
            self.reused = stamp_ordered(self.stamps)
        self.history: OrderedKeys[Key] = OrderedKeys(history_limit)
        self.limit = history_limit

    def listed(self, stamp: int) -> Any:
        """The sorted list that holds an evictable key with this stamp."""
        return self.reused if stamp & 1 else self.once

    def insert(self, key: Key, tick: int) -> None:
        before = self.history.pop(key)
        if before is None:
            self.stamps[key] = tick << 1
        else:
            self.stamps[key] = (
                before << _SECOND_SHIFT | tick << 1 | 1 if self.lru2 else tick << 1 | 1
            )

    def use(self, key: Key, tick: int, *, reused: bool, evictable: bool) -> None:
        stamp = self.stamps[key]
        if evictable:
            self.discard(key)
        if not self.lru2:
            stamp = tick << 1 | stamp & 1 | reused
        elif reused:  # the last use becomes the second
            stamp = (stamp & _RECENCY) >> 1 << _SECOND_SHIFT | tick << 1 | 1
        else:  # recency only: the second use stays
            stamp = stamp >> _SECOND_SHIFT << _SECOND_SHIFT | tick << 1 | stamp & 1
        self.stamps[key] = stamp
        if evictable:
            self.add(key)

    def add(self, key: Key) -> None:
        if self.stamps[key] & 1:
            if self.by_last:
                self.reused.add(key)
            if self.paired is not None:
                self.paired.add(key)
        else:
            self.once.add(key)

    def discard(self, key: Key) -> None:
        if self.stamps[key] & 1:
            if self.by_last:
                self.reused.remove(key)
            if self.paired is not None:
                self.paired.remove(key)
        else:
            self.once.remove(key)

    def forget(self, key: Key) -> None:
        """``key`` left (evicted, and not evictable any more): it goes to the history."""
        last = (self.stamps.pop(key) & _RECENCY) >> 1
        if self.limit:
            self.history.append_within(key, self.limit, last if self.lru2 else 0)

    def drop(self, key: Key) -> None:
        """``key`` left without a use worth remembering (its store failed)."""
        del self.stamps[key]

    def ordered(self, order: str) -> Iterator[Key]:
        """The evictable keys, victims first, in ``order`` (one of ``DUEL_ORDERS``)."""
        if order == "reuse":
            return itertools.chain(self.once, self.reused)
        if order == "lru2" and self.paired is not None:
            return itertools.chain(self.once, self.paired)
        return heapq.merge(self.once, self.reused, key=self.recency)

    def penult(self, key: Key) -> int:
        """The second most recent use of a resident key, -1 if it was used once; 0 stands
        for any second use in a pool that does not follow LRU-2 (it reads only whether
        there is one)."""
        stamp = self.stamps[key]
        return stamp >> _SECOND_SHIFT if stamp & 1 else -1

    def last(self, key: Key) -> int:
        """The last use of a resident key."""
        return (self.stamps[key] & _RECENCY) >> 1

    def everything(self, order: str) -> list[Key]:
        """Every key in ``order`` (O(n log n): for checks)."""
        stamps, recency = self.stamps, self.recency
        if order == "lru":
            return sorted(stamps, key=recency)
        if order == "reuse":
            return sorted(stamps, key=lambda key: (stamps[key] & 1, recency(key)))
        penult = self.penult
        return sorted(stamps, key=lambda key: (stamps[key] & 1, penult(key), recency(key)))

    def past(self) -> list[object]:
        """The history as the spec's must match it: keys, with last uses under LRU-2."""
        return list(self.history.items()) if self.lru2 else list(self.history)

    def evictable(self) -> int:
        reused = self.reused if self.by_last or self.paired is None else self.paired
        return len(self.once) + len(reused)

    def clear(self) -> None:
        self.once.clear()
        self.reused.clear()
        self.stamps.clear()
        if self.paired is not None:
            self.paired.clear()
        self.history.clear()


class _Shadow:
    """A keys-only pool of ``capacity`` blocks in one of ``DUEL_ORDERS``, driven by the
    touched requests as an engine drives the real pool, scoring its prefix hits. Every key
    of a shadow is evictable."""

    __slots__ = ("capacity", "clock", "mask", "order", "score", "uses")

    def __init__(self, capacity: int, order: str, *, rate: int) -> None:
        self.capacity = capacity // rate
        self.mask = rate - 1  # a power of two: in the sample when the hash's low bits are 0
        self.order = order
        # LRU never reads a reuse: its shadow keeps no history.
        limit = HISTORY * self.capacity if order != "lru" else 0
        lru2 = order == "lru2"
        self.uses = _Uses(self.capacity, limit, lru2=lru2, by_last=not lru2)
        self.score = 0.0
        self.clock = 0

    def replay(self, keys: Sequence[Key]) -> None:
        if self.mask:
            mask = self.mask
            keys = [key for key in keys if not stable_hash(key) & mask]
        uses = self.uses
        resident = uses.stamps
        hits = sum(1 for _ in itertools.takewhile(resident.__contains__, keys))
        self.score = self.score * DUEL_DECAY + hits
        distinct = dict.fromkeys(keys)
        absent = [key for key in distinct if key not in resident]
        size = uses.evictable()
        need = len(absent) - (self.capacity - size)
        if need > size - (len(distinct) - len(absent)):
            absent = []  # it does not fit: the store is refused, the touch still counts
        elif need > 0:
            ordered = uses.ordered(self.order)
            for key in list(itertools.islice(unprotected(ordered, distinct), need)):
                uses.discard(key)
                uses.forget(key)
        for key in absent:
            self.clock += 1
            uses.insert(key, self.clock)
            uses.add(key)
        fresh = set(absent)
        for key in reversed(keys):
            if key in resident:
                self.clock += 1
                uses.use(key, self.clock, reused=key not in fresh, evictable=True)

    def clear(self) -> None:
        self.uses.clear()
        self.score = 0.0


class DuelPolicy(EvictionPolicy):
    """Victims in LRU, reuse or LRU-2 order, whichever shadow scored the most prefix hits
    lately.

    Every resident key has one stamp, and a reused one its second use too (see ``_Uses``);
    the evictable keys sit in sorted lists, so choosing k victims costs O(k log n) in any
    order, however many blocks are pinned or pending.
    """

    touch_counts_reuse = True  # a touch of a ready key is its second use in reuse order

    __slots__ = ("_clock", "_shadows", "_uses")

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._uses = _Uses(capacity, HISTORY * capacity, lru2=True)
        rate = sample_rate(capacity)
        self._shadows = tuple(_Shadow(capacity, order, rate=rate) for order in DUEL_ORDERS)
        self._clock = 0

    @property
    def leader(self) -> str:
        """The order victims come in now: the shadow with the highest score, the earliest of
        ``DUEL_ORDERS`` on a tie."""
        shadows = self._shadows
        best = shadows[0]
        for shadow in shadows[1:]:
            if shadow.score > best.score:
                best = shadow
        return best.order

    @property
    def scores(self) -> tuple[float, ...]:
        """The decayed prefix-hit scores of the shadows, in ``DUEL_ORDERS``."""
        return tuple(shadow.score for shadow in self._shadows)

    def insert(self, key: Key) -> None:
        self._uses.insert(key, self._tick())

    def remove(self, key: Key) -> None:
        self._uses.drop(key)

    def mark_evictable(self, key: Key) -> None:
        self._uses.add(key)

    def mark_unevictable(self, key: Key) -> None:
        self._uses.discard(key)

    def touch(self, keys: Sequence[Key], is_ready: Callable[[Key], bool]) -> None:
        for shadow in self._shadows:
            shadow.replay(keys)
        uses = self._uses
        stamps = uses.stamps
        for key in reversed(keys):
            if key in stamps:
                evictable = key in uses.listed(stamps[key])
                # A pending block was only just inserted: that is not a second use.
                uses.use(key, self._tick(), reused=is_ready(key), evictable=evictable)

    def choose_victims(self, need: int, protected: Container[Key]) -> list[Key] | None:
        victims = list(itertools.islice(self._candidates(protected), need))
        return victims if len(victims) == need else None

    def evict(self, victims: Sequence[Key]) -> None:
        for key in victims:
            self._uses.discard(key)
            self._uses.forget(key)

    def clear(self) -> None:
        self._uses.clear()
        for shadow in self._shadows:
            shadow.clear()

    def resident(self) -> list[Key]:
        return self._uses.everything("lru")

    def snapshot(self) -> tuple[object, ...]:
        """Everything that decides the future, in the shape of the spec's
        ``DuelOrder.snapshot()`` (O(n log n): for checks and tests)."""
        uses = self._uses
        return (
            [uses.everything(order) for order in DUEL_ORDERS],
            uses.past(),
            [shadow.uses.everything(shadow.order) for shadow in self._shadows],
            [shadow.uses.past() for shadow in self._shadows],
            self.scores,
        )

    def orders(self) -> list[list[Key]]:
        """The evictable keys in each of ``DUEL_ORDERS``, victims first (for checks)."""
        return [list(self._uses.ordered(order)) for order in DUEL_ORDERS]

    def check_invariants(self, is_evictable: Callable[[Key], bool]) -> list[str]:
        problems: list[str] = []
        uses = self._uses
        expected = [
            [key for key in uses.everything(order) if is_evictable(key)] for order in DUEL_ORDERS
        ]
        if self.orders() != expected:
            problems.append(f"duel's evictable orders are {self.orders()}, expected {expected}")
        stamps = uses.stamps
        if any(stamps[key] & 1 for key in uses.once) or not all(
            stamps[key] & 1 for key in uses.reused
        ):
            problems.append("duel lists a key used once as reused, or the reverse")
        if any(stamps[key] >> _SECOND_SHIFT and not stamps[key] & 1 for key in stamps):
            problems.append("duel keeps a second use for a key used once")
        if len(uses.history) > uses.limit:
            problems.append("duel's history exceeds its bound")
        if any(key in uses.stamps for key in uses.history):
            problems.append("a resident key is in duel's history")
        return problems

    def _candidates(self, protected: Container[Key]) -> Iterator[Key]:
        return unprotected(self._uses.ordered(self.leader), protected)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def abstract_order(self) -> DuelOrder:
        from kvoffload_spec.policies import DuelOrder, ShadowPool

        lru, reuse, lru2 = (
            ShadowPool(
                shadow.capacity,
                shadow.order,
                _spec_uses(shadow.uses),
                shadow.mask + 1,
                shadow.clock,
                shadow.score,
            )
            for shadow in self._shadows
        )
        return DuelOrder(self.capacity, _spec_uses(self._uses), (lru, reuse, lru2), self._clock)


def _spec_uses(uses: _Uses) -> KeyUses:
    """The spec's bookkeeping that ``uses`` stands for. A stamp is twice the last use plus
    the reused bit; a pool that follows LRU-2 keeps the second use's time as the spec does,
    and the last uses of its history. One that does not reads only whether there is a
    second use, so 0 stands for any, and its history's last uses are likewise only read as
    "was here": 0 each, in the same order."""
    from kvoffload_spec.policies import KeyUses

    last = {key: uses.last(key) for key in uses.stamps}
    penult = {key: uses.penult(key) for key in uses.stamps}
    return KeyUses(uses.limit, last, penult, dict(uses.history.items()))
