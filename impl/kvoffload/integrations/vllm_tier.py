"""kvoffload's remote tier (a Valkey or Redis server) as a secondary tier of vLLM 0.33's
``TieringOffloadingSpec``, selected by configuration alone::

    kv_connector_extra_config = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": ...,
        "secondary_tiers": [{
            "type": "KvoffloadValkeyTier",
            "module_path": "kvoffload.integrations.vllm_tier",
            "url": "redis://cache.internal:6379/0",
            "namespace": {"deployment": "chat-v3"},  # optional, added to the derived one
            "secret_file": "/run/secrets/kvoffload",  # optional: sealed values
            "timeout_s": 0.5,  # optional
            "cluster": False,  # optional: True when url names nodes of a Valkey Cluster
        }],
    }

vLLM's primary tier is its CPU pool; this tier writes each chunk the pool holds to the
server (a cascade) and reads chunks found there back into pool slots (a promotion). What
crosses the boundary is a :class:`~kvoffload.tiers.ValkeyStore`'s: every value carries a
header with the namespace, the key, the length and a checksum, so a stale, foreign,
truncated or corrupt value is a miss and never reaches vLLM's pool; with a tenant secret
(``secret``, ``secret_file`` or ``$KVOFFLOAD_REMOTE_SECRET``) the values are sealed, so a
forged one is a miss too; a server that is down, slow or restarted makes misses and failed
jobs, never an exception in vLLM's scheduler.

Importing this module imports vLLM; ``import kvoffload`` never does.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvoffload.integrations.vllm_metrics import TIER_METRICS, StepReport, definitions
from kvoffload.metrics import METRICS, Sample, remote_samples
from kvoffload.tiers import (
    Namespace,
    RemoteJob,
    RemoteStats,
    RemoteStore,
    RemoteTier,
    ValkeyStore,
)
from kvoffload.tiers.secret import resolve_secret
from kvoffload_spec.errors import InvalidArgumentError

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

__all__ = ["KvoffloadValkeyTier", "TierStats", "namespace_of"]


def namespace_of(
    offloading_spec: OffloadingSpec, chunk_bytes: int, extra: str | Mapping[str, Any] | None
) -> Namespace:
    """What a chunk's bytes depend on, from vLLM's offloading configuration, plus the
    deployment's own ``extra`` description: engines share chunks exactly when these match.

    The model and its KV dtype, the tokens a chunk covers (per hash, per block of each
    group, blocks per chunk) and the layers of each group, the KV layout (canonical or not,
    replicated or not, its name), the bytes of a chunk in the CPU pool; and, unless vLLM
    says a chunk's bytes are the same under any parallelism, the parallel layout.
    """
    config: Any = getattr(offloading_spec, "config", None)
    model = getattr(config, "model", None)
    if config is None or model is None:
        if extra is None:
            raise InvalidArgumentError(
                "the vLLM offloading spec has no model configuration to derive a namespace "
                "from: give the tier a 'namespace' describing the model and KV layout"
            )
        described: dict[str, Any] = {"chunk_bytes": chunk_bytes}
    else:
        parallel = config.parallel
        described = {
            "engine": "vllm",
            "model": model.name,
            "dtype": model.dtype,
            "tokens_per_hash": config.cache.tokens_per_hash,
            "blocks_per_chunk": config.cache.blocks_per_chunk,
            "groups": [[g.tokens_per_block, list(g.layer_names)] for g in config.groups],
            "canonical_layout": config.canonical_layout,
            "replicated_layout": config.replicated_layout,
            "kv_cache_layout": config.kv_cache_layout,
            "chunk_bytes": chunk_bytes,
        }
        if not parallel.is_parallelism_agnostic:
            described["parallel"] = {
                "world_size": parallel.world_size,
                "tp": parallel.tp_size,
                "pp": parallel.pp_size,
                "pcp": parallel.pcp_size,
                "dcp": parallel.dcp_size,
            }
    if extra is not None:
        described["deployment"] = Namespace.of(extra).description
    return Namespace.of(described)


@dataclass(frozen=True)
class TierStats:
    """The tier's jobs, and the counters of its two connections (see RemoteStats)."""

    stores_submitted: int
    stores_failed: int
    loads_submitted: int
    loads_failed: int  # loads with at least one key not loaded
    keys_not_loaded: int
    transfers: RemoteStats  # the connection that moves chunks
    lookups: RemoteStats  # the connection that answers whether a chunk is there


