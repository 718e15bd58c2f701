"""Seeded random pauses at the Offloader's hand-off points between threads, installed from
the test side (the production code has no hook): shared by the thread and fetch-job tests."""

from __future__ import annotations

import queue
import random
import threading
import time

from kvoffload import Offloader
from kvoffload.transfer.cpu import CpuBackend
from kvoffload.transfer.jobs import Job


class Jitter:
    """Seeded random pauses at the hand-off points between threads (test-side wrappers only:
    the production code has no hook). Each pause is taken with ``chance``, for 0 to ``most``
    seconds; a pause of 0 still hands the GIL over.
    """

    def __init__(self, seed: int, chance: float = 0.3, most: float = 5e-4) -> None:
        self._random = random.Random(seed)
        self._chance = chance
        self._most = most

    def pause(self) -> None:
        if self._random.random() < self._chance:
            time.sleep(self._random.choice((0.0, self._most / 10, self._most)))

    def install(self, offloader: Offloader) -> None:
        """Pause around the offloader's lock, after each wait for jobs returns, after a job
        is queued for its worker thread, and before each run of a copy."""
        offloader._lock = JitteryLock(self)  # type: ignore[assignment]
        engine = offloader.engine
        wait = engine.wait

        def wait_then_pause(*args: object, **kwargs: object) -> bool:
            finished = wait(*args, **kwargs)  # type: ignore[arg-type]
            self.pause()
            return finished

        engine.wait = wait_then_pause  # type: ignore[method-assign]
        backend = engine._backend
        assert isinstance(backend, CpuBackend)
        backend._queues = {
            direction: JitteryQueue(jobs, self)  # type: ignore[misc]
            for direction, jobs in backend._queues.items()
        }


class JitteryLock:
    def __init__(self, jitter: Jitter) -> None:
        self._lock = threading.Lock()
        self._jitter = jitter

    def __enter__(self) -> None:
        self._jitter.pause()
        self._lock.acquire()

    def __exit__(self, *exc_info: object) -> None:
        self._lock.release()
        self._jitter.pause()


class JitteryQueue:
    """A worker's job queue that pauses the submitting thread right after the hand-off."""

    def __init__(self, jobs: queue.SimpleQueue[Job | None], jitter: Jitter) -> None:
        self._jobs = jobs
        self._jitter = jitter

    def put(self, job: Job | None) -> None:
        self._jobs.put(job)
        if job is not None:
            self._jitter.pause()
