"""The sizes of a replay's engine: device cache, CPU pool, policy, block bytes."""

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
