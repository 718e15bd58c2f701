"""vLLM 0.33's ``tests/v1/kv_offload/cpu/test_manager.py`` behaviours, on our adapter.

Each test names the vLLM test it ports; where vLLM's test reads a private field, ours
reads the public counterpart (tests/vllm_port.py). The ARC tests are in
tests/test_vllm_ported_arc.py; the tests that do not carry over, and why, are listed in
docs/integrations.md.
"""

from __future__ import annotations

import pytest
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.common import CPUOffloadingMetrics

from kvoffload.integrations.vllm import KvoffloadManager
from kvoffload.policies import LruPolicy
from kvoffload_spec.errors import InvalidArgumentError
from kvoffload_spec.surface import Key
from tests.vllm_port import (
    EMPTY,
    check_store,
    chunk_ids,
    context,
    event_sets,
    key,
    keys,
    manager,
    reduced,
    usage,
)

SIZE = CPUOffloadingMetrics.CPU_ALLOCATION_SIZE
SKIPPED = CPUOffloadingMetrics.STORES_SKIPPED


def stored(adapter: KvoffloadManager, numbers: list[int], ctx: ReqContext = EMPTY) -> None:
    assert adapter.prepare_store(keys(numbers), ctx) is not None
    adapter.complete_store(keys(numbers), ctx)


# -- events ---------------------------------------------------------------------------------


def test_cpu_eviction_removed_precedes_stored() -> None:
    adapter = manager(2, enable_events=True)
    stored(adapter, [1, 2])
    list(adapter.take_events())
    stored(adapter, [3])
    events = list(adapter.take_events())
    removed = [i for i, event in enumerate(events) if event.removed]
    added = [i for i, event in enumerate(events) if not event.removed]
    assert removed and added and max(removed) < min(added)
    assert all(event.medium == Medium.CPU == adapter.medium for event in events)


def test_take_events_prunes_retried_cleanup_and_drains_once() -> None:
    adapter = manager(4, enable_events=True)
    assert adapter.prepare_store(keys([1, 2]), EMPTY) is not None
    adapter.complete_store(keys([1, 2]), EMPTY, success=False)
    # A retry owns key 1 again before the failure's cleanup is taken.
    assert adapter.prepare_store(keys([1]), EMPTY) is not None
    stored(adapter, [3])
    drain = iter(adapter.take_events())
    cleanup = next(drain)
    assert cleanup.removed and cleanup.metadata_only and cleanup.keys == keys([2])
    assert list(adapter.take_events()) == []  # stopping early does not replay the batch
    assert [event.keys for event in drain] == [keys([3])]


# -- the vLLM-style metrics -------------------------------------------------------------------


def test_filter_reused_manager_reports_stores_skipped_counter() -> None:
    """Bug 2 of issue 27: the counter was never set."""
    adapter = manager(4, store_threshold=2)
    check_store(adapter.prepare_store(keys([1, 2, 3]), EMPTY), [], [], [])
    assert reduced(adapter)[SKIPPED] == 3
    assert reduced(adapter)[SKIPPED] == 0


def test_cpu_manager_reports_no_config_info_without_info() -> None:
    assert manager(4).config_info() == [{}]


def test_cpu_manager_reports_cache_usage_gauge() -> None:
    adapter = manager(4)
    assert usage(adapter)[2] == 0.0
    adapter.prepare_store(keys([1, 2]), EMPTY)
    assert usage(adapter)[2] == pytest.approx(0.5)
    adapter.prepare_store(keys([3, 4]), EMPTY)
    assert usage(adapter)[2] == pytest.approx(1.0)
    adapter.complete_store(keys([1, 2]), EMPTY)
    assert usage(adapter)[2] == pytest.approx(0.5)
    adapter.complete_store(keys([3, 4]), EMPTY)
    assert usage(adapter)[2] == 0.0


def test_a_pool_of_no_chunk_is_a_typed_error_naming_cpu_bytes_to_use() -> None:
    """vLLM's test_cpu_manager_reports_cache_usage_gauge starts with ``num_chunks=0``,
    which vLLM's manager accepts and then offloads nothing; ours says so at start-up."""
    with pytest.raises(InvalidArgumentError, match="cpu_bytes_to_use"):
        manager(0)


