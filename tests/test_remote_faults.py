"""The remote tier under server failures, on a real server process the tests kill, pause and
restart: no call raises, every failure is counted, no wrong byte is ever returned, and the
store uses the server again once it is back. And two OS processes share one server.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest

from kvoffload.tiers import RemoteStats, ValkeyStore
from tests.remote_support import LAYOUT, assert_accounted, blocks
from tests.valkey_server import ValkeyServer, free_port

pytestmark = pytest.mark.slow  # killed, stalled, restarted servers: the full gate only

KiB, MiB = 1 << 10, 1 << 20
# Long enough for loopback round trips on a busy machine (the gate runs tests in parallel on
# two cores), short enough to keep the stall tests quick.
TIMEOUT_S = 1.0
RETRY_S = 0.5  # calls within it after a failure are answered at once (the tests count them)


def store_for(url: str, **options: Any) -> ValkeyStore:
    settings = {"timeout_s": TIMEOUT_S, "retry_after_s": RETRY_S, **options}
    return ValkeyStore(url, namespace=LAYOUT, **settings)


def exact_or_missing(store: ValkeyStore, keys: list[int], values: list[bytes]) -> int:
    """How many keys read back exactly; fails on any wrong byte."""
    found = store.get(keys)
    for key, view, value in zip(keys, found, values, strict=True):
        assert view is None or view.tobytes() == value, key
    return sum(view is not None for view in found)


def wait_until_used_again(store: ValkeyStore, keys: list[int], values: list[bytes]) -> None:
    """The store goes back to the server by itself once retry_after_s has passed."""
    deadline = time.monotonic() + 10
    while store.put(keys, values) != [True] * len(keys):
        assert time.monotonic() < deadline, store.stats()
        time.sleep(RETRY_S / 4)


def test_a_server_down_at_start_is_survived_and_used_once_up() -> None:
    port = free_port()
    store = store_for(f"redis://127.0.0.1:{port}/0")
    keys, values = list(range(4)), blocks(4, 64 * KiB)
    assert store.put(keys, values) == [False] * 4
    assert store.get(keys) == [None] * 4
    assert store.get_into(keys[:1], [bytearray(64 * KiB)]) == [False]
    assert store.contains(keys) == [False] * 4 and store.delete(keys) == [False] * 4
    assert not store.ping()
    stats = store.stats()
    assert stats.connection_errors == 1 and stats.skipped == 5 and stats.server_down
    assert stats.unavailable == 5 and stats.keys_not_stored == 4 and stats.connects == 0
    assert stats.last_error is not None and "connection_errors" in stats.last_error
    assert_accounted(stats)
    with ValkeyServer(port):
        wait_until_used_again(store, keys, values)
        assert exact_or_missing(store, keys, values) == 4
        assert store.stats().connects == 1 and not store.stats().server_down


def test_a_killed_server_is_counted_and_a_restarted_empty_one_used_again(
    valkey_server: ValkeyServer,
) -> None:
    store = store_for(valkey_server.url)
    keys, values = list(range(8)), blocks(8, 64 * KiB, seed=1)
    assert store.put(keys, values) == [True] * 8
    valkey_server.kill()
    assert store.get(keys) == [None] * 8
    assert store.put(keys, values) == [False] * 8  # marked down: answered at once
    stats = store.stats()
    assert (stats.connection_errors, stats.skipped, stats.failures) == (1, 1, 1)
    valkey_server.start()  # the same port, empty
    time.sleep(RETRY_S)
    assert store.get(keys) == [None] * 8  # empty is a plain miss, not a failure
    after = store.stats()
    assert after.misses - stats.misses == 8 and after.failures == 1 and after.connects == 2
    assert store.put(keys, values) == [True] * 8
    assert exact_or_missing(store, keys, values) == 8
    assert_accounted(store.stats())


def test_an_error_reply_is_a_failed_write_and_the_connection_stays_in_step() -> None:
    with ValkeyServer(maxmemory="3mb", maxmemory_policy="noeviction") as server:
        store = store_for(server.url)
        small = blocks(4, 1 * KiB, seed=2)
        assert store.put([0, 1, 2, 3], small) == [True] * 4
        big = blocks(3, 1 * MiB, seed=3)
        assert store.put([10, 11, 12], big) == [False] * 3  # one MSET, refused: OOM
        stats = store.stats()
        assert stats.server_errors == 1 and stats.keys_not_stored == 3
        assert stats.last_error is not None and "OOM" in stats.last_error
        assert not stats.server_down  # the server answers: no need to back off
        huge = blocks(2, 3 * MiB, seed=4)
        assert store.put([20, 21], huge) == [False] * 2  # two MSETs (over the limit together)
        stats = store.stats()
        assert (stats.server_errors, stats.failures) == (2, 2)  # one failure per call
        assert exact_or_missing(store, [0, 1, 2, 3, 10, 20], [*small, big[0], huge[0]]) == 4
        assert store.stats().connects == 1  # the same connection, still in step


@pytest.mark.slow
def test_a_server_killed_mid_call_never_raises_nor_returns_a_wrong_byte(
    valkey_server: ValkeyServer,
) -> None:
    store = store_for(valkey_server.url, timeout_s=2.0)
    keys, values = list(range(16)), blocks(16, 2 * MiB, seed=4)
    failed = 0
    for attempt in range(12):
        wait_until_used_again(store, keys, values)
        before = store.stats().failures
        killer = threading.Timer(0.002 * attempt, valkey_server.kill)
        killer.start()
        if attempt % 2:
            stored = store.put(keys, values)
            # a call that fails reports no key stored, whatever the server ran before the kill
            assert stored in ([True] * 16, [False] * 16)
        else:
            found = store.get(keys)
            assert all(view is None or view.tobytes() == values[i] for i, view in enumerate(found))
        killer.join()
        failed += store.stats().failures > before
        valkey_server.start()
        time.sleep(RETRY_S)
        assert store.get(keys) == [None] * 16  # back, and empty
    assert failed >= 3, store.stats()  # most kills land mid-call
    wait_until_used_again(store, keys, values)
    assert exact_or_missing(store, keys, values) == 16
    assert_accounted(store.stats())


def test_a_stalled_server_times_out_and_a_late_reply_is_never_read(
    valkey_server: ValkeyServer,
) -> None:
    store = store_for(valkey_server.url)
    keys, values = [0, 1], blocks(2, 64 * KiB, seed=5)
    assert store.put(keys, values) == [True, True]
    valkey_server.pause()
    try:
        started = time.monotonic()
        assert store.get([0]) == [None]
        waited = time.monotonic() - started
        assert store.put([2], [b"late"]) == [False]  # marked down: at once
        assert store.get([1]) == [None]
        stats = store.stats()
        assert (stats.timeouts, stats.skipped, stats.failures) == (1, 2, 1), stats
        assert stats.server_down
        # bounded by the timeout, not by the server (a generous bound: the machine is shared)
        assert waited < TIMEOUT_S + 5
    finally:
        valkey_server.resume()
    time.sleep(RETRY_S)
    # The first call after the stall asks for key 1 on a new connection: the late reply to
    # "get 0" went to the dropped one, so key 1's own bytes come back.
    assert [v and v.tobytes() for v in store.get([1])] == [values[1]]
    after = store.stats()
    assert after.rejected == 0 and after.connects == 2
    assert_accounted(after)


def test_writes_during_a_stall_are_either_stored_whole_or_missing(
    valkey_server: ValkeyServer,
) -> None:
    store = store_for(valkey_server.url)
    keys, values = list(range(4)), blocks(4, 2 * MiB, seed=6)
    valkey_server.pause()
    try:
        assert store.put(keys, values) == [False] * 4  # sent, never acknowledged
    finally:
        valkey_server.resume()
    time.sleep(RETRY_S)
    # The server may still run the commands it had received whole (one MSET per value here:
    # each 2 MiB value is over half the command limit), in order: the values stored are the
    # first ones of the batch, each whole, never a torn one.
    stored = exact_or_missing(store, keys, values)
    found = [view is not None for view in store.get(keys)]
    assert found == [True] * stored + [False] * (4 - stored)
    assert store.stats().timeouts == 1


WRITER = """
import json, random, sys
from kvoffload.tiers import ValkeyStore
url, count, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
store = ValkeyStore(url, namespace={"model": "tiny-llama", "layers": 2, "dtype": "bfloat16"})
rng = random.Random(7)
values = [rng.randbytes(size) for _ in range(count)]
print(json.dumps({"stored": store.put([("prefix", i) for i in range(count)], values)}))
"""

READER = """
import hashlib, json, random, sys
from kvoffload.tiers import ValkeyStore

