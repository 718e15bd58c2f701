"""The vLLM adapter against vLLM 0.33's own ``CPUOffloadingManager``, call for call.

A random walk drives both managers with the calls vLLM's scheduler makes (lookups until the
first miss, one load of the hit prefix, stores of the rest, completions by keys in any
order, failed stores, resets, finished requests) and compares every answer. Requests run
one after another here; interleaved requests are where the two recency rules differ (see
docs/integrations.md), so that mode checks the adapter's own invariants only.
"""

from __future__ import annotations

import importlib
import itertools
import random
from collections.abc import Iterable
from dataclasses import dataclass, field

import pytest
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from kvoffload.integrations.vllm import KvoffloadManager
from kvoffload.policies import BUILTIN_POLICIES
from tests.planted import PARTLY_PRESENT, Planted, PlantedAdapter, share


def test_the_adapter_takes_its_defaults_from_the_one_place() -> None:
    import inspect

    from kvoffload_spec import defaults

    parameters = inspect.signature(KvoffloadManager).parameters
    assert parameters["eviction_policy"].default == defaults.DEFAULT_POLICY
    assert parameters["store_threshold"].default == defaults.DEFAULT_STORE_THRESHOLD
    assert parameters["max_tracker_size"].default == defaults.DEFAULT_MAX_TRACKER_SIZE


def key(name: str) -> OffloadKey:
    return make_offload_key(name.encode(), 0)


def context(req_id: str, keys: list[OffloadKey]) -> ReqContext:
    ctx = ReqContext(req_id)
    for position, k in enumerate(keys):
        ctx.set_offload_key_position(k, position + 1)
    return ctx


@dataclass
class Tally:
    lookups: int = 0
    stores: int = 0
    rejected: int = 0
    evictions: int = 0
    loads: int = 0
    failed_stores: int = 0
    resets: int = 0
    requests: int = 0
    differences: list[str] = field(default_factory=list)


def stored_sets(events: Iterable[OffloadingEvent]) -> list[list[OffloadKey]]:
    return sorted(sorted(event.keys) for event in events if not event.removed)


def chains(rng: random.Random, count: int) -> list[list[OffloadKey]]:
    """Prompts as prefix chains: a few roots, each prompt extending a shared prefix."""
    prompts: list[list[OffloadKey]] = []
    for index in range(count):
        if prompts and rng.random() < 0.7:
            base = rng.choice(prompts)
            shared = base[: rng.randint(1, len(base))]
        else:
            shared = []
        tail = [key(f"r{index}-{i}") for i in range(rng.randint(1, 5))]
        prompts.append(shared + tail)
    return prompts


