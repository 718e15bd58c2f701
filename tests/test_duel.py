"""The dueling policy against the spec's ``DuelOrder``, outside the manager.

The differential test reaches ``duel`` only through the manager, whose shadows almost
never lead by exactly the other's score, and never looks at what ``check_invariants`` says
about a broken duel. So here: the policy and the spec's order fed every history of the
policy interface (each order leading, ties, longer touches than the pool holds); the
shadows' stores, refusals and histories on hand-made requests; and each of ``check_invariants``'s
reports on a corrupted policy.
"""

from __future__ import annotations

import itertools
import random
import zlib
from collections.abc import Callable

from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule, run_state_machine_as_test

from kvoffload.policies.duel import HISTORY, DuelPolicy, _ByLast, stable_hash
from kvoffload.sharded import ShardedDict
from kvoffload_spec.policies import DUEL_DECAY, DUEL_ORDERS, DuelOrder, sample_hash
from kvoffload_spec.surface import Key
from tests.policy_machine import CAPACITY, KEYS, PolicyAgainstSpec


class DuelAgainstSpec(PolicyAgainstSpec):
    def __init__(self) -> None:
        super().__init__()
        self.duel = self.policy = DuelPolicy(CAPACITY)
        self.duel_order = self.order = DuelOrder.empty(CAPACITY)

    @rule(scores=st.tuples(*[st.sampled_from([1.0, 2.0])] * len(DUEL_ORDERS)))
    def set_lead(self, scores: tuple[float, ...]) -> None:
        """Scores set outright, so that any order (or a tie) picks the next victims."""
        for shadow, score in zip(self.duel._shadows, scores, strict=True):
            shadow.score = score
        for pool, score in zip(self.duel_order.shadows, scores, strict=True):
            pool.score = score

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=CAPACITY + 1, max_size=len(KEYS)))
    def touch_more_than_fits(self, keys: list[int]) -> None:
        """A request longer than the pool: the shadows refuse its store."""
        self.duel.touch(keys, self.ready)
        self.duel_order.touch(keys, self.ready)

    @invariant()
    def same_state(self) -> None:
        assert self.duel.snapshot() == self.duel_order.snapshot()
        assert self.duel.leader == self.duel_order.leader


def test_duel_policy_is_the_spec_order() -> None:
    run_state_machine_as_test(DuelAgainstSpec)


def always(_: Key) -> bool:
    return True


def filled(keys: list[Key], capacity: int = CAPACITY) -> tuple[DuelPolicy, DuelOrder]:
    """A policy and the spec's order holding ``keys``, each stored and ready."""
    policy, order = DuelPolicy(capacity), DuelOrder.empty(capacity)
    for key in keys:
        policy.insert(key)
        policy.mark_evictable(key)
        order.insert(key)
    return policy, order


def test_the_reuse_order_puts_keys_used_once_first_each_part_by_last_use() -> None:
    policy, order = filled(["a", "b", "c", "d"], capacity=4)
    policy.touch(["c", "a"], always)  # a and c used again: a is touched last, most recent
    order.touch(["c", "a"], always)
    assert policy.orders() == [["b", "d", "a", "c"]] * 3
    policy.touch(["b"], lambda key: False)  # pending when touched: recency, not reuse
    assert policy.orders()[:2] == [["d", "a", "c", "b"], ["d", "b", "a", "c"]]
    policy.touch(["d"], always)
    assert policy.orders()[:2] == [["a", "c", "b", "d"], ["b", "a", "c", "d"]]
    policy.mark_unevictable("a")  # pinned: out of every order, back in its place after
    assert policy.orders()[:2] == [["c", "b", "d"], ["b", "c", "d"]]
    policy.mark_evictable("a")
    assert policy.orders()[:2] == [["a", "c", "b", "d"], ["b", "a", "c", "d"]]


def test_lru2_orders_the_reused_keys_by_their_second_most_recent_use() -> None:
    policy, order = filled(["a", "b", "c", "d"], capacity=4)
    for request in (["a"], ["b"], ["a"], ["c"]):  # b's two uses are the furthest apart
        policy.touch(request, always)
        order.touch(request, always)
    # Used once: d. Reused, by the second most recent use: b (at its store), c (at its
    # store, after b's), a (at its first touch); LRU would say b, a, c.
    assert policy.orders()[2] == ["d", "b", "c", "a"] == order.uses.by_second_use()
    policy.touch(["b"], lambda key: False)  # pending when touched: no new second use
    assert policy.orders()[2] == ["d", "b", "c", "a"]
    policy.evict(["b"])
    policy.insert("b")  # stored again: its last use before it left is its second
    policy.mark_evictable("b")
    assert policy.orders()[2] == ["d", "c", "a", "b"]
    assert policy.check_invariants(always) == []


