"""vLLM 0.33's ARC behaviours (``TestARCPolicy`` and the ``test_arc_*`` tests of
``tests/v1/kv_offload/cpu/test_manager.py``), on our adapter with ``eviction_policy="arc"``.

vLLM's tests read ``policy.t1``, ``t2``, ``b1``, ``b2`` and ``target_t1_size``; ours read
``ArcPolicy.lists()`` (each list least recent first) and ``ArcPolicy.p``. Where vLLM's
test calls its policy's ``evict(n, protected)`` with chunks pinned by writing their
``ref_cnt``, ours calls ``choose_victims(n, protected)`` with the chunks pinned by loads.
"""

from __future__ import annotations

import pytest
from vllm.v1.kv_offload.base import LookupResult, OffloadKey

from kvoffload.integrations.vllm import KvoffloadManager
from tests.vllm_port import EMPTY, arc, b1, b2, check_store, context, key, keys, manager, t1, t2


def stored(adapter: KvoffloadManager, numbers: list[int]) -> None:
    assert adapter.prepare_store(keys(numbers), EMPTY) is not None
    adapter.complete_store(keys(numbers), EMPTY)


def test_basic() -> None:
    adapter = manager(4, "arc", enable_events=True)
    check_store(adapter.prepare_store(keys([1, 2]), EMPTY), [1, 2], [], [0, 1])
    assert adapter.lookup(key(1), EMPTY) is LookupResult.HIT_PENDING
    assert list(adapter.take_events()) == []
    adapter.complete_store(keys([1, 2]), EMPTY)
    [event] = adapter.take_events()
    assert not event.removed and set(event.keys) == set(keys([1, 2]))
    assert adapter.lookup(key(3), EMPTY) is LookupResult.MISS
    assert (len(t1(adapter)), len(t2(adapter))) == (2, 0)


def test_t1_to_t2_promotion() -> None:
    adapter = manager(4, "arc")
    stored(adapter, [1])
    assert t1(adapter) == keys([1]) and t2(adapter) == []
    adapter.touch(keys([1]), EMPTY)  # a second access
    assert t1(adapter) == [] and t2(adapter) == keys([1])


def test_eviction_with_load() -> None:
    adapter = manager(4, "arc", enable_events=True)
    check_store(adapter.prepare_store(keys([1, 2, 3, 4]), EMPTY), [1, 2, 3, 4], [], [0, 1, 2, 3])
    adapter.complete_store(keys([1, 2, 3, 4]), EMPTY)
    adapter.prepare_load(keys([2, 3]), EMPTY)
    assert adapter.prepare_store(keys([5, 6, 7]), EMPTY) is None  # 2 and 3 are read
    adapter.complete_load(keys([2, 3]), EMPTY)
    output = adapter.prepare_store(keys([5, 6, 7]), EMPTY)
    assert output is not None and len(output.evicted_keys) >= 1


def test_adaptive_target() -> None:
    adapter = manager(2, "arc")
    stored(adapter, [1, 2])
    before = arc(adapter).p
    stored(adapter, [3])  # evicts 1 into B1
    assert key(1) in b1(adapter)
    adapter.touch(keys([1]), EMPTY)  # a ghost hit in B1: T1's target grows
    assert arc(adapter).p > before


def test_t1_t2_eviction_policy() -> None:
    adapter = manager(4, "arc")
    stored(adapter, [1, 2, 3, 4])
    adapter.touch(keys([3, 4]), EMPTY)
    assert (len(t1(adapter)), len(t2(adapter))) == (2, 2)
    arc(adapter).p = 1  # |T1| >= p: the victim comes from T1
    output = adapter.prepare_store(keys([5]), EMPTY)
    assert output is not None and output.evicted_keys == keys([1])
    adapter.complete_store(keys([5]), EMPTY)
    assert key(1) in b1(adapter) and key(5) in t1(adapter)


