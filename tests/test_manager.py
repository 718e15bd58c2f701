"""Unit tests of OffloadManager beyond the differential machine: stats, policy plug-ins,
constructor arguments, a policy that breaks its contract, key types, copies, and the cost
of choosing victims among pinned blocks.
"""

from __future__ import annotations

import copy
import dataclasses
import doctest
import itertools
from collections.abc import Callable, Container, Iterator, Sequence
from typing import Any

import pytest

import kvoffload.manager
from kvoffload.manager import OffloadManager
from kvoffload.policies import ArcPolicy, EvictionPolicy, LruPolicy, PolicyContractError
from kvoffload.policies.recency import unprotected
from kvoffload.stats import ManagerStats
from kvoffload_spec.errors import InvalidArgumentError, SpecViolation, UnknownPolicyError
from kvoffload_spec.surface import BlocksRemoved, BlocksStored, Key, Lookup, RemovalReason


def test_module_examples() -> None:
    assert doctest.testmod(kvoffload.manager).failed == 0


def stored(manager: OffloadManager, keys: Sequence[Key]) -> None:
    plan = manager.prepare_store(keys)
    assert plan is not None
    manager.complete_store(plan)


# -- stats -----------------------------------------------------------------------------------


def test_stats_count_what_happened() -> None:
    manager = OffloadManager(3)
    stored(manager, ["a", "b"])
    failing = manager.prepare_store(["c"])
    assert failing is not None
    manager.complete_store(failing, success=False)
    manager.lookup("a")
    manager.lookup("zz")
    pending = manager.prepare_store(["p"])
    manager.lookup("p")
    load = manager.prepare_load(["a", "a", "b"])
    assert manager.prepare_store(["x", "y"]) is None  # need 1, nothing evictable: O(1) refusal
    manager.complete_load(load)
    assert manager.prepare_store(["x", "a", "b"]) is None  # need 1, but a and b are protected
    stored(manager, ["x"])  # evicts a
    stats = manager.stats()
    assert (stats.resident, stats.pending, stats.pinned, stats.evictable, stats.free) == (
        3,
        1,
        0,
        2,
        0,
    )
    assert (stats.lookup_hits, stats.lookup_misses, stats.lookup_pending) == (1, 1, 1)
    assert (stats.blocks_stored, stats.failed_stores, stats.blocks_loaded) == (3, 1, 3)
    assert (stats.evictions, stats.rejected_stores, stats.fast_fail_rejections) == (1, 2, 1)
    assert stats.hit_ratio == pytest.approx(1 / 3)
    assert pending is not None
    manager.reset_cache()
    after = manager.stats()
    assert (after.resets, after.resident, after.free, after.evictions) == (1, 0, 3, 1)


def test_stats_gauges_while_pinned_and_pending() -> None:
    manager = OffloadManager(4, "arc")
    stored(manager, ["a", "b"])
    manager.prepare_load(["a"])
    manager.prepare_store(["c"])
    stats = manager.stats()
    assert (stats.resident, stats.pending, stats.pinned, stats.evictable, stats.free) == (
        3,
        1,
        1,
        1,
        1,
    )
    assert stats.resident + stats.free == stats.num_blocks == 4


def test_stats_is_a_frozen_snapshot() -> None:
    manager = OffloadManager(2)
    before = manager.stats()
    stored(manager, ["a"])
    assert before.resident == 0 and manager.stats().resident == 1
    assert before.hit_ratio == 0.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.resident = 5  # type: ignore[misc]
    assert isinstance(before, ManagerStats)


# -- policies: by name, by class, by "module:Class" ------------------------------------------


