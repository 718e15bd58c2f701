"""The spec's remote tier: the pool's guarantees over an adversarial shared store, explored
exhaustively at small bounds (``kvoffload_spec.tiers``)."""

from __future__ import annotations

import doctest

import pytest

import kvoffload_spec.tiers
from kvoffload_spec.tiers import (
    FOREIGN,
    FULL,
    TierRules,
    Value,
    explore_tiers,
    own,
)
from tests.planted.tiers import FreesAnAbandonedFetchsSlot, TreatsAMissAsAHit, WritesBackLate


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
    rules = TierRules()
    assert rules.accept("a", own("a"))
    for value in (None, own("b"), Value("a", FULL - 1), Value("a", FULL, FOREIGN)):
        assert not rules.accept("a", value), value


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
        == "the fetch of 'a' writes block id 0, which another key now holds"
    )


def test_the_module_examples_run() -> None:
    assert doctest.testmod(kvoffload_spec.tiers).failed == 0
