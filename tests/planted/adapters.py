"""Planted bugs in the engines' adapters. Importing this module imports SGLang: the
catalogue names the classes by module and class name (:class:`PlantedAdapter`), and the
engine's own factory loads them from there, as it loads the real ones.
"""

from __future__ import annotations

import torch

from kvoffload.integrations.sglang import KvoffloadHiCacheStorage
from kvoffload_spec.surface import Lookup


class PairsTheCallsKeysWithThePlansBlocks(KvoffloadHiCacheStorage):
    """A batch set pairs the call's keys (not the plan's) with the plan's block ids: when
    some keys are stored already, one key's page goes under another key."""

    def _set(self, keys: list[bytes], pages: list[torch.Tensor]) -> list[bool]:
        plan = self.manager.prepare_store(keys)
        if plan is None:
            return [self.manager.lookup(key) is Lookup.HIT for key in keys]
        source = dict(zip(keys, pages, strict=True))
        try:
            for key, block_id in zip(keys, plan.block_ids, strict=False):
                self._pool_page(block_id).copy_(source[key].reshape(-1).view(torch.uint8))
        finally:
            self.manager.complete_store(plan, True)
        return [self.manager.lookup(key) is Lookup.HIT for key in keys]
