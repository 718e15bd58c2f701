"""The sweep: the engine's call order, the device tier, and the published reference figures."""

from __future__ import annotations

import doctest
from collections import OrderedDict
from collections.abc import Callable, Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvoffload.replay.sweep
from kvoffload.policies import LruPolicy
from kvoffload.replay.belady import belady_hits
from kvoffload.replay.device_cache import DevicePrefixCache
from kvoffload.replay.sweep import (
    PolicyName,
    SweepPoint,
    cpu_stream,
    new_manager,
    replay,
    sweep,
)
from kvoffload.replay.traces import Request, Trace, bundled_trace
from kvoffload_spec import OffloadModel
from kvoffload_spec.errors import InvalidArgumentError, UnknownPolicyError
from kvoffload_spec.surface import Key, ManagerOperations


def test_module_examples() -> None:
    assert doctest.testmod(kvoffload.replay.sweep).failed == 0


# The reference figures published with the traces: a single-tier LRU cache in the engine's
# call order
REFERENCE_LRU = {
    ("conversation", 1000): 0.0445,
    ("conversation", 4000): 0.0865,
    ("conversation", 16000): 0.2627,
    ("conversation", 64000): 0.3593,
    ("synthetic", 1000): 0.0841,
    ("synthetic", 4000): 0.2345,
    ("synthetic", 16000): 0.5299,
    ("synthetic", 64000): 0.6396,
}


@pytest.mark.parametrize(("name", "capacity"), sorted(REFERENCE_LRU))
def test_the_manager_reproduces_the_reference_lru_figures(name: str, capacity: int) -> None:
    trace = bundled_trace(name)
    result = sweep(trace, [capacity], ["lru", "belady"])
    lru, belady = result.points
    assert round(lru.hit_ratio, 4) == REFERENCE_LRU[name, capacity]
    assert lru.hit_ratio <= belady.hit_ratio
    assert result.device_hit_ratio == 0.0


def test_arc_on_a_whole_trace_is_its_own_policy_below_the_optimum() -> None:
    trace = bundled_trace("synthetic")
    lru, arc, belady = sweep(trace, [4000], ["lru", "arc", "belady"]).points
    assert 0.0 < arc.hit_ratio <= belady.hit_ratio
    # touched while their stores are in flight, new blocks stay in T1: were they promoted
    # to T2 at once, ARC would be an LRU and match it exactly
    assert round(arc.hit_ratio, 4) != round(lru.hit_ratio, 4)


def plain_lru(requests: Sequence[Request], capacity: int) -> int:
    """The reference figures' rule, re-stated on an OrderedDict (least recent first)."""
    cache: OrderedDict[int | str, None] = OrderedDict()
    hits = 0
    for request in requests:
        for key in request:
            if key not in cache:
                break
            hits += 1
        absent = [key for key in dict.fromkeys(request) if key not in cache]
        victims = [key for key in cache if key not in request]
        need = len(absent) - (capacity - len(cache))
        if need <= len(victims):  # else the store is refused and nothing is stored
            for victim in victims[: max(need, 0)]:
                del cache[victim]
            cache.update(dict.fromkeys(absent))
        for key in reversed(request):
            if key in cache:
                cache.move_to_end(key)
    return hits


def model_tier(policy: PolicyName, capacity: int) -> ManagerOperations:
    assert isinstance(policy, str), "the spec knows the built-in policies by name only"
    return OffloadModel(capacity, policy)


# prefix-chained like real traces: a request is a path in a small tree of blocks
chains = st.lists(
    st.integers(1, 4), min_size=0, max_size=6
).map(  # one id per prefix
    lambda path: tuple(int("".join(map(str, path[: i + 1]))) for i in range(len(path)))
)
traces = st.lists(chains, min_size=1, max_size=25)


@given(traces, st.integers(1, 8))
def test_replay_follows_the_reference_call_order(requests: list[Request], capacity: int) -> None:
    counts = replay(requests, OffloadModel(capacity, "lru"))
    assert counts.hits == plain_lru(requests, capacity)
    assert counts.refs == sum(len(request) for request in requests)
    assert counts.stored - counts.evicted <= capacity


@given(traces, st.integers(1, 8))
def test_the_device_cache_is_the_same_lru(requests: list[Request], capacity: int) -> None:
    fits = [request for request in requests if len(request) <= capacity]
    device = DevicePrefixCache(capacity)
    assert sum(device.admit(request) for request in fits) == plain_lru(fits, capacity)
    blocks = list(device.slots.values())
    assert len(set(blocks)) == len(blocks) and all(0 <= block < capacity for block in blocks)


def test_a_request_longer_than_the_device_changes_nothing() -> None:
    device = DevicePrefixCache(3)
    device.admit((1, 2))
    before = dict(device.slots)
    with pytest.raises(InvalidArgumentError, match="does not fit"):
        device.admit((5, 6, 7, 8))
    assert device.slots == before
    assert device.admit((1, 2, 3)) == 2


