"""``kvoffload simulate``: replay a trace through a small serving engine with real tensors.

The engine, per request (the call order of :mod:`kvoffload.replay.sweep`, with the data moving):

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

With a disk tier (``--disk PATH --disk-bytes SIZE``), each engine has a ``DiskStore`` of its
own in front of the remote (``tiers=[disk, remote]``): evicted blocks are written to both, a
fetch asks the disk first, and a block the remote served is written to the disk too. The
disk's blocks outlive the run: a second run on the same directory (the same trace and block
size) starts with what the first left, as an engine restarted would.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvoffload.replay.belady import belady_hits
from kvoffload.replay.config import DiskTierConfig, SimulationConfig
from kvoffload.replay.device_cache import DevicePrefixCache
from kvoffload.replay.report import (
    DiskTally,
    RemoteTally,
    SharedSimulationReport,
    SimulationReport,
    format_size,
)
from kvoffload.replay.timing import Latency, TimedManager
from kvoffload.replay.traces import BlockId, Request, Trace
from kvoffload_spec.errors import InvalidArgumentError
from kvoffload_spec.surface import Key, Lookup, StorePlan
from kvoffload_spec.validation import check_count

# The report and timing classes lived here before they had modules of their own.
__all__ = [
    "BlockContent",
    "Latency",
    "MemoryPlan",
    "ProgressHook",
    "RemoteTally",
    "SharedSimulationReport",
    "SimulationConfig",
    "SimulationReport",
    "TimedManager",
    "key_seed",
    "memory_plan",
    "simulate",
    "simulate_shared",
]

if TYPE_CHECKING:
    import torch

    from kvoffload.offloader import Finished, Offloader, RemoteMode
    from kvoffload.tiers import DiskStore, RemoteStore


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

    @classmethod
    def pattern_count(cls, block_bytes: int) -> int:
        return max(2, min(61, cls.PATTERN_BYTES // block_bytes))

    @classmethod
    def pattern_bytes(cls, block_bytes: int) -> int:
        return cls.pattern_count(block_bytes) * block_bytes

    def __init__(self, block_bytes: int, device: torch.device) -> None:
        import torch

        count = self.pattern_count(block_bytes)
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


# -- the engine --------------------------------------------------------------------------------


ProgressHook = Callable[[int, int], None]
"""``hook(requests done, requests in all)``, called now and then during a replay."""


def simulate(
    trace: Trace,
    config: SimulationConfig,
    on_request: ProgressHook | None = None,
    on_start: Callable[[MemoryPlan], None] | None = None,
    metrics_port: int | None = None,
    *,
    disk: DiskTierConfig | None = None,
) -> SimulationReport:
    """Replay ``trace`` (see the module docstring); bad sizes raise before any allocation.
    ``on_start(plan)`` is called once the arguments are checked, before anything is
    allocated; ``metrics_port``: serve kvoffload's metrics on it while the replay runs."""
    requests = _check(trace, config)
    from kvoffload.manager import OffloadManager
    from kvoffload.policies.loading import resolve_policy

    policy = resolve_policy(config.policy)
    device = _device()
    plan = _check_memory(config, device)  # before the manager, whose arrays grow with the pool
    if on_start is not None:
        on_start(plan)
    disks = _open_disks(disk, trace, config, 1)
    manager = TimedManager(OffloadManager(config.cpu_blocks, policy))
    engine = _Engine(trace.name, config, manager, device, disk=disks[0] if disks else None)
    started = time.perf_counter()
    with _one_cpu_thread(), _serving(metrics_port, [engine]) as refresh:
        for done, request in enumerate(requests, start=1):
            engine.serve(request)
            if done % 64 == 0 or done == len(requests):
                refresh()
                if on_request is not None:
                    on_request(done, len(requests))
    report = engine.finish(time.perf_counter() - started)
    for store in disks:
        store.close()
    return report


