"""What the remote tier's tests share besides the server (tests/valkey_server.py): value
blocks, the stats' accounting, and a small engine around an Offloader with a remote tier
(also run as a script by the two-process test)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvoffload import Offloader
from kvoffload.offloader import Finished, RemoteOffloadStats
from kvoffload.tiers import RemoteStats, RemoteStore, ValkeyStore
from kvoffload_spec.surface import Lookup, StorePlan

if TYPE_CHECKING:
    pass

LAYOUT = {"model": "tiny-llama", "dtype": "bfloat16", "block_tokens": 16, "layers": 2}


def blocks(count: int, size: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(size) for _ in range(count)]


def assert_accounted(stats: RemoteStats) -> None:
    """Every key asked for, every key offered and every failure is counted exactly once."""
    assert stats.hits + stats.misses + stats.rejected + stats.unavailable == stats.keys_requested
    assert stats.rejected == (
        stats.rejected_malformed
        + stats.rejected_foreign
        + stats.rejected_wrong_key
        + stats.rejected_length
        + stats.rejected_checksum
        + stats.rejected_mac
    )
    assert stats.keys_stored + stats.keys_not_stored == stats.keys_offered
    assert stats.failures == (
        stats.timeouts + stats.connection_errors + stats.server_errors + stats.protocol_errors
    ), stats


BLOCK_BYTES = 4096
DEVICE_BLOCKS = 4  # 0-2 take stores, 3 is the scratch block loads land in
SCRATCH = DEVICE_BLOCKS - 1
POISON = 0xA5  # what every CPU block holds before a copy writes it


def content(key: int) -> bytes:
    """The bytes stored under ``key``, in every offloader of the test."""
    return random.Random(key).randbytes(BLOCK_BYTES)


def make_store(url: str, *, timeout_s: float = 5.0) -> ValkeyStore:
    # The default is a timeout no busy machine reaches: a test that expects its calls to
    # succeed must not see a timeout, which marks the server down and turns them into misses.
    # The tests of timeouts pass their own.
    return ValkeyStore(url, namespace=LAYOUT, timeout_s=timeout_s, retry_after_s=0.05)


class Engine:
    """One offloader over a one-tensor device cache, and the checks of its bytes."""

    def __init__(
        self,
        store: RemoteStore | None,
        cpu_blocks: int = 2,
        cls: type[Offloader] = Offloader,
        **options: object,
    ) -> None:
        self.cache = torch.zeros(DEVICE_BLOCKS, BLOCK_BYTES, dtype=torch.uint8)
        self.reported: list[Finished] = []  # every plan poll reported, in order
        self.offloader = cls(
            [self.cache],
            num_cpu_blocks=cpu_blocks,
            remote=store,
            **options,  # type: ignore[arg-type]
        )
        # The pool is uninitialized memory, which may hold an earlier test's blocks (the same
        # keys' bytes, freed and reallocated): poisoned, a block no copy wrote is never a
        # key's own bytes, so a bug that makes one readable always shows.
        self.offloader.engine.pool.tensor.fill_(POISON)

    def store(self, key: int) -> StorePlan | None:
        """Compute ``key``'s block on the device, offload it, wait for it."""
        self.cache[0] = torch.frombuffer(bytearray(content(key)), dtype=torch.uint8)
        plan = self.offloader.store([key], [0])
        self.settle()
        return plan

    def settle(self) -> list[Finished]:
        assert self.offloader.wait(timeout=30)
        finished = self.offloader.poll()
        self.reported += finished
        return finished

    def fetch(self, keys: Sequence[int]) -> dict[object, bool]:
        plans = self.offloader.fetch(list(keys))
        finished = self.settle()
        fetched = {f.plan.keys[0]: f.ok for f in finished if f.fetched}
        assert set(fetched) == {plan.keys[0] for plan in plans}
        return fetched

    def check_ready_bytes(self, keys: Sequence[int]) -> list[int]:
        """Load every key of ``keys`` that is ready and compare its bytes; the ready ones."""
        ready, wrong = self.load_ready(keys)
        assert not wrong, f"key {wrong[0]}: wrong bytes"
        return ready

    def load_ready(self, keys: Sequence[int]) -> tuple[list[int], list[int]]:
        """Load every key of ``keys`` that is ready: those keys, and those of them whose
        bytes loaded are not their own."""
        ready, wrong = [], []
        for key in keys:
            if self.offloader.lookup(key) is not Lookup.HIT:
                continue
            self.cache[SCRATCH].zero_()
            self.offloader.load([key], [SCRATCH])
            self.settle()
            ready.append(key)
            if bytes(self.cache[SCRATCH].numpy()) != content(key):
                wrong.append(key)
        return ready, wrong

    def stats(self) -> RemoteOffloadStats:
        stats = self.offloader.remote_stats()
        assert stats is not None
        return stats

    def close(self) -> None:
        self.offloader.close(timeout=30)


# A short slice of the bundled trace for `kvoffload simulate` against a server or a cluster.
SIMULATE_SLICE = ["--trace", "conversation", "--requests", "300", "--gpu-blocks", "256"]
SIMULATE_SMALL = [*SIMULATE_SLICE, "--cpu-blocks", "400", "--block-bytes", "1KiB", "--json"]


def simulation_adds_up(report: dict[str, Any]) -> None:
    """One engine's (or the total's) `simulate --json` figures are consistent and exact."""
    remote = report.get("remote", {"hits": 0})
    hits = report["device_hits"] + report["cpu_hits"] + remote["hits"]
    assert hits + report["misses"] == report["block_refs"]
    assert report["blocks_loaded"] == report["cpu_hits"] + remote["hits"]
    assert report["all_loads_verified"] is True and report["load_mismatches"] == 0
