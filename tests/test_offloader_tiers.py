"""The Offloader with tiers in order: a disk tier (real files), then a remote one (a real
Valkey server). Evictions go to every tier, a miss asks them in order, a block a lower tier
served is written to the ones above it, and every byte loaded is the key's own.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvoffload import Offloader
from kvoffload.tiers import DiskStore, ValkeyStore
from kvoffload_spec.errors import InvalidArgumentError
from tests.disk_support import capacity_for
from tests.remote_support import BLOCK_BYTES, LAYOUT, Engine, make_store
from tests.valkey_server import ValkeyServer


def disk(path: Path, blocks: int = 8) -> DiskStore:
    return DiskStore(
        path,
        capacity_bytes=capacity_for(blocks, BLOCK_BYTES),
        namespace=LAYOUT,
        block_bytes=BLOCK_BYTES,
        admission="every-offer",
    )


@pytest.fixture
def closing() -> Iterator[list[Engine | DiskStore | ValkeyStore]]:
    """What a test opened, closed at its end (engines first), whether it passed or not."""
    opened: list[Engine | DiskStore | ValkeyStore] = []
    yield opened
    for thing in sorted(opened, key=lambda item: not isinstance(item, Engine)):
        thing.close()


def test_evictions_go_to_every_tier_and_a_miss_asks_them_in_order(
    tmp_path: Path, valkey_server: ValkeyServer, closing: list[Engine | DiskStore | ValkeyStore]
) -> None:
    remote, other_remote = make_store(valkey_server.url), make_store(valkey_server.url)
    first_disk, second_disk = disk(tmp_path / "first"), disk(tmp_path / "second")
    closing += [remote, other_remote, first_disk, second_disk]
    first = Engine(None, tiers=[first_disk, remote])
    second = Engine(None, cpu_blocks=4, tiers=[second_disk, other_remote])
    closing += [first, second]
    for key in range(4):
        first.store(key)  # 0 and 1 evicted: written to the disk and to the server
    assert first_disk.contains([0, 1]) == [True, True]
    disk_stats, remote_stats = first.offloader.tier_stats()
    assert (disk_stats.written, remote_stats.written) == (2, 2)

    assert first.fetch([0]) == {0: True}  # the disk has it: the server is not asked
    assert [f.tier for f in first.reported if f.fetched] == [0]
    disk_stats, remote_stats = first.offloader.tier_stats()
    assert (disk_stats.fetch_hits, remote_stats.fetch_keys) == (1, 0)

    assert second.fetch([0, 1, 9]) == {0: True, 1: True, 9: False}  # from the server
    assert [(f.plan.keys[0], f.tier) for f in second.reported if f.fetched] == [
        (0, 1), (1, 1), (9, None),
    ]  # fmt: skip
    second.settle()
    assert second_disk.contains([0, 1]) == [True, True]  # promoted to the disk above it
    disk_stats, remote_stats = second.offloader.tier_stats()
    assert (disk_stats.fetch_keys, disk_stats.fetch_misses, disk_stats.promoted) == (3, 3, 2)
    assert (remote_stats.fetch_keys, remote_stats.fetch_hits) == (3, 2)
    assert second.check_ready_bytes([0, 1]) == [0, 1]
    path = second.offloader.remote_stats()
    assert path is not None
    assert (path.fetch_keys, path.fetch_hits, path.fetch_misses) == (3, 2, 1)
    assert path.fetch_hits + path.fetch_misses == path.fetch_keys


def test_blocks_on_the_disk_outlive_the_engine(
    tmp_path: Path, closing: list[Engine | DiskStore | ValkeyStore]
) -> None:
    """An engine writes back to its disk and stops; the next one, on the same directory,
    fetches those blocks byte-exact."""
    store = disk(tmp_path / "disk")
    engine = Engine(None, tiers=[store])
    for key in range(6):
        engine.store(key)  # 0-3 evicted to the disk
    engine.close()
    store.close()
    store = disk(tmp_path / "disk")
    closing.append(store)
    assert store.stats().opened_blocks == 4
    engine = Engine(None, cpu_blocks=4, tiers=[store])
    closing.append(engine)
    assert engine.fetch(range(6)) == {k: k < 4 for k in range(4)}  # no room left after 4
    assert engine.check_ready_bytes(range(6)) == [0, 1, 2, 3]


def test_remote_is_the_shorthand_of_one_tier(
    tmp_path: Path, closing: list[Engine | DiskStore | ValkeyStore]
) -> None:
    store = disk(tmp_path / "disk")
    closing.append(store)
    engine = Engine(store)  # remote=store
    closing.append(engine)
    for key in range(3):
        engine.store(key)
    stats = engine.stats()
    assert stats.written == 1 and stats.store is not None and stats.store.keys_stored == 1
    assert engine.offloader.tier_stats() == [stats]


def test_bad_tiers_raise_before_any_pool(
    tmp_path: Path, closing: list[Engine | DiskStore | ValkeyStore]
) -> None:
    store = disk(tmp_path / "disk")
    closing.append(store)
    cache = torch.zeros(4, BLOCK_BYTES, dtype=torch.uint8)
    for options in (
        {"remote": store, "tiers": [store]},
        {"tiers": store},
        {"tiers": [store, "redis://x"]},
        {"tiers": [store, store]},
        {"tiers": [store], "remote_mode": "write-around"},
    ):
        with pytest.raises(InvalidArgumentError):
            Offloader([cache], num_cpu_blocks=1 << 40, **options)
    empty = Offloader([cache], num_cpu_blocks=2, tiers=[])
    assert empty.remote_stats() is None and empty.tier_stats() == []
    empty.close()
