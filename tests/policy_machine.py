"""A state machine that feeds one policy and the spec's order the same calls, through the
policy interface directly (what a manager never does: remove a pinned key, say), and
compares them through the policy's part of the refinement mapping. tests/test_policies.py
and tests/test_duel.py run it for each built-in policy."""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvoffload.policies.base import EvictionPolicy
from kvoffload_spec.policies import PolicyOrder
from kvoffload_spec.surface import Key

CAPACITY = 3  # ghosts are trimmed to this
KEYS = list(range(5))  # more than CAPACITY: ghosts, and touches of absent keys

# -- each policy against the spec's order, on any history of its interface --------------------


class PolicyAgainstSpec(RuleBasedStateMachine):
    """A policy and the spec's order, fed the same calls. ``status`` is what the manager
    would know of each resident key: "pending", "ready" (evictable) or "pinned". Each rule
    applies only where it has a key to act on, so that no step is wasted.
    """

    policy: EvictionPolicy
    order: PolicyOrder

    def __init__(self) -> None:
        super().__init__()
        self.status: dict[Key, str] = {}

    def evictable(self, key: Key) -> bool:
        return self.status.get(key) == "ready"

    def ready(self, key: Key) -> bool:
        return self.status.get(key) in ("ready", "pinned")

    def keys_in(self, *states: str) -> list[Key]:
        return [key for key, status in self.status.items() if status in states]

    def pick(self, data: st.DataObject, *states: str) -> Key:
        return data.draw(st.sampled_from(self.keys_in(*states)))

    @precondition(lambda self: len(self.status) < len(KEYS))
    @rule(data=st.data())
    def insert(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from([key for key in KEYS if key not in self.status]))
        self.policy.insert(key)
        self.order.insert(key)
        self.status[key] = "pending"

    @precondition(lambda self: self.keys_in("pending"))
    @rule(data=st.data())
    def store_completes(self, data: st.DataObject) -> None:
        key = self.pick(data, "pending")
        self.policy.mark_evictable(key)
        self.status[key] = "ready"

    @precondition(lambda self: self.keys_in("ready"))
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        key = self.pick(data, "ready")
        self.policy.mark_unevictable(key)
        self.status[key] = "pinned"

    @precondition(lambda self: self.keys_in("pinned"))
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        key = self.pick(data, "pinned")
        self.policy.mark_evictable(key)
        self.status[key] = "ready"

    # The batch forms the manager calls, on several keys of one state at once.

    def some(self, data: st.DataObject, keys: list[Key]) -> list[Key]:
        return data.draw(st.lists(st.sampled_from(keys), min_size=1, unique=True))

    @precondition(lambda self: len(self.status) < len(KEYS))
    @rule(data=st.data())
    def insert_each(self, data: st.DataObject) -> None:
        keys = self.some(data, [key for key in KEYS if key not in self.status])
        self.policy.insert_each(keys)
        for key in keys:
            self.order.insert(key)
            self.status[key] = "pending"

    @precondition(lambda self: self.keys_in("pending", "pinned"))
    @rule(data=st.data())
    def mark_evictable_each(self, data: st.DataObject) -> None:
        """Stores completing and loads finishing, mixed, as one batch."""
        keys = self.some(data, self.keys_in("pending", "pinned"))
        self.policy.mark_evictable_each(keys)
        self.status.update(dict.fromkeys(keys, "ready"))

    @precondition(lambda self: self.keys_in("ready"))
    @rule(data=st.data())
    def mark_unevictable_each(self, data: st.DataObject) -> None:
        keys = self.some(data, self.keys_in("ready"))
        self.policy.mark_unevictable_each(keys)
        self.status.update(dict.fromkeys(keys, "pinned"))

    @precondition(lambda self: self.keys_in("pending", "pinned"))
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        """Any key that is not evictable: pending, or pinned (the interface allows it,
        though the manager only removes keys whose store failed).
        """
        key = self.pick(data, "pending", "pinned")
        self.policy.remove(key)
        self.order.remove(key)
        del self.status[key]

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=3))
    def touch(self, keys: list[int]) -> None:
        self.policy.touch(keys, self.ready)
        self.order.touch(keys, self.ready)

    @rule(need=st.integers(1, 3), protected=st.sets(st.sampled_from(KEYS), max_size=2))
    def evict(self, need: int, protected: set[int]) -> None:
        chosen = self.policy.choose_victims(need, protected)
        expected = self.order.choose_victims(
            need, lambda key: self.evictable(key) and key not in protected
        )
        assert chosen == expected
        if chosen is not None:
            self.policy.evict(chosen)
            self.order.evict(chosen)
            for victim in chosen:
                del self.status[victim]

    @precondition(lambda self: len(self.status) == len(KEYS))  # rarely: it wipes the state
    @rule()
    def clear(self) -> None:
        self.policy.clear()
        self.order.clear()
        self.status.clear()

    @invariant()
    def agree(self) -> None:
        stands_for(self.policy, self.order)
        assert self.policy.check_invariants(self.evictable) == []


def stands_for(policy: EvictionPolicy, order: PolicyOrder) -> None:
    """The policy's structures stand for exactly ``order``: its abstraction has the spec
    order's fingerprint (LRU: the order; ARC: T1, T2, B1, B2 in order, and ``p``)."""
    mine = policy.abstract_order()
    assert mine is not None and mine.fingerprint() == order.fingerprint(), (mine, order)
