"""How a store is configured and reached: its URL checked whole at construction, the
password never shown, TLS through a terminating proxy, a least-privilege ACL user, and the
accounting of what a server answers (a real server each, started by the test)."""

from __future__ import annotations

import gc
import json
import os
import threading
import time
from pathlib import Path

import pytest
import valkey

from kvoffload.tiers import StoreClosedError, ValkeyStore, acl_rule
from kvoffload_spec.errors import InvalidArgumentError
from tests.helpers import run_cli
from tests.remote_proxies import SelfSigned, TlsProxy
from tests.remote_support import LAYOUT, Engine, assert_accounted, blocks, content, make_store
from tests.valkey_server import ValkeyServer, free_port

KiB = 1 << 10
PASSWORD = "hunter2-not-for-logs"

BAD_URLS = {
    "an unknown option": "redis://127.0.0.1:6379/0?foo=bar",
    "a client library's pool option": "redis://127.0.0.1:6379/0?max_connections=5",
    "a client library's decoding option": "redis://127.0.0.1:6379/0?decode_responses=1",
    "a timeout in the URL": "redis://127.0.0.1:6379/0?timeout_s=1e300",
    "port 0": "redis://127.0.0.1:0/0",
    "a port out of range": "redis://127.0.0.1:70000/0",
    "a database that is not a number": "redis://127.0.0.1:6379/abc",
    "the database twice": "redis://127.0.0.1:6379/1?db=2",
    "another scheme": "http://127.0.0.1:6379/0",
    "no host": "redis:///0",
    "TLS options without TLS": "redis://127.0.0.1:6379/0?tls_verify=no",
    "a TLS flag that is no flag": "rediss://127.0.0.1:6379/0?tls_verify=maybe",
    "a CA file that is not there": "rediss://127.0.0.1:6379/0?tls_ca_file=/nonexistent.pem",
}


@pytest.mark.parametrize("url", list(BAD_URLS.values()), ids=list(BAD_URLS))
def test_a_bad_url_is_refused_at_construction_without_its_password(url: str) -> None:
    with_password = url.replace("://", f"://user:{PASSWORD}@", 1)
    for candidate in (url, with_password):
        with pytest.raises(InvalidArgumentError) as refused:
            ValkeyStore(candidate, namespace=LAYOUT)
        assert PASSWORD not in str(refused.value)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("timeout_s", 1e300),
        ("timeout_s", 0),
        ("timeout_s", float("nan")),
        ("retry_after_s", -1),
        ("max_value_bytes", 0),
        ("max_value_bytes", 1 << 40),
        ("secret", b"short"),
        ("secret", ""),
    ],
)
def test_a_bad_option_is_refused_at_construction(option: str, value: object) -> None:
    with pytest.raises(InvalidArgumentError):
        ValkeyStore("redis://127.0.0.1:6379/0", namespace=LAYOUT, **{option: value})  # type: ignore[arg-type]


def test_the_password_is_shown_nowhere(valkey_server: ValkeyServer) -> None:
    url = f"redis://tenant:{PASSWORD}@127.0.0.1:{valkey_server.port}/0"
    store = ValkeyStore(url, namespace=LAYOUT, timeout_s=5)
    assert store.url == f"redis://tenant:***@127.0.0.1:{valkey_server.port}/0"
    assert store.get([1]) == [None]  # refused: no such user
    shown = [repr(store), store.url, str(store.stats())]
    store.close()
    with pytest.raises(StoreClosedError) as closed:
        store.get([1])
    shown.append(str(closed.value))
    assert all(PASSWORD not in text for text in shown), shown
    assert all("***" in text for text in shown[:2] + shown[3:])


