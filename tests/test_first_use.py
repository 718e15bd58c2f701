"""What a new user meets first: the installed command, policy modules of their own, pipes,
and the README's examples, run as written."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Container, Iterator
from pathlib import Path

import pytest

from kvoffload.cli import main
from kvoffload.policies import LruPolicy, resolve_policy
from kvoffload_spec.errors import UnknownPolicyError
from kvoffload_spec.surface import Key

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "docs" / "examples"
# the console script pip installed next to this interpreter (README: .venv/bin/kvoffload)
KVOFFLOAD = Path(sys.executable).with_name("kvoffload")


def kvoffload(*argv: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The installed ``kvoffload`` command, run as a user runs it (not ``python -m``)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [str(KVOFFLOAD), *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


# -- policy modules of your own --------------------------------------------------------------


@pytest.mark.slow  # a subprocess of the command, 4-5 s
def test_the_installed_command_imports_a_policy_module_from_the_working_directory(
    tmp_path: Path,
) -> None:
    (tmp_path / "mine.py").write_text(
        "from kvoffload.policies import LruPolicy\n\nclass Renamed(LruPolicy):\n    pass\n"
    )
    done = kvoffload("verify", "--policy", "mine:Renamed", "--budget", "1", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert '"passed": true' in done.stdout


@pytest.mark.slow  # a conformance run in a subprocess
def test_the_shipped_example_policy_conforms_from_its_directory() -> None:
    done = kvoffload(
        "verify", "--policy", "mypolicies:SlruPolicy", "--budget", "3", "--json", cwd=EXAMPLES
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert '"passed": true' in done.stdout


@pytest.mark.parametrize(
    ("source", "policy", "expected"),
    [
        (
            "import no_such_dependency\n",
            "imports_missing:P",
            "importing 'imports_missing' failed: ModuleNotFoundError: No module named "
            "'no_such_dependency' (",
        ),
        (
            "class P(\n",
            "syntax_error:P",
            "importing 'syntax_error' failed: SyntaxError in ",
        ),
        (
            "raise RuntimeError('no GPU here')\n",
            "raises_on_import:P",
            "importing 'raises_on_import' failed: RuntimeError: no GPU here (",
        ),
        (
            "from kvoffload.policies import LruPolicy\n"
            "class P(LruPolicy):\n"
            "    def __init__(self, capacity, ghosts):\n"
            "        super().__init__(capacity)\n",
            "needs_arguments:P",
            "cannot be built as P(capacity): its constructor takes (capacity, ghosts)",
        ),
        ("", "not_there:P", "cannot import 'not_there': no module 'not_there' in the current"),
    ],
)
def test_a_broken_policy_module_is_one_line_naming_the_cause(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    source: str,
    policy: str,
    expected: str,
) -> None:
    module = policy.partition(":")[0]
    if source:
        (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.curdir)])
    code = main(["verify", "--policy", policy, "--budget", "1"])
    err = capsys.readouterr().err
    assert code == 1
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert expected in err, err
    if source and "SyntaxError" in expected:
        assert f"{module}.py, line 1" in err, err
    sys.modules.pop(module, None)


def test_resolve_policy_says_what_the_constructor_wants() -> None:
    from kvoffload.policies import LruPolicy

    class TwoArguments(LruPolicy):
        def __init__(self, capacity: int, share: float) -> None:
            super().__init__(capacity)

    with pytest.raises(UnknownPolicyError, match=r"cannot be built as TwoArguments\(capacity\)"):
        resolve_policy(TwoArguments)


def test_the_user_guide_quotes_the_example_file_verbatim() -> None:
    guide = (ROOT / "docs" / "user_guide.md").read_text()
    source = (EXAMPLES / "mypolicies.py").read_text()
    blocks = [b for b in guide.split("```python\n")[1:] if "class " in b.split("```")[0]]
    assert blocks, "the guide shows no policy class from docs/examples/mypolicies.py"
    for block in blocks:
        assert block.split("```")[0].strip() in source


@pytest.mark.slow  # a subprocess of the command, 4-5 s
def test_the_python_dash_m_spelling_still_finds_the_working_directory(tmp_path: Path) -> None:
    (tmp_path / "mine2.py").write_text(
        textwrap.dedent(
            """
            from kvoffload.policies import LruPolicy

            class Renamed(LruPolicy):
                pass
            """
        )
    )
    done = subprocess.run(
        [sys.executable, "-m", "kvoffload", "verify", "--policy", "mine2:Renamed", "--budget", "1"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.slow  # a conformance run in a subprocess
def test_the_broken_example_policy_is_caught_as_the_user_guide_shows() -> None:
    done = kvoffload(
        "verify", "--policy", "mypolicies:GivesUpOnProtected", "--budget", "60", cwd=EXAMPLES
    )  # the exploration stops at the violation, in seconds: the budget is a bound
    assert done.returncode == 1, done.stdout + done.stderr
    guide = (ROOT / "docs" / "user_guide.md").read_text()
    shown = guide.split("$ kvoffload verify --policy mypolicies:GivesUpOnProtected\n")[1]
    history = shown.split("counterexample:\n")[1].split("```")[0]
    assert history.strip() in done.stdout, done.stdout


# -- pipes -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["sweep", "--trace", "synthetic", "--capacities", "100", "--policies", "lru", "--json"],
        ["sweep", "--trace", "synthetic", "--capacities", "100", "--policies", "lru"],
        ["simulate", "--trace", "synthetic", "--gpu-blocks", "400", "--requests", "5", "--json"],
        ["verify", "--budget", "0.5", "--json"],
    ],
    ids=["sweep-json", "sweep-table", "simulate-json", "verify-json"],
)
def test_a_reader_that_leaves_early_ends_the_command_quietly(argv: list[str]) -> None:
    # `kvoffload ... | head -1` once head has exited: the read end is already closed when
    # the command writes, so every write fails with EPIPE
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "kvoffload", *argv],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        os.close(write_end)
    assert done.stderr == ""
    assert done.returncode == 141  # 128 + SIGPIPE, as a Unix tool killed by the pipe


# -- sweeping your own policy, and the flags' small print ----------------------------------


def test_the_sweep_command_takes_a_policy_of_your_own_by_module_and_class(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["sweep", "--trace", "synthetic", "--capacities", "1k", "--json"]
    code = main([*argv, "--policies", "lru,kvoffload.policies:LruPolicy,belady"])
    results = json.loads(capsys.readouterr().out)["results"]
    assert code == 0
    assert [r["policy"] for r in results] == ["lru", "LruPolicy", "belady"]
    assert results[0]["hit_ratio"] == results[1]["hit_ratio"]


def test_sweep_json_carries_the_context_the_table_shows(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvoffload.replay.traces import bundled_trace

    argv = ["sweep", "--trace", "synthetic", "--gpu-blocks", "400", "--capacities", "1k"]
    assert main([*argv, "--policies", "lru", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    trace = bundled_trace("synthetic")
    assert {k: v for k, v in payload.items() if k != "results"} == {
        "trace": "synthetic",
        "requests": trace.num_requests,
        "block_refs": trace.num_refs,
        "gpu_blocks": 400,
        "device_hit_ratio": payload["device_hit_ratio"],
        "infinite_cache_hit_ratio": trace.ideal_hit_ratio,
    }
    assert 0 < payload["device_hit_ratio"] < trace.ideal_hit_ratio
    assert main([*argv, "--policies", "lru"]) == 0
    table = " ".join(capsys.readouterr().out.split())  # the title wraps on a narrow console
    assert f"device hit ratio {payload['device_hit_ratio']:.4f}" in table
    assert f"{trace.num_refs:,} block refs" in table


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["sweep", "--policies", ""], "give at least one policy"),
        (["sweep", "--policies", " , "], "give at least one policy"),
        (["sweep", "--capacities", ""], "give at least one capacity"),
        (["simulate", "--requests", "-3"], "'-3': must be at least 1"),
        (["simulate", "--requests", "many"], "'many' is not a whole number of requests"),
        (["sweep", "--gpu-blocks", "-1"], "'-1': must be at least 0"),
    ],
)
def test_an_empty_or_negative_flag_is_a_usage_error_that_says_so(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert expected in err and "of blocks" not in err.replace(expected, ""), err


def test_the_plot_target_is_checked_before_the_sweep_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import kvoffload.replay.sweep

    def no_sweep(*args: object, **kwargs: object) -> None:
        raise AssertionError("the sweep ran before the plot's path was checked")

    monkeypatch.setattr(kvoffload.replay.sweep, "sweep", no_sweep)
    argv = ["sweep", "--trace", "synthetic", "--plot"]
    assert main([*argv, str(tmp_path / "no" / "such" / "dir" / "curves.png")]) == 1
    assert "no directory" in capsys.readouterr().err
    assert main([*argv, str(tmp_path) + "/"]) == 1  # no file name at all
    assert main([*argv, str(tmp_path / "curves.gif")]) == 1
    assert "ending in .png, .svg, .pdf" in capsys.readouterr().err
    (tmp_path / "taken.svg").mkdir()
    assert main([*argv, str(tmp_path / "taken.svg")]) == 1
    assert "is a directory" in capsys.readouterr().err


@pytest.mark.parametrize("suffix", [".png", ".svg", ".pdf", ".PDF"])
def test_the_plot_may_be_a_png_an_svg_or_a_pdf(
    suffix: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.util

    target = tmp_path / f"curves{suffix}"
    code = main(["sweep", "--trace", "synthetic", "--capacities", "100", "--plot", str(target)])
    err = capsys.readouterr().err
    if importlib.util.find_spec("matplotlib") is None:  # the gate's venv: the next check
        assert code == 1 and "needs matplotlib" in err, err
    else:
        assert code == 0 and target.stat().st_size > 0, err


def test_help_names_every_policy_form_and_says_which_suffixes_are_decimal(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvoffload.policies import BUILTIN_POLICIES

    helps = {}
    for command in ("simulate", "sweep", "verify"):
        assert main([command, "--help"]) == 0
        helps[command] = " ".join(capsys.readouterr().out.split())
    assert f"--policy {'|'.join(BUILTIN_POLICIES)}|module:Class" in helps["simulate"]
    assert f"--policy {'|'.join(BUILTIN_POLICIES)}|module:Class" in helps["verify"]
    assert "module:Class" in helps["sweep"] and "4k = 4,000" in helps["sweep"]
    assert "4k = 4,000" in helps["simulate"] and "1 KiB = 1,024 bytes" in helps["simulate"]
    assert ".svg" in helps["sweep"] and ".pdf" in helps["sweep"]


def test_dir_lists_the_lazy_exports_without_importing_them() -> None:
    probe = (
        "import sys, kvoffload; names = dir(kvoffload); "
        "print(all(n in names for n in kvoffload.__all__), 'kvoffload.offloader' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.split() == ["True", "False"]


def test_a_wheel_built_in_the_checkout_is_ignored_by_git() -> None:
    done = subprocess.run(
        ["git", "check-ignore", "--no-index", "kvoffload-0.1.0-py3-none-any.whl"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, "a `pip wheel .` artefact in the repo root is not ignored"


# -- conformance counterexamples, in words ---------------------------------------------------


class EvictsNewestFirst(LruPolicy):
    """Claims to be LRU, but evicts the most recent block first."""

    def _candidates(self, protected: Container[Key]) -> Iterator[Key]:
        return (key for key in reversed(self._evictable) if key not in protected)


class RefusesAboveTwoBlocks(LruPolicy):
    """Refuses every eviction in a pool of three blocks or more: the exploration's pool of
    two never sees it, the conformance machine's pools of up to four do."""

    def choose_victims(self, need: int, protected: Container[Key]) -> list[Key] | None:
        return None if self.capacity > 2 else super().choose_victims(need, protected)


