"""Planted bugs in the manager that its CrossHair contracts must refute
(``kvoffload.checking.contracts``). Each binds only the check that must catch it, to a
``CheckedManager`` (not to ``LruChecks``: a check inherited and bound again would be
analysed twice); where the kit's catalogue has the same bug, the class is that bug's with
the check bound. CrossHair runs ``tests.planted.crosshair_manager.<Class>.<check>``."""

from __future__ import annotations

import heapq
from collections.abc import Container

from kvoffload.checking import contracts
from kvoffload.checking.contracts import CheckedManager
from kvoffload_spec.surface import Key, Plan
from tests.planted import manager as broken


class CounterNotRestoredOnLoad(broken.CounterNotRestoredOnLoad, CheckedManager):
    """complete_load makes the block evictable but forgets the counter (LMCache #987)."""

    POLICY = "lru"
    check_complete_load = contracts.check_complete_load


class EvictsBeforeGivingUp(CheckedManager):
    """Evicts what it can before finding out it cannot make room: a failed prepare_store
    that changed the cache.
    """

    POLICY = "arc"
    check_prepare_store = contracts.check_prepare_store

    def _make_room(self, count: int, protected: Container[Key]) -> list[Key] | None:
        need = count - self.num_free_blocks
        if 0 < self.num_evictable_blocks < need:
            victims = self._policy.choose_victims(self.num_evictable_blocks, protected)
            self._evict(victims or [])
            return None
        return super()._make_room(count, protected)


class StaleStoreCompletionApplied(broken.StaleStoreCompletionApplied, CheckedManager):
    """The ABA hazard (vLLM #48090): a store plan made before reset_cache marks ready a key
    stored again since, whose new store job has not written it yet.
    """

    POLICY = "lru"
    check_complete_store = contracts.check_complete_store


class AbandonFreesSlotsAtOnce(CheckedManager):
    """Abandoning a store hands its slots out again at once, though the stalled job may
    still write them: a later store there would be overwritten by the late job.
    """

    POLICY = "arc"
    check_abandon = contracts.check_abandon

    def abandon(self, plan: Plan) -> None:
        super().abandon(plan)
        for slot in self._abandoned[plan.plan_id]:
            heapq.heappush(self._freed, slot)
        self._abandoned[plan.plan_id] = ()


class EvictsTheNewest(CheckedManager):
    """Under LRU, evicts the most recently used evictable blocks, not the least: legal
    victims, the wrong ones (which victims, the hand-written postconditions never said).
    """

    POLICY = "lru"
    check_prepare_store = contracts.check_prepare_store

    def _make_room(self, count: int, protected: Container[Key]) -> list[Key] | None:
        victims = super()._make_room(count, protected)
        if not victims:
            return victims
        newest = [
            key
            for key in reversed(self._policy.resident())
            if self._is_evictable(key) and key not in protected
        ]
        return newest[: len(victims)]
