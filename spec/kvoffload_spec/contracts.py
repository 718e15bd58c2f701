"""Entry points that let CrossHair check the spec's transitions on every small state.

CrossHair builds ``self`` through ``__init__`` from symbolic arguments. A constructor that
took the raw fields (free list, counter, plans...) would almost never produce a state that
satisfies the invariants: CrossHair would spend its budget on unreachable junk and report
nothing, a vacuous pass. These constructors take a few plain values instead and *derive* a
consistent state from them: which key sits in which block id, which block ids are pending on which
store plan, which load plans read which block ids, the policy's order and the offer tracker.
Every state a history can reach is one of them, and all of them satisfy the invariants,
which each check still asserts.

Keys come from a small key space, ``0 .. KEY_SPACE - 1``, so that a call's keys often meet
the resident ones, which is where the bugs are. An int argument picks its key by
comparisons (see :func:`_key`) rather than ``% KEY_SPACE``: CrossHair explores both sides
of each comparison, while it would turn a symbolic remainder into one concrete number,
nearly always 0, the moment the key is hashed.

Each ``check_*`` method opens with the precondition (at most :data:`MAX_BLOCKS` blocks and
every invariant holds), runs one transition, whose own asserts are checked on the way, and
closes with the postcondition (every invariant still holds). Check one method at a time::

    crosshair check --analysis_kind=asserts --per_condition_timeout=5 \\
        kvoffload_spec.contracts.LruContracts.check_prepare_store

Capacities stay tiny on purpose: CrossHair found a planted protection bug in 4 s with 3
blocks and not in 20 s with 5 (a probe on the 2-core development machines).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from kvoffload_spec.policies import ArcOrder, DuelOrder, LruOrder, PolicyOrder
from kvoffload_spec.state import Block, SpecState, invariant_violations
from kvoffload_spec.surface import Key, LoadPlan, StorePlan

MAX_BLOCKS = 3
KEY_SPACE = MAX_BLOCKS + 2  # room for every block and two keys that are not resident

CHECKS = (
    "check_prepare_store",
    "check_complete_store",
    "check_prepare_load",
    "check_complete_load",
    "check_abandon",
    "check_touch",
    "check_reset_cache",
)
"""The methods to hand to ``crosshair check``, one target each, on both classes below."""

_CURRENT, _STALE = 1, 0  # the generation of the state, and that of plans made before it


def _key(value: int) -> int:
    """A key of the small key space, chosen by comparisons CrossHair branches on."""
    for key in range(KEY_SPACE - 1):
        if value <= key:
            return key
    return KEY_SPACE - 1


def _index(value: int, size: int) -> int:
    """An index into ``size`` things, chosen by comparisons too."""
    for index in range(size - 1):
        if value <= index:
            return index
    return size - 1


def _size(values: Sequence[int]) -> int:
    """``len(values)`` as a plain int, chosen by comparisons, ``MAX_BLOCKS + 1`` for any
    longer list (which the precondition refuses anyway).

    A symbolic length would reach every bound derived from it (the loop over the block
    ids, ARC's ghost lists sliced to the capacity, the dueling policy's sample rate and
    history limit): each of CrossHair's later solver calls then carries those terms, and
    a probe measured the dueling policy's canaries at 13-39 CPU-s each, against 1-5 s for
    the same states with a plain length.
    """
    for size in range(MAX_BLOCKS + 1):
        if len(values) <= size:
            return size
    return MAX_BLOCKS + 1


def _keys(values: Sequence[int]) -> list[Key]:
    """Keys of the small key space, each once, in order."""
    return list(dict.fromkeys(_key(value) for value in values))


class _Checks(SpecState):
    """A consistent state derived from plain values (see the module's docstring).

    ``block_ids[i]`` says what block id ``i`` holds: nothing if negative, a ready block if zero, a
    block still pending on the store plan labelled ``block_ids[i]`` if positive. The key in
    block id ``i`` is ``(i + _key(shift)) % KEY_SPACE``: keys are opaque, so naming them by block id
    loses nothing, and the shift keeps a key from always equalling its block id. ``loads``
    lists, per open load plan, the block ids it reads (those not ready are left out). ``stale``
    gives the keys of a store plan and of a load plan made before the last reset (none if
    empty). ``abandon`` picks open plans to abandon, as ``abandon()`` would: a store's keys
    leave and its block ids are quarantined, a load's pins are released.
    """

    _args: tuple[object, ...]  # what the constructor was given, for a counterexample's repr

    def __init__(
        self,
        block_ids: list[int],
        shift: int,
        loads: list[list[int]],
        stale: list[int],
        abandon: list[int],
        order: PolicyOrder,
    ) -> None:
        num_blocks = _size(block_ids)
        key_in = {
            block_id: (block_id + _key(shift)) % KEY_SPACE
            for block_id in range(num_blocks)
            if block_ids[block_id] >= 0
        }
        blocks: dict[Key, Block] = {key: Block(block_id) for block_id, key in key_in.items()}
        plans: list[StorePlan | LoadPlan] = []
        for label in sorted(
            {block_ids[block_id] for block_id in key_in if block_ids[block_id] > 0}
        ):
            # A plan takes the lowest free block ids in call order: its keys are in block id order.
            pending = tuple(block_id for block_id in key_in if block_ids[block_id] == label)
            for block_id in pending:
                blocks[key_in[block_id]].store_plan = len(plans)
            keys = tuple(key_in[block_id] for block_id in pending)
            plans.append(StorePlan(keys, pending, (), len(plans), _CURRENT, 0))
        for read in loads:
            readable = tuple(s for s in read if s in key_in and block_ids[s] == 0)
            for block_id in readable:
                blocks[key_in[block_id]].refs += 1
            keys = tuple(key_in[block_id] for block_id in readable)
            plans.append(LoadPlan(keys, readable, len(plans), _CURRENT, 0))
        if stale:
            dropped = tuple(_keys(stale))
            places = tuple(range(len(dropped)))
            plans.append(StorePlan(dropped, places, (), len(plans), _STALE, 0))
            plans.append(LoadPlan(dropped, places, len(plans), _STALE, 0))
        abandoned: dict[int, list[int]] = {}
        for value in abandon if plans else ():
            plan = plans[_index(value, len(plans))]
            if plan.plan_id in abandoned:
                continue
            abandoned[plan.plan_id] = []
            if plan.generation == _CURRENT and isinstance(plan, StorePlan):
                abandoned[plan.plan_id] = [blocks.pop(key).block_id for key in plan.keys]
            elif plan.generation == _CURRENT:
                for key in plan.keys:
                    blocks[key].refs -= 1
        taken = {block.block_id for block in blocks.values()}
        taken.update(block_id for quarantine in abandoned.values() for block_id in quarantine)
        super().__init__(
            num_blocks=num_blocks,
            order=order,
            blocks=blocks,
            free_block_ids=[block_id for block_id in range(num_blocks) if block_id not in taken],
            num_evictable=sum(1 for b in blocks.values() if b.ready and b.refs == 0),
            generation=_CURRENT,
            open_plans={plan.plan_id: plan for plan in plans},
            next_plan_id=len(plans),
            max_tracker_size=MAX_BLOCKS,
            abandoned=abandoned,
        )

    def _check_prepare_store(self, keys: list[int]) -> None:
        assert 1 <= self.num_blocks <= MAX_BLOCKS
        assert not invariant_violations(self)
        call = [_key(key) for key in keys]
        before = self._cache()
        absent = [key for key in dict.fromkeys(call) if key not in self.blocks]
        outside = sum(1 for key in self.blocks if self.evictable(key) and key not in call)
        room = len(self.free_block_ids) + outside
        arc = self.order if isinstance(self.order, ArcOrder) else None
        ghosts = set(arc.b1 + arc.b2) if arc is not None else set()
        target = arc.p if arc is not None else 0.0
        plan = self.prepare_store(call)
        # Counted after the call, which records its offers before it picks candidates.
        threshold = self.store_threshold
        candidates = [k for k in absent if threshold < 2 or self.offers.get(k, 0) >= threshold]
        # Refused exactly when the candidates cannot fit in the free and evictable blocks.
        assert (plan is None) == (len(candidates) > room)
        assert plan is None or list(plan.keys) == candidates
        assert plan is not None or self._cache() == before
        # ARC's target moves only on a ghost hit: a candidate that was a ghost.
        assert arc is None or arc.p == target or any(key in ghosts for key in candidates)
        assert not invariant_violations(self)

    def _check_complete_store(self, which: int, success: bool) -> None:
        assert 1 <= self.num_blocks <= MAX_BLOCKS
        assert any(isinstance(plan, StorePlan) for plan in self.open_plans.values())
        assert not invariant_violations(self)
        plans = [plan for plan in self.open_plans.values() if isinstance(plan, StorePlan)]
        plan = plans[_index(which, len(plans))]
        self.complete_store(plan, success)
        assert plan.plan_id not in self.open_plans
        assert not invariant_violations(self)

    def _check_prepare_load(self, block_ids: list[int]) -> None:
        """Load the keys in ``block_ids`` (those ready): a load of anything else is refused."""
        assert 1 <= self.num_blocks <= MAX_BLOCKS
        assert not invariant_violations(self)
        key_in = {block.block_id: key for key, block in self.blocks.items() if block.ready}
        picked = [_index(block_id, self.num_blocks) for block_id in block_ids]
        keys = [key_in[block_id] for block_id in picked if block_id in key_in]
        self.prepare_load(keys)
        assert not invariant_violations(self)

    def _check_complete_load(self, which: int) -> None:
        assert 1 <= self.num_blocks <= MAX_BLOCKS
        assert any(isinstance(plan, LoadPlan) for plan in self.open_plans.values())
        assert not invariant_violations(self)
        plans = [plan for plan in self.open_plans.values() if isinstance(plan, LoadPlan)]
        plan = plans[_index(which, len(plans))]
        self.complete_load(plan)
        assert plan.plan_id not in self.open_plans
        assert not invariant_violations(self)

    def _check_abandon(self, which: int) -> None:
        assert 1 <= self.num_blocks <= MAX_BLOCKS
        assert any(plan_id not in self.abandoned for plan_id in self.open_plans)
        assert not invariant_violations(self)
        plans = [plan for plan in self.open_plans.values() if plan.plan_id not in self.abandoned]
        plan = plans[_index(which, len(plans))]
        free_before = list(self.free_block_ids)
        self.abandon(plan)
        # Still open (its late completion is due), and no block id freed: the job may write it.
        assert plan.plan_id in self.abandoned and plan.plan_id in self.open_plans
        assert self.free_block_ids == free_before
        assert not invariant_violations(self)

    def _check_touch(self, keys: list[int]) -> None:
        assert 1 <= self.num_blocks <= MAX_BLOCKS
        assert not invariant_violations(self)
        self.touch([_key(key) for key in keys])
        assert not invariant_violations(self)

    def _check_reset_cache(self) -> None:
        assert 1 <= self.num_blocks <= MAX_BLOCKS
        assert not invariant_violations(self)
        self.reset_cache()
        assert not self.blocks and self.num_evictable == 0
        assert not invariant_violations(self)

    def _cache(self) -> tuple[object, ...]:
        """What a failed ``prepare_store`` must leave as it was (its observations, the
        tracker and ARC's ghost hits, may move)."""
        cache = (self.blocks, self.free_block_ids, self.num_evictable, self.open_plans)
        order, _ = self.order.fingerprint()
        return (*copy.deepcopy(cache), order, self.next_plan_id, self.generation)

    def _resident_first(self, keys: Sequence[int]) -> list[Key]:
        """The resident keys among ``keys``, in that order, then the others by block id."""
        chosen = [key for key in _keys(keys) if key in self.blocks]
        rest = sorted(
            (key for key in self.blocks if key not in chosen), key=lambda k: self.blocks[k].block_id
        )
        return chosen + rest


class LruContracts(_Checks):
    """A spec state under LRU, with the offer tracker in play.

    ``lru`` orders the resident keys, least recent first (the others follow by block id).
    ``store_threshold`` and ``offered`` (keys offered, oldest first) set up the tracker.
    """

    # CrossHair looks a target method up in the class's own namespace only, and would check
    # a method twice if the base class had one of the same name.
    check_prepare_store = _Checks._check_prepare_store
    check_complete_store = _Checks._check_complete_store
    check_prepare_load = _Checks._check_prepare_load
    check_complete_load = _Checks._check_complete_load
    check_abandon = _Checks._check_abandon
    check_touch = _Checks._check_touch
    check_reset_cache = _Checks._check_reset_cache

    def __init__(
        self,
        block_ids: list[int],
        shift: int,
        loads: list[list[int]],
        stale: list[int],
        abandon: list[int],
        lru: list[int],
        store_threshold: int,
        offered: list[int],
    ) -> None:
        self._args = (block_ids, shift, loads, stale, abandon, lru, store_threshold, offered)
        order = LruOrder()
        super().__init__(block_ids, shift, loads, stale, abandon, order)
        order.order = self._resident_first(lru)
        self.store_threshold = store_threshold
        self._record_offers([_key(value) for value in offered])

    def __repr__(self) -> str:
        return f"LruContracts{self._args!r}"


class ArcContracts(_Checks):
    """A spec state under ARC.

    ``t2`` lists the resident ready keys in T2, least recent first; the other resident keys
    are in T1, in ``t1``'s order (the others follow by block id). ``b1`` and ``b2`` are the
    ghosts (keys not resident; the most recent ``len(block_ids)`` of each are kept) and
    ``p`` the target size of T1 (held within ``[0, len(block_ids)]``).
    """

    # CrossHair looks a target method up in the class's own namespace only, and would check
    # a method twice if the base class had one of the same name.
    check_prepare_store = _Checks._check_prepare_store
    check_complete_store = _Checks._check_complete_store
    check_prepare_load = _Checks._check_prepare_load
    check_complete_load = _Checks._check_complete_load
    check_abandon = _Checks._check_abandon
    check_touch = _Checks._check_touch
    check_reset_cache = _Checks._check_reset_cache

    def __init__(
        self,
        block_ids: list[int],
        shift: int,
        loads: list[list[int]],
        stale: list[int],
        abandon: list[int],
        t1: list[int],
        t2: list[int],
        b1: list[int],
        b2: list[int],
        p: float,
    ) -> None:
        self._args = (block_ids, shift, loads, stale, abandon, t1, t2, b1, b2, p)
        arc = ArcOrder(_size(block_ids))
        super().__init__(block_ids, shift, loads, stale, abandon, arc)
        blocks = self.blocks
        # A pending key was inserted into T1 and has not been touched while ready since.
        arc.t2 = [key for key in _keys(t2) if key in blocks and blocks[key].ready]
        arc.t1 = [key for key in self._resident_first(t1) if key not in arc.t2]
        capacity = arc.capacity
        arc.b1 = [key for key in _keys(b1) if key not in blocks][-capacity:]
        arc.b2 = [key for key in _keys(b2) if key not in blocks and key not in arc.b1]
        arc.b2 = arc.b2[-capacity:]
        arc.p = min(max(p, 0.0), float(arc.capacity))

    def __repr__(self) -> str:
        return f"ArcContracts{self._args!r}"


class DuelContracts(_Checks):
    """A spec state under the dueling policy.

    ``lru`` orders the resident keys by last use, least recent first (the others follow by
    block id); the keys of ``reused`` (resident ones) were used twice, their second most recent
    uses in that order, all before any last use. ``gone`` are keys in the history (not
    resident), oldest first. ``lead`` picks the shadow with the higher score (its index in
    ``DUEL_ORDERS``, modulo 3). The shadows hold no keys: they only decide which order the
    victims come in.
    """

    # CrossHair looks a target method up in the class's own namespace only, and would check
    # a method twice if the base class had one of the same name.
    check_prepare_store = _Checks._check_prepare_store
    check_complete_store = _Checks._check_complete_store
    check_prepare_load = _Checks._check_prepare_load
    check_complete_load = _Checks._check_complete_load
    check_abandon = _Checks._check_abandon
    check_touch = _Checks._check_touch
    check_reset_cache = _Checks._check_reset_cache

    def __init__(
        self,
        block_ids: list[int],
        shift: int,
        loads: list[list[int]],
        stale: list[int],
        abandon: list[int],
        lru: list[int],
        reused: list[int],
        gone: list[int],
        lead: int,
    ) -> None:
        self._args = (block_ids, shift, loads, stale, abandon, lru, reused, gone, lead)
        duel = DuelOrder.empty(_size(block_ids))
        super().__init__(block_ids, shift, loads, stale, abandon, duel)
        uses = duel.uses
        twice = [key for key in _keys(reused) if key in self.blocks]
        history = [key for key in _keys(gone) if key not in self.blocks]
        history = history[len(history) - uses.history_limit :]
        uses.history = {key: stamp for stamp, key in enumerate(history, start=1)}
        first = len(history) + 1  # every use of a resident key comes after the history's
        for rank, key in enumerate(self._resident_first(lru)):
            uses.last[key] = first + len(twice) + rank
            uses.penult[key] = first + twice.index(key) if key in twice else -1
        duel.clock = first + len(twice) + len(self.blocks)
        duel.shadows[lead % len(duel.shadows)].score = 1.0

    def __repr__(self) -> str:
        return f"DuelContracts{self._args!r}"