def test_cpu_manager_reports_allocation_size_histogram() -> None:
    adapter = manager(4)
    stored(adapter, [1, 2])
    adapter.prepare_store(keys([1, 2, 3]), EMPTY)
    values = reduced(adapter)
    assert (values[f"{SIZE}_count"], values[f"{SIZE}_sum"]) == (2, 3)
    assert f"{SIZE}_count" not in reduced(adapter)


def test_cpu_manager_reports_allocation_size_on_eviction_failure() -> None:
    """Bug 3 of issue 27: a refused store was not counted."""
    adapter = manager(1)
    adapter.prepare_store(keys([1]), EMPTY)
    reduced(adapter)
    assert adapter.prepare_store(keys([2]), EMPTY) is None
    values = reduced(adapter)
    assert (values[f"{SIZE}_count"], values[f"{SIZE}_sum"]) == (1, 1)


def test_cpu_manager_reports_cache_write_and_read_usage_gauges() -> None:
    adapter = manager(4)
    adapter.prepare_store(keys([1, 2]), EMPTY)
    assert usage(adapter) == pytest.approx((0.5, 0.0, 0.5))
    adapter.complete_store(keys([1, 2]), EMPTY)
    assert usage(adapter) == pytest.approx((0.0, 0.0, 0.0))
    assert adapter.lookup(key(1), EMPTY) is LookupResult.HIT
    adapter.prepare_load(keys([1]), EMPTY)
    assert usage(adapter) == pytest.approx((0.0, 0.25, 0.25))
    adapter.complete_load(keys([1]), EMPTY)
    assert usage(adapter) == pytest.approx((0.0, 0.0, 0.0))
    adapter.prepare_store(keys([3, 4]), EMPTY)
    adapter.prepare_load(keys([2]), EMPTY)
    assert usage(adapter) == pytest.approx((0.5, 0.25, 0.75))


def test_cpu_manager_clears_write_usage_after_failed_store() -> None:
    adapter = manager(4)
    adapter.prepare_store(keys([1, 2]), EMPTY)
    assert usage(adapter) == pytest.approx((0.5, 0.0, 0.5))
    adapter.complete_store(keys([1, 2]), EMPTY, success=False)
    assert usage(adapter) == pytest.approx((0.0, 0.0, 0.0))


# -- the LRU walk-through ---------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_already_stored_chunk_not_evicted_during_prepare_store(policy: str) -> None:
    adapter = manager(4, policy, enable_events=True)
    stored(adapter, [1, 2])
    adapter.touch(keys([1]), EMPTY)
    output = adapter.prepare_store(keys([2, 3, 4, 5]), EMPTY)
    check_store(output, [3, 4, 5], [1], [2, 3, 0])
    adapter.complete_store(keys([2, 3, 4, 5]), EMPTY)
    assert adapter.lookup(key(2), EMPTY) is LookupResult.HIT


