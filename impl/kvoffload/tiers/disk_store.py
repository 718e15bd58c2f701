"""DiskStore: the block store on a local directory, bounded, restart-safe, crash-consistent.

It keeps the :class:`~kvoffload.tiers.store.RemoteStore` contract, so what is built on it
(``RemoteTier``, the Offloader's tiers, the vLLM secondary tier, the simulator) takes it as
it takes a ``ValkeyStore``. What lies where on the disk: :mod:`kvoffload.tiers.disk_layout`;
opening and taking back a directory: :mod:`kvoffload.tiers.disk_open`; how the bytes move:
:mod:`kvoffload.tiers.disk_io`; docs/disk.md says how to use it.

In RAM, per block on the disk: its digest in :class:`~kvoffload.tiers.disk_index.SlotIndex`,
its place in the eviction order (an :class:`~kvoffload.policies.base.EvictionPolicy`, LRU by
default, whose keys are the blocks' digests), and a sum of its payload; about 180 bytes.
A slot is *being written* (a put holds it: not readable, not evictable), *ready*, or
*pinned* by the reads in flight (not evictable): the policy hears each change, as it hears
the CPU pool's. The lock guards only that bookkeeping; the bytes move without it, on the
calling thread and a few helper threads, one gathered system call per run of adjacent
slots.
"""

from __future__ import annotations

import errno
import itertools
import os
import threading
import time
from array import array
from collections import Counter
from collections.abc import Hashable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import xxhash

import kvoffload.tiers.disk_layout as layout
from kvoffload.tiers.admission import AdmitAll, SecondOffer
from kvoffload.tiers.disk_index import SlotIndex
from kvoffload.tiers.disk_io import IoThreads, page_aligned
from kvoffload.tiers.disk_open import (
    check_geometry,
    check_int,
    claim,
    inspect_directory,
    open_counts,
    open_files,
    recover_files,
    slot_tables,
)
from kvoffload.tiers.disk_stats import DiskStats
from kvoffload.tiers.store import Payload, StoreClosedError, WritableBuffer
from kvoffload.tiers.values import (
    Namespace,
    Rejection,
    encode_key,
    put_payloads,
    value_format,
    writable_buffers,
)
from kvoffload_spec.errors import InvalidArgumentError

if TYPE_CHECKING:
    from kvoffload.policies.base import EvictionPolicy
    from kvoffload.tiers.values import ValueFormat

Admission = Literal["second-offer", "every-offer"]
ADMISSIONS: tuple[Admission, ...] = ("second-offer", "every-offer")
MAX_BLOCK_BYTES = 1 << 30
_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


