"""Every remote call is bounded: in time by ``timeout_s`` from its start, whatever the link
does; in memory by what the call can accept, whatever the server holds; and in outcome by
the store's contract, whatever bytes come back (a fake server speaks wrong protocol on
purpose). A real server behind a trickling proxy the test starts, a real server holding
oversized values; the fake server only where a real one would never answer so.
"""

from __future__ import annotations

import signal
import threading
import time
import tracemalloc
from collections.abc import Callable, Hashable, Iterator
from types import FrameType
from typing import Any

import pytest
import torch
import valkey

from kvoffload.tiers import ValkeyStore
from kvoffload.tiers.values import encode_key
from tests.planted import CALL_DEADLINE, MALFORMED_REPLIES, REPLY_BOUNDS, Planted, share
from tests.remote_proxies import FakeServer, TrickleProxy
from tests.remote_support import (
    LAYOUT,
    Engine,
    assert_accounted,
    blocks,
    content,
    make_store,
)
from tests.valkey_server import ValkeyServer

KiB, MiB = 1 << 10, 1 << 20
TIMEOUT_S = 1.0
# What a call may take past its deadline: the last wait's wake-up and the call's own work.
MARGIN_S = 0.5
LONGEST: list[float] = []  # every bounded call's time, for the summary line


def server_key(store: ValkeyStore, key: Hashable) -> bytes:
    return store.key_prefix.encode() + encode_key(key)


@pytest.fixture
def trickle(valkey_server: ValkeyServer) -> Iterator[TrickleProxy]:
    with TrickleProxy(valkey_server.port) as proxy:
        yield proxy


def timed(call: Callable[[], object]) -> tuple[object, float]:
    started = time.monotonic()
    result = call()
    took = time.monotonic() - started
    LONGEST.append(took)
    return result, took


def timed_or_cut(call: Callable[[], object], link: TrickleProxy) -> tuple[object, float]:
    """``timed(call)``, but a call still running a second past its deadline has failed: the
    link is cut to end it, rather than waiting out a store that waits per socket operation
    (at 2 KiB every 0.3 s, 1 MiB would hold the test for 150 s)."""
    outcome: list[tuple[object, float]] = []
    caller = threading.Thread(target=lambda: outcome.append(timed(call)), daemon=True)
    started = time.monotonic()
    caller.start()
    caller.join(TIMEOUT_S + MARGIN_S + 1.0)
    if caller.is_alive():
        link.close()
        caller.join(10)
        return None, time.monotonic() - started
    return outcome[0]


# -- time --------------------------------------------------------------------------------


def assert_every_call_is_bounded(
    server: ValkeyServer, trickle: TrickleProxy, store_class: type[ValkeyStore] = ValkeyStore
) -> None:
    """A 1 MiB get, get_into and put through ``trickle``: each is over by its deadline."""
    direct = make_store(server.url)
    value = blocks(1, 1 * MiB, seed=1)[0]
    assert direct.put(["big"], [value]) == [True]
    store = store_class(trickle.url(), namespace=LAYOUT, timeout_s=TIMEOUT_S, retry_after_s=0)
    calls: list[tuple[str, Callable[[], object], object]] = [
        ("get", lambda: store.get(["big"]), [None]),
        ("get_into", lambda: store.get_into(["big"], [bytearray(1 * MiB)]), [False]),
        ("put", lambda: store.put(["other"], [value]), [False]),
    ]
    try:
        for name, call, expected in calls:
            result, took = timed_or_cut(call, trickle)
            assert took <= TIMEOUT_S + MARGIN_S, f"{name} took {took:.2f} s"
            assert result == expected, name
        stats = store.stats()
        assert stats.timeouts == 3 and stats.failures == 3
        assert_accounted(stats)
    finally:
        store.close()


