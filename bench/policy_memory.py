"""Bookkeeping bytes per resident block for every built-in policy, before and after churn.

``tracemalloc`` over a whole ``OffloadManager``: the pool is filled by stores of ``--batch``
keys (each completed, then touched, as an engine does with a request's blocks), measured,
then ``--pools`` more pools' worth of new keys pass through (every store evicts), and it is
measured again. The keys belong to the caller and are not counted. The first figure is the
cost of a resident block (target < 200 bytes); the second adds what the policy remembers
of evicted keys (ARC's ghosts, the duel's histories), which is bounded but not per block.

``python bench/policy_memory.py`` takes about a minute on 2 cores at 100,000 blocks;
``--quick`` is a smoke run at 2,000; ``--json`` prints the JSON instead of the table.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tracemalloc
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from kvoffload.manager import OffloadManager
from kvoffload_spec.policies import POLICY_NAMES

RESULTS = Path(__file__).resolve().parent / "results"
TARGET_BYTES_PER_BLOCK = 200.0


@dataclass(frozen=True)
class Row:
    policy: str
    blocks: int
    batch: int
    full_bytes_per_block: float
    pools_after: int
    churned_bytes_per_block: float


def measure(policy: str, blocks: int, batch: int, pools: int) -> Row:
    keys = list(range(10**9, 10**9 + blocks * (pools + 1)))  # allocated before tracing
    gc.collect()
    tracemalloc.start()
    try:
        baseline = tracemalloc.get_traced_memory()[0]
        manager = OffloadManager(blocks, policy)
        full = 0.0
        for start in range(0, len(keys), batch):
            request = keys[start : start + batch]
            plan = manager.prepare_store(request)
            if plan is None:
                raise RuntimeError(f"{manager!r} refused a store")
            manager.complete_store(plan)
            manager.touch(request)
            if start + batch == blocks:
                gc.collect()
                full = (tracemalloc.get_traced_memory()[0] - baseline) / blocks
        gc.collect()
        churned = (tracemalloc.get_traced_memory()[0] - baseline) / blocks
    finally:
        tracemalloc.stop()
    if manager.stats().resident != blocks:
        raise RuntimeError(f"{manager!r} should hold {blocks} blocks")
    return Row(policy, blocks, batch, full, pools, churned)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Bytes per resident block, per policy.")
    parser.add_argument("--blocks", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=1_000, help="keys per store")
    parser.add_argument("--pools", type=int, default=5, help="pools' worth of churn after")
    parser.add_argument("--quick", action="store_true", help="2,000 blocks: a smoke run")
    parser.add_argument("--json", action="store_true", help="print the JSON, not the table")
    parser.add_argument("--out", type=Path, default=RESULTS / "policy_memory.json")
    args = parser.parse_args(argv)
    blocks, batch = (2_000, 100) if args.quick else (args.blocks, args.batch)
    if blocks % batch:
        parser.error("--blocks must be a multiple of --batch")
    rows = [measure(policy, blocks, batch, args.pools) for policy in POLICY_NAMES]
    met = all(row.full_bytes_per_block < TARGET_BYTES_PER_BLOCK for row in rows)
    result = {"rows": [asdict(row) for row in rows], "target": TARGET_BYTES_PER_BLOCK, "met": met}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"bytes per resident block, {blocks:,} blocks, stores of {batch:,} keys")
    print(f"| policy | pool full | after {args.pools} more pools of keys |")
    print("|---|---|---|")
    for row in rows:
        print(
            f"| {row.policy} | {row.full_bytes_per_block:.0f} | {row.churned_bytes_per_block:.0f} |"
        )
    verdict = "met" if met else "MISSED"
    print(f"target < {TARGET_BYTES_PER_BLOCK:.0f} bytes per resident block: {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
