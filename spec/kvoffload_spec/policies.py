"""Eviction order: which resident blocks leave first. LRU and ARC, written plainly.

A policy only keeps an *order* of resident keys (and, for ARC, ghosts of evicted ones). It
never decides on its own which blocks may go: the state passes ``can_evict``, which is false
for pinned, pending and protected blocks. A policy's ``choose_victims`` changes nothing; the
state commits the choice with ``evict`` once the whole store is known to succeed, so a
failed ``prepare_store`` leaves the order exactly as it was.

The verbs are those of the product's ``kvoffload.EvictionPolicy``: ``insert``, ``remove``
(left without being evicted), ``evict``, ``touch``, ``on_store_miss`` (an optional hook: a
no-op unless a policy learns from misses), ``choose_victims``, ``resident`` and ``clear``.
Two differ by design: the spec passes ``choose_victims`` a predicate ``can_evict`` (it
derives evictability from the state each time), where a product policy hears
``mark_evictable`` / ``mark_unevictable`` as it changes and receives only the protected
keys; and a spec order has a ``fingerprint``, a product policy its ``abstract_order``.

Lists are in recency order: index 0 is the least recent. Recency comes from insertion and
``touch`` alone; loads and pinning never move a key.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from zlib import crc32

from kvoffload_spec.surface import Key


class Order:
    """What every spec order shares: the optional hooks, as no-ops."""

    def on_store_miss(self, keys: Sequence[Key]) -> None:
        """``prepare_store`` is about to place ``keys`` (absent, admitted), before it asks
        for victims; called also when the store is then refused. Learns nothing by default.
        """


@dataclass
class LruOrder(Order):
    """Least recently used first."""

    order: list[Key] = field(default_factory=list)

    def insert(self, key: Key) -> None:
        self.order.append(key)

    def remove(self, key: Key) -> None:
        """``key`` left without being evicted (its store failed)."""
        self.order.remove(key)

    def evict(self, victims: Sequence[Key]) -> None:
        for key in victims:
            self.order.remove(key)

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
class ArcOrder(Order):
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

    def evict(self, victims: Sequence[Key]) -> None:
        for key in victims:
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


DUEL_DECAY = 0.999
"""Each replayed request multiplies a shadow's score by this before adding its hits: the
score weighs about the last thousand requests."""

DUEL_HISTORY = 4
"""The reuse order remembers the last use of up to this many times ``capacity`` evicted
keys, so that a key stored again soon after its eviction counts as reused."""

DUEL_ORDERS = ("lru", "reuse", "lru2")
"""The orders ``duel`` chooses among, in the order that breaks a tie of their shadows' scores:
LRU, the segmented reuse order, and LRU-2 (by the second most recent use)."""

DUEL_SAMPLE = 32
"""A shadow simulates at most one key in this many (the sample rate's upper bound)."""

DUEL_SAMPLE_MIN = 1024
"""A shadow simulates at least this many blocks: a pool under twice this is not sampled."""


def duel_sample_rate(capacity: int) -> int:
    """How sparsely the shadows of a ``capacity``-block pool sample the keys: the largest
    power of two at most ``DUEL_SAMPLE`` that leaves them ``DUEL_SAMPLE_MIN`` blocks."""
    rate = 1
    while rate < DUEL_SAMPLE and capacity // (2 * rate) >= DUEL_SAMPLE_MIN:
        rate *= 2
    return rate


def sample_hash(key: Key) -> int:
    """A hash of ``key`` that every run agrees on (Python's ``hash`` salts str and bytes):
    Fibonacci hashing for ints, CRC-32 of the bytes, of a str's UTF-8, else of its repr."""
    if isinstance(key, int):
        return (key * 0x9E3779B97F4A7C15) % 2**64 // 2**32
    if isinstance(key, bytes):
        return crc32(key)
    if isinstance(key, str):
        return crc32(key.encode("utf-8", "surrogatepass"))
    return crc32(repr(key).encode("utf-8", "backslashreplace"))


def in_sample(key: Key, rate: int) -> bool:
    """Whether a shadow sampling one key in ``rate`` simulates ``key``."""
    return rate == 1 or sample_hash(key) % rate == 0  # small pools sample every key


@dataclass
class KeyUses:
    """Each resident key's last and second most recent use (-1: used once), and the last
    uses of up to ``history_limit`` recently evicted keys, oldest first, so that a key
    stored again is known as reused. The reuse order reads only whether a second use
    exists (LRU-2 would order by its stamp)."""

    history_limit: int
    last: dict[Key, int] = field(default_factory=dict)
    penult: dict[Key, int] = field(default_factory=dict)
    history: dict[Key, int] = field(default_factory=dict)

    def insert(self, key: Key, stamp: int) -> None:
        self.last[key] = stamp
        self.penult[key] = self.history.pop(key, -1)

    def use(self, key: Key, stamp: int, *, reused: bool) -> None:
        if reused:
            self.penult[key] = self.last[key]
        self.last[key] = stamp

    def forget(self, key: Key) -> None:
        self.history.pop(key, None)
        self.history[key] = self.last.pop(key)
        del self.penult[key]
        while len(self.history) > self.history_limit:
            del self.history[next(iter(self.history))]

    def drop(self, key: Key) -> None:
        del self.last[key]
        del self.penult[key]

    def by_recency(self) -> list[Key]:
        return sorted(self.last, key=lambda key: self.last[key])

    def by_reuse(self) -> list[Key]:
        """Segmented LRU: the keys used once, least recent first, then the reused ones."""
        return sorted(self.last, key=lambda key: (self.penult[key] >= 0, self.last[key]))

    def by_second_use(self) -> list[Key]:
        """LRU-2: the keys used once, least recent first, then the reused ones by their
        second most recent use (ties, a request's keys, by last use)."""
        penult, last = self.penult, self.last
        return sorted(last, key=lambda key: (penult[key] >= 0, penult[key], last[key]))

    def ordered(self, order: str) -> list[Key]:
        """Every key in ``order`` (one of ``DUEL_ORDERS``), victims first."""
        if order == "lru":
            return self.by_recency()
        return self.by_reuse() if order == "reuse" else self.by_second_use()

    def clear(self) -> None:
        self.last.clear()
        self.penult.clear()
        self.history.clear()

    def copy(self) -> KeyUses:
        return KeyUses(self.history_limit, dict(self.last), dict(self.penult), dict(self.history))


@dataclass
class ShadowPool:
    """A keys-only pool of ``capacity`` blocks in one of the ``DUEL_ORDERS`` (``order``),
    driven by the touched requests as an engine drives a pool: a request's hits are its
    longest resident prefix, then its absent keys are stored (evicting keys outside the
    request; none if they cannot fit), then it is touched (the first key ends most recent; a
    key just stored is not reused). ``score`` is the decayed count of its hits.

    A sampled shadow (``rate`` above 1) sees only the keys ``in_sample`` picks, about one in
    ``rate``, in a pool of ``capacity`` (the real one's divided by ``rate``): a sample of
    the keys sees about the same hit ratio as all of them (SHARDS, Waldspurger et al.)."""

    capacity: int
    order: str
    uses: KeyUses
    rate: int = 1
    clock: int = 0
    score: float = 0.0

    def replay(self, keys: Sequence[Key]) -> None:
        keys = [key for key in keys if in_sample(key, self.rate)]
        resident = self.uses.last
        hits = 0
        while hits < len(keys) and keys[hits] in resident:
            hits += 1
        self.score = self.score * DUEL_DECAY + hits
        distinct = list(dict.fromkeys(keys))
        absent = [key for key in distinct if key not in resident]
        outside = [key for key in self.uses.ordered(self.order) if key not in distinct]
        need = len(absent) - (self.capacity - len(resident))
        if need > len(outside):
            absent = []
        for key in outside[: max(need, 0)] if absent else []:
            self.uses.forget(key)
        for key in absent:
            self.clock += 1
            self.uses.insert(key, self.clock)
        for key in reversed(keys):
            if key in resident:
                self.clock += 1
                self.uses.use(key, self.clock, reused=key not in absent)

    def clear(self) -> None:
        self.uses.clear()
        self.score = 0.0

    def copy(self) -> ShadowPool:
        uses = self.uses.copy()
        return ShadowPool(self.capacity, self.order, uses, self.rate, self.clock, self.score)


@dataclass
class DuelOrder(Order):
    """Victims in the order that would have served the most prefix hits lately: LRU, the
    reuse order or LRU-2 (``DUEL_ORDERS``).

    A request reuses only a prefix of its blocks, and a conversation's prefix is reused when
    its next turn arrives. LRU wins when the pool holds the workload's reuse distances. When
    it does not, one-shot blocks flush everything under LRU, and the two scan-resistant
    orders evict the keys used once first (least recent first): the reuse order (segmented
    LRU) then the reused ones by last use, LRU-2 by their second most recent use, which
    evicts first the prefixes whose last two uses lay furthest apart (the conversations
    that come back least often) and keeps those that return soon. Three shadows,
    keys-only pools in each order that see a sample of the keys (``ShadowPool``), replay
    every touched request and score the prefix hits they would have served; the real pool
    evicts in the order of the shadow with the highest score (a tie goes to the earlier
    of ``DUEL_ORDERS``). Only ``touch`` feeds the shadows: it names a request's keys in
    order, which is what a prefix hit needs. Recency (every order) comes from insertion and
    ``touch`` alone.
    """

    capacity: int
    uses: KeyUses
    shadows: tuple[ShadowPool, ShadowPool, ShadowPool]
    clock: int = 0

    @staticmethod
    def empty(capacity: int) -> DuelOrder:
        rate = duel_sample_rate(capacity)
        size = capacity // rate
        # LRU never reads a second use: its shadow keeps no history.
        lru = ShadowPool(size, "lru", KeyUses(0), rate)
        reuse = ShadowPool(size, "reuse", KeyUses(DUEL_HISTORY * size), rate)
        lru2 = ShadowPool(size, "lru2", KeyUses(DUEL_HISTORY * size), rate)
        return DuelOrder(capacity, KeyUses(DUEL_HISTORY * capacity), (lru, reuse, lru2))

    @property
    def leader(self) -> str:
        """The order victims come in now: the shadow with the highest score, the earliest on
        a tie."""
        best = max(shadow.score for shadow in self.shadows)
        return next(shadow.order for shadow in self.shadows if shadow.score == best)

    def insert(self, key: Key) -> None:
        self.clock += 1
        self.uses.insert(key, self.clock)

    def remove(self, key: Key) -> None:
        self.uses.drop(key)

    def evict(self, victims: Sequence[Key]) -> None:
        for key in victims:
            self.uses.forget(key)

    def touch(self, keys: Sequence[Key], is_ready: Callable[[Key], bool]) -> None:
        for shadow in self.shadows:
            shadow.replay(keys)
        for key in reversed(keys):
            if key in self.uses.last:
                self.clock += 1
                # A pending block was only just inserted: that is not a second use.
                self.uses.use(key, self.clock, reused=is_ready(key))

    def choose_victims(self, need: int, can_evict: Callable[[Key], bool]) -> list[Key] | None:
        candidates = [key for key in self.uses.ordered(self.leader) if can_evict(key)]
        return candidates[:need] if len(candidates) >= need else None

    def resident(self) -> list[Key]:
        return self.uses.by_recency()

    def snapshot(self) -> tuple[object, ...]:
        """The resident keys in each order, the history (keys, and the last uses the LRU-2
        order reads), each shadow's keys in its own order and its history, and the scores
        (compared with the manager's)."""
        uses = self.uses
        return (
            [uses.ordered(order) for order in DUEL_ORDERS],
            list(uses.history.items()),
            [shadow.uses.ordered(shadow.order) for shadow in self.shadows],
            [_history(shadow) for shadow in self.shadows],
            tuple(shadow.score for shadow in self.shadows),
        )

    def fingerprint(self) -> tuple[Hashable, Hashable]:
        """As ``LruOrder.fingerprint``: stamps as ranks, so equal orders compare equal."""
        parts: list[Hashable] = [self._ranks(self.uses, DUEL_ORDERS), self.leader]
        for shadow in self.shadows:
            parts += [self._ranks(shadow.uses, (shadow.order,)), shadow.score]
        return tuple(parts), ()

    @staticmethod
    def _ranks(uses: KeyUses, orders: Sequence[str]) -> Hashable:
        """The orders that decide the pool's future: its own, and, where LRU-2 reads them,
        the history's last uses as ranks among its keys' last uses."""
        ranked = tuple(tuple(uses.ordered(order)) for order in orders)
        if "lru2" not in orders:
            return ranked, tuple(uses.history)
        times = sorted({*uses.last.values(), *uses.penult.values(), *uses.history.values()})
        rank = {time: number for number, time in enumerate(times)}
        penult = tuple((key, rank[uses.penult[key]]) for key in ranked[0])
        gone = tuple((key, rank[time]) for key, time in uses.history.items())
        return ranked, penult, gone

    def clear(self) -> None:
        self.uses.clear()
        for shadow in self.shadows:
            shadow.clear()

    def copy(self) -> DuelOrder:
        """A deep copy (keys are immutable: only the containers are copied)."""
        lru, reuse, lru2 = (shadow.copy() for shadow in self.shadows)
        return DuelOrder(self.capacity, self.uses.copy(), (lru, reuse, lru2), self.clock)


def _history(shadow: ShadowPool) -> list[object]:
    """A shadow's history as the manager's must match it: keys, with the last uses where
    the shadow's order reads them (LRU-2)."""
    if shadow.order == "lru2":
        return list(shadow.uses.history.items())
    return list(shadow.uses.history)


PolicyOrder = LruOrder | ArcOrder | DuelOrder

POLICY_NAMES = ("lru", "arc", "duel")


def new_order(policy: str, capacity: int) -> PolicyOrder:
    if policy == "duel":
        return DuelOrder.empty(capacity)
    return LruOrder() if policy == "lru" else ArcOrder(capacity)
