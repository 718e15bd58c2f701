"""Dueling eviction: LRU or LRU-2, whichever would have served more prefix hits lately.

The two orders win in different regimes. When the pool is small against the reuse
distances of a workload, LRU flushes every block before its next use, while LRU-2 (evict the
block whose second most recent use is oldest; blocks used once go first) keeps the blocks
that were reused and loses the one-shot ones. When the pool is large, LRU-2 holds on to
blocks reused long ago and LRU wins. Which regime holds depends on the workload and the
pool, so the policy measures it: two *shadows*, keys-only simulations of an LRU and an
LRU-2 pool of the same capacity, replay every touched request and count the prefix hits
each would have served (a request reuses only a prefix of its blocks, so a block counts only
if every block before it is resident too). The real pool evicts in the order of the shadow
with the higher score; scores decay, so the choice follows the workload as it changes.

See the spec's ``DuelOrder`` (``kvoffload_spec.policies``) for the rules written plainly.

The shadows are sampled (SHARDS): each simulates only the keys whose ``stable_hash`` is 0
modulo ``sample_rate(capacity)``, in a pool of ``capacity // rate`` blocks, so that they
cost a thirty-second of the pool at most sizes while pools under 2,048 blocks are
simulated whole.

Costs: every operation is O(k log n) for k keys (the shadows' included), and finding
victims walks only evictable keys. Memory: per resident key a code and two sorted-list
entries; per shadow at most ``capacity // rate`` keys, and LRU-2's histories of at most
``HISTORY`` times their pool's capacity evicted keys' last uses (bounded, like ARC's
ghosts).
"""

from __future__ import annotations

import functools
import itertools
from collections import OrderedDict
from collections.abc import Callable, Container, Iterator, Sequence
from typing import TYPE_CHECKING, Any
from zlib import crc32

from sortedcontainers import SortedKeyList

from kvoffload.policies.base import EvictionPolicy
from kvoffload.policies.recency import stamp_ordered, unprotected
from kvoffload_spec.policies import DUEL_DECAY, DUEL_HISTORY, DUEL_SAMPLE, DUEL_SAMPLE_MIN
from kvoffload_spec.surface import Key

if TYPE_CHECKING:
    from kvoffload_spec.policies import DuelOrder, Lru2Uses

HISTORY = DUEL_HISTORY
_FIBONACCI = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1
_LAST_BITS = 40  # stamps stay below 2**40: a trillion uses
_LAST_MASK = (1 << _LAST_BITS) - 1


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


def reuse_code(penult: int, last: int) -> int:
    """LRU-2's order as one int: by the second most recent use (-1: none), then the last."""
    return (penult + 1) << _LAST_BITS | last


class _LastUse:
    """The sort key of the LRU order: a key's last use, the low bits of its code. A class
    rather than a closure, so that ``copy.deepcopy`` gives a clone's sorted list the clone's
    codes (as the ``partial`` of ``recency.stamp_ordered`` does)."""

    __slots__ = ("codes",)

    def __init__(self, codes: dict[Key, int]) -> None:
        self.codes = codes

    def __call__(self, key: Key) -> int:
        return self.codes[key] & _LAST_MASK


class _Lru2Stamps:
    """LRU-2 bookkeeping: each key's code (see ``reuse_code``: its last and second most
    recent use in one int), and a bounded history of evicted keys' last uses, so that a key
    stored again is known as reused."""

    __slots__ = ("codes", "history", "limit")

    def __init__(self, history_limit: int) -> None:
        self.codes: dict[Key, int] = {}
        self.history: OrderedDict[Key, int] = OrderedDict()
        self.limit = history_limit

    def insert(self, key: Key, stamp: int) -> None:
        self.codes[key] = reuse_code(self.history.pop(key, -1), stamp)

    def use(self, key: Key, stamp: int, *, reused: bool) -> None:
        code = self.codes[key]
        penult = code & _LAST_MASK if reused else (code >> _LAST_BITS) - 1
        self.codes[key] = reuse_code(penult, stamp)

    def forget(self, key: Key) -> None:
        """``key`` left (evicted): its last use goes to the history."""
        self.history[key] = self.codes.pop(key) & _LAST_MASK
        while len(self.history) > self.limit:
            self.history.popitem(last=False)

    def drop(self, key: Key) -> None:
        """``key`` left without a use worth remembering (its store failed)."""
        del self.codes[key]

    def clear(self) -> None:
        self.codes.clear()
        self.history.clear()


