"""Planted bugs in the production manager and its policies: each a one-line slip of the
kind peers shipped. ``tests/planted/__init__.py`` lists them in the catalogue with the
checkers that must find each; ``MostRecentFirst`` is no bug, but a correct policy the spec
does not know (the base of one bug, and the kit's example of a user's policy).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Container, Hashable, Iterator, Sequence
from typing import TYPE_CHECKING

from kvoffload.manager import OffloadManager
from kvoffload.offloader import Offloader
from kvoffload.policies.arc import ArcPolicy
from kvoffload.policies.base import EvictionPolicy
from kvoffload.policies.duel import DuelPolicy
from kvoffload.policies.lru import LruPolicy
from kvoffload.policies.recency import unprotected
from kvoffload_spec.surface import Key, LoadPlan, Plan, RemovalReason, StorePlan
from kvoffload_spec.validation import check_flag, check_keys

if TYPE_CHECKING:
    from kvoffload.tiers import RemoteJob


class MostRecentFirst(EvictionPolicy):
    """A policy the spec does not know: evict the most recently inserted key first."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.order: dict[Key, None] = {}  # insertion order
        self.evictable: set[Key] = set()

    def insert(self, key: Key) -> None:
        self.order[key] = None

    def remove(self, key: Key) -> None:
        del self.order[key]

    def mark_evictable(self, key: Key) -> None:
        self.evictable.add(key)

    def mark_unevictable(self, key: Key) -> None:
        self.evictable.remove(key)

    def touch(self, keys: Sequence[Key], is_ready: Callable[[Key], bool]) -> None:
        pass  # insertion order only

    def choose_victims(self, need: int, protected: Container[Key]) -> list[Key] | None:
        ok = [k for k in reversed(self.order) if k in self.evictable and k not in protected]
        return ok[:need] if len(ok) >= need else None

    def evict(self, victims: Sequence[Key]) -> None:
        for key in victims:
            del self.order[key]
            self.evictable.remove(key)

    def clear(self) -> None:
        self.order.clear()
        self.evictable.clear()

    def resident(self) -> list[Key]:
        return list(self.order)


class CounterNotRestoredOnLoad(OffloadManager):
    """complete_load makes the block evictable but forgets the counter (LMCache #987)."""

    def _unpin_each(self, keys: Sequence[Key], block_ids: Sequence[int]) -> None:
        for key, block_id in zip(keys, block_ids, strict=True):
            self._refs[block_id] -= 1
            if not self._refs[block_id]:
                self._policy.mark_evictable(key)


class NestedLoadsShareOnePin(OffloadManager):
    """Refs as a flag, not a count: the first of two loads of a block to finish unpins it."""

    def _pin_each(self, keys: Sequence[Key], block_ids: Sequence[int]) -> None:
        for key, block_id in zip(keys, block_ids, strict=True):
            if not self._refs[block_id]:
                self._policy.mark_unevictable(key)
                self._num_evictable -= 1
            self._refs[block_id] = 1


class StaleLoadCompletionApplied(OffloadManager):
    """A load plan made before reset_cache unpins the blocks stored again since."""

    def complete_load(self, plan: LoadPlan) -> None:
        plan = self._close(plan, LoadPlan)
        for key in plan.keys:
            if key in self._block_id_of:  # the generation check forgotten
                self._unpin_each((key,), (self._block_id_of[key],))


class StaleStoreCompletionApplied(OffloadManager):
    """The ABA hazard (vLLM #48090): a store plan made before reset_cache marks ready a key
    stored again since, whose new store job has not written it yet.
    """

    def complete_store(self, plan: StorePlan, success: bool = True) -> None:
        check_flag("success", success)
        plan = self._close(plan, StorePlan)
        done = [key for key in plan.keys if key in self._storing]  # by key, not by plan
        for key in done:
            del self._storing[key]
        if success:
            self._mark_stored(done)
        else:
            self._drop_failed(done)


class ArcWithoutFallbackToT1(ArcPolicy):
    """ARC as vLLM had it before PR #55461: T2 preferred but empty means no victim."""

    falls_back_to_t1 = False


class LruRestampedWhenUnpinned(LruPolicy):
    """Pinning changes recency: an unpinned block jumps to the most recent end."""

    def mark_evictable(self, key: Key) -> None:
        self._stamps[key] = self._tick()
        super().mark_evictable(key)


class TouchDeduplicatedKeepingTheLast(OffloadManager):
    """Restamps each key of a touch once, but keeps its *last* occurrence: in ``[a, b, a]``,
    ``b`` ends most recent instead of ``a``.
    """

    def touch(self, keys: Sequence[Key]) -> None:
        once = list(dict.fromkeys(reversed(check_keys(keys))))
        self._policy.touch(once[::-1], self._is_ready)


