"""Breadth-first search over a world of steps: every state reachable within a bound, each
checked, the first violation reported with a shortest path to it.

The tier worlds (:mod:`kvoffload_spec.disk`; :mod:`kvoffload_spec.tiers` has its own copy of
this loop) give a root, the steps that apply in a state, the state after a step (a copy; None
when the step does not apply; raising ``violation`` when a guarantee fails) and a canonical
key per state, so that each state is expanded once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

from kvoffload_spec.explore import Counterexample, Report

W = TypeVar("W")
Op = TypeVar("Op")


def breadth_first(
    root: W,
    *,
    depth: int,
    steps: Callable[[W], Sequence[Op]],
    after: Callable[[W, Op], W | None],
    key: Callable[[W], Hashable],
    violation: type[Exception],
    max_seconds: float | None = None,
) -> Report:
    """Every state within ``depth`` steps of ``root``, breadth first."""
    start = time.perf_counter()
    deadline = None if max_seconds is None else start + max_seconds
    parents: dict[Hashable, tuple[Hashable, str] | None] = {key(root): None}
    level = [root]
    transitions = 0

    def report(done: int, complete: bool, found: Counterexample | None) -> Report:
        seconds = time.perf_counter() - start
        return Report(len(parents), transitions, seconds, done, complete, found)

    for done in range(depth):
        following: list[W] = []
        for world in level:
            if deadline is not None and time.perf_counter() > deadline:
                return report(done, False, None)
            here = key(world)
            for op in steps(world):
                transitions += 1
                try:
                    child = after(world, op)
                except Exception as error:
                    path = (*_path(parents, here), str(op))
                    message = str(error) if isinstance(error, violation) else repr(error)
                    return report(done, False, Counterexample(path, message))
                if child is None:
                    continue
                child_key = key(child)
                if child_key not in parents:
                    parents[child_key] = (here, str(op))
                    following.append(child)
        level = following
    return report(depth, True, None)


def _path(parents: dict[Hashable, tuple[Hashable, str] | None], key: Hashable) -> list[str]:
    steps: list[str] = []
    link = parents[key]
    while link is not None:
        key, step = link
        steps.append(step)
        link = parents[key]
    return steps[::-1]
