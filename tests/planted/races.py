"""Planted races in the offloader and the CPU backend: each hand-off made in the wrong
order, which the jittered hammering of tests/test_threads.py must report."""

from __future__ import annotations

from dataclasses import dataclass

from kvoffload import Offloader
from kvoffload.offloader import Finished
from kvoffload.transfer import engine as engine_module
from kvoffload.transfer.cpu import CpuBackend
from kvoffload.transfer.jobs import Job


class ResetWaitsOutsideTheLock(Offloader):
    """reset waits for the jobs in flight before taking the lock: a store can start between
    the wait and the reset, and its job still runs when the manager forgets the pool."""

    def reset(self, timeout: float | None = None) -> list[Finished]:
        with self._lock:
            jobs = self._unabandoned()
        if not self.engine.wait(jobs, timeout):
            raise engine_module.TransferTimeoutError("jobs in flight did not finish")
        with self._lock:
            finished = self._poll()
            self.manager.reset_cache()
            return finished


class RegistersAfterTheHandOff(CpuBackend):
    """A job is registered as running only after it was queued for the worker thread: a
    worker that finishes it first leaves it counted as running for ever."""

    def submit(self, job: Job) -> None:
        jobs = self._queues.get(job.direction)
        if jobs is None:
            super().submit(job)
            return
        jobs.put(job)
        with self._changed:
            self._running.add(job.job_id)


@dataclass(frozen=True)
class PlantedRace:
    """A race planted in the offloader or the CPU backend; ``caught_as`` is the start of
    the problem the jittered hammering must report within ``SEEDS`` seeds."""

    name: str
    planted: dict[str, type]
    caught_as: str


PLANTED_RACES = (
    PlantedRace(
        "reset waits outside the lock",
        {"offloader_class": ResetWaitsOutsideTheLock},
        "resets with jobs in flight",
    ),
    PlantedRace(
        "job registered as running after the hand-off",
        {"backend_class": RegistersAfterTheHandOff},
        "counts as running",
    ),
)
