"""``kvoffload remote ping|stats|clear --cluster`` against a real Valkey Cluster of 3 primaries
(tests/valkey_cluster.py): every primary is asked, so a namespace's keys are counted and
deleted in every slot; and one line, not a partial answer, when the flag and the server
disagree."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest

from kvoffload.tiers import ValkeyStore
from kvoffload.tiers.cluster_map import key_slot
from kvoffload.tiers.values import Namespace, encode_key, frame
from tests.helpers import run_cli as run
from tests.valkey_cluster import ValkeyCluster, command
from tests.valkey_server import ValkeyServer

pytestmark = pytest.mark.slow  # a cluster of its own: the full gate

MODEL_A = {"model": "a", "block_tokens": 16}
MODEL_B = {"model": "b", "block_tokens": 16}
FOREIGN = b"somebody else's key"


def plain_id(description: object) -> str:
    return f"kvo1:{Namespace.of(description).fingerprint.hex()}"  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def cluster() -> Iterator[ValkeyCluster]:
    with ValkeyCluster(replicas_each=0) as running:
        yield running


@pytest.fixture
def seeded(cluster: ValkeyCluster) -> Iterator[dict[str, tuple[int, int]]]:
    """60 blocks of one namespace and 7 of another, written by a cluster store (so spread
    over every primary), and a key of nobody's; the keys and value bytes of each namespace
    (a cluster store writes no description)."""
    expected: dict[str, tuple[int, int]] = {}
    for description, count in ((MODEL_A, 60), (MODEL_B, 7)):
        with ValkeyStore(cluster.url, namespace=description, cluster=True, timeout_s=10) as store:
            assert store.put(list(range(count)), [bytes(100)] * count) == [True] * count
        namespace = Namespace.of(description)
        size = sum(
            len(frame(namespace, encode_key(i), memoryview(bytes(100)))) for i in range(count)
        )
        expected[plain_id(description)] = (count, size)
    owners = {cluster.owner(key_slot(Namespace.of(MODEL_A).key_prefix + encode_key(i))).port
              for i in range(60)}  # fmt: skip
    assert len(owners) == 3, "the blocks are on every primary"
    command(cluster.owner(key_slot(FOREIGN)), "SET", FOREIGN, b"x")
    yield expected
    for server in cluster.servers:
        command(server, "FLUSHALL")


def test_ping_reaches_every_primary(
    cluster: ValkeyCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(["remote", "ping", cluster.url, "--cluster"], capsys)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == f"{cluster.url}: a cluster of 3 primaries"
    ports = {server.port for server in cluster.servers}
    shown = [re.fullmatch(r"  127\.0\.0\.1:(\d+): valkey [\d.]+, PONG in \d+\.\d\d ms", line)
             for line in lines[1:]]  # fmt: skip
    assert len(shown) == 3 and all(shown) and {int(m.group(1)) for m in shown if m} <= ports
    code, out, _ = run(["remote", "ping", cluster.url, "--cluster", "--json"], capsys)
    report = json.loads(out)
    assert code == 0 and report["server"] == "valkey" and len(report["nodes"]) == 3
    assert report["latency_ms"] == max(node["latency_ms"] for node in report["nodes"]) > 0


def test_stats_counts_a_namespace_in_every_slot(
    cluster: ValkeyCluster, seeded: dict[str, tuple[int, int]], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(["remote", "stats", cluster.url, "--cluster", "--json"], capsys)
    assert code == 0
    report = json.loads(out)
    found = {entry["namespace"]: entry for entry in report["namespaces"]}
    assert {name: (e["keys"], e["bytes"]) for name, e in found.items()} == seeded
    assert report["other_keys"] == 1
    assert found[plain_id(MODEL_A)]["sample"] == {
        "checked": 8,
        "valid": 8,
    }  # 8 in all, not per node
    assert found[plain_id(MODEL_A)]["description"] is None  # a cluster store writes none
    one_node = cluster.url.split(",")[0]  # a seed that is one node is enough
    only = ["remote", "stats", one_node, "--cluster", "--namespace", plain_id(MODEL_B), "--json"]
    code, out, _ = run(only, capsys)
    (entry,) = json.loads(out)["namespaces"]
    assert code == 0 and (entry["keys"], entry["bytes"]) == seeded[plain_id(MODEL_B)]


def test_clear_deletes_a_namespace_from_every_primary_and_nothing_else(
    cluster: ValkeyCluster, seeded: dict[str, tuple[int, int]], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["remote", "clear", cluster.url, "--cluster", "--namespace", plain_id(MODEL_A)]
    code, out, _ = run([*argv, "--yes", "--json"], capsys)
    assert code == 0 and json.loads(out)["deleted"] == seeded[plain_id(MODEL_A)][0]
    code, out, _ = run(["remote", "stats", cluster.url, "--cluster", "--json"], capsys)
    report = json.loads(out)
    assert {e["namespace"]: e["keys"] for e in report["namespaces"]} == {plain_id(MODEL_B): 7}
    assert report["other_keys"] == 1
    with ValkeyStore(cluster.url, namespace=MODEL_A, cluster=True, timeout_s=10) as store:
        assert store.get(list(range(60))) == [None] * 60


@pytest.mark.parametrize("verb", ["ping", "stats", "clear"])
def test_a_cluster_node_without_the_flag_is_one_line(
    cluster: ValkeyCluster, verb: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Alone, a node answers for its own slots only: stats would count a third of a
    namespace and clear delete a third of it, each saying it was done."""
    one_node = cluster.url.split(",")[0]
    extra = ["--namespace", plain_id(MODEL_A), "--yes"] if verb == "clear" else []
    code, out, err = run(["remote", verb, one_node, *extra], capsys)
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and "is a cluster node: add --cluster" in err


def test_the_flag_against_a_single_server_is_one_line(
    valkey_server: ValkeyServer, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(["remote", "stats", valkey_server.url, "--cluster"], capsys)
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and "is not a cluster node: drop --cluster" in err


def test_the_flag_needs_a_url(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["remote", "stats", "--cluster"], capsys)
    assert code == 2 and "--cluster does nothing without URL" in err
