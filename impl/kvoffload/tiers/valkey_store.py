"""ValkeyStore: the remote block store on a Valkey or Redis server.

One connection, one batch per round trip: ``get`` is one ``MGET``, ``put`` one ``MSET`` per
~4 MiB of values (all sent before any reply is read), ``contains`` and ``delete`` pipeline
one ``EXISTS`` / ``UNLINK`` per key. The client library (``valkey``, which speaks to Redis
servers too) parses the URL, connects and parses replies; the commands are packed and sent
here, so that a value goes out as its small header followed by the caller's own buffer (a
put copies no payload byte), many buffers to one ``sendmsg``, each header made just before
its payload is handed to the socket.

Failures never escape (see :mod:`kvoffload.tiers.store`): a timeout, a refused or reset
connection or an error reply makes the call's keys misses (or writes not stored), is counted,
drops the connection (a reply that comes late must never be read as the answer to a later
command), and marks the server down for ``retry_after_s``: until then calls return at once,
so a dead server costs the caller one timeout per ``retry_after_s``, not one per call. The
first call after that connects again. A connection found dead on its first use by a call
(the server restarted while the store was idle) is not a failure: the call is sent once
more on a new connection, and counted in ``retries``.
"""

from __future__ import annotations

import os
import socket
import ssl
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, cast

import valkey
from valkey.connection import parse_url

from kvoffload_spec.errors import InvalidArgumentError

from .store import Payload, RemoteStats, StoreClosedError, WritableBuffer
from .values import Namespace, Rejection, as_payload, encode_key, header, payload_of

# A command as the successive sends that make it (called again to send it again).
_Sends = Callable[[], Iterable[Sequence[bytes | memoryview]]]


class _Connection(Protocol):
    """What is used of the client's connection (its methods carry no annotations)."""

    _sock: object | None

    def connect(self) -> None: ...

    def disconnect(self) -> None: ...

    def send_packed_command(
        self, command: Sequence[bytes | memoryview], check_health: bool = True
    ) -> None: ...

    def read_response(self, *, disconnect_on_error: bool = True) -> Any: ...


# One MSET carries at most this many value bytes (a larger value goes alone). The server holds
# a whole command before it runs it, and frees the values it replaces only then: one MSET of a
# whole batch has the server hold the batch twice over, in memory its allocator must map and
# fault in again and again; commands of a few MiB each let it reuse at once the memory of the
# values it has just replaced. Measured against one MSET per 64 MiB: a put of 2 MiB x 4 or x 16
# cost the server 10-20% less CPU (page faults: ~10-50 per put instead of 250-1,800).
MAX_COMMAND_BYTES = 4 * 1024 * 1024
# Buffers one sendmsg takes (the kernel's limit, 1024 on Linux).
_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
# A put hands its bytes to the socket in sends of about this many payload bytes: large enough
# that a send is not a wake-up of the server per small value, small enough that the next
# values are hashed while the server reads these (and that a value hashed is still in the
# cache when the kernel copies it). 256 KiB to 4 MiB measured alike within the noise here.
_SEND_EVERY = 1024 * 1024
# The namespace's description, after the namespace's key prefix (see _describe_namespace).
DESCRIPTION_NAME = b"#description"
# Below this, pieces of a command are joined into one buffer (one send, not many).
_JOIN_BELOW = 16 * 1024


