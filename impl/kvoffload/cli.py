"""The ``kvoffload`` command: ``simulate``, ``sweep``, ``verify``, ``remote`` and ``server``.

Startup stays quick: this module imports only the standard library, the parser reads the
policy names and the sweep's and simulate's defaults from their modules (no torch, no
numpy), and each command imports what it needs (torch only for ``simulate``) when it runs.
A mistake a user can make (a bad trace, an unknown policy, an impossible size) ends with
one line on stderr and exit status 1; a malformed command line with argparse's usage
message and status 2, and so do a configuration file or variable that cannot be used
and a flag that would do nothing, in one line. What is printed is in
:mod:`kvoffload.cli_output`, the configuration in :mod:`kvoffload.cli_config`, the remote
commands in :mod:`kvoffload.cli_remote`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvoffload import cli_args as kinds
from kvoffload import cli_output as output
from kvoffload_spec.errors import InvalidArgumentError, OffloadError

if TYPE_CHECKING:
    from kvoffload.replay.config import DiskTierConfig
    from kvoffload.replay.report import SimulationReport
    from kvoffload.replay.simulate import MemoryPlan, SimulationConfig
    from kvoffload.replay.sweep import SweepResult
    from kvoffload.replay.traces import Trace

EXIT_OK = 0
EXIT_ERROR = 1  # a user error (bad trace, size, policy) or a verification that failed
EXIT_USAGE = 2  # a malformed command line, configuration or flag that does nothing
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a Unix tool killed by a closed pipe reports

# An option that does nothing without another (given on the command line while the other
# is set nowhere) is refused rather than quietly ignored.
NEEDS = {
    "remote_mode": "remote",
    "remote_secret_file": "remote",
    "remote_cluster": "remote",
    "disk_bytes": "disk",
    "disk_admission": "disk",
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    from kvoffload.cli_config import ConfigError, layer, leaf_parsers

    arguments = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    try:
        args = parser.parse_args(arguments)
    except SystemExit as exit_:  # --help, --version or a usage error: argparse has spoken
        return exit_.code if isinstance(exit_.code, int) else EXIT_ERROR
    try:
        layered = layer(parser, arguments, args, os.environ)
    except ConfigError as error:
        return _fail(args, str(error), EXIT_USAGE)
    for option, needed in NEEDS.items():
        if option in layered.given and needed in vars(args) and getattr(args, needed) is None:
            leaf = leaf_parsers(parser)[args.command_name]
            said = f"{_flag(leaf, option)} does nothing without {_flag(leaf, needed)}"
            return _fail(args, said, EXIT_USAGE)
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


def _flag(leaf: argparse.ArgumentParser, dest: str) -> str:
    """How the command ``leaf`` spells its option ``dest`` (``remote stats`` says ``--cluster``
    and ``URL`` where ``simulate`` says ``--remote-cluster`` and ``--remote``)."""
    from kvoffload.cli_config import configurable, flag_of

    action = configurable(leaf).get(dest)
    return "--" + dest.replace("_", "-") if action is None else flag_of(action)


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


def _fail(args: argparse.Namespace, message: str, status: int = EXIT_ERROR) -> int:
    print(f"kvoffload {args.command_name}: error: {message}", file=sys.stderr)
    return status


# -- the command line ----------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    # the policy registry is a few small modules (no torch, no numpy): read names from it
    from kvoffload.cli_config import leaf_parsers
    from kvoffload.cli_remote import add_remote_commands
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
        type=kinds.count("blocks"),
        default=sizes.gpu_blocks,
        metavar="N",
        help="device prefix cache size in blocks; must hold the longest request "
        f"(default: %(default)s; {kinds.DECIMAL_SUFFIXES})",
    )
    simulate.add_argument(
        "--cpu-blocks",
        type=kinds.count("blocks"),
        default=sizes.cpu_blocks,
        metavar="N",
        help=f"CPU pool size in blocks (default: %(default)s; {kinds.DECIMAL_SUFFIXES})",
    )
    simulate.add_argument(
        "--policy",
        default=sizes.policy,
        metavar=f"{builtin}|module:Class",
        help="the CPU pool's eviction policy: a built-in one (duel follows LRU, segmented "
        "LRU or LRU-2, whichever its sampled shadow pools find would serve the most prefix "
        "hits), or your own EvictionPolicy subclass, imported from the current directory or "
        "PYTHONPATH (default: %(default)s)",
    )
    simulate.add_argument(
        "--block-bytes",
        type=kinds.byte_size,
        default=sizes.block_bytes,
        metavar="BYTES",
        help="bytes per KV block, e.g. 4096, 64KiB, 2MiB; KiB, MiB, GiB are binary (1 KiB = "
        "1,024 bytes), KB, MB, GB decimal (1 KB = 1,000 bytes) (default: %(default)s)",
    )
    simulate.add_argument(
        "--requests",
        type=kinds.count("requests"),
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
        type=kinds.count("instances"),
        default=1,
        metavar="N",
        help="N engines serving the trace's requests in turn (request i on engine i mod N), "
        "each with the sizes above, sharing --remote (default: 1)",
    )
    simulate.add_argument(
        "--remote-secret-file",
        default=None,
        metavar="PATH",
        help="with --remote: a file holding the tenant's secret (at least 16 bytes, read "
        "once; its final newline is not part of it): values are sealed and server keys "
        "derived from it, so nobody without it can forge a block or see which are cached; "
        "without this flag, $KVOFFLOAD_REMOTE_SECRET if set (default: no secret)",
    )
    simulate.add_argument(
        "--remote-cluster",
        action="store_true",
        help="with --remote: the URL names nodes of a Valkey Cluster (one or several, "
        "comma-separated: redis://host:port,host:port); blocks go to their slots' primaries "
        "and follow failovers",
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
        type=kinds.port,
        default=None,
        metavar="N",
        help="serve kvoffload's metrics (Prometheus text format) on "
        "http://127.0.0.1:N/metrics while the replay runs (needs prometheus_client: "
        "pip install 'kvoffload[metrics]')",
    )
    kinds.add_json_argument(simulate)
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
        type=kinds.count("blocks", minimum=0),
        default=0,
        metavar="N",
        help="device prefix cache in front of the CPU tier; 0 means a single tier "
        f"(default: %(default)s; {kinds.DECIMAL_SUFFIXES})",
    )
    sweep.add_argument(
        "--capacities",
        type=kinds.count_list,
        default=",".join(map(str, DEFAULT_CAPACITIES)),
        metavar="N,N,...",
        help="CPU capacities in blocks, e.g. 1000,4k,16k; decimal suffixes: 4k = 4,000 and "
        "1m = 1,000,000 blocks (default: %(default)s)",
    )
    sweep.add_argument(
        "--policies",
        type=kinds.name_list,
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
    kinds.add_json_argument(sweep)
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
        type=kinds.seconds,
        default=60.0,
        metavar="SECONDS",
        help="time budget for both checks together (default: %(default)s)",
    )
    kinds.add_json_argument(verify)
    verify.set_defaults(command=_run_verify, command_name="verify")
    add_remote_commands(commands)
    for leaf in leaf_parsers(parser).values():
        leaf.add_argument(
            "--config",
            metavar="PATH",
            default=None,
            help="a TOML file of defaults for these options (default: $KVOFFLOAD_CONFIG); "
            "the command line wins over KVOFFLOAD_<OPTION> variables, which win over it",
        )
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


def _version() -> str:
    import kvoffload

    return kvoffload.__version__


# -- the commands ---------------------------------------------------------------------------


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
        type=kinds.byte_size,
        default=DEFAULT_DISK_BYTES,
        metavar="SIZE",
        help="with --disk: the disk tier's capacity per engine, e.g. 512MiB, 4GiB (default: 4GiB)",
    )
    parser.add_argument(
        "--disk-admission",
        choices=("second-offer", "every-offer"),
        default="second-offer",
        help="with --disk: write a block to the disk on its second offer (a cold scan "
        "cannot flush the disk) or on every one (default: %(default)s)",
    )


DEFAULT_DISK_BYTES = 4 << 30


def _disk_tier(args: argparse.Namespace) -> DiskTierConfig | None:
    """The ``DiskTierConfig`` the disk options ask for, or None."""
    if args.disk is None:
        return None
    from kvoffload.replay.config import DiskTierConfig

    return DiskTierConfig(args.disk, capacity_bytes=args.disk_bytes, admission=args.disk_admission)


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
    console = output.console(stderr=True)
    try:
        with output.progress(console, enabled=not args.json) as progress:
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
    except Exception as error:
        return _fail(args, _raised_by_policy(error, [args.policy]))
    if args.json:
        output.print_json(report.to_json())
    else:
        output.show_simulation(trace, report, disk=args.disk)
    _warn_tier_failures(args, report)
    if not report.all_loads_verified:
        return _fail(args, f"{report.load_mismatches} loaded blocks differ from what was stored")
    return EXIT_OK


def _run_sweep(args: argparse.Namespace) -> int:
    from kvoffload.replay.sweep import SweepInterrupted, sweep
    from kvoffload.replay.traces import resolve_trace

    trace = resolve_trace(args.trace)
    if args.plot is not None:
        output.check_plot_target(args.plot)
    console = output.console(stderr=True)
    total = len(args.capacities) * len(args.policies)
    try:
        with output.progress(console, enabled=not args.json) as progress:
            task = progress.add_task(f"sweeping {trace.name}", total=total)
            result = sweep(
                trace,
                args.capacities,
                args.policies,
                gpu_blocks=args.gpu_blocks,
                on_point=lambda _point: progress.advance(task),
            )
    except SweepInterrupted as interrupted:  # Ctrl-C: the points done are not thrown away
        partial = interrupted.result
        if partial.points:
            _show_sweep_result(args, trace, partial)
        print(
            f"kvoffload sweep: interrupted after {len(partial.points)} of {total} points",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    except Exception as error:
        return _fail(args, _raised_by_policy(error, args.policies))
    _show_sweep_result(args, trace, result)
    if args.plot is not None:
        output.plot_sweep(trace, args.gpu_blocks, result, args.plot)
    return EXIT_OK


def _show_sweep_result(args: argparse.Namespace, trace: Trace, result: SweepResult) -> None:
    if args.json:
        output.print_json(result.to_json())
    else:
        output.show_sweep(trace, args.gpu_blocks, result)


def _raised_by_policy(error: Exception, policies: Sequence[str]) -> str:
    """What a user's own policy (``module:Class``) raised, where, in one line, as ``verify``
    says it; an error that did not come out of one is raised on (a bug of kvoffload's own,
    whose traceback is what its report needs)."""
    import traceback
    from pathlib import Path

    from kvoffload.policies.loading import resolve_policy

    files: dict[str, str] = {}
    for name in policies:
        if ":" in name:
            module = sys.modules.get(resolve_policy(name).__module__)
            source = getattr(module, "__file__", None)
            if source is not None:
                files[os.path.realpath(source)] = name
    frames = traceback.extract_tb(error.__traceback__)
    owners = [
        files[path] for path in map(os.path.realpath, (f.filename for f in frames)) if path in files
    ]
    if not owners:
        raise error
    where = frames[-1]
    return (
        f"policy {owners[-1]} raised {type(error).__name__}({error}) at "
        f"{Path(where.filename).name}:{where.lineno}: {where.line} "
        f"(kvoffload verify --policy {owners[-1]} shows how)"
    )


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

    console = output.console(stderr=True)
    with output.progress(console, enabled=not args.json, unit="s") as progress:
        # the checks share the time budget: the bar is the budget spent
        task = progress.add_task(f"verifying {args.policy}", total=args.budget)
        with output.ticking(lambda spent: progress.update(task, completed=min(spent, args.budget))):
            report = verify(
                args.policy,
                budget_s=args.budget,
                on_stage=lambda stage: progress.update(task, description=stage),
            )
    if args.json:
        output.print_json(report.to_json())
    else:
        output.show_verification(report)
    return EXIT_OK if report.passed else EXIT_ERROR


def _run_simulate_shared(
    args: argparse.Namespace, trace: Trace, config: SimulationConfig, disk: DiskTierConfig | None
) -> int:
    from kvoffload.policies.base import PolicyContractError
    from kvoffload.replay.simulate import simulate_shared

    secret: bytes | None = None
    if args.remote is not None:
        try:
            secret = _remote_secret(args)
        except ImportError as error:  # --remote without the client: kvoffload[remote]
            return _fail(args, str(error))
        except InvalidArgumentError as error:  # names the file or the variable, never bytes
            return _fail(args, str(error))
        try:
            _check_remote_answers(args.remote, cluster=args.remote_cluster)
        except InvalidArgumentError as error:  # --remote-cluster, or not, against the other
            flag = "without --remote-cluster" if args.remote_cluster else "add --remote-cluster"
            return _fail(args, f"{error} ({flag})")
    console = output.console(stderr=True)
    try:
        with output.progress(console, enabled=not args.json) as progress:
            task = progress.add_task(f"replaying {trace.name}", total=None)
            shared = simulate_shared(
                trace,
                config,
                instances=args.instances,
                remote_url=args.remote,
                remote_cluster=args.remote_cluster,
                remote_mode=args.remote_mode,
                remote_secret=secret,
                disk=disk,
                on_request=lambda done, total: progress.update(task, completed=done, total=total),
                on_start=_announce_memory,
                metrics_port=args.metrics_port,
            )
    except PolicyContractError as error:
        return _fail(args, f"{error} (kvoffload verify --policy {args.policy} shows how)")
    except ImportError as error:  # --remote without the client: pip install 'kvoffload[remote]'
        return _fail(args, str(error))
    except Exception as error:
        return _fail(args, _raised_by_policy(error, [args.policy]))
    if args.json:
        output.print_json(shared.to_json())
    else:
        remote = shared.remote_url
        if remote is not None and args.remote_cluster:
            remote += " (a Valkey Cluster)"
        output.show_shared_simulation(trace, shared, remote, args.disk)
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


def _remote_secret(args: argparse.Namespace) -> bytes | None:
    """The tenant's secret: the file of ``--remote-secret-file``, else
    ``$KVOFFLOAD_REMOTE_SECRET``, else none.

    A file others can read is used, with a warning: a secret mounted by Kubernetes is 0644
    unless its ``defaultMode`` says otherwise, and refusing it would leave such a deployment
    unsealed, which is worse than a readable file on the engine's own host.
    """
    from kvoffload.tiers.secret import resolve_secret

    path = args.remote_secret_file
    secret = resolve_secret(secret_file=path)
    try:
        shared = path is not None and bool(os.stat(path).st_mode & 0o077)
    except OSError:  # gone since it was read: the secret read is what counts
        shared = False
    if shared:
        _warn(args, f"the secret file {path} can be read by its group or others (chmod 600)")
    return secret


def _check_remote_answers(url: str, *, cluster: bool) -> None:
    """Say at once, on stderr, when the remote tier does not answer: the run still goes on
    (a store survives a server that is down), but its remote column would be all misses."""
    from kvoffload.tiers import ValkeyStore

    with ValkeyStore(url, namespace="kvoffload simulate: ping", cluster=cluster) as probe:
        if not probe.check_mode():  # a store of the wrong mode raises here, before the run
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


if __name__ == "__main__":
    sys.exit(main())
