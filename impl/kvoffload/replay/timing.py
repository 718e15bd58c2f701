"""Every manager call the replay makes, timed: :class:`TimedManager` wraps the manager the
offloader drives, :class:`Latency` summarises what it recorded."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvoffload_spec.surface import Key, LoadPlan, Lookup, Plan, StorePlan

if TYPE_CHECKING:
    from kvoffload.manager import OffloadManager
    from kvoffload.stats import ManagerStats


class TimedManager:
    """The manager surface the offloader drives, timing each call of ``inner``."""

    def __init__(self, inner: OffloadManager) -> None:
        self.inner = inner
        self.latencies_ns: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.inner.num_blocks

    def stats(self) -> ManagerStats:
        return self.inner.stats()

    def _timed(self, name: str, started: int) -> None:
        self.latencies_ns.setdefault(name, []).append(time.perf_counter_ns() - started)

    def lookup(self, key: Key) -> Lookup:
        started = time.perf_counter_ns()
        found = self.inner.lookup(key)
        self._timed("lookup", started)
        return found

    def prepare_store(self, keys: Sequence[Key]) -> StorePlan | None:
        started = time.perf_counter_ns()
        plan = self.inner.prepare_store(keys)
        self._timed("prepare_store", started)
        return plan

    def complete_store(self, plan: StorePlan, success: bool = True) -> None:
        started = time.perf_counter_ns()
        self.inner.complete_store(plan, success)
        self._timed("complete_store", started)

    def prepare_load(self, keys: Sequence[Key]) -> LoadPlan:
        started = time.perf_counter_ns()
        plan = self.inner.prepare_load(keys)
        self._timed("prepare_load", started)
        return plan

    def complete_load(self, plan: LoadPlan) -> None:
        started = time.perf_counter_ns()
        self.inner.complete_load(plan)
        self._timed("complete_load", started)

    def abandon(self, plan: Plan) -> None:
        started = time.perf_counter_ns()
        self.inner.abandon(plan)
        self._timed("abandon", started)

    def is_abandoned(self, plan: Plan) -> bool:
        return self.inner.is_abandoned(plan)  # a query, not timed: the offloader's own use

    def touch(self, keys: Sequence[Key]) -> None:
        started = time.perf_counter_ns()
        self.inner.touch(keys)
        self._timed("touch", started)

    def reset_cache(self) -> None:
        started = time.perf_counter_ns()
        self.inner.reset_cache()
        self._timed("reset_cache", started)


@dataclass(frozen=True)
class Latency:
    """Percentiles of call latencies, in microseconds."""

    calls: int
    p50_us: float
    p99_us: float
    max_us: float

    @staticmethod
    def of(samples_ns: Sequence[int]) -> Latency:
        if not samples_ns:
            return Latency(0, 0.0, 0.0, 0.0)
        ordered = sorted(samples_ns)

        def at(fraction: float) -> float:
            return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] / 1000

        return Latency(len(ordered), at(0.50), at(0.99), ordered[-1] / 1000)