class DiskStore:
    """Blocks of ``namespace`` in the directory ``path``, at most ``capacity_bytes`` of disk.

    ``block_bytes``: the slots' payload size; a value may be shorter. None takes it from the
    directory (required for a new one). ``secret``: seal the values (the remote tier's
    ``KVO\\x02`` format: see docs/disk.md for what that protects, against whom).
    ``policy``: the eviction order (a built-in policy name or an ``EvictionPolicy`` class).
    ``admission``: ``"second-offer"`` writes a block on its first offer only into free room,
    and, once the disk is full, on its second offer within a window of about ``capacity``
    offers (a cold scan cannot flush the disk); ``"every-offer"`` writes every offer.
    ``direct``: ``O_DIRECT`` for page-aligned buffers where the file system takes it
    (None), always (True: refused where it is not available), never (False).
    ``io_threads``: threads moving one call's bytes (the calling thread is one of them).

    Bad arguments and a directory this store may not open raise
    :class:`~kvoffload_spec.errors.InvalidArgumentError` (``DiskLayoutError``,
    ``DiskInUseError``) before anything is written or deleted. Thread-safe.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        capacity_bytes: int,
        namespace: str | Mapping[str, Any] | Namespace,
        secret: bytes | bytearray | str | None = None,
        block_bytes: int | None = None,
        policy: str | type[EvictionPolicy] = "lru",
        admission: Admission = "second-offer",
        direct: bool | None = None,
        io_threads: int = 4,
    ) -> None:
        started = time.perf_counter()
        from kvoffload.policies.loading import resolve_policy

        if not isinstance(path, (str, os.PathLike)):
            raise InvalidArgumentError(f"path must be a str or a path; got {type(path).__name__}")
        check_int("capacity_bytes", capacity_bytes, 1)
        if block_bytes is not None:
            check_int("block_bytes", block_bytes, 1, MAX_BLOCK_BYTES)
        check_int("io_threads", io_threads, 1, 64)
        if admission not in ADMISSIONS:
            raise InvalidArgumentError(f"admission must be one of {ADMISSIONS}; got {admission!r}")
        if direct is not None and not isinstance(direct, bool):
            raise InvalidArgumentError(f"direct must be True, False or None; got {direct!r}")
        policy_class = resolve_policy(policy)
        self._namespace = Namespace.of(namespace)
        self._format: ValueFormat = value_format(self._namespace, secret)
        directory = Path(path)
        self.path = directory
        found = inspect_directory(directory)
        geometry = check_geometry(directory, self._format, found, block_bytes)
        slots = geometry.slots_for(capacity_bytes)
        if slots < 1:
            raise InvalidArgumentError(
                f"capacity_bytes={capacity_bytes:,} holds no block of {geometry.block_bytes:,} "
                f"bytes: a disk tier needs at least "
                f"{layout.RESERVED_BYTES + geometry.slot_bytes + layout.RECORD_BYTES:,}"
            )
        self.capacity_bytes = capacity_bytes
        self.geometry = geometry
        self.slots = slots
        self._lock_fd, meta, created = claim(directory, self._format, found, geometry)
        self._epoch = meta.epoch
        self._file, self._records = open_files(directory, direct, self._lock_fd, created)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._active = 0
        self._closed = False
        self._counts: Counter[str] = Counter()
        self._seconds = {"read": 0.0, "write": 0.0}
        self._policy = policy_class(slots)
        self._admission = SecondOffer(slots) if admission == "second-offer" else AdmitAll()
        self._index = SlotIndex(slots)
        # Set by _recover: each slot's payload sum; slot -> payload length, for values
        # shorter than a slot; the free slots below the high-water mark; the mark itself
        # (slots from there on have never held a block).
        self._sums: array[int]
        self._short: dict[int, int]
        self._free: array[int]
        self._fresh: int
        self._pins: dict[int, int] = {}  # slot -> reads in flight
        self._writing: set[int] = set()
        self._incoming: set[int] = set()  # digests of blocks being written to a new slot
        self._doomed: set[int] = set()  # pinned slots deleted or refused: freed at unpin
        self._rewriting = 0  # ready blocks being written again (in the index, not evictable)
        self._threads = IoThreads(io_threads)
        self._zeros = page_aligned(layout.ALIGN).toreadonly()
        self._sink = page_aligned(layout.ALIGN)  # padding read into, never looked at
        self._seq = 1
        self._open_counts = self._recover()
        self._open_seconds = time.perf_counter() - started

    # -- opening -------------------------------------------------------------------------

    def _recover(self) -> Counter[str]:
        """Take back what the previous process left, within this open's capacity."""
        geometry = self.geometry
        found = recover_files(self._file.buffered, self._records, self._epoch, geometry, self.slots)
        digests = found.digests.tolist()
        slots = found.slots.tolist()
        for digest, slot in zip(digests, slots, strict=True):
            self._index.set(digest, slot)
        self._policy.insert_each(digests)
        self._policy.mark_evictable_each(digests)
        self._sums, self._short, self._fresh, self._free = slot_tables(
            found, self.slots, geometry.block_bytes
        )
        self._seq = found.next_seq
        return open_counts(found)

    # -- the surface ---------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called (every call refused since)."""
        return self._closed

    @property
    def namespace(self) -> Namespace:
        return self._namespace

    @property
    def value_format(self) -> ValueFormat:
        return self._format

    def get(self, keys: Sequence[Hashable]) -> list[memoryview | None]:
        """The payload stored under each key, or ``None`` (read into memory of its own)."""
        identities = self._identities(keys)
        with self._call():
            found: list[memoryview | None] = [None] * len(identities)
            self._read(identities, None, found)
            return found

    def get_into(self, keys: Sequence[Hashable], buffers: Sequence[WritableBuffer]) -> list[bool]:
        """Read each key's payload straight into its buffer (no copy): ``True`` where it is
        the exact bytes stored. ``False``: the buffer is untouched when the disk had no
        such block (or one of another size), zeroed when the block read there was refused
        (torn, overwritten, foreign)."""
        identities = self._identities(keys)
        targets = writable_buffers(buffers, len(identities))
        with self._call():
            found: list[memoryview | None] = [None] * len(identities)
            self._read(identities, targets, found)
            return [view is not None for view in found]

    def put(self, keys: Sequence[Hashable], values: Sequence[Payload]) -> list[bool]:
        """Store each value under its key; ``True`` where it is on the disk now (written, or
        held already with these very bytes). ``False``: not admitted (a first offer), the
        block busy, no slot free of reads and writes, or the write failed (counted)."""
        identities = self._identities(keys)
        payloads = put_payloads(values, len(identities))
        for i, payload in enumerate(payloads):
            if payload.nbytes > self.geometry.block_bytes:
                raise InvalidArgumentError(
                    f"the value for key #{i} holds {payload.nbytes:,} bytes, more than this "
                    f"disk tier's blocks ({self.geometry.block_bytes:,})"
                )
        with self._call():
            return self._put(identities, payloads)

    def contains(self, keys: Sequence[Hashable]) -> list[bool]:
        """Whether each key's block is on the disk and readable (a hint: a read checks)."""
        identities = self._identities(keys)
        with self._call(), self._lock:
            self._counts["contains_calls"] += 1
            return [self._readable(layout.digest_of(ident)) >= 0 for ident in identities]

    def delete(self, keys: Sequence[Hashable]) -> list[bool]:
        """Remove each key's block; ``True`` where one was there (``False`` for a block being
        written now)."""
        identities = self._identities(keys)
        with self._call(), self._lock:
            self._counts["delete_calls"] += 1
            removed = []
            for ident in identities:
                digest = layout.digest_of(ident)
                slot = self._readable(digest)
                if slot >= 0:
                    self._drop(digest, slot, evictable=slot not in self._pins)
                    self._counts["keys_deleted"] += 1
                removed.append(slot >= 0)
            return removed

    def stats(self) -> DiskStats:
        with self._lock:
            counts: dict[str, Any] = dict(self._counts + self._open_counts)
            failures = counts.get("disk_full", 0) + counts.get("io_errors", 0)
            return DiskStats(
                **counts,
                failures=failures,
                server_errors=failures,
                blocks=len(self._index),
                slots=self.slots,
                capacity_bytes=self.capacity_bytes,
                read_seconds=self._seconds["read"],
                write_seconds=self._seconds["write"],
                direct=self._file.direct is not None,
                open_seconds=self._open_seconds,
                last_error=self._last_error,
            )

    def close(self) -> None:
        """Wait for the calls in flight, then release the files and the directory's lock;
        further calls raise :class:`StoreClosedError`. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while self._active:
                self._idle.wait()
        self._threads.close()
        self._file.close()
        os.close(self._records)
        os.close(self._lock_fd)

    def __enter__(self) -> DiskStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        sealed = ", sealed" if self._format.authenticated else ""
        return (
            f"DiskStore({str(self.path)!r}, capacity_bytes={self.capacity_bytes:,}, "
            f"block_bytes={self.geometry.block_bytes:,}, "
            f"namespace={self._namespace.description!r}{sealed})"
        )

    _last_error: str | None = None

    # -- arguments and bookkeeping -------------------------------------------------------

    def _identities(self, keys: Sequence[Hashable]) -> list[bytes]:
        if self._closed:
            raise StoreClosedError(f"{self!r} is closed")
        if isinstance(keys, (str, bytes, bytearray, memoryview)) or not isinstance(keys, Sequence):
            raise InvalidArgumentError(
                f"keys must be a sequence of block keys (a list or tuple); "
                f"got {type(keys).__name__}"
            )
        return [layout.identity(self._format, encode_key(key)) for key in keys]

    @contextmanager
    def _call(self) -> Iterator[None]:
        """A call in flight: ``close`` waits for it (its descriptors must stay open)."""
        with self._lock:
            if self._closed:
                raise StoreClosedError(f"{self!r} is closed")
            self._active += 1
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1
                if not self._active:
                    self._idle.notify_all()

    def _readable(self, digest: int) -> int:
        slot = self._index.get(digest)
        return -1 if slot < 0 or slot in self._writing else slot

    def _ready(self, digest: Hashable) -> bool:
        """The policy's ``is_ready``: its keys are digests."""
        return self._readable(cast(int, digest)) >= 0

    def _length(self, slot: int) -> int:
        return self._short.get(slot, self.geometry.block_bytes)

    def _drop(self, digest: int, slot: int, *, evictable: bool) -> None:
        """Forget a block (deleted, or its value refused): freed now, or after its reads."""
        self._index.pop(digest)
        if evictable:
            self._policy.mark_unevictable(digest)
        self._policy.remove(digest)
        self._erase_record(slot)
        if slot in self._pins:
            self._doomed.add(slot)
        else:
            self._free_slot(slot)

    def _free_slot(self, slot: int) -> None:
        self._short.pop(slot, None)
        self._free.append(slot)

    def _erase_record(self, slot: int) -> None:
        try:
            os.pwrite(self._records, layout.EMPTY_RECORD, slot * layout.RECORD_BYTES)
            self._counts["deleted_records"] += 1
        except OSError as error:  # it may come back after a restart: a valid block, or a miss
            self._failed(error)

    def _failed(self, error: OSError) -> None:
        self._counts["disk_full" if error.errno in _FULL else "io_errors"] += 1
        self._last_error = f"{errno.errorcode.get(error.errno or 0, 'OSError')}: {error}"

    # -- writes --------------------------------------------------------------------------

    def _put(self, identities: list[bytes], payloads: list[memoryview]) -> list[bool]:
        # The last value of a key given twice is the one written (as a server's MSET).
        last = {layout.digest_of(ident): i for i, ident in enumerate(identities)}
        with self._lock:
            self._counts.update(put_calls=1, keys_offered=len(identities))
            writes = self._plan_writes(last, payloads)
        outcome, unchanged = self._write(writes, identities, payloads) if writes else ({}, set())
        with self._lock:
            self._finish_writes(writes, outcome, unchanged, payloads)
        stored = {digest: outcome.get(slot, False) for slot, (digest, _, _) in writes.items()}
        done = [stored.get(layout.digest_of(ident), False) for ident in identities]
        with self._lock:
            self._counts.update(keys_stored=sum(done), keys_not_stored=len(done) - sum(done))
        return done

    def _plan_writes(
        self, last: dict[int, int], payloads: list[memoryview]
    ) -> dict[int, tuple[int, int, bool]]:
        """Under the lock: a slot for each block to write, ``slot -> (digest, position,
        fresh)``; victims evicted, slots marked as being written."""
        writes: dict[int, tuple[int, int, bool]] = {}
        new: list[tuple[int, int]] = []
        # A first offer is written into free room (it pushes nothing out); once the disk is
        # full, a block must come back to displace another (the admission rule).
        room = len(self._free) + (self.slots - self._fresh)
        for digest, position in last.items():
            slot = self._index.get(digest)
            if slot >= 0:
                if slot in self._writing or slot in self._pins:
                    self._counts["busy"] += 1
                    continue
                self._policy.mark_unevictable(digest)
                self._rewriting += 1
                self._writing.add(slot)
                writes[slot] = (digest, position, False)
            elif digest in self._incoming:
                self._counts["busy"] += 1
            elif self._admission.offer(digest) or len(new) < room:
                new.append((digest, position))
            else:
                self._counts["not_admitted"] += 1
        need = len(new) - room
        if need > 0:
            evictable = len(self._index) - (len(self._pins) - len(self._doomed)) - self._rewriting
            victims = self._policy.choose_victims(max(0, min(need, evictable)), ()) or []
            self._policy.evict(victims)
            for victim in victims:
                self._free_slot(self._index.pop(cast(int, victim)))
            self._counts["evictions"] += len(victims)
        placed: list[int] = []
        for digest, position in new:
            if self._free:
                slot = self._free.pop()
            elif self._fresh < self.slots:
                slot, self._fresh = self._fresh, self._fresh + 1
            else:
                self._counts["no_room"] += 1
                continue
            self._writing.add(slot)
            self._incoming.add(digest)
            writes[slot] = (digest, position, True)
            placed.append(digest)
        self._policy.insert_each(placed)
        return writes

    def _write(
        self,
        writes: dict[int, tuple[int, int, bool]],
        identities: list[bytes],
        payloads: list[memoryview],
    ) -> tuple[dict[int, bool], set[int]]:
        """Without the lock: each slot's header and bytes, then its record; ``slot -> ok``,
        and the slots found holding these very bytes already (not written again)."""
        started = time.perf_counter()
        order = sorted(writes)
        nbytes = sum(payloads[writes[slot][1]].nbytes for slot in order)
        results: dict[int, bool] = {}
        unchanged: set[int] = set()

        def work(part: list[int]) -> tuple[dict[int, bool], set[int]]:
            return self._write_part(part, writes, identities, payloads)

        for done, same in self._threads.run(self._threads.split(order, nbytes), work):
            results.update(done)
            unchanged |= same
        with self._lock:
            self._seconds["write"] += time.perf_counter() - started
        return results, unchanged

    def _write_part(
        self,
        part: list[int],
        writes: dict[int, tuple[int, int, bool]],
        identities: list[bytes],
        payloads: list[memoryview],
    ) -> tuple[dict[int, bool], set[int]]:
        geometry = self.geometry
        heads = page_aligned(len(part) * layout.HEAD_BYTES)
        results: dict[int, bool] = {}
        unchanged: set[int] = set()
        runs: list[list[tuple[int, int, bytes]]] = []  # adjacent slots: (slot, n, record)
        with self._lock:  # this part's sequence numbers, in one go
            first_seq, self._seq = self._seq, self._seq + len(part)
        header, total_of, epoch = self._format.header, self._sum, self._epoch
        for n, slot in enumerate(part):
            digest, position, fresh = writes[slot]
            payload = payloads[position]
            head = header(identities[position], payload)
            total = total_of(head, payload)
            if not fresh and total == self._sums[slot] and payload.nbytes == self._length(slot):
                results[slot] = True  # the same bytes are there: nothing to write
                unchanged.add(slot)
                continue
            at = n * layout.HEAD_BYTES
            heads[at : at + len(head)] = head
            record = layout.pack_record(digest, first_seq + n, total, payload.nbytes, slot, epoch)
            if runs and runs[-1][-1][0] == slot - 1:
                runs[-1].append((slot, n, record))
            else:
                runs.append([(slot, n, record)])
            self._sums[slot] = total
        for run in runs:
            pieces: list[memoryview] = []
            for slot, n, _ in run:
                payload = payloads[writes[slot][1]]
                pieces.append(heads[n * layout.HEAD_BYTES : (n + 1) * layout.HEAD_BYTES])
                pieces.append(payload)
                pad = layout.round_up(geometry.block_bytes) - payload.nbytes
                if pad:
                    pieces.append(self._zeros[: pad % layout.ALIGN or layout.ALIGN])
                    pieces += [self._zeros] * ((pad - 1) // layout.ALIGN)
            first = run[0][0]
            try:
                self._file.write(geometry.offset(first), pieces)
                # The record after the bytes: a crash between the two leaves a record that
                # names the slot's previous block, whose read is then refused.
                os.pwrite(
                    self._records,
                    b"".join(record for _, _, record in run),
                    first * layout.RECORD_BYTES,
                )
            except OSError as error:
                with self._lock:
                    self._failed(error)
                results.update((slot, False) for slot, _, _ in run)
                continue
            results.update((slot, True) for slot, _, _ in run)
        return results, unchanged

    def _sum(self, head: bytes, payload: memoryview) -> int:
        """What tells one block's bytes from another's: a plain header's checksum (it covers
        the payload), else a hash of the payload."""
        if self._format.authenticated:
            return xxhash.xxh3_64_intdigest(payload)
        return int.from_bytes(head[32:40], "little")

    def _finish_writes(
        self,
        writes: dict[int, tuple[int, int, bool]],
        outcome: dict[int, bool],
        unchanged: set[int],
        payloads: list[memoryview],
    ) -> None:
        written = 0
        self._counts["rewrites_skipped"] += len(unchanged)
        touched: list[int] = []
        for slot, (digest, position, fresh) in writes.items():
            self._writing.discard(slot)
            if fresh:
                self._incoming.discard(digest)
            length = payloads[position].nbytes
            if outcome.get(slot, False):
                if length == self.geometry.block_bytes:
                    self._short.pop(slot, None)
                else:
                    self._short[slot] = length
                if fresh:
                    self._index.set(digest, slot)
                else:
                    self._rewriting -= 1
                    touched.append(digest)
                self._policy.mark_evictable(digest)
                written += 0 if slot in unchanged else length
                continue
            # Failed: the slot's bytes are unknown now; its block is gone.
            if not fresh:
                self._rewriting -= 1
                self._index.pop(digest)
            self._policy.remove(digest)
            self._free_slot(slot)
        if touched:
            self._policy.touch(touched, self._ready)
        self._counts["bytes_sent"] += written

    # -- reads ---------------------------------------------------------------------------

    def _read(
        self,
        identities: list[bytes],
        targets: list[memoryview] | None,
        found: list[memoryview | None],
    ) -> None:
        """Read each key's block into ``targets`` (or into memory of its own); ``found``
        receives the payload views of the blocks accepted."""
        reads: list[tuple[int, int, int]] = []  # (slot, position, digest)
        with self._lock:
            self._counts.update(get_calls=1, keys_requested=len(identities))
            hits: list[int] = []
            for position, ident in enumerate(identities):
                digest = layout.digest_of(ident)
                slot = self._readable(digest)
                if slot < 0:
                    self._counts["misses"] += 1
                    continue
                if targets is not None and targets[position].nbytes != self._length(slot):
                    # A block of another size: the namespace did not describe the block size.
                    self._counts.update(rejected=1, rejected_length=1)
                    continue
                pins = self._pins.get(slot, 0)
                if not pins:
                    self._policy.mark_unevictable(digest)
                self._pins[slot] = pins + 1
                reads.append((slot, position, digest))
                hits.append(digest)
            self._policy.touch(hits, self._ready)
            lengths = [self._length(slot) for slot, _, _ in reads]
        if not reads:
            return
        started = time.perf_counter()
        if targets is None:
            spans = [layout.round_up(length) for length in lengths]
            memory = page_aligned(sum(spans))
            offsets = [0, *itertools.accumulate(spans)][:-1]
            into = [memory[at : at + length] for at, length in zip(offsets, lengths, strict=True)]
        else:
            into = [targets[position] for _, position, _ in reads]
        by_slot = sorted(range(len(reads)), key=lambda n: reads[n][0])
        nbytes = sum(lengths)
        verdicts: dict[int, Rejection | None] = {}
        for part in self._threads.run(
            self._threads.split(by_slot, nbytes),
            lambda part: self._read_part(part, reads, into, identities),
        ):
            verdicts.update(part)
        with self._lock:
            self._seconds["read"] += time.perf_counter() - started
            for n, (slot, position, digest) in enumerate(reads):
                verdict = verdicts[n]
                pins = self._pins.pop(slot) - 1
                if pins:
                    self._pins[slot] = pins
                if verdict is None:
                    self._counts["hits"] += 1
                    self._counts["bytes_received"] += into[n].nbytes
                    found[position] = into[n] if targets is not None else into[n].toreadonly()
                    if not pins and slot not in self._doomed:
                        self._policy.mark_evictable(digest)
                else:
                    self._counts.update({"rejected": 1, f"rejected_{verdict.value}": 1})
                    if self._index.get(digest) == slot:
                        self._drop(digest, slot, evictable=False)
                if not pins and slot in self._doomed:
                    self._doomed.discard(slot)
                    self._free_slot(slot)

    def _read_part(
        self,
        part: list[int],
        reads: list[tuple[int, int, int]],
        into: list[memoryview],
        identities: list[bytes],
    ) -> dict[int, Rejection | None]:
        """Read one part's blocks, a run of adjacent slots per system call, and check each."""
        geometry = self.geometry
        heads = page_aligned(len(part) * layout.HEAD_BYTES)
        runs: list[list[int]] = []
        for n in part:
            if runs and reads[runs[-1][-1]][0] + 1 == reads[n][0]:
                runs[-1].append(n)
            else:
                runs.append([n])
        verdicts: dict[int, Rejection | None] = {}
        where = {n: k for k, n in enumerate(part)}
        for run in runs:
            pieces: list[memoryview] = []
            wanted: list[int] = []  # bytes each block needs read, header page included
            for n in run:
                k = where[n]
                pieces.append(heads[k * layout.HEAD_BYTES : (k + 1) * layout.HEAD_BYTES])
                pieces.append(into[n])
                pad = layout.round_up(geometry.block_bytes) - into[n].nbytes
                wanted.append(layout.HEAD_BYTES + into[n].nbytes)
                if pad and n != run[-1]:
                    pieces.append(self._sink[: pad % layout.ALIGN or layout.ALIGN])
                    pieces += [self._sink] * ((pad - 1) // layout.ALIGN)
            try:
                got = self._file.read(geometry.offset(reads[run[0]][0]), pieces)
            except OSError as error:
                with self._lock:
                    self._failed(error)
                got = 0
            for n, need in zip(run, wanted, strict=True):
                k = where[n]
                if got < need:
                    verdict: Rejection | None = Rejection.LENGTH  # the file was cut short
                else:
                    head = heads[k * layout.HEAD_BYTES : (k + 1) * layout.HEAD_BYTES]
                    verdict = self._format.check(identities[reads[n][1]], head, into[n])
                if verdict is not None:
                    into[n][:] = bytes(into[n].nbytes)  # no refused byte is left for anyone
                verdicts[n] = verdict
                got -= geometry.slot_bytes
        return verdicts
