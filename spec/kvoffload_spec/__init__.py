"""kvoffload_spec: the executable reference model of a CPU KV-block offloading manager.

Pure Python, standard library only. ``OffloadModel`` is the design document that runs; the
production ``kvoffload.OffloadManager`` is checked against it. See docs/spec.md.
"""

from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from kvoffload_spec.model import OffloadModel as OffloadModel


def __getattr__(name: str) -> Any:
    # The state machine loads on first use: a product that needs only the errors and the
    # plans (``import kvoffload.manager``) never imports it.
    if name == "OffloadModel":
        from kvoffload_spec.model import OffloadModel

        return OffloadModel
    raise AttributeError(f"module 'kvoffload_spec' has no attribute {name!r}")


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
