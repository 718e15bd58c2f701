"""Throughput of the disk tier (``DiskStore``) next to a plain ``os.pwrite``/``os.pread`` loop
of the same bytes on the same file system, in the same run; and what a restart costs.

Both sides move the same blocks between the same page-aligned memory (a CPU pool's) and a
file in the same directory: the store's ``put``/``get_into`` of a batch of blocks (its
headers, checksums, records, index and eviction order included), against one
``os.pwrite``/``os.preadv`` per block at the same offsets (a file of the same size, written
over in place). Buffered, both go through the page cache; with ``O_DIRECT`` (where the file
system takes it) both go to the device. Each sample runs both sides, one right after the
other (which goes first alternates), on new keys (so every put writes: the store skips
rewriting a block it holds with the same bytes); the GB/s figures are the medians of the
samples, the ratio is the median of the samples' own ratios, steadier on a shared machine.
The target is a ratio of 0.80 for the plain format at 64 KiB and 2 MiB blocks; the sealed
format (an AES-GCM tag per value, as on the remote tier) is shown next to it. The ``bound``
column is the ratio the store would reach if hashing every byte once (XXH3, on the calling
thread: the binding holds the GIL) were its only cost: where the file system runs at memory
speed (the page cache), that alone keeps a self-checking store near or under the target.

Then the restart: the store holding the last sample's blocks is closed and opened again
(its index rebuilt from the records), and a directory whose records name 1M blocks (4 KiB
blocks, a sparse slot file) is opened: seconds per GiB of blocks, and the RAM per block of
the rebuilt index (``tracemalloc``; target < 200 bytes).

``python bench/disk_bench.py [--dir DIR]`` prints a table and writes bench/results/disk.json
(DIR: where the files go, default the system's temporary directory: put it on the drive to
measure); ``--json`` prints the JSON instead; ``--quick`` is a smoke run of a few seconds.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvoffload.tiers import DiskStore
from kvoffload.tiers import disk_layout as layout

RESULTS = Path(__file__).resolve().parent / "results"
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
TARGET = 0.80
SECRET = "the disk benchmark's secret, 32+ bytes long"
# (block bytes, blocks per call): 8-16 MiB per call, a few requests' prefixes
CASES = ((64 * KiB, 128), (2 * MiB, 8))
MEMORY_TARGET = 200.0


@dataclass(frozen=True)
class Row:
    mode: str  # buffered or direct
    format: str  # plain or sealed
    operation: str  # put or get
    block_bytes: int
    batch: int
    samples: int
    store_gbps: float
    plain_gbps: float
    ratio: float
    # What the ratio would be if checking the bytes were the store's only cost: the plain
    # loop's time over that time plus one XXH3 pass over the same bytes (on this thread).
    checksum_bound: float
    target: float | None
    met: bool | None


def pool(count: int, size: int, seed: int) -> np.ndarray:
    """``count`` page-aligned rows of ``size`` random bytes (a CPU pool's blocks)."""
    raw = np.empty(count * size + 4096, dtype=np.uint8)
    skip = -raw.ctypes.data % 4096
    rows = raw[skip : skip + count * size].reshape(count, size)
    rows[:] = np.random.default_rng(seed).integers(0, 256, rows.shape, dtype=np.uint8)
    return rows


def capacity(blocks: int, size: int) -> int:
    return layout.RESERVED_BYTES + blocks * (
        layout.HEAD_BYTES + layout.round_up(size) + layout.RECORD_BYTES
    )


def timed(work: Callable[[], object]) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def measure(
    where: Path, mode: str, fmt: str, size: int, batch: int, total: int, samples: int
) -> tuple[list[Row], dict[str, float]]:
    count = max(batch, total // size)
    count -= count % batch
    source = pool(count, size, seed=1)
    target = pool(count, size, seed=2)
    store_dir = where / f"store-{mode}-{fmt}-{size}"
    store = DiskStore(
        store_dir,
        capacity_bytes=capacity(count, size),
        namespace={"disk bench": size},
        secret=SECRET if fmt == "sealed" else None,
        block_bytes=size,
        admission="every-offer",
        direct=mode == "direct",
    )
    plain_path = where / f"plain-{mode}-{size}"
    flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if mode == "direct" else 0)
    plain = os.open(plain_path, flags, 0o600)
    rows = [memoryview(row) for row in source]
    into = [memoryview(row) for row in target]
    # The plain side writes each block where the store puts its payload: same offsets.
    slot_bytes = layout.Geometry(size).slot_bytes

    def plain_put() -> None:
        for i, row in enumerate(rows):
            os.pwrite(plain, row, i * slot_bytes)

    def plain_get() -> None:
        for i, row in enumerate(into):
            os.preadv(plain, [row], i * slot_bytes)

    ratios: dict[str, list[float]] = {"put": [], "get": []}
    bounds: dict[str, list[float]] = {"put": [], "get": []}

    def checksums() -> None:
        for row in rows:
            xxhash.xxh3_64_intdigest(row)

    speeds: dict[str, list[tuple[float, float]]] = {"put": [], "get": []}
    for sample in range(samples + 1):  # the first sample warms up (files grow), not counted
        keys = [(sample, i) for i in range(count)]

        def store_put(keys: list[tuple[int, int]] = keys) -> None:
            for start in range(0, count, batch):
                done = store.put(keys[start : start + batch], rows[start : start + batch])
                assert all(done), "a put failed"

        def store_get(keys: list[tuple[int, int]] = keys) -> None:
            for start in range(0, count, batch):
                found = store.get_into(keys[start : start + batch], into[start : start + batch])
                assert all(found), "a get missed"

        for operation, ours, theirs in (
            ("put", store_put, plain_put),
            ("get", store_get, plain_get),
        ):
            if sample % 2:
                mine, other = timed(ours), timed(theirs)
            else:
                other, mine = timed(theirs), timed(ours)
            if sample:
                nbytes = count * size
                speeds[operation].append((nbytes / mine / 1e9, nbytes / other / 1e9))
                ratios[operation].append(other / mine)
                bounds[operation].append(other / (other + timed(checksums)))
        assert np.array_equal(source, target), "the bytes read back differ"
    result = []
    for operation in ("put", "get"):
        store_gbps = statistics.median(s for s, _ in speeds[operation])
        plain_gbps = statistics.median(p for _, p in speeds[operation])
        ratio = statistics.median(ratios[operation])
        aimed = TARGET if fmt == "plain" else None
        met = None if aimed is None else ratio >= aimed
        bound = statistics.median(bounds[operation])
        row = (mode, fmt, operation, size, batch, samples, store_gbps, plain_gbps, ratio, bound)
        result.append(Row(*row, aimed, met))
    direct = store.stats().direct
    store.close()
    os.close(plain)
    secret = SECRET if fmt == "sealed" else None
    reopen = timed(
        lambda: DiskStore(
            store_dir,
            capacity_bytes=capacity(count, size),
            namespace={"disk bench": size},
            secret=secret,
        ).close()
    )
    held = count * size / GiB
    opened = {
        "block_bytes": size,
        "blocks": count,
        "seconds": reopen,
        "seconds_per_gib": reopen / held,
    }
    shutil.rmtree(store_dir)
    plain_path.unlink()
    if mode == "direct" and not direct:
        raise SystemExit(f"O_DIRECT was asked for but not used in {where}")
    return result, opened


def synthetic_open(where: Path, blocks: int) -> dict[str, float]:
    """Open a directory whose records name ``blocks`` blocks of 4 KiB: time and RAM."""
    size = 4096
    path = where / "synthetic"
    first = DiskStore(path, capacity_bytes=capacity(blocks, size), namespace="synthetic",
                      block_bytes=size)  # fmt: skip
    epoch = first._epoch
    first.close()
    (path / layout.INDEX_NAME).write_bytes(layout.synthetic_records(blocks, size, epoch))
    os.truncate(path / layout.DATA_NAME, blocks * layout.Geometry(size).slot_bytes)

    def open_it() -> DiskStore:
        return DiskStore(path, capacity_bytes=capacity(blocks, size), namespace="synthetic")

    seconds = timed(lambda: open_it().close())
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    store = open_it()
    gc.collect()
    per_block = (tracemalloc.get_traced_memory()[0] - before) / blocks
    tracemalloc.stop()
    assert store.stats().opened_blocks == blocks
    store.close()
    shutil.rmtree(path)
    return {
        "blocks": blocks,
        "block_bytes": size,
        "seconds": seconds,
        "microseconds_per_block": seconds / blocks * 1e6,
        "seconds_per_gib": seconds / (blocks * size / GiB),
        "ram_bytes_per_block": per_block,
        "ram_target": MEMORY_TARGET,
        "ram_met": per_block < MEMORY_TARGET,
    }


def file_system(path: Path) -> str:
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts", encoding="utf-8") as mounts:
            for line in mounts:
                _, point, fs, *_ = line.split()
                if str(path.resolve()).startswith(point) and len(point) > len(best):
                    best, kind = point, fs
    except OSError:
        pass
    return kind


def direct_allowed(where: Path) -> bool:
    probe = where / "probe"
    try:
        os.close(os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600))
        return True
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=None, help="where the files go")
    parser.add_argument("--json", action="store_true", help="print the JSON instead")
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    parser.add_argument("--out", type=Path, default=None, help="where to write the JSON")
    args = parser.parse_args(argv)
    where = Path(tempfile.mkdtemp(prefix="kvoffload-disk-bench-", dir=args.dir))
    total, samples, synthetic = (16 * MiB, 2, 20_000) if args.quick else (256 * MiB, 7, 1_000_000)
    try:
        modes = ["buffered"] + (["direct"] if direct_allowed(where) else [])
        rows: list[Row] = []
        opens: list[dict[str, float]] = []
        for mode in modes:
            for fmt in ("plain", "sealed"):
                for size, batch in CASES:
                    found, opened = measure(where, mode, fmt, size, batch, total, samples)
                    rows += found
                    opens.append({"mode": mode, "format": fmt, **opened})  # type: ignore[dict-item]
        memory = synthetic_open(where, synthetic)
        report = {
            "benchmark": "disk",
            "quick": args.quick,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "file_system": file_system(where),
            "bytes_per_sample": total,
            "throughput": [asdict(row) for row in rows],
            "targets_met": all(row.met for row in rows if row.met is not None),
            "reopen": opens,
            "open_1m": memory,
        }
    finally:
        shutil.rmtree(where, ignore_errors=True)
    out = args.out or RESULTS / "disk.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"disk tier vs a plain pwrite/pread loop, {report['file_system']}, "
          f"{total // MiB} MiB per sample, {samples} samples")  # fmt: skip
    print(f"{'mode':9} {'format':7} {'op':4} {'block':>8} {'batch':>5} "
          f"{'store GB/s':>10} {'plain GB/s':>10} {'ratio':>6} {'bound':>6}  target")  # fmt: skip
    for row in rows:
        met = "" if row.met is None else ("met" if row.met else "MISSED")
        print(f"{row.mode:9} {row.format:7} {row.operation:4} {row.block_bytes // KiB:>6}Ki "
              f"{row.batch:>5} {row.store_gbps:>10.2f} {row.plain_gbps:>10.2f} "
              f"{row.ratio:>6.2f} {row.checksum_bound:>6.2f}  {met}")  # fmt: skip
    for opened in opens:
        kib = int(opened["block_bytes"]) // KiB
        print(f"reopen {opened['mode']} {opened['format']} {kib} KiB: "
              f"{opened['seconds'] * 1e3:.1f} ms for {int(opened['blocks']):,} blocks "
              f"({opened['seconds_per_gib'] * 1e3:.1f} ms per GiB)")  # fmt: skip
    print(f"open of {memory['blocks']:,} blocks of 4 KiB: {memory['seconds']:.2f} s "
          f"({memory['microseconds_per_block']:.2f} us per block, {memory['seconds_per_gib']:.2f} "
          f"s per GiB), {memory['ram_bytes_per_block']:.0f} bytes of RAM per block")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
