"""Planted bugs in the pool's remote-tier rules (``kvoffload_spec.tiers.TierRules``): each is
what a plausible slip in a fetch or a write-back would do. The exhaustive exploration of
the tiered world (``explore_tiers``) must find each."""

from __future__ import annotations

from kvoffload_spec.surface import Key
from kvoffload_spec.tiers import FULL, OURS, TierRules, Value


class AcceptsAnotherKeysValue(TierRules):
    """A fetch checks the value's length and namespace but not whose key it is."""

    def accept(self, key: Key, value: Value | None) -> bool:
        return value is not None and value.length == FULL and value.namespace == OURS


class AcceptsAPartialValue(TierRules):
    """A fetch accepts a value cut short (its header's length not checked)."""

    def accept(self, key: Key, value: Value | None) -> bool:
        return value is not None and value.owner == key and value.namespace == OURS


class AcceptsAForeignValue(TierRules):
    """A fetch accepts another model's or layout's value stored under the same key."""

    def accept(self, key: Key, value: Value | None) -> bool:
        return value is not None and value.owner == key and value.length == FULL


class TreatsAMissAsAHit(TierRules):
    """A remote miss completes the fetch as a success: the CPU block holds garbage."""

    def accept(self, key: Key, value: Value | None) -> bool:
        return value is None or super().accept(key, value)


class FreesAnAbandonedFetchsSlot(TierRules):
    """An abandoned fetch's slot is free at once, while its job may still write it."""

    def quarantines_abandoned_fetches(self) -> bool:
        return False


class WritesBackLate(TierRules):
    """A write-back reads the victim's slot when it runs, after a new store took it."""

    def write_back_reads_at_eviction(self) -> bool:
        return False