@pytest.mark.slow  # seconds of a trickling link: the full gate
def test_no_call_outlasts_its_deadline_over_a_trickling_link(
    valkey_server: ValkeyServer, trickle: TrickleProxy
) -> None:
    """2 KiB every 0.3 s: each socket operation makes progress, so only a deadline per call
    ends a call of 1 MiB (a timeout per operation held one for 15 s and more)."""
    assert_every_call_is_bounded(valkey_server, trickle)
    print(f"longest call through the trickling proxy: {max(LONGEST):.3f} s")


@pytest.mark.slow  # seconds of a trickling link: the full gate
@pytest.mark.parametrize("entry", share(CALL_DEADLINE), ids=lambda bug: bug.name)
def test_the_deadline_check_finds_its_share_of_the_catalogue(
    valkey_server: ValkeyServer, trickle: TrickleProxy, entry: Planted
) -> None:
    assert isinstance(entry.subject, type) and issubclass(entry.subject, ValkeyStore)
    with pytest.raises(AssertionError, match="took"):
        assert_every_call_is_bounded(valkey_server, trickle, entry.subject)


@pytest.mark.slow  # seconds of a trickling link: the full gate
def test_close_from_another_thread_ends_a_stuck_call_at_once(
    valkey_server: ValkeyServer, trickle: TrickleProxy
) -> None:
    assert make_store(valkey_server.url).put(["big"], blocks(1, 1 * MiB)) == [True]
    store = ValkeyStore(trickle.url(), namespace=LAYOUT, timeout_s=60)
    results: list[object] = []
    caller = threading.Thread(target=lambda: results.append(store.get(["big"])))
    caller.start()
    time.sleep(0.7)  # the call is connected and reading, a few KiB a second
    assert caller.is_alive()
    _, closing = timed(store.close)
    caller.join(5)
    assert not caller.is_alive() and results == [[None]]
    assert closing < MARGIN_S, f"close() waited {closing:.2f} s behind the call"


@pytest.mark.slow  # seconds of a trickling link: the full gate
def test_a_stuck_fetch_gives_the_pool_back_by_its_deadline(
    valkey_server: ValkeyServer, trickle: TrickleProxy
) -> None:
    """Both CPU blocks fetching over a link that takes seconds per block: by the store's
    deadline the fetches are over (misses), the blocks free, and a store() finds one."""
    direct = make_store(valkey_server.url)
    assert direct.put([5, 6], [content(5), content(6)]) == [True, True]
    slow = TrickleProxy(valkey_server.port, piece=256, every_s=0.3)  # 4 KiB: ~5 s
    store = ValkeyStore(slow.url(), namespace=LAYOUT, timeout_s=TIMEOUT_S, retry_after_s=0)
    engine = Engine(store, cpu_blocks=2)
    try:
        started = time.monotonic()
        plans = engine.offloader.fetch([5, 6])
        assert len(plans) == 2
        engine.cache[0] = torch.frombuffer(bytearray(content(1)), dtype=torch.uint8)
        assert engine.offloader.store([1], [0]) is None  # every block is being fetched into
        assert engine.offloader.wait(plans, timeout=TIMEOUT_S + MARGIN_S + 1.0)
        took = time.monotonic() - started
        LONGEST.append(took)
        finished = engine.offloader.poll()
        assert sorted((f.plan.keys[0], f.ok) for f in finished if f.fetched) == [
            (5, False),
            (6, False),
        ]
        assert took <= TIMEOUT_S + MARGIN_S + 0.5, f"the fetches held the pool {took:.2f} s"
        assert engine.offloader.store([1], [0]) is not None
        engine.settle()
    finally:
        engine.close()
        slow.close()


# -- memory ------------------------------------------------------------------------------


