"""The explorer builds each state's abstraction once, for its invariants and its fingerprint.

A system whose ``check_invariants`` takes ``abstraction=`` (the manager, the model) is handed
the one built for the fingerprint; one whose check takes nothing is called as before.
"""

from __future__ import annotations

from kvoffload.manager import OffloadManager
from kvoffload_spec.explore import explore
from kvoffload_spec.refinement import state_differences
from kvoffload_spec.state import SpecState


class Recording(OffloadManager):
    """Counts its abstractions and checks that each one handed in is its own, exactly."""

    abstractions = 0
    handed = 0
    plain = 0

    def abstract_state(self) -> SpecState:
        Recording.abstractions += 1
        return super().abstract_state()

    def check_invariants(self, abstraction: SpecState | None = None) -> None:
        if abstraction is None:
            Recording.plain += 1
        else:
            Recording.handed += 1
            assert state_differences(abstraction, OffloadManager.abstract_state(self)) == []
        super().check_invariants(abstraction)


class PlainCheck(OffloadManager):
    """A check that takes no abstraction (a wrapper's, say)."""

    calls = 0

    def check_invariants(self) -> None:  # type: ignore[override]
        PlainCheck.calls += 1
        super().check_invariants()


def test_each_state_is_abstracted_once_for_its_invariants_and_its_fingerprint() -> None:
    report = explore(lambda: Recording(1, "lru", enable_events=True), keys=("a",), depth=3)
    assert report.ok and report.complete
    assert Recording.plain == 0 and Recording.handed > 0
    # One abstraction per checked state, plus one per call that must change nothing (its
    # fingerprint is compared with the state's before): never a second one for the check.
    assert Recording.abstractions < 2 * Recording.handed


def test_a_check_that_takes_no_abstraction_is_called_plainly() -> None:
    report = explore(lambda: PlainCheck(1, "lru", enable_events=True), keys=("a",), depth=2)
    assert report.ok and PlainCheck.calls > 0
