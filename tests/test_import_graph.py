"""No import cycle among kvoffload's modules, lazy imports included.

A cycle that only lazy (function-level) imports close still ties the modules into one unit
that cannot be read, tested or imported alone, and it turns into an ImportError the day
one of those imports moves to the top. So every ``import`` statement counts here, wherever
it stands; the implicit import of a module's parent package does not (Python initializes
parents first, so that is no cycle).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "impl" / "kvoffload"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(source: str, own: str) -> set[str]:
    """The package's modules that ``source`` imports, anywhere in it."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            # ``from package import module`` imports a module too
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        found.update(name for name in names if name in MODULES and name != own)
    return found


def import_graph() -> dict[str, set[str]]:
    return {name: imported_modules(path.read_text(), name) for name, path in MODULES.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that ends where it starts, or None."""
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()

    def visit(node: str) -> list[str] | None:
        path.append(node)
        on_path.add(node)
        for target in sorted(graph.get(node, ())):
            if target in on_path:
                return [*path[path.index(target) :], target]
            if target not in done:
                cycle = visit(target)
                if cycle is not None:
                    return cycle
        path.pop()
        on_path.discard(node)
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done:
            cycle = visit(start)
            if cycle is not None:
                return cycle
    return None


def test_the_package_imports_form_no_cycle() -> None:
    graph = import_graph()
    assert "kvoffload.transfer.pool" in graph and graph["kvoffload.transfer.engine"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_checker_finds_the_cycle_that_lazy_imports_closed() -> None:
    """The cycle this package once had, copiers -> pool -> cuda -> copiers, the middle edge a
    lazy import inside a method: put back, it must be found."""
    pool_source = MODULES["kvoffload.transfer.pool"].read_text()
    lazy = pool_source + (
        "\n\ndef _pin_later() -> None:\n    from kvoffload.transfer.cuda import CudaBackend\n"
    )
    graph = import_graph()
    graph["kvoffload.transfer.pool"] = imported_modules(lazy, "kvoffload.transfer.pool")
    cycle = find_cycle(graph)
    assert cycle is not None and {
        "kvoffload.transfer.copiers",
        "kvoffload.transfer.pool",
        "kvoffload.transfer.cuda",
    } <= set(cycle), cycle
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("kvoffload.transfer")))
def test_each_transfer_module_imports_alone(module: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", f"import {module}"], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
