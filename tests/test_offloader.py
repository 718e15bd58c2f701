"""The Offloader facade: plans drive copies, poll completes plans, reset waits."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable

import pytest
import torch

from kvoffload import Finished, Offloader
from kvoffload.manager import OffloadManager
from kvoffload.policies import LruPolicy
from kvoffload.transfer import EngineClosedError
from kvoffload_spec import OffloadModel
from kvoffload_spec.errors import BlockNotFoundError, BlockPendingError, InvalidArgumentError
from kvoffload_spec.surface import Lookup, ManagerOperations, ManagerSurface
from tests.caches import DEVICES, make_cache, reference_block


def build(
    *,
    num_blocks: int = 8,
    cpu_blocks: int = 4,
    factor: int = 1,
    device: str = "cpu",
    threaded: bool = False,
) -> tuple[Offloader, list[torch.Tensor], int]:
    tensors, block_dim = make_cache("kv_split", num_blocks=num_blocks, device=device)
    offloader = Offloader(
        tensors,
        num_cpu_blocks=cpu_blocks,
        block_dim=block_dim,
        block_size_factor=factor,
        threaded=threaded,
    )
    return offloader, tensors, block_dim


def settle(offloader: Offloader) -> list[Finished]:
    offloader.wait()
    return offloader.poll()


def counts(offloader: Offloader) -> tuple[int, int]:
    manager = offloader.manager
    assert isinstance(manager, OffloadManager)
    return manager.num_free_blocks, manager.num_evictable_blocks


class FailJob:
    """A fault hook failing job ``job`` at its run ``run``."""

    def __init__(self, job: int, run: int = 0) -> None:
        self.job, self.run = job, run

    def __call__(self, job: int, run: int) -> None:
        if (job, run) == (self.job, self.run):
            raise RuntimeError(f"injected into job {job} at run {run}")


@pytest.mark.parametrize("device", DEVICES)
def test_store_then_load_by_key(device: str) -> None:
    offloader, tensors, dim = build(device=device, factor=2)
    before = [reference_block(tensors, dim, i) for i in range(8)]
    plan = offloader.store(["a", "b"], [0, 1, 4, 5])
    assert plan is not None and plan.keys == ("a", "b")
    assert offloader.lookup("a") is Lookup.PENDING and offloader.num_in_flight == 1
    (done,) = settle(offloader)
    assert done.plan == plan and done.ok
    assert done.result.nbytes == 4 * offloader.engine.layout.bytes_per_block
    assert offloader.lookup("a") is Lookup.HIT and offloader.num_in_flight == 0
    load = offloader.load(["b", "a"], [6, 7, 2, 3])
    offloader.stream_wait(load)
    (done,) = settle(offloader)
    assert done.plan == load and done.ok
    after = [reference_block(tensors, dim, i) for i in range(8)]
    for target, source in ((6, 4), (7, 5), (2, 0), (3, 1), (0, 0), (1, 1), (4, 4), (5, 5)):
        assert torch.equal(after[target], before[source]), target
    assert counts(offloader) == (2, 2)
    offloader.close()


def test_duplicate_and_resident_keys_are_stored_once_from_their_first_blocks() -> None:
    offloader, tensors, dim = build()
    expected = reference_block(tensors, dim, 2)
    offloader.store(["x"], [0])
    settle(offloader)
    plan = offloader.store(["x", "y", "y"], [1, 2, 3])
    assert plan is not None and plan.keys == ("y",)
    settle(offloader)
    offloader.load(["y"], [7])
    settle(offloader)
    assert torch.equal(reference_block(tensors, dim, 7), expected)


def test_a_store_that_cannot_make_room_changes_nothing() -> None:
    offloader, _, _ = build(cpu_blocks=2)
    offloader.store(["a", "b"], [0, 1])
    settle(offloader)
    offloader.load(["a", "b"], [2, 3])  # both pinned until this load is polled
    assert counts(offloader) == (0, 0)
    assert offloader.store(["c"], [4]) is None
    assert counts(offloader) == (0, 0)
    assert offloader.lookup("c") is Lookup.MISS and offloader.num_in_flight == 1


def test_an_empty_plan_still_completes() -> None:
    offloader, _, _ = build()
    offloader.store(["a"], [0])
    settle(offloader)
    plan = offloader.store(["a"], [5])
    assert plan is not None and plan.keys == ()
    (done,) = settle(offloader)
    assert done.plan == plan and done.ok and done.result.nbytes == 0


@pytest.mark.parametrize("device", DEVICES)
def test_a_failed_store_is_never_readable_and_its_block_id_is_reused(device: str) -> None:
    offloader, tensors, dim = build(device=device, cpu_blocks=2)
    offloader.engine.fault_hook = FailJob(0, run=1)  # after the K run, before the V run
    plan = offloader.store(["a"], [0])
    assert plan is not None
    (done,) = settle(offloader)
    assert not done.ok and isinstance(done.result.error, RuntimeError)
    assert offloader.lookup("a") is Lookup.MISS
    with pytest.raises(BlockNotFoundError):
        offloader.load(["a"], [5])
    again = offloader.store(["b"], [3])
    assert again is not None and again.block_ids == plan.block_ids  # the freed block id
    settle(offloader)
    offloader.load(["b"], [6])
    settle(offloader)
    assert torch.equal(reference_block(tensors, dim, 6), reference_block(tensors, dim, 3))


def test_a_failed_load_releases_its_pins() -> None:
    offloader, _, _ = build(cpu_blocks=1)
    offloader.store(["a"], [0])
    settle(offloader)
    offloader.engine.fault_hook = FailJob(1)
    load = offloader.load(["a"], [4])
    (done,) = settle(offloader)
    assert done.plan == load and not done.ok
    assert counts(offloader) == (0, 1)
    assert offloader.store(["b"], [1]) is not None  # "a" was evictable again


def test_bad_calls_raise_before_any_state_changes() -> None:
    offloader, _, _ = build(cpu_blocks=2)
    offloader.store(["a"], [0])
    pending = offloader.poll()
    assert len(pending) == 1
    offloader.store(["p"], [1])  # stays pending: not polled
    snapshot = (repr(offloader.manager), offloader.num_in_flight)
    bad_calls: list[tuple[Callable[[], object], type[Exception]]] = [
        (lambda: offloader.store(["b"], [0, 1]), InvalidArgumentError),
        (lambda: offloader.store(["b"], [8]), InvalidArgumentError),
        (lambda: offloader.store("b", [0]), InvalidArgumentError),
        (lambda: offloader.store([["b"]], [0]), InvalidArgumentError),  # type: ignore[list-item]
        (lambda: offloader.load(["a", "a"], [3, 3]), InvalidArgumentError),
        (lambda: offloader.load(["a"], []), InvalidArgumentError),
        (lambda: offloader.load(["z"], [3]), BlockNotFoundError),
        (lambda: offloader.load(["p"], [3]), BlockPendingError),
    ]
    for call, error in bad_calls:
        with pytest.raises(error):
            call()
        assert (repr(offloader.manager), offloader.num_in_flight) == snapshot


def test_reset_waits_for_jobs_in_flight() -> None:
    offloader, tensors, dim = build(threaded=True, cpu_blocks=1)
    gate = threading.Event()

    def hold(job: int, run: int) -> None:
        gate.wait()

    offloader.engine.fault_hook = hold
    plan = offloader.store(["a"], [0])
    finished: list[Finished] = []
    resetting = threading.Thread(target=lambda: finished.extend(offloader.reset()))
    resetting.start()
    try:
        resetting.join(timeout=0.2)
        returned_early = not resetting.is_alive()
    finally:
        gate.set()  # whatever happened, let the copy finish so nothing hangs
    resetting.join()
    assert not returned_early, "reset returned while a store was still copying"
    assert [f.plan for f in finished] == [plan] and finished[0].ok
    assert offloader.lookup("a") is Lookup.MISS and offloader.num_in_flight == 0
    offloader.engine.fault_hook = None
    offloader.store(["a"], [5])  # the same block id, for new bytes
    settle(offloader)
    offloader.load(["a"], [6])
    settle(offloader)
    assert torch.equal(reference_block(tensors, dim, 6), reference_block(tensors, dim, 5))
    offloader.close()


def test_a_given_manager_sizes_the_pool() -> None:
    tensors, dim = make_cache("per_layer", num_blocks=4)
    model = OffloadModel(3, "arc")
    offloader = Offloader(tensors, manager=model, block_dim=dim)
    assert offloader.engine.pool.num_blocks == 3 and offloader.manager is model
    with pytest.raises(InvalidArgumentError, match="manages 3 blocks but the pool has 2"):
        Offloader(tensors, manager=model, num_cpu_blocks=2)


def test_stalled_reads_the_managers_plan_ages_and_keeps_none_of_its_own() -> None:
    now = [0.0]
    manager = OffloadManager(4, clock=lambda: now[0])
    tensors, dim = make_cache("kv_split", num_blocks=8)
    offloader = Offloader(tensors, block_dim=dim, manager=manager, stall_after=10.0)
    plan = offloader.store(["a"], [0])  # finished, but not polled: still in flight here
    assert plan is not None and offloader.stalled() == []
    now[0] = 10.0
    direct = manager.prepare_store(["z"])  # the manager's own plan: no job of this offloader
    now[0] = 30.0
    assert manager.stalled_plans(10.0) == [plan, direct]
    assert offloader.stalled() == [plan] and offloader.stalled(older_than=25.0) == [plan]
    assert offloader.stalled(older_than=30.5) == []
    assert offloader._submitted_at == {}  # no second ledger
    manager.abandon(plan)  # abandoned on the manager itself: no longer a candidate here
    assert offloader.stalled() == []
    offloader.close()


def test_with_a_manager_that_keeps_no_ages_the_offloader_keeps_them() -> None:
    tensors, dim = make_cache("kv_split", num_blocks=8)
    offloader = Offloader(tensors, block_dim=dim, manager=OffloadModel(4))
    plan = offloader.store(["a"], [0])
    other = offloader.store(["b"], [1])
    assert plan is not None and other is not None
    assert offloader.stalled() == []  # younger than stall_after
    assert offloader.stalled(older_than=1e-9) == [plan, other]
    offloader.abandon(plan)
    assert offloader.stalled(older_than=1e-9) == [other]
    finished = settle(offloader)
    assert [(done.plan, done.abandoned) for done in finished] == [
        (plan, True),
        (other, False),
    ]
    assert offloader.stalled(older_than=1e-9) == [] and offloader._submitted_at == {}
    offloader.close()


class ExplodingPolicy(LruPolicy):
    def __init__(self, capacity: int) -> None:
        raise RuntimeError("this policy cannot be built")


def test_a_manager_that_cannot_be_built_leaves_no_engine_behind() -> None:
    tensors, dim = make_cache("kv_split", num_blocks=8)
    threads = threading.active_count()
    with pytest.raises(RuntimeError, match="cannot be built"):
        Offloader(tensors, block_dim=dim, num_cpu_blocks=4, policy=ExplodingPolicy, threaded=True)
    assert threading.active_count() == threads  # the engine's workers were stopped
    with pytest.raises(InvalidArgumentError, match="manages 3 blocks but the pool has 4"):
        Offloader(tensors, block_dim=dim, num_cpu_blocks=4, manager=OffloadModel(3), threaded=True)
    assert threading.active_count() == threads


def test_the_managers_offer_the_one_protocol_the_offloader_drives() -> None:
    from kvoffload.replay.timing import TimedManager

    manager = OffloadManager(2)
    for whole in (manager, OffloadModel(2)):
        assert isinstance(whole, ManagerSurface) and isinstance(whole, ManagerOperations)
    timed = TimedManager(manager)  # a wrapper: the operations only, which is enough
    assert isinstance(timed, ManagerOperations) and not isinstance(timed, ManagerSurface)
    tensors, dim = make_cache("kv_split", num_blocks=8)
    assert Offloader(tensors, block_dim=dim, manager=timed).manager is timed
    with pytest.raises(InvalidArgumentError, match="manager must be an OffloadManager"):
        Offloader(tensors, block_dim=dim, num_cpu_blocks=2, manager=object())  # type: ignore[arg-type]


def test_a_byte_budget_sizes_pool_and_manager() -> None:
    tensors, _ = make_cache("cross_layer", num_blocks=4)  # 96-byte device blocks
    offloader = Offloader(tensors, cpu_bytes=1000, block_size_factor=2, policy="arc")
    assert offloader.engine.pool.block_bytes == 192
    assert offloader.engine.pool.num_blocks == offloader.manager.num_blocks == 1000 // 192


def test_waiting_on_a_plan_that_is_not_in_flight_is_an_error() -> None:
    offloader, _, _ = build()
    plan = offloader.store(["a"], [0])
    assert plan is not None
    offloader.wait([plan])
    offloader.poll()
    with pytest.raises(InvalidArgumentError, match="not in flight"):
        offloader.wait([plan])
    with pytest.raises(InvalidArgumentError, match="not in flight"):
        offloader.wait(["a"])  # type: ignore[list-item]


def test_close_completes_what_is_in_flight() -> None:
    with build(threaded=True)[0] as offloader:
        offloader.store(["a"], [0])
    assert offloader.num_in_flight == 0 and offloader.lookup("a") is Lookup.HIT
    manager = repr(offloader.manager)
    with pytest.raises(EngineClosedError):
        offloader.store(["b"], [1])
    with pytest.raises(EngineClosedError):
        offloader.load(["a"], [1])
    assert repr(offloader.manager) == manager  # refused before the manager was asked


def test_import_kvoffload_does_not_import_torch() -> None:
    script = (
        "import sys, kvoffload; kvoffload.Offloader; kvoffload.TransferEngine; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
