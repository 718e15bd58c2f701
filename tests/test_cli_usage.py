"""What a user trips over on the command line: a flag that would do nothing, a mistyped
trace name, a policy of their own that raises, Ctrl-C in a long sweep, a progress bar
without an end in sight."""

from __future__ import annotations

import inspect
import io
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload.policies.lru import LruPolicy
from tests.helpers import run_cli as run
from tests.planted.policies import RaisesOnEviction

RAISES = f"{RaisesOnEviction.__module__}:{RaisesOnEviction.__name__}"


class InterruptsTheThirdPool(LruPolicy):
    """Ctrl-C, as it would come, while the third tier of a sweep is being built."""

    made = 0

    def __init__(self, capacity: int) -> None:
        type(self).made += 1
        if type(self).made == 3:
            raise KeyboardInterrupt
        super().__init__(capacity)


class SignalsTheSecondPool(LruPolicy):
    """A real SIGINT, the one Ctrl-C sends, while its second pool is built."""

    made = 0

    def __init__(self, capacity: int) -> None:
        type(self).made += 1
        if type(self).made == 2:
            os.kill(os.getpid(), signal.SIGINT)
        super().__init__(capacity)


@pytest.mark.parametrize(
    "argv",
    [
        ["simulate", "--remote-mode", "write-through"],
        ["simulate", "--instances", "2", "--remote-mode=write-back"],
    ],
)
def test_a_flag_that_would_do_nothing_is_refused_in_one_line(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(argv, capsys)
    assert (code, out) == (2, "")
    assert err == "kvoffload simulate: error: --remote-mode does nothing without --remote\n"


def test_a_mistyped_bundled_trace_name_suggests_the_names(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run(["sweep", "--trace", "conversaton"], capsys)
    assert (code, out) == (1, "")
    assert err == (
        "kvoffload sweep: error: no trace file or bundled trace 'conversaton' (did you mean "
        "'conversation'? bundled traces: conversation, synthetic)\n"
    )
    _, _, err = run(["simulate", "--trace", "zzz"], capsys)
    assert "'zzz' (bundled traces: conversation, synthetic)" in err
    _, _, err = run(["simulate", "--trace", "nothere.jsonl"], capsys)  # a file's name: as before
    assert "trace file not found: nothere.jsonl" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["simulate", "--trace", "synthetic", "--policy", RAISES],
        ["simulate", "--trace", "synthetic", "--policy", RAISES, "--instances", "2"],
        ["sweep", "--trace", "synthetic", "--capacities", "100", "--policies", f"lru,{RAISES}"],
    ],
)
def test_a_user_policy_that_raises_is_reported_in_one_line_as_verify_does(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(argv, capsys)
    assert (code, out) == (1, "")
    line = inspect.getsourcelines(RaisesOnEviction.evict)[1] + 1
    assert err == (
        f"kvoffload {argv[0]}: error: policy {RAISES} raised ZeroDivisionError(the author "
        f"divided by the pool's free blocks) at policies.py:{line}: raise ZeroDivisionError(\"the "
        f"author divided by the pool's free blocks\") (kvoffload verify --policy {RAISES} "
        "shows how)\n"
    )


def test_an_error_that_is_not_the_policys_keeps_its_traceback() -> None:
    from kvoffload.cli import _raised_by_policy

    with pytest.raises(KeyError):
        try:
            raise KeyError("raised here, in no policy's module")
        except KeyError as error:
            _raised_by_policy(error, [RAISES, "lru"])


@pytest.mark.parametrize("as_json", [False, True])
def test_ctrl_c_in_a_sweep_prints_the_points_done_and_exits_130(
    as_json: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    InterruptsTheThirdPool.made = 0
    policy = f"{__name__}:InterruptsTheThirdPool"
    argv = ["sweep", "--trace", "synthetic", "--capacities", "100,200,400"]
    argv += ["--policies", f"{policy},belady", *(["--json"] if as_json else [])]
    code, out, err = run(argv, capsys)
    assert code == 130
    assert err == "kvoffload sweep: interrupted after 4 of 6 points\n"
    if as_json:
        report = json.loads(out)
        assert report["partial"] is True
        assert [(r["policy"], r["capacity"]) for r in report["results"]] == [
            ("InterruptsTheThirdPool", 100),
            ("belady", 100),
            ("InterruptsTheThirdPool", 200),
            ("belady", 200),
        ]
    else:
        assert "partial: interrupted after 4 points" in out
        assert "200" in out and "400" not in out


def test_a_real_sigint_in_a_sweep_run_as_a_user_runs_it() -> None:
    policy = f"{__name__}:SignalsTheSecondPool"
    argv = ["sweep", "--trace", "synthetic", "--capacities", "100,200", "--policies"]
    done = subprocess.run(
        [sys.executable, "-m", "kvoffload", *argv, f"{policy},belady", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parent.parent,
        # as on a terminal: a job started in the background inherits SIGINT ignored
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert done.returncode == 130, done.stderr
    assert done.stderr == "kvoffload sweep: interrupted after 2 of 4 points\n"
    report = json.loads(done.stdout)
    assert report["partial"] is True and len(report["results"]) == 2


def test_a_whole_sweep_says_nothing_of_partial(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["sweep", "--trace", "synthetic", "--capacities", "100", "--policies", "lru", "--json"]
    code, out, _ = run(argv, capsys)
    assert code == 0 and "partial" not in json.loads(out)


def test_a_progress_bar_shows_the_time_left() -> None:
    from rich.console import Console

    from kvoffload.cli_output import progress

    screen = Console(file=io.StringIO(), force_terminal=True, width=120)
    with progress(screen, enabled=True) as bar:
        task = bar.add_task("sweeping", total=10)
        bar.update(task, completed=5)
        drawn = Console(file=io.StringIO(), width=120, color_system=None)
        drawn.print(bar.make_tasks_table(bar.tasks))
    line = drawn.file.getvalue()  # type: ignore[attr-defined]
    assert "sweeping" in line and "5/10" in line
    assert re.search(r"eta (\d+:\d\d:\d\d|-:--:--)", line), line


def test_a_bare_4k_byte_size_names_the_units_it_takes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["simulate", "--block-bytes", "4k"], capsys)
    assert out == ""
    assert code == 2 and "KiB, MiB, GiB" in err and "KB, MB, GB" in err
