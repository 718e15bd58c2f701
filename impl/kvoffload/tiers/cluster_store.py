"""The remote store on a Valkey Cluster: ``ValkeyStore(url, namespace=..., cluster=True)``.

The values, keys, limits and counters are the single-server store's
(:mod:`kvoffload.tiers.valkey_store`); what differs is where each command goes:

- the slot map is read with ``CLUSTER NODES`` (:mod:`kvoffload.tiers.cluster_map`) from the
  URL's seed nodes or any node learned since, at the first call and again after a node
  failed or answered ``MOVED`` (at most every ``_REFRESH_S``), under the calling
  operation's deadline;
- a call's keys are grouped by slot (the cluster refuses a multi-key command over several
  slots: ``CROSSSLOT``), the slots by their primary; every node is sent all its commands
  (pipelined on its one connection) before any reply is read: one round trip per node, the
  nodes working in parallel, all under the call's one deadline;
- ``MOVED`` updates the map and sends the command once more to the node named; ``ASK`` sends
  ``ASKING`` and the command to the node named (a slot being migrated); a command
  redirected a second time fails (counted);
- a node that fails (refused, reset, timed out, malformed) fails only its own commands: its
  keys are unavailable, the failure is counted, the node is left alone for
  ``retry_after_s`` and the map is read again at the next call (its replica may have been
  promoted). Nothing escapes get/get_into/put/contains/delete but misuse, and a
  :class:`~kvoffload.tiers.cluster_map.ClusterModeError` when the server named has no
  cluster support.

One connection per node, opened when first needed (authenticated as the seed's URL says).
An ACL user needs ``+cluster|nodes`` and ``+asking`` on top of the single-server recipe.
"""

from __future__ import annotations

import os
import selectors
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed, wait
from dataclasses import dataclass, field
from typing import Any

from .address import ServerAddress
from .cluster_map import (
    MAX_MAP_BYTES,
    ClusterModeError,
    Endpoint,
    SlotMap,
    key_slot,
    node_address,
    parse_nodes,
    parse_redirect,
    seed_addresses,
)
from .connection import (
    Deadline,
    ErrorReply,
    HeldLink,
    Link,
    Oversized,
    ProtocolError,
    Refused,
    ServerClosed,
    pack,
)
from .store import Payload
from .valkey_store import (
    _BACK_OFF,
    _JOIN_BELOW,
    _SEND_EVERY,
    DEFAULT_MAX_VALUE_BYTES,
    ValkeyStore,
    _batches,
    _describe,
    checked_value,
)
from .values import Namespace

# The map is read again at most this often while it is stale (a node down for a while
# would otherwise cost every call a CLUSTER NODES round trip).
_REFRESH_S = 0.05
# Below this many payload bytes in all, a round sends to its nodes one after another: every
# node's share fits the kernel's socket buffers, so no send waits for its node to read.
_ALONE_BELOW = 256 * 1024
_SENDERS = 8  # helper threads sending to nodes at once (more nodes: they queue)
_ASKING = pack(b"ASKING", [])
_CLUSTER_NODES = pack(b"CLUSTER", [b"NODES"])
# Read returns the error a command was answered with (the stream in step), else None.
_ReadOne = Callable[[Link, Deadline], ErrorReply | None]


class _Drop(Exception):
    """A reply left unread (a value over the call's limit): the connection goes (not a
    failure of the node), the keys not yet read are asked again on a new one."""


@dataclass(eq=False)
class _Command:
    """One command of a call: one reply, the keys of one slot."""

    slot: int
    sends: Callable[[], Iterable[Sequence[bytes | memoryview]]]
    read: _ReadOne
    to: Endpoint | None = None  # where a redirect sent it (else the slot's owner)
    asking: bool = False
    redirected: bool = False  # a second redirect fails it
    # After a _Drop: the command for the keys it had not read yet (None: it read them all).
    rest: Callable[[], _Command | None] | None = None
    nbytes: int = 0  # the payload bytes it sends (a put's; the other commands are small)


@dataclass(eq=False)
class _Node:
    address: ServerAddress
    held: HeldLink = field(default_factory=HeldLink)
    down_until: float = 0.0