def walk(seed: int, steps: int, tally: Tally) -> None:
    rng = random.Random(seed)
    capacity = rng.randint(3, 12)
    threshold = rng.choice([0, 0, 2])
    ours = KvoffloadManager(capacity, "lru", store_threshold=threshold, enable_events=True)
    theirs = CPUOffloadingManager(capacity, "lru", store_threshold=threshold, enable_events=True)
    jobs: list[tuple[str, set[OffloadKey], ReqContext]] = []  # in flight, on both
    prompts = chains(rng, steps)
    for number, prompt in enumerate(prompts):
        tally.requests += 1
        ctx_ours, ctx_theirs = context(str(number), prompt), context(str(number), prompt)
        ours.on_new_request(ctx_ours)
        theirs.on_new_request(ctx_theirs)
        hits = 0
        for k in prompt:
            tally.lookups += 1
            found = ours.lookup(k, ctx_ours)
            assert found == theirs.lookup(k, ctx_theirs), (seed, number, k)
            if found is not LookupResult.HIT:
                break
            hits += 1
        if hits and rng.random() < 0.8:
            ours.prepare_load(prompt[:hits], ctx_ours)
            theirs.prepare_load(prompt[:hits], ctx_theirs)
            jobs.append(("load", set(prompt[:hits]), ctx_ours))
            tally.loads += 1
        rest = prompt[hits:]
        cut = rng.randint(0, len(rest))
        for part in (rest[:cut], rest[cut:]):
            if not part:
                continue
            offered = part + part[:1] if rng.random() < 0.1 else part  # a duplicate, rarely
            if len(offered) != len(part):
                continue  # vLLM 0.33 leaks a chunk on duplicates: test_duplicates_* below
            mine, vllm = (
                ours.prepare_store(offered, ctx_ours),
                theirs.prepare_store(offered, ctx_theirs),
            )
            tally.stores += 1
            assert (mine is None) == (vllm is None), (seed, number, offered)
            if mine is None or vllm is None:
                tally.rejected += 1
                continue
            assert mine.keys_to_store == vllm.keys_to_store, (seed, number)
            assert mine.evicted_keys == vllm.evicted_keys, (seed, number, "victims")
            tally.evictions += len(mine.evicted_keys)
            if mine.keys_to_store:
                jobs.append(("store", set(mine.keys_to_store), ctx_ours))
        # Finish some jobs now, in any order; some stores fail.
        rng.shuffle(jobs)
        for _ in range(rng.randint(0, len(jobs))):
            kind, keys, ctx = jobs.pop()
            if kind == "load":
                ours.complete_load(keys, ctx)
                theirs.complete_load(keys, ctx)
            else:
                success = rng.random() > 0.15
                tally.failed_stores += not success
                ours.complete_store(keys, ctx, success)
                theirs.complete_store(keys, ctx, success)
        ours.on_request_finished(ctx_ours)
        theirs.on_request_finished(ctx_theirs)
        ours.manager.check_invariants()
        # The same blocks announced as stored (the order of keys within one event follows
        # the set vLLM completes with in its manager, the plan's order in ours).
        assert stored_sets(ours.take_events()) == stored_sets(theirs.take_events())
        if rng.random() < 0.03:
            tally.resets += 1
            ours.reset_cache()
            theirs.reset_cache()
            jobs.clear()  # vLLM never completes jobs made before a reset
            ours.on_reset_flushed()
            ours.take_events()
    for k in {k for prompt in prompts for k in prompt}:
        assert ours.lookup(k, ReqContext("end")) == theirs.lookup(k, ReqContext("end"))


def test_lru_matches_vllms_manager_call_for_call(capsys: pytest.CaptureFixture[str]) -> None:
    tally = Tally()
    for seed in range(60):
        walk(seed, 120, tally)
    with capsys.disabled():
        print(f"\nvLLM differential (LRU, serial requests): {tally}")
    assert tally.evictions > 1000 and tally.rejected > 10 and tally.loads > 1000


@pytest.mark.parametrize("policy", sorted(BUILTIN_POLICIES))
def test_every_policy_of_the_registry_is_accepted(policy: str) -> None:
    manager = KvoffloadManager(4, policy)
    ctx = context("a", [key("a")])
    out = manager.prepare_store([key("a")], ctx)
    assert out is not None and out.keys_to_store == [key("a")]
    manager.complete_store([key("a")], ctx)
    assert manager.lookup(key("a"), ctx) is LookupResult.HIT


def test_duplicate_keys_in_one_store_leak_a_chunk_in_vllm_not_in_ours() -> None:
    a, b = key("a"), key("b")
    theirs = CPUOffloadingManager(4, "lru")
    ctx = context("r", [a, b])
    out = theirs.prepare_store([a, a, b], ctx)
    assert out is not None and out.keys_to_store == [a, a, b]  # vLLM allocates a twice
    theirs.complete_store(out.keys_to_store, ctx)
    resident = sum(theirs.lookup(k, ctx) is LookupResult.HIT for k in (a, b))
    # vLLM 0.33: free chunks + resident blocks no longer add up to the pool: one is lost.
    assert theirs._get_num_free_chunks() + resident == 3

    ours = KvoffloadManager(4, "lru")
    mine = ours.prepare_store([a, a, b], ctx)
    assert mine is not None and mine.keys_to_store == [a, b]
    ours.complete_store(mine.keys_to_store, ctx)
    stats = ours.manager.stats()
    assert stats.free + stats.resident == 4 and stats.resident == 2
    ours.manager.check_invariants()


def stored(manager: KvoffloadManager, names: str, ctx: ReqContext) -> list[OffloadKey]:
    keys = [key(name) for name in names]
    out = manager.prepare_store(keys, ctx)
    assert out is not None
    manager.complete_store(out.keys_to_store, ctx)
    return keys


