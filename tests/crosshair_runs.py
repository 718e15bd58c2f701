"""Running CrossHair from the tests: one ``crosshair check`` subprocess per target, two at a
time, each verdict said as it comes (tests/test_crosshair.py, tests/test_crosshair_manager.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Run:
    target: str
    returncode: int
    output: str
    seconds: float

    def vacuous(self) -> bool:
        return "Unable to meet precondition" in self.output

    def refuted(self) -> bool:
        return self.returncode == 1 and ": error: " in self.output and not self.vacuous()

    def unexpected_lines(self) -> list[str]:
        """Lines other than CrossHair's verdict on the target."""
        verdicts = (": info: Not confirmed.", ": info: Confirmed over all paths.")
        return [line for line in self.output.splitlines() if not line.endswith(verdicts)]


def crosshair(target: str, timeout: float, pythonpath: Sequence[Path] = ()) -> Run:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), env.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "crosshair", "check", "--analysis_kind=asserts"]
    command += [f"--per_condition_timeout={timeout}", "--report_all", target]
    start = time.perf_counter()
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, check=False, timeout=600
    )
    seconds = time.perf_counter() - start
    return Run(target, done.returncode, (done.stdout + done.stderr).strip(), seconds)


def crosshair_all(
    jobs: Sequence[tuple[str, float]], pythonpath: Sequence[Path], say: Callable[[str], None]
) -> dict[str, Run]:
    """Run every (target, timeout), two at a time (the machine has two cores), saying each
    verdict as it comes: the runs take minutes, and a silent gate looks hung.

    The runs with the largest budget start first: those are the canaries and planted bugs,
    a few of which search for minutes, so that the short runs fill in beside the last of
    them instead of one long run finishing alone on a core.
    """
    started = time.perf_counter()
    say(f"CrossHair: {len(jobs)} targets, two at a time")
    runs: dict[str, Run] = {}
    longest_first = sorted(jobs, key=lambda job: -job[1])
    with ThreadPoolExecutor(max_workers=2) as pool:
        pending = [
            pool.submit(crosshair, target, timeout, pythonpath) for target, timeout in longest_first
        ]
        for future in as_completed(pending):
            run = future.result()
            runs[run.target] = run
            say(
                f"CrossHair {len(runs):3}/{len(jobs)} {time.perf_counter() - started:6.1f} s  "
                f"({run.seconds:5.1f} s, rc {run.returncode})  {run.target}"
            )
    return {target: runs[target] for target, _ in jobs}