class _Pool:
    """The nodes' connections, apart from the store (its finalizer closes them)."""

    def __init__(self) -> None:
        self.nodes: dict[Endpoint, _Node] = {}
        self.lock = threading.Lock()
        self._senders: ThreadPoolExecutor | None = None
        self._senders_pid = 0

    def all(self) -> list[_Node]:
        with self.lock:
            return list(self.nodes.values())

    def shutdown(self) -> None:
        for node in self.all():
            node.held.shutdown()

    def close(self) -> None:
        for node in self.all():
            node.held.close()

    def senders(self) -> ThreadPoolExecutor:
        """The threads that send to several nodes at once (made at first need, and again in
        a forked child, which inherits none of them)."""
        with self.lock:
            if self._senders is None or self._senders_pid != os.getpid():
                self._senders = ThreadPoolExecutor(_SENDERS, thread_name_prefix="kvoffload-send")
                self._senders_pid = os.getpid()
            return self._senders

    def release(self) -> None:
        """Close every connection and let the sending threads go."""
        self.close()
        with self.lock:
            senders, self._senders = self._senders, None
        if senders is not None and self._senders_pid == os.getpid():
            senders.shutdown(wait=False)


class ClusterStore(ValkeyStore):
    """A :class:`ValkeyStore` made with ``cluster=True`` (see the module)."""

    def __init__(
        self,
        url: str,
        *,
        namespace: str | Mapping[str, Any] | Namespace,
        cluster: bool = True,
        secret: bytes | str | None = None,
        timeout_s: float = 0.5,
        retry_after_s: float = 1.0,
        max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
        tls_ca_file: str | None = None,
        tls_verify: bool | None = None,
    ) -> None:
        self._seeds = seed_addresses(url, tls_ca_file=tls_ca_file, tls_verify=tls_verify)
        super().__init__(
            url,
            namespace=namespace,
            cluster=cluster,
            secret=secret,
            timeout_s=timeout_s,
            retry_after_s=retry_after_s,
            max_value_bytes=max_value_bytes,
            tls_ca_file=tls_ca_file,
            tls_verify=tls_verify,
        )
        self._pool = _Pool()
        for seed in self._seeds:
            self._pool.nodes[Endpoint(seed.host or "", seed.port)] = _Node(seed)
        self._cluster_finalizer = weakref.finalize(self, self._pool.release)
        self._map: SlotMap | None = None
        self._stale = True
        self._refreshed_at = -_REFRESH_S
        self._described = True  # no namespace description on a cluster (nothing reads it)

    def _parse_address(
        self, url: str, tls_ca_file: str | None, tls_verify: bool | None
    ) -> ServerAddress:
        return self._seeds[0]

    @property
    def url(self) -> str:
        return ",".join(seed.url for seed in self._seeds)

    @property
    def slot_map(self) -> SlotMap | None:
        """The map as last read (``None`` before the first call reached a node)."""
        return self._map

    def close(self) -> None:
        self._closed = True
        self._pool.shutdown()
        if self._io.acquire(blocking=False):
            try:
                self._pool.release()
            finally:
                self._io.release()

    def __enter__(self) -> ClusterStore:
        return self

    def __repr__(self) -> str:
        return super().__repr__().replace("ValkeyStore(", "ValkeyStore(cluster=True, ", 1)

    # -- the calls -----------------------------------------------------------------------

    def _read(
        self,
        encoded: list[bytes],
        limits: list[int],
        scratch: int | None,
        accept: Callable[[int, memoryview], bool],
    ) -> int:
        counts: Counter[str] = Counter(get_calls=1, keys_requested=len(encoded))
        names = [self._format.server_key(key) for key in encoded]
        deadline = Deadline(self._timeout_s)
        if scratch is not None and len(self._scratch) < scratch:
            self._scratch = bytearray(scratch)
        into = None if scratch is None else self._scratch
        answered = [False] * len(encoded)
        taken = 0

        def mget(slot: int, indices: list[int]) -> _Command:
            position = [0]  # the keys of indices read so far

            def rest() -> _Command | None:
                left = indices[position[0] :]
                return mget(slot, left) if left else None

            return _Command(
                slot,
                _once(pack(b"MGET", [names[i] for i in indices])),
                reader(indices, position),
                rest=rest,
            )

        def reader(indices: list[int], position: list[int]) -> _ReadOne:
            def read(link: Link, deadline: Deadline) -> ErrorReply | None:
                nonlocal taken
                count = link.array_header(deadline)
                if isinstance(count, ErrorReply):
                    return count
                if count != len(indices):
                    raise ProtocolError(f"MGET of {len(indices)} keys answered {count}")
                for index in indices:
                    value = link.bulk(deadline, limits[index], into)
                    answered[index] = True
                    position[0] += 1
                    if isinstance(value, Oversized):
                        counts["rejected"] += 1
                        counts["rejected_length"] += 1
                        raise _Drop
                    taken += checked_value(
                        self._format, encoded[index], value, index, accept, counts
                    )
                return None

            return read

        commands = [mget(slot, indices) for slot, indices in _by_slot(names).items()]
        try:
            self._run(commands, deadline)
        finally:
            counts["unavailable"] += answered.count(False)
            self._count(**counts)
        return taken

    def put(self, keys: Sequence[Hashable], values: Sequence[Payload]) -> list[bool]:
        """As :meth:`ValkeyStore.put`: one ``MSET`` per slot (and per ~4 MiB)."""
        encoded, payloads = self._checked_put(keys, values)
        if not encoded:
            self._count(put_calls=1)
            return []
        names = [self._format.server_key(key) for key in encoded]
        stored = [False] * len(encoded)

        def reader(indices: list[int]) -> _ReadOne:
            def read(link: Link, deadline: Deadline) -> ErrorReply | None:
                reply = link.reply(deadline)
                if isinstance(reply, ErrorReply):
                    return reply
                if reply != b"OK":
                    raise ProtocolError(f"MSET answered {reply!r:.40}")
                for index in indices:
                    stored[index] = True
                return None

            return read

        def sends(indices: list[int]) -> Callable[[], Iterable[Sequence[bytes | memoryview]]]:
            return lambda: self._mset_sends(
                [encoded[i] for i in indices],
                [names[i] for i in indices],
                [payloads[i] for i in indices],
                [(0, len(indices))],
            )

        commands = []
        for slot, indices in _by_slot(names).items():
            for start, stop in _batches([payloads[i] for i in indices]):
                part = indices[start:stop]
                size = sum(payloads[i].nbytes for i in part)
                commands.append(_Command(slot, sends(part), reader(part), nbytes=size))
        self._run(commands, Deadline(self._timeout_s))
        good = sum(stored)
        sent = sum(p.nbytes for p, ok in zip(payloads, stored, strict=True) if ok)
        joined = sum(payload.nbytes for payload in payloads if payload.nbytes < _JOIN_BELOW)
        self._count(
            put_calls=1,
            keys_offered=len(encoded),
            keys_stored=good,
            keys_not_stored=len(encoded) - good,
            bytes_sent=sent,
            bytes_copied=joined,
        )
        return stored

    def _per_key(self, verb: bytes, encoded: list[bytes]) -> list[bool]:
        found = [False] * len(encoded)

        def reader(index: int) -> _ReadOne:
            def read(link: Link, deadline: Deadline) -> ErrorReply | None:
                reply = link.reply(deadline)
                if isinstance(reply, ErrorReply):
                    return reply
                if not isinstance(reply, int):
                    raise ProtocolError(f"{verb.decode()} answered {reply!r:.40}")
                found[index] = reply == 1
                return None

            return read

        commands = []
        for index, key in enumerate(encoded):
            name = self._format.server_key(key)
            commands.append(_Command(key_slot(name), _once(pack(verb, [name])), reader(index)))
        if commands:
            self._run(commands, Deadline(self._timeout_s))
        return found

    def ping(self) -> bool:
        """Whether every primary of the map answers now (the map read first if needed)."""
        self._check_open()
        answers: list[bool] = []

        def read(link: Link, deadline: Deadline) -> ErrorReply | None:
            reply = link.reply(deadline)
            if isinstance(reply, ErrorReply):
                return reply
            answers.append(reply == b"PONG")
            return None

        with self._io:
            self._refresh_if_stale(Deadline(self._timeout_s))
            primaries = sorted(self._map.primaries, key=str) if self._map else []
        commands = [_Command(-1, _once(pack(b"PING", [])), read, to) for to in primaries]
        self._run(commands, Deadline(self._timeout_s))
        return bool(primaries) and len(answers) == len(primaries) and all(answers)

    # -- the rounds ----------------------------------------------------------------------

    def _run(self, commands: list[_Command], deadline: Deadline) -> None:
        """Send every command to its node, all nodes before any reply is read, then read
        them; the commands redirected (or met a connection found dead before any reply)
        go once more, in a second round, within the same deadline."""
        with self._io:
            self._check_open()
            try:
                self._refresh_if_stale(deadline)
                # Rounds end: a command is redirected once at most, sent again after a dead
                # idle link only in the first round, and continued after a _Drop only with
                # a key fewer (and the deadline bounds them all).
                pending, final = commands, False
                while pending:
                    pending, final = self._round(pending, deadline, final), True
            except BaseException:
                # Not the cluster's doing (an interrupt, a bug): commands may be half sent.
                self._pool.close()
                raise
            finally:
                if self._closed:
                    self._pool.close()

    def _round(self, commands: list[_Command], deadline: Deadline, final: bool) -> list[_Command]:
        grouped: dict[Endpoint, list[_Command]] = {}
        orphans = False
        for command in commands:
            to = command.to
            if to is None and self._map is not None:
                to = self._map.owners[command.slot]
            if to is None:
                orphans = True  # no node serves the slot now (or no map yet): unavailable
                continue
            grouped.setdefault(to, []).append(command)
        targets: list[tuple[_Node, list[_Command]]] = []
        skipped = int(orphans)
        for to, group in grouped.items():
            node = self._node(to)
            if time.monotonic() < node.down_until:
                skipped += 1
                continue
            targets.append((node, group))
        if skipped:
            self._count(skipped=skipped)
        again: list[_Command] = []
        if len(targets) < 2 or _group_bytes(targets) < _ALONE_BELOW:
            sent = [self._send_group(node, group, deadline) for node, group in targets]
            answering = _as_ready([entry for entry in sent if entry is not None], deadline)
        else:
            answering = self._sent_at_once(targets, deadline)
        for node, link, group, opened in answering:
            again += self._replies(node, link, group, deadline, opened, final)
        return again

    def _sent_at_once(
        self, targets: list[tuple[_Node, list[_Command]]], deadline: Deadline
    ) -> Iterator[_Sent]:
        """Each node's commands sent by a helper thread of its own, all at once; the nodes
        sent to, in the order their replies start to come (those that failed: counted).

        A node that stops reading (a process paused, a link cut without a reset) holds a
        send once the kernel's buffers are full, until the deadline. Sent one node after
        another, a large put would then reach no node after it, and a reply read only after
        that send would find the deadline passed: past ``_ALONE_BELOW`` bytes, the nodes are
        sent to at once (the socket releases the GIL while the kernel copies), and the
        calling thread reads each node's replies as they come.
        """
        helpers = self._pool.senders()
        futures = {
            helpers.submit(self._send_and_wait, node, group, deadline): node
            for node, group in targets
        }
        try:
            for future in as_completed(futures):
                entry = future.result()
                if entry is not None:
                    yield entry
        finally:
            # However the call ends, no helper goes on sending after it.
            for future, node in futures.items():
                if not future.done():
                    node.held.shutdown()
            wait(futures)

    def _send_and_wait(
        self, node: _Node, group: list[_Command], deadline: Deadline
    ) -> _Sent | None:
        """``_send_group``, then wait (within ``deadline``) for the node's first reply byte."""
        entry = self._send_group(node, group, deadline)
        if entry is not None and not entry[1].buffered():
            with selectors.DefaultSelector() as selector:
                selector.register(entry[1].sock, selectors.EVENT_READ)
                selector.select(max(deadline.at - time.monotonic(), 0))
        return entry

    def _send_group(self, node: _Node, group: list[_Command], deadline: Deadline) -> _Sent | None:
        opened = True  # until the link is found: a reset while connecting is no retry
        try:
            link, opened = self._node_link(node, deadline)
            self._send(link, group, deadline)
        except (ConnectionResetError, BrokenPipeError) as error:
            if opened:
                self._node_failed(node, "connection_errors", error)
                return None
            # An idle connection found dead: no news about the node; once more, anew.
            node.held.close()
            self._count(retries=1)
            try:
                link, opened = self._node_link(node, deadline)
                self._send(link, group, deadline)
            except Exception as second:
                self._fail_by_kind(node, second)
                return None
        except Exception as error:
            self._fail_by_kind(node, error)
            return None
        return node, link, group, opened

    def _send(self, link: Link, group: list[_Command], deadline: Deadline) -> None:
        """A node's commands, gathered into sends of about ``_SEND_EVERY`` bytes."""
        pending: list[bytes | memoryview] = []
        size = 0
        for command in group:
            if command.asking:
                pending.append(_ASKING)
            for chunks in command.sends():
                for chunk in chunks:
                    pending.append(chunk)
                    size += len(chunk) if isinstance(chunk, bytes) else chunk.nbytes
                if size >= _SEND_EVERY:
                    link.send(pending, deadline)
                    pending, size = [], 0
        if pending:
            link.send(pending, deadline)

    def _replies(
        self,
        node: _Node,
        link: Link,
        group: list[_Command],
        deadline: Deadline,
        opened: bool,
        final: bool,
    ) -> list[_Command]:
        again: list[_Command] = []
        errors: list[ErrorReply] = []
        received = link.received
        done = 0
        try:
            for command in group:
                if command.asking:
                    ok = link.reply(deadline)
                    if ok != b"OK":
                        raise ProtocolError(f"ASKING answered {ok!r:.40}")
                error = command.read(link, deadline)
                done += 1
                if error is None:
                    continue
                redirect = parse_redirect(error.message)
                if error.kind in ("MOVED", "ASK") and redirect is not None:
                    if command.redirected:
                        errors.append(error)
                        continue
                    slot, to = redirect
                    command.to, command.asking = to, error.kind == "ASK"
                    command.redirected = True
                    if error.kind == "MOVED" and self._map is not None:
                        self._map = self._map.moved(slot, to)
                        self._stale = True
                    again.append(command)
                    continue
                errors.append(error)
        except _Drop:
            node.held.close()
            current = group[done]
            follow = current.rest() if current.rest is not None else None
            if follow is not None:
                follow.to, follow.asking = current.to, current.asking
                follow.redirected = current.redirected
                again.append(follow)
            again += group[done + 1 :]
        except ServerClosed as error:
            if opened or final or link.received != received or done:
                self._node_failed(node, "connection_errors", error)
            else:  # found dead before any reply: the node restarted while we were idle
                node.held.close()
                self._count(retries=1)
                again += group
        except Exception as error:
            self._fail_by_kind(node, error)
        if errors:
            if any(e.kind in _BACK_OFF - {"TRYAGAIN"} for e in errors):
                node.down_until = time.monotonic() + self._retry_after_s
            if any(e.kind in ("CLUSTERDOWN", "MOVED", "ASK") for e in errors):
                self._stale = True
            self._note_failure("server_errors", f"{errors[0].kind}: {errors[0].message}")
        return again

    # -- the nodes and the map -----------------------------------------------------------

    def _node(self, to: Endpoint) -> _Node:
        with self._pool.lock:
            node = self._pool.nodes.get(to)
            if node is None:
                node = self._pool.nodes[to] = _Node(node_address(self._seeds[0], to))
            return node

    def _node_link(self, node: _Node, deadline: Deadline) -> tuple[Link, bool]:
        link = node.held.link
        if link is not None and link.pid == os.getpid():
            return link, False
        if link is not None:  # forked: the parent's socket is not ours to use, nor to shut
            node.held.close()
        link = Link.open(node.address, deadline, self._tls)
        node.held.set(link)
        if self._closed:
            raise ServerClosed("the store was closed during the call")
        self._count(connects=1)
        link.authenticate(node.address, deadline)
        return link, True

    def _fail_by_kind(self, node: _Node, error: BaseException) -> None:
        if isinstance(error, Refused):
            self._node_failed(node, "server_errors", error)
        elif isinstance(error, ProtocolError):
            self._node_failed(node, "protocol_errors", error)
        elif isinstance(error, TimeoutError):
            self._node_failed(node, "timeouts", error)
        elif isinstance(error, OSError):
            self._node_failed(node, "connection_errors", error)
        else:
            raise error

    def _node_failed(self, node: _Node, counter: str, error: BaseException) -> None:
        node.held.close()
        node.down_until = time.monotonic() + self._retry_after_s
        self._stale = True  # its replica may be promoted: read the map again
        self._note_failure(counter, f"{node.address.url}: {_describe(error)}")

    def _refresh_if_stale(self, deadline: Deadline) -> None:
        now = time.monotonic()
        if not self._stale or now - self._refreshed_at < _REFRESH_S:
            return
        self._refreshed_at = now
        known = self._map.primaries if self._map is not None else set()
        with self._pool.lock:
            others = [e for e in self._pool.nodes if e not in known]
        for to in [*sorted(known, key=str), *others]:
            node = self._node(to)
            if time.monotonic() < node.down_until:
                continue
            try:
                link, _ = self._node_link(node, deadline)
                link.send([_CLUSTER_NODES], deadline)
                reply = link.reply(deadline, MAX_MAP_BYTES)
            except Exception as error:
                self._fail_by_kind(node, error)
                continue
            if isinstance(reply, ErrorReply):
                if "cluster support disabled" in reply.message:
                    raise ClusterModeError(
                        f"{node.address.url} is not a cluster node ({reply.message}): "
                        "make the store with cluster=False"
                    )
                self._note_failure("server_errors", f"{reply.kind}: {reply.message}")
                continue
            if not isinstance(reply, bytes):
                self._node_failed(node, "protocol_errors", ProtocolError("CLUSTER NODES"))
                continue
            try:
                found = parse_nodes(reply)
            except ProtocolError as error:
                self._node_failed(node, "protocol_errors", error)
                continue
            self._map = found
            # Stale still while a slot has no primary, or its primary is failing or down.
            self._stale = any(
                owner is None
                or owner in found.failing
                or time.monotonic() < self._node(owner).down_until
                for owner in set(found.owners)
            )
            return


