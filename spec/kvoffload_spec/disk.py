"""The disk tier: a persistent store behind the CPU pool that survives a restart of the
engine, may tear a write at a crash, and has a capacity; what the pool guarantees on it.

The disk is the engine's own (no other writer, unlike the remote tier of
:mod:`kvoffload_spec.tiers`), but it outlives the engine's process: blocks written before a
crash are there after it, and a write in flight at the crash is *torn* (its slot holds part
of the new bytes). It has ``capacity`` slots; a write to a full disk evicts the least
recently written or read block first. Each slot holds bytes and a record naming the block
they are; the engine keeps the index (which block is in which slot) in RAM, lost at a
crash and rebuilt from the records when the engine starts again. The records are written
after the bytes, but nothing orders the two on their way to the device: a crash may leave
the new record with torn bytes, or the old record with the new block's bytes. So nothing
read from the disk is trusted: like a remote value, a slot's value is checked against the
block's own identity and namespace when it is read (:meth:`DiskRules.accept`).

A restarted engine may be of another model or layout (another namespace): the directory
says which namespace wrote it, and an engine of another one does not take its blocks
(:meth:`DiskRules.reopens`: the product refuses to open it; the operator gives another
directory, modelled as an empty disk).

The pool reaches the disk as it reaches the remote tier: a write-back of each block it
evicts (the bytes its block id held at the eviction), and a fetch on a miss (a store plan
whose job reads the disk). Guarantees, checked after every step of every interleaving of
the pool's stores, fetches, loads, the disk's writes (begun, ended, failed) and crashes
(:func:`explore_disk`):

1. the manager's invariants hold unchanged;
2. a block reaches the device only with its own whole bytes, of the engine's namespace;
3. the disk never holds more than ``capacity`` blocks;
4. after a restart the index names only blocks written under the engine's namespace.

>>> report = explore_disk(blocks=1, keys=("a", "b"), capacity=1, depth=5)
>>> report.ok, report.complete
(True, True)
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, replace

from kvoffload_spec.explore import Report
from kvoffload_spec.model import OffloadModel
from kvoffload_spec.refinement import copy_state, fingerprint
from kvoffload_spec.search import breadth_first
from kvoffload_spec.surface import Key, Lookup, StorePlan
from kvoffload_spec.tiers import FOREIGN, FULL, OURS, TierViolation, Value

NAMESPACES = (OURS, FOREIGN)


def whole(key: Key, namespace: int) -> Value:
    """``key``'s own bytes, whole, as an engine of ``namespace`` computes them."""
    return Value(key, FULL, namespace)


class DiskRules:
    """What the disk tier's code decides; ``kvoffload.tiers.DiskStore`` implements each
    rule, and planted bugs override one."""

    def accept(self, key: Key, value: Value | None, namespace: int) -> bool:
        """A value read from a slot may be loaded only if it is ``key``'s whole bytes, of
        the engine's namespace: a torn one, another block's (a stale record), another
        namespace's are misses."""
        return value is not None and value == whole(key, namespace)

    def evicts_when_full(self) -> bool:
        """A write to a full disk evicts a block first (none free: the write fails)."""
        return True

    def reopens(self, written_under: int, engine: int) -> bool:
        """A restarted engine takes the directory's blocks only if they were written under
        its own namespace."""
        return written_under == engine


@dataclass(frozen=True)
class Slot:
    """What a slot holds on the disk: the block its record names (None: no record), its
    bytes as they are, the order of the record's write, and the namespace of the engine
    that wrote the record."""

    record: Key
    data: Value | None
    seq: int
    written_under: int


@dataclass(frozen=True)
class DiskWrite:
    """A write-back to the disk in flight: queued (``slot`` -1), or writing its slot."""

    key: Key
    value: Value | None
    slot: int = -1


@dataclass(frozen=True)
class DiskFetch:
    """A fetch in flight: its plan, and what it read (False: not read yet)."""

    plan: StorePlan
    read: Value | bool | None = False
    abandoned: bool = False


@dataclass
class DiskWorld:
    """The pool (the spec's model) and its block ids' bytes, the disk's slots and the
    engine's index of them (least recent first), and the jobs in flight."""

    pool: OffloadModel
    rules: DiskRules
    capacity: int
    namespace: int = OURS  # the engine's
    directory: int = OURS  # the namespace the directory was made under
    memory: dict[int, Value | None] = field(default_factory=dict)
    slots: tuple[Slot | None, ...] = ()
    index: tuple[tuple[Key, int], ...] = ()
    fetches: tuple[DiskFetch, ...] = ()
    writes: tuple[DiskWrite, ...] = ()
    clock: int = 0

    def copy(self) -> DiskWorld:
        pool = OffloadModel.from_state(copy_state(self.pool.state), self.pool.policy)
        return replace(self, pool=pool, memory=dict(self.memory))

    def key(self) -> Hashable:
        names = {fetch.plan.plan_id: n for n, fetch in enumerate(self.fetches)}
        order = sorted({slot.seq for slot in self.slots if slot is not None})
        rank = {seq: n for n, seq in enumerate(order)}  # only the order of seqs matters
        return (
            fingerprint(self.pool.state, names),
            self.namespace,
            self.directory,
            tuple(sorted((block_id, repr(v)) for block_id, v in self.memory.items())),
            tuple(
                None
                if slot is None
                else (repr(slot.record), repr(slot.data), rank[slot.seq], slot.written_under)
                for slot in self.slots
            ),
            tuple((repr(key), slot) for key, slot in self.index),
            tuple((f.plan.keys, f.plan.block_ids, repr(f.read), f.abandoned) for f in self.fetches),
            tuple((repr(w.key), repr(w.value), w.slot) for w in self.writes),
        )

    def slot_of(self, key: Key) -> int:
        return next((slot for held, slot in self.index if held == key), -1)