def test_lookup_states_and_a_failed_store() -> None:
    manager = KvoffloadManager(4, "lru", enable_events=True)
    ctx = ReqContext("r")
    a, b = key("a"), key("b")
    assert manager.lookup(a, ctx) is LookupResult.MISS
    out = manager.prepare_store([a, b], ctx)
    assert out is not None and out.keys_to_store == [a, b] and out.evicted_keys == []
    assert manager.lookup(a, ctx) is LookupResult.HIT_PENDING
    manager.complete_store([a], ctx)  # half a job is not a job: nothing is readable yet
    assert manager.lookup(a, ctx) is LookupResult.HIT_PENDING
    manager.complete_store([b], ctx, success=False)
    # The job failed as a whole: neither key became readable, both block ids are free again.
    assert manager.lookup(a, ctx) is LookupResult.MISS
    assert manager.lookup(b, ctx) is LookupResult.MISS
    assert manager.manager.stats().free == 4
    (event,) = manager.take_events()
    assert event.removed and event.metadata_only and sorted(event.keys) == [a, b]


def test_stored_blocks_of_the_call_are_not_evicted_and_none_when_full_or_pinned() -> None:
    manager = KvoffloadManager(3, "lru", enable_events=True)
    ctx = context("r", [key(name) for name in "abcde"])
    a, b, c = stored(manager, "abc", ctx)
    # The request's blocks rank in prefix order (by token position), tail least recent.
    # Re-offering the tail c with a new d: c is protected, so b goes.
    out = manager.prepare_store([c, key("d")], ctx)
    assert out is not None and out.keys_to_store == [key("d")] and out.evicted_keys == [b]
    manager.complete_store(out.keys_to_store, ctx)
    # Everything pinned by loads: nothing can be evicted, so None, and nothing changed.
    manager.prepare_load([a, c, key("d")], ctx)
    before = manager.manager.stats()
    assert manager.prepare_store([key("e")], ctx) is None
    after = manager.manager.stats()
    assert (after.resident, after.pinned, after.free) == (before.resident, before.pinned, 0)
    manager.complete_load({a, c, key("d")}, ctx)
    # Full and the only evictable blocks are keys of this very call: None.
    assert manager.prepare_store([a, c, key("d"), key("e")], ctx) is None
    events = list(manager.take_events())
    assert [(e.removed, sorted(e.keys)) for e in events] == [
        (False, [a, b, c]),
        (True, [b]),
        (False, [key("d")]),
    ]


def test_two_loads_of_the_same_blocks_complete_one_each() -> None:
    manager = KvoffloadManager(2, "lru")
    ctx = ReqContext("r")
    a, b = stored(manager, "ab", ctx)
    manager.prepare_load([a, b], ctx)
    manager.prepare_load([b, a], ReqContext("s"))
    assert manager.manager.stats().pinned == 2
    manager.complete_load({a, b}, ctx)
    assert manager.prepare_store([key("c")], ctx) is None  # still pinned by the other load
    manager.complete_load({a, b}, ctx)
    assert manager.manager.stats().pinned == 0


def test_reset_keeps_old_jobs_block_ids_out_of_use_until_flushed() -> None:
    manager = KvoffloadManager(2, "lru")
    ctx = ReqContext("r")
    a = key("a")
    old = manager.prepare_store([a], ctx)
    assert old is not None
    old_block_ids = set(old.store_spec.block_ids.tolist())
    manager.reset_cache()
    # vLLM never completes the old job; its copy may still land in its CPU block.
    new = manager.prepare_store([a, key("b")], ctx)
    assert new is None  # one of two block ids is quarantined: no room for two
    new = manager.prepare_store([a], ctx)
    assert new is not None
    assert old_block_ids.isdisjoint(new.store_spec.block_ids.tolist())
    manager.complete_store([a], ctx)
    assert manager.lookup(a, ctx) is LookupResult.HIT
    manager.on_reset_flushed()  # every old job reported: its block id is free again
    assert manager.manager.stats().free == 1
    manager.manager.check_invariants()