def assert_oversized_values_are_never_read(
    server: ValkeyServer, store_class: type[ValkeyStore] = ValkeyStore
) -> None:
    """Four 64 MiB values planted under a victim's keys (SETRANGE: the server makes them,
    nothing crosses the wire): a get_into of 4 x 4 KiB reads no more than its buffers and
    headers, a get no more than max_value_bytes; each oversized value is refused unread."""
    store = store_class(server.url, namespace=LAYOUT, timeout_s=10, max_value_bytes=1 * MiB)
    keys = list(range(4))
    planter = valkey.Valkey.from_url(server.url)
    for key in keys:
        planter.setrange(server_key(store, key), 64 * MiB - 1, b"x")
    buffers = [bytearray(4 * KiB) for _ in keys]
    tracemalloc.start()
    try:
        assert store.get_into(keys, buffers) == [False] * 4
        into_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        assert store.get(keys) == [None] * 4
        get_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        store.close()
    assert buffers == [bytearray(4 * KiB)] * 4  # untouched
    print(f"peak Python memory: get_into {into_peak / KiB:.0f} KiB, get {get_peak / KiB:.0f} KiB")
    # The link's 256 KiB buffer and a 4 KiB scratch; for get, max_value_bytes besides.
    assert into_peak < 1 * MiB, f"get_into held {into_peak / KiB:.0f} KiB"
    assert get_peak < 2 * MiB, f"get held {get_peak / KiB:.0f} KiB"
    stats = store.stats()
    assert stats.rejected_length == 8 and stats.failures == 0
    assert_accounted(stats)


def test_oversized_planted_values_are_never_read(valkey_server: ValkeyServer) -> None:
    assert_oversized_values_are_never_read(valkey_server)
    # The keys are still the store's to use: a real value replaces the planted one.
    store = make_store(valkey_server.url)
    assert store.put([0], [content(0)]) == [True]
    (found,) = store.get([0])
    assert found is not None and found.tobytes() == content(0)


@pytest.mark.parametrize("entry", share(REPLY_BOUNDS), ids=lambda bug: bug.name)
def test_the_memory_bound_finds_its_share_of_the_catalogue(
    valkey_server: ValkeyServer, entry: Planted
) -> None:
    assert isinstance(entry.subject, type) and issubclass(entry.subject, ValkeyStore)
    with pytest.raises(AssertionError, match="held"):
        assert_oversized_values_are_never_read(valkey_server, entry.subject)


# -- outcome -----------------------------------------------------------------------------

MALFORMED = {
    "20,000-deep nesting": b"*2\r\n" + b"*1\r\n" * 20_000,
    "a length that is not a number": b"*2\r\n$abc\r\n",
    "a count that is not a number": b"*x\r\n",
    "a 5000-digit integer": b":" + b"9" * 5000 + b"\r\n",
    "a 5000-digit length": b"*1\r\n$" + b"9" * 5000 + b"\r\n",
    "a negative length": b"*2\r\n$-7\r\n",
    "a line with no end": b"+" + b"x" * 10_000,
    "an unknown type": b"?what\r\n",
    "an empty line": b"\r\n",
    "a bulk longer than announced": b"*2\r\n$1\r\nabc\r\n$1\r\na\r\n",
    "an error that is not text": b"-ERR \xff\xfe\x80\r\n",
    "a negative count": b"*-3\r\n",
    "a closed connection": b"",
}


def assert_a_malformed_reply_is_a_counted_failure(
    reply: bytes, store_class: type[ValkeyStore] = ValkeyStore
) -> None:
    """Every call answered ``reply`` fails, counted, and nothing it provokes reaches the
    caller."""
    with FakeServer(lambda data: reply or None) as fake:
        store = store_class(fake.url(), namespace=LAYOUT, timeout_s=0.5, retry_after_s=0)
        keys = [1, 2]
        try:
            assert store.get(keys) == [None, None]
            assert store.get_into(keys, [bytearray(8), bytearray(8)]) == [False, False]
            assert store.put(keys, [b"a" * 8, b"b" * 8]) == [False, False]
            assert store.contains(keys) == [False, False]
            assert store.delete(keys) == [False, False]
            assert store.ping() is False
        except AssertionError:
            raise
        except Exception as error:
            raise AssertionError(f"{error!r:.80} raised into the caller") from error
        finally:
            store.close()
        stats = store.stats()
        assert stats.hits == 0 and stats.keys_stored == 0
        assert stats.failures >= 5, stats  # an error reply to MGET, counted, keeps the link
        assert_accounted(stats)


