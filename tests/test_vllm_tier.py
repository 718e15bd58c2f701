"""kvoffload's remote tier inside vLLM 0.33's own tiering manager, on CPU, on a real server.

Each manager is built the way vLLM builds it: a ``VllmConfig`` whose
``kv_connector_extra_config`` names ``TieringOffloadingSpec`` and lists our tier in
``secondary_tiers`` (``type`` + ``module_path``); vLLM's ``build_offloading_config``, its
``OffloadingSpecFactory``, its ``TieringOffloadingSpec.get_manager()`` (its CPU primary tier
on its shared memory region, its ``SecondaryTierFactory``), its ``TieringOffloadingManager``.
The tests then make the calls vLLM's scheduler makes (new request, prepare/complete store,
lookups step after step, prepare/complete load, end of step) and write or read the primary
tier's chunks where vLLM's worker would. Two managers are two engines sharing one server.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import random
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest
import torch
import valkey
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from vllm.config import (
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
    build_offloading_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadPromMetrics
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager

from kvoffload.integrations.vllm_tier import KvoffloadValkeyTier, namespace_of
from kvoffload.tiers import ValkeyStore
from kvoffload.tiers.values import HEADER_BYTES, encode_key, value_format
from kvoffload_spec.errors import InvalidArgumentError
from tests.valkey_server import ValkeyServer, free_port
from tests.vllm_support import cpu_engine_config

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
BLOCK_TOKENS, HEADS, HEAD_SIZE = 16, 2, 16
TIER = {"type": "KvoffloadValkeyTier", "module_path": "kvoffload.integrations.vllm_tier"}
DEADLINE_S = 30.0


@pytest.fixture(scope="module")
def vllm_config() -> VllmConfig:
    """One engine configuration (the slow part to build); each manager gets its own
    engine id and tier settings from it."""
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


@pytest.fixture
def engines(vllm_config: VllmConfig) -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for engine in made:
        engine.close()


def keys_for(prefix: str, count: int) -> list[OffloadKey]:
    return [make_offload_key(f"{prefix}-{i}".encode().ljust(32, b"."), 0) for i in range(count)]


def chunk_values(engine: Engine, count: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(engine.chunk_bytes) for _ in range(count)]


def tier_options(server_url: str, **more: Any) -> dict[str, Any]:
    return {"url": server_url, "timeout_s": 2.0, "retry_after_s": 0.2, **more}


def test_vllms_factory_loads_the_tier_from_its_module_path(vllm_config: VllmConfig) -> None:
    assert SecondaryTierFactory.get_tier_class(dict(TIER)) is KvoffloadValkeyTier


def test_a_chunk_stored_by_one_engine_is_loaded_byte_exact_by_another(
    valkey_server: ValkeyServer, engines: list[Engine], vllm_config: VllmConfig
) -> None:
    writer = Engine(vllm_config, tier_options(valkey_server.url))
    engines.append(writer)
    keys = keys_for("prefix", 6)
    chunks = chunk_values(writer, 6, seed=1)
    writer.store(keys, chunks)
    stats = writer.tier.stats()
    assert stats.stores_submitted == 1 and stats.stores_failed == 0
    assert stats.transfers.keys_stored == 6

    reader = Engine(vllm_config, tier_options(valkey_server.url))
    engines.append(reader)
    assert reader.tier.namespace == writer.tier.namespace  # the same model and layout
    context, answers = reader.look_up(keys)
    assert answers == [LookupResult.HIT] * 6  # found on the server, promoted into its pool
    assert reader.load(keys, context) == chunks
    reader.finish(context)
    read = reader.tier.stats()
    assert read.loads_submitted >= 1 and read.loads_failed == 0
    assert read.transfers.hits == 6 and read.transfers.rejected == 0
    # Promoted chunks are the reader's own now: a later request hits its CPU pool.
    again, answers = reader.look_up(keys)
    assert answers == [LookupResult.HIT] * 6 and reader.tier.stats().transfers.hits == 6
    reader.finish(again)


def test_a_server_down_makes_misses_and_failed_stores_and_nothing_raises(
    engines: list[Engine], vllm_config: VllmConfig
) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    engine = Engine(vllm_config, tier_options(url))
    engines.append(engine)
    keys = keys_for("down", 4)
    chunks = chunk_values(engine, 4, seed=2)
    engine.store(keys, chunks)  # the cascade fails; vLLM releases the chunks
    stats = engine.tier.stats()
    assert stats.stores_failed == 1 and stats.transfers.keys_not_stored == 4
    # The chunks are still in the engine's own CPU pool, served from there.
    context, answers = engine.look_up(keys)
    assert answers == [LookupResult.HIT] * 4
    assert engine.load(keys, context) == chunks
    engine.finish(context)
    # Chunks it never had: the remote tier answers "not there", never waits or raises.
    context, answers = engine.look_up(keys_for("never", 3))
    assert answers == [LookupResult.MISS] * 3
    engine.finish(context)
    lookups = engine.tier.stats().lookups
    assert lookups.connection_errors >= 1 and lookups.contains_calls >= 1


def test_a_server_killed_and_restarted_is_used_again(
    valkey_server: ValkeyServer, engines: list[Engine], vllm_config: VllmConfig
) -> None:
    writer = Engine(vllm_config, tier_options(valkey_server.url))
    engines.append(writer)
    writer.store(keys_for("before", 2), chunk_values(writer, 2, seed=3))
    valkey_server.restart()  # empty, the same port; the tier's connections are dead
    keys, chunks = keys_for("after", 3), chunk_values(writer, 3, seed=4)
    writer.store(keys, chunks)  # the first call after the restart: retried, stored
    assert writer.tier.stats().stores_failed == 0
    assert writer.tier.stats().transfers.retries == 1
    reader = Engine(vllm_config, tier_options(valkey_server.url))
    engines.append(reader)
    context, answers = reader.look_up([*keys_for("before", 2), *keys])
    assert answers == [LookupResult.MISS] * 2 + [LookupResult.HIT] * 3  # gone with the restart
    assert reader.load(keys, context) == chunks
    reader.finish(context)


def test_a_corrupt_value_is_a_miss_and_the_rest_load_byte_exact(
    valkey_server: ValkeyServer, engines: list[Engine], vllm_config: VllmConfig
) -> None:
    writer = Engine(vllm_config, tier_options(valkey_server.url))
    engines.append(writer)
    keys = keys_for("corrupt", 4)
    chunks = chunk_values(writer, 4, seed=5)
    writer.store(keys, chunks)
    # One payload byte of chunk 1 flipped on the server, under the tier's own key.
    client = valkey.Valkey.from_url(valkey_server.url)
    server_key = writer.tier.namespace.key_prefix + encode_key(keys[1])
    value = bytearray(cast(bytes, client.get(server_key)))
    value[HEADER_BYTES + len(value) // 2] ^= 0x01
    client.set(server_key, bytes(value))
    client.close()  # type: ignore[no-untyped-call]

    reader = Engine(vllm_config, tier_options(valkey_server.url))
    engines.append(reader)
    context, answers = reader.look_up(keys)
    # The server has a value under each key, but chunk 1's is refused when loaded: vLLM
    # is told that key did not load, and the tier's cached verdict becomes a miss.
    assert answers[0] is LookupResult.HIT and answers[1] is LookupResult.MISS
    hits = [key for key, answer in zip(keys, answers, strict=True) if answer is LookupResult.HIT]
    assert reader.load(hits, context) == [chunks[keys.index(key)] for key in hits]
    reader.finish(context)
    stats = reader.tier.stats()
    assert stats.transfers.rejected_checksum == 1 and stats.keys_not_loaded == 1
    assert stats.loads_failed == 1


def test_another_model_on_the_same_server_never_sees_the_chunks(
    valkey_server: ValkeyServer, engines: list[Engine], vllm_config: VllmConfig
) -> None:
    writer = Engine(vllm_config, tier_options(valkey_server.url))
    engines.append(writer)
    keys = keys_for("model", 2)
    writer.store(keys, chunk_values(writer, 2, seed=6))
    other = Engine(vllm_config, tier_options(valkey_server.url, namespace={"fine_tune": "b"}))
    engines.append(other)
    assert other.tier.namespace != writer.tier.namespace
    context, answers = other.look_up(keys)
    assert answers == [LookupResult.MISS] * 2
    other.finish(context)


def test_the_namespace_describes_the_model_and_layout(vllm_config: VllmConfig) -> None:
    engine = Engine(vllm_config, tier_options(f"redis://127.0.0.1:{free_port()}/0"))
    try:
        description = engine.tier.namespace.description
        for fact in ('"model":', '"dtype":"float32"', '"tokens_per_hash":16', LAYERS[0]):
            assert fact in description, (fact, description)
        assert f'"chunk_bytes":{engine.chunk_bytes}' in description
        assert namespace_of(engine.spec, engine.chunk_bytes + 1, None) != engine.tier.namespace
    finally:
        engine.close()
    with pytest.raises(InvalidArgumentError, match="namespace"):
        namespace_of(object(), 8192, None)


def test_a_bad_url_fails_when_vllm_builds_the_tier(vllm_config: VllmConfig) -> None:
    with pytest.raises(InvalidArgumentError, match="URL"):
        Engine(vllm_config, {"url": "http://not-a-valkey-url"})


def test_a_reset_during_a_stalled_transfer_waits_for_it_and_then_goes_on(
    valkey_server: ValkeyServer, engines: list[Engine], vllm_config: VllmConfig
) -> None:
    """vLLM's reset_cache drains every tier, then asserts no job is left: the stalled
    server's put ends by its timeout, is reported failed, and the engine goes on."""
    engine = Engine(vllm_config, tier_options(valkey_server.url, timeout_s=0.5))
    engines.append(engine)
    keys, chunks = keys_for("stall", 3), chunk_values(engine, 3, seed=7)
    valkey_server.pause()
    try:
        context = engine.context()
        prepared = engine.manager.prepare_store(keys, context)
        assert prepared is not None
        for slot, chunk in zip(prepared.store_spec.chunk_ids, chunks, strict=True):
            engine.write_slot(int(slot), chunk)
        engine.manager.complete_store(keys, context, success=True)  # the cascade is sent
        assert engine.tier.has_pending_work()
        engine.manager.on_request_finished(context)
        engine.manager.reset_cache()  # waits for the put: no slot reused under it
    finally:
        valkey_server.resume()
    engine.manager.on_reset_flushed()
    stats = engine.tier.stats()
    assert stats.stores_failed == 1 and stats.transfers.timeouts == 1
    assert not engine.tier.has_pending_work()
    time.sleep(0.3)  # retry_after_s: the server is left alone that long after a failure
    engine.store(keys, chunks)
    reader = Engine(vllm_config, tier_options(valkey_server.url))
    engines.append(reader)
    context, answers = reader.look_up(keys)
    assert answers == [LookupResult.HIT] * 3 and reader.load(keys, context) == chunks
    reader.finish(context)


