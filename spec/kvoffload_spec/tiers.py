"""The remote tier: a shared store behind the CPU pool, adversarial, and what the pool
guarantees on top of it.

The remote store (a Valkey or Redis server in the product) is shared and out of our
control. Any key may vanish at any moment (another instance, the server's own eviction, a
restart); another writer may put anything under any key (another model's value, another
key's bytes, a value cut short); a write may fail or time out. The store promises one thing
only: a read returns some value or a miss.

The pool reaches the remote in two ways, both on top of the manager's unchanged operations:

- **write-back**: a block the CPU pool evicts is written to the remote with the bytes its
  block id held *when it was evicted* (the block id is handed to a new store at once);
- **fetch**: on a CPU miss, a fetch is a store plan (``prepare_store`` of the key: absent ->
  pending) whose job reads the remote instead of the device, checks the value, writes the
  block id if it is accepted, and completes the plan: success only for an accepted value, a
  failed store otherwise (the key is absent again). A fetch given up on (``abandon``)
  quarantines its block id until its job reports, as any store does.

**Tenants.** The pool belongs to a :class:`Tenant`: the namespace of its model and KV layout
and, optionally, a *secret* its engines share and nobody else knows. Other tenants write to
the same server, and so does an **adversary** who knows everything but the secrets: every
namespace, every key, the format, every value on the server or on the wire. It can write any
value it can build under any server key it can name, copy any value it has seen (from any
key, of any tenant), delete keys and tear values; it may have a secret of its own.

Values are terms (:class:`Value`, :class:`Tag`, :class:`Stored`, :class:`ServerKey`): they
record what they were made from, so the explorer can tell what each party can build. The
MAC is taken to be perfect: a tag verifies exactly when it is recomputed over the same
fields under the same secret, and nobody makes a tag under a secret they do not hold. So a
tag check tells the secret, the namespace, the block key and the bytes (length included) a
value was sealed over; it cannot tell *which* holder of the secret sealed it, nor when (an
older copy of the same key's value passes, which is harmless: a key names its bytes). A
value without a tag (the plain format, no secret) proves nothing: its header and checksum
are public functions of public data, so anyone can make one (:meth:`TierRules.accept`).

What the pool guarantees, whatever the remote does (:func:`explore_tiers` checks each after
every step, over every interleaving at small bounds):

1. the manager's invariants hold unchanged (a fetch is a store plan);
2. a block reaches the device only with the bytes stored under its own key, whichever tier
   it came from: every load reads its key's full bytes of its tenant's namespace;
3. a write-back puts under a key only that key's full bytes;
4. no block id a fetch may still write is handed to another key;
5. a tenant accepts only values it made itself or got from a holder of its secret: another
   tenant's or the adversary's values are misses, so their writes cost hits, never bytes;
6. with a secret, nobody without it finds the tenant's values under a server key they can
   compute, so nobody learns which keys it has cached (nor addresses them by key).

Without a secret, 5 and 6 do not hold and are not promised: :data:`NO_SECRET` is that world,
where the explorer finds the adversary's forged bytes accepted.

>>> report = explore_tiers(blocks=1, keys=("a", "b"), depth=4)
>>> report.ok, report.complete
(True, True)
>>> explore_tiers(blocks=1, keys=("a",), depth=4, tenancy=TENANTS).ok
True
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Mapping, Sequence
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
class Tenant:
    """Who stores blocks: a name, the namespace of its model and KV layout, and the secret its
    engines share (None: no secret, the plain format). Engines of one tenant share its name."""

    name: str
    namespace: int = OURS
    secret: str | None = None


@dataclass(frozen=True)
class Value:
    """Bytes as the explorer knows them: whose key's bytes they are (or claim to be), how many,
    in which namespace, and whether the adversary made them up."""

    owner: Key
    length: int = FULL
    namespace: int = OURS
    forged: bool = False

    def __repr__(self) -> str:
        flaws = [f"{self.length}/{FULL}"] if self.length != FULL else []
        flaws += ["foreign"] if self.namespace != OURS else []
        flaws += ["forged"] if self.forged else []
        return f"<{self.owner}{' ' + ' '.join(flaws) if flaws else ''}>"


def own(key: Key, namespace: int = OURS) -> Value:
    """The bytes stored under ``key`` in ``namespace``: whole, as the model computes them."""
    return Value(key, FULL, namespace)


@dataclass(frozen=True)
class Tag:
    """A sealed value's MAC, as what it was computed from: the secret and the fields it
    covers (None: a field the MAC left out)."""

    secret: str
    namespace: int | None
    key: Key | None
    value: Value


@dataclass(frozen=True)
class Stored:
    """A value as the server holds it: its bytes, the tag of a sealed value (None: a plain
    one), and who made it (the explorer's record: no check can read it)."""

    value: Value
    tag: Tag | None = None
    maker: str = ""

    def __repr__(self) -> str:
        said = f"{self.value!r} by {self.maker}"
        tag = self.tag
        if tag is None:
            return said + ", plain"
        said += f", sealed with {tag.secret}"
        said += " for no key" if tag.key is None else f" for {tag.key!r}"
        if tag.namespace is None:
            said += " of no namespace"
        elif tag.namespace != self.value.namespace:
            said += f" of namespace {tag.namespace}"
        return said if tag.value == self.value else f"{said} over {tag.value!r}"


@dataclass(frozen=True)
class ServerKey:
    """A server key name, as what it was derived from. Whoever holds its secret (anyone, when
    it is None) can compute it from a block key; nobody else can, nor tell which key it names."""

    namespace: int
    key: Key
    secret: str | None = None


class TierRules:
    """What the pool's tier code decides; the product implements each rule (the value format
    in ``kvoffload.tiers.values``: ``PlainFormat`` without a secret, ``SealedFormat`` with
    one), and planted bugs override one."""

    def server_key(self, tenant: Tenant, key: Key) -> ServerKey:
        """The name ``tenant`` stores ``key`` under (``ValueFormat.server_key``): public
        without a secret (``kvo1:<namespace fingerprint hex>:<key>``), derived from the secret
        with one (``kvo2:<tenant id>:<keyed hash of the key>``)."""
        return ServerKey(tenant.namespace, key, tenant.secret)

    def tag(self, secret: str, namespace: int, key: Key, value: Value) -> Tag:
        """A sealed value's MAC: under ``secret``, over the namespace (in the product, the
        header's tenant id, a keyed hash of the namespace's fingerprint), this very block key,
        and the bytes with their length."""
        return Tag(secret, namespace, key, value)

    def seal(self, tenant: Tenant, key: Key, value: Value) -> Stored:
        """What ``tenant`` writes under ``key`` (``ValueFormat.frame``): plain without a
        secret (its header claims the namespace, the key and the length), tagged with one."""
        if tenant.secret is None:
            return Stored(value, None, tenant.name)
        return Stored(value, self.tag(tenant.secret, tenant.namespace, key, value), tenant.name)

    def accept(self, tenant: Tenant, key: Key, stored: Stored | None) -> bool:
        """Whether a fetch of ``key`` by ``tenant`` may load ``stored`` (``payload_of``).

        Plain (no secret): only a plain value whose header claims this namespace and this key,
        whole. The checksum catches accidents, but anyone can compute it: a made-up value
        with the right header passes. Sealed: only a value whose tag verifies under the
        tenant's secret, for its namespace, this very key and the bytes as read; a moved, torn,
        altered, plain or foreign value fails it. (The product compares the header's tenant id
        first: a cheap sort, not a defence, since anyone can copy a tenant id onto a value.)
        A miss is never accepted."""
        if stored is None:
            return False
        if tenant.secret is None:
            value = stored.value
            return (
                stored.tag is None
                and value.owner == key
                and value.namespace == tenant.namespace
                and value.length == FULL
            )
        return stored.tag == self.tag(tenant.secret, tenant.namespace, key, stored.value)

    def quarantines_abandoned_fetches(self) -> bool:
        """An abandoned fetch's block id stays quarantined until its job reports."""
        return True

    def write_back_reads_at_eviction(self) -> bool:
        """A write-back takes the victim's bytes when it is evicted, not later (the block id is
        handed to a new store at once)."""
        return True


# -- who shares the server --------------------------------------------------------------------


ADVERSARY = Tenant("the adversary", OURS, "the adversary's secret")


@dataclass(frozen=True)
class Tenancy:
    """Who shares the server with the pool's ``tenant``: ``others`` whose honest values may be
    copied under the tenant's keys, and whether the adversary also makes values up."""

    tenant: Tenant
    others: tuple[Tenant, ...] = ()
    forger: bool = False

    def holders(self) -> frozenset[str]:
        """Whose values the tenant may accept: its own, and those of each holder of its
        secret (with no secret, nobody else's)."""
        secret = self.tenant.secret
        holders = {other.name for other in self.others if secret and other.secret == secret}
        return frozenset({self.tenant.name} | holders)


ACCIDENTS = Tenancy(Tenant("A"), (Tenant("F", FOREIGN),))
"""A server with accidents only: lost keys, torn values, values moved to other keys, and
another model's engine (F) writing the same keys. No secret, no forger."""

TENANTS = Tenancy(
    Tenant("A", OURS, "A's secret"),
    (Tenant("B", OURS, "B's secret"), Tenant("A2", FOREIGN, "A's secret")),
    forger=True,
)
"""Tenant A with a secret; B runs the same model with its own secret; A2 is A's other model,
under A's secret; and the adversary."""

NO_SECRET = Tenancy(Tenant("A"), forger=True)
"""The unprotected mode: the adversary against a tenant without a secret."""


def plantable(tenancy: Tenancy, rules: TierRules, key: Key, keys: Sequence[Key]) -> list[Stored]:
    """Every value the others may put under the tenant's server key of ``key`` (they see the
    name on the server; without the secret they cannot tell which key it is, so they try all):

    - what any honest writer (the tenant, each of the others) writes for any key: a replayed,
      moved or other tenant's value;
    - the tenant's own value of ``key`` cut short (a torn write);
    - with a forger, its own bytes dressed as ``key``'s: plain (a valid header and checksum),
      sealed with its own secret, and carrying the tag of the tenant's own value (a bit
      flip in the payload).
    """
    tenant = tenancy.tenant
    honest = [
        rules.seal(writer, k, own(k, writer.namespace))
        for writer in (tenant, *tenancy.others)
        for k in keys
    ]
    genuine = rules.seal(tenant, key, own(key, tenant.namespace))
    values = [*honest, replace(genuine, value=replace(genuine.value, length=FULL - 1))]
    if tenancy.forger:
        fake = Value(key, FULL, tenant.namespace, forged=True)
        values += [
            Stored(fake, None, ADVERSARY.name),
            rules.seal(replace(ADVERSARY, namespace=tenant.namespace), key, fake),
            replace(genuine, value=fake, maker=ADVERSARY.name),
        ]
    return list(dict.fromkeys(values))  # a plain tenant's tag copy is the plain forgery


# -- the world ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fetch:
    """A fetch in flight: its plan, and what its job read from the remote (``read`` is
    False until it has read; then the value, or None for a miss)."""

    plan: StorePlan
    read: Stored | bool | None = False
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
    tenancy: Tenancy = ACCIDENTS
    plantable: Mapping[Key, Sequence[Stored]] = field(default_factory=dict)
    memory: dict[int, Value | None] = field(default_factory=dict)  # block id -> bytes
    remote: dict[ServerKey, Stored] = field(default_factory=dict)
    written: frozenset[ServerKey] = frozenset()  # names whose value the tenant wrote last
    fetches: tuple[Fetch, ...] = ()
    write_backs: tuple[WriteBack, ...] = ()

    @property
    def tenant(self) -> Tenant:
        return self.tenancy.tenant

    def name(self, key: Key) -> ServerKey:
        return self.rules.server_key(self.tenant, key)

    def copy(self) -> TierWorld:
        pool = OffloadModel.from_state(copy_state(self.pool.state), self.pool.policy)
        return replace(self, pool=pool, memory=dict(self.memory), remote=dict(self.remote))

    def key(self) -> Hashable:
        names = {fetch.plan.plan_id: n for n, fetch in enumerate(self.fetches)}
        return (
            fingerprint(self.pool.state, names),
            tuple(sorted(self.memory.items())),
            tuple(sorted(self.remote.items(), key=repr)),
            tuple(sorted(self.written, key=repr)),
            tuple((f.plan.keys, f.plan.block_ids, f.read, f.abandoned) for f in self.fetches),
            self.write_backs,
        )


class TierViolation(Exception):
    """A guarantee of the pool failed; the message says which, in words."""


# -- the operations ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TierOp:
    """One step: ``name`` with a key (and the value a put writes), or with the index of a job
    in flight."""

    name: str
    key: Key = None
    index: int = -1
    ok: bool = True
    value: Stored | None = None

    def __str__(self) -> str:
        if self.index >= 0:
            flag = "" if self.ok else ", failed"
            return f"{self.name}(job {self.index}{flag})"
        if self.value is not None:
            return f"{self.name}({self.key!r}, {self.value!r})"
        return f"{self.name}({self.key!r})"


STORE, FETCH, LOAD = "store", "fetch", "load"  # the pool's
DELETE, PUT, PROBE = "delete", "put", "probe"  # the others'
READ, FINISH, ABANDON, WRITE = "fetch_reads", "fetch_finishes", "abandon_fetch", "write_back"


def operations(world: TierWorld, keys: Sequence[Key]) -> list[TierOp]:
    ops = [TierOp(name, key) for name in (STORE, FETCH, LOAD, DELETE) for key in keys]
    for key in keys:
        ops += [TierOp(PUT, key, value=value) for value in world.plantable[key]]
        if world.tenancy.forger:
            ops.append(TierOp(PROBE, key))
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


def apply(world: TierWorld, op: TierOp) -> TierWorld | None:
    """The world after ``op`` (a copy), or None when ``op`` does not apply. Raises
    :class:`TierViolation` when a guarantee fails."""
    if op.name in (DELETE, PUT, PROBE):
        return _others_move(world, op)
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
            world.memory[plan.block_ids[0]] = own(op.key, world.tenant.namespace)
            pool.complete_store(plan)
        else:
            world.memory[plan.block_ids[0]] = None  # being written: garbage until done
            world.fetches += (Fetch(plan),)
    elif op.name == LOAD:
        if pool.lookup(op.key) is not Lookup.HIT:
            return None
        load = pool.prepare_load([op.key])
        got = world.memory.get(load.block_ids[0])
        if got != own(op.key, world.tenant.namespace):
            raise TierViolation(f"a load of {op.key!r} reads {got!r} from its CPU block")
        pool.complete_load(load)
    elif op.name == WRITE:
        _write_back(world, op)
    else:
        _fetch_step(world, op)
    pool.check_invariants()
    return world


def _others_move(world: TierWorld, op: TierOp) -> TierWorld:
    """A move on the remote alone: the pool is untouched, so the new world shares it (every
    step copies a world before changing it)."""
    if op.name == PROBE:
        _probe(world, op.key)
        return world
    name = world.name(op.key)
    world = replace(world, remote=dict(world.remote), written=world.written - {name})
    if op.name == DELETE:
        world.remote.pop(name, None)
    elif op.value is not None:
        world.remote[name] = op.value
    return world


def _evicted(world: TierWorld, plan: StorePlan) -> None:
    """Each victim's bytes leave for the remote: a write-back in flight."""
    late = not world.rules.write_back_reads_at_eviction()
    for key, block_id in zip(plan.evicted_keys, plan.evicted_block_ids, strict=True):
        value = None if late else world.memory.get(block_id)
        world.write_backs += (WriteBack(key, value, block_id),)


def _probe(world: TierWorld, key: Key) -> None:
    """The adversary reads the server keys it can compute for ``key`` in the tenant's
    namespace (with no secret, or with its own): finding a value the tenant wrote there tells
    it that ``key`` is cached. A tenant without a secret gives its names away by design."""
    tenant = world.tenant
    if tenant.secret is None:
        return
    for secret in (None, ADVERSARY.secret):
        guess = replace(ADVERSARY, namespace=tenant.namespace, secret=secret)
        name = world.rules.server_key(guess, key)
        if name in world.written:
            raise TierViolation(
                f"the adversary finds {tenant.name}'s write-back of {key!r} under a server key "
                f"it computed without {tenant.name}'s secret: it learns that {key!r} is cached"
            )


def _write_back(world: TierWorld, op: TierOp) -> None:
    job = world.write_backs[op.index]
    world.write_backs = world.write_backs[: op.index] + world.write_backs[op.index + 1 :]
    value = (
        job.value if world.rules.write_back_reads_at_eviction() else world.memory.get(job.block_id)
    )
    if not op.ok:
        return  # the server refused or timed out: the remote is as it was
    if value != own(job.key, world.tenant.namespace):
        raise TierViolation(f"a write-back puts {value!r} under {job.key!r}")
    name = world.name(job.key)
    world.remote[name] = world.rules.seal(world.tenant, job.key, value)
    world.written |= {name}


def _fetch_step(world: TierWorld, op: TierOp) -> None:
    pool = world.pool
    fetch = world.fetches[op.index]
    key, block_id = fetch.plan.keys[0], fetch.plan.block_ids[0]
    fetches = list(world.fetches)
    if op.name == READ:
        fetches[op.index] = replace(fetch, read=world.remote.get(world.name(key)))
    elif op.name == ABANDON:
        pool.abandon(fetch.plan)
        if not world.rules.quarantines_abandoned_fetches():
            # The bug this rule plants: the block id is free at once, though the job may write.
            state = pool.state
            state.abandoned[fetch.plan.plan_id] = []
            state._free(block_id)
        fetches[op.index] = replace(fetch, abandoned=True)
    else:  # FINISH: the job checks what it read, writes the block id if accepted, reports
        read = fetch.read if isinstance(fetch.read, Stored) else None
        accepted = world.rules.accept(world.tenant, key, read)
        if accepted:
            if read is not None and read.maker not in world.tenancy.holders():
                raise TierViolation(
                    f"{world.tenant.name} accepts {read!r} for {key!r}: neither its own "
                    "nor a holder of its secret's"
                )
            if _taken_by_another(world, block_id, fetch):
                raise TierViolation(
                    f"the fetch of {key!r} writes block id {block_id}, which another store "
                    "now holds"
                )
            world.memory[block_id] = None if read is None else read.value
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
    tenancy: Tenancy = ACCIDENTS,
    max_seconds: float | None = None,
) -> Report:
    """Every interleaving of the pool's stores, fetches, loads and write-backs with the others'
    moves on the remote (``tenancy`` says who they are), up to ``depth`` steps from an empty
    pool and remote, each checked; breadth first, so a violation's counterexample is a
    shortest one."""
    start = time.perf_counter()
    deadline = None if max_seconds is None else start + max_seconds
    rules = rules or TierRules()
    values = {key: tuple(plantable(tenancy, rules, key, keys)) for key in keys}
    root = TierWorld(OffloadModel(blocks, policy), rules, tenancy, values)
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
                    child = apply(world, op)
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
