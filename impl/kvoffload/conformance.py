"""A conformance kit: check any offloading manager against the spec, call by call.

``check_conformance(make_manager, policy="lru")`` runs a Hypothesis state machine that
drives a manager built by ``make_manager`` and the reference ``OffloadModel`` side by side,
with the same calls, tiny capacities and a handful of keys, so that eviction, failed stores,
stale completions and bad arguments come up often. After every step it compares what both
returned or raised, every lookup, the counters and the events, and runs
``check_invariants()`` on both. See docs/conformance.md.

With a built-in policy name the manager must match the spec exactly, victims included. With
``policy=None`` (a policy the spec does not know), the spec follows the manager's victims
and checks only what does not depend on them: each victim was evictable and unprotected,
a store was refused only when there was truly no room, and everything else (slots, states,
counters, events, errors) is exactly the spec's.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from typing import ClassVar, Protocol, TypeVar

import hypothesis
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvoffload.manager import OffloadManager
from kvoffload.policies.arc import ArcPolicy
from kvoffload.policies.duel import DuelPolicy
from kvoffload.policies.lru import LruPolicy
from kvoffload_spec.errors import OffloadError
from kvoffload_spec.model import OffloadModel
from kvoffload_spec.policies import POLICY_NAMES, ArcOrder, DuelOrder, LruOrder
from kvoffload_spec.surface import Key, LoadPlan, Lookup, ManagerSurface, StorePlan
from kvoffload_spec.validation import check_policy_name

_T = TypeVar("_T")
Plan = StorePlan | LoadPlan

# Keys of several hashable types; none equal to another (so no 1 and True, 2 and 2.0).
KEY_POOL: tuple[Key, ...] = (0, b"h1", "h2", (3, "t"), 4.5, frozenset({5}), 6, "h7", b"h8", (9,))
# Usually a few keys, so that they collide; sometimes all of them, so that ARC can hold more
# ghosts than residents: a ratio |B2|/|B1| such as 3/2 needs five ghosts besides the pool.
POOL_SIZES = (4, 5, 6, len(KEY_POOL))
# After a round of churn: touch nothing, the keys just stored (into T2), or every absent key
# (ghost hits, each moving ARC's target).
CHURN_TOUCHES = ("nothing", "stored", "absent")

Churn = tuple[tuple[int, str], ...]
DIRECTED: tuple[tuple[int, Churn, tuple[int, ...]], ...] = (
    # ARC: a B1 ghost hit at |B2|/|B1| = 3/2 moves p by 1.5, then B2 hits move it back.
    (3, ((1, "stored"), (3, "nothing"), (1, "stored"), (3, "absent")), ()),
    # ARC at 4 blocks: ghost hits at ratios 3/2 and 2/3, p fractional when the pool refills.
    (4, ((1, "stored"), (3, "nothing"), (2, "stored"), (3, "absent"), (4, "nothing")), ()),
    # A touch whose repeat is not adjacent: the first occurrence decides (0 ends most recent).
    (3, ((3, "nothing"),), (0, 1, 0)),
    (3, ((3, "stored"),), (2, 0, 1, 0, 2)),
)
"""Histories that random generation reaches only rarely, run before the random ones: each
is (pool size, churn rounds as in ``ConformanceMachine.start``, then a touch of these
``KEY_POOL`` indices)."""
# Arguments every keyed method must refuse with InvalidArgumentError, changing nothing.
BAD_KEYS = st.sampled_from(("h2", b"h1", 7, None, [[0]], [0, {}]))
KEYED_METHODS = ("prepare_store", "prepare_load", "touch", "lookup")
PLAN_MISUSES = ("foreign", "other kind", "forged id", "altered", "flag", "junk", "abandon junk")


class ConformanceError(AssertionError):
    """The manager did something the spec would not have done."""


ManagerLike = ManagerSurface
"""The public surface of an offloading manager, as the kit uses it."""


class ManagerFactory(Protocol):
    """Builds a fresh manager; the kit passes everything but the policy."""

    def __call__(
        self, num_blocks: int, *, store_threshold: int, max_tracker_size: int, enable_events: bool
    ) -> ManagerLike: ...


@dataclasses.dataclass
class DictatedOrder(LruOrder):
    """A spec order whose victims are dictated by the manager under test, once checked.

    ``answer`` is what the manager's ``prepare_store`` evicted (None if it returned None).
    The spec asks for victims only when it needs some and its O(1) guard passed; the answer
    must then be exactly ``need`` distinct keys the spec may evict, or None only when fewer
    than ``need`` keys could be.
    """

    answer: tuple[Key, ...] | None = None

    def choose_victims(self, need: int, can_evict: Callable[[Key], bool]) -> list[Key] | None:
        if self.answer is None:
            room = sum(1 for key in self.order if can_evict(key))
            if room >= need:
                raise ConformanceError(f"a store needing {need} was refused; {room} could go")
            return None
        victims = list(self.answer)
        illegal = [key for key in victims if not can_evict(key)]
        if illegal or len(victims) != need or len(set(victims)) != need:
            raise ConformanceError(
                f"evicted {victims} to make room for {need}: {illegal} are pinned, pending, "
                "protected or absent, or the count is wrong"
            )
        return victims


def _attempt(call: Callable[[], _T]) -> _T | OffloadError:
    """What ``call`` returned, or the ``OffloadError`` it raised; any other error is a bug."""
    try:
        return call()
    except OffloadError as error:
        return error
    except AssertionError:
        raise
    except Exception as error:
        raise ConformanceError(f"crashed: {error!r}") from error


def _agree(got: object, expected: object) -> bool:
    if isinstance(got, OffloadError) or isinstance(expected, OffloadError):
        return type(got) is type(expected)
    return got == expected


def _shown(result: object) -> str:
    """A result as a person reads it: a plan's fields by name, an error by its class."""
    if isinstance(result, OffloadError):
        return f"raised {type(result).__name__}"
    if isinstance(result, StorePlan):
        return (
            f"StorePlan(keys={list(result.keys)!r}, block_ids={list(result.block_ids)!r}, "
            f"evicted={list(result.evicted_keys)!r}, plan_id={result.plan_id}, "
            f"generation={result.generation})"
        )
    if isinstance(result, LoadPlan):
        return (
            f"LoadPlan(keys={list(result.keys)!r}, block_ids={list(result.block_ids)!r}, "
            f"plan_id={result.plan_id}, generation={result.generation})"
        )
    if result is None:
        return "None"
    return repr(result)