def assert_reads_as_a_history(text: str) -> list[str]:
    """Numbered manager calls from 1, then the verdict; no Hypothesis vocabulary."""
    lines = text.splitlines()
    assert lines[0].startswith("a failing history, on a manager with ")
    calls = [line for line in lines if re.match(r"  \d+\. ", line)]
    assert calls, text
    assert [int(line.split(".")[0]) for line in calls] == list(range(1, len(calls) + 1))
    assert any(line.startswith("  -> ") for line in lines), text
    for jargon in ("state.", "Draw ", "data(", "Falsifying", "teardown"):
        assert jargon not in text, text
    return lines


def test_a_conformance_failure_is_the_history_of_manager_calls_and_the_two_results() -> None:
    from hypothesis import Phase, settings

    from kvoffload.checking.conformance import ConformanceError, check_conformance
    from kvoffload.manager import OffloadManager

    quick = settings(max_examples=2000, database=None, deadline=None)
    with pytest.raises(ConformanceError) as caught:
        check_conformance(
            functools.partial(OffloadManager, policy=EvictsNewestFirst),
            policy="lru",
            settings=settings(quick, phases=[Phase.generate, Phase.shrink]),
        )
    lines = assert_reads_as_a_history(str(caught.value))
    assert re.search(r"^  \d+\. prepare_store\(\[.*\]\)$", "\n".join(lines), re.M), lines
    manager = next(line for line in lines if line.startswith("     the manager: "))
    spec = next(line for line in lines if line.startswith("     the spec:    "))
    assert manager.split(": ", 1)[1] != spec.split(": ", 1)[1]  # the two results differ
    # shrunk: a few calls, not the 30 of a random history
    assert sum(bool(re.match(r"  \d+\. ", line)) for line in lines) <= 15, lines


