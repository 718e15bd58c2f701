"""``bench/gpu_check.sh`` on the machine the tests run on: its CPU path, as docs/gpu.md shows it.

On a CPU-only torch the ``env`` step must fail (no CUDA device; usually no ``nvidia-smi``
either), and say so with a non-zero rc although its last command works; and a run leaves
nothing in the checkout: its outputs go to ``$OUT`` or to a new temporary directory.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_check.sh"


def untracked() -> set[str]:
    """The checkout's untracked files that git does not ignore."""
    done = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return {line[3:] for line in done.stdout.splitlines() if line.startswith("?? ")}


def run_env_step(tmp_path: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    """The script run from ``tmp_path`` with its temporary directories there: by default only
    its ``env`` step, with this interpreter."""
    env = {k: v for k, v in os.environ.items() if k not in {"OUT", "STEPS"}}
    env.update({"STEPS": "env", "PYTHON": sys.executable, "TMPDIR": str(tmp_path), **extra})
    return subprocess.run(
        ["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )


@pytest.mark.slow  # the env step imports torch twice, ~6 s
def test_the_env_step_reports_its_first_failure_and_nothing_lands_in_the_checkout(
    tmp_path: Path,
) -> None:
    before = untracked()
    done = run_env_step(tmp_path)
    assert untracked() <= before, "gpu_check.sh left files in the checkout"
    assert not (ROOT / "gpu_out").exists()

    where = re.search(r"^outputs in (.+)$", done.stdout, re.MULTILINE)
    assert where, done.stdout
    out = Path(where.group(1))
    assert out.parent == tmp_path and out.name.startswith("kvoffload-gpu-check.")
    summary = (out / "summary.txt").read_text()
    assert summary == done.stdout
    step = re.search(r"^env: rc=(\d+) \(\d+ s, limit 30 s\)$", summary, re.MULTILINE)
    assert step, summary
    rc = int(step.group(1))

    env_log = (out / "env.log").read_text()
    # the step's last command imports numpy, pytest and hypothesis, which works here
    assert re.search(r"^\d+\.\d+\S* \d+\.\d+\S* \d+\.\d+\S*$", env_log, re.MULTILINE), env_log
    a_gpu_machine = torch.cuda.is_available() and shutil.which("nvidia-smi") is not None
    if a_gpu_machine:
        assert rc == 0 and done.returncode == 0, env_log
        assert summary.endswith(f"every step passed (outputs in {out})\n")
    else:
        assert rc != 0, env_log  # it read rc=0 over a traceback
        assert f"env: rc={rc} from: " in env_log, env_log
        assert done.returncode == 1
        assert summary.endswith(f"failed: env (outputs in {out})\n")
    if not torch.cuda.is_available():
        assert "Traceback" in env_log and "get_device_name" in env_log


def test_an_unknown_step_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    done = run_env_step(tmp_path, STEPS="env,overlap,gpu")
    assert done.returncode == 2
    assert "STEPS: no step named 'gpu' (the steps: env pytest transfer" in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_out_is_used_when_set(tmp_path: Path) -> None:
    out = tmp_path / "given"
    done = run_env_step(tmp_path, STEPS="overlap,transfer", OUT=str(out), PYTHON="false")
    # the two steps named run, in the script's order; `false` fails each at once
    assert done.stdout.splitlines()[0] == f"outputs in {out}"
    assert re.findall(r"^(\w+): rc=(\d+)", done.stdout, re.MULTILINE) == [
        ("transfer", "1"),
        ("overlap", "1"),
    ]
    assert sorted(p.name for p in out.iterdir()) == ["overlap.log", "summary.txt", "transfer.log"]
    assert [p.name for p in tmp_path.iterdir()] == ["given"]
