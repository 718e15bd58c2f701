"""kvoffload inside vLLM 0.33's ``OffloadingConnector``, selected by configuration alone.

``kv_connector_extra_config = {"spec_name": "KvoffloadSpec", "spec_module_path":
"kvoffload.integrations.vllm", "cpu_bytes_to_use": ..., "eviction_policy": "lru"}``.

- ``KvoffloadManagerSpec``: kvoffload's manager for the bookkeeping, vLLM's own CPU worker
  (and its sizing, shared memory region and metrics) for the copies.
- ``KvoffloadSpec``: kvoffload's manager and kvoffload's transfer engine (CPU and CUDA).

``KvoffloadManager`` adapts ``OffloadManager`` to vLLM's ``OffloadingManager`` interface;
docs/integrations.md says what it bridges and where it differs from vLLM's own manager.
Importing this module imports vLLM; ``import kvoffload`` never does.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    ConfigInfoMapping,
    GPULoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    TransferResult,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec, CPUOffloadingMetrics
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvoffload.integrations.vllm_metrics import MANAGER_METRICS, StepReport, definitions
from kvoffload.manager import OffloadManager
from kvoffload.metrics import manager_samples
from kvoffload.transfer import CpuBlockPool, KVLayout, TransferEngine
from kvoffload_spec.defaults import (
    DEFAULT_MAX_TRACKER_SIZE,
    DEFAULT_POLICY,
    DEFAULT_STORE_THRESHOLD,
)
from kvoffload_spec.errors import InvalidArgumentError
from kvoffload_spec.surface import (
    BlocksRemoved,
    BlocksStored,
    Event,
    LoadPlan,
    Lookup,
    Plan,
    RemovalReason,
    StorePlan,
)

__all__ = ["KvoffloadManager", "KvoffloadManagerSpec", "KvoffloadSpec", "KvoffloadWorker"]

_LOOKUP = {Lookup.HIT: LookupResult.HIT, Lookup.PENDING: LookupResult.HIT_PENDING}


@dataclass(slots=True)
class _RequestAccess:
    """What one request did with the pool, for its recency (vLLM 0.33 never calls
    ``touch``) and its store misses (a policy hears each once per request)."""

    owner: object
    generation: int
    # key -> its token position (None: the engine gave none), in the order first met
    order: dict[OffloadKey, int | None] = field(default_factory=dict)
    unpositioned: bool = False  # some key has no position
    inserted: set[OffloadKey] = field(default_factory=set)  # placed by its own stores
    # ready when the request met it, and not its own store then: a reuse
    reused: set[OffloadKey] = field(default_factory=set)
    store_misses: set[OffloadKey] = field(default_factory=set)  # heard by the policy
    finished: bool = False


class KvoffloadManager(OffloadingManager):
    """vLLM's ``OffloadingManager`` interface over kvoffload's ``OffloadManager``.

    vLLM completes jobs by their keys and makes exactly one job per prepare call, so each
    completion is mapped back to the plan of that call: a store by its keys (a pending key
    belongs to exactly one open store plan), a load by its set of keys (two requests may load
    the same blocks at once; their plans complete oldest first). Recency, which vLLM 0.33's
    scheduler never reports through ``touch``, comes from the accesses of each request:
    its keys are touched in prefix order (the head ends most recent) after each of its
    prepare calls and when it finishes. For a policy whose touch counts a reuse (ARC),
    a reuse is one per request, when it finishes, and a request reading back or offering
    again what it stored itself is no reuse (as in vLLM's manager). A reset abandons every
    open plan, so that no block id an old job may still write is handed out before
    ``on_reset_flushed`` says those jobs are over.
    """

    def __init__(
        self,
        num_chunks: int,
        eviction_policy: str = DEFAULT_POLICY,
        *,
        store_threshold: int = DEFAULT_STORE_THRESHOLD,
        max_tracker_size: int = DEFAULT_MAX_TRACKER_SIZE,
        enable_events: bool = False,
        config_info: ConfigInfoMapping | None = None,
        manager: OffloadManager | None = None,
    ) -> None:
        self.medium = Medium.CPU
        if manager is None and not (isinstance(num_chunks, int) and num_chunks >= 1):
            # vLLM's own manager then offloads nothing, quietly: a budget that holds no
            # chunk is a configuration mistake, said here at start-up.
            raise InvalidArgumentError(
                f"the CPU pool holds {num_chunks!r} chunks: kv_connector_extra_config's "
                "cpu_bytes_to_use must hold at least one chunk (blocks_per_chunk device "
                "blocks of every layer)"
            )
        self.manager = manager or OffloadManager(
            num_chunks,
            eviction_policy,
            store_threshold=max(1, store_threshold),
            max_tracker_size=max_tracker_size,
            enable_events=enable_events,
        )
        self._events_on = enable_events
        self._store_threshold = store_threshold
        self._config_info: ConfigInfoMapping = config_info or {}
        # A policy that reads a touch of a ready key as a second use (ARC) hears a
        # request's reuses once, when it finishes, and never its own stores as reuse; a
        # recency-only one (LRU) must hear every access at once, or the request's tail and
        # head end in the wrong order.
        self._touch_counts_reuse = self.manager.policy.touch_counts_reuse
        self._store_plan_of: dict[OffloadKey, StorePlan] = {}  # pending key -> its open plan
        self._store_left: dict[int, set[OffloadKey]] = {}  # plan id -> keys not completed yet
        self._store_failed: set[int] = set()  # plan ids a completion of some key failed
        self._load_plans: defaultdict[frozenset[OffloadKey], deque[LoadPlan]] = defaultdict(deque)
        self._abandoned: list[Plan] = []  # due at on_reset_flushed
        self._carried: list[Event] = []  # events from before a reset, not taken yet
        self._generation = 0
        self._allocation_sizes: list[int] = []
        self._stores_skipped = 0
        self._step_report = StepReport()

    # -- lookups and loads -----------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return _LOOKUP.get(self.manager.lookup(key), LookupResult.MISS)

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        return CacheHitSource.HOST

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        plan = self.manager.prepare_load(list(keys))
        self._load_plans[frozenset(plan.keys)].append(plan)
        self._record(req_context, plan.keys, reused=plan.keys)
        self._touch_request(req_context)
        return CPULoadStoreSpec(list(plan.block_ids))

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        plans = self._load_plans.get(frozenset(keys))
        if not plans:
            return  # a job made before a reset: its plan was abandoned then
        plan = plans.popleft()
        if not plans:
            del self._load_plans[frozenset(keys)]
        self.manager.complete_load(plan)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.manager.touch(list(keys))

    # -- stores ----------------------------------------------------------------------------

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        offered = list(keys)
        found = {key: self.manager.peek(key) for key in offered}  # distinct, in call order
        access = self._access(req_context)
        plan = self.manager.prepare_store(offered, seen_misses=access.store_misses)
        missing = [key for key, state in found.items() if state is Lookup.MISS]
        candidates = self._candidates(missing)
        if candidates:  # asked for, whether or not room was found (as vLLM counts it)
            self._allocation_sizes.append(len(candidates))
        self._stores_skipped += len(missing) - len(candidates)
        # The request accessed the keys it asked to store and the ready ones it offered
        # again; a key another request is still storing is neither (as in vLLM's manager).
        ready = [key for key, state in found.items() if state is Lookup.HIT]
        accessed = set(ready).union(candidates)
        self._record(req_context, [key for key in found if key in accessed], reused=ready)
        if plan is None:
            self._touch_request(req_context)
            return None
        access.inserted.update(plan.keys)
        if not plan.keys:
            # Nothing to store: vLLM makes no job, so no completion will come. Close it.
            self.manager.complete_store(plan)
        else:
            self._store_left[plan.plan_id] = set(plan.keys)
            for key in plan.keys:
                self._store_plan_of[key] = plan
        self._touch_request(req_context)
        return PrepareStoreOutput(
            keys_to_store=list(plan.keys),
            store_spec=CPULoadStoreSpec(list(plan.block_ids)),
            evicted_keys=list(plan.evicted_keys),
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        for key in keys:
            plan = self._store_plan_of.pop(key, None)
            if plan is None:
                continue  # not pending in an open plan (a pre-reset job, or reported twice)
            left = self._store_left[plan.plan_id]
            left.discard(key)
            if not success:  # a plan completes as a whole: one key's failure fails it
                self._store_failed.add(plan.plan_id)
            if not left:
                del self._store_left[plan.plan_id]
                failed = plan.plan_id in self._store_failed
                self._store_failed.discard(plan.plan_id)
                self.manager.complete_store(plan, not failed)

    def _candidates(self, missing: list[OffloadKey]) -> list[OffloadKey]:
        """The keys of ``missing`` the manager admitted as store candidates just now."""
        threshold = self.manager.store_threshold
        if threshold < 2:
            return missing
        return [key for key in missing if self.manager.offer_count(key) >= threshold]

    # -- requests --------------------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._access(req_context)
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        access = req_context.get_state(_RequestAccess)
        if access is None or access.owner is not self or access.generation != self._generation:
            return
        if access.finished:
            return
        self._touch_request(req_context, finishing=True)
        access.finished = True

    # -- reset -----------------------------------------------------------------------------

    def reset_cache(self) -> None:
        # vLLM never completes the jobs in flight now; it calls on_reset_flushed once the
        # workers have reported them all. Abandon their plans first: a store's block ids stay
        # quarantined (handed to no one) until then, so an old copy cannot land in a CPU
        # block a new key was given.
        self._carried += self.manager.take_events()
        open_plans: list[Plan] = list(
            {plan.plan_id: plan for plan in self._store_plan_of.values()}.values()
        )
        open_plans += [plan for plans in self._load_plans.values() for plan in plans]
        for plan in open_plans:
            self.manager.abandon(plan)
        self._abandoned += open_plans
        self._store_plan_of.clear()
        self._store_left.clear()
        self._store_failed.clear()
        self._load_plans.clear()
        self.manager.reset_cache()
        # vLLM's manager announces nothing at a reset: its scheduler resets its event
        # tracker instead, and may store the same chunks again before it takes events, so
        # a removal announced now would drop a re-stored chunk's metadata.
        self.manager.take_events()
        self._generation += 1

    def on_reset_flushed(self) -> None:
        for plan in self._abandoned:
            if isinstance(plan, StorePlan):
                self.manager.complete_store(plan, success=False)
            else:
                self.manager.complete_load(plan)
        self._abandoned.clear()

    # -- events, stats ---------------------------------------------------------------------

    def take_events(self) -> Iterable[OffloadingEvent]:
        if not self._events_on:
            return []
        events, self._carried = [*self._carried, *self.manager.take_events()], []
        taken = []
        for event in events:
            keys = event.keys
            if isinstance(event, BlocksRemoved) and event.reason is RemovalReason.STORE_FAILED:
                # A retry may own the key again already: its store is not the one that
                # failed, and its metadata must stay (vLLM's manager drops these too).
                keys = tuple(key for key in keys if self.manager.peek(key) is Lookup.MISS)
            if keys:
                taken.append(_vllm_event(event, keys))
        return taken

    def get_stats(self) -> OffloadingConnectorStats | None:
        stats = self.manager.stats()
        num_blocks = stats.num_blocks
        in_use = (stats.pending + stats.pinned) / num_blocks
        writing = stats.pending / num_blocks
        connector_stats = OffloadingConnectorStats()
        connector_stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC, in_use)
        connector_stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC, writing)
        connector_stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC, in_use - writing)
        for size in self._allocation_sizes:
            connector_stats.observe_histogram(CPUOffloadingMetrics.CPU_ALLOCATION_SIZE, size)
        self._allocation_sizes.clear()
        if self._store_threshold >= 2:  # declared by the spec only then (as vLLM's)
            connector_stats.increase_counter(
                CPUOffloadingMetrics.STORES_SKIPPED, self._stores_skipped
            )
            self._stores_skipped = 0
        self._step_report.add(connector_stats, manager_samples(stats))
        return connector_stats

    def config_info(self) -> Sequence[ConfigInfoMapping]:
        return [self._config_info]

    # -- recency ---------------------------------------------------------------------------

    def _access(self, req_context: ReqContext) -> _RequestAccess:
        access = req_context.get_state(_RequestAccess)
        if (
            not isinstance(access, _RequestAccess)
            or access.owner is not self
            or access.generation != self._generation
        ):
            access = _RequestAccess(self, self._generation)
            req_context.set_state(access)
        return access

    def _record(
        self, req_context: ReqContext, keys: Iterable[OffloadKey], reused: Iterable[OffloadKey]
    ) -> None:
        access = self._access(req_context)
        for key in keys:
            if key not in access.order:
                position = req_context.get_offload_key_position(key)
                access.order[key] = position
                access.unpositioned |= position is None
        # Reading back (or offering again) a block the request stored itself is an
        # internal transfer, not a second use.
        access.reused.update(key for key in reused if key not in access.inserted)

    def _touch_request(self, req_context: ReqContext, finishing: bool = False) -> None:
        """Touch the request's keys in prefix order, so its head ends most recent.

        For a policy whose touch counts a reuse (ARC), vLLM orders a request's own stores
        (head most recent) and counts its reuses once, when it finishes; a touch of a
        ready block would count a reuse, so ours orders the request's own stores while
        they are pending, by their token positions (a block without one keeps the order
        it was stored in, as in vLLM while the request runs), and touches its reuses, and
        its stores still pending, when it finishes (docs/integrations.md).
        """
        access = self._access(req_context)
        if access.finished:
            return
        if not self._touch_counts_reuse:
            keys = _prefix_order(access, finishing)
        else:
            pending, inserted, order = self._store_plan_of, access.inserted, access.order
            if finishing:
                reused = access.reused
                keys = [
                    key
                    for key in _prefix_order(access, finishing)
                    if (key in inserted and key in pending)
                    or (key in reused and self.manager.peek(key) is not Lookup.MISS)
                ]
            else:
                own = [k for k in order if k in inserted and k in pending and order[k] is not None]
                keys = sorted(own, key=order.__getitem__)  # type: ignore[arg-type]
        if keys:
            self.manager.touch(keys)


def _prefix_order(access: _RequestAccess, finishing: bool) -> list[OffloadKey]:
    """The request's keys head first, as vLLM's manager ranks them: by token position; a
    key without one, while the request runs, as more recent than the positioned ones and
    than those met before it; once it finishes, if any key has none, in the order met,
    KV cache group by group."""
    order = access.order
    if not access.unpositioned:
        return sorted(order, key=order.__getitem__)  # type: ignore[arg-type]
    if finishing:
        met = {key: index for index, key in enumerate(order)}
        return sorted(order, key=lambda key: (get_offload_group_idx(key), met[key]))
    ranked = {
        key: (1, position) if position is not None else (0, -index)
        for index, (key, position) in enumerate(order.items())
    }
    return sorted(order, key=ranked.__getitem__)


def _require_cpu_spec(spec: LoadStoreSpec) -> None:
    # vLLM's input, so a typed error rather than an assert (gone under python -O)
    if not isinstance(spec, CPULoadStoreSpec):
        raise InvalidArgumentError(
            f"the CPU side of a job must be a CPULoadStoreSpec, got {spec!r}"
        )


def _vllm_event(event: Event, event_keys: Sequence[object]) -> OffloadingEvent:
    keys = [OffloadKey(key) for key in event_keys]
    if isinstance(event, BlocksStored):
        return OffloadingEvent(keys=keys, medium=Medium.CPU, removed=False)
    assert isinstance(event, BlocksRemoved)
    return OffloadingEvent(
        keys=keys,
        medium=Medium.CPU,
        removed=True,
        metadata_only=event.reason is RemovalReason.STORE_FAILED,
    )


def _manager_for(spec: CPUOffloadingSpec) -> KvoffloadManager:
    extra: dict[str, Any] = dict(spec.extra_config)
    if spec.num_chunks < 1:
        raise InvalidArgumentError(
            f"cpu_bytes_to_use={extra.get('cpu_bytes_to_use')!r} holds no CPU chunk of "
            f"{spec.kv_bytes_per_chunk} bytes ({spec.blocks_per_chunk} device blocks of "
            "every layer): give kv_connector_extra_config a larger cpu_bytes_to_use (vLLM's "
            "own manager would quietly offload nothing)"
        )
    return KvoffloadManager(
        spec.num_chunks,
        str(extra.get("eviction_policy", DEFAULT_POLICY)),
        store_threshold=int(extra.get("store_threshold", DEFAULT_STORE_THRESHOLD)),
        max_tracker_size=int(extra.get("max_tracker_size", DEFAULT_MAX_TRACKER_SIZE)),
        enable_events=spec.kv_events_config.enable_kv_cache_events,
        config_info=spec.cpu_info.as_config_info(),
    )


class KvoffloadManagerSpec(CPUOffloadingSpec):
    """kvoffload's manager, vLLM's own CPU worker (its sizing and metrics kept)."""

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        """vLLM's CPU manager metrics, and the manager's own (docs/metrics.md)."""
        declared: dict[str, OffloadingMetricMetadata] = dict(
            super().build_metric_definitions(extra_config)
        )
        declared.update(definitions(MANAGER_METRICS))
        return declared

    def get_manager(self) -> OffloadingManager:
        manager: KvoffloadManager | None = getattr(self, "_kvoffload_manager", None)
        if manager is None:
            manager = _manager_for(self)
            self._kvoffload_manager = self._manager = manager
        return manager


class KvoffloadSpec(KvoffloadManagerSpec):
    """kvoffload's manager and kvoffload's transfer engine, on CPU and CUDA alike."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        worker = getattr(self, "_kvoffload_worker", None)
        if worker is None:
            worker = KvoffloadWorker(kv_caches, self.num_chunks, self.blocks_per_chunk)
            self._kvoffload_worker = worker
        return worker


class KvoffloadWorker(OffloadingWorker):
    """vLLM's worker interface over kvoffload's ``TransferEngine``.

    A CPU chunk holds ``blocks_per_chunk`` device blocks of every KV tensor. Transfers must
    be chunk-aligned (whole chunks), and a job must succeed: vLLM 0.33's worker asserts
    ``success`` and has no channel to report a failed job.
    """

    def __init__(self, kv_caches: CanonicalKVCaches, num_chunks: int, blocks_per_chunk: int):
        if len(kv_caches.group_data_refs) != 1:
            raise InvalidArgumentError(
                "KvoffloadSpec supports one KV cache group; use KvoffloadManagerSpec"
            )
        tensors = [canonical.tensor for canonical in kv_caches.tensors]
        layout = KVLayout(tensors, 0)
        pool = CpuBlockPool(
            blocks_per_chunk * layout.bytes_per_block,
            max(1, num_chunks),
            pin=layout.device.type == "cuda",
        )
        self.engine = TransferEngine(layout, pool, block_size_factor=blocks_per_chunk)
        self._factor = blocks_per_chunk
        self._vllm_job: dict[int, int] = {}  # engine job id -> vLLM job id
        self._engine_job: dict[int, int] = {}  # vLLM job id -> engine job id

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        _require_cpu_spec(dst_spec)
        if not self._aligned(src_spec, dst_spec):
            return False
        self._track(job_id, self.engine.submit_store(src_spec.block_ids, dst_spec.block_ids))
        return True

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        _require_cpu_spec(src_spec)
        if not self._aligned(dst_spec, src_spec):
            return False
        self._track(job_id, self.engine.submit_load(src_spec.block_ids, dst_spec.block_ids))
        return True

    def get_finished(self) -> list[TransferResult]:
        finished = []
        for result in self.engine.poll():
            job_id = self._vllm_job.pop(result.job_id)
            del self._engine_job[job_id]
            finished.append(TransferResult(job_id, result.ok, result.nbytes, result.seconds))
        return finished

    def wait(self, job_ids: set[int]) -> None:
        self.engine.wait([self._engine_job[job] for job in job_ids if job in self._engine_job])

    def shutdown(self) -> None:
        self.engine.close()

    def _aligned(self, device: GPULoadStoreSpec, cpu: CPULoadStoreSpec) -> bool:
        starts_aligned = all(index % self._factor == 0 for index in device.block_indices)
        return starts_aligned and len(device.block_ids) == self._factor * len(cpu.block_ids)

    def _track(self, job_id: int, engine_job: int) -> None:
        self._vllm_job[engine_job] = job_id
        self._engine_job[job_id] = engine_job
