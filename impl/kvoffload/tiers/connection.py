"""One connection to a Valkey/Redis server, every step of it under the calling operation's
deadline, its replies read by a parser that reads no more than the call can accept.

Why not the client library's connection and parser: its timeout bounds each socket
operation, not a call (a link that passes a few bytes now and then holds a call for ever);
its parser reads whatever length a reply announces (a value of 64 MiB planted under a key
is read whole, into memory, by a call that can accept 4 KiB) and raises whatever the bytes
provoke (a deeply nested array: RecursionError; ``$abc``: ValueError). Here:

- a :class:`Deadline` is fixed when an operation starts; connecting, the TLS handshake,
  every send and every receive wait only for what is left of it;
- every command the stores send replies with one scalar (``+OK``, ``:1``, a bulk string,
  an error) or, for ``MGET``, one flat array of bulk strings of a known count: nothing
  nests, so nothing is parsed recursively; any other shape is a :class:`ProtocolError`;
- a bulk string's announced length is checked against the most the call can accept before
  one byte of it is read: over it, the reader stops (:class:`Oversized`) and the caller
  drops the connection, unread;
- integers and lengths are at most 19 digits; a line longer than ``MAX_LINE`` is refused.

RESP3's null (``_``) and blob error (``!``) are read too, so a proxy that speaks RESP3 works.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import ssl
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .address import ServerAddress

# Longest line accepted: a simple string, an error's text, a length or an integer.
MAX_LINE = 4096
_BUFFER_BYTES = 256 * 1024
_INTEGER = re.compile(rb"-?[0-9]{1,19}")
# Buffers one sendmsg takes (the kernel's limit, 1024 on Linux).
IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
# A TLS socket has no sendmsg: it sends pieces of at most this many bytes, each under the
# deadline (its sendall would wait per piece, not per call).
_TLS_PIECE = 256 * 1024


class ProtocolError(Exception):
    """A reply that no command sent here can have: the connection is out of step."""


class Refused(Exception):
    """The server refused the connection's AUTH or SELECT."""


class ServerClosed(ConnectionError):
    """The server (or whatever is at the address) closed the connection."""


class Deadline:
    """The moment an operation must be over by: every wait gets only what is left."""

    __slots__ = ("at",)

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        left = self.at - time.monotonic()
        if left <= 0:
            raise TimeoutError("the call's deadline passed")
        return left


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """An error the server answered (the stream stays in step: it was read whole)."""

    message: str

    @property
    def kind(self) -> str:
        return self.message.split(" ", 1)[0]


@dataclass(frozen=True, slots=True)
class Oversized:
    """A bulk string longer than the call accepts, left unread: drop the connection."""

    length: int


Reply = bytes | int | None | ErrorReply


def tls_context(address: ServerAddress) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=address.tls_ca_file)
    if not address.tls_verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


