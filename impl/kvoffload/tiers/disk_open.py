"""Opening a disk tier's directory: what is there, whether it is this tier's, and holding it.

Everything here runs before a store takes anything: a path that cannot be a tier, a block
size or namespace that differs from the files there, a directory another store holds, all
raise (``InvalidArgumentError``, ``DiskLayoutError``, ``DiskInUseError``) with nothing
written, and a directory this open made is removed again when the open fails.
"""

from __future__ import annotations

import os
from array import array
from collections import Counter
from contextlib import suppress
from pathlib import Path

from kvoffload_spec.errors import InvalidArgumentError

from . import disk_layout as layout
from .disk_io import SlotFile
from .values import ValueFormat


def inspect_directory(directory: Path) -> layout.Meta | None:
    """The metadata of the disk tier at ``directory`` (None: a new or empty directory),
    read only: raises for a path that cannot be one."""
    if directory.exists() and not directory.is_dir():
        raise InvalidArgumentError(f"{directory} is a file, not a directory for a disk tier")
    if not directory.exists():
        parent = directory.parent
        if not parent.is_dir():
            raise InvalidArgumentError(
                f"cannot make a disk tier at {directory}: {parent} is not a directory"
            )
        return None
    return layout.read_meta(directory)


def remove_made(directory: Path) -> None:
    """Undo the making of ``directory`` (an open that failed leaves nothing behind)."""
    for name in (layout.LOCK_NAME, layout.META_NAME, layout.DATA_NAME, layout.INDEX_NAME):
        with suppress(OSError):
            (directory / name).unlink()
    with suppress(OSError):
        directory.rmdir()


def check_geometry(
    directory: Path, values: ValueFormat, found: layout.Meta | None, block_bytes: int | None
) -> layout.Geometry:
    """The geometry of the tier at ``directory``: a new one's from ``block_bytes``, an
    existing one's from its metadata, which must be of this namespace and block size."""
    if found is None:
        if block_bytes is None:
            raise InvalidArgumentError(
                "block_bytes is needed to make a new disk tier (it is read from an existing one)"
            )
        return layout.Geometry(block_bytes)
    if block_bytes is not None and block_bytes != found.block_bytes:
        raise layout.DiskLayoutError(
            f"the disk tier in {directory} "
            f"holds blocks of {found.block_bytes:,} bytes, not {block_bytes:,}: give "
            "another directory, or remove this one"
        )
    kind, ident, _ = layout.namespace_of(values)
    if (found.values, found.namespace) != (kind, ident):
        said = "a sealed" if found.values == "sealed" else "a plain"
        raise layout.DiskLayoutError(
            f"the disk tier holds {said} tier's blocks of another namespace"
            + (" or secret" if "sealed" in (kind, found.values) else "")
            + ": give another directory, or remove this one"
        )
    return layout.Geometry(found.block_bytes)


def claim(
    directory: Path, values: ValueFormat, found: layout.Meta | None, geometry: layout.Geometry
) -> tuple[int, layout.Meta, bool]:
    """Make the directory if need be, hold its lock, write its metadata if new."""
    created = False
    if not directory.exists():
        try:
            directory.mkdir(mode=0o700)
        except OSError as error:
            raise InvalidArgumentError(
                f"cannot make the disk tier's directory {directory}: {error.strerror}"
            ) from None
        created = True
    try:
        descriptor = layout.lock(directory)
    except InvalidArgumentError:
        if created:
            remove_made(directory)
        raise
    try:
        # Read again under the lock: another store may have made it meanwhile.
        meta = inspect_directory(directory)
        if meta != found and meta is not None:
            check_geometry(directory, values, meta, geometry.block_bytes)
        if meta is None:
            kind, ident, description = layout.namespace_of(values)
            meta = layout.Meta(
                geometry.block_bytes,
                kind,
                ident,
                description,
                int.from_bytes(os.urandom(8), "little"),
            )
            layout.write_meta(directory, meta)
    except OSError as error:
        os.close(descriptor)
        if created:
            remove_made(directory)
        raise InvalidArgumentError(
            f"cannot write the disk tier's metadata in {directory}: {error.strerror}"
        ) from None
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor, meta, created


