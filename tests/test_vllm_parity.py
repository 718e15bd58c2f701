"""Where the spec follows vLLM 0.33's CPU offloading manager: ARC's ghost hits on a store,
and the offer tracker. Each scenario runs on the spec and on the production manager alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from kvoffload.manager import OffloadManager
from kvoffload.policies import ArcPolicy
from kvoffload.replay.sweep import sweep
from kvoffload.replay.traces import bundled_trace
from kvoffload_spec import OffloadModel
from kvoffload_spec.policies import ArcOrder
from kvoffload_spec.surface import Key, ManagerSurface

Factory = Callable[..., ManagerSurface]
BOTH = pytest.mark.parametrize("make", [OffloadModel, OffloadManager], ids=["spec", "manager"])


def stored(system: ManagerSurface, keys: Sequence[Key]) -> tuple[Key, ...]:
    plan = system.prepare_store(keys)
    assert plan is not None
    system.complete_store(plan)
    return plan.keys


def target_p(system: ManagerSurface) -> float:
    if isinstance(system, OffloadModel):
        assert isinstance(system.state.order, ArcOrder)
        return system.state.order.p
    assert isinstance(system, OffloadManager) and isinstance(system.policy, ArcPolicy)
    return system.policy.p


@BOTH
def test_a_store_that_meets_a_ghost_adapts_p_before_evicting(make: Factory) -> None:
    """The issue's reproducer: vLLM 0.33 evicts (c, b) here with p = 2."""
    arc = make(3, "arc")
    stored(arc, ["a", "b"])
    stored(arc, ["c", "d"])  # a leaves T1 for the ghost list B1
    arc.touch(["a", "b"])  # b moves to T2; a is a ghost hit of the touch: p = 1
    assert target_p(arc) == 1.0
    plan = arc.prepare_store(["e", "a"])  # a is a ghost hit again, before insert drops it
    assert target_p(arc) == 2.0
    assert plan is not None and plan.evicted_keys == ("c", "b")


@BOTH
def test_ghost_hits_count_once_per_call(make: Factory) -> None:
    arc = make(2, "arc")
    stored(arc, ["a", "b"])
    stored(arc, ["c"])  # a: a B1 ghost
    plan = arc.prepare_store(["a", "a"])
    assert target_p(arc) == 1.0 and plan is not None and plan.keys == ("a",)


@BOTH
def test_a_refused_store_still_adapts_p(make: Factory) -> None:
    """A ghost hit is an observation of the request stream, like an offer: it counts even
    when the store is refused; the blocks and the resident order do not change."""
    arc = make(1, "arc")
    stored(arc, ["a"])
    stored(arc, ["b"])  # a: a B1 ghost
    arc.prepare_load(["b"])  # pinned: nothing can be evicted
    assert arc.prepare_store(["a"]) is None
    assert target_p(arc) == 1.0
    assert arc.num_evictable_blocks == 0 and arc.num_free_blocks == 0


@BOTH
def test_a_ghost_not_admitted_by_the_threshold_is_not_a_hit(make: Factory) -> None:
    arc = make(1, "arc", store_threshold=2, max_tracker_size=2)
    for key in ("a", "a", "b", "b"):
        stored(arc, [key])  # a and b stored in turn: a is a B1 ghost
    stored(arc, ["x"])  # the tracker forgets a's offers
    assert stored(arc, ["a"]) == ()  # a first offer: not a candidate, so no ghost hit
    assert target_p(arc) == 0.0
    assert stored(arc, ["a"]) == ("a",)  # admitted now: the ghost hit counts
    assert target_p(arc) == 1.0


@BOTH
def test_the_keys_of_one_offer_never_push_each_other_out(make: Factory) -> None:
    """vLLM 0.33 stores [a] here; forgetting a to make room for b would store nothing."""
    system = make(4, store_threshold=2, max_tracker_size=1)
    assert stored(system, ["a"]) == ()
    assert stored(system, ["b", "a"]) == ("a",)  # b found the tracker full of this call


@BOTH
def test_a_new_key_forgets_the_least_recent_key_outside_the_call(make: Factory) -> None:
    system = make(4, store_threshold=2, max_tracker_size=2)
    stored(system, ["a"])
    stored(system, ["b"])
    assert stored(system, ["c", "a"]) == ("a",)  # a counted, c forgets b (not a)
    assert stored(system, ["c"]) == ("c",)
    assert stored(system, ["b"]) == ()  # b was forgotten: a first offer again


@BOTH
def test_offers_of_resident_keys_are_recorded(make: Factory) -> None:
    """An offer of a resident key is a reuse: it counts, so the key is not forgotten for a
    newer one while it is still being offered."""
    system = make(1, store_threshold=2, max_tracker_size=2)
    stored(system, ["a"])
    assert stored(system, ["a"]) == ("a",)
    stored(system, ["x"])  # tracker: a, x
    stored(system, ["a"])  # a is resident; its offer makes it the most recent: x, a
    stored(system, ["y"])  # forgets x, not a
    assert stored(system, ["x"]) == ()  # a first offer again


# vLLM 0.33.0's ARC on the bundled conversation trace, single tier, in the engine's order
VLLM_ARC = {4000: 0.0846, 8000: 0.1655, 16000: 0.2632, 32000: 0.3089}


@pytest.mark.parametrize(
    "capacity",
    [
        4000,
        8000,
        pytest.param(16000, marks=pytest.mark.slow),
        pytest.param(32000, marks=pytest.mark.slow),
    ],
)
def test_arc_reproduces_vllm_033_on_the_conversation_trace(capacity: int) -> None:
    (point,) = sweep(bundled_trace("conversation"), [capacity], ["arc"]).points
    assert round(point.hit_ratio, 4) == VLLM_ARC[capacity]


def either(system: ManagerSurface) -> OffloadModel | OffloadManager:
    """The keyword ``seen_misses`` is the spec's and the manager's, not the protocol's."""
    assert isinstance(system, (OffloadModel, OffloadManager))
    return system


@BOTH
def test_a_requesters_seen_misses_make_its_ghost_hit_count_once(make: Factory) -> None:
    """``prepare_store(keys, seen_misses=...)``: vLLM retries a refused store every step and
    counts the ghost hit once per request; without the set, each call counts one."""
    empty: set[Key] = set()
    for seen in (empty, None):
        system = make(2, "arc")
        stored(system, [b"a", b"b"])
        stored(system, [b"c"])  # a becomes a ghost
        pins = system.prepare_load([b"b", b"c"])  # nothing evictable: a's stores are refused
        targets = []
        for _ in range(2):
            assert either(system).prepare_store([b"a"], seen_misses=seen) is None
            targets.append(target_p(system))
        assert targets == ([1.0, 1.0] if seen is not None else [1.0, 2.0])
        if seen is not None:
            assert seen == {b"a"}
        system.complete_load(pins)
        system.check_invariants()


@BOTH
def test_seen_misses_must_be_a_set(make: Factory) -> None:
    from kvoffload_spec.errors import InvalidArgumentError

    system = make(2, "arc")
    with pytest.raises(InvalidArgumentError, match="seen_misses"):
        either(system).prepare_store([b"a"], seen_misses=[b"a"])  # type: ignore[arg-type]
    assert system.lookup(b"a").value == "miss"
