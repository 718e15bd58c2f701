"""kvoffload_spec: the executable reference model of a CPU KV-block offloading manager.

Pure Python, standard library only. ``OffloadModel`` is the design document that runs; the
production ``kvoffload.OffloadManager`` is checked against it. See docs/spec.md.
"""

from kvoffload_spec.errors import (
    BlockNotFoundError,
    BlockNotReadyError,
    BlockPendingError,
    ForeignPlanError,
    InvalidArgumentError,
    OffloadError,
    PlanAlreadyAbandonedError,
    PlanAlreadyCompletedError,
    PlanError,
    SpecViolation,
    UnknownPolicyError,
)
from kvoffload_spec.model import OffloadModel
from kvoffload_spec.surface import (
    BlocksRemoved,
    BlocksStored,
    Event,
    Key,
    LoadPlan,
    Lookup,
    Plan,
    RemovalReason,
    StorePlan,
)

__all__ = [
    "BlockNotFoundError",
    "BlockNotReadyError",
    "BlockPendingError",
    "BlocksRemoved",
    "BlocksStored",
    "Event",
    "ForeignPlanError",
    "InvalidArgumentError",
    "Key",
    "LoadPlan",
    "Lookup",
    "OffloadError",
    "OffloadModel",
    "Plan",
    "PlanAlreadyAbandonedError",
    "PlanAlreadyCompletedError",
    "PlanError",
    "RemovalReason",
    "SpecViolation",
    "StorePlan",
    "UnknownPolicyError",
]
