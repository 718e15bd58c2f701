"""A Valkey Cluster reached over TLS (``rediss://`` with ``cluster=True``): every node behind a
TLS-terminating proxy the test starts on 127.0.0.1 (the bundled server has no TLS), each node
announcing its proxy's port, so the slot map and every redirect name TLS endpoints. The
store's TLS options, given once in the URL, reach every node it is sent to."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvoffload.tiers import ValkeyStore
from tests.remote_proxies import SelfSigned, TlsProxy
from tests.valkey_cluster import ValkeyCluster, command

pytestmark = pytest.mark.slow  # a cluster of its own behind proxies: the full gate

SECRET = b"cluster-tls-test-secret-0123456789"
ANNOUNCED_S = 10.0  # gossip takes a node's new port to the others well within this


def announced_ports(cluster: ValkeyCluster) -> list[set[int]]:
    """The client ports each node's CLUSTER NODES names."""
    maps = []
    for server in cluster.servers:
        text = command(server, "CLUSTER", "NODES")
        lines = (text.decode() if isinstance(text, bytes) else str(text)).splitlines()
        maps.append({int(line.split()[1].split("@")[0].rsplit(":", 1)[1]) for line in lines})
    return maps


@pytest.fixture(scope="module")
def behind_tls(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[ValkeyCluster, list[TlsProxy], SelfSigned]]:
    certificate = SelfSigned(tmp_path_factory.mktemp("tls"))
    with ValkeyCluster(replicas_each=0) as cluster:
        proxies = [TlsProxy(server.port, certificate) for server in cluster.servers]
        try:
            for server, proxy in zip(cluster.servers, proxies, strict=True):
                command(server, "CONFIG", "SET", "cluster-announce-port", str(proxy.port))
            wanted = {proxy.port for proxy in proxies}
            deadline = time.monotonic() + ANNOUNCED_S
            while any(ports != wanted for ports in announced_ports(cluster)):
                assert time.monotonic() < deadline, "the nodes did not learn the TLS ports"
                time.sleep(0.05)
            yield cluster, proxies, certificate
        finally:
            for proxy in proxies:
                proxy.close()


def test_a_sealed_cluster_store_over_tls_reaches_every_primary_byte_exact(
    behind_tls: tuple[ValkeyCluster, list[TlsProxy], SelfSigned],
) -> None:
    _, proxies, certificate = behind_tls
    seed = f"rediss://127.0.0.1:{proxies[0].port}?tls_ca_file={certificate.cert_file}"
    keys = list(range(60))
    values = [bytes([i]) * (4096 + i) for i in keys]
    with ValkeyStore(
        seed, namespace="cluster over TLS", cluster=True, secret=SECRET, timeout_s=10
    ) as store:
        assert store.put(keys, values) == [True] * len(keys)
        got = store.get(keys)
        assert [None if view is None else view.tobytes() for view in got] == values
        buffers = [bytearray(len(value)) for value in values]
        assert store.get_into(keys, buffers) == [True] * len(keys)
        assert buffers == [bytearray(value) for value in values]
        stats = store.stats()
        assert stats.failures == 0 and stats.hits == 2 * len(keys), stats
    # The map named only the proxies: every primary was reached through its TLS endpoint.
    assert all(proxy.accepted >= 1 for proxy in proxies), [p.accepted for p in proxies]


def test_a_cluster_store_speaking_plain_to_tls_endpoints_fails_counted(
    behind_tls: tuple[ValkeyCluster, list[TlsProxy], SelfSigned],
) -> None:
    _, proxies, _ = behind_tls
    url = f"redis://127.0.0.1:{proxies[0].port}"
    with ValkeyStore(
        url, namespace="cluster over TLS", cluster=True, timeout_s=1, retry_after_s=0
    ) as store:
        assert store.get([1, 2]) == [None, None]
        assert store.put([1], [b"x" * 100]) == [False]
        stats = store.stats()
        assert stats.failures >= 1 and stats.hits == 0, stats