class ValkeyStore:
    """Blocks on a Valkey/Redis server at ``url``, under ``namespace``.

    ``url``: ``valkey://`` or ``redis://host:port/db`` (``valkeys://``/``rediss://`` for TLS,
    ``unix:///path``), user and password in it if needed. ``namespace``: what the blocks'
    bytes depend on (a :class:`Namespace`, or the str or mapping to make one from).
    ``timeout_s``: how long one socket operation (connect, send, receive) may wait.
    ``retry_after_s``: how long the server stays marked down after a failure.

    Nothing connects here: a server down at start is found, counted and survived by the
    first call. Thread-safe: calls from several threads take turns on the one connection.
    """

    def __init__(
        self,
        url: str,
        *,
        namespace: str | Mapping[str, Any] | Namespace,
        timeout_s: float = 0.5,
        retry_after_s: float = 1.0,
    ) -> None:
        if not isinstance(url, str):
            raise InvalidArgumentError(f"url must be a str; got {type(url).__name__}")
        for name, value in (("timeout_s", timeout_s), ("retry_after_s", retry_after_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidArgumentError(f"{name} must be a number of seconds")
        if not 0 < timeout_s < float("inf"):
            raise InvalidArgumentError(f"timeout_s must be positive and finite; got {timeout_s}")
        if not 0 <= retry_after_s < float("inf"):
            raise InvalidArgumentError(f"retry_after_s must be >= 0; got {retry_after_s}")
        self._namespace = Namespace.of(namespace)
        try:
            options: dict[str, Any] = parse_url(url)
        except ValueError as error:
            raise InvalidArgumentError(f"not a Valkey/Redis URL: {url!r} ({error})") from None
        connection_class = options.pop("connection_class", valkey.Connection)
        options.update(
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=None,
            retry_on_error=None,
            retry_on_timeout=False,
            health_check_interval=0,
            client_name="kvoffload",
        )
        self._url = url
        self._timeout_s = float(timeout_s)
        self._retry_after_s = float(retry_after_s)
        self._make_connection: Callable[[], _Connection] = lambda: cast(
            _Connection, connection_class(**options)
        )
        self._connection: _Connection | None = None
        self._pid = os.getpid()
        self._closed = False
        self._down_until = 0.0
        self._io = threading.Lock()
        self._counting = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._last_error: str | None = None
        self._described = False  # the namespace's description is on the server

    # -- the surface ---------------------------------------------------------------------

    @property
    def namespace(self) -> Namespace:
        return self._namespace

    @property
    def url(self) -> str:
        return self._url

    def get(self, keys: Sequence[Hashable]) -> list[memoryview | None]:
        """The payload stored under each key, or ``None``: views into the reply, no copy."""
        encoded = self._keys(keys)
        return self._read(encoded)

    def get_into(self, keys: Sequence[Hashable], buffers: Sequence[WritableBuffer]) -> list[bool]:
        """Copy each key's payload into its buffer, only if it is valid and exactly the
        buffer's size; ``False`` leaves that buffer untouched."""
        encoded = self._keys(keys)
        targets = self._buffers(buffers, len(encoded))
        found = self._read(encoded)
        done: list[bool] = []
        copied = 0
        for payload, target in zip(found, targets, strict=True):
            if payload is not None and payload.nbytes == target.nbytes:
                target[:] = payload
                copied += payload.nbytes
                done.append(True)
            else:
                done.append(False)
        # A valid value of another size: the namespace did not describe the block size.
        mismatched = sum(
            1 for payload, ok in zip(found, done, strict=True) if payload is not None and not ok
        )
        self._count(
            bytes_copied=copied, hits=-mismatched, rejected=mismatched, rejected_length=mismatched
        )
        return done

    def put(self, keys: Sequence[Hashable], values: Sequence[Payload]) -> list[bool]:
        """Store each value under its key; ``True`` where the server acknowledged it.

        The values are sent from the caller's buffers as they are when the call runs: do not
        change them until it returns.
        """
        encoded = self._keys(keys)
        if isinstance(values, (str, bytes, bytearray, memoryview)) or not isinstance(
            values, Sequence
        ):
            raise InvalidArgumentError("values must be a sequence of buffers, one per key")
        if len(values) != len(encoded):
            raise InvalidArgumentError(
                f"put got {len(encoded)} keys and {len(values)} values; give one value per key"
            )
        payloads = [as_payload(value, f"the value for key #{i}") for i, value in enumerate(values)]
        self._count(put_calls=1, keys_offered=len(encoded))
        if not encoded:
            return []
        spans = _batches(payloads)
        replies = self._exchange(lambda: self._mset_sends(encoded, payloads, spans), len(spans))
        stored: list[bool] = []
        sent = 0
        for (start, stop), reply in zip(spans, replies or [None] * len(spans), strict=True):
            ok = reply in (b"OK", "OK", True)
            stored.extend([ok] * (stop - start))
            if ok:
                sent += sum(payload.nbytes for payload in payloads[start:stop])
        good = sum(stored)
        if good and not self._described:
            self._describe_namespace()
        joined = sum(payload.nbytes for payload in payloads if payload.nbytes < _JOIN_BELOW)
        self._count(
            keys_stored=good,
            keys_not_stored=len(stored) - good,
            bytes_sent=sent,
            bytes_copied=joined,
        )
        return stored

    def _describe_namespace(self) -> None:
        """Write the namespace's description under ``kvo1:<fingerprint>:#description``, once
        per store, so that ``kvoffload remote stats`` can say whose blocks these are. Only
        a hint for people: nothing reads it back. It is under the namespace's prefix (an ACL
        on the prefix covers it, a clear of the namespace takes it) and no block's key is
        it: an encoded key starts with its type's letter, never ``#``."""
        name = self._namespace.key_prefix + DESCRIPTION_NAME
        text = self._namespace.description.encode("utf-8", "surrogatepass")
        replies = self._exchange(_once(_pack(b"SET", [name, text])), 1)
        self._described = replies is not None

    def contains(self, keys: Sequence[Hashable]) -> list[bool]:
        """Whether the server has a value under each key (not checked: a hint)."""
        encoded = self._keys(keys)
        self._count(contains_calls=1)
        replies = self._per_key(b"EXISTS", encoded)
        return [reply == 1 for reply in replies]

    def delete(self, keys: Sequence[Hashable]) -> list[bool]:
        """Remove each key's value; ``True`` where one was there and is gone now."""
        encoded = self._keys(keys)
        self._count(delete_calls=1)
        replies = self._per_key(b"UNLINK", encoded)
        removed = [reply == 1 for reply in replies]
        self._count(keys_deleted=sum(removed))
        return removed

    def ping(self) -> bool:
        """Whether the server answers now (a failure is counted like any other)."""
        self._check_open()
        replies = self._exchange(_once([b"*1\r\n$4\r\nPING\r\n"]), 1)
        return replies is not None and replies[0] in (b"PONG", "PONG", True)

    def stats(self) -> RemoteStats:
        with self._counting:
            down = time.monotonic() < self._down_until
            return RemoteStats(**self._counts, server_down=down, last_error=self._last_error)

    def close(self) -> None:
        """Drop the connection; further calls raise :class:`StoreClosedError`."""
        with self._io:
            self._closed = True
            self._drop()

    def __enter__(self) -> ValkeyStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"ValkeyStore({self._url!r}, namespace={self._namespace.description!r}, "
            f"timeout_s={self._timeout_s})"
        )

    # -- arguments -----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"{self!r} is closed")

    def _keys(self, keys: Sequence[Hashable]) -> list[bytes]:
        self._check_open()
        if isinstance(keys, (str, bytes, bytearray, memoryview)) or not isinstance(keys, Sequence):
            raise InvalidArgumentError(
                f"keys must be a sequence of block keys (a list or tuple); "
                f"got {type(keys).__name__}"
            )
        prefix = self._namespace.key_prefix
        return [prefix + encode_key(key) for key in keys]

    @staticmethod
    def _buffers(buffers: Sequence[WritableBuffer], count: int) -> list[memoryview]:
        if isinstance(buffers, (bytes, bytearray, memoryview)) or not isinstance(buffers, Sequence):
            raise InvalidArgumentError("buffers must be a sequence of buffers, one per key")
        if len(buffers) != count:
            raise InvalidArgumentError(
                f"get_into got {count} keys and {len(buffers)} buffers; give one per key"
            )
        views: list[memoryview] = []
        for i, buffer in enumerate(buffers):
            view = as_payload(buffer, f"buffer #{i}")
            if view.readonly:
                raise InvalidArgumentError(f"buffer #{i} is read-only")
            views.append(view)
        return views

    # -- commands ------------------------------------------------------------------------

    def _read(self, encoded: list[bytes]) -> list[memoryview | None]:
        self._count(get_calls=1, keys_requested=len(encoded))
        if not encoded:
            return []
        replies = self._exchange(_once(_pack(b"MGET", encoded)), 1)
        if replies is None:
            self._count(unavailable=len(encoded))
            return [None] * len(encoded)
        values = replies[0]
        if not isinstance(values, list) or len(values) != len(encoded):
            with self._io:  # out of step with the server: drop the connection
                self._fail("server_errors", f"MGET answered {type(values).__name__}")
            self._count(unavailable=len(encoded))
            return [None] * len(encoded)
        found: list[memoryview | None] = []
        counts: dict[str, int] = {"hits": 0, "misses": 0, "rejected": 0, "bytes_received": 0}
        prefix = len(self._namespace.key_prefix)
        for key, value in zip(encoded, values, strict=True):
            if value is None:
                counts["misses"] += 1
                found.append(None)
                continue
            payload = payload_of(self._namespace, key[prefix:], value)
            if isinstance(payload, Rejection):
                counts["rejected"] += 1
                name = f"rejected_{payload.value}"
                counts[name] = counts.get(name, 0) + 1
                found.append(None)
            else:
                counts["hits"] += 1
                counts["bytes_received"] += payload.nbytes
                found.append(payload.toreadonly())
        self._count(**counts)
        return found

    def _per_key(self, verb: bytes, encoded: list[bytes]) -> list[object]:
        if not encoded:
            return []
        command = [b"".join(_pack(verb, [key])[0] for key in encoded)]
        replies = self._exchange(_once(command), len(encoded))
        return [None] * len(encoded) if replies is None else replies

    def _mset_sends(
        self, keys: list[bytes], payloads: list[memoryview], spans: list[tuple[int, int]]
    ) -> Iterator[list[bytes | memoryview]]:
        """One ``MSET`` per span, its values going out as header, then the caller's buffer
        (no copy), handed to the socket every ``_SEND_EVERY`` payload bytes.

        A header holds the payload's checksum, so it is made just before its payload is
        sent: while the server reads what was handed over, the next headers are made. Made
        all first, the hashing would be time the server waits (several percent of a put).
        """
        namespace = self._namespace
        prefix = len(namespace.key_prefix)
        for start, stop in spans:
            pieces = [b"*%d\r\n$4\r\nMSET\r\n" % (1 + 2 * (stop - start))]
            chunks: list[bytes | memoryview] = []
            pending = 0
            for key, payload in zip(keys[start:stop], payloads[start:stop], strict=True):
                head = header(namespace, key[prefix:], payload)
                size = len(head) + payload.nbytes
                if payload.nbytes < _JOIN_BELOW:
                    pieces.append(
                        b"$%d\r\n%s\r\n$%d\r\n%s%s\r\n" % (len(key), key, size, head, payload)
                    )
                    continue
                pieces.append(b"$%d\r\n%s\r\n$%d\r\n%s" % (len(key), key, size, head))
                chunks.append(b"".join(pieces))
                chunks.append(payload)
                pieces = [b"\r\n"]
                pending += payload.nbytes
                if pending >= _SEND_EVERY:
                    yield chunks
                    chunks, pending = [], 0
            chunks.append(b"".join(pieces))
            yield chunks

    def _exchange(self, sends: _Sends, replies: int) -> list[Any] | None:
        """Send what ``sends()`` yields, read ``replies`` replies; ``None`` on any failure
        (counted).

        A connection that served earlier calls may have died since (the server restarted,
        an idle connection was closed): the first use finds it reset or closed. That is no
        news about the server now, so the call is sent once more on a new connection, and
        only what that second attempt meets counts as the call's failure. Every command sent
        here is idempotent (``MSET`` of the same values, ``MGET``, ``EXISTS``, ``UNLINK``,
        ``PING``), and the second attempt reads only its own connection's replies, so
        nothing of the first can be taken for an answer. A timeout is never sent again (a
        stalled server would cost two), nor a call on a connection opened by this very call.
        """
        with self._io:
            self._check_open()
            if time.monotonic() < self._down_until:
                self._count(skipped=1)
                return None
            connection = self._connection
            reused = (
                connection is not None and connection._sock is not None
            ) and self._pid == os.getpid()
            try:
                try:
                    return self._send_and_read(sends, replies)
                except (valkey.ConnectionError, OSError) as error:
                    if not reused or isinstance(error, (valkey.TimeoutError, TimeoutError)):
                        raise
                    self._drop()
                    with self._counting:
                        self._counts["retries"] += 1
                        self._last_error = f"retried: {_describe(error)}"
                    return self._send_and_read(sends, replies)
            except valkey.TimeoutError as error:
                self._fail("timeouts", error)
            except (valkey.ConnectionError, OSError) as error:
                self._fail("connection_errors", error)
            except valkey.ValkeyError as error:
                self._fail("server_errors", error)
            return None

    def _send_and_read(self, sends: _Sends, replies: int) -> list[Any]:
        connection = self._connected()
        for chunks in sends():
            _send(connection, chunks)
        answers: list[Any] = []
        for _ in range(replies):
            try:
                answers.append(connection.read_response(disconnect_on_error=True))
            except valkey.ResponseError as error:
                # The error reply was read whole: the stream is still in step.
                answers.append(error)
                self._fail("server_errors", error, down=False)
        return answers

    def _connected(self) -> _Connection:
        if self._pid != os.getpid():  # forked: the parent's socket is not ours to use
            self._connection = None
            self._pid = os.getpid()
        if self._connection is None:
            self._connection = self._make_connection()
        connection = self._connection
        if connection._sock is None:
            connection.connect()
            self._count(connects=1)
        return connection

    def _drop(self) -> None:
        if self._connection is not None:
            self._connection.disconnect()

    def _fail(self, counter: str, error: BaseException | str, *, down: bool = True) -> None:
        if down:
            self._drop()
            self._down_until = time.monotonic() + self._retry_after_s
        with self._counting:
            self._counts["failures"] += 1
            self._counts[counter] += 1
            self._last_error = f"{counter}: {_describe(error)}"

    def _count(self, **deltas: int) -> None:
        with self._counting:
            self._counts.update(deltas)


def _send(connection: _Connection, chunks: Sequence[bytes | memoryview]) -> None:
    """Send ``chunks`` with as few system calls as the socket allows.

    The client's own send makes one ``sendall`` per chunk: a put of 128 blocks is 257 system
    calls, and as many TCP segments (its sockets set ``TCP_NODELAY``), each one a wake-up
    and a read for the server. One ``sendmsg`` takes up to ``IOV_MAX`` buffers, the payloads
    still sent from the caller's memory. TLS sockets have no ``sendmsg``: they keep the
    client's send.
    """
    sock = connection._sock
    if isinstance(sock, ssl.SSLSocket) or not isinstance(sock, socket.socket):
        connection.send_packed_command(chunks, check_health=False)
        return
    try:
        _send_gathered(sock, [memoryview(chunk) for chunk in chunks])
    except TimeoutError:  # socket.timeout: as the client reports it, the connection dropped
        connection.disconnect()
        raise valkey.TimeoutError("Timeout writing to socket") from None
    except OSError as error:
        connection.disconnect()
        raise valkey.ConnectionError(f"Error while writing to socket: {error}") from None


def _send_gathered(sock: socket.socket, views: list[memoryview]) -> None:
    """``sendall`` of the concatenation of ``views``, without concatenating them."""
    first = 0
    while first < len(views):
        sent = sock.sendmsg(views[first : first + _IOV_MAX])
        # A short send stops anywhere: drop the buffers sent whole, cut the one sent in part.
        while first < len(views) and sent >= views[first].nbytes:
            sent -= views[first].nbytes
            first += 1
        if sent:
            views[first] = views[first][sent:]


def _describe(error: BaseException | str) -> str:
    return error if isinstance(error, str) else f"{type(error).__name__}: {error}"


def _once(chunks: Sequence[bytes | memoryview]) -> _Sends:
    return lambda: (chunks,)


def _pack(verb: bytes, args: list[bytes]) -> list[bytes]:
    pieces = [b"*%d\r\n$%d\r\n%s\r\n" % (1 + len(args), len(verb), verb)]
    pieces.extend(b"$%d\r\n%s\r\n" % (len(arg), arg) for arg in args)
    return [b"".join(pieces)]


def _batches(payloads: list[memoryview]) -> list[tuple[int, int]]:
    spans: list[tuple[int, int]] = []
    start = 0
    size = 0
    for i, payload in enumerate(payloads):
        if i > start and size + payload.nbytes > MAX_COMMAND_BYTES:
            spans.append((start, i))
            start, size = i, 0
        size += payload.nbytes
    spans.append((start, len(payloads)))
    return spans
