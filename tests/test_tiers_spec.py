"""The spec's remote tier: the pool's guarantees over an adversarial shared store, explored
exhaustively at small bounds (``kvoffload_spec.tiers``)."""

from __future__ import annotations

import doctest

import pytest

import kvoffload_spec.tiers
from kvoffload_spec.tiers import (
    ACCIDENTS,
    ADVERSARY,
    FOREIGN,
    FULL,
    NO_SECRET,
    OURS,
    TENANTS,
    Stored,
    Tenancy,
    TierRules,
    Value,
    explore_tiers,
    own,
    plantable,
)
from tests.planted.tiers import (
    FreesAnAbandonedFetchsSlot,
    MacSkipsTheKey,
    MacSkipsTheNamespace,
    NamesIgnoreTheSecret,
    TreatsAMissAsAHit,
    WritesBackLate,
)

KEYS = ("a", "b")


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["lru", "arc", "duel"])
@pytest.mark.parametrize(("blocks", "depth"), [(1, 7), (2, 6)])
def test_every_interleaving_keeps_the_pools_guarantees(
    blocks: int, depth: int, policy: str
) -> None:
    report = explore_tiers(blocks=blocks, keys=("a", "b"), depth=depth, policy=policy)
    assert report.ok and report.complete, report.summary()
    assert report.states > 1_000  # fetches, write-backs and the adversary all interleave


def test_a_small_world_keeps_them_in_a_second() -> None:
    report = explore_tiers(blocks=1, keys=("a", "b"), depth=5)
    assert report.ok and report.complete, report.summary()


@pytest.mark.slow
def test_three_keys_on_two_blocks_keep_them_too() -> None:
    report = explore_tiers(blocks=2, keys=("a", "b", "c"), depth=5)
    assert report.ok and report.complete, report.summary()


def test_only_a_keys_own_whole_value_of_our_namespace_is_accepted() -> None:
    rules, tenant = TierRules(), ACCIDENTS.tenant
    assert rules.accept(tenant, "a", Stored(own("a"), None, "A"))
    for value in (own("b"), Value("a", FULL - 1), Value("a", FULL, FOREIGN)):
        assert not rules.accept(tenant, "a", Stored(value, None, "A")), value
    assert not rules.accept(tenant, "a", None)
    assert not rules.accept(tenant, "a", rules.seal(TENANTS.tenant, "a", own("a")))


@pytest.mark.parametrize(
    "tenancy", [ACCIDENTS, TENANTS, NO_SECRET], ids=["accidents", "tenants", "no secret"]
)
def test_of_all_the_others_can_plant_a_tenant_accepts_what_its_holders_made_for_the_key(
    tenancy: Tenancy,
) -> None:
    """With a secret, exactly the values a holder of it sealed for this key in this namespace;
    without one, also whatever anyone dresses as this key's (the forger's bytes)."""
    rules, tenant = TierRules(), tenancy.tenant
    for key in KEYS:
        values = plantable(tenancy, rules, key, KEYS)
        accepted = [stored for stored in values if rules.accept(tenant, key, stored)]
        genuine = rules.seal(tenant, key, own(key, tenant.namespace))
        if tenancy.forger and tenant.secret is None:
            forged = Stored(Value(key, FULL, tenant.namespace, forged=True), None, ADVERSARY.name)
            assert accepted == [genuine, forged]
        else:
            assert accepted == [genuine]
        assert len(values) >= (10 if tenancy is TENANTS else 5)


def test_sealed_values_fail_their_tag_moved_torn_altered_or_from_elsewhere() -> None:
    rules, tenant = TierRules(), TENANTS.tenant
    genuine = rules.seal(tenant, "a", own("a"))
    moved = rules.seal(tenant, "b", own("b"))
    other_model = rules.seal(TENANTS.others[1], "a", own("a", FOREIGN))
    other_tenant = rules.seal(TENANTS.others[0], "a", own("a"))
    fake = Value("a", FULL, OURS, forged=True)
    for stored in (
        moved,
        other_model,
        other_tenant,
        Stored(genuine.value, None, "A"),  # the plain format
        Stored(Value("a", FULL - 1), genuine.tag, "A"),  # torn
        Stored(fake, genuine.tag, ADVERSARY.name),  # a bit flip in the payload
        rules.seal(ADVERSARY, "a", fake),  # sealed with another secret
    ):
        assert not rules.accept(tenant, "a", stored), stored
    assert rules.accept(tenant, "a", genuine)
    # Each holder of the secret seals under it, but for its own namespace.
    assert other_model.tag is not None and other_model.tag.secret == tenant.secret
    assert TENANTS.holders() == {"A", "A2"} and NO_SECRET.holders() == {"A"}


