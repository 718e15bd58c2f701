"""What the remote tier's tests share besides the server (tests/valkey_server.py)."""

from __future__ import annotations

import random

from kvoffload.tiers import RemoteStats

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
    )
    assert stats.keys_stored + stats.keys_not_stored == stats.keys_offered
    assert stats.failures == stats.timeouts + stats.connection_errors + stats.server_errors, stats
