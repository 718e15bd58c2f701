"""The spec's disk tier: the pool's guarantees over a persistent, bounded disk that a crash
may tear, explored exhaustively through crashes and restarts (``kvoffload_spec.disk``), and
the planted bugs of tests/planted/disk.py each found with a shortest counterexample."""

from __future__ import annotations

import doctest

import pytest

import kvoffload_spec.disk
from kvoffload_spec.disk import DiskRules, explore_disk, whole
from kvoffload_spec.tiers import FOREIGN, FULL, OURS, Value
from tests.planted import DISK, Planted, share
from tests.planted.disk import AcceptsATornWrite, KeepsBlocksAcrossANamespaceChange


def test_the_disk_rules_are_named_in_kvoffload_spec_tiers_too() -> None:
    import kvoffload_spec.tiers as tiers

    assert tiers.DiskRules is DiskRules and tiers.explore_disk is explore_disk
    with pytest.raises(AttributeError):
        _ = tiers.NoSuchRule


def test_a_small_world_keeps_the_guarantees_in_a_second() -> None:
    report = explore_disk(blocks=1, keys=("a", "b"), capacity=1, depth=8)
    assert report.ok and report.complete, report.summary()
    assert report.states > 1_000  # writes, crashes and restarts all interleave


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize(
    ("blocks", "keys", "capacity", "depth"),
    [(1, "ab", 1, 10), (2, "ab", 2, 9), (2, "abc", 2, 7)],
)
def test_every_interleaving_with_crashes_keeps_the_guarantees(
    blocks: int, keys: str, capacity: int, depth: int, policy: str
) -> None:
    report = explore_disk(
        blocks=blocks, keys=tuple(keys), capacity=capacity, depth=depth, policy=policy
    )
    assert report.ok and report.complete, report.summary()


def test_only_a_keys_whole_bytes_of_the_engines_namespace_are_accepted() -> None:
    rules = DiskRules()
    assert rules.accept("a", whole("a", OURS), OURS)
    assert rules.accept("a", whole("a", FOREIGN), FOREIGN)
    for value in (None, whole("b", OURS), Value("a", FULL - 1), whole("a", FOREIGN)):
        assert not rules.accept("a", value, OURS), value


@pytest.mark.parametrize("bug", [pytest.param(bug, id=bug.name) for bug in share(DISK)])
def test_the_disk_explorer_finds_its_share(bug: Planted) -> None:
    assert isinstance(bug.subject, DiskRules)
    report = explore_disk(blocks=1, keys=("a", "b"), capacity=1, depth=9, rules=bug.subject)
    assert report.violation is not None, f"{bug.bug}: not found"
    # Breadth first: one step fewer passes every check.
    shorter = len(report.violation.steps) - 1
    assert explore_disk(blocks=1, keys=("a", "b"), capacity=1, depth=shorter, rules=bug.subject).ok


def test_a_torn_write_accepted_loads_torn_bytes_after_the_crash() -> None:
    report = explore_disk(blocks=1, keys=("a", "b"), capacity=1, depth=9, rules=AcceptsATornWrite())
    assert report.violation is not None
    assert "crash_and_restart(namespace 0, records first)" in report.violation.steps
    assert report.violation.message == "a load of 'a' reads <a 1/2> from its CPU block"


def test_blocks_kept_across_a_namespace_change_are_caught_at_the_restart() -> None:
    report = explore_disk(
        blocks=1, keys=("a", "b"), capacity=1, depth=5, rules=KeepsBlocksAcrossANamespaceChange()
    )
    assert report.violation is not None
    assert report.violation.steps[-1].startswith("crash_and_restart(namespace 1")


def test_the_module_examples_run() -> None:
    assert doctest.testmod(kvoffload_spec.disk).failed == 0
