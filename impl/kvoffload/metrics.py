"""kvoffload's counters as Prometheus metrics, inside vLLM and out (docs/metrics.md).

One catalogue (``METRICS``) names everything kvoffload counts: the manager's lookups,
evictions, refused and fast-failed stores and its blocks by state (``ManagerStats``), an
``Offloader``'s copies per direction (``TransferStats``) and its remote tier
(``RemoteOffloadStats``), and a remote store's hits, misses, refusals by reason, failures,
timeouts and whether its server is down (``RemoteStats``). ``samples`` reads those snapshots
into ``Sample``s; vLLM's connector gets them through ``kvoffload.integrations.vllm``, and
anything else through :class:`MetricsExporter` (``prometheus_client``, the optional extra
``kvoffload[metrics]``; imported only when an exporter is made)::

    exporter = MetricsExporter({"engine0": offloader})
    exporter.serve(9400)  # http://127.0.0.1:9400/metrics
    ...  # each step, from the thread that drives the offloader:
    exporter.refresh()

A counter is declared by its name and exposed with ``_total`` appended, as Prometheus does.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Literal

from kvoffload_spec.errors import InvalidArgumentError

if TYPE_CHECKING:
    from prometheus_client.registry import Collector, CollectorRegistry

    from kvoffload.offloader import RemoteOffloadStats
    from kvoffload.stats import ManagerStats, TransferStats
    from kvoffload.tiers import RemoteStats

__all__ = [
    "METRICS",
    "Metric",
    "MetricsExporter",
    "Sample",
    "manager_samples",
    "remote_offload_samples",
    "remote_samples",
    "samples",
    "transfer_samples",
]

Kind = Literal["counter", "gauge"]


@dataclass(frozen=True)
class Metric:
    """One metric: its name (a counter's without ``_total``), kind, help and label names;
    ``vllm_name``: vLLM's own name(s) for the same quantity, which vLLM's connector reports
    itself, so kvoffload does not report this one inside vLLM."""

    name: str
    kind: Kind
    documentation: str
    labelnames: tuple[str, ...] = ()
    vllm_name: str | None = None

    @property
    def exposed_name(self) -> str:
        return f"{self.name}_total" if self.kind == "counter" else self.name


@dataclass(frozen=True)
class Sample:
    """A metric's value for one set of label values (in ``metric.labelnames`` order)."""

    metric: Metric
    labelvalues: tuple[str, ...]
    value: float


_TIER = ("tier", "connection")  # a remote store: which tier, which of its connections

METRICS: dict[str, Metric] = {
    metric.name: metric
    for metric in (
        # -- the manager (ManagerStats) ---------------------------------------------------
        Metric("kvoffload_lookups", "counter", "Lookups of the CPU pool by result.", ("result",)),
        Metric("kvoffload_blocks_stored", "counter", "Blocks made readable by a store."),
        Metric("kvoffload_blocks_loaded", "counter", "Blocks read by completed loads."),
        Metric("kvoffload_evictions", "counter", "Blocks evicted from the CPU pool."),
        Metric("kvoffload_failed_stores", "counter", "Blocks whose store job failed."),
        Metric(
            "kvoffload_rejected_stores",
            "counter",
            "Stores refused for want of room (prepare_store returned None).",
            vllm_name="vllm:kv_offload_allocation_failure",
        ),
        Metric(
            "kvoffload_fast_fail_rejections",
            "counter",
            "Refused stores decided in O(1): not even every evictable block would make room.",
        ),
        Metric("kvoffload_resets", "counter", "Resets of the CPU pool."),
        Metric("kvoffload_abandoned_plans", "counter", "Plans abandoned (stalled jobs, resets)."),
        Metric(
            "kvoffload_blocks",
            "gauge",
            "CPU pool blocks by state: pending (store in flight), pinned (loads reading), "
            "evictable, free, quarantined (an abandoned job may still write them).",
            ("state",),
        ),
        Metric("kvoffload_capacity_blocks", "gauge", "Blocks the CPU pool holds in all."),
        Metric("kvoffload_stalled_plans", "gauge", "Open plans older than stall_after."),
        Metric(
            "kvoffload_stalled_blocks",
            "gauge",
            "Blocks held by stalled plans: pinned by loads, pending in stores.",
            ("state",),
        ),
        Metric(
            "kvoffload_abandoned_open_plans",
            "gauge",
            "Abandoned plans whose (late) completion has not come yet.",
        ),
        # -- an Offloader's copies (TransferStats) ------------------------------------------
        Metric(
            "kvoffload_transfers",
            "counter",
            "Copy jobs finished, by direction and result.",
            ("direction", "result"),
        ),
        Metric(
            "kvoffload_transfer_bytes",
            "counter",
            "Bytes copied, by direction (load: CPU to device; store: device to CPU).",
            ("direction",),
            vllm_name="vllm:kv_offload_load_bytes, vllm:kv_offload_store_bytes",
        ),
        Metric(
            "kvoffload_transfer_seconds",
            "counter",
            "Seconds spent copying, by direction.",
            ("direction",),
            vllm_name="vllm:kv_offload_load_time, vllm:kv_offload_store_time",
        ),
        Metric(
            "kvoffload_transfers_finished_abandoned",
            "counter",
            "Copy jobs that finished after their plan was abandoned.",
        ),
        # -- an Offloader's remote tier (RemoteOffloadStats) --------------------------------
        Metric(
            "kvoffload_remote_fetches",
            "counter",
            "Keys asked of the remote tier, by result (hit, miss, skipped: resident here "
            "already, no_room: no CPU block for it).",
            ("result",),
        ),
        Metric("kvoffload_remote_fetch_bytes", "counter", "Bytes fetched from the remote tier."),
        Metric(
            "kvoffload_remote_writes",
            "counter",
            "Keys written to the remote tier, by result (written, not_written).",
            ("result",),
        ),
        Metric("kvoffload_remote_write_bytes", "counter", "Bytes written to the remote tier."),
        Metric(
            "kvoffload_remote_jobs_dropped", "counter", "Remote jobs that found the queue full."
        ),
        Metric("kvoffload_remote_jobs_in_flight", "gauge", "Remote jobs not reported yet."),
        # -- a remote store (RemoteStats) ---------------------------------------------------
        Metric(
            "kvoffload_remote_calls", "counter", "Calls to the remote store, by op.", (*_TIER, "op")
        ),
        Metric(
            "kvoffload_remote_keys",
            "counter",
            "Keys read from the remote store, by result (hit, miss: no value, rejected: a "
            "value that failed its checks, unavailable: the server failed or was down).",
            (*_TIER, "result"),
        ),
        Metric(
            "kvoffload_remote_rejections",
            "counter",
            "Values refused, by reason (malformed, foreign, wrong_key, length, checksum).",
            (*_TIER, "reason"),
        ),
        Metric(
            "kvoffload_remote_puts",
            "counter",
            "Keys written to the remote store, by result (stored, not_stored).",
            (*_TIER, "result"),
        ),
        Metric("kvoffload_remote_deletes", "counter", "Keys deleted from the remote store.", _TIER),
        Metric(
            "kvoffload_remote_failures",
            "counter",
            "Calls that met a failure, by kind (timeout, connection, server: an error "
            "reply, skipped: answered at once while the server was marked down).",
            (*_TIER, "kind"),
        ),
        Metric("kvoffload_remote_connects", "counter", "Connections established.", _TIER),
        Metric(
            "kvoffload_remote_retries", "counter", "Calls sent again on a new connection.", _TIER
        ),
        Metric(
            "kvoffload_remote_bytes",
            "counter",
            "Payload bytes: sent (acknowledged), received (hits), copied (by the store).",
            (*_TIER, "direction"),
        ),
        Metric(
            "kvoffload_remote_server_down",
            "gauge",
            "1 while the server is marked down (calls return at once), else 0.",
            _TIER,
        ),
        # -- kvoffload's vLLM secondary tier (TierStats) ------------------------------------
        Metric(
            "kvoffload_tier_keys_not_loaded",
            "counter",
            "Keys a load from the tier could not load (vLLM recomputes them).",
            ("tier",),
        ),
    )
}

# Snapshot field -> (metric, its label values); a test checks every field is here or in
# the fields left out on purpose (sums of others, or not numbers).
_MANAGER: dict[str, tuple[str, tuple[str, ...]]] = {
    "lookup_hits": ("kvoffload_lookups", ("hit",)),
    "lookup_misses": ("kvoffload_lookups", ("miss",)),
    "lookup_pending": ("kvoffload_lookups", ("pending",)),
    "blocks_stored": ("kvoffload_blocks_stored", ()),
    "blocks_loaded": ("kvoffload_blocks_loaded", ()),
    "evictions": ("kvoffload_evictions", ()),
    "failed_stores": ("kvoffload_failed_stores", ()),
    "rejected_stores": ("kvoffload_rejected_stores", ()),
    "fast_fail_rejections": ("kvoffload_fast_fail_rejections", ()),
    "resets": ("kvoffload_resets", ()),
    "abandoned_plans": ("kvoffload_abandoned_plans", ()),
    "pending": ("kvoffload_blocks", ("pending",)),
    "pinned": ("kvoffload_blocks", ("pinned",)),
    "evictable": ("kvoffload_blocks", ("evictable",)),
    "free": ("kvoffload_blocks", ("free",)),
    "quarantined": ("kvoffload_blocks", ("quarantined",)),
    "num_blocks": ("kvoffload_capacity_blocks", ()),
    "stalled_plans": ("kvoffload_stalled_plans", ()),
    "stalled_pins": ("kvoffload_stalled_blocks", ("pinned",)),
    "stalled_pending": ("kvoffload_stalled_blocks", ("pending",)),
    "abandoned_open": ("kvoffload_abandoned_open_plans", ()),
}
MANAGER_FIELDS_LEFT_OUT = {"resident": "pending + pinned + evictable"}

_TRANSFER: dict[str, tuple[str, tuple[str, ...]]] = {
    "loads": ("kvoffload_transfers", ("load", "ok")),
    "loads_failed": ("kvoffload_transfers", ("load", "failed")),
    "load_bytes": ("kvoffload_transfer_bytes", ("load",)),
    "load_seconds": ("kvoffload_transfer_seconds", ("load",)),
    "stores": ("kvoffload_transfers", ("store", "ok")),
    "stores_failed": ("kvoffload_transfers", ("store", "failed")),
    "store_bytes": ("kvoffload_transfer_bytes", ("store",)),
    "store_seconds": ("kvoffload_transfer_seconds", ("store",)),
    "finished_abandoned": ("kvoffload_transfers_finished_abandoned", ()),
}

_REMOTE_OFFLOAD: dict[str, tuple[str, tuple[str, ...]]] = {
    "fetch_hits": ("kvoffload_remote_fetches", ("hit",)),
    "fetch_misses": ("kvoffload_remote_fetches", ("miss",)),
    "fetch_skipped": ("kvoffload_remote_fetches", ("skipped",)),
    "fetch_no_room": ("kvoffload_remote_fetches", ("no_room",)),
    "fetch_bytes": ("kvoffload_remote_fetch_bytes", ()),
    "written": ("kvoffload_remote_writes", ("written",)),
    "not_written": ("kvoffload_remote_writes", ("not_written",)),
    "written_bytes": ("kvoffload_remote_write_bytes", ()),
    "jobs_dropped": ("kvoffload_remote_jobs_dropped", ()),
    "in_flight": ("kvoffload_remote_jobs_in_flight", ()),
}
REMOTE_OFFLOAD_FIELDS_LEFT_OUT = {
    "mode": "not a number",
    "fetch_calls": "calls, the keys are counted",
    "fetch_keys": "hits + misses (once reported)",
    "write_keys": "written + not_written (once reported)",
    "promoted": "of write_keys: blocks a lower tier served, written up (tier_stats() has them)",
    "store": "the store's own RemoteStats",
}

_REMOTE: dict[str, tuple[str, tuple[str, ...]]] = {
    "get_calls": ("kvoffload_remote_calls", ("get",)),
    "put_calls": ("kvoffload_remote_calls", ("put",)),
    "delete_calls": ("kvoffload_remote_calls", ("delete",)),
    "contains_calls": ("kvoffload_remote_calls", ("contains",)),
    "hits": ("kvoffload_remote_keys", ("hit",)),
    "misses": ("kvoffload_remote_keys", ("miss",)),
    "rejected": ("kvoffload_remote_keys", ("rejected",)),
    "unavailable": ("kvoffload_remote_keys", ("unavailable",)),
    "rejected_malformed": ("kvoffload_remote_rejections", ("malformed",)),
    "rejected_foreign": ("kvoffload_remote_rejections", ("foreign",)),
    "rejected_wrong_key": ("kvoffload_remote_rejections", ("wrong_key",)),
    "rejected_length": ("kvoffload_remote_rejections", ("length",)),
    "rejected_checksum": ("kvoffload_remote_rejections", ("checksum",)),
    "rejected_mac": ("kvoffload_remote_rejections", ("mac",)),
    "keys_stored": ("kvoffload_remote_puts", ("stored",)),
    "keys_not_stored": ("kvoffload_remote_puts", ("not_stored",)),
    "keys_deleted": ("kvoffload_remote_deletes", ()),
    "timeouts": ("kvoffload_remote_failures", ("timeout",)),
    "connection_errors": ("kvoffload_remote_failures", ("connection",)),
    "server_errors": ("kvoffload_remote_failures", ("server",)),
    "protocol_errors": ("kvoffload_remote_failures", ("protocol",)),
    "skipped": ("kvoffload_remote_failures", ("skipped",)),
    "connects": ("kvoffload_remote_connects", ()),
    "retries": ("kvoffload_remote_retries", ()),
    "bytes_sent": ("kvoffload_remote_bytes", ("sent",)),
    "bytes_received": ("kvoffload_remote_bytes", ("received",)),
    "bytes_copied": ("kvoffload_remote_bytes", ("copied",)),
    "server_down": ("kvoffload_remote_server_down", ()),
}
REMOTE_FIELDS_LEFT_OUT = {
    "keys_requested": "hits + misses + rejected + unavailable",
    "keys_offered": "keys_stored + keys_not_stored",
    "failures": "the sum of the failures by kind",
    "last_error": "not a number",
}


def _read(
    snapshot: object, table: Mapping[str, tuple[str, tuple[str, ...]]], labels: tuple[str, ...]
) -> list[Sample]:
    return [
        Sample(METRICS[name], (*labels, *values), float(getattr(snapshot, field)))
        for field, (name, values) in table.items()
    ]


def manager_samples(stats: ManagerStats) -> list[Sample]:
    """The manager's counters and gauges (``OffloadManager.stats()``)."""
    return _read(stats, _MANAGER, ())


def transfer_samples(stats: TransferStats) -> list[Sample]:
    """An offloader's copies (``Offloader.transfer_stats()``)."""
    return _read(stats, _TRANSFER, ())


def remote_offload_samples(stats: RemoteOffloadStats) -> list[Sample]:
    """An offloader's remote tier (``Offloader.remote_stats()``); its store's own counters
    are ``remote_samples(stats.store, ...)``."""
    return _read(stats, _REMOTE_OFFLOAD, ())


def remote_samples(stats: RemoteStats, tier: str, connection: str) -> list[Sample]:
    """A remote store's counters (``ValkeyStore.stats()``), labelled with its tier and
    which of the tier's connections it is."""
    return _read(stats, _REMOTE, (tier, connection))


def samples(source: object) -> list[Sample]:
    """Everything ``source`` counts: an ``Offloader`` (its manager's stats too, where the
    manager has ``stats()``), an ``OffloadManager``, or a ``RemoteStore``. Read it from the
    thread that drives it."""
    from kvoffload.stats import ManagerStats
    from kvoffload.tiers.store import RemoteStats

    found: list[Sample] = []
    transfer_stats = getattr(source, "transfer_stats", None)
    offloader = callable(transfer_stats)
    if offloader:
        found += transfer_samples(transfer_stats())  # type: ignore[misc]
        remote = source.remote_stats()  # type: ignore[attr-defined]
        if remote is not None:
            found += remote_offload_samples(remote)
            if remote.store is not None:
                found += remote_samples(remote.store, "remote", "offloader")
        source = source.manager  # type: ignore[attr-defined]
    stats = getattr(source, "stats", None)
    snapshot = stats() if callable(stats) else None
    if isinstance(snapshot, ManagerStats):
        found += manager_samples(snapshot)
    elif isinstance(snapshot, RemoteStats):
        found += remote_samples(snapshot, "remote", "store")
    elif not offloader:
        raise TypeError(f"{source!r} is not an Offloader, OffloadManager or RemoteStore")
    return found


def unexported_fields() -> dict[str, list[str]]:
    """Each snapshot's fields that no metric reads and that are not left out on purpose
    (empty lists: a test holds it so, and a new counter fails it until it is named)."""
    from kvoffload.offloader import RemoteOffloadStats
    from kvoffload.stats import ManagerStats, TransferStats
    from kvoffload.tiers.store import RemoteStats

    checked: list[tuple[type, Mapping[str, object], Mapping[str, str]]] = [
        (ManagerStats, _MANAGER, MANAGER_FIELDS_LEFT_OUT),
        (TransferStats, _TRANSFER, {}),
        (RemoteOffloadStats, _REMOTE_OFFLOAD, REMOTE_OFFLOAD_FIELDS_LEFT_OUT),
        (RemoteStats, _REMOTE, REMOTE_FIELDS_LEFT_OUT),
    ]
    return {
        kind.__name__: [
            f.name for f in fields(kind) if f.name not in table and f.name not in left_out
        ]
        for kind, table, left_out in checked
    }


class MetricsExporter:
    """Serves kvoffload's metrics to Prometheus (``prometheus_client``).

    ``sources``: one object (an ``Offloader``, ``OffloadManager`` or ``RemoteStore``), or a
    mapping of names to such objects, whose name then labels every sample (the label is
    ``label``). ``refresh()`` reads them, in the caller's thread (the one that drives them:
    the objects are not read from the server's thread); a scrape returns the last values
    read. ``registry()`` holds this exporter only; ``serve(port)`` serves it over HTTP.
    """

    def __init__(self, sources: object, *, label: str = "instance") -> None:
        try:
            from prometheus_client.registry import Collector
        except ImportError as error:
            raise ImportError(
                "kvoffload's metrics exporter needs prometheus_client: "
                "pip install 'kvoffload[metrics]'"
            ) from error

        if isinstance(sources, Mapping):
            self._sources: dict[str, object] = {str(name): s for name, s in sources.items()}
            self._labels: tuple[str, ...] = (label,)
        else:
            self._sources, self._labels = {"": sources}, ()
        self._lock = threading.Lock()
        self._last: list[tuple[str, Sample]] = []
        self._server: Any = None
        exporter = self

        class _Collector(Collector):
            def collect(self) -> Iterator[Any]:
                return exporter._families()

        self.collector: Collector = _Collector()

    def refresh(self) -> None:
        """Read every source now; the next scrape serves these values."""
        read = [
            (name, sample) for name, source in self._sources.items() for sample in samples(source)
        ]
        with self._lock:
            self._last = read

    def registry(self) -> CollectorRegistry:
        from prometheus_client import CollectorRegistry

        registry = CollectorRegistry(auto_describe=False)
        registry.register(self.collector)
        return registry

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``addr:port`` (0: any free port) from a daemon thread until
        ``close()``; returns the port."""
        from prometheus_client import start_http_server

        if self._server is not None:
            raise InvalidArgumentError("this exporter is serving already")
        self.refresh()
        try:
            self._server, _ = start_http_server(port, addr=addr, registry=self.registry())
        except OSError as error:  # the port is taken, or the address is not this host's
            raise InvalidArgumentError(f"cannot serve metrics on {addr}:{port}: {error}") from None
        bound: int = self._server.server_address[1]
        return bound

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> MetricsExporter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _families(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        with self._lock:
            read = list(self._last)
        families: dict[str, Any] = {}
        for name, sample in read:
            metric = sample.metric
            family = families.get(metric.name)
            if family is None:
                kind = CounterMetricFamily if metric.kind == "counter" else GaugeMetricFamily
                labels = [*self._labels, *metric.labelnames]
                family = kind(metric.name, metric.documentation, labels=labels)
                families[metric.name] = family
            prefix = (name,) if self._labels else ()
            family.add_metric([*prefix, *sample.labelvalues], sample.value)
        return iter(families.values())
