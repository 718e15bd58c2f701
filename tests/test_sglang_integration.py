"""kvoffload's HiCache storage built by SGLang's own ``StorageBackendFactory``.

SGLang's real factory loads the class from the ``dynamic`` extra config, and SGLang's
``HiCacheStorage`` base class is the one subclassed. The host pool is a small stand-in
with the page methods of SGLang's ``HostKVCache`` (``page_size``, ``get_data_page``,
``set_from_flat_data_page``, layer-first layout): SGLang's own host pools cannot be
imported without torchvision (their module imports SGLang's model configs), which the gate
does not install.
"""

from __future__ import annotations

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from kvoffload.integrations.sglang import KvoffloadHiCacheStorage
from kvoffload_spec.errors import InvalidArgumentError

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


def backend(num_pages: int, policy: str = "lru") -> tuple[HiCacheStorage, LayerFirstHostPool]:
    extra = {
        "backend_name": "kvoffload",
        "module_path": "kvoffload.integrations.sglang",
        "class_name": "KvoffloadHiCacheStorage",
        "interface_v1": 1,
        "num_pages": num_pages,
        "eviction_policy": policy,
    }
    config = HiCacheStorageConfig(
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
    host = LayerFirstHostPool(tokens=16 * PAGE)
    storage = StorageBackendFactory.create_backend("dynamic", config, host)
    storage.register_mem_pool_host(host)
    return storage, host


def pages(first: int, count: int) -> torch.Tensor:
    """The host token indices of ``count`` pages from page ``first``."""
    return torch.arange(first * PAGE, (first + count) * PAGE)


@pytest.mark.parametrize("policy", ["lru", "arc", "duel"])
def test_set_exists_get_byte_exact_with_an_eviction(policy: str) -> None:
    storage, host = backend(num_pages=3, policy=policy)
    assert isinstance(storage, KvoffloadHiCacheStorage)
    torch.manual_seed(0)
    host.kv_buffer.copy_(torch.randn_like(host.kv_buffer))
    original = host.kv_buffer.clone()

    assert storage.batch_set_v1(["a", "b"], pages(0, 2)) == [True, True]
    assert storage.batch_exists(["a", "b", "c"]) == 2
    assert storage.batch_set_v1(["c"], pages(2, 1)) == [True]
    # Read a and b again: c is now the least recent, so the next store evicts c.
    assert storage.batch_get_v1(["a", "b"], pages(8, 2)) == [True, True]
    assert torch.equal(host.kv_buffer[:, :, 8 * PAGE : 10 * PAGE], original[:, :, : 2 * PAGE])
    assert storage.batch_set_v1(["d"], pages(3, 1)) == [True]
    assert storage.batch_exists(["c"]) == 0
    assert storage.batch_exists(["a", "b", "d"]) == 3

    host.kv_buffer[:, :, 4 * PAGE :].zero_()
    # get reads the hit prefix only: a, b, then stops at the evicted c.
    assert storage.batch_get_v1(["a", "b", "c", "d"], pages(4, 4)) == [True, True, False, False]
    for source, target in ((0, 4), (1, 5)):
        assert torch.equal(
            host.kv_buffer[:, :, target * PAGE : (target + 1) * PAGE],
            original[:, :, source * PAGE : (source + 1) * PAGE],
        )
    assert not host.kv_buffer[:, :, 6 * PAGE : 8 * PAGE].any()
    assert storage.batch_get_v1(["d"], pages(6, 1)) == [True]
    assert torch.equal(
        host.kv_buffer[:, :, 6 * PAGE : 7 * PAGE], original[:, :, 3 * PAGE : 4 * PAGE]
    )
    storage.manager.check_invariants()


def test_full_of_nothing_evictable_refuses_and_clear_empties() -> None:
    storage, _ = backend(num_pages=1)
    assert storage.batch_set_v1(["a", "b"], torch.arange(0, 2 * PAGE)) == [False, False]
    assert storage.batch_set_v1(["a"], torch.arange(0, PAGE)) == [True]
    assert storage.exists("a")
    storage.clear()
    assert storage.batch_exists(["a"]) == 0


def test_zero_copy_set_and_get_by_host_pool_address() -> None:
    """SGLang's Mooncake backend calls ``set(key, target_location=<address>,
    target_sizes=<bytes>)`` (and ``get`` alike): an untyped AttributeError before issue 27.
    The pages are copied byte-exact; an address outside the registered host pool, or a
    size other than a page's, is a typed error with nothing read or written."""
    storage, host = backend(num_pages=4)
    assert isinstance(storage, KvoffloadHiCacheStorage)
    torch.manual_seed(1)
    host.kv_buffer.copy_(torch.randn_like(host.kv_buffer))
    flat = host.kv_buffer.view(-1).view(torch.uint8)
    page_bytes = host.get_data_page(0).numel() * host.kv_buffer.element_size()
    first, second = flat[:page_bytes], flat[page_bytes : 2 * page_bytes]
    original = first.clone()
    assert storage.set("a", target_location=first.data_ptr(), target_sizes=page_bytes)
    assert storage.exists("a")
    second.zero_()
    assert storage.get("a", target_location=second.data_ptr(), target_sizes=page_bytes) is True
    assert torch.equal(second, original)
    assert storage.get("b", target_location=second.data_ptr(), target_sizes=page_bytes) is False
    locations = [flat[i * page_bytes :].data_ptr() for i in (2, 3)]
    assert storage.batch_set(["c", "d"], target_locations=locations, target_sizes=[page_bytes] * 2)
    assert (
        storage.batch_get(
            ["c", "d", "x"], [locations[1], locations[0], locations[0]], [page_bytes] * 3
        )
        == 2
    )
    outside = torch.zeros(page_bytes, dtype=torch.uint8)
    before = storage.manager.stats()
    with pytest.raises(InvalidArgumentError, match="not inside the registered host pool"):
        storage.set("e", target_location=outside.data_ptr(), target_sizes=page_bytes)
    with pytest.raises(InvalidArgumentError, match="whole pages"):
        storage.set("e", target_location=first.data_ptr(), target_sizes=page_bytes // 2)
    with pytest.raises(InvalidArgumentError, match="address"):
        storage.set("e", target_location="0x10", target_sizes=page_bytes)
    assert storage.manager.stats() == before
    assert not storage.exists("e")
    storage.manager.check_invariants()
