"""The ``kvoffload`` command: ``simulate``, ``sweep`` and ``verify``.

Startup stays quick: this module imports only the standard library, the parser reads the
policy names and the sweep's and simulate's defaults from their modules (no torch, no
numpy), and each command imports what it needs (torch only for ``simulate``) when it runs.
A mistake a user can make (a bad trace, an unknown policy, an impossible size) ends with
one line on stderr and exit status 1; a malformed command line with argparse's usage
message and status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from kvoffload_spec.errors import InvalidArgumentError, OffloadError

if TYPE_CHECKING:
    from rich.console import Console

    from kvoffload.checking.verify import VerifyReport
    from kvoffload.replay.config import DiskTierConfig
    from kvoffload.replay.report import RemoteTally, SharedSimulationReport, SimulationReport
    from kvoffload.replay.simulate import MemoryPlan, SimulationConfig
    from kvoffload.replay.sweep import SweepResult
    from kvoffload.replay.traces import Trace

EXIT_OK = 0
EXIT_ERROR = 1  # a user error (bad trace, size, policy) or a verification that failed
EXIT_INTERRUPTED = 130
PIPED_WIDTH = 100  # a table of text in a pipe or a log wraps its words at this width
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a Unix tool killed by a closed pipe reports


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, --version or a usage error: argparse has spoken
        return exit_.code if isinstance(exit_.code, int) else EXIT_ERROR
    command: Callable[[argparse.Namespace], int] = args.command
    _search_working_directory()
    try:
        return command(args)
    except OffloadError as error:
        return _fail(args, str(error))
    except MemoryError:
        return _fail(args, "out of memory: try fewer or smaller blocks")
    except KeyboardInterrupt:
        print(f"kvoffload {args.command_name}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader left (`... | head`): stop quietly, as Unix tools do
        _discard_stdout()
        return EXIT_BROKEN_PIPE


def _search_working_directory() -> None:
    """Put the working directory first on ``sys.path``, as ``python -m`` does.

    An installed console script starts with its own ``bin/`` directory there instead, so
    ``--policy mypolicies:Class`` would not find the ``mypolicies.py`` next to the user.
    """
    try:
        here = os.getcwd()
    except OSError:  # the working directory was deleted: nothing to import from it
        return
    if not any(os.path.abspath(entry or os.curdir) == here for entry in sys.path):
        sys.path.insert(0, here)


def _discard_stdout() -> None:
    """Point stdout at the null device, so that the interpreter's last flush of what is
    still buffered does not fail again with a second, unhandled ``BrokenPipeError``."""
    try:
        descriptor = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (captured, replaced)
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, descriptor)
    finally:
        os.close(null)


def _fail(args: argparse.Namespace, message: str) -> int:
    print(f"kvoffload {args.command_name}: error: {message}", file=sys.stderr)
    return EXIT_ERROR


# -- the command line ----------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    # the policy registry is a few small modules (no torch, no numpy): read names from it
    from kvoffload.policies.loading import BUILTIN_POLICIES
    from kvoffload.replay.simulate import SimulationConfig
    from kvoffload.replay.sweep import DEFAULT_CAPACITIES, SWEEP_POLICIES
    from kvoffload_spec.defaults import DEFAULT_POLICY

    sizes = SimulationConfig()  # simulate's defaults are the config's

    builtin = "|".join(BUILTIN_POLICIES)
    parser = argparse.ArgumentParser(
        prog="kvoffload",
        description="Offload LLM KV-cache blocks to a CPU block pool: replay traces, compare "
        "eviction policies against Belady's optimum, verify a policy against the spec.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)

    simulate = commands.add_parser(
        "simulate",
        help="replay a trace through a device prefix cache and the CPU offloader",
        description="Replay a request trace through a small model of a serving engine: an LRU "
        "device prefix cache whose blocks are offloaded, as real tensors, into a CPU pool, "
        "and loaded back (and verified byte-exact) on a CPU hit.",
    )
    _add_trace_argument(simulate)
    simulate.add_argument(
        "--gpu-blocks",
        type=_count("blocks"),
        default=sizes.gpu_blocks,
        metavar="N",
        help="device prefix cache size in blocks; must hold the longest request "
        f"(default: %(default)s; {_DECIMAL_SUFFIXES})",
    )
    simulate.add_argument(
        "--cpu-blocks",
        type=_count("blocks"),
        default=sizes.cpu_blocks,
        metavar="N",
        help=f"CPU pool size in blocks (default: %(default)s; {_DECIMAL_SUFFIXES})",
    )
    simulate.add_argument(
        "--policy",
        default=sizes.policy,
        metavar=f"{builtin}|module:Class",
        help="the CPU pool's eviction policy: a built-in one, or your own EvictionPolicy "
        "subclass, imported from the current directory or PYTHONPATH (default: %(default)s)",
    )
    simulate.add_argument(
        "--block-bytes",
        type=_byte_size,
        default=sizes.block_bytes,
        metavar="BYTES",
        help="bytes per KV block, e.g. 4096, 64KiB, 2MiB; binary units: 1 KiB = 1,024 "
        "bytes (default: %(default)s)",
    )
    simulate.add_argument(
        "--requests",
        type=_count("requests"),
        default=None,
        metavar="N",
        help="replay only the first N requests",
    )
    simulate.add_argument(
        "--remote",
        default=None,
        metavar="URL",
        help="a Valkey/Redis server (redis://host:port/db) behind every engine's CPU pool: "
        "evicted blocks are written back to it, CPU misses fetched from it (default: none)",
    )
    simulate.add_argument(
        "--instances",
        type=_count("instances"),
        default=1,
        metavar="N",
        help="N engines serving the trace's requests in turn (request i on engine i mod N), "
        "each with the sizes above, sharing --remote (default: 1)",
    )
    simulate.add_argument(
        "--remote-mode",
        choices=("write-back", "write-through"),
        default="write-back",
        help="with --remote: write each block the CPU pool evicts (write-back), or each "
        "block once stored (write-through) (default: %(default)s)",
    )
    _add_disk_arguments(simulate)
    simulate.add_argument(
        "--metrics-port",
        type=_port,
        default=None,
        metavar="N",
        help="serve kvoffload's metrics (Prometheus text format) on "
        "http://127.0.0.1:N/metrics while the replay runs (needs prometheus_client: "
        "pip install 'kvoffload[metrics]')",
    )
    _add_json_argument(simulate)
    simulate.set_defaults(command=_run_simulate, command_name="simulate")

    sweep = commands.add_parser(
        "sweep",
        help="hit ratio against CPU capacity for LRU, ARC and Belady's optimum",
        description="The CPU tier's block hit ratio at each capacity, for each policy and "
        "for Belady's offline optimum on the same key stream.",
    )
    _add_trace_argument(sweep)
    sweep.add_argument(
        "--gpu-blocks",
        type=_count("blocks", minimum=0),
        default=0,
        metavar="N",
        help="device prefix cache in front of the CPU tier; 0 means a single tier "
        f"(default: %(default)s; {_DECIMAL_SUFFIXES})",
    )
    sweep.add_argument(
        "--capacities",
        type=_count_list,
        default=",".join(map(str, DEFAULT_CAPACITIES)),
        metavar="N,N,...",
        help="CPU capacities in blocks, e.g. 1000,4k,16k; decimal suffixes: 4k = 4,000 and "
        "1m = 1,000,000 blocks (default: %(default)s)",
    )
    sweep.add_argument(
        "--policies",
        type=_name_list,
        default=",".join(SWEEP_POLICIES),
        metavar="P,P,...",
        help=f"any of {', '.join(SWEEP_POLICIES)}, or your own as module:Class "
        "(its column is the class name) (default: %(default)s)",
    )
    sweep.add_argument(
        "--plot",
        metavar="FILE",
        help="draw the curves into FILE, a .png, .svg or .pdf (needs matplotlib: "
        "pip install 'kvoffload[plot]'); checked before the sweep starts",
    )
    _add_json_argument(sweep)
    sweep.set_defaults(command=_run_sweep, command_name="sweep")

    verify = commands.add_parser(
        "verify",
        help="check a policy against the spec: exhaustive exploration and conformance",
        description="Explore every reachable state of small configurations exhaustively, "
        "then run the randomized conformance machine against the spec, for a built-in "
        "policy or your own (module:Class), within a time budget.",
    )
    verify.add_argument(
        "--policy",
        default=DEFAULT_POLICY,
        metavar=f"{builtin}|module:Class",
        help="the policy to check: a built-in one, or your own EvictionPolicy subclass, "
        "imported from the current directory or PYTHONPATH (default: %(default)s)",
    )
    verify.add_argument(
        "--budget",
        type=_seconds,
        default=60.0,
        metavar="SECONDS",
        help="time budget for both checks together (default: %(default)s)",
    )
    _add_json_argument(verify)
    verify.set_defaults(command=_run_verify, command_name="verify")
    return parser


def _add_trace_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trace",
        metavar="FILE",
        default=None,
        help="JSON-lines trace with 'hash_ids' per request (.jsonl, or gzipped .jsonl.gz), "
        "or the name of a bundled trace (conversation, synthetic); default: the bundled "
        "conversation trace",
    )


def _add_disk_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--disk",
        default=None,
        metavar="PATH",
        help="a disk tier behind every engine's CPU pool (and in front of --remote), in the "
        "directory PATH (engine i of several: PATH/engine-i); made if new, reopened with "
        "its blocks if it holds this trace's (default: none)",
    )
    parser.add_argument(
        "--disk-bytes",
        type=_byte_size,
        default=None,
        metavar="SIZE",
        help="the disk tier's capacity per engine, e.g. 512MiB, 4GiB (default: 4GiB)",
    )
    parser.add_argument(
        "--disk-admission",
        choices=("second-offer", "every-offer"),
        default=None,
        help="write a block to the disk on its second offer (a cold scan cannot flush the "
        "disk) or on every one (default: second-offer)",
    )


def _disk_tier(args: argparse.Namespace) -> DiskTierConfig | None:
    """The ``DiskTierConfig`` the disk options ask for, or None."""
    if args.disk is None:
        if args.disk_bytes is not None or args.disk_admission is not None:
            raise InvalidArgumentError("--disk-bytes and --disk-admission need --disk PATH")
        return None
    from kvoffload.replay.config import DiskTierConfig

    return DiskTierConfig(
        args.disk,
        capacity_bytes=args.disk_bytes if args.disk_bytes is not None else 4 << 30,
        admission=args.disk_admission or "second-offer",
    )


def _add_json_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")


def _version() -> str:
    import kvoffload

    return kvoffload.__version__


# -- argument types: argparse turns their ValueError into a usage error ---------------------


_DECIMAL_SUFFIXES = "decimal suffixes: 4k = 4,000"


def _count(unit: str, minimum: int = 1) -> Callable[[str], int]:
    """An argument type: a whole number of ``unit`` of at least ``minimum``, where ``4k``
    means 4,000 and ``1m`` 1,000,000 (decimal, as in the reference tables; byte sizes are
    binary instead: 1 KiB = 1,024 bytes).
    """

    def parse(text: str) -> int:
        cleaned = text.strip().lower().replace("_", "")
        factor = 1
        if cleaned.endswith("k"):
            cleaned, factor = cleaned[:-1], 1000
        elif cleaned.endswith("m"):
            cleaned, factor = cleaned[:-1], 1_000_000
        negative = cleaned.startswith("-") and cleaned[1:].isdigit()
        if not cleaned.isdigit() and not negative:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of {unit}")
        value = int(cleaned) * factor
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r}: must be at least {minimum}")
        return value

    parse.__name__ = f"number of {unit}"  # argparse names the type in some messages
    return parse


_BYTE_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


def _byte_size(text: str) -> int:
    cleaned = text.strip().lower().replace("_", "")
    digits = cleaned.rstrip("abigkm")
    unit = _BYTE_UNITS.get(cleaned[len(digits) :])
    if not digits.isdigit() or unit is None or int(digits) == 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a positive size in bytes (e.g. 4096, 64KiB, 2MiB)"
        )
    return int(digits) * unit


def _count_list(text: str) -> list[int]:
    counts = [_count("blocks")(part) for part in text.split(",") if part.strip()]
    if not counts:
        raise argparse.ArgumentTypeError("give at least one capacity, e.g. 1000,4k")
    return counts


def _name_list(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise argparse.ArgumentTypeError("give at least one policy, e.g. lru,belady")
    return names


def _seconds(text: str) -> float:
    from kvoffload_spec.errors import InvalidArgumentError
    from kvoffload_spec.validation import check_seconds

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    try:
        return check_seconds("the value", value)
    except InvalidArgumentError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _port(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (1 to 65535)")
    return int(text)


# -- the commands ---------------------------------------------------------------------------


def _run_simulate(args: argparse.Namespace) -> int:
    from kvoffload.replay.simulate import SimulationConfig, simulate
    from kvoffload.replay.traces import resolve_trace

    trace = resolve_trace(args.trace)
    config = SimulationConfig(
        gpu_blocks=args.gpu_blocks,
        cpu_blocks=args.cpu_blocks,
        policy=args.policy,
        block_bytes=args.block_bytes,
        max_requests=args.requests,
    )
    from kvoffload.policies.base import PolicyContractError

    disk = _disk_tier(args)
    if args.metrics_port is not None:
        where = f"http://127.0.0.1:{args.metrics_port}/metrics"
        print(f"kvoffload simulate: metrics on {where} while it runs", file=sys.stderr)
    if args.remote is not None or args.instances > 1:
        return _run_simulate_shared(args, trace, config, disk)
    console = _console(stderr=True)
    try:
        with _progress(console, enabled=not args.json) as progress:
            task = progress.add_task(f"replaying {trace.name}", total=None)
            report = simulate(
                trace,
                config,
                on_request=lambda done, total: progress.update(task, completed=done, total=total),
                disk=disk,
                on_start=_announce_memory,
                metrics_port=args.metrics_port,
            )
    except PolicyContractError as error:  # a bug in the user's policy, said in one line
        return _fail(args, f"{error} (kvoffload verify --policy {args.policy} shows how)")
    except ImportError as error:  # --metrics-port without prometheus_client
        return _fail(args, str(error))
    if args.json:
        _print_json(report.to_json())
    else:
        _show_simulation(trace, report, disk=args.disk)
    _warn_tier_failures(args, report)
    if not report.all_loads_verified:
        return _fail(args, f"{report.load_mismatches} loaded blocks differ from what was stored")
    return EXIT_OK


def _run_sweep(args: argparse.Namespace) -> int:
    from kvoffload.replay.sweep import sweep
    from kvoffload.replay.traces import resolve_trace

    trace = resolve_trace(args.trace)
    if args.plot is not None:
        _check_plot_target(args.plot)
    console = _console(stderr=True)
    with _progress(console, enabled=not args.json) as progress:
        total = len(args.capacities) * len(args.policies)
        task = progress.add_task(f"sweeping {trace.name}", total=total)
        result = sweep(
            trace,
            args.capacities,
            args.policies,
            gpu_blocks=args.gpu_blocks,
            on_point=lambda _point: progress.advance(task),
        )
    if args.json:
        _print_json(result.to_json())
    else:
        _show_sweep(trace, args.gpu_blocks, result)
    if args.plot is not None:
        _plot_sweep(trace, args.gpu_blocks, result, args.plot)
    return EXIT_OK


def _run_verify(args: argparse.Namespace) -> int:
    try:
        import hypothesis  # noqa: F401
    except ImportError:
        return _fail(
            args,
            "kvoffload verify needs Hypothesis, which a serving install leaves out: "
            "pip install 'kvoffload[verify]'",
        )
    from kvoffload.checking.verify import verify

    console = _console(stderr=True)
    with _progress(console, enabled=not args.json, unit="s") as progress:
        # the checks share the time budget: the bar is the budget spent
        task = progress.add_task(f"verifying {args.policy}", total=args.budget)
        with _ticking(lambda spent: progress.update(task, completed=min(spent, args.budget))):
            report = verify(
                args.policy,
                budget_s=args.budget,
                on_stage=lambda stage: progress.update(task, description=stage),
            )
    if args.json:
        _print_json(report.to_json())
    else:
        _show_verification(report)
    return EXIT_OK if report.passed else EXIT_ERROR


# -- output ----------------------------------------------------------------------------------


def _print_json(payload: object) -> None:
    json.dump(payload, sys.stdout, indent=2)
    sys.stdout.write("\n")


def _console(stderr: bool = False) -> Console:
    from rich.console import Console

    class PipeAwareConsole(Console):
        def on_broken_pipe(self) -> None:
            # rich would exit with status 1 here; main() ends the way it ends any command
            self.quiet = True
            raise BrokenPipeError

    return PipeAwareConsole(stderr=stderr)


def _progress(console: Console, enabled: bool, unit: str = "") -> Any:
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
def _ticking(tick: Callable[[float], None], every_s: float = 0.5) -> Iterator[None]:
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


def _table(
    title: str, columns: Sequence[str], rows: Sequence[Sequence[str]], numeric: bool = True
) -> None:
    """Print a table; ``numeric`` right-aligns every column but the first."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for index, column in enumerate(columns):
        table.add_column(column, justify="right" if numeric and index else "left")
    for row in rows:
        table.add_row(*row)
    console = _console()
    if not console.is_terminal:
        # In a pipe or a log nothing limits the width: print a table of numbers with every
        # column whole (a sweep of every built-in policy is wider than 80 columns), and
        # wrap the words of a table of text at a width that reads.
        from rich.measure import Measurement

        natural = Measurement.get(console, console.options.update_width(1_000), table).maximum
        console.width = max(console.width, natural if numeric else min(natural, PIPED_WIDTH))
    console.print(table)


