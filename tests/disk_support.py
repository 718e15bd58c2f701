"""What the disk tier's tests share: stores on a test's directory, block contents that say
whose they are, the stats' accounting, and the bytes a directory takes on the disk."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from kvoffload.tiers.disk_layout import HEAD_BYTES, RECORD_BYTES, RESERVED_BYTES, round_up
from kvoffload.tiers.disk_store import DiskStore
from tests.remote_support import assert_accounted as assert_accounted  # one count for every store

LAYOUT = {"model": "tiny-llama", "dtype": "bfloat16", "block_tokens": 16, "layers": 2}
SECRET = "a tenant's secret of more than sixteen bytes"
BLOCK = 8192  # two pages: O_DIRECT-able


def capacity_for(blocks: int, block_bytes: int = BLOCK) -> int:
    """The capacity_bytes that holds exactly ``blocks`` blocks."""
    return RESERVED_BYTES + blocks * (HEAD_BYTES + round_up(block_bytes, 4096) + RECORD_BYTES)


def disk_store(path: Path, blocks: int = 8, block_bytes: int = BLOCK, **options: Any) -> DiskStore:
    options.setdefault("namespace", LAYOUT)
    options.setdefault("admission", "every-offer")
    return DiskStore(
        path, capacity_bytes=capacity_for(blocks, block_bytes), block_bytes=block_bytes, **options
    )


def content(key: int, size: int = BLOCK, version: int = 0) -> bytes:
    """The bytes of ``key``'s block (its ``version``): the key and version in the first 16
    bytes, then bytes that follow from them, so a block can say whose it is."""
    head = key.to_bytes(8, "little") + version.to_bytes(8, "little")
    body = hashlib.shake_128(head).digest(max(0, size - 16))
    return (head + body)[:size]


def whose(block: bytes) -> tuple[int, int] | None:
    """``(key, version)`` of a block that is exactly :func:`content`'s, else None."""
    if len(block) < 16:
        return None
    key, version = int.from_bytes(block[:8], "little"), int.from_bytes(block[8:16], "little")
    return (key, version) if block == content(key, len(block), version) else None


def bytes_on_disk(path: Path) -> int:
    """What the directory takes on its file system: allocated blocks, itself included."""
    total = os.stat(path).st_blocks * 512
    for entry in os.scandir(path):
        total += entry.stat().st_blocks * 512
    return total


def listing(path: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``path``: its size and modification time (nothing changed: equal)."""
    if not path.exists():
        return {}
    return {
        entry.name: (entry.stat().st_size, entry.stat().st_mtime_ns) for entry in os.scandir(path)
    }
