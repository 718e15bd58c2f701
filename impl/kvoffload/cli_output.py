"""What the ``kvoffload`` commands print: tables, progress bars, JSON and the sweep's plot.

Rich and matplotlib are imported when something is drawn, not when the command starts.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from kvoffload_spec.errors import InvalidArgumentError

if TYPE_CHECKING:
    from rich.console import Console

    from kvoffload.checking.verify import VerifyReport
    from kvoffload.replay.report import RemoteTally, SharedSimulationReport, SimulationReport
    from kvoffload.replay.sweep import SweepResult
    from kvoffload.replay.traces import Trace

PIPED_WIDTH = 100  # a table of text in a pipe or a log wraps its words at this width


def print_json(payload: object) -> None:
    json.dump(payload, sys.stdout, indent=2)
    sys.stdout.write("\n")


def console(stderr: bool = False) -> Console:
    from rich.console import Console

    class PipeAwareConsole(Console):
        def on_broken_pipe(self) -> None:
            # rich would exit with status 1 here; main() ends the way it ends any command
            self.quiet = True
            raise BrokenPipeError

    return PipeAwareConsole(stderr=stderr)


def progress(console: Console, enabled: bool, unit: str = "") -> Any:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(separator="/" if not unit else f" {unit} / "),
        TimeElapsedColumn(),
        "eta",
        TimeRemainingColumn(),
        console=console,
        transient=True,
        # a bar is for a person watching: not in a pipe, a log or with --json
        disable=not (enabled and console.is_terminal),
    )


@contextmanager
def ticking(tick: Callable[[float], None], every_s: float = 0.5) -> Iterator[None]:
    """Call ``tick(seconds since start)`` every ``every_s`` on a daemon thread while the
    block runs (for work that reports no progress of its own)."""
    import threading

    started = time.monotonic()
    done = threading.Event()

    def loop() -> None:
        while not done.wait(every_s):
            tick(time.monotonic() - started)

    thread = threading.Thread(target=loop, name="kvoffload-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def table(
    title: str, columns: Sequence[str], rows: Sequence[Sequence[str]], numeric: bool = True
) -> None:
    """Print a table; ``numeric`` right-aligns every column but the first."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for index, column in enumerate(columns):
        table.add_column(column, justify="right" if numeric and index else "left")
    for row in rows:
        table.add_row(*row)
    screen = console()
    if not screen.is_terminal:
        # In a pipe or a log nothing limits the width: print a table of numbers with every
        # column whole (a sweep of every built-in policy is wider than 80 columns), and
        # wrap the words of a table of text at a width that reads.
        from rich.measure import Measurement

        natural = Measurement.get(screen, screen.options.update_width(1_000), table).maximum
        screen.width = max(screen.width, natural if numeric else min(natural, PIPED_WIDTH))
    screen.print(table)


def show_shared_simulation(
    trace: Trace, shared: SharedSimulationReport, remote: str | None, disk: str | None = None
) -> None:
    """One row per engine and one for them all; what they share is said once, above."""
    total = shared.total
    engines = len(shared.engines)
    if remote is not None and shared.remote_sealed:
        remote += " (values sealed with the tenant secret)"
    if engines == 1:  # one engine and a remote: its summary says it all
        show_simulation(trace, total, remote, disk)
        return
    where = f"sharing the remote tier {remote}" if remote else "with no remote tier"
    where += f", each with a disk tier in {disk}/engine-i" if disk else ""
    columns = [c for c in _ENGINE_COLUMNS if total.disk is not None or c[0] != "disk hits"]
    table(
        f"kvoffload simulate: {trace.name}, {total.requests:,} requests over {engines} "
        f"engine{'s' if engines != 1 else ''} {where}\neach engine: "
        f"{shared.engines[0].engine_description()}\nreusable at most (an infinite cache): "
        f"{total.reusable_ratio:.4f} of {total.block_refs:,} block references",
        [column for column, _ in columns],
        [
            (name, *(cell(report) for _, cell in columns[1:]))
            for name, report in [
                *((f"engine {i}", report) for i, report in enumerate(shared.engines)),
                ("all engines", total),
            ]
        ],
    )


def _remote_cell(report: SimulationReport, cell: Callable[[RemoteTally], str]) -> str:
    return "-" if report.remote is None else cell(report.remote)


_ENGINE_COLUMNS: list[tuple[str, Callable[[SimulationReport], str]]] = [
    ("", lambda report: ""),
    ("requests", lambda report: f"{report.requests:,}"),
    ("device hits", lambda report: f"{report.device_hit_ratio:.4f}"),
    ("CPU hits", lambda report: f"{report.cpu_hit_ratio:.4f}"),
    ("disk hits", lambda report: f"{report.disk_hits / report.block_refs:.4f}"),
    (
        "remote hits",
        lambda report: _remote_cell(report, lambda r: f"{r.hits / report.block_refs:.4f}"),
    ),
    (
        "by sharing",
        lambda report: _remote_cell(report, lambda r: f"{r.shared_hits / report.block_refs:.4f}"),
    ),
    ("recomputed", lambda report: f"{report.miss_ratio:.4f}"),
    ("stored", lambda report: f"{report.blocks_stored:,}"),
    ("loaded", lambda report: f"{report.blocks_loaded:,}"),
    ("remote failures", lambda report: _remote_cell(report, lambda r: f"{r.failures:,}")),
    (
        "verified",
        lambda report: "byte-exact" if report.all_loads_verified else "DIFFER",
    ),
]


