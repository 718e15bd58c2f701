"""``kvoffload simulate --remote URL --instances N`` against a real Valkey server, and the
promise that without ``--remote`` the command's output is what it was."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.helpers import run_cli as run
from tests.remote_support import SIMULATE_SLICE as SLICE
from tests.remote_support import SIMULATE_SMALL as SMALL
from tests.remote_support import simulation_adds_up as adds_up
from tests.valkey_server import ValkeyServer, free_port

pytestmark = pytest.mark.slow  # whole simulations on a server: the full gate only


# The fields of `simulate --json` before the remote tier existed: still exactly these.
LOCAL_FIELDS = {
    "trace", "backend", "gpu_blocks", "cpu_blocks", "policy", "block_bytes", "requests",
    "block_refs", "device_hits", "cpu_hits", "misses", "device_hit_ratio", "cpu_hit_ratio",
    "miss_ratio", "belady_cpu_hit_ratio", "cpu_fraction_of_belady", "blocks_stored",
    "blocks_loaded", "bytes_stored", "bytes_loaded", "transfer_gbps", "evictions",
    "rejected_stores", "fast_fail_rejections", "failed_stores", "load_mismatches",
    "all_loads_verified", "wall_seconds", "manager_latency_us", "first_uses", "reusable_ratio",
}  # fmt: skip


def shared(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    code, out, err = run(["simulate", *argv], capsys)
    assert (code, err) == (0, "")
    report: dict[str, Any] = json.loads(out)
    return report


@pytest.mark.parametrize("mode", ["write-back", "write-through"])
def test_two_engines_share_one_server(
    valkey_server: ValkeyServer, capsys: pytest.CaptureFixture[str], mode: str
) -> None:
    argv = [*SMALL, "--remote", valkey_server.url, "--instances", "2", "--remote-mode", mode]
    report = shared(argv, capsys)
    assert report["instances"] == 2 and report["remote"] == valkey_server.url
    engines, total = report["engines"], report["total"]
    assert [engine["requests"] for engine in engines] == [150, 150]
    for engine in [*engines, total]:
        adds_up(engine)
        assert engine["remote"]["failures"] == 0 and engine["remote"]["not_written"] == 0
    remote = total["remote"]
    assert remote["hits"] > 0 and remote["shared_hits"] > 0  # some came from the other engine
    assert remote["shared_hits"] <= remote["hits"] <= remote["fetched_blocks"]
    assert remote["bytes_fetched"] == 1024 * remote["fetched_blocks"]
    assert remote["bytes_written"] == 1024 * remote["blocks_written"] > 0
    for name in ("hits", "shared_hits", "blocks_written", "fetched_blocks"):
        assert remote[name] == sum(engine["remote"][name] for engine in engines)
    # The local tiers did what they do without a remote: the same device hits.
    local = shared([*SMALL, "--instances", "2"], capsys)
    assert total["device_hits"] == local["total"]["device_hits"]
    assert "remote" not in local["total"]
    assert total["misses"] < local["total"]["misses"]


def test_a_server_that_is_down_costs_hits_never_the_run(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    argv = ["simulate", *SMALL, "--requests", "60", "--remote", url, "--instances", "2"]
    code, out, err = run(argv, capsys)
    warnings = err.splitlines()
    assert code == 0 and len(warnings) == 2, err  # one at start (ping), one at the end
    assert all(line.startswith("kvoffload simulate: warning:") for line in warnings), err
    assert "does not answer" in warnings[0] and "Connection refused" in warnings[1], err
    report: dict[str, Any] = json.loads(out)
    total = report["total"]
    adds_up(total)
    assert total["remote"]["hits"] == 0 and total["remote"]["failures"] > 0


def test_without_remote_the_output_is_unchanged(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["simulate", *SMALL], capsys)
    assert (code, err) == (0, "")
    report = json.loads(out)
    assert set(report) == LOCAL_FIELDS
    adds_up(report)
    code, out, _ = run(["simulate", *SLICE], capsys)
    assert code == 0 and "remote" not in out and "engine 0" not in out


def test_the_table_shows_every_engine_and_the_sum(
    valkey_server: ValkeyServer, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [*SLICE, "--requests", "60", "--remote", valkey_server.url, "--instances", "2"]
    code, out, _ = run(["simulate", *argv], capsys)
    assert code == 0
    lines = out.splitlines()
    for text in ("all engines", "engine 0", "engine 1"):  # one row each
        assert sum(text in line for line in lines) == 1, text
    for text in ("remote hits", "by sharing", "2 engines sharing the remote tier"):
        assert text in out
    assert sum("4,096 CPU blocks" in line for line in lines) == 1  # said once, in the title


def test_bad_instances_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["simulate", "--instances", "0"], capsys)
    assert code == 2 and "--instances" in err