class Link:
    """A connected socket and its receive buffer."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pid = os.getpid()  # a forked child must never shut its parent's connection
        self.received = 0  # bytes read so far (a call is sent again only if it read none)
        self._gathered = not isinstance(sock, ssl.SSLSocket)
        self._buffer = bytearray(_BUFFER_BYTES)
        self._view = memoryview(self._buffer)
        self._start = 0
        self._end = 0

    @classmethod
    def open(
        cls, address: ServerAddress, deadline: Deadline, context: ssl.SSLContext | None
    ) -> Link:
        if address.path is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(deadline.left())
                sock.connect(address.path)
            except BaseException:
                sock.close()
                raise
            return cls(sock)
        if address.host is None:
            raise ProtocolError("an address with neither a host nor a unix socket path")
        sock = _connect(address.host, address.port, deadline)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if context is not None:
                sock = context.wrap_socket(
                    sock, server_hostname=address.host, do_handshake_on_connect=False
                )
                sock.settimeout(deadline.left())
                sock.do_handshake()  # one deadline for the whole handshake (CPython's)
        except BaseException:
            sock.close()
            raise
        return cls(sock)

    def authenticate(self, address: ServerAddress, deadline: Deadline) -> None:
        """AUTH with the address's credentials and SELECT its database (pipelined, one
        round trip; nothing sent when neither is needed)."""
        setup: list[bytes] = []
        if address.password is not None:
            credentials = [address.password.encode()]
            if address.username:
                credentials.insert(0, address.username.encode())
            setup.append(pack(b"AUTH", credentials))
        if address.db:
            setup.append(pack(b"SELECT", [b"%d" % address.db]))
        if not setup:
            return
        self.send([b"".join(setup)], deadline)
        for command in setup:
            reply = self.reply(deadline)
            if isinstance(reply, ErrorReply):
                verb = command.split(b"\r\n")[2].decode()
                raise Refused(f"{verb} refused: {reply.message}")
            if reply != b"OK":
                raise ProtocolError(f"{reply!r:.40} where OK was expected")

    def buffered(self) -> bool:
        """Whether reply bytes are already here, read from the socket (or held by TLS): a
        wait for the socket to be readable would not see them."""
        if self._end > self._start:
            return True
        return isinstance(self.sock, ssl.SSLSocket) and self.sock.pending() > 0

    def shutdown(self) -> None:
        """End the connection from any thread: a call blocked on it returns at once. The
        socket itself is closed by its user (never under another thread's feet)."""
        # The plain socket's shutdown, also under TLS: no TLS alert is written from here.
        with contextlib.suppress(OSError):
            socket.socket.shutdown(self.sock, socket.SHUT_RDWR)

    def close(self) -> None:
        self.sock.close()

    # -- sending -----------------------------------------------------------------------------

    def send(self, chunks: Sequence[bytes | memoryview], deadline: Deadline) -> None:
        views = [memoryview(chunk) for chunk in chunks]
        if self._gathered:
            send_gathered(self.sock, views, deadline)
            return
        for view in views:
            flat = view.cast("B") if view.format != "B" else view
            sent = 0
            while sent < flat.nbytes:
                self.sock.settimeout(deadline.left())
                sent += self.sock.send(flat[sent : sent + _TLS_PIECE])

    # -- reading -----------------------------------------------------------------------------

    def reply(self, deadline: Deadline, limit: int = MAX_LINE) -> Reply:
        """One scalar reply: a simple string, an integer, a bulk string of at most ``limit``
        bytes, a null or an error. An array, or a longer bulk, is a protocol error."""
        kind, line = self._line(deadline)
        if kind == 0x2B:  # +
            return line
        if kind == 0x3A:  # :
            return _integer(line)
        if kind == 0x24:  # $
            found = self.bulk_after(_integer(line), deadline, limit, None)
            if isinstance(found, Oversized):
                raise ProtocolError(f"a reply of {found.length} bytes, at most {limit} expected")
            return None if found is None else bytes(found)
        return self._other(kind, line, deadline)

    def array_header(self, deadline: Deadline) -> int | ErrorReply:
        """The count of an array reply (``*N``), or the error answered instead."""
        kind, line = self._line(deadline)
        if kind == 0x2A:  # *
            count = _integer(line)
            if count < 0:
                raise ProtocolError(f"an array of {count} elements")
            return count
        found = self._other(kind, line, deadline)
        if isinstance(found, ErrorReply):
            return found
        raise ProtocolError(f"{_shown(kind, line)} where an array was expected")

    def bulk(
        self, deadline: Deadline, limit: int, into: bytearray | None
    ) -> memoryview | Oversized | None:
        """One element of a flat array: a bulk string of at most ``limit`` bytes (read into
        ``into`` when it is large enough, else into a new buffer of its own), a null, or
        :class:`Oversized` (nothing of it read)."""
        kind, line = self._line(deadline)
        if kind == 0x24:  # $
            return self.bulk_after(_integer(line), deadline, limit, into)
        if kind == 0x5F and not line:  # _ (RESP3 null)
            return None
        raise ProtocolError(f"{_shown(kind, line)} where a bulk string was expected")

    def value_reply(self, deadline: Deadline, limit: int) -> memoryview | Oversized | Reply:
        """A command's reply that should be a bulk string of at most ``limit`` bytes (read
        into a new buffer), a null or an error (:class:`Oversized`: nothing of it read)."""
        kind, line = self._line(deadline)
        if kind == 0x24:  # $
            return self.bulk_after(_integer(line), deadline, limit, None)
        return self._other(kind, line, deadline)

    def bulk_after(
        self, length: int, deadline: Deadline, limit: int, into: bytearray | None
    ) -> memoryview | Oversized | None:
        if length == -1:
            return None
        if length < 0:
            raise ProtocolError(f"a bulk string of {length} bytes")
        if length > limit:
            return Oversized(length)
        target = memoryview(into)[:length] if into is not None and len(into) >= length else None
        if target is None:
            target = memoryview(bytearray(length))
        got = min(length, self._end - self._start)
        target[:got] = self._view[self._start : self._start + got]
        self._start += got
        while got < length:  # the rest straight into the target: no second copy
            self.sock.settimeout(deadline.left())
            count = self.sock.recv_into(target[got:])
            if not count:
                raise ServerClosed("the server closed the connection mid-reply")
            got += count
            self.received += count
        end = self._take(2, deadline)
        if end != b"\r\n":
            raise ProtocolError("a bulk string longer than its announced length")
        return target

    def _other(self, kind: int, line: bytes, deadline: Deadline) -> Reply:
        if kind == 0x2D:  # -
            return ErrorReply(_text(line))
        if kind == 0x5F and not line:  # _
            return None
        if kind == 0x21:  # ! (RESP3 blob error)
            found = self.bulk_after(_integer(line), deadline, MAX_LINE, None)
            if not isinstance(found, memoryview):
                raise ProtocolError("an empty or oversized blob error")
            return ErrorReply(_text(bytes(found)))
        raise ProtocolError(f"{_shown(kind, line)}: no command sent here replies that")

    def _line(self, deadline: Deadline) -> tuple[int, bytes]:
        """The next line's type byte and the rest of it (without CRLF)."""
        while True:
            at = self._buffer.find(b"\r\n", self._start, self._end)
            if at >= 0:
                if at == self._start:
                    raise ProtocolError("an empty line where a reply was expected")
                kind = self._buffer[self._start]
                line = bytes(self._view[self._start + 1 : at])
                self._start = at + 2
                return kind, line
            if self._end - self._start > MAX_LINE:
                raise ProtocolError(f"a reply line longer than {MAX_LINE} bytes")
            self._fill(deadline)

    def _take(self, count: int, deadline: Deadline) -> bytes:
        while self._end - self._start < count:
            self._fill(deadline)
        taken = bytes(self._view[self._start : self._start + count])
        self._start += count
        return taken

    def _fill(self, deadline: Deadline) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buffer):  # no room after the data: move it to the front
            kept = self._end - self._start
            self._view[:kept] = self._view[self._start : self._end]
            self._start, self._end = 0, kept
        self.sock.settimeout(deadline.left())
        count = self.sock.recv_into(self._view[self._end :])
        if not count:
            raise ServerClosed("the server closed the connection")
        self._end += count
        self.received += count


