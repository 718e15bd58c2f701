"""The state of the offloading manager and its transitions, with their contracts.

This is the heart of the spec. :class:`SpecState` takes all of its state in the constructor,
so that a checker (CrossHair) can build arbitrary states; :func:`invariant_violations` says
which of them are reachable-shaped. Each transition opens with ``assert`` preconditions (what
the caller, :class:`~kvoffload_spec.model.OffloadModel`, has validated) and closes with
``assert`` postconditions. Those asserts are the contract, not input validation: the public
model raises typed errors before it ever calls a transition. One precondition is common to
every transition and not asserted at its entry: the state satisfies every invariant. Each
checker that drives a state (the explorer, the lockstep driver, the CrossHair contracts)
checks ``invariant_violations`` after every call, so the state a transition starts from has
been checked already; asserting it again at each entry doubled the checkers' largest cost.
What a postcondition compares with (a snapshot taken before the change) is taken only
``if __debug__``: under ``python -O`` the asserts are gone, and so is their cost.

Block states::

    absent --prepare_store--> pending --complete_store(ok)----> ready(refs=0)
       ^                        |                               |   ^
       |                        +--complete_store(failed)--+    |   | prepare_load: refs+1
       |                                                   |    |   | complete_load: refs-1
       +----- evicted (only ready with refs == 0) ---------+----+
       +----- reset_cache (every state) -------------------+
       +----- abandon (pending: its block id is quarantined) --+

``abandon(plan)`` gives up waiting for a plan's job (one that stalled): a load's pins are
released at once, a store's pending keys become absent at once, but the block ids the store's
job may still write are *quarantined* (neither free nor resident) until the plan's late
completion says the job is over. So no block id is handed out while an old job might write it.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvoffload_spec.defaults import DEFAULT_MAX_TRACKER_SIZE
from kvoffload_spec.policies import (
    DUEL_HISTORY,
    ArcOrder,
    DuelOrder,
    LruOrder,
    PolicyOrder,
    in_sample,
)
from kvoffload_spec.surface import (
    BlocksRemoved,
    BlocksStored,
    Event,
    Key,
    LoadPlan,
    Lookup,
    PlanT,
    RemovalReason,
    StorePlan,
)


@dataclass
class Block:
    """A resident block. ``store_plan`` is the id of its in-flight store while it is pending,
    None once it is ready. ``refs`` counts the loads reading it (only ready blocks have any).
    """

    block_id: int
    refs: int = 0
    store_plan: int | None = None

    @property
    def ready(self) -> bool:
        return self.store_plan is None


@dataclass
class SpecState:
    num_blocks: int
    order: PolicyOrder
    blocks: dict[Key, Block] = field(default_factory=dict)
    free_block_ids: list[int] = field(default_factory=list)  # ascending
    num_evictable: int = 0
    generation: int = 0
    open_plans: dict[int, StorePlan | LoadPlan] = field(default_factory=dict)
    next_plan_id: int = 0
    store_threshold: int = 1
    max_tracker_size: int = DEFAULT_MAX_TRACKER_SIZE
    offers: dict[Key, int] = field(default_factory=dict)  # least recently offered first
    events: list[Event] | None = None
    owner: int = 0
    # abandoned plan id -> the block ids it quarantines (those its store job may still write)
    abandoned: dict[int, list[int]] = field(default_factory=dict)

    @staticmethod
    def empty(
        num_blocks: int,
        order: PolicyOrder,
        store_threshold: int = 1,
        max_tracker_size: int = DEFAULT_MAX_TRACKER_SIZE,
        enable_events: bool = False,
        owner: int = 0,
    ) -> SpecState:
        return SpecState(
            num_blocks=num_blocks,
            order=order,
            free_block_ids=list(range(num_blocks)),
            store_threshold=store_threshold,
            max_tracker_size=max_tracker_size,
            events=[] if enable_events else None,
            owner=owner,
        )

    # -- derived views -------------------------------------------------------------------

    def evictable(self, key: Key) -> bool:
        block = self.blocks.get(key)
        return block is not None and block.ready and block.refs == 0

    def count_evictable(self) -> int:
        """What the ``num_evictable`` counter must always equal (invariant 1)."""
        return sum(1 for block in self.blocks.values() if block.ready and block.refs == 0)

    def _pending_on(self, key: Key, plan_id: int) -> bool:
        block = self.blocks.get(key)
        return block is not None and block.store_plan == plan_id

    def lookup(self, key: Key) -> Lookup:
        block = self.blocks.get(key)
        if block is None:
            return Lookup.MISS
        return Lookup.HIT if block.ready else Lookup.PENDING

    def is_abandoned(self, plan: StorePlan | LoadPlan) -> bool:
        """Whether ``plan`` was abandoned and its (late) completion has not come yet.

        Pre: ``plan`` was issued by this state (open, or completed already).
        True from ``abandon(plan)`` until ``complete_*(plan)``, whatever resets came
        between (a reset makes the plan stale, not less abandoned: its job is still due to
        report, and a store's quarantine lasts until it does); False before ``abandon``,
        for a plan never abandoned, and once the plan is completed (closed, it holds
        nothing). Only an open plan can be abandoned (invariant 10), so a closed plan's id
        is never in ``abandoned``.
        """
        assert 0 <= plan.plan_id < self.next_plan_id
        return plan.plan_id in self.abandoned

    def quarantined(self) -> list[int]:
        """The block ids abandoned store jobs may still write: neither free nor resident."""
        return [block_id for block_ids in self.abandoned.values() for block_id in block_ids]

    def snapshot(self) -> str:
        """Everything a caller can observe, or a failed call could have disturbed."""
        return repr(self)

    # -- helpers of the transitions --------------------------------------------------------

    def _emit(self, event: Event) -> None:
        if self.events is not None and event.keys:
            self.events.append(event)

    def _open(self, plan: PlanT) -> PlanT:
        self.next_plan_id += 1
        self.open_plans[plan.plan_id] = plan
        return plan

    def _block_id_of(self, key: Key) -> int:
        return self.blocks[key].block_id

    def _free(self, block_id: int) -> None:
        bisect.insort(self.free_block_ids, block_id)

    def _record_offers(self, keys: Sequence[Key]) -> None:
        """The tracker behind ``store_threshold``: offers per key of the call (``keys``, each
        once; resident keys too: an offer of a resident key is a reuse), bounded in size.

        A key already tracked counts one more offer and becomes the most recently offered
        (in call order); then each new key is recorded with one offer, forgetting the least
        recently offered key *outside this call* when the tracker is full, or not recorded
        at all when every tracked key is of this call: the keys of one offer never push
        each other out. An observation, not cache state: recorded also when the store then
        fails.
        """
        tracked = [key for key in keys if key in self.offers]
        for key in tracked:
            self.offers[key] = self.offers.pop(key) + 1
        for key in keys:
            if key in tracked:
                continue
            if len(self.offers) >= self.max_tracker_size:
                outside = [old for old in self.offers if old not in keys]
                if not outside:
                    continue
                del self.offers[outside[0]]
            self.offers[key] = 1

    # -- transitions -----------------------------------------------------------------------

    def prepare_store(
        self, keys: Sequence[Key], seen_misses: set[Key] | None = None
    ) -> StorePlan | None:
        """Plan to store the absent ``keys``, evicting what the policy chooses to make room.
        The policy hears the candidates' store misses, those in ``seen_misses`` excepted
        (which then holds them all).

        Pre: the state satisfies every invariant (checked after the previous call).
        Post, on None: no cache state changed (only the observations may have: the offer
        tracker, and ARC's ghost hits).
        Post, on a plan: victims were ready, unpinned and not among ``keys``; they are now
        absent; the candidates are pending in the lowest free block ids, in call order; the
        evictable counter dropped by exactly the number of victims.
        """
        distinct = list(dict.fromkeys(keys))
        absent = [key for key in distinct if key not in self.blocks]
        resident = [key for key in distinct if key in self.blocks]
        if self.store_threshold >= 2:
            self._record_offers(distinct)
            candidates = [k for k in absent if self.offers.get(k, 0) >= self.store_threshold]
        else:
            candidates = absent
        # Before anything is evicted or inserted (insert drops a ghost), and also when the
        # store is then refused: what the request asked for is an observation.
        if seen_misses is None:
            self.order.on_store_miss(candidates)
        else:
            heard = [key for key in candidates if key not in seen_misses]
            self.order.on_store_miss(heard)
            seen_misses.update(heard)
        evictable_before = self.num_evictable
        need = len(candidates) - len(self.free_block_ids)
        victims: list[Key] = []
        if need > 0:
            # The guard of vLLM PR #45757: fail in O(1), without asking the policy, when
            # even evicting every evictable block could not make room.
            if need > self.num_evictable:
                return None
            protected = set(distinct)  # a key of this call must survive it
            chosen = self.order.choose_victims(
                need, lambda key: self.evictable(key) and key not in protected
            )
            if chosen is None:
                return None
            victims = chosen
        evicted_block_ids: list[int] = []
        for key in victims:
            assert self.evictable(key) and key not in distinct
            evicted_block_ids.append(self.blocks.pop(key).block_id)
            self._free(evicted_block_ids[-1])
            self.num_evictable -= 1
        self.order.evict(victims)
        self._emit(BlocksRemoved(tuple(victims), RemovalReason.EVICTED))
        block_ids = self.free_block_ids[: len(candidates)]
        del self.free_block_ids[: len(candidates)]
        plan_id = self.next_plan_id
        for key, block_id in zip(candidates, block_ids, strict=True):
            self.blocks[key] = Block(block_id, store_plan=plan_id)
            self.order.insert(key)
        assert self.num_evictable == evictable_before - len(victims)
        assert all(self.lookup(key) is Lookup.PENDING for key in candidates)
        assert all(key in self.blocks for key in resident)
        return self._open(
            StorePlan(
                tuple(candidates),
                tuple(block_ids),
                tuple(victims),
                plan_id,
                self.generation,
                self.owner,
                tuple(evicted_block_ids),
            )
        )

    def complete_store(self, plan: StorePlan, success: bool) -> None:
        """The store job of ``plan`` finished.

        Pre: ``plan`` is open (issued by this state, not completed yet).
        Post: the plan is closed. If it was abandoned, the block ids it quarantined are free
        and nothing else changed (its job can no longer write them; ``success`` does not
        matter: its keys were dropped when it was abandoned). Else, if it is stale (made
        before a reset) nothing else changed. Otherwise each of its blocks that still
        belongs to it became ready with no refs (success; the counter rose by one each) or
        absent with its block id free (failure).
        """
        assert self.open_plans.get(plan.plan_id) == plan
        del self.open_plans[plan.plan_id]
        if plan.plan_id in self.abandoned:
            for block_id in self.abandoned.pop(plan.plan_id):
                self._free(block_id)
            return
        if plan.generation != self.generation:
            return  # the ABA guard: these keys may have been stored again since the reset
        evictable_before = self.num_evictable
        done = [k for k in plan.keys if self._pending_on(k, plan.plan_id)]
        for key in done:
            block = self.blocks[key]
            if success:
                block.store_plan = None
                self.num_evictable += 1
            else:
                del self.blocks[key]
                self._free(block.block_id)
                self.order.remove(key)
        if success:
            self._emit(BlocksStored(tuple(done)))
            assert self.num_evictable == evictable_before + len(done)
            assert all(self.lookup(key) is Lookup.HIT for key in done)
        else:
            self._emit(BlocksRemoved(tuple(done), RemovalReason.STORE_FAILED))
            assert self.num_evictable == evictable_before
            assert all(self.lookup(key) is Lookup.MISS for key in done)

    def prepare_load(self, keys: Sequence[Key]) -> LoadPlan:
        """Pin each of ``keys`` (once per occurrence) so that it cannot be evicted while read.

        Pre: every key is ready.
        Post: each key's refs rose by its number of occurrences; the counter fell by the
        number of distinct keys that had no refs before.
        """
        assert all(self.lookup(key) is Lookup.HIT for key in keys)
        newly_pinned = 0
        if __debug__:
            newly_pinned = sum(1 for key in set(keys) if self.blocks[key].refs == 0)
        evictable_before = self.num_evictable
        for key in keys:
            block = self.blocks[key]
            if block.refs == 0:
                self.num_evictable -= 1
            block.refs += 1
        assert self.num_evictable == evictable_before - newly_pinned
        return self._open(
            LoadPlan(
                tuple(keys),
                tuple(self.blocks[key].block_id for key in keys),
                self.next_plan_id,
                self.generation,
                self.owner,
            )
        )

    def complete_load(self, plan: LoadPlan) -> None:
        """The load job of ``plan`` finished: unpin what it pinned.

        Pre: ``plan`` is open.
        Post: the plan is closed; unless it is stale or was abandoned (which released its
        pins already), each key's refs fell by its number of occurrences, and a block left
        with no refs is evictable again.
        """
        assert self.open_plans.get(plan.plan_id) == plan
        del self.open_plans[plan.plan_id]
        if self.abandoned.pop(plan.plan_id, None) is None and plan.generation == self.generation:
            self._unpin(plan)

    def _unpin(self, plan: LoadPlan) -> None:
        # Pinned blocks cannot be evicted and only a reset (which makes the plan stale) drops
        # them, so every key of a current load plan is still resident and pinned.
        assert all(self.blocks[key].refs > 0 for key in plan.keys)
        evictable_before = self.num_evictable
        for key in plan.keys:
            block = self.blocks[key]
            block.refs -= 1
            if block.refs == 0:
                self.num_evictable += 1
        released = 0
        if __debug__:
            released = sum(1 for key in set(plan.keys) if self.blocks[key].refs == 0)
        assert self.num_evictable == evictable_before + released

    def abandon(self, plan: StorePlan | LoadPlan) -> None:
        """Give up waiting for the job of ``plan`` (it stalled): release what it holds now.

        Pre: ``plan`` is open and not abandoned.
        Post: the plan is still open (its job may still report: completing it is then
        due, once) and abandoned. If it is stale nothing else changed. A current load
        plan's pins were released, as by ``complete_load``. A current store plan's keys
        (all still pending on it) are absent, as after a failed store, but their block ids are
        quarantined, not free: the job may still write them. No free block id changed.
        """
        assert self.open_plans.get(plan.plan_id) == plan
        assert plan.plan_id not in self.abandoned
        free_before = list(self.free_block_ids) if __debug__ else []
        quarantine: list[int] = []
        dropped: list[Key] = []
        if plan.generation == self.generation and isinstance(plan, LoadPlan):
            self._unpin(plan)
        elif plan.generation == self.generation:
            dropped = [key for key in plan.keys if self._pending_on(key, plan.plan_id)]
            for key in dropped:
                quarantine.append(self.blocks.pop(key).block_id)
                self.order.remove(key)
            self._emit(BlocksRemoved(tuple(dropped), RemovalReason.STORE_FAILED))
        self.abandoned[plan.plan_id] = quarantine
        assert self.free_block_ids == free_before
        assert all(self.lookup(key) is Lookup.MISS for key in dropped)
        assert self.open_plans.get(plan.plan_id) == plan

    def touch(self, keys: Sequence[Key]) -> None:
        """Mark ``keys`` recently used; the first key ends up the most recent.

        Post: the same blocks in the same states; only the policy's order (and ARC's
        target) changed.
        """
        before = repr(self.blocks) if __debug__ else ""
        self.order.touch(keys, lambda key: self.blocks[key].ready)
        assert repr(self.blocks) == before

    def reset_cache(self) -> None:
        """Drop every block; a new generation begins, making every open plan stale.

        Post: every block id is free but the quarantined ones (an abandoned store job may
        still write those), nothing is evictable, the open plans are still open (each must
        still be completed once; doing so changes nothing but end a quarantine).
        """
        ready = sorted((k for k, b in self.blocks.items() if b.ready), key=self._block_id_of)
        self._emit(BlocksRemoved(tuple(ready), RemovalReason.RESET))
        self.blocks.clear()
        self.order.clear()
        quarantined = set(self.quarantined())
        self.free_block_ids = [
            block_id for block_id in range(self.num_blocks) if block_id not in quarantined
        ]
        self.num_evictable = 0
        self.generation += 1
        assert len(self.free_block_ids) + len(quarantined) == self.num_blocks
        assert all(plan.generation < self.generation for plan in self.open_plans.values())


def invariant_violations(state: SpecState) -> list[str]:
    """Every invariant of the design (docs/spec.md, Invariants) that ``state`` breaks, in words."""
    problems: list[str] = []
    n = state.num_blocks
    blocks = state.blocks
    counted = state.count_evictable()
    if state.num_evictable != counted:
        problems.append(
            f"evictable counter is {state.num_evictable} but {counted} blocks are ready "
            "with no refs"
        )
    pending = sum(1 for b in blocks.values() if not b.ready)
    ready = len(blocks) - pending
    quarantined = state.quarantined()
    if len(state.free_block_ids) + pending + ready + len(quarantined) != n:
        problems.append(
            f"free {len(state.free_block_ids)} + pending {pending} + ready {ready} + quarantined "
            f"{len(quarantined)} != {n} blocks"
        )
    block_ids = [b.block_id for b in blocks.values()]
    if len(set(block_ids)) != len(block_ids):
        problems.append(f"resident keys share block ids: {sorted(block_ids)}")
    if any(not 0 <= s < n for s in block_ids + state.free_block_ids + quarantined):
        problems.append(f"a block id is outside [0, {n})")
    if set(block_ids) & set(state.free_block_ids) or state.free_block_ids != sorted(
        set(state.free_block_ids)
    ):
        problems.append(f"free block ids {state.free_block_ids} overlap resident ones or repeat")
    if len(set(quarantined)) != len(quarantined) or set(quarantined) & set(
        block_ids + state.free_block_ids
    ):
        problems.append(f"quarantined block ids {quarantined} repeat or are free or resident")
    for key, b in blocks.items():
        if b.refs < 0 or (not b.ready and b.refs != 0):
            problems.append(f"{key!r} has refs {b.refs} while {'ready' if b.ready else 'pending'}")
        plan = state.open_plans.get(b.store_plan) if b.store_plan is not None else None
        if b.store_plan is not None and (
            not isinstance(plan, StorePlan)
            or plan.generation != state.generation
            or key not in plan.keys
            or b.store_plan in state.abandoned
        ):
            problems.append(f"{key!r} is pending on plan {b.store_plan}, which is not open now")
    problems.extend(_plan_violations(state))
    resident = state.order.resident()
    if set(resident) != set(blocks) or len(resident) != len(blocks):
        problems.append(f"policy order {resident} does not hold exactly the resident keys")
    if isinstance(state.order, ArcOrder):
        arc = state.order
        lists = [arc.t1, arc.t2, arc.b1, arc.b2]
        everything = [key for lst in lists for key in lst]
        if len(everything) != len(set(everything)):
            problems.append(f"ARC lists overlap: {arc!r}")
        if len(arc.b1) > arc.capacity or len(arc.b2) > arc.capacity:
            problems.append(f"ARC ghosts exceed capacity {arc.capacity}: {arc!r}")
        if not 0 <= arc.p <= arc.capacity:
            problems.append(f"ARC target p={arc.p} outside [0, {arc.capacity}]")
    elif isinstance(state.order, LruOrder) and len(set(state.order.order)) != len(
        state.order.order
    ):
        problems.append("LRU order repeats a key")
    elif isinstance(state.order, DuelOrder):
        problems.extend(_duel_violations(state.order))
    if len(state.offers) > max(state.max_tracker_size, 0):
        problems.append(f"offer tracker holds {len(state.offers)} > {state.max_tracker_size}")
    if any(p.generation > state.generation for p in state.open_plans.values()):
        problems.append("an open plan belongs to a future generation")
    if any(plan_id >= state.next_plan_id for plan_id in state.open_plans):
        problems.append("an open plan has an id that was never issued")
    return problems


def _duel_violations(duel: DuelOrder) -> list[str]:
    """The dueling order's own invariants: in the real order and in each shadow, every key
    has a last use after its second most recent one, the history (bounded) holds no
    resident key, and a shadow holds at most ``capacity`` keys."""
    problems: list[str] = []
    for name, uses in [("duel", duel.uses)] + [("shadow", s.uses) for s in duel.shadows]:
        if uses.last.keys() != uses.penult.keys():
            problems.append(f"{name}'s uses disagree: {uses!r}")
        elif any(uses.penult[key] >= last for key, last in uses.last.items()):
            problems.append(f"{name} has a key used twice at once: {uses!r}")
        bound = DUEL_HISTORY * duel.capacity
        if set(uses.history) & set(uses.last) or len(uses.history) > min(uses.history_limit, bound):
            problems.append(f"{name}'s history holds a resident key or too many: {uses!r}")
    if any(len(s.uses.last) > s.capacity or s.score < 0 for s in duel.shadows):
        problems.append(f"a shadow holds more than its capacity or scores below 0: {duel!r}")
    if any(not in_sample(key, s.rate) for s in duel.shadows for key in s.uses.last):
        problems.append(f"a shadow holds a key outside its sample: {duel!r}")
    return problems


def _plan_violations(state: SpecState) -> list[str]:
    """The open plans agree with the blocks: a current store plan's keys are pending on it in
    its block ids, and a ready block's refs count exactly its keys in current load plans.

    Plain consequences of the transitions, stated so that a checker that builds arbitrary
    states (CrossHair) builds only those a history could reach.
    """
    problems: list[str] = []
    for plan_id, quarantine in state.abandoned.items():
        plan = state.open_plans.get(plan_id)
        if plan is None or (quarantine and not isinstance(plan, StorePlan)):
            problems.append(f"abandoned plan {plan_id} is not an open store plan: {plan!r}")
        elif plan.generation == state.generation and not set(quarantine) <= set(plan.block_ids):
            problems.append(f"abandoned plan {plan!r} quarantines block ids {quarantine}")
    expected_refs: dict[Key, int] = {}
    for plan_id, plan in state.open_plans.items():
        if plan.plan_id != plan_id or len(plan.keys) != len(plan.block_ids):
            problems.append(f"open plan {plan_id} is malformed: {plan!r}")
            continue
        if plan.generation != state.generation or plan_id in state.abandoned:
            continue  # stale or abandoned: it holds no block
        for key, block_id in zip(plan.keys, plan.block_ids, strict=True):
            block = state.blocks.get(key)
            if isinstance(plan, StorePlan):
                wanted = block is not None and block.store_plan == plan_id
            else:
                wanted = block is not None and block.ready
                expected_refs[key] = expected_refs.get(key, 0) + 1
            if not wanted or block is None or block.block_id != block_id:
                problems.append(f"{key!r} in block id {block_id} does not match open plan {plan!r}")
        if isinstance(plan, StorePlan) and len(set(plan.keys)) != len(plan.keys):
            problems.append(f"store plan {plan_id} lists a key twice")
    for key, block in state.blocks.items():
        if block.refs != expected_refs.get(key, 0):
            problems.append(
                f"{key!r} has refs {block.refs} but current load plans read it "
                f"{expected_refs.get(key, 0)} times"
            )
    return problems
