"""The production offloading manager: the spec's surface, at O(k log n) per call.

``OffloadManager`` is checked step by step against ``kvoffload_spec.OffloadModel`` (see
docs/conformance.md): the same plans, block ids, events and errors. It owns the blocks, their
block ids, refs, counters, plans and events; the eviction policy owns only the order (see
``kvoffload.policies.base``). docs/manager.md explains the data structures.
"""

from __future__ import annotations

import heapq
import time
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import fields
from itertools import repeat
from typing import TYPE_CHECKING

from kvoffload.policies.base import EvictionPolicy, PolicyContractError
from kvoffload.policies.loading import BUILTIN_POLICIES, resolve_policy
from kvoffload.sharded import AscendingDict, ShardedDict
from kvoffload.stats import ManagerStats, Tally
from kvoffload_spec.defaults import (
    DEFAULT_MAX_TRACKER_SIZE,
    DEFAULT_POLICY,
    DEFAULT_STALL_AFTER,
    DEFAULT_STORE_THRESHOLD,
)
from kvoffload_spec.errors import (
    BlockNotFoundError,
    BlockPendingError,
    InvalidArgumentError,
    SpecViolation,
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
    new_owner_id,
)
from kvoffload_spec.validation import (
    check_abandonable,
    check_count,
    check_flag,
    check_issued_plan,
    check_key,
    check_keys,
    check_open_plan,
    check_seconds,
    check_seen_misses,
)

if TYPE_CHECKING:
    from kvoffload_spec.state import SpecState

# The built-in policies' victims are checked by the spec differential, not on every call.
_TRUSTED_POLICIES = frozenset(BUILTIN_POLICIES.values())
# The tally's counters by name, for stats(): they are ints, so reading them is the copy
# that dataclasses.asdict (recursive, deep-copying each value) makes several times slower.
_TALLY_FIELDS = tuple(field.name for field in fields(Tally))


def _zeros(length: int) -> array[int]:
    return array("q", bytes(8 * length))


_consume: Callable[[Iterable[int]], None] = deque[int](maxlen=0).extend  # drains, in C


def _checked_keys(keys: Sequence[Key]) -> Sequence[Key]:
    """``check_keys(keys)``, hashing a list or tuple in one C loop: the common case pays
    no Python step per key, and anything else (or an unhashable key) gets the full check
    and its error.
    """
    if type(keys) is list or type(keys) is tuple:
        try:
            _consume(map(hash, keys))
        except TypeError:
            pass
        else:
            return keys
    return check_keys(keys)


