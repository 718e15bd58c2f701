"""vLLM 0.33's connector behaviours on our adapter: its KV events through vLLM's own
``OffloadingEventsTracker`` and ``OffloadingConnectorScheduler._maximal_prefix_lookup``
(``tests/v1/kv_connector/unit/offloading_connector/test_events.py``), and its metrics
through vLLM's own ``OffloadPromMetrics`` into a real ``prometheus_client`` registry
(``.../test_metrics.py``), scraped over HTTP and parsed with prometheus_client's parser.

vLLM's tests read the tracker's private ``_pending_event_metadata``; ours read what it
publishes instead: a chunk's metadata is there exactly when its next event carries the
chunk's tokens and block size (a placeholder event has ``block_size == 0``).
"""

from __future__ import annotations

import functools
import urllib.request
from types import SimpleNamespace
from typing import Any
from unittest.mock import MagicMock

import pytest
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.parser import text_string_to_metric_families
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
    OffloadingEventGroupSpec,
    OffloadingEventsTracker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
    OffloadPromMetrics,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    GroupOffloadConfig,
    OffloadingConnectorScheduler,
)
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpecKind
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingKVEventsConfig,
    OffloadKey,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.common import CPUOffloadingMetrics

from kvoffload.integrations.vllm import KvoffloadManager
from kvoffload.integrations.vllm_metrics import MANAGER_METRICS
from kvoffload.metrics import METRICS

# -- the events tracker -------------------------------------------------------------------------


def tracker() -> OffloadingEventsTracker:
    return OffloadingEventsTracker(
        OffloadingKVEventsConfig(enable_kv_cache_events=True, self_describing_kv_events=True)
    )


def block_hash(number: int) -> BlockHash:
    return BlockHash(str(number).encode())


def request(hashes: list[BlockHash], tokens: int, req_id: str = "req") -> MagicMock:
    """The attributes of a vLLM ``Request`` the tracker reads."""
    req = MagicMock()
    req.request_id = req_id
    req.block_hashes = hashes
    req.all_token_ids = list(range(1, tokens + 1))
    req.lora_request = None
    return req


def group(block_size: int, blocks_per_chunk: int = 1) -> GroupOffloadConfig:
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    manager_cls = KVCacheSpecRegistry.get_manager_class(spec)
    assert manager_cls is not None
    tokens_per_chunk = block_size * blocks_per_chunk
    return GroupOffloadConfig(
        group_idx=0,
        tokens_per_block=block_size,
        tokens_per_chunk=tokens_per_chunk,
        hashes_per_chunk=blocks_per_chunk,
        sliding_window_size_in_chunks=None,
        kv_cache_spec=spec,
        manager_cls=manager_cls,
        kv_event_group_spec=OffloadingEventGroupSpec(
            kv_cache_spec_kind=KVCacheSpecKind.FULL_ATTENTION.value,
            kv_cache_spec_sliding_window=None,
        ),
    )


def found_pending(
    adapter: KvoffloadManager,
    events: OffloadingEventsTracker,
    key: OffloadKey,
    ctx: ReqContext,
    req: MagicMock,
    config: GroupOffloadConfig,
) -> None:
    """vLLM's scheduler looks the chunk up (and records its metadata): a pending hit."""
    scheduler = SimpleNamespace(manager=adapter, _events_tracker=events)
    lookup = OffloadingConnectorScheduler._maximal_prefix_lookup
    assert lookup(scheduler, [key], ctx, req, config, 0) is None


def stored_event(key: OffloadKey, **fields: Any) -> OffloadingEvent:
    return OffloadingEvent(keys=[key], medium=Medium.CPU, removed=False, **fields)


def removed_event(key: OffloadKey, **fields: Any) -> OffloadingEvent:
    return OffloadingEvent(keys=[key], medium=Medium.CPU, removed=True, **fields)


def test_failed_pending_chunk_does_not_remove_shared_ready_prefix() -> None:
    events = tracker()
    config = group(block_size=1600, blocks_per_chunk=2)
    ready_req = request([block_hash(0), block_hash(1)], 3200)
    failed_req = request([block_hash(0), block_hash(2)], 3200)
    ready_key, failed_key = (make_offload_key(block_hash(i), 0) for i in (1, 2))
    adapter = KvoffloadManager(2, enable_events=True)
    ctx = ReqContext(req_id="shared-prefix")
    adapter.prepare_store([ready_key], ctx)
    events.record_store(ready_req, config, 0, ready_key)
    adapter.complete_store([ready_key], ctx)
    [stored] = events.take_events(adapter.take_events())
    assert stored.block_hashes == [maybe_convert_block_hash(block_hash(i)) for i in (0, 1)]
    adapter.prepare_store([failed_key], ctx)
    found_pending(adapter, events, failed_key, ctx, failed_req, config)
    adapter.complete_store([failed_key], ctx, success=False)
    assert list(events.take_events(adapter.take_events())) == []
    assert adapter.lookup(ready_key, ctx) is LookupResult.HIT
    # The failed chunk's metadata is gone (a later store of it is a placeholder); the
    # ready chunk's is still there (its removal describes it in full).
    [placeholder] = events.take_events([stored_event(failed_key)])
    assert isinstance(placeholder, BlockStored) and placeholder.block_size == 0
    [removed] = events.take_events([removed_event(ready_key)])
    assert isinstance(removed, BlockRemoved)
    assert removed.block_hashes == stored.block_hashes


