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


# The docs' examples that run the conformance kit for seconds: the full gate, not the inner
# loop (every other page's examples stay in it).
SLOW_DOCS = ("conformance.md",)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in SLOW_DOCS and item.path.parent.name == "docs":
            item.add_marker(pytest.mark.slow)