class OffloadManager:
    """Bookkeeping of a CPU block pool: which keys it holds, in which block id, what to evict.

    The surface, plans, block ids, events and errors are exactly those of
    ``kvoffload_spec.OffloadModel``; every call costs O(k log n) for k keys (``reset_cache``
    and ``check_invariants`` excepted), however many blocks are pinned, pending or protected.

    >>> manager = OffloadManager(2, "arc")
    >>> plan = manager.prepare_store([b"h0", b"h1"])
    >>> plan.block_ids
    (0, 1)
    >>> manager.complete_store(plan)
    >>> manager.lookup(b"h0")
    <Lookup.HIT: 'hit'>
    """

    __slots__ = (
        "_abandoned",
        "_block_id_of",
        "_clock",
        "_events",
        "_freed",
        "_fresh",
        "_generation",
        "_max_tracker_size",
        "_next_plan_id",
        "_num_blocks",
        "_num_evictable",
        "_offers",
        "_open_plans",
        "_opened_at",
        "_owner",
        "_policy",
        "_refs",
        "_stall_after",
        "_store_threshold",
        "_storing",
        "_tally",
    )

    def __init__(
        self,
        num_blocks: int,
        policy: str | type[EvictionPolicy] = DEFAULT_POLICY,
        *,
        store_threshold: int = DEFAULT_STORE_THRESHOLD,
        max_tracker_size: int = DEFAULT_MAX_TRACKER_SIZE,
        enable_events: bool = False,
        stall_after: float = DEFAULT_STALL_AFTER,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``policy`` is "lru", "arc", an ``EvictionPolicy`` subclass or "module:Class".

        A key becomes a store candidate once offered ``store_threshold`` times (the offers
        of at most ``max_tracker_size`` keys are remembered). A plan still open
        ``stall_after`` seconds (by ``clock``) after it was made counts as stalled in
        ``stats()`` and ``stalled_plans()``. Bad arguments raise ``InvalidArgumentError``
        (``UnknownPolicyError`` for the policy).
        """
        check_count("num_blocks", num_blocks)
        policy_class = resolve_policy(policy)
        self._store_threshold = check_count("store_threshold", store_threshold)
        self._max_tracker_size = check_count("max_tracker_size", max_tracker_size)
        events_on = check_flag("enable_events", enable_events)
        self._stall_after = check_seconds("stall_after", stall_after)
        if not callable(clock):
            raise InvalidArgumentError(
                f"clock must be a function returning seconds, like time.monotonic, got {clock!r}"
            )
        self._clock = clock
        self._num_blocks = num_blocks
        self._policy = policy_class(num_blocks)
        self._block_id_of: ShardedDict[Key, int] = ShardedDict(num_blocks)  # every resident key
        self._storing: dict[Key, int] = {}  # pending key -> id of the plan storing it
        self._refs = _zeros(num_blocks)  # by block id: loads reading that block
        # The free block ids are the heap ``_freed`` plus every block id from ``_fresh`` up: all of
        # ``_freed`` lies below ``_fresh``, so the lowest free block id is on top of the heap.
        self._freed: list[int] = []
        self._fresh = 0
        self._num_evictable = 0
        self._offers: OrderedDict[Key, int] = OrderedDict()  # least recently offered first
        self._events: list[Event] | None = [] if events_on else None
        self._open_plans: AscendingDict[StorePlan | LoadPlan] = AscendingDict()
        self._opened_at: AscendingDict[float] = AscendingDict()  # open plan id -> its clock
        # abandoned plan id -> the block ids its store job may still write (quarantined)
        self._abandoned: dict[int, tuple[int, ...]] = {}
        self._next_plan_id = 0
        self._generation = 0
        self._owner = new_owner_id()
        self._tally = Tally()

    def __repr__(self) -> str:
        return (
            f"OffloadManager({self._num_blocks}, {type(self._policy).__name__}, "
            f"resident={len(self._block_id_of)}, pending={len(self._storing)}, "
            f"evictable={self._num_evictable}, free={self.num_free_blocks})"
        )

    # -- read-only views -------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self._num_blocks - self._fresh + len(self._freed)

    @property
    def store_threshold(self) -> int:
        return self._store_threshold

    @property
    def num_evictable_blocks(self) -> int:
        return self._num_evictable

    @property
    def num_quarantined_blocks(self) -> int:
        """Slots of abandoned stores whose jobs have not reported yet: not usable."""
        return sum(map(len, self._abandoned.values()))

    @property
    def policy(self) -> EvictionPolicy:
        """The eviction policy instance (read it; changing it corrupts the manager)."""
        return self._policy

    def lookup(self, key: Key) -> Lookup:
        """MISS, PENDING or HIT. Changes no cache state (only the lookup counters)."""
        try:
            resident = key in self._block_id_of
        except TypeError:
            check_key(key)  # raises the typed error for an unhashable key
            raise
        tally = self._tally
        if not resident:
            tally.lookup_misses += 1
            return Lookup.MISS
        if key in self._storing:
            tally.lookup_pending += 1
            return Lookup.PENDING
        tally.lookup_hits += 1
        return Lookup.HIT

    def peek(self, key: Key) -> Lookup:
        """``lookup`` without counting it: for a caller that classifies keys on the way to
        another call (an engine adapter sorting the keys of a store), not a request's lookup.
        """
        try:
            return self._lookup(key)
        except TypeError:
            check_key(key)
            raise

    def offer_count(self, key: Key) -> int:
        """How many offers of ``key`` the store threshold counts now (0 when it is not
        tracked, or forgotten; always 0 with ``store_threshold < 2``)."""
        try:
            return self._offers.get(key, 0)
        except TypeError:
            check_key(key)
            raise

    def stats(self) -> ManagerStats:
        """Gauges and counters, as a frozen snapshot (O(n / 512) for the resident count, plus
        the stalled plans).
        """
        resident, pending = len(self._block_id_of), len(self._storing)
        stalled = self.stalled_plans()
        current = [plan for plan in stalled if plan.generation == self._generation]
        return ManagerStats(
            num_blocks=self._num_blocks,
            resident=resident,
            pending=pending,
            pinned=resident - pending - self._num_evictable,
            evictable=self._num_evictable,
            free=self.num_free_blocks,
            quarantined=self.num_quarantined_blocks,
            stalled_plans=len(stalled),
            stalled_pins=sum(len(p.keys) for p in current if isinstance(p, LoadPlan)),
            stalled_pending=sum(len(p.keys) for p in current if isinstance(p, StorePlan)),
            abandoned_open=len(self._abandoned),
            **{name: getattr(self._tally, name) for name in _TALLY_FIELDS},
        )

    def stalled_plans(self, older_than: float | None = None) -> list[StorePlan | LoadPlan]:
        """The open plans made more than ``older_than`` seconds ago (default: the manager's
        ``stall_after``), oldest first, abandoned ones left out: the candidates for
        ``abandon`` when their jobs seem never to finish.
        """
        age = self._stall_after if older_than is None else check_seconds("older_than", older_than)
        cutoff = self._clock() - age
        stalled: list[StorePlan | LoadPlan] = []
        # Plans are opened in id order, so the dict is ordered by age: stop at a young one.
        for plan_id, opened in self._opened_at.items():
            if opened > cutoff:
                break
            if plan_id not in self._abandoned:
                stalled.append(self._open_plans[plan_id])
        return stalled

    # -- operations ------------------------------------------------------------------------

    def prepare_store(
        self, keys: Sequence[Key], *, seen_misses: set[Key] | None = None
    ) -> StorePlan | None:
        """Plan to store the absent ``keys``, evicting to make room; None when they cannot
        all be placed, and then no cache state changed.

        ``seen_misses``: the candidates whose store miss the policy already heard from this
        requester (vLLM retries a refused store every step, and ARC must count its ghost hit
        once): not reported again; the ones reported now are added to it.
        """
        distinct = dict.fromkeys(_checked_keys(keys))
        check_seen_misses(seen_misses)
        candidates = self._candidates(distinct)
        heard = candidates
        if seen_misses is not None:
            heard = [key for key in candidates if key not in seen_misses]
            seen_misses.update(heard)
        if heard:
            self._policy.on_store_miss(heard)  # an observation, even if refused
        victims = self._make_room(len(candidates), distinct)
        if victims is None:
            self._tally.rejected_stores += 1
            return None
        evicted_block_ids = self._evict(victims)
        plan_id = self._next_plan_id
        block_ids = self._place(candidates, plan_id, evicted_block_ids)
        return self._open(
            StorePlan(
                tuple(candidates),
                block_ids,
                tuple(victims),
                plan_id,
                self._generation,
                self._owner,
                evicted_block_ids,
            )
        )

    def complete_store(self, plan: StorePlan, success: bool = True) -> None:
        """The store job of ``plan`` finished: its blocks become readable, or (on failure)
        absent again. A plan made before ``reset_cache`` changes nothing.
        """
        check_flag("success", success)
        plan = self._close(plan, StorePlan)
        quarantine = self._abandoned.pop(plan.plan_id, None)
        if quarantine is not None:
            for block_id in quarantine:  # its job is over: nothing can write these block ids now
                heapq.heappush(self._freed, block_id)
            return
        if plan.generation != self._generation:
            return  # the ABA guard: these keys may have been stored again since the reset
        storing, plan_id = self._storing, plan.plan_id
        done = [key for key in plan.keys if storing.get(key) == plan_id]
        for key in done:
            del storing[key]
        if success:
            self._mark_stored(done)
        else:
            self._drop_failed(done)

    def prepare_load(self, keys: Sequence[Key]) -> LoadPlan:
        """Pin ``keys`` (once per occurrence) for reading. Raises ``BlockNotFoundError`` or
        ``BlockPendingError`` if a key is not ready; then nothing changed.
        """
        found = self._block_id_of.get_each(_checked_keys(keys))
        if None in found or not self._storing.keys().isdisjoint(keys):
            for key in keys:  # the first key that is not ready says why
                self._require_ready(key)
        block_ids: tuple[int, ...] = tuple(found)  # type: ignore[arg-type]  # no None left
        self._pin_each(keys, block_ids)
        return self._open(
            LoadPlan(tuple(keys), block_ids, self._next_plan_id, self._generation, self._owner)
        )

    def complete_load(self, plan: LoadPlan) -> None:
        """The load job of ``plan`` finished: unpin what it pinned."""
        plan = self._close(plan, LoadPlan)
        if self._abandoned.pop(plan.plan_id, None) is not None:
            return  # its pins were released when it was abandoned
        self._tally.blocks_loaded += len(plan.keys)
        if plan.generation != self._generation:
            return
        self._unpin_each(plan.keys, plan.block_ids)

    def abandon(self, plan: StorePlan | LoadPlan) -> None:
        """Give up waiting for the job of ``plan`` (it stalled), without trusting it ended.

        A load plan's pins are released now. A store plan's keys become absent now (an
        event says their store failed), but their block ids stay *quarantined*, handed out to no
        one, until ``complete_store(plan)`` reports that the job can no longer write them.
        The plan must still be completed once, when its job reports (late); that changes
        nothing else. Raises ``PlanAlreadyAbandonedError`` the second time, and the errors
        of ``complete_*`` for a plan that is not open.
        """
        plan = check_abandonable(
            plan,
            owner=self._owner,
            open_plans=self._open_plans,
            issued=self._next_plan_id,
            abandoned=self._abandoned,
        )
        self._tally.abandoned_plans += 1
        if plan.generation != self._generation:
            self._abandoned[plan.plan_id] = ()  # a reset released everything it held
        elif isinstance(plan, LoadPlan):
            self._unpin_each(plan.keys, plan.block_ids)
            self._abandoned[plan.plan_id] = ()
        else:
            dropped = [key for key in plan.keys if self._storing.get(key) == plan.plan_id]
            block_ids = []
            for key in dropped:
                del self._storing[key]
                block_ids.append(self._block_id_of.pop(key))
                self._policy.remove(key)
            self._abandoned[plan.plan_id] = tuple(block_ids)
            self._emit(dropped, RemovalReason.STORE_FAILED)

    def is_abandoned(self, plan: StorePlan | LoadPlan) -> bool:
        """Whether ``plan`` was abandoned and its (late) completion has not come yet: True
        from ``abandon(plan)`` until ``complete_*(plan)``, across resets; False otherwise,
        a completed plan included. O(1); changes nothing. Raises ``ForeignPlanError`` for
        anything but a plan this manager issued (an open one must be the very plan issued).
        """
        # The very plan object this manager holds open needs no check (as in ``_close``).
        if not (
            isinstance(plan, (StorePlan, LoadPlan)) and self._open_plans.get(plan.plan_id) is plan
        ):
            check_issued_plan(
                plan, owner=self._owner, open_plans=self._open_plans, issued=self._next_plan_id
            )
        return plan.plan_id in self._abandoned

    def touch(self, keys: Sequence[Key]) -> None:
        """Mark ``keys`` recently used; the first key ends up the most recent."""
        self._policy.touch(_checked_keys(keys), self._is_ready)

    def reset_cache(self) -> None:
        """Drop every block (O(n)). Open plans stay open; completing them changes nothing."""
        if self._events is not None:
            ready = [key for key in self._block_id_of if key not in self._storing]
            ready.sort(key=self._block_id_of.__getitem__)
            self._emit(ready, RemovalReason.RESET)
        self._block_id_of.clear()
        self._storing.clear()
        self._refs = _zeros(self._num_blocks)
        # Abandoned stores' jobs may still write their block ids: those stay quarantined.
        quarantined = {block_id for block_ids in self._abandoned.values() for block_id in block_ids}
        self._fresh = max(quarantined, default=-1) + 1
        self._freed = [block_id for block_id in range(self._fresh) if block_id not in quarantined]
        self._num_evictable = 0
        self._policy.clear()
        self._generation += 1
        self._tally.resets += 1

    def take_events(self) -> list[Event]:
        """The events since the last call, oldest first (always empty unless enabled)."""
        if self._events is None:
            return []
        taken = list(self._events)
        self._events.clear()
        return taken

    def check_invariants(self, abstraction: SpecState | None = None) -> None:
        """Raise ``SpecViolation`` if any invariant of the design fails (O(n log n)): the
        tables must be well formed, and the spec state they stand for
        (:meth:`abstract_state`) must satisfy every invariant of the spec.
        ``abstraction``: that state, when the caller built it already (the explorer does,
        for its fingerprint), so that it is built once.
        """
        from kvoffload_spec.state import invariant_violations

        problems = self._representation_violations()
        try:
            state = self.abstract_state() if abstraction is None else abstraction
            problems += invariant_violations(state)
        except Exception as error:  # malformed tables may not even map to a state
            problems.append(f"the tables stand for no spec state: {error!r}")
        if problems:
            raise SpecViolation("; ".join(problems))

    def abstract_state(self) -> SpecState:
        """The refinement mapping: the spec state these tables stand for (O(n log n); see
        ``kvoffload_spec.refinement``). Each call builds a fresh state; changing it changes
        nothing here. The policy contributes its order (``EvictionPolicy.abstract_order``);
        a policy the spec does not know stands as an LRU order of ``resident()``.
        """
        from kvoffload.manager_refinement import abstract_state

        return abstract_state(self)

    # -- prepare_store, step by step -------------------------------------------------------

    def _candidates(self, distinct: dict[Key, None]) -> list[Key]:
        absent = self._block_id_of.missing(distinct)
        if self._store_threshold < 2:
            return absent
        self._record_offers(distinct)
        return [key for key in absent if self._offers.get(key, 0) >= self._store_threshold]

    def _record_offers(self, keys: dict[Key, None]) -> None:
        # An observation, not cache state: recorded even when the store then fails. Every
        # key of the call counts (a resident one is a reuse), and the keys of one call never
        # push each other out: a new key forgets only a key outside the call.
        offers = self._offers
        new = []
        for key in keys:
            count = offers.get(key)
            if count is None:
                new.append(key)
            else:
                offers[key] = count + 1
                offers.move_to_end(key)
        # The call's tracked keys are now the most recent, so the least recent key is
        # outside the call while any is.
        outside = len(offers) - (len(keys) - len(new))
        for key in new:
            if len(offers) >= self._max_tracker_size:
                if not outside:
                    continue
                offers.popitem(last=False)
                outside -= 1
            offers[key] = 1

    def _make_room(self, count: int, protected: Container[Key]) -> list[Key] | None:
        """The victims that free room for ``count`` new blocks, or None if there are none."""
        need = count - self.num_free_blocks
        if need <= 0:
            return []
        if need > self._num_evictable:
            # The guard of vLLM PR #45757: even evicting everything evictable is not enough.
            self._tally.fast_fail_rejections += 1
            return None
        victims = self._policy.choose_victims(need, protected)
        if victims is not None and type(self._policy) not in _TRUSTED_POLICIES:
            self._check_victims(victims, need, protected)
        return victims

    def _check_victims(self, victims: list[Key], need: int, protected: Container[Key]) -> None:
        # A plugged-in policy is code we do not control: refuse a bad choice before any
        # state changes rather than corrupt the pool.
        legal = all(self._is_evictable(key) and key not in protected for key in victims)
        if not legal or len(victims) != need or len(set(victims)) != need:
            raise PolicyContractError(
                f"{type(self._policy).__name__}.choose_victims({need}) chose {victims!r}: "
                f"it must choose {need} distinct evictable keys outside {protected!r}"
            )

    def _evict(self, victims: list[Key]) -> tuple[int, ...]:
        """Drop ``victims``; their block ids, in eviction order (their bytes are still there),
        for ``_take_block_ids`` to hand out again.
        """
        block_ids = tuple(self._block_id_of.pop_each(victims))
        self._num_evictable -= len(victims)
        self._policy.evict(victims)
        self._tally.evictions += len(victims)
        self._emit(victims, RemovalReason.EVICTED)
        return block_ids

    def _place(
        self, candidates: list[Key], plan_id: int, evicted: tuple[int, ...]
    ) -> tuple[int, ...]:
        """Make ``candidates`` pending in the lowest free block ids, in call order, the
        block ids just ``evicted`` among them.
        """
        block_ids = self._take_block_ids(len(candidates), evicted)
        self._block_id_of.set_each(candidates, block_ids)
        self._storing.update(zip(candidates, repeat(plan_id)))
        self._policy.insert_each(candidates)
        return block_ids

    def _take_block_ids(self, count: int, evicted: tuple[int, ...]) -> tuple[int, ...]:
        """The ``count`` lowest free block ids, ascending (freed ones lie below the fresh),
        ``evicted`` (not in the heap) counting as free.
        """
        freed = self._freed
        if len(freed) + len(evicted) + self._num_blocks - self._fresh == count:
            # Victims make exactly enough room: every free block id is taken, so they are
            # sorted together rather than pushed and popped one by one.
            every_free = sorted([*freed, *evicted])
            freed.clear()
            fresh, self._fresh = self._fresh, self._num_blocks
            return (*every_free, *range(fresh, self._num_blocks))
        for block_id in evicted:  # more room than needed: the rest stays free
            heapq.heappush(freed, block_id)
        reused = min(count, len(freed))
        taken = tuple(map(heapq.heappop, repeat(freed, reused)))
        if reused == count:  # enough block ids freed earlier (failed or abandoned stores)
            return taken
        fresh = self._fresh
        self._fresh = fresh + count - reused
        return (*taken, *range(fresh, self._fresh))

    # -- completions and pins --------------------------------------------------------------

    def _mark_stored(self, keys: list[Key]) -> None:
        self._policy.mark_evictable_each(keys)
        self._num_evictable += len(keys)
        self._tally.blocks_stored += len(keys)
        self._emit(keys)

    def _drop_failed(self, keys: list[Key]) -> None:
        for key in keys:
            heapq.heappush(self._freed, self._block_id_of.pop(key))
            self._policy.remove(key)
        self._tally.failed_stores += len(keys)
        self._emit(keys, RemovalReason.STORE_FAILED)

    def _pin_each(self, keys: Sequence[Key], block_ids: Sequence[int]) -> None:
        """Pin each key of ``keys``, ready in the block id of ``block_ids`` beside it."""
        refs = self._refs
        newly = []  # the keys that stop being evictable, in call order
        for key, block_id in zip(keys, block_ids, strict=True):
            if not refs[block_id]:
                newly.append(key)
            refs[block_id] += 1
        self._num_evictable -= len(newly)
        self._policy.mark_unevictable_each(newly)

    def _unpin_each(self, keys: Sequence[Key], block_ids: Sequence[int]) -> None:
        """Undo ``_pin_each(keys, block_ids)``: the block ids are still the keys' (pinned
        blocks are neither evicted nor moved), so no key is looked up again.
        """
        refs = self._refs
        released = []  # the keys that become evictable again, in call order
        for key, block_id in zip(keys, block_ids, strict=True):
            refs[block_id] -= 1
            if not refs[block_id]:
                released.append(key)
        self._num_evictable += len(released)
        self._policy.mark_evictable_each(released)

    # -- helpers ---------------------------------------------------------------------------

    def _lookup(self, key: Key) -> Lookup:
        if key not in self._block_id_of:
            return Lookup.MISS
        return Lookup.PENDING if key in self._storing else Lookup.HIT

    def _is_ready(self, key: Key) -> bool:
        return key in self._block_id_of and key not in self._storing

    def _is_evictable(self, key: Key) -> bool:
        block_id = self._block_id_of.get(key)
        return block_id is not None and key not in self._storing and not self._refs[block_id]

    def _require_ready(self, key: Key) -> None:
        found = self._lookup(key)
        if found is Lookup.MISS:
            raise BlockNotFoundError(f"cannot load {key!r}: it is not in the CPU pool")
        if found is Lookup.PENDING:
            raise BlockPendingError(f"cannot load {key!r}: its store has not completed yet")

    def _emit(self, keys: list[Key], reason: RemovalReason | None = None) -> None:
        """Record that ``keys`` were stored (no ``reason``) or removed for ``reason``; the
        event is only built when events are on (the hot path pays nothing otherwise).
        """
        if self._events is not None and keys:
            event = (
                BlocksStored(tuple(keys)) if reason is None else BlocksRemoved(tuple(keys), reason)
            )
            self._events.append(event)

    def _open(self, plan: PlanT) -> PlanT:
        self._next_plan_id += 1
        self._open_plans[plan.plan_id] = plan
        self._opened_at[plan.plan_id] = self._clock()
        return plan

    def _close(self, plan: object, kind: type[PlanT]) -> PlanT:
        checked: PlanT
        if type(plan) is kind and self._open_plans.get(plan.plan_id) is plan:
            checked = plan  # the very plan object this manager issued: nothing to check
        else:
            checked = check_open_plan(
                plan,
                kind,
                owner=self._owner,
                open_plans=self._open_plans,
                issued=self._next_plan_id,
            )
        del self._open_plans[checked.plan_id]
        del self._opened_at[checked.plan_id]
        return checked

    def _representation_violations(self) -> list[str]:
        """What is wrong with the tables themselves, in words: what the abstraction cannot
        show (the spec's invariants cover everything it can)."""
        from kvoffload.manager_refinement import representation_violations

        return representation_violations(self)