class DiskViolation(TierViolation):
    """A guarantee of the pool on its disk tier failed; the message says which."""


# -- the operations ---------------------------------------------------------------------------


@dataclass(frozen=True)
class DiskOp:
    """One step: ``name`` with a key, a job's index, or a crash's namespace and kind."""

    name: str
    key: Key = None
    index: int = -1
    ok: bool = True

    def __str__(self) -> str:
        if self.name == CRASH:
            torn = "records first" if self.ok else "bytes first"
            return f"crash_and_restart(namespace {self.index}, {torn})"
        if self.index >= 0:
            return f"{self.name}(job {self.index}{'' if self.ok else ', failed'})"
        return f"{self.name}({self.key!r})"


STORE, FETCH, LOAD = "store", "fetch", "load"
READ, FINISH, ABANDON = "fetch_reads", "fetch_finishes", "abandon_fetch"
BEGIN, END, CRASH = "write_begins", "write_ends", "crash"


def operations(world: DiskWorld, keys: Sequence[Key]) -> list[DiskOp]:
    ops = [DiskOp(name, key) for name in (STORE, FETCH, LOAD) for key in keys]
    for n, fetch in enumerate(world.fetches):
        ops.append(DiskOp(READ if fetch.read is False else FINISH, index=n))
        if not fetch.abandoned:
            ops.append(DiskOp(ABANDON, index=n))
    for n, write in enumerate(world.writes):
        ops.append(DiskOp(BEGIN if write.slot < 0 else END, index=n))
        ops.append(DiskOp(END, index=n, ok=False))  # refused: the file system full, failing
    # A crash, then an engine of either namespace starts; the writes in flight leave their
    # records on the disk (records first) or not (bytes first), their bytes torn either way.
    ops += [DiskOp(CRASH, index=ns, ok=first) for ns in NAMESPACES for first in (True, False)]
    return ops


def apply(world: DiskWorld, op: DiskOp, keys: Sequence[Key]) -> DiskWorld | None:
    """The world after ``op`` (a copy), or None when ``op`` does not apply. Raises
    :class:`DiskViolation` when a guarantee fails."""
    world = world.copy()
    pool = world.pool
    if op.name in (STORE, FETCH):
        if pool.lookup(op.key) is not Lookup.MISS:
            return None
        plan = pool.prepare_store([op.key])
        if plan is None:
            return None
        for key, block_id in zip(plan.evicted_keys, plan.evicted_block_ids, strict=True):
            world.writes += (DiskWrite(key, world.memory.get(block_id)),)
        if op.name == STORE:
            world.memory[plan.block_ids[0]] = whole(op.key, world.namespace)
            pool.complete_store(plan)
        else:
            world.memory[plan.block_ids[0]] = None
            world.fetches += (DiskFetch(plan),)
    elif op.name == LOAD:
        if pool.lookup(op.key) is not Lookup.HIT:
            return None
        load = pool.prepare_load([op.key])
        got = world.memory.get(load.block_ids[0])
        if got != whole(op.key, world.namespace):
            raise DiskViolation(f"a load of {op.key!r} reads {got!r} from its CPU block")
        pool.complete_load(load)
    elif op.name in (READ, FINISH, ABANDON):
        _fetch_step(world, op)
    elif op.name == CRASH:
        _crash_and_restart(world, op.index, records_first=op.ok)
    elif not _write_step(world, op):
        return None
    pool.check_invariants()
    used = sum(slot is not None for slot in world.slots)
    if len(world.slots) > world.capacity:
        raise DiskViolation(
            f"the disk holds {used} blocks in {len(world.slots)} slots, over its capacity "
            f"of {world.capacity}"
        )
    return world


def _fetch_step(world: DiskWorld, op: DiskOp) -> None:
    pool = world.pool
    fetch = world.fetches[op.index]
    key, block_id = fetch.plan.keys[0], fetch.plan.block_ids[0]
    fetches = list(world.fetches)
    if op.name == READ:
        slot = world.slot_of(key)
        found = world.slots[slot] if slot >= 0 else None
        fetches[op.index] = replace(fetch, read=None if found is None else found.data)
        if slot >= 0:  # a read makes the block the most recent
            world.index = (*tuple(p for p in world.index if p[0] != key), (key, slot))
    elif op.name == ABANDON:
        pool.abandon(fetch.plan)  # its block id stays quarantined until the job reports
        fetches[op.index] = replace(fetch, abandoned=True)
    else:
        read = fetch.read if isinstance(fetch.read, Value) else None
        accepted = world.rules.accept(key, read, world.namespace)
        if accepted:
            world.memory[block_id] = read
        elif read is not None and world.slot_of(key) >= 0:  # refused: dropped from the index
            world.index = tuple(p for p in world.index if p[0] != key)
        pool.complete_store(fetch.plan, success=accepted and not fetch.abandoned)
        del fetches[op.index]
    world.fetches = tuple(fetches)


