"""CrossHair checks the contracts of ``kvoffload.checking.contracts`` on the production manager.

``crosshair check --analysis_kind=asserts`` on each target (a ``check_*`` method of
``LruChecks``, ``ArcChecks`` or ``DuelChecks``: one operation, checked as the commuting
square of the refinement mapping), with the runner of tests/test_crosshair.py.
Three kinds of run, as there:

- the manager: no counterexample within the time budget;
- canaries: the contracts with ``assert False, "reached"`` after each check's last
  postcondition. CrossHair must refute every one, which proves it gets past the
  preconditions (a vacuous pass reads as a plain "Not confirmed");
- planted bugs (below): CrossHair must find each, with the contracts unchanged (a bug
  in the manager, never a hand-written postcondition: the spec's transition is the
  contract).

Then the same checks run in-process on random histories, which is fast and catches a
contract that a correct manager fails before CrossHair has to.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvoffload.checking import contracts
from kvoffload.checking.contracts import (
    CHECKS,
    ArcChecks,
    CheckedManager,
    DuelChecks,
    Fate,
    LruChecks,
)
from kvoffload_spec.operations import COMPLETE_LOAD
from kvoffload_spec.surface import Lookup
from tests.crosshair_runs import Run, crosshair_all
from tests.planted import MANAGER_CROSSHAIR, CrossHairTarget, share
from tests.planted.crosshair_manager import (
    AbandonFreesSlotsAtOnce,
    CounterNotRestoredOnLoad,
    EvictsBeforeGivingUp,
    EvictsTheNewest,
    StaleStoreCompletionApplied,
)
from tests.progress import progress

pytestmark = pytest.mark.slow  # minutes of CrossHair: the full gate, not the inner loop

SECONDS_PER_TARGET = 3.0  # CPU seconds of search per check
SECONDS_TO_FIND = 40.0  # a canary or a planted bug is found within a few
LAST_POSTCONDITION = "    assert manager.invariants_hold()\n\n\n"
CLASSES = (LruChecks, ArcChecks, DuelChecks)


def targets(module: str = "kvoffload.checking.contracts") -> list[str]:
    return [f"{module}.{cls.__name__}.{check}" for cls in CLASSES for check in CHECKS]


def write_canaries(directory: Path) -> str:
    source = Path(contracts.__file__).read_text(encoding="utf-8")
    if source.count(LAST_POSTCONDITION) != len(CHECKS):
        raise LookupError("each check must end with: assert manager.invariants_hold()")
    reached = LAST_POSTCONDITION.replace("\n\n\n", '\n    assert False, "reached"\n\n\n')
    (directory / "canary_manager_contracts.py").write_text(
        source.replace(LAST_POSTCONDITION, reached), encoding="utf-8"
    )
    return "canary_manager_contracts"


# The planted bugs CrossHair must refute: its share of the catalogue (tests/planted/).
PLANTED = {
    bug.subject.target: bug.subject.broken
    for bug in share(MANAGER_CROSSHAIR)
    if isinstance(bug.subject, CrossHairTarget)
}


# -- CrossHair -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(
    tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config
) -> Iterator[dict[str, Run]]:
    """Every CrossHair run of this module, two processes at a time (two cores)."""
    scratch = tmp_path_factory.mktemp("crosshair_manager")
    jobs = [(target, SECONDS_PER_TARGET) for target in targets()]
    jobs += [(target, SECONDS_TO_FIND) for target in targets(write_canaries(scratch))]
    jobs += [(target, SECONDS_TO_FIND) for target in PLANTED]
    yield crosshair_all(jobs, [scratch], progress(pytestconfig))


@pytest.mark.parametrize("target", targets())
def test_crosshair_finds_no_counterexample_in_the_manager(
    runs: dict[str, Run], target: str
) -> None:
    run = runs[target]
    assert run.returncode == 0 and not run.vacuous(), run.output
    assert not run.unexpected_lines(), run.output
    assert run.output, "CrossHair said nothing about the target"


@pytest.mark.parametrize("target", targets("canary_manager_contracts"))
def test_crosshair_gets_past_every_precondition(runs: dict[str, Run], target: str) -> None:
    run = runs[target]
    assert run.refuted(), f"CrossHair never reached the end of {target}:\n{run.output}"
    assert "reached" in run.output


@pytest.mark.parametrize("target", list(PLANTED), ids=[cls.__name__ for cls in PLANTED.values()])
def test_crosshair_catches_planted_bugs(runs: dict[str, Run], target: str) -> None:
    run = runs[target]
    assert run.refuted(), f"CrossHair missed the bug: {PLANTED[target].__doc__}\n{run.output}"
    assert "reached" not in run.output
    assert "AssertionError" in run.output or "Divergence" in run.output


# -- the same checks, on random histories, in-process ----------------------------------------

fates = st.tuples(*[st.sampled_from(Fate)] * 4)
keys = st.lists(st.integers(0, 5), max_size=4)


@given(st.sampled_from(CLASSES), st.integers(0, 2), fates)
def test_every_history_satisfies_the_invariants(
    cls: type[CheckedManager], num_blocks: int, fate: tuple[int, int, int, int]
) -> None:
    assert cls(num_blocks, fate).invariants_hold()


@given(
    st.sampled_from(CLASSES),
    st.integers(0, 2),
    fates,
    st.sampled_from(CHECKS),
    keys,
    st.integers(0, 5),
    st.booleans(),
)
def test_every_check_holds_on_random_histories(
    cls: type[LruChecks | ArcChecks | DuelChecks],
    num_blocks: int,
    fate: tuple[int, int, int, int],
    check: str,
    arguments: list[int],
    which: int,
    success: bool,
) -> None:
    manager = cls(num_blocks, fate)
    if check == "check_complete_store" and manager.store_plans:
        manager.check_complete_store(which, success)
    elif check == "check_complete_load" and manager.load_plans:
        manager.check_complete_load(which)
    elif check == "check_abandon" and (manager.store_plans or manager.load_plans):
        manager.check_abandon(which)
    elif check in ("check_prepare_store", "check_prepare_load", "check_touch"):
        getattr(manager, check)(arguments)
    elif check == "check_reset_cache":
        manager.check_reset_cache()


def test_the_planted_bugs_break_the_contracts() -> None:
    """Concrete witnesses: a change to the contracts that blinds them fails here at once,
    not only after CrossHair's search.
    """
    absent = (Fate.ABSENT,) * 3
    with pytest.raises(AssertionError):
        CounterNotRestoredOnLoad(1, (Fate.PINNED, *absent)).check_complete_load(0)
    with pytest.raises(AssertionError):
        EvictsBeforeGivingUp(0, (Fate.READY, *absent)).check_prepare_store([1, 2])
    with pytest.raises(AssertionError):
        StaleStoreCompletionApplied(0, (Fate.STORED_AGAIN, *absent)).check_complete_store(0, True)
    with pytest.raises(AssertionError):
        AbandonFreesSlotsAtOnce(0, (Fate.PENDING, *absent)).check_abandon(0)
    with pytest.raises(AssertionError):
        EvictsTheNewest(1, (Fate.READY, Fate.READY, Fate.ABSENT, Fate.ABSENT)).check_prepare_store(
            [2]
        )


def test_the_mirror_carries_on_from_a_copy_of_the_managers_abstraction() -> None:
    """The spec's side starts equal to the manager's abstraction but is not shared with
    it (else the square would compare a state with itself), and holds the manager's open
    plans, each valid on both sides, and its completed ones.
    """
    manager = LruChecks(2, (Fate.PINNED, Fate.PENDING, Fate.STALE_LOAD, Fate.ABSENT))
    step = manager.mirror()
    opened = sorted(manager.abstract_state().open_plans.values(), key=lambda p: p.plan_id)
    assert [mine for mine, _ in step.held] == opened and all(a is b for a, b in step.held)
    issued = [*manager.store_plans, *manager.load_plans]
    assert [mine for mine, _ in step.closed] == [p for p in issued if p not in opened]
    assert step.model.state is not manager.abstract_state()
    step.model.reset_cache()
    assert manager.lookup(0) is Lookup.HIT
    again = manager.mirror()  # and the square commutes for the pinned key's load plan
    pinned = manager.load_plans[-1]
    assert pinned in opened and pinned.keys == (0,)
    contracts.commutes(manager, again, contracts.on_plan(again, COMPLETE_LOAD, pinned))
    assert manager.lookup(0) is Lookup.HIT and not manager.abstract_state().blocks[0].refs
