"""What a replay measured: :class:`SimulationReport` per engine, :class:`RemoteTally` for its
remote tier, :class:`DiskTally` for its disk tier, :class:`SharedSimulationReport` for engines
sharing one, and their JSON and table rows."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvoffload.replay.config import SimulationConfig
from kvoffload.replay.timing import Latency


@dataclass
class SimulationReport:
    """What a simulation did and measured; ratios are over all block references."""

    trace: str
    config: SimulationConfig
    backend: str  # where the "device" cache lives: cuda or cpu
    requests: int = 0
    block_refs: int = 0
    first_uses: int = 0  # references to a block never asked for before: no cache can hit
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
    disk: DiskTally | None = None  # with a disk tier only

    @property
    def remote_hits(self) -> int:
        return 0 if self.remote is None else self.remote.hits

    @property
    def disk_hits(self) -> int:
        return 0 if self.disk is None else self.disk.hits

    @property
    def misses(self) -> int:
        return (
            self.block_refs - self.device_hits - self.cpu_hits - self.disk_hits - self.remote_hits
        )

    def _ratio(self, count: int) -> float:
        return count / self.block_refs if self.block_refs else 0.0

    @property
    def reusable_ratio(self) -> float:
        """The hit ratio of an infinite cache: every reference but a block's first."""
        return self._ratio(self.block_refs - self.first_uses)

    @property
    def first_use_ratio(self) -> float:
        return self._ratio(self.first_uses)

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
            "first_uses": self.first_uses,
            "reusable_ratio": self.reusable_ratio,
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
        } | (
            ({} if self.disk is None else {"disk": self.disk.to_json(self.block_refs)})
            | ({} if self.remote is None else {"remote": self.remote.to_json(self.block_refs)})
        )

    def engine_description(self) -> str:
        c = self.config
        where = " (in host memory: no GPU here)" if self.backend == "cpu" else " (GPU)"
        return (
            f"{c.gpu_blocks:,} device blocks{where}, {c.cpu_blocks:,} CPU blocks "
            f"({c.policy}), {format_size(c.block_bytes)} per block"
        )

    def summary_rows(self) -> list[tuple[str, str, str]]:
        """The summary table, as (label, value, what it means) rows: where the block
        references were served, set against what any cache could serve, then the work."""
        every = self.latency.get("all", Latency(0, 0.0, 0.0, 0.0))
        served = self.device_hits + self.cpu_hits + self.disk_hits + self.remote_hits
        reusable = self.block_refs - self.first_uses
        evicted_too_soon = self.miss_ratio - self.first_use_ratio
        return [
            ("block references", f"{self.block_refs:,}", f"in {self.requests:,} requests"),
            (
                "reusable at most",
                f"{self.reusable_ratio:.4f}",
                f"an infinite cache's hit ratio; the other {self.first_use_ratio:.4f} are "
                "first uses, which no cache can hit",
            ),
            ("device cache hits", f"{self.device_hit_ratio:.4f}", ""),
            (
                "CPU tier hits",
                f"{self.cpu_hit_ratio:.4f}",
                f"{self.cpu_fraction_of_belady:.1%} of Belady's optimum for "
                f"{self.config.cpu_blocks:,} CPU blocks ({self.belady_cpu_hit_ratio:.4f})",
            ),
            *([] if self.disk is None else self.disk.summary_rows(self.block_refs)),
            *([] if self.remote is None else self.remote.summary_rows(self.block_refs)),
            (
                "recomputed",
                f"{self.miss_ratio:.4f}",
                f"{self.first_use_ratio:.4f} first uses + {evicted_too_soon:.4f} evicted "
                "before their reuse",
            ),
            (
                "served",
                f"{served / reusable if reusable else 1.0:.1%}",
                "of the reusable references, from a tier instead of recomputed",
            ),
            ("stored", f"{self.blocks_stored:,}", f"blocks, {format_size(self.bytes_stored)}"),
            ("loaded", f"{self.blocks_loaded:,}", f"blocks, {format_size(self.bytes_loaded)}"),
            (
                "copy speed",
                f"{self.transfer_gbps:.2f} GB/s",
                "bytes copied over the copy jobs' time, device cache <-> CPU pool (small "
                "blocks copy slower than large ones)",
            ),
            (
                "manager calls",
                f"p50 {every.p50_us:.1f} us",
                f"p99 {every.p99_us:.1f} us, max {every.max_us / 1000:.1f} ms, "
                f"{every.calls:,} calls (a max of several ms is a pause of the process or "
                "the machine, such as garbage collection)",
            ),
            ("evictions", f"{self.evictions:,}", ""),
            (
                "rejected stores",
                f"{self.rejected_stores:,}",
                f"{self.fast_fail_rejections:,} of them fast-failed (no room at all)",
            ),
            ("failed stores", f"{self.failed_stores:,}", ""),
            (
                "loads verified",
                "byte-exact" if self.all_loads_verified else "DIFFER",
                "every loaded block compared with what was stored"
                if self.all_loads_verified
                else f"{self.load_mismatches:,} blocks differ from what was stored",
            ),
            ("wall time", f"{self.wall_seconds:.1f} s", ""),
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
    last_error: str | None = None  # the store's last failure, as it described it

    def to_json(self, block_refs: int) -> dict[str, object]:
        return {
            "hits": self.hits,
            "shared_hits": self.shared_hits,
            "hit_ratio": share_of(self.hits, block_refs),
            "shared_hit_ratio": share_of(self.shared_hits, block_refs),
            "fetched_blocks": self.fetched_blocks,
            "fetch_misses": self.fetch_misses,
            "bytes_fetched": self.bytes_fetched,
            "blocks_written": self.blocks_written,
            "bytes_written": self.bytes_written,
            "not_written": self.not_written,
            "failures": self.failures,
            "last_error": self.last_error,
        }

    def summary_rows(self, block_refs: int) -> list[tuple[str, str, str]]:
        return [
            ("remote tier hits", f"{share_of(self.hits, block_refs):.4f}", ""),
            (
                "gained by sharing",
                f"{share_of(self.shared_hits, block_refs):.4f}",
                "remote hits on blocks another engine wrote",
            ),
            (
                "remote traffic",
                f"{self.blocks_written:,}",
                f"blocks written ({format_size(self.bytes_written)}), "
                f"{self.fetched_blocks:,} fetched ({format_size(self.bytes_fetched)})",
            ),
            (
                "remote failures",
                f"{self.failures:,}",
                f"{self.not_written:,} writes lost, {self.fetch_misses:,} fetches missed",
            ),
        ]

    def add(self, other: RemoteTally) -> None:
        for name, value in vars(other).items():
            if isinstance(value, int | float):  # counts, and a disk tally's seconds
                setattr(self, name, getattr(self, name) + value)
        self.last_error = other.last_error or self.last_error


@dataclass
class DiskTally(RemoteTally):
    """What one engine did with its disk tier: a :class:`RemoteTally` (no sharing: a disk is
    one engine's), and the disk's own time and choices."""

    read_seconds: float = 0.0  # in the disk's reads (system calls and checks)
    write_seconds: float = 0.0
    not_admitted: int = 0  # first offers the admission rule kept out
    rewrites_skipped: int = 0  # blocks written back that the disk held already, unchanged
    evictions: int = 0
    blocks_at_start: int = 0  # found on the disk when the engine started
    blocks_at_end: int = 0
    slots: int = 0  # blocks the disk's capacity holds

    def to_json(self, block_refs: int) -> dict[str, object]:
        found = super().to_json(block_refs)
        for name in ("shared_hits", "shared_hit_ratio"):
            del found[name]
        return found | {
            "read_seconds": self.read_seconds,
            "write_seconds": self.write_seconds,
            "not_admitted": self.not_admitted,
            "rewrites_skipped": self.rewrites_skipped,
            "evictions": self.evictions,
            "blocks_at_start": self.blocks_at_start,
            "blocks_at_end": self.blocks_at_end,
            "slots": self.slots,
        }

    def summary_rows(self, block_refs: int) -> list[tuple[str, str, str]]:
        return [
            (
                "disk tier hits",
                f"{share_of(self.hits, block_refs):.4f}",
                f"{self.blocks_at_start:,} blocks on the disk at the start, "
                f"{self.blocks_at_end:,} at the end, of {self.slots:,}",
            ),
            (
                "disk traffic",
                f"{self.blocks_written:,}",
                f"blocks written ({format_size(self.bytes_written)}), "
                f"{self.fetched_blocks:,} read ({format_size(self.bytes_fetched)})",
            ),
            (
                "disk time",
                f"{self.write_seconds + self.read_seconds:.2f} s",
                f"{self.write_seconds:.2f} s writing, {self.read_seconds:.2f} s reading",
            ),
            (
                "disk evictions",
                f"{self.evictions:,}",
                f"{self.rewrites_skipped:,} blocks written back unchanged (not rewritten)",
            ),
            (
                "disk failures",
                f"{self.failures:,}",
                f"I/O errors; {self.not_written:,} writes refused ({self.not_admitted:,} not "
                f"admitted), {self.fetch_misses:,} reads missed",
            ),
        ]


def share_of(count: int, total: int) -> float:
    return count / total if total else 0.0


def format_size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


@dataclass
class SharedSimulationReport:
    """``simulate_shared``: each engine's report, and their sum."""

    trace: str
    remote_url: str | None
    engines: list[SimulationReport]
    wall_seconds: float = 0.0
    first_uses: int = 0  # over the whole trace: a block first used by one engine is reusable
    # by the others only through the remote
    remote_sealed: bool = False  # the remote's values sealed with a tenant secret

    @property
    def total(self) -> SimulationReport:
        """The engines' counts added up (ratios over all their block refs)."""
        first = self.engines[0]
        total = SimulationReport(first.trace, first.config, first.backend)
        total.remote = None if first.remote is None else RemoteTally()
        total.disk = None if first.disk is None else DiskTally()
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
            if total.disk is not None and report.disk is not None:
                total.disk.add(report.disk)
        total.wall_seconds = self.wall_seconds
        total.first_uses = self.first_uses
        return total

    @property
    def all_loads_verified(self) -> bool:
        return all(report.all_loads_verified for report in self.engines)

    def to_json(self) -> dict[str, object]:
        """The format of ``kvoffload simulate --instances N --json``."""
        return {
            "trace": self.trace,
            "remote": self.remote_url,
            "remote_sealed": self.remote_sealed,
            "instances": len(self.engines),
            "total": self.total.to_json(),
            "engines": [report.to_json() for report in self.engines],
        }
