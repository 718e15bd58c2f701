"""The CPU backend: jobs complete synchronously, or on one worker thread per direction.

The worker threads mirror CUDA's one stream per direction: jobs of one direction run in
submission order, the two directions overlap. A job that raises is reported failed; the
exception is kept in its result and never escapes into an unrelated call.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Collection

from kvoffload.transfer.copiers import Copier
from kvoffload.transfer.jobs import Direction, FaultHook, Job, JobResult


def run_job(copier: Copier, job: Job, hook: FaultHook | None) -> JobResult:
    """Execute ``job`` now; every exception becomes a failed result."""
    start = time.perf_counter()
    try:
        copier.copy(job, hook)
    except Exception as error:  # a job's failure is data for its caller, not a crash here
        return JobResult(job.job_id, job.direction, False, 0, time.perf_counter() - start, error)
    seconds = time.perf_counter() - start
    return JobResult(job.job_id, job.direction, True, job.nbytes, seconds)


class CpuBackend:
    """Executes jobs on the CPU; ``threaded`` moves them onto worker threads."""

    def __init__(self, copier: Copier, *, threaded: bool) -> None:
        self._copier = copier
        self.hook: FaultHook | None = None
        self._done: dict[int, JobResult] = {}  # finished, not yet polled; in finishing order
        self._running: set[int] = set()
        # taken directly where nobody is notified: a with-block on the lock is C code, on
        # the condition two Python calls (which a job pays cold, after its copy)
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._queues: dict[Direction, queue.SimpleQueue[Job | None]] = {}
        self._workers: list[threading.Thread] = []
        if threaded:
            for direction in Direction:
                jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
                worker = threading.Thread(
                    target=self._work, args=(jobs,), name=f"kvoffload-{direction.value}"
                )
                worker.daemon = True
                worker.start()
                self._queues[direction] = jobs
                self._workers.append(worker)

    def submit(self, job: Job) -> None:
        jobs = self._queues.get(job.direction)
        if jobs is None:
            self._finish(run_job(self._copier, job, self.hook))
            return
        with self._lock:
            self._running.add(job.job_id)
        jobs.put(job)

    def poll(self) -> list[JobResult]:
        with self._lock:
            finished = list(self._done.values())
            self._done.clear()
        return finished

    def wait(self, job_ids: Collection[int], timeout: float | None = None) -> bool:
        if not self._workers:  # every job finished inside its submit
            return True
        with self._changed:
            return self._changed.wait_for(lambda: self._running.isdisjoint(job_ids), timeout)

    def wait_all(self, timeout: float | None = None) -> bool:
        if not self._workers:
            return True
        with self._changed:
            return self._changed.wait_for(lambda: not self._running, timeout)

    def close(self) -> None:
        """Let queued jobs finish, then stop the workers (idempotent)."""
        for jobs in self._queues.values():
            jobs.put(None)
        for worker in self._workers:
            worker.join()
        self._queues.clear()
        self._workers.clear()

    def _work(self, jobs: queue.SimpleQueue[Job | None]) -> None:
        while (job := jobs.get()) is not None:
            self._finish(run_job(self._copier, job, self.hook))

    def _finish(self, result: JobResult) -> None:
        with self._lock:
            self._done[result.job_id] = result
            if self._workers:  # only worker threads leave anyone waiting
                self._running.discard(result.job_id)
                self._changed.notify_all()