url, count, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
# the same description, its keys in another order: the same namespace
store = ValkeyStore(url, namespace={"dtype": "bfloat16", "layers": 2, "model": "tiny-llama"})
buffers = [bytearray(size) for _ in range(count)]
found = store.get_into([("prefix", i) for i in range(count)], buffers)
print(json.dumps({"found": found, "sha256": [hashlib.sha256(b).hexdigest() for b in buffers]}))
"""


def run_python(program: str, *arguments: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(program), *arguments],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    answer: dict[str, Any] = json.loads(done.stdout)
    return answer


def test_a_second_process_reads_the_first_ones_blocks_byte_exact(
    valkey_server: ValkeyServer,
) -> None:
    import hashlib
    import random

    count, size = 12, 256 * KiB
    written = run_python(WRITER, valkey_server.url, str(count), str(size))
    assert written["stored"] == [True] * count
    read = run_python(READER, valkey_server.url, str(count), str(size))
    assert read["found"] == [True] * count
    rng = random.Random(7)
    expected = [hashlib.sha256(rng.randbytes(size)).hexdigest() for _ in range(count)]
    assert read["sha256"] == expected


def test_stats_are_a_snapshot() -> None:
    store = store_for(f"redis://127.0.0.1:{free_port()}/0")
    before = store.stats()
    store.get([1])
    assert before == RemoteStats() and store.stats() != before


def test_a_store_inherited_by_a_forked_child_connects_anew(valkey_server: ValkeyServer) -> None:
    import os

    store = store_for(valkey_server.url)
    assert store.put([0], [b"parent"]) == [True]
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:  # the child: its own connection, never the parent's socket
        try:
            ok = store.put([1], [b"child"]) == [True] and store.stats().connects == 2
            os.write(writer, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(writer)
    assert os.read(reader, 1) == b"1"
    os.close(reader)
    os.waitpid(child, 0)
    # the parent's connection is untouched by the child's: still the first one, in step
    assert [v and v.tobytes() for v in store.get([0, 1])] == [b"parent", b"child"]
    assert store.stats().connects == 1 and store.stats().failures == 0


def test_the_first_calls_after_a_restart_succeed_on_a_new_connection(
    valkey_server: ValkeyServer,
) -> None:
    """Two stores connected before the server restarts, idle meanwhile: each one's first
    call meets its dead connection, is sent again on a new one and succeeds."""
    writer, reader = store_for(valkey_server.url), store_for(valkey_server.url)
    keys, values = list(range(6)), blocks(6, 64 * KiB, seed=8)
    assert writer.put(keys, values) == [True] * 6
    assert exact_or_missing(reader, keys, values) == 6
    valkey_server.restart()  # the same port, empty; no call in between
    assert writer.put(keys, values) == [True] * 6  # the very first call after the restart
    assert [view and view.tobytes() for view in reader.get(keys)] == values  # and this one
    for store in (writer, reader):
        stats = store.stats()
        assert (stats.retries, stats.failures, stats.connects) == (1, 0, 2), stats
        assert not stats.server_down and stats.unavailable == 0 and stats.skipped == 0
        assert stats.last_error is not None and stats.last_error.startswith("retried: ")
        assert_accounted(stats)
    # A get_into, the same way: its buffer gets the bytes stored after the restart.
    valkey_server.restart()
    assert writer.put(keys[:1], values[:1]) == [True]
    buffer = bytearray(64 * KiB)
    assert reader.get_into(keys[:1], [buffer]) == [True] and bytes(buffer) == values[0]
    assert reader.stats().retries == 2 and reader.stats().failures == 0


def test_a_server_really_down_is_retried_once_then_backed_off(
    valkey_server: ValkeyServer,
) -> None:
    """No retry storm: the dead connection is retried once, the refused reconnect is the
    failure, and calls until retry_after_s are answered at once (no connect, no retry)."""
    store = store_for(valkey_server.url)
    keys, values = list(range(4)), blocks(4, 64 * KiB, seed=9)
    assert store.put(keys, values) == [True] * 4
    valkey_server.kill()
    assert store.get(keys) == [None] * 4
    for _ in range(20):
        assert store.put(keys, values) == [False] * 4
        assert store.get(keys) == [None] * 4
    stats = store.stats()
    assert (stats.retries, stats.connection_errors, stats.failures) == (1, 1, 1), stats
    assert stats.skipped == 40 and stats.connects == 1 and stats.server_down
    time.sleep(RETRY_S)
    # After the back-off: a new connection (refused), not a dead one: no retry.
    assert store.get(keys) == [None] * 4
    later = store.stats()
    assert (later.retries, later.connection_errors) == (1, 2), later
    assert_accounted(later)
    valkey_server.start()
    wait_until_used_again(store, keys, values)
    assert exact_or_missing(store, keys, values) == 4
    assert store.stats().retries == 1  # reconnects after a back-off are not retries
