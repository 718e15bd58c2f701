"""The disk tier on real files: the RemoteStore contract, the capacity, the eviction order
and the admission rule, a restart, and every value changed behind its back refused.

Each test has a directory of its own (``tmp_path``); faults that need other processes or
file systems are in tests/test_disk_faults.py.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvoffload.tiers import DiskInUseError, DiskLayoutError, DiskStore, RemoteStore
from kvoffload.tiers import disk_layout as layout
from kvoffload.tiers.store import StoreClosedError
from kvoffload.tiers.values import encode_key
from kvoffload_spec.errors import InvalidArgumentError
from tests.disk_support import (
    BLOCK,
    LAYOUT,
    SECRET,
    assert_accounted,
    bytes_on_disk,
    capacity_for,
    content,
    disk_store,
    listing,
)

FORMATS = [pytest.param(None, id="plain"), pytest.param(SECRET, id="sealed")]


def aligned_rows(count: int, size: int) -> np.ndarray:
    """``count`` rows of ``size`` bytes, page-aligned (as a CPU pool's blocks are)."""
    raw = np.zeros(count * size + 4096, dtype=np.uint8)
    skip = -raw.ctypes.data % 4096
    return raw[skip : skip + count * size].reshape(count, size)


# -- the contract --------------------------------------------------------------------------


@pytest.mark.parametrize("secret", FORMATS)
@pytest.mark.parametrize("size", [BLOCK, 5000])
def test_blocks_round_trip_byte_exact(tmp_path: Path, secret: str | None, size: int) -> None:
    store = disk_store(tmp_path / "disk", blocks=16, block_bytes=size, secret=secret)
    assert isinstance(store, RemoteStore)
    keys = list(range(12))
    values = [content(key, size) for key in keys]
    assert store.put(keys, values) == [True] * 12
    assert [view is not None and view.tobytes() for view in store.get(keys)] == values
    rows = aligned_rows(12, size)
    assert store.get_into(keys, list(rows)) == [True] * 12
    assert [row.tobytes() for row in rows] == values
    assert store.contains([*keys, 99]) == [True] * 12 + [False]
    stats = store.stats()
    assert stats.hits == 24 and stats.keys_stored == 12 and stats.blocks == 12
    assert stats.bytes_copied == 0  # get_into read straight into the rows
    assert_accounted(stats)
    store.close()


def test_aligned_buffers_go_through_o_direct_where_the_file_system_takes_it(
    tmp_path: Path,
) -> None:
    store = disk_store(tmp_path / "disk", blocks=4)
    rows = aligned_rows(4, BLOCK)
    rows[:] = np.frombuffer(b"".join(content(k) for k in range(4)), np.uint8).reshape(4, BLOCK)
    assert store.put(list(range(4)), list(rows)) == [True] * 4
    into = aligned_rows(4, BLOCK)
    assert store.get_into(list(range(4)), list(into)) == [True] * 4
    assert np.array_equal(into, rows)
    # ext4, xfs, btrfs take O_DIRECT; tmpfs does not: then the store is buffered, and says so.
    probe = os.open(tmp_path / "probe", os.O_RDWR | os.O_CREAT)
    os.close(probe)
    try:
        os.close(os.open(tmp_path / "probe", os.O_RDWR | os.O_DIRECT))
        takes_direct = True
    except OSError:
        takes_direct = False
    assert store.stats().direct is takes_direct
    store.close()


def test_misses_leave_buffers_untouched_and_are_counted(tmp_path: Path) -> None:
    store = disk_store(tmp_path / "disk")
    store.put([1], [content(1)])
    buffers = [bytearray(b"\x5a" * BLOCK), bytearray(b"\x5a" * (BLOCK - 1))]
    assert store.get_into([2, 1], buffers) == [False, False]  # absent; another size
    assert buffers == [bytearray(b"\x5a" * BLOCK), bytearray(b"\x5a" * (BLOCK - 1))]
    assert store.get([2]) == [None]
    stats = store.stats()
    assert (stats.misses, stats.rejected_length) == (2, 1)
    assert_accounted(stats)
    store.close()


def test_delete_and_a_closed_store(tmp_path: Path) -> None:
    store = disk_store(tmp_path / "disk")
    store.put([1, 2], [content(1), content(2)])
    assert store.delete([1, 1, 3]) == [True, False, False]
    assert store.contains([1, 2]) == [False, True]
    store.close()
    store.close()  # idempotent
    for call in (
        lambda: store.get([2]),
        lambda: store.put([2], [content(2)]),
        lambda: store.contains([2]),
        lambda: store.delete([2]),
    ):
        with pytest.raises(StoreClosedError):
            call()
    reopened = disk_store(tmp_path / "disk")  # a deletion lasts across a restart
    assert reopened.contains([1, 2]) == [False, True]
    reopened.close()


def test_bad_calls_raise_before_anything_is_written(tmp_path: Path) -> None:
    store = disk_store(tmp_path / "disk")
    before = listing(tmp_path / "disk")
    bad: list[Callable[[], object]] = [
        lambda: store.put("ab", [b"x", b"y"]),
        lambda: store.put([1], [content(1), content(2)]),
        lambda: store.put([1], ["text"]),  # type: ignore[list-item]
        lambda: store.put([1], [bytes(BLOCK + 1)]),
        lambda: store.put([object()], [content(1)]),
        lambda: store.get_into([1], [bytes(BLOCK)]),  # type: ignore[list-item]
        lambda: store.get_into([1, 2], [bytearray(BLOCK)]),
        lambda: store.get(b"key"),
    ]
    for call in bad:
        with pytest.raises(InvalidArgumentError):
            call()
    assert listing(tmp_path / "disk") == before
    stats = store.stats()
    assert (stats.put_calls, stats.get_calls, stats.keys_offered) == (0, 0, 0)
    store.close()


# -- bounded -------------------------------------------------------------------------------


def test_the_capacity_holds_on_the_disk_and_in_blocks(tmp_path: Path) -> None:
    capacity = capacity_for(10) + 5000  # not a whole number of blocks
    store = DiskStore(
        tmp_path / "disk", capacity_bytes=capacity, namespace=LAYOUT, block_bytes=BLOCK,
        admission="every-offer",
    )  # fmt: skip
    assert store.slots == 10
    for start in range(0, 60, 7):
        keys = list(range(start, start + 7))
        assert store.put(keys, [content(key) for key in keys]) == [True] * 7
        assert store.stats().blocks <= 10
        assert bytes_on_disk(tmp_path / "disk") <= capacity
    stats = store.stats()
    assert stats.blocks == 10 and stats.evictions == 63 - 10
    assert_accounted(stats)
    store.close()


def test_eviction_is_least_recently_used_first(tmp_path: Path) -> None:
    store = disk_store(tmp_path / "disk", blocks=4)
    store.put([0, 1, 2, 3], [content(k) for k in range(4)])
    store.get([0])  # a read makes a block recent
    store.put([4, 5], [content(4), content(5)])
    assert store.contains([0, 1, 2, 3, 4, 5]) == [True, False, False, True, True, True]
    store.close()


def test_a_put_larger_than_the_disk_stores_what_fits(tmp_path: Path) -> None:
    store = disk_store(tmp_path / "disk", blocks=3)
    assert store.put(list(range(5)), [content(k) for k in range(5)]) == [True] * 3 + [False] * 2
    assert store.stats().no_room == 2
    store.close()


def test_a_block_stored_again_with_its_bytes_is_not_rewritten(tmp_path: Path) -> None:
    store = disk_store(tmp_path / "disk")
    store.put([1], [content(1)])
    sent = store.stats().bytes_sent
    assert store.put([1], [content(1)]) == [True]
    assert (store.stats().rewrites_skipped, store.stats().bytes_sent) == (1, sent)
    assert store.put([1], [content(1, version=2)]) == [True]  # other bytes: written
    assert bytes(store.get([1])[0] or b"") == content(1, version=2)
    store.close()


def test_second_offer_admission_keeps_a_cold_scan_from_flushing_the_disk(
    tmp_path: Path,
) -> None:
    """First offers fill free room; once the disk is full, a block must come back to
    displace another: a scan of blocks offered once each leaves the warm set alone."""
    store = disk_store(tmp_path / "disk", blocks=32, admission="second-offer")
    warm = list(range(32))
    assert store.put(warm, [content(k) for k in warm]) == [True] * 32  # free room
    cold = list(range(1000, 1200))
    assert store.put(cold, [content(k) for k in cold]).count(True) <= 10  # Bloom false hits
    assert store.contains(warm).count(True) >= 32 - 10
    assert store.stats().not_admitted >= 190
    again = cold[-8:]  # offered again within the window: now they come in
    assert store.put(again, [content(k) for k in again]) == [True] * 8
    every = disk_store(tmp_path / "every", blocks=32, admission="every-offer")
    every.put(warm, [content(k) for k in warm])
    every.put(cold, [content(k) for k in cold])
    assert not any(every.contains(warm))  # without admission the scan flushed it
    store.close()
    every.close()


# -- restart -------------------------------------------------------------------------------


@pytest.mark.parametrize("secret", FORMATS)
def test_a_restart_finds_the_blocks_in_their_order(tmp_path: Path, secret: str | None) -> None:
    store = disk_store(tmp_path / "disk", blocks=6, secret=secret)
    store.put([0, 1, 2, 3], [content(k) for k in range(4)])
    store.put([1], [content(1, version=1)])  # rewritten: now the most recent
    store.delete([2])
    store.close()
    store = disk_store(tmp_path / "disk", blocks=6, secret=secret)
    stats = store.stats()
    assert (stats.opened_blocks, stats.open_refused_records) == (3, 0)
    # The order of the writes came back: 0 the oldest, then 3, then 1 (written again).
    store.put([10, 11, 12, 13], [content(k) for k in range(10, 14)])  # one eviction
    assert store.contains([0, 1, 3]) == [False, True, True]
    assert [v and v.tobytes() for v in store.get([1, 2, 3])] == [
        content(1, version=1), None, content(3),
    ]  # fmt: skip
    store.close()


def test_a_smaller_capacity_holds_from_the_first_call(tmp_path: Path) -> None:
    store = disk_store(tmp_path / "disk", blocks=10)
    store.put(list(range(10)), [content(k) for k in range(10)])
    store.close()
    store = disk_store(tmp_path / "disk", blocks=4)
    stats = store.stats()
    assert (stats.opened_blocks, stats.open_dropped_beyond_capacity) == (4, 6)
    assert bytes_on_disk(tmp_path / "disk") <= capacity_for(4)
    assert store.put([20], [content(20)]) == [True] and store.stats().blocks == 4
    store.close()


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"block_bytes": 4096}, DiskLayoutError),
        ({"namespace": {**LAYOUT, "layers": 3}}, DiskLayoutError),
        ({"secret": SECRET}, DiskLayoutError),
    ],
)
def test_a_directory_of_another_layout_is_refused_untouched(
    tmp_path: Path, change: dict[str, object], error: type[Exception]
) -> None:
    store = disk_store(tmp_path / "disk")
    store.put([1], [content(1)])
    store.close()
    before = listing(tmp_path / "disk")
    options: dict[str, object] = {"namespace": LAYOUT, "block_bytes": BLOCK, **change}
    with pytest.raises(error):
        DiskStore(tmp_path / "disk", capacity_bytes=capacity_for(8), **options)  # type: ignore[arg-type]
    assert listing(tmp_path / "disk") == before


