"""What the SGLang back end's tests share: a host pool with the page methods of SGLang's
``HostKVCache``, and a back end made by SGLang's own ``StorageBackendFactory``.

The host pool is a small stand-in (``page_size``, ``get_data_page``,
``set_from_flat_data_page``, layer-first layout): SGLang's own host pools cannot be imported
without torchvision (their module imports SGLang's model configs), which the gate does not
install.
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

LAYERS, HEADS, DIM, PAGE = 2, 2, 8, 4


class LayerFirstHostPool:
    """The page interface of SGLang's MHA host pool, layer-first: [2, layers, tokens, ...]."""

    def __init__(self, tokens: int) -> None:
        self.page_size = PAGE
        self.kv_buffer = torch.zeros(2, LAYERS, tokens, HEADS, DIM)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.kv_buffer[:, :, index : index + PAGE]
        return page.flatten() if flat else page

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.kv_buffer[:, :, index : index + PAGE] = data_page.reshape(2, LAYERS, PAGE, HEADS, DIM)


def backend(
    num_pages: int | None,
    policy: str | None = "lru",
    module_path: str = "kvoffload.integrations.sglang",
    class_name: str = "KvoffloadHiCacheStorage",
    **options: object,
) -> tuple[HiCacheStorage, LayerFirstHostPool]:
    """A back end made by SGLang's factory, registered with a host pool; ``num_pages`` and
    ``policy`` None leave them out of the extra config, ``options`` go in as they are."""
    extra: dict[str, object] = {
        "backend_name": "kvoffload",
        "module_path": module_path,
        "class_name": class_name,
        "interface_v1": 1,
        **({} if num_pages is None else {"num_pages": num_pages}),
        **({} if policy is None else {"eviction_policy": policy}),
        **options,
    }
    host = LayerFirstHostPool(tokens=16 * PAGE)
    storage = StorageBackendFactory.create_backend("dynamic", storage_config(extra), host)
    storage.register_mem_pool_host(host)
    return storage, host


def storage_config(extra: dict[str, object]) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=False,
        model_name="test",
        extra_config=extra,
    )


def pages(first: int, count: int) -> torch.Tensor:
    """The host token indices of ``count`` pages from page ``first``."""
    return torch.arange(first * PAGE, (first + count) * PAGE)