def _connect(host: str, port: int, deadline: Deadline) -> socket.socket:
    """A TCP connection to ``host``, its name looked up and every address tried within
    ``deadline`` (``socket.create_connection`` would wait for the resolver unbounded)."""
    last: OSError = OSError(f"{host} has no address")
    for family, kind, protocol, _, target in _resolve(host, port, deadline):
        sock = socket.socket(family, kind, protocol)
        try:
            sock.settimeout(deadline.left())
            sock.connect(target)
        except OSError as error:  # TimeoutError too: the deadline passed
            sock.close()
            last = error
            if isinstance(error, TimeoutError):
                raise
            continue
        except BaseException:
            sock.close()
            raise
        return sock
    raise last


_AddrInfo = Sequence[tuple[socket.AddressFamily, socket.SocketKind, int, str, tuple[Any, ...]]]


def _resolve(host: str, port: int, deadline: Deadline) -> _AddrInfo:
    """``getaddrinfo`` under the deadline. An address literal needs no resolver; a name is
    looked up on a daemon thread (the C resolver has no timeout of ours): when the deadline
    passes first, the call fails and the lookup is left to end on its own."""
    numeric = socket.AI_NUMERICHOST | socket.AI_NUMERICSERV
    try:
        return socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM, 0, numeric)
    except socket.gaierror:
        pass  # a name, not a literal
    found: list[_AddrInfo] = []
    failed: list[OSError] = []
    done = threading.Event()

    def look_up() -> None:
        try:
            found.append(socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM))
        except OSError as error:
            failed.append(error)
        finally:
            done.set()

    threading.Thread(target=look_up, name="kvoffload-resolve", daemon=True).start()
    if not done.wait(deadline.left()):
        raise TimeoutError(f"looking up {host} took longer than the call's deadline")
    if failed:
        raise failed[0]
    return found[0]


class HeldLink:
    """A store's connection, held apart from the store: the store's finalizer closes the
    socket of a store dropped without ``close()`` without keeping the store alive."""

    __slots__ = ("link", "lock")

    def __init__(self) -> None:
        self.link: Link | None = None
        self.lock = threading.Lock()  # between the caller's thread and close()'s shutdown

    def set(self, link: Link) -> None:
        with self.lock:
            self.link = link

    def close(self) -> None:
        with self.lock:
            link, self.link = self.link, None
            if link is not None:
                link.close()

    def shutdown(self) -> None:
        with self.lock:
            if self.link is not None and self.link.pid == os.getpid():
                self.link.shutdown()


def send_gathered(
    sock: socket.socket, views: list[memoryview], deadline: Deadline | None = None
) -> None:
    """``sendall`` of the concatenation of ``views``, without concatenating them, each
    ``sendmsg`` waiting only for what is left of ``deadline``.

    One ``sendmsg`` takes up to ``IOV_MAX`` buffers: a put of 128 blocks is a few system
    calls, not 257 (and, with ``TCP_NODELAY``, not as many segments for the server to wake
    up for), the payloads still sent from the caller's memory.
    """
    first = 0
    while first < len(views):
        if deadline is not None:
            sock.settimeout(deadline.left())
        sent = sock.sendmsg(views[first : first + IOV_MAX])
        # A short send stops anywhere: drop the buffers sent whole, cut the one sent in part.
        while first < len(views) and sent >= views[first].nbytes:
            sent -= views[first].nbytes
            first += 1
        if sent:
            views[first] = views[first][sent:]


def _integer(text: bytes) -> int:
    if _INTEGER.fullmatch(text) is None:
        raise ProtocolError(f"not an integer: {text[:40]!r}")
    return int(text)


def _text(raw: bytes) -> str:
    return raw[:300].decode("utf-8", "replace")


def _shown(kind: int, line: bytes) -> str:
    return repr(bytes([kind]) + line[:40])


def pack(verb: bytes, args: Sequence[bytes]) -> bytes:
    """A command in RESP: an array of bulk strings."""
    pieces = [b"*%d\r\n$%d\r\n%s\r\n" % (1 + len(args), len(verb), verb)]
    pieces.extend(b"$%d\r\n%s\r\n" % (len(arg), arg) for arg in args)
    return b"".join(pieces)
