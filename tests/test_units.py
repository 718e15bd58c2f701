"""Sizes as people write them (kvoffload.units): the command line, the configuration file and
the engines' ``cpu_bytes_to_use`` read them with one parser."""

from __future__ import annotations

import dataclasses
import uuid

import pytest
import torch
from vllm.config import set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
    build_offloading_config,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from kvoffload.integrations.vllm import KvoffloadManagerSpec
from kvoffload.units import BYTES_ACCEPTED, byte_size, parse_bytes, parse_count
from kvoffload_spec.errors import InvalidArgumentError
from tests.vllm_support import cpu_engine_config


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        ("4096b", 4096),
        ("64KiB", 65536),
        ("2MiB", 2 << 20),
        ("16 GiB", 16 << 30),
        ("1TiB", 1 << 40),
        ("2mib", 2 << 20),
        ("16GB", 16 * 10**9),
        ("4kb", 4000),
        ("1.5GiB", 3 << 29),
        ("1_000", 1000),
    ],
)
def test_a_byte_size_takes_binary_and_decimal_units(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected
    assert byte_size(text, "x") == expected


@pytest.mark.parametrize("text", ["4k", "2m", "4 bytes", "MiB", "-1KiB", "1e3", "", "2MiBs"])
def test_a_byte_size_that_is_not_one_says_what_is_accepted(text: str) -> None:
    with pytest.raises(InvalidArgumentError) as raised:
        parse_bytes(text)
    assert str(raised.value) == f"{text!r} is not a size in bytes: give {BYTES_ACCEPTED}"


def test_a_byte_size_is_whole_and_at_least_its_minimum() -> None:
    with pytest.raises(InvalidArgumentError, match="not a whole number of bytes"):
        parse_bytes("0.3KiB")
    with pytest.raises(InvalidArgumentError, match="at least 1 bytes"):
        parse_bytes("0")
    with pytest.raises(InvalidArgumentError, match="cpu_bytes_to_use must be at least 1"):
        byte_size(0, "cpu_bytes_to_use")
    with pytest.raises(InvalidArgumentError, match="cpu_bytes_to_use must be a number of bytes"):
        byte_size(True, "cpu_bytes_to_use")
    with pytest.raises(InvalidArgumentError, match="cpu_bytes_to_use: '4k' is not a size"):
        byte_size("4k", "cpu_bytes_to_use")
    assert byte_size(1e10, "a JSON number") == 10**10


@pytest.mark.parametrize(("text", "expected"), [("12", 12), ("4k", 4000), ("1M", 10**6)])
def test_a_count_takes_decimal_suffixes(text: str, expected: int) -> None:
    assert parse_count(text) == expected


def test_a_count_that_is_not_one_names_its_unit() -> None:
    with pytest.raises(InvalidArgumentError, match="'4KiB' is not a whole number of blocks"):
        parse_count("4KiB")
    with pytest.raises(InvalidArgumentError, match="must be at least 1"):
        parse_count("0", "requests")


def vllm_spec(cpu_bytes_to_use: object) -> KvoffloadManagerSpec:
    """kvoffload's spec as vLLM's factory builds it from the connector's extra config."""
    config = cpu_engine_config(
        16,
        {
            "spec_name": "KvoffloadManagerSpec",
            "spec_module_path": "kvoffload.integrations.vllm",
            "cpu_bytes_to_use": cpu_bytes_to_use,
        },
    )
    kv_spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(
        num_blocks=40,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], kv_spec)],
    )
    with set_current_vllm_config(config):
        offloading = build_offloading_config(config, kv_cache_config)
    offloading = dataclasses.replace(offloading, engine_id=f"kvoffload-{uuid.uuid4().hex[:12]}")
    spec = OffloadingSpecFactory.create_spec(offloading)
    assert isinstance(spec, KvoffloadManagerSpec)
    return spec


def test_vllm_takes_cpu_bytes_to_use_with_a_unit() -> None:
    assert vllm_spec("1MiB").num_chunks == vllm_spec(1 << 20).num_chunks > 0
    with pytest.raises(InvalidArgumentError, match="cpu_bytes_to_use: '1M' is not a size"):
        vllm_spec("1M")
