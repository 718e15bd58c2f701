"""The ``kvoffload`` command: its output formats, its errors, and its quick startup."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from kvoffload.policies import BUILTIN_POLICIES, resolve_policy
from kvoffload.policies.lru import LruPolicy
from kvoffload.replay.sweep import SWEEP_POLICIES, cpu_stream, new_manager, replay
from kvoffload.replay.traces import load_trace
from kvoffload_spec.errors import InvalidArgumentError
from tests.helpers import run_cli
from tests.planted import VERIFY, Planted, share
from tests.planted.policies import UserPolicyBug

run = run_cli


def write_trace(path: Path, *requests: list[int]) -> str:
    path.write_text("".join(json.dumps({"hash_ids": r}) + "\n" for r in requests))
    return str(path)


@pytest.fixture
def small_trace(tmp_path: Path) -> str:
    # five conversations growing a block per turn, and a hot shared prefix in between:
    # the device keeps the hot prefix, the CPU tier catches conversations the device lost
    requests: list[list[int]] = []
    for turn in range(6):
        for conversation in range(5):
            requests.append([conversation * 100 + i for i in range(turn + 3)])
            if conversation % 2 == 0:
                requests.append([0, 1, 2])
    return write_trace(tmp_path / "small.jsonl", *requests)


def test_help_does_not_import_torch() -> None:
    probe = textwrap.dedent(
        """
        import contextlib, io, sys
        from kvoffload.cli import main
        with contextlib.redirect_stdout(io.StringIO()) as out:
            codes = [main(["--help"]), main(["simulate", "--help"]), main(["sweep", "--help"])]
        assert codes == [0, 0, 0], codes
        assert "simulate" in out.getvalue()
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy")))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == "[]", done.stdout


def test_python_dash_m_runs_the_same_command() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvoffload", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0 and done.stdout.startswith("kvoffload "), done


# -- sweep ------------------------------------------------------------------------------------


