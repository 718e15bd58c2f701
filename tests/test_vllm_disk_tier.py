"""kvoffload's disk tier inside vLLM 0.33's own tiering manager, on CPU, on real files.

The engines are tests/vllm_tier_support.py's (vLLM's config, factory, spec and tiering
manager, driven as its scheduler drives them); the tier is ``KvoffloadDiskTier`` on a
directory of the test's own. An engine shut down and a new one on the same directory is an
engine restarted.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm.config import VllmConfig
from vllm.v1.kv_offload.base import LookupResult
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

from kvoffload.integrations.vllm_disk_tier import KvoffloadDiskTier
from kvoffload.tiers import DiskInUseError, DiskLayoutError
from kvoffload.tiers import disk_layout as layout
from kvoffload_spec.errors import InvalidArgumentError
from tests.vllm_tier_support import Engine, chunk_values, keys_for, tiering_config

TIER = {"type": "KvoffloadDiskTier", "module_path": "kvoffload.integrations.vllm_disk_tier"}


@pytest.fixture(scope="module")
def vllm_config() -> VllmConfig:
    return tiering_config()


@pytest.fixture
def engines(vllm_config: VllmConfig) -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for engine in made:
        engine.close()


def disk_tier(where: Path, **more: Any) -> dict[str, Any]:
    return {**TIER, "path": str(where), "disk_bytes": 1 / 64, **more}  # 16 MiB


def test_vllms_factory_loads_the_disk_tier_from_its_module_path() -> None:
    assert SecondaryTierFactory.get_tier_class(dict(TIER)) is KvoffloadDiskTier


def test_chunks_written_to_the_disk_are_loaded_byte_exact_after_a_restart(
    tmp_path: Path, engines: list[Engine], vllm_config: VllmConfig
) -> None:
    first = Engine(vllm_config, disk_tier(tmp_path / "disk"))
    keys = keys_for("prefix", 6)
    chunks = chunk_values(first, 6, seed=1)
    first.store(keys, chunks)
    assert isinstance(first.tier, KvoffloadDiskTier)
    stats = first.tier.stats()
    assert stats.stores_failed == 0 and stats.transfers.keys_stored == 6
    assert first.tier.disk.stats().blocks == 6
    first.close()  # the engine stops: its CPU pool is gone, its disk is not

    # The same capacity as a size with its unit: 1/64 GiB.
    second = Engine(vllm_config, disk_tier(tmp_path / "disk", disk_bytes="16MiB"))
    engines.append(second)
    assert isinstance(second.tier, KvoffloadDiskTier)
    assert second.tier.disk.stats().opened_blocks == 6
    context, answers = second.look_up([*keys, *keys_for("never", 2)])
    assert answers == [LookupResult.HIT] * 6 + [LookupResult.MISS] * 2
    assert second.load(keys, context) == chunks
    second.finish(context)
    read = second.tier.stats()
    assert read.loads_failed == 0 and read.transfers.hits == 6


def test_a_chunk_changed_on_the_disk_is_never_loaded(
    tmp_path: Path, engines: list[Engine], vllm_config: VllmConfig
) -> None:
    first = Engine(vllm_config, disk_tier(tmp_path / "disk"))
    keys = keys_for("changed", 3)
    chunks = chunk_values(first, 3, seed=2)
    first.store(keys, chunks)
    first.close()
    data = tmp_path / "disk" / layout.DATA_NAME
    raw = bytearray(data.read_bytes())
    slot_bytes = layout.Geometry(len(chunks[0])).slot_bytes
    for slot in range(3):
        raw[slot * slot_bytes + layout.HEAD_BYTES + 5] ^= 0x01  # one bit of every payload
    data.write_bytes(bytes(raw))

    second = Engine(vllm_config, disk_tier(tmp_path / "disk"))
    engines.append(second)
    context, answers = second.look_up(keys)
    assert answers == [LookupResult.MISS] * 3  # the promotions failed: nothing to load
    second.finish(context)
    stats = second.tier.stats()
    assert stats.keys_not_loaded == 3 and stats.transfers.rejected_checksum == 3


def test_a_second_engine_on_the_directory_and_another_model_are_refused(
    tmp_path: Path, engines: list[Engine], vllm_config: VllmConfig
) -> None:
    first = Engine(vllm_config, disk_tier(tmp_path / "disk"))
    engines.append(first)
    with pytest.raises(DiskInUseError):
        Engine(vllm_config, disk_tier(tmp_path / "disk"))
    first.close()
    engines.remove(first)
    with pytest.raises(DiskLayoutError):  # another deployment: another namespace
        Engine(vllm_config, disk_tier(tmp_path / "disk", namespace={"deployment": "other"}))


@pytest.mark.parametrize(
    "bad",
    [
        {"path": None},
        {"disk_bytes": None},
        {"disk_bytes": 0},
        {"disk_bytes": True},
        {"disk_bytes": "4 gigs"},
        {"disk_bytes": "0MiB"},
        {"admission": "sometimes"},
        {"disk_bytes": 1e-9},  # less than one chunk
    ],
)
def test_bad_settings_raise_a_typed_error(
    tmp_path: Path, vllm_config: VllmConfig, bad: dict[str, Any]
) -> None:
    with pytest.raises(InvalidArgumentError):
        Engine(vllm_config, disk_tier(tmp_path / "disk", **bad))
    assert not (tmp_path / "disk").exists()
