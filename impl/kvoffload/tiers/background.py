"""RemoteTier: a remote store's calls on a worker thread, so that the scheduler never waits.

The scheduler submits a write-back (``submit_put``) or a fetch into CPU buffers
(``submit_get``) and gets a :class:`RemoteJob` at once; one worker thread runs the jobs in
order against the store; the scheduler collects finished jobs with :meth:`RemoteTier.poll`
(or waits on one). ``submit_*`` never blocks: the queue is bounded, and a job that finds it
full is finished at once as not done (a write-back dropped, a fetch missed), and counted.

Buffers belong to the job until it is done: a put's values are read, a get's buffers are
written, by the worker thread, at any time before the job reports done. A caller that frees
or reuses such a buffer earlier (a CPU slot given to another block) stores or loads wrong
bytes: keep the slot until the job is done (or cancelled before it started).
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Literal

from kvoffload_spec.errors import InvalidArgumentError

from .store import Payload, RemoteStore, StoreClosedError, WritableBuffer
from .values import as_payload, encode_key

JobKind = Literal["put", "get"]


class JobNotDoneError(InvalidArgumentError):
    """A job's result was asked for before it finished: poll or wait first."""


class RemoteJob:
    """One submitted batch. ``result`` per key, as the store's ``put`` / ``get_into``."""

    def __init__(
        self,
        job_id: int,
        kind: JobKind,
        keys: tuple[Hashable, ...],
        buffers: tuple[memoryview, ...],
    ) -> None:
        self.job_id = job_id
        self.kind: JobKind = kind
        self.keys = keys
        self._buffers = buffers
        self._finished = threading.Event()
        self._result: list[bool] | None = None
        self.outcome: Literal["pending", "ran", "dropped", "cancelled", "error"] = "pending"
        self.error: str | None = None  # what went wrong in the store, if it raised

    @property
    def done(self) -> bool:
        return self._finished.is_set()

    @property
    def result(self) -> list[bool]:
        if self._result is None:
            raise JobNotDoneError(f"remote job {self.job_id} ({self.kind}) is not done yet")
        return self._result

    def wait(self, timeout_s: float | None = None) -> bool:
        """Whether the job is done, after waiting at most ``timeout_s`` (None: for ever)."""
        return self._finished.wait(timeout_s)

    def _finish(
        self, result: list[bool], outcome: Literal["ran", "dropped", "cancelled", "error"]
    ) -> None:
        self._result = result
        self.outcome = outcome
        self._buffers = ()  # the caller's buffers are free again
        self._finished.set()

    def __repr__(self) -> str:
        return f"RemoteJob({self.job_id}, {self.kind}, {len(self.keys)} keys, {self.outcome})"


@dataclass(frozen=True)
class RemoteTierStats:
    submitted: int = 0
    ran: int = 0  # jobs the store ran (their keys may still have failed: see store.stats())
    dropped: int = 0  # found the queue full: finished at once, nothing done
    cancelled: int = 0
    errors: int = 0  # the store raised (a bug: a store counts its failures, never raises)
    queued: int = 0  # now
    running: bool = False  # now


