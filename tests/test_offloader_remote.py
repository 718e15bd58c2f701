"""The Offloader's remote tier on a real Valkey server: write-back, fetch, sharing, faults.

Every test checks bytes: a key the offloader reports ready is loaded to the device and
compared with the bytes stored under it, whichever tier it came from. Two planted bugs
(a write-back that reads the victim's block after the new store wrote it; a fetch miss
taken for a hit) must each make that check fail.
"""

from __future__ import annotations

import hashlib
import json
import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

from kvoffload import Offloader
from kvoffload.manager import OffloadManager
from kvoffload.offloader import NoRemoteTierError
from kvoffload_spec.errors import InvalidArgumentError
from kvoffload_spec.surface import Key, Lookup, StorePlan
from tests.remote_support import (
    BLOCK_BYTES,
    POISON,
    Engine,
    assert_accounted,
    content,
    make_store,
)
from tests.test_block_ids import Misplanning
from tests.valkey_server import ValkeyServer, free_port

if TYPE_CHECKING:
    from kvoffload.transfer.engine import BlockIds


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for engine in made:
        engine.close()


def test_write_back_then_fetch_in_another_offloader(
    valkey_server: ValkeyServer, engines: list[Engine]
) -> None:
    first = Engine(make_store(valkey_server.url))
    second = Engine(make_store(valkey_server.url), cpu_blocks=4)
    engines += [first, second]
    for key in range(6):  # 2 CPU blocks: each store from the third on evicts one
        first.store(key)
    stats = first.stats()
    assert (stats.write_keys, stats.written, stats.not_written) == (4, 4, 0)
    assert stats.written_bytes == 4 * BLOCK_BYTES
    assert first.check_ready_bytes(range(6)) == [4, 5]
    # 0-3 were written back when evicted; 4 and 5 are still only in the first's CPU pool.
    # The second's 4 CPU blocks take 0-3 (pending); 4 finds no room and is not sent.
    assert second.fetch(range(6)) == {0: True, 1: True, 2: True, 3: True}
    assert second.check_ready_bytes(range(6)) == [0, 1, 2, 3]
    assert second.fetch([4, 5]) == {4: False, 5: False}  # evicting 0 and 1 for them
    assert second.check_ready_bytes(range(6)) == [2, 3]
    stats = second.stats()
    assert (stats.fetch_keys, stats.fetch_hits, stats.fetch_misses) == (6, 4, 2)
    assert stats.fetch_no_room == 1 and stats.fetch_skipped == 0
    assert stats.fetch_bytes == 4 * BLOCK_BYTES
    assert (stats.write_keys, stats.written) == (2, 2)  # the second wrote 0 and 1 back
    assert stats.store is not None
    assert_accounted(stats.store)
    assert stats.failures == 0


def test_write_through_writes_every_stored_block(
    valkey_server: ValkeyServer, engines: list[Engine]
) -> None:
    first = Engine(make_store(valkey_server.url), remote_mode="write-through")
    second = Engine(make_store(valkey_server.url), cpu_blocks=4)
    engines += [first, second]
    for key in range(3):
        first.store(key)
    first.settle()  # each write is submitted when poll completes its store
    assert first.stats().written == 3  # at each store's completion, none at eviction
    assert second.fetch(range(4)) == {0: True, 1: True, 2: True, 3: False}
    assert second.check_ready_bytes(range(4)) == [0, 1, 2]


def test_a_fetch_evicts_and_writes_back_its_victims(
    valkey_server: ValkeyServer, engines: list[Engine]
) -> None:
    other = Engine(make_store(valkey_server.url), cpu_blocks=4)
    engine = Engine(make_store(valkey_server.url))
    engines += [other, engine]
    for key in (10, 11):
        other.store(key)
    other.offloader.close()  # nothing evicted: write through the remote by hand
    engines.remove(other)
    store = make_store(valkey_server.url)
    assert store.put([10, 11], [content(10), content(11)]) == [True, True]
    engine.store(1)
    engine.store(2)  # the pool is full of 1 and 2
    assert engine.fetch([10, 11]) == {10: True, 11: True}  # 1 and 2 evicted, written back
    assert engine.check_ready_bytes([1, 2, 10, 11]) == [10, 11]
    assert store.get_into([1, 2], [bytearray(BLOCK_BYTES), bytearray(BLOCK_BYTES)]) == [
        True,
        True,
    ]
    assert engine.fetch([1]) == {1: True}
    assert engine.check_ready_bytes([1]) == [1]


