"""The contract of a remote block store (``kvoffload.tiers.RemoteStore``) as checks that any
store must pass, whatever holds its values.

Each check takes a :data:`StoreMaker` (a function that opens another store on the same
backing storage, in a namespace) and raises ``AssertionError`` where the store breaks the
contract. tests/test_store_contract.py runs every check of :data:`CONTRACT` on every store
of :data:`STORES`; a new store (a disk tier, ...) is one more :class:`StoreFactory` there,
and the catalogue of planted bugs (tests/planted/stores.py) proves the checks fail on a
store that breaks them.

The heart of it is ``get_into``: a value is copied into the caller's buffer only when it is
valid and exactly the buffer's size; a payload shorter or longer than the buffer, in any
mix of a batch, is refused and its buffer left byte for byte as it was.
"""

from __future__ import annotations

import atexit
import itertools
import random
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.tiers import Namespace, RemoteStore, StoreClosedError, ValkeyStore
from kvoffload_spec.errors import InvalidArgumentError
from tests.remote_support import LAYOUT, assert_accounted
from tests.valkey_server import ValkeyServer

if TYPE_CHECKING:
    from tests.valkey_cluster import ValkeyCluster

StoreMaker = Callable[..., RemoteStore]
"""``make(namespace=None)``: a new store on the factory's backing storage (``LAYOUT`` by
default); every store it made is closed when the factory's context ends."""


@dataclass(frozen=True)
class StoreFactory:
    """A kind of store: ``opened()`` gives fresh, empty backing storage for one check."""

    name: str
    opened: Callable[[], AbstractContextManager[StoreMaker]]


@contextmanager
def valkey_stores(store_class: type[ValkeyStore] = ValkeyStore) -> Iterator[StoreMaker]:
    """Stores of ``store_class`` on a real Valkey server of their own (127.0.0.1)."""
    with (
        ValkeyServer() as server,
        _closing(
            # A timeout no busy machine reaches: these checks expect every call to succeed.
            lambda namespace: store_class(server.url, namespace=namespace, timeout_s=10)
        ) as make,
    ):
        yield make


@contextmanager
def _closing(open_store: Callable[[Any], RemoteStore]) -> Iterator[StoreMaker]:
    """A maker of stores by ``open_store(namespace)``, each closed when the context ends."""
    made: list[RemoteStore] = []

    def make(namespace: str | Mapping[str, Any] | Namespace | None = None) -> RemoteStore:
        store = open_store(namespace or LAYOUT)
        made.append(store)
        return store

    try:
        yield make
    finally:
        for store in made:
            store.close()


_CLUSTER: list[ValkeyCluster] = []  # the process's one cluster, once started


def _shared_cluster() -> ValkeyCluster:
    """A 3-primary cluster for every check this process runs, started at the first and
    stopped at exit: a cluster takes seconds to form, and a check needs only empty slots."""
    from tests.valkey_cluster import ValkeyCluster

    if not _CLUSTER:
        cluster = ValkeyCluster(replicas_each=0).start()
        atexit.register(cluster.close)
        _CLUSTER.append(cluster)
    return _CLUSTER[0]


@contextmanager
def valkey_cluster_stores() -> Iterator[StoreMaker]:
    """Cluster stores (``cluster=True``) on a real 3-primary Valkey Cluster, every primary
    emptied first (no replicas: the contract is about values, not failover;
    tests/test_remote_cluster.py has those)."""
    from tests.valkey_cluster import command

    cluster = _shared_cluster()
    for server in cluster.servers:
        command(server, "FLUSHALL")
    with _closing(
        lambda namespace: ValkeyStore(cluster.url, namespace=namespace, cluster=True, timeout_s=10)
    ) as make:
        yield make


@contextmanager
def disk_stores() -> Iterator[StoreMaker]:
    """Disk stores in a temporary directory: one directory per namespace (a disk tier holds
    one namespace's blocks), and "another store on the same storage" is the same one while
    it is open, else the directory opened again (a restart)."""
    import tempfile
    from pathlib import Path

    from kvoffload.tiers import DiskStore

    with tempfile.TemporaryDirectory(prefix="kvoffload-contract-") as root:
        made: dict[bytes, DiskStore] = {}

        def make(namespace: str | Mapping[str, Any] | Namespace | None = None) -> RemoteStore:
            of = Namespace.of(namespace or LAYOUT)
            store = made.get(of.fingerprint)
            if store is None or store.closed:
                store = DiskStore(
                    Path(root) / of.fingerprint.hex(),
                    capacity_bytes=64 << 20,
                    namespace=of,
                    block_bytes=DISK_BLOCK_BYTES,
                    admission="every-offer",
                )
                made[of.fingerprint] = store
            return store

        try:
            yield make
        finally:
            for store in made.values():
                store.close()