class Fifo(EvictionPolicy):
    """First in, first out; a policy of the user's own."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.may_go: dict[Key, bool] = {}

    def insert(self, key: Key) -> None:
        self.may_go[key] = False

    def remove(self, key: Key) -> None:
        del self.may_go[key]

    def mark_evictable(self, key: Key) -> None:
        self.may_go[key] = True

    def mark_unevictable(self, key: Key) -> None:
        self.may_go[key] = False

    def touch(self, keys: Sequence[Key], is_ready: Callable[[Key], bool]) -> None:
        pass

    def choose_victims(self, need: int, protected: Container[Key]) -> list[Key] | None:
        fit = [k for k, ok in self.may_go.items() if ok and k not in protected][:need]
        return fit if len(fit) == need else None

    def evict(self, victims: Sequence[Key]) -> None:
        for key in victims:
            del self.may_go[key]

    def clear(self) -> None:
        self.may_go.clear()

    def resident(self) -> list[Key]:
        return list(self.may_go)

    class Nested(LruPolicy):
        """Reachable as "module:Fifo.Nested"."""


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("lru", LruPolicy),
        ("arc", ArcPolicy),
        (Fifo, Fifo),
        (f"{__name__}:Fifo", Fifo),
        (f"{__name__}:Fifo.Nested", Fifo.Nested),
        ("kvoffload.policies.arc:ArcPolicy", ArcPolicy),
    ],
)
def test_policy_by_name_class_or_path(policy: Any, expected: type[EvictionPolicy]) -> None:
    manager = OffloadManager(2, policy)
    assert type(manager.policy) is expected
    assert manager.policy.capacity == 2
    stored(manager, ["a", "b"])
    manager.touch(["a"])
    plan = manager.prepare_store(["c"])
    assert plan is not None and len(plan.evicted_keys) == 1
    manager.check_invariants()


def test_a_user_policy_chooses_the_victims() -> None:
    manager = OffloadManager(2, Fifo)
    stored(manager, ["a", "b"])
    manager.touch(["a"])  # FIFO ignores it; LRU would now evict b
    plan = manager.prepare_store(["c"])
    assert plan is not None and plan.evicted_keys == ("a",)


class Refuses(Fifo):
    """A user's policy that finds no victim, however many blocks may go."""

    def choose_victims(self, need: int, protected: Container[Key]) -> list[Key] | None:
        return None


def test_a_user_policy_that_finds_no_victim_refuses_the_store_and_changes_nothing() -> None:
    manager = OffloadManager(2, Refuses)
    stored(manager, ["a", "b"])
    before = manager.stats()
    assert manager.prepare_store(["a", "c", "d"]) is None
    after = manager.stats()
    assert after.rejected_stores == before.rejected_stores + 1
    assert dataclasses.replace(after, rejected_stores=before.rejected_stores) == before
    assert [manager.lookup(key) for key in "abc"] == [Lookup.HIT, Lookup.HIT, Lookup.MISS]
    manager.check_invariants()


class Abstract(EvictionPolicy):
    """Forgets to implement the interface."""


@pytest.mark.parametrize(
    "policy",
    [
        "lfu",
        "",
        "LRU",
        None,
        5,
        LruPolicy(2),
        int,
        Abstract,
        "no_such_module_here:Policy",
        ":Fifo",
        f"{__name__}:Missing",
        f"{__name__}:Fifo.Missing",
        "json:dumps",
        f"{__name__}:Abstract",
    ],
)
def test_a_bad_policy_is_refused_before_anything_exists(policy: Any) -> None:
    with pytest.raises(UnknownPolicyError):
        OffloadManager(2, policy)


@pytest.mark.parametrize(
    "arguments",
    [
        {"num_blocks": 0},
        {"num_blocks": -3},
        {"num_blocks": True},
        {"num_blocks": 2.0},
        {"num_blocks": "4"},
        {"num_blocks": 2, "store_threshold": 0},
        {"num_blocks": 2, "max_tracker_size": 0},
        {"num_blocks": 2, "max_tracker_size": None},
        {"num_blocks": 2, "enable_events": 1},
    ],
)
def test_bad_constructor_arguments_are_refused(arguments: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgumentError):
        OffloadManager(**arguments)


# -- a policy that breaks its contract ---------------------------------------------------------


class Reckless(LruPolicy):
    """Returns whatever ``answer`` holds, ignoring pins and protection."""

    answer: list[Key] | None = None

    def choose_victims(self, need: int, protected: Container[Key]) -> list[Key] | None:
        return self.answer