class _Shadow:
    """A keys-only pool of ``capacity`` blocks under LRU (``reuse=False``) or LRU-2, driven
    by the touched requests as an engine drives the real pool, scoring its prefix hits."""

    __slots__ = ("capacity", "clock", "mask", "order", "reuse", "score", "stamps")

    def __init__(self, capacity: int, *, reuse: bool, rate: int = 1) -> None:
        self.capacity = capacity // rate
        self.mask = rate - 1  # a power of two: in the sample when the hash's low bits are 0
        self.reuse = reuse
        # LRU never reads a second use: its shadow keeps no history.
        self.stamps = _Lru2Stamps(HISTORY * self.capacity if reuse else 0)
        codes = self.stamps.codes
        by = functools.partial(dict.__getitem__, codes) if reuse else _LastUse(codes)
        self.order = SortedKeyList(key=by)
        self.score = 0.0
        self.clock = 0

    def replay(self, keys: Sequence[Key]) -> None:
        if self.mask:
            mask = self.mask
            keys = [key for key in keys if not stable_hash(key) & mask]
        resident = self.stamps.codes
        hits = sum(1 for _ in itertools.takewhile(resident.__contains__, keys))
        self.score = self.score * DUEL_DECAY + hits
        distinct = dict.fromkeys(keys)
        absent = [key for key in distinct if key not in resident]
        need = len(absent) - (self.capacity - len(resident))
        if need > len(resident) - (len(distinct) - len(absent)):
            absent = []  # it does not fit: the store is refused, the touch still counts
        elif need > 0:
            victims = list(itertools.islice(unprotected(self.order, distinct), need))
            for key in victims:
                self.order.remove(key)
                self.stamps.forget(key)
        for key in absent:
            self.clock += 1
            self.stamps.insert(key, self.clock)
            self.order.add(key)
        fresh = set(absent)
        for key in reversed(keys):
            if key in resident:
                self.order.remove(key)
                self.clock += 1
                self.stamps.use(key, self.clock, reused=key not in fresh)
                self.order.add(key)

    def clear(self) -> None:
        self.stamps.clear()
        self.order.clear()
        self.score = 0.0


