"""kvoffload inside vLLM 0.33's real scheduler and both ``OffloadingConnector`` roles, on CPU.

A fake forward pass writes KV values derived from (token, position, layer) into the device
KV cache. Request A runs and its blocks are offloaded through kvoffload; then the device
prefix cache is dropped and the device KV zeroed, and request B, sharing A's prefix, must be
scheduled with that prefix computed externally and must find A's exact values in its own
device blocks once the connector loaded them.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from vllm import SamplingParams
from vllm.config import (
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.forward_context import ForwardContext
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvoffload.integrations.vllm import KvoffloadManager
from tests.vllm_support import cpu_engine_config

BLOCK_SIZE = 16
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
HEADS, HEAD_SIZE = 2, 16
EOS = 999


def kv_value(token: int, position: int, layer: int) -> float:
    return float(token * 7 + position * 1000 + layer * 100_000 + 1)


class Engine:
    """vLLM's scheduler and worker-side connector, with a fake model runner."""

    def __init__(self, spec_name: str, policy: str, num_gpu_blocks: int = 40) -> None:
        extra: dict[str, Any] = {
            "spec_name": spec_name,
            "spec_module_path": "kvoffload.integrations.vllm",
            "cpu_bytes_to_use": 64 * 2**20,
            "eviction_policy": policy,
        }
        self.config = cpu_engine_config(BLOCK_SIZE, extra)
        spec = FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float32
        )
        self.kv_cache_config = KVCacheConfig(
            num_blocks=num_gpu_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)],
        )
        self.config.cache_config.num_gpu_blocks = num_gpu_blocks
        worker_config = copy.deepcopy(self.config)
        assert worker_config.kv_transfer_config is not None
        worker_config.kv_transfer_config.kv_connector_extra_config["spec_name"] = "KvoffloadSpec"
        with set_current_vllm_config(self.config):
            self.scheduler = Scheduler(
                vllm_config=self.config,
                kv_cache_config=self.kv_cache_config,
                structured_output_manager=StructuredOutputManager(self.config),
                block_size=BLOCK_SIZE,
                log_stats=True,
            )
            self.worker = OffloadingConnector(
                worker_config, KVConnectorRole.WORKER, self.kv_cache_config
            )
            # [num_blocks, block_size, heads, 2 (K/V), head_size] per layer: blocks first.
            self.kv = {
                name: torch.zeros(num_gpu_blocks, BLOCK_SIZE, HEADS, 2, HEAD_SIZE)
                for name in LAYERS
            }
            self.worker.register_kv_caches(self.kv)
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
        self.context = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
        connector = self.scheduler.connector
        assert isinstance(connector, OffloadingConnector)
        assert OffloadingSpecFactory.get_spec_cls(extra).__name__ == spec_name
        manager = connector.scheduler.manager
        assert isinstance(manager, KvoffloadManager)
        self.manager = manager
        self.requests: dict[str, Request] = {}

    def add(self, req_id: str, tokens: list[int], max_tokens: int = 2) -> Request:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        params.update_from_generation_config({}, EOS)
        request = Request(req_id, tokens, params, None, block_hasher=self.hasher)
        self.scheduler.add_request(request)
        self.requests[req_id] = request
        return request

    def step(self) -> Any:
        output = self.scheduler.schedule()
        meta = output.kv_connector_metadata
        self.worker.handle_preemptions(meta)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(self.context)
        self.forward(output)
        if output.total_num_scheduled_tokens > 0:
            self.worker.wait_for_save()
        sending, recving = self.worker.get_finished(output.finished_req_ids)
        worker_meta = self.worker.build_connector_worker_meta()
        self.worker.clear_connector_metadata()
        running = [r.request_id for r in self.scheduler.running]
        runner = ModelRunnerOutput(
            req_ids=running,
            req_id_to_index={rid: i for i, rid in enumerate(running)},
            sampled_token_ids=[[5] for _ in running],
            kv_connector_output=KVConnectorOutput(
                finished_sending=sending,
                finished_recving=recving,
                kv_connector_worker_meta=worker_meta,
            ),
        )
        self.scheduler.update_from_output(output, runner)
        return output

    def forward(self, output: Any) -> None:
        """Write each scheduled token's KV: a value of (token, position, layer)."""
        for req_id, count in output.num_scheduled_tokens.items():
            request = self.requests[req_id]
            start = request.num_computed_tokens - count  # schedule() already advanced it
            blocks = self.block_ids(req_id)
            tokens = request.all_token_ids
            for position in range(start, start + count):
                # A decode step's input is the token sampled last, which vLLM appends later.
                token = tokens[position] if position < len(tokens) else 0
                block, offset = blocks[position // BLOCK_SIZE], position % BLOCK_SIZE
                for layer, name in enumerate(LAYERS):
                    self.kv[name][block, offset] = kv_value(token, position, layer)

    def block_ids(self, req_id: str) -> list[int]:
        (blocks,) = self.scheduler.kv_cache_manager.get_block_ids(req_id)
        return list(blocks)

    def run_until_done(self, limit: int = 50) -> None:
        for _ in range(limit):
            if not self.scheduler.requests and not self.manager.manager.stats().pending:
                return
            self.step()
        raise AssertionError("the engine did not drain")


# vLLM's own CPU worker runs only on CUDA (its get_worker refuses other platforms), so with
# KvoffloadManagerSpec the scheduler runs that spec and the worker kvoffload's engine.
@pytest.mark.parametrize("spec_name", ["KvoffloadSpec", "KvoffloadManagerSpec"])
@pytest.mark.parametrize("policy", ["lru", "arc", "duel"])
def test_prefix_stored_by_a_is_loaded_into_b_byte_exact(spec_name: str, policy: str) -> None:
    engine = Engine(spec_name, policy)
    prefix = [(i * 37) % 900 + 1 for i in range(4 * BLOCK_SIZE)]
    engine.add("A", [*prefix, 11, 12, 13])
    engine.run_until_done()
    stats = engine.manager.manager.stats()
    assert stats.blocks_stored >= 4, stats

    # Drop the device prefix cache and the device KV: only the CPU tier can help B now.
    assert engine.scheduler.reset_prefix_cache()
    for tensor in engine.kv.values():
        tensor.zero_()

    request = engine.add("B", [*prefix, 21, 22, 23, 24, 25])
    loaded_before = engine.manager.manager.stats().blocks_loaded
    first = None
    for _ in range(6):
        output = engine.step()
        scheduled = [new for new in output.scheduled_new_reqs if new.req_id == "B"]
        if scheduled:
            first = scheduled[0]
            break
    # B starts with the whole prefix computed, by the connector (the device cache is empty),
    # and only its own tail left to compute.
    assert first is not None and first.num_computed_tokens == len(prefix), first
    assert output.num_scheduled_tokens["B"] == len(request.prompt_token_ids) - len(prefix)
    assert engine.manager.manager.stats().blocks_loaded - loaded_before == 4
    blocks = engine.block_ids("B")
    for position, token in enumerate(prefix):
        block, offset = blocks[position // BLOCK_SIZE], position % BLOCK_SIZE
        for layer, name in enumerate(LAYERS):
            expected = kv_value(token, position, layer)
            assert torch.all(engine.kv[name][block, offset] == expected), (position, layer)
    engine.run_until_done()
    engine.manager.manager.check_invariants()