class Lookups(Protocol):
    """How a tier answers vLLM's lookups (a probe of the server, or a disk's RAM index)."""

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None: ...

    def cleanup(self, req_id: str) -> None: ...

    def flush(self) -> None: ...

    def mark_miss(self, keys: list[OffloadKey]) -> None: ...

    def shutdown(self) -> None: ...


class _ExistenceProbe(AsyncLookupManager):
    """vLLM's per-step batched lookups, answered by one ``EXISTS`` pipeline per request."""

    def __init__(self, store: ValkeyStore, tier_type: str) -> None:
        self._store = store
        super().__init__(tier_type=tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        # A server down or slow answers False (counted in the store): a miss, never a wait.
        return self._store.contains(list(keys))


class KvoffloadValkeyTier(SecondaryTierManager):
    """A vLLM secondary tier on a Valkey/Redis server, through kvoffload's ``ValkeyStore``.

    Configuration keys (the tier's entry in ``secondary_tiers``): ``url`` (required:
    ``redis://host:port/db``, ``valkey://``, ``rediss://`` for TLS, ``unix:///path``, user
    and password in it if needed); ``namespace`` (optional str or mapping, added to the one
    derived from vLLM's configuration); ``secret`` or ``secret_file`` (optional: the
    tenant's secret, or a file holding it; without either, ``$KVOFFLOAD_REMOTE_SECRET`` if
    set: values are then sealed, see docs/remote.md); ``timeout_s`` (0.5: one call's limit);
    ``retry_after_s`` (1.0: how long a failed server is left alone); ``max_pending_jobs``
    (64: transfers queued beyond it fail at once rather than wait).

    ``lookup`` is asynchronous: a chunk's first lookup answers RETRY, and the chunks looked
    up in one step are asked for in one batch by vLLM's lookup thread; the answer is a hint
    (another engine may delete the value meanwhile), so a load checks every value again and
    reports the keys it could not load. Transfers run in order on kvoffload's worker thread,
    reading and writing vLLM's CPU pool slots in place (one copy into the slot on a load,
    none on a store).
    """

    medium: ClassVar[Medium] = Medium.STORAGE
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        url: str,
        namespace: str | Mapping[str, Any] | None = None,
        secret: str | None = None,
        secret_file: str | None = None,
        timeout_s: float = 0.5,
        retry_after_s: float = 1.0,
        max_pending_jobs: int = 64,
        backpressure_detector: BackpressureDetector | None = None,
        cluster: bool = False,
    ) -> None:
        super().__init__(
            offloading_spec=offloading_spec,
            primary_kv_view=primary_kv_view,
            tier_type=tier_type,
            backpressure_detector=backpressure_detector,
        )
        if not primary_kv_view.c_contiguous:
            raise InvalidArgumentError("vLLM's primary KV view must be C-contiguous")
        self.namespace = namespace_of(offloading_spec, self.block_size_bytes, namespace)
        options: dict[str, Any] = {
            "namespace": self.namespace,
            # Read once, here: both connections seal alike, and a file changed later is
            # never half-read by one of them.
            "secret": resolve_secret(secret, secret_file),
            "timeout_s": timeout_s,
            "retry_after_s": retry_after_s,
            "cluster": cluster,
        }
        # Two connections: a lookup batch never waits behind a chunk transfer. (Made before
        # any view of vLLM's pool: a bad setting raises with nothing of the pool held.)
        store = ValkeyStore(url, **options)
        lookup_store = ValkeyStore(url, **options)
        try:
            # A cluster node for a tier made without "cluster" (or the other way round)
            # stops vLLM's start here, in one line, rather than failing every transfer.
            lookup_store.check_mode()
        except InvalidArgumentError:
            store.close()
            lookup_store.close()
            raise
        self._attach(
            store,
            lookup_store,
            _ExistenceProbe(lookup_store, tier_type),
            primary_kv_view,
            max_pending_jobs,
        )

    def _attach(
        self,
        store: RemoteStore,
        lookup_store: RemoteStore,
        probe: Lookups,
        primary_kv_view: memoryview,
        max_pending_jobs: int,
    ) -> None:
        """What the tier's transfers need, whatever its store (a disk tier's too)."""
        self._store = store
        self._lookup_store = lookup_store
        # One row of bytes per CPU chunk: a chunk is the slice at its row's offset.
        self._pool = primary_kv_view.cast("B")
        self._chunks = len(primary_kv_view)
        self._transfers = RemoteTier(
            store, max_pending=max_pending_jobs, name=f"kvoffload-vllm-{self.tier_type}"
        )
        self._probe = probe
        # our job id -> (the job, vLLM's job id, whether it is a load)
        self._in_flight: dict[int, tuple[RemoteJob, int, bool]] = {}
        self._failed_now: list[JobResult] = []  # jobs refused before they were submitted
        self._counts = {
            "stores_submitted": 0,
            "stores_failed": 0,
            "loads_submitted": 0,
            "loads_failed": 0,
            "keys_not_loaded": 0,
        }
        self._shut = threading.Event()
        self._step_report = StepReport()

    # -- lookups -------------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._probe.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._probe.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._probe.flush()

    # -- transfers -----------------------------------------------------------------------

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._counts["stores_submitted"] += 1
        self._submit(job_metadata, load=False)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._counts["loads_submitted"] += 1
        self._submit(job_metadata, load=True)

    def _submit(self, job_metadata: TransferJob, *, load: bool) -> None:
        keys = list(job_metadata.keys)
        chunk_ids = [int(chunk) for chunk in job_metadata.chunk_ids]
        if len(keys) != len(chunk_ids) or any(not 0 <= c < self._chunks for c in chunk_ids):
            # Not a server failure but a broken job: fail it rather than touch other slots.
            self._failed_now.append(JobResult(job_id=job_metadata.job_id, success=False))
            return
        size = self.block_size_bytes
        slots = [self._pool[c * size : (c + 1) * size] for c in chunk_ids]
        try:
            if load:
                job = self._transfers.submit_get(keys, slots)
            else:
                job = self._transfers.submit_put(keys, slots)
        except InvalidArgumentError:  # closed (shut down) or a key no store can hold
            self._failed_now.append(JobResult(job_id=job_metadata.job_id, success=False))
            return
        self._in_flight[job.job_id] = (job, job_metadata.job_id, load)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results, self._failed_now = self._failed_now, []
        for job in self._transfers.poll():
            _, job_id, load = self._in_flight.pop(job.job_id)
            done = job.result
            nbytes = self.block_size_bytes * sum(done)
            if all(done):
                results.append(JobResult(job_id=job_id, success=True, transfer_bytes=nbytes))
                continue
            if not load:
                self._counts["stores_failed"] += 1
                results.append(JobResult(job_id=job_id, success=False))
                continue
            loaded = [key for key, ok in zip(job.keys, done, strict=True) if ok]
            missed = [key for key, ok in zip(job.keys, done, strict=True) if not ok]
            self._counts["loads_failed"] += 1
            self._counts["keys_not_loaded"] += len(missed)
            # The lookup said "there", the value was not (deleted, evicted, refused): the
            # cached verdict must not send the next request after it again.
            self._probe.mark_miss(missed)
            results.append(
                JobResult(
                    job_id=job_id,
                    success=False,
                    successful_keys=loaded,
                    transfer_bytes=nbytes,
                )
            )
        return results

    def has_pending_work(self) -> bool:
        return bool(self._in_flight or self._failed_now)

    def drain_jobs(self) -> None:
        """Wait for every submitted transfer: each one ends (the store's timeout bounds
        every socket operation), and none is cut short mid-copy."""
        for job, _, _ in list(self._in_flight.values()):
            job.wait()

    def shutdown(self) -> None:
        if self._shut.is_set():
            return
        self._shut.set()
        self._probe.shutdown()
        self._transfers.close()  # cancels queued jobs; a running one finishes first
        self._store.close()
        self._lookup_store.close()
        # Our view of vLLM's pool must not outlive it: vLLM unmaps its shared region only
        # once no view of it is left (the jobs dropped their slices when they finished).
        self._pool.release()

    # -- counters ------------------------------------------------------------------------

    def stats(self) -> TierStats:
        return TierStats(
            **self._counts, transfers=self._store.stats(), lookups=self._lookup_store.stats()
        )

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        """The tier's counters on vLLM's ``/metrics`` (docs/metrics.md); its jobs, bytes
        and chunk hits are vLLM's own tiering metrics."""
        return definitions(TIER_METRICS)

    def get_stats(self) -> OffloadingConnectorStats | None:
        """Both connections' counters, labelled with the tier type and the connection."""
        tier = self.tier_type
        stats = OffloadingConnectorStats()
        found = [
            *remote_samples(self._store.stats(), tier, "transfers"),
            *remote_samples(self._lookup_store.stats(), tier, "lookups"),
            Sample(
                METRICS["kvoffload_tier_keys_not_loaded"], (tier,), self._counts["keys_not_loaded"]
            ),
        ]
        self._step_report.add(stats, found)
        return stats