class DuelPolicy(EvictionPolicy):
    """Victims in LRU or LRU-2 order, whichever shadow scored more prefix hits lately.

    The real keys carry both orders' stamps; each order keeps its evictable keys in a sorted
    list, so choosing k victims costs O(k log n) however many blocks are pinned or pending.
    """

    touch_counts_reuse = True  # a touch of a ready key is its second use in LRU-2 order

    __slots__ = ("_by_recency", "_by_reuse", "_clock", "_shadows", "_stamps")

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._stamps = _Lru2Stamps(HISTORY * capacity)
        self._by_recency = SortedKeyList(key=_LastUse(self._stamps.codes))
        self._by_reuse = stamp_ordered(self._stamps.codes)
        rate = sample_rate(capacity)
        self._shadows = (
            _Shadow(capacity, reuse=False, rate=rate),
            _Shadow(capacity, reuse=True, rate=rate),
        )
        self._clock = 0

    @property
    def follows_reuse(self) -> bool:
        """Whether victims come in LRU-2 order now (else LRU): the LRU-2 shadow leads."""
        lru, lru2 = self._shadows
        return lru2.score > lru.score

    @property
    def scores(self) -> tuple[float, float]:
        """The decayed prefix-hit scores of the LRU and the LRU-2 shadow."""
        return self._shadows[0].score, self._shadows[1].score

    def insert(self, key: Key) -> None:
        self._stamps.insert(key, self._tick())

    def remove(self, key: Key) -> None:
        self._stamps.drop(key)

    def mark_evictable(self, key: Key) -> None:
        self._by_recency.add(key)
        self._by_reuse.add(key)

    def mark_unevictable(self, key: Key) -> None:
        self._by_recency.remove(key)
        self._by_reuse.remove(key)

    def touch(self, keys: Sequence[Key], is_ready: Callable[[Key], bool]) -> None:
        for shadow in self._shadows:
            shadow.replay(keys)
        for key in reversed(keys):
            if key in self._stamps.codes:
                evictable = key in self._by_recency
                if evictable:
                    self.mark_unevictable(key)
                # A pending block was only just inserted: that is not a second use.
                self._stamps.use(key, self._tick(), reused=is_ready(key))
                if evictable:
                    self.mark_evictable(key)

    def choose_victims(self, need: int, protected: Container[Key]) -> list[Key] | None:
        victims = list(itertools.islice(self._candidates(protected), need))
        return victims if len(victims) == need else None

    def evict(self, victims: Sequence[Key]) -> None:
        for key in victims:
            self.mark_unevictable(key)
            self._stamps.forget(key)

    def clear(self) -> None:
        self._by_recency.clear()
        self._by_reuse.clear()
        self._stamps.clear()
        for shadow in self._shadows:
            shadow.clear()

    def resident(self) -> list[Key]:
        return sorted(self._stamps.codes, key=_LastUse(self._stamps.codes))

    def snapshot(self) -> tuple[object, ...]:
        """Everything that decides the future, in the shape of the spec's
        ``DuelOrder.snapshot()`` (O(n log n): for checks and tests)."""
        stamps = self._stamps
        return (
            self.resident(),
            sorted(stamps.codes, key=stamps.codes.__getitem__),
            list(stamps.history),
            [list(shadow.order) for shadow in self._shadows],
            [list(shadow.stamps.history) for shadow in self._shadows],
            self.scores,
        )

    def orders(self) -> tuple[list[Key], list[Key]]:
        """The evictable keys in LRU and in LRU-2 order, victims first (for checks)."""
        return list(self._by_recency), list(self._by_reuse)

    def check_invariants(self, is_evictable: Callable[[Key], bool]) -> list[str]:
        problems: list[str] = []
        stamps = self._stamps
        by_last = [key for key in self.resident() if is_evictable(key)]
        by_code = sorted(by_last, key=stamps.codes.__getitem__)
        if self.orders() != (by_last, by_code):
            problems.append(f"duel's evictable orders are {self.orders()}, expected {by_last}")
        if len(stamps.history) > stamps.limit:
            problems.append("duel's history exceeds its bound")
        if set(stamps.history) & set(stamps.codes):
            problems.append("a resident key is in duel's history")
        return problems

    def _candidates(self, protected: Container[Key]) -> Iterator[Key]:
        ordered: Any = self._by_reuse if self.follows_reuse else self._by_recency
        return unprotected(ordered, protected)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def abstract_order(self) -> DuelOrder:
        from kvoffload_spec.policies import DuelOrder, ShadowPool

        lru, lru2 = (
            ShadowPool(
                shadow.capacity,
                shadow.reuse,
                _spec_uses(shadow.stamps),
                shadow.mask + 1,
                shadow.clock,
                shadow.score,
            )
            for shadow in self._shadows
        )
        return DuelOrder(self.capacity, _spec_uses(self._stamps), (lru, lru2), self._clock)


def _spec_uses(stamps: _Lru2Stamps) -> Lru2Uses:
    """The spec's LRU-2 bookkeeping that ``stamps`` stand for: each code unpacked."""
    from kvoffload_spec.policies import Lru2Uses

    last = {key: code & _LAST_MASK for key, code in stamps.codes.items()}
    penult = {key: (code >> _LAST_BITS) - 1 for key, code in stamps.codes.items()}
    return Lru2Uses(stamps.limit, last, penult, dict(stamps.history))
