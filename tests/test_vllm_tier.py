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

import functools
import itertools
import random
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest
import valkey
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from vllm.config import (
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadPromMetrics
from vllm.v1.kv_offload.base import (
    LookupResult,
    ReqContext,
)
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

from kvoffload.integrations.vllm_tier import KvoffloadValkeyTier, namespace_of
from kvoffload.tiers import ValkeyStore
from kvoffload.tiers.values import HEADER_BYTES, encode_key, value_format
from kvoffload_spec.errors import InvalidArgumentError
from tests.valkey_server import ValkeyServer, free_port
from tests.vllm_tier_support import (
    LAYERS,
    TIER,
    Engine,
    chunk_values,
    keys_for,
    tiering_config,
)


@pytest.fixture(scope="module")
def vllm_config() -> VllmConfig:
    """One engine configuration (the slow part to build); each manager gets its own
    engine id and tier settings from it."""
    return tiering_config()


@pytest.fixture
def engines(vllm_config: VllmConfig) -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for engine in made:
        engine.close()


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
