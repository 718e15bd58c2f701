"""The cluster map's parsing, without a server: CLUSTER NODES lines (migrating slots,
replicas, failing nodes), redirects, seed URLs; and a hostile node whose CLUSTER NODES
announces more than the store reads (a protocol error, counted; nothing allocated)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from kvoffload.tiers.cluster_map import (
    MAX_MAP_BYTES,
    Endpoint,
    parse_nodes,
    parse_redirect,
    seed_addresses,
)
from kvoffload.tiers.connection import ProtocolError
from kvoffload.tiers.valkey_store import ValkeyStore
from kvoffload_spec.errors import InvalidArgumentError
from tests.remote_support import assert_accounted

A = "a" * 40
B = "b" * 40
C = "c" * 40
NODES = (
    f"{A} 127.0.0.1:7000@17000,host-a myself,master - 0 0 1 connected 0-100 102 [101->-{B}]\n"
    f"{B} 127.0.0.1:7001@17001 master - 0 0 2 connected 101 103-16383 [102-<-{A}]\n"
    f"{C} 127.0.0.1:7002@17002 slave,fail? {A} 0 0 1 connected\n"
).encode()


def test_nodes_parsed() -> None:
    found = parse_nodes(NODES)
    a, b = Endpoint("127.0.0.1", 7000), Endpoint("127.0.0.1", 7001)
    assert found.owners[0] == found.owners[100] == found.owners[102] == a
    assert found.owners[101] == found.owners[103] == found.owners[16383] == b
    assert found.primaries == {a, b}
    assert found.failing == {Endpoint("127.0.0.1", 7002)}
    assert found.moved(5, b).owners[5] == b


@pytest.mark.parametrize(
    "text",
    [
        b"garbage\n",
        f"{A} 127.0.0.1:7000 master - 0 0 1 connected 0-5\n".encode(),
        f"{A} 127.0.0.1:7000@1 master - 0 0 1 connected 0-16384\n".encode(),
        f"{A} 127.0.0.1:7000@1 master - 0 0 1 connected 5-x\n".encode(),
    ],
)
def test_malformed_nodes_refused(text: bytes) -> None:
    with pytest.raises(ProtocolError):
        parse_nodes(text)


def test_redirects() -> None:
    assert parse_redirect("MOVED 3999 127.0.0.1:6381") == (3999, Endpoint("127.0.0.1", 6381))
    assert parse_redirect("ASK 1 ::1:6381") == (1, Endpoint("::1", 6381))
    for bad in ("MOVED", "MOVED x 1:2", "MOVED 1 host", "MOVED 16384 h:1", "MOVED 1 h:0"):
        assert parse_redirect(bad) is None


def test_seed_urls() -> None:
    seeds = seed_addresses("redis://u:p@w,x@h1:1,h2:2", tls_ca_file=None, tls_verify=None)
    assert [(s.host, s.port, s.username, s.password) for s in seeds] == [
        ("h1", 1, "u", "p@w,x"),
        ("h2", 2, "u", "p@w,x"),
    ]
    for bad in ("unix:///tmp/s", "redis://h1:1,h2:2/3", "nothing", "redis://h1:1,,h2"):
        with pytest.raises(InvalidArgumentError):
            seed_addresses(bad, tls_ca_file=None, tls_verify=None)


@pytest.fixture
def hostile() -> Iterator[int]:
    """A node whose every reply announces a bulk string over the map's limit."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.05)  # to see the stop flag (a close does not end an accept)
    port = listener.getsockname()[1]
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(2.0)
            with conn:
                try:
                    conn.recv(65536)
                    conn.sendall(b"$%d\r\nabc" % (MAX_MAP_BYTES + 1))
                    conn.recv(65536)
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield port
    stop.set()
    thread.join(timeout=5)
    listener.close()


def test_an_oversized_map_is_a_protocol_error(hostile: int) -> None:
    url = f"redis://127.0.0.1:{hostile}"
    with ValkeyStore(url, namespace="x", cluster=True, timeout_s=0.5) as remote:
        assert remote.get([("a", i) for i in range(5)]) == [None] * 5
        stats = remote.stats()
        assert stats.protocol_errors == 1 and stats.unavailable == 5, stats
        assert_accounted(stats)


def test_no_seed_answers() -> None:
    from tests.valkey_server import free_port

    url = f"redis://127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    with ValkeyStore(url, namespace="x", cluster=True, retry_after_s=60) as remote:
        keys = [("a", i) for i in range(5)]
        assert remote.get(keys) == [None] * 5
        assert remote.put(keys, [b"v"] * 5) == [False] * 5
        assert remote.contains(keys) == [False] * 5 and not remote.ping()
        stats = remote.stats()
        assert stats.connection_errors == 2 and stats.failures == 2, stats  # each seed once
        assert stats.unavailable == 5 and stats.keys_not_stored == 5
        assert_accounted(stats)