def test_cpu_manager() -> None:
    adapter = manager(4, enable_events=True)
    check_store(adapter.prepare_store(keys([1, 2]), EMPTY), [1, 2], [], [0, 1])
    assert adapter.lookup(key(1), EMPTY) is LookupResult.HIT_PENDING
    assert adapter.lookup(key(2), EMPTY) is LookupResult.HIT_PENDING
    assert list(adapter.take_events()) == []
    adapter.complete_store(keys([1, 2]), EMPTY)
    assert event_sets(adapter.take_events()) == ([set(keys([1, 2]))], [])
    assert [adapter.lookup(k, EMPTY) for k in keys([1, 2, 3])] == [
        LookupResult.HIT,
        LookupResult.HIT,
        LookupResult.MISS,
    ]
    ids = check_store(adapter.prepare_store(keys([2, 3, 4, 5]), EMPTY), [3, 4, 5], [1], [2, 3, 0])
    chunk_of = dict(zip(keys([3, 4, 5]), ids, strict=True)) | {key(2): 1}
    assert event_sets(adapter.take_events()) == ([], [set(keys([1]))])
    assert adapter.prepare_store(keys([1, 6]), EMPTY) is None
    adapter.complete_store(keys([2, 3, 4, 5]), EMPTY)
    assert [adapter.lookup(k, EMPTY) for k in keys([1, 2, 3, 4, 5, 0])] == [
        LookupResult.MISS,
        *[LookupResult.HIT] * 4,
        LookupResult.MISS,
    ]
    load_ctx = context("load-2-3")
    # vLLM's chunk ids are [1, 2]: each key's own chunk, in the order asked.
    assert chunk_ids(adapter.prepare_load(keys([2, 3]), load_ctx)) == [
        chunk_of[key(2)],
        chunk_of[key(3)],
    ]
    assert adapter.prepare_store(keys([6, 7, 8]), EMPTY) is None  # 2 and 3 are read
    adapter.complete_load(keys([2, 3]), load_ctx)
    adapter.on_request_finished(load_ctx)
    # The oldest go, and within the read prefix [2, 3] its tail before its head.
    check_store(adapter.prepare_store(keys([6, 7, 8]), EMPTY), [6, 7, 8], [4, 5, 3], [2, 0, 3])
    adapter.complete_store(keys([6, 7, 8]), EMPTY)
    adapter.touch(keys([2, 6, 7]), EMPTY)
    check_store(adapter.prepare_store(keys([9]), EMPTY), [9], [8])
    adapter.complete_store(keys([7, 9]), EMPTY, success=False)  # 7 was stored already
    assert adapter.lookup(key(7), EMPTY) is LookupResult.HIT
    assert adapter.lookup(key(9), EMPTY) is LookupResult.MISS
    assert event_sets(adapter.take_events()) == (
        [set(keys([3, 4, 5])), set(keys([6, 7, 8]))],
        [set(keys([4, 5, 3])), set(keys([8])), set(keys([9]))],
    )


def test_prepare_load_preserves_key_order() -> None:
    adapter = manager(4)
    a, b, c = keys([0, 1, 2])
    output = adapter.prepare_store([a, b, c], EMPTY)
    assert output is not None
    chunk_of = dict(zip(output.keys_to_store, chunk_ids(output.store_spec), strict=True))
    adapter.complete_store([a, b, c], EMPTY)
    for order in ([a, b, c], [b, c, a]):
        assert chunk_ids(adapter.prepare_load(order, EMPTY)) == [chunk_of[k] for k in order]
        adapter.complete_load([a, b, c], EMPTY)  # the order of a completion is irrelevant


def test_lru_batch_eviction_failure_is_atomic() -> None:
    """Ported at the adapter: vLLM's test calls its policy's private ``evict``."""
    adapter = manager(4)
    four = keys([1, 2, 3, 4])
    stored(adapter, [1, 2, 3, 4])
    before = adapter.manager.abstract_state()
    # Keys 2-4 are offered (protected), so two victims cannot be found: nothing changes.
    assert adapter.prepare_store([*four[1:], key(5), key(6)], EMPTY) is None
    assert adapter.manager.abstract_state().blocks == before.blocks
    assert all(adapter.lookup(k, EMPTY) is LookupResult.HIT for k in four)
    output = adapter.prepare_store([*four[1:], key(5)], EMPTY)
    assert output is not None and output.evicted_keys == [four[0]]


def test_lru_repeated_pin_cycles_compact_lazy_heap_entries() -> None:
    """vLLM's test bounds its lazy heap; ours has none: the policy stays well formed and
    the key is still the one victim after 128 pin cycles."""
    adapter = manager(1)
    stored(adapter, [1])
    for _ in range(128):
        adapter.prepare_load(keys([1]), EMPTY)
        adapter.complete_load(keys([1]), EMPTY)
    adapter.manager.check_invariants()
    assert adapter.manager.policy.resident() == keys([1])
    output = adapter.prepare_store(keys([2]), EMPTY)
    assert output is not None and output.evicted_keys == keys([1])


# -- the offer tracker ------------------------------------------------------------------------


