"""What a new user meets first: the installed command, policy modules of their own, pipes,
and the README's examples, run as written."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvoffload.cli import main
from kvoffload.policies import resolve_policy
from kvoffload_spec.errors import UnknownPolicyError

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


def test_the_installed_command_imports_a_policy_module_from_the_working_directory(
    tmp_path: Path,
) -> None:
    (tmp_path / "mine.py").write_text(
        "from kvoffload.policies import LruPolicy\n\nclass Renamed(LruPolicy):\n    pass\n"
    )
    done = kvoffload("verify", "--policy", "mine:Renamed", "--budget", "1", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert '"passed": true' in done.stdout


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


def test_the_broken_example_policy_is_caught_as_the_user_guide_shows() -> None:
    done = kvoffload(
        "verify", "--policy", "mypolicies:GivesUpOnProtected", "--budget", "10", cwd=EXAMPLES
    )
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