def test_batch_eviction_scans_t1_and_t2_once() -> None:
    """The victims' order (T1's run while it is preferred, then T2's); vLLM counts its
    OrderedDict's steps as well, which our structures do not have (choosing k victims
    walks k keys plus the protected ones: docs/manager.md)."""
    adapter = manager(256, "arc")
    everything = keys(range(256))
    stored(adapter, list(range(256)))
    adapter.touch(everything[128:], EMPTY)
    policy = arc(adapter)
    policy.p = 64
    protected = {everything[0], everything[2], everything[255]}
    adapter.prepare_load([everything[1], everything[254]], EMPTY)  # pinned
    first, second = t1(adapter), t2(adapter)
    from_t1 = len(first) - int(policy.p) + 1
    free = [k for k in first if k not in protected and k != everything[1]][:from_t1]
    rest = [k for k in second if k not in protected and k != everything[254]][: 124 - from_t1]
    assert policy.choose_victims(124, protected) == free + rest


def test_batch_eviction_falls_back_after_t1_iterator_exhausted() -> None:
    adapter = manager(8, "arc")
    stored(adapter, list(range(8)))
    adapter.touch(keys([6, 7]), EMPTY)
    policy = arc(adapter)
    policy.p = 4
    first, second = t1(adapter), t2(adapter)
    protected = set(first[1:3])
    adapter.prepare_load(first[3:], EMPTY)  # pinned: only first[0] is a T1 candidate
    assert len(first) - 1 >= int(policy.p)
    assert policy.choose_victims(3, protected) == [first[0], *second]


@pytest.mark.parametrize(
    "pinned, protected, new_keys, expected_evicted",
    [
        ([], [], [7, 8, 9], [6, 5, 3]),
        ([], [], [7, 8, 9, 10], [6, 5, 3, 4]),
        ([5, 6], [], [7, 8], [3, 4]),
        ([], [5, 6], [7, 8], [3, 4]),
        ([5, 6], [3], [7], [4]),
        ([5, 6], [3], [7, 8], None),
    ],
)
def test_store_falls_back_to_t1_when_t2_cannot_satisfy_eviction(
    pinned: list[int], protected: list[int], new_keys: list[int], expected_evicted: list[int] | None
) -> None:
    adapter = manager(4, "arc")
    for batch in ([1, 2, 3, 4], [5, 6]):
        stored(adapter, batch)
    # Ghost hits raise the target to 3; promotion leaves only 2 entries in T1.
    adapter.touch(keys([1, 2]), EMPTY)
    adapter.touch(keys([1]), EMPTY)
    adapter.touch(keys([5, 6]), EMPTY)
    policy = arc(adapter)
    assert policy.p == 3
    assert t1(adapter) == keys([3, 4]) and t2(adapter) == keys([6, 5])
    adapter.prepare_load(keys(pinned), EMPTY)
    before = policy.lists()
    output = adapter.prepare_store(keys(protected + new_keys), EMPTY)
    if expected_evicted is None:
        assert output is None and policy.lists() == before
    else:
        assert output is not None
        assert output.keys_to_store == keys(new_keys)
        assert output.evicted_keys == keys(expected_evicted)
        adapter.complete_store(keys(new_keys), EMPTY)
        assert all(adapter.lookup(k, EMPTY) is LookupResult.HIT for k in keys(new_keys))
    assert all(adapter.lookup(k, EMPTY) is LookupResult.HIT for k in keys(pinned + protected))
    adapter.complete_load(keys(pinned), EMPTY)


def test_batch_eviction_failure_is_atomic() -> None:
    adapter = manager(4, "arc")
    stored(adapter, [0, 1, 2, 3])
    before = arc(adapter).lists()
    assert arc(adapter).choose_victims(2, set(keys([1, 2, 3]))) is None
    assert arc(adapter).lists() == before and not t2(adapter) and not b1(adapter)


def test_ghost_list_bounds() -> None:
    adapter = manager(2, "arc")
    stored(adapter, [1, 2])
    for number in range(3, 20):
        stored(adapter, [number])
    assert len(b1(adapter)) <= 2 and len(b2(adapter)) <= 2


def test_touch_ordering() -> None:
    adapter = manager(4, "arc")
    stored(adapter, [1, 2, 3, 4])
    adapter.touch(keys([3, 4]), EMPTY)
    adapter.touch(keys([1, 3, 4]), EMPTY)
    assert (len(t1(adapter)), len(t2(adapter))) == (1, 3)
    check_store(adapter.prepare_store(keys([5]), EMPTY), [5], [2], [1])  # 2's chunk