def test_interleaved_requests_keep_every_invariant(capsys: pytest.CaptureFixture[str]) -> None:
    """Interleaved requests: the two managers' recency may differ (docs/integrations.md);
    ours must stay consistent, and the differences are counted."""
    rng = random.Random(7)
    differences = compared = 0
    for seed in range(20):
        ours = KvoffloadManager(8, "lru")
        theirs = CPUOffloadingManager(8, "lru")
        live: list[tuple[list[OffloadKey], ReqContext, ReqContext]] = []
        for number, prompt in enumerate(chains(random.Random(seed), 80)):
            pair = (prompt, context(str(number), prompt), context(str(number), prompt))
            live.append(pair)
            if len(live) < 3 and rng.random() < 0.7:
                continue
            prompt, mine, vllm = live.pop(rng.randrange(len(live)))
            a, b = ours.prepare_store(prompt, mine), theirs.prepare_store(prompt, vllm)
            compared += 1
            differences += (a is None) != (b is None) or (
                a is not None and b is not None and a.evicted_keys != b.evicted_keys
            )
            for out, manager, ctx in ((a, ours, mine), (b, theirs, vllm)):
                if out is not None and out.keys_to_store:
                    manager.complete_store(out.keys_to_store, ctx)
            ours.on_request_finished(mine)
            theirs.on_request_finished(vllm)
            ours.manager.check_invariants()
    with capsys.disabled():
        print(f"\ninterleaved requests: {differences} of {compared} stores differ from vLLM")


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_store_completed_in_parts_is_readable_only_if_every_part_succeeded(
    policy: str,
) -> None:
    """A plan of four keys completed by keys in two or more calls, in every split and
    order, each call succeeding or failing: a key whose completion said failure is never
    readable (its block holds what no copy wrote). vLLM's own manager marks each key by its
    own call; ours completes the plan as a whole, so it fails the whole plan."""
    names = "abcd"
    for cuts in itertools.product((False, True), repeat=len(names) - 1):
        parts: list[list[str]] = [[names[0]]]
        for name, cut in zip(names[1:], cuts, strict=True):
            if cut:
                parts.append([name])
            else:
                parts[-1].append(name)
        for order in itertools.permutations(range(len(parts))):
            for outcome in itertools.product((True, False), repeat=len(parts)):
                ours = KvoffloadManager(4, policy)
                ctx = ReqContext("r")
                keys = [key(name) for name in names]
                out = ours.prepare_store(keys, ctx)
                assert out is not None and out.keys_to_store == keys
                for part, success in zip((parts[i] for i in order), outcome, strict=True):
                    ours.complete_store([key(name) for name in part], ctx, success)
                readable = [ours.lookup(k, ctx) is LookupResult.HIT for k in keys]
                assert readable == [all(outcome)] * len(keys), (parts, order, outcome)
                ours.manager.check_invariants()
                assert ours.manager.stats().free == (0 if all(outcome) else 4)


def test_a_reset_between_the_parts_of_a_store_keeps_all_its_block_ids_out_of_use() -> None:
    """A store plan with some keys completed and some not when vLLM resets: the job may
    still write every block id of the plan (vLLM never completes it now), so none is handed
    out before ``on_reset_flushed``, and a late completion of its other keys changes
    nothing."""
    for done in range(1, 3):
        manager = KvoffloadManager(3, "lru")
        ctx = ReqContext("r")
        keys = [key(name) for name in "abc"]
        old = manager.prepare_store(keys, ctx)
        assert old is not None
        manager.complete_store(keys[:done], ctx)
        manager.reset_cache()
        assert manager.prepare_store([key("d")], ctx) is None  # all three quarantined
        manager.complete_store(keys[done:], ctx)  # a pre-reset job: nothing changes
        assert manager.prepare_store([key("d")], ctx) is None
        assert [manager.lookup(k, ctx) for k in keys] == [LookupResult.MISS] * 3
        manager.on_reset_flushed()
        new = manager.prepare_store([key(name) for name in "def"], ctx)
        assert new is not None and sorted(new.store_spec.block_ids.tolist()) == [0, 1, 2]
        manager.manager.check_invariants()


# -- stores of keys partly stored already ---------------------------------------------------


