"""kvoffload's metrics on vLLM 0.33's connector stats path (docs/metrics.md).

vLLM publishes on ``/metrics`` what an offloading spec declares
(``build_metric_definitions``) and what its manager and tiers put in their
``OffloadingConnectorStats`` each scheduler step: a counter as its increase since the last
step, a gauge as its value now. kvoffload's snapshots hold running totals, so
:class:`StepReport` turns them into increases. A metric vLLM reports under its own name
(``Metric.vllm_name``: refused stores, bytes and time per direction) is left to vLLM.

Importing this module imports vLLM; ``import kvoffload`` never does.
"""

from __future__ import annotations

from collections.abc import Iterable

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
)

from kvoffload.metrics import METRICS, Metric, Sample

__all__ = ["MANAGER_METRICS", "TIER_METRICS", "StepReport", "definitions"]

#: What ``KvoffloadManager.get_stats`` reports besides vLLM's own CPU manager metrics.
MANAGER_METRICS: tuple[str, ...] = (
    "kvoffload_lookups",
    "kvoffload_blocks_stored",
    "kvoffload_blocks_loaded",
    "kvoffload_evictions",
    "kvoffload_failed_stores",
    "kvoffload_fast_fail_rejections",
    "kvoffload_resets",
    "kvoffload_abandoned_plans",
    "kvoffload_blocks",
    "kvoffload_capacity_blocks",
    "kvoffload_stalled_plans",
    "kvoffload_stalled_blocks",
    "kvoffload_abandoned_open_plans",
)

#: What ``KvoffloadValkeyTier.get_stats`` reports (vLLM's tiering manager reports the
#: tier's jobs, bytes and chunk hits under its own names).
TIER_METRICS: tuple[str, ...] = (
    "kvoffload_remote_calls",
    "kvoffload_remote_keys",
    "kvoffload_remote_rejections",
    "kvoffload_remote_puts",
    "kvoffload_remote_deletes",
    "kvoffload_remote_failures",
    "kvoffload_remote_connects",
    "kvoffload_remote_retries",
    "kvoffload_remote_bytes",
    "kvoffload_remote_server_down",
    "kvoffload_tier_keys_not_loaded",
)


def definitions(names: Iterable[str]) -> dict[str, OffloadingMetricMetadata]:
    """vLLM's declarations of the metrics ``names`` (for ``build_metric_definitions``)."""
    declared: dict[str, OffloadingMetricMetadata] = {}
    for name in names:
        metric: Metric = METRICS[name]
        if metric.kind == "counter":
            declared[name] = OffloadingCounterMetadata(metric.documentation, metric.labelnames)
        else:
            declared[name] = OffloadingGaugeMetadata(metric.documentation, metric.labelnames)
    return declared


class StepReport:
    """Puts samples on a step's stats: gauges as they are, counters as their increase
    since the previous step (the first step reports the whole total, zeros included, so
    that every series exists from the start)."""

    def __init__(self) -> None:
        self._reported: dict[tuple[str, tuple[str, ...]], float] = {}

    def add(self, stats: OffloadingConnectorStats, samples: Iterable[Sample]) -> None:
        reported = self._reported
        for sample in samples:
            metric = sample.metric
            if metric.vllm_name is not None:
                continue  # vLLM counts it under its own name
            if metric.kind == "gauge":
                stats.set_gauge(metric.name, sample.value, sample.labelvalues)
                continue
            series = (metric.name, sample.labelvalues)
            before = reported.get(series)
            if before is None or sample.value != before:
                reported[series] = sample.value
                stats.increase_counter(
                    metric.name, sample.value - (before or 0.0), sample.labelvalues
                )