def _complete(target: ManagerLike | OffloadModel, plan: object) -> None:
    """Complete ``plan`` with the method its kind calls for (a non-plan goes to stores)."""
    if isinstance(plan, LoadPlan):
        target.complete_load(plan)
    else:
        target.complete_store(plan)  # type: ignore[arg-type]  # refusing a non-plan is tested


class ConformanceMachine(RuleBasedStateMachine):
    """Drives a manager and the spec side by side (build one with ``conformance_machine``).

    Every call is recorded, numbered, with the manager's result, so that a failure reads as
    the explorer's do: the history of manager calls, then the two results that differed.
    """

    make_manager: ClassVar[ManagerFactory]
    policy: ClassVar[str | None]

    def __init__(self) -> None:
        super().__init__()
        self.manager: ManagerLike
        self.model: OffloadModel
        self.keys: tuple[Key, ...] = ()
        self.unused: list[Key] = []  # the pool's keys, least recently stored by churn first
        self.stores: list[tuple[StorePlan, StorePlan]] = []  # open: (manager's, spec's)
        self.loads: list[tuple[LoadPlan, LoadPlan]] = []
        self.closed: list[tuple[Plan, Plan]] = []
        self.setting = ""  # the manager's configuration, in words
        self.history: list[tuple[str, object]] = []  # (call, the manager's result)
        self.plan_names: dict[int, str] = {}  # id() of a manager's plan -> "plan N"

    @initialize(
        num_blocks=st.integers(1, 4),
        pool=st.sampled_from(POOL_SIZES),
        store_threshold=st.sampled_from((1, 1, 1, 2, 3)),
        max_tracker_size=st.sampled_from((1, 2, 64_000, 64_000)),
        enable_events=st.booleans(),
        warm_up=st.integers(0, len(KEY_POOL)),
        churn=st.lists(st.tuples(st.integers(1, 4), st.sampled_from(CHURN_TOUCHES)), max_size=4),
    )
    def start(
        self,
        num_blocks: int,
        pool: int,
        store_threshold: int,
        max_tracker_size: int,
        enable_events: bool,
        warm_up: int,
        churn: list[tuple[int, str]],
    ) -> None:
        """A fresh manager and spec, then ``warm_up`` keys stored one by one (evicting once
        the pool is full), so that most histories start where eviction happens. Then each
        round of ``churn`` stores that many absent keys at once (the least recently used
        absent keys of the pool first), completes them and then touches nothing, them (ready,
        so into ARC's T2) or every absent key: rounds like these push T2 and T1 keys out
        into ARC's ghost lists in any proportion, and hit those ghosts, so that the target
        ``p`` moves by fractions (|B2|/|B1| = 3/2, say).
        """
        self.keys = KEY_POOL[:pool]
        self.setting = (
            f"num_blocks={num_blocks}, store_threshold={store_threshold}, "
            f"max_tracker_size={max_tracker_size}, enable_events={enable_events}; "
            f"keys {', '.join(map(repr, self.keys))}"
        )
        self.manager = type(self).make_manager(
            num_blocks,
            store_threshold=store_threshold,
            max_tracker_size=max_tracker_size,
            enable_events=enable_events,
        )
        self.model = OffloadModel(
            num_blocks,
            self.policy or "lru",
            store_threshold=store_threshold,
            max_tracker_size=max_tracker_size,
            enable_events=enable_events,
        )
        if self.policy is None:
            self.model.state.order = DictatedOrder()
        for key in self.keys[:warm_up]:
            for _ in range(store_threshold):  # offered often enough to become a candidate
                self._store([key])
            while self.stores:
                self._complete_store(0, success=True)
        self.unused = list(self.keys[warm_up:]) + list(self.keys[:warm_up])
        for count, touch in churn:
            absent = [key for key in self.unused if self.model.lookup(key) is Lookup.MISS]
            batch = absent[:count]
            self.unused = [key for key in self.unused if key not in batch] + batch
            for _ in range(store_threshold):
                self._store(batch)
            while self.stores:
                self._complete_store(0, success=True)
            if touch == "stored":
                self._touch(batch)
            elif touch == "absent":
                self._touch(self._keys_in(Lookup.MISS))

    # -- operations ------------------------------------------------------------------------

    @rule(data=st.data())
    def store(self, data: st.DataObject) -> None:
        self._store(self._draw_keys(data))

    @precondition(lambda self: bool(self._keys_in(Lookup.MISS)))
    @rule(data=st.data(), complete_now=st.booleans())
    def store_absent(self, data: st.DataObject, complete_now: bool) -> None:
        """Store absent keys (the calls that need room, so evict), often completing at once
        so that the pool fills with ready blocks.
        """
        absent = st.sampled_from(self._keys_in(Lookup.MISS))
        self._store(data.draw(st.lists(absent, min_size=1, max_size=self.model.num_blocks)))
        if complete_now and self.stores:
            self._complete_store(len(self.stores) - 1, success=True)

    @precondition(lambda self: bool(self.stores))
    @rule(data=st.data(), success=st.sampled_from((True, True, True, False)))
    def complete_store(self, data: st.DataObject, success: bool) -> None:
        self._complete_store(data.draw(st.integers(0, len(self.stores) - 1)), success)

    @precondition(lambda self: bool(self._keys_in(Lookup.HIT)))
    @rule(data=st.data(), complete_now=st.booleans())
    def load_ready(self, data: st.DataObject, complete_now: bool) -> None:
        """Load ready keys (repeats pin twice), often finishing at once: open loads pin."""
        ready = st.sampled_from(self._keys_in(Lookup.HIT))
        self._load(data.draw(st.lists(ready, min_size=1, max_size=4)))
        if complete_now and self.loads:
            self._complete_load(len(self.loads) - 1)

    @rule(data=st.data())
    def load_any(self, data: st.DataObject) -> None:
        self._load(self._draw_keys(data))

    @precondition(lambda self: bool(self.loads))
    @rule(data=st.data())
    def complete_load(self, data: st.DataObject) -> None:
        self._complete_load(data.draw(st.integers(0, len(self.loads) - 1)))

    @rule(data=st.data(), among=st.sampled_from((None, Lookup.MISS, Lookup.PENDING, Lookup.HIT)))
    def touch(self, data: st.DataObject, among: Lookup | None) -> None:
        """Touch any keys, or only absent ones (ARC's ghost hits, which move its target), or
        only pending ones (they stay in T1), or only ready ones (they move to T2).
        """
        self._touch(self._draw_keys(data, among=None if among is None else self._keys_in(among)))

    @precondition(lambda self: len(self._resident()) >= 2)
    @rule(data=st.data())
    def touch_repeats(self, data: st.DataObject) -> None:
        """Touch resident keys with repeats anywhere in the list (as in ``[a, b, a]``): the
        first occurrence decides, so ``a`` ends up more recent than ``b``.
        """
        resident = self._resident()
        distinct = data.draw(st.lists(st.sampled_from(resident), min_size=2, unique=True))
        again = data.draw(st.lists(st.sampled_from(distinct), min_size=1, max_size=3))
        self._touch(data.draw(st.permutations(distinct + again)))

    @precondition(lambda self: bool(self.stores or self.loads))
    @rule(data=st.data())
    def abandon(self, data: st.DataObject) -> None:
        """Give up on an open plan's job (it stalled): the plan stays open, its completion
        is still due; abandoning it again must fail.
        """
        open_plans: list[tuple[Plan, Plan]] = [*self.stores, *self.loads]
        mine, spec = data.draw(st.sampled_from(open_plans))
        self._both(
            f"abandon({self._name(mine)})",
            lambda: self.manager.abandon(mine),
            lambda: self.model.abandon(spec),
        )

    @precondition(lambda self: self.model.num_free_blocks < self.model.num_blocks)
    @rule()
    def reset(self) -> None:
        self._both("reset_cache()", self.manager.reset_cache, self.model.reset_cache)

    @rule()
    def clone(self) -> None:
        """Carry on with deep copies: plans issued before must still complete on the clones."""
        self.history.append(("copy.deepcopy(manager): the calls go on on the copy", None))
        self.manager = copy.deepcopy(self.manager)
        self.model = copy.deepcopy(self.model)

    # -- misuse: both must raise the same error class and change nothing -------------------

    @rule(data=st.data())
    def misuse(self, data: st.DataObject) -> None:
        """Bad keys, or a plan misused: completed again, another manager's, the wrong kind,
        forged, altered, with a bad flag, or not a plan at all.
        """
        plans: list[tuple[Plan, Plan]] = [*self.stores, *self.loads, *self.closed]
        again = ["again", "abandon again"] if self.closed else []
        kinds = ["bad keys", *(PLAN_MISUSES if plans else ()), *again]
        kind = data.draw(st.sampled_from(kinds), label="misuse")
        if kind == "bad keys":
            self._bad_keys(data.draw(st.sampled_from(KEYED_METHODS)), data.draw(BAD_KEYS))
            return
        mine, spec = data.draw(st.sampled_from(self.closed if kind in again else plans))
        self._both(
            _misuse_call(kind, self._name(mine), mine),
            lambda: _misuse(self.manager, mine, spec, kind),
            lambda: _misuse(self.model, spec, mine, kind),
        )

    # -- after every step ------------------------------------------------------------------

    @invariant()
    def agree(self) -> None:
        try:
            self.manager.check_invariants()
        except Exception as error:  # a broken invariant is whatever the manager raises
            raise self._failure(f"the manager's check_invariants() raised {error!r}") from error
        self.model.check_invariants()
        views = ("num_blocks", "num_free_blocks", "num_evictable_blocks", "num_quarantined_blocks")
        for view in views:
            self._same(view, getattr(self.manager, view), getattr(self.model, view))
        for key in self.keys:
            self._same(f"lookup({key!r})", self.manager.lookup(key), self.model.lookup(key))
        self._same("take_events()", self.manager.take_events(), self.model.take_events())
        if isinstance(self.manager, OffloadManager):
            self._agree_on_stats(self.manager)
            if self.policy is not None:
                self._agree_on_order(self.manager)

    def _agree_on_stats(self, manager: OffloadManager) -> None:
        stats = manager.stats()
        model = self.model
        blocks = model.state.blocks.values()
        pending = sum(1 for block in blocks if not block.ready)
        pinned = sum(1 for block in blocks if block.ready and block.refs)
        evictable, free = model.num_evictable_blocks, model.num_free_blocks
        self._same(
            "stats() (resident, pending, pinned, evictable, free)",
            (stats.resident, stats.pending, stats.pinned, stats.evictable, stats.free),
            (len(blocks), pending, pinned, evictable, free),
        )
        self._same("stats().quarantined", stats.quarantined, model.num_quarantined_blocks)

    def _agree_on_order(self, manager: OffloadManager) -> None:
        """The built-in policies' internal order, compared directly: a wrong order shows up
        here long before it picks a different victim.
        """
        policy, order = manager.policy, self.model.state.order
        if isinstance(policy, LruPolicy) and isinstance(order, LruOrder):
            self._same("LRU order", policy.resident(), order.order)
        elif isinstance(policy, ArcPolicy) and isinstance(order, ArcOrder):
            self._same(
                "ARC lists (T1, T2, B1, B2) and p",
                (*policy.lists(), policy.p),
                (order.t1, order.t2, order.b1, order.b2, order.p),
            )
        elif isinstance(policy, DuelPolicy) and isinstance(order, DuelOrder):
            self._same(
                "duel's orders, histories, shadows and scores", policy.snapshot(), order.snapshot()
            )

    # -- the record, and failures that read as histories -----------------------------------

    def _both(
        self,
        call: str,
        on_manager: Callable[[], object],
        on_spec: Callable[[], object],
        between: Callable[[object], None] | None = None,
    ) -> tuple[object, object]:
        """Make ``call`` on the manager, then on the spec; record it; the results must
        agree (``between`` hears the manager's result before the spec is called)."""
        try:
            got = _attempt(on_manager)
            if between is not None:
                between(got)
            expected = _attempt(on_spec)
        except AssertionError as failure:  # a crash, or victims the spec cannot accept
            self.history.append((call, None))
            raise self._failure(str(failure), last_result=False) from failure
        self.history.append((call, got))
        if not _agree(got, expected):
            raise self._failure(
                "the results differ:\n"
                f"     the manager: {_shown(got)}\n"
                f"     the spec:    {_shown(expected)}",
                last_result=False,
            )
        return got, expected

    def _same(self, what: str, got: object, expected: object) -> None:
        """What both report after the last call must agree."""
        if not _agree(got, expected):
            raise self._failure(
                f"then {what} differs:\n"
                f"     the manager: {_shown(got)}\n"
                f"     the spec:    {_shown(expected)}"
            )

    def _failure(self, what: str, last_result: bool = True) -> ConformanceError:
        """``what`` went wrong, after the history so far: numbered calls with the manager's
        results (the last call's result is in ``what`` unless ``last_result``)."""
        lines = [f"a failing history, on a manager with {self.setting}:"]
        for number, (call, result) in enumerate(self.history, start=1):
            shown_result = last_result or number < len(self.history)
            returned = f" -> {_shown(result)}" if shown_result and "deepcopy" not in call else ""
            lines.append(f"  {number}. {call}{returned}")
        lines.append(f"  -> {what}")
        return ConformanceError("\n".join(lines))

    def _name(self, plan: Plan) -> str:
        """A plan by the call that made it, as the history numbers calls."""
        return self.plan_names.get(id(plan), repr(plan))

    def _named(self, plan: object) -> None:
        if isinstance(plan, (StorePlan, LoadPlan)):
            self.plan_names[id(plan)] = f"plan {len(self.history) + 1}"

    # -- helpers ---------------------------------------------------------------------------

    def _draw_keys(self, data: st.DataObject, among: Sequence[Key] | None = None) -> list[Key]:
        return data.draw(st.lists(st.sampled_from(among or self.keys), max_size=5))

    def _store(self, keys: list[Key]) -> None:
        def dictate(got: object) -> None:
            self._named(got)
            order = self.model.state.order
            if isinstance(order, DictatedOrder):
                order.answer = got.evicted_keys if isinstance(got, StorePlan) else None

        got, expected = self._both(
            f"prepare_store({keys!r})",
            lambda: self.manager.prepare_store(keys),
            lambda: self.model.prepare_store(keys),
            between=dictate,
        )
        if isinstance(got, StorePlan) and isinstance(expected, StorePlan):
            self.stores.append((got, expected))

    def _complete_store(self, index: int, success: bool) -> None:
        mine, spec = self.stores.pop(index)
        self._both(
            f"complete_store({self._name(mine)}, success={success})",
            lambda: self.manager.complete_store(mine, success),
            lambda: self.model.complete_store(spec, success),
        )
        self.closed.append((mine, spec))

    def _complete_load(self, index: int) -> None:
        mine, spec = self.loads.pop(index)
        self._both(
            f"complete_load({self._name(mine)})",
            lambda: self.manager.complete_load(mine),
            lambda: self.model.complete_load(spec),
        )
        self.closed.append((mine, spec))

    def _touch(self, keys: list[Key]) -> None:
        self._both(
            f"touch({keys!r})", lambda: self.manager.touch(keys), lambda: self.model.touch(keys)
        )

    def _resident(self) -> list[Key]:
        return [key for key in self.keys if self.model.lookup(key) is not Lookup.MISS]

    def _keys_in(self, state: Lookup) -> list[Key]:
        return [key for key in self.keys if self.model.lookup(key) is state]

    def _load(self, keys: list[Key]) -> None:
        got, expected = self._both(
            f"prepare_load({keys!r})",
            lambda: self.manager.prepare_load(keys),
            lambda: self.model.prepare_load(keys),
            between=self._named,
        )
        if isinstance(got, LoadPlan) and isinstance(expected, LoadPlan):
            self.loads.append((got, expected))

    def _bad_keys(self, method: str, argument: object) -> None:
        if method == "lookup" and isinstance(argument, list):
            argument = [argument]  # a list is unhashable, so never a valid key
        self._both(
            f"{method}({argument!r})",
            lambda: getattr(self.manager, method)(argument),
            lambda: getattr(self.model, method)(argument),
        )


