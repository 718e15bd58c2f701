"""RemoteTier: a store's calls on a worker thread, on a real server. Submitting never waits
for the server, a full queue drops (counted), every job finishes exactly once, and bytes
fetched are exactly the bytes stored.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from kvoffload.tiers import (
    JobNotDoneError,
    RemoteJob,
    RemoteTier,
    RemoteTierStats,
    StoreClosedError,
    ValkeyStore,
)
from kvoffload_spec.errors import InvalidArgumentError
from tests.remote_support import LAYOUT, blocks
from tests.valkey_server import ValkeyServer

KiB = 1 << 10


def finished(tier: RemoteTier, jobs: list[RemoteJob], timeout_s: float = 30) -> list[RemoteJob]:
    """Poll until every job in ``jobs`` came back; each must come back exactly once."""
    seen: list[RemoteJob] = []
    deadline = time.monotonic() + timeout_s
    while len(seen) < len(jobs):
        assert time.monotonic() < deadline, (seen, jobs)
        seen += tier.poll()
        time.sleep(0.001)
    assert sorted(job.job_id for job in seen) == sorted(job.job_id for job in jobs)
    return seen


def test_write_backs_and_fetches_round_trip_in_the_background(
    valkey_server: ValkeyServer,
) -> None:
    store = ValkeyStore(valkey_server.url, namespace=LAYOUT, timeout_s=10)
    values = blocks(24, 64 * KiB, seed=1)
    with RemoteTier(store, max_pending=8) as tier:
        puts = [tier.submit_put(list(range(i, i + 8)), values[i : i + 8]) for i in range(0, 24, 8)]
        assert all(job.kind == "put" for job in puts)
        finished(tier, puts)
        assert [job.result for job in puts] == [[True] * 8] * 3
        assert all(job.outcome == "ran" for job in puts)
        buffers = [bytearray(64 * KiB) for _ in range(26)]
        fetch = tier.submit_get(list(range(26)), buffers)
        assert fetch.wait(30) and fetch.done
        assert fetch.result == [True] * 24 + [False, False]
        assert [bytes(b) for b in buffers[:24]] == values
        assert buffers[24] == bytearray(64 * KiB)  # a miss leaves its buffer alone
        assert tier.poll() == [fetch] and tier.poll() == []
        assert tier.stats() == RemoteTierStats(submitted=4, ran=4)
    assert store.stats().keys_stored == 24


def test_a_stalled_server_never_blocks_a_submit_and_a_full_queue_drops(
    valkey_server: ValkeyServer,
) -> None:
    store = ValkeyStore(valkey_server.url, namespace=LAYOUT, timeout_s=0.5, retry_after_s=0.1)
    tier = RemoteTier(store, max_pending=2)
    valkey_server.pause()
    try:
        first = tier.submit_put([0], [b"a"])
        deadline = time.monotonic() + 10
        while not tier.stats().running:  # the worker has taken it and waits on the server
            assert time.monotonic() < deadline
            time.sleep(0.001)
        queued = [tier.submit_put([i], [b"b"]) for i in (1, 2)]
        dropped = tier.submit_get([3], [bytearray(1)])
        # the queue was full: finished at once, while the server still sleeps
        assert dropped.done and dropped.outcome == "dropped" and dropped.result == [False]
        assert not first.done and not any(job.done for job in queued)
        assert tier.cancel(queued[1]) and not tier.cancel(queued[1]) and not tier.cancel(first)
        assert queued[1].result == [False] and queued[1].outcome == "cancelled"
        with pytest.raises(JobNotDoneError):
            _ = first.result
        assert first.wait(30) and first.result == [False]  # timed out, counted by the store
        assert store.stats().timeouts == 1
    finally:
        valkey_server.resume()
    finished(tier, [first, *queued, dropped])
    assert tier.stats() == RemoteTierStats(submitted=4, ran=2, dropped=1, cancelled=1)
    assert tier.close()


def test_jobs_against_a_dead_server_finish_as_not_done(valkey_server: ValkeyServer) -> None:
    store = ValkeyStore(valkey_server.url, namespace=LAYOUT, timeout_s=2, retry_after_s=0.1)
    valkey_server.kill()
    with RemoteTier(store) as tier:
        jobs = [tier.submit_put([i], [b"x"]) for i in range(5)]
        jobs.append(tier.submit_get([0], [bytearray(1)]))
        finished(tier, jobs)
        assert all(job.result == [False] and job.outcome == "ran" for job in jobs)
        valkey_server.start()
        time.sleep(0.1)
        again = tier.submit_put([0], [b"x"])
        assert again.wait(30) and again.result == [True]
    assert store.stats().connection_errors == 1


class Raising(ValkeyStore):
    """A store with a bug: it raises. The tier records it; the caller's loop goes on."""

    def put(self, keys: object, values: object) -> list[bool]:
        raise RuntimeError("a bug in a store")


