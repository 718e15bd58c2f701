"""The files of a disk tier, what each byte of them means, and how they are checked on open.

A disk tier is a directory of four files:

- ``kvoffload-disk.json``: what the blocks are (their size, the value format, the namespace
  or the tenant id, a random *epoch* naming this directory), written once, atomically
  (a temporary file, ``fsync``, ``rename``), checked by its own checksum;
- ``slots``: fixed-size slots, slot ``i`` at ``i * slot_bytes``: a page holding the value's
  header (:mod:`kvoffload.tiers.values`, padded with zeros), then the payload, padded to a
  page. Pages (4 KiB) keep every offset and length aligned for ``O_DIRECT``;
- ``index``: one 32-byte record per slot, at ``32 * i``: which block the slot holds (its
  digest), the write's sequence number, a sum of the payload (to see that a block written
  again is unchanged), its length, and a check of the record's fields, the slot and the
  epoch. A record is a hint, never trusted: a slot's value is checked against the block's
  full identity when it is read, so a record that names the wrong block (torn, stale,
  overwritten) makes a miss, never wrong bytes;
- ``lock``: held with ``flock`` while a store has the directory open: a second store (in
  this process or another) is refused.

A block's *identity*, which its value's header carries (a plain value) or its tag covers (a
sealed value), is a 32-byte BLAKE2b of the block's server key in the value format: the
encoded key for a plain format (so the directory never holds a key in plain text), a keyed
name for a sealed one (so without the secret nobody can tell whether a given prefix is on
the disk). Its first 60 bits are the digest by which the RAM index and the records know it.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import xxhash

from kvoffload.tiers.disk_index import DIGEST_BITS
from kvoffload_spec.errors import InvalidArgumentError

if TYPE_CHECKING:
    import numpy as np

    from kvoffload.tiers.values import ValueFormat

ALIGN = 4096  # every offset and length of the slot file: O_DIRECT's granule on any device
HEAD_BYTES = 4096  # a value's header (72 bytes plain, 60 sealed), in a page of its own
RECORD = struct.Struct("<QQQII")  # digest, sequence, payload sum, payload length, check
RECORD_BYTES = RECORD.size
# Pages not in any slot that the directory still takes on the disk: the directory itself,
# the metadata file, the index file's last page.
RESERVED_BYTES = 3 * 4096

META_NAME = "kvoffload-disk.json"
DATA_NAME = "slots"
INDEX_NAME = "index"
LOCK_NAME = "lock"
OURS = frozenset({META_NAME, DATA_NAME, INDEX_NAME, LOCK_NAME})
FORMAT = "kvoffload disk tier"
VERSION = 1
_DIGEST_MASK = (1 << DIGEST_BITS) - 1
_MASK64 = (1 << 64) - 1
# Odd 64-bit constants (splitmix64's): each field of a record moves every bit of its check.
_C1, _C2, _C3, _C4 = (
    0x9E3779B97F4A7C15,
    0xBF58476D1CE4E5B9,
    0x94D049BB133111EB,
    0xD6E8FEB86659FD93,
)


class DiskInUseError(InvalidArgumentError):
    """Another store (in this process or another) has the directory open."""


class DiskLayoutError(InvalidArgumentError):
    """The directory is not a disk tier this store may open: not one at all, or one of
    another block size, value format or namespace, or its metadata is damaged."""


# -- geometry ----------------------------------------------------------------------------


def round_up(value: int, granule: int = ALIGN) -> int:
    return -(-value // granule) * granule


@dataclass(frozen=True)
class Geometry:
    """Where slot ``i`` and its record lie, for blocks of ``block_bytes``."""

    block_bytes: int

    @property
    def slot_bytes(self) -> int:
        return HEAD_BYTES + round_up(self.block_bytes)

    def slots_for(self, capacity_bytes: int) -> int:
        """How many slots ``capacity_bytes`` of disk hold, with their records and the
        directory's other files."""
        return max(0, (capacity_bytes - RESERVED_BYTES) // (self.slot_bytes + RECORD_BYTES))

    def offset(self, slot: int) -> int:
        return slot * self.slot_bytes


# -- identities --------------------------------------------------------------------------


def identity(value_format: ValueFormat, encoded_key: bytes) -> bytes:
    """The 32 bytes that stand for the block in its value (see the module docstring)."""
    return hashlib.blake2b(
        value_format.server_key(encoded_key), digest_size=32, person=b"kvoffload-disk"
    ).digest()


def digest_of(block_identity: bytes) -> int:
    """The identity's first 60 bits, never 0 (0 marks an empty record)."""
    return (int.from_bytes(block_identity[:8], "little") & _DIGEST_MASK) or 1


def namespace_of(value_format: ValueFormat) -> tuple[str, str, str | None]:
    """``(kind, id, description)`` as the metadata records them: a sealed format's tenant id
    is keyed, and its namespace description is not written at all."""
    tenant = getattr(value_format, "tenant_id", None)
    if isinstance(tenant, bytes):
        return "sealed", tenant.hex(), None
    namespace = value_format.namespace
    return "plain", namespace.fingerprint.hex(), namespace.description


# -- records -----------------------------------------------------------------------------


def record_check(digest: int, seq: int, total: int, length: int, slot: int, epoch: int) -> int:
    """The 32-bit check of a record (the same arithmetic as :func:`record_checks`)."""
    x = digest ^ (seq * _C1) ^ (total * _C2) ^ (((length << 32) | slot) * _C3) ^ epoch
    x &= _MASK64
    x ^= x >> 31
    x = (x * _C4) & _MASK64
    x ^= x >> 29
    return x >> 32


def record_checks(
    digest: np.ndarray,
    seq: np.ndarray,
    total: np.ndarray,
    length: np.ndarray,
    slot: np.ndarray,
    epoch: int,
) -> np.ndarray:
    """:func:`record_check` of whole arrays of records at once (uint32)."""
    import numpy as np

    u64 = np.uint64
    with np.errstate(over="ignore"):
        x = (
            digest.astype(u64)
            ^ (seq.astype(u64) * u64(_C1))
            ^ (total.astype(u64) * u64(_C2))
            ^ (((length.astype(u64) << u64(32)) | slot.astype(u64)) * u64(_C3))
            ^ u64(epoch)
        )
        x ^= x >> u64(31)
        x *= u64(_C4)
        x ^= x >> u64(29)
    checks: np.ndarray = (x >> u64(32)).astype(np.uint32)
    return checks


def record_dtype() -> np.dtype[np.void]:
    import numpy as np

    return np.dtype(
        [("digest", "<u8"), ("seq", "<u8"), ("sum", "<u8"), ("length", "<u4"), ("check", "<u4")]
    )


def pack_record(digest: int, seq: int, total: int, length: int, slot: int, epoch: int) -> bytes:
    return RECORD.pack(
        digest, seq, total, length, record_check(digest, seq, total, length, slot, epoch)
    )


EMPTY_RECORD = bytes(RECORD_BYTES)


@dataclass(frozen=True)
class Recovered:
    """What an open found in the index file: the blocks it takes back (arrays in the order
    of their writes, oldest first) and what it refused, by reason."""

    digests: np.ndarray
    slots: np.ndarray
    sums: np.ndarray
    lengths: np.ndarray
    next_seq: int
    refused_records: int  # a check that fails: torn, overwritten, another directory's
    refused_truncated: int  # the slot lies past the end of the slot file
    refused_duplicates: int  # a digest another, later record holds too
    dropped_beyond_capacity: int  # a slot past the capacity of this open


def recover(
    raw: bytes, *, epoch: int, geometry: Geometry, slots: int, data_bytes: int
) -> Recovered:
    """The blocks ``raw`` (the index file's bytes) says the slot file holds."""
    import numpy as np

    count = len(raw) // RECORD_BYTES
    records = np.frombuffer(raw, dtype=record_dtype(), count=count)
    slot = np.arange(count, dtype=np.uint64)
    used = records["digest"] != 0
    checks = record_checks(
        records["digest"], records["seq"], records["sum"], records["length"], slot, epoch
    )
    sound = (
        (checks == records["check"])
        & (records["length"] <= geometry.block_bytes)
        & (records["digest"] <= _DIGEST_MASK)
    )
    refused = int(np.count_nonzero(used & ~sound))
    good = used & sound
    within = slot < slots
    beyond = int(np.count_nonzero(good & ~within))
    good &= within
    ends = (
        (slot + np.uint64(1)) * np.uint64(geometry.slot_bytes)
        - np.uint64(round_up(geometry.block_bytes))
        + records["length"].astype(np.uint64)
    )
    whole = ends <= np.uint64(data_bytes)
    truncated = int(np.count_nonzero(good & ~whole))
    good &= whole
    at = np.flatnonzero(good)
    order = at[np.argsort(records["seq"][at], kind="stable")]
    # The latest record of a digest wins (two can name one only after a crash cut a move).
    reversed_order = order[::-1]
    _, first = np.unique(records["digest"][reversed_order], return_index=True)
    keep = np.sort(reversed_order[first])
    keep = keep[np.argsort(records["seq"][keep], kind="stable")]
    next_seq = int(records["seq"][at].max()) + 1 if at.size else 1
    return Recovered(
        digests=records["digest"][keep].copy(),
        slots=keep.astype(np.int64),
        sums=records["sum"][keep].copy(),
        lengths=records["length"][keep].copy(),
        next_seq=next_seq,
        refused_records=refused,
        refused_truncated=truncated,
        refused_duplicates=int(order.size - keep.size),
        dropped_beyond_capacity=beyond,
    )


# -- metadata ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Meta:
    """The metadata file's content."""

    block_bytes: int
    values: str  # "plain" or "sealed"
    namespace: str  # the fingerprint (plain) or the tenant id (sealed), hex
    description: str | None  # the namespace's description (plain only)
    epoch: int

    def to_bytes(self) -> bytes:
        body = self._body()
        check = xxhash.xxh3_64_hexdigest(_canonical(body))
        return json.dumps({**body, "check": check}, indent=1, sort_keys=True).encode() + b"\n"

    def _body(self) -> dict[str, object]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "block_bytes": self.block_bytes,
            "head_bytes": HEAD_BYTES,
            "align": ALIGN,
            "values": self.values,
            "namespace": self.namespace,
            "description": self.description,
            "epoch": self.epoch,
        }

    @classmethod
    def parse(cls, raw: bytes, where: Path) -> Meta:
        try:
            found = json.loads(raw)
        except (UnicodeDecodeError, ValueError):
            raise DiskLayoutError(f"{where} is damaged (not JSON): remove the directory") from None
        if not isinstance(found, dict) or found.get("format") != FORMAT:
            raise DiskLayoutError(f"{where} is not a kvoffload disk tier's metadata")
        check = found.pop("check", None)
        if check != xxhash.xxh3_64_hexdigest(_canonical(found)):
            raise DiskLayoutError(f"{where} is damaged (its check fails): remove the directory")
        if (found.get("version"), found.get("head_bytes"), found.get("align")) != (
            VERSION,
            HEAD_BYTES,
            ALIGN,
        ):
            raise DiskLayoutError(
                f"{where} is of another version of the disk tier's layout "
                f"(version {found.get('version')!r}): remove the directory"
            )
        try:
            return cls(
                block_bytes=int(found["block_bytes"]),
                values=str(found["values"]),
                namespace=str(found["namespace"]),
                description=found["description"],
                epoch=int(found["epoch"]),
            )
        except (KeyError, TypeError, ValueError):
            raise DiskLayoutError(f"{where} is damaged (a field is missing)") from None