@pytest.mark.slow  # a verify run of its full budget
def test_verify_prints_a_conformance_counterexample_as_a_history(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["verify", "--policy", f"{__name__}:RefusesAboveTwoBlocks", "--budget", "20"])
    out = capsys.readouterr().out
    assert code == 1
    counterexample = out.split("counterexample:\n")[1]
    lines = assert_reads_as_a_history(counterexample)
    assert "num_blocks=3" in lines[0] or "num_blocks=4" in lines[0], lines[0]
    assert re.fullmatch(r"  \d+\. prepare_store\(\[.+\]\)", lines[-2]), lines
    assert re.fullmatch(r"  -> a store needing 1 was refused; \d could go", lines[-1]), lines


# -- the README, as written --------------------------------------------------------------------

README = (ROOT / "README.md").read_text()


def test_the_readme_opens_with_exactly_the_two_set_up_and_run_commands() -> None:
    first = README.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line for line in first.splitlines() if line and not line.startswith("#")]
    assert commands == [
        "python3 -m venv .venv && .venv/bin/pip install -q -r requirements.txt && "
        ".venv/bin/kvoffload simulate",
        "python3 -m venv .venv && .venv/bin/pip install -q -r requirements-dev.txt && "
        ".venv/bin/pip install -q --no-deps -r requirements-engines.txt && "
        ".venv/bin/python -m pytest",
    ]
    # CI runs the README's test command and nothing else
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert [line for line in ci if line.startswith("python3 ")] == commands[1:]


