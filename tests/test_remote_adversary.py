"""Sealed values on a real server, against an adversary who holds everything but the secret.

The adversary is a client of the same server with full rights (it runs ``SCAN``, ``GET``,
``SET``, ``SETRANGE`` with the plain client), the namespace description, the block keys of
the prefixes it wants to plant or probe, the format's code, and a secret of its own. It
plants values of every valid format it can make, flips bits of genuine values, and moves
genuine values to other keys and from other tenants. What it gets: misses, counted as
rejected, and a caller's buffer left untouched; never a byte of its own in a victim's
block. And without the secret it cannot tell whether a tenant cached a prefix: the names it
can compute are not the names the tenant uses.
"""

from __future__ import annotations

from collections.abc import Hashable

import pytest
import valkey

from kvoffload.tiers import ValkeyStore
from kvoffload.tiers.values import (
    SEALED_HEADER_BYTES,
    SEALED_MAGIC,
    Namespace,
    ValueFormat,
    encode_key,
    value_format,
)
from tests.remote_support import LAYOUT, Engine, blocks, content
from tests.valkey_server import ValkeyServer

SECRET_A = b"tenant A's secret: 32 bytes long"
SECRET_B = b"tenant B's secret: 32 bytes long"
ADVERSARY = b"the adversary's own secret, 32 b"
BLOCK = 4096
KEYS: list[Hashable] = [("prefix", i) for i in range(8)]


def sealed_store(
    server: ValkeyServer, secret: bytes | None, namespace: object = None
) -> ValkeyStore:
    return ValkeyStore(
        server.url,
        namespace=namespace or LAYOUT,  # type: ignore[arg-type]
        secret=secret,
        timeout_s=10,
        retry_after_s=0.05,
    )


def fmt(secret: bytes | None, namespace: object = None) -> ValueFormat:
    """The format a store of this secret and namespace uses (every process computes the same)."""
    return value_format(Namespace.of(namespace or LAYOUT), secret)  # type: ignore[arg-type]


def name_of(secret: bytes | None, key: Hashable, namespace: object = None) -> bytes:
    return fmt(secret, namespace).server_key(encode_key(key))


def raw(server: ValkeyServer) -> valkey.Valkey:
    return valkey.Valkey.from_url(server.url)


def assert_all_misses_untouched(store: ValkeyStore, keys: list[Hashable]) -> None:
    """``get`` finds nothing, ``get_into`` leaves every buffer as it was."""
    assert store.get(keys) == [None] * len(keys)
    buffers = [bytearray(b"\xa5" * BLOCK) for _ in keys]
    assert store.get_into(keys, buffers) == [False] * len(keys)
    assert all(buffer == b"\xa5" * BLOCK for buffer in buffers)


def test_the_store_seals_with_its_secret_and_names_keys_by_it(valkey_server: ValkeyServer) -> None:
    store = sealed_store(valkey_server, SECRET_A)
    assert store.authenticated
    values = blocks(len(KEYS), BLOCK)
    assert store.put(KEYS, values) == [True] * len(KEYS)
    client = raw(valkey_server)
    names = sorted(client.scan_iter(count=1000))
    assert names == sorted(name_of(SECRET_A, key) for key in KEYS)
    assert all(name.startswith(store.key_prefix.encode()) for name in names)
    for key, value in zip(KEYS, values, strict=True):
        stored = client.get(name_of(SECRET_A, key))
        assert isinstance(stored, bytes) and stored.startswith(SEALED_MAGIC)
        assert stored[SEALED_HEADER_BYTES:] == value  # authenticated, not encrypted
        assert encode_key(key) not in stored  # the block key is not stored
    assert [view and view.tobytes() for view in store.get(KEYS)] == values
    # Without a secret the same namespace reads nothing of it, nor does another tenant's.
    assert sealed_store(valkey_server, None).get(KEYS) == [None] * len(KEYS)
    assert sealed_store(valkey_server, SECRET_B).get(KEYS) == [None] * len(KEYS)


def test_planted_values_of_every_format_the_adversary_can_make_are_misses(
    valkey_server: ValkeyServer,
) -> None:
    """Under the victim's own server names (read off the server), values the adversary can
    build: the plain format for the namespace, the sealed format under its own secret, a
    genuine header (tenant id, nonce, tag) with its own payload, a tag of zeros."""
    victim = sealed_store(valkey_server, SECRET_A)
    genuine = blocks(len(KEYS), BLOCK, seed=1)
    assert victim.put(KEYS, genuine) == [True] * len(KEYS)
    client = raw(valkey_server)
    attack = b"\x66" * BLOCK
    planted = 0
    for key in KEYS:
        name = name_of(SECRET_A, key)
        real = client.get(name)
        assert isinstance(real, bytes)
        encoded = encode_key(key)
        forgeries = [
            fmt(None).frame(encoded, memoryview(attack)),
            fmt(ADVERSARY).frame(encoded, memoryview(attack)),
            real[:SEALED_HEADER_BYTES] + attack,
            real[: SEALED_HEADER_BYTES - 16] + bytes(16) + attack,
        ]
        for forged in forgeries:
            client.set(name, forged)
            assert_all_misses_untouched(victim, [key])
            planted += 1
    stats = victim.stats()
    assert stats.hits == 0 and stats.rejected == 2 * planted  # a get and a get_into each
    assert stats.rejected_mac + stats.rejected_foreign == stats.rejected
    assert stats.rejected_mac > 0 and stats.rejected_foreign > 0