@pytest.mark.parametrize(
    "answer",
    [
        ["pinned", "free"],
        ["pending", "free"],
        ["kept", "free"],
        ["absent", "free"],
        ["free", "free"],
        ["free"],
        [],
    ],
)
def test_an_illegal_choice_is_refused_and_nothing_changes(answer: list[Key]) -> None:
    manager = OffloadManager(5, Reckless)
    stored(manager, ["pinned", "free", "kept", "kept2"])
    manager.prepare_load(["pinned"])
    manager.prepare_store(["pending"])
    before = (manager.stats(), [manager.lookup(k) for k in ("pinned", "free", "new")])
    Reckless.answer = answer
    try:
        with pytest.raises(PolicyContractError, match="chose"):
            manager.prepare_store(["kept", "new", "new2"])  # needs two victims, not "kept"
    finally:
        Reckless.answer = None
    manager.check_invariants()
    after = (manager.stats(), [manager.lookup(k) for k in ("pinned", "free", "new")])
    assert dataclasses.replace(after[0], lookup_hits=0, lookup_misses=0, lookup_pending=0) == (
        dataclasses.replace(before[0], lookup_hits=0, lookup_misses=0, lookup_pending=0)
    )
    assert after[1] == before[1]


# -- events ------------------------------------------------------------------------------------


def test_events_tell_stores_evictions_failures_and_resets() -> None:
    manager = OffloadManager(2, enable_events=True)
    stored(manager, ["a", "b"])
    failing = manager.prepare_store(["c"])  # evicts a
    assert failing is not None
    manager.complete_store(failing, success=False)
    pending = manager.prepare_store(["d"])
    manager.reset_cache()  # b was ready, d still pending: only b is reported
    assert pending is not None
    manager.complete_store(pending)  # stale: changes nothing, says nothing
    assert manager.take_events() == [
        BlocksStored(("a", "b")),
        BlocksRemoved(("a",), RemovalReason.EVICTED),
        BlocksRemoved(("c",), RemovalReason.STORE_FAILED),
        BlocksRemoved(("b",), RemovalReason.RESET),
    ]
    assert manager.take_events() == []


def test_reset_reports_ready_keys_by_slot() -> None:
    manager = OffloadManager(3, enable_events=True)
    stored(manager, ["a", "b", "c"])
    manager.prepare_load(["a"])
    plan = manager.prepare_store(["d"])  # evicts b (a is pinned): d takes block id 1
    assert plan is not None and plan.block_ids == (1,)
    manager.complete_store(plan)
    manager.take_events()
    manager.reset_cache()
    assert manager.take_events() == [BlocksRemoved(("a", "d", "c"), RemovalReason.RESET)]


def test_events_are_off_by_default() -> None:
    manager = OffloadManager(1)
    stored(manager, ["a"])
    stored(manager, ["b"])
    assert manager.take_events() == []


# -- keys ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BlockHash:
    """An engine's own key type: hashable, never inspected by the manager."""

    digest: bytes
    layer_group: int


KEYS: list[Key] = [
    b"\x00" * 32,
    2**70,
    -1,
    "prefix/0",
    (1, b"x", ("nested",)),
    frozenset({1, 2}),
    BlockHash(b"abc", 0),
    BlockHash(b"abc", 1),
    None,
    3.5,
]


@pytest.mark.parametrize("policy", ["lru", "arc", "duel"])
def test_any_hashable_key_works(policy: str) -> None:
    manager = OffloadManager(len(KEYS) - 2, policy)
    stored(manager, KEYS[:-2])
    assert all(manager.lookup(key) is Lookup.HIT for key in KEYS[:-2])
    load = manager.prepare_load(KEYS[:3])
    manager.touch(list(reversed(KEYS)))
    plan = manager.prepare_store(KEYS[-2:])
    assert plan is not None and not set(plan.evicted_keys) & set(KEYS[:3])
    manager.complete_load(load)
    manager.check_invariants()


@pytest.mark.parametrize("bad", [[["list"]], [{"a": 1}], [b"ok", bytearray(b"no")], "abc", b"ab"])
def test_unhashable_keys_or_a_lone_string_are_refused(bad: Any) -> None:
    manager = OffloadManager(4)
    with pytest.raises(InvalidArgumentError):
        manager.prepare_store(bad)
    assert manager.stats().resident == 0
    with pytest.raises(InvalidArgumentError):
        manager.lookup([1])  # type: ignore[arg-type]


