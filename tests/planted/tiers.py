"""Planted bugs in the pool's remote-tier rules (``kvoffload_spec.tiers.TierRules``): each is
what a plausible slip in a fetch, a write-back, the MAC or the server key names would do. The
exhaustive exploration of the tiered world (``explore_tiers``) must find each, in the world
it is planted in (:class:`TierBug`: the plain format's slips with accidents only, the
sealed format's with tenants and the adversary)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvoffload_spec.surface import Key
from kvoffload_spec.tiers import (
    ACCIDENTS,
    FULL,
    TENANTS,
    ServerKey,
    Stored,
    Tag,
    Tenancy,
    Tenant,
    TierRules,
    Value,
)


@dataclass(frozen=True)
class TierBug:
    """Broken rules and the world whose exploration must find them."""

    rules: TierRules
    tenancy: Tenancy


class AcceptsAnotherKeysValue(TierRules):
    """A fetch checks the value's length and namespace but not whose key it is."""

    def accept(self, tenant: Tenant, key: Key, stored: Stored | None) -> bool:
        value = None if stored is None else stored.value
        return value is not None and value.length == FULL and value.namespace == tenant.namespace


class AcceptsAPartialValue(TierRules):
    """A fetch accepts a value cut short (its header's length not checked)."""

    def accept(self, tenant: Tenant, key: Key, stored: Stored | None) -> bool:
        value = None if stored is None else stored.value
        return value is not None and value.owner == key and value.namespace == tenant.namespace


class AcceptsAForeignValue(TierRules):
    """A fetch accepts another model's or layout's value stored under the same key."""

    def accept(self, tenant: Tenant, key: Key, stored: Stored | None) -> bool:
        value = None if stored is None else stored.value
        return value is not None and value.owner == key and value.length == FULL


class TreatsAMissAsAHit(TierRules):
    """A remote miss completes the fetch as a success: the CPU block holds garbage."""

    def accept(self, tenant: Tenant, key: Key, stored: Stored | None) -> bool:
        return stored is None or super().accept(tenant, key, stored)


class FreesAnAbandonedFetchsSlot(TierRules):
    """An abandoned fetch's slot is free at once, while its job may still write it."""

    def quarantines_abandoned_fetches(self) -> bool:
        return False


class WritesBackLate(TierRules):
    """A write-back reads the victim's slot when it runs, after a new store took it."""

    def write_back_reads_at_eviction(self) -> bool:
        return False


class MacSkipsTheKey(TierRules):
    """The MAC covers the namespace and the bytes but not the block key: a sealed value moved
    from another key of the same tenant verifies."""

    def tag(self, secret: str, namespace: int, key: Key, value: Value) -> Tag:
        return Tag(secret, namespace, None, value)


class MacSkipsTheNamespace(TierRules):
    """The MAC covers the block key and the bytes but not the namespace (the header's tenant
    id): a value of another namespace sealed with the same secret verifies."""

    def tag(self, secret: str, namespace: int, key: Key, value: Value) -> Tag:
        return Tag(secret, None, key, value)


class NamesIgnoreTheSecret(TierRules):
    """Server keys are derived from the namespace and the block key alone, as without a
    secret: anyone can compute a tenant's name for a key and see whether it is cached (and
    another tenant of the same model writes under the same names)."""

    def server_key(self, tenant: Tenant, key: Key) -> ServerKey:
        return super().server_key(replace(tenant, secret=None), key)


PLANTED_TIER_BUGS = tuple(
    TierBug(rules(), tenancy)
    for rules, tenancy in (
        (AcceptsAnotherKeysValue, ACCIDENTS),
        (AcceptsAPartialValue, ACCIDENTS),
        (AcceptsAForeignValue, ACCIDENTS),
        (TreatsAMissAsAHit, ACCIDENTS),
        (FreesAnAbandonedFetchsSlot, ACCIDENTS),
        (WritesBackLate, ACCIDENTS),
        (MacSkipsTheKey, TENANTS),
        (MacSkipsTheNamespace, TENANTS),
        (NamesIgnoreTheSecret, TENANTS),
    )
)