def test_filter_reused_manager() -> None:
    """vLLM reads its private ``counts``; ours the public ``offer_count``."""
    adapter = manager(4, enable_events=True, store_threshold=2, max_tracker_size=3)
    offers = adapter.manager.offer_count
    assert adapter.lookup(key(1), EMPTY) is LookupResult.MISS  # lookups are no offers
    assert offers(key(1)) == 0
    check_store(adapter.prepare_store(keys([1, 2]), EMPTY), [], [])
    assert (offers(key(1)), offers(key(2))) == (1, 1)
    check_store(adapter.prepare_store(keys([1, 2]), EMPTY), [1, 2], [])
    adapter.complete_store(keys([1, 2]), EMPTY)
    check_store(adapter.prepare_store(keys([3, 4]), EMPTY), [], [])
    assert (offers(key(1)), offers(key(3)), offers(key(4))) == (0, 1, 1)
    check_store(adapter.prepare_store(keys([1]), EMPTY), [], [])
    assert offers(key(1)) == 1


def test_filter_reused_manager_oversized_offer_makes_progress() -> None:
    adapter = manager(4, store_threshold=2, max_tracker_size=3)
    wanted = keys([1, 2, 3, 4])
    done: set[OffloadKey] = set()
    for _ in range(4):
        output = adapter.prepare_store([k for k in wanted if k not in done], EMPTY)
        assert output is not None
        if output.keys_to_store:
            adapter.complete_store(output.keys_to_store, EMPTY)
            done.update(output.keys_to_store)
    assert done == set(wanted)


def test_store_threshold_does_not_hide_ready_reuse() -> None:
    """vLLM reads its private ``stores_skipped_in_current_batch``; ours the counter on
    the stats."""
    adapter = manager(2, store_threshold=2, max_tracker_size=2)
    head, tail, noise_1, noise_2, replacement = keys(range(5))
    seed = context("seed")
    check_store(adapter.prepare_store([head, tail], seed), [], [])
    output = adapter.prepare_store([head, tail], seed)
    assert output is not None and output.keys_to_store == [head, tail]
    adapter.complete_store([head, tail], seed)
    adapter.on_request_finished(seed)
    check_store(adapter.prepare_store([noise_1, noise_2], context("noise")), [], [])
    reduced(adapter)
    reuse = context("reuse")
    check_store(adapter.prepare_store([tail], reuse), [], [])
    assert reduced(adapter)[SKIPPED] == 0  # the resident tail is a reuse, not a skip
    adapter.on_request_finished(reuse)
    other = context("replacement")
    check_store(adapter.prepare_store([replacement], other), [], [])
    output = adapter.prepare_store([replacement], other)
    assert output is not None and output.evicted_keys == [head]


def test_evictable_cache_chunk_count() -> None:
    """The seed of the evictable counter (vLLM's private ``_num_evictable_cache_chunks``;
    ours ``stats().evictable``), and its O(1) refusal (vLLM spies on its policy's
    ``evict``; ours counts ``fast_fail_rejections`` and its policy is never asked)."""
    calls: list[int] = []

    class Spy(LruPolicy):
        def choose_victims(self, need: int, protected: object) -> list[Key] | None:
            calls.append(need)
            return super().choose_victims(need, protected)  # type: ignore[arg-type]

    from kvoffload.manager import OffloadManager

    adapter = KvoffloadManager(4, manager=OffloadManager(4, Spy))

    def evictable() -> int:
        return adapter.manager.stats().evictable

    assert evictable() == 0
    adapter.prepare_store(keys([1, 2, 3]), EMPTY)
    assert evictable() == 0
    adapter.complete_store(keys([1, 2, 3]), EMPTY)
    assert evictable() == 3
    adapter.prepare_load(keys([1]), EMPTY)
    assert evictable() == 2
    adapter.prepare_load(keys([1]), EMPTY)  # a second concurrent load of the same chunk
    assert evictable() == 2
    adapter.complete_load(keys([1]), EMPTY)
    assert evictable() == 2
    adapter.complete_load(keys([1]), EMPTY)
    assert evictable() == 3
    adapter.prepare_store(keys([4, 5, 6]), EMPTY)  # one free chunk, two evictions
    assert evictable() == 1
    adapter.complete_store(keys([4, 5, 6]), EMPTY, success=False)
    assert evictable() == 1
    adapter.reset_cache()
    assert evictable() == 0
    stored(adapter, [10, 11, 12])
    adapter.prepare_load(keys([10, 11, 12]), EMPTY)
    assert evictable() == 0
    calls.clear()
    assert adapter.prepare_store(keys([14, 15]), EMPTY) is None
    assert calls == [] and adapter.manager.stats().fast_fail_rejections == 1
    adapter.complete_load(keys([10, 11, 12]), EMPTY)
    assert evictable() == 3
    assert adapter.prepare_store(keys([14, 15]), EMPTY) is not None
    assert evictable() == 2
    adapter.complete_store(keys([14, 15]), EMPTY)
    assert evictable() == 4