def test_victims_follow_the_leading_shadow_and_lru_on_a_tie() -> None:
    policy, _ = filled(["a", "b"], capacity=4)
    policy.touch(["a"], always)  # reused, and now more recent than b
    for key in ("c", "d"):
        policy.insert(key)
        policy.mark_evictable(key)
    lru, reuse, lru2 = policy._shadows
    assert policy.orders()[:2] == [["b", "a", "c", "d"], ["b", "c", "d", "a"]]
    assert policy.choose_victims(2, ()) == ["b", "a"]  # LRU
    assert policy.choose_victims(2, {"b"}) == ["a", "c"]
    reuse.score = lru.score + 1
    assert (policy.leader, policy.scores) == ("reuse", (lru.score, lru.score + 1, lru2.score))
    assert policy.choose_victims(2, ()) == ["b", "c"]
    assert policy.choose_victims(3, {"c"}) == ["b", "d", "a"]
    assert policy.choose_victims(4, {"a"}) is None
    lru2.score = reuse.score  # a tie goes to the earlier order
    assert policy.leader == "reuse"
    lru2.score += 1
    assert policy.leader == "lru2"
    lru.score = reuse.score = lru2.score
    assert (policy.leader, policy.choose_victims(2, ())) == ("lru", ["b", "a"])


def test_the_policy_knows_its_capacity_and_its_shadows_theirs() -> None:
    policy = DuelPolicy(8192)
    assert policy.capacity == 8192
    assert [(shadow.capacity, shadow.mask, shadow.order) for shadow in policy._shadows] == [
        (1024, 7, "lru"),
        (1024, 7, "reuse"),
        (1024, 7, "lru2"),
    ]
    assert [shadow.uses.limit for shadow in policy._shadows] == [0, *[HISTORY * 1024] * 2]
    assert policy._uses.limit == HISTORY * 8192


class OddRepr:
    """A key whose repr is not valid UTF-8 on its own (a lone surrogate)."""

    def __hash__(self) -> int:
        return 1

    def __repr__(self) -> str:
        return "k\udc80"


def test_a_key_whose_repr_cannot_be_encoded_is_hashed_with_escapes() -> None:
    assert stable_hash(OddRepr()) == sample_hash(OddRepr()) == zlib.crc32(b"k\\udc80")


def test_an_evicted_key_stored_again_is_reused_while_the_history_remembers_it() -> None:
    capacity = 2
    policy, _ = filled(["a", "b"], capacity)
    policy.evict(["a"])
    assert list(policy._uses.history) == ["a"]
    policy.insert("a")
    policy.mark_evictable("a")
    assert policy.orders()[1] == ["b", "a"]  # a counts as reused: b goes first
    assert list(policy._uses.history) == []
    bound = HISTORY * capacity
    gone = [f"g{i}" for i in range(bound + 1)]
    for key in gone:
        policy.insert(key)
        policy.mark_evictable(key)
        policy.evict([key])
    assert list(policy._uses.history) == gone[1:]  # the oldest is forgotten first
    policy.insert(gone[0])
    policy.mark_evictable(gone[0])
    assert policy.orders()[1] == ["b", gone[0], "a"]  # forgotten: used once
    policy.insert(gone[1])
    policy.mark_evictable(gone[1])
    assert policy.orders()[1] == ["b", gone[0], "a", gone[1]]  # remembered: reused


def test_a_failed_store_leaves_no_history() -> None:
    policy = DuelPolicy(CAPACITY)
    policy.insert("a")
    policy.remove("a")
    policy.insert("a")
    policy.mark_evictable("a")
    assert list(policy._uses.history) == [] and policy.orders() == [["a"]] * 3


def test_a_shadow_scores_the_longest_resident_prefix_and_decays() -> None:
    policy, order = DuelPolicy(4), DuelOrder.empty(4)
    for request in (["a", "b", "c"], ["a", "b", "x"], ["z", "a"], ["a", "b", "x", "y"]):
        policy.touch(request, always)
        order.touch(request, always)
    hits = [0, 2, 0, 3]  # the second request's "x", the third's "z" were missing
    expected = 0.0
    for count in hits:
        expected = expected * DUEL_DECAY + count
    assert policy.scores[0] == expected == order.shadows[0].score
    assert policy.snapshot() == order.snapshot()


def test_a_shadow_refuses_a_store_that_cannot_fit_and_still_counts_the_touch() -> None:
    policy, order = DuelPolicy(2), DuelOrder.empty(2)
    steps = (["a", "b"], ["a", "b", "c"], ["b", "a"], ["c", "d"], ["d", "a", "b"])
    for request in steps:
        policy.touch(request, always)
        order.touch(request, always)
        assert policy.snapshot() == order.snapshot(), request
    lru, reuse, lru2 = policy._shadows
    # ["a", "b", "c"] did not fit: "a" and "b" were touched again (so reused), "c" never
    # stored; ["c", "d"] then evicted both; ["d", "a", "b"] did not fit either.
    assert [shadow.uses.everything(shadow.order) for shadow in policy._shadows] == [["c", "d"]] * 3
    assert list(reuse.uses.history) == ["a", "b"]
    assert list(lru2.uses.history) == ["b", "a"]  # b's two uses are further apart
    assert list(lru.uses.history) == []


