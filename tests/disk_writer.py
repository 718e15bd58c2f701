"""A process that writes to a disk tier until it is killed, or holds one open (run by
tests/test_disk_faults.py as ``python -m tests.disk_writer MODE PATH SEED``).

``write``: puts, rewrites (a new version of a block) and deletes at random, from three I/O
threads, as fast as it can, printing ``ready`` once the store is open; the test kills it
with SIGKILL at a random moment. ``tear``: the same, but the process kills itself in the
middle of one of its writes to the slot file, a random one after the disk is full: what it
wrote of that run is cut at a random byte, its records are never written. ``hold``: opens
the store, prints ``ready``, and waits for its standard input to close. ``fill``: under the
file size limit the test set, puts until the disk refuses, then prints what it saw as JSON.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import sys
from pathlib import Path

from kvoffload.tiers.disk_store import DiskStore
from tests.disk_support import content, disk_store

KEYS = 48  # more than the tier holds: evictions reuse slots
BLOCKS = 32
SIZE = 64 * 1024


def write(path: Path, seed: int, *, tear: bool = False) -> None:
    rng = random.Random(seed)
    store = disk_store(path, blocks=BLOCKS, block_bytes=SIZE, io_threads=3)
    if tear:
        tear_a_write(store, rng)
    print("ready", flush=True)
    versions = dict.fromkeys(range(KEYS), 0)
    while True:
        keys = rng.sample(range(KEYS), rng.randint(1, 12))
        if rng.random() < 0.1:
            store.delete(keys)
            continue
        for key in keys:
            versions[key] += rng.random() < 0.5
        store.put(keys, [content(key, SIZE, versions[key]) for key in keys])


def tear_a_write(store: DiskStore, rng: random.Random) -> None:
    """Make the store's ``k``-th write to its slot file its last: cut short, then SIGKILL."""
    file = store._file
    whole = file.write
    calls = itertools.count()
    fatal = rng.randint(12, 40)

    def write(offset: int, pieces: list[memoryview]) -> None:
        if next(calls) < fatal:
            return whole(offset, pieces)
        data = b"".join(bytes(piece) for piece in pieces)
        os.pwrite(file.buffered, data[: rng.randrange(len(data))], offset)
        os.kill(os.getpid(), signal.SIGKILL)
        return None

    file.write = write  # type: ignore[method-assign]


def hold(path: Path) -> None:
    store = disk_store(path)
    print("ready", flush=True)
    sys.stdin.read()
    store.close()


def fill(path: Path) -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # so that a write past the limit fails
    store = disk_store(path, blocks=64, block_bytes=SIZE)
    answers = [store.put([key], [content(key, SIZE)])[0] for key in range(64)]
    readable = [
        key for key, view in enumerate(store.get(list(range(64))))
        if view is not None and view.tobytes() == content(key, SIZE)
    ]  # fmt: skip
    stats = store.stats()
    print(json.dumps({
        "answers": answers, "readable": readable, "disk_full": stats.disk_full,
        "keys_not_stored": stats.keys_not_stored, "rejected": stats.rejected,
    }))  # fmt: skip
    store.close()


if __name__ == "__main__":
    mode, where, seed = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    modes = {
        "write": lambda: write(where, seed),
        "tear": lambda: write(where, seed, tear=True),
        "hold": lambda: hold(where),
        "fill": lambda: fill(where),
    }
    modes[mode]()
