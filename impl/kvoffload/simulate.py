"""``kvoffload simulate``: replay a trace through a small serving engine with real tensors.

The engine, per request (the call order of :mod:`kvoffload.sweep`, with the data moving):

1. the device prefix cache (LRU, ``gpu_blocks`` blocks) gives the device hits and a device
   block for every block of the request;
2. the ids after the device's hit prefix go to the CPU tier: the longest prefix of them
   that ``lookup`` finds ready are the CPU hits, loaded back into their device blocks through
   the :class:`~kvoffload.offloader.Offloader` and compared byte for byte with what was
   stored;
3. the rest are misses, "recomputed": their device blocks are written with content derived
   from the key, then offered to the CPU tier with ``store``;
4. the CPU tier's ids are touched, and then the store's copy is waited for.

Every job finishes before the next request, so the device cache may reuse any block.
Every manager call goes through a timing wrapper, so the report has real latencies; the
CPU tier's hit ratio is also set against Belady's optimum on the same key stream.

With a remote tier (``simulate_shared``: ``--remote URL --instances N``), N such engines
serve the trace's requests in turn (request ``i`` goes to engine ``i mod N``), each with its
own device cache and CPU pool, all writing back to one remote store; between steps 2 and 3,
the ids after the CPU hits that the remote holds are fetched into the CPU pool and loaded
with the CPU hits (the remote hits), so fewer are recomputed.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from kvoffload.belady import belady_hits
from kvoffload.device_cache import DevicePrefixCache
from kvoffload.traces import BlockId, Request, Trace
from kvoffload_spec.defaults import DEFAULT_POLICY
from kvoffload_spec.errors import InvalidArgumentError
from kvoffload_spec.surface import Key, LoadPlan, Lookup, Plan, StorePlan
from kvoffload_spec.validation import check_count

if TYPE_CHECKING:
    import torch

    from kvoffload.manager import OffloadManager
    from kvoffload.offloader import Finished, Offloader, RemoteMode
    from kvoffload.tiers import RemoteStore


@dataclass(frozen=True)
class SimulationConfig:
    """The engine's sizes. ``max_requests`` replays only the first requests of the trace."""

    gpu_blocks: int = 1024
    cpu_blocks: int = 4096
    policy: str = DEFAULT_POLICY
    block_bytes: int = 4096
    max_requests: int | None = None


# -- timing every manager call ---------------------------------------------------------------


class TimedManager:
    """The manager surface the offloader drives, timing each call of ``inner``."""

    def __init__(self, inner: OffloadManager) -> None:
        self.inner = inner
        self.latencies_ns: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.inner.num_blocks

    def _timed(self, name: str, started: int) -> None:
        self.latencies_ns.setdefault(name, []).append(time.perf_counter_ns() - started)

    def lookup(self, key: Key) -> Lookup:
        started = time.perf_counter_ns()
        found = self.inner.lookup(key)
        self._timed("lookup", started)
        return found

    def prepare_store(self, keys: Sequence[Key]) -> StorePlan | None:
        started = time.perf_counter_ns()
        plan = self.inner.prepare_store(keys)
        self._timed("prepare_store", started)
        return plan

    def complete_store(self, plan: StorePlan, success: bool = True) -> None:
        started = time.perf_counter_ns()
        self.inner.complete_store(plan, success)
        self._timed("complete_store", started)

    def prepare_load(self, keys: Sequence[Key]) -> LoadPlan:
        started = time.perf_counter_ns()
        plan = self.inner.prepare_load(keys)
        self._timed("prepare_load", started)
        return plan

    def complete_load(self, plan: LoadPlan) -> None:
        started = time.perf_counter_ns()
        self.inner.complete_load(plan)
        self._timed("complete_load", started)

    def abandon(self, plan: Plan) -> None:
        started = time.perf_counter_ns()
        self.inner.abandon(plan)
        self._timed("abandon", started)

    def is_abandoned(self, plan: Plan) -> bool:
        return self.inner.is_abandoned(plan)  # a query, not timed: the offloader's own use

    def touch(self, keys: Sequence[Key]) -> None:
        started = time.perf_counter_ns()
        self.inner.touch(keys)
        self._timed("touch", started)

    def reset_cache(self) -> None:
        started = time.perf_counter_ns()
        self.inner.reset_cache()
        self._timed("reset_cache", started)


