"""The explorer's planted bugs beyond its share of the catalogue (tests/test_catalogue.py
checks it finds each with a shortest counterexample): they show in a wider world too, the
outside checks find them without the system's own invariants, and each family of its
checks catches at least one bug on its own: none of them is a check that cannot fail.

The spec copies (tests/planted/spec.py) have their ``assert`` contracts stripped, so what
catches a bug here is the explorer, as it would be in a manager without such asserts.
"""

from __future__ import annotations

import pytest

from kvoffload_spec.explore import CHECKS, Report, explore
from tests.planted.spec import VARIANTS, Variant

pytestmark = pytest.mark.slow  # each planted bug is a whole exploration

BY_NAME = {variant.name: variant for variant in VARIANTS}
SHORT = 6  # calls: every planted bug shows within this many


def run(
    variant: Variant, policy: str, *, blocks: int, keys: str, depth: int = SHORT, **options: object
) -> Report:
    return explore(
        lambda: variant.model(blocks, policy),
        keys=tuple(keys),
        depth=depth,
        **options,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize(
    "variant",
    [v for v in VARIANTS if v.name != "stale_load_completion_applied"],  # 6 calls: 10 s here
    ids=lambda v: v.name,
)
def test_the_bugs_show_in_a_wider_world_too(variant: Variant, policy: str) -> None:
    report = run(variant, policy, blocks=2, keys="abc")
    assert report.violation is not None and len(report.violation.steps) <= SHORT


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_the_outside_checks_find_every_bug_without_the_systems_own_invariants(
    variant: Variant,
) -> None:
    """What ``kvoffload verify`` relies on: a policy or manager need not check itself."""
    report = run(variant, "arc", blocks=1, keys="ab", checks=CHECKS - {"invariants"})
    assert report.violation is not None
    assert not report.violation.message.startswith("invariant broken")


@pytest.mark.parametrize(
    ("family", "variant", "expected"),
    [
        ("invariants", "counter_not_restored", "evictable counter is 0 but 1 blocks"),
        ("model", "guard_off_by_one", "prepare_store refused 1 absent keys"),
        ("model", "protected_evictable", "evicted ('a',): ['a'] not evictable"),
        ("model", "failed_store_leaks_slot", "blocks are (0, 0, 0), the plans say (1"),
        ("events", "stale_store_completion_applied", "[BlocksStored(keys=('a',))]"),
        ("unchanged", "stale_store_completion_applied", "a stale completion changed"),
        ("unchanged", "completion_keeps_plan_open", "second completion of the same"),
        ("data", "stale_store_completion_applied", "a load of 'a' starts reading"),
        ("data", "abandon_frees_slots", "store of 'a' takes block id 0: an abandoned job"),
    ],
)
def test_each_family_of_checks_catches_a_bug_alone(
    family: str, variant: str, expected: str
) -> None:
    report = run(BY_NAME[variant], "lru", blocks=1, keys="ab", checks={family})
    assert report.violation is not None, f"{family} alone missed {variant}"
    assert expected in report.violation.message


def test_the_stale_completion_bug_reads_as_data_corruption() -> None:
    """The ABA hazard: a key stored again after a reset is marked ready by the old job."""
    report = run(BY_NAME["stale_store_completion_applied"], "arc", blocks=1, keys="a")
    assert report.violation is not None
    assert report.violation.steps == (
        "prepare_store(['a'])",
        "reset_cache()",
        "prepare_store(['a'])",
        "complete_store(plan 1 (stale), success=True)",
    )
    assert report.violation.message == "a stale completion changed the state"
    data_only = run(
        BY_NAME["stale_store_completion_applied"], "arc", blocks=1, keys="a", checks={"data"}
    )
    assert data_only.violation is not None
    assert data_only.violation.steps[-1] == "prepare_load(['a'])"
    assert data_only.violation.message == "data: a load of 'a' starts reading block id 0: garbage"