def test_a_store_that_raises_fails_its_job_and_not_the_caller(
    valkey_server: ValkeyServer,
) -> None:
    with RemoteTier(Raising(valkey_server.url, namespace=LAYOUT)) as tier:
        job = tier.submit_put([1], [b"x"])
        assert job.wait(30) and job.result == [False] and job.outcome == "error"
        assert job.error == "RuntimeError: a bug in a store"
        assert tier.stats().errors == 1
        fetch = tier.submit_get([1], [bytearray(1)])
        assert fetch.wait(30) and fetch.outcome == "ran"


def test_bad_arguments_raise_at_submit_and_queue_nothing(valkey_server: ValkeyServer) -> None:
    store = ValkeyStore(valkey_server.url, namespace=LAYOUT)
    with pytest.raises(InvalidArgumentError):
        RemoteTier(object())  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        RemoteTier(store, max_pending=0)
    tier = RemoteTier(store)
    calls: list[Callable[[], object]] = [
        lambda: tier.submit_put([1, 2], [b"x"]),
        lambda: tier.submit_put([1.5], [b"x"]),
        lambda: tier.submit_put([1], ["text"]),  # type: ignore[list-item]
        lambda: tier.submit_put("ab", [b"x", b"y"]),
        lambda: tier.submit_get([1], [b"read-only"]),  # type: ignore[list-item]
        lambda: tier.submit_get([1], [bytearray(1), bytearray(1)]),
        lambda: tier.submit_get([[1]], [bytearray(1)]),  # type: ignore[list-item]
    ]
    for call in calls:
        with pytest.raises(InvalidArgumentError):
            call()
    assert tier.stats() == RemoteTierStats() and tier.poll() == []
    assert tier.close()
    with pytest.raises(StoreClosedError):
        tier.submit_put([1], [b"x"])
    assert store.stats().put_calls == 0


def test_close_cancels_what_is_queued_and_every_job_finishes_once(
    valkey_server: ValkeyServer,
) -> None:
    store = ValkeyStore(valkey_server.url, namespace=LAYOUT, timeout_s=10)
    tier = RemoteTier(store, max_pending=1000)
    jobs: list[RemoteJob] = []
    values = blocks(4, 16 * KiB)

    def submit(offset: int) -> None:
        for i in range(50):
            jobs.append(tier.submit_put([offset + i], [values[i % 4]]))

    threads = [threading.Thread(target=submit, args=(1000 * n,)) for n in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert tier.close()
    assert all(job.done for job in jobs)
    outcomes = {job.outcome for job in jobs}
    assert outcomes <= {"ran", "cancelled"}
    seen = tier.poll()
    assert sorted(job.job_id for job in seen) == sorted(job.job_id for job in jobs)
    stats = tier.stats()
    assert stats.ran + stats.cancelled == stats.submitted == 150
    assert store.stats().keys_stored == stats.ran


def test_each_job_says_where_it_stands_and_the_tier_counts_every_one(
    valkey_server: ValkeyServer,
) -> None:
    """A job held by a paused server and one queued behind it are pending, a wait with a
    timeout gives up, the queue's one place is counted; every drop and every cancel is
    counted, not just the first."""
    with pytest.raises(InvalidArgumentError):
        RemoteTier(ValkeyStore(valkey_server.url, namespace=LAYOUT), max_pending=True)
    store = ValkeyStore(valkey_server.url, namespace=LAYOUT, timeout_s=10)
    tier = RemoteTier(store, max_pending=1)  # the least queue there is
    valkey_server.pause()
    try:
        first = tier.submit_put([0], [b"a"])
        deadline = time.monotonic() + 10
        while not tier.stats().running:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert not first.wait(0.01) and first.outcome == "pending" and first.error is None
        queued = tier.submit_get([0], [bytearray(1)])
        assert queued.kind == "get" and queued.outcome == "pending" and not queued.done
        assert tier.stats().queued == 1
        dropped = [tier.submit_put([1], [b"b"]), tier.submit_get([2], [bytearray(1)])]
        assert [job.outcome for job in dropped] == ["dropped", "dropped"]
        assert tier.cancel(queued)
        again = tier.submit_put([3], [b"c"])
        assert tier.stats().queued == 1 and tier.cancel(again)
        assert tier.stats() == RemoteTierStats(submitted=5, dropped=2, cancelled=2, running=True)
    finally:
        valkey_server.resume()
    assert first.wait(30) and first.result == [True] and first.error is None
    finished(tier, [first, queued, again, *dropped])
    assert tier.stats() == RemoteTierStats(submitted=5, ran=1, dropped=2, cancelled=2)
    assert tier.close()