# -- recency of requests (LRU) ----------------------------------------------------------------


@pytest.mark.parametrize("finish_before_completion", [False, True])
def test_request_finish_orders_lru_prefix_independent_of_store_completion(
    finish_before_completion: bool,
) -> None:
    adapter = manager(4)
    prefix, ctx = keys([1, 2, 3, 4]), context("prefix")
    assert adapter.prepare_store(prefix, ctx) is not None
    if finish_before_completion:
        adapter.on_request_finished(ctx)
    adapter.complete_store(set(prefix), ctx)
    if not finish_before_completion:
        adapter.on_request_finished(ctx)
    output = adapter.prepare_store(keys([5]), context("evict"))
    assert output is not None and output.evicted_keys == keys([4])


@pytest.mark.parametrize("finish_before_completion", [False, True])
def test_request_finish_orders_lru_prefix_independent_of_load_completion(
    finish_before_completion: bool,
) -> None:
    adapter = manager(4)
    prefix = keys([1, 2, 3, 4])
    stored(adapter, [1, 2, 3, 4], context("seed"))
    reuse = context("reuse")
    adapter.prepare_load(prefix, reuse)
    if finish_before_completion:
        adapter.on_request_finished(reuse)
    adapter.complete_load(set(prefix), reuse)
    if not finish_before_completion:
        adapter.on_request_finished(reuse)
    output = adapter.prepare_store(keys([5]), context("evict"))
    assert output is not None and output.evicted_keys == keys([4])


def test_late_old_completion_does_not_override_newer_request_recency() -> None:
    adapter = manager(4)
    old = context("old")
    assert adapter.prepare_store(keys([1, 2]), old) is not None
    adapter.on_request_finished(old)
    stored(adapter, [3, 4], new := context("new"))
    adapter.on_request_finished(new)
    adapter.complete_store(keys([1, 2]), old)  # late, but the access is older
    output = adapter.prepare_store(keys([5]), context("evict"))
    assert output is not None and output.evicted_keys == keys([2])


def test_request_key_positions_override_store_observation_order() -> None:
    adapter = manager(2)
    head, tail = keys([1, 2])
    ctx = context("out-of-order-store")
    ctx.set_offload_key_position(head, 16)
    ctx.set_offload_key_position(tail, 32)
    assert adapter.prepare_store([tail], ctx) is not None  # a backfill offers the tail first
    assert adapter.prepare_store([head], ctx) is not None
    adapter.on_request_finished(ctx)
    adapter.complete_store({head, tail}, ctx)
    output = adapter.prepare_store(keys([3]), context("evict-tail"))
    assert output is not None and output.evicted_keys == [tail]


def test_request_key_positions_order_tails_across_kv_groups() -> None:
    adapter = manager(4)
    head_0, tail_0 = make_offload_key(b"group-0-head", 0), make_offload_key(b"group-0-tail", 0)
    head_1, tail_1 = make_offload_key(b"group-1-head", 1), make_offload_key(b"group-1-tail", 1)
    ctx = context("hybrid-groups")
    for k in (head_0, head_1):
        ctx.set_offload_key_position(k, 16)
    for k in (tail_0, tail_1):
        ctx.set_offload_key_position(k, 32)
    both = [head_0, tail_0, head_1, tail_1]
    assert adapter.prepare_store(both, ctx) is not None
    adapter.complete_store(both, ctx)
    adapter.on_request_finished(ctx)
    output = adapter.prepare_store(keys([10, 11]), context("evict"))
    assert output is not None and set(output.evicted_keys) == {tail_0, tail_1}


