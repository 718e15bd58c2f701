"""The production manager against the spec, step by step, with the conformance kit.

``check_conformance`` drives an ``OffloadManager`` and the spec's ``OffloadModel`` with the
same calls and compares every observable, every internal counter and the whole abstract
state after every step (without the counters, a probe never found a failed-store counter
bug). That the comparison can fail is shown by the catalogue of planted bugs
(tests/planted/, run by tests/test_catalogue.py).
"""

from __future__ import annotations

import functools

import pytest
from hypothesis import settings

from kvoffload.checking.conformance import (
    ManagerFactory,
    check_conformance,
    check_directed_histories,
)
from kvoffload.manager import OffloadManager
from kvoffload.policies.arc import ArcPolicy
from kvoffload.policies.base import EvictionPolicy
from kvoffload_spec import OffloadModel
from kvoffload_spec.policies import ArcOrder
from tests.planted.manager import MostRecentFirst


def managers(policy: str | type[EvictionPolicy]) -> ManagerFactory:
    return functools.partial(OffloadManager, policy=policy)


# An example costs ~10 ms, and deep ARC states (target p above |T1|, T2 all pinned) need
# many histories: run at least 1,000 whatever the profile asks (a probe found 200 too few).
EXAMPLES = max(settings().max_examples, 1_000)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["lru", "arc", "duel"])
def test_manager_matches_the_spec(policy: str) -> None:
    check_conformance(managers(policy), policy=policy, max_examples=EXAMPLES)


@pytest.mark.slow
def test_a_user_policy_conforms() -> None:
    check_conformance(managers(MostRecentFirst), policy=None, max_examples=EXAMPLES)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_the_manager_passes_the_directed_histories(policy: str) -> None:
    check_directed_histories(managers(policy), policy=policy)


def test_a_touch_with_a_repeat_ends_with_its_first_key_most_recent() -> None:
    manager = OffloadManager(3, "lru")
    for key in "abc":
        plan = manager.prepare_store([key])
        assert plan is not None
        manager.complete_store(plan)
    manager.touch(["a", "b", "a", "c", "b"])
    assert manager.policy.resident() == ["c", "b", "a"]


@pytest.mark.parametrize("start", range(4))
def test_an_arc_ghost_hit_moves_the_target_by_the_fractional_ratio(start: int) -> None:
    """|B2| = 3, |B1| = 2 at 3 blocks: a B1 hit adds 3/2 to p (capped at 3), exactly."""
    manager, model = OffloadManager(3, "arc"), OffloadModel(3, "arc")
    fill_ghosts(manager)
    fill_ghosts(model)
    policy, order = manager.policy, model.state.order
    assert isinstance(policy, ArcPolicy) and isinstance(order, ArcOrder)
    policy.p = order.p = float(start)
    assert policy.lists()[2:] == (order.b1, order.b2) == ([3, 4], [2, 1, 0])
    manager.touch([3])
    model.touch([3])
    assert policy.p == order.p == min(start + 1.5, 3.0)


def fill_ghosts(target: OffloadManager | OffloadModel) -> None:
    """Keys 0-2 through T2 into B2, then 3 and 4 through T1 into B1."""
    for batch, twice in (([0, 1, 2], True), ([3, 4, 5], False), ([6, 7], False)):
        plan = target.prepare_store(batch)
        assert plan is not None
        target.complete_store(plan)
        if twice:
            target.touch(batch)
