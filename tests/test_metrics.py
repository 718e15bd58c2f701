"""kvoffload's metrics outside vLLM: ``kvoffload.metrics`` serves what the manager, an
offloader and a remote store count, over a real HTTP endpoint, parsed by
prometheus_client's own parser; ``kvoffload simulate --metrics-port`` serves them while
it runs; docs/metrics.md names every metric."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvoffload import Offloader
from kvoffload.cli import main
from kvoffload.manager import OffloadManager
from kvoffload.metrics import METRICS, MetricsExporter, samples, unexported_fields
from kvoffload.replay.simulate import SimulationConfig, simulate
from kvoffload.replay.traces import bundled_trace
from kvoffload_spec.errors import InvalidArgumentError
from tests.valkey_server import free_port

ROOT = pathlib.Path(__file__).resolve().parent.parent
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_every_counter_of_every_snapshot_is_a_metric() -> None:
    """A counter added to ManagerStats, TransferStats, RemoteOffloadStats or RemoteStats
    fails this until it is named in kvoffload.metrics (and so on /metrics)."""
    assert unexported_fields() == {
        "ManagerStats": [],
        "TransferStats": [],
        "RemoteOffloadStats": [],
        "RemoteStats": [],
    }


def test_an_offloaders_counters_served_over_http_equal_its_snapshots() -> None:
    kv = [torch.arange(8 * 16, dtype=torch.float32).reshape(8, 16)]
    offloader = Offloader(kv, num_cpu_blocks=2, policy="lru")
    try:
        for keys, blocks in (([b"a", b"b"], [0, 1]), ([b"c"], [2])):
            assert offloader.store(keys, blocks) is not None
            offloader.wait()
            offloader.poll()
        assert offloader.lookup(b"a") is not None
        offloader.load([b"c"], [5])
        offloader.wait()
        offloader.poll()
        with MetricsExporter({"engine0": offloader}) as exporter:
            port = exporter.serve(0)
            served = scrape(port)
            manager = offloader.manager
            assert isinstance(manager, OffloadManager)
            stats, copies = manager.stats(), offloader.transfer_stats()

            def value(name: str, **labels: str) -> float:
                return served[(name, tuple(sorted({"instance": "engine0", **labels}.items())))]

            assert value("kvoffload_evictions_total") == stats.evictions == 1
            assert value("kvoffload_blocks_stored_total") == stats.blocks_stored == 3
            assert value("kvoffload_lookups_total", result="hit") == stats.lookup_hits
            assert value("kvoffload_blocks", state="evictable") == stats.evictable == 2
            assert value("kvoffload_capacity_blocks") == 2
            assert value("kvoffload_transfers_total", direction="store", result="ok") == 2
            assert value("kvoffload_transfer_bytes_total", direction="load") == copies.load_bytes
            assert copies.load_bytes == 16 * 4 and copies.store_bytes == 3 * 16 * 4
            # A scrape serves the last refresh: more work shows only after the next one.
            offloader.store([b"d"], [3])
            offloader.wait()
            offloader.poll()
            assert scrape(port) == served
            exporter.refresh()
            assert scrape(port)[("kvoffload_evictions_total", (("instance", "engine0"),))] == 2
    finally:
        offloader.close()


def test_simulate_serves_its_engines_metrics_while_it_runs() -> None:
    port = free_port()
    seen: list[Samples] = []
    config = SimulationConfig(gpu_blocks=256, cpu_blocks=128, max_requests=200)
    report = simulate(
        bundled_trace("synthetic"),
        config,
        on_request=lambda done, total: seen.append(scrape(port)),
        metrics_port=port,
    )
    assert len(seen) >= 2
    key = ("kvoffload_blocks_stored_total", (("instance", "0"),))
    assert 0 < seen[0][key] <= seen[-1][key]
    assert seen[-1][("kvoffload_capacity_blocks", (("instance", "0"),))] == 128
    assert report.requests == 200
    with pytest.raises(OSError):  # the replay is over: so is the server
        scrape(port)


def test_the_cli_takes_a_port_and_refuses_anything_else(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for bad in ("0", "65536", "x"):
        assert main(["simulate", "--metrics-port", bad]) == 2  # argparse's usage error
        assert "TCP port" in capsys.readouterr().err
    port = free_port()
    command = ["simulate", "--trace", "synthetic", "--requests", "64", "--json"]
    code = main([*command, "--metrics-port", str(port)])
    assert code == 0
    assert f"http://127.0.0.1:{port}/metrics" in capsys.readouterr().err


def test_a_port_in_use_is_a_typed_error() -> None:
    manager = OffloadManager(4)
    with MetricsExporter(manager) as first:
        port = first.serve(0)
        with (
            MetricsExporter(manager) as second,
            pytest.raises(InvalidArgumentError, match="cannot serve"),
        ):
            second.serve(port)
        with pytest.raises(InvalidArgumentError, match="serving already"):
            first.serve(0)


def test_a_source_that_counts_nothing_is_refused() -> None:
    with pytest.raises(TypeError, match="not an Offloader"):
        samples(object())


def test_importing_kvoffload_or_its_metrics_imports_no_prometheus_client() -> None:
    probe = (
        "import sys, kvoffload, kvoffload.metrics\n"
        "from kvoffload import OffloadManager, Offloader\n"
        "print('prometheus_client' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_docs_name_every_metric() -> None:
    text = (ROOT / "docs" / "metrics.md").read_text()
    missing = [m.exposed_name for m in METRICS.values() if f"`{m.exposed_name}`" not in text]
    assert missing == []


def test_every_sample_has_a_value_for_each_of_its_labels() -> None:
    """(vLLM's frontend refuses a series with the wrong number of label values.)"""
    import dataclasses

    from kvoffload.metrics import (
        manager_samples,
        remote_offload_samples,
        remote_samples,
        transfer_samples,
    )
    from kvoffload.offloader import RemoteOffloadStats
    from kvoffload.stats import ManagerStats, TransferStats
    from kvoffload.tiers.store import RemoteStats

    zeros = {f.name: 0 for f in dataclasses.fields(ManagerStats)}
    every = [
        *manager_samples(ManagerStats(**zeros)),
        *transfer_samples(TransferStats()),
        *remote_offload_samples(RemoteOffloadStats("write-back")),
        *remote_samples(RemoteStats(), "tier", "connection"),
    ]
    assert {sample.metric.name for sample in every} == set(METRICS) - {
        "kvoffload_tier_keys_not_loaded"  # the vLLM tier's own (test_vllm_tier.py)
    }
    for sample in every:
        assert len(sample.labelvalues) == len(sample.metric.labelnames), sample
    series = [(sample.metric.name, sample.labelvalues) for sample in every]
    assert len(series) == len(set(series))  # no two fields on one series