@pytest.mark.parametrize("batch_size", [1, 2, 3])
@pytest.mark.parametrize("reverse_completion", [False, True])
def test_unfinished_lru_prefix_survives_pressure_across_store_batches(
    batch_size: int, reverse_completion: bool
) -> None:
    adapter = manager(8)
    ctx = context("unfinished")
    groups = [[make_offload_key(str(p).encode(), g) for p in range(3)] for g in range(2)]
    batches = []
    for start in range(0, 3, batch_size):
        batch = [k for group in groups for k in group[start : start + batch_size]]
        for group in groups:
            for position in range(start, min(start + batch_size, 3)):
                ctx.set_offload_key_position(group[position], (position + 1) * 16)
        assert adapter.prepare_store(batch, ctx) is not None
        batches.append(batch)
        if not reverse_completion:
            adapter.complete_store(batch, ctx)
    if reverse_completion:
        for batch in reversed(batches):
            adapter.complete_store(batch, ctx)
    output = adapter.prepare_store(keys([10, 11, 12, 13]), context("B"))
    assert output is not None and set(output.evicted_keys) == {group[-1] for group in groups}
    for group in groups:
        assert all(adapter.lookup(k, ctx) is LookupResult.HIT for k in group[:-1])


@pytest.mark.parametrize("reuse_method", ["load", "store"])
def test_unfinished_lru_reused_prefix_outlives_new_tail(reuse_method: str) -> None:
    adapter = manager(4)
    head, middle, tail = keys([1, 2, 3])
    seed = context("seed")
    stored(adapter, [1, 2], seed)
    adapter.on_request_finished(seed)
    ctx = context("reuse")
    for position, k in enumerate([head, middle, tail], 1):
        ctx.set_offload_key_position(k, position * 16)
    if reuse_method == "load":
        adapter.prepare_load([head, middle], ctx)
        adapter.complete_load([middle, head], ctx)
    else:
        assert adapter.prepare_store([head, middle], ctx) is not None
    assert adapter.prepare_store([tail], ctx) is not None
    adapter.complete_store([tail], ctx)
    output = adapter.prepare_store(keys([10, 11, 12]), context("B"))
    assert output is not None and set(output.evicted_keys) == {middle, tail}
    assert adapter.lookup(head, ctx) is LookupResult.HIT


@pytest.mark.parametrize("complete_each", [True, False])
def test_unfinished_lru_backfill_orders_by_token_position(complete_each: bool) -> None:
    """Also vLLM's test_lru_insert_orders_positioned_chunks_without_followup_access, at
    the adapter (vLLM's calls its policy's ``insert`` with a request context; ours has
    none): out-of-order stores of one request rank by token position, tail first."""
    adapter = manager(3)
    ctx = context("backfill")
    head, middle, tail = keys([1, 2, 3])
    for position, k in enumerate([head, middle, tail], 1):
        ctx.set_offload_key_position(k, position * 16)
    for k in [head, tail, middle]:
        assert adapter.prepare_store([k], ctx) is not None
        if complete_each:
            adapter.complete_store([k], ctx)
    if not complete_each:
        adapter.complete_store([head, tail, middle], ctx)
    output = adapter.prepare_store(keys([4, 5]), context("B"))
    assert output is not None and output.evicted_keys == [tail, middle]


def test_lru_failed_store_retry_preserves_prefix_order() -> None:
    adapter = manager(2)
    ctx = context("retry")
    head, tail = keys([1, 2])
    ctx.set_offload_key_position(head, 16)
    ctx.set_offload_key_position(tail, 32)
    assert adapter.prepare_store([head], ctx) is not None
    adapter.complete_store([head], ctx, success=False)
    for k in (head, tail):
        assert adapter.prepare_store([k], ctx) is not None
        adapter.complete_store([k], ctx)
    output = adapter.prepare_store(keys([3]), context("B"))
    assert output is not None and output.evicted_keys == [tail]


