"""CrossHair checks the contracts of ``kvoffload.contracts`` on the production manager.

Each ``check_*`` method of ``LruChecks`` and ``ArcChecks`` is one target, analysed for a
few seconds (DESIGN.md section 6); every run of the module starts at once, one process
per policy and one per planted bug.
CrossHair passes vacuously when no state meets a precondition, so every target must also
report that it was explored ("Not confirmed" or "Confirmed", never "Unable to meet
precondition"). The planted bugs below show the analysis can fail: CrossHair must find
each of them, with the contracts unchanged.
"""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from collections.abc import Container, Iterator, Sequence
from pathlib import Path

import pytest

from kvoffload import contracts
from kvoffload.contracts import CHECKS, ArcChecks, CheckedManager, LruChecks
from kvoffload.policies.arc import ArcPolicy
from kvoffload.policies.lru import LruPolicy
from kvoffload_spec.surface import Key, StorePlan
from kvoffload_spec.validation import check_flag

ROOT = Path(__file__).resolve().parent.parent
SECONDS_PER_TARGET = 4  # CPU seconds of search per check
SECONDS_TO_FIND_A_BUG = 60  # each planted bug is found in a few
EXPLORED = re.compile(r":(\d+): info: (Not confirmed|Confirmed over all paths)\.")


def crosshair(targets: Sequence[str], seconds: float) -> subprocess.Popen[str]:
    """Start ``crosshair check`` on ``targets`` (assert contracts, every outcome reported)."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "crosshair",
            "check",
            "--analysis_kind=asserts",
            f"--per_condition_timeout={seconds}",
            "--report_all",
            *targets,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(process: subprocess.Popen[str], timeout: float = 300) -> tuple[int, str]:
    output, _ = process.communicate(timeout=timeout)
    return process.returncode, output


def target(cls: type[CheckedManager], check: str) -> str:
    return f"{cls.__module__}.{cls.__qualname__}.{check}"


def test_every_check_is_a_method_of_both_classes() -> None:
    for cls in (LruChecks, ArcChecks):
        assert [name for name in CHECKS if name in vars(cls)] == list(CHECKS)


def test_the_contracts_hold_on_the_manager(runs: dict[str, subprocess.Popen[str]]) -> None:
    for cls in (LruChecks, ArcChecks):
        returncode, output = finish(runs[cls.__name__])
        assert returncode == 0, output
        assert "Unable to meet precondition" not in output, output
        assert "error" not in output.lower(), output
        explored = {int(line) for line, _ in EXPLORED.findall(output)}
        def_lines = {inspect.getsourcelines(getattr(cls, check))[1] for check in CHECKS}
        assert explored == def_lines, f"not every target of {cls.__name__} was explored:\n{output}"


# -- planted bugs ----------------------------------------------------------------------------


# Each binds only the check that must catch it, to a CheckedManager (not to LruChecks: a
# check inherited and bound again would be analysed twice).


class CounterNotRestoredOnLoad(CheckedManager):
    """complete_load makes the block evictable but forgets the counter (LMCache #987)."""

    POLICY = LruPolicy
    check_complete_load = contracts.check_complete_load

    def _unpin(self, key: Key) -> None:
        slot = self._slot_of[key]
        self._refs[slot] -= 1
        if not self._refs[slot]:
            self._policy.mark_evictable(key)


class EvictsBeforeGivingUp(CheckedManager):
    """Evicts what it can before finding out it cannot make room: a failed prepare_store
    that changed the cache.
    """

    POLICY = ArcPolicy
    check_prepare_store = contracts.check_prepare_store

    def _make_room(self, count: int, protected: Container[Key]) -> list[Key] | None:
        need = count - self.num_free_blocks
        if 0 < self.num_evictable_blocks < need:
            victims = self._policy.choose_victims(self.num_evictable_blocks, protected)
            self._evict(victims or [])
            return None
        return super()._make_room(count, protected)


class StaleStoreCompletionApplied(CheckedManager):
    """The ABA hazard (vLLM #48090): a store plan made before reset_cache marks ready a key
    stored again since, whose new store job has not written it yet.
    """

    POLICY = LruPolicy
    check_complete_store = contracts.check_complete_store

    def complete_store(self, plan: StorePlan, success: bool = True) -> None:
        check_flag("success", success)
        plan = self._close(plan, StorePlan)
        done = [key for key in plan.keys if key in self._storing]  # by key, not by plan
        for key in done:
            del self._storing[key]
        if success:
            self._mark_stored(done)
        else:
            self._drop_failed(done)


PLANTED = [
    (CounterNotRestoredOnLoad, "check_complete_load"),
    (EvictsBeforeGivingUp, "check_prepare_store"),
    (StaleStoreCompletionApplied, "check_complete_store"),
]


@pytest.fixture(scope="module")
def runs() -> Iterator[dict[str, subprocess.Popen[str]]]:
    """Every CrossHair run of this module, started at once: each stops on its own CPU-time
    budget, so the runs share the cores without exploring less.
    """
    started = {
        cls.__name__: crosshair([target(cls, check) for check in CHECKS], SECONDS_PER_TARGET)
        for cls in (LruChecks, ArcChecks)
    }
    started.update(
        (planted.__name__, crosshair([target(planted, check)], SECONDS_TO_FIND_A_BUG))
        for planted, check in PLANTED
    )
    yield started
    for process in started.values():
        if process.poll() is None:
            process.kill()
            process.communicate()


@pytest.mark.parametrize(("planted", "check"), PLANTED, ids=[cls.__name__ for cls, _ in PLANTED])
def test_crosshair_finds_a_planted_bug(
    planted: type[CheckedManager], check: str, runs: dict[str, subprocess.Popen[str]]
) -> None:
    returncode, output = finish(runs[planted.__name__])
    assert returncode != 0, output
    assert re.search(rf"error: AssertionError: .* when calling {check}\(", output), output


def test_the_planted_bugs_are_bugs_and_the_contracts_see_them() -> None:
    """Concrete witnesses, so that a change to the contracts that blinds them fails here
    quickly, not only after CrossHair's search.
    """
    fates = contracts.Fate
    leak = CounterNotRestoredOnLoad(1, (fates.PINNED, fates.ABSENT, fates.ABSENT, fates.ABSENT))
    with pytest.raises(AssertionError):
        leak.check_complete_load(0)
    greedy = EvictsBeforeGivingUp(0, (fates.READY, fates.ABSENT, fates.ABSENT, fates.ABSENT))
    with pytest.raises(AssertionError):
        greedy.check_prepare_store([1, 2])
    aba = StaleStoreCompletionApplied(
        0, (fates.STORED_AGAIN, fates.ABSENT, fates.ABSENT, fates.ABSENT)
    )
    with pytest.raises(AssertionError):
        aba.check_complete_store(0, True)
