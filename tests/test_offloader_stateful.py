"""End to end against the spec: the Offloader with real tensors, mirrored in OffloadModel.

Random interleavings of store, load, poll, touch, reset and injected copy failures drive an
``Offloader`` over a real KV cache. The lockstep driver follows every manager call the
offloader makes on the spec's ``OffloadModel`` (same plans, same errors) and after every
step compares the offloader's manager with it in everything (``Lockstep.check``: the
invariants, lookups, counters, stats and the whole abstract state, the eviction order
included, so a wrong touch shows before it evicts a block); after every poll each device block that
no job is using must hold exactly what the test expects: the bytes its last completed
load read from the CPU pool (the bytes stored for that key, by the store that made it
readable), or what the test itself wrote there. Block contents derive from (key, store
version), so a load that returned stale or partial bytes of an older store is caught.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvoffload import Finished, Offloader
from kvoffload.checking.lockstep import Lockstep
from kvoffload.manager import OffloadManager
from kvoffload_spec import OffloadModel
from kvoffload_spec.errors import BlockNotReadyError
from kvoffload_spec.operations import (
    COMPLETE_LOAD,
    COMPLETE_STORE,
    PREPARE_LOAD,
    PREPARE_STORE,
    RESET,
    TOUCH,
    Operation,
)
from kvoffload_spec.surface import Key, Lookup, Plan, StorePlan
from tests.caches import CUDA, DTYPES, KINDS, make_cache, reference_block
from tests.planted import OFFLOADER_MACHINE, Planted, share

pytestmark = pytest.mark.slow  # an end-to-end machine over real tensors

KEYS = range(6)
keys_lists = st.lists(st.sampled_from(KEYS), min_size=1, max_size=3)
# a copy fails at run 0..5 of its job about once in four jobs
fail_at = st.integers(0, 23).map(lambda n: n if n < 6 else None)


class Injector:
    """The fault hook: once armed, fails the next job that reaches run ``run``."""

    def __init__(self) -> None:
        self.armed: int | None = None
        self.failed: list[int] = []

    def __call__(self, job: int, run: int) -> None:
        if run == self.armed:
            self.armed = None
            self.failed.append(job)
            raise RuntimeError(f"injected into job {job} at run {run}")


@dataclass
class InFlight:
    plan: Plan  # the offloader's
    device_blocks: list[int]  # read (store) or written (load) by the job
    fails: bool
    contents: list[torch.Tensor]  # store: what each key's blocks held; load: what must land


class OffloaderMachine(RuleBasedStateMachine):
    device = "cpu"
    offloader_class: type[Offloader] = Offloader  # a planted bug may replace it

    @initialize(
        kind=st.sampled_from(KINDS),
        dtype=st.sampled_from(DTYPES),
        factor=st.integers(1, 2),
        cpu_blocks=st.integers(1, 4),
        policy=st.sampled_from(["lru", "arc"]),
    )
    def build(
        self, kind: str, dtype: torch.dtype, factor: int, cpu_blocks: int, policy: str
    ) -> None:
        self.factor = factor
        num_blocks = factor * 8
        self.tensors, self.block_dim = make_cache(
            kind, num_blocks=num_blocks, dtype=dtype, layers=2, device=self.device
        )
        self.offloader = self.offloader_class(
            self.tensors,
            num_cpu_blocks=cpu_blocks,
            block_dim=self.block_dim,
            block_size_factor=factor,
            policy=policy,
        )
        self.injector = Injector()
        self.offloader.engine.fault_hook = self.injector
        manager = self.offloader.manager
        assert isinstance(manager, OffloadManager)
        self.driver = Lockstep(
            manager,
            OffloadModel(cpu_blocks, policy),
            setting=f"{cpu_blocks} CPU blocks, {policy}, block_size_factor={factor}",
            watched=tuple(KEYS),
            label="offloader's manager",
        )
        block_bytes = self.offloader.engine.layout.bytes_per_block
        generator = torch.Generator().manual_seed(cpu_blocks * 7 + factor)
        self.noise = torch.randint(0, 256, (block_bytes,), dtype=torch.int32, generator=generator)
        self.expected: list[torch.Tensor] = [
            reference_block(self.tensors, self.block_dim, b) for b in range(num_blocks)
        ]
        self.busy: set[int] = set()
        self.in_flight: dict[int, InFlight] = {}  # plan id -> what the test expects
        self.stored: dict[Key, list[torch.Tensor]] = {}  # readable key -> its sub-blocks
        self.version = 0

    # -- helpers ---------------------------------------------------------------------------

    def content(self, key: int, sub_block: int) -> torch.Tensor:
        salt = key * 131 + self.version * 29 + sub_block * 17 + 1
        return ((self.noise + salt) % 256).to(torch.uint8)

    def write(self, block: int, data: torch.Tensor) -> None:
        dims = [self.block_dim] * len(self.tensors)
        offset = 0
        for tensor, dim in zip(self.tensors, dims, strict=True):
            raw = tensor.select(dim, block).view(torch.uint8)
            raw.copy_(data[offset : offset + raw.numel()].reshape(raw.shape))
            offset += raw.numel()
        self.expected[block] = data.clone()

    def free_blocks(self, count: int, order: list[int]) -> list[int] | None:
        free = [b for b in order if b not in self.busy]
        return free[:count] if len(free) >= count else None

    def ready_keys(self) -> list[int]:
        return [k for k in KEYS if self.driver.model.lookup(k) is Lookup.HIT]

    # -- rules -----------------------------------------------------------------------------

    @rule(keys=keys_lists, order=st.permutations(range(16)), fail_at=fail_at, poll=st.booleans())
    def store(self, keys: list[int], order: list[int], fail_at: int | None, poll: bool) -> None:
        k = self.factor
        blocks = self.free_blocks(k * len(keys), [b for b in order if b < 8 * k])
        if blocks is None:
            return
        self.version += 1
        contents = [self.content(key, j % k) for key in keys for j in range(k)]
        for block, data in zip(blocks, contents, strict=True):
            self.write(block, data)
        self.injector.armed = fail_at
        fired_before = len(self.injector.failed)
        plan = self.offloader.store(keys, blocks)
        self.injector.armed = None
        self.driver.follow(Operation(PREPARE_STORE, tuple(keys)), plan)
        event(f"store: {'no room' if plan is None else f'{len(plan.keys)} keys'}")
        if plan is None:
            return
        self.busy.update(blocks)
        fails = len(self.injector.failed) > fired_before
        first: dict[Key, int] = {key: i for i, key in reversed(list(enumerate(keys)))}
        kept = [contents[first[key] * k + j] for key in plan.keys for j in range(k)]
        self.in_flight[plan.plan_id] = InFlight(plan, blocks, fails, kept)
        if poll:
            self.complete(self.offloader.poll())

    @precondition(lambda self: bool(self.ready_keys()))
    @rule(data=st.data(), order=st.permutations(range(16)), fail_at=fail_at, poll=st.booleans())
    def load(self, data: st.DataObject, order: list[int], fail_at: int | None, poll: bool) -> None:
        k = self.factor
        keys = data.draw(st.lists(st.sampled_from(self.ready_keys()), min_size=1, max_size=3))
        blocks = self.free_blocks(k * len(keys), [b for b in order if b < 8 * k])
        if blocks is None:
            return
        self.injector.armed = fail_at
        fired_before = len(self.injector.failed)
        plan = self.offloader.load(keys, blocks)
        self.injector.armed = None
        self.driver.follow(Operation(PREPARE_LOAD, tuple(keys)), plan)
        self.busy.update(blocks)
        fails = len(self.injector.failed) > fired_before
        landing = [self.stored[key][j] for key in keys for j in range(k)]
        self.in_flight[plan.plan_id] = InFlight(plan, blocks, fails, landing)
        if poll:
            self.complete(self.offloader.poll())

    @rule(key=st.sampled_from(KEYS))
    def load_a_key_that_is_not_ready(self, key: int) -> None:
        """Refused alike (the driver compares the error classes), and nothing changes:
        the spec refuses without a change, and the invariant compares the whole state."""
        if self.driver.model.lookup(key) is Lookup.HIT:
            return
        with pytest.raises(BlockNotReadyError) as raised:
            self.offloader.load([key], list(range(self.factor)))
        self.driver.follow(Operation(PREPARE_LOAD, (key,)), raised.value)

    @rule(keys=keys_lists)
    def touch(self, keys: list[int]) -> None:
        self.offloader.touch(keys)
        self.driver.follow(Operation(TOUCH, tuple(keys)), None)

    @precondition(lambda self: len(self.ready_keys()) >= 2)
    @rule(data=st.data())
    def touch_with_a_repeat(self, data: st.DataObject) -> None:
        """``[a, b, a]``: the first occurrence decides, so ``a`` ends up more recent."""
        pair = st.lists(st.sampled_from(self.ready_keys()), min_size=2, max_size=2, unique=True)
        first, second = data.draw(pair)
        self.touch([first, second, first])

    @rule(data=st.data())
    def poll(self, data: st.DataObject) -> None:
        # Waiting first makes the finished set independent of timing on CUDA; on the CPU
        # every job finished inside its submit call.
        waiting = data.draw(st.sets(st.sampled_from(sorted(self.in_flight) or [-1])))
        plans = [self.in_flight[p].plan for p in waiting if p in self.in_flight]
        self.offloader.wait(plans)
        self.complete(self.offloader.poll())

    @rule(now=st.integers(0, 3))
    def reset(self, now: int) -> None:
        if now:  # engines reset rarely; a reset every few steps would hide longer histories
            return
        self.complete(self.offloader.reset())
        assert not self.in_flight and not self.busy
        self.driver.follow(Operation(RESET), None)
        self.stored.clear()

    def complete(self, finished: list[Finished]) -> None:
        """The offloader completed these plans in its manager: the driver follows."""
        driver = self.driver
        for done in finished:
            flight = self.in_flight.pop(done.plan.plan_id)
            assert done.ok != flight.fails, f"{done.result} but the test expected otherwise"
            event(f"{type(done.plan).__name__} {'ok' if done.ok else 'failed'}")
            self.busy.difference_update(flight.device_blocks)
            plan = flight.plan
            if isinstance(plan, StorePlan):
                operation = Operation(COMPLETE_STORE, plan=driver.index(plan), success=done.ok)
                driver.follow(operation, None)
                if done.ok and plan.generation == driver.model.state.generation:
                    k = self.factor
                    for i, key in enumerate(plan.keys):
                        self.stored[key] = flight.contents[i * k : (i + 1) * k]
            else:
                driver.follow(Operation(COMPLETE_LOAD, plan=driver.index(plan)), None)
                for block, data in zip(flight.device_blocks, flight.contents, strict=True):
                    self.expected[block] = data if done.ok else torch.empty(0)
        self.stored = {k: v for k, v in self.stored.items() if driver.model.lookup(k) is Lookup.HIT}
        self.check_device_blocks()

    def check_device_blocks(self) -> None:
        for block, expected in enumerate(self.expected):
            if block in self.busy or expected.numel() == 0:
                continue  # a job is using it, or a failed load left it undefined
            actual = reference_block(self.tensors, self.block_dim, block)
            assert torch.equal(actual, expected), f"device block {block} holds wrong bytes"

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def manager_agrees_with_the_spec(self) -> None:
        self.driver.check()
        self.driver.same("num_in_flight", self.offloader.num_in_flight, len(self.in_flight))

    def teardown(self) -> None:
        if hasattr(self, "offloader"):
            self.offloader.close()


# A load needs a store and a poll before it: three times the profile's examples make
# completed loads (and failed ones) common in every run, at ~10 s on 2 cores for "ci".
OffloaderMachine.TestCase.settings = settings(max_examples=3 * settings().max_examples)
TestOffloaderOnCpu = OffloaderMachine.TestCase


@pytest.mark.parametrize("entry", share(OFFLOADER_MACHINE), ids=lambda bug: bug.name)
def test_the_offloader_machine_finds_its_share_of_the_catalogue(entry: Planted) -> None:
    broken = entry.subject
    assert isinstance(broken, type) and issubclass(broken, Offloader)
    machine = type("PlantedMachine", (OffloaderMachine,), {"offloader_class": broken})
    find_only = settings(phases=(Phase.generate,), database=None, max_examples=2_000)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(machine, settings=find_only)


class CudaOffloaderMachine(OffloaderMachine):
    device = "cuda"


TestOffloaderOnCuda = pytest.mark.cuda(
    pytest.mark.skipif(not CUDA, reason="needs CUDA")(CudaOffloaderMachine.TestCase)
)
