"""A conformance kit: check any offloading manager against the spec, call by call.

``check_conformance(make_manager, policy="lru")`` runs a Hypothesis state machine that
drives a manager built by ``make_manager`` and the reference ``OffloadModel`` side by side
through the one lockstep driver (:class:`kvoffload.checking.lockstep.Lockstep`), with the same
calls, tiny capacities and a handful of keys, so that eviction, failed stores, stale
completions and bad arguments come up often. After every step the driver compares what both
returned or raised, every lookup, the counters, the events, both sides' invariants and, for
a manager that states its abstraction (``abstract_state()``, as ``OffloadManager`` does),
the whole abstract state. See docs/conformance.md.

With a built-in policy name the manager must match the spec exactly, victims and order
included. With ``policy=None`` (a policy the spec does not know), the spec follows the
manager's victims and checks only what does not depend on them: each victim was evictable
and unprotected, a store was refused only when there was truly no room, and everything else
(slots, states, counters, events, errors) is exactly the spec's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Protocol

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

from kvoffload.checking.lockstep import Divergence, Lockstep
from kvoffload_spec.defaults import DEFAULT_MAX_TRACKER_SIZE
from kvoffload_spec.model import OffloadModel
from kvoffload_spec.operations import (
    ABANDON,
    CLOSED_MISUSES,
    COMPLETE_LOAD,
    COMPLETE_STORE,
    LOOKUP,
    PLAN_MISUSES,
    PREPARE_LOAD,
    PREPARE_STORE,
    RESET,
    TOUCH,
    Operation,
    misuse_of,
)
from kvoffload_spec.policies import POLICY_NAMES
from kvoffload_spec.surface import Key, LoadPlan, Lookup, ManagerSurface, StorePlan
from kvoffload_spec.validation import check_policy_name

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
    # Duel: LRU-2 leads from the fifth round, and the seventh round's victim is the reused
    # key whose second most recent use is oldest, not the one used longest ago.
    (
        3,
        (
            (2, "stored"),
            (2, "absent"),
            (3, "absent"),
            (2, "stored"),
            (2, "absent"),
            (1, "stored"),
            (1, "absent"),
        ),
        (),
    ),
)
"""Histories that random generation reaches only rarely, run before the random ones: each
is (pool size, churn rounds as in ``ConformanceMachine.start``, then a touch of these
``KEY_POOL`` indices)."""
# Arguments every keyed method must refuse with InvalidArgumentError, changing nothing.
BAD_KEYS = st.sampled_from(("h2", b"h1", 7, None, [[0]], [0, {}]))
KEYED_METHODS = (PREPARE_STORE, PREPARE_LOAD, TOUCH, LOOKUP)

ConformanceError = Divergence
"""The manager did something the spec would not have done (the driver's ``Divergence``)."""

ManagerLike = ManagerSurface
"""The public surface of an offloading manager, as the kit uses it."""


class ManagerFactory(Protocol):
    """Builds a fresh manager; the kit passes everything but the policy."""

    def __call__(
        self, num_blocks: int, *, store_threshold: int, max_tracker_size: int, enable_events: bool
    ) -> ManagerLike: ...


class ConformanceMachine(RuleBasedStateMachine):
    """Draws operations for the lockstep driver (build one with ``conformance_machine``).

    The rules only choose what to call; :class:`~kvoffload.checking.lockstep.Lockstep` makes
    each call on the manager and the spec, compares, and keeps the numbered history a
    failure reads as.
    """

    make_manager: ClassVar[ManagerFactory]
    policy: ClassVar[str | None]

    def __init__(self) -> None:
        super().__init__()
        self.driver: Lockstep
        self.keys: tuple[Key, ...] = ()
        self.unused: list[Key] = []  # the pool's keys, least recently stored by churn first

    @initialize(
        num_blocks=st.integers(1, 4),
        pool=st.sampled_from(POOL_SIZES),
        store_threshold=st.sampled_from((1, 1, 1, 2, 3)),
        max_tracker_size=st.sampled_from(
            (1, 2, DEFAULT_MAX_TRACKER_SIZE, DEFAULT_MAX_TRACKER_SIZE)
        ),
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
        manager = type(self).make_manager(
            num_blocks,
            store_threshold=store_threshold,
            max_tracker_size=max_tracker_size,
            enable_events=enable_events,
        )
        model = OffloadModel(
            num_blocks,
            self.policy or "lru",
            store_threshold=store_threshold,
            max_tracker_size=max_tracker_size,
            enable_events=enable_events,
        )
        self.driver = Lockstep(
            manager,
            model,
            setting=(
                f"num_blocks={num_blocks}, store_threshold={store_threshold}, "
                f"max_tracker_size={max_tracker_size}, enable_events={enable_events}; "
                f"keys {', '.join(map(repr, self.keys))}"
            ),
            watched=self.keys,
            dictated=self.policy is None,
            label="manager",
        )
        for key in self.keys[:warm_up]:
            for _ in range(store_threshold):  # offered often enough to become a candidate
                self._store([key])
            self._complete_every_store()
        self.unused = list(self.keys[warm_up:]) + list(self.keys[:warm_up])
        for count, touch in churn:
            model = self.driver.model
            absent = [key for key in self.unused if model.lookup(key) is Lookup.MISS]
            batch = absent[:count]
            self.unused = [key for key in self.unused if key not in batch] + batch
            for _ in range(store_threshold):
                self._store(batch)
            self._complete_every_store()
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
        self._store(data.draw(st.lists(absent, min_size=1, max_size=self.driver.model.num_blocks)))
        stores = self._held(StorePlan)
        if complete_now and stores:
            self._complete(stores[-1], success=True)

    @precondition(lambda self: bool(self._held(StorePlan)))
    @rule(data=st.data(), success=st.sampled_from((True, True, True, False)))
    def complete_store(self, data: st.DataObject, success: bool) -> None:
        self._complete(data.draw(st.sampled_from(self._held(StorePlan))), success)

    @precondition(lambda self: bool(self._keys_in(Lookup.HIT)))
    @rule(data=st.data(), complete_now=st.booleans())
    def load_ready(self, data: st.DataObject, complete_now: bool) -> None:
        """Load ready keys (repeats pin twice), often finishing at once: open loads pin."""
        ready = st.sampled_from(self._keys_in(Lookup.HIT))
        self._load(data.draw(st.lists(ready, min_size=1, max_size=4)))
        loads = self._held(LoadPlan)
        if complete_now and loads:
            self._complete(loads[-1])

    @rule(data=st.data())
    def load_any(self, data: st.DataObject) -> None:
        self._load(self._draw_keys(data))

    @precondition(lambda self: bool(self._held(LoadPlan)))
    @rule(data=st.data())
    def complete_load(self, data: st.DataObject) -> None:
        self._complete(data.draw(st.sampled_from(self._held(LoadPlan))))

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

    @precondition(lambda self: bool(self.driver.held))
    @rule(data=st.data())
    def abandon(self, data: st.DataObject) -> None:
        """Give up on an open plan's job (it stalled): the plan stays open, its completion
        is still due; abandoning it again must fail.
        """
        index = data.draw(st.integers(0, len(self.driver.held) - 1))
        self.driver.apply(Operation(ABANDON, plan=index))

    @precondition(lambda self: self.driver.model.num_free_blocks < self.driver.model.num_blocks)
    @rule()
    def reset(self) -> None:
        self.driver.apply(Operation(RESET))

    @rule()
    def clone(self) -> None:
        """Carry on with deep copies: plans issued before must still complete on the clones."""
        self.driver.clone()

    # -- misuse: both must raise the same error class and change nothing -------------------

    @rule(data=st.data())
    def misuse(self, data: st.DataObject) -> None:
        """Bad keys, or a plan misused: completed again, another manager's, the wrong kind,
        forged, altered, with a bad flag, or not a plan at all.
        """
        driver = self.driver
        plans = driver.held + driver.closed
        again = list(CLOSED_MISUSES) if driver.closed else []
        kinds = ["bad keys", *(PLAN_MISUSES if plans else ()), *again]
        kind = data.draw(st.sampled_from(kinds), label="misuse")
        if kind == "bad keys":
            method = data.draw(st.sampled_from(KEYED_METHODS))
            argument: object = data.draw(BAD_KEYS)
            if method == LOOKUP and isinstance(argument, list):
                argument = [argument]  # a list is unhashable, so never a valid key
            driver.apply(Operation(method, argument=argument))
            return
        first = len(driver.held) if kind in again else 0
        index = data.draw(st.integers(first, len(plans) - 1))
        driver.apply(misuse_of(kind, plans[index][0], index))

    # -- after every step ------------------------------------------------------------------

    @invariant()
    def agree(self) -> None:
        self.driver.check()

    # -- helpers ---------------------------------------------------------------------------

    def _draw_keys(self, data: st.DataObject, among: Sequence[Key] | None = None) -> list[Key]:
        return data.draw(st.lists(st.sampled_from(among or self.keys), max_size=5))

    def _held(self, kind: type[StorePlan] | type[LoadPlan]) -> list[int]:
        """The indices of the held plans of ``kind``, oldest first."""
        return [n for n, (mine, _) in enumerate(self.driver.held) if isinstance(mine, kind)]

    def _store(self, keys: list[Key]) -> None:
        self.driver.apply(Operation(PREPARE_STORE, tuple(keys)))

    def _load(self, keys: list[Key]) -> None:
        self.driver.apply(Operation(PREPARE_LOAD, tuple(keys)))

    def _touch(self, keys: list[Key]) -> None:
        self.driver.apply(Operation(TOUCH, tuple(keys)))

    def _complete(self, index: int, success: bool = True) -> None:
        mine, _ = self.driver.held[index]
        name = COMPLETE_LOAD if isinstance(mine, LoadPlan) else COMPLETE_STORE
        self.driver.apply(Operation(name, plan=index, success=success))

    def _complete_every_store(self) -> None:
        while stores := self._held(StorePlan):
            self._complete(stores[0], success=True)

    def _resident(self) -> list[Key]:
        return self.driver.resident(self.keys)

    def _keys_in(self, state: Lookup) -> list[Key]:
        model = self.driver.model
        return [key for key in self.keys if model.lookup(key) is state]


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
            max_tracker_size=DEFAULT_MAX_TRACKER_SIZE,
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