def show_simulation(
    trace: Trace, report: SimulationReport, remote: str | None = None, disk: str | None = None
) -> None:
    behind = (f", disk tier {disk}" if disk else "") + (f", remote tier {remote}" if remote else "")
    table(
        f"kvoffload simulate: {trace.name}\n{report.engine_description()}{behind}",
        ["", "value", ""],
        report.summary_rows(),
        numeric=False,
    )


def _ratio(value: float) -> str:
    return f"{value:.4f}"


def show_sweep(trace: Trace, gpu_blocks: int, result: SweepResult) -> None:
    policies = list(dict.fromkeys(p.policy for p in result.points))
    by_capacity: dict[int, dict[str, float]] = {}
    for point in result.points:
        by_capacity.setdefault(point.capacity, {})[point.policy] = point.hit_ratio
    columns = ["CPU blocks", *policies]
    compared = [p for p in policies if p != "belady"] if "belady" in policies else []
    columns += [f"{p}/belady" for p in compared]
    rows = []
    for capacity, ratios in by_capacity.items():
        # an interrupted sweep may end within a capacity: what it lacks is a dash
        row = [f"{capacity:,}", *(_ratio(ratios[p]) if p in ratios else "-" for p in policies)]
        optimum = ratios.get("belady", 0.0)
        row += [_ratio(ratios[p] / optimum) if optimum and p in ratios else "-" for p in compared]
        rows.append(row)
    tier = (
        "single tier"
        if gpu_blocks == 0
        else f"CPU tier behind {gpu_blocks:,} device blocks "
        f"(device hit ratio {_ratio(result.device_hit_ratio)})"
    )
    table(
        f"kvoffload sweep: {trace.name}, {trace.num_refs:,} block refs, {tier}; "
        f"infinite cache {_ratio(trace.ideal_hit_ratio)}"
        + (f"\npartial: interrupted after {len(result.points)} points" if result.partial else ""),
        columns,
        rows,
    )


def show_verification(report: VerifyReport) -> None:
    table(
        f"kvoffload verify: {report.policy}",
        ["check", "result"],
        report.summary_rows(),
        numeric=False,
    )
    if report.counterexample:
        print(f"\ncounterexample:\n{report.counterexample}")


PLOT_FORMATS = (".png", ".svg", ".pdf")


def check_plot_target(path: str) -> None:
    """Fail before a long sweep, not after it, when the plot cannot be drawn or written."""
    import importlib.util
    from pathlib import Path

    target = Path(path)
    if target.suffix.lower() not in PLOT_FORMATS:
        raise InvalidArgumentError(
            f"--plot wants a file name ending in {', '.join(PLOT_FORMATS)}, got {path!r}"
        )
    folder = target.parent
    if not folder.is_dir():
        raise InvalidArgumentError(f"cannot write {path}: no directory {str(folder)!r}")
    if target.is_dir():
        raise InvalidArgumentError(f"cannot write {path}: it is a directory")
    writable = os.access(target, os.W_OK) if target.exists() else os.access(folder, os.W_OK)
    if not writable:
        raise InvalidArgumentError(f"cannot write {path}: permission denied")
    if importlib.util.find_spec("matplotlib") is None:
        raise InvalidArgumentError(
            "--plot needs matplotlib, which is not installed: pip install 'kvoffload[plot]'"
        )


def plot_sweep(trace: Trace, gpu_blocks: int, result: SweepResult, path: str) -> None:
    import importlib

    matplotlib: Any = importlib.import_module("matplotlib")
    matplotlib.use("Agg")  # files only: never open a window
    pyplot: Any = importlib.import_module("matplotlib.pyplot")
    figure, axes = pyplot.subplots(figsize=(7, 4.5))
    for policy in dict.fromkeys(p.policy for p in result.points):
        points = [p for p in result.points if p.policy == policy]
        axes.plot(
            [p.capacity for p in points],
            [p.hit_ratio for p in points],
            marker="o",
            linestyle="--" if policy == "belady" else "-",
            label=policy,
        )
    axes.axhline(trace.ideal_hit_ratio, color="grey", linewidth=0.8, label="infinite cache")
    axes.set_xscale("log")
    axes.set_xlabel("CPU capacity (blocks)")
    axes.set_ylabel("block hit ratio")
    tier = "single tier" if gpu_blocks == 0 else f"behind {gpu_blocks:,} device blocks"
    axes.set_title(f"{trace.name} trace, {tier}")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    try:
        figure.savefig(path, dpi=120)
    except OSError as error:
        raise InvalidArgumentError(f"cannot write {path}: {error.strerror}") from None
    finally:
        pyplot.close(figure)
    print(f"plot written to {path}", file=sys.stderr)
