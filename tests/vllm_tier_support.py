"""vLLM 0.33's tiering manager built and driven as vLLM builds and drives it, with one of
kvoffload's secondary tiers (tests/test_vllm_tier.py, tests/test_vllm_disk_tier.py)."""

from __future__ import annotations

import dataclasses
import random
import time
import uuid
from typing import Any

import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
    build_offloading_config,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager

from kvoffload.integrations.vllm_tier import KvoffloadValkeyTier
from tests.vllm_support import cpu_engine_config

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
BLOCK_TOKENS, HEADS, HEAD_SIZE = 16, 2, 16
TIER = {"type": "KvoffloadValkeyTier", "module_path": "kvoffload.integrations.vllm_tier"}
DEADLINE_S = 30.0


def tiering_config() -> VllmConfig:
    """One engine configuration with vLLM's tiering spec (the slow part to build); each
    manager gets its own engine id and tier settings from it."""
    return cpu_engine_config(
        BLOCK_TOKENS,
        {
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": 1 << 20,  # 128 chunks of 8 KiB
        },
    )


class Engine:
    """vLLM's tiering manager with our tier, as vLLM's scheduler drives it."""

    def __init__(self, config: VllmConfig, tier: dict[str, Any]) -> None:
        kv_spec = FullAttentionSpec(
            block_size=BLOCK_TOKENS, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float32
        )
        kv_cache_config = KVCacheConfig(
            num_blocks=40,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), kv_spec)],
        )
        with set_current_vllm_config(config):
            base = build_offloading_config(config, kv_cache_config)
        extra = {**base.extra_config, "secondary_tiers": [{**TIER, **tier}]}
        # a distinct engine id: each engine its own shared memory region, as two engines
        offloading = dataclasses.replace(
            base, extra_config=extra, engine_id=f"kvoffload-test-{uuid.uuid4().hex[:12]}"
        )
        self.spec = OffloadingSpecFactory.create_spec(offloading)
        manager = self.spec.get_manager()
        assert isinstance(manager, TieringOffloadingManager)
        self.manager = manager
        (tier_manager,) = manager.secondary_tiers
        assert isinstance(tier_manager, KvoffloadValkeyTier)
        self.tier = tier_manager
        self.pool: memoryview = manager.primary_tier.get_kv_memoryview()
        self.chunk_bytes: int = self.pool.strides[0]
        self.requests = 0

    def context(self) -> ReqContext:
        self.requests += 1
        context = ReqContext(f"request-{self.requests}")
        self.manager.on_new_request(context)
        return context

    def step(self) -> None:
        self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        list(self.manager.take_events())

    def settle(self) -> None:
        """Step until no transfer is in flight (the engine keeps stepping while there is)."""
        deadline = time.monotonic() + DEADLINE_S
        while self.manager.has_pending_work():
            assert time.monotonic() < deadline, "transfers still in flight"
            self.step()
            time.sleep(0.002)
        self.step()

    def store(self, keys: list[OffloadKey], chunks: list[bytes]) -> None:
        """A request's chunks offloaded: written into the slots vLLM gives them (where its
        worker copies them from the device), then completed, which cascades them to us."""
        context = self.context()
        prepared = self.manager.prepare_store(keys, context)
        assert prepared is not None and list(prepared.keys_to_store) == keys
        for slot, chunk in zip(prepared.store_spec.chunk_ids, chunks, strict=True):
            self.write_slot(int(slot), chunk)
        self.manager.complete_store(keys, context, success=True)
        self.settle()
        self.manager.on_request_finished(context)
        self.step()

    def write_slot(self, slot: int, chunk: bytes) -> None:
        row = self.pool.cast("B")[slot * self.chunk_bytes : (slot + 1) * self.chunk_bytes]
        row[:] = chunk

    def read_slot(self, slot: int) -> bytes:
        row = self.pool.cast("B")[slot * self.chunk_bytes : (slot + 1) * self.chunk_bytes]
        return row.tobytes()

    def look_up(self, keys: list[OffloadKey]) -> tuple[ReqContext, list[LookupResult]]:
        """Look the keys up step after step, as the scheduler does for a waiting request,
        until no answer is RETRY or HIT_PENDING (promotions in flight)."""
        context = self.context()
        deadline = time.monotonic() + DEADLINE_S
        while True:
            answers = [self.manager.lookup(key, context) for key in keys]
            waiting = (LookupResult.RETRY, LookupResult.HIT_PENDING)
            if not any(answer in waiting for answer in answers):
                return context, answers
            assert time.monotonic() < deadline, answers
            self.step()
            time.sleep(0.002)

    def load(self, keys: list[OffloadKey], context: ReqContext) -> list[bytes]:
        """The hit chunks' bytes, read from the slots ``prepare_load`` names (where vLLM's
        worker copies them to the device from)."""
        spec = self.manager.prepare_load(keys, context)
        chunks = [self.read_slot(int(slot)) for slot in spec.chunk_ids]
        self.manager.complete_load(keys, context)
        return chunks

    def finish(self, context: ReqContext) -> None:
        self.manager.on_request_finished(context)
        self.step()

    def close(self) -> None:
        self.manager.shutdown()


def keys_for(prefix: str, count: int) -> list[OffloadKey]:
    return [make_offload_key(f"{prefix}-{i}".encode().ljust(32, b"."), 0) for i in range(count)]


def chunk_values(engine: Engine, count: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(engine.chunk_bytes) for _ in range(count)]