def test_another_secret_is_refused(tmp_path: Path) -> None:
    disk_store(tmp_path / "disk", secret=SECRET).close()
    with pytest.raises(DiskLayoutError):
        disk_store(tmp_path / "disk", secret=SECRET + " but another")


def test_bad_places_and_sizes_raise_before_anything_is_written(tmp_path: Path) -> None:
    (tmp_path / "a file").write_bytes(b"x")
    (tmp_path / "not ours").mkdir()
    (tmp_path / "not ours" / "notes.txt").write_text("mine")
    cases: list[tuple[Path, dict[str, object]]] = [
        (tmp_path / "a file", {}),
        (tmp_path / "no" / "parent", {}),
        (tmp_path / "not ours", {}),
        (tmp_path / "new", {"capacity_bytes": capacity_for(1) - 1}),
        (tmp_path / "new", {"block_bytes": None}),
        (tmp_path / "new", {"block_bytes": 0}),
        (tmp_path / "new", {"capacity_bytes": True}),
        (tmp_path / "new", {"admission": "sometimes"}),
        (tmp_path / "new", {"policy": "no-such-policy"}),
        (tmp_path / "new", {"io_threads": 0}),
        (tmp_path / "new", {"direct": "yes"}),
        (tmp_path / "new", {"secret": "short"}),
        (tmp_path / "new", {"namespace": ""}),
    ]
    for path, change in cases:
        before = {p.name: listing(p) for p in tmp_path.iterdir() if p.is_dir()}
        options: dict[str, object] = {
            "capacity_bytes": capacity_for(4), "namespace": LAYOUT, "block_bytes": BLOCK,
            **change,
        }  # fmt: skip
        with pytest.raises(InvalidArgumentError):
            DiskStore(path, **options)  # type: ignore[arg-type]
        assert {p.name: listing(p) for p in tmp_path.iterdir() if p.is_dir()} == before, change
        assert not (tmp_path / "new").exists(), change
    assert (tmp_path / "a file").read_bytes() == b"x"