def test_the_tiers_counters_reach_vllms_metrics_endpoint(
    engines: list[Engine], vllm_config: VllmConfig
) -> None:
    """kvoffload's remote counters, per connection, through vLLM's tiering manager's
    stats and vLLM's own ``OffloadPromMetrics`` (which refuses an undeclared metric)."""
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    engine = Engine(vllm_config, tier_options(url))
    engines.append(engine)
    engine.store(keys_for("down", 4), chunk_values(engine, 4, seed=2))
    context, _ = engine.look_up(keys_for("never", 3))
    engine.finish(context)
    registry = CollectorRegistry()
    kinds = {
        kind: functools.partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)
    }
    config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=engine.spec.extra_config)
    )
    frontend = OffloadPromMetrics(config, kinds, ["engine"], {0: ["0"]})
    for _ in range(2):  # the second step reports no increase again
        stats = engine.manager.get_stats()
        assert stats is not None
        frontend.observe(stats.data)
    served = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for sample in family.samples
    }
    tier = engine.tier.tier_type
    counts = engine.tier.stats()

    def value(name: str, connection: str, **labels: str) -> float:
        every = {"engine": "0", "tier": tier, "connection": connection, **labels}
        return served[(name, tuple(sorted(every.items())))]

    assert value("kvoffload_remote_puts_total", "transfers", result="not_stored") == 4
    assert value("kvoffload_remote_failures_total", "transfers", kind="connection") == (
        counts.transfers.connection_errors
    )
    assert (
        value("kvoffload_remote_failures_total", "lookups", kind="connection")
        == (counts.lookups.connection_errors)
        >= 1
    )
    assert value("kvoffload_remote_calls_total", "lookups", op="contains") == (
        counts.lookups.contains_calls
    )
    assert value("kvoffload_remote_server_down", "transfers") in (0.0, 1.0)