def _run_simulate_shared(
    args: argparse.Namespace, trace: Trace, config: SimulationConfig, disk: DiskTierConfig | None
) -> int:
    from kvoffload.policies.base import PolicyContractError
    from kvoffload.replay.simulate import simulate_shared

    if args.remote is not None:
        _check_remote_answers(args.remote)
    console = _console(stderr=True)
    try:
        with _progress(console, enabled=not args.json) as progress:
            task = progress.add_task(f"replaying {trace.name}", total=None)
            shared = simulate_shared(
                trace,
                config,
                instances=args.instances,
                remote_url=args.remote,
                remote_mode=args.remote_mode,
                on_request=lambda done, total: progress.update(task, completed=done, total=total),
                disk=disk,
                on_start=_announce_memory,
                metrics_port=args.metrics_port,
            )
    except PolicyContractError as error:
        return _fail(args, f"{error} (kvoffload verify --policy {args.policy} shows how)")
    except ImportError as error:  # --remote without the client: pip install 'kvoffload[remote]'
        return _fail(args, str(error))
    if args.json:
        _print_json(shared.to_json())
    else:
        _show_shared_simulation(trace, shared, args.remote, args.disk)
    _warn_tier_failures(args, shared.total)
    if not shared.all_loads_verified:
        wrong = sum(report.load_mismatches for report in shared.engines)
        return _fail(args, f"{wrong} loaded blocks differ from what was stored")
    return EXIT_OK


