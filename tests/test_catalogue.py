"""Each checker finds its share of the catalogue of planted bugs (tests/planted/).

A check that cannot fail shows up here as a bug it misses. The explorer, the conformance
kit and its directed histories run here; CrossHair's share runs in tests/test_crosshair.py
(its processes are pooled there), the soak's in tests/test_soak_smoke.py and the fault
scenario's in tests/test_faults.py, each parametrized by the catalogue.
"""

from __future__ import annotations

import pytest
from hypothesis import Phase, settings

from kvoffload.checking.conformance import (
    ConformanceError,
    check_conformance,
    check_directed_histories,
)
from kvoffload_spec.explore import explore
from kvoffload_spec.tiers import explore_tiers
from tests.planted import (
    CATALOGUE,
    CHECKERS,
    CONFORMANCE,
    DIRECTED,
    EXPLORER,
    TIERS,
    ManagerBug,
    Planted,
    share,
)
from tests.planted.spec import Variant
from tests.planted.tiers import TierBug

SHORT = 6  # calls: every planted spec bug shows within this many
# Stop at the first failure (shrinking it would only cost time here). The budget is a cap:
# the hardest two (ARC fallback, stale load) were found within 1,000 examples in 5 runs of
# 6, so 10,000 leave a miss at odds of about 1e-8; the rest take a few hundred at most.
FIND_ONLY = settings(settings(), phases=(Phase.generate,), database=None, max_examples=10_000)


def cases(checker: str, *, slow: bool) -> list[object]:
    marks = [pytest.mark.slow] if slow else []
    return [pytest.param(bug, id=bug.name, marks=marks) for bug in share(checker)]


def test_the_catalogue_is_well_formed() -> None:
    names = [bug.name for bug in CATALOGUE]
    assert len(names) == len(set(names))
    assert all(bug.found_by and bug.found_by <= set(CHECKERS) for bug in CATALOGUE)
    assert all(share(checker) for checker in CHECKERS), "a checker with nothing to find"
    assert all(bug.bug for bug in CATALOGUE)


def spec_bug(bug: Planted) -> Variant:
    assert isinstance(bug.subject, Variant)
    return bug.subject


def manager_bug(bug: Planted) -> ManagerBug:
    assert isinstance(bug.subject, ManagerBug)
    return bug.subject


@pytest.mark.parametrize("policy", ["lru", "arc", "duel"])
@pytest.mark.parametrize("bug", cases(EXPLORER, slow=True))
def test_the_explorer_finds_its_share_with_a_shortest_counterexample(
    bug: Planted, policy: str
) -> None:
    variant = spec_bug(bug)

    report = explore(lambda: variant.model(1, policy), keys=("a", "b"), depth=SHORT)
    assert report.violation is not None, f"{bug.bug}: not found"
    assert len(report.violation.steps) <= SHORT
    # Breadth first: every state fewer calls away passes every check.
    assert explore(lambda: variant.model(1, policy), keys=("a", "b"), depth=report.depth).ok


@pytest.mark.parametrize("bug", cases(CONFORMANCE, slow=True))
def test_the_conformance_kit_finds_its_share(bug: Planted) -> None:
    broken = manager_bug(bug)
    with pytest.raises(AssertionError):
        check_conformance(broken.make, policy=broken.policy, settings=FIND_ONLY)


@pytest.mark.parametrize("bug", cases(DIRECTED, slow=False))
def test_the_directed_histories_find_their_share(bug: Planted) -> None:
    broken = manager_bug(bug)
    with pytest.raises(ConformanceError, match="the directed history of"):
        check_directed_histories(broken.make, policy=broken.policy)


@pytest.mark.parametrize("bug", cases(TIERS, slow=True))
def test_the_tier_explorer_finds_its_share(bug: Planted) -> None:
    """Each bug shows within 7 steps, on a pool of one block or else on one of two, in the
    world it is planted in (accidents only, or tenants and the adversary)."""
    planted = bug.subject
    assert isinstance(planted, TierBug)
    # Lazily: the pool of two blocks is explored only where one block did not show the bug.
    found = (
        explore_tiers(
            blocks=blocks,
            keys=("a", "b"),
            depth=7,
            rules=planted.rules,
            tenancy=planted.tenancy,
        )
        for blocks in (1, 2)
    )
    assert any(report.violation is not None for report in found), f"{bug.bug}: not found"
