"""What a cluster store knows of a Valkey Cluster: which of its 16,384 hash slots a server
key falls in, and which primary serves each slot.

The slot is the server's own: CRC16 (XMODEM) of the key modulo 16,384, or of the key's hash
tag (what lies between the first ``{`` and the first ``}`` after it, when that is not empty).
A store computes it exactly as the server does, or the server answers ``MOVED`` to every
call.

The map comes from ``CLUSTER NODES``: one bulk string (read by the connection's bounded
reader, at most ``MAX_MAP_BYTES``: a larger reply is a protocol error, never unbounded
memory), one line per node, parsed here without trusting it (a line that is not a node is
refused whole: :class:`~kvoffload.tiers.connection.ProtocolError`). ``CLUSTER NODES`` rather
than ``CLUSTER SLOTS``: a flat text, no nested arrays for the connection's parser to learn,
and it says which nodes are failing.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from kvoffload_spec.errors import InvalidArgumentError

from .address import ServerAddress, redact
from .connection import ProtocolError

SLOTS = 16384
# The largest CLUSTER NODES reply read: ~150 bytes a node plus its slot ranges; 1,000 nodes
# with fragmented slots fit many times over.
MAX_MAP_BYTES = 4 * 1024 * 1024
_NODE_ID = re.compile(rb"[0-9a-f]{40}")
_ADDRESS = re.compile(rb"(.*):([0-9]{1,5})@[0-9]{1,5}(?:,.*)?")
_RANGE = re.compile(rb"([0-9]{1,5})(?:-([0-9]{1,5}))?")


class ClusterModeError(InvalidArgumentError):
    """The server is not what the store was told: ``cluster=True`` against a server without
    cluster support, or ``cluster=False`` against a cluster node (it answered ``MOVED``,
    ``ASK`` or ``CROSSSLOT``). A configuration mistake, raised at the first contact."""


def _table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
        table.append(crc & 0xFFFF)
    return table


_CRC_TABLE = _table()


def crc16(data: bytes) -> int:
    """CRC16/XMODEM (polynomial 0x1021, initial 0), the cluster's key hash."""
    crc = 0
    table = _CRC_TABLE
    for byte in data:
        crc = ((crc << 8) & 0xFFFF) ^ table[((crc >> 8) ^ byte) & 0xFF]
    return crc


def key_slot(key: bytes) -> int:
    """The hash slot of a server key, hash tags honoured as the server does."""
    start = key.find(b"{")
    if start >= 0:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            key = key[start + 1 : end]
    return crc16(key) % SLOTS


@dataclass(frozen=True, slots=True)
class Endpoint:
    host: str
    port: int


@dataclass(frozen=True, slots=True)
class SlotMap:
    """The primary of every slot (``None``: no primary serves it now) and the nodes that
    were failing when the map was read."""

    owners: tuple[Endpoint | None, ...]
    failing: frozenset[Endpoint]

    @property
    def primaries(self) -> set[Endpoint]:
        return {owner for owner in self.owners if owner is not None}

    def moved(self, slot: int, to: Endpoint) -> SlotMap:
        owners = list(self.owners)
        owners[slot] = to
        return SlotMap(tuple(owners), self.failing)


def parse_nodes(text: bytes) -> SlotMap:
    """A ``CLUSTER NODES`` reply as a slot map (only primaries own slots; a slot being
    migrated, ``[slot->-id]`` / ``[slot-<-id]``, stays its present owner's)."""
    owners: list[Endpoint | None] = [None] * SLOTS
    failing: set[Endpoint] = set()
    for line in text.split(b"\n"):
        line = line.strip()
        if not line:
            continue
        fields = line.split(b" ")
        if len(fields) < 8 or _NODE_ID.fullmatch(fields[0]) is None:
            raise ProtocolError(f"not a CLUSTER NODES line: {line[:80]!r}")
        address = _ADDRESS.fullmatch(fields[1])
        if address is None:
            raise ProtocolError(f"not a node address: {fields[1][:80]!r}")
        flags = set(fields[2].split(b","))
        host = address.group(1).decode("ascii", "replace")
        port = int(address.group(2))
        if not host or b"noaddr" in flags or not 0 < port < 65536:
            continue  # a node the cluster knows of but cannot reach: nothing to send it
        endpoint = Endpoint(host, port)
        if flags & {b"fail", b"fail?"}:
            failing.add(endpoint)
        if b"master" not in flags:
            continue
        for entry in fields[8:]:
            if entry.startswith(b"["):
                continue
            found = _RANGE.fullmatch(entry)
            if found is None:
                raise ProtocolError(f"not a slot range: {entry[:40]!r}")
            first = int(found.group(1))
            last = int(found.group(2) or found.group(1))
            if not first <= last < SLOTS:
                raise ProtocolError(f"slot range {entry[:40]!r} out of 0-{SLOTS - 1}")
            for slot in range(first, last + 1):
                owners[slot] = endpoint
    return SlotMap(tuple(owners), frozenset(failing))


def parse_redirect(message: str) -> tuple[int, Endpoint] | None:
    """``MOVED 3999 127.0.0.1:6381`` or ``ASK ...`` as (slot, node); ``None`` if malformed."""
    parts = message.split(" ")
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    host, colon, port = parts[2].rpartition(":")
    slot = int(parts[1])
    if not colon or not port.isdigit() or not 0 < int(port) < 65536 or slot >= SLOTS:
        return None
    return slot, Endpoint(host, int(port))


def seed_addresses(
    url: object, *, tls_ca_file: str | None, tls_verify: bool | None
) -> list[ServerAddress]:
    """The nodes named by a cluster URL: ``redis://[user:pass@]host:port,host:port[/db]``
    (its options apply to every node). A cluster has only database 0."""
    if not isinstance(url, str):
        raise InvalidArgumentError(f"url must be a str; got {type(url).__name__}")
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() == "unix":
        raise InvalidArgumentError(
            f"a cluster URL is redis://host:port[,host:port...] (or valkeys:// for TLS); "
            f"got {redact(url)!r}"
        )
    at = rest.rfind("@", 0, _authority_end(rest))
    credentials = rest[: at + 1]
    hosts_end = _authority_end(rest)
    hosts, tail = rest[at + 1 : hosts_end], rest[hosts_end:]
    seeds = [
        ServerAddress.parse(
            f"{scheme}://{credentials}{host}{tail}", tls_ca_file=tls_ca_file, tls_verify=tls_verify
        )
        for host in hosts.split(",")
    ]
    if any(seed.db for seed in seeds):
        raise InvalidArgumentError(f"a cluster has only database 0; got {redact(url)!r}")
    return seeds


def _authority_end(rest: str) -> int:
    """Where the authority ends: the first / or ? after its last @ (a password may hold
    either)."""
    at = rest.rfind("@")
    ends = [i for i in (rest.find("/", at + 1), rest.find("?", at + 1)) if i >= 0]
    return min(ends) if ends else len(rest)


def node_address(seed: ServerAddress, node: Endpoint) -> ServerAddress:
    """The address of a node the map names: the seed's credentials and TLS options."""
    scheme = seed.url.partition("://")[0]
    return dataclasses.replace(
        seed, host=node.host, port=node.port, url=f"{scheme}://{node.host}:{node.port}"
    )
