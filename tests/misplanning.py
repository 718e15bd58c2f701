"""A manager of the caller's own that plans block ids it was told to (a buggy manager):
shared by the block-id checks and the Offloader's remote-path tests."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kvoffload.manager import OffloadManager
from kvoffload_spec.surface import Key, LoadPlan, Lookup, Plan, StorePlan


class Misplanning:
    """A manager of the caller's own that, while ``block_ids`` is set, hands out plans with
    those block ids instead of its own (a buggy manager). Completions of such a plan go to
    the real plan behind it, so a refused plan still completes in the manager.
    """

    def __init__(self, inner: OffloadManager) -> None:
        self.inner = inner
        self.block_ids: list[int] | None = None
        self._real: dict[int, Plan] = {}  # plan id -> the plan the manager really made

    @property
    def num_blocks(self) -> int:
        return self.inner.num_blocks

    def _doctored(self, plan: Plan) -> Plan:
        if self.block_ids is None:
            return plan
        self._real[plan.plan_id] = plan
        return dataclasses.replace(plan, block_ids=tuple(self.block_ids))

    def lookup(self, key: Key) -> Lookup:
        return self.inner.lookup(key)

    def prepare_store(self, keys: Sequence[Key]) -> StorePlan | None:
        plan = self.inner.prepare_store(keys)
        if plan is None:
            return None
        doctored = self._doctored(plan)
        assert isinstance(doctored, StorePlan)
        return doctored

    def complete_store(self, plan: StorePlan, success: bool = True) -> None:
        real = self._real.pop(plan.plan_id, plan)
        assert isinstance(real, StorePlan)
        self.inner.complete_store(real, success)

    def prepare_load(self, keys: Sequence[Key]) -> LoadPlan:
        doctored = self._doctored(self.inner.prepare_load(keys))
        assert isinstance(doctored, LoadPlan)
        return doctored

    def complete_load(self, plan: LoadPlan) -> None:
        real = self._real.pop(plan.plan_id, plan)
        assert isinstance(real, LoadPlan)
        self.inner.complete_load(real)

    def abandon(self, plan: Plan) -> None:
        self.inner.abandon(self._real.get(plan.plan_id, plan))

    def is_abandoned(self, plan: Plan) -> bool:
        return self.inner.is_abandoned(self._real.get(plan.plan_id, plan))

    def touch(self, keys: Sequence[Key]) -> None:
        self.inner.touch(keys)

    def reset_cache(self) -> None:
        self.inner.reset_cache()