class ArcIntegerTarget(ArcPolicy):
    """ARC adapting its target by whole blocks: the ratio of the ghost lists is floored."""

    def _adapt(self, in_b1: bool) -> None:
        b1, b2 = self._b1_size, self._b2_size
        if in_b1:
            self.p = min(self.p + max(1, b2 // b1), self.capacity)
        else:
            self.p = max(self.p - max(1, b1 // b2), 0.0)


class DuelTouchOfPendingIsReuse(DuelPolicy):
    """A block touched while its store is in flight counts as used twice."""

    def touch(self, keys: Sequence[Key], is_ready: Callable[[Key], bool]) -> None:
        super().touch(keys, lambda key: True)


class DuelBreaksTiesTowardsTheLastOrder(DuelPolicy):
    """Victims in LRU-2 order while the shadows' scores are equal (at the start, say)."""

    @property
    def leader(self) -> str:
        best = max(self.scores)
        return [s.order for s in self._shadows if s.score == best][-1]


class DuelLru2ReadsTheLastUse(DuelPolicy):
    """LRU-2 orders the reused keys by their last use, as the reuse order does."""

    def _candidates(self, protected: Container[Key]) -> Iterator[Key]:
        order = "reuse" if self.leader == "lru2" else self.leader
        return unprotected(self._uses.ordered(order), protected)


class DuelForgetsTheLastUseOfAGoneKey(DuelPolicy):
    """A key stored again counts as reused, but its second use is taken as time 0 rather
    than its last use before it was evicted."""

    def insert(self, key: Key) -> None:
        super().insert(key)
        self._uses.stamps[key] &= (1 << 41) - 1


class GivesUpOnProtected(MostRecentFirst):
    """Refuses the whole store when its first candidate is protected, though others fit."""

    def choose_victims(self, need: int, protected: Container[Key]) -> list[Key] | None:
        ok = [k for k in reversed(self.order) if k in self.evictable]
        if any(key in protected for key in ok[:need]):
            return None
        return ok[:need] if len(ok) >= need else None


class AbandonFreesAtOnce(OffloadManager):
    """What a timeout that completes the store as failed does (vLLM #46019's first fix):
    the block id is free at once, though the stalled job may still write it.
    """

    def abandon(self, plan: Plan) -> None:
        super().abandon(plan)
        for block_id in self._abandoned.pop(plan.plan_id):
            self._freed.append(block_id)
        self._abandoned[plan.plan_id] = ()


class AbandonedLoadKeepsItsPins(OffloadManager):
    """Abandon marks a load abandoned but leaves its blocks pinned (the leak of #46019)."""

    def abandon(self, plan: Plan) -> None:
        if (
            isinstance(plan, LoadPlan)
            and self._open_plans.get(plan.plan_id) == plan
            and plan.owner == self._owner
            and plan.plan_id not in self._abandoned
        ):
            self._abandoned[plan.plan_id] = ()
            return
        super().abandon(plan)


class LateLoadCompletionUnpinsAgain(OffloadManager):
    """The late completion of an abandoned load releases its pins a second time (the
    ref-count bugs of LMCache #987 and #1756).
    """

    def complete_load(self, plan: LoadPlan) -> None:
        late = isinstance(plan, LoadPlan) and plan.plan_id in self._abandoned
        super().complete_load(plan)
        if late and plan.generation == self._generation:
            for key in plan.keys:
                if key in self._block_id_of:
                    self._unpin_each((key,), (self._block_id_of[key],))


class ResetFreesQuarantine(OffloadManager):
    """A reset frees every block id, also those abandoned store jobs may still write."""

    def reset_cache(self) -> None:
        self._abandoned = dict.fromkeys(self._abandoned, ())
        super().reset_cache()


class ForgetsAFailedStoresEvent(OffloadManager):
    """A failed store's keys leave without the event that says so."""

    def _emit(self, keys: list[Key], reason: RemovalReason | None = None) -> None:
        if reason is not RemovalReason.STORE_FAILED:
            super()._emit(keys, reason)


class CountsATouchAsAnOffer(OffloadManager):
    """A touch records offers (an observation only prepare_store may make); only
    the abstract state shows it: no lookup, count or event differs."""

    def touch(self, keys: object) -> None:
        super().touch(keys)  # type: ignore[arg-type]
        for key in keys:  # type: ignore[attr-defined]
            self._offers[key] = self._offers.get(key, 0) + 1


class RefusedTouchStillTouches(OffloadManager):
    """Touches the keys before the first unhashable one, then refuses."""

    def touch(self, keys: Sequence[Key]) -> None:
        if isinstance(keys, list):
            super().touch(list(itertools.takewhile(lambda key: isinstance(key, Hashable), keys)))
        super().touch(keys)


class OffloaderTouchDeduplicatedKeepingTheLast(Offloader):
    """Hands the manager each key of a touch once, keeping its last occurrence: after
    ``touch([a, b, a])``, ``b`` is more recent than ``a``."""

    def touch(self, keys: Sequence[Key]) -> None:
        with self._lock:
            self.manager.touch(list(dict.fromkeys(reversed(keys)))[::-1])


class OffloaderFreesAnAbandonedFetchAtOnce(Offloader):
    """Ends an abandoned fetch's quarantine at once, completing its plan as failed (what a
    timeout that gives up on the remote does): the fetch's job may still write the block
    id, which another key's store then takes."""

    ended: frozenset[int] = frozenset()  # fetch plan ids completed at abandon

    def abandon(self, plan: Plan) -> None:
        super().abandon(plan)
        if isinstance(plan, StorePlan) and self._is_fetch(plan.plan_id):
            self.manager.complete_store(plan, success=False)
            self.ended |= {plan.plan_id}

    def _complete_fetch(self, plan: StorePlan, accepted: bool) -> None:
        if plan.plan_id not in self.ended:
            super()._complete_fetch(plan, accepted)


class OffloaderStopsWaitingAtAnAbandonedPlan(Offloader):
    """Counts a fetch job as abandoned as soon as any one of its plans is: ``reset`` and
    ``wait`` stop waiting for a job whose other plans are live, and ``reset`` frees their
    block ids while the job can still write them."""

    def _unabandoned_fetches(self) -> list[RemoteJob]:
        tiers = self._tiers
        if tiers is None:
            return []
        return [
            tiers._fetch_of[plans[0].plan_id]
            for plans in tiers._fetch_plans.values()
            if not any(map(self.manager.is_abandoned, plans))
        ]
