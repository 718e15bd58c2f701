"""ValkeyStore: the remote block store on a Valkey or Redis server.

One connection, one batch per round trip: ``get`` is one ``MGET``, ``put`` one ``MSET`` per
~4 MiB of values (all sent before any reply is read), ``contains`` and ``delete`` pipeline
one ``EXISTS`` / ``UNLINK`` per key. The store speaks the protocol itself
(:mod:`kvoffload.tiers.connection`): a value goes out as its small header followed by the
caller's own buffer (a put copies no payload byte), many buffers to one ``sendmsg``; a reply
is read straight into the memory it ends in, never more of it than the call can accept.

Every call has one deadline, ``timeout_s`` from its start: connecting, authenticating, each
send and each receive wait only for what is left of it. Failures never escape (see
:mod:`kvoffload.tiers.store`): a timeout, a refused or reset connection, an error reply or a
malformed one makes the call's keys misses (or writes not stored), is counted, and (but for
an error reply, read whole) drops the connection, so that a reply that comes late is never
read as the answer to a later command; any other exception on the connection (a
``KeyboardInterrupt``, a signal handler's) drops it too, and propagates. After a failure the
server is marked down for ``retry_after_s``: calls return at once until then. A connection
found dead on its first use by a call (the server restarted while the store was idle) is not
a failure: the call is sent once more on a new connection, within the same deadline, and
counted in ``retries``.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from kvoffload_spec.errors import InvalidArgumentError

from .acl import COMMANDS, acl_rule
from .address import ServerAddress, redact
from .cluster_map import ClusterModeError
from .connection import (
    Deadline,
    ErrorReply,
    HeldLink,
    Link,
    Oversized,
    ProtocolError,
    Refused,
    Reply,
    ServerClosed,
    pack,
    tls_context,
)
from .secret import resolve_secret
from .store import Payload, RemoteStats, StoreClosedError, WritableBuffer
from .values import (
    MAX_KEY_BYTES,
    MAX_VALUE_BYTES,
    Namespace,
    PlainFormat,
    Rejection,
    ValueFormat,
    encode_key,
    put_payloads,
    writable_buffers,
)
from .values import value_format as make_format

T = TypeVar("T")
# A command as the successive sends that make it (called again to send it again).
_Sends = Callable[[], Iterable[Sequence[bytes | memoryview]]]
_Read = Callable[[Link, Deadline], T]

# One MSET carries at most this many value bytes (a larger value goes alone). The server holds
# a whole command before it runs it, and frees the values it replaces only then: one MSET of a
# whole batch has the server hold the batch twice over, in memory its allocator must map and
# fault in again and again; commands of a few MiB each let it reuse at once the memory of the
# values it has just replaced. Measured against one MSET per 64 MiB: a put of 2 MiB x 4 or x 16
# cost the server 10-20% less CPU (page faults: ~10-50 per put instead of 250-1,800).
MAX_COMMAND_BYTES = 4 * 1024 * 1024
# A put hands its bytes to the socket in sends of about this many payload bytes: large enough
# that a send is not a wake-up of the server per small value, small enough that the next
# values are hashed while the server reads these (and that a value hashed is still in the
# cache when the kernel copies it). 256 KiB to 4 MiB measured alike within the noise here.
_SEND_EVERY = 1024 * 1024
# The namespace's description, after the namespace's key prefix (see _describe_namespace).
DESCRIPTION_NAME = b"#description"
# Below this, pieces of a command are joined into one buffer (one send, not many).
_JOIN_BELOW = 16 * 1024
# The largest payload a get reads by default (a KV block is 0.5-2.5 MiB in practice).
DEFAULT_MAX_VALUE_BYTES = 64 * 1024 * 1024
# timeout_s beyond this is a configuration mistake, not a deadline.
MAX_TIMEOUT_S = 3600.0
# Error replies after which the server is left alone for retry_after_s: it says it cannot
# serve now (loading its data, its primary down, a script running).
_BACK_OFF = {"LOADING", "MASTERDOWN", "BUSY", "TRYAGAIN"}
# Error replies only a cluster node sends: a store made with cluster=False is misconfigured.
_CLUSTER_REPLIES = {"MOVED", "ASK", "CROSSSLOT", "CLUSTERDOWN"}


class ValkeyStore:
    """Blocks on a Valkey/Redis server at ``url``, under ``namespace``.

    ``url``: ``valkey://`` or ``redis://[user:password@]host:port/db``, ``valkeys://`` /
    ``rediss://`` for TLS, ``unix:///path``; its options: :mod:`kvoffload.tiers.address`.
    ``namespace``: what the blocks' bytes depend on (a :class:`Namespace`, or the str or
    mapping to make one from). ``secret``: the tenant's secret (at least 16 bytes; without
    one, ``$KVOFFLOAD_REMOTE_SECRET`` if set): values are then sealed and the server keys
    derived from it (:class:`~kvoffload.tiers.values.SealedFormat`), so that nobody without
    it can forge a value this store accepts or tell which prefixes it holds.
    ``timeout_s``: the most one call may take, all of it (connect, sends, receives).
    ``retry_after_s``: how long the server stays marked down after a failure.
    ``max_value_bytes``: the largest payload ``get`` reads (a larger value is refused
    unread; ``get_into`` reads at most its buffers' sizes) and ``put`` accepts.
    ``tls_ca_file``, ``tls_verify``: TLS options (over the URL's own).
    ``cluster``: the URL names nodes of a Valkey Cluster (one or several, comma-separated:
    ``redis://host:port,host:port``); see :mod:`kvoffload.tiers.cluster_store`. A store made
    without it against a cluster node raises :class:`ClusterModeError` at its first call
    the node answers with a redirect (``MOVED``/``CROSSSLOT``), and one made with it against
    a server without cluster support at its first call.

    Nothing connects here: a server down at start is found, counted and survived by the
    first call. Thread-safe: calls from several threads take turns on the one connection;
    ``close()`` from another thread ends a call in flight at once.
    """

    def __new__(cls, *args: Any, cluster: bool = False, **kwargs: Any) -> ValkeyStore:
        if cluster is True and cls is ValkeyStore:
            from .cluster_store import ClusterStore  # it builds on this module

            return super().__new__(ClusterStore)
        return super().__new__(cls)

    def __init__(
        self,
        url: str,
        *,
        namespace: str | Mapping[str, Any] | Namespace,
        cluster: bool = False,
        secret: bytes | str | None = None,
        timeout_s: float = 0.5,
        retry_after_s: float = 1.0,
        max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
        tls_ca_file: str | None = None,
        tls_verify: bool | None = None,
    ) -> None:
        if not isinstance(cluster, bool):
            raise InvalidArgumentError(f"cluster must be a bool; got {cluster!r}")
        self._cluster_mode = cluster
        for name, value in (("timeout_s", timeout_s), ("retry_after_s", retry_after_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidArgumentError(f"{name} must be a number of seconds")
        if not 0 < timeout_s <= MAX_TIMEOUT_S:
            raise InvalidArgumentError(
                f"timeout_s must be over 0 and at most {MAX_TIMEOUT_S:g} s; got {timeout_s}"
            )
        if not 0 <= retry_after_s <= MAX_TIMEOUT_S:
            raise InvalidArgumentError(
                f"retry_after_s must be 0 to {MAX_TIMEOUT_S:g} s; got {retry_after_s}"
            )
        limit = MAX_VALUE_BYTES - 2 * MAX_KEY_BYTES
        if (
            isinstance(max_value_bytes, bool)
            or not isinstance(max_value_bytes, int)
            or not 0 < max_value_bytes <= limit
        ):
            raise InvalidArgumentError(
                f"max_value_bytes must be an int from 1 to {limit}; got {max_value_bytes!r}"
            )
        self._address = self._parse_address(url, tls_ca_file, tls_verify)
        self._namespace = Namespace.of(namespace)
        self._format = make_format(self._namespace, resolve_secret(secret))
        try:
            self._tls = tls_context(self._address) if self._address.tls else None
        except (OSError, ValueError) as error:  # a CA file that holds no certificate
            raise InvalidArgumentError(
                f"TLS for {self._address.url!r}: {type(error).__name__}: {error}"
            ) from None
        self._timeout_s = float(timeout_s)
        self._retry_after_s = float(retry_after_s)
        self._max_value_bytes = max_value_bytes
        self._held = HeldLink()
        self._finalizer = weakref.finalize(self, self._held.close)
        self._closed = False
        self._down_until = 0.0
        self._io = threading.Lock()
        self._counting = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._last_error: str | None = None
        self._scratch = bytearray()  # where get_into reads a value before checking it
        # A sealed store never describes itself: its server keys hide whose they are.
        self._described = not isinstance(self._format, PlainFormat)

    def _parse_address(
        self, url: str, tls_ca_file: str | None, tls_verify: bool | None
    ) -> ServerAddress:
        return ServerAddress.parse(url, tls_ca_file=tls_ca_file, tls_verify=tls_verify)

    # -- the surface ---------------------------------------------------------------------

    @property
    def namespace(self) -> Namespace:
        return self._namespace

    @property
    def url(self) -> str:
        """The URL, its password replaced by ``***``."""
        return self._address.url

    @property
    def authenticated(self) -> bool:
        """Whether values are sealed with a secret (``False``: the plain format)."""
        return self._format.authenticated

    @property
    def key_prefix(self) -> str:
        """What every server key of this store starts with: ``kvo2:<tenant id hex>:`` with
        a secret, ``kvo1:<namespace fingerprint hex>:`` without (an ACL's key pattern)."""
        return self._format.key_prefix.decode("ascii")

    def get(self, keys: Sequence[Hashable]) -> list[memoryview | None]:
        """The payload stored under each key, or ``None``: read-only views, each into a
        buffer of its own (no copy after the socket's)."""
        encoded = self._keys(keys)
        found: list[memoryview | None] = [None] * len(encoded)
        limits = [self._format.header_bytes(key) + self._max_value_bytes for key in encoded]

        def accept(index: int, payload: memoryview) -> bool:
            found[index] = payload.toreadonly()
            return True

        self._read(encoded, limits, None, accept)
        return found

    def get_into(self, keys: Sequence[Hashable], buffers: Sequence[WritableBuffer]) -> list[bool]:
        """Copy each key's payload into its buffer, only if it is valid and exactly the
        buffer's size; ``False`` leaves that buffer untouched. No more than each buffer's
        size plus the value's header is read from the server."""
        encoded = self._keys(keys)
        targets = writable_buffers(buffers, len(encoded))
        done = [False] * len(encoded)
        limits = [
            self._format.header_bytes(key) + target.nbytes
            for key, target in zip(encoded, targets, strict=True)
        ]

        def accept(index: int, payload: memoryview) -> bool:
            target = targets[index]
            if payload.nbytes != target.nbytes:
                return False  # valid, another size: the namespace did not describe the block
            target[:] = payload
            done[index] = True
            return True

        copied = self._read(encoded, limits, max(limits, default=0), accept)
        self._count(bytes_copied=copied)
        return done

    def put(self, keys: Sequence[Hashable], values: Sequence[Payload]) -> list[bool]:
        """Store each value under its key; ``True`` where the server acknowledged it.

        The values are sent from the caller's buffers as they are when the call runs: do not
        change them until it returns.
        """
        encoded, payloads = self._checked_put(keys, values)
        if not encoded:
            self._count(put_calls=1)
            return []
        spans = _batches(payloads)
        names = [self._format.server_key(key) for key in encoded]

        def read(link: Link, deadline: Deadline) -> list[bool]:
            replies = [link.reply(deadline) for _ in spans]
            self._error_replies(replies)
            return [_acknowledged(reply) for reply in replies]

        deadline = Deadline(self._timeout_s)
        acknowledged = self._call(
            lambda: self._mset_sends(encoded, names, payloads, spans), read, deadline
        )
        stored: list[bool] = []
        sent = 0
        for (start, stop), ok in zip(spans, acknowledged or [False] * len(spans), strict=True):
            stored.extend([ok] * (stop - start))
            if ok:
                sent += sum(payload.nbytes for payload in payloads[start:stop])
        good = sum(stored)
        # Within the put's own deadline, and only with half of it left: a put never waits
        # for the description; a later put writes it.
        if good and not self._described and deadline.at - time.monotonic() > self._timeout_s / 2:
            self._describe_namespace(deadline)
        joined = sum(payload.nbytes for payload in payloads if payload.nbytes < _JOIN_BELOW)
        self._count(
            put_calls=1,
            keys_offered=len(encoded),
            keys_stored=good,
            keys_not_stored=len(stored) - good,
            bytes_sent=sent,
            bytes_copied=joined,
        )
        return stored

    def _checked_put(
        self, keys: Sequence[Hashable], values: Sequence[Payload]
    ) -> tuple[list[bytes], list[memoryview]]:
        encoded = self._keys(keys)
        payloads = put_payloads(values, len(encoded))
        for i, payload in enumerate(payloads):
            if payload.nbytes > self._max_value_bytes:
                raise InvalidArgumentError(
                    f"the value for key #{i} holds {payload.nbytes} bytes, over this store's "
                    f"max_value_bytes ({self._max_value_bytes}): no get would read it back"
                )
        return encoded, payloads

    def _describe_namespace(self, deadline: Deadline) -> None:
        """Write the namespace's description under ``kvo1:<fingerprint>:#description``, once
        per store, so that ``kvoffload remote stats`` can say whose blocks these are. Only
        a hint for people: nothing reads it back. It is under the namespace's prefix (an ACL
        on the prefix covers it, a clear of the namespace takes it) and no block's key is
        it: an encoded key starts with its type's letter, never ``#``. Sent as an MSET so
        that the commands the store needs stay the ones the ACL recipe grants."""
        name = self._format.key_prefix + DESCRIPTION_NAME
        text = self._namespace.description.encode("utf-8", "surrogatepass")

        def read(link: Link, deadline: Deadline) -> bool:
            reply = link.reply(deadline)
            self._error_replies([reply])
            return _acknowledged(reply)

        self._described = bool(self._call(_once(pack(b"MSET", [name, text])), read, deadline))

    def contains(self, keys: Sequence[Hashable]) -> list[bool]:
        """Whether the server has a value under each key (not checked: a hint)."""
        found = self._per_key(b"EXISTS", self._keys(keys))
        self._count(contains_calls=1)
        return found

    def delete(self, keys: Sequence[Hashable]) -> list[bool]:
        """Remove each key's value; ``True`` where one was there and is gone now."""
        removed = self._per_key(b"UNLINK", self._keys(keys))
        self._count(delete_calls=1, keys_deleted=sum(removed))
        return removed

    def ping(self) -> bool:
        """Whether the server answers now (a failure is counted like any other)."""
        self._check_open()

        def read(link: Link, deadline: Deadline) -> bool:
            reply = link.reply(deadline)
            self._error_replies([reply])
            return reply == b"PONG"

        return bool(self._call(_once(pack(b"PING", [])), read, Deadline(self._timeout_s)))

    def check_mode(self) -> bool:
        """Contact the server once and raise :class:`ClusterModeError` if it is not what the
        store was told (a cluster node for a store made without ``cluster=True``, or the
        other way round), so that a misconfiguration stops an engine's start rather than
        failing every call. Whether the server answered (one that does not is no error:
        the store survives it, counted, and the mode is found at its first answer).
        """
        answers = self.ping()
        if answers:
            # A cluster node answers PING like any server; one MGET of keys in several slots
            # is refused (CROSSSLOT) by every node, wherever those slots are.
            self.get([("kvoffload cluster mode?", n) for n in range(4)])
        return answers

    def stats(self) -> RemoteStats:
        with self._counting:
            down = time.monotonic() < self._down_until
            return RemoteStats(**self._counts, server_down=down, last_error=self._last_error)

    def close(self) -> None:
        """Drop the connection; further calls raise :class:`StoreClosedError`. Called from
        another thread, it does not wait for a call in flight: that call's connection is
        shut down, so it ends at once (its keys unavailable)."""
        self._closed = True
        self._held.shutdown()
        if self._io.acquire(blocking=False):
            try:
                self._held.close()
            finally:
                self._io.release()
        # else the call in flight closes the connection as it ends

    def __enter__(self) -> ValkeyStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        sealed = ", sealed" if self.authenticated else ""
        return (
            f"ValkeyStore({self.url!r}, namespace={self._namespace.description!r}, "
            f"timeout_s={self._timeout_s}{sealed})"
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
        return [encode_key(key) for key in keys]

    # -- commands ------------------------------------------------------------------------

    def _read(
        self,
        encoded: list[bytes],
        limits: list[int],
        scratch: int | None,
        accept: Callable[[int, memoryview], bool],
    ) -> int:
        """``MGET`` the keys; each valid payload goes to ``accept(index, payload)`` (a view
        valid only during the call: into ``scratch`` bytes reused, when given), which says
        whether it was taken. Counts everything once, at the end. Returns the bytes taken.

        A value longer than its key's limit is refused unread: the connection is dropped (its
        bytes are never read) and the keys after it are asked again on a new connection,
        within the same deadline.
        """
        counts: Counter[str] = Counter(get_calls=1, keys_requested=len(encoded))
        names = [self._format.server_key(key) for key in encoded]
        deadline = Deadline(self._timeout_s)
        if scratch is not None and len(self._scratch) < scratch:
            self._scratch = bytearray(scratch)
        into = None if scratch is None else self._scratch
        position = [0]  # the next key to ask for, moved on by each key's answer
        taken = 0

        def read(link: Link, deadline: Deadline) -> None:
            nonlocal taken
            count = link.array_header(deadline)
            if isinstance(count, ErrorReply):
                self._error_replies([count])
                raise _Answered
            if count != len(encoded) - position[0]:
                raise ProtocolError(f"MGET of {len(encoded) - position[0]} keys answered {count}")
            for index in range(position[0], len(encoded)):
                value = link.bulk(deadline, limits[index], into)
                position[0] = index + 1
                if isinstance(value, Oversized):
                    counts["rejected"] += 1
                    counts["rejected_length"] += 1
                    self._held.close()  # its bytes stay unread: the connection goes with them
                    return
                taken += checked_value(self._format, encoded[index], value, index, accept, counts)

        try:
            while position[0] < len(encoded):
                first = position[0]
                sends = _once(pack(b"MGET", names[first:]))
                if self._call(sends, read, deadline, answered=True) is _FAILED:
                    break
        finally:
            counts["unavailable"] += len(encoded) - position[0]
            self._count(**counts)
        return taken

    def _per_key(self, verb: bytes, encoded: list[bytes]) -> list[bool]:
        if not encoded:
            return []
        command = b"".join(pack(verb, [self._format.server_key(key)]) for key in encoded)

        def read(link: Link, deadline: Deadline) -> list[bool]:
            replies = [link.reply(deadline) for _ in encoded]
            self._error_replies(replies)
            for reply in replies:
                if not isinstance(reply, (int, ErrorReply)):
                    raise ProtocolError(f"{verb.decode()} answered {reply!r:.40}")
            return [reply == 1 for reply in replies]

        found = self._call(_once(command), read, Deadline(self._timeout_s))
        return [False] * len(encoded) if found is None else found

    def _mset_sends(
        self,
        keys: list[bytes],
        names: list[bytes],
        payloads: list[memoryview],
        spans: list[tuple[int, int]],
    ) -> Iterator[list[bytes | memoryview]]:
        """One ``MSET`` per span, its values going out as header, then the caller's buffer
        (no copy), handed to the socket every ``_SEND_EVERY`` payload bytes.

        A header holds the payload's checksum or tag, so it is made just before its payload
        is sent: while the server reads what was handed over, the next headers are made.
        Made all first, the hashing would be time the server waits (several percent of a put).
        """
        header = self._format.header
        for start, stop in spans:
            pieces = [b"*%d\r\n$4\r\nMSET\r\n" % (1 + 2 * (stop - start))]
            chunks: list[bytes | memoryview] = []
            pending = 0
            for key, name, payload in zip(
                keys[start:stop], names[start:stop], payloads[start:stop], strict=True
            ):
                head = header(key, payload)
                size = len(head) + payload.nbytes
                if payload.nbytes < _JOIN_BELOW:
                    pieces.append(
                        b"$%d\r\n%s\r\n$%d\r\n%s%s\r\n" % (len(name), name, size, head, payload)
                    )
                    continue
                pieces.append(b"$%d\r\n%s\r\n$%d\r\n%s" % (len(name), name, size, head))
                chunks.append(b"".join(pieces))
                chunks.append(payload)
                pieces = [b"\r\n"]
                pending += payload.nbytes
                if pending >= _SEND_EVERY:
                    yield chunks
                    chunks, pending = [], 0
            chunks.append(b"".join(pieces))
            yield chunks

    # -- the connection ------------------------------------------------------------------

    def _call(
        self, sends: _Sends, read: _Read[T], deadline: Deadline, *, answered: bool = False
    ) -> T | None:
        """Send what ``sends()`` yields, then ``read`` the replies, before ``deadline``;
        ``None`` on any failure (counted; with ``answered``, an error reply too, as
        ``_FAILED``, told apart from a ``read`` that returns ``None``).

        A connection that served earlier calls may have died since (the server restarted,
        an idle connection was closed): the first use finds it reset or closed before any
        byte of a reply came. That is no news about the server now, so the call is sent once
        more on a new connection, and only what that second attempt meets counts as the
        call's failure. Every command sent here is idempotent (``MSET`` of the same values,
        ``MGET``, ``EXISTS``, ``UNLINK``, ``PING``), and the second attempt reads only its
        own connection's replies. A timeout is never sent again (a stalled server would cost
        two), nor a call on a connection opened by this very call.
        """
        failed: Any = _FAILED if answered else None
        with self._io:
            try:
                self._check_open()
                if time.monotonic() < self._down_until:
                    self._count(skipped=1)
                    return failed  # type: ignore[no-any-return]
                link, opened = self._connected(deadline)
                received_before = link.received
                try:
                    return self._attempt(link, sends, read, deadline)
                except (ConnectionResetError, BrokenPipeError, ServerClosed) as error:
                    if opened or link.received != received_before or self._closed:
                        raise
                    self._held.close()
                    with self._counting:
                        self._counts["retries"] += 1
                        self._last_error = f"retried: {_describe(error)}"
                    link, _ = self._connected(deadline)
                    return self._attempt(link, sends, read, deadline)
            except _Answered:
                return failed  # type: ignore[no-any-return]
            except Refused as error:
                self._fail("server_errors", error)
            except ProtocolError as error:
                self._fail("protocol_errors", error)
            except TimeoutError as error:
                self._fail("timeouts", error)
            except OSError as error:  # refused, reset, closed; TLS errors too
                self._fail("connection_errors", error)
            except BaseException:
                # Not the server's doing (an interrupt, a signal handler's exception, a bug):
                # a command may be half sent, so the connection goes; the exception is the
                # caller's.
                self._held.close()
                raise
            finally:
                if self._closed:
                    self._held.close()
            return failed  # type: ignore[no-any-return]

    @staticmethod
    def _attempt(link: Link, sends: _Sends, read: _Read[T], deadline: Deadline) -> T:
        for chunks in sends():
            link.send(chunks, deadline)
        return read(link, deadline)

    def _connected(self, deadline: Deadline) -> tuple[Link, bool]:
        """The connection, and whether it was opened now (and authenticated, and its
        database selected: pipelined, before the call's command)."""
        link = self._held.link
        if link is not None and link.pid == os.getpid():
            return link, False
        if link is not None:  # forked: the parent's socket is not ours to use, nor to shut
            self._held.close()
        link = Link.open(self._address, deadline, self._tls)
        self._held.set(link)
        if self._closed:  # close() came while this call connected: it found nothing to shut
            raise ServerClosed("the store was closed during the call")
        self._count(connects=1)
        link.authenticate(self._address, deadline)
        return link, True

    def _error_replies(self, replies: Sequence[Reply]) -> None:
        """Count the call's error replies as one failure (the stream is in step: the
        connection stays); after one that says the server cannot serve now, back off."""
        errors = [reply for reply in replies if isinstance(reply, ErrorReply)]
        if not errors:
            return
        redirected = [error for error in errors if error.kind in _CLUSTER_REPLIES]
        if redirected:
            # A cluster node: every call would fail on MOVED. No command of its own is
            # needed to find out (an ACL user may send none): the first call's replies say.
            raise ClusterModeError(
                f"{self._address.url} is a cluster node ({redirected[0].message}): make the "
                "store with cluster=True"
            )
        if any(error.kind in _BACK_OFF for error in errors):
            self._down_until = time.monotonic() + self._retry_after_s
        self._note_failure("server_errors", f"{errors[0].kind}: {errors[0].message}")

    def _fail(self, counter: str, error: BaseException) -> None:
        self._held.close()
        self._down_until = time.monotonic() + self._retry_after_s
        self._note_failure(counter, _describe(error))

    def _note_failure(self, counter: str, description: str) -> None:
        with self._counting:
            self._counts["failures"] += 1
            self._counts[counter] += 1
            self._last_error = f"{counter}: {description}"

    def _count(self, **deltas: int) -> None:
        with self._counting:
            self._counts.update(deltas)


def checked_value(
    value_format: ValueFormat,
    encoded_key: bytes,
    value: memoryview | bytes | None,
    index: int,
    accept: Callable[[int, memoryview], bool],
    counts: Counter[str],
) -> int:
    """Check one value read under ``encoded_key`` (None: a miss), hand its payload to
    ``accept`` if it is this key's, count what it was; the payload bytes taken."""
    if value is None:
        counts["misses"] += 1
        return 0
    payload = value_format.payload_of(encoded_key, value)
    if isinstance(payload, Rejection):
        counts["rejected"] += 1
        counts[f"rejected_{payload.value}"] += 1
        return 0
    if accept(index, payload):
        counts["hits"] += 1
        taken: int = payload.nbytes
        counts["bytes_received"] += taken
        return taken
    counts["rejected"] += 1  # a payload of the wrong size for its buffer
    counts["rejected_length"] += 1
    return 0


class _Answered(Exception):
    """An error reply answered the whole command (counted already; the stream in step)."""


_FAILED: Any = object()


def _acknowledged(reply: Reply) -> bool:
    if isinstance(reply, ErrorReply):
        return False
    if reply != b"OK":
        raise ProtocolError(f"MSET answered {reply!r:.40}")
    return True


def _describe(error: BaseException | str) -> str:
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return text[:300]


def _once(command: bytes) -> _Sends:
    return lambda: ((command,),)


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


__all__ = [
    "COMMANDS",
    "DEFAULT_MAX_VALUE_BYTES",
    "ClusterModeError",
    "ValkeyStore",
    "acl_rule",
    "redact",
]