class RemoteTier:
    """A worker thread and a bounded queue in front of ``store``."""

    def __init__(
        self, store: RemoteStore, *, max_pending: int = 64, name: str = "kvoffload-remote"
    ) -> None:
        if not isinstance(store, RemoteStore):
            raise InvalidArgumentError(
                f"store must implement RemoteStore (ValkeyStore does); got {type(store).__name__}"
            )
        if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
            raise InvalidArgumentError(f"max_pending must be an int >= 1; got {max_pending!r}")
        self.store = store
        self.max_pending = max_pending
        self._queue: deque[RemoteJob] = deque()
        self._finished: list[RemoteJob] = []
        self._changed = threading.Condition()
        self._ids = itertools.count(1)
        self._running: RemoteJob | None = None
        self._closed = False
        self._counts = {"submitted": 0, "ran": 0, "dropped": 0, "cancelled": 0, "errors": 0}
        self._worker = threading.Thread(target=self._work, name=name, daemon=True)
        self._worker.start()

    # -- the scheduler's side ------------------------------------------------------------

    def submit_put(self, keys: Sequence[Hashable], values: Sequence[Payload]) -> RemoteJob:
        """Write ``values`` under ``keys`` in the background (their buffers: see the module)."""
        checked = self._checked_keys(keys)
        if isinstance(values, (str, bytes, bytearray, memoryview)) or not isinstance(
            values, Sequence
        ):
            raise InvalidArgumentError("values must be a sequence of buffers, one per key")
        if len(values) != len(checked):
            raise InvalidArgumentError(
                f"submit_put got {len(checked)} keys and {len(values)} values; one per key"
            )
        views = tuple(
            as_payload(value, f"the value for key #{i}") for i, value in enumerate(values)
        )
        return self._submit("put", checked, views)

    def submit_get(self, keys: Sequence[Hashable], buffers: Sequence[WritableBuffer]) -> RemoteJob:
        """Fetch ``keys`` into ``buffers`` in the background: ``True`` per key whose buffer
        holds the exact bytes stored under it; ``False`` leaves it untouched."""
        checked = self._checked_keys(keys)
        if isinstance(buffers, (bytes, bytearray, memoryview)) or not isinstance(buffers, Sequence):
            raise InvalidArgumentError("buffers must be a sequence of buffers, one per key")
        if len(buffers) != len(checked):
            raise InvalidArgumentError(
                f"submit_get got {len(checked)} keys and {len(buffers)} buffers; one per key"
            )
        views = tuple(as_payload(buffer, f"buffer #{i}") for i, buffer in enumerate(buffers))
        for i, view in enumerate(views):
            if view.readonly:
                raise InvalidArgumentError(f"buffer #{i} is read-only")
        return self._submit("get", checked, views)

    def poll(self) -> list[RemoteJob]:
        """The jobs finished since the last poll (each once), in the order they finished."""
        with self._changed:
            finished, self._finished = self._finished, []
            return finished

    def cancel(self, job: RemoteJob) -> bool:
        """Finish a job that has not started as not done; ``False`` if it has started."""
        with self._changed:
            if job not in self._queue:
                return False
            self._queue.remove(job)
            self._counts["cancelled"] += 1
            job._finish([False] * len(job.keys), "cancelled")
            self._finished.append(job)
            self._changed.notify_all()
            return True

    def stats(self) -> RemoteTierStats:
        with self._changed:
            return RemoteTierStats(
                **self._counts, queued=len(self._queue), running=self._running is not None
            )

    def close(self, timeout_s: float = 10.0) -> bool:
        """Cancel the queued jobs, let the running one finish (at most ``timeout_s``), stop
        the worker; ``True`` if it stopped in time. The store stays open (it is the caller's)."""
        with self._changed:
            self._closed = True
            while self._queue:
                job = self._queue.popleft()
                self._counts["cancelled"] += 1
                job._finish([False] * len(job.keys), "cancelled")
                self._finished.append(job)
            self._changed.notify_all()
        self._worker.join(timeout_s)
        return not self._worker.is_alive()

    def __enter__(self) -> RemoteTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------

    def _checked_keys(self, keys: Sequence[Hashable]) -> tuple[Hashable, ...]:
        if self._closed:
            raise StoreClosedError("this RemoteTier is closed")
        if isinstance(keys, (str, bytes, bytearray, memoryview)) or not isinstance(keys, Sequence):
            raise InvalidArgumentError(
                f"keys must be a sequence of block keys; got {type(keys).__name__}"
            )
        for key in keys:
            encode_key(key)  # raises on a key no store can hold
        return tuple(keys)

    def _submit(
        self, kind: JobKind, keys: tuple[Hashable, ...], views: tuple[memoryview, ...]
    ) -> RemoteJob:
        with self._changed:
            if self._closed:
                raise StoreClosedError("this RemoteTier is closed")
            job = RemoteJob(next(self._ids), kind, keys, views)
            self._counts["submitted"] += 1
            if len(self._queue) >= self.max_pending:
                self._counts["dropped"] += 1
                job._finish([False] * len(keys), "dropped")
                self._finished.append(job)
            else:
                self._queue.append(job)
                self._changed.notify_all()
            return job

    def _work(self) -> None:
        while True:
            with self._changed:
                while not self._queue and not self._closed:
                    self._changed.wait()
                if not self._queue:
                    return
                job = self._queue.popleft()
                self._running = job
            result, outcome = self._run(job)
            with self._changed:
                self._running = None
                self._counts["ran" if outcome == "ran" else "errors"] += 1
                job._finish(result, outcome)
                self._finished.append(job)
                self._changed.notify_all()

    def _run(self, job: RemoteJob) -> tuple[list[bool], Literal["ran", "error"]]:
        try:
            if job.kind == "put":
                return self.store.put(job.keys, job._buffers), "ran"
            return self.store.get_into(job.keys, job._buffers), "ran"
        except Exception as error:  # a store must not raise; if one does, the engine lives on
            job.error = f"{type(error).__name__}: {error}"
            return [False] * len(job.keys), "error"