def test_failed_store() -> None:
    adapter = manager(4, "arc")
    stored(adapter, [1, 2, 3, 4])
    output = adapter.prepare_store(keys([5]), EMPTY)
    assert output is not None and len(output.evicted_keys) == 1
    adapter.complete_store(keys([5]), EMPTY, success=False)
    assert adapter.lookup(key(5), EMPTY) is LookupResult.MISS
    assert key(5) not in t1(adapter) + t2(adapter)
    assert output.evicted_keys[0] in b1(adapter)


def test_full_scenario() -> None:
    adapter = manager(4, "arc", enable_events=True)
    stored(adapter, [1, 2])
    output = adapter.prepare_store(keys([3, 4, 5]), EMPTY)
    assert output is not None and len(output.evicted_keys) == 1
    adapter.complete_store(keys([3, 4, 5]), EMPTY)
    adapter.touch(keys([2, 3]), EMPTY)
    assert (len(t1(adapter)), len(t2(adapter))) == (2, 2)
    assert adapter.prepare_store(keys([6]), EMPTY) is not None
    adapter.complete_store(keys([6]), EMPTY)
    assert adapter.lookup(key(2), EMPTY) is LookupResult.HIT
    assert adapter.lookup(key(3), EMPTY) is LookupResult.HIT
    assert list(adapter.take_events())


# -- ARC and requests -------------------------------------------------------------------------


def test_reset_discards_stale_request_access_classification() -> None:
    adapter = manager(1, "arc")
    one = key(1)
    resumed = context("resumed")
    assert adapter.prepare_store([one], resumed) is not None
    adapter.complete_store([one], resumed)
    adapter.reset_cache()
    replacement = context("replacement")
    assert adapter.prepare_store([one], replacement) is not None
    adapter.complete_store([one], replacement)
    adapter.on_request_finished(replacement)
    assert t1(adapter) == [one]
    # The resumed request stored the key before the reset: reading it now is a reuse.
    adapter.prepare_load([one], resumed)
    adapter.complete_load([one], resumed)
    adapter.on_request_finished(resumed)
    assert t2(adapter) == [one]


def test_arc_counts_reuse_once_and_keeps_insertions_in_t1() -> None:
    """Issue 27: reading back one's own stores was counted as reuse (T1 -> T2).

    vLLM's test gives its request no token positions and expects T1 in reverse prefix
    order after the finish; vLLM's scheduler always gives them, and ours orders a
    request's stores by them (without positions ours keeps the order they were stored
    in: docs/integrations.md), so ours gives them."""
    adapter = manager(4, "arc")
    prefix = keys([1, 2, 3, 4])
    seed = context("seed")
    for position, k in enumerate(prefix, 1):
        seed.set_offload_key_position(k, position * 16)
    assert adapter.prepare_store(prefix, seed) is not None
    adapter.complete_store(prefix, seed)
    assert adapter.prepare_store(prefix, seed) is not None  # offered again: no reuse
    adapter.prepare_load(prefix, seed)  # read back (a cascade to a tier): no reuse
    adapter.complete_load(prefix, seed)
    adapter.on_request_finished(seed)
    assert t1(adapter) == list(reversed(prefix)) and t2(adapter) == []
    reuse = context("reuse")
    for _ in range(2):  # the second pin (a cascade's) counts no second reuse
        adapter.prepare_load(prefix, reuse)
        adapter.complete_load(prefix, reuse)
    adapter.on_request_finished(reuse)
    assert t1(adapter) == [] and t2(adapter) == list(reversed(prefix))


def test_arc_reuse_wins_if_same_request_later_reinserts_key() -> None:
    adapter = manager(1, "arc")
    first, second = keys([1, 2])
    seed = context("seed")
    assert adapter.prepare_store([first], seed) is not None
    adapter.complete_store([first], seed)
    adapter.on_request_finished(seed)
    reuse = context("reuse-and-reinsert")
    adapter.prepare_load([first], reuse)
    adapter.complete_load([first], reuse)
    other = context("evict-reused-key")
    assert adapter.prepare_store([second], other) is not None
    adapter.complete_store([second], other)
    adapter.on_request_finished(other)
    assert adapter.prepare_store([first], reuse) is not None
    adapter.complete_store([first], reuse)
    adapter.on_request_finished(reuse)
    assert first not in t1(adapter) and t2(adapter) == [first]