@pytest.mark.parametrize(
    "where", ["magic", "tenant id", "length", "nonce", "tag", "first payload byte", "last byte"]
)
def test_a_bit_flipped_on_the_server_anywhere_is_a_miss(
    valkey_server: ValkeyServer, where: str
) -> None:
    offset = {
        "magic": 0,
        "tenant id": 4,
        "length": 20,
        "nonce": 28,
        "tag": 44,
        "first payload byte": SEALED_HEADER_BYTES,
        "last byte": SEALED_HEADER_BYTES + BLOCK - 1,
    }[where]
    store = sealed_store(valkey_server, SECRET_A)
    value = blocks(1, BLOCK, seed=2)[0]
    assert store.put(["k"], [value]) == [True]
    client = raw(valkey_server)
    name = name_of(SECRET_A, "k")
    stored = client.get(name)
    assert isinstance(stored, bytes)
    client.setrange(name, offset, bytes([stored[offset] ^ 0x10]))  # the review's SETRANGE
    assert_all_misses_untouched(store, ["k"])
    assert store.stats().rejected == 2
    client.set(name, stored)  # put back as it was: accepted again
    assert [view and view.tobytes() for view in store.get(["k"])] == [value]


def test_values_replayed_from_another_key_another_namespace_or_tenant_are_misses(
    valkey_server: ValkeyServer,
) -> None:
    other_model = {**LAYOUT, "layers": 3}
    a = sealed_store(valkey_server, SECRET_A)
    a_other_model = sealed_store(valkey_server, SECRET_A, other_model)
    b = sealed_store(valkey_server, SECRET_B)
    source, target = ("prefix", "source"), ("prefix", "target")
    assert a.put([source], [b"\x01" * BLOCK]) == [True]
    assert a_other_model.put([target], [b"\x02" * BLOCK]) == [True]
    assert b.put([target], [b"\x03" * BLOCK]) == [True]
    client = raw(valkey_server)
    victim_name = name_of(SECRET_A, target)
    for copied_from in (
        name_of(SECRET_A, source),  # the same tenant's value of another block
        name_of(SECRET_A, target, other_model),  # the same secret, another model's
        name_of(SECRET_B, target),  # another tenant's value of the same block key
    ):
        moved = client.get(copied_from)
        assert isinstance(moved, bytes)
        client.set(victim_name, moved)
        assert_all_misses_untouched(a, [target])
    stats = a.stats()
    assert stats.hits == 0 and stats.rejected == 6
    assert stats.rejected_mac == 2 and stats.rejected_foreign == 4  # the tenant id differs
    # Each value is still good where it belongs.
    assert [v and v.tobytes() for v in a_other_model.get([target])] == [b"\x02" * BLOCK]
    assert [v and v.tobytes() for v in b.get([target])] == [b"\x03" * BLOCK]


def test_an_adversarys_writes_cost_hits_never_bytes(valkey_server: ValkeyServer) -> None:
    """Through an Offloader: every value the victim wrote back is overwritten with forged
    ones; its fetches all miss (the keys stay absent, no load gives attacker bytes), and
    blocks written again afterwards are fetched and loaded byte-exact."""
    writer = Engine(sealed_store(valkey_server, SECRET_A), cpu_blocks=2)
    keys = list(range(6))
    for key in keys:  # a pool of 2: each store evicts an older block, which is written back
        writer.store(key)
    writer.close()
    client = raw(valkey_server)
    written = [key for key in keys if client.exists(name_of(SECRET_A, key))]
    assert len(written) >= 4
    attack = b"\x66" * len(content(0))
    for key in written:
        forged = fmt(ADVERSARY).frame(encode_key(key), memoryview(attack))
        client.set(name_of(SECRET_A, key), forged)
    reader = Engine(sealed_store(valkey_server, SECRET_A), cpu_blocks=len(written))
    assert reader.fetch(written) == dict.fromkeys(written, False)
    assert reader.check_ready_bytes(written) == []  # nothing ready, nothing loaded
    stats = reader.stats()
    assert stats.fetch_hits == 0 and stats.fetch_misses == len(written)
    assert stats.store is not None
    assert stats.store.rejected == len(written) and stats.store.hits == 0
    # The cost is hits: the tenant writes the blocks again and reads them again.
    honest = sealed_store(valkey_server, SECRET_A)
    assert honest.put(written, [content(key) for key in written]) == [True] * len(written)
    assert reader.fetch(written) == dict.fromkeys(written, True)
    assert reader.check_ready_bytes(written) == written
    reader.close()


def test_without_the_secret_a_tenant_cannot_tell_whether_a_prefix_is_cached(
    valkey_server: ValkeyServer,
) -> None:
    """The review's membership probe: tenant A caches one of two candidate prompts; B knows
    both candidates' block keys and A's namespace, and asks for each under every name it
    can compute. Its answers are the same for the cached candidate and the other: nothing."""
    cached = [("candidate one", i) for i in range(10)]
    other = [("candidate two", i) for i in range(10)]
    a = sealed_store(valkey_server, SECRET_A)
    assert a.put(cached, blocks(10, BLOCK)) == [True] * 10
    assert a.contains(cached) == [True] * 10 and a.contains(other) == [False] * 10  # control
    for prober in (
        sealed_store(valkey_server, None),  # the plain names of A's namespace
        sealed_store(valkey_server, SECRET_B),  # B's own sealed names for A's namespace
    ):
        for candidate in (cached, other):
            assert prober.contains(candidate) == [False] * 10
            assert prober.get(candidate) == [None] * 10
        assert prober.stats().rejected == 0  # nothing was even there to refuse
    client = raw(valkey_server)
    guesses = {name_of(secret, key) for secret in (None, SECRET_B, ADVERSARY) for key in cached}
    assert not guesses & set(client.scan_iter(count=1000))