# -- loads of partly present chunks, and of values of another size ---------------------------

STATES = ("present", "absent", "short", "long")  # what the server holds under a chunk's key


def test_a_load_of_partly_present_chunks_fills_exactly_the_slots_of_valid_ones(
    valkey_server: ValkeyServer, engines: list[Engine], vllm_config: VllmConfig
) -> None:
    """Every mix of three chunks present, absent, or with a valid value one byte shorter or
    longer than a chunk (another layout's, under this namespace): the tier, called as vLLM's
    manager calls it, fills each present chunk's slot with its own bytes, leaves every other
    slot byte for byte as it was, and names exactly the present keys as loaded."""
    engine = Engine(vllm_config, tier_options(valkey_server.url))
    engines.append(engine)
    tier, size = engine.tier, engine.chunk_bytes
    writer = ValkeyStore(valkey_server.url, namespace=tier.namespace, timeout_s=10)
    length = {"present": size, "short": size - 1, "long": size + 1}
    fill = b"\xa5" * size
    for job_id, states in enumerate(itertools.product(STATES, repeat=3)):
        keys = keys_for(f"mix-{job_id}", 3)
        stored = {
            key: random.Random(f"{job_id}-{i}").randbytes(length[state])
            for i, (key, state) in enumerate(zip(keys, states, strict=True))
            if state != "absent"
        }
        assert writer.put(list(stored), list(stored.values())) == [True] * len(stored)
        slots = [100 + i for i in range(3)]  # vLLM allocates from 0: these stay unused
        for slot in slots:
            engine.write_slot(slot, fill)
        context = ReqContext(f"mix-{job_id}")
        tier.submit_load(
            TransferJob(job_id, keys, np.array(slots), is_promotion=True, req_context=context)
        )
        tier.drain_jobs()
        (result,) = tier.get_finished_jobs()
        present = [key for key, state in zip(keys, states, strict=True) if state == "present"]
        assert result.job_id == job_id
        assert result.success == (len(present) == 3), states
        if not result.success:
            assert list(result.successful_keys or []) == present, states
        for key, slot, state in zip(keys, slots, states, strict=True):
            expected = stored[key] if state == "present" else fill
            assert engine.read_slot(slot) == expected, (states, state)
    stats = tier.stats().transfers
    assert stats.rejected_length == 2 * 3 * 4**2  # each of 3 positions short or long in 16 mixes
    writer.close()