def _misuse_call(kind: str, name: str, plan: Plan) -> str:
    """The misusing call as the history shows it."""
    complete = "complete_load" if isinstance(plan, LoadPlan) else "complete_store"
    other = "complete_store" if isinstance(plan, LoadPlan) else "complete_load"
    return {
        "again": f"{complete}({name})  # again",
        "abandon again": f"abandon({name})  # again",
        "abandon junk": "abandon('not a plan')",
        "foreign": f"{complete}(the spec's twin of {name})  # another manager's plan",
        "other kind": f"{other}({name})  # the wrong kind of plan",
        "forged id": f"{complete}({name} with plan_id + 1000)",
        "altered": f"{complete}({name} with generation + 1)",
        "flag": f"complete_store({name}, success='yes')"
        if isinstance(plan, StorePlan)
        else "complete_store('not a plan')",
        "junk": "complete_store('not a plan')",
    }.get(kind, f"{complete}('not a plan')")


def _misuse(target: ManagerLike | OffloadModel, own: Plan, other: Plan, kind: str) -> None:
    if kind == "again":
        _complete(target, own)
    elif kind == "abandon again":
        target.abandon(own)
    elif kind == "abandon junk":
        target.abandon("not a plan")  # type: ignore[arg-type]
    elif kind == "foreign":
        _complete(target, other)  # the other side's plan: another owner
    elif kind == "other kind":
        if isinstance(own, StorePlan):
            target.complete_load(own)  # type: ignore[arg-type]
        else:
            target.complete_store(own)  # type: ignore[arg-type]
    elif kind == "forged id":
        _complete(target, dataclasses.replace(own, plan_id=own.plan_id + 1000))
    elif kind == "altered":
        _complete(target, dataclasses.replace(own, generation=own.generation + 1))
    elif kind == "flag" and isinstance(own, StorePlan):
        target.complete_store(own, success="yes")  # type: ignore[arg-type]
    else:
        _complete(target, "not a plan")