@pytest.mark.parametrize("reply", list(MALFORMED.values()), ids=list(MALFORMED))
def test_a_malformed_reply_is_a_counted_failure_never_an_exception(reply: bytes) -> None:
    assert_a_malformed_reply_is_a_counted_failure(reply)


@pytest.mark.parametrize("entry", share(MALFORMED_REPLIES), ids=lambda bug: bug.name)
def test_the_malformed_replies_find_their_share_of_the_catalogue(entry: Planted) -> None:
    assert isinstance(entry.subject, type) and issubclass(entry.subject, ValkeyStore)
    caught: list[str] = []
    for name, reply in MALFORMED.items():
        try:
            assert_a_malformed_reply_is_a_counted_failure(reply, entry.subject)
        except AssertionError as failure:
            assert "raised into the caller" in str(failure), failure
            caught.append(name)
    print(f"{entry.name}: caught by {caught}")
    assert caught, f"no malformed reply told {entry.name!r} from the real store"


class Interrupted(Exception):
    """What a signal handler raises in the middle of a send."""


@pytest.mark.slow  # seconds of a trickling link: the full gate
def test_a_send_interrupted_midway_drops_the_connection(
    valkey_server: ValkeyServer, trickle: TrickleProxy
) -> None:
    """A signal handler's exception inside a put's send: the put raises it, the half-sent
    MSET goes with its connection, and the next call, on a new one, is answered in step."""
    store = ValkeyStore(trickle.url(), namespace=LAYOUT, timeout_s=30)
    values = blocks(2, 8 * MiB, seed=4)

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise Interrupted

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    try:
        with pytest.raises(Interrupted):
            store.put([1, 2], values)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    trickle.piece, trickle.every_s = 1 << 20, 0.0  # the link is fast again
    small = blocks(3, 4 * KiB, seed=5)
    assert store.put([3, 4, 5], small) == [True] * 3
    assert [None if v is None else v.tobytes() for v in store.get([1, 3, 4, 5])] == [
        None,
        *small,
    ]
    stats = store.stats()
    assert stats.connects == 2 and stats.failures == 0


@pytest.mark.slow  # seconds of a trickling link: the full gate
def test_a_name_lookup_that_hangs_is_under_the_call_deadline(
    valkey_server: ValkeyServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The C resolver has no timeout of ours (a DNS server that does not answer holds
    ``getaddrinfo`` for 5 s per try and more): the lookup runs beside the call, which ends
    by its deadline. The resolver here is made to hang for one name; literals never ask it,
    and a name that resolves connects as before."""
    import socket

    real = socket.getaddrinfo
    release = threading.Event()

    def hanging(host: object, *args: Any, **kwargs: Any) -> Any:
        numeric = len(args) >= 5 and args[4] & socket.AI_NUMERICHOST
        if host == "stuck.invalid" and not numeric:  # a literal is never looked up
            release.wait(30)
        return real(host, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(socket, "getaddrinfo", hanging)
    try:
        url = f"redis://stuck.invalid:{valkey_server.port}/0"
        store = ValkeyStore(url, namespace=LAYOUT, timeout_s=TIMEOUT_S, retry_after_s=0)
        result, took = timed(lambda: store.put(["k"], [b"block"]))
        assert result == [False] and took <= TIMEOUT_S + MARGIN_S, f"took {took:.2f} s"
        assert store.stats().timeouts == 1
        by_name = ValkeyStore(
            f"redis://localhost:{valkey_server.port}/0", namespace=LAYOUT, timeout_s=5
        )
        assert by_name.put(["k"], [b"block"]) == [True]
        assert [v and v.tobytes() for v in by_name.get(["k"])] == [b"block"]
        store.close()
        by_name.close()
    finally:
        release.set()