def test_the_readme_integration_example_runs_as_written(
    capsys: pytest.CaptureFixture[str],
) -> None:
    section = README.split("## Integrating it", 1)[1]
    source = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert "stream_wait(load)" in source  # the forward pass must wait for the copy
    exec(compile(source, "README.md", "exec"), {"__name__": "readme"})
    printed = capsys.readouterr().out.splitlines()
    promised = [
        line.split("  # ")[1].split(":")[0] for line in source.splitlines() if "print(" in line
    ]
    assert printed == promised


@pytest.mark.slow  # a verify run of its full budget
def test_the_readme_verify_command_runs_as_written() -> None:
    line = next(line for line in README.splitlines() if line.startswith("$ cd docs/examples"))
    command = line.removeprefix("$ ").split("  #")[0]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = f"{KVOFFLOAD.parent}{os.pathsep}{env.get('PATH', '')}"  # an activated venv
    done = subprocess.run(
        ["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "conforms to the spec" in done.stdout


# -- the gate's long steps say what they are doing -------------------------------------------


@pytest.mark.slow  # a subprocess of the command, 4-5 s
def test_progress_reaches_the_terminal_while_pytest_captures_output(tmp_path: Path) -> None:
    (tmp_path / "test_long.py").write_text(
        textwrap.dedent(
            """
            from tests.progress import progress

            def test_long(pytestconfig):
                say = progress(pytestconfig)
                say("CrossHair   1/2   3.0 s  first target")
                print("a captured print, shown only if the test fails")
                say("CrossHair   2/2   6.0 s  second target")
            """
        )
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_long.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert "CrossHair   1/2   3.0 s  first target" in lines, done.stdout
    assert "CrossHair   2/2   6.0 s  second target" in lines, done.stdout
    assert "a captured print" not in done.stdout  # capturing itself is untouched
