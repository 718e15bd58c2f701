"""Sealed values on a real server: a tenant's stores share what they write, and a client
that can write to the server and knows everything but the secret (the namespace, the block
keys, the format, every value it can read) makes no value they accept: planted values,
bit flips, values moved from another key or another tenant are all misses, counted."""

from __future__ import annotations

import pytest
import valkey

from kvoffload.tiers import ValkeyStore
from kvoffload.tiers.values import encode_key, value_format
from kvoffload_spec.errors import InvalidArgumentError
from tests.remote_support import LAYOUT, assert_accounted, blocks
from tests.valkey_server import ValkeyServer

SECRET = b"tenant-a secret: 32 random bytes"
OTHER_SECRET = b"tenant-b secret, 32 bytes long.."
KiB = 1 << 10


def sealed(server: ValkeyServer, secret: bytes | str | None = SECRET) -> ValkeyStore:
    return ValkeyStore(server.url, namespace=LAYOUT, secret=secret, timeout_s=10)


def fetched(client: valkey.Valkey, name: bytes) -> bytes:
    value = client.get(name)
    assert isinstance(value, bytes)
    return value


def readable(store: ValkeyStore, keys: list[int]) -> list[bytes | None]:
    return [None if view is None else view.tobytes() for view in store.get(keys)]


def test_a_tenants_stores_share_and_nobody_else_reads(valkey_server: ValkeyServer) -> None:
    writer = sealed(valkey_server)
    assert writer.authenticated and writer.key_prefix.startswith("kvo2:")
    values = blocks(4, 16 * KiB, seed=1)
    keys = [0, 1, 2, 3]
    assert writer.put(keys, values) == [True] * 4
    assert readable(sealed(valkey_server, SECRET.decode()), keys) == values  # the str form
    for outsider in (sealed(valkey_server, OTHER_SECRET), sealed(valkey_server, None)):
        assert outsider.get(keys) == [None] * 4
        assert outsider.contains(keys) == [False] * 4  # other names: it cannot even tell
    names = valkey.Valkey.from_url(valkey_server.url).keys("*")
    assert isinstance(names, list)
    assert len(names) == 4
    assert all(name.startswith(b"kvo2:") and encode_key(0) not in name[5:] for name in names)


def test_a_forger_without_the_secret_makes_only_misses(valkey_server: ValkeyServer) -> None:
    victim = sealed(valkey_server)
    other_tenant = sealed(valkey_server, OTHER_SECRET)
    values = blocks(3, 4 * KiB, seed=2)
    assert victim.put([0, 1, 2], values) == [True] * 3
    assert other_tenant.put([0, 1, 2], values) == [True] * 3
    client = valkey.Valkey.from_url(valkey_server.url)
    sealing = value_format(victim.namespace, SECRET)  # what the test knows, not the forger
    name = {key: sealing.server_key(encode_key(key)) for key in range(8)}
    stolen = [fetched(client, name[key]) for key in range(3)]
    other_name = value_format(victim.namespace, OTHER_SECRET).server_key(encode_key(0))
    attacker = b"attacker bytes!!" * 256
    plain = value_format(victim.namespace)
    planted = {
        3: plain.frame(encode_key(3), memoryview(attacker)),  # a valid plain value
        4: stolen[1],  # key 1's value under key 4
        5: fetched(client, other_name),  # another tenant's value of the same block
        6: bytes([stolen[0][0] ^ 1]) + stolen[0][1:],  # a flipped bit in the header
        7: stolen[2][:-1] + bytes([stolen[2][-1] ^ 0x80]),  # a flipped bit in the payload
    }
    for key, value in planted.items():
        client.set(name[key], value)
    # A real value with its tag replaced: the forger's guess of a tag.
    client.setrange(name[0], len(stolen[0]) - 16, b"\x00" * 16)
    found = victim.get(list(range(8)))
    assert [view is not None for view in found] == [False, True, True] + [False] * 5
    stats = victim.stats()
    assert stats.hits == 2 and stats.rejected == 6 and stats.rejected_mac >= 3, stats
    assert_accounted(stats)


def test_the_secret_comes_from_the_environment_without_an_argument(
    valkey_server: ValkeyServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVOFFLOAD_REMOTE_SECRET", SECRET.decode())
    from_env = ValkeyStore(valkey_server.url, namespace=LAYOUT, timeout_s=10)
    assert from_env.authenticated and from_env.key_prefix == sealed(valkey_server).key_prefix
    monkeypatch.setenv("KVOFFLOAD_REMOTE_SECRET", "short")
    with pytest.raises(InvalidArgumentError) as refused:
        ValkeyStore(valkey_server.url, namespace=LAYOUT)
    assert "short" not in str(refused.value) and "KVOFFLOAD_REMOTE_SECRET" in str(refused.value)