def test_sweep_json_has_the_documented_format(
    small_trace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(
        ["sweep", "--trace", small_trace, "--gpu-blocks", "0", "--capacities", "4,16", "--json"],
        capsys,
    )
    assert (code, err) == (0, "")
    results = json.loads(out)["results"]
    assert list(json.loads(out))[-1] == "results"
    # by default every built-in policy, and Belady
    assert (*BUILTIN_POLICIES, "belady") == SWEEP_POLICIES
    assert [(r["policy"], r["capacity"]) for r in results] == [
        (policy, capacity) for capacity in (4, 16) for policy in SWEEP_POLICIES
    ]
    assert all(set(r) == {"policy", "capacity", "hit_ratio"} for r in results)
    assert all(isinstance(r["hit_ratio"], float) and 0 <= r["hit_ratio"] < 1 for r in results)
    by_key = {(r["policy"], r["capacity"]): r["hit_ratio"] for r in results}
    assert by_key["lru", 16] <= by_key["belady", 16]
    assert by_key["belady", 4] < by_key["belady", 16]


def test_sweep_reproduces_a_reference_figure_from_the_command_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["sweep", "--trace", "synthetic", "--capacities", "1k", "--policies", "lru,belady"]
    code, out, _ = run([*argv, "--json"], capsys)
    assert code == 0
    assert [round(r["hit_ratio"], 4) for r in json.loads(out)["results"]] == [0.0841, 0.2766]


def test_sweep_prints_a_table_with_ratios_to_the_optimum(
    small_trace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(["sweep", "--trace", small_trace, "--capacities", "8"], capsys)
    assert code == 0
    assert "lru/belady" in out and "arc/belady" in out and "single tier" in out


def test_sweep_behind_a_device_cache_reports_the_device_tier(
    small_trace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(
        ["sweep", "--trace", small_trace, "--gpu-blocks", "10", "--capacities", "8"], capsys
    )
    assert code == 0
    assert "device hit ratio" in out


def test_sweep_plot_needs_matplotlib_or_draws_the_curves(
    small_trace: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.util

    target = tmp_path / "curves.png"
    code, _, err = run(
        ["sweep", "--trace", small_trace, "--capacities", "4,8", "--plot", str(target)], capsys
    )
    if importlib.util.find_spec("matplotlib") is None:
        assert code == 1
        assert err.count("\n") == 1 and "pip install 'kvoffload[plot]'" in err
        assert not target.exists()
    else:
        assert code == 0
        assert target.read_bytes().startswith(b"\x89PNG")


def test_the_policy_registry_names_the_specs_policies() -> None:
    """One table of built-in policies (the impl's); the spec, stdlib-only, cannot read it and
    names the same ones, in the same order."""
    from kvoffload_spec.policies import POLICY_NAMES

    assert tuple(BUILTIN_POLICIES) == POLICY_NAMES
    assert (*POLICY_NAMES, "belady") == SWEEP_POLICIES
    for name, policy_class in BUILTIN_POLICIES.items():
        assert resolve_policy(name) is policy_class


def test_every_entry_point_takes_its_defaults_from_the_one_place() -> None:
    import inspect

    from kvoffload import Offloader, OffloadManager
    from kvoffload.cli import build_parser
    from kvoffload.replay.simulate import SimulationConfig
    from kvoffload_spec import defaults

    def default_of(function: object, name: str) -> object:
        return inspect.signature(function).parameters[name].default  # type: ignore[arg-type]

    assert default_of(Offloader, "policy") == defaults.DEFAULT_POLICY
    assert default_of(Offloader, "stall_after") == defaults.DEFAULT_STALL_AFTER
    assert default_of(OffloadManager, "policy") == defaults.DEFAULT_POLICY
    assert default_of(OffloadManager, "store_threshold") == defaults.DEFAULT_STORE_THRESHOLD
    assert default_of(OffloadManager, "max_tracker_size") == defaults.DEFAULT_MAX_TRACKER_SIZE
    assert default_of(OffloadManager, "stall_after") == defaults.DEFAULT_STALL_AFTER
    assert SimulationConfig().policy == defaults.DEFAULT_POLICY
    parser = build_parser()
    for command in ("simulate", "verify"):
        assert parser.parse_args([command]).policy == defaults.DEFAULT_POLICY
    simulate = parser.parse_args(["simulate"])
    sizes = SimulationConfig()
    assert (simulate.gpu_blocks, simulate.cpu_blocks, simulate.block_bytes) == (
        sizes.gpu_blocks,
        sizes.cpu_blocks,
        sizes.block_bytes,
    )


# -- simulate --------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_simulate_json_adds_up_and_verifies_every_load(
    policy: str, small_trace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["simulate", "--trace", small_trace, "--gpu-blocks", "10", "--cpu-blocks", "20"]
    code, out, err = run([*argv, "--policy", policy, "--block-bytes", "1KiB", "--json"], capsys)
    assert (code, err) == (0, "")
    report = json.loads(out)
    assert report["device_hits"] + report["cpu_hits"] + report["misses"] == report["block_refs"]
    assert report["block_refs"] == 5 * (3 + 4 + 5 + 6 + 7 + 8) + 18 * 3
    assert report["cpu_hits"] > 0 and report["device_hits"] > 0
    assert report["blocks_loaded"] == report["cpu_hits"]
    assert report["bytes_loaded"] == 1024 * report["blocks_loaded"]
    assert report["all_loads_verified"] is True and report["load_mismatches"] == 0
    assert report["evictions"] > 0 and report["failed_stores"] == 0
    assert 0 < report["cpu_fraction_of_belady"] <= 1
    latency = report["manager_latency_us"]["all"]
    assert latency["calls"] > 0 and 0 < latency["p50"] <= latency["p99"] <= latency["max"]
    # the data path changes nothing in the bookkeeping: the sweep's replay gets the same hits
    stream, device_hits = cpu_stream(load_trace(small_trace).requests, 10)
    assert report["device_hits"] == device_hits
    assert report["cpu_hits"] == replay(stream, new_manager(policy, 20)).hits


def test_simulate_notices_a_load_that_brings_back_the_wrong_bytes(
    small_trace: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvoffload.transfer.engine import TransferEngine
    from kvoffload.transfer.jobs import Direction
    from kvoffload.transfer.runs import IdArray

    real_submit = TransferEngine._submit_trusted  # the offloader's entry: ids checked already

    def loads_from_block_zero(
        engine: TransferEngine, direction: Direction, device: IdArray, cpu: IdArray
    ) -> int:
        if direction is Direction.LOAD:
            cpu = np.zeros(len(cpu), dtype=np.int64)
        return real_submit(engine, direction, device, cpu)

    monkeypatch.setattr(TransferEngine, "_submit_trusted", loads_from_block_zero)
    argv = ["simulate", "--trace", small_trace, "--gpu-blocks", "10", "--cpu-blocks", "20"]
    code, out, err = run([*argv, "--json"], capsys)
    assert code == 1
    report = json.loads(out)
    assert report["all_loads_verified"] is False and report["load_mismatches"] > 0
    assert err == f"kvoffload simulate: error: {report['load_mismatches']} loaded blocks " + (
        "differ from what was stored\n"
    )


def test_simulate_prints_a_summary_on_a_bundled_trace(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["simulate", "--trace", "synthetic", "--requests", "200"], capsys)
    assert code == 0
    for label in (
        "reusable at most",
        "first uses",
        "device cache hits",
        "CPU tier hits",
        "of Belady's optimum",
        "GB/s",
        "p99",
    ):
        assert label in out
    assert "byte-exact" in out


# -- verify ----------------------------------------------------------------------------------


class RenamedLru(LruPolicy):
    """A user's policy that is LRU under another name: legal victims, so it conforms."""


@pytest.mark.slow  # whole verify runs
@pytest.mark.parametrize("entry", share(VERIFY), ids=lambda bug: bug.name)
def test_verify_finds_its_share_of_the_catalogue(
    entry: Planted, capsys: pytest.CaptureFixture[str]
) -> None:
    """A user's broken policy, named as ``module:Class`` the way a user names theirs."""
    bug = entry.subject
    assert isinstance(bug, UserPolicyBug)
    policy, symptom = f"{bug.policy.__module__}:{bug.policy.__name__}", bug.symptom
    argv = ["verify", "--policy", policy, "--budget", "30", "--json"]
    code, out, _ = run(argv, capsys)
    assert code == 1
    report = json.loads(out)
    assert report["passed"] is False
    assert [(c["name"], c["passed"]) for c in report["checks"]] == [("exploration", False)]
    counterexample = report["counterexample"]
    assert "a shortest history" in counterexample and symptom in counterexample
    assert "1. prepare_store(" in counterexample


@pytest.mark.slow  # whole verify runs
@pytest.mark.parametrize("policy", ["lru", f"{__name__}:RenamedLru"])
def test_verify_passes_a_conforming_policy(policy: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["verify", "--policy", policy, "--budget", "2", "--json"], capsys)
    assert code == 0
    report = json.loads(out)
    assert report["passed"] is True and report["counterexample"] is None
    exploration, conformance = report["checks"]
    assert exploration["name"] == "exploration" and "every state within" in exploration["covered"]
    assert conformance["name"] == "conformance" and "random histories" in conformance["covered"]
    explored = exploration["coverage"]
    assert set(explored) == {"depth", "complete", "states", "transitions"}
    assert explored["depth"] >= 1 and explored["transitions"] >= explored["states"] > 1
    assert f"within {explored['depth']} calls" in exploration["covered"]
    assert f"{explored['states']:,} states" in exploration["covered"]
    histories = conformance["coverage"]["histories"]
    assert histories >= 50 and f"{histories:,} random histories" in conformance["covered"]
    assert conformance["coverage"]["max_steps"] == 30


@pytest.mark.parametrize("budget", [0, -1.0, True, "60"])
def test_verify_refuses_a_budget_that_is_not_a_positive_number(budget: object) -> None:
    from kvoffload.checking.verify import verify

    with pytest.raises(InvalidArgumentError, match="budget_s"):
        verify("lru", budget_s=budget)  # type: ignore[arg-type]


# -- user errors: one line on stderr, status 1 (2 for a malformed command line) --------------


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["sweep", "--trace", "/no/such/trace.jsonl"], "trace file not found"),
        (["simulate", "--trace", "/no/such/trace.jsonl"], "trace file not found"),
        (["sweep", "--trace", "synthetic", "--policies", "lru,lfu"], "unknown policy 'lfu'"),
        (["sweep", "--trace", "synthetic", "--gpu-blocks", "100"], "longest request"),
        (["sweep", "--trace", "synthetic", "--plot", "curves.gif"], "ending in .png, .svg, .pdf"),
        (["simulate", "--trace", "synthetic", "--policy", "mru"], "unknown policy 'mru'"),
        (["simulate", "--trace", "synthetic", "--gpu-blocks", "100"], "longest request"),
        (["simulate", "--block-bytes", "1GiB", "--cpu-blocks", "1m"], "memory"),
        (["simulate", "--cpu-blocks", "1000000m"], "exceeds this machine's memory"),
        (["simulate", "--policy", "tests.planted.policies:IgnoresProtection"], "kvoffload verify"),
        (["verify", "--policy", "nosuchmodule:Policy"], "cannot import 'nosuchmodule'"),
        (["verify", "--policy", "json:dumps"], "not an EvictionPolicy subclass"),
        (["verify", "--policy", "mru"], "unknown policy 'mru'"),
    ],
)
def test_a_user_error_is_one_line_without_a_traceback(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(argv, capsys)
    assert code == 1
    assert err.count("\n") == 1, err
    assert err.startswith(f"kvoffload {argv[0]}: error: ") and expected in err, err
    assert "Traceback" not in err and out == ""


def test_a_malformed_trace_names_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "broken.jsonl"
    path.write_text('{"hash_ids": [1, 2]}\n{"hash_ids": [1, 2\n')
    code, _, err = run(["sweep", "--trace", str(path)], capsys)
    assert code == 1 and "broken.jsonl:2: not valid JSON" in err


@pytest.mark.parametrize("budget", ["0", "-1", "inf", "nan", "soon"])
def test_a_budget_is_checked_as_every_duration_is(
    budget: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The CLI's seconds are the library's: a finite number > 0 (check_seconds)."""
    code, out, err = run(["verify", "--budget", budget], capsys)
    assert (code, out) == (2, "")
    expected = (
        f"{budget!r} is not a number of seconds"
        if budget == "soon"
        else f"the value must be a finite number of seconds > 0, got {float(budget)!r}"
    )
    assert f"argument --budget: {expected}" in err


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["explode"],
        ["sweep", "--capacities", "1000,many"],
        ["sweep", "--gpu-blocks", "-1"],
        ["simulate", "--cpu-blocks", "0"],
        ["simulate", "--block-bytes", "4 bytes"],
        ["verify", "--budget", "0"],
    ],
)
def test_a_malformed_command_line_is_a_usage_error(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(argv, capsys)
    assert code == 2
    assert "usage: kvoffload" in err and "Traceback" not in err and out == ""