def test_arc_ghost_hit_adapts_once_per_request_before_insertion() -> None:
    """Issue 27: a refused store retried every step counted a ghost hit each time (p
    climbed 1.0 -> 2.0); vLLM counts one per request."""
    adapter = manager(2, "arc")
    three = keys([1, 2, 3])
    seed = context("seed")
    assert adapter.prepare_store(three[:2], seed) is not None
    adapter.complete_store(three[:2], seed)
    adapter.on_request_finished(seed)
    evict = context("create-ghost")
    output = adapter.prepare_store([three[2]], evict)
    assert output is not None
    [ghost] = output.evicted_keys
    adapter.complete_store([three[2]], evict)
    adapter.on_request_finished(evict)
    assert ghost in b1(adapter)
    residents = [k for k in three if k != ghost]
    pins = context("pin-residents")
    adapter.prepare_load(residents, pins)
    hit = context("ghost-hit")
    before = arc(adapter).p
    assert adapter.prepare_store([ghost], hit) is None
    after_first = arc(adapter).p
    assert after_first > before
    assert adapter.prepare_store([ghost], hit) is None
    assert arc(adapter).p == after_first
    adapter.complete_load(residents, pins)
    assert adapter.prepare_store([ghost], hit) is not None
    assert arc(adapter).p == after_first
    adapter.complete_store([ghost], hit)
    adapter.on_request_finished(hit)
    assert ghost in t1(adapter) and ghost not in t2(adapter)


def test_a_ghost_hit_of_another_request_still_counts() -> None:
    """The count is per request: another request's store of the ghost is a ghost hit of
    its own (as in vLLM)."""
    adapter = manager(2, "arc")
    stored(adapter, [1, 2])
    stored(adapter, [3])  # 1 becomes a ghost
    adapter.prepare_load(keys([2, 3]), EMPTY)  # nothing evictable: stores of 1 are refused
    first = context("a")
    targets = []
    for ctx in (first, first, context("b")):
        assert adapter.prepare_store(keys([1]), ctx) is None
        targets.append(arc(adapter).p)
    assert targets[0] == targets[1] < targets[2]


def test_arc_pending_chunk_is_not_a_frequency_hit() -> None:
    adapter = manager(2, "arc")
    one = key(1)
    assert adapter.prepare_store([one], context("writer")) is not None
    observer = context("pending-observer")
    output = adapter.prepare_store([one], observer)
    assert output is not None and not output.keys_to_store
    adapter.on_request_finished(observer)
    assert adapter.lookup(one, EMPTY) is LookupResult.HIT_PENDING
    assert t1(adapter) == [one] and t2(adapter) == []


def test_arc_promotes_when_the_request_finishes_not_at_each_call() -> None:
    """Issue 27: a reuse moved keys to T2 at each prepare call, even a refused store; vLLM
    (and now ours) promote when the request finishes."""
    adapter = manager(2, "arc")
    stored(adapter, [1, 2])
    reuse = context("reuse")
    adapter.prepare_load(keys([1]), reuse)  # 1 pinned, 2 the only candidate
    assert adapter.prepare_store(keys([2, 3, 4]), reuse) is None  # refused; 2 was offered
    adapter.complete_load(keys([1]), reuse)
    assert t2(adapter) == []  # nothing promoted yet
    adapter.on_request_finished(reuse)
    assert sorted(t2(adapter)) == sorted(keys([1, 2]))


def test_within_a_running_request_the_tail_goes_first() -> None:
    """The difference kept (docs/integrations.md): while a request runs, vLLM's ARC evicts
    its first stored chunk first, which leaves the rest of its prefix unreachable (a
    lookup stops at the first miss); ours evicts the tail of the request's store first."""
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    prefix = keys([1, 2, 3, 4])
    victims: list[list[OffloadKey]] = []
    for made in (lambda: manager(4, "arc"), lambda: CPUOffloadingManager(4, "arc")):
        system = made()
        running = context("running")
        for position, k in enumerate(prefix, 1):
            running.set_offload_key_position(k, position * 16)
        assert system.prepare_store(prefix, running) is not None
        system.complete_store(prefix, running)
        output = system.prepare_store(keys([5]), context("other"))
        assert output is not None
        victims.append(output.evicted_keys)
    assert victims == [keys([4]), keys([1])]