def test_simulate_remote_shows_the_url_without_its_password(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with ValkeyServer() as server:
        valkey.Valkey.from_url(server.url).config_set("requirepass", PASSWORD)
        url = f"redis://:{PASSWORD}@127.0.0.1:{server.port}/0"
        argv = ["simulate", "--trace", "conversation", "--requests", "40", "--gpu-blocks", "256"]
        argv += ["--cpu-blocks", "64", "--block-bytes", "1KiB", "--remote", url]
        code, out, err = run_cli([*argv, "--json"], capsys)
        assert code == 0 and PASSWORD not in out + err
        report = json.loads(out)
        assert report["remote"] == f"redis://:***@127.0.0.1:{server.port}/0"
        code, out, err = run_cli(argv, capsys)
        assert code == 0 and PASSWORD not in out + err and ":***@" in out


# -- TLS ---------------------------------------------------------------------------------


def test_rediss_through_a_tls_terminating_proxy(
    valkey_server: ValkeyServer, tmp_path: Path
) -> None:
    certificate = SelfSigned(tmp_path)
    with TlsProxy(valkey_server.port, certificate) as proxy:
        values = blocks(3, 256 * KiB, seed=3)
        by_url = ValkeyStore(
            proxy.url("rediss") + f"?tls_ca_file={certificate.cert_file}",
            namespace=LAYOUT,
            timeout_s=10,
        )
        assert by_url.put([1, 2, 3], values) == [True] * 3
        by_argument = ValkeyStore(
            proxy.url("valkeys"),
            namespace=LAYOUT,
            timeout_s=10,
            tls_ca_file=str(certificate.cert_file),
        )
        unverified = ValkeyStore(
            proxy.url("rediss") + "?tls_verify=no", namespace=LAYOUT, timeout_s=10
        )
        for store in (by_url, by_argument, unverified):
            got = store.get([1, 2, 3])
            assert [None if view is None else view.tobytes() for view in got] == values
            assert store.stats().failures == 0
        # Verified against the system's CAs, the self-signed server is refused: counted.
        untrusted = ValkeyStore(proxy.url("rediss"), namespace=LAYOUT, timeout_s=10)
        assert untrusted.get([1]) == [None]
        stats = untrusted.stats()
        assert stats.connection_errors == 1 and "SSL" in (stats.last_error or "")
        # The plain protocol to a TLS port is no answer either, never an exception.
        plain = ValkeyStore(proxy.url("redis"), namespace=LAYOUT, timeout_s=1, retry_after_s=0)
        assert plain.get([1]) == [None] and plain.stats().failures == 1
        for store in (by_url, by_argument, unverified, untrusted, plain):
            store.close()


# -- ACL ---------------------------------------------------------------------------------


def test_a_user_allowed_only_the_stores_commands_can_run_every_call(
    valkey_server: ValkeyServer,
) -> None:
    """No CLIENT SETNAME, no SELECT on db 0, no INFO: the store sends none of them."""
    admin = valkey.Valkey.from_url(valkey_server.url)
    probe = make_store(valkey_server.url)
    admin.execute_command(*acl_rule("tenant", PASSWORD, probe.key_prefix).split())  # type: ignore[no-untyped-call]
    url = f"redis://tenant:{PASSWORD}@127.0.0.1:{valkey_server.port}/0"
    store = ValkeyStore(url, namespace=LAYOUT, timeout_s=10)
    assert store.ping()
    assert store.put([1, 2], [content(1), content(2)]) == [True, True]
    assert [v is not None and v.tobytes() for v in store.get([1, 2])] == [content(1), content(2)]
    assert store.get_into([1], [bytearray(len(content(1)))]) == [True]
    assert store.contains([1, 3]) == [True, False]
    assert store.delete([1]) == [True]
    stats = store.stats()
    assert stats.failures == 0, stats.last_error
    tenant = valkey.Valkey(port=valkey_server.port, username="tenant", password=PASSWORD)
    with pytest.raises(valkey.exceptions.NoPermissionError):
        tenant.execute_command("CLIENT", "SETNAME", "x")  # type: ignore[no-untyped-call]


# -- accounting --------------------------------------------------------------------------


def test_masterdown_counts_once_and_keeps_the_connection() -> None:
    with ValkeyServer(replica_serve_stale_data="no") as server:
        store = ValkeyStore(server.url, namespace=LAYOUT, timeout_s=5, retry_after_s=0.2)
        assert store.ping()
        valkey.Valkey.from_url(server.url).execute_command(  # type: ignore[no-untyped-call]
            "REPLICAOF", "127.0.0.1", free_port()
        )
        assert store.get([1, 2]) == [None, None]
        stats = store.stats()
        assert (stats.failures, stats.server_errors, stats.connects) == (1, 1, 1), stats
        assert stats.server_down and "MASTERDOWN" in (stats.last_error or "")
        assert store.get([1]) == [None] and store.stats().skipped == 1  # backed off
        time.sleep(0.3)
        assert store.get([1]) == [None]
        stats = store.stats()
        assert (stats.failures, stats.connects) == (2, 1)
        assert_accounted(stats)


def test_stats_read_during_other_threads_calls_keep_their_identities(
    valkey_server: ValkeyServer,
) -> None:
    store = make_store(valkey_server.url)
    values = blocks(16, 16 * KiB, seed=6)
    keys = list(range(16))
    done = threading.Event()

    def work() -> None:
        while not done.is_set():
            store.put(keys, values)
            store.get([*keys, 99])
            store.get_into(keys[:4], [bytearray(16 * KiB) for _ in range(4)])

    workers = [threading.Thread(target=work) for _ in range(2)]
    for worker in workers:
        worker.start()
    try:
        deadline = time.monotonic() + 1.5
        snapshots = 0
        while time.monotonic() < deadline:
            assert_accounted(store.stats())
            snapshots += 1
    finally:
        done.set()
        for worker in workers:
            worker.join(10)
    stats = store.stats()
    assert snapshots > 100 and stats.get_calls > 10
    assert_accounted(stats)


def test_an_int_key_too_long_to_write_is_refused_typed(valkey_server: ValkeyServer) -> None:
    store = make_store(valkey_server.url)
    for call in (store.get, store.contains, store.delete):
        with pytest.raises(InvalidArgumentError):
            call([10**5000])
    with pytest.raises(InvalidArgumentError):
        store.put([10**5000], [b"x"])
    assert store.put([10**4000], [b"x"]) == [True]  # long, but it fits a key
    assert store.stats().keys_requested == 0


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_an_offloader_dropped_without_close_leaks_no_thread_nor_socket(
    valkey_server: ValkeyServer,
) -> None:
    def use_one() -> None:
        engine = Engine(make_store(valkey_server.url))
        assert engine.store(1) is not None
        assert engine.fetch([7]) == {7: False}  # the store's socket is open now
        # Dropped here: no close() of the offloader, nor of the store.

    use_one()  # the first one imports and warms what stays (torch's threads)
    gc.collect()
    threads, fds = threading.active_count(), open_fds()
    for _ in range(5):
        use_one()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        gc.collect()
        if threading.active_count() <= threads and open_fds() <= fds:
            break
        time.sleep(0.05)
    assert (threading.active_count(), open_fds()) == (threads, fds)


def test_a_unix_socket_and_a_database_by_query(tmp_path: Path) -> None:
    path = tmp_path / "valkey.sock"
    with ValkeyServer(unixsocket=str(path), unixsocketperm="700") as server:
        store = ValkeyStore(f"unix://{path}?db=3", namespace=LAYOUT, timeout_s=10)
        assert store.put([1], [content(1)]) == [True]
        (found,) = store.get([1])
        assert found is not None and found.tobytes() == content(1)
        assert valkey.Valkey.from_url(server.url).dbsize() == 0  # db 0: not there
        assert valkey.Valkey(port=server.port, db=3).dbsize() == 2  # and the description
        assert store.stats().failures == 0
