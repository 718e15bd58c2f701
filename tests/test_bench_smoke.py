"""The manager benchmark runs, and writes what docs/performance.md says it writes.

Timings are not checked here (they belong to the benchmark's report, not to the gate); the
structure of the JSON is, and so is the benchmark's naive manager: it must give the same
answers as the manager, or the speedup measured against it would be meaningless.
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload.checking.conformance import check_conformance
from kvoffload.manager import OffloadManager
from kvoffload_spec.surface import LoadPlan, Lookup, StorePlan

BENCH = Path(__file__).resolve().parent.parent / "bench"
FLOOR_EXAMPLES = 100  # a few seconds: enough for stores that evict, loads and failures


def run_quick(script: str, out: Path, timeout: int) -> dict[str, object]:
    """``bench/<script> --quick --json --out <out>``: what it printed, which must be what
    it wrote.
    """
    done = subprocess.run(
        [sys.executable, str(BENCH / script), "--quick", "--json", "--out", str(out)],
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr
    printed: dict[str, object] = json.loads(done.stdout)
    assert json.loads(out.read_text(encoding="utf-8")) == printed
    return printed


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, object], Path]:
    out = tmp_path_factory.mktemp("bench") / "manager.json"
    return run_quick("manager_bench.py", out, timeout=120), out


def section(result: dict[str, object], name: str) -> dict[str, object]:
    found = result[name]
    assert isinstance(found, dict)
    return found


def rows(result: dict[str, object], name: str, field: str = "rows") -> list[dict[str, object]]:
    found = section(result, name)[field]
    assert isinstance(found, list) and found
    assert all(isinstance(row, dict) for row in found)
    return found


def listed(result: dict[str, object], name: str) -> list[dict[str, object]]:
    found = result[name]
    assert isinstance(found, list) and found
    assert all(isinstance(row, dict) for row in found)
    return found


def assert_positive_numbers(row: dict[str, object], *fields: str) -> list[float]:
    values: list[float] = []
    for field in fields:
        value = row[field]
        assert isinstance(value, (int, float)) and not isinstance(value, bool), (field, row)
        assert math.isfinite(value) and value > 0, (field, row)
        values.append(value)
    return values


@pytest.mark.slow  # the benchmark's quick run, ~8 s
def test_the_json_printed_is_the_json_written(quick_run: tuple[dict[str, object], Path]) -> None:
    printed, out = quick_run
    assert json.loads(out.read_text(encoding="utf-8")) == printed
    assert printed["benchmark"] == "manager" and printed["quick"] is True
    machine = section(printed, "machine")
    assert {"python", "implementation", "platform", "cpus"} <= machine.keys()


@pytest.mark.slow  # the benchmark's quick run, ~8 s
def test_fast_fail_compares_every_size_with_the_naive_manager(
    quick_run: tuple[dict[str, object], Path],
) -> None:
    result, _ = quick_run
    fast_fail = rows(result, "fast_fail")
    assert [row["blocks"] for row in fast_fail] == [1_000, 10_000]
    for row in fast_fail:
        assert_positive_numbers(row, "manager_us", "naive_us", "speedup")
    summary = section(result, "fast_fail")
    assert_positive_numbers(summary, "growth", "speedup_at_largest")
    assert isinstance(summary["growth_met"], bool) and isinstance(summary["speedup_met"], bool)


@pytest.mark.slow  # the benchmark's quick run, ~8 s
def test_one_victim_covers_every_policy_and_pin_level(
    quick_run: tuple[dict[str, object], Path],
) -> None:
    result, _ = quick_run
    configurations = {(r["blocks"], r["policy"], r["pinned"]) for r in rows(result, "one_victim")}
    assert configurations == {
        (n, policy, pinned)
        for n in (1_000, 10_000)
        for policy in ("lru", "arc")
        for pinned in (0.0, 0.5, 0.99)
    }
    long_runs = rows(result, "one_victim", "long_runs")
    assert {row["policy"] for row in long_runs} == {"lru", "arc"}
    for row in rows(result, "one_victim") + long_runs:
        fields = ("median_us", "p99_us", "p999_us", "max_us", "raw_max_us")
        latencies = assert_positive_numbers(row, *fields)
        assert latencies == sorted(latencies), row
        assert_positive_numbers(row, "calls", "rounds", "steady_max_us")
        assert row["max_cause"] in {"collection", "dict rebuild", "steady"}
        slow = row["slow_calls"]
        assert isinstance(slow, dict) and set(slow) <= {"collection", "dict rebuild", "steady"}


@pytest.mark.slow  # the benchmark's quick run, ~8 s
def test_memory_and_replay_rows(quick_run: tuple[dict[str, object], Path]) -> None:
    result, _ = quick_run
    for row in rows(result, "memory"):
        assert_positive_numbers(row, "blocks", "bytes_per_block")
    assert section(result, "replay")["trace"] == "conversation"
    for row in rows(result, "replay"):
        assert_positive_numbers(row, "requests", "calls", "calls_per_s", "requests_per_s")
        assert isinstance(row["hit_ratio"], float) and 0.0 <= row["hit_ratio"] <= 1.0


@pytest.mark.parametrize("seed", range(20))
def test_the_naive_manager_evicts_what_the_manager_evicts(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random histories, call by call against ``OffloadManager`` (which the differential
    test holds to the spec): long enough for touches to reorder blocks evicted later.
    """
    monkeypatch.syspath_prepend(str(BENCH))
    from naive_manager import naive_manager

    rng = random.Random(seed)
    managers = (OffloadManager(4, "lru"), naive_manager(4))
    stores: list[tuple[StorePlan, StorePlan]] = []
    loads: list[tuple[LoadPlan, LoadPlan]] = []
    keys = range(8)
    for step in range(300):
        action = rng.choice(("store", "store", "complete", "load", "unload", "touch", "touch"))
        chosen = rng.sample(keys, rng.randint(1, 3))
        if action == "store":
            plans = [manager.prepare_store(chosen) for manager in managers]
            assert plans[0] == plans[1], (step, plans)
            if plans[0] is not None and plans[1] is not None:
                stores.append((plans[0], plans[1]))
        elif action == "complete" and stores:
            success = rng.random() < 0.8
            pair = stores.pop(rng.randrange(len(stores)))
            for manager, store_plan in zip(managers, pair, strict=True):
                manager.complete_store(store_plan, success)
        elif action == "load":
            ready = [key for key in chosen if managers[0].lookup(key) is Lookup.HIT]
            if ready:
                loaded = [manager.prepare_load(ready) for manager in managers]
                assert loaded[0] == loaded[1], (step, loaded)
                loads.append((loaded[0], loaded[1]))
        elif action == "unload" and loads:
            for manager, load_plan in zip(
                managers, loads.pop(rng.randrange(len(loads))), strict=True
            ):
                manager.complete_load(load_plan)
        elif action == "touch":
            for manager in managers:
                manager.touch(chosen)
        assert [managers[0].lookup(k) for k in keys] == [managers[1].lookup(k) for k in keys]
    for manager in managers:
        manager.check_invariants()


