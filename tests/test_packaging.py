"""What a user gets from the repository and the wheel stands on its own."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload._moved import MOVED

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ("README.md", "docs", "impl", "spec", "bench")
# Files a user does not have: the planning notes and the folder beside the repository.
OUTSIDE = re.compile(r"DESIGN\.md|\.\./shared|shared/traces|shared/hooks")


def test_docs_and_code_point_only_inside_the_repository() -> None:
    offenders = []
    for top in SHIPPED:
        root = ROOT / top
        paths = [root] if root.is_file() else sorted(root.rglob("*"))
        for path in paths:
            if path.suffix not in {".md", ".py", ".sh", ".toml", ".txt"}:
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if OUTSIDE.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert offenders == []


def test_the_declared_license_ships_with_the_package() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^license = "Apache-2.0"$', pyproject, re.MULTILINE)
    assert re.search(r'^license-files = \[.*"LICENSE"', pyproject, re.MULTILINE)
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text


def loaded_after(statement: str, prefixes: tuple[str, ...]) -> list[str]:
    """The modules whose names start with ``prefixes`` that ``statement`` loads, in a
    fresh interpreter."""
    probe = (
        "import sys\n"
        f"{statement}\n"
        f"print(sorted(m for m in sys.modules if m.startswith({prefixes!r})))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT
    )
    loaded: list[str] = ast.literal_eval(done.stdout.strip())
    return loaded


def test_the_product_imports_no_checker() -> None:
    checkers = (
        "hypothesis",
        "crosshair",
        "kvoffload_spec.explore",
        "kvoffload.checking",
        "kvoffload.conformance",
    )
    assert loaded_after("from kvoffload import OffloadManager, Offloader", checkers) == []


def test_the_manager_does_not_load_the_spec_state_machine() -> None:
    """The manager needs the spec's errors, plans and validators, not its model: that loads
    only when a checker asks for the abstraction."""
    machine = ("kvoffload_spec.model", "kvoffload_spec.state", "kvoffload.checking")
    assert loaded_after("import kvoffload.manager", machine) == []


def test_no_test_module_imports_another() -> None:
    """What several test modules share lives in helper modules (tests/helpers.py,
    tests/caches.py, tests/planted/, ...), so each test file stands on its own."""
    offenders = [
        f"{path.name}: {line.strip()}"
        for path in sorted((ROOT / "tests").glob("*.py"))
        for line in path.read_text(encoding="utf-8").splitlines()
        if re.match(r"\s*(from tests\.test_\w+ import|import tests\.test_)", line)
    ]
    assert offenders == []


def test_a_missing_test_dependency_fails_the_gate() -> None:
    """vLLM, SGLang and the Valkey server are test requirements: a test module that skips
    itself when one is absent would turn a broken install into a green gate. Only the CUDA
    tests may skip (the gate's machines have no GPU)."""
    pattern = re.compile(r"importorskip|pytest\.skip\(|skipif\((?!not CUDA|CUDA)")
    offenders = [
        f"{path.name}:{number}: {line.strip()}"
        for path in sorted((ROOT / "tests").rglob("*.py"))
        if path.name != Path(__file__).name
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if pattern.search(line)
    ]
    assert offenders == []


@pytest.mark.parametrize("old_name", sorted(MOVED))
def test_a_moved_module_keeps_its_old_name_with_a_warning(old_name: str) -> None:
    """Code written against the flat layout keeps working: the old name is the new module
    itself (so patching one patches both), and importing it says where it went."""
    probe = (
        "import importlib, warnings\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        f"    old = importlib.import_module({old_name!r})\n"
        f"new = importlib.import_module({MOVED[old_name]!r})\n"
        "print(old is new, [str(w.message) for w in seen if w.category is DeprecationWarning])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT
    )
    same, messages = done.stdout.strip().split(" ", 1)
    assert same == "True"
    assert MOVED[old_name] in messages and old_name in messages


def test_serving_needs_no_checker_and_verify_says_what_to_install() -> None:
    """Hypothesis is the `verify` extra: without it the product imports and serves, and the
    commands that need it say which extra to install instead of a traceback."""
    probe = (
        "import sys\n"
        "sys.modules['hypothesis'] = None  # as if it were not installed\n"
        "from kvoffload import OffloadManager\n"
        "manager = OffloadManager(4)\n"
        "assert manager.prepare_store([1]) is not None\n"
        "try:\n"
        "    from kvoffload import check_conformance\n"
        "except ImportError as error:\n"
        "    print('import:', error)\n"
        "from kvoffload.cli import main\n"
        "sys.exit(main(['verify', '--budget', '1']))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 1, done.stderr
    assert "import: kvoffload.check_conformance" in done.stdout
    assert "pip install 'kvoffload[verify]'" in done.stdout
    assert "kvoffload verify: error:" in done.stderr and "kvoffload[verify]" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_version_is_one_number_everywhere() -> None:
    import kvoffload

    assert re.fullmatch(r"\d+\.\d+\.\d+", kvoffload.__version__)
    done = subprocess.run(
        [sys.executable, "-m", "kvoffload", "--version"], capture_output=True, text=True, cwd=ROOT
    )
    assert done.stdout.split() == ["kvoffload", kvoffload.__version__]
