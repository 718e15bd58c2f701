"""The built-in policies, each against the spec's order: on any history of the policy interface
(what a manager never does included: a pinned key removed, ``p`` set outright), compared
through the policy's part of the refinement mapping (``abstract_order``); the victims in
every small state; ARC's target after ghost hits; what each policy's ``check_invariants``
reports; and how ``resolve_policy`` refuses a policy it cannot use."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    rule,
    run_state_machine_as_test,
)

from kvoffload.manager import OffloadManager
from kvoffload.policies import BUILTIN_POLICIES
from kvoffload.policies.arc import ArcPolicy
from kvoffload.policies.base import EvictionPolicy
from kvoffload.policies.loading import resolve_policy
from kvoffload.policies.lru import LruPolicy
from kvoffload_spec.errors import (
    UnknownPolicyError,
)
from kvoffload_spec.policies import ArcOrder, LruOrder, PolicyOrder
from kvoffload_spec.surface import Key, Lookup
from tests.helpers import reported
from tests.policy_machine import CAPACITY, PolicyAgainstSpec, stands_for


class LruAgainstSpec(PolicyAgainstSpec):
    def __init__(self) -> None:
        super().__init__()
        self.policy = LruPolicy(CAPACITY)
        self.order = LruOrder()


class ArcAgainstSpec(PolicyAgainstSpec):
    def __init__(self) -> None:
        super().__init__()
        self.arc = self.policy = ArcPolicy(CAPACITY)
        self.arc_order = self.order = ArcOrder(CAPACITY)

    @rule(target_size=st.integers(0, CAPACITY))
    def set_target(self, target_size: int) -> None:
        """``p`` set outright, to reach every target (ghost hits move it step by step)."""
        self.arc.p = self.arc_order.p = float(target_size)


def test_lru_policy_is_the_spec_order() -> None:
    run_state_machine_as_test(LruAgainstSpec)


def test_arc_policy_is_the_spec_order() -> None:
    run_state_machine_as_test(ArcAgainstSpec)


# -- victims in every small state, against the spec -------------------------------------------

FATES = ("absent", "pending", "T1", "T1 pinned", "T2", "T2 pinned")


def built(policy: EvictionPolicy, order: PolicyOrder, fates: tuple[str, ...]) -> set[Key]:
    """Give each key ``k`` the state ``fates[k]`` through the interface (inserted in key
    order, T2 by a touch while ready); returns the evictable keys.
    """
    resident = [key for key, fate in enumerate(fates) if fate != "absent"]
    for key in resident:
        policy.insert(key)
        order.insert(key)
        if fates[key] != "pending":
            policy.mark_evictable(key)
    for key in resident:
        if fates[key].startswith("T2"):
            policy.touch([key], lambda _: True)
            order.touch([key], lambda _: True)
    for key in resident:
        if fates[key].endswith("pinned"):
            policy.mark_unevictable(key)
    return {key for key, fate in enumerate(fates) if fate in ("T1", "T2")}


def spec_victims(order: PolicyOrder, need: int, candidates: set[Key]) -> list[Key] | None:
    return order.choose_victims(need, candidates.__contains__)


@pytest.mark.parametrize("name", ["lru", "arc"])
def test_victims_in_every_small_state_are_the_spec_victims(name: str) -> None:
    """Every state of 4 keys, every ARC target: the boundaries (``|T1| == p``, a list
    with nothing evictable) come up by construction, not by luck.
    """
    targets = range(CAPACITY + 1) if name == "arc" else [0]
    for fates in itertools.product(FATES, repeat=4):
        for target in targets:
            policy: EvictionPolicy = ArcPolicy(CAPACITY) if name == "arc" else LruPolicy(CAPACITY)
            order: PolicyOrder = ArcOrder(CAPACITY) if name == "arc" else LruOrder()
            evictable = built(policy, order, fates)
            if isinstance(policy, ArcPolicy) and isinstance(order, ArcOrder):
                policy.p = order.p = float(target)
            for need, protected in itertools.product((1, 2, 3), ((), (0,), (1, 3))):
                expected = spec_victims(order, need, evictable - set(protected))
                assert policy.choose_victims(need, protected) == expected, (fates, target)


# -- ARC's target after ghost hits, against the spec -------------------------------------------


def ghosts(policy: ArcPolicy, order: ArcOrder, in_b1: int, in_b2: int) -> tuple[Key, Key]:
    """Make ``in_b2`` ghosts of T2 keys, then ``in_b1`` of T1 keys, through the interface;
    returns a key of each list (or -1).
    """
    keys = iter(range(100))

    def store(count: int, *, twice: bool) -> list[Key]:
        stored: list[Key] = [next(keys) for _ in range(count)]
        for key in stored:
            policy.insert(key)
            order.insert(key)
            policy.mark_evictable(key)
        if twice:
            policy.touch(stored, lambda _: True)
            order.touch(stored, lambda _: True)
        victims = policy.choose_victims(count, ())
        assert victims is not None and victims == order.choose_victims(count, lambda _: True)
        policy.evict(victims)
        order.evict(victims)
        return stored

    from_t2 = store(in_b2, twice=True)
    from_t1 = store(in_b1, twice=False)
    return (from_t1[0] if from_t1 else -1), (from_t2[0] if from_t2 else -1)


@pytest.mark.parametrize(("in_b1", "in_b2"), itertools.product(range(CAPACITY + 1), repeat=2))
def test_ghost_hits_move_the_target_as_the_spec_does(in_b1: int, in_b2: int) -> None:
    for start in range(CAPACITY + 1):
        for hit_b1 in (True, False):
            policy, order = ArcPolicy(CAPACITY), ArcOrder(CAPACITY)
            b1_key, b2_key = ghosts(policy, order, in_b1, in_b2)
            policy.p = order.p = float(start)
            ghost = b1_key if hit_b1 else b2_key
            policy.touch([ghost], lambda _: False)
            order.touch([ghost], lambda _: False)
            stands_for(policy, order)


# -- what check_invariants says about a broken policy --------------------------------------------


def arc_with(fates: dict[Key, str]) -> ArcPolicy:
    policy = ArcPolicy(CAPACITY)
    built(policy, ArcOrder(CAPACITY), tuple(fates.get(key, "absent") for key in range(4)))
    return policy


def evictable_in(fates: dict[Key, str]) -> Callable[[Key], bool]:
    return lambda key: fates.get(key) in ("T1", "T2")


def test_arc_reports_its_list_sizes() -> None:
    fates: dict[Key, str] = {0: "T1", 1: "T2"}
    policy = arc_with(fates)
    policy._t1_size += 1
    problems = policy.check_invariants(evictable_in(fates))
    assert reported(problems, r"ARC sizes 2, 1 but T1=\[0\], T2=\[1\]")


@pytest.mark.parametrize(
    ("fates", "wrong", "named"),
    [
        ({0: "T1 pinned", 1: "T2"}, 0, "evictable T1"),
        ({0: "T1", 1: "T2 pinned"}, 1, "evictable T2"),
    ],
)
def test_arc_names_the_list_whose_evictable_keys_disagree(
    fates: dict[Key, str], wrong: Key, named: str
) -> None:
    policy = arc_with(fates)
    claims = evictable_in({**fates, wrong: "T1"})  # the manager thinks ``wrong`` is evictable
    problems = policy.check_invariants(claims)
    assert reported(problems, rf"ARC's {named} is \[.*\], the manager's \[.*\]")


def test_repeated_stamps_are_reported() -> None:
    fates: dict[Key, str] = {0: "T1", 1: "T1"}
    arc = arc_with(fates)
    arc._codes[1] = arc._codes[0]
    assert "ARC stamps repeat" in arc.check_invariants(evictable_in(fates))
    lru = LruPolicy(CAPACITY)
    built(lru, LruOrder(), ("T1", "T1", "absent", "absent"))
    lru._stamps[1] = lru._stamps[0]
    assert "LRU stamps repeat" in lru.check_invariants(evictable_in(fates))


# -- a subclass that overrides a per-key method ------------------------------------------------


def counting_subclass(base: type[EvictionPolicy]) -> tuple[type[EvictionPolicy], Counter[str]]:
    """``base`` with its per-key methods overridden to count their calls (in the counter
    returned beside it) and defer to it."""
    calls: Counter[str] = Counter()

    class Counting(base):  # type: ignore[valid-type,misc]
        def insert(self, key: Key) -> None:
            calls["insert"] += 1
            super().insert(key)

        def mark_evictable(self, key: Key) -> None:
            calls["mark_evictable"] += 1
            super().mark_evictable(key)

        def mark_unevictable(self, key: Key) -> None:
            calls["mark_unevictable"] += 1
            super().mark_unevictable(key)

    return Counting, calls


def lookups_after_a_history(policy: type[EvictionPolicy]) -> list[Lookup]:
    """Stores that evict, a load, and every key looked up after."""
    manager = OffloadManager(3, policy)
    for batch in (["a", "b"], ["c"], ["d", "e"], ["a"]):
        plan = manager.prepare_store(batch)
        assert plan is not None
        manager.complete_store(plan)
        load = manager.prepare_load(batch[:1])
        manager.touch(batch)
        manager.complete_load(load)
    manager.check_invariants()
    return [manager.lookup(key) for key in "abcde"]


@pytest.mark.parametrize("name", sorted(BUILTIN_POLICIES))
def test_a_subclass_overriding_the_per_key_methods_is_called_for_every_key(name: str) -> None:
    """The manager calls the batch forms; a subclass that overrides only the per-key methods
    gets each of its overrides called once per key (and no recursion through ``super``),
    and the policy behaves as its base does."""
    base = BUILTIN_POLICIES[name]
    counting, calls = counting_subclass(base)
    assert lookups_after_a_history(counting) == lookups_after_a_history(base)
    # six keys stored and completed ("a" twice: evicted in between), four loads of one key
    assert calls == {"insert": 6, "mark_evictable": 6 + 4, "mark_unevictable": 4}


# -- what resolve_policy says when it cannot ---------------------------------------------------


class Incomplete(EvictionPolicy):
    """Implements nothing: abstract."""


@pytest.mark.parametrize(
    ("policy", "says"),
    [
        (
            "fifo",
            "unknown policy 'fifo': choose one of lru, arc, duel, an EvictionPolicy subclass, or "
            "'module:Class'",
        ),
        (
            "kvoffload.no_such_module:Policy",
            "policy 'kvoffload.no_such_module:Policy': cannot import 'kvoffload.no_such_module': "
            "no module 'kvoffload.no_such_module' in the current directory or on PYTHONPATH",
        ),
        (
            "kvoffload.policies:NoSuchPolicy",
            "policy 'kvoffload.policies:NoSuchPolicy': 'kvoffload.policies' has no 'NoSuchPolicy'",
        ),
        (
            "kvoffload.policies:LruPolicy:extra",
            "policy 'kvoffload.policies:LruPolicy:extra': 'kvoffload.policies' has no "
            "'LruPolicy:extra'",
        ),
        (
            "kvoffload.policies:BUILTIN_POLICIES",
            "policy 'kvoffload.policies:BUILTIN_POLICIES' is not an EvictionPolicy subclass",
        ),
        (Incomplete, "policy 'Incomplete' leaves abstract methods unimplemented"),
    ],
)
def test_an_unusable_policy_is_refused_with_the_reason(policy: object, says: str) -> None:
    with pytest.raises(UnknownPolicyError) as raised:
        resolve_policy(policy)
    assert str(raised.value) == says


def test_arc_reports_overlapping_lists_and_oversized_ghosts_or_target() -> None:
    fates: dict[Key, str] = {0: "T1", 1: "T2"}
    evictable = evictable_in(fates)
    overlap = arc_with(fates)
    overlap._b1.add(0, 1 << 40)  # a resident key that is also a ghost
    assert reported(overlap.check_invariants(evictable), r"ARC lists overlap: T1=.* B2=.*")
    too_many = arc_with(fates)
    for ghost in range(10, 11 + CAPACITY):
        too_many._b2.add(ghost, ghost << 3)
    too_far = arc_with(fates)
    too_far.p = CAPACITY + 1.0
    below = arc_with(fates)
    below.p = -1.0
    for broken in (too_many, too_far, below):  # each alone: ghosts, or the target
        problems = broken.check_invariants(evictable)
        assert reported(problems, r"ARC ghosts \d+, \d+ or p=.* exceed 3")
