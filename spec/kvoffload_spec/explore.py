"""Exhaustive exploration: every state the manager reaches in a few calls, each one checked.

Breadth first from a fresh system, :func:`explore` applies every operation with every
argument from a small alphabet: ``prepare_store``, ``prepare_load`` and ``touch`` of every
ordering of every subset of the keys (and of the empty list, the first key twice, and a
list with an unhashable key), ``reset_cache``, and, for every plan still held (stale ones
after a reset included), its completion, successful or failed and tried a second time at
once, and ``abandon``, which gives up on a stalled job. States are canonicalised (plan ids
and generations renamed, since only "current or stale" of a plan matters), so each is
expanded once. After every call it checks, by families (see :data:`CHECKS`):

``invariants``
    the system's own ``check_invariants()``.
``model``
    what the plans handed out so far predict, whatever the eviction policy: each key's
    lookup, the free, evictable and quarantined counts, whether each plan held is
    abandoned (``is_abandoned``); a refused ``prepare_store`` only
    when the candidates cannot fit in the free blocks plus the blocks that are ready,
    unpinned and outside the call; a store plan's candidates in call order, its victims
    evictable and not in the call, its block ids the lowest free ones; a load of a key that is
    not ready refused with the right error, else planned on the key's own block id.
``events``
    the events emitted are those of the call.
``unchanged``
    a call that raised, a refused store (its offer tracker aside) and a stale completion
    change nothing; a second completion of a plan raises ``PlanAlreadyCompletedError``, a
    second ``abandon`` ``PlanAlreadyAbandonedError``.
``data``
    a shadow of the CPU pool records whose bytes each block id holds (written when a store job
    completes; a reset fences the jobs issued before it, all but the abandoned ones, whose
    block ids stay quarantined); every load reads its own key's bytes, at the start and at the
    end of the read; no store takes a block id being read, nor one an abandoned job may write.

An argument list with an unhashable key must raise ``InvalidArgumentError``, always. The
first violation stops the search; breadth first makes its counterexample a shortest one.

>>> from kvoffload_spec import OffloadModel
>>> report = explore(lambda: OffloadModel(1, enable_events=True), keys=("a",), depth=3)
>>> report.ok, report.complete, report.states
(True, True, 54)

From the command line: ``python -m kvoffload_spec.explore --policy arc --blocks 2 --keys 3
--depth 4``.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import sys
import time
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, cast

from kvoffload_spec.checked_call import Checker, FingerprintFn, Node, S, Violation
from kvoffload_spec.checked_call import System as System  # the explorer's names, as before
from kvoffload_spec.checked_call import model_fingerprint as model_fingerprint
from kvoffload_spec.errors import InvalidArgumentError
from kvoffload_spec.model import OffloadModel
from kvoffload_spec.operations import (
    ABANDON,
    COMPLETE_LOAD,
    COMPLETE_STORE,
    PREPARE_LOAD,
    PREPARE_STORE,
    RESET,
    TOUCH,
    Operation,
)
from kvoffload_spec.policies import POLICY_NAMES
from kvoffload_spec.refinement import copy_state
from kvoffload_spec.surface import (
    Key,
)
from kvoffload_spec.validation import check_count, check_keys, check_seconds

CHECKS = frozenset({"invariants", "model", "events", "unchanged", "data"})
"""The families of checks (see the module's docstring); :func:`explore` runs them all."""


def clone_model(model: OffloadModel) -> OffloadModel:
    """A deep copy of the reference model, several times faster than ``copy.deepcopy``
    (see :func:`kvoffload_spec.refinement.copy_state`)."""
    return OffloadModel.from_state(copy_state(model.state), model.policy)


# -- operations ----------------------------------------------------------------------------


def key_sequences(keys: Sequence[Key]) -> list[tuple[Key, ...]]:
    """The key lists passed to ``prepare_*`` and ``touch``: the empty list, every ordering
    of every subset of ``keys``, and the first key twice."""
    sequences: list[tuple[Key, ...]] = [()]
    for size in range(1, len(keys) + 1):
        sequences.extend(itertools.permutations(keys, size))
    return [*sequences, (keys[0], keys[0])]


def _keyed_operations(keys: Sequence[Key]) -> list[Operation]:
    names = (PREPARE_STORE, PREPARE_LOAD, TOUCH)
    calls = [Operation(name, sequence) for name in names for sequence in key_sequences(keys)]
    malformed = [Operation(name, (keys[0],), malformed=True) for name in names]
    return [*calls, Operation(RESET), *malformed]


# -- the report -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Counterexample:
    """A shortest sequence of calls from a fresh system to a failed check."""

    steps: tuple[str, ...]
    message: str

    def __str__(self) -> str:
        lines = [f"  {n}. {step}" for n, step in enumerate(self.steps, 1)]
        return "\n".join([*lines, f"  -> {self.message}"])


@dataclass(frozen=True)
class Report:
    """What an exploration covered and the first violation it found, if any."""

    states: int
    transitions: int
    seconds: float
    depth: int  # the deepest level whose states were all expanded
    complete: bool  # every state within the depth bound was expanded
    violation: Counterexample | None

    @property
    def ok(self) -> bool:
        return self.violation is None

    def summary(self) -> str:
        verdict = "ok" if self.ok else "VIOLATION"
        cover = "all states" if self.complete else f"complete to depth {self.depth}"
        head = (
            f"{verdict}: {self.states} states, {self.transitions} transitions, "
            f"{self.seconds:.1f} s ({cover})"
        )
        if self.violation is None:
            return head
        count = len(self.violation.steps)
        return f"{head}\nshortest counterexample ({count} calls):\n{self.violation}"


# -- the search -----------------------------------------------------------------------------


def explore(
    make_system: Callable[[], S],
    *,
    keys: Sequence[Key],
    depth: int,
    fingerprint: FingerprintFn[S] | None = None,
    clone: Callable[[S], S] | None = None,
    store_threshold: int = 1,
    checks: Collection[str] = CHECKS,
    max_seconds: float | None = None,
) -> Report:
    """Explore every state ``make_system()`` reaches in at most ``depth`` calls on ``keys``.

    ``fingerprint`` defaults to :func:`model_fingerprint`, the fingerprint of the system's
    abstraction, which works for every system that states one (``abstract_state()``: the
    reference model, ``OffloadManager``); give one for any other system. By default the
    abstraction of each state is built once: a system whose ``check_invariants`` takes
    ``abstraction=`` (both of those) is handed the one built for the fingerprint. ``clone``
    defaults to :func:`clone_model` for the model, else ``copy.deepcopy``.
    ``store_threshold`` is the system's: with 1, a store's candidates are checked exactly.
    ``checks`` picks families from :data:`CHECKS`: leave out ``"events"`` for a system
    built without events.
    ``max_seconds`` stops the search early; the report then says how deep it was complete.
    Raises :class:`InvalidArgumentError` on a bad argument, before exploring.
    """
    check_count("depth", depth, minimum=0)
    check_count("store_threshold", store_threshold)
    alphabet = list(check_keys(keys))
    if not alphabet or len(set(alphabet)) != len(alphabet):
        raise InvalidArgumentError(f"keys must be distinct and at least one, got {keys!r}")
    unknown = set(checks) - CHECKS
    if unknown:
        raise InvalidArgumentError(
            f"unknown checks {sorted(unknown)}: choose from {sorted(CHECKS)}"
        )
    if max_seconds is not None:
        check_seconds("max_seconds", max_seconds)
    if clone is None:
        clone = cast(Callable[[S], S], _clone)
    checker = Checker(fingerprint, clone, alphabet, store_threshold, frozenset(checks))
    return _Search(checker, make_system, _keyed_operations(alphabet)).run(depth, max_seconds)


def _clone(system: object) -> object:
    return clone_model(system) if type(system) is OffloadModel else copy.deepcopy(system)


class _Search(Generic[S]):
    def __init__(
        self, checker: Checker[S], make_system: Callable[[], S], keyed: list[Operation]
    ) -> None:
        self.checker = checker
        self.make_system = make_system
        self.keyed = keyed
        self.with_memory = "data" in checker.checks
        self.parents: dict[Hashable, tuple[Hashable, Operation] | None] = {}
        self.transitions = 0

    def run(self, depth: int, max_seconds: float | None) -> Report:
        start = time.perf_counter()
        deadline = None if max_seconds is None else start + max_seconds

        def report(level: int, complete: bool, violation: Counterexample | None) -> Report:
            seconds = time.perf_counter() - start
            return Report(len(self.parents), self.transitions, seconds, level, complete, violation)

        try:
            root = self.checker.root(self.make_system())
        except Violation as violation:
            return report(0, False, Counterexample((), f"a fresh system: {violation}"))
        self.parents[root.key(self.with_memory)] = None
        frontier = [root]
        for level in range(depth):
            following: list[Node[S]] = []
            for node in frontier:
                if deadline is not None and time.perf_counter() > deadline:
                    return report(level, False, None)
                found = self._expand(node, following)
                if found is not None:
                    return report(level, False, found)
            frontier = following
        return report(depth, True, None)

    def _expand(self, node: Node[S], following: list[Node[S]]) -> Counterexample | None:
        here = node.key(self.with_memory)
        for op in self.checker.operations(node, self.keyed):
            self.transitions += 1
            try:
                child = self.checker.apply(node, op)
            except Violation as violation:
                return self._counterexample(here, op, str(violation))
            if child is None:
                continue
            if op.name in (COMPLETE_STORE, COMPLETE_LOAD):
                self.transitions += 1
                try:
                    self.checker.complete_again(child, op, node.held[op.plan].plan)
                except Violation as violation:
                    return self._counterexample(here, op, str(violation), again=True)
            key = child.key(self.with_memory)
            if key not in self.parents:
                self.parents[key] = (here, op)
                following.append(child)
        return None

    def _counterexample(
        self, last: Hashable, op: Operation, message: str, *, again: bool = False
    ) -> Counterexample:
        """Replays the path to ``last``, then ``op``, naming plans in the order issued."""
        path = [op]
        entry = self.parents[last]
        while entry is not None:
            last, step = entry
            path.append(step)
            entry = self.parents[last]
        path.reverse()
        node = self.checker.root(self.make_system())
        names: dict[int, int] = {}
        steps = []
        for step in path[:-1]:
            steps.append(_describe(step, node, names))
            child = self.checker.apply(node, step)
            assert child is not None, "the search records only calls that made a new state"
            for held in child.held:
                names.setdefault(held.plan.plan_id, len(names) + 1)
            node = child
        steps.append(_describe(op, node, names))
        if again:
            steps.append(f"{steps[-1]} again")
        return Counterexample(tuple(steps), message)


def _describe(op: Operation, node: Node[S], names: Mapping[int, int]) -> str:
    if op.plan >= 0:
        held = node.held[op.plan]
        fate = ("" if held.current else " stale") + (" abandoned" if held.abandoned else "")
        plan = f"plan {names.get(held.plan.plan_id, '?')}" + (f" ({fate[1:]})" if fate else "")
        if op.name == ABANDON:
            return f"abandon({plan})"
        if op.name == COMPLETE_STORE:
            return f"complete_store({plan}, success={op.success})"
        return f"complete_load({plan})"
    if op.name == RESET:
        return "reset_cache()"
    return f"{op.name}({op.arguments()!r})"


# -- command line ---------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvoffload_spec.explore``: explore the reference model, print the report."""
    parser = argparse.ArgumentParser(
        prog="python -m kvoffload_spec.explore",
        description="Explore every state of the reference model within a number of calls.",
    )
    parser.add_argument("--policy", choices=POLICY_NAMES, default="lru")
    parser.add_argument("--blocks", type=int, default=2, help="CPU blocks (default 2)")
    parser.add_argument("--keys", type=int, default=3, help="distinct keys, 1-26 (default 3)")
    parser.add_argument("--depth", type=int, default=4, help="calls per path (default 4)")
    parser.add_argument("--threshold", type=int, default=1, help="store_threshold (default 1)")
    parser.add_argument("--max-seconds", type=float, default=None, help="time budget")
    args = parser.parse_args(argv)
    if not 1 <= args.keys <= 26 or args.blocks < 1 or args.depth < 0 or args.threshold < 1:
        parser.error("need 1 <= --keys <= 26, --blocks >= 1, --depth >= 0, --threshold >= 1")
    if args.max_seconds is not None and not args.max_seconds > 0:
        parser.error("--max-seconds must be positive")
    keys = tuple("abcdefghijklmnopqrstuvwxyz"[: args.keys])
    print(
        f"exploring {args.policy} with {args.blocks} blocks, keys {', '.join(keys)}, "
        f"depth {args.depth}, store_threshold {args.threshold}"
    )
    report = explore(
        lambda: OffloadModel(
            args.blocks, args.policy, store_threshold=args.threshold, enable_events=True
        ),
        keys=keys,
        depth=args.depth,
        store_threshold=args.threshold,
        max_seconds=args.max_seconds,
    )
    print(report.summary())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
