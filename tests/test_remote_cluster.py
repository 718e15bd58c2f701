"""The remote store on a real Valkey Cluster (3 primaries, 3 replicas on 127.0.0.1): byte-exact
across every slot, shared between processes, MOVED and ASK followed, a primary killed (its
replica promoted), the whole cluster down and back; and the typed error when the store and
the server disagree about cluster mode."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from kvoffload.tiers.acl import acl_rule
from kvoffload.tiers.cluster_map import SLOTS, ClusterModeError, crc16, key_slot
from kvoffload.tiers.cluster_store import ClusterStore
from kvoffload.tiers.valkey_store import ValkeyStore
from kvoffload.tiers.values import encode_key
from tests.remote_support import assert_accounted
from tests.valkey_cluster import ValkeyCluster, command
from tests.valkey_server import ValkeyServer

pytestmark = pytest.mark.slow  # clusters of six servers, nodes killed and moved: the full gate

SECRET = b"cluster-test-secret-0123456789"
TIMEOUT_S = 0.5
MARGIN_S = 0.25  # what a call may take past its timeout_s on a loaded 2-core machine


@pytest.fixture(scope="module")
def cluster() -> Iterator[ValkeyCluster]:
    """One cluster for the tests that leave it as they found it."""
    with ValkeyCluster() as running:
        yield running


@pytest.fixture
def own_cluster() -> Iterator[ValkeyCluster]:
    """A cluster of the test's own (it kills nodes or moves slots)."""
    with ValkeyCluster() as running:
        yield running


def store(
    cluster: ValkeyCluster, namespace: str = "cluster-test", **options: float
) -> ClusterStore:
    made = ValkeyStore(
        cluster.url,
        namespace=namespace,
        cluster=True,
        secret=SECRET,
        timeout_s=options.pop("timeout_s", TIMEOUT_S),
        retry_after_s=options.pop("retry_after_s", 0.1),
    )
    assert isinstance(made, ClusterStore)
    return made