LARGE_RUN_BYTES = 1 << 30


def _announce_memory(plan: MemoryPlan) -> None:
    """Say what a run will take before it takes it: to a person watching, and to a log
    whenever it is a lot."""
    if sys.stderr.isatty() or plan.host_bytes >= LARGE_RUN_BYTES:
        print(f"kvoffload simulate: {plan.describe()}", file=sys.stderr)


def _check_remote_answers(url: str) -> None:
    """Say at once, on stderr, when the remote tier does not answer: the run still goes on
    (a store survives a server that is down), but its remote column would be all misses."""
    from kvoffload.tiers import ValkeyStore

    with ValkeyStore(url, namespace="kvoffload simulate: ping") as probe:
        if not probe.ping():
            print(
                f"kvoffload simulate: warning: the remote tier does not answer "
                f"({probe.stats().last_error}); the run goes on without it",
                file=sys.stderr,
            )


def _warn_tier_failures(args: argparse.Namespace, report: SimulationReport) -> None:
    for name, tally in (("disk", report.disk), ("remote", report.remote)):
        if tally is not None and tally.failures:
            _warn(
                args,
                f"the {name} tier failed {tally.failures:,} times (last: {tally.last_error}); "
                "those blocks were recomputed",
            )


def _warn(args: argparse.Namespace, message: str) -> None:
    print(f"kvoffload {args.command_name}: warning: {message}", file=sys.stderr)


