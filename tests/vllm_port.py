"""What the tests ported from vLLM 0.33's own suites share: keys, request contexts, the
adapter built as vLLM's tests build their manager, and checks of its outputs.

The ported tests (tests/test_vllm_ported_*.py) are our own code, written after the
behaviours vLLM's tests assert (vLLM is Apache-2.0; each test names the vLLM test it ports).
Where vLLM's test reads a private field, ours reads the public counterpart: the manager's
``stats()``, ``offer_count``, the ARC policy's ``lists()`` and ``p``.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    OffloadingEvent,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec, CPUOffloadingMetrics

from kvoffload.integrations.vllm import KvoffloadManager
from kvoffload.policies import ArcPolicy

EMPTY = ReqContext(req_id="")


def key(number: int) -> OffloadKey:
    return make_offload_key(str(number).encode(), 0)


def keys(numbers: Iterable[int]) -> list[OffloadKey]:
    return [key(number) for number in numbers]


def context(req_id: str = "") -> ReqContext:
    return ReqContext(req_id=req_id)


def manager(
    num_chunks: int = 4,
    policy: str = "lru",
    *,
    enable_events: bool = False,
    store_threshold: int = 0,
    max_tracker_size: int = 64_000,
) -> KvoffloadManager:
    """The adapter, with the defaults of vLLM's ``make_cpu_manager``."""
    return KvoffloadManager(
        num_chunks,
        policy,
        store_threshold=store_threshold,
        max_tracker_size=max_tracker_size,
        enable_events=enable_events,
    )


def arc(adapter: KvoffloadManager) -> ArcPolicy:
    policy = adapter.manager.policy
    assert isinstance(policy, ArcPolicy)
    return policy


def t1(adapter: KvoffloadManager) -> list[OffloadKey]:
    """ARC's T1, least recent first (vLLM's ``policy.t1`` in order)."""
    return [OffloadKey(k) for k in arc(adapter).lists()[0]]


def t2(adapter: KvoffloadManager) -> list[OffloadKey]:
    return [OffloadKey(k) for k in arc(adapter).lists()[1]]


def b1(adapter: KvoffloadManager) -> list[OffloadKey]:
    return [OffloadKey(k) for k in arc(adapter).lists()[2]]


def b2(adapter: KvoffloadManager) -> list[OffloadKey]:
    return [OffloadKey(k) for k in arc(adapter).lists()[3]]


def chunk_ids(spec: LoadStoreSpec) -> list[int]:
    assert isinstance(spec, CPULoadStoreSpec)
    return [int(chunk) for chunk in np.asarray(spec.chunk_ids)]


def check_store(
    output: PrepareStoreOutput | None,
    to_store: list[int],
    evicted: list[int],
    vllm_chunk_ids: list[int] | None = None,
) -> list[int]:
    """The keys to store and the victims exactly as vLLM's test expects; the chunk ids as
    a set only (vLLM hands out a LIFO free list, kvoffload the lowest free ids ascending:
    docs/integrations.md). Returns the chunk ids."""
    assert output is not None
    assert output.keys_to_store == keys(to_store)
    assert output.evicted_keys == keys(evicted)
    ids = chunk_ids(output.store_spec)
    assert len(ids) == len(to_store)
    if vllm_chunk_ids is not None:
        assert sorted(ids) == sorted(vllm_chunk_ids)
    return ids


def event_sets(
    events: Iterable[OffloadingEvent],
) -> tuple[list[set[OffloadKey]], list[set[OffloadKey]]]:
    """The stored and the removed key sets, in order (vLLM's ``verify_events``)."""
    stored: list[set[OffloadKey]] = []
    removed: list[set[OffloadKey]] = []
    for event in events:
        (removed if event.removed else stored).append(set(event.keys))
    return stored, removed


def reduced(adapter: KvoffloadManager) -> dict[str, int | float]:
    stats = adapter.get_stats()
    assert stats is not None
    values: dict[str, int | float] = stats.reduce()
    return values


def usage(adapter: KvoffloadManager) -> tuple[float, float, float]:
    """(write, read, total) of vLLM's CPU cache usage gauges."""
    values = reduced(adapter)
    return (
        values[CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC],
        values[CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC],
        values[CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC],
    )