def test_lru_reset_discards_unfinished_request_recency() -> None:
    adapter = manager(2)
    ctx = context("resumed")
    head = key(1)
    ctx.set_offload_key_position(head, 16)
    assert adapter.prepare_store([head], ctx) is not None
    adapter.complete_store([head], ctx)
    adapter.reset_cache()
    other = context("other")
    other.set_offload_key_position(key(9), 16)
    assert adapter.prepare_store(keys([9]), other) is not None
    adapter.complete_store(keys([9]), other)
    assert adapter.prepare_store([head], ctx) is not None
    adapter.complete_store([head], ctx)
    output = adapter.prepare_store(keys([10]), context("B"))
    assert output is not None and output.evicted_keys == keys([9])


def test_older_lru_request_does_not_demote_a_newer_shared_access() -> None:
    adapter = manager(3)
    old = context("old")
    pinned, cold, shared = keys([1, 2, 3])
    steps = [(old, pinned, 16), (context("cold"), cold, 16), (context("newer"), shared, 32)]
    for ctx, k, position in steps:
        ctx.set_offload_key_position(k, position)
        assert adapter.prepare_store([k], ctx) is not None
        adapter.complete_store([k], ctx)
    adapter.prepare_load([pinned], old)
    old.set_offload_key_position(shared, 32)
    adapter.prepare_load([shared], old)
    adapter.complete_load([shared], old)
    output = adapter.prepare_store(keys([4]), context("pressure"))
    assert output is not None and output.evicted_keys == [cold]
    adapter.complete_load([pinned], old)


def test_lru_incremental_stores_do_not_rescan_the_prefix() -> None:
    """Each key's position is read once (vLLM's bound: at most three times per key). The
    adapter still touches the request's prefix after each call: docs/integrations.md."""

    class CountingContext(ReqContext):  # type: ignore[misc]
        position_lookups = 0

        def get_offload_key_position(self, key: OffloadKey) -> int | None:
            self.position_lookups += 1
            position: int | None = super().get_offload_key_position(key)
            return position

    prefix = keys(range(64))
    adapter = manager(len(prefix))
    ctx = CountingContext(req_id="incremental")
    for position, k in enumerate(prefix, 1):
        ctx.set_offload_key_position(k, position * 16)
        assert adapter.prepare_store([k], ctx) is not None
        adapter.complete_store([k], ctx)
    assert 0 < ctx.position_lookups <= 3 * len(prefix)


def test_failed_store_records_access_once_and_uses_store_miss_hook() -> None:
    """The policy hears a refused store's miss once per request (vLLM spies on its
    policy's ``on_store_miss``; ours is a policy subclass, kvoffload's extension point).
    vLLM's test also spies on its ``on_request_finished`` hook, which our policy
    interface does not have: at the finish ours touches the request's keys instead."""
    misses: list[list[Key]] = []
    touches: list[list[Key]] = []

    class Spy(LruPolicy):
        def on_store_miss(self, keys: object) -> None:
            misses.append(list(keys))  # type: ignore[call-overload]

        def touch(self, keys: object, is_ready: object) -> None:
            touches.append(list(keys))  # type: ignore[call-overload]
            super().touch(keys, is_ready)  # type: ignore[arg-type]

    from kvoffload.manager import OffloadManager

    adapter = KvoffloadManager(1, manager=OffloadManager(1, Spy))
    resident, candidate = keys([1, 2])
    stored(adapter, [1], context("seed"))
    pin = context("pin")
    adapter.prepare_load([resident], pin)
    misses.clear()
    touches.clear()
    ctx = context("failed-store")
    for _ in range(3):  # vLLM retries a refused store every step
        assert adapter.prepare_store([candidate, resident], ctx) is None
    assert misses == [[candidate]]
    adapter.on_request_finished(ctx)
    assert touches[-1] == [candidate, resident]  # the request's accesses, head first
    adapter.complete_load([resident], pin)
