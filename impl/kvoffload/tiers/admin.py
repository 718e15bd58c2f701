"""An operator's session with a server: the few commands ``kvoffload remote`` sends to look
at a server and to clean it (``PING``, ``INFO``, ``CLUSTER NODES``, ``SCAN``, ``STRLEN``,
``GET``, ``DBSIZE``, ``UNLINK``), on the stores' own connection (:mod:`.connection`).

Commands on several keys are pipelined, one command per key (one round trip all the same):
on a cluster node, keys of several slots in one command are refused (``CROSSSLOT``), and a
node's ``SCAN`` lists keys of all of its slots.

Not a store: nothing here is on an engine's path, so a failure raises (:class:`AdminError`,
or the ``OSError`` of the socket, ``TimeoutError`` included) for the command line to report
in one line. Each command still runs under its own deadline of ``timeout_s`` and reads no
more than it can use: a key name or a description at most ``MAX_NAME_BYTES``, a sampled
value at most ``max_value_bytes``, so a server that misbehaves cannot hold the terminal or
fill the operator's memory.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload_spec.errors import InvalidArgumentError

from .address import ServerAddress
from .cluster_map import MAX_MAP_BYTES
from .connection import (
    MAX_LINE,
    Deadline,
    ErrorReply,
    Link,
    Oversized,
    ProtocolError,
    Refused,
    Reply,
    pack,
    tls_context,
)

# The longest key name or INFO section read: ours are under 100 bytes, INFO's under 8 KiB.
MAX_NAME_BYTES = 64 * 1024


class AdminError(Exception):
    """The server refused a command, or replied what no server would."""


# What a session's command may raise: the server's refusal or nonsense, or the socket's.
FAILURES = (AdminError, ProtocolError, OSError)


class AdminSession:
    """One connection to the server at ``url``, authenticated and on its database."""

    def __init__(self, url: str | ServerAddress, *, timeout_s: float, max_value_bytes: int) -> None:
        self.address = url if isinstance(url, ServerAddress) else ServerAddress.parse(url)
        self._timeout_s = timeout_s
        self._max_value_bytes = max_value_bytes
        try:
            context = tls_context(self.address) if self.address.tls else None
        except OSError as error:
            raise InvalidArgumentError(f"{self.address.url}: TLS set-up failed: {error}") from None
        deadline = Deadline(timeout_s)
        self._link = Link.open(self.address, deadline, context)
        try:
            self._link.authenticate(self.address, deadline)
        except (Refused, ProtocolError) as error:
            self._link.close()
            raise AdminError(str(error)) from None
        except BaseException:
            self._link.close()
            raise

    def __enter__(self) -> AdminSession:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self._link.close()

    # -- the commands ----------------------------------------------------------------------

    def ping(self) -> None:
        if self._call(b"PING", []) != b"PONG":
            raise AdminError("PING was not answered PONG")

    def info(self, section: str) -> dict[str, str]:
        """``INFO section`` as ``field -> value``."""
        text = self._call(b"INFO", [section.encode()], limit=MAX_NAME_BYTES)
        if not isinstance(text, bytes):
            raise AdminError(f"INFO answered {text!r:.40}")
        fields: dict[str, str] = {}
        for line in text.decode("utf-8", "replace").splitlines():
            name, colon, value = line.partition(":")
            if colon and not name.startswith("#"):
                fields[name] = value
        return fields

    def dbsize(self) -> int:
        return self._integer(self._call(b"DBSIZE", []))

    def scan(self, cursor: int, *, match: str, count: int) -> tuple[int, list[bytes]]:
        """One page of ``SCAN``: the next cursor (0: done) and the keys it found."""
        deadline = Deadline(self._timeout_s)
        arguments = [b"%d" % cursor, b"MATCH", match.encode(), b"COUNT", b"%d" % count]
        self._link.send([pack(b"SCAN", arguments)], deadline)
        if self._count(self._link.array_header(deadline)) != 2:
            raise AdminError("SCAN answered an array that is not [cursor, keys]")
        next_cursor = self._link.reply(deadline)
        if not isinstance(next_cursor, bytes) or not next_cursor.isdigit():
            raise AdminError(f"SCAN answered the cursor {next_cursor!r:.40}")
        keys = self._names(self._count(self._link.array_header(deadline)), deadline)
        return int(next_cursor), [key for key in keys if key is not None]

    def strlens(self, keys: Sequence[bytes]) -> list[int]:
        """Each key's value length (0: gone, or not a string: anyone may write any type
        under any name), pipelined: one round trip."""
        if not keys:
            return []
        deadline = self._send_each(b"STRLEN", keys)
        lengths = [self._link.reply(deadline) for _ in keys]
        return [
            0 if isinstance(length, ErrorReply) else self._integer(length) for length in lengths
        ]

    def get_text(self, key: bytes) -> bytes | None:
        """A short value (a description), or ``None``."""
        found = self._call(b"GET", [key], limit=MAX_NAME_BYTES)
        if found is not None and not isinstance(found, bytes):
            raise AdminError(f"GET answered {found!r:.40}")
        return found

    def cluster_nodes(self) -> bytes:
        """``CLUSTER NODES``: every node of the cluster and the slots it serves."""
        text = self._call(b"CLUSTER", [b"NODES"], limit=MAX_MAP_BYTES)
        if not isinstance(text, bytes):
            raise AdminError(f"CLUSTER NODES answered {text!r:.40}")
        return text

    def values(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Each key's value (``None``: gone, or not a string), at most ``max_value_bytes``
        each (a longer one ends the session), pipelined."""
        if not keys:
            return []
        deadline = self._send_each(b"GET", keys)
        values: list[bytes | None] = []
        for _ in keys:
            found = self._link.value_reply(deadline, self._max_value_bytes)
            if isinstance(found, Oversized):
                limit = self._max_value_bytes
                raise AdminError(f"a value of {found.length:,} bytes, over {limit:,}")
            # Not a string (WRONGTYPE): no store's value, as a null is none.
            values.append(bytes(found) if isinstance(found, memoryview) else None)
        return values

    def unlink(self, keys: Sequence[bytes]) -> int:
        """Delete the keys (pipelined); how many were there."""
        if not keys:
            return 0
        deadline = self._send_each(b"UNLINK", keys)
        return sum(self._integer(self._answer(self._link.reply(deadline))) for _ in keys)

    def _send_each(self, verb: bytes, keys: Sequence[bytes]) -> Deadline:
        """``verb`` once per key, pipelined (see the module); the deadline of its replies."""
        deadline = Deadline(self._timeout_s)
        self._link.send([b"".join(pack(verb, [key]) for key in keys)], deadline)
        return deadline

    # -- replies -----------------------------------------------------------------------------

    def _call(self, verb: bytes, arguments: list[bytes], limit: int = MAX_LINE) -> Reply:
        deadline = Deadline(self._timeout_s)
        self._link.send([pack(verb, arguments)], deadline)
        return self._answer(self._link.reply(deadline, limit))

    def _names(self, count: int, deadline: Deadline) -> list[bytes | None]:
        names: list[bytes | None] = []
        for _ in range(count):
            found = self._link.bulk(deadline, MAX_NAME_BYTES, None)
            if isinstance(found, Oversized):
                raise AdminError(f"a key name of {found.length:,} bytes")
            names.append(None if found is None else bytes(found))
        return names

    @staticmethod
    def _count(header: int | ErrorReply) -> int:
        if isinstance(header, ErrorReply):
            raise AdminError(header.message)
        return header

    @staticmethod
    def _answer(reply: Reply) -> Reply:
        if isinstance(reply, ErrorReply):
            raise AdminError(reply.message)
        return reply

    @staticmethod
    def _integer(reply: Reply) -> int:
        if not isinstance(reply, int):
            raise AdminError(f"{reply!r:.40} where an integer was expected")
        return reply


__all__ = ["FAILURES", "MAX_NAME_BYTES", "AdminError", "AdminSession"]