@pytest.mark.parametrize("success", [False, True])
def test_failed_pending_retry_preserves_replacement_metadata(success: bool) -> None:
    """The failed-store path of issue 27's bug 1: the old store's removal, taken after a
    retry recorded its metadata, wiped the retry's (vLLM's manager drops that removal)."""
    events = tracker()
    req = request([block_hash(0)], 1600)
    config = group(block_size=1600)
    key = make_offload_key(block_hash(0), 0)
    adapter = KvoffloadManager(1, enable_events=True)
    ctx = ReqContext(req_id="retry")
    for attempt in range(2):
        adapter.prepare_store([key], ctx)
        found_pending(adapter, events, key, ctx, req, config)
        if attempt == 0:
            adapter.complete_store([key], ctx, success=False)
    old_cleanup = list(events.take_events(adapter.take_events()))  # taken after the retry
    assert old_cleanup == []
    [inventory] = events.take_events([stored_event(key, ownership="kvcr", removal_expected=True)])
    assert isinstance(inventory, BlockStored)
    assert inventory.block_size == 1600 and inventory.token_ids == req.all_token_ids
    assert adapter.lookup(key, ctx) is LookupResult.HIT_PENDING
    adapter.complete_store([key], ctx, success=success)
    taken = list(events.take_events(adapter.take_events()))
    assert len(taken) == int(success)
    if success:
        assert isinstance(taken[0], BlockStored) and taken[0].block_size == 1600


@pytest.mark.parametrize("history", ["never_seen", "evicted", "retained", "secondary_only"])
@pytest.mark.parametrize("success", [False, True])
def test_pending_promotion_captures_payload_before_inventory(history: str, success: bool) -> None:
    events = tracker()
    req = request([block_hash(0)], 1600)
    config = group(block_size=1600)
    key = make_offload_key(block_hash(0), 0)
    if history != "never_seen":
        events.record_store(req, config, 0, key)
        if history == "evicted":
            list(events.take_events([removed_event(key)]))
        elif history == "secondary_only":
            list(
                events.take_events(
                    [stored_event(key, ownership="kvcr", removal_expected=True), removed_event(key)]
                )
            )
    adapter = KvoffloadManager(1, enable_events=True)
    ctx = ReqContext(req_id="promotion")
    adapter.prepare_store([key], ctx)
    found_pending(adapter, events, key, ctx, req, config)
    assert list(events.take_events(adapter.take_events())) == []
    if history == "secondary_only":
        list(events.take_events([removed_event(key, ownership="kvcr")]))
    if success:
        [event] = events.take_events([stored_event(key, ownership="kvcr", removal_expected=True)])
        assert isinstance(event, BlockStored)
        assert event.ownership == "kvcr" and event.block_size == 1600
        assert event.token_ids == req.all_token_ids
    adapter.complete_store([key], ctx, success=success)
    taken = list(events.take_events(adapter.take_events()))
    if success:
        assert adapter.lookup(key, ctx) is LookupResult.HIT
        assert len(taken) == 1 and isinstance(taken[0], BlockStored)
        assert taken[0].block_size == 1600
    else:
        assert adapter.lookup(key, ctx) is LookupResult.MISS


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_chunk_stored_again_after_a_reset_keeps_its_metadata(policy: str) -> None:
    """Issue 27's bug 1: vLLM's scheduler resets its tracker, stores the same chunk again
    and only then takes the manager's events. The reset's own removals (vLLM's manager
    announces none) wiped the re-stored chunk's metadata: its BlockStored came out as a
    placeholder (block_size 0), after a spurious BlockRemoved."""
    assert_reset_silent(KvoffloadManager(2, policy, enable_events=True))
    events = tracker()
    req = request([block_hash(0), block_hash(1)], 3200)
    config = group(block_size=1600)
    ready, pending = (make_offload_key(block_hash(i), 0) for i in (0, 1))
    adapter = KvoffloadManager(2, policy, enable_events=True)
    ctx = ReqContext(req_id="before")
    adapter.prepare_store([ready], ctx)
    adapter.complete_store([ready], ctx)
    list(adapter.take_events())
    adapter.prepare_store([pending], ctx)  # in flight at the reset
    adapter.reset_cache()
    events.reset()
    adapter.on_reset_flushed()
    again = ReqContext(req_id="after")
    for index, key in enumerate((ready, pending)):
        adapter.prepare_store([key], again)
        events.record_store(req, config, index, key)
    adapter.complete_store([ready, pending], again)
    taken = list(events.take_events(adapter.take_events()))
    assert all(isinstance(event, BlockStored) for event in taken)
    assert [event.block_size for event in taken] == [1600, 1600]  # no placeholder
    assert sorted(token for event in taken for token in event.token_ids) == req.all_token_ids


