"""The remote tier: a shared store behind the CPU pool, adversarial, and what the pool
guarantees on top of it.

The remote store (a Valkey or Redis server in the product) is shared and out of our
control. Any key may vanish at any moment (another instance, the server's own eviction, a
restart); another writer may put anything under any key (another model's value, another
key's bytes, a value cut short); a write may fail or time out. The store promises one thing
only: a read returns some value or a miss. Values carry a header (the namespace of the KV
layout and model, the key, the length, a checksum), so the pool can tell a value that is
exactly the bytes stored under its own key, in its own namespace, from anything else:
:meth:`TierRules.accept`.

The pool reaches the remote in two ways, both on top of the manager's unchanged operations:

- **write-back**: a block the CPU pool evicts is written to the remote with the bytes its
  block id held *when it was evicted* (the block id is handed to a new store at once);
- **fetch**: on a CPU miss, a fetch is a store plan (``prepare_store`` of the key: absent ->
  pending) whose job reads the remote instead of the device, checks the value, writes the
  block id if it is accepted, and completes the plan: success only for an accepted value, a
  failed store otherwise (the key is absent again). A fetch given up on (``abandon``)
  quarantines its block id until its job reports, as any store does.

What the pool guarantees, whatever the remote does (:func:`explore_tiers` checks each after
every step, over every interleaving at small bounds):

1. the manager's invariants hold unchanged (a fetch is a store plan);
2. a block reaches the device only with the bytes stored under its own key, whichever tier
   it came from: every load reads its key's full bytes of our namespace;
3. a write-back puts under a key only that key's full bytes;
4. no block id a fetch may still write is handed to another key.

>>> report = explore_tiers(blocks=1, keys=("a", "b"), depth=4)
>>> report.ok, report.complete
(True, True)
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from kvoffload_spec.explore import Counterexample, Report
from kvoffload_spec.model import OffloadModel
from kvoffload_spec.refinement import copy_state, fingerprint
from kvoffload_spec.surface import Key, Lookup, StorePlan

if TYPE_CHECKING:  # the disk tier's rules, named here too: kvoffload_spec.tiers is every tier
    from kvoffload_spec.disk import DiskRules as DiskRules
    from kvoffload_spec.disk import DiskViolation as DiskViolation
    from kvoffload_spec.disk import DiskWorld as DiskWorld
    from kvoffload_spec.disk import explore_disk as explore_disk

_DISK_NAMES = frozenset({"DiskRules", "DiskViolation", "DiskWorld", "explore_disk"})


def __getattr__(name: str) -> object:
    """The disk tier's names, loaded on first use: kvoffload_spec.disk imports this module."""
    if name in _DISK_NAMES:
        from kvoffload_spec import disk

        return getattr(disk, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


OURS, FOREIGN = 0, 1  # namespaces: this pool's (layout, model), and another one's
FULL = 2  # a value's length in the explored world: 2 is whole, 1 is cut short


@dataclass(frozen=True)
class Value:
    """Bytes as the explorer knows them: whose they are, how many, in which namespace."""

    owner: Key
    length: int = FULL
    namespace: int = OURS

    def __repr__(self) -> str:
        flaws = [f"{self.length}/{FULL}"] if self.length != FULL else []
        flaws += ["foreign"] if self.namespace != OURS else []
        return f"<{self.owner}{' ' + ' '.join(flaws) if flaws else ''}>"


def own(key: Key) -> Value:
    """The bytes stored under ``key``: whole, in our namespace."""
    return Value(key)


class TierRules:
    """What the pool's tier code decides; the product's ``kvoffload.tiers`` implements
    each rule, and planted bugs override one."""

    def accept(self, key: Key, value: Value | None) -> bool:
        """A fetched value may be loaded only if it is exactly ``key``'s bytes: a miss, a
        value of another key, of another namespace or cut short is a miss."""
        return value is not None and value == own(key)

    def quarantines_abandoned_fetches(self) -> bool:
        """An abandoned fetch's block id stays quarantined until its job reports."""
        return True

    def write_back_reads_at_eviction(self) -> bool:
        """A write-back takes the victim's bytes when it is evicted, not later (the block id is
        handed to a new store at once)."""
        return True


@dataclass(frozen=True)
class Fetch:
    """A fetch in flight: its plan, and what its job read from the remote (``read`` is
    False until it has read; then the value, or None for a miss)."""

    plan: StorePlan
    read: Value | bool | None = False
    abandoned: bool = False


@dataclass(frozen=True)
class WriteBack:
    """A write-back in flight: the key, and its bytes (or, under a rule that reads late,
    the block id it will read them from)."""

    key: Key
    value: Value | None
    block_id: int


@dataclass
class TierWorld:
    """The pool (the spec's model), its block ids' bytes, the remote's values, and the jobs in
    flight between them."""

    pool: OffloadModel
    rules: TierRules
    memory: dict[int, Value | None] = field(default_factory=dict)  # block id -> bytes
    remote: dict[Key, Value] = field(default_factory=dict)
    fetches: tuple[Fetch, ...] = ()
    write_backs: tuple[WriteBack, ...] = ()

    def copy(self) -> TierWorld:
        pool = OffloadModel.from_state(copy_state(self.pool.state), self.pool.policy)
        return TierWorld(
            pool, self.rules, dict(self.memory), dict(self.remote), self.fetches, self.write_backs
        )

    def key(self) -> Hashable:
        names = {fetch.plan.plan_id: n for n, fetch in enumerate(self.fetches)}
        return (
            fingerprint(self.pool.state, names),
            tuple(sorted((block_id, repr(v)) for block_id, v in self.memory.items())),
            tuple(sorted((repr(k), repr(v)) for k, v in self.remote.items())),
            tuple((f.plan.keys, f.plan.block_ids, repr(f.read), f.abandoned) for f in self.fetches),
            tuple((repr(w.key), repr(w.value), w.block_id) for w in self.write_backs),
        )


class TierViolation(Exception):
    """A guarantee of the pool failed; the message says which, in words."""


# -- the operations ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TierOp:
    """One step: ``name`` with a key, or with the index of a job in flight."""

    name: str
    key: Key = None
    index: int = -1
    ok: bool = True

    def __str__(self) -> str:
        if self.index >= 0:
            flag = "" if self.ok else ", failed"
            return f"{self.name}(job {self.index}{flag})"
        return f"{self.name}({self.key!r})"


STORE, FETCH, LOAD = "store", "fetch", "load"  # the pool's
VANISH, MISPLACE, TRUNCATE, FOREIGN_VALUE = "vanish", "misplace", "truncate", "foreign"  # others'
READ, FINISH, ABANDON, WRITE = "fetch_reads", "fetch_finishes", "abandon_fetch", "write_back"

KEYED = (STORE, FETCH, LOAD, VANISH, MISPLACE, TRUNCATE, FOREIGN_VALUE)


def operations(world: TierWorld, keys: Sequence[Key]) -> list[TierOp]:
    ops = [TierOp(name, key) for name in KEYED for key in keys]
    for n, fetch in enumerate(world.fetches):
        if fetch.read is False:
            ops.append(TierOp(READ, index=n))
        else:
            ops.append(TierOp(FINISH, index=n))
        if not fetch.abandoned:
            ops.append(TierOp(ABANDON, index=n))
    for n in range(len(world.write_backs)):
        ops += [TierOp(WRITE, index=n), TierOp(WRITE, index=n, ok=False)]
    return ops


def apply(world: TierWorld, op: TierOp, keys: Sequence[Key]) -> TierWorld | None:
    """The world after ``op`` (a copy), or None when ``op`` does not apply. Raises
    :class:`TierViolation` when a guarantee fails."""
    world = world.copy()
    pool = world.pool
    if op.name in (STORE, FETCH):
        if pool.lookup(op.key) is not Lookup.MISS:
            return None
        plan = pool.prepare_store([op.key])
        if plan is None:
            return None
        _evicted(world, plan)
        if op.name == STORE:  # from the device: its job copies the key's own bytes
            world.memory[plan.block_ids[0]] = own(op.key)
            pool.complete_store(plan)
        else:
            world.memory[plan.block_ids[0]] = None  # being written: garbage until done
            world.fetches += (Fetch(plan),)
    elif op.name == LOAD:
        if pool.lookup(op.key) is not Lookup.HIT:
            return None
        load = pool.prepare_load([op.key])
        got = world.memory.get(load.block_ids[0])
        if got != own(op.key):
            raise TierViolation(f"a load of {op.key!r} reads {got!r} from its CPU block")
        pool.complete_load(load)
    elif op.name in (VANISH, MISPLACE, TRUNCATE, FOREIGN_VALUE):
        _adversary(world, op, keys)
    elif op.name == WRITE:
        _write_back(world, op)
    else:
        _fetch_step(world, op)
    pool.check_invariants()
    return world


def _evicted(world: TierWorld, plan: StorePlan) -> None:
    """Each victim's bytes leave for the remote: a write-back in flight."""
    late = not world.rules.write_back_reads_at_eviction()
    for key, block_id in zip(plan.evicted_keys, plan.evicted_block_ids, strict=True):
        value = None if late else world.memory.get(block_id)
        world.write_backs += (WriteBack(key, value, block_id),)


def _adversary(world: TierWorld, op: TierOp, keys: Sequence[Key]) -> None:
    key = op.key
    if op.name == VANISH:
        world.remote.pop(key, None)
    elif op.name == MISPLACE:
        other = next(k for k in keys if k != key) if len(keys) > 1 else key
        world.remote[key] = own(other)
    elif op.name == TRUNCATE:
        world.remote[key] = Value(key, FULL - 1)
    else:
        world.remote[key] = Value(key, FULL, FOREIGN)


def _write_back(world: TierWorld, op: TierOp) -> None:
    job = world.write_backs[op.index]
    world.write_backs = world.write_backs[: op.index] + world.write_backs[op.index + 1 :]
    value = (
        job.value if world.rules.write_back_reads_at_eviction() else world.memory.get(job.block_id)
    )
    if not op.ok:
        return  # the server refused or timed out: the remote is as it was
    if value != own(job.key):
        raise TierViolation(f"a write-back puts {value!r} under {job.key!r}")
    world.remote[job.key] = value


def _fetch_step(world: TierWorld, op: TierOp) -> None:
    pool = world.pool
    fetch = world.fetches[op.index]
    key, block_id = fetch.plan.keys[0], fetch.plan.block_ids[0]
    fetches = list(world.fetches)
    if op.name == READ:
        fetches[op.index] = replace(fetch, read=world.remote.get(key))
    elif op.name == ABANDON:
        pool.abandon(fetch.plan)
        if not world.rules.quarantines_abandoned_fetches():
            # The bug this rule plants: the block id is free at once, though the job may write.
            state = pool.state
            state.abandoned[fetch.plan.plan_id] = []
            state._free(block_id)
        fetches[op.index] = replace(fetch, abandoned=True)
    else:  # FINISH: the job checks what it read, writes the block id if accepted, reports
        read = fetch.read if isinstance(fetch.read, Value) else None
        accepted = world.rules.accept(key, read)
        if accepted:
            if _taken_by_another(world, block_id, fetch):
                raise TierViolation(
                    f"the fetch of {key!r} writes block id {block_id}, which another key now holds"
                )
            world.memory[block_id] = read
        pool.complete_store(fetch.plan, success=accepted and not fetch.abandoned)
        del fetches[op.index]
    world.fetches = tuple(fetches)


def _taken_by_another(world: TierWorld, block_id: int, fetch: Fetch) -> bool:
    state = world.pool.state
    return any(
        block.block_id == block_id and block.store_plan != fetch.plan.plan_id
        for block in state.blocks.values()
    )


# -- the search -------------------------------------------------------------------------------


def explore_tiers(
    *,
    blocks: int,
    keys: Sequence[Key],
    depth: int,
    policy: str = "lru",
    rules: TierRules | None = None,
    max_seconds: float | None = None,
) -> Report:
    """Every interleaving of the pool's stores, fetches, loads and write-backs with the
    remote's adversary, up to ``depth`` steps from an empty pool and remote, each checked;
    breadth first, so a violation's counterexample is a shortest one."""
    start = time.perf_counter()
    deadline = None if max_seconds is None else start + max_seconds
    root = TierWorld(OffloadModel(blocks, policy), rules or TierRules())
    parents: dict[Hashable, tuple[Hashable, str] | None] = {root.key(): None}
    level = [root]
    transitions = 0

    def report(done: int, complete: bool, violation: Counterexample | None) -> Report:
        seconds = time.perf_counter() - start
        return Report(len(parents), transitions, seconds, done, complete, violation)

    for done in range(depth):
        following: list[TierWorld] = []
        for world in level:
            if deadline is not None and time.perf_counter() > deadline:
                return report(done, False, None)
            for op in operations(world, keys):
                transitions += 1
                try:
                    child = apply(world, op, keys)
                except Exception as error:
                    steps = (*_path(parents, world.key()), str(op))
                    message = str(error) if isinstance(error, TierViolation) else repr(error)
                    return report(done, False, Counterexample(steps, message))
                if child is None:
                    continue
                child_key = child.key()
                if child_key not in parents:
                    parents[child_key] = (world.key(), str(op))
                    following.append(child)
        level = following
    return report(depth, True, None)


def _path(parents: dict[Hashable, tuple[Hashable, str] | None], key: Hashable) -> list[str]:
    steps: list[str] = []
    link = parents[key]
    while link is not None:
        key, step = link
        steps.append(step)
        link = parents[key]
    return steps[::-1]
