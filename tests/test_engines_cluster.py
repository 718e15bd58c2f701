"""vLLM's secondary tier and SGLang's back end with ``"cluster": true``, built by the engines'
own factories, on a real Valkey Cluster (3 primaries, 3 replicas on 127.0.0.1): two engines
share blocks byte-exact through it; a server of the other mode than the configuration says
stops the engine's start with one typed error."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from vllm.config import VllmConfig
from vllm.v1.kv_offload.base import LookupResult

from kvoffload.integrations.sglang import KvoffloadHiCacheStorage
from kvoffload.tiers.cluster_map import ClusterModeError
from tests.sglang_support import PAGE, backend, pages
from tests.valkey_cluster import ValkeyCluster
from tests.valkey_server import ValkeyServer
from tests.vllm_tier_support import Engine, chunk_values, keys_for, tiering_config

pytestmark = pytest.mark.slow  # six servers and two engines' start: the full gate


@pytest.fixture(scope="module")
def cluster() -> Iterator[ValkeyCluster]:
    with ValkeyCluster() as running:
        yield running


@pytest.fixture(scope="module")
def vllm_config() -> VllmConfig:
    return tiering_config()


def _tier(url: str, **more: Any) -> dict[str, Any]:
    return {"url": url, "timeout_s": 2.0, "retry_after_s": 0.2, **more}


def test_two_vllm_engines_share_chunks_through_a_cluster(
    cluster: ValkeyCluster, vllm_config: VllmConfig
) -> None:
    writer = Engine(vllm_config, _tier(cluster.url, cluster=True))
    reader = Engine(vllm_config, _tier("redis://" + cluster.url.split(",")[-1], cluster=True))
    try:
        keys = keys_for("cluster prefix", 12)
        chunks = chunk_values(writer, 12, seed=3)
        writer.store(keys, chunks)
        assert writer.tier.stats().transfers.keys_stored == 12
        context, answers = reader.look_up(keys)
        assert answers == [LookupResult.HIT] * 12
        assert reader.load(keys, context) == chunks
        reader.finish(context)
        assert reader.tier.stats().transfers.rejected == 0
    finally:
        writer.close()
        reader.close()


def test_vllm_refuses_a_tier_of_the_other_mode_at_its_start(
    cluster: ValkeyCluster, valkey_server: ValkeyServer, vllm_config: VllmConfig
) -> None:
    with pytest.raises(ClusterModeError, match="cluster node"):
        Engine(vllm_config, _tier(cluster.url.split(",")[0]))
    with pytest.raises(ClusterModeError):
        Engine(vllm_config, _tier(valkey_server.url, cluster=True))


def _sglang(url: str, **options: Any) -> tuple[KvoffloadHiCacheStorage, torch.Tensor]:
    storage, host = backend(4, remote_url=url, remote_timeout_s=5.0, **options)
    assert isinstance(storage, KvoffloadHiCacheStorage)
    host.kv_buffer.copy_(torch.randn_like(host.kv_buffer))
    return storage, host.kv_buffer


def _page(buffer: torch.Tensor, page: int) -> bytes:
    return bytes(buffer[:, :, page * PAGE : (page + 1) * PAGE].contiguous().numpy().tobytes())


def test_two_sglang_engines_share_pages_through_a_cluster(cluster: ValkeyCluster) -> None:
    writer, written = _sglang(cluster.url, cluster=True)
    reader, read = _sglang("redis://" + cluster.url.split(",")[-1], cluster=True)
    keys = ["c0", "c1", "c2", "c3"]
    assert writer.batch_set_v1(keys, pages(0, 4)) == [True] * 4
    assert reader.batch_exists(keys) == 4
    assert reader.batch_get_v1(keys, pages(8, 4)) == [True] * 4
    for source, target in zip(range(4), range(8, 12), strict=True):
        assert _page(read, target) == _page(written, source)


def test_sglang_refuses_a_back_end_of_the_other_mode_at_its_start(
    cluster: ValkeyCluster, valkey_server: ValkeyServer
) -> None:
    with pytest.raises(ClusterModeError, match="cluster node"):
        _sglang(cluster.url.split(",")[0])
    with pytest.raises(ClusterModeError):
        _sglang(valkey_server.url, cluster=True)
