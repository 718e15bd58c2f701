"""``kvoffload simulate --disk PATH --disk-bytes SIZE``: a disk tier behind the CPU pool of
the replay's engine, on real files; a second run on the directory is an engine restarted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import run_cli as run

SMALL = [
    "simulate", "--trace", "conversation", "--requests", "300", "--gpu-blocks", "256",
    "--cpu-blocks", "200", "--block-bytes", "4KiB", "--json",
]  # fmt: skip


def simulated(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    code, out, err = run(argv, capsys)
    assert (code, err) == (0, "")
    report: dict[str, Any] = json.loads(out)
    return report


def adds_up(report: dict[str, Any]) -> None:
    disk = report["disk"]
    hits = report["device_hits"] + report["cpu_hits"] + disk["hits"]
    assert hits + report["misses"] == report["block_refs"]
    assert report["blocks_loaded"] == report["cpu_hits"] + disk["hits"]
    assert report["all_loads_verified"] is True and disk["failures"] == 0
    assert disk["blocks_at_end"] <= disk["slots"]
    assert disk["bytes_fetched"] == 4096 * disk["fetched_blocks"]


@pytest.mark.slow  # three replays, ~10 s
def test_a_disk_tier_serves_what_the_cpu_pool_evicted_and_outlives_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    without = simulated(SMALL, capsys)
    argv = [*SMALL, "--disk", str(tmp_path / "disk"), "--disk-bytes", "8MiB"]
    first = simulated(argv, capsys)
    adds_up(first)
    disk = first["disk"]
    assert disk["hits"] > 0 and disk["blocks_at_start"] == 0 and disk["blocks_written"] > 0
    assert first["misses"] == without["misses"] - disk["hits"]  # the same engine otherwise
    second = simulated(argv, capsys)  # the engine restarted on the same directory
    adds_up(second)
    assert second["disk"]["blocks_at_start"] == disk["blocks_at_end"]
    assert second["disk"]["hits"] > disk["hits"]


def test_the_table_has_the_disk_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [a for a in SMALL if a != "--json"] + ["--disk", str(tmp_path / "disk")]
    code, out, err = run(argv, capsys)
    assert code == 0, err
    rows = [line.split("│")[1].strip() for line in out.splitlines() if line.count("│") > 2]
    tiers = ["device cache hits", "CPU tier hits", "disk tier hits", "recomputed", "served"]
    assert [row for row in rows if row in tiers] == tiers  # the disk in the tiers' order
    for row in ("disk traffic", "disk time", "disk evictions", "disk failures"):
        assert row in rows


def test_engines_with_a_disk_each_have_a_disk_hits_column(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [a for a in SMALL if a != "--json"] + ["--instances", "2", "--disk", str(tmp_path)]
    code, out, err = run(argv, capsys)
    assert code == 0, err
    header = next(line for line in out.splitlines() if "requests" in line and "┃" in line)
    columns = [cell.strip() for cell in header.split("┃")]
    assert columns.index("CPU hits") + 1 == columns.index("disk hits"), columns
    assert sorted(path.name for path in tmp_path.iterdir()) == ["engine-0", "engine-1"]
    code, out, err = run([a for a in SMALL if a != "--json"] + ["--instances", "2"], capsys)
    assert code == 0 and "disk hits" not in out, err


@pytest.mark.parametrize(
    ("extra", "says", "status"),
    [
        (["--disk-bytes", "1GiB"], "--disk-bytes does nothing without --disk", 2),
        (["--disk-admission", "every-offer"], "does nothing without --disk", 2),
        (["--disk", "/proc/no/such/dir"], "cannot make a disk tier", 1),
        (["--disk", "{tmp}", "--disk-bytes", "1KiB"], "holds no block", 1),
    ],
)
def test_bad_disk_options_end_with_one_line(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    says: str,
    status: int,
) -> None:
    argv = [*SMALL, *(part.replace("{tmp}", str(tmp_path / "d")) for part in extra)]
    code, out, err = run(argv, capsys)
    assert code == status and out == "" and says in err and err.count("\n") == 1, err
