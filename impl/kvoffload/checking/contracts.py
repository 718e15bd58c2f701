"""Contract-checked managers, for CrossHair: each operation as one commuting square.

``OffloadManager`` itself carries no contracts (they would cost every call O(n)). Here
each operation is wrapped in a ``check_*`` function, bound as a method of ``LruChecks``,
``ArcChecks`` and ``DuelChecks``, whose leading asserts are its preconditions (CrossHair's
"asserts" analysis). Each check states the one contract of the refinement mapping
(``kvoffload_spec.refinement``), from the manager's present state ``m``::

    abstract(op(m)) == spec_op(abstract(m))

The spec's side is an ``OffloadModel`` carrying on from a copy of ``abstract(m)``, driven
with the manager by the one lockstep driver (``Lockstep.mirror``: the same plan objects
are valid on both sides). The check asserts the invariants before and after, that both
returned equal results or raised errors of one class, and that the abstract states are
then equal field by field (blocks, free block ids, the evictable counter of vLLM PR
#45757, the policy's order, quarantines, open plans, the offer tracker, events). So no
postcondition is written by hand: what a call must do is what the spec's transition does.
(The driver's full ``check``, which compares counts, lookups and stats too, is left to the
conformance kit: here it made CrossHair's search 40% slower per path.)

CrossHair builds ``self`` through ``__init__`` from symbolic arguments. A manager's state
cannot be written down field by field without duplicating the manager, so the constructor
*replays* a short history, given as the fate of each key, through the public operations
instead: every state it builds is one a caller can reach, and none is junk that the
invariants would have to filter out (a vacuous pass). Check one method at a time, with
tiny capacities::

    crosshair check --analysis_kind=asserts --per_condition_timeout=5 \\
        kvoffload.checking.contracts.LruChecks.check_prepare_store
"""

from __future__ import annotations

import enum
from typing import ClassVar

from kvoffload.checking.lockstep import Lockstep, agree
from kvoffload.manager import OffloadManager
from kvoffload_spec.contracts import CHECKS as SPEC_CHECKS
from kvoffload_spec.errors import SpecViolation
from kvoffload_spec.operations import (
    ABANDON,
    ABANDON_AGAIN,
    AGAIN,
    COMPLETE_LOAD,
    COMPLETE_STORE,
    PREPARE_LOAD,
    PREPARE_STORE,
    RESET,
    TOUCH,
    Operation,
)
from kvoffload_spec.refinement import state_differences
from kvoffload_spec.surface import Key, LoadPlan, Lookup, Plan, StorePlan

MAX_BLOCKS = 3
KEYS = 4  # the keys a history uses: one more than fits, so that stores must evict

# The spec's contracts and these check the same operations: the methods to hand to
# ``crosshair check``, one target each, on each class below.
CHECKS = SPEC_CHECKS


def plain(value: int, bound: int) -> int:
    """``value`` (which lies in ``range(bound)``) as a plain int.

    Under CrossHair each comparison forks the path, so that every state holds plain ints:
    CrossHair copies each state it builds, and a sorted list cannot be rebuilt from
    symbolic keys outside the analysis.
    """
    return next(choice for choice in range(bound) if choice == value)


def plain_keys(keys: list[int]) -> list[Key]:
    """``keys`` mapped onto the history's keys and one key it never uses."""
    return [plain(key % (KEYS + 1), KEYS + 1) for key in keys]


def frozen_clock() -> float:
    """The checked managers' clock: CrossHair treats ``time.monotonic`` as a symbolic input
    and then sees the same decisions take different paths; no check depends on time.
    """
    return 0.0


class Fate(enum.IntEnum):
    """What the history does with one key (see :class:`CheckedManager`)."""

    ABSENT = 0
    READY = 1
    TOUCHED = 2  # ready, then touched: ARC moves it to T2
    PENDING = 3
    PINNED = 4  # ready, then loaded by a plan left open
    STALE_STORE = 5  # stored before the reset by a plan left open
    STORED_AGAIN = 6  # STALE_STORE, then pending again on a new plan (the ABA hazard)
    STALE_LOAD = 7  # stored and loaded before the reset by a plan left open, then ready
    ABANDONED_STORE = 8  # stored by a plan then abandoned: absent, its slot quarantined
    ABANDONED_LOAD = 9  # ready, then loaded by a plan then abandoned: unpinned again


STALE_FATES = (Fate.STALE_STORE, Fate.STORED_AGAIN, Fate.STALE_LOAD)


