"""Running CrossHair from the tests: ``crosshair check`` subprocesses, two at a time, each
verdict said as it comes (tests/test_crosshair.py, tests/test_crosshair_manager.py).

The targets of one class with one time budget share a process: a process costs about half
a CPU second before its first path (Python, CrossHair, the package), as much as a canary's
whole search, and the gate runs about a hundred targets. CrossHair reports each target on
lines of its own, which are told apart here by the function they name.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# ``path:line: level: message``; an error's message ends with the call that failed,
# ``when calling check_touch(LruChecks(2, ...), [])``, naming the method and the class.
LINE = re.compile(r"^(?P<path>.+?):(?P<line>\d+): (?P<level>\w+): (?P<message>.*)$")
CALL = re.compile(r" when calling (?P<function>\w+)\((?P<cls>\w+)\(")


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


def _method(name: str) -> str:
    """A check's name, whether CrossHair names the method or the function behind it (the
    spec's classes bind ``_check_touch`` as ``check_touch``)."""
    return name.lstrip("_")


@cache
def _function_at(path: str, line: int) -> str | None:
    """The function whose ``def`` is at ``line`` of ``path``: where CrossHair puts its info
    lines."""
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    except (OSError, SyntaxError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.lineno == line:
            return node.name
    return None


def _owner(line: str, methods: dict[str, str], cls: str) -> str | None:
    """The target of this batch (a class's methods, by check name) that ``line`` is about."""
    found = LINE.match(line)
    if found is None:
        return None
    call = CALL.search(found["message"]) if found["level"] == "error" else None
    if call is not None:
        return methods.get(_method(call["function"])) if call["cls"] == cls else None
    function = _function_at(found["path"], int(found["line"]))
    return None if function is None else methods.get(_method(function))


def crosshair(targets: Sequence[str], timeout: float, pythonpath: Sequence[Path] = ()) -> list[Run]:
    """Check ``targets``, distinct methods of one class, in one process, ``timeout`` CPU
    seconds each."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), env.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "crosshair", "check", "--analysis_kind=asserts"]
    command += [f"--per_condition_timeout={timeout}", "--report_all", *targets]
    start = time.perf_counter()
    done = subprocess.run(
        command,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=120 + 2 * timeout * len(targets),
    )
    seconds = time.perf_counter() - start
    return split_runs(targets, done.stdout + done.stderr, done.returncode, seconds)


def split_runs(targets: Sequence[str], output: str, returncode: int, seconds: float) -> list[Run]:
    """One process's output, as a run per target: each holds the lines about it; a line
    about none of them (a crash, a warning) goes to every one, where it fails the verdict
    instead of vanishing."""
    classes = {target.rsplit(".", 1)[0] for target in targets}
    methods = {_method(target.rsplit(".", 1)[1]): target for target in targets}
    if len(classes) != 1 or len(methods) != len(targets):
        raise ValueError(f"one process checks distinct methods of one class: {targets}")
    cls = next(iter(classes)).rsplit(".", 1)[-1]
    lines: dict[str, list[str]] = {target: [] for target in targets}
    stray: list[str] = []
    for line in output.strip().splitlines():
        owner = _owner(line, methods, cls)
        (stray if owner is None else lines[owner]).append(line)
    runs = []
    for target in targets:
        mine = lines[target] + stray
        # Exit status 1 is CrossHair's "a counterexample was found", for the whole process;
        # any other failure (a crash, 2 for bad arguments) is every target's.
        code = returncode if returncode not in (0, 1) else 0
        if code == 0 and any(": error: " in line for line in mine):
            code = 1
        runs.append(Run(target, code, "\n".join(mine), seconds))
    return runs


def crosshair_all(
    jobs: Sequence[tuple[str, float]], pythonpath: Sequence[Path], say: Callable[[str], None]
) -> dict[str, Run]:
    """Run every (target, timeout), two processes at a time (the machine has two cores), one
    process per class and timeout, saying each verdict as its process ends: the runs take
    minutes, and a silent gate looks hung.

    The processes with the largest budget per target start first: those are the canaries
    and planted bugs, a few of which search for minutes, so that the short runs fill in
    beside the last of them instead of one long run finishing alone on a core.
    """
    started = time.perf_counter()
    say(f"CrossHair: {len(jobs)} targets, two processes at a time")
    batches: dict[tuple[str, float], list[str]] = {}
    for target, timeout in jobs:
        batches.setdefault((target.rsplit(".", 1)[0], timeout), []).append(target)
    longest_first = sorted(batches.items(), key=lambda item: (-item[0][1], -len(item[1])))
    runs: dict[str, Run] = {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        pending = [
            pool.submit(crosshair, targets, timeout, pythonpath)
            for (_, timeout), targets in longest_first
        ]
        for future in as_completed(pending):
            for run in future.result():
                runs[run.target] = run
                say(
                    f"CrossHair {len(runs):3}/{len(jobs)} {time.perf_counter() - started:6.1f} s  "
                    f"({run.seconds:5.1f} s, rc {run.returncode})  {run.target}"
                )
    return {target: runs[target] for target, _ in jobs}
