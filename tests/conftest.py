"""Hypothesis profiles shared by every property-based test.

Select with ``KVOFFLOAD_HYPOTHESIS_PROFILE`` (default ``ci``):
- ``ci``: what the gate runs; minutes on 2 cores.
- ``thorough``: long runs before a release.
- ``mutation``: derandomized, no database and no shrinking, so that mutmut's many runs are
  fast and repeatable.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, Phase, settings

from tests.valkey_server import ValkeyServer

settings.register_profile(
    "ci",
    max_examples=300,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "thorough",
    max_examples=10_000,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "mutation",
    max_examples=300,
    stateful_step_count=30,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=list(HealthCheck),
)
settings.load_profile(os.environ.get("KVOFFLOAD_HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def valkey_server() -> Iterator[ValkeyServer]:
    """A real Valkey server of this test's own on 127.0.0.1 (tests/valkey_server.py)."""
    with ValkeyServer() as server:
        yield server


# The docs' examples that run for seconds (the conformance kit; the user guide's whole
# walk-through): the full gate, not the inner loop (every other page's examples stay in it).
SLOW_DOCS = ("conformance.md", "user_guide.md")


# The gate's longest files, longest first: the sums of their tests' durations in a full run
# on a loaded 2-core machine (2026-12) were 690 s (CrossHair on the spec, two processes),
# 530 (the explorations), 475 (the conformance runs), 390 (CrossHair on the manager, two
# processes), 150 (the offloader machine), 130 (the installed command), 105 (the catalogue),
# 75 on an idle machine (the policies' whole-trace sweeps) and 70 (the soak); the next, 50.
# xdist hands whole files to its workers in collection order (pyproject.toml turns its
# reordering by number of tests off): a long file handed out last would run alone on one
# core while the other idles.
LONGEST_FIRST = (
    "test_crosshair.py",
    "test_explore.py",
    "test_differential.py",
    "test_crosshair_manager.py",
    "test_offloader_stateful.py",
    "test_first_use.py",
    "test_catalogue.py",
    "test_policy_quality.py",
    "test_soak_smoke.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in SLOW_DOCS and item.path.parent.name == "docs":
            item.add_marker(pytest.mark.slow)
    rank = {name: place for place, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))