class CheckedManager(OffloadManager):
    """A manager built by a short history (see the module's docstring), with checked
    operations.

    ``fates`` gives each of the ``KEYS`` keys its :class:`Fate` (any int: it is taken
    modulo the number of fates): one symbolic int per key forks only into states a history
    reaches, where free-form lists of operations drown CrossHair in redundant ones. The
    history, in order: the stale plans are made and the cache is reset (if there are
    any); the keys to be ready are stored one plan each and completed, in key order (a
    small pool evicts the first ones again); the TOUCHED keys are touched; the PENDING
    and STORED_AGAIN keys are stored in one plan, left open; the PINNED keys still
    resident are loaded, one plan each, left open; the ABANDONED_LOAD keys are stored,
    loaded and their load plans abandoned; the ABANDONED_STORE keys are stored in one plan,
    which is abandoned.

    The manager keeps every plan it issued, completed or not, so that a check can complete
    an open plan, a stale one, or one completed already (which must fail).
    """

    POLICY: ClassVar[str]
    """The policy's name, for the manager and for the spec alike."""

    def __init__(self, num_blocks: int, fates: tuple[int, int, int, int]) -> None:
        size = 1 + plain(num_blocks % MAX_BLOCKS, MAX_BLOCKS)
        super().__init__(size, self.POLICY, clock=frozen_clock)
        self.store_plans: list[StorePlan] = []
        self.load_plans: list[LoadPlan] = []
        fate = [Fate(plain(value % len(Fate), len(Fate))) for value in fates]

        def keys(*wanted: Fate) -> list[Key]:
            return [key for key in range(KEYS) if fate[key] in wanted]

        self._store(keys(Fate.STALE_STORE, Fate.STORED_AGAIN))
        for key in keys(Fate.STALE_LOAD):
            self._store([key], complete=True)
            self._load([key])
        if keys(*STALE_FATES):
            self.reset_cache()
        for key in keys(
            Fate.READY, Fate.TOUCHED, Fate.PINNED, Fate.STALE_LOAD, Fate.ABANDONED_LOAD
        ):
            self._store([key], complete=True)
        self.touch(keys(Fate.TOUCHED))
        self._store(keys(Fate.PENDING, Fate.STORED_AGAIN))
        for key in keys(Fate.PINNED):
            self._load([key])
        for key in keys(Fate.ABANDONED_LOAD):
            if self._load([key]):
                self.abandon(self.load_plans[-1])
        if self._store(keys(Fate.ABANDONED_STORE)):
            self.abandon(self.store_plans[-1])

    def __repr__(self) -> str:
        return f"{super().__repr__()} after plans {[*self.store_plans, *self.load_plans]}"

    def _store(self, keys: list[Key], *, complete: bool = False) -> bool:
        plan = self.prepare_store(keys)
        if plan is None or not plan.keys:
            return False
        self.store_plans.append(plan)
        if complete:
            self.complete_store(plan)
        return True

    def _load(self, keys: list[Key]) -> bool:
        if not all(self.lookup(key) is Lookup.HIT for key in keys):
            return False
        self.load_plans.append(self.prepare_load(keys))
        return True

    # -- what the checks read --------------------------------------------------------------

    def invariants_hold(self) -> bool:
        try:
            self.check_invariants()
        except SpecViolation:
            return False
        return True

    def mirror(self) -> Lockstep:
        """This manager and the spec carrying on from its abstraction, in lockstep; the
        plans it completed already are the driver's closed ones (to complete again)."""
        issued: list[Plan] = [*self.store_plans, *self.load_plans]
        done = [plan for plan in issued if plan.plan_id not in self._open_plans]
        return Lockstep.mirror(self, self.POLICY, closed=done, label=type(self).__name__)


def on_plan(step: Lockstep, name: str, plan: Plan, success: bool = True) -> Operation:
    """``name`` (a completion or ``abandon``) of ``plan`` as the driver indexes it: an open
    plan by its place among the held ones, a completed one as the misuse of doing it again.
    """
    for index, (held, _) in enumerate(step.held):
        if held is plan:
            return Operation(name, plan=index, success=success)
    closed = [mine for mine, _ in step.closed]
    again = ABANDON_AGAIN if name == ABANDON else AGAIN
    return Operation(name, plan=len(step.held) + closed.index(plan), misuse=again)


