"""The remote tier on a real Valkey server: bytes round-trip exactly, namespaces stay apart,
and every corrupt, foreign or stale value is a miss, never returned.

Each test gets its own server (tests/valkey_server.py, started by the ``valkey_server``
fixture); corrupt values are planted with the plain client, under the store's own keys.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np
import pytest
import valkey

from kvoffload.tiers import Namespace, RemoteStore, StoreClosedError, ValkeyStore
from kvoffload.tiers import valkey_store as valkey_store_module
from kvoffload.tiers.connection import send_gathered
from kvoffload.tiers.values import HEADER_BYTES, encode_key, frame
from kvoffload_spec.errors import InvalidArgumentError, OffloadError
from tests.remote_support import LAYOUT, assert_accounted, blocks
from tests.valkey_server import ValkeyServer

KiB, MiB = 1 << 10, 1 << 20


def store_on(server: ValkeyServer, namespace: object = None) -> ValkeyStore:
    # a timeout no busy machine reaches: these tests expect every call to succeed
    return ValkeyStore(server.url, namespace=namespace or LAYOUT, timeout_s=10)  # type: ignore[arg-type]


def raw(server: ValkeyServer) -> valkey.Valkey:
    return valkey.Valkey.from_url(server.url)


def info(client: valkey.Valkey, section: str) -> dict[str, Any]:
    found = client.info(section)
    assert isinstance(found, dict)
    return found


def server_key(store: ValkeyStore, key: Hashable) -> bytes:
    return store.namespace.key_prefix + encode_key(key)


# -- round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize(("count", "size"), [(64, 64 * KiB), (16, 2 * MiB)])
def test_one_batch_round_trips_byte_exact(
    valkey_server: ValkeyServer, count: int, size: int
) -> None:
    store = store_on(valkey_server)
    assert isinstance(store, RemoteStore)
    values = blocks(count, size)
    keys = [("block", i) for i in range(count)]
    assert store.put(keys, values) == [True] * count
    got = store.get(keys)
    assert [None if view is None else view.tobytes() for view in got] == values
    assert all(view is not None and view.readonly for view in got)
    buffers = [bytearray(size) for _ in range(count)]
    assert store.get_into(keys, buffers) == [True] * count
    assert [bytes(buffer) for buffer in buffers] == values
    stats = store.stats()
    assert (stats.hits, stats.misses, stats.keys_stored) == (2 * count, 0, count)
    assert stats.bytes_sent == count * size and stats.bytes_received == 2 * count * size
    assert stats.bytes_copied == count * size  # get_into's one copy; put and get copy nothing
    assert stats.failures == 0 and stats.connects == 1
    assert_accounted(stats)


def test_any_buffer_goes_in_and_mixed_batches_come_out(valkey_server: ValkeyServer) -> None:
    store = store_on(valkey_server)
    array = np.arange(3 * 1024, dtype=np.float32).reshape(3, 1024)
    values: list[bytes | bytearray | memoryview] = [
        b"",
        b"x",
        bytearray(b"a small block"),
        array.data,
        memoryview(bytes(range(256)) * 300)[100:20_100],
    ]
    keys: list[Hashable] = [0, -1, "s", b"b", (1, "two", b"3", (4,))]
    assert store.put(keys, values) == [True] * 5
    asked = [*keys, 7, 0]
    got = store.get(asked)
    expected = [bytes(memoryview(v).cast("B")) for v in values]
    assert [None if view is None else view.tobytes() for view in got] == [*expected, None, b""]
    assert got[3] is not None
    assert np.array_equal(np.frombuffer(got[3], dtype=np.float32).reshape(3, 1024), array)
    stats = store.stats()
    assert (stats.hits, stats.misses, stats.keys_requested) == (6, 1, 7)
    assert_accounted(stats)


def test_keys_of_each_type_are_distinct_and_stable() -> None:
    encoded = [encode_key(key) for key in (1, "1", b"1", (1,), ("1",), (1, 2), ((1, 2),))]
    assert len(set(encoded)) == len(encoded)
    assert encode_key(np.int64(5)) == encode_key(5) == b"i5"
    assert encode_key(True) == encode_key(1)  # as in a dict: True and 1 are one key
    assert encode_key((1, (b"a", "b"))) == b"t2:i19:t2:ba2:sb"
    # a tuple's parts are framed by length: no two tuples encode alike
    assert encode_key(("a:", "b")) != encode_key(("a", ":b"))


def test_put_overwrites_and_delete_and_contains_answer_per_key(
    valkey_server: ValkeyServer,
) -> None:
    store = store_on(valkey_server)
    assert store.put([1, 2, 1], [b"old", b"two", b"new"]) == [True] * 3
    assert [v and v.tobytes() for v in store.get([1, 2])] == [b"new", b"two"]
    assert store.contains([1, 2, 3]) == [True, True, False]
    assert store.delete([2, 3, 2]) == [True, False, False]
    assert store.contains([1, 2]) == [True, False]
    assert store.get([2]) == [None]
    assert store.put([], []) == [] and store.get([]) == [] and store.delete([]) == []
    assert store.ping()
    stats = store.stats()
    assert (stats.delete_calls, stats.keys_deleted, stats.contains_calls) == (2, 1, 2)
    assert_accounted(stats)


def test_a_batch_over_the_command_limit_goes_as_several_msets(
    valkey_server: ValkeyServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(valkey_store_module, "MAX_COMMAND_BYTES", 200 * KiB)
    store = store_on(valkey_server)
    values = blocks(10, 64 * KiB, seed=3)
    client = raw(valkey_server)
    before = info(client, "commandstats").get("cmdstat_mset", {}).get("calls", 0)
    assert store.put(list(range(10)), values) == [True] * 10
    # 3+3+3+1 blocks, and the namespace's description after the first
    assert info(client, "commandstats")["cmdstat_mset"]["calls"] - before == 5
    assert [v and v.tobytes() for v in store.get(list(range(10)))] == values


# -- namespaces ----------------------------------------------------------------------------


def test_two_namespaces_share_a_server_and_not_their_blocks(valkey_server: ValkeyServer) -> None:
    first = store_on(valkey_server, LAYOUT)
    second = store_on(valkey_server, {**LAYOUT, "dtype": "float16"})
    assert first.namespace.fingerprint != second.namespace.fingerprint
    keys = list(range(8))
    mine, theirs = blocks(8, 4 * KiB, seed=1), blocks(8, 4 * KiB, seed=2)
    assert first.put(keys, mine) == [True] * 8
    assert second.get(keys) == [None] * 8
    assert second.put(keys, theirs) == [True] * 8
    assert [v and v.tobytes() for v in first.get(keys)] == mine
    assert [v and v.tobytes() for v in second.get(keys)] == theirs
    assert second.delete(keys) == [True] * 8
    assert [v and v.tobytes() for v in first.get(keys)] == mine
    assert raw(valkey_server).dbsize() == 8 + 2  # and each namespace's description


def test_a_namespace_is_its_description_whatever_the_order() -> None:
    one = Namespace.of({"model": "m", "layout": {"layers": 2, "bytes": 4096}})
    two = Namespace.of({"layout": {"bytes": 4096, "layers": 2}, "model": "m"})
    assert one == two and Namespace.of(one) is one
    assert Namespace.of("m/bf16/16") != Namespace.of("m/bf16/32")
    assert len(one.fingerprint) == 16 and one.key_prefix.startswith(b"kvo1:")


# -- refused values ------------------------------------------------------------------------


def corruptions(
    store: ValkeyStore, other_namespace: ValkeyStore
) -> dict[str, tuple[Callable[[bytes], bytes], str]]:
    """name -> (how the stored value of key 0 is rewritten, the counter that must count it)"""
    payload_of_key_1 = frame(store.namespace, encode_key(1), memoryview(b"y" * 4096))
    foreign = frame(other_namespace.namespace, encode_key(0), memoryview(b"x" * 4096))

    def flip(offset: int) -> Callable[[bytes], bytes]:
        def flipped(value: bytes) -> bytes:
            at = offset % len(value)
            return value[:at] + bytes([value[at] ^ 0x01]) + value[at + 1 :]

        return flipped

    return {
        "payload byte flipped": (flip(-1), "rejected_checksum"),
        "first payload byte flipped": (
            flip(HEADER_BYTES + len(encode_key(0))),
            "rejected_checksum",
        ),
        "checksum flipped": (flip(35), "rejected_checksum"),
        "length field changed": (flip(24), "rejected_length"),
        "truncated by one byte": (lambda value: value[:-1], "rejected_length"),
        "truncated to half": (lambda value: value[: len(value) // 2], "rejected_length"),
        "one byte appended": (lambda value: value + b"\0", "rejected_length"),
        "header only": (
            lambda value: value[: HEADER_BYTES + len(encode_key(0))],
            "rejected_length",
        ),
        "another key's value": (lambda value: payload_of_key_1, "rejected_wrong_key"),
        "key field flipped": (flip(HEADER_BYTES), "rejected_wrong_key"),
        "another namespace's value": (lambda value: foreign, "rejected_foreign"),
        "another format version": (flip(3), "rejected_foreign"),
        "shorter than a header": (lambda value: value[:10], "rejected_malformed"),
        "empty": (lambda value: b"", "rejected_malformed"),
        "plain bytes": (lambda value: b"x" * 4096, "rejected_foreign"),
    }


def test_each_corrupt_form_is_a_miss_and_counted(valkey_server: ValkeyServer) -> None:
    store = store_on(valkey_server)
    other = store_on(valkey_server, {**LAYOUT, "model": "another"})
    client = raw(valkey_server)
    original = b"x" * 4096
    forms = corruptions(store, other)
    for name, (rewrite, counter) in forms.items():
        assert store.put([0], [original]) == [True]
        stored = client.get(server_key(store, 0))
        assert isinstance(stored, bytes)
        client.set(server_key(store, 0), rewrite(stored))
        before = store.stats()
        assert store.get([0]) == [None], name
        untouched = bytearray(b"\xaa" * 4096)
        assert store.get_into([0], [untouched]) == [False], name
        assert untouched == b"\xaa" * 4096, name
        after = store.stats()
        assert getattr(after, counter) - getattr(before, counter) == 2, (name, after)
        assert after.rejected - before.rejected == 2 and after.hits == before.hits, name
        assert_accounted(after)
    # the same value, rewritten back exactly, is accepted again
    assert store.put([0], [original]) == [True]
    assert [v and v.tobytes() for v in store.get([0])] == [original]


def test_a_valid_value_of_another_size_is_not_copied_into_a_buffer(
    valkey_server: ValkeyServer,
) -> None:
    store = store_on(valkey_server)
    assert store.put([0, 1], [b"a" * 100, b"b" * 64]) == [True, True]
    small, exact = bytearray(64), bytearray(64)
    assert store.get_into([0, 1], [small, exact]) == [False, True]
    assert small == bytearray(64) and exact == b"b" * 64
    stats = store.stats()
    assert (stats.hits, stats.rejected_length) == (1, 1)
    assert_accounted(stats)


# -- bad arguments -------------------------------------------------------------------------


def bad_calls(store: ValkeyStore) -> dict[str, Callable[[], object]]:
    fortran = np.zeros((4, 4), dtype=np.uint8, order="F")
    return {
        # a str and bytes are sequences to a type checker: only the store refuses them
        "keys as a str": lambda: store.get("abc"),
        "keys as bytes": lambda: store.put(b"ab", [b"1", b"2"]),
        "keys not a sequence": lambda: store.get({1, 2}),  # type: ignore[arg-type]
        "a float key": lambda: store.put([1, 2.5], [b"1", b"2"]),
        "a list key": lambda: store.get([[1]]),  # type: ignore[list-item]
        "a key too long": lambda: store.put([b"k" * 5000], [b"v"]),
        "tuples nested too deep": lambda: store.get([((((((((((1,),),),),),),),),),)]),
        "fewer values than keys": lambda: store.put([1, 2], [b"1"]),
        "values as bytes": lambda: store.put([1], b"1"),  # type: ignore[arg-type]
        "a value that is no buffer": lambda: store.put([1, 2], [b"1", "two"]),  # type: ignore[list-item]
        "a non-contiguous value": lambda: store.put([1], [fortran.data]),
        "a read-only buffer": lambda: store.get_into([1], [memoryview(b"1234")]),
        "fewer buffers than keys": lambda: store.get_into([1, 2], [bytearray(1)]),
        "a bad key among good ones": lambda: store.delete([1, object()]),
        "contains a bad key": lambda: store.contains([1, None]),
    }


def test_bad_arguments_raise_before_anything_is_sent(valkey_server: ValkeyServer) -> None:
    store = store_on(valkey_server)
    assert store.put([1, 2], [b"1", b"2"]) == [True, True]
    client = raw(valkey_server)
    before_stats = store.stats()
    before_calls = info(client, "stats")["total_commands_processed"]
    for name, call in bad_calls(store).items():
        with pytest.raises(InvalidArgumentError):
            call()
        assert store.stats() == before_stats, name
    # only the INFO call itself reached the server
    assert info(client, "stats")["total_commands_processed"] == before_calls + 1
    assert client.dbsize() == 2 + 1  # and the namespace's description


@pytest.mark.parametrize(
    ("url", "options"),
    [
        ("http://127.0.0.1:1", {}),
        ("127.0.0.1:6379", {}),
        (42, {}),
        ("redis://127.0.0.1:1", {"timeout_s": 0}),
        ("redis://127.0.0.1:1", {"timeout_s": float("inf")}),
        ("redis://127.0.0.1:1", {"timeout_s": True}),
        ("redis://127.0.0.1:1", {"retry_after_s": -1}),
        ("redis://127.0.0.1:1", {"namespace": ""}),
        ("redis://127.0.0.1:1", {"namespace": {}}),
        ("redis://127.0.0.1:1", {"namespace": {"dtype": object()}}),
        ("redis://127.0.0.1:1", {"namespace": {"nan": float("nan")}}),
        ("redis://127.0.0.1:1", {"namespace": 7}),
    ],
)
def test_a_bad_configuration_is_refused_at_construction(url: object, options: object) -> None:
    arguments = {"namespace": LAYOUT, **options}  # type: ignore[dict-item]
    with pytest.raises(InvalidArgumentError):
        ValkeyStore(url, **arguments)  # type: ignore[arg-type]


def test_a_closed_store_refuses_calls(valkey_server: ValkeyServer) -> None:
    with store_on(valkey_server) as store:
        assert store.put([1], [b"1"]) == [True]
    for call in (
        lambda: store.get([1]),
        lambda: store.put([1], [b"1"]),
        lambda: store.get_into([1], [bytearray(1)]),
        lambda: store.contains([1]),
        lambda: store.delete([1]),
        store.ping,
    ):
        with pytest.raises(StoreClosedError) as raised:
            call()
        assert isinstance(raised.value, OffloadError)
    store.close()  # twice is fine


# -- copies --------------------------------------------------------------------------------


def traced_peak(work: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        work()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def test_a_put_copies_no_payload_and_a_get_no_more_than_the_client(
    valkey_server: ValkeyServer,
) -> None:
    store = store_on(valkey_server)
    values = [memoryview(v) for v in blocks(8, 2 * MiB, seed=5)]
    keys = list(range(8))
    payload_bytes = 8 * 2 * MiB
    store.put(keys, values)  # connected, warmed up
    assert traced_peak(lambda: store.put(keys, values)) < payload_bytes // 20
    client = raw(valkey_server)
    client.mset({f"raw{i}": value for i, value in enumerate(values)})
    client_peak = traced_peak(lambda: client.mget([f"raw{i}" for i in keys]))
    store_peak = traced_peak(lambda: store.get(keys))
    assert client_peak >= payload_bytes  # the client's reply holds the bytes once at least
    assert store_peak <= client_peak + payload_bytes // 20
    assert store.stats().bytes_copied == 0


def test_blocks_go_from_a_torch_pool_slot_and_come_back_into_another(
    valkey_server: ValkeyServer,
) -> None:
    """The path an engine takes: a CPU pool slot's bytes out, a free slot filled in place."""
    import torch

    kv = torch.randn(4, 2, 16, 1024, dtype=torch.bfloat16)  # 4 blocks of 64 KiB, bf16
    pool = kv.view(4, -1).view(torch.uint8)  # the same memory, one row of bytes per block
    store = store_on(valkey_server)
    assert store.put(["a", "b"], [pool[0].numpy().data, pool[1].numpy().data]) == [True] * 2
    before = kv.clone()
    assert store.get_into(["b", "missing"], [pool[3].numpy().data, pool[2].numpy().data]) == [
        True,
        False,
    ]
    assert torch.equal(kv[3], before[1]) and torch.equal(kv[:3], before[:3])
    assert store.stats().bytes_copied == pool[0].numel()


