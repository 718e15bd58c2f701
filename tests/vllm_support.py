"""The vLLM configuration the engine tests run under: the tiny model of tests/engine_model
on CPU, vLLM's offloading connector in both roles, and the connector's extra settings."""

from __future__ import annotations

import pathlib
from typing import Any

from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)

MODEL_DIR = pathlib.Path(__file__).parent / "engine_model"


def cpu_engine_config(block_tokens: int, connector_config: dict[str, Any]) -> VllmConfig:
    """An engine of at most 8 sequences of 1,024 tokens, ``block_tokens`` per KV block,
    with prefix caching and the offloading connector set up by ``connector_config``."""
    model = ModelConfig(
        model=str(MODEL_DIR), skip_tokenizer_init=True, dtype="float32", max_model_len=1024
    )
    return VllmConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=block_tokens, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=1024,
            max_num_seqs=8,
            max_model_len=1024,
            is_encoder_decoder=False,
            async_scheduling=False,
        ),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config=connector_config,
        ),
    )