@dataclass(frozen=True)
class Latency:
    """Percentiles of call latencies, in microseconds."""

    calls: int
    p50_us: float
    p99_us: float
    max_us: float

    @staticmethod
    def of(samples_ns: Sequence[int]) -> Latency:
        if not samples_ns:
            return Latency(0, 0.0, 0.0, 0.0)
        ordered = sorted(samples_ns)

        def at(fraction: float) -> float:
            return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] / 1000

        return Latency(len(ordered), at(0.50), at(0.99), ordered[-1] / 1000)


# -- block content -----------------------------------------------------------------------------


def key_seed(key: BlockId) -> int:
    """A well-mixed 64-bit number per key, the same in every process."""
    data = key.encode() if isinstance(key, str) else key.to_bytes(16, "little", signed=True)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class BlockContent:
    """What a block "computed" for a key holds: its 64-bit seed in the first 8 bytes, then
    random bytes, one of a few dozen patterns picked by the seed. Two keys' blocks differ
    unless their seeds collide; a block that was not copied at all still holds zeros.
    """

    PATTERN_BYTES = 64 << 20  # at most this much memory for the patterns

    def __init__(self, block_bytes: int, device: torch.device) -> None:
        import torch

        count = max(2, min(61, self.PATTERN_BYTES // block_bytes))
        generator = torch.Generator().manual_seed(0)
        patterns = torch.randint(0, 256, (count, block_bytes), generator=generator)
        self._patterns = patterns.to(dtype=torch.uint8, device=device)
        self._header = min(8, block_bytes)
        self._device = device

    def of(self, keys: Sequence[BlockId]) -> torch.Tensor:
        """``uint8[len(keys), block_bytes]``: the content of each key's block."""
        import torch

        if not keys:
            return self._patterns[:0].clone()
        seeds = [key_seed(key) for key in keys]
        picks = torch.tensor(
            [seed % len(self._patterns) for seed in seeds], dtype=torch.int64, device=self._device
        )
        content = self._patterns.index_select(0, picks)
        headers = b"".join(seed.to_bytes(8, "little") for seed in seeds)
        header = torch.frombuffer(bytearray(headers), dtype=torch.uint8).view(len(keys), 8)
        content[:, : self._header] = header[:, : self._header].to(self._device)
        return content


# -- the report --------------------------------------------------------------------------------


@dataclass
class SimulationReport:
    """What a simulation did and measured; ratios are over all block references."""

    trace: str
    config: SimulationConfig
    backend: str  # where the "device" cache lives: cuda or cpu
    requests: int = 0
    block_refs: int = 0
    device_hits: int = 0
    cpu_hits: int = 0
    belady_cpu_hits: int = 0
    blocks_stored: int = 0
    blocks_loaded: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0
    store_seconds: float = 0.0
    load_seconds: float = 0.0
    evictions: int = 0
    rejected_stores: int = 0
    fast_fail_rejections: int = 0
    failed_stores: int = 0
    load_mismatches: int = 0
    wall_seconds: float = 0.0
    latency: dict[str, Latency] = field(default_factory=dict)
    remote: RemoteTally | None = None  # with a remote tier only

    @property
    def remote_hits(self) -> int:
        return 0 if self.remote is None else self.remote.hits

    @property
    def misses(self) -> int:
        return self.block_refs - self.device_hits - self.cpu_hits - self.remote_hits

    def _ratio(self, count: int) -> float:
        return count / self.block_refs if self.block_refs else 0.0

    @property
    def device_hit_ratio(self) -> float:
        return self._ratio(self.device_hits)

    @property
    def cpu_hit_ratio(self) -> float:
        return self._ratio(self.cpu_hits)

    @property
    def miss_ratio(self) -> float:
        return self._ratio(self.misses)

    @property
    def belady_cpu_hit_ratio(self) -> float:
        return self._ratio(self.belady_cpu_hits)

    @property
    def cpu_fraction_of_belady(self) -> float:
        """The CPU tier's hits as a fraction of Belady's on the same key stream."""
        return self.cpu_hits / self.belady_cpu_hits if self.belady_cpu_hits else 1.0

    @property
    def transfer_gbps(self) -> float:
        seconds = self.store_seconds + self.load_seconds
        return (self.bytes_stored + self.bytes_loaded) / seconds / 1e9 if seconds else 0.0

    @property
    def all_loads_verified(self) -> bool:
        return self.load_mismatches == 0

    def to_json(self) -> dict[str, object]:
        """The format of ``kvoffload simulate --json``."""
        return {
            "trace": self.trace,
            "backend": self.backend,
            "gpu_blocks": self.config.gpu_blocks,
            "cpu_blocks": self.config.cpu_blocks,
            "policy": self.config.policy,
            "block_bytes": self.config.block_bytes,
            "requests": self.requests,
            "block_refs": self.block_refs,
            "device_hits": self.device_hits,
            "cpu_hits": self.cpu_hits,
            "misses": self.misses,
            "device_hit_ratio": self.device_hit_ratio,
            "cpu_hit_ratio": self.cpu_hit_ratio,
            "miss_ratio": self.miss_ratio,
            "belady_cpu_hit_ratio": self.belady_cpu_hit_ratio,
            "cpu_fraction_of_belady": self.cpu_fraction_of_belady,
            "blocks_stored": self.blocks_stored,
            "blocks_loaded": self.blocks_loaded,
            "bytes_stored": self.bytes_stored,
            "bytes_loaded": self.bytes_loaded,
            "transfer_gbps": self.transfer_gbps,
            "evictions": self.evictions,
            "rejected_stores": self.rejected_stores,
            "fast_fail_rejections": self.fast_fail_rejections,
            "failed_stores": self.failed_stores,
            "load_mismatches": self.load_mismatches,
            "all_loads_verified": self.all_loads_verified,
            "wall_seconds": self.wall_seconds,
            "manager_latency_us": {
                name: {"calls": t.calls, "p50": t.p50_us, "p99": t.p99_us, "max": t.max_us}
                for name, t in self.latency.items()
            },
        } | ({} if self.remote is None else {"remote": self.remote.to_json(self.block_refs)})

    def summary_rows(self) -> list[tuple[str, str]]:
        """The summary table, as (label, value) rows."""
        c = self.config
        every = self.latency.get("all", Latency(0, 0.0, 0.0, 0.0))
        return [
            (
                "engine",
                f"{c.gpu_blocks:,} device blocks ({self.backend}), {c.cpu_blocks:,} CPU "
                f"blocks ({c.policy}), {_size(c.block_bytes)} per block",
            ),
            ("requests / block refs", f"{self.requests:,} / {self.block_refs:,}"),
            ("device hit ratio", f"{self.device_hit_ratio:.4f}"),
            ("CPU hit ratio", f"{self.cpu_hit_ratio:.4f}"),
            (
                "CPU tier vs Belady",
                f"{self.cpu_fraction_of_belady:.1%} of the optimum {self.belady_cpu_hit_ratio:.4f}",
            ),
            *([] if self.remote is None else self.remote.summary_rows(self.block_refs)),
            ("miss ratio (recomputed)", f"{self.miss_ratio:.4f}"),
            (
                "stored",
                f"{self.blocks_stored:,} blocks, {_size(self.bytes_stored)}",
            ),
            (
                "loaded",
                f"{self.blocks_loaded:,} blocks, {_size(self.bytes_loaded)}",
            ),
            ("transfer", f"{self.transfer_gbps:.2f} GB/s"),
            (
                "manager call latency",
                f"p50 {every.p50_us:.1f} us, p99 {every.p99_us:.1f} us, max "
                f"{every.max_us:.0f} us ({every.calls:,} calls)",
            ),
            ("evictions", f"{self.evictions:,}"),
            (
                "rejected stores",
                f"{self.rejected_stores:,} ({self.fast_fail_rejections:,} fast-fail)",
            ),
            ("failed stores", f"{self.failed_stores:,}"),
            (
                "loads verified",
                "all byte-exact"
                if self.all_loads_verified
                else f"{self.load_mismatches:,} blocks DIFFER from what was stored",
            ),
            ("wall time", f"{self.wall_seconds:.1f} s"),
        ]


@dataclass
class RemoteTally:
    """What one engine did with the remote tier.

    ``hits``: block refs served from the remote (fetched, then loaded); ``shared_hits``:
    those of blocks this engine had never written back itself, so only another engine could
    have put them there: the hits gained by sharing.
    """

    hits: int = 0
    shared_hits: int = 0
    fetched_blocks: int = 0  # fetches accepted (hits, and blocks past the first miss)
    fetch_misses: int = 0
    bytes_fetched: int = 0
    blocks_written: int = 0
    bytes_written: int = 0
    not_written: int = 0
    failures: int = 0

    def to_json(self, block_refs: int) -> dict[str, object]:
        return {
            "hits": self.hits,
            "shared_hits": self.shared_hits,
            "hit_ratio": _share(self.hits, block_refs),
            "shared_hit_ratio": _share(self.shared_hits, block_refs),
            "fetched_blocks": self.fetched_blocks,
            "fetch_misses": self.fetch_misses,
            "bytes_fetched": self.bytes_fetched,
            "blocks_written": self.blocks_written,
            "bytes_written": self.bytes_written,
            "not_written": self.not_written,
            "failures": self.failures,
        }

    def summary_rows(self, block_refs: int) -> list[tuple[str, str]]:
        return [
            ("remote hit ratio", f"{_share(self.hits, block_refs):.4f}"),
            (
                "gained by sharing",
                f"{_share(self.shared_hits, block_refs):.4f} (blocks another engine wrote)",
            ),
            (
                "remote traffic",
                f"{self.blocks_written:,} blocks written ({_size(self.bytes_written)}), "
                f"{self.fetched_blocks:,} fetched ({_size(self.bytes_fetched)})",
            ),
            (
                "remote failures",
                f"{self.failures:,} ({self.not_written:,} writes lost, "
                f"{self.fetch_misses:,} fetches missed)",
            ),
        ]

    def add(self, other: RemoteTally) -> None:
        for name in vars(self):
            setattr(self, name, getattr(self, name) + getattr(other, name))


def _share(count: int, total: int) -> float:
    return count / total if total else 0.0


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


# -- the engine --------------------------------------------------------------------------------


ProgressHook = Callable[[int, int], None]
"""``hook(requests done, requests in all)``, called now and then during a replay."""


def simulate(
    trace: Trace, config: SimulationConfig, on_request: ProgressHook | None = None
) -> SimulationReport:
    """Replay ``trace`` (see the module docstring); bad sizes raise before any allocation."""
    requests = _check(trace, config)
    from kvoffload.manager import OffloadManager
    from kvoffload.policies.loading import resolve_policy

    policy = resolve_policy(config.policy)
    device = _device()
    _check_memory(config, device)  # before the manager, whose arrays grow with the pool
    manager = TimedManager(OffloadManager(config.cpu_blocks, policy))
    engine = _Engine(trace.name, config, manager, device)
    started = time.perf_counter()
    with _one_cpu_thread():
        for done, request in enumerate(requests, start=1):
            engine.serve(request)
            if on_request is not None and (done % 64 == 0 or done == len(requests)):
                on_request(done, len(requests))
    return engine.finish(time.perf_counter() - started)


@dataclass
class SharedSimulationReport:
    """``simulate_shared``: each engine's report, and their sum."""

    trace: str
    remote_url: str | None
    engines: list[SimulationReport]
    wall_seconds: float = 0.0

    @property
    def total(self) -> SimulationReport:
        """The engines' counts added up (ratios over all their block refs)."""
        first = self.engines[0]
        total = SimulationReport(first.trace, first.config, first.backend)
        total.remote = None if first.remote is None else RemoteTally()
        for report in self.engines:
            for name in (
                "requests", "block_refs", "device_hits", "cpu_hits", "belady_cpu_hits",
                "blocks_stored", "blocks_loaded", "bytes_stored", "bytes_loaded",
                "store_seconds", "load_seconds", "evictions", "rejected_stores",
                "fast_fail_rejections", "failed_stores", "load_mismatches",
            ):  # fmt: skip
                setattr(total, name, getattr(total, name) + getattr(report, name))
            if total.remote is not None and report.remote is not None:
                total.remote.add(report.remote)
        total.wall_seconds = self.wall_seconds
        return total

    @property
    def all_loads_verified(self) -> bool:
        return all(report.all_loads_verified for report in self.engines)

    def to_json(self) -> dict[str, object]:
        """The format of ``kvoffload simulate --instances N --json``."""
        return {
            "trace": self.trace,
            "remote": self.remote_url,
            "instances": len(self.engines),
            "total": self.total.to_json(),
            "engines": [report.to_json() for report in self.engines],
        }


def simulate_shared(
    trace: Trace,
    config: SimulationConfig,
    *,
    instances: int,
    remote_url: str | None,
    remote_mode: RemoteMode = "write-back",
    on_request: ProgressHook | None = None,
) -> SharedSimulationReport:
    """``instances`` engines, request ``i`` of ``trace`` served by engine ``i mod instances``,
    each with the sizes of ``config`` and, with ``remote_url``, all writing back to and
    fetching from one Valkey/Redis server (a fresh namespace per run: another run's blocks
    are never read). A server down or failing counts failures; the run goes on locally.
    """
    check_count("instances", instances)
    from kvoffload.offloader import REMOTE_MODES

    if remote_mode not in REMOTE_MODES:
        raise InvalidArgumentError(f"remote_mode must be one of {REMOTE_MODES}: {remote_mode!r}")
    requests = _check(trace, config)
    from kvoffload.manager import OffloadManager
    from kvoffload.policies.loading import resolve_policy

    policy = resolve_policy(config.policy)
    device = _device()
    # All the engines' pools and caches at once must fit.
    _check_memory(
        replace(
            config,
            gpu_blocks=config.gpu_blocks * instances,
            cpu_blocks=config.cpu_blocks * instances,
        ),
        device,
    )
    stores = []
    if remote_url is not None:
        import uuid

        from kvoffload.tiers import ValkeyStore

        namespace = {
            "kvoffload simulate": trace.name,
            "block_bytes": config.block_bytes,
            "run": uuid.uuid4().hex,
        }
        stores = [ValkeyStore(remote_url, namespace=namespace) for _ in range(instances)]
    engines = [
        _Engine(
            trace.name,
            config,
            TimedManager(OffloadManager(config.cpu_blocks, policy)),
            device,
            remote=stores[i] if stores else None,
            remote_mode=remote_mode,
        )
        for i in range(instances)
    ]
    started = time.perf_counter()
    with _one_cpu_thread():
        for done, request in enumerate(requests, start=1):
            engines[(done - 1) % instances].serve(request)
            if on_request is not None and (done % 64 == 0 or done == len(requests)):
                on_request(done, len(requests))
    wall = time.perf_counter() - started
    reports = [engine.finish(wall) for engine in engines]
    for store in stores:
        store.close()
    return SharedSimulationReport(trace.name, remote_url, reports, wall)


@contextmanager
def _one_cpu_thread() -> Iterator[None]:
    """Run torch's CPU ops on one thread, then restore the setting.

    The engine's tensor ops touch a few blocks at a time: splitting them across threads
    costs more than it saves (measured 4x slower on 2 busy cores), and one thread already
    copies at memory speed.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _check(trace: Trace, config: SimulationConfig) -> tuple[Request, ...]:
    check_count("gpu_blocks", config.gpu_blocks)
    check_count("cpu_blocks", config.cpu_blocks)
    check_count("block_bytes", config.block_bytes)
    if config.max_requests is not None:
        check_count("max_requests", config.max_requests)
    requests = trace.requests[: config.max_requests]
    longest = max(len(dict.fromkeys(request)) for request in requests)
    if config.gpu_blocks < longest:
        raise InvalidArgumentError(
            f"--gpu-blocks {config.gpu_blocks} cannot hold the longest request of trace "
            f"{trace.name!r} ({longest} blocks): every block of a request must be on the "
            "device at once"
        )
    return requests


def _device() -> torch.device:
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _check_memory(config: SimulationConfig, device: torch.device) -> None:
    """Refuse sizes this machine cannot hold, before allocating anything."""
    from kvoffload.transfer.pool import machine_memory_bytes

    pool = config.cpu_blocks * config.block_bytes
    cache = config.gpu_blocks * config.block_bytes
    host = machine_memory_bytes()
    needed = pool + (cache if device.type == "cpu" else 0)
    if needed > host:
        raise InvalidArgumentError(
            f"--cpu-blocks {config.cpu_blocks:,} x --block-bytes {config.block_bytes:,} "
            f"= {_size(pool)}"
            + (f" plus the device cache's {_size(cache)}" if device.type == "cpu" else "")
            + f" exceeds this machine's memory ({_size(host)})"
        )
    if device.type == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info(device)
        if cache > free:
            raise InvalidArgumentError(
                f"--gpu-blocks {config.gpu_blocks:,} x --block-bytes {config.block_bytes:,} "
                f"= {_size(cache)} exceeds the free device memory ({_size(free)})"
            )


class _Engine:
    """One simulation's state: the device cache and its tensor, the offloader, the tallies."""

    def __init__(
        self,
        name: str,
        config: SimulationConfig,
        manager: TimedManager,
        device: torch.device,
        remote: RemoteStore | None = None,
        remote_mode: RemoteMode = "write-back",
    ) -> None:
        import torch

        from kvoffload.offloader import Offloader

        self.manager = manager
        self.kv = torch.zeros(
            (config.gpu_blocks, config.block_bytes), dtype=torch.uint8, device=device
        )
        self.offloader: Offloader = Offloader(
            [self.kv],
            num_cpu_blocks=config.cpu_blocks,
            manager=manager,
            remote=remote,
            remote_mode=remote_mode,
        )
        self.remote_mode = remote_mode
        self.remote = remote
        self.written_back: set[Key] = set()  # every key this engine wrote to the remote
        self.device_cache = DevicePrefixCache(config.gpu_blocks)
        self.content = BlockContent(config.block_bytes, device)
        self.cpu_stream: list[Request] = []
        self.report = SimulationReport(name, config, device.type)
        if remote is not None:
            self.report.remote = RemoteTally()
        self._device = device

    def serve(self, request: Request) -> None:
        report = self.report
        report.requests += 1
        report.block_refs += len(request)
        device_hits = self.device_cache.admit(request)
        report.device_hits += device_hits
        cpu_ids = request[device_hits:]
        self.cpu_stream.append(cpu_ids)
        cpu_hits = 0
        for key in cpu_ids:
            if self.offloader.lookup(key) is not Lookup.HIT:
                break
            cpu_hits += 1
        report.cpu_hits += cpu_hits
        if cpu_hits:
            self._load(list(dict.fromkeys(cpu_ids[:cpu_hits])))
        loaded = cpu_hits
        if self.remote is not None:
            # After the CPU hits' load: a fetch may evict them from the pool.
            remote_hits = self._fetch(cpu_ids[cpu_hits:])
            fetched = list(dict.fromkeys(cpu_ids[cpu_hits : cpu_hits + remote_hits]))
            if fetched:
                self._load(fetched)
            loaded += remote_hits
        self._recompute(list(dict.fromkeys(cpu_ids[loaded:])))
        plan = self.offloader.store(cpu_ids, self._device_blocks(cpu_ids)) if cpu_ids else None
        self.offloader.touch(cpu_ids)
        if plan is not None:
            self._written_back(plan)
            # With a remote, its writes too: the queue never fills, no write is dropped.
            self.offloader.wait(None if self.remote is not None else [plan])
            self._account(self.offloader.poll())

    def _fetch(self, ids: Sequence[BlockId]) -> int:
        """Fetch the prefix of ``ids`` the remote holds into the CPU pool; the remote hits:
        how many of ``ids``, from the first, are ready in the CPU pool now."""
        assert self.remote is not None and self.report.remote is not None
        tally = self.report.remote
        distinct = list(dict.fromkeys(ids))
        # Ask which ones the server has first (one round trip, no CPU block taken): a fetch
        # of a key it lacks would evict a local block for nothing.
        held = self.remote.contains(distinct) if distinct else []
        wanted = distinct[: held.index(False) if False in held else len(held)]
        if not wanted:
            return 0
        for plan in self.offloader.fetch(wanted):
            self._written_back(plan, fetched=True)
        self.offloader.wait()
        self._account(self.offloader.poll())
        hits = 0
        for key in ids:
            if self.offloader.lookup(key) is not Lookup.HIT:
                break
            hits += 1
            tally.shared_hits += key not in self.written_back
        tally.hits += hits
        return hits

    def _written_back(self, plan: StorePlan, fetched: bool = False) -> None:
        """Note the keys this engine writes to the remote: the victims (write-back), or the
        keys stored (write-through; a fetch's key came from the remote, it is not written)."""
        if self.remote is None:
            return
        if self.remote_mode == "write-back":
            self.written_back.update(plan.evicted_keys)
        elif not fetched:
            self.written_back.update(plan.keys)

    def _device_blocks(self, keys: Sequence[BlockId]) -> list[int]:
        return [self.device_cache.slots[key] for key in keys]

    def _rows(self, keys: Sequence[BlockId]) -> torch.Tensor:
        import torch

        return torch.tensor(self._device_blocks(keys), dtype=torch.int64, device=self._device)

    def _recompute(self, keys: Sequence[BlockId]) -> None:
        if keys:
            self.kv[self._rows(keys)] = self.content.of(keys)

    def _load(self, keys: Sequence[BlockId]) -> None:
        import torch

        rows = self._rows(keys)
        self.kv[rows] = 0  # so a load that copies nothing cannot pass for a correct one
        plan = self.offloader.load(keys, self._device_blocks(keys))
        self.offloader.wait([plan])
        self._account(self.offloader.poll())
        loaded = self.kv[rows]
        expected = self.content.of(keys)
        if not torch.equal(loaded, expected):
            differs = (loaded != expected).any(dim=1)
            self.report.load_mismatches += int(differs.sum().item())

    def _account(self, finished: Sequence[Finished]) -> None:
        report = self.report
        for done in finished:
            result = done.result
            if done.fetched:
                assert report.remote is not None
                report.remote.fetched_blocks += done.ok
                report.remote.fetch_misses += not done.ok
                report.remote.bytes_fetched += result.nbytes
                continue
            if isinstance(done.plan, StorePlan):
                report.store_seconds += result.seconds
                if done.ok:
                    report.blocks_stored += len(done.plan.keys)
                    report.bytes_stored += result.nbytes
            else:
                report.load_seconds += result.seconds
                if done.ok:
                    report.blocks_loaded += len(done.plan.keys)
                    report.bytes_loaded += result.nbytes
                else:
                    report.load_mismatches += len(done.plan.keys)

    def finish(self, wall_seconds: float) -> SimulationReport:
        self.offloader.close()
        report = self.report
        remote = self.offloader.remote_stats()
        if remote is not None and report.remote is not None:
            report.remote.blocks_written = remote.written
            report.remote.bytes_written = remote.written_bytes
            report.remote.not_written = remote.not_written
            report.remote.failures = remote.failures
        stats = self.manager.inner.stats()
        report.evictions = stats.evictions
        report.rejected_stores = stats.rejected_stores
        report.fast_fail_rejections = stats.fast_fail_rejections
        report.failed_stores = stats.failed_stores
        report.belady_cpu_hits = belady_hits(self.cpu_stream, self.report.config.cpu_blocks)
        report.wall_seconds = wall_seconds
        samples = self.manager.latencies_ns
        report.latency = {"all": Latency.of([t for ts in samples.values() for t in ts])}
        report.latency.update((name, Latency.of(ts)) for name, ts in sorted(samples.items()))
        return report
