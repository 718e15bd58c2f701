"""The exhaustive explorer on the reference model: the gate's bounds, the CLI, the API.

The gate explores every state within the bounds below for both policies (about 30 s on
this 2-core machine; docs/spec.md records the counts). That the explorer can fail at all
is shown by tests/test_planted_bugs.py.
"""

from __future__ import annotations

import copy
import doctest
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pytest

import kvoffload_spec.explore
from kvoffload_spec import InvalidArgumentError, LoadPlan, Lookup, OffloadModel, StorePlan
from kvoffload_spec.explore import (
    CHECKS,
    clone_model,
    explore,
    key_sequences,
    main,
    model_fingerprint,
)
from kvoffload_spec.refinement import Fingerprint
from kvoffload_spec.surface import Event, Key
from tests.planted.spec import VARIANTS

pytestmark = pytest.mark.slow  # exhaustive exploration at the gate's bounds


@dataclass(frozen=True)
class Bounds:
    blocks: int
    keys: int
    depth: int
    threshold: int = 1

    @property
    def alphabet(self) -> tuple[str, ...]:
        return tuple("abc"[: self.keys])


GATE_BOUNDS = (
    Bounds(blocks=2, keys=3, depth=5),  # wide: eviction choices, protection, pins
    Bounds(blocks=1, keys=2, depth=7),  # deep: resets, stale and abandoned plans
    Bounds(blocks=2, keys=3, depth=4, threshold=2),  # the offer tracker
)


@pytest.mark.parametrize("policy", ["lru", "arc", "duel"])
@pytest.mark.parametrize("bounds", GATE_BOUNDS, ids=str)
def test_every_reachable_state_passes_every_check(bounds: Bounds, policy: str) -> None:
    report = explore(
        lambda: OffloadModel(
            bounds.blocks, policy, store_threshold=bounds.threshold, enable_events=True
        ),
        keys=bounds.alphabet,
        depth=bounds.depth,
        store_threshold=bounds.threshold,
    )
    print(f"{policy} {bounds}: {report.summary()}")
    assert report.violation is None, report.summary()
    assert report.complete and report.depth == bounds.depth
    assert report.transitions > report.states > 1_000  # not a search that went nowhere


def test_the_alphabet_has_every_ordering_of_every_subset() -> None:
    sequences = key_sequences(["a", "b", "c"])
    assert sequences[0] == ()
    assert ("c", "a") in sequences and ("b", "c", "a") in sequences
    assert sequences[-1] == ("a", "a")
    assert len(sequences) == 1 + 3 + 6 + 6 + 1


def test_a_time_budget_cuts_the_search_short_and_says_so() -> None:
    report = explore(
        lambda: OffloadModel(2, enable_events=True), keys=("a", "b", "c"), depth=12, max_seconds=0.2
    )
    assert report.ok and not report.complete
    assert report.depth < 12
    assert "complete to depth" in report.summary()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"keys": ()}, "distinct"),
        ({"keys": ("a", "a")}, "distinct"),
        ({"keys": "ab"}, "list or tuple"),
        ({"keys": ("a", ["b"])}, "hashable"),
        ({"depth": -1}, "depth"),
        ({"checks": {"data", "vibes"}}, "unknown checks"),
        ({"max_seconds": 0}, "max_seconds"),
        ({"store_threshold": 0}, "store_threshold"),
    ],
)
def test_bad_arguments_raise_a_typed_error(options: dict[str, object], message: str) -> None:
    arguments: dict[str, object] = {"keys": ("a",), "depth": 1, **options}
    with pytest.raises(InvalidArgumentError, match=message):
        explore(lambda: OffloadModel(1, enable_events=True), **arguments)  # type: ignore[arg-type]


class Delegate:
    """A system that is not the reference model: the surface, passed through."""

    def __init__(self, num_blocks: int) -> None:
        self.inner = OffloadModel(num_blocks, "arc", enable_events=True)

    @property
    def num_blocks(self) -> int:
        return self.inner.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.inner.num_free_blocks

    @property
    def num_evictable_blocks(self) -> int:
        return self.inner.num_evictable_blocks

    @property
    def num_quarantined_blocks(self) -> int:
        return self.inner.num_quarantined_blocks

    def lookup(self, key: Key) -> Lookup:
        return self.inner.lookup(key)

    def prepare_store(self, keys: Sequence[Key]) -> StorePlan | None:
        return self.inner.prepare_store(keys)

    def complete_store(self, plan: StorePlan, success: bool = True) -> None:
        self.inner.complete_store(plan, success)

    def prepare_load(self, keys: Sequence[Key]) -> LoadPlan:
        return self.inner.prepare_load(keys)

    def complete_load(self, plan: LoadPlan) -> None:
        self.inner.complete_load(plan)

    def abandon(self, plan: StorePlan | LoadPlan) -> None:
        self.inner.abandon(plan)

    def is_abandoned(self, plan: StorePlan | LoadPlan) -> bool:
        return self.inner.is_abandoned(plan)

    def touch(self, keys: Sequence[Key]) -> None:
        self.inner.touch(keys)

    def reset_cache(self) -> None:
        self.inner.reset_cache()

    def take_events(self) -> list[Event]:
        return self.inner.take_events()

    def check_invariants(self) -> None:
        self.inner.check_invariants()


