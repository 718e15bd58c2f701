"""An abandoned fetch, against a real Valkey server: its block id stays quarantined until its
job reports, so no key's bytes are ever overwritten by the late reply.

The fetch's plan is abandoned through the ``Offloader``, which keeps no ledger of its own: the
manager's ``is_abandoned`` is what ``wait``, ``reset``, ``stalled`` and ``poll`` read. The same
history with the quarantine ended at once (the catalogue's ``abandoned fetch`` share) must
load another key's bytes: that is what the quarantine prevents.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvoffload import Offloader, OffloadManager
from kvoffload_spec.surface import Lookup
from tests.planted import ABANDONED_FETCH, Planted, share
from tests.remote_support import Engine, content, make_store
from tests.valkey_server import ValkeyServer


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for engine in made:
        engine.close()


def store(engine: Engine, key: int) -> None:
    """Offload ``key``'s block and wait for that store alone (not for the fetch)."""
    engine.cache[0] = torch.frombuffer(bytearray(content(key)), dtype=torch.uint8)
    plan = engine.offloader.store([key], [0])
    assert plan is not None and engine.offloader.wait([plan], timeout=30)
    engine.reported += engine.offloader.poll()


def abandon_a_stalled_fetch_then_reuse_the_pool(
    server: ValkeyServer, engines: list[Engine], offloader: type[Offloader]
) -> list[int]:
    """A fetch stalls on a paused server and is abandoned; two keys are stored, then the
    server resumes and the late reply arrives. The keys that load wrong bytes."""
    engine = Engine(make_store(server.url, timeout_s=5.0), cls=offloader)
    engines.append(engine)
    assert make_store(server.url).put([5], [content(5)]) == [True]
    server.pause()
    try:
        (plan,) = engine.offloader.fetch([5])
        assert engine.offloader.stalled(older_than=1e-9) == [plan]
        engine.offloader.abandon(plan)
        assert engine.offloader.stalled(older_than=1e-9) == []
        assert engine.offloader.lookup(5) is Lookup.MISS
        store(engine, 1)
        store(engine, 2)
    finally:
        server.resume()
    engine.settle()  # the late reply is written where the fetch's block id was
    return engine.load_ready([1, 2, 5])[1]  # the keys that loaded wrong bytes


def test_an_abandoned_fetch_never_overwrites_a_key(
    valkey_server: ValkeyServer, engines: list[Engine]
) -> None:
    assert abandon_a_stalled_fetch_then_reuse_the_pool(valkey_server, engines, Offloader) == []
    (late,) = [done for done in engines[0].reported if done.fetched]
    assert late.abandoned and not late.ok  # reported, from the manager's ledger
    assert engines[0].offloader.num_in_flight == 0
    manager = engines[0].offloader.manager
    assert isinstance(manager, OffloadManager) and manager.num_quarantined_blocks == 0


@pytest.mark.parametrize("bug", share(ABANDONED_FETCH), ids=lambda bug: bug.name)
def test_the_abandoned_fetch_finds_its_share_of_the_catalogue(
    bug: Planted, valkey_server: ValkeyServer, engines: list[Engine]
) -> None:
    broken = bug.subject
    assert isinstance(broken, type) and issubclass(broken, Offloader)
    assert abandon_a_stalled_fetch_then_reuse_the_pool(valkey_server, engines, broken) != []
