"""The CUDA backend: one stream per direction, a pair of events per job.

Only the GPU test run exercises this module (tests marked ``cuda``); here it is
type-checked. Ordering, which is what keeps bytes right:

- a store's stream waits for the compute stream at submission, so it reads the KV the
  forward pass queued before it (vLLM #31341 is a store that read KV too early);
- a load's stream waits for the compute stream too: the device blocks it overwrites may
  still be read by kernels queued before the load;
- a consumer makes its own stream wait for a load's end event (:meth:`stream_wait`)
  instead of synchronizing the host.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvoffload.transfer.copiers import Copier
from kvoffload.transfer.jobs import Direction, FaultHook, Job, JobResult

if TYPE_CHECKING:
    import torch


@dataclass
class _InFlight:
    job: Job
    start: torch.cuda.Event
    end: torch.cuda.Event
    error: Exception | None


class CudaBackend:
    """Queues each job's copies on its direction's stream, bracketed by timing events."""

    def __init__(self, copier: Copier, device: torch.device) -> None:
        import torch

        self._copier = copier
        self._device = device
        self.hook: FaultHook | None = None
        self._streams = {d: torch.cuda.Stream(device) for d in Direction}  # type: ignore[no-untyped-call]
        self._in_flight: dict[Direction, deque[_InFlight]] = {d: deque() for d in Direction}
        self._by_id: dict[int, _InFlight] = {}
        self._spare_events: list[torch.cuda.Event] = []

    def submit(self, job: Job) -> None:
        import torch

        stream = self._streams[job.direction]
        stream.wait_stream(torch.cuda.current_stream(self._device))
        start, end = self._event(), self._event()
        error: Exception | None = None
        with torch.cuda.stream(stream):
            start.record(stream)
            try:
                self._copier.copy(job, self.hook)
            except Exception as failure:  # reported by poll as this job's failure
                error = failure
            end.record(stream)
        flight = _InFlight(job, start, end, error)
        self._in_flight[job.direction].append(flight)
        self._by_id[job.job_id] = flight

    def poll(self) -> list[JobResult]:
        finished: list[JobResult] = []
        for flights in self._in_flight.values():
            # a stream finishes its jobs in order: stop at the first one still running
            while flights and flights[0].end.query():  # type: ignore[no-untyped-call]
                finished.append(self._finish(flights.popleft()))
        return finished

    def wait(self, job_ids: Collection[int], timeout: float | None = None) -> bool:
        flights = [flight for job in job_ids if (flight := self._by_id.get(job)) is not None]
        if timeout is not None:
            ends = [flight.end for flight in flights]

            def ended() -> bool:
                return all(end.query() for end in ends)  # type: ignore[no-untyped-call]

            return _until(ended, timeout)
        for flight in flights:
            flight.end.synchronize()
        return True

    def wait_all(self, timeout: float | None = None) -> bool:
        streams = list(self._streams.values())
        if timeout is not None:
            return _until(lambda: all(stream.query() for stream in streams), timeout)
        for stream in streams:
            stream.synchronize()
        return True

    def stream_wait(self, job_id: int, stream: torch.cuda.Stream) -> None:
        flight = self._by_id.get(job_id)
        if flight is not None:
            stream.wait_event(flight.end)

    def close(self) -> None:
        self.wait_all()

    def _event(self) -> torch.cuda.Event:
        import torch

        if self._spare_events:
            return self._spare_events.pop()
        return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]

    def _finish(self, flight: _InFlight) -> JobResult:
        job = flight.job
        del self._by_id[job.job_id]
        seconds = flight.start.elapsed_time(flight.end) / 1e3
        self._spare_events += (flight.start, flight.end)
        if flight.error is not None:
            return JobResult(job.job_id, job.direction, False, 0, seconds, flight.error)
        return JobResult(job.job_id, job.direction, True, job.nbytes, seconds)


def _until(done: Callable[[], bool], timeout: float) -> bool:
    """Poll ``done`` until it holds or ``timeout`` seconds passed (CUDA has no timed
    synchronize; a millisecond's sleep keeps the host from spinning).
    """
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)
    return True
