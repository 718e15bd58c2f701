"""The hit ratios the docs claim for ``duel``, held on whole traces.

The differential and the explorer prove that the product's ``duel`` is the spec's; neither
can notice that both got worse (a decay or a tie order changed, an order dropped from the
duel). These tests replay the two bundled Mooncake traces and the agentic sessions of
``tests/traces`` (multi-turn conversations over long growing prefixes, the workload LRU-2
joined the duel for) and check the claims of docs/performance.md: ``duel`` reaches its
targets there, is never more than half a point below LRU, keeps the reused prefixes that
one-shot blocks flush out of LRU, and serves the conversations that take turns over
prefixes longer than the pool. Each claim is a margin well inside today's figures, so only
a real loss fails it; plain LRU, swept in ``duel``'s place, must fail them (the checks can
fail).
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from kvoffload.replay.sweep import sweep
from kvoffload.replay.traces import Trace, bundled_trace, load_trace

pytestmark = pytest.mark.slow

AGENTIC = Path(__file__).parent / "traces" / "agentic-dev.jsonl.gz"
BUNDLED_CAPACITIES = (1000, 2000, 4000, 8000, 16000, 32000, 64000)
AGENTIC_CAPACITIES = (15000, 30000, 60000)

TARGETS = (
    ("conversation", 4000, 0.14),
    ("conversation", 8000, 0.20),
    ("synthetic", 4000, 0.25),
    ("synthetic", 8000, 0.39),
)
"""``duel``'s hit-ratio targets (docs/performance.md): trace, capacity, the least it reaches."""

TOLERANCE = 0.005
"""How far below LRU ``duel`` may fall anywhere: half a point of hit ratio."""


@functools.cache
def trace(name: str) -> Trace:
    return load_trace(AGENTIC, "agentic") if name == "agentic" else bundled_trace(name)


@functools.cache
def hit_ratios(name: str, policy: str) -> dict[int, float]:
    """``policy``'s hit ratio on trace ``name`` at each capacity swept there (single tier)."""
    capacities = AGENTIC_CAPACITIES if name == "agentic" else BUNDLED_CAPACITIES
    result = sweep(trace(name), capacities, [policy])
    return {point.capacity: point.hit_ratio for point in result.points}


def broken_claims(policy: str) -> list[str]:
    """The docs' claims for ``duel`` that ``policy`` does not meet, LRU its baseline."""
    broken = []
    for name in ("conversation", "synthetic", "agentic"):
        ours, lru = hit_ratios(name, policy), hit_ratios(name, "lru")
        broken += [
            f"{name} at {capacity}: {ours[capacity]:.4f}, more than half a point below "
            f"LRU's {lru[capacity]:.4f}"
            for capacity in ours
            if ours[capacity] < lru[capacity] - TOLERANCE
        ]
    # The targets of docs/performance.md (today 0.1546, 0.2053; 0.2628, 0.4043).
    for name, capacity, target in TARGETS:
        reached = hit_ratios(name, policy)[capacity]
        if reached < target:
            broken.append(f"{name} at {capacity}: {reached:.4f}, under the target {target}")
    # One-shot blocks flush the reused prefixes out of LRU at small pools (today 1.8-2.0x).
    conversation, lru = hit_ratios("conversation", policy), hit_ratios("conversation", "lru")
    broken += [
        f"conversation at {capacity}: {conversation[capacity]:.4f}, under 1.5 times LRU's "
        f"{lru[capacity]:.4f}"
        for capacity in (1000, 2000, 4000)
        if conversation[capacity] < 1.5 * lru[capacity]
    ]
    synthetic, lru = hit_ratios("synthetic", policy), hit_ratios("synthetic", "lru")
    broken += [
        f"synthetic at {capacity}: {synthetic[capacity]:.4f}, under LRU's "
        f"{lru[capacity]:.4f} + 0.02"
        for capacity in (4000, 8000, 16000)
        if synthetic[capacity] < lru[capacity] + 0.02
    ]
    # Sessions taking turns over prefixes longer than the pool holds for all of them: LRU-2
    # keeps those that come back soonest (today +0.085 at 15,000 blocks).
    agentic, lru = hit_ratios("agentic", policy), hit_ratios("agentic", "lru")
    if agentic[15000] < lru[15000] + 0.07:
        at_15k, lru_at_15k = agentic[15000], lru[15000]
        broken.append(f"agentic at 15000: {at_15k:.4f}, under LRU's {lru_at_15k:.4f} + 0.07")
    return broken


def test_the_agentic_trace_is_the_one_described() -> None:
    agentic = trace("agentic")
    assert (agentic.num_requests, agentic.num_refs) == (600, 966772)
    assert round(hit_ratios("agentic", "lru")[15000], 4) == 0.3103  # the README's figure


def test_duel_meets_every_claim_of_the_docs() -> None:
    assert broken_claims("duel") == []


def test_lru_in_duels_place_breaks_the_claims() -> None:
    broken = broken_claims("lru")
    assert any(claim.startswith("conversation at 4000") for claim in broken), broken
    assert any(claim.startswith("synthetic at 8000") for claim in broken), broken
    assert any("under the target" in claim for claim in broken), broken
    assert any(claim.startswith("agentic at 15000") for claim in broken), broken
