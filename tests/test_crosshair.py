"""CrossHair checks the spec's transitions, assert contracts included, on every small state.

``crosshair check --analysis_kind=asserts`` on each target (a transition under LRU, ARC or
the duel, spec/kvoffload_spec/contracts.py), the targets of one class in one process, two
processes at a time (tests/crosshair_runs.py). Three kinds of run:

- the spec: no counterexample within the time budget;
- canaries: the spec with ``assert False`` after each check's postcondition. CrossHair must
  refute every one at once, which proves it gets past the preconditions: in this mode an
  unsatisfiable precondition, or a constructor that always raises, is reported as a plain
  "Not confirmed" with exit status 0, a silent vacuous pass;
- its share of the catalogue of planted bugs (tests/planted/): CrossHair must find each.

Any "Unable to meet precondition" line fails the gate too. The whole module takes 3-5
minutes on two cores; each target's verdict is shown on the terminal as it comes in.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvoffload_spec.contracts import (
    CHECKS,
    MAX_BLOCKS,
    ArcContracts,
    DuelContracts,
    LruContracts,
)
from kvoffload_spec.state import invariant_violations
from kvoffload_spec.surface import LoadPlan, StorePlan
from tests.crosshair_runs import Run, crosshair_all
from tests.planted import CROSSHAIR, share
from tests.planted.spec import CONTRACTS_SOURCE, Variant
from tests.progress import progress

pytestmark = pytest.mark.slow  # minutes of CrossHair: the full gate, not the inner loop

CLASSES = ("LruContracts", "ArcContracts", "DuelContracts")
SPEC_TIMEOUT = 4.0  # CPU seconds per target (a probe found 5 enough for 10 targets)
# A cap: with plain lengths in the derived states (contracts._size), each canary took about
# 1 CPU-s and the planted bugs 0.9-28 CPU-s (2026-12, a machine loaded ten deep).
FIND_TIMEOUT = 150.0
# CrossHair's share of the catalogue: the spec copies whose contracts it must refute.
SHARE = [bug.subject for bug in share(CROSSHAIR) if isinstance(bug.subject, Variant)]
POSTCONDITION = "        assert not invariant_violations(self)\n\n    def "


def spec_targets(module: str = "kvoffload_spec.contracts") -> list[str]:
    return [f"{module}.{cls}.{check}" for cls in CLASSES for check in CHECKS]


def write_canaries(directory: Path) -> str:
    if CONTRACTS_SOURCE.count(POSTCONDITION) != len(CHECKS):
        raise LookupError("each check must end with: assert not invariant_violations(self)")
    reached = POSTCONDITION.replace("\n\n", '\n        assert False, "reached"\n\n')
    (directory / "canary_contracts.py").write_text(CONTRACTS_SOURCE.replace(POSTCONDITION, reached))
    return "canary_contracts"


@pytest.fixture(scope="module")
def runs(
    tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config
) -> Iterator[dict[str, Run]]:
    """Every CrossHair run of this module, two processes at a time (two cores)."""
    scratch = tmp_path_factory.mktemp("crosshair")
    jobs = [(target, SPEC_TIMEOUT) for target in spec_targets()]
    jobs += [(target, FIND_TIMEOUT) for target in spec_targets(write_canaries(scratch))]
    for variant in SHARE:
        jobs.append((f"{variant.write_contracts(scratch)}.{variant.crosshair}", FIND_TIMEOUT))
    yield crosshair_all(jobs, [scratch], progress(pytestconfig))


@pytest.mark.parametrize("target", spec_targets())
def test_crosshair_finds_no_counterexample_in_the_spec(runs: dict[str, Run], target: str) -> None:
    run = runs[target]
    assert run.returncode == 0 and not run.vacuous(), run.output
    assert not run.unexpected_lines(), run.output
    assert run.output, "CrossHair said nothing about the target"


@pytest.mark.parametrize("target", spec_targets("canary_contracts"))
def test_crosshair_gets_past_every_precondition(runs: dict[str, Run], target: str) -> None:
    run = runs[target]
    assert run.refuted(), f"CrossHair never reached the end of {target}:\n{run.output}"
    assert "reached" in run.output


@pytest.mark.parametrize("variant", SHARE, ids=lambda v: v.name)
def test_crosshair_finds_its_share_of_the_catalogue(runs: dict[str, Run], variant: Variant) -> None:
    run = runs[f"broken_contracts_{variant.name}.{variant.crosshair}"]
    assert run.refuted(), f"CrossHair missed the bug: {variant.bug}\n{run.output}"


def test_a_vacuous_run_fails_the_gate() -> None:
    line = "contracts.py:59: info: Unable to meet precondition."
    vacuous = Run("x", 0, line, 1.0)
    assert vacuous.vacuous() and vacuous.unexpected_lines() == [line] and not vacuous.refuted()
    assert not Run("x", 0, "contracts.py:59: info: Not confirmed.", 1.0).unexpected_lines()


# -- the same checks, on random states, in-process ------------------------------------------

keys = st.integers(-2, MAX_BLOCKS + 3)
slots = st.lists(st.integers(-1, 3), min_size=1, max_size=MAX_BLOCKS)
loads = st.lists(st.lists(st.integers(0, MAX_BLOCKS - 1), max_size=3), max_size=2)
small = st.lists(keys, max_size=4)


Derived = LruContracts | ArcContracts | DuelContracts


@st.composite
def states(draw: st.DrawFn) -> Derived:
    common = (draw(slots), draw(keys), draw(loads), draw(small), draw(small))
    kind = draw(st.sampled_from(("lru", "arc", "duel")))
    if kind == "lru":
        return LruContracts(*common, draw(small), draw(st.integers(1, 3)), draw(small))
    if kind == "duel":
        return DuelContracts(
            *common, draw(small), draw(small), draw(small), draw(st.integers(0, 2))
        )
    capacity = len(common[0])
    p = draw(st.floats(0, capacity))
    return ArcContracts(*common, draw(small), draw(small), draw(small), draw(small), p)


@given(states())
def test_every_derived_state_satisfies_the_invariants(state: Derived) -> None:
    assert invariant_violations(state) == []


@given(states(), st.sampled_from(CHECKS), small, st.integers(0, 5), st.booleans())
def test_every_check_holds_on_random_states(
    state: Derived,
    check: str,
    arguments: list[int],
    which: int,
    success: bool,
) -> None:
    kinds = {plan.__class__ for plan in state.open_plans.values()}
    if check == "check_complete_store" and StorePlan in kinds:
        state.check_complete_store(which, success)
    elif check == "check_complete_load" and LoadPlan in kinds:
        state.check_complete_load(which)
    elif check == "check_abandon" and set(state.open_plans) - set(state.abandoned):
        state.check_abandon(which)
    elif check in ("check_prepare_store", "check_prepare_load", "check_touch"):
        getattr(state, check)(arguments)
    elif check == "check_reset_cache":
        state.check_reset_cache()