def _canonical(body: dict[str, object]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def write_meta(directory: Path, meta: Meta) -> None:
    """Write the metadata file whole or not at all."""
    temporary = directory / (META_NAME + ".tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(descriptor, meta.to_bytes())
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
    os.replace(temporary, directory / META_NAME)
    folder = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def read_meta(directory: Path) -> Meta | None:
    """The directory's metadata, or None for an empty directory; raises
    :class:`DiskLayoutError` for a directory that is something else."""
    where = directory / META_NAME
    try:
        raw = where.read_bytes()
    except FileNotFoundError:
        strangers = sorted(
            name
            for name in os.listdir(directory)
            if name not in OURS and name != META_NAME + ".tmp"
        )
        if strangers:
            shown = ", ".join(strangers[:3]) + (", ..." if len(strangers) > 3 else "")
            raise DiskLayoutError(
                f"{directory} is neither empty nor a kvoffload disk tier (it holds {shown}): "
                "give an empty or new directory"
            ) from None
        return None
    except OSError as error:
        raise DiskLayoutError(f"cannot read {where}: {error.strerror}") from None
    return Meta.parse(raw, where)


# -- the lock ----------------------------------------------------------------------------


def lock(directory: Path) -> int:
    """Hold the directory's lock (a file descriptor: closing it releases the lock)."""
    try:
        descriptor = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as error:
        raise InvalidArgumentError(
            f"cannot use {directory} as a disk tier: {error.strerror} (it must be writable)"
        ) from None
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        os.close(descriptor)
        if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise DiskInUseError(
                f"{directory} is in use by another disk store (this process or another): "
                "each engine needs a directory of its own"
            ) from None
        raise InvalidArgumentError(f"cannot lock {directory}: {error.strerror}") from None
    return descriptor


def synthetic_records(blocks: int, block_bytes: int, epoch: int) -> bytes:
    """A record file naming ``blocks`` full blocks in slots 0 to ``blocks - 1`` (random
    digests and sums, each record's check right): what an open of a large tier costs, in
    time and RAM, measured without writing its bytes (the benchmark and the tests)."""
    import numpy as np

    rng = np.random.default_rng(0)
    records = np.zeros(blocks, dtype=record_dtype())
    records["digest"] = rng.integers(1, 1 << 60, size=blocks, dtype=np.uint64)
    records["seq"] = np.arange(1, blocks + 1, dtype=np.uint64)
    records["sum"] = rng.integers(0, 1 << 63, size=blocks, dtype=np.uint64)
    records["length"] = block_bytes
    records["check"] = record_checks(
        records["digest"], records["seq"], records["sum"], records["length"],
        np.arange(blocks, dtype=np.uint64), epoch,
    )  # fmt: skip
    return records.tobytes()
