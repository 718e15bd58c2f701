"""Belady's optimum: the published reference figures, and a plain re-statement to agree with."""

from __future__ import annotations

import doctest

import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvoffload.replay.belady
from kvoffload.replay.belady import belady_hits, next_uses
from kvoffload.replay.traces import bundled_trace
from kvoffload_spec.errors import InvalidArgumentError


def test_module_examples() -> None:
    assert doctest.testmod(kvoffload.replay.belady).failed == 0


# The reference figures published with the traces, from an independent simulation
REFERENCE = {
    ("conversation", 1000): 0.1906,
    ("conversation", 4000): 0.3223,
    ("conversation", 16000): 0.3664,
    ("conversation", 64000): 0.3664,
    ("synthetic", 1000): 0.2766,
    ("synthetic", 4000): 0.4934,
    ("synthetic", 16000): 0.6396,
    ("synthetic", 64000): 0.6396,
}


@pytest.mark.parametrize(("name", "capacity"), sorted(REFERENCE))
def test_reproduces_the_reference_figures(name: str, capacity: int) -> None:
    trace = bundled_trace(name)
    ratio = belady_hits(trace.requests, capacity) / trace.num_refs
    assert round(ratio, 4) == REFERENCE[name, capacity]


def plain_belady(requests: list[list[int]], capacity: int) -> int:
    """The rule of the README, with every next use found by scanning ahead."""
    stream = [key for request in requests for key in request]

    def next_use(key: int, after: int) -> int:
        return next((p for p in range(after + 1, len(stream)) if stream[p] == key), len(stream))

    resident: dict[int, int] = {}
    hits = 0
    position = 0
    for request in requests:
        for key in request:
            if key not in resident:
                break
            hits += 1
        for key in request:
            use = next_use(key, position)
            if key in resident or use < len(stream):
                if key not in resident and len(resident) >= capacity:
                    del resident[max(resident, key=lambda k: resident[k])]
                resident[key] = use
            position += 1
    return hits


requests_strategy = st.lists(
    st.lists(st.integers(0, 12), max_size=6, unique=True), min_size=1, max_size=30
)


@given(requests_strategy, st.integers(1, 8))
def test_agrees_with_the_plain_rule(requests: list[list[int]], capacity: int) -> None:
    assert belady_hits(requests, capacity) == plain_belady(requests, capacity)


@given(requests_strategy)
def test_a_cache_holding_everything_misses_only_first_references(
    requests: list[list[int]],
) -> None:
    stream = [key for request in requests for key in request]
    infinite = len(set(stream)) or 1
    # hits are prefix hits, so an id after a first reference in its request does not count
    expected = 0
    seen: set[int] = set()
    for request in requests:
        for key in request:
            if key not in seen:
                break
            expected += 1
        seen.update(request)
    assert belady_hits(requests, infinite) == expected


def test_the_heap_is_compacted_on_long_streams() -> None:
    # one hot key and a long tail of keys used twice: lots of stale heap entries
    requests = [[0, n, n + 1] for n in range(1, 300)]
    assert belady_hits(requests, 3) == plain_belady(requests, 3) == 2 * 298


def test_next_uses() -> None:
    assert next_uses(["a", "b", "a", "c", "b"]) == [2, 4, 5, 5, 5]
    assert next_uses([]) == []


@pytest.mark.parametrize("capacity", [0, -1, 1.5, True])
def test_capacity_must_be_a_positive_int(capacity: object) -> None:
    with pytest.raises(InvalidArgumentError):
        belady_hits([[1]], capacity)  # type: ignore[arg-type]