def slot_tables(
    found: layout.Recovered, slots: int, block_bytes: int
) -> tuple[array[int], dict[int, int], int, array[int]]:
    """From the blocks found at open: each slot's payload sum, the lengths of payloads
    shorter than a slot, the high-water mark of slots ever used, and the free slots below
    it (the lowest last: taken first, so the files stay compact)."""
    import numpy as np

    sums = np.zeros(slots, dtype=np.uint64)
    sums[found.slots] = found.sums
    short = {
        slot: length
        for slot, length in zip(found.slots.tolist(), found.lengths.tolist(), strict=True)
        if length != block_bytes
    }
    fresh = int(found.slots.max()) + 1 if len(found.slots) else 0
    used = np.zeros(fresh, dtype=bool)
    used[found.slots] = True
    free = array("i", np.flatnonzero(~used)[::-1].astype(np.int32).tobytes())
    return array("Q", sums.tobytes()), short, fresh, free


def open_files(
    directory: Path, direct: bool | None, lock_fd: int, created: bool
) -> tuple[SlotFile, int]:
    """The slot file and the record file of the claimed ``directory``; if either cannot be
    opened, the claim is let go (and a directory this open made, removed) first."""
    try:
        slot_file = SlotFile(str(directory / layout.DATA_NAME), direct=direct)
    except OSError as error:
        _let_go(directory, lock_fd, created)
        raise InvalidArgumentError(
            f"cannot open {directory / layout.DATA_NAME}"
            + (" with O_DIRECT" if direct else "")
            + f": {error.strerror or error}"
        ) from None
    try:
        records = os.open(directory / layout.INDEX_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as error:
        slot_file.close()
        _let_go(directory, lock_fd, created)
        raise InvalidArgumentError(f"cannot open {directory}: {error.strerror}") from None
    return slot_file, records


def _let_go(directory: Path, lock_fd: int, created: bool) -> None:
    os.close(lock_fd)
    if created:
        remove_made(directory)


def recover_files(
    data: int, records: int, epoch: int, geometry: layout.Geometry, slots: int
) -> layout.Recovered:
    """What the slot file ``data`` and the record file ``records`` of a previous process
    hold that this open may take back; then the capacity of this open holds: what lies
    past it is cut off."""
    data_bytes = os.fstat(data).st_size
    index_bytes = os.fstat(records).st_size
    raw = os.pread(records, index_bytes, 0)
    found = layout.recover(raw, epoch=epoch, geometry=geometry, slots=slots, data_bytes=data_bytes)
    if data_bytes > slots * geometry.slot_bytes:
        os.ftruncate(data, slots * geometry.slot_bytes)
    if index_bytes > slots * layout.RECORD_BYTES:
        os.ftruncate(records, slots * layout.RECORD_BYTES)
    return found


def open_counts(found: layout.Recovered) -> Counter[str]:
    """The open's figures, as ``DiskStats`` names them."""
    return Counter(
        opened_blocks=len(found.slots),
        open_refused_records=found.refused_records,
        open_refused_truncated=found.refused_truncated,
        open_refused_duplicates=found.refused_duplicates,
        open_dropped_beyond_capacity=found.dropped_beyond_capacity,
    )


def check_int(name: str, value: object, minimum: int, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"{name} must be an int; got {type(value).__name__}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum:,}]"
        raise InvalidArgumentError(f"{name} must be {bound}; got {value}")


__all__ = [
    "check_geometry",
    "check_int",
    "claim",
    "inspect_directory",
    "open_counts",
    "open_files",
    "recover_files",
    "remove_made",
    "slot_tables",
]