def assert_reset_silent(adapter: KvoffloadManager) -> None:
    """The issue's reproducer: a removal of ``k`` while it is pending again."""
    key, ctx = make_offload_key(b"k", 0), ReqContext(req_id="r")
    adapter.prepare_store([key], ctx)
    adapter.reset_cache()
    adapter.on_reset_flushed()
    adapter.prepare_store([key], ctx)
    assert list(adapter.take_events()) == []


# -- metrics: vLLM's Prometheus path ---------------------------------------------------------


def vllm_config(extra: dict[str, Any]) -> SimpleNamespace:
    """What ``OffloadPromMetrics`` reads of a ``VllmConfig``."""
    config = {
        "spec_name": "KvoffloadManagerSpec",
        "spec_module_path": "kvoffload.integrations.vllm",
    }
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=config | extra)
    )


def prom_metrics(extra: dict[str, Any], registry: CollectorRegistry) -> OffloadPromMetrics:
    """vLLM's frontend metrics object, its metrics made in ``registry``."""
    kinds = {
        kind: functools.partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)
    }
    return OffloadPromMetrics(
        vllm_config=vllm_config(extra),
        metric_types=kinds,
        labelnames=["model_name", "engine"],
        per_engine_labelvalues={0: ["model", "0"]},
    )


def scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample served over HTTP, parsed by prometheus_client's parser."""
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        port = server.server_address[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


ENGINE = (("engine", "0"), ("model_name", "model"))


def test_prom_metrics_uses_configured_manager_metrics() -> None:
    """vLLM declares ``stores_skipped`` only with ``store_threshold >= 2``; so does ours,
    and it declares the manager's own metrics."""
    quiet = prom_metrics({"store_threshold": 0}, CollectorRegistry())
    declared = quiet._offloading_metric_metadata
    assert CPUOffloadingMetrics.STORES_SKIPPED not in declared
    assert set(MANAGER_METRICS) <= set(declared)
    counting = prom_metrics({"store_threshold": 2}, CollectorRegistry())
    assert CPUOffloadingMetrics.STORES_SKIPPED in counting._offloading_metric_metadata


def test_everything_the_manager_counts_reaches_vllms_metrics_endpoint() -> None:
    """``vllm:kv_offload_*`` as vLLM's manager reports them, and kvoffload's own: the
    stats of two steps merged the way vLLM's scheduler does (``aggregate``), observed by
    vLLM's ``OffloadPromMetrics`` and scraped."""
    registry = CollectorRegistry()
    frontend = prom_metrics({"store_threshold": 2}, registry)
    adapter = KvoffloadManager(2, "lru", store_threshold=2)
    ctx = ReqContext(req_id="r")
    keys = [make_offload_key(str(i).encode(), 0) for i in range(4)]
    adapter.prepare_store(keys[:2], ctx)  # first offers: skipped
    adapter.prepare_store(keys[:2], ctx)
    adapter.complete_store(keys[:2], ctx)
    adapter.lookup(keys[0], ctx)
    adapter.prepare_load(keys[:1], ctx)
    step = adapter.get_stats()
    assert step is not None
    frontend.observe(step.data)
    adapter.prepare_store(keys[2:], ctx)  # offered once: skipped
    assert adapter.prepare_store(keys[2:], ctx) is None  # one chunk pinned: refused
    adapter.complete_load(keys[:1], ctx)
    adapter.prepare_store(keys[2:3], ctx)  # evicts one
    merged = OffloadingConnectorStats()
    for stats in (adapter.get_stats(), adapter.get_stats()):
        assert stats is not None
        merged.aggregate(stats)
    frontend.observe(merged.data)
    values = scrape(registry)

    def value(name: str, **labels: str) -> float:
        return values[(name, tuple(sorted((*ENGINE, *labels.items()))))]

    final = adapter.manager.stats()
    assert value("vllm:kv_offload_stores_skipped_total") == 4
    assert value("vllm:kv_offload_cpu_allocation_size_count") == 3  # the refused one too
    assert value("vllm:kv_offload_cpu_allocation_size_sum") == 5
    assert value("vllm:kv_offload_cpu_cache_write_usage_perc") == 0.5
    assert value("kvoffload_lookups_total", result="hit") == final.lookup_hits == 1
    assert value("kvoffload_evictions_total") == final.evictions == 1
    assert value("kvoffload_fast_fail_rejections_total") == final.fast_fail_rejections == 1
    assert value("kvoffload_blocks_loaded_total") == 1
    assert value("kvoffload_blocks", state="pending") == final.pending == 1
    assert value("kvoffload_blocks", state="evictable") == final.evictable == 1
    assert value("kvoffload_capacity_blocks") == 2
    # Refused stores are vLLM's own vllm:kv_offload_allocation_failure (its connector
    # counts them): not reported twice.
    assert not any(name == "kvoffload_rejected_stores_total" for name, _ in values)


def test_every_declared_metric_is_in_the_catalogue() -> None:
    declared = prom_metrics({}, CollectorRegistry())._offloading_metric_metadata
    ours = {name for name in declared if name.startswith("kvoffload_")}
    assert ours == set(MANAGER_METRICS) and ours <= set(METRICS)