def test_any_system_with_the_surface_can_be_explored_given_a_fingerprint() -> None:
    def fingerprint(system: Delegate, plan_names: Mapping[int, int]) -> Fingerprint:
        return model_fingerprint(system.inner, plan_names)

    keys = ("a", "b")
    on_model = explore(lambda: OffloadModel(1, "arc", enable_events=True), keys=keys, depth=5)
    on_delegate = explore(lambda: Delegate(1), keys=keys, depth=5, fingerprint=fingerprint)
    assert on_delegate.ok and on_delegate.complete
    assert (on_delegate.states, on_delegate.transitions) == (on_model.states, on_model.transitions)
    with pytest.raises(InvalidArgumentError, match="needs a fingerprint for Delegate"):
        explore(lambda: Delegate(1), keys=keys, depth=1)


class CrashesOnHits(Delegate):
    def lookup(self, key: Key) -> Lookup:
        found = super().lookup(key)
        if found is Lookup.HIT:
            raise RuntimeError(f"cannot look {key!r} up")
        return found


def test_a_system_that_crashes_when_asked_is_reported_not_raised() -> None:
    def fingerprint(system: Delegate, plan_names: Mapping[int, int]) -> Fingerprint:
        return model_fingerprint(system.inner, plan_names)

    report = explore(lambda: CrashesOnHits(1), keys=("a",), depth=3, fingerprint=fingerprint)
    assert report.violation is not None
    assert report.violation.steps == (
        "prepare_store(['a'])",
        "complete_store(plan 1, success=True)",
    )
    assert report.violation.message.startswith(
        "asking the system how it stands raised RuntimeError(cannot look 'a' up)"
    )


def test_checks_can_be_left_out_for_a_system_without_events() -> None:
    silent = explore(lambda: OffloadModel(1), keys=("a",), depth=3, checks=CHECKS - {"events"})
    assert silent.ok
    loud = explore(lambda: OffloadModel(1), keys=("a",), depth=3)
    assert loud.violation is not None
    assert "events [] where [BlocksStored(keys=('a',))] were due" in loud.violation.message


def test_clone_model_is_a_deep_copy() -> None:
    model = OffloadModel(2, "arc", store_threshold=2, enable_events=True)
    model.prepare_store(["a", "b"])
    plan = model.prepare_store(["a", "b"])
    assert plan is not None
    model.complete_store(plan)
    load = model.prepare_load(["a"])
    names = {plan.plan_id: 0, load.plan_id: 1}
    before = model_fingerprint(model, names)
    open_before = set(model.state.open_plans)
    clone = clone_model(model)
    assert model_fingerprint(clone, names) == model_fingerprint(copy.deepcopy(model), names)
    clone.complete_load(load)
    clone.touch(["a", "b"])
    clone.prepare_store(["c", "d"])  # offered once: below the threshold
    evicting = clone.prepare_store(["c", "d"])
    assert evicting is not None and evicting.evicted_keys  # every container was changed
    assert model_fingerprint(model, names) == before
    assert set(model.state.open_plans) == open_before


def test_the_command_line_prints_the_report() -> None:
    bounds = ["--policy", "arc", "--blocks", "1", "--keys", "2", "--depth", "3"]
    done = subprocess.run(
        [sys.executable, "-m", "kvoffload_spec.explore", *bounds],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == (
        "exploring arc with 1 blocks, keys a, b, depth 3, store_threshold 1"
    )
    assert done.stdout.splitlines()[1].startswith("ok: ")
    assert (
        "states" in done.stdout
        and "transitions" in done.stdout
        and " s (all states)" in done.stdout
    )


def test_the_command_line_prints_a_counterexample_and_fails(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = next(v for v in VARIANTS if v.name == "failed_store_leaks_slot")
    monkeypatch.setattr(kvoffload_spec.explore, "OffloadModel", broken.model_class)
    assert main(["--blocks", "1", "--keys", "1", "--depth", "3"]) == 1
    out = capsys.readouterr().out
    assert "VIOLATION" in out
    assert "1. prepare_store(['a'])\n  2. complete_store(plan 1, success=False)" in out


@pytest.mark.parametrize("argv", [["--keys", "0"], ["--blocks", "0"], ["--policy", "fifo"]])
def test_the_command_line_refuses_bad_bounds(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_the_module_examples_run() -> None:
    assert doctest.testmod(kvoffload_spec.explore).failed == 0