def commutes(manager: CheckedManager, step: Lockstep, op: Operation) -> None:
    """``abstract(op(m)) == spec_op(abstract(m))``, with equal results: ``op`` made on the
    manager and on the spec carrying on from its abstraction (``step``, from
    :meth:`CheckedManager.mirror`) ends in equal outcomes and equal abstract states.
    """
    got, expected = step.apply(op)  # the driver raises at once on a crash or a divergence
    assert agree(got, expected), f"{op.describe()}: the manager's {got!r}, the spec's {expected!r}"
    differences = state_differences(manager.abstract_state(), step.model.state)
    assert differences == [], differences


# -- the checks --------------------------------------------------------------------------
#
# Functions, bound as methods by the classes at the end: CrossHair analyses a method once
# for its class and once more for each base class that defines it with conditions, so
# checks defined on CheckedManager and re-bound in a subclass (which CrossHair needs: it
# finds a target only in the class's own namespace) would each be analysed twice.


def check_prepare_store(manager: CheckedManager, raw_keys: list[int]) -> None:
    """The square commutes for ``prepare_store`` of any keys, a refused store included."""
    assert manager.invariants_hold()
    commutes(manager, manager.mirror(), Operation(PREPARE_STORE, tuple(plain_keys(raw_keys))))
    assert manager.invariants_hold()


def check_complete_store(manager: CheckedManager, which: int, success: bool) -> None:
    """The square commutes for ``complete_store`` of any plan the manager issued: open,
    stale, abandoned, or completed already."""
    assert manager.store_plans
    assert manager.invariants_hold()
    step = manager.mirror()
    plan = manager.store_plans[which % len(manager.store_plans)]
    commutes(manager, step, on_plan(step, COMPLETE_STORE, plan, success))
    assert manager.invariants_hold()


def check_prepare_load(manager: CheckedManager, raw_keys: list[int]) -> None:
    """The square commutes for ``prepare_load`` of any keys, ready or not."""
    assert manager.invariants_hold()
    commutes(manager, manager.mirror(), Operation(PREPARE_LOAD, tuple(plain_keys(raw_keys))))
    assert manager.invariants_hold()


def check_complete_load(manager: CheckedManager, which: int) -> None:
    """The square commutes for ``complete_load`` of any plan the manager issued."""
    assert manager.load_plans
    assert manager.invariants_hold()
    step = manager.mirror()
    plan = manager.load_plans[which % len(manager.load_plans)]
    commutes(manager, step, on_plan(step, COMPLETE_LOAD, plan))
    assert manager.invariants_hold()


def check_abandon(manager: CheckedManager, which: int) -> None:
    """The square commutes for ``abandon`` of any plan the manager issued."""
    assert manager.store_plans or manager.load_plans
    assert manager.invariants_hold()
    step = manager.mirror()
    plans: list[Plan] = [*manager.store_plans, *manager.load_plans]
    commutes(manager, step, on_plan(step, ABANDON, plans[which % len(plans)]))
    assert manager.invariants_hold()


def check_touch(manager: CheckedManager, raw_keys: list[int]) -> None:
    """The square commutes for ``touch`` of any keys, resident or not."""
    assert manager.invariants_hold()
    commutes(manager, manager.mirror(), Operation(TOUCH, tuple(plain_keys(raw_keys))))
    assert manager.invariants_hold()


def check_reset_cache(manager: CheckedManager) -> None:
    """The square commutes for ``reset_cache``."""
    assert manager.invariants_hold()
    commutes(manager, manager.mirror(), Operation(RESET))
    assert manager.invariants_hold()


class LruChecks(CheckedManager):
    """A checked manager with the LRU policy."""

    POLICY = "lru"
    check_prepare_store = check_prepare_store
    check_complete_store = check_complete_store
    check_prepare_load = check_prepare_load
    check_complete_load = check_complete_load
    check_abandon = check_abandon
    check_touch = check_touch
    check_reset_cache = check_reset_cache


class ArcChecks(CheckedManager):
    """A checked manager with the ARC policy."""

    POLICY = "arc"
    check_prepare_store = check_prepare_store
    check_complete_store = check_complete_store
    check_prepare_load = check_prepare_load
    check_complete_load = check_complete_load
    check_abandon = check_abandon
    check_touch = check_touch
    check_reset_cache = check_reset_cache


class DuelChecks(CheckedManager):
    """A checked manager with the duel policy."""

    POLICY = "duel"
    check_prepare_store = check_prepare_store
    check_complete_store = check_complete_store
    check_prepare_load = check_prepare_load
    check_complete_load = check_complete_load
    check_abandon = check_abandon
    check_touch = check_touch
    check_reset_cache = check_reset_cache
