"""kvoffload's HiCache storage built by SGLang's own ``StorageBackendFactory``.

SGLang's real factory loads the class from the ``dynamic`` extra config, and SGLang's
``HiCacheStorage`` base class is the one subclassed. The host pool is a small stand-in
with the page methods of SGLang's ``HostKVCache`` (``page_size``, ``get_data_page``,
``set_from_flat_data_page``, layer-first layout): SGLang's own host pools cannot be
imported without torchvision (their module imports SGLang's model configs), which the gate
does not install.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from kvoffload.integrations.sglang import KvoffloadHiCacheStorage
from kvoffload.policies.loading import resolve_policy
from kvoffload_spec.defaults import (
    DEFAULT_MAX_TRACKER_SIZE,
    DEFAULT_POLICY,
    DEFAULT_STORE_THRESHOLD,
)
from kvoffload_spec.errors import InvalidArgumentError
from tests.planted import PARTLY_PRESENT, Planted, PlantedAdapter, share

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


# -- batch sets whose keys are partly stored already ---------------------------------------

KEYS = ("k0", "k1", "k2", "k3")
FILLER = "filler"  # stored first: the one page a batch set may evict


def page_of(key: str) -> torch.Tensor:
    """The page stored under ``key`` (SGLang's keys name their pages' content)."""
    generator = torch.Generator().manual_seed(sum(key.encode()) * 31 + len(key))
    return torch.randn(2, LAYERS, PAGE, HEADS, DIM, generator=generator)


def set_pages(
    storage: HiCacheStorage, host: LayerFirstHostPool, keys: list[str], way: str
) -> list[bool]:
    """Set ``keys`` with their own pages: from host pages (v1), or as tensors."""
    if way == "tensors":
        return [storage.batch_set(keys, [page_of(key).flatten() for key in keys])] * len(keys)
    for slot, key in enumerate(keys):
        host.kv_buffer[:, :, slot * PAGE : (slot + 1) * PAGE] = page_of(key)
    stored: list[bool] = storage.batch_set_v1(keys, pages(0, len(keys)))
    return stored


def read_back(storage: HiCacheStorage, host: LayerFirstHostPool, keys: list[str]) -> list[str]:
    """The keys whose page reads back other bytes, by both get paths."""
    wrong = []
    host.kv_buffer.zero_()
    first = 16 - len(keys)
    assert storage.batch_get_v1(keys, pages(first, len(keys))) == [True] * len(keys)
    as_tensors = storage.batch_get(keys)
    assert isinstance(as_tensors, list)
    for i, key in enumerate(keys):
        expected = page_of(key)
        slot = first + i
        read = host.kv_buffer[:, :, slot * PAGE : (slot + 1) * PAGE]
        tensor = as_tensors[i]
        if (
            not torch.equal(read, expected)
            or tensor is None
            or not torch.equal(tensor.reshape(expected.shape), expected)
        ):
            wrong.append(key)
    return wrong


def partly_present_problems(**factory: str) -> list[str]:
    """Every subset of ``KEYS`` stored first, then a batch set of them all (in order and
    reversed, from host pages and as tensors) into a pool with room for the new ones only by
    evicting ``FILLER``: each key must read back its own page."""
    problems = []
    subsets = itertools.chain.from_iterable(
        itertools.combinations(KEYS, size) for size in range(len(KEYS) + 1)
    )
    for present in subsets:
        for order in (list(KEYS), list(reversed(KEYS))):
            for way in ("host pages", "tensors"):
                storage, host = backend(num_pages=len(KEYS), **factory)
                assert set_pages(storage, host, [FILLER], way) == [True]
                if present:
                    assert set_pages(storage, host, list(present), way) == [True] * len(present)
                case = f"{list(present)} stored, then {order} from {way}"
                if set_pages(storage, host, order, way) != [True] * len(KEYS):
                    problems.append(f"{case}: not all stored")
                    continue
                assert storage.batch_exists([FILLER]) == 0  # the one victim
                problems += [
                    f"{case}: {key} reads another page" for key in read_back(storage, host, order)
                ]
    return problems


def test_a_batch_set_of_partly_stored_keys_stores_each_page_under_its_own_key() -> None:
    assert partly_present_problems() == []


SGLANG_SHARE = [
    bug
    for bug in share(PARTLY_PRESENT)
    if isinstance(bug.subject, PlantedAdapter) and bug.subject.engine == "sglang"
]


@pytest.mark.parametrize("entry", SGLANG_SHARE, ids=lambda bug: bug.name)
def test_the_partly_present_checks_find_their_share_of_the_catalogue(entry: Planted) -> None:
    adapter = entry.subject
    assert isinstance(adapter, PlantedAdapter)
    problems = partly_present_problems(module_path=adapter.module, class_name=adapter.class_name)
    assert any("reads another page" in problem for problem in problems), problems


# -- pages of another size ------------------------------------------------------------------


def test_a_page_or_target_of_another_size_raises_before_anything_changes() -> None:
    """A page shorter or longer than the pool's, a one-byte page (which ``copy_`` would
    broadcast over a whole page), a target of another size or dtype, host indices not one
    page's worth per key: each is refused with a typed error, nothing evicted, nothing
    copied."""
    storage, host = backend(num_pages=2)
    assert isinstance(storage, KvoffloadHiCacheStorage)
    assert storage.batch_set(["a", "b"], [page_of("a").flatten(), page_of("b").flatten()])
    page = page_of("c").flatten()
    target = torch.zeros_like(page)
    # Each refusal names what is wrong (matched as a regular expression).
    bad: dict[str, tuple[str, Callable[[], object]]] = {
        "a page one element short": (
            "page #0 holds 1020 bytes; a page holds 1024",
            lambda: storage.batch_set(["c"], [page[:-1]]),
        ),
        "a page one element long": (
            "page #0 holds 1028 bytes",
            lambda: storage.batch_set(["c"], [torch.cat([page, page[:1]])]),
        ),
        "a one-byte page": (
            "page #0 holds 1 bytes",
            lambda: storage.batch_set(["c"], [torch.ones(1, dtype=torch.uint8)]),
        ),
        "no tensor": (
            "page #1 is a list, not a tensor",
            lambda: storage.batch_set(["c", "d"], [page, page.tolist()]),
        ),
        "fewer pages than keys": (
            "2 keys but 1 pages",
            lambda: storage.batch_set(["c", "d"], [page]),
        ),
        "a target twice a page": (
            "target location #0 holds 2048 bytes",
            lambda: storage.batch_get(["a"], [torch.zeros(2, len(page))]),
        ),
        "a target one element short": (
            "target location #0 holds 1020 bytes",
            lambda: storage.batch_get(["a"], [target[:-1]]),
        ),
        "a target of another dtype": (
            "target location #0 is torch.float64; pages are torch.float32",
            lambda: storage.batch_get(["a"], [target.double()[::2]]),
        ),
        "fewer targets than keys": (
            "2 keys but 1 target locations",
            lambda: storage.batch_get(["a", "b"], [target]),
        ),
        "v1 set, host indices short": (
            r"1 keys need 4 host indices \(4 per page\), got 3",
            lambda: storage.batch_set_v1(["c"], pages(2, 1)[:-1]),
        ),
        "v1 get, host indices long": (
            r"1 keys need 4 host indices \(4 per page\), got 8",
            lambda: storage.batch_get_v1(["a"], pages(2, 2)),
        ),
    }
    host_before, stats_before = host.kv_buffer.clone(), storage.manager.stats()
    for name, (message, call) in bad.items():
        with pytest.raises(InvalidArgumentError, match=message):
            call()
        assert storage.manager.stats() == stats_before, name
        assert torch.equal(host.kv_buffer, host_before), name
        assert not target.any(), name
    assert storage.batch_exists(["a", "b"]) == 2 and storage.batch_exists(["c"]) == 0
    assert read_back(storage, host, ["a", "b"]) == []


class CopyFailsAt(KvoffloadHiCacheStorage):
    """The real back end whose copy into the pool raises at the ``fail_at``-th page (a
    fault injected into kvoffload's side of the copy; SGLang's code is untouched)."""

    fail_at: int | None = None

    def _pool_page(self, block_id: int) -> torch.Tensor:
        if self.fail_at is not None:
            self.fail_at -= 1
            if self.fail_at == 0:
                raise RuntimeError("the copy failed")
        return super()._pool_page(block_id)


@pytest.mark.parametrize("way", ["host pages", "tensors"])
def test_a_batch_set_whose_copy_fails_half_way_stores_none_of_its_keys(way: str) -> None:
    """The first page copied, the second's copy raising: the error reaches SGLang, no key
    of the batch is readable (the first one's page was written, the plan is not), what
    was stored before still is, and the same batch set again stores both."""
    storage, host = backend(3, module_path=__name__, class_name="CopyFailsAt")
    assert isinstance(storage, CopyFailsAt)
    assert set_pages(storage, host, ["a"], way) == [True]
    storage.fail_at = 2
    with pytest.raises(RuntimeError, match="the copy failed"):
        set_pages(storage, host, ["b", "c"], way)
    assert storage.batch_exists(["b"]) == 0 and not storage.exists("c")
    assert storage.manager.stats().free == 2
    storage.manager.check_invariants()
    assert read_back(storage, host, ["a"]) == []
    assert set_pages(storage, host, ["b", "c"], way) == [True, True]
    assert read_back(storage, host, ["a", "b", "c"]) == []


# -- the extra config, the single-key calls, targets ---------------------------------------

PAGE_BYTES = 2 * LAYERS * PAGE * HEADS * DIM * 4  # float32


def test_the_extra_config_sizes_the_pool_and_makes_the_manager() -> None:
    storage, host = backend(None, None)  # the defaults: 4096 pages, the default policy
    assert isinstance(storage, KvoffloadHiCacheStorage) and storage.mem_pool_host is host
    assert storage.manager.num_blocks == 4096
    assert type(storage.manager.policy) is resolve_policy(DEFAULT_POLICY)
    state = storage.manager.abstract_state()
    assert (state.store_threshold, state.max_tracker_size) == (
        DEFAULT_STORE_THRESHOLD,
        DEFAULT_MAX_TRACKER_SIZE,
    )
    storage, _ = backend(7, cpu_bytes_to_use=3 * PAGE_BYTES + PAGE_BYTES - 1)  # wins
    assert isinstance(storage, KvoffloadHiCacheStorage) and storage.manager.num_blocks == 3
    with pytest.raises(InvalidArgumentError, match=f"no page of {PAGE_BYTES} bytes"):
        backend(None, cpu_bytes_to_use=PAGE_BYTES - 1)
    storage, host = backend(4, "arc", store_threshold=2, max_tracker_size=7)
    assert isinstance(storage, KvoffloadHiCacheStorage)
    assert type(storage.manager.policy) is resolve_policy("arc")
    assert storage.manager.abstract_state().max_tracker_size == 7
    assert storage.batch_set_v1(["a"], pages(0, 1)) == [False]  # the first offer of two
    assert storage.batch_set_v1(["a"], pages(0, 1)) == [True]


def test_before_a_host_pool_is_registered_every_call_refuses() -> None:
    storage = KvoffloadHiCacheStorage(storage_config({"num_pages": 2}))
    assert storage.get_stats() is None
    page = torch.zeros(PAGE_BYTES // 4)
    calls: dict[str, Callable[[], object]] = {
        "batch_exists": lambda: storage.batch_exists(["a"]),
        "exists": lambda: storage.exists("a"),
        "batch_set": lambda: storage.batch_set(["a"], [page]),
        "batch_set_v1": lambda: storage.batch_set_v1(["a"], pages(0, 1)),
        "batch_get_v1": lambda: storage.batch_get_v1(["a"], pages(0, 1)),
        "batch_get": lambda: storage.batch_get(["a"]),
    }
    for name, call in calls.items():
        with pytest.raises(InvalidArgumentError, match="register_mem_pool_host must come first"):
            call()
        assert storage.get_stats() is None, name


def test_single_keys_and_targets_get_their_own_page() -> None:
    """``set`` and ``get`` of one key, ``get`` into a target, ``batch_get`` into targets and
    as tensors with a miss among the keys, a full pool's batch set that stores what it can."""
    storage, host = backend(num_pages=2)
    assert storage.set("a", page_of("a").flatten()) and storage.exists("a")
    found = storage.get("a")
    assert isinstance(found, torch.Tensor) and torch.equal(found, page_of("a").flatten())
    target = torch.zeros(PAGE_BYTES // 4)
    assert storage.get("a", target) is target and torch.equal(target, page_of("a").flatten())
    assert storage.get("absent") is None
    targets = [torch.zeros(PAGE_BYTES // 4) for _ in range(2)]
    got = storage.batch_get(["a", "absent"], targets)
    assert got == [targets[0], None] and torch.equal(targets[0], page_of("a").flatten())
    assert not targets[1].any()  # a miss leaves its target alone
    as_tensors = storage.batch_get(["a", "absent"])
    assert isinstance(as_tensors, list) and as_tensors[1] is None
    assert as_tensors[0] is not None and torch.equal(as_tensors[0], page_of("a").flatten())
    stats = storage.get_stats()
    assert stats is not None and stats.num_blocks == 2
    # Two pages, "a" stored: a batch of three new keys cannot fit, the stored key still counts.
    assert storage.batch_set_v1(["a", "b", "c", "d"], pages(0, 4)) == [True, False, False, False]
    assert read_back(storage, host, ["a"]) == []