def test_fetch_skips_resident_keys_and_bad_arguments_change_nothing(
    valkey_server: ValkeyServer, engines: list[Engine]
) -> None:
    engine = Engine(make_store(valkey_server.url))
    engines.append(engine)
    engine.store(1)
    assert engine.offloader.fetch([1]) == []
    assert engine.stats().fetch_skipped == 1
    before = engine.stats()
    for bad in ("abc", 5, [1.5], [object()]):
        with pytest.raises(InvalidArgumentError):
            engine.offloader.fetch(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        engine.offloader.store([1.5], [0])  # a key the remote could not hold
    assert engine.stats() == before
    assert engine.offloader.num_in_flight == 0
    with pytest.raises(NoRemoteTierError):
        Engine(None).offloader.fetch([1])


def test_a_key_pending_here_is_skipped_and_another_offloaders_plan_refused(
    valkey_server: ValkeyServer, engines: list[Engine]
) -> None:
    """A key pending here (its fetch not reported yet) is skipped like a resident one; a
    plan of another offloader, even one of the same plan id, is refused by ``wait`` and
    ``abandon`` with a typed error, not taken for this one's."""
    ours, theirs = Engine(make_store(valkey_server.url)), Engine(make_store(valkey_server.url))
    engines += [ours, theirs]
    (plan,) = ours.offloader.fetch([7])
    assert ours.offloader.fetch([7]) == [] and ours.stats().fetch_skipped == 1
    (foreign,) = theirs.offloader.fetch([8])
    assert foreign.plan_id == plan.plan_id and foreign != plan
    with pytest.raises(InvalidArgumentError):
        ours.offloader.wait([foreign], timeout=1)
    with pytest.raises(InvalidArgumentError):
        ours.offloader.abandon(foreign)
    for engine in (ours, theirs):
        engine.settle()
        assert engine.offloader.num_in_flight == 0


@pytest.mark.parametrize(
    "options",
    [{"remote": "redis://x"}, {"remote_mode": "write-around"}, {"remote_max_pending": 0}],
)
def test_bad_remote_options_raise_before_any_pool(options: dict[str, object]) -> None:
    with pytest.raises(InvalidArgumentError):
        Offloader([torch.zeros(2, 16, dtype=torch.uint8)], num_cpu_blocks=2, **options)  # type: ignore[arg-type]


def test_an_offloader_without_remote_loads_no_remote_code() -> None:
    program = (
        "import sys, torch\n"
        "from kvoffload import Offloader\n"
        "offloader = Offloader([torch.zeros(4, 64, dtype=torch.uint8)], num_cpu_blocks=2)\n"
        "offloader.store([1], [0]); offloader.wait(); offloader.poll(); offloader.close()\n"
        "print(sorted(m for m in sys.modules if m.startswith(('valkey', 'xxhash', \n"
        "    'kvoffload.tiers.background', 'kvoffload.tiers.valkey_store'))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, check=False, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_without_remote_nothing_changes() -> None:
    engine = Engine(None)
    for key in range(4):
        engine.store(key)
    assert engine.offloader.remote_stats() is None
    assert engine.check_ready_bytes(range(4)) == [2, 3]
    engine.close()


def test_a_fetch_of_a_value_of_another_size_misses_and_leaves_the_block_untouched(
    valkey_server: ValkeyServer, engines: list[Engine]
) -> None:
    """Valid values one byte shorter or longer than a CPU block, empty, or twice its size
    (another layout's, under this namespace), fetched in one job with a value of the right
    size: that one hits, each other misses, and its CPU block keeps the poison it held."""
    engine = Engine(make_store(valkey_server.url), cpu_blocks=5)
    engines.append(engine)
    sizes = {1: BLOCK_BYTES - 1, 2: BLOCK_BYTES + 1, 3: 0, 4: 2 * BLOCK_BYTES, 5: BLOCK_BYTES}
    values = [random.Random(key).randbytes(size) for key, size in sizes.items()]
    assert make_store(valkey_server.url).put(list(sizes), values) == [True] * len(sizes)
    plans = engine.offloader.fetch(list(sizes))
    engine.settle()
    fetched = {f.plan.keys[0]: f.ok for f in engine.reported if f.fetched}
    assert fetched == {1: False, 2: False, 3: False, 4: False, 5: True}
    pool = engine.offloader.engine.pool.tensor
    for plan in plans:
        if plan.keys[0] != 5:
            assert bool((pool[plan.block_ids[0]] == POISON).all()), plan
    assert engine.check_ready_bytes(list(sizes)) == [5]
    stats = engine.stats()
    assert stats.fetch_misses == 4 and stats.store is not None
    assert stats.store.rejected_length == 4
    assert_accounted(stats.store)


# -- faults ------------------------------------------------------------------------------


@pytest.mark.slow
def test_server_down_at_start_then_up(engines: list[Engine]) -> None:
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    first = Engine(make_store(url))
    engines.append(first)
    for key in range(4):
        first.store(key)  # write-backs of 0 and 1 fail: counted, never raised
    assert first.fetch([0]) == {0: False}  # evicting 2, whose write-back fails too
    assert first.check_ready_bytes(range(4)) == [3]  # the local tier still serves
    stats = first.stats()
    assert stats.not_written == 3 and stats.fetch_misses == 1 and stats.failures >= 1
    assert stats.store is not None and stats.store.connection_errors >= 1
    with ValkeyServer(port=port):
        time.sleep(0.1)  # past retry_after_s: the store tries again
        first.store(4)  # into the free block id
        first.store(5)  # evicts 3: written
        first.store(6)  # evicts 4: written
        assert first.stats().written == 2
        second = Engine(make_store(url))
        engines.append(second)
        assert second.fetch([3, 4]) == {3: True, 4: True}
        assert second.check_ready_bytes([3, 4]) == [3, 4]
        for engine in engines:
            engine.close()
        engines.clear()


@pytest.mark.slow
def test_server_killed_mid_run_then_restarted_empty(
    valkey_server: ValkeyServer, engines: list[Engine]
) -> None:
    first = Engine(make_store(valkey_server.url))
    second = Engine(make_store(valkey_server.url), cpu_blocks=4)
    engines += [first, second]
    for key in range(4):
        first.store(key)  # 0 and 1 written back
    valkey_server.kill()
    for key in range(4, 6):
        first.store(key)  # 2 and 3: not written
    assert second.fetch(range(4)) == {0: False, 1: False, 2: False, 3: False}
    assert first.check_ready_bytes(range(6)) == [4, 5]
    assert first.stats().not_written == 2 and first.stats().failures >= 1
    assert second.stats().fetch_misses == 4
    valkey_server.start()  # empty: 0 and 1 are gone
    time.sleep(0.1)
    first.store(6)  # evicts 4: written
    assert second.fetch([0, 1, 4]) == {0: False, 1: False, 4: True}
    assert second.check_ready_bytes(range(7)) == [4]
    for engine in (first, second):
        assert engine.stats().store is not None
        assert_accounted(engine.stats().store)  # type: ignore[arg-type]


@pytest.mark.slow
def test_server_stalled_fetches_miss_after_the_timeout_then_resume(
    valkey_server: ValkeyServer, engines: list[Engine]
) -> None:
    engine = Engine(make_store(valkey_server.url, timeout_s=0.2))
    engines.append(engine)
    for key in range(3):
        engine.store(key)  # 0 written back
    assert engine.stats().written == 1
    valkey_server.pause()
    try:
        assert len(engine.offloader.fetch([0])) == 1  # returns at once; the server is silent
        engine.store(3)  # the local tiers serve meanwhile; 1 and 2 are evicted
        engine.settle()
        assert engine.check_ready_bytes(range(4)) == [3]  # 0 missed: absent again
        stats = engine.stats()
        assert stats.fetch_misses == 1 and stats.not_written == 2
        assert stats.store is not None and stats.store.timeouts >= 1
    finally:
        valkey_server.resume()
    time.sleep(0.1)  # past retry_after_s
    assert engine.fetch([0]) == {0: True}  # written before the stall, read after it
    assert engine.check_ready_bytes(range(4)) == [0, 3]


def test_abandoned_fetch_keeps_its_block_id_quarantined(
    valkey_server: ValkeyServer, engines: list[Engine]
) -> None:
    engine = Engine(make_store(valkey_server.url, timeout_s=1.0))
    engines.append(engine)
    assert make_store(valkey_server.url).put([5], [content(5)]) == [True]
    valkey_server.pause()
    try:
        (plan,) = engine.offloader.fetch([5])
        assert engine.offloader.stalled(older_than=1e-9) == [plan]
        engine.offloader.abandon(plan)
        assert engine.offloader.lookup(5) is Lookup.MISS
        assert engine.offloader.num_in_flight == 1  # its job may still write the block id
        one = engine.store(1)
        two = engine.store(2)  # no room but 1's block id: the quarantined one is not reused
        assert one is not None and two is not None
        assert two.evicted_keys == (1,) and plan.block_ids[0] not in one.block_ids + two.block_ids
    finally:
        valkey_server.resume()
    engine.settle()
    assert [(f.plan, f.abandoned) for f in engine.reported if f.fetched] == [(plan, True)]
    three = engine.store(3)  # the quarantine ended: its block id is free again
    assert three is not None and three.block_ids == plan.block_ids and three.evicted_keys == ()
    assert engine.check_ready_bytes([1, 2, 3, 5]) == [2, 3]


# -- planted bugs: the byte checks above must catch them ---------------------------------


class WritesBackLate(Offloader):
    """Writes the victims back only after the new store's job wrote their block ids."""

    late: tuple[StorePlan, ...] = ()

    def _write_back(self, plans: Sequence[StorePlan]) -> None:
        self.late += tuple(plans)

    def _store(self, keys: Sequence[Key], device_block_ids: BlockIds) -> StorePlan | None:
        plan = super()._store(keys, device_block_ids)
        self.engine.wait(list(self._plans))  # the job has written the victims' block ids
        Offloader._write_back(self, self.late)
        self.late = ()
        return plan


class AcceptsMisses(Offloader):
    """Completes every fetch as a success: a remote miss is taken for a hit."""

    def _complete_fetch(self, plan: StorePlan, accepted: bool) -> None:
        super()._complete_fetch(plan, True)


@pytest.mark.parametrize("planted", [WritesBackLate, AcceptsMisses, Offloader])
def test_planted_bugs_load_wrong_bytes_and_are_caught(
    valkey_server: ValkeyServer, engines: list[Engine], planted: type[Offloader]
) -> None:
    first = Engine(make_store(valkey_server.url), cls=planted)
    second = Engine(make_store(valkey_server.url), cpu_blocks=4, cls=planted)
    engines += [first, second]
    for key in range(4):
        first.store(key)  # 0 and 1 written back
    second.fetch(range(4))  # 0 and 1 hit, 2 and 3 miss
    if planted is Offloader:  # the control: the same steps, every byte right
        assert second.check_ready_bytes(range(4)) == [0, 1]
        return
    with pytest.raises(AssertionError, match="wrong bytes"):
        second.check_ready_bytes(range(4))


# -- two processes ----------------------------------------------------------------------

WRITER = """
import hashlib, json, sys
from tests.remote_support import Engine, content, make_store
engine = Engine(make_store(sys.argv[1]))
for key in range(int(sys.argv[2])):
    engine.store(key)
engine.close()  # the writes in flight go out first
stats = engine.stats()
print(json.dumps({"written": stats.written, "not_written": stats.not_written}))
"""

READER = """
import hashlib, json, sys
from kvoffload_spec.surface import Lookup
from tests.remote_support import SCRATCH, Engine, make_store
engine = Engine(make_store(sys.argv[1]), cpu_blocks=8)
count = int(sys.argv[2])
fetched = engine.fetch(range(count))
loaded = {}
for key in range(count):
    if engine.offloader.lookup(key) is Lookup.HIT:
        engine.offloader.load([key], [SCRATCH])
        engine.settle()
        loaded[key] = hashlib.sha256(bytes(engine.cache[SCRATCH].numpy())).hexdigest()
engine.close()
print(json.dumps({"fetched": {str(k): v for k, v in fetched.items()}, "sha256": loaded}))
"""


def run_python(program: str, *arguments: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", program, *arguments],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert done.returncode == 0, done.stderr
    answer: dict[str, Any] = json.loads(done.stdout)
    return answer


@pytest.mark.slow  # two torch imports, ~6 s; the in-process sharing test is in the fast tier
def test_a_second_process_fetches_the_first_ones_evicted_blocks_byte_exact(
    valkey_server: ValkeyServer,
) -> None:
    written = run_python(WRITER, valkey_server.url, "8")
    assert written == {"written": 6, "not_written": 0}  # 2 CPU blocks: 0-5 were evicted
    read = run_python(READER, valkey_server.url, "8")
    assert read["fetched"] == {str(key): key < 6 for key in range(8)}
    expected = {str(key): hashlib.sha256(content(key)).hexdigest() for key in range(6)}
    assert read["sha256"] == expected


# -- faults at random moments ------------------------------------------------------------


@pytest.mark.slow
def test_random_faults_never_load_a_wrong_byte(
    valkey_server: ValkeyServer, engines: list[Engine]
) -> None:
    """Two engines store, fetch and load at random while the server is killed, restarted
    empty, paused and resumed at random: every ready key loads its own bytes, and once the
    server is back for good, the remote serves again."""
    rng = random.Random(13)
    first = Engine(make_store(valkey_server.url, timeout_s=0.1), cpu_blocks=3)
    second = Engine(make_store(valkey_server.url, timeout_s=0.1), cpu_blocks=3)
    engines += [first, second]
    keys = range(12)
    paused = False
    for _ in range(60):
        engine = rng.choice((first, second))
        action = rng.random()
        if action < 0.4:
            key = rng.choice(keys)
            if engine.offloader.lookup(key) is Lookup.MISS:
                engine.store(key)
        elif action < 0.8:
            engine.offloader.fetch(rng.sample(keys, 3))
            if rng.random() < 0.5:
                engine.settle()
        elif action < 0.87 and not paused:
            valkey_server.kill()
            valkey_server.start()  # empty
        elif action < 0.94:
            if paused:
                valkey_server.resume()
            else:
                valkey_server.pause()
            paused = not paused
        for each in (first, second):
            each.offloader.poll()
            each.check_ready_bytes(keys)
    if paused:
        valkey_server.resume()
    for engine in (first, second):
        engine.settle()
        engine.check_ready_bytes(keys)
    time.sleep(0.1)
    for key in range(20, 30):  # the first call on a connection the restart broke may fail
        first.store(key)  # from the fourth on, each evicts one of these: written back
    wanted = [24, 25, 26]
    for _ in range(3):  # the reader's connection too may be a dead one, found on first use
        fetched = second.fetch(wanted)
        wanted = [key for key in wanted if not fetched[key]]
        if not wanted:
            break
        time.sleep(0.1)  # past retry_after_s
    assert wanted == [], (second.stats(), first.stats())
    assert second.check_ready_bytes([24, 25, 26]) == [24, 25, 26]
    for engine in (first, second):
        stats = engine.stats()
        assert stats.store is not None
        assert_accounted(stats.store)
        assert stats.fetch_hits + stats.fetch_misses == stats.fetch_keys
        assert stats.written + stats.not_written == stats.write_keys


class MisplansTheSecondFetch(Misplanning):
    """A manager of the caller's own that, once ``armed``, gives every store plan after the
    first the block ids ``doctor`` makes of the first one's: outside the pool, none, two, or
    the first one's again (one job would then write two keys' values into one block)."""

    def __init__(self, inner: OffloadManager, doctor: Callable[[list[int]], list[int]]) -> None:
        super().__init__(inner)
        self.doctor = doctor
        self.armed = False
        self.first: list[int] | None = None

    def prepare_store(self, keys: Sequence[Key]) -> StorePlan | None:
        if self.armed and self.first is not None:
            self.block_ids = self.doctor(self.first)
        try:
            plan = super().prepare_store(keys)
        finally:
            self.block_ids = None
        if self.armed and plan is not None and self.first is None:
            self.first = list(plan.block_ids)
        return plan


MISPLANS: dict[str, Callable[[list[int]], list[int]]] = {
    "one past the pool": lambda first: [4],
    "-1": lambda first: [-1],
    "no block id": lambda first: [],
    "two block ids": lambda first: [2, 3],
    "the first plan's block id": lambda first: first,
}


@pytest.mark.parametrize("misplan", MISPLANS, ids=list(MISPLANS))
def test_a_fetch_planned_a_bad_block_id_sends_nothing_and_ends_every_plan(
    valkey_server: ValkeyServer, engines: list[Engine], misplan: str
) -> None:
    """One fetch job carries a plan per key, checked as one: a bad block id in any plan
    (or one block id in two plans) is refused with a typed error before anything is sent,
    every plan made so far ends (no key left pending for ever), the victims are written
    back, and the same fetch with good plans then loads each key's own bytes."""
    keys = [1, 2, 3]
    assert make_store(valkey_server.url).put(keys, [content(key) for key in keys]) == [True] * 3
    inner = OffloadManager(4)
    manager = MisplansTheSecondFetch(inner, MISPLANS[misplan])
    engine = Engine(make_store(valkey_server.url), cpu_blocks=4, manager=manager)
    engines.append(engine)
    for key in (10, 11, 12, 13):  # a full pool: the fetch evicts
        engine.store(key)
    manager.armed = True
    with pytest.raises(InvalidArgumentError, match=r"cpu_block_ids|block ids"):
        engine.offloader.fetch(keys)
    manager.armed = False
    assert [inner.lookup(key) for key in keys] == [Lookup.MISS] * 3
    assert not inner.abstract_state().open_plans and engine.offloader.num_in_flight == 0
    assert engine.stats().fetch_keys == 0
    assert engine.fetch(keys) == {key: True for key in keys}
    assert engine.check_ready_bytes(keys) == keys
    evicted = [key for key in (10, 11, 12, 13) if inner.lookup(key) is Lookup.MISS]
    assert engine.fetch(evicted[:1]) == {evicted[0]: True}  # written back, then evicted
    assert engine.check_ready_bytes(evicted[:1]) == evicted[:1]
    inner.check_invariants()
