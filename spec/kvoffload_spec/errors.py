"""The errors of the offloading manager's public surface.

Every misuse raises a subclass of :class:`OffloadError`, and raises it *before* any state
changes: a failed call leaves the manager exactly as it was. The production package
``kvoffload`` re-exports these very classes, so ``except kvoffload.OffloadError`` catches what
both the spec and the implementation raise.
"""

from __future__ import annotations


class OffloadError(Exception):
    """Base class of every error this library raises on purpose."""


class InvalidArgumentError(OffloadError, ValueError):
    """An argument has the wrong type or value (size, policy name, key list, flag)."""


class UnknownPolicyError(InvalidArgumentError):
    """The eviction policy name or ``module:Class`` path does not name a usable policy."""


class BlockNotReadyError(OffloadError):
    """A load asked for a key whose block cannot be read now."""


class BlockNotFoundError(BlockNotReadyError):
    """A load asked for a key that is not in the CPU pool (never stored, evicted or reset)."""


class BlockPendingError(BlockNotReadyError):
    """A load asked for a key whose store is still in flight: wait for ``complete_store``."""


class PlanError(OffloadError):
    """A plan handed back to ``complete_*`` cannot be completed."""


class PlanAlreadyCompletedError(PlanError):
    """The plan was completed before; every plan is completed exactly once."""


class ForeignPlanError(PlanError):
    """The object is not a plan of this manager (another manager's, or the wrong kind)."""


class PlanAlreadyAbandonedError(PlanError):
    """The plan was abandoned before; abandon a plan once, then complete it once."""


class SpecViolation(AssertionError):
    """An invariant of the design does not hold: a bug in the model or the manager (not an
    ``OffloadError``: no caller's misuse causes it)."""
