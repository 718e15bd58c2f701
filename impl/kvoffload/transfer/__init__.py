"""The data path: copies KV blocks between device tensors and a CPU block pool.

Importing this package imports torch; ``import kvoffload`` alone does not.
"""

from kvoffload.transfer.engine import EngineClosedError, TransferEngine, TransferTimeoutError
from kvoffload.transfer.jobs import Direction, FaultHook, JobResult
from kvoffload.transfer.layout import KVLayout, Segment
from kvoffload.transfer.pool import CpuBlockPool, PoolTooLargeError

__all__ = [
    "CpuBlockPool",
    "Direction",
    "EngineClosedError",
    "FaultHook",
    "JobResult",
    "KVLayout",
    "PoolTooLargeError",
    "Segment",
    "TransferEngine",
    "TransferTimeoutError",
]