_Sent = tuple[_Node, Link, list[_Command], bool]


def _as_ready(sent: list[_Sent], deadline: Deadline) -> Iterator[_Sent]:
    """The nodes sent to, those whose replies have come first: a node that hangs costs the
    call its deadline, but not the replies the others have sent meanwhile (read in the
    order sent, they would wait behind it and find the deadline passed)."""
    remaining = list(sent)
    if len(remaining) < 2:
        yield from remaining
        return
    with selectors.DefaultSelector() as selector:
        for entry in remaining:
            selector.register(entry[1].sock, selectors.EVENT_READ, entry)
        while remaining:
            ready = [entry for entry in remaining if entry[1].buffered()]
            if not ready:
                left = deadline.at - time.monotonic()
                if left > 0:
                    found = {id(key.data) for key, _ in selector.select(left)}
                    ready = [entry for entry in remaining if id(entry) in found]
                ready = ready or list(remaining)  # the deadline passed: each fails, counted
            for entry in ready:
                remaining.remove(entry)
                selector.unregister(entry[1].sock)
                yield entry


def _group_bytes(targets: list[tuple[_Node, list[_Command]]]) -> int:
    return sum(command.nbytes for _, group in targets for command in group)


def _by_slot(names: list[bytes]) -> dict[int, list[int]]:
    slots: dict[int, list[int]] = {}
    for index, name in enumerate(names):
        slots.setdefault(key_slot(name), []).append(index)
    return slots


def _once(command: bytes) -> Callable[[], Iterable[Sequence[bytes | memoryview]]]:
    return lambda: ((command,),)
