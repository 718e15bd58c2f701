"""How one CrossHair process's output is told apart into a verdict per target."""

from __future__ import annotations

import inspect

import pytest

from kvoffload.checking import contracts
from kvoffload_spec import contracts as spec_contracts
from tests.crosshair_runs import split_runs

MANAGER = "kvoffload.checking.contracts.LruChecks"
SPEC = "kvoffload_spec.contracts.ArcContracts"


def def_line(function: object) -> str:
    """Where CrossHair puts its info line about ``function``: ``path:line`` of its def."""
    return f"{inspect.getsourcefile(function)}:{inspect.getsourcelines(function)[1]}"  # type: ignore[arg-type]


def test_each_verdict_goes_to_the_target_it_is_about() -> None:
    targets = [f"{MANAGER}.check_touch", f"{MANAGER}.check_abandon", f"{MANAGER}.check_reset_cache"]
    output = "\n".join(
        [
            f"{def_line(contracts.check_touch)}: info: Not confirmed.",
            f"{contracts.__file__}:263: error: AssertionError: [] when calling "
            "check_abandon(LruChecks(0, (0, 0, 1, 6)), 2)",
            f"{def_line(contracts.check_reset_cache)}: info: Unable to meet precondition.",
        ]
    )
    touch, abandon, reset = split_runs(targets, output, 1, 3.0)
    assert touch.returncode == 0 and touch.output.endswith("Not confirmed.")
    assert not touch.unexpected_lines() and not touch.refuted()
    assert abandon.refuted() and "check_abandon(LruChecks" in abandon.output
    assert "Not confirmed" not in abandon.output
    assert reset.vacuous() and reset.returncode == 0


def test_the_spec_classes_are_told_apart_by_the_function_behind_each_check() -> None:
    targets = [f"{SPEC}.check_touch", f"{SPEC}.check_prepare_load"]
    output = "\n".join(
        [
            f"{def_line(spec_contracts._Checks._check_touch)}: info: Not confirmed.",
            f"{spec_contracts.__file__}:1: error: AssertionError: reached when calling "
            "_check_prepare_load(ArcContracts([0], 0, [], [], [], [], [], [], [], 0.0), [])",
        ]
    )
    touch, load = split_runs(targets, output, 1, 3.0)
    assert touch.returncode == 0 and not touch.unexpected_lines()
    assert load.refuted() and "reached" in load.output and "Not confirmed" not in load.output


def test_a_line_about_no_target_fails_every_one() -> None:
    targets = [f"{MANAGER}.check_touch", f"{MANAGER}.check_abandon"]
    output = "\n".join(
        [
            f"{def_line(contracts.check_touch)}: info: Not confirmed.",
            f"{def_line(contracts.check_abandon)}: info: Not confirmed.",
            "Traceback (most recent call last):",
            f"{contracts.__file__}:1: error: AssertionError when calling "
            "check_touch(ArcChecks(0, (0, 0, 0, 0)), [])",  # another class: not this batch's
        ]
    )
    for run in split_runs(targets, output, 1, 3.0):
        assert run.returncode == 1 and len(run.unexpected_lines()) == 2


def test_a_crashed_process_fails_every_target() -> None:
    targets = [f"{MANAGER}.check_touch"]
    (run,) = split_runs(targets, f"{def_line(contracts.check_touch)}: info: Not confirmed.", 2, 1.0)
    assert run.returncode == 2


def test_one_process_checks_distinct_methods_of_one_class() -> None:
    with pytest.raises(ValueError, match="one class"):
        split_runs([f"{MANAGER}.check_touch", f"{SPEC}.check_abandon"], "", 0, 0.0)
    with pytest.raises(ValueError, match="distinct"):
        split_runs([f"{MANAGER}.check_touch", f"{MANAGER}.check_touch"], "", 0, 0.0)
