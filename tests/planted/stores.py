"""Planted bugs in a remote store: a ``get_into`` that takes a valid value of another size
than the caller's buffer, which the contract's size checks (tests/store_contract.py) must
find; a store that times each socket operation, one that reads a value of any length and
two whose reply parser raises what malformed bytes provoke, which tests/test_remote_bounds.py
must find. Every other part of each store is the real one.

Each reads through the store's own ``get`` (every value there is valid: namespace, key,
length and checksum checked), so the only slip is the one planted: which sizes it copies.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from kvoffload.tiers import ValkeyStore
from kvoffload.tiers.connection import (
    Deadline,
    ErrorReply,
    Link,
    Oversized,
    ProtocolError,
    _integer,
)
from kvoffload.tiers.store import WritableBuffer
from kvoffload_spec.errors import InvalidArgumentError


def _targets(buffers: Sequence[WritableBuffer], count: int) -> list[memoryview]:
    if len(buffers) != count:
        raise InvalidArgumentError(f"{count} keys and {len(buffers)} buffers")
    views = [memoryview(buffer).cast("B") for buffer in buffers]
    if any(view.readonly for view in views):
        raise InvalidArgumentError("a read-only buffer")
    return views


class CopiesAShorterPayload(ValkeyStore):
    """get_into copies a valid payload shorter than the buffer into the buffer's first
    bytes and reports success: the rest of the buffer keeps stale bytes."""

    def get_into(self, keys: Sequence[Hashable], buffers: Sequence[WritableBuffer]) -> list[bool]:
        found = self.get(keys)
        done = []
        for value, target in zip(found, _targets(buffers, len(found)), strict=True):
            fits = value is not None and value.nbytes <= target.nbytes
            if value is not None and fits:
                target[: value.nbytes] = value
            done.append(fits)
        return done


class CopiesALongerPayloadsPrefix(ValkeyStore):
    """get_into copies as much of a valid payload longer than the buffer as fits and
    reports success: the buffer holds another layout's bytes, cut short."""

    def get_into(self, keys: Sequence[Hashable], buffers: Sequence[WritableBuffer]) -> list[bool]:
        found = self.get(keys)
        done = []
        for value, target in zip(found, _targets(buffers, len(found)), strict=True):
            fits = value is not None and value.nbytes >= target.nbytes
            if value is not None and fits:
                target[:] = value[: target.nbytes]
            done.append(fits)
        return done


class SizesABatchByItsFirstBuffer(ValkeyStore):
    """get_into compares every value with the batch's first buffer (a pool's buffers are
    all one size): in a batch of buffers of several sizes, a value of the first one's size
    is copied, cut or short, into a buffer of another and reported done."""

    def get_into(self, keys: Sequence[Hashable], buffers: Sequence[WritableBuffer]) -> list[bool]:
        found = self.get(keys)
        targets = _targets(buffers, len(found))
        done = []
        for value, target in zip(found, targets, strict=True):
            fits = value is not None and value.nbytes == targets[0].nbytes
            if value is not None and fits:
                size = min(value.nbytes, target.nbytes)
                target[:size] = value[:size]
            done.append(fits)
        return done


class ReadsAValueWhateverItsLength(ValkeyStore):
    """get accepts any length the server announces and finds an oversized value invalid
    only once it is read: each value planted at 64 MiB costs the victim 64 MiB."""

    def get(self, keys: Sequence[Hashable]) -> list[memoryview | None]:
        encoded = self._keys(keys)
        found: list[memoryview | None] = [None] * len(encoded)

        def accept(index: int, payload: memoryview) -> bool:
            found[index] = payload.toreadonly()
            return True

        self._read(encoded, [1 << 40] * len(encoded), None, accept)
        return found


class _EachOperation(Deadline):
    """A "deadline" that gives every wait the whole timeout: a timeout per socket
    operation, as the client library has, instead of one per call."""

    __slots__ = ("seconds",)

    def __init__(self, seconds: float) -> None:
        super().__init__(seconds)
        self.seconds = seconds

    def left(self) -> float:
        return self.seconds


class TimesEachSocketOperation(ValkeyStore):
    """timeout_s bounds each connect, send and receive, not the call: a link that passes a
    few bytes now and then holds a call for as long as the value takes to trickle in."""

    def _call(self, sends: Any, read: Any, deadline: Deadline, **options: Any) -> Any:
        return super()._call(sends, read, _EachOperation(self._timeout_s), **options)


class _NumbersByInt(Link):
    """Reads an MGET's reply as a general client's parser does: ``int()`` of whatever a
    count or length line holds (``$abc``: ValueError; 5,000 digits: ValueError)."""

    def array_header(self, deadline: Deadline) -> int | ErrorReply:
        kind, line = self._line(deadline)
        if kind == ord("*"):
            return int(line)
        found = self._other(kind, line, deadline)
        if isinstance(found, ErrorReply):
            return found
        raise ProtocolError(f"{found!r:.40} where an array was expected")

    def bulk(
        self, deadline: Deadline, limit: int, into: bytearray | None
    ) -> memoryview | Oversized | None:
        kind, line = self._line(deadline)
        if kind == ord("$"):
            return self.bulk_after(int(line), deadline, limit, into)
        raise ProtocolError(f"{kind!r}{line!r:.40} where a bulk string was expected")


class _NestedArrays(Link):
    """Takes an array where an MGET's element should be and reads it, element by element,
    recursively, as a general RESP parser does (20,000 levels deep: RecursionError)."""

    def bulk(
        self, deadline: Deadline, limit: int, into: bytearray | None
    ) -> memoryview | Oversized | None:
        kind, line = self._line(deadline)
        if kind == ord("*"):
            for _ in range(_integer(line)):
                self.bulk(deadline, limit, into)
            return None  # an array is no value: a miss
        if kind == ord("$"):
            return self.bulk_after(_integer(line), deadline, limit, into)
        raise ProtocolError(f"{kind!r}{line!r:.40} where a bulk string was expected")


class _ParsedBy(ValkeyStore):
    """The real store, each new connection's replies read by ``parser`` instead."""

    parser: type[Link] = Link

    def _connected(self, deadline: Deadline) -> tuple[Link, bool]:
        link, opened = super()._connected(deadline)
        if opened:
            link.__class__ = self.parser
        return link, opened


class ParsesNumbersWithInt(_ParsedBy):
    """An MGET reply's counts and lengths are read with ``int()``: a malformed one raises
    ValueError into the caller, uncounted, instead of failing the call."""

    parser = _NumbersByInt


class ParsesNestedArraysRecursively(_ParsedBy):
    """An array in place of an MGET's element is parsed recursively: a deep one raises
    RecursionError into the caller, uncounted, instead of failing the call."""

    parser = _NestedArrays


@dataclass(frozen=True)
class PlantedStore:
    """A broken store class, and the checks of tests/store_contract.py's ``CONTRACT`` that
    must each refute it (by name)."""

    store_class: type[ValkeyStore]
    caught_by: tuple[str, ...]


SIZE_CHECKS = (
    "check_get_into_copies_a_value_only_into_a_buffer_of_its_size",
    "check_get_into_on_any_mixed_batch",
)

PLANTED_STORES = (
    PlantedStore(CopiesAShorterPayload, SIZE_CHECKS),
    PlantedStore(CopiesALongerPayloadsPrefix, SIZE_CHECKS),
    PlantedStore(SizesABatchByItsFirstBuffer, SIZE_CHECKS),
)