def _show_shared_simulation(
    trace: Trace, shared: SharedSimulationReport, remote: str | None, disk: str | None
) -> None:
    """One row per engine and one for them all; what they share is said once, above."""
    total = shared.total
    engines = len(shared.engines)
    if engines == 1:  # one engine and a remote: its summary says it all
        _show_simulation(trace, total, remote, disk)
        return
    where = f"sharing the remote tier {remote}" if remote else "with no remote tier"
    where += f", each with a disk tier in {disk}/engine-i" if disk else ""
    columns = [c for c in _ENGINE_COLUMNS if total.disk is not None or c[0] != "disk hits"]
    _table(
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


def _show_simulation(
    trace: Trace, report: SimulationReport, remote: str | None = None, disk: str | None = None
) -> None:
    behind = (f", disk tier {disk}" if disk else "") + (f", remote tier {remote}" if remote else "")
    _table(
        f"kvoffload simulate: {trace.name}\n{report.engine_description()}{behind}",
        ["", "value", ""],
        report.summary_rows(),
        numeric=False,
    )


def _ratio(value: float) -> str:
    return f"{value:.4f}"


def _show_sweep(trace: Trace, gpu_blocks: int, result: SweepResult) -> None:
    policies = list(dict.fromkeys(p.policy for p in result.points))
    by_capacity: dict[int, dict[str, float]] = {}
    for point in result.points:
        by_capacity.setdefault(point.capacity, {})[point.policy] = point.hit_ratio
    columns = ["CPU blocks", *policies]
    compared = [p for p in policies if p != "belady"] if "belady" in policies else []
    columns += [f"{p}/belady" for p in compared]
    rows = []
    for capacity, ratios in by_capacity.items():
        row = [f"{capacity:,}", *(_ratio(ratios[p]) for p in policies)]
        optimum = ratios.get("belady", 0.0)
        row += [_ratio(ratios[p] / optimum) if optimum else "-" for p in compared]
        rows.append(row)
    tier = (
        "single tier"
        if gpu_blocks == 0
        else f"CPU tier behind {gpu_blocks:,} device blocks "
        f"(device hit ratio {_ratio(result.device_hit_ratio)})"
    )
    _table(
        f"kvoffload sweep: {trace.name}, {trace.num_refs:,} block refs, {tier}; "
        f"infinite cache {_ratio(trace.ideal_hit_ratio)}",
        columns,
        rows,
    )


def _show_verification(report: VerifyReport) -> None:
    _table(
        f"kvoffload verify: {report.policy}",
        ["check", "result"],
        report.summary_rows(),
        numeric=False,
    )
    if report.counterexample:
        print(f"\ncounterexample:\n{report.counterexample}")


PLOT_FORMATS = (".png", ".svg", ".pdf")


def _check_plot_target(path: str) -> None:
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


def _plot_sweep(trace: Trace, gpu_blocks: int, result: SweepResult, path: str) -> None:
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


if __name__ == "__main__":
    sys.exit(main())