# The largest payload the checks store (twice their largest buffer, 64 KiB), and more.
DISK_BLOCK_BYTES = 256 << 10

STORES: tuple[StoreFactory, ...] = (
    StoreFactory("valkey", valkey_stores),
    StoreFactory("valkey-cluster", valkey_cluster_stores),
    StoreFactory("disk", disk_stores),
)
"""Every store the contract is run on."""


FILL = 0xFF  # what a buffer holds before a get_into; no payload byte is FILL
_NO_FILL = bytes(range(255)) + b"\xfe"  # FILL -> 0xFE: a payload differs from FILL everywhere


def payload(seed: Hashable, size: int) -> bytes:
    """``size`` bytes of their own for ``seed``, none of them ``FILL``: a copy of even one
    payload byte into a filled buffer shows."""
    return random.Random(repr(seed)).randbytes(size).translate(_NO_FILL)


def filled(size: int) -> bytearray:
    return bytearray([FILL]) * size


def untouched(buffer: bytearray) -> bool:
    return buffer == filled(len(buffer))


# -- get_into: only a value of exactly the buffer's size ----------------------------------

BUFFER_SIZES = (0, 1, 2, 7, 64, 4096, 65_539)


def sizes_around(buffer: int) -> list[int]:
    """Payload sizes at and around ``buffer``: empty, one byte, one off either way, half,
    double, a page more."""
    near = {0, 1, buffer - 1, buffer, buffer + 1, buffer // 2, 2 * buffer, buffer + 4096}
    return sorted(size for size in near if size >= 0)


def check_get_into_copies_a_value_only_into_a_buffer_of_its_size(make: StoreMaker) -> None:
    """Every buffer size against payloads at and around it, in one shuffled batch with
    missing keys among them, then each key alone: ``True`` and the exact bytes where the
    sizes are equal; ``False`` and the buffer byte for byte as it was everywhere else."""
    store = make()
    cases = [(buffer, size) for buffer in BUFFER_SIZES for size in sizes_around(buffer)]
    keys: list[Hashable] = [("sized", buffer, size) for buffer, size in cases]
    values = [payload(key, size) for key, (_, size) in zip(keys, cases, strict=True)]
    assert store.put(keys, values) == [True] * len(keys)
    stored = dict(zip(keys, values, strict=True))
    missing: list[Hashable] = [("never stored", buffer) for buffer in BUFFER_SIZES]
    size_of = {key: buffer for key, (buffer, _) in zip(keys, cases, strict=True)}
    size_of.update({key: buffer for key, buffer in zip(missing, BUFFER_SIZES, strict=True)})
    batch = keys + missing
    random.Random(0).shuffle(batch)
    before = store.stats()
    _check_get_into(store, batch, [size_of[key] for key in batch], stored)
    after = store.stats()
    exact = sum(1 for buffer, size in cases if buffer == size)
    assert after.hits - before.hits == exact, after
    assert after.rejected_length - before.rejected_length == len(cases) - exact, after
    assert after.misses - before.misses == len(missing), after
    assert_accounted(after)
    for key in batch:  # alone, too: a batch of one takes no other path
        _check_get_into(store, [key], [size_of[key]], stored)


def _check_get_into(
    store: RemoteStore,
    keys: Sequence[Hashable],
    sizes: Sequence[int],
    stored: Mapping[Hashable, bytes],
) -> None:
    buffers = [filled(size) for size in sizes]
    done = store.get_into(keys, buffers)
    assert isinstance(done, list) and len(done) == len(keys)
    for key, buffer, ok in zip(keys, buffers, done, strict=True):
        value = stored.get(key)
        fits = value is not None and len(value) == len(buffer)
        what = f"{key!r}: a value of {None if value is None else len(value)} bytes"
        assert ok is fits, f"{what} into a buffer of {len(buffer)}: get_into said {ok}"
        if value is not None and fits:
            assert bytes(buffer) == value, f"{what}: other bytes copied"
        else:
            assert untouched(buffer), f"{what} into a buffer of {len(buffer)}: buffer changed"


@st.composite
def batches(draw: st.DrawFn) -> tuple[dict[int, int], list[tuple[int, int]]]:
    """Which of six keys are stored (and their payload sizes), and a batch of (key, buffer
    size) asking for any of them, repeats included, sizes equal, near or far."""
    stored = draw(st.dictionaries(st.integers(0, 5), st.integers(0, 24), max_size=6))
    asked = draw(
        st.lists(st.tuples(st.integers(0, 5), st.integers(0, 24)), min_size=1, max_size=10)
    )
    # Half the asks take the stored size or one off it: the cases a slip lets through.
    nudges = draw(st.lists(st.sampled_from((None, -1, 0, 1)), min_size=len(asked)))
    batch = []
    for (key, size), nudge in zip(asked, nudges, strict=False):
        if nudge is not None and key in stored:
            size = max(0, stored[key] + nudge)
        batch.append((key, size))
    return stored, batch


MIXED_BATCHES = settings(max_examples=100, deadline=None)
"""How many batches the mixed-batch check draws (the catalogue's test skips shrinking)."""


def check_get_into_on_any_mixed_batch(make: StoreMaker) -> None:
    """Random batches mixing hits, misses, repeated keys and buffers shorter, longer and
    exactly the size of each value (Hypothesis)."""
    store = make()
    rounds = itertools.count()

    @MIXED_BATCHES
    @given(case=batches())
    def round_trip(case: tuple[dict[int, int], list[tuple[int, int]]]) -> None:
        stored_sizes, batch = case
        name = next(rounds)  # each example its own keys: nothing of the last one is read
        stored: dict[Hashable, bytes] = {
            ("mixed", name, k): payload((name, k), size) for k, size in stored_sizes.items()
        }
        assert store.put(list(stored), list(stored.values())) == [True] * len(stored)
        keys: list[Hashable] = [("mixed", name, key) for key, _ in batch]
        _check_get_into(store, keys, [size for _, size in batch], stored)

    round_trip()
    assert_accounted(store.stats())


def check_a_value_refused_for_its_size_stays_readable(make: StoreMaker) -> None:
    """A refusal changes nothing stored: ``get`` still returns the value, and a buffer of
    its size still takes it."""
    store = make()
    value = payload("kept", 100)
    assert store.put(["kept"], [value]) == [True]
    for size in (99, 101, 0):
        buffer = filled(size)
        assert store.get_into(["kept"], [buffer]) == [False] and untouched(buffer)
    (view,) = store.get(["kept"])
    assert view is not None and view.tobytes() == value
    buffer = filled(100)
    assert store.get_into(["kept"], [buffer]) == [True] and buffer == value


# -- round trips, per key -----------------------------------------------------------------


def check_values_of_any_buffer_and_keys_of_any_type_round_trip(make: StoreMaker) -> None:
    """Any C-contiguous buffer goes in; ``get`` gives read-only views of the exact bytes,
    ``get_into`` copies them into any writable buffer (a numpy row too); a miss is
    ``None`` / ``False``."""
    store = make()
    array = np.arange(2 * 1024, dtype=np.float32).reshape(2, 1024)
    values: list[bytes | bytearray | memoryview] = [
        b"",
        payload(1, 1),
        bytearray(payload(2, 300)),
        array.data,
        memoryview(payload(3, 70_000))[5:66_005],
    ]
    keys: list[Hashable] = [0, -7, "s", b"b", (1, "two", b"3", (4,))]
    assert store.put(keys, values) == [True] * len(keys)
    expected = [bytes(memoryview(value).cast("B")) for value in values]
    got = store.get([*keys, "absent"])
    assert [None if view is None else view.tobytes() for view in got] == [*expected, None]
    assert all(view is None or view.readonly for view in got)
    rows = np.full((len(keys), 70_000), FILL, dtype=np.uint8)
    buffers = [rows[i, : len(value)].data for i, value in enumerate(expected)]
    assert store.get_into(keys, buffers) == [True] * len(keys)
    assert [rows[i, : len(value)].tobytes() for i, value in enumerate(expected)] == expected
    assert all((rows[i, len(value) :] == FILL).all() for i, value in enumerate(expected))
    missed = filled(8)
    assert store.get_into(["absent"], [missed]) == [False] and untouched(missed)
    assert_accounted(store.stats())


def check_put_overwrites_and_contains_and_delete_answer_per_key(make: StoreMaker) -> None:
    store = make()
    assert store.put([1, 2, 1], [b"old", b"two", b"new"]) == [True] * 3
    assert [view and view.tobytes() for view in store.get([1, 2])] == [b"new", b"two"]
    assert store.contains([1, 2, 3]) == [True, True, False]
    assert store.delete([2, 3, 2]) == [True, False, False]
    assert store.contains([1, 2]) == [True, False]
    assert store.get([2]) == [None]
    buffer = filled(3)
    assert store.get_into([2, 1], [filled(3), buffer]) == [False, True] and buffer == b"new"
    stats = store.stats()
    assert (stats.keys_deleted, stats.keys_stored) == (1, 3)
    assert_accounted(stats)


def check_empty_batches_are_answered_empty(make: StoreMaker) -> None:
    store = make()
    assert store.put([], []) == [] and store.get([]) == [] and store.get_into([], []) == []
    assert store.contains([]) == [] and store.delete([]) == []
    assert_accounted(store.stats())


def check_namespaces_share_storage_and_not_their_values(make: StoreMaker) -> None:
    """Two namespaces on one backing storage: neither reads, finds or deletes the other's
    values under the same keys."""
    mine, theirs = make(), make({**LAYOUT, "model": "another"})
    assert mine.namespace != theirs.namespace
    assert mine.put([1, 2], [b"mine-1", b"mine-2"]) == [True, True]
    assert theirs.get([1, 2]) == [None, None] and theirs.contains([1, 2]) == [False, False]
    assert theirs.get_into([1], [filled(6)]) == [False]
    assert theirs.delete([1]) == [False]
    assert theirs.put([1], [b"theirs"]) == [True]
    assert [view and view.tobytes() for view in mine.get([1, 2])] == [b"mine-1", b"mine-2"]
    assert [view and view.tobytes() for view in theirs.get([1])] == [b"theirs"]


def bad_calls(store: RemoteStore) -> dict[str, Callable[[], object]]:
    """Calls with a bad argument: each must raise ``InvalidArgumentError``, having sent
    nothing and changed nothing."""
    fortran = np.zeros((4, 4), dtype=np.uint8, order="F")
    return {
        "keys as a str": lambda: store.get("abc"),
        "keys as bytes": lambda: store.delete(b"abc"),
        "a key of no block type": lambda: store.get([1.5]),
        "a bad key among good ones": lambda: store.contains([1, object()]),
        "fewer values than keys": lambda: store.put([1, 2], [b"1"]),
        "values as bytes": lambda: store.put([1], b"1"),  # type: ignore[arg-type]
        "a value that is no buffer": lambda: store.put([1, 2], [b"1", "two"]),  # type: ignore[list-item]
        "a non-contiguous value": lambda: store.put([1], [fortran.data]),
        "a read-only buffer": lambda: store.get_into([1], [memoryview(b"1234")]),
        "fewer buffers than keys": lambda: store.get_into([1, 2], [bytearray(1)]),
        "buffers as a bytearray": lambda: store.get_into([1], bytearray(4)),  # type: ignore[arg-type]
        "a non-contiguous buffer": lambda: store.get_into([1], [fortran.data]),
    }


def check_bad_arguments_raise_and_change_nothing(make: StoreMaker) -> None:
    store = make()
    assert store.put([1, 2], [b"1111", b"2222"]) == [True, True]
    before = store.stats()
    for name, call in bad_calls(store).items():
        try:
            call()
        except InvalidArgumentError:
            pass
        else:
            raise AssertionError(f"{name}: accepted")
        assert store.stats() == before, name
    assert [view and view.tobytes() for view in store.get([1, 2])] == [b"1111", b"2222"]


def check_a_closed_store_refuses_every_call(make: StoreMaker) -> None:
    store = make()
    assert store.put([1], [b"1"]) == [True]
    store.close()
    calls: dict[str, Callable[[], object]] = {
        "get": lambda: store.get([1]),
        "get_into": lambda: store.get_into([1], [bytearray(1)]),
        "put": lambda: store.put([1], [b"1"]),
        "contains": lambda: store.contains([1]),
        "delete": lambda: store.delete([1]),
    }
    for name, call in calls.items():
        try:
            call()
        except StoreClosedError:
            continue
        raise AssertionError(f"{name} on a closed store: no StoreClosedError")
    store.close()  # twice is fine


def check_a_value_put_by_one_store_is_read_by_another(make: StoreMaker) -> None:
    """Stores of one namespace on one backing storage share their values (engines share
    blocks so), also once the writer is closed: a store opened after it reads what it
    wrote (for a disk tier, the next process on its directory)."""
    writer = make()
    value = payload("shared", 4096)
    assert writer.put(["shared"], [value]) == [True]
    writer.close()
    reader = make()
    buffer = filled(4096)
    assert reader.get_into(["shared"], [buffer]) == [True] and buffer == value
    assert reader.contains(["shared"]) == [True]
    assert make().delete(["shared"]) == [True] and reader.get(["shared"]) == [None]


CONTRACT: tuple[Callable[[StoreMaker], None], ...] = (
    check_get_into_copies_a_value_only_into_a_buffer_of_its_size,
    check_get_into_on_any_mixed_batch,
    check_a_value_refused_for_its_size_stays_readable,
    check_values_of_any_buffer_and_keys_of_any_type_round_trip,
    check_put_overwrites_and_contains_and_delete_answer_per_key,
    check_empty_batches_are_answered_empty,
    check_namespaces_share_storage_and_not_their_values,
    check_a_value_put_by_one_store_is_read_by_another,
    check_bad_arguments_raise_and_change_nothing,
    check_a_closed_store_refuses_every_call,
)
"""Every check of the contract, the size checks first."""