def conformance_machine(
    make_manager: ManagerFactory, policy: str | None
) -> type[ConformanceMachine]:
    """A ``ConformanceMachine`` subclass for ``make_manager``; use its ``TestCase`` with
    unittest/pytest, or run it with ``check_conformance``.
    """
    if policy is not None:
        check_policy_name(policy, POLICY_NAMES)
    return type(
        "ConformanceMachine",
        (ConformanceMachine,),
        {"make_manager": staticmethod(make_manager), "policy": policy},
    )


def check_conformance(
    make_manager: ManagerFactory,
    *,
    policy: str | None,
    settings: hypothesis.settings | None = None,
    max_examples: int | None = None,
    stateful_step_count: int | None = None,
) -> None:
    """Check that managers from ``make_manager`` behave as the spec does; raise
    ``ConformanceError`` if not, whose message is the failing history, shrunk: the
    manager's configuration, every call numbered with its arguments and the manager's
    result, and the two results (or states) that differed.

    ``policy`` is the built-in policy the manager uses ("lru" or "arc": compared exactly),
    or None for a policy of your own (victims are only checked for legality). ``settings``
    defaults to the current Hypothesis profile; ``max_examples`` and
    ``stateful_step_count`` override it. One failure is reported, the first one shrunk
    (``report_multiple_bugs`` is off).
    """
    check_directed_histories(make_manager, policy=policy)
    chosen = hypothesis.settings(settings or hypothesis.settings(), report_multiple_bugs=False)
    if max_examples is not None:
        chosen = hypothesis.settings(chosen, max_examples=max_examples)
    if stateful_step_count is not None:
        chosen = hypothesis.settings(chosen, stateful_step_count=stateful_step_count)
    run_state_machine_as_test(conformance_machine(make_manager, policy), settings=chosen)


