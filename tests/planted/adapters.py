"""Planted bugs in the engines' adapters. Importing this module imports SGLang: the
catalogue names the classes by module and class name (:class:`PlantedAdapter`), and the
engine's own factory loads them from there, as it loads the real ones.
"""

from __future__ import annotations

from typing import Any

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


class AssumesTheStoredKeysAreAPrefix(KvoffloadHiCacheStorage):
    """A batch set takes the plan's pages from the end of the call (the keys stored already
    taken for a prefix hit, as SGLang usually sends them): when the stored keys are not a
    prefix, a new key's block gets another key's page."""

    def _set(self, keys: list[bytes], pages: list[torch.Tensor]) -> list[bool]:
        plan = self.manager.prepare_store(keys)
        if plan is None:
            return [self.manager.lookup(key) is Lookup.HIT for key in keys]
        skipped = len(keys) - len(plan.keys)
        try:
            for i, block_id in enumerate(plan.block_ids):
                page = pages[skipped + i].reshape(-1).view(torch.uint8)
                self._pool_page(block_id).copy_(page)
        finally:
            self.manager.complete_store(plan, True)
        return [self.manager.lookup(key) is Lookup.HIT for key in keys]


class GathersTheFirstHostPagesForTheNewKeys(KvoffloadHiCacheStorage):
    """batch_set_v1 sends only the keys not stored yet, with the first host pages (one per
    new key) instead of each new key's own: a partly-stored batch from host pages stores
    the pages of the keys before it."""

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        with self._lock:
            self._check_host_indices(keys, host_indices)
            names = [key.encode() for key in keys]
            new = [name for name in names if self.manager.lookup(name) is not Lookup.HIT]
            self._set(new, [self._host_page(host_indices, i) for i in range(len(new))])
            return [self.manager.lookup(name) is Lookup.HIT for name in names]