def test_damaged_metadata_is_refused(tmp_path: Path) -> None:
    disk_store(tmp_path / "disk").close()
    meta = tmp_path / "disk" / layout.META_NAME
    meta.write_bytes(meta.read_bytes().replace(b'"block_bytes": 8192', b'"block_bytes": 8193'))
    with pytest.raises(DiskLayoutError, match="damaged"):
        disk_store(tmp_path / "disk")


def test_a_second_store_on_the_same_directory_is_refused(tmp_path: Path) -> None:
    first = disk_store(tmp_path / "disk")
    with pytest.raises(DiskInUseError):
        disk_store(tmp_path / "disk")
    first.close()
    disk_store(tmp_path / "disk").close()  # free again


# -- changed behind the store's back ---------------------------------------------------------


def slot_of(store: DiskStore, key: int) -> int:
    digest = layout.digest_of(layout.identity(store.value_format, encode_key(key)))
    return store._index.get(digest)


@pytest.mark.parametrize("secret", FORMATS)
def test_a_byte_changed_in_a_slot_is_a_miss_with_a_zeroed_buffer(
    tmp_path: Path, secret: str | None
) -> None:
    store = disk_store(tmp_path / "disk", secret=secret)
    store.put([1, 2], [content(1), content(2)])
    data = tmp_path / "disk" / layout.DATA_NAME
    for key, offset in ((1, layout.HEAD_BYTES + 100), (2, 30)):  # the payload; the header
        at = store.geometry.offset(slot_of(store, key)) + offset
        with data.open("r+b") as file:
            file.seek(at)
            byte = file.read(1)
            file.seek(at)
            file.write(bytes([byte[0] ^ 1]))
    buffers = [bytearray(b"\x5a" * BLOCK) for _ in range(2)]
    assert store.get_into([1, 2], buffers) == [False, False]
    assert buffers == [bytearray(BLOCK)] * 2
    stats = store.stats()
    assert stats.rejected == 2 and stats.blocks == 0  # refused blocks are dropped
    assert_accounted(stats)
    store.close()


