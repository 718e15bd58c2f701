"""kvoffload as an L3 storage back end of SGLang's HiCache (``--hicache-storage-backend
dynamic``, ``class_name`` ``KvoffloadHiCacheStorage``, ``interface_v1: 1``).

Pages move between SGLang's host pool (registered with ``register_mem_pool_host``) and
kvoffload's CPU pool; kvoffload's manager decides which pages stay. Copies are synchronous
(one ``copy_`` per page), so every plan completes inside the call that made it. Importing
this module imports SGLang; ``import kvoffload`` never does.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from kvoffload.manager import OffloadManager
from kvoffload_spec.defaults import (
    DEFAULT_MAX_TRACKER_SIZE,
    DEFAULT_POLICY,
    DEFAULT_STORE_THRESHOLD,
)
from kvoffload_spec.errors import InvalidArgumentError
from kvoffload_spec.surface import Lookup

__all__ = ["KvoffloadHiCacheStorage"]

_DEFAULT_PAGES = 4096


class KvoffloadHiCacheStorage(HiCacheStorage):
    """SGLang's ``HiCacheStorage`` over kvoffload's manager and a CPU page pool.

    Extra config: ``num_pages`` (pool size in pages, default 4096) or ``cpu_bytes_to_use``;
    ``eviction_policy`` (any kvoffload policy name, default ``lru``); ``store_threshold``,
    ``max_tracker_size`` as for the manager. The pool is allocated when the host pool is
    registered (the page size in bytes is known only then).
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        extra: dict[str, Any] = dict(getattr(storage_config, "extra_config", None) or {})
        self._extra = extra
        self._lock = threading.Lock()  # HiCache calls from its prefetch and backup threads
        self._manager: OffloadManager | None = None
        self._pool: torch.Tensor | None = None  # [num_pages, page_bytes] uint8
        self._host: Any = None

    # -- set-up ----------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        page = mem_pool_host.get_data_page(0, flat=True)
        page_bytes = page.numel() * page.element_size()
        budget = self._extra.get("cpu_bytes_to_use")
        num_pages = (
            int(budget) // page_bytes
            if budget
            else int(self._extra.get("num_pages", _DEFAULT_PAGES))
        )
        if num_pages < 1:
            raise InvalidArgumentError(f"the pool holds no page of {page_bytes} bytes")
        with self._lock:
            self._host = mem_pool_host
            self._page_dtype = page.dtype
            self._pool = torch.empty((num_pages, page_bytes), dtype=torch.uint8)
            extra = self._extra
            self._manager = OffloadManager(
                num_pages,
                str(extra.get("eviction_policy", DEFAULT_POLICY)),
                store_threshold=max(1, int(extra.get("store_threshold", DEFAULT_STORE_THRESHOLD))),
                max_tracker_size=int(extra.get("max_tracker_size", DEFAULT_MAX_TRACKER_SIZE)),
            )

    @property
    def manager(self) -> OffloadManager:
        if self._manager is None:
            raise InvalidArgumentError("register_mem_pool_host must come first")
        return self._manager

    # -- the v1 interface: pages by host index ---------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many of ``keys``, from the first, are stored and readable."""
        with self._lock:
            return self._hit_prefix([key.encode() for key in keys])

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        with self._lock:
            self._check_host_indices(keys, host_indices)
            return self._set(
                [key.encode() for key in keys],
                [self._host_page(host_indices, i) for i in range(len(keys))],
            )

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        with self._lock:
            self._check_host_indices(keys, host_indices)
            names = [key.encode() for key in keys]
            hits = self._hit_prefix(names)
            plan = self.manager.prepare_load(names[:hits])
            try:
                for i, block_id in enumerate(plan.block_ids):
                    index = int(host_indices[i * self._host.page_size])
                    data = self._pool_page(block_id).view(self._page_dtype)
                    self._host.set_from_flat_data_page(index, data)
            finally:
                self.manager.complete_load(plan)
            self.manager.touch(names[:hits])
            return [i < hits for i in range(len(keys))]

    # -- the original interface: pages as tensors ------------------------------------------

    def exists(self, key: str) -> bool:
        with self._lock:
            return self.manager.lookup(key.encode()) is Lookup.HIT

    def set(
        self,
        key: str,
        value: Any = None,
        target_location: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        with self._lock:
            return all(self._set([key.encode() for key in keys], list(values or [])))

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        found = self.batch_get([key], [target_location] if target_location is not None else None)
        return found[0] if isinstance(found, list) else None

    def batch_get(
        self,
        keys: list[str],
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> list[torch.Tensor | None] | int:
        with self._lock:
            names = [key.encode() for key in keys]
            if target_locations is not None:
                if len(target_locations) < len(keys):
                    raise InvalidArgumentError(
                        f"{len(keys)} keys but {len(target_locations)} target locations"
                    )
                self._check_page_sizes(
                    "target location", target_locations[: len(keys)], self._page_dtype
                )
            hits = self._hit_prefix(names)
            plan = self.manager.prepare_load(names[:hits])
            found: list[torch.Tensor | None] = [None] * len(keys)
            try:
                for i, slot in enumerate(plan.block_ids):
                    data = self._pool_page(slot).view(self._page_dtype)
                    if target_locations is not None:
                        target_locations[i].copy_(data)
                        found[i] = target_locations[i]
                    else:
                        found[i] = data.clone()
            finally:
                self.manager.complete_load(plan)
            self.manager.touch(names[:hits])
            return found

    def clear(self) -> None:
        with self._lock:
            if self._manager is not None:
                self._manager.reset_cache()  # nothing is in flight: copies are synchronous

    def get_stats(self) -> Any:
        return None if self._manager is None else self._manager.stats()

    # -- helpers ---------------------------------------------------------------------------

    def _hit_prefix(self, keys: Sequence[bytes]) -> int:
        for count, key in enumerate(keys):
            if self.manager.lookup(key) is not Lookup.HIT:
                return count
        return len(keys)

    def _set(self, keys: list[bytes], pages: list[torch.Tensor]) -> list[bool]:
        if len(pages) != len(keys):
            raise InvalidArgumentError(f"{len(keys)} keys but {len(pages)} pages")
        self._check_page_sizes("page", pages)
        plan = self.manager.prepare_store(keys)
        if plan is None:  # no room: keys already stored still count as stored
            return [self.manager.lookup(key) is Lookup.HIT for key in keys]
        source: dict[object, torch.Tensor] = dict(zip(keys, pages, strict=True))
        ok = False
        try:
            for key, block_id in zip(plan.keys, plan.block_ids, strict=True):
                flat = source[key].reshape(-1)
                self._pool_page(block_id).copy_(flat.view(torch.uint8))
            ok = True
        finally:
            self.manager.complete_store(plan, ok)
        return [self.manager.lookup(key) is Lookup.HIT for key in keys]

    def _check_page_sizes(
        self, what: str, pages: Sequence[Any], dtype: torch.dtype | None = None
    ) -> None:
        """Before the manager plans anything: a page of another size would be cut short,
        spread over the pool page by broadcasting, or raise half-way (victims evicted); a
        target of another dtype would take the page's values converted, not its bytes."""
        page_bytes = self._page_bytes()
        for i, page in enumerate(pages):
            if not isinstance(page, torch.Tensor):
                raise InvalidArgumentError(f"{what} #{i} is a {type(page).__name__}, not a tensor")
            if dtype is not None and page.dtype != dtype:
                raise InvalidArgumentError(f"{what} #{i} is {page.dtype}; pages are {dtype}")
            if page.numel() * page.element_size() != page_bytes:
                raise InvalidArgumentError(
                    f"{what} #{i} holds {page.numel() * page.element_size()} bytes; "
                    f"a page holds {page_bytes}"
                )

    def _page_bytes(self) -> int:
        if self._pool is None:
            raise InvalidArgumentError("register_mem_pool_host must come first")
        return int(self._pool.shape[1])

    def _check_host_indices(self, keys: list[str], host_indices: torch.Tensor) -> None:
        """SGLang hands ``page_size`` host indices per key."""
        self._page_bytes()  # registered first
        expected = len(keys) * self._host.page_size
        if len(host_indices) != expected:
            raise InvalidArgumentError(
                f"{len(keys)} keys need {expected} host indices "
                f"({self._host.page_size} per page), got {len(host_indices)}"
            )

    def _host_page(self, host_indices: torch.Tensor, page: int) -> torch.Tensor:
        index = int(host_indices[page * self._host.page_size])
        data: torch.Tensor = self._host.get_data_page(index, flat=True)
        return data

    def _pool_page(self, block_id: int) -> torch.Tensor:
        assert self._pool is not None
        return self._pool[block_id]