def arc_walk(seed: int, split: bool) -> tuple[int, int]:
    """Serial requests with token positions (as vLLM's scheduler gives them) through ours
    and vLLM 0.33's ARC manager: lookups of the prefix, a load of the hits, the rest
    stored (in one call, or ``split`` in two), completions in any order. Returns the
    stores compared before the first difference, and 1 if there was one."""
    import random

    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    rng = random.Random(seed)
    capacity = rng.randint(3, 12)
    ours, theirs = manager(capacity, "arc"), CPUOffloadingManager(capacity, "arc")
    prompts: list[list[OffloadKey]] = []
    jobs: list[tuple[bool, list[OffloadKey], object, object]] = []
    compared = 0
    for number in range(120):
        shared = rng.choice(prompts)[: rng.randint(1, 3)] if prompts and rng.random() < 0.7 else []
        prompt = shared + keys(range(1000 * number, 1000 * number + rng.randint(1, 5)))
        prompts.append(prompt)
        mine, vllm = context(str(number)), context(str(number))
        for ctx in (mine, vllm):
            for position, k in enumerate(prompt, 1):
                ctx.set_offload_key_position(k, position * 16)
        ours.on_new_request(mine)
        theirs.on_new_request(vllm)
        hits = 0
        for k in prompt:
            found = ours.lookup(k, mine)
            if found != theirs.lookup(k, vllm):
                return compared, 1
            if found is not LookupResult.HIT:
                break
            hits += 1
        if hits:
            ours.prepare_load(prompt[:hits], mine)
            theirs.prepare_load(prompt[:hits], vllm)
            jobs.append((False, prompt[:hits], mine, vllm))
        rest = prompt[hits:]
        cut = rng.randint(0, len(rest)) if split else len(rest)
        for part in (rest[:cut], rest[cut:]):
            if not part:
                continue
            a, b = ours.prepare_store(part, mine), theirs.prepare_store(part, vllm)
            if (a is None) != (b is None) or (
                a is not None
                and b is not None
                and (a.keys_to_store, a.evicted_keys) != (b.keys_to_store, b.evicted_keys)
            ):
                return compared, 1
            compared += 1
            if a is not None and a.keys_to_store:
                jobs.append((True, a.keys_to_store, mine, vllm))
        rng.shuffle(jobs)
        for _ in range(rng.randint(0, len(jobs))):
            store, done, ctx_ours, ctx_theirs = jobs.pop()
            if store:
                ours.complete_store(done, ctx_ours)
                theirs.complete_store(done, ctx_theirs)
            else:
                ours.complete_load(done, ctx_ours)
                theirs.complete_load(done, ctx_theirs)
        ours.on_request_finished(mine)
        theirs.on_request_finished(vllm)
    return compared, 0


def test_arc_matches_vllms_arc_call_for_call_with_one_store_per_request(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Ghost hits once per request, reuse counted at the finish and never of a request's
    own stores: with each request storing its blocks in one call, ours and vLLM's ARC make
    the same lookups, stores, refusals and victims. Storing in two calls is where they
    part (docs/integrations.md): counted, not asserted."""
    walks = [arc_walk(seed, split=False) for seed in range(40)]
    compared = sum(stores for stores, _ in walks)
    assert [parted for _, parted in walks] == [0] * 40 and compared == 40 * 120
    parted = sum(arc_walk(seed, split=True)[1] for seed in range(40))
    with capsys.disabled():
        print(
            f"\nARC vs vLLM: {compared} one-call stores alike; {parted} of 40 two-call walks part"
        )


def test_a_request_storing_in_two_calls_keeps_the_calls_order_after_it_finishes() -> None:
    """The difference left (docs/integrations.md): at the finish vLLM's ARC moves all of a
    request's own blocks to T1's most recent end, head last; a ready block cannot be
    reordered by ours without counting a reuse, so the earlier call's blocks stay older."""
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    prefix = keys([1, 2, 3, 4])
    victims: list[list[OffloadKey]] = []
    for made in (lambda: manager(4, "arc"), lambda: CPUOffloadingManager(4, "arc")):
        system = made()
        ctx = context("two-calls")
        for position, k in enumerate(prefix, 1):
            ctx.set_offload_key_position(k, position * 16)
        for part in (prefix[:2], prefix[2:]):
            assert system.prepare_store(part, ctx) is not None
            system.complete_store(part, ctx)
        system.on_request_finished(ctx)
        output = system.prepare_store(keys([5]), context("other"))
        assert output is not None
        victims.append(output.evicted_keys)
    assert victims == [keys([2]), keys([4])]