# -- recency -------------------------------------------------------------------------------------


def test_touch_makes_the_first_key_most_recent() -> None:
    manager = OffloadManager(3)
    stored(manager, ["a", "b", "c"])
    manager.touch(["a", "b"])
    assert manager.policy.resident() == ["c", "b", "a"]


@pytest.mark.parametrize("policy", ["lru", "arc", "duel"])
def test_pinning_does_not_change_recency(policy: str) -> None:
    manager = OffloadManager(3, policy)
    stored(manager, ["a", "b", "c"])
    manager.complete_load(manager.prepare_load(["a"]))
    plan = manager.prepare_store(["d"])
    assert plan is not None and plan.evicted_keys == ("a",)


# -- copies and invariants -----------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["lru", "arc", "duel"])
def test_a_deep_copy_is_independent_and_accepts_earlier_plans(policy: str) -> None:
    manager = OffloadManager(2, policy)
    stored(manager, ["a"])
    plan = manager.prepare_store(["b"])
    assert plan is not None
    clone = copy.deepcopy(manager)
    clone.complete_store(plan)
    stored(clone, ["c"])  # evicts a in the clone only
    assert manager.lookup("b") is Lookup.PENDING and manager.lookup("a") is Lookup.HIT
    assert clone.lookup("b") is Lookup.HIT and clone.lookup("a") is Lookup.MISS
    manager.complete_store(plan)
    manager.check_invariants()
    clone.check_invariants()


def corrupt_counter(manager: OffloadManager) -> None:
    manager._num_evictable += 1


def corrupt_refs(manager: OffloadManager) -> None:
    manager._refs[manager._block_id_of["a"]] = 2


def corrupt_free_slots(manager: OffloadManager) -> None:
    manager._freed.append(manager._block_id_of["a"])


def corrupt_policy(manager: OffloadManager) -> None:
    manager.policy.mark_unevictable("a")


def forget_a_pending_plan(manager: OffloadManager) -> None:
    manager._open_plans.clear()


@pytest.mark.parametrize(
    "corrupt",
    [corrupt_counter, corrupt_refs, corrupt_free_slots, corrupt_policy, forget_a_pending_plan],
)
@pytest.mark.parametrize("policy", ["lru", "arc", "duel"])
def test_check_invariants_notices_corruption(
    corrupt: Callable[[OffloadManager], None], policy: str
) -> None:
    manager = OffloadManager(4, policy)
    stored(manager, ["a", "b"])
    manager.prepare_store(["p"])
    manager.check_invariants()
    corrupt(manager)
    with pytest.raises(SpecViolation):
        manager.check_invariants()


def test_repr_names_the_policy_and_the_counts() -> None:
    manager = OffloadManager(3, "arc")
    stored(manager, ["a"])
    assert (
        repr(manager) == "OffloadManager(3, ArcPolicy, resident=1, pending=0, evictable=1, free=2)"
    )


# -- cost: the walk for victims never meets a pinned block ----------------------------------------


def counted(keys: Any) -> Iterator[Key]:
    """Iterate ``keys``, counting every key the walk looks at in ``counted.seen``."""
    for key in keys:
        counted.seen += 1  # type: ignore[attr-defined]
        yield key


class CountingLru(LruPolicy):
    def _candidates(self, protected: Container[Key]) -> Iterator[Key]:
        return unprotected(counted(self._evictable), protected)


class CountingArc(ArcPolicy):
    def _candidates(self, run: Any, protected: Container[Key]) -> Iterator[Key]:
        return super()._candidates(counted(run), protected)


