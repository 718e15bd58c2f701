"""``kvoffload simulate --remote URL --remote-cluster``: engines sharing a real Valkey Cluster
(3 primaries, 3 replicas on 127.0.0.1), and one line, not a run of failures, when the flag
and the server disagree."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers import run_cli as run
from tests.remote_support import SIMULATE_SMALL as SMALL
from tests.remote_support import simulation_adds_up as adds_up
from tests.valkey_cluster import ValkeyCluster
from tests.valkey_server import ValkeyServer

pytestmark = pytest.mark.slow  # a cluster of six servers and whole simulations: the full gate


@pytest.fixture(scope="module")
def cluster() -> Iterator[ValkeyCluster]:
    with ValkeyCluster() as running:
        yield running


def test_three_engines_share_a_cluster_byte_exact(
    cluster: ValkeyCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["simulate", *SMALL, "--remote", cluster.url, "--remote-cluster", "--instances", "3"]
    code, out, err = run(argv, capsys)
    assert (code, err) == (0, "")
    report: dict[str, Any] = json.loads(out)
    total = report["total"]
    adds_up(total)
    remote = total["remote"]
    assert remote["failures"] == 0 and remote["hits"] > 0 and remote["shared_hits"] > 0
    assert all(engine["all_loads_verified"] for engine in report["engines"])


def test_the_table_says_the_remote_tier_is_a_cluster(
    cluster: ValkeyCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    one_node = cluster.url.split(",")[0]
    argv = ["simulate", *SMALL[:-1], "--requests", "30", "--remote", one_node, "--remote-cluster"]
    code, out, _ = run(argv, capsys)
    assert code == 0 and "(a Valkey Cluster)" in " ".join(out.split())


def test_a_cluster_node_without_the_flag_is_one_line(
    cluster: ValkeyCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    one_node = cluster.url.split(",")[0]
    code, out, err = run(["simulate", *SMALL, "--remote", one_node], capsys)
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and "cluster node" in err and "add --remote-cluster" in err


def test_the_flag_against_a_single_server_is_one_line(
    valkey_server: ValkeyServer, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["simulate", *SMALL, "--remote", valkey_server.url, "--remote-cluster"]
    code, out, err = run(argv, capsys)
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and "without --remote-cluster" in err


def test_the_flag_needs_a_remote(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["simulate", *SMALL, "--remote-cluster"], capsys)
    assert code == 2 and "--remote-cluster does nothing without --remote" in err
