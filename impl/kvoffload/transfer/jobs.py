"""A transfer job, its result, and the fault-injection hook the backends consult."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from kvoffload.transfer.runs import CopyRuns


class Direction(enum.Enum):
    STORE = "store"  # device -> CPU pool
    LOAD = "load"  # CPU pool -> device


FaultHook = Callable[[int, int], None]
"""``hook(job_id, run_index)`` is called before each run copy of every job while set; an
exception it raises fails that job half-way, exactly like a copy that raised. For tests."""


@dataclass(frozen=True)
class Job:
    job_id: int
    direction: Direction
    runs: CopyRuns
    nbytes: int  # what the runs add up to: the copiers choose their path by it, not by a sum


@dataclass(frozen=True)
class JobResult:
    """How a job ended. ``error`` is what its copy raised when ``ok`` is False."""

    job_id: int
    direction: Direction
    ok: bool
    nbytes: int
    seconds: float
    error: BaseException | None = None