def partly_present_problems(adapter: type[KvoffloadManager] = KvoffloadManager) -> list[str]:
    """Every subset of four keys stored first, then a store offering all four (in order and
    reversed): the keys to store are vLLM's own manager's, in its order, and each is paired
    with the CPU block it loads from afterwards (vLLM copies ``keys_to_store[i]`` into
    ``store_spec.block_ids[i]``)."""
    problems = []
    names = "abcd"
    subsets = itertools.chain.from_iterable(
        itertools.combinations(names, size) for size in range(len(names) + 1)
    )
    for present in subsets:
        for order in (names, names[::-1]):
            ours, theirs = adapter(len(names), "lru"), CPUOffloadingManager(len(names), "lru")
            block_of: dict[OffloadKey, int] = {}
            case = f"{list(present)} stored, then {list(order)} offered"
            for offer in ([key(name) for name in present], [key(name) for name in order]):
                ctx, ctx_theirs = ReqContext("r"), ReqContext("r")
                out, out_theirs = (
                    ours.prepare_store(offer, ctx),
                    theirs.prepare_store(offer, ctx_theirs),
                )
                assert out is not None and out_theirs is not None, case
                expected = list(out_theirs.keys_to_store)
                if list(out.keys_to_store) != expected:
                    problems.append(f"{case}: stores {out.keys_to_store}, vLLM's {expected}")
                block_ids = out.store_spec.block_ids.tolist()
                block_of.update(zip(out.keys_to_store, block_ids, strict=True))
                ours.complete_store(out.keys_to_store, ctx)
                theirs.complete_store(out_theirs.keys_to_store, ctx_theirs)
            for name in names:
                k = key(name)
                if ours.lookup(k, ctx) is not LookupResult.HIT:
                    problems.append(f"{case}: {name} not stored")
                    continue
                loaded = ours.prepare_load([k], ctx).block_ids.tolist()
                ours.complete_load([k], ctx)
                if loaded != [block_of.get(k)]:
                    problems.append(
                        f"{case}: {name} loads from block {loaded}, stored in {block_of.get(k)}"
                    )
            left_open = ours.manager.abstract_state().open_plans  # a store of nothing new too
            if left_open:
                problems.append(f"{case}: plans left open {left_open}")
            ours.manager.check_invariants()
    return problems


def test_a_store_of_partly_stored_keys_pairs_each_key_with_its_own_block() -> None:
    assert partly_present_problems() == []


VLLM_SHARE = [
    bug
    for bug in share(PARTLY_PRESENT)
    if isinstance(bug.subject, PlantedAdapter) and bug.subject.engine == "vllm"
]


@pytest.mark.parametrize("entry", VLLM_SHARE, ids=lambda bug: bug.name)
def test_the_partly_present_checks_find_their_share_of_the_catalogue(entry: Planted) -> None:
    planted = entry.subject
    assert isinstance(planted, PlantedAdapter)
    adapter = getattr(importlib.import_module(planted.module), planted.class_name)
    assert issubclass(adapter, KvoffloadManager)
    assert partly_present_problems(adapter), f"{entry.name}: not found"


def test_the_adapter_keeps_nothing_of_jobs_that_ended() -> None:
    """A server runs for ever: once every job completed (or a reset dropped it and vLLM
    flushed), none of the adapter's per-job tables holds anything, whatever the jobs did
    (loads of many key sets, a store failed in part, a reset between a store's parts)."""
    ours = KvoffloadManager(8, "lru")
    ctx = ReqContext("r")
    a, b, c, d = (key(name) for name in "abcd")
    assert ours.prepare_store([a, b], ctx) is not None
    ours.complete_store([a, b], ctx)
    for keys in ([a], [b], [a, b], [b, a], [a]):
        ours.prepare_load(keys, ctx)
        ours.complete_load(set(keys), ctx)
    assert ours.prepare_store([c, d], ctx) is not None
    ours.complete_store([c], ctx, success=False)
    ours.reset_cache()  # d never completes: vLLM drops the job
    ours.on_reset_flushed()
    tables = {
        "store plans": ours._store_plan_of,
        "keys left": ours._store_left,
        "failed plans": ours._store_failed,
        "load plans": ours._load_plans,
        "abandoned": ours._abandoned,
    }
    assert {name: table for name, table in tables.items() if table} == {}
    assert not ours.manager.abstract_state().open_plans
    ours.manager.check_invariants()