def test_the_shadows_keep_only_the_sampled_keys_in_a_smaller_pool() -> None:
    capacity = 4096  # one key in four
    policy, order = DuelPolicy(capacity), DuelOrder.empty(capacity)
    keys = list(range(3000))
    policy.touch(keys, always)
    order.touch(keys, always)
    lru, reuse, lru2 = policy._shadows
    assert lru.capacity == reuse.capacity == lru2.capacity == 1024 and lru.mask == 3
    sampled = lru.uses.everything("lru")
    assert sampled == [key for key in reversed(keys) if key in order.shadows[0].uses.last]
    assert 0 < len(sampled) <= 1024
    assert reuse.uses.everything("reuse") == sampled == lru2.uses.everything("lru2")
    assert policy.snapshot() == order.snapshot()


def test_clear_forgets_keys_histories_and_scores() -> None:
    policy, _ = filled(["a", "b", "c"])
    policy.touch(["a", "b"], always)
    policy.touch(["a", "b"], always)
    policy.evict(["c"])
    policy.clear()
    assert policy.snapshot() == ([[], [], []], [], [[], [], []], [[], [], []], (0.0, 0.0, 0.0))
    policy.insert("c")
    policy.mark_evictable("c")
    assert policy.orders() == [["c"]] * 3 and policy.check_invariants(always) == []


# -- what check_invariants says about a broken duel -------------------------------------------


def broken(corrupt: Callable[[DuelPolicy], None]) -> list[str]:
    policy, _ = filled(["a", "b", "c"])
    policy.touch(["b"], always)
    policy.evict(["a"])
    assert policy.check_invariants(lambda key: key != "a") == []
    corrupt(policy)
    return policy.check_invariants(lambda key: key != "a")


def test_a_key_in_the_wrong_list_is_reported() -> None:
    def swap(policy: DuelPolicy) -> None:
        uses = policy._uses
        uses.reused.remove("b")
        uses.stamps["b"] -= 1  # used once, as far as the stamp says, but listed as reused
        uses.reused.add("b")

    assert "duel lists a key used once as reused, or the reverse" in broken(swap)


def test_a_reused_key_among_the_keys_used_once_is_reported() -> None:
    def swap(policy: DuelPolicy) -> None:
        uses = policy._uses
        uses.once.remove("c")
        uses.stamps["c"] += 1
        uses.once.add("c")

    assert "duel lists a key used once as reused, or the reverse" in broken(swap)


def test_a_second_use_kept_for_a_key_used_once_is_reported() -> None:
    def stray(policy: DuelPolicy) -> None:
        policy._uses.stamps["c"] |= 1 << 41

    assert "duel keeps a second use for a key used once" in broken(stray)


def test_a_reused_key_missing_from_the_lru2_order_is_reported() -> None:
    def lose(policy: DuelPolicy) -> None:
        paired = policy._uses.paired
        assert paired is not None
        paired.remove("b")

    expected = "duel's evictable orders are [['c', 'b'], ['c', 'b'], ['c']], expected "
    assert broken(lose) == [expected + "[['c', 'b'], ['c', 'b'], ['c', 'b']]"]


def test_an_evictable_key_missing_from_its_list_is_reported() -> None:
    problems = broken(lambda policy: policy._uses.once.remove("c"))
    expected = "[['c', 'b'], ['c', 'b'], ['c', 'b']]"
    assert problems == [f"duel's evictable orders are [['b'], ['b'], ['b']], expected {expected}"]


def test_an_overfull_history_is_reported() -> None:
    def overfill(policy: DuelPolicy) -> None:
        for key in itertools.islice(itertools.count(100), policy._uses.limit):
            policy._uses.history.append(key)

    assert broken(overfill) == ["duel's history exceeds its bound"]


def test_a_full_history_is_not_overfull() -> None:
    def fill(policy: DuelPolicy) -> None:
        for key in itertools.islice(itertools.count(100), policy._uses.limit - 1):
            policy._uses.history.append(key)

    assert broken(fill) == []


def test_a_resident_key_in_the_history_is_reported() -> None:
    problems = broken(lambda policy: policy._uses.history.append("b"))
    assert problems == ["a resident key is in duel's history"]


def test_the_reused_keys_by_last_use_stay_ordered_when_keys_arrive_older() -> None:
    """``_ByLast``, the LRU-2 pool's list of reused keys by last use, over several buckets:
    keys added out of order (as unpinned keys return) and removed until buckets empty."""
    stamps: ShardedDict[Key, int] = ShardedDict(64)
    listed = _ByLast(stamps)
    ticks = list(range(0, 3000, 3))
    random.Random(7).shuffle(ticks)
    for number, tick in enumerate(ticks):  # second uses in the high bits, in no order
        stamps[f"k{tick}"] = (number % 5) << 41 | tick << 1 | 1
        listed.add(f"k{tick}")
    by_last = [f"k{tick}" for tick in sorted(ticks)]
    assert list(listed) == by_last and len(listed) == len(ticks)
    for key in by_last[::2] + by_last[1:600:2]:
        listed.remove(key)
    kept = by_last[601::2]
    assert list(listed) == kept and len(listed) == len(kept)
    assert kept[0] in listed and by_last[0] not in listed and "absent" not in listed
    listed.clear()
    assert list(listed) == [] and len(listed) == 0
