"""The README's line for a vLLM user: ``pip install kvoffload`` in the environment where
vLLM already runs must install kvoffload and change nothing else, above all not torch
(vLLM 0.33 pins torch==2.14.0; this machine's is 2.13.0, CPU). pip decides that from the
package's own requirements, so the check is pip's: a dry run with no index, whose report
lists what it would install, against the packages installed here."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def would_install(requirement: str, tmp_path: pathlib.Path) -> list[str]:
    source = tmp_path / "kvoffload"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    for folder in ("impl", "spec"):
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("*.egg-info"))
    report = tmp_path / "report.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--no-index",  # nothing may come from elsewhere: installed packages must do
            "--no-build-isolation",
            "--quiet",
            "--report",
            str(report),
            requirement.replace("PACKAGE", str(source)),
        ],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    return [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]


@pytest.mark.parametrize("requirement", ["PACKAGE", "PACKAGE[metrics]"])
def test_installing_kvoffload_next_to_vllm_changes_no_other_package(
    requirement: str, tmp_path: pathlib.Path
) -> None:
    import torch
    import vllm

    assert torch.__version__ and vllm.__version__  # both installed here, as for the user
    assert would_install(requirement, tmp_path) == ["kvoffload"]


def test_the_package_requires_no_engine_and_pins_no_torch() -> None:
    """What makes the line above hold anywhere: torch only as a lower bound, and no extra
    that would pull vLLM (and so re-resolve vLLM's own torch pin)."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch = [dep for dep in project["dependencies"] if dep.startswith("torch")]
    assert torch == ["torch>=2.4"]
    extras = project["optional-dependencies"]
    assert not any(
        dep.startswith(("vllm", "sglang", "torch")) for deps in extras.values() for dep in deps
    )
    assert extras["metrics"] == ["prometheus_client>=0.20"]