@pytest.mark.parametrize("secret", FORMATS)
def test_a_record_naming_another_block_is_refused(tmp_path: Path, secret: str | None) -> None:
    """Swap two slots' records: each now names the other's bytes."""
    store = disk_store(tmp_path / "disk", secret=secret)
    store.put([1, 2], [content(1), content(2)])
    one, two = slot_of(store, 1), slot_of(store, 2)
    store.close()
    index = tmp_path / "disk" / layout.INDEX_NAME
    raw = bytearray(index.read_bytes())
    size = layout.RECORD_BYTES
    first, second = raw[one * size : (one + 1) * size], raw[two * size : (two + 1) * size]
    for at, record in ((one, second), (two, first)):
        digest, seq, total, length, _ = layout.RECORD.unpack(record)
        raw[at * size : (at + 1) * size] = layout.pack_record(
            digest, seq, total, length, at, store._epoch
        )
    index.write_bytes(bytes(raw))
    store = disk_store(tmp_path / "disk", secret=secret)
    assert store.get([1, 2]) == [None, None]
    stats = store.stats()
    assert (stats.rejected_mac if secret else stats.rejected_wrong_key) == 2
    store.close()


def test_torn_and_foreign_records_are_refused_at_open_and_counted(tmp_path: Path) -> None:
    store = disk_store(tmp_path / "disk")
    store.put([1, 2, 3], [content(k) for k in (1, 2, 3)])
    two = slot_of(store, 2)
    store.close()
    index = tmp_path / "disk" / layout.INDEX_NAME
    raw = bytearray(index.read_bytes())
    raw[two * layout.RECORD_BYTES + 9] ^= 0xFF  # a torn record
    raw += os.urandom(layout.RECORD_BYTES * 3)  # garbage past the records
    index.write_bytes(bytes(raw))
    store = disk_store(tmp_path / "disk")
    stats = store.stats()
    assert (stats.opened_blocks, stats.open_refused_records) == (2, 3 + 1)
    assert [v is not None for v in store.get([1, 2, 3])] == [True, False, True]
    store.close()


