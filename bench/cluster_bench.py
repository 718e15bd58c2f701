"""The remote tier on a Valkey Cluster (``ValkeyStore(..., cluster=True)``) next to the
client library's cluster client (``valkey.cluster.ValkeyCluster``) doing the same batched
work in the same run: ``put`` of a batch (the client's ``mset_nonatomic``), ``get`` of it
(``mget_nonatomic``), both grouping keys per slot and per node. Samples alternate which side
goes first; the ratio is the median of the samples' own ratios (see remote_bench.py).

Also: the slot choice, measured on the client (whose keys we choose): a batch whose keys
share one hash tag (one slot: one MSET/MGET to one node) next to the same batch spread over
slots (one command per slot, every node working); and the cost of a failover: a primary
killed while gets run, how long until every key hits again (automatic failover,
``cluster-node-timeout`` 500 ms), in ms.

A 3-primary, 3-replica cluster is started here (tests/valkey_cluster.py), nothing persisted.
``python bench/remote_bench.py --cluster`` (or this file) prints a table and writes
bench/results/remote-cluster.json.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import valkey.cluster

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for tests.valkey_cluster

from tests.valkey_cluster import ValkeyCluster, command

from kvoffload.tiers import ValkeyStore

RESULTS = Path(__file__).resolve().parent / "results"
TARGET = 0.80


def _timed(work: Callable[[], object]) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def _compare(ours: Callable[[], object], theirs: Callable[[], object], samples: int) -> list[float]:
    ours(), theirs()
    mine: list[float] = []
    plain: list[float] = []
    for sample in range(samples):
        pair = (theirs, ours) if sample % 2 else (ours, theirs)
        times = [_timed(work) for work in pair]
        a, b = (times[1], times[0]) if sample % 2 else (times[0], times[1])
        mine.append(a)
        plain.append(b)
    ratio = statistics.median([b / a for a, b in zip(mine, plain, strict=True)])
    return [statistics.median(mine), statistics.median(plain), ratio]


def throughput(
    store: ValkeyStore, client: Any, block_bytes: int, batch: int, samples: int
) -> list[dict[str, object]]:
    rng = random.Random(block_bytes)
    values = [memoryview(rng.randbytes(block_bytes)) for _ in range(batch)]
    keys = [("bench", i) for i in range(batch)]
    raw = {f"raw:{block_bytes}:{i}".encode(): bytes(v) for i, v in enumerate(values)}
    names = list(raw)
    rows = []
    for operation, ours, theirs in (
        (
            "put",
            lambda: store.put(keys, values) == [True] * batch or sys.exit("put failed"),
            lambda: client.mset_nonatomic(raw),
        ),
        (
            "get",
            lambda: all(v is not None for v in store.get(keys)) or sys.exit("get missed"),
            lambda: client.mget_nonatomic(names),
        ),
    ):
        mine, plain, ratio = _compare(ours, theirs, samples)
        payload = block_bytes * batch
        rows.append(
            {
                "operation": operation,
                "block_bytes": block_bytes,
                "batch": batch,
                "store_gbps": round(payload / mine / 1e9, 3),
                "client_gbps": round(payload / plain / 1e9, 3),
                "ratio": round(ratio, 3),
                "target": TARGET,
                "met": ratio >= TARGET,
            }
        )
    return rows


def slot_choice(client: Any, block_bytes: int, batch: int, samples: int) -> dict[str, object]:
    """One hash tag for the batch (one slot, one node) against keys spread over slots."""
    value = random.Random(1).randbytes(block_bytes)
    tagged = {f"{{chain}}:{i}".encode(): value for i in range(batch)}
    spread = {f"chain:{i}".encode(): value for i in range(batch)}
    result: dict[str, object] = {"block_bytes": block_bytes, "batch": batch}
    for name, mapping in (("one_slot", tagged), ("spread", spread)):
        names = list(mapping)
        client.mset_nonatomic(mapping)

        def put(m: dict[bytes, bytes] = mapping) -> object:
            return client.mset_nonatomic(m)

        def get(n: list[bytes] = names) -> object:
            return client.mget_nonatomic(n)

        puts = [_timed(put) for _ in range(samples)]
        gets = [_timed(get) for _ in range(samples)]
        result[f"{name}_put_ms"] = round(statistics.median(puts) * 1e3, 3)
        result[f"{name}_get_ms"] = round(statistics.median(gets) * 1e3, 3)
    return result


def failover(cluster: ValkeyCluster) -> dict[str, object]:
    """A primary killed during gets: ms until every key hits again, and the slowest call."""
    store = ValkeyStore(cluster.url, namespace="failover", cluster=True, retry_after_s=0.1)
    keys = [("f", i) for i in range(300)]
    assert all(store.put(keys, [b"v" * 4096] * 300))
    for server in cluster.servers[:3]:
        command(server, "WAIT", 1, 8000)
    cluster.servers[0].kill()
    killed = time.monotonic()
    slowest = 0.0
    while time.monotonic() - killed < 30:
        took = _timed(lambda: store.get(keys))
        slowest = max(slowest, took)
        if all(v is not None for v in store.get(keys)):
            break
        time.sleep(0.01)
    back = time.monotonic() - killed
    stats = store.stats()
    store.close()
    return {
        "hits_back_after_ms": round(back * 1e3),
        "slowest_call_ms": round(slowest * 1e3, 1),
        "timeout_s": 0.5,
        "unavailable_keys": stats.unavailable,
        "failures": stats.failures,
    }


def run(quick: bool) -> dict[str, object]:
    samples = 5 if quick else 21
    shapes = (
        ((64 * 1024, 64), (2 * 1024 * 1024, 8))
        if quick
        else (
            (64 * 1024, 128),
            (2 * 1024 * 1024, 16),
        )
    )
    with ValkeyCluster() as cluster:
        seed = cluster.servers[0]
        client = valkey.cluster.ValkeyCluster(host="127.0.0.1", port=seed.port)
        store = ValkeyStore(cluster.url, namespace="bench", cluster=True, timeout_s=10.0)
        rows = [row for b, n in shapes for row in throughput(store, client, b, n, samples)]
        slots = [slot_choice(client, b, n, samples) for b, n in shapes]
        store.close()
        client.close()  # type: ignore[no-untyped-call]
    with ValkeyCluster() as cluster:
        cost = failover(cluster)
    return {
        "throughput": rows,
        "slot_choice": slots,
        "failover": cost,
        "targets_met": all(bool(row["met"]) for row in rows),
    }


def table(result: dict[str, Any]) -> str:
    lines = ["op   block      batch  store GB/s  client GB/s  ratio  met"]
    for row in result["throughput"]:
        lines.append(
            f"{row['operation']:<4} {row['block_bytes']:>9} {row['batch']:>6} "
            f"{row['store_gbps']:>11} {row['client_gbps']:>12} {row['ratio']:>6}  {row['met']}"
        )
    lines.append("slot choice (client, ms): " + json.dumps(result["slot_choice"]))
    lines.append("failover: " + json.dumps(result["failover"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    quick = "--quick" in (argv or sys.argv[1:])
    result = run(quick)
    out = RESULTS / ("remote-cluster-quick.json" if quick else "remote-cluster.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