@given(traces, st.integers(6, 10), st.integers(1, 8))
def test_the_cpu_tier_sees_what_the_device_missed(
    requests: list[Request], gpu_blocks: int, capacity: int
) -> None:
    stream, device_hits = cpu_stream(requests, gpu_blocks)
    assert len(stream) == len(requests)
    for request, suffix in zip(requests, stream, strict=True):
        assert request[len(request) - len(suffix) :] == suffix
    assert device_hits + sum(map(len, stream)) == sum(map(len, requests))
    # the tiers together never beat a single cache of infinite size
    trace = Trace("t", tuple(requests))
    result = sweep(trace, [capacity], gpu_blocks=gpu_blocks, new_tier=model_tier)
    for point in result.points:
        assert result.device_hit_ratio + point.hit_ratio <= trace.ideal_hit_ratio + 1e-12


def test_without_a_device_the_cpu_stream_is_the_trace() -> None:
    requests = [(1, 2), (1, 3)]
    assert cpu_stream(requests, 0) == (requests, 0)


def test_sweep_is_capacity_major_and_reports_in_the_json_format() -> None:
    trace = Trace("t", ((1, 2, 3), (1, 2, 4), (1, 2, 3), (5,), (1, 2, 3)))
    result = sweep(trace, [2, 3], ["lru", "belady"], new_tier=model_tier)
    assert [(p.policy, p.capacity) for p in result.points] == [
        ("lru", 2),
        ("belady", 2),
        ("lru", 3),
        ("belady", 3),
    ]
    assert result.points[-1] == SweepPoint("belady", 3, belady_hits(trace.requests, 3) / 13)
    payload = result.to_json()
    assert payload["trace"] == "t" and payload["requests"] == 5 and payload["block_refs"] == 13
    assert payload["gpu_blocks"] == 0 and payload["device_hit_ratio"] == 0.0
    assert payload["infinite_cache_hit_ratio"] == trace.ideal_hit_ratio
    assert payload["results"] == [
        {"policy": p.policy, "capacity": p.capacity, "hit_ratio": p.hit_ratio}
        for p in result.points
    ]


def test_sweep_refuses_impossible_arguments_before_any_work() -> None:
    trace = Trace("t", ((1, 2, 3),))
    with pytest.raises(UnknownPolicyError):
        sweep(trace, [4], ["lfu"], new_tier=model_tier)
    with pytest.raises(InvalidArgumentError, match="capacity"):
        sweep(trace, [0], new_tier=model_tier)
    with pytest.raises(InvalidArgumentError, match="at least one"):
        sweep(trace, [], new_tier=model_tier)
    with pytest.raises(InvalidArgumentError, match="longest request"):
        sweep(trace, [4], gpu_blocks=2, new_tier=model_tier)


def test_the_default_tier_is_the_production_manager() -> None:
    tier = new_manager("arc", 16)
    assert type(tier).__name__ == "OffloadManager"
    assert replay([(1, 2), (1, 2)], tier).hits == 2


class Fifo(LruPolicy):
    """First stored, first evicted: an LRU that ignores touches."""

    def touch(self, keys: Sequence[Key], is_ready: Callable[[Key], bool]) -> None:
        pass


def test_a_policy_of_your_own_is_swept_under_its_class_name() -> None:
    trace = Trace("t", ((1, 2, 3), (1, 2, 4), (1, 2, 3), (5,), (1, 2, 3)))
    by_class = sweep(trace, [2, 3], ["lru", Fifo, "belady"])
    assert [p.policy for p in by_class.points] == ["lru", "Fifo", "belady"] * 2
    fifo = [p.hit_ratio for p in by_class.points if p.policy == "Fifo"]
    assert fifo == [replay(trace.requests, new_manager(Fifo, c)).hits / 13 for c in (2, 3)]
    by_path = sweep(trace, [2, 3], ["lru", f"{__name__}:Fifo", "belady"])
    assert by_path.points == by_class.points


def test_sweep_names_each_policy_once_and_at_least_one() -> None:
    trace = Trace("t", ((1, 2, 3),))
    with pytest.raises(InvalidArgumentError, match="at least one policy"):
        sweep(trace, [4], [])
    with pytest.raises(InvalidArgumentError, match="at least one policy"):
        sweep(trace, [4], "lru")  # a lone name, not a list
    with pytest.raises(InvalidArgumentError, match="labelled 'lru'"):
        sweep(trace, [4], ["lru", "lru"])
    with pytest.raises(InvalidArgumentError, match="labelled 'Fifo'"):
        sweep(trace, [4], [Fifo, f"{__name__}:Fifo"])
    with pytest.raises(UnknownPolicyError, match="cannot import 'nosuchmodule'"):
        sweep(trace, [4], ["nosuchmodule:Policy"])


def test_every_built_in_policy_can_be_swept() -> None:
    from kvoffload.policies import BUILTIN_POLICIES

    trace = Trace("t", ((1, 2, 3), (1, 2, 4), (1, 2, 3)))
    points = sweep(trace, [3], [*BUILTIN_POLICIES, "belady"]).points
    assert [p.policy for p in points] == [*BUILTIN_POLICIES, "belady"]