def test_a_slot_file_cut_short_is_refused(tmp_path: Path) -> None:
    store = disk_store(tmp_path / "disk")
    store.put([1, 2, 3], [content(k) for k in (1, 2, 3)])
    data = tmp_path / "disk" / layout.DATA_NAME
    cut = store.geometry.offset(slot_of(store, 3)) + layout.HEAD_BYTES + 10
    os.truncate(data, cut)
    assert [v is not None for v in store.get([1, 2, 3])] == [True, True, False]  # while open
    assert store.stats().rejected_length == 1
    store.close()
    store = disk_store(tmp_path / "disk")  # and at the next open
    assert store.stats().open_refused_truncated == 0  # dropped already: its record erased
    assert store.stats().opened_blocks == 2
    store.close()
    os.truncate(data, store.geometry.offset(1) + 10)
    store = disk_store(tmp_path / "disk")
    assert (store.stats().opened_blocks, store.stats().open_refused_truncated) == (1, 1)
    store.close()


# -- threads -------------------------------------------------------------------------------


@pytest.mark.parametrize("secret", FORMATS)
def test_threads_sharing_a_store_only_ever_read_exact_blocks(
    tmp_path: Path, secret: str | None
) -> None:
    store = disk_store(tmp_path / "disk", blocks=24, secret=secret, io_threads=3)
    wrong: list[object] = []

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(150):
            keys = [int(k) for k in rng.integers(0, 40, size=int(rng.integers(1, 6)))]
            version = int(rng.integers(0, 2))
            if rng.random() < 0.5:
                store.put(keys, [content(k, version=version) for k in keys])
            elif rng.random() < 0.1:
                store.delete(keys)
            else:
                for key, view in zip(keys, store.get(keys), strict=True):
                    if view is not None and view.tobytes() not in (
                        content(key), content(key, version=1),
                    ):  # fmt: skip
                        wrong.append((key, view.tobytes()[:16]))

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []
    stats = store.stats()
    assert_accounted(stats)
    assert stats.hits > 0 and stats.rejected == 0
    store.close()
    reopened = disk_store(tmp_path / "disk", blocks=24, secret=secret)
    for key, view in zip(range(40), reopened.get(list(range(40))), strict=True):
        assert view is None or view.tobytes() in (content(key), content(key, version=1))
    reopened.close()


# -- what is on the disk -------------------------------------------------------------------


def test_a_sealed_directory_holds_no_key_and_no_description(tmp_path: Path) -> None:
    key = b"a prefix hash that names a prompt"
    store = disk_store(tmp_path / "disk", secret=SECRET, namespace={"model": "secret-model"})
    store.put([key], [content(1)])
    store.close()
    everything = b"".join(p.read_bytes() for p in (tmp_path / "disk").iterdir())
    for needle in (key, encode_key(key), b"secret-model", SECRET.encode()):
        assert needle not in everything


# -- memory --------------------------------------------------------------------------------


def reopened_with(path: Path, blocks: int) -> DiskStore:
    """A directory whose index says it holds ``blocks`` blocks of 4 KiB (their slot file a
    sparse one of the full size), opened, with ``tracemalloc`` counting what the open
    allocated; returns the store, its bytes per block in ``store.measured_bytes``."""
    block = 4096
    capacity = capacity_for(blocks, block)
    first = DiskStore(path, capacity_bytes=capacity, namespace=LAYOUT, block_bytes=block)
    epoch = first._epoch
    first.close()
    (path / layout.INDEX_NAME).write_bytes(layout.synthetic_records(blocks, block, epoch))
    os.truncate(path / layout.DATA_NAME, blocks * layout.Geometry(block).slot_bytes)
    import gc
    import tracemalloc

    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        store = DiskStore(path, capacity_bytes=capacity, namespace=LAYOUT)
        gc.collect()
        measured = (tracemalloc.get_traced_memory()[0] - before) / blocks
    finally:
        tracemalloc.stop()
    assert store.stats().opened_blocks == blocks
    store.measured_bytes = measured  # type: ignore[attr-defined]
    return store


def test_ram_per_block_on_the_disk_is_under_200_bytes(tmp_path: Path) -> None:
    store = reopened_with(tmp_path / "disk", 50_000)
    assert store.measured_bytes < 200  # type: ignore[attr-defined]
    store.close()


@pytest.mark.slow
def test_ram_per_block_at_a_million_blocks_is_under_200_bytes(tmp_path: Path) -> None:
    """1M blocks: the index, the eviction order, the sums and the admission filter."""
    store = reopened_with(tmp_path / "disk", 1_000_000)
    assert store.measured_bytes < 200  # type: ignore[attr-defined]
    assert store.get([1]) == [None]  # usable: a miss, not an error
    store.close()
