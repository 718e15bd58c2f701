"""The contract of a remote block store, and the counters every store keeps.

A remote store is a cache shared by engines, never a source of truth: any key may be gone at
any moment (another engine deleted it, the server evicted it or restarted empty), and the
server may be down or slow. So no operation ever raises because of the server: every
failure reads as a miss (or a write not known to be done), and is counted in
:meth:`RemoteStore.stats`. What does raise, before anything is sent, is a bad argument: an
:class:`~kvoffload_spec.errors.InvalidArgumentError` (a subclass of ``OffloadError``), or
:class:`StoreClosedError` on a closed store.

What each operation returns, per key, position by position:

=============  ===========================  ==========================  ====================
operation      the server has the value     no (valid) value            timeout / down
=============  ===========================  ==========================  ====================
``get``        a read-only view of the      ``None``                    ``None``
               exact bytes stored
``get_into``   ``True``, bytes copied into  ``False``, buffer untouched ``False``, untouched
               the caller's buffer
``put``        ``True``: the server         (not applicable)            ``False``: maybe
               acknowledged the write                                   stored, maybe not
``contains``   ``True`` (a hint: a ``get``  ``False``                   ``False``
               may still miss)
``delete``     ``True``: removed now        ``False``                   ``False``
=============  ===========================  ==========================  ====================

"No valid value" includes a value that is there but refused: another namespace's or
tenant's, another key's, truncated, corrupt, forged (see :mod:`kvoffload.tiers.values`), or
longer than the call can accept; such a value is never returned. One exception to "buffer
untouched": a store that reads a value straight into the caller's buffer (``DiskStore``: no
copy) can only check it there, so a value it refuses after reading leaves that buffer zeroed
(never the refused bytes). A miss, or a value of another size, leaves it untouched in every
store.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from kvoffload_spec.errors import InvalidArgumentError

if TYPE_CHECKING:
    from .values import Namespace

# What a store writes from: bytes, bytearray, memoryview, a numpy array, ... (C-contiguous).
Payload = bytes | bytearray | memoryview
# What get_into writes to: a writable C-contiguous buffer (bytearray, a numpy array, ...).
WritableBuffer = bytearray | memoryview


class StoreClosedError(InvalidArgumentError):
    """The store was closed: calling it is a bug of the caller, not a server failure."""


@dataclass(frozen=True)
class RemoteStats:
    """Counters since the store was made (a snapshot: later calls do not change it).

    Keys asked for: ``hits + misses + rejected + unavailable == keys_requested``. Keys
    written: ``keys_stored + keys_not_stored == keys_offered``. ``failures == timeouts +
    connection_errors + server_errors + protocol_errors``. Each call's counts are added at
    once, so a snapshot taken during another thread's call keeps these identities.
    """

    get_calls: int = 0
    keys_requested: int = 0
    hits: int = 0
    misses: int = 0  # the server had no value under the key
    rejected: int = 0  # a value was there but refused (the six counters below add up)
    rejected_malformed: int = 0
    rejected_foreign: int = 0
    rejected_wrong_key: int = 0
    rejected_length: int = 0  # truncated, extended, another size, or over the call's limit
    rejected_checksum: int = 0
    rejected_mac: int = 0  # a sealed value whose tag does not verify: forged or moved
    unavailable: int = 0  # asked during a failure, or while the server was marked down
    put_calls: int = 0
    keys_offered: int = 0
    keys_stored: int = 0  # acknowledged by the server
    keys_not_stored: int = 0  # failed, timed out or refused by the server (e.g. out of memory)
    delete_calls: int = 0
    keys_deleted: int = 0
    contains_calls: int = 0
    failures: int = 0  # calls that met a failure (the next four add up to it)
    timeouts: int = 0  # the call's deadline passed (timeout_s from its start)
    connection_errors: int = 0  # refused, reset, closed, killed mid-call, TLS refused
    server_errors: int = 0  # error replies (out of memory, loading, no permission...)
    protocol_errors: int = 0  # replies no command sent can have (malformed, out of step)
    skipped: int = 0  # calls answered at once because the server was marked down
    connects: int = 0  # connections established (the first, then each reconnect)
    retries: int = 0  # calls sent again on a new connection: the one they met was dead
    bytes_sent: int = 0  # payload bytes the server acknowledged
    bytes_received: int = 0  # payload bytes of hits
    bytes_copied: int = 0  # payload bytes the store itself copied (get_into's one copy)
    server_down: bool = False  # marked down now: calls return at once until retry_after_s
    last_error: str | None = None


@runtime_checkable
class RemoteStore(Protocol):
    """A batched block store (implementations: ValkeyStore, shared by engines; DiskStore,
    an engine's own drive).

    Every call is synchronous and takes a whole batch: its time is one round trip plus the
    bytes' transfer, and never more than the store's timeout, whatever the server does. Call it
    off the scheduler's critical path (a worker thread: :class:`~kvoffload.tiers.RemoteTier`).
    """

    @property
    def namespace(self) -> Namespace: ...

    def get(self, keys: Sequence[Hashable]) -> list[memoryview | None]: ...

    def get_into(
        self, keys: Sequence[Hashable], buffers: Sequence[WritableBuffer]
    ) -> list[bool]: ...

    def put(self, keys: Sequence[Hashable], values: Sequence[Payload]) -> list[bool]: ...

    def contains(self, keys: Sequence[Hashable]) -> list[bool]: ...

    def delete(self, keys: Sequence[Hashable]) -> list[bool]: ...

    def stats(self) -> RemoteStats: ...

    def close(self) -> None: ...