# -- a tenant secret --------------------------------------------------------------------------

SECRET = "the deployment's secret, 32 byte"


def test_a_secret_seals_the_tiers_chunks_from_a_file_an_entry_or_the_environment(
    valkey_server: ValkeyServer,
    engines: list[Engine],
    vllm_config: VllmConfig,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three engines of one tenant, each given the secret another way, share chunks; an
    engine without it finds none, and a chunk forged under the tier's own server name (by
    a client with every right but the secret) is a miss, never loaded."""
    monkeypatch.delenv("KVOFFLOAD_REMOTE_SECRET", raising=False)
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n", encoding="utf-8")
    writer = Engine(vllm_config, tier_options(valkey_server.url, secret_file=str(path)))
    engines.append(writer)
    keys = keys_for("sealed", 4)
    chunks = chunk_values(writer, 4, seed=11)
    writer.store(keys, chunks)
    client = valkey.Valkey.from_url(valkey_server.url)
    names = list(client.scan_iter())
    sealed = value_format(writer.tier.namespace, SECRET)
    assert sorted(names) == sorted(sealed.server_key(encode_key(key)) for key in keys)
    plain = Engine(vllm_config, tier_options(valkey_server.url))  # no secret: plain names
    engines.append(plain)
    context, answers = plain.look_up(keys)
    assert answers == [LookupResult.MISS] * 4
    plain.finish(context)
    # The adversary overwrites chunk 2 with its own bytes in every format it can make.
    forged = value_format(writer.tier.namespace, "the adversary's secret, 32 bytes")
    name = sealed.server_key(encode_key(keys[2]))
    client.set(name, forged.frame(encode_key(keys[2]), memoryview(b"\x66" * writer.chunk_bytes)))
    by_entry = Engine(vllm_config, tier_options(valkey_server.url, secret=SECRET))
    engines.append(by_entry)
    context, answers = by_entry.look_up(keys)
    assert answers[2] is LookupResult.MISS  # there, refused when loaded
    hits = [key for key, answer in zip(keys, answers, strict=True) if answer is LookupResult.HIT]
    assert len(hits) == 3
    assert by_entry.load(hits, context) == [chunks[keys.index(key)] for key in hits]
    by_entry.finish(context)
    stats = by_entry.tier.stats()
    assert stats.transfers.rejected == 1 and stats.keys_not_loaded == 1  # another tenant id
    monkeypatch.setenv("KVOFFLOAD_REMOTE_SECRET", SECRET)
    from_env = Engine(vllm_config, tier_options(valkey_server.url))
    engines.append(from_env)
    context, answers = from_env.look_up(keys[:2])
    assert answers == [LookupResult.HIT] * 2
    assert from_env.load(keys[:2], context) == chunks[:2]
    from_env.finish(context)
    client.close()  # type: ignore[no-untyped-call]


@pytest.mark.parametrize("problem", ["short entry", "short file", "missing file", "both"])
def test_a_bad_secret_fails_when_vllm_builds_the_tier_and_is_not_shown(
    vllm_config: VllmConfig, tmp_path: Path, problem: str
) -> None:
    path = tmp_path / "secret"
    path.write_text("short secret", encoding="utf-8")
    options = {
        "short entry": {"secret": "short secret"},
        "short file": {"secret_file": str(path)},
        "missing file": {"secret_file": str(tmp_path / "none")},
        "both": {"secret": SECRET, "secret_file": str(path)},
    }[problem]
    with pytest.raises(InvalidArgumentError) as caught:
        Engine(vllm_config, tier_options(f"redis://127.0.0.1:{free_port()}/0", **options))
    assert "short secret" not in str(caught.value) and SECRET not in str(caught.value)
