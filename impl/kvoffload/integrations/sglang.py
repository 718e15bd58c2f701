"""kvoffload as an L3 storage back end of SGLang's HiCache (``--hicache-storage-backend
dynamic``, ``class_name`` ``KvoffloadHiCacheStorage``, ``interface_v1: 1``).

Pages move between SGLang's host pool (registered with ``register_mem_pool_host``) and
kvoffload's CPU pool; kvoffload's manager decides which pages stay. Copies are synchronous
(one ``copy_`` per page), so every plan completes inside the call that made it. With
``remote_url``, a Valkey/Redis server behind the pool (kvoffload's ``ValkeyStore``): every
page stored is written through to it, and a lookup that misses the pool reads the pages
that follow from it into the pool, so engines sharing the server share their pages; with a
tenant secret (``remote_secret``, ``remote_secret_file`` or ``$KVOFFLOAD_REMOTE_SECRET``)
they are sealed, and a forged page is a miss. Importing this module imports SGLang;
``import kvoffload`` never does.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from kvoffload.manager import OffloadManager
from kvoffload.units import byte_size
from kvoffload_spec.defaults import (
    DEFAULT_MAX_TRACKER_SIZE,
    DEFAULT_POLICY,
    DEFAULT_STORE_THRESHOLD,
)
from kvoffload_spec.errors import InvalidArgumentError
from kvoffload_spec.surface import Lookup

if TYPE_CHECKING:  # the remote tier's modules load only with remote_url
    from kvoffload.tiers import Namespace, ValkeyStore

__all__ = ["KvoffloadHiCacheStorage"]

_DEFAULT_PAGES = 4096


class KvoffloadHiCacheStorage(HiCacheStorage):
    """SGLang's ``HiCacheStorage`` over kvoffload's manager and a CPU page pool.

    Extra config: ``num_pages`` (pool size in pages, default 4096) or ``cpu_bytes_to_use``
    (bytes, or a str with a unit: ``"16GiB"``); ``eviction_policy`` (any kvoffload policy
    name, default ``lru``); ``store_threshold``, ``max_tracker_size`` as for the manager.
    The pool is allocated when the host pool is registered (the page size in bytes is
    known only then).

    A remote tier: ``remote_url`` (``redis://host:port/db``, ``rediss://`` for TLS...);
    ``remote_namespace`` (optional str or mapping, added to the namespace derived from
    SGLang's storage config: model name, parallel ranks, layout, page bytes and dtype);
    ``remote_secret`` or ``remote_secret_file`` (the tenant's secret, else
    ``$KVOFFLOAD_REMOTE_SECRET``); ``remote_timeout_s`` (0.5: the longest one call to the
    server may take). A server down or slow costs misses, never an exception.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        extra: dict[str, Any] = dict(getattr(storage_config, "extra_config", None) or {})
        self._extra = extra
        self._config = storage_config
        self._lock = threading.Lock()  # HiCache calls from its prefetch and backup threads
        self._manager: OffloadManager | None = None
        self._pool: torch.Tensor | None = None  # [num_pages, page_bytes] uint8
        self._host: Any = None
        self._remote: ValkeyStore | None = None
        self._remote_url = extra.get("remote_url")
        self._remote_secret: bytes | None = None
        if self._remote_url is not None:
            from kvoffload.tiers.secret import resolve_secret

            # Read once, here: a bad secret fails SGLang's start, before any pool exists.
            self._remote_secret = resolve_secret(
                extra.get("remote_secret"), extra.get("remote_secret_file")
            )
        elif "cluster" in extra or any(name.startswith("remote_") for name in extra):
            raise InvalidArgumentError("the remote_* options and cluster need remote_url")

    # -- set-up ----------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        page = mem_pool_host.get_data_page(0, flat=True)
        page_bytes = page.numel() * page.element_size()
        budget = self._extra.get("cpu_bytes_to_use")
        num_pages = (
            byte_size(budget, "cpu_bytes_to_use") // page_bytes
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
            if self._remote_url is not None:
                from kvoffload.tiers import ValkeyStore

                self._remote = ValkeyStore(
                    str(self._remote_url),
                    namespace=self._namespace(page_bytes, page.dtype),
                    secret=self._remote_secret,
                    timeout_s=float(extra.get("remote_timeout_s", 0.5)),
                    cluster=extra.get("cluster", False),
                )
                try:
                    # A server of the other mode than "cluster" says stops the start here.
                    self._remote.check_mode()
                except InvalidArgumentError:
                    self._remote.close()
                    self._remote = None
                    raise

    def _namespace(self, page_bytes: int, dtype: torch.dtype) -> Namespace:
        """What a page's bytes depend on: SGLang's keys hash tokens only, so the model and
        the layout must tell two deployments' pages apart."""
        from kvoffload.tiers import Namespace

        config = self._config
        model = getattr(config, "model_name", None)
        extra = self._extra.get("remote_namespace")
        if model is None and extra is None:
            raise InvalidArgumentError(
                "SGLang gives no model name to derive the remote namespace from: set "
                "remote_namespace to a description of the model and KV layout"
            )
        layout = ("tp_rank", "tp_size", "pp_rank", "pp_size", "attn_cp_rank", "attn_cp_size",
                  "is_mla_model", "is_page_first_layout")  # fmt: skip
        described: dict[str, Any] = {
            "engine": "sglang",
            "model": model,
            "page_bytes": page_bytes,
            "dtype": str(dtype),
            **{name: getattr(config, name, None) for name in layout},
        }
        if extra is not None:
            described["deployment"] = Namespace.of(extra).description
        return Namespace.of(described)

    @property
    def remote(self) -> ValkeyStore | None:
        """The remote tier's store (None without ``remote_url``): its ``stats()``."""
        return self._remote

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
            return self._hit_prefix([key.encode()]) == 1

    def set(
        self,
        key: str,
        value: Any = None,
        target_location: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store one page: ``value`` (a tensor), or, as SGLang's Mooncake backend calls it,
        the ``target_sizes`` bytes at the host-pool address ``target_location``."""
        if value is None and target_location is not None:
            return self.batch_set(
                [key], target_locations=[target_location], target_sizes=[target_sizes]
            )
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        with self._lock:
            if values is None and target_locations is not None:
                values = self._host_slices(keys, target_locations, target_sizes)
            return all(self._set([key.encode() for key in keys], list(values or [])))

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        """A page's tensor (None: not there); with ``target_location`` a tensor, the page
        copied into it; with an address (the zero-copy form), True once copied there."""
        if isinstance(target_location, int):
            return self.batch_get([key], [target_location], [target_sizes]) == 1
        found = self.batch_get([key], [target_location] if target_location is not None else None)
        return found[0] if isinstance(found, list) else None

    def batch_get(
        self,
        keys: list[str],
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> list[torch.Tensor | None] | int:
        """The pages of the hit prefix of ``keys``: as tensors (copied into
        ``target_locations`` when given), or, given addresses in the host pool (the
        zero-copy form), copied there and counted (the hit prefix's length)."""
        with self._lock:
            addresses = target_locations is not None and all(
                isinstance(location, int) for location in target_locations
            )
            if addresses:
                target_locations = self._host_slices(keys, target_locations, target_sizes)
            names = [key.encode() for key in keys]
            if target_locations is not None:
                if len(target_locations) < len(keys):
                    raise InvalidArgumentError(
                        f"{len(keys)} keys but {len(target_locations)} target locations"
                    )
                self._check_page_sizes(  # address slices are bytes, not the pages' dtype
                    "target location",
                    target_locations[: len(keys)],
                    None if addresses else self._page_dtype,
                )
            hits = self._hit_prefix(names)
            plan = self.manager.prepare_load(names[:hits])
            found: list[torch.Tensor | None] = [None] * len(keys)
            try:
                for i, slot in enumerate(plan.block_ids):
                    data = self._pool_page(slot)
                    if target_locations is not None:
                        target = target_locations[i]
                        target.copy_(data if addresses else data.view(self._page_dtype))
                        found[i] = target
                    else:
                        found[i] = data.view(self._page_dtype).clone()
            finally:
                self.manager.complete_load(plan)
            self.manager.touch(names[:hits])
            return hits if addresses else found

    def clear(self) -> None:
        with self._lock:
            if self._manager is not None:
                self._manager.reset_cache()  # nothing is in flight: copies are synchronous

    def get_stats(self) -> Any:
        return None if self._manager is None else self._manager.stats()

    # -- helpers ---------------------------------------------------------------------------

    def _hit_prefix(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, are in the pool; with a remote tier, the
        ones after the pool's hits that the server holds are read into the pool first."""
        count = self._local_prefix(keys)
        if self._remote is not None and count < len(keys):
            count += self._promote(list(keys[count:]), hits=list(keys[:count]))
        return count

    def _local_prefix(self, keys: Sequence[bytes]) -> int:
        for count, key in enumerate(keys):
            if self.manager.lookup(key) is not Lookup.HIT:
                return count
        return len(keys)

    def _promote(self, keys: list[bytes], hits: list[bytes]) -> int:
        """Read ``keys`` from the server and store the prefix of them it holds (each value
        checked by the store, of exactly a page's size) in the pool; how many are there.
        The pool's ``hits`` before them are protected: making room evicts none of them."""
        assert self._remote is not None
        page_bytes = self._page_bytes()
        found = self._remote.get(keys)
        held = 0
        while held < len(found) and (view := found[held]) is not None:
            if view.nbytes != page_bytes:
                break
            held += 1
        if not held:
            return 0
        # Keys of the call are never evicted by it: the hits go in too (stored already,
        # they are no candidates), so the prefix found so far stays whole.
        plan = self.manager.prepare_store(hits + keys[:held])
        if plan is not None:
            views: dict[object, memoryview | None] = dict(zip(keys, found, strict=False))
            ok = False
            try:
                for key, block_id in zip(plan.keys, plan.block_ids, strict=True):
                    self._pool_page(block_id).numpy()[:] = views[key]
                ok = True
            finally:
                self.manager.complete_store(plan, ok)
        return self._local_prefix(keys[:held])

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
        if self._remote is not None and plan.keys:
            # Written through from the pool's own pages, now ready: a failure is a page the
            # server does not have (counted in its stats), never an error in SGLang.
            stored = list(plan.keys)
            assert self._pool is not None
            rows = self._pool.numpy()
            pages_stored = [memoryview(rows[block_id]) for block_id in plan.block_ids]
            self._remote.put(stored, pages_stored)
        return [self.manager.lookup(key) is Lookup.HIT for key in keys]

    def _host_slices(self, keys: list[str], addresses: Any, sizes: Any) -> list[torch.Tensor]:
        """The host-pool bytes at ``addresses`` (one page of ``sizes`` bytes each), as
        views: an address outside the registered host pool, or a size other than a page's,
        is refused before anything is read or written."""
        addresses, sizes = list(addresses), list(sizes or [])
        if not len(keys) == len(addresses) == len(sizes):
            raise InvalidArgumentError(
                f"{len(keys)} keys, {len(addresses)} target locations, {len(sizes)} sizes"
            )
        page_bytes = self._page_bytes()
        regions = self._host_regions()
        views = []
        for address, size in zip(addresses, sizes, strict=True):
            if isinstance(size, bool) or not isinstance(size, int) or size != page_bytes:
                raise InvalidArgumentError(
                    f"target size {size!r}: this backend stores whole pages of {page_bytes} "
                    "bytes (all layers' K and V of one page)"
                )
            views.append(_inside(regions, address, size))
        return views

    def _host_regions(self) -> list[torch.Tensor]:
        buffers = getattr(self._host, "kv_buffer", None)
        if isinstance(buffers, torch.Tensor):
            buffers = [buffers]
        regions = [
            buffer.view(-1).view(torch.uint8)
            for buffer in buffers or []
            if isinstance(buffer, torch.Tensor)
            and buffer.device.type == "cpu"
            and buffer.is_contiguous()
        ]
        if not regions:
            raise InvalidArgumentError(
                "the registered host pool has no contiguous CPU kv_buffer to address"
            )
        return regions

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


def _inside(regions: list[torch.Tensor], address: object, size: int) -> torch.Tensor:
    """The ``size`` bytes at ``address``, a view of the region (a host pool buffer) that
    holds all of them; an address anywhere else is refused, never dereferenced."""
    if isinstance(address, bool) or not isinstance(address, int):
        raise InvalidArgumentError(f"a target location must be an address (int), got {address!r}")
    for region in regions:
        start = region.data_ptr()
        if start <= address and address + size <= start + region.numel():
            return region[address - start : address - start + size]
    raise InvalidArgumentError(
        f"target location {address:#x} (+{size} bytes) is not inside the registered host pool"
    )