def test_the_vllm_comparison_says_why_it_measures_nothing_without_vllm() -> None:
    # ``sys.modules["vllm"] = None`` makes ``import vllm`` fail as if it were not installed.
    program = (
        "import sys; sys.modules['vllm'] = None; sys.path.insert(0, sys.argv[1]); "
        "import vllm_compare; sys.exit(vllm_compare.main(['--quick']))"
    )
    done = subprocess.run(
        [sys.executable, "-c", program, str(BENCH)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("vllm_compare: skipped: vLLM is not importable here"), done.stdout


@pytest.mark.slow  # a benchmark run against its own server, ~7 s
def test_the_remote_benchmark_starts_its_server_and_writes_what_it_prints(
    tmp_path: Path,
) -> None:
    printed = run_quick("remote_bench.py", tmp_path / "remote.json", timeout=120)
    assert printed["benchmark"] == "remote" and printed["quick"] is True
    assert str(printed["server"]).startswith(("Valkey server", "Redis server"))
    throughput = listed(printed, "throughput")
    assert {(r["operation"], r["block_bytes"]) for r in throughput} == {
        (operation, size) for operation in ("put", "get") for size in (64 << 10, 2 << 20)
    }
    for row in throughput:
        # the ratio is the median of each sample's own ratio, not a ratio of the medians
        (ratio,) = assert_positive_numbers(row, "store_gbps", "client_gbps", "ratio")[2:]
        target = row["target"]
        assert isinstance(target, float) and row["met"] is (ratio >= target)
    assert printed["targets_met"] is all(row["met"] for row in throughput)
    sealing = listed(printed, "sealing")  # with a secret next to without
    assert {(r["operation"], r["block_bytes"]) for r in sealing} == {
        (operation, size) for operation in ("put", "get") for size in (64 << 10, 2 << 20)
    }
    for row in sealing:
        (ratio,) = assert_positive_numbers(row, "sealed_gbps", "plain_gbps", "ratio")[2:]
        assert row["target"] == 0.85 and row["met"] is (ratio >= 0.85)
    assert printed["sealed_targets_met"] is all(row["met"] for row in sealing)
    macs = {(r["algorithm"], r["block_bytes"]) for r in listed(printed, "mac_speed")}
    for algorithm in ("Poly1305 alone", "BLAKE2b keyed", "HMAC-SHA256"):
        assert {(algorithm, 64 << 10), (algorithm, 2 << 20)} <= macs
    for algorithm in ("AES-GMAC alone (AES-256-GCM, no plaintext)",):
        assert {(algorithm, 64 << 10), (algorithm, 2 << 20)} <= macs
    for row in listed(printed, "mac_speed"):
        assert_positive_numbers(row, "gbps", "us_per_block")
    for row in listed(printed, "copies"):
        assert row["operation"] in ("put", "get") and row["store_bytes_copied"] == 0
        assert_positive_numbers(row, "client_alloc_per_byte")
        # a put of 2 MiB blocks allocates nothing of its payload: 0.00 per byte, rounded
        store_alloc = row["store_alloc_per_byte"]
        assert isinstance(store_alloc, float) and 0 <= store_alloc < 3, row
    for row in listed(printed, "latency"):
        assert_positive_numbers(row, "store_median_us", "store_p99_us", "client_median_us")


def test_the_floor_manager_conforms(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its victims go unchecked, so a wrong one would corrupt the tables: the conformance
    kit holds it to the spec, as a user's policy (victims checked for legality only).
    """
    monkeypatch.syspath_prepend(str(BENCH))
    from floor_manager import FloorManager

    check_conformance(FloorManager, policy=None, max_examples=FLOOR_EXAMPLES)


@pytest.mark.slow  # vLLM's own manager at small sizes, ~20 s
def test_the_vllm_comparison_writes_its_rows_and_the_floor(tmp_path: Path) -> None:
    printed = run_quick("vllm_compare.py", tmp_path / "vllm.json", timeout=300)
    assert printed["benchmark"] == "vllm_compare" and printed["vllm_version"] == "0.33.0"
    replay = listed(printed, "replay")
    assert {(row["trace"], row["policy"]) for row in replay} == {
        (trace, policy) for trace in ("conversation", "synthetic") for policy in ("lru", "arc")
    }
    for row in replay:
        assert row["ours_hits"] == row["vllm_hits"], row  # the same evictions in both
        ours_s, vllm_s, ratio = assert_positive_numbers(row, "ours_s", "vllm_s", "ratio")
        assert ratio == pytest.approx(vllm_s / ours_s)
    for row in listed(printed, "floor"):
        floor_s = assert_positive_numbers(row, "floor_s")[0]
        vllm_by_policy, ceiling = row["vllm_s"], row["ceiling"]
        assert isinstance(vllm_by_policy, dict) and isinstance(ceiling, dict)
        for policy in ("lru", "arc"):
            theirs = [
                r["vllm_s"]
                for r in replay
                if (r["trace"], r["blocks"], r["policy"]) == (row["trace"], row["blocks"], policy)
            ]
            assert isinstance(theirs[0], float)
            assert vllm_by_policy[policy] == theirs[0]
            assert ceiling[policy] == pytest.approx(theirs[0] / floor_s)
    assert [row["policy"] for row in listed(printed, "one_victim")] == ["lru", "arc"]


@pytest.mark.slow  # the disk benchmark's quick run on real files, ~8 s
def test_the_disk_benchmark_writes_what_it_prints(tmp_path: Path) -> None:
    printed = run_quick("disk_bench.py", tmp_path / "disk.json", timeout=180)
    assert printed["benchmark"] == "disk" and printed["quick"] is True
    throughput = listed(printed, "throughput")
    assert {(r["format"], r["operation"], r["block_bytes"]) for r in throughput} >= {
        ("plain", operation, size) for operation in ("put", "get") for size in (64 << 10, 2 << 20)
    }
    for row in throughput:
        ratio, bound = assert_positive_numbers(
            row, "store_gbps", "plain_gbps", "ratio", "checksum_bound"
        )[2:]
        assert bound < 1
        if row["format"] == "plain":
            assert row["target"] == 0.8 and row["met"] is (ratio >= 0.8)
    assert printed["targets_met"] is all(r["met"] for r in throughput if r["met"] is not None)
    for row in listed(printed, "reopen"):
        assert_positive_numbers(row, "seconds", "seconds_per_gib")
    opened = printed["open_1m"]
    assert isinstance(opened, dict)
    assert_positive_numbers(opened, "seconds", "ram_bytes_per_block")


def test_the_policy_research_writes_what_it_prints(tmp_path: Path) -> None:
    printed = run_quick("policy_research.py", tmp_path / "research.json", timeout=120)
    assert printed["benchmark"] == "policy_research" and printed["quick"] is True
    assert printed["lru_matches_sweep"] is True  # else its columns are not the sweep's
    found = listed(printed, "rows")
    rules = ("lru", "lru2", "tinylfu", "admission-duel", "three-way-duel")
    assert [(row["rule"], row["capacity"]) for row in found] == [
        (rule, capacity) for capacity in (500, 1000) for rule in rules
    ]
    for row in found:
        ratio, leads = row["hit_ratio"], row["leads"]
        assert isinstance(ratio, float) and 0 <= ratio <= 1
        assert isinstance(leads, dict)
        assert (leads == {}) is (row["rule"] in ("lru", "lru2", "tinylfu"))
        assert not leads or math.isclose(sum(leads.values()), 1.0)


def test_the_policy_research_admission_refuses_what_is_asked_for_less(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two blocks of room: LRU lets a one-shot pair flush the pair asked for next, while
    admission keeps it (the newcomers were asked for no more often than their victims)."""
    monkeypatch.syspath_prepend(str(BENCH))
    from kvoffload.replay.traces import Trace
    from policy_research import replay

    trace = Trace("tiny", ((1, 2), (3, 4), (1, 2)))
    assert replay(trace, 2, "lru").hit_ratio == 0.0
    assert replay(trace, 2, "tinylfu").hit_ratio == 2 / 6
    # Asked for a second time, the pair wins against victims asked for once: stored then,
    # it hits the third time.
    again = Trace("again", ((1, 2), (3, 4), (3, 4), (3, 4)))
    assert replay(again, 2, "tinylfu").hit_ratio == 2 / 8
