"""Opening a disk tier's directory: what is there, whether it is this tier's, and holding it.

Everything here runs before a store takes anything: a path that cannot be a tier, a block
size or namespace that differs from the files there, a directory another store holds, all
raise (``InvalidArgumentError``, ``DiskLayoutError``, ``DiskInUseError``) with nothing
written, and a directory this open made is removed again when the open fails.
"""

from __future__ import annotations

import os
from array import array
from contextlib import suppress
from pathlib import Path

from kvoffload_spec.errors import InvalidArgumentError

from . import disk_layout as layout
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


__all__ = ["check_geometry", "claim", "inspect_directory", "remove_made", "slot_tables"]