def test_server_keys_with_a_secret_are_derived_from_it() -> None:
    rules = TierRules()
    a, b, a2 = TENANTS.tenant, *TENANTS.others
    assert rules.server_key(a, "a").secret == a.secret
    assert len({rules.server_key(t, k) for t in (a, b, a2) for k in KEYS}) == 6
    assert rules.server_key(NO_SECRET.tenant, "a").secret is None  # public: anyone computes it


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["lru", "arc", "duel"])
@pytest.mark.parametrize(("blocks", "depth"), [(1, 6), (2, 5)])
def test_tenants_and_the_adversary_cost_hits_never_bytes(
    blocks: int, depth: int, policy: str
) -> None:
    report = explore_tiers(blocks=blocks, keys=KEYS, depth=depth, policy=policy, tenancy=TENANTS)
    assert report.ok and report.complete, report.summary()
    assert report.states > 10_000


def test_a_small_world_with_tenants_keeps_them_in_a_second() -> None:
    report = explore_tiers(blocks=1, keys=KEYS, depth=4, tenancy=TENANTS)
    assert report.ok and report.complete, report.summary()


def test_without_a_secret_the_adversarys_forged_bytes_are_accepted() -> None:
    """The unprotected mode, shown: nothing but a secret tells a made-up value from ours."""
    report = explore_tiers(blocks=1, keys=("a",), depth=5, tenancy=NO_SECRET)
    assert report.violation is not None
    assert report.violation.steps == (
        "fetch('a')",
        "put('a', <a forged> by the adversary, plain)",
        "fetch_reads(job 0)",
        "fetch_finishes(job 0)",
    )
    assert report.violation.message == (
        "A accepts <a forged> by the adversary, plain for 'a': "
        "neither its own nor a holder of its secret's"
    )
    # The same adversary, against the same tenant with a secret, gets nothing accepted.
    assert explore_tiers(blocks=1, keys=("a",), depth=5, tenancy=TENANTS).ok


@pytest.mark.slow
def test_a_mac_without_the_key_loads_another_keys_bytes() -> None:
    report = explore_tiers(blocks=1, keys=KEYS, depth=5, rules=MacSkipsTheKey(), tenancy=TENANTS)
    assert report.violation is not None
    assert report.violation.steps[1] == "put('a', <b> by A, sealed with A's secret for no key)"
    assert report.violation.message == "a load of 'a' reads <b> from its CPU block"


@pytest.mark.slow
def test_a_mac_without_the_namespace_loads_another_models_bytes() -> None:
    rules = MacSkipsTheNamespace()
    report = explore_tiers(blocks=1, keys=KEYS, depth=5, rules=rules, tenancy=TENANTS)
    assert report.violation is not None
    assert report.violation.steps[1] == (
        "put('a', <a foreign> by A2, sealed with A's secret for 'a' of no namespace)"
    )
    assert report.violation.message == "a load of 'a' reads <a foreign> from its CPU block"


def test_names_without_the_secret_tell_the_adversary_what_is_cached() -> None:
    rules = NamesIgnoreTheSecret()
    report = explore_tiers(blocks=1, keys=KEYS, depth=5, rules=rules, tenancy=TENANTS)
    assert report.violation is not None
    assert report.violation.steps == ("store('a')", "store('b')", "write_back(job 0)", "probe('a')")
    assert report.violation.message == (
        "the adversary finds A's write-back of 'a' under a server key it computed without "
        "A's secret: it learns that 'a' is cached"
    )


def test_a_miss_taken_for_a_hit_loads_garbage_in_four_steps() -> None:
    report = explore_tiers(blocks=1, keys=("a",), depth=5, rules=TreatsAMissAsAHit())
    assert report.violation is not None
    assert report.violation.steps == (
        "fetch('a')",
        "fetch_reads(job 0)",
        "fetch_finishes(job 0)",
        "load('a')",
    )
    assert report.violation.message == "a load of 'a' reads None from its CPU block"


def test_a_late_write_back_sends_the_new_keys_bytes() -> None:
    report = explore_tiers(blocks=1, keys=("a", "b"), depth=4, rules=WritesBackLate())
    assert report.violation is not None
    assert report.violation.message == "a write-back puts <b> under 'a'"


@pytest.mark.slow
def test_without_the_quarantine_an_abandoned_fetch_overwrites_another_key() -> None:
    report = explore_tiers(blocks=1, keys=("a", "b"), depth=7, rules=FreesAnAbandonedFetchsSlot())
    assert report.violation is not None
    assert "abandon_fetch(job 0)" in report.violation.steps
    assert (
        report.violation.message
        == "the fetch of 'a' writes block id 0, which another store now holds"
    )


def test_the_module_examples_run() -> None:
    assert doctest.testmod(kvoffload_spec.tiers).failed == 0
