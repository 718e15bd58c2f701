"""kvoffload: offload LLM KV-cache blocks to a CPU block pool and back.

The error classes, plans, events and ``Lookup`` are the spec's own (``kvoffload_spec``), so
``except kvoffload.OffloadError`` catches what both raise. Everything else is imported on
first use: ``import kvoffload`` stays cheap and never imports torch until the data path is
touched.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvoffload._moved import install as _install_moved_names
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
    pass  # each lazily exported name is imported here for type checkers
    from kvoffload.checking.conformance import check_conformance as check_conformance
    from kvoffload.manager import OffloadManager as OffloadManager
    from kvoffload.offloader import Finished as Finished
    from kvoffload.offloader import Offloader as Offloader
    from kvoffload.policies.arc import ArcPolicy as ArcPolicy
    from kvoffload.policies.base import EvictionPolicy as EvictionPolicy
    from kvoffload.policies.base import PolicyContractError as PolicyContractError
    from kvoffload.policies.lru import LruPolicy as LruPolicy
    from kvoffload.stats import ManagerStats as ManagerStats
    from kvoffload.transfer import CpuBlockPool as CpuBlockPool
    from kvoffload.transfer import JobResult as JobResult
    from kvoffload.transfer import KVLayout as KVLayout
    from kvoffload.transfer import TransferEngine as TransferEngine
    from kvoffload.transfer import TransferTimeoutError as TransferTimeoutError

__version__ = "0.2.0"

_install_moved_names()

# public name -> module that defines it; imported on first attribute access
_LAZY: dict[str, str] = {
    "ArcPolicy": "kvoffload.policies.arc",
    "CpuBlockPool": "kvoffload.transfer",
    "EvictionPolicy": "kvoffload.policies.base",
    "Finished": "kvoffload.offloader",
    "JobResult": "kvoffload.transfer",
    "KVLayout": "kvoffload.transfer",
    "LruPolicy": "kvoffload.policies.lru",
    "ManagerStats": "kvoffload.stats",
    "OffloadManager": "kvoffload.manager",
    "Offloader": "kvoffload.offloader",
    "PolicyContractError": "kvoffload.policies.base",
    "TransferEngine": "kvoffload.transfer",
    "TransferTimeoutError": "kvoffload.transfer",
    "check_conformance": "kvoffload.checking.conformance",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvoffload' has no attribute {name!r}")
    try:
        loaded = importlib.import_module(module)
    except ImportError as error:
        if module.startswith("kvoffload.checking."):
            raise ImportError(
                f"kvoffload.{name} checks a manager with Hypothesis, which a serving install "
                f"leaves out: pip install 'kvoffload[verify]' ({error})"
            ) from error
        raise
    return getattr(loaded, name)


def __dir__() -> list[str]:
    """What ``dir(kvoffload)`` and completion show: the lazy exports too, not yet loaded."""
    return sorted({*globals(), *_LAZY})


__all__ = [
    "__version__",
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
    "Plan",
    "PlanAlreadyAbandonedError",
    "PlanAlreadyCompletedError",
    "PlanError",
    "RemovalReason",
    "StorePlan",
    "UnknownPolicyError",
    *_LAZY,
]