def value(i: int, size: int = 3000) -> bytes:
    return (i.to_bytes(4, "little") * (size // 4 + 1))[: size + i % 17]


def test_crc16_and_hash_tags_match_the_server(cluster: ValkeyCluster) -> None:
    assert crc16(b"123456789") == 0x31C3  # the XMODEM check value
    for key in (b"a", b"kvo2:ab:K\x00\xff", b"{user1}.x", b"x{}y", b"{}{a}", b"a{b}{c}", b"{"):
        assert key_slot(key) == command(cluster.servers[0], "CLUSTER KEYSLOT", key)


def test_byte_exact_over_every_slot(cluster: ValkeyCluster) -> None:
    keys = [("block", i) for i in range(600)]
    values = [value(i) for i in range(600)]
    with store(cluster) as remote:
        assert remote.put(keys, values) == [True] * 600
        assert [bytes(v) if v is not None else None for v in remote.get(keys)] == values
        buffers = [bytearray(len(v)) for v in values]
        assert remote.get_into(keys, buffers) == [True] * 600
        assert [bytes(b) for b in buffers] == values
        assert remote.contains(keys) == [True] * 600
        assert remote.delete(keys[:200]) == [True] * 200
        assert remote.contains(keys) == [False] * 200 + [True] * 400
        assert remote.get(keys[:200]) == [None] * 200
        assert remote.ping()
        stats = remote.stats()
        assert_accounted(stats)
        assert stats.failures == 0 and stats.hits == 1200 and stats.misses == 200
        # the keys were spread over all three primaries, one connection each (+ the seeds)
        slot_map = remote.slot_map
        assert slot_map is not None and len(slot_map.primaries) == 3
        assert stats.connects == 3


def test_large_values_and_empty_calls(cluster: ValkeyCluster) -> None:
    keys = [("large", i) for i in range(6)]
    values = [bytes([i]) * (2 * 1024 * 1024 + i) for i in range(6)]
    with store(cluster, timeout_s=5.0) as remote:
        assert remote.put([], []) == [] and remote.get([]) == [] and remote.contains([]) == []
        assert remote.put(keys, values) == [True] * 6
        got = remote.get(keys)
        assert all(g is not None and g == v for g, v in zip(got, values, strict=True))
        assert_accounted(remote.stats())


def test_two_processes_share_values(cluster: ValkeyCluster) -> None:
    keys = [("shared", i) for i in range(100)]
    with store(cluster, namespace="shared") as remote:
        assert all(remote.put(keys, [value(i) for i in range(100)]))
    child = f"""
import sys
from kvoffload.tiers.valkey_store import ValkeyStore
from kvoffload.tiers.values import encode_key
def value(i: int, size: int = 3000) -> bytes:
    return (i.to_bytes(4, "little") * (size // 4 + 1))[: size + i % 17]
s = ValkeyStore({cluster.url!r}, namespace="shared", cluster=True, secret={SECRET!r})
keys = [("shared", i) for i in range(100)]
got = s.get(keys)
ok = all(g is not None and bytes(g) == value(i) for i, g in enumerate(got))
s.put([("child", i) for i in range(50)], [value(i + 7) for i in range(50)])
sys.exit(0 if ok else 3)
"""
    done = subprocess.run([sys.executable, "-c", child], env=os.environ.copy(), timeout=60)
    assert done.returncode == 0
    with store(cluster, namespace="shared") as remote:
        got = remote.get([("child", i) for i in range(50)])
        assert [bytes(g) if g is not None else None for g in got] == [
            value(i + 7) for i in range(50)
        ]


def test_cluster_true_against_a_plain_server(valkey_server: ValkeyServer) -> None:
    remote = ValkeyStore(valkey_server.url.removesuffix("/0"), namespace="x", cluster=True)
    with pytest.raises(ClusterModeError, match="cluster=False"):
        remote.get([("a", 1)])
    remote.close()


def test_cluster_false_against_a_cluster_node(cluster: ValkeyCluster) -> None:
    node = cluster.servers[0]
    remote = ValkeyStore(f"redis://127.0.0.1:{node.port}", namespace="x", secret=SECRET)
    with pytest.raises(ClusterModeError, match="cluster=True"):
        remote.get([("a", i) for i in range(10)])
    remote.close()


def _node_id(server: ValkeyServer) -> str:
    found = command(server, "CLUSTER MYID")
    return found.decode() if isinstance(found, bytes) else str(found)


def _server_key(remote: ValkeyStore, key: tuple[str, int]) -> bytes:
    return remote._format.server_key(encode_key(key))


def test_moved_and_ask_during_a_slot_migration(own_cluster: ValkeyCluster) -> None:
    with store(own_cluster) as remote:
        key = ("moving", 1)
        name = _server_key(remote, key)
        slot = key_slot(name)
        assert remote.put([key], [b"v" * 5000]) == [True]
        source = own_cluster.owner(slot)
        target = next(s for s in own_cluster.servers[:3] if s is not source)
        # ASK: the slot is being migrated, its key already on the target
        command(target, "CLUSTER SETSLOT", slot, "IMPORTING", _node_id(source))
        command(source, "CLUSTER SETSLOT", slot, "MIGRATING", _node_id(target))
        command(source, "MIGRATE", "127.0.0.1", target.port, name, 0, 5000)
        got = remote.get([key])
        assert got[0] is not None and bytes(got[0]) == b"v" * 5000
        assert remote.contains([key]) == [True]
        # MOVED: the migration ends, the slot is the target's
        for server in own_cluster.servers[:3]:
            command(server, "CLUSTER SETSLOT", slot, "NODE", _node_id(target))
        got = remote.get([key])
        assert got[0] is not None and bytes(got[0]) == b"v" * 5000
        assert remote.put([key], [b"w" * 10]) == [True]
        assert bytes(remote.get([key])[0] or b"") == b"w" * 10
        stats = remote.stats()
        assert_accounted(stats)
        assert stats.failures == 0, stats
        slot_map = remote.slot_map
        owner = None if slot_map is None else slot_map.owners[slot]
        assert owner is not None and owner.port == target.port


def test_a_primary_killed_mid_run(own_cluster: ValkeyCluster) -> None:
    keys = [("failover", i) for i in range(300)]
    values = [value(i) for i in range(300)]
    with store(own_cluster) as remote:
        assert all(remote.put(keys, values))
        for server in own_cluster.servers[:3]:
            # every value on the replicas too (a replica just attached may still be syncing)
            assert command(server, "WAIT", 1, 8000) == 1
        victim = own_cluster.servers[0]
        replica = own_cluster.replica_of(victim)
        assert command(replica, "DBSIZE") == command(victim, "DBSIZE")
        victim.kill()
        killed_at = time.monotonic()
        slowest = 0.0
        recovered_at = None
        while time.monotonic() - killed_at < 20:
            started = time.monotonic()
            got = remote.get(keys)
            stored = remote.put([("during", 0)], [b"x" * 100])
            slowest = max(slowest, (time.monotonic() - started) / 2)
            for g, v in zip(got, values, strict=True):
                assert g is None or bytes(g) == v  # never a wrong byte
            if all(g is not None for g in got) and stored == [True]:
                recovered_at = time.monotonic()
                break
            time.sleep(0.02)
        assert recovered_at is not None, remote.stats()
        assert slowest <= TIMEOUT_S + MARGIN_S
        stats = remote.stats()
        assert_accounted(stats)
        assert stats.unavailable > 0 and stats.failures > 0
        print(f"failover: hits back {1000 * (recovered_at - killed_at):.0f} ms after the kill")


def test_the_whole_cluster_down_then_back(own_cluster: ValkeyCluster) -> None:
    keys = [("down", i) for i in range(60)]
    with store(own_cluster) as remote:
        assert all(remote.put(keys, [value(i) for i in range(60)]))
        for server in own_cluster.servers:
            server.kill()
        for _ in range(3):
            started = time.monotonic()
            assert remote.get(keys) == [None] * 60
            assert remote.put(keys, [b"x"] * 60) == [False] * 60
            assert remote.contains(keys) == [False] * 60
            assert time.monotonic() - started <= 3 * (TIMEOUT_S + MARGIN_S)
            time.sleep(0.12)
        stats = remote.stats()
        assert_accounted(stats)
        assert stats.unavailable >= 180 and stats.keys_not_stored >= 180 and stats.failures > 0
        for server in own_cluster.servers:
            server.start()  # back with its nodes.conf, empty of values
        own_cluster.wait_ok()
        deadline = time.monotonic() + 10
        while remote.put(keys, [value(i) for i in range(60)]) != [True] * 60:
            assert time.monotonic() < deadline, remote.stats()
            time.sleep(0.1)
        got = remote.get(keys)
        assert [bytes(g) if g is not None else None for g in got] == [value(i) for i in range(60)]
        assert_accounted(remote.stats())


def test_slot_count() -> None:
    assert SLOTS == 16384


def test_a_least_privilege_user_on_every_node(own_cluster: ValkeyCluster) -> None:
    with store(own_cluster, namespace="acl") as probe:
        prefix = probe.key_prefix
    rule = acl_rule("tenant", "tenant-password-123", prefix, cluster=True)
    for server in own_cluster.servers:
        command(server, *rule.split())
    ports = ",".join(f"127.0.0.1:{s.port}" for s in own_cluster.servers[:1])
    url = f"redis://tenant:tenant-password-123@{ports}"
    with ValkeyStore(url, namespace="acl", cluster=True, secret=SECRET) as remote:
        keys = [("acl", i) for i in range(50)]
        assert remote.put(keys, [value(i) for i in range(50)]) == [True] * 50
        assert [bytes(v or b"") for v in remote.get(keys)] == [value(i) for i in range(50)]
        assert remote.stats().failures == 0, remote.stats()


def test_a_hung_primary_costs_the_deadline_not_the_others_hits(own_cluster: ValkeyCluster) -> None:
    keys = [("hung", i) for i in range(120)]
    values = [value(i) for i in range(120)]
    with store(own_cluster) as remote:
        assert all(remote.put(keys, values))
        victim = own_cluster.servers[1]
        victim.pause()
        try:
            started = time.monotonic()
            got = remote.get(keys)
            took = time.monotonic() - started
        finally:
            victim.resume()
        assert took <= TIMEOUT_S + MARGIN_S
        hits = [g is not None for g in got]
        assert 0 < sum(hits) < len(keys)  # the two others' keys, read while it hung
        assert all(bytes(g) == v for g, v in zip(got, values, strict=True) if g is not None)
        stats = remote.stats()
        assert stats.timeouts == 1 and stats.failures == 1, stats
        assert_accounted(stats)
        time.sleep(0.15)  # past retry_after_s
        assert [bytes(g or b"") for g in remote.get(keys)] == values


def test_a_hung_primary_costs_a_large_put_its_keys_not_the_others() -> None:
    """The node that the put's first slot belongs to stops reading: 8 MiB for it fill the
    kernel's buffers, and its send waits out the deadline. Sent after it, the other nodes'
    shares would find the deadline passed; sent at the same time, they are stored. (A long
    node timeout: the pause is no failure the cluster acts on.)"""
    keys = [("hung put", i) for i in range(96)]
    values = [value(i, 256 * 1024) for i in range(96)]  # ~24 MiB, ~8 MiB a primary
    with (
        ValkeyCluster(replicas_each=0, node_timeout_ms=30_000) as cluster,
        store(cluster, timeout_s=2.0) as remote,
    ):
        slots = [key_slot(remote._format.server_key(encode_key(key))) for key in keys]
        owners = [cluster.owner(slot) for slot in slots]
        victim = owners[0]  # the first command's node: sent to first, one after another
        victim.pause()
        try:
            started = time.monotonic()
            stored = remote.put(keys, values)
            took = time.monotonic() - started
        finally:
            victim.resume()
        assert took <= 2.0 + MARGIN_S, took
        theirs = [ok for ok, owner in zip(stored, owners, strict=True) if owner is victim]
        assert theirs == [False] * len(theirs)
        assert all(ok for ok, owner in zip(stored, owners, strict=True) if owner is not victim)
        stats = remote.stats()
        assert stats.timeouts == 1 and stats.failures == 1, stats
        assert_accounted(stats)
        time.sleep(0.15)  # past retry_after_s
        assert all(remote.put(keys, values))
        assert [bytes(g or b"") for g in remote.get(keys)] == values
