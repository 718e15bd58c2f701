"""The sizes of a replay's engine: device cache, CPU pool, policy, block bytes; and its disk
tier, if it has one."""

from __future__ import annotations

from dataclasses import dataclass

from kvoffload_spec.defaults import DEFAULT_POLICY


@dataclass(frozen=True)
class SimulationConfig:
    """The engine's sizes. ``max_requests`` replays only the first requests of the trace."""

    gpu_blocks: int = 1024
    cpu_blocks: int = 4096
    policy: str = DEFAULT_POLICY
    block_bytes: int = 4096
    max_requests: int | None = None


@dataclass(frozen=True)
class DiskTierConfig:
    """A disk tier behind each engine's CPU pool: the directory (engine ``i`` of several
    gets ``path/engine-i``), its capacity, its admission rule (see ``DiskStore``)."""

    path: str
    capacity_bytes: int = 4 << 30
    admission: str = "second-offer"
