"""Adaptive Replacement Cache eviction, with no cost for pinned or pending blocks."""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from kvoffload.policies.base import EvictionPolicy
from kvoffload.policies.recency import StampOrder, unprotected
from kvoffload.sharded import OrderedKeys, ShardedDict
from kvoffload_spec.surface import Key

if TYPE_CHECKING:
    from kvoffload_spec.policies import ArcOrder

_END: Any = object()  # no candidate left in a list
_IN_T2 = 1  # the bits of a resident key's code below its stamp
_STORED = 2


class ArcPolicy(EvictionPolicy):
    """Adaptive Replacement Cache (Megiddo & Modha, FAST'03), as the spec adapts it.

    T1 holds keys seen once, T2 keys touched again while ready; B1 and B2 are ghosts of keys
    evicted from T1 and T2, and a ghost hit (a store about to place a ghost's key again, or
    a touch of it) moves the target size ``p`` of T1.
    Victims come from T1 when ``|T1| >= p``, else from T2, falling back to the other list
    when the preferred one has no candidate.

    Each resident key has a code ``4 * stamp + 2 * stored + in_t2``: its recency stamp,
    whether its store has completed (it is ready: only a touch of a ready key is a second
    use) and its list. The evictable keys of each list are kept apart, ordered by code
    (``StampOrder``), and the list sizes are counters, so choosing k victims walks k keys
    (plus the protected ones) however many blocks are pinned. Ghosts are insertion-ordered
    sets. No table is one large dict (``kvoffload.sharded``), so no call pauses to rebuild
    one.
    """

    touch_counts_reuse = True

    __slots__ = ("_b1", "_b2", "_clock", "_codes", "_t1", "_t1_size", "_t2", "_t2_size", "p")

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._codes: ShardedDict[Key, int] = ShardedDict(capacity)
        self._t1 = StampOrder(low_bits=2)  # the evictable keys of T1, by code
        self._t2 = StampOrder(low_bits=2)  # the evictable keys of T2, by code
        self._t1_size = 0
        self._t2_size = 0
        self._b1: OrderedKeys[Key] = OrderedKeys(capacity)
        self._b2: OrderedKeys[Key] = OrderedKeys(capacity)
        self.p: float = 0.0
        self._clock = 0

    def insert(self, key: Key) -> None:
        self._clock += 1
        self._codes[key] = self._clock << 2
        self._t1_size += 1
        self._b1.discard(key)
        self._b2.discard(key)

    def remove(self, key: Key) -> None:
        if self._codes.pop(key) & _IN_T2:
            self._t2_size -= 1
        else:
            self._t1_size -= 1

    def mark_evictable(self, key: Key) -> None:
        code = self._codes[key]
        if not code & _STORED:  # its store completed (else it was unpinned)
            code |= _STORED
            self._codes[key] = code
        (self._t2 if code & _IN_T2 else self._t1).add(key, code)

    def mark_unevictable(self, key: Key) -> None:
        code = self._codes[key]
        (self._t2 if code & _IN_T2 else self._t1).remove(key, code)

    def touch(self, keys: Sequence[Key], is_ready: Callable[[Key], bool]) -> None:
        # ``is_ready`` is not needed: a key is ready once its store completed (_STORED).
        codes, t1, t2 = self._codes, self._t1, self._t2
        for key in reversed(keys):
            code = codes.get(key)
            if code is None:
                self._ghost_hit(key)
                continue
            # A ready key moves to (or within) T2; a pending one was only just inserted,
            # which is not a second use: it stays in T1, as the most recent.
            self._clock += 1
            new_code = self._clock << 2 | (code & _STORED) | (code >> 1 & 1)
            codes[key] = new_code
            if code & _IN_T2:
                if t2.discard(key, code):
                    t2.add(key, new_code)
                continue
            evictable = t1.discard(key, code)
            if new_code & _IN_T2:
                self._t1_size -= 1
                self._t2_size += 1
                if evictable:
                    t2.add(key, new_code)
            elif evictable:
                t1.add(key, new_code)

    def on_store_miss(self, keys: Sequence[Key]) -> None:
        # Before insert drops the ghost: in an engine's order a returning key is stored
        # again before it is touched, so this is where ARC sees it come back.
        b1, b2 = self._b1, self._b2
        for key in reversed(keys):
            if key in b1 or key in b2:
                self._ghost_hit(key)

    def choose_victims(self, need: int, protected: Container[Key]) -> list[Key] | None:
        t1_keys = self._candidates(self._t1, protected)
        t2_keys = self._candidates(self._t2, protected)
        t1_head, t2_head = next(t1_keys, _END), next(t2_keys, _END)
        t1_size = self._t1_size  # as it will be once the victims chosen so far are gone
        victims: list[Key] = []
        while len(victims) < need:
            from_t1 = self._from_t1(t1_size, t1_head is not _END, t2_head is not _END)
            head = t1_head if from_t1 else t2_head
            if head is _END:
                return None
            victims.append(head)
            if from_t1:
                t1_head = next(t1_keys, _END)
                t1_size -= 1
            else:
                t2_head = next(t2_keys, _END)
        return victims

    def evict(self, victims: Sequence[Key]) -> None:
        pop = self._codes.pop
        for key in victims:
            code = pop(key)
            if code & _IN_T2:
                self._t2.remove(key, code)
                self._t2_size -= 1
                self._b2.append_within(key, self.capacity)
            else:
                self._t1.remove(key, code)
                self._t1_size -= 1
                self._b1.append_within(key, self.capacity)

    def clear(self) -> None:
        for run in (self._t1, self._t2):
            run.clear()
        self._codes.clear()
        self._b1.clear()
        self._b2.clear()
        self._t1_size = self._t2_size = 0
        self.p = 0.0

    def resident(self) -> list[Key]:
        t1, t2, _, _ = self.lists()
        return t1 + t2

    def lists(self) -> tuple[list[Key], list[Key], list[Key], list[Key]]:
        """T1, T2, B1 and B2, each least recent first (O(n log n): for checks and tests)."""
        by_code = sorted(self._codes, key=self._codes.__getitem__)
        return (
            [key for key in by_code if not self._codes[key] & _IN_T2],
            [key for key in by_code if self._codes[key] & _IN_T2],
            list(self._b1),
            list(self._b2),
        )

    def check_invariants(self, is_evictable: Callable[[Key], bool]) -> list[str]:
        problems = self._t1.problems(self._codes.get) + self._t2.problems(self._codes.get)
        t1, t2, b1, b2 = self.lists()
        if (len(t1), len(t2)) != (self._t1_size, self._t2_size):
            problems.append(f"ARC sizes {self._t1_size}, {self._t2_size} but T1={t1}, T2={t2}")
        for resident, run, name in ((t1, self._t1, "T1"), (t2, self._t2, "T2")):
            listed = list(run)
            evictable = [key for key in resident if is_evictable(key)]
            if listed != evictable:
                problems.append(f"ARC's evictable {name} is {listed}, the manager's {evictable}")
        if len(set(self._codes.values())) != len(self._codes):
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

    def _from_t1(self, t1_size: int, t1_has: bool, t2_has: bool) -> bool:
        """Whether the next victim comes from T1: the preferred list, unless it has no
        candidate left (vLLM fell back only from T1 to T2 until PR #55461).
        """
        prefer_t1 = t1_size >= int(self.p)
        return t1_has if prefer_t1 else not t2_has

    def _ghost_hit(self, key: Key) -> None:
        if key in self._b1:
            self.p = min(self.p + max(1.0, len(self._b2) / len(self._b1)), self.capacity)
            self._b1.move_to_end(key)
        elif key in self._b2:
            self.p = max(self.p - max(1.0, len(self._b1) / len(self._b2)), 0.0)
            self._b2.move_to_end(key)

    def abstract_order(self) -> ArcOrder:
        from kvoffload_spec.policies import ArcOrder

        t1, t2, b1, b2 = self.lists()
        return ArcOrder(self.capacity, t1, t2, b1, b2, self.p)