def check_directed_histories(make_manager: ManagerFactory, *, policy: str | None) -> None:
    """Run only the ``DIRECTED`` histories (``check_conformance`` runs them first): raise
    ``ConformanceError`` naming the history where the manager and the spec part.
    """
    machine = conformance_machine(make_manager, policy)
    for history in DIRECTED:
        _run_directed(machine, *history)


def _run_directed(
    machine_class: type[ConformanceMachine], num_blocks: int, churn: Churn, touch: tuple[int, ...]
) -> None:
    machine = machine_class()
    try:
        machine.start(
            num_blocks=num_blocks,
            pool=len(KEY_POOL),
            store_threshold=1,
            max_tracker_size=64_000,
            enable_events=True,
            warm_up=0,
            churn=list(churn),
        )
        machine.agree()
        if touch:
            machine._touch([KEY_POOL[index] for index in touch])
            machine.agree()
    except ConformanceError as error:
        history = f"{num_blocks} blocks, churn {list(churn)}, touch {touch}"
        # The history's name goes on its header line: the lines below it stay the calls
        # and the verdict, as in every other counterexample.
        header, _, rest = str(error).partition("\n")
        error.args = (f"{header} (the directed history of {history})\n{rest}".rstrip("\n"),)
        raise
    finally:
        machine.teardown()