def _write_step(world: DiskWorld, op: DiskOp) -> bool:
    """A write-back's step; False when it does not apply."""
    write = world.writes[op.index]
    writes = list(world.writes)
    if op.name == BEGIN:
        slot = _slot_for(world, write.key)
        if slot is None:  # every slot is being written: the write fails (no room)
            del writes[op.index]
            world.writes = tuple(writes)
            return True
        world.index = tuple(p for p in world.index if p[1] != slot)  # unreadable meanwhile
        while len(world.slots) <= slot:
            world.slots += (None,)
        old = world.slots[slot]
        torn = Value(write.key, FULL - 1, world.namespace)
        world.slots = _set(
            world.slots,
            slot,
            Slot(None, torn, 0, world.namespace)
            if old is None
            else replace(old, data=torn),  # the old record still names the old block
        )
        writes[op.index] = replace(write, slot=slot)
    elif not op.ok:  # refused by the file system: the slot, if begun, is torn and unindexed
        del writes[op.index]
    else:
        if write.value != whole(write.key, world.namespace):
            raise DiskViolation(f"a write-back puts {write.value!r} under {write.key!r}")
        world.clock += 1
        world.slots = _set(
            world.slots, write.slot, Slot(write.key, write.value, world.clock, world.namespace)
        )
        world.index += ((write.key, write.slot),)
        del writes[op.index]
    world.writes = tuple(writes)
    return True


def _slot_for(world: DiskWorld, key: Key) -> int | None:
    """The slot a write of ``key`` goes to: its own, a free one, or a victim's (evicted)."""
    own = world.slot_of(key)
    if own >= 0:
        return own
    busy = {write.slot for write in world.writes if write.slot >= 0}
    indexed = {slot for _, slot in world.index}
    for slot in range(world.capacity):
        if slot not in busy and slot not in indexed:
            return slot
    if not world.rules.evicts_when_full():
        return len(world.slots)  # the bug: one slot more
    for held, slot in world.index:  # least recent first
        if slot not in busy:
            world.index = tuple(p for p in world.index if p[0] != held)
            return slot
    return None


def _crash_and_restart(world: DiskWorld, namespace: int, *, records_first: bool) -> None:
    """The engine dies: its CPU pool, its index and its jobs are gone; each write in flight
    leaves its slot torn, under its new record or its old one. An engine of ``namespace``
    starts and reopens the directory."""
    for write in world.writes:
        if write.slot >= 0 and records_first:
            old = world.slots[write.slot]
            assert old is not None  # a begun write's slot holds its torn bytes
            world.clock += 1
            world.slots = _set(
                world.slots,
                write.slot,
                replace(old, record=write.key, seq=world.clock, written_under=world.namespace),
            )
    world.pool = OffloadModel(world.pool.state.num_blocks, world.pool.policy)
    world.memory = {}
    world.fetches = ()
    world.writes = ()
    world.namespace = namespace
    if world.rules.reopens(world.directory, namespace):
        indexed = sorted(
            (slot.seq, n) for n, slot in enumerate(world.slots)
            if slot is not None and slot.record is not None
        )  # fmt: skip
        world.index = tuple((world.slots[n].record, n) for _, n in indexed)  # type: ignore[union-attr]
    else:  # refused: the engine gets another, empty directory
        world.slots = ()
        world.index = ()
        world.directory = namespace
    for key, slot in world.index:
        held = world.slots[slot]
        if held is not None and held.written_under != namespace:
            raise DiskViolation(
                f"after a restart under namespace {namespace}, the disk's index names "
                f"{key!r}, written under namespace {held.written_under}"
            )


def _set(slots: tuple[Slot | None, ...], at: int, slot: Slot | None) -> tuple[Slot | None, ...]:
    return (*slots[:at], slot, *slots[at + 1 :])


# -- the search -------------------------------------------------------------------------------


def explore_disk(
    *,
    blocks: int,
    keys: Sequence[Key],
    capacity: int,
    depth: int,
    policy: str = "lru",
    rules: DiskRules | None = None,
    max_seconds: float | None = None,
) -> Report:
    """Every interleaving of the pool's stores, fetches and loads with the disk's writes and
    crashes (each followed by an engine of either namespace starting), up to ``depth`` steps
    from an empty pool and disk, each checked; breadth first, so a counterexample is a
    shortest one."""
    root = DiskWorld(OffloadModel(blocks, policy), rules or DiskRules(), capacity)
    return breadth_first(
        root,
        depth=depth,
        steps=lambda world: operations(world, keys),
        after=lambda world, op: apply(world, op, keys),
        key=DiskWorld.key,
        violation=DiskViolation,
        max_seconds=max_seconds,
    )