# -- the gathered send -----------------------------------------------------------------------


def test_a_gathered_send_survives_short_sends_byte_exact() -> None:
    """A socket with a small send buffer takes a part of each sendmsg: the rest, cut
    anywhere inside a buffer, goes out next, in order, nothing twice or skipped."""
    import socket
    import threading

    sender, receiver = socket.socketpair()
    sender.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    sender.settimeout(30)  # as the store's sockets: sendmsg returns what the buffer took
    pieces = [memoryview(piece) for piece in blocks(40, 1, seed=11)]  # 1-byte buffers
    pieces += [memoryview(b""), *(memoryview(piece) for piece in blocks(5, 300 * KiB, seed=12))]
    pieces += [memoryview(piece) for piece in blocks(2000, 7, seed=13)]  # > IOV_MAX buffers
    expected = b"".join(pieces)
    received = bytearray()

    def drain() -> None:
        while len(received) < len(expected):
            received.extend(receiver.recv(3000))

    reader = threading.Thread(target=drain)
    reader.start()
    send_gathered(sender, list(pieces))
    reader.join(timeout=30)
    sender.close()
    receiver.close()
    assert bytes(received) == expected


def test_many_small_values_and_large_ones_in_one_put_round_trip(
    valkey_server: ValkeyServer,
) -> None:
    """More than IOV_MAX buffers in one MSET, small (joined) and large (sent from the
    caller's buffer) values mixed: each key reads back its own bytes."""
    store = store_on(valkey_server)
    sizes = [1, 16 * KiB - 1, 16 * KiB, 300 * KiB, 0, 5] * 200
    values = [bytes([i % 251]) * size for i, size in enumerate(sizes)]
    keys = [("mixed", i) for i in range(len(values))]
    assert store.put(keys, values) == [True] * len(values)
    got = store.get(keys)
    exact = [
        view is not None and view.tobytes() == value
        for view, value in zip(got, values, strict=True)
    ]
    assert exact == [True] * len(values)
    assert_accounted(store.stats())


def test_a_store_describes_its_namespace_once_for_people_to_read(
    valkey_server: ValkeyServer,
) -> None:
    """``kvoffload remote stats`` shows it; nothing reads it back."""
    store = store_on(valkey_server)
    client = raw(valkey_server)
    assert store.put([], []) == [] and client.dbsize() == 0  # nothing stored, nothing said
    for key in range(3):
        assert store.put([key], [b"block"]) == [True]
    name = store.namespace.key_prefix + valkey_store_module.DESCRIPTION_NAME
    assert client.get(name) == store.namespace.description.encode()
    assert info(client, "commandstats")["cmdstat_mset"]["calls"] == 3 + 1  # described once
    assert [v and v.tobytes() for v in store.get([0, 1, 2])] == [b"block"] * 3
    # A sealed store says nothing of whose blocks these are: only the blocks are written.
    client.flushall()
    sealed = ValkeyStore(valkey_server.url, namespace=LAYOUT, secret=b"s" * 32)
    assert sealed.put([0, 1], [b"block", b"block"]) == [True, True]
    assert client.dbsize() == 2
    sealed.close()
