"""What a disk tier counts: the remote tier's figures and those only a disk has."""

from __future__ import annotations

from dataclasses import dataclass

from kvoffload.tiers.store import RemoteStats


@dataclass(frozen=True)
class DiskStats(RemoteStats):
    """A :class:`RemoteStats` (``server_errors`` are the I/O errors, ``disk_full`` and
    ``io_errors`` added up) with what only a disk tier has."""

    rejected_mac: int = 0  # sealed values whose tag fails (counted in ``rejected`` too)
    blocks: int = 0  # on the disk now
    slots: int = 0  # blocks the capacity holds
    capacity_bytes: int = 0
    not_admitted: int = 0  # first offers, remembered and not written (admission)
    rewrites_skipped: int = 0  # puts of a block held with the same bytes: not written again
    busy: int = 0  # puts of a block being read or written: not stored
    no_room: int = 0  # puts that found every slot pinned or being written
    evictions: int = 0
    deleted_records: int = 0
    disk_full: int = 0  # writes the file system refused: full, over quota or file size limit
    io_errors: int = 0  # other failed reads and writes
    read_seconds: float = 0.0  # in the system calls and checks of reads
    write_seconds: float = 0.0
    direct: bool = False  # O_DIRECT in use for aligned buffers
    opened_blocks: int = 0  # found on the disk when the store opened
    open_refused_records: int = 0  # torn, overwritten or another directory's records
    open_refused_truncated: int = 0  # slots past the end of a slot file cut short
    open_refused_duplicates: int = 0
    open_dropped_beyond_capacity: int = 0
    open_seconds: float = 0.0


__all__ = ["DiskStats"]