def _open_disks(
    disk: DiskTierConfig | None, trace: Trace, config: SimulationConfig, instances: int
) -> list[DiskStore]:
    """One disk tier per engine (engine ``i`` of several in ``path/engine-i``)."""
    if disk is None:
        return []
    from pathlib import Path

    from kvoffload.tiers import DiskStore

    namespace = {"kvoffload simulate": trace.name, "block_bytes": config.block_bytes}
    root = Path(disk.path)
    if instances > 1 and not root.exists():
        try:
            root.mkdir()
        except OSError as error:
            raise InvalidArgumentError(f"cannot make {root}: {error.strerror}") from None
    paths = [root] if instances == 1 else [root / f"engine-{i}" for i in range(instances)]
    opened: list[DiskStore] = []
    try:
        for path in paths:
            opened.append(
                DiskStore(
                    path,
                    capacity_bytes=disk.capacity_bytes,
                    namespace=namespace,
                    block_bytes=config.block_bytes,
                    admission=disk.admission,  # type: ignore[arg-type]
                )
            )
    except BaseException:
        for store in opened:
            store.close()
        raise
    return opened


def simulate_shared(
    trace: Trace,
    config: SimulationConfig,
    *,
    instances: int,
    remote_url: str | None,
    remote_mode: RemoteMode = "write-back",
    on_request: ProgressHook | None = None,
    on_start: Callable[[MemoryPlan], None] | None = None,
    metrics_port: int | None = None,
    remote_secret: bytes | str | None = None,
    disk: DiskTierConfig | None = None,
    remote_cluster: bool = False,
) -> SharedSimulationReport:
    """``instances`` engines, request ``i`` of ``trace`` served by engine ``i mod instances``,
    each with the sizes of ``config`` and, with ``remote_url``, all writing back to and
    fetching from one Valkey/Redis server (a fresh namespace per run: another run's blocks
    are never read). With ``remote_secret`` (else ``$KVOFFLOAD_REMOTE_SECRET``, if set) the
    values are sealed. With ``remote_cluster``, ``remote_url`` names nodes of a Valkey
    Cluster. A server down or failing counts failures; the run goes on locally.
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
    plan = _check_memory(config, device, instances)  # all the engines' pools and caches at once
    if on_start is not None:
        on_start(plan)
    stores = []
    if remote_url is not None:
        import uuid

        from kvoffload.tiers import ValkeyStore

        namespace = {
            "kvoffload simulate": trace.name,
            "block_bytes": config.block_bytes,
            "run": uuid.uuid4().hex,
        }
        stores = [
            ValkeyStore(
                remote_url, namespace=namespace, secret=remote_secret, cluster=remote_cluster
            )
            for _ in range(instances)
        ]
    disks = _open_disks(disk, trace, config, instances)
    engines = [
        _Engine(
            trace.name,
            config,
            TimedManager(OffloadManager(config.cpu_blocks, policy)),
            device,
            remote=stores[i] if stores else None,
            remote_mode=remote_mode,
            disk=disks[i] if disks else None,
        )
        for i in range(instances)
    ]
    started = time.perf_counter()
    with _one_cpu_thread(), _serving(metrics_port, engines) as refresh:
        for done, request in enumerate(requests, start=1):
            engines[(done - 1) % instances].serve(request)
            if done % 64 == 0 or done == len(requests):
                refresh()
                if on_request is not None:
                    on_request(done, len(requests))
    wall = time.perf_counter() - started
    reports = [engine.finish(wall) for engine in engines]
    opened: list[RemoteStore] = [*stores, *disks]
    for store in opened:
        store.close()
    first_uses = len({block for request in requests for block in request})
    shown = stores[0].url if stores else None  # its password replaced by ***
    sealed = bool(stores) and stores[0].authenticated
    return SharedSimulationReport(trace.name, shown, reports, wall, first_uses, sealed)


@contextmanager
def _serving(port: int | None, engines: Sequence[_Engine]) -> Iterator[Callable[[], None]]:
    """kvoffload's metrics of ``engines`` on ``port`` (labelled ``instance`` 0, 1, ...)
    while the replay runs; yields what reads them anew (in the replay's thread)."""
    if port is None:
        yield lambda: None
        return
    from kvoffload.metrics import MetricsExporter

    with MetricsExporter({str(i): e.offloader for i, e in enumerate(engines)}) as exporter:
        exporter.serve(port)
        yield exporter.refresh


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


@dataclass(frozen=True)
class MemoryPlan:
    """What a replay will allocate, and what the machine has for it now."""

    pool_bytes: int  # the engines' CPU pools
    device_cache_bytes: int  # their device caches (in host memory without a GPU)
    content_bytes: int  # the patterns blocks are "computed" from
    on_host: bool  # whether the device caches are host memory too
    available_bytes: int  # host memory available now (not the total)

    @property
    def host_bytes(self) -> int:
        return (
            self.pool_bytes + self.content_bytes + (self.device_cache_bytes if self.on_host else 0)
        )

    def describe(self) -> str:
        device = f" + device caches {format_size(self.device_cache_bytes)}" + (
            " (host memory: no GPU)" if self.on_host else " (GPU memory)"
        )
        return (
            f"will use {format_size(self.host_bytes)} of host memory: CPU pools "
            f"{format_size(self.pool_bytes)}{device} + block contents "
            f"{format_size(self.content_bytes)}; {format_size(self.available_bytes)} available"
        )


def memory_plan(config: SimulationConfig, instances: int = 1) -> MemoryPlan:
    """The memory ``instances`` engines of ``config`` take (checked by the replays before
    they allocate anything, and printed by the CLI before it starts)."""
    from kvoffload.transfer.pool import available_memory_bytes

    device = _device()
    return MemoryPlan(
        pool_bytes=instances * config.cpu_blocks * config.block_bytes,
        device_cache_bytes=instances * config.gpu_blocks * config.block_bytes,
        content_bytes=instances * BlockContent.pattern_bytes(config.block_bytes),
        on_host=device.type == "cpu",
        available_bytes=available_memory_bytes(),
    )


def _check_memory(config: SimulationConfig, device: torch.device, instances: int = 1) -> MemoryPlan:
    """Refuse sizes this machine cannot hold now, before allocating anything."""
    plan = memory_plan(config, instances)
    if plan.host_bytes > plan.available_bytes:
        engines = f"{instances} engines x " if instances > 1 else ""
        raise InvalidArgumentError(
            f"{engines}(--cpu-blocks {config.cpu_blocks:,}"
            + (f" + --gpu-blocks {config.gpu_blocks:,}" if plan.on_host else "")
            + f") x --block-bytes {config.block_bytes:,} = "
            + f"{format_size(plan.host_bytes)} of host memory exceeds this machine's memory "
            + f"available now ({format_size(plan.available_bytes)}; "
            + plan.describe().removeprefix("will use ").split(": ", 1)[1].split(";")[0]
            + "). Use fewer or smaller blocks"
        )
    if device.type == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info(device)
        if plan.device_cache_bytes > free:
            raise InvalidArgumentError(
                f"--gpu-blocks {config.gpu_blocks:,} x --block-bytes {config.block_bytes:,} "
                f"= {format_size(plan.device_cache_bytes)} exceeds the free device memory "
                f"({format_size(free)})"
            )
    return plan


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
        disk: DiskStore | None = None,
    ) -> None:
        import torch

        from kvoffload.offloader import Offloader

        self.manager = manager
        self.kv = torch.zeros(
            (config.gpu_blocks, config.block_bytes), dtype=torch.uint8, device=device
        )
        # The tiers in order, each with the tally of its hits.
        self.report = SimulationReport(name, config, device.type)
        self.tiers: list[tuple[RemoteStore, RemoteTally]] = []
        if disk is not None:
            self.report.disk = DiskTally()
            self.tiers.append((disk, self.report.disk))
        if remote is not None:
            self.report.remote = RemoteTally()
            self.tiers.append((remote, self.report.remote))
        self.offloader: Offloader = Offloader(
            [self.kv],
            num_cpu_blocks=config.cpu_blocks,
            manager=manager,
            tiers=[store for store, _ in self.tiers],
            remote_mode=remote_mode,
        )
        self.remote_mode = remote_mode
        self.remote = remote
        self.disk = disk
        self.written_back: set[Key] = set()  # every key this engine wrote to the remote
        self.device_cache = DevicePrefixCache(config.gpu_blocks)
        self.content = BlockContent(config.block_bytes, device)
        self.cpu_stream: list[Request] = []
        self._seen: set[BlockId] = set()  # every block id this engine was asked for
        if disk is not None and self.report.disk is not None:
            self.report.disk.blocks_at_start = disk.stats().blocks
        self._device = device

    def serve(self, request: Request) -> None:
        report = self.report
        report.requests += 1
        report.block_refs += len(request)
        seen = len(self._seen)
        self._seen.update(request)
        report.first_uses += len(self._seen) - seen
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
        if self.tiers:
            # After the CPU hits' load: a fetch may evict them from the pool.
            tier_hits = self._fetch(cpu_ids[cpu_hits:])
            fetched = list(dict.fromkeys(cpu_ids[cpu_hits : cpu_hits + tier_hits]))
            if fetched:
                self._load(fetched)
            loaded += tier_hits
        self._recompute(list(dict.fromkeys(cpu_ids[loaded:])))
        plan = self.offloader.store(cpu_ids, self._device_blocks(cpu_ids)) if cpu_ids else None
        self.offloader.touch(cpu_ids)
        if plan is not None:
            self._written_back(plan)
            # With tiers, their writes too: the queues never fill, no write is dropped.
            self.offloader.wait(None if self.tiers else [plan])
            self._account(self.offloader.poll())

    def _fetch(self, ids: Sequence[BlockId]) -> int:
        """Fetch the prefix of ``ids`` the tiers hold into the CPU pool; the tiers' hits:
        how many of ``ids``, from the first, are ready in the CPU pool now, each counted for
        the tier that served it."""
        distinct = list(dict.fromkeys(ids))
        # Ask which ones the tiers have first (no CPU block taken): a fetch of a key they
        # lack would evict a local block for nothing.
        held = [False] * len(distinct)
        for store, _ in self.tiers:
            missing = [i for i, found in enumerate(held) if not found]
            if not missing:
                break
            for i, found in zip(
                missing, store.contains([distinct[i] for i in missing]), strict=True
            ):
                held[i] = found
        wanted = distinct[: held.index(False) if False in held else len(held)]
        if not wanted:
            return 0
        for plan in self.offloader.fetch(wanted):
            self._written_back(plan, fetched=True)
        self.offloader.wait()
        finished = self.offloader.poll()
        served = {done.plan.keys[0]: done.tier for done in finished if done.fetched and done.ok}
        self._account(finished)
        hits = 0
        for key in ids:
            if self.offloader.lookup(key) is not Lookup.HIT:
                break
            hits += 1
            tier = served.get(key)
            if tier is not None:
                store, tally = self.tiers[tier]
                tally.hits += 1
                tally.shared_hits += store is self.remote and key not in self.written_back
        return hits

    def _written_back(self, plan: StorePlan, fetched: bool = False) -> None:
        """Note the keys this engine writes to the remote: the victims (write-back), or the
        keys stored (write-through; a fetch's key came from the remote, it is not written)."""
        if not self.tiers:
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
            if done.fetched:  # counted per tier, from the tiers' own counters, at the end
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
        for (_, tally), tier in zip(self.tiers, self.offloader.tier_stats(), strict=True):
            tally.fetched_blocks = tier.fetch_hits
            tally.fetch_misses = tier.fetch_misses
            tally.bytes_fetched = tier.fetch_bytes
            tally.blocks_written = tier.written
            tally.bytes_written = tier.written_bytes
            tally.not_written = tier.not_written
            tally.failures = tier.failures
        if self.disk is not None and report.disk is not None:
            disk = self.disk.stats()
            report.disk.read_seconds = disk.read_seconds
            report.disk.write_seconds = disk.write_seconds
            report.disk.not_admitted = disk.not_admitted
            report.disk.rewrites_skipped = disk.rewrites_skipped
            report.disk.evictions = disk.evictions
            report.disk.blocks_at_end = disk.blocks
            report.disk.slots = disk.slots
            report.disk.last_error = disk.last_error
        if self.remote is not None and report.remote is not None:
            report.remote.last_error = self.remote.stats().last_error
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