@pytest.mark.parametrize("policy", [CountingLru, CountingArc])
def test_choosing_a_victim_walks_only_evictable_unprotected_keys(policy: Any) -> None:
    blocks = 20_000
    manager = OffloadManager(blocks, policy)
    stored(manager, list(range(blocks)))
    manager.touch(list(range(0, blocks, 2)))  # ARC: half the blocks move to T2
    pinned = [key for key in range(blocks) if key % 100]  # 99% pinned, spread everywhere
    manager.prepare_load(pinned)
    # the five least recent evictable keys, which the walk meets first
    order: list[Any] = manager.policy.resident()
    protected = [key for key in order if not key % 100][:5]
    counted.seen = 0  # type: ignore[attr-defined]
    plan = manager.prepare_store(["new", *protected])
    assert plan is not None and len(plan.evicted_keys) == 1
    # the five protected keys are stepped over, then the victim, plus one look-ahead per
    # list (ARC): never one of the 19,800 pinned blocks
    assert 6 <= counted.seen <= len(protected) + 3  # type: ignore[attr-defined]
    manager.check_invariants()


def test_a_full_pool_of_pending_blocks_is_refused_without_asking_the_policy() -> None:
    manager = OffloadManager(1_000, CountingLru)
    manager.prepare_store(list(range(1_000)))
    counted.seen = 0  # type: ignore[attr-defined]
    assert manager.prepare_store(["new"]) is None
    assert counted.seen == 0 and manager.stats().fast_fail_rejections == 1  # type: ignore[attr-defined]


def test_slots_are_reused_lowest_first() -> None:
    manager = OffloadManager(6)
    stored(manager, list("abcdef"))
    plan = manager.prepare_store(["x", "y"])  # evicts a and b: block ids 0 and 1 come back
    assert plan is not None and plan.block_ids == (0, 1)
    failing = manager.prepare_store([])
    assert failing is not None and failing.keys == () and failing.block_ids == ()
    assert list(itertools.islice(iter(manager.policy.resident()), 2)) == ["c", "d"]


# -- duel's sampled shadows ------------------------------------------------------------------


def test_duel_samples_keys_by_a_stable_hash() -> None:
    from kvoffload.policies.duel import sample_rate, stable_hash
    from kvoffload_spec.policies import duel_sample_rate, sample_hash

    keys: list[Key] = [0, 1, -5, 2**70, "a", "é\udc80", b"", b"\xffabc", ("t", 1), True]
    assert [stable_hash(key) for key in keys] == [sample_hash(key) for key in keys]
    assert sample_hash("a") == 0xE8B7BE43 and sample_hash(b"a") == 0xE8B7BE43  # crc32
    assert sample_hash(1) == 0x9E3779B9
    sizes = [1, 3, 1024, 2047, 2048, 4095, 4096, 8000, 64_000, 10**6]
    assert [sample_rate(n) for n in sizes] == [duel_sample_rate(n) for n in sizes]
    assert [duel_sample_rate(n) for n in sizes] == [1, 1, 1, 1, 2, 2, 4, 4, 32, 32]


def outside(protected: set[Key]) -> Callable[[Key], bool]:
    return lambda key: key not in protected


def test_sampled_duel_matches_the_spec() -> None:
    import random

    from kvoffload.policies.duel import DuelPolicy
    from kvoffload_spec.policies import DuelOrder

    capacity = 2048  # shadows sample one key in two
    policy, order = DuelPolicy(capacity), DuelOrder.empty(capacity)
    rng = random.Random(11)
    makers: list[Callable[[int, int], Key]] = [
        lambda root, i: root * 1000 + i,
        lambda root, i: f"{root}/{i}",
        lambda root, i: b"%d:%d" % (root, i),
    ]
    for step in range(400):
        root = rng.randrange(60)
        keys = [makers[root % 3](root, i) for i in range(rng.randrange(1, 60))]
        absent = [key for key in keys if key not in order.uses.last]
        need = len(absent) - (capacity - len(order.uses.last))
        if need > 0:
            protected = set(keys)
            victims = policy.choose_victims(need, protected)
            assert victims == order.choose_victims(need, outside(protected))
            assert victims is not None
            policy.evict(victims)
            order.evict(victims)
        for key in absent:
            policy.insert(key)
            policy.mark_evictable(key)
            order.insert(key)
        policy.touch(keys, lambda key: True)
        order.touch(keys, lambda key: True)
        if step % 50 == 49:
            assert policy.snapshot() == order.snapshot()
    assert policy.leader == order.leader
    assert all(0 < len(shadow.uses.last) <= capacity // 2 for shadow in order.shadows)
