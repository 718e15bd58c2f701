"""kvoffload's SGLang HiCache back end with a remote tier (``remote_url``), built by SGLang's
own factory, on a real Valkey server: two engines share pages through it, sealed with a
tenant secret given in the extra config, a file or the environment; a page forged by a
client with every right but the secret is a miss; a server down costs misses, never an
exception; bad remote options fail when SGLang builds the back end.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import valkey

from kvoffload.integrations.sglang import KvoffloadHiCacheStorage
from kvoffload.tiers.values import encode_key, value_format
from kvoffload_spec.errors import InvalidArgumentError
from tests.sglang_support import PAGE, LayerFirstHostPool, backend, pages, storage_config
from tests.valkey_server import ValkeyServer, free_port

SECRET = "the SGLang tenant's secret, 32 b"


def engine(
    url: str, num_pages: int = 4, **options: Any
) -> tuple[KvoffloadHiCacheStorage, torch.Tensor]:
    """A back end behind the server at ``url``, its host pool filled at random."""
    storage, host = backend(num_pages, remote_url=url, remote_timeout_s=5.0, **options)
    assert isinstance(storage, KvoffloadHiCacheStorage)
    host.kv_buffer.copy_(torch.randn_like(host.kv_buffer))
    return storage, host.kv_buffer


def page_bytes(buffer: torch.Tensor, page: int) -> bytes:
    return bytes(buffer[:, :, page * PAGE : (page + 1) * PAGE].contiguous().numpy().tobytes())


def test_two_engines_share_sealed_pages_and_a_forged_one_is_a_miss(
    valkey_server: ValkeyServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("KVOFFLOAD_REMOTE_SECRET", raising=False)
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n", encoding="utf-8")
    writer, written = engine(valkey_server.url, remote_secret_file=str(path))
    keys = ["p0", "p1", "p2", "p3"]
    assert writer.batch_set_v1(keys, pages(0, 4)) == [True] * 4
    assert writer.remote is not None and writer.remote.authenticated
    assert writer.remote.stats().keys_stored == 4
    client = valkey.Valkey.from_url(valkey_server.url)
    names = sorted(client.scan_iter())
    assert len(names) == 4 and all(
        name.startswith(writer.remote.key_prefix.encode()) for name in names
    )

    reader, read = engine(valkey_server.url, remote_secret=SECRET)
    assert reader.batch_exists(keys) == 4  # read from the server into its own pool
    assert reader.batch_get_v1(keys, pages(8, 4)) == [True] * 4
    for source, target in zip(range(4), range(8, 12), strict=True):
        assert page_bytes(read, target) == page_bytes(written, source)

    # Without the secret (the plain names), another engine of the same model finds nothing.
    outsider, _ = engine(valkey_server.url)
    assert outsider.batch_exists(keys) == 0

    # The adversary replaces p1 with a value of its own, sealed under its own secret.
    assert reader.remote is not None
    sealed = value_format(reader.remote.namespace, SECRET)
    forged = value_format(reader.remote.namespace, "the adversary's secret, 32 bytes")
    attack = b"\x66" * len(page_bytes(written, 0))
    client.set(
        sealed.server_key(encode_key(b"p1")), forged.frame(encode_key(b"p1"), memoryview(attack))
    )
    third, got = engine(valkey_server.url, remote_secret=SECRET)
    assert third.batch_exists(keys) == 1  # the prefix stops at the forged page
    assert third.batch_get_v1(keys, pages(8, 4)) == [True, False, False, False]
    assert page_bytes(got, 8) == page_bytes(written, 0)
    assert attack not in got.numpy().tobytes()
    # refused by each call that looked past the pool (exists, then get), never loaded
    assert third.remote is not None and third.remote.stats().rejected == 2


def test_reading_pages_from_the_server_never_evicts_the_pools_hits_before_them(
    valkey_server: ValkeyServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full pool of 2 pages, ``a`` the least recent: the page after it, ``b``, comes from
    the server, and the room it needs is made by evicting ``x``, never ``a``, which the
    same call is about to read."""
    monkeypatch.delenv("KVOFFLOAD_REMOTE_SECRET", raising=False)
    writer, written = engine(valkey_server.url, remote_secret=SECRET)
    assert writer.batch_set_v1(["b"], pages(5, 1)) == [True]
    reader, read = engine(valkey_server.url, num_pages=2, remote_secret=SECRET)
    assert reader.batch_set_v1(["a", "x"], pages(0, 2)) == [True, True]
    expected_a = page_bytes(read, 0)
    assert reader.batch_get_v1(["a", "b"], pages(8, 2)) == [True, True]
    assert page_bytes(read, 8) == expected_a and page_bytes(read, 9) == page_bytes(written, 5)
    assert reader.batch_exists(["a", "b"]) == 2 and reader.manager.lookup(b"x").name == "MISS"


def test_the_environments_secret_and_a_server_down(
    monkeypatch: pytest.MonkeyPatch, valkey_server: ValkeyServer
) -> None:
    monkeypatch.setenv("KVOFFLOAD_REMOTE_SECRET", SECRET)
    writer, _ = engine(valkey_server.url)
    assert writer.remote is not None and writer.remote.authenticated
    assert writer.batch_set_v1(["a"], pages(0, 1)) == [True]
    reader, _ = engine(valkey_server.url, remote_secret=SECRET)  # the same tenant
    assert reader.exists("a")
    # Nothing listens: the pool works as without a remote, the failures are counted.
    down, _ = engine(f"redis://127.0.0.1:{free_port()}/0")
    assert down.batch_set_v1(["a", "b"], pages(0, 2)) == [True, True]
    assert down.batch_exists(["a", "b", "c"]) == 2
    assert down.remote is not None and down.remote.stats().failures >= 1


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"remote_secret": "short"}, "at least 16 bytes"),
        ({"remote_secret_file": "/no/such/file"}, "cannot read the secret file"),
        ({"remote_secret": SECRET, "remote_secret_file": "/x"}, "not both"),
        ({"remote_url": None, "remote_secret": SECRET}, "need remote_url"),
        ({"remote_url": "http://not-valkey"}, "URL"),
        ({"remote_url": None, "cluster": True}, "need remote_url"),
        ({"cluster": "yes"}, "cluster must be a bool"),
    ],
)
def test_bad_remote_options_fail_when_sglang_builds_the_back_end(
    options: dict[str, object], message: str
) -> None:
    settings: dict[str, Any] = {"remote_url": f"redis://127.0.0.1:{free_port()}/0", **options}
    if settings["remote_url"] is None:
        del settings["remote_url"]
    with pytest.raises(InvalidArgumentError, match=message) as caught:
        backend(num_pages=4, **settings)
    assert SECRET not in str(caught.value) and "short" not in str(caught.value).split(":")[-1]


def test_without_a_model_name_the_namespace_must_be_given() -> None:
    extra = {"remote_url": f"redis://127.0.0.1:{free_port()}/0", "num_pages": 2}
    config = storage_config(extra)
    config.model_name = None
    storage = KvoffloadHiCacheStorage(config)
    with pytest.raises(InvalidArgumentError, match="remote_namespace"):
        storage.register_mem_pool_host(LayerFirstHostPool(tokens=4 * PAGE))
    named = KvoffloadHiCacheStorage(storage_config({**extra, "remote_namespace": "m@rev"}))
    named.register_mem_pool_host(LayerFirstHostPool(tokens=4 * PAGE))
    assert named.remote is not None and "m@rev" in named.remote.namespace.description
