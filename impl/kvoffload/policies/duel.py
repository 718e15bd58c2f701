"""Dueling eviction: LRU or the reuse order, whichever would have served more prefix hits.

The two orders win in different regimes. When the pool is small against the reuse
distances of a workload, LRU flushes every block before its next use, while the reuse
order (segmented LRU: blocks used once go first, least recent first, then the reused ones,
least recent first) keeps the blocks that were reused and loses the one-shot ones. When the
pool is large, the reuse order holds on to blocks reused long ago and LRU wins. Which
regime holds depends on the workload and the pool, so the policy measures it: two
*shadows*, keys-only simulations of an LRU and a reuse-order pool of the same capacity,
replay every touched request and count the prefix hits each would have served (a request
reuses only a prefix of its blocks, so a block counts only if every block before it is
resident too). The real pool evicts in the order of the shadow with the higher score;
scores decay, so the choice follows the workload as it changes.

See the spec's ``DuelOrder`` (``kvoffload_spec.policies``) for the rules written plainly.

The shadows are sampled (SHARDS): each simulates only the keys whose ``stable_hash`` is 0
modulo ``sample_rate(capacity)``, in a pool of ``capacity // rate`` blocks, so that they
cost a thirty-second of the pool at most sizes while pools under 2,048 blocks are
simulated whole.

Both orders come from one stamp per key: twice its last use, plus one once the key was
reused. The evictable keys sit in two sorted lists by stamp, the keys used once and the
reused ones: the reuse order reads the first list and then the second, LRU merges the two
by stamp. So a resident key costs what it costs under LRU (one stamp, one sorted-list
entry), every operation is O(k log n) for k keys (the shadows' included), and finding
victims walks only evictable keys. The history of evicted keys (bounded, like ARC's
ghosts) holds keys only: up to ``HISTORY`` times the pool for the real pool and the
reuse-order shadow.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Container, Iterator, Sequence
from typing import TYPE_CHECKING, Any
from zlib import crc32

from kvoffload.policies.base import EvictionPolicy
from kvoffload.policies.recency import stamp_ordered, unprotected
from kvoffload.sharded import OrderedKeys, ShardedDict
from kvoffload_spec.policies import DUEL_DECAY, DUEL_HISTORY, DUEL_SAMPLE, DUEL_SAMPLE_MIN
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


class _Uses:
    """The keys of one pool (the real one or a shadow) and both orders over them.

    ``stamps[key]`` is twice the key's last use, plus one once it was reused: unique, so
    ordering by it is LRU order, and its low bit says which of the two sorted lists
    (``once``, ``reused``) holds the key while it is evictable. ``history`` holds the
    last ``limit`` evicted keys, oldest first: one stored again is reused at once.
    """

    __slots__ = ("history", "limit", "once", "reused", "stamps")

    def __init__(self, capacity: int, history_limit: int) -> None:
        self.stamps: ShardedDict[Key, int] = ShardedDict(capacity)
        self.once = stamp_ordered(self.stamps)
        self.reused = stamp_ordered(self.stamps)
        self.history: OrderedKeys[Key] = OrderedKeys(history_limit)
        self.limit = history_limit

    def listed(self, stamp: int) -> Any:
        """The sorted list that holds an evictable key with this stamp."""
        return self.reused if stamp & 1 else self.once

    def insert(self, key: Key, tick: int) -> None:
        self.stamps[key] = tick << 1 | self.history.discard(key)

    def use(self, key: Key, tick: int, *, reused: bool, evictable: bool) -> None:
        stamp = self.stamps[key]
        if evictable:
            self.listed(stamp).remove(key)
        stamp = tick << 1 | stamp & 1 | reused
        self.stamps[key] = stamp
        if evictable:
            self.listed(stamp).add(key)

    def add(self, key: Key) -> None:
        self.listed(self.stamps[key]).add(key)

    def discard(self, key: Key) -> None:
        self.listed(self.stamps[key]).remove(key)

    def forget(self, key: Key) -> None:
        """``key`` left (evicted, and not evictable any more): it goes to the history."""
        del self.stamps[key]
        if self.limit:
            self.history.append_within(key, self.limit)

    def drop(self, key: Key) -> None:
        """``key`` left without a use worth remembering (its store failed)."""
        del self.stamps[key]

    def ordered(self, *, by_reuse: bool) -> Iterator[Key]:
        """The evictable keys, victims first, in the reuse order or in LRU order."""
        if by_reuse:
            return itertools.chain(self.once, self.reused)
        return heapq.merge(self.once, self.reused, key=self.stamps.__getitem__)

    def by_recency(self) -> list[Key]:
        """Every key, least recent first (O(n log n): for checks)."""
        return sorted(self.stamps, key=self.stamps.__getitem__)

    def by_reuse(self) -> list[Key]:
        """Every key in the reuse order (O(n log n): for checks)."""
        stamps = self.stamps
        return sorted(stamps, key=lambda key: (stamps[key] & 1, stamps[key]))

    def evictable(self) -> int:
        return len(self.once) + len(self.reused)

    def clear(self) -> None:
        self.once.clear()
        self.reused.clear()
        self.stamps.clear()
        self.history.clear()


class _Shadow:
    """A keys-only pool of ``capacity`` blocks in LRU (``reuse=False``) or reuse order,
    driven by the touched requests as an engine drives the real pool, scoring its prefix
    hits. Every key of a shadow is evictable."""

    __slots__ = ("capacity", "clock", "mask", "reuse", "score", "uses")

    def __init__(self, capacity: int, *, reuse: bool, rate: int) -> None:
        self.capacity = capacity // rate
        self.mask = rate - 1  # a power of two: in the sample when the hash's low bits are 0
        self.reuse = reuse
        # LRU never reads a reuse: its shadow keeps no history.
        self.uses = _Uses(self.capacity, HISTORY * self.capacity if reuse else 0)
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
            ordered = uses.ordered(by_reuse=self.reuse)
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

    def order(self) -> list[Key]:
        return self.uses.by_reuse() if self.reuse else self.uses.by_recency()

    def clear(self) -> None:
        self.uses.clear()
        self.score = 0.0


class DuelPolicy(EvictionPolicy):
    """Victims in LRU or reuse order, whichever shadow scored more prefix hits lately.

    Every resident key has one stamp (see ``_Uses``); the evictable keys sit in two sorted
    lists by stamp, so choosing k victims costs O(k log n) in either order, however many
    blocks are pinned or pending.
    """

    touch_counts_reuse = True  # a touch of a ready key is its second use in reuse order

    __slots__ = ("_clock", "_shadows", "_uses")

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._uses = _Uses(capacity, HISTORY * capacity)
        rate = sample_rate(capacity)
        self._shadows = (
            _Shadow(capacity, reuse=False, rate=rate),
            _Shadow(capacity, reuse=True, rate=rate),
        )
        self._clock = 0

    @property
    def follows_reuse(self) -> bool:
        """Whether victims come in reuse order now (else LRU): the reuse shadow leads."""
        lru, reuse = self._shadows
        return reuse.score > lru.score

    @property
    def scores(self) -> tuple[float, float]:
        """The decayed prefix-hit scores of the LRU and the reuse-order shadow."""
        return self._shadows[0].score, self._shadows[1].score

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
        return self._uses.by_recency()

    def snapshot(self) -> tuple[object, ...]:
        """Everything that decides the future, in the shape of the spec's
        ``DuelOrder.snapshot()`` (O(n log n): for checks and tests)."""
        uses = self._uses
        return (
            uses.by_recency(),
            uses.by_reuse(),
            list(uses.history),
            [shadow.order() for shadow in self._shadows],
            [list(shadow.uses.history) for shadow in self._shadows],
            self.scores,
        )

    def orders(self) -> tuple[list[Key], list[Key]]:
        """The evictable keys in LRU and in reuse order, victims first (for checks)."""
        uses = self._uses
        return list(uses.ordered(by_reuse=False)), list(uses.ordered(by_reuse=True))

    def check_invariants(self, is_evictable: Callable[[Key], bool]) -> list[str]:
        problems: list[str] = []
        uses = self._uses
        by_last = [key for key in uses.by_recency() if is_evictable(key)]
        by_reuse = [key for key in uses.by_reuse() if is_evictable(key)]
        if self.orders() != (by_last, by_reuse):
            problems.append(f"duel's evictable orders are {self.orders()}, expected {by_last}")
        stamps = uses.stamps
        if any(stamps[key] & 1 for key in uses.once) or not all(
            stamps[key] & 1 for key in uses.reused
        ):
            problems.append("duel lists a key used once as reused, or the reverse")
        if len(uses.history) > uses.limit:
            problems.append("duel's history exceeds its bound")
        if any(key in uses.stamps for key in uses.history):
            problems.append("a resident key is in duel's history")
        return problems

    def _candidates(self, protected: Container[Key]) -> Iterator[Key]:
        return unprotected(self._uses.ordered(by_reuse=self.follows_reuse), protected)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def abstract_order(self) -> DuelOrder:
        from kvoffload_spec.policies import DuelOrder, ShadowPool

        lru, lru2 = (
            ShadowPool(
                shadow.capacity,
                shadow.reuse,
                _spec_uses(shadow.uses),
                shadow.mask + 1,
                shadow.clock,
                shadow.score,
            )
            for shadow in self._shadows
        )
        return DuelOrder(self.capacity, _spec_uses(self._uses), (lru, lru2), self._clock)


def _spec_uses(uses: _Uses) -> KeyUses:
    """The spec's bookkeeping that ``uses`` stands for. A stamp is twice the last use plus
    the reused bit; the spec keeps a second use's time where this keeps only that bit, and
    its order reads only whether there is one, so 0 stands for "reused". The history's
    last uses are likewise only read as "was here": 0 each, in the same order."""
    from kvoffload_spec.policies import KeyUses

    stamps = dict(uses.stamps.items())
    last = {key: stamp >> 1 for key, stamp in stamps.items()}
    penult = {key: 0 if stamp & 1 else -1 for key, stamp in stamps.items()}
    return KeyUses(uses.limit, last, penult, dict.fromkeys(uses.history, 0))
