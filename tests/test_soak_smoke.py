"""The soak in the gate: 100,000 operations with no divergence and no leak, and a planted
bug that the soak must report.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.planted import SOAK, ManagerBug, Planted, share

pytestmark = pytest.mark.slow  # a quick soak is still half a minute

BENCH = Path(__file__).resolve().parent.parent / "bench"
LEAK_MIB = 1.0  # a leak of 10 bytes per operation would show as 0.8 MiB after the warm-up


def load_soak() -> ModuleType:
    """bench/soak.py as a module (bench/ is no package)."""
    spec = importlib.util.spec_from_file_location("bench_soak", BENCH / "soak.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, object], Path]:
    out = tmp_path_factory.mktemp("soak") / "soak.json"
    command = [sys.executable, str(BENCH / "soak.py"), "--quick", "--trace-memory", "--json"]
    done = subprocess.run(
        [*command, "--out", str(out)], capture_output=True, text=True, check=False, timeout=120
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report: dict[str, object] = json.loads(done.stdout)
    return report, out


def test_the_quick_soak_finds_no_divergence_and_no_leak(
    quick: tuple[dict[str, object], Path],
) -> None:
    report, out = quick
    assert json.loads(out.read_text()) == report
    assert report["operations"] == 100_000 and report["divergences"] == 0
    assert report["contracts"] is False  # it re-ran itself under python -O
    memory = report["memory"]
    assert isinstance(memory, dict)
    assert memory["samples"] == 20 and memory["traced_growth_mib"] < LEAK_MIB, memory


def test_every_lane_met_every_fault(quick: tuple[dict[str, object], Path]) -> None:
    lanes = quick[0]["lanes"]
    assert isinstance(lanes, list) and len(lanes) == 5
    for lane in lanes:
        assert isinstance(lane, dict)
        faults = ["stores", "loads", "failed copies", "resets", "checks"]
        if lane["lane"] != "offloader":  # its jobs run inside store and load: none stalls
            faults += ["stalled jobs", "abandoned", "abandoned, reported late"]
        assert all(lane.get(fault, 0) > 0 for fault in faults), lane


@pytest.mark.parametrize("bug", share(SOAK), ids=lambda bug: bug.name)
def test_the_soak_finds_its_share_of_the_catalogue(bug: Planted) -> None:
    """A manager that frees abandoned slots at once: the soak reports it, naming both
    answers."""
    assert isinstance(bug.subject, ManagerBug)
    soak = load_soak()
    report = soak.soak(
        20_000, seed=1, check_every=500, manager=bug.subject.broken, with_offloader=False
    )
    assert report["divergences"] == 1 and report["operations"] < 20_000, report
    divergence = str(report["divergence"])  # the history, ending in both answers
    assert "the manager:" in divergence and "the spec:" in divergence, divergence
