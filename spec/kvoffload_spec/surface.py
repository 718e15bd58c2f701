"""The values that cross the manager's public surface: lookups, plans and events.

The spec and the production manager return these same classes, so a caller (or a
differential test) can compare them field by field.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar, runtime_checkable

Key = Hashable
"""A block key: any hashable (engines use ``bytes`` hashes or ``int``). Never inspected."""


class Lookup(enum.Enum):
    """Where a key stands in the CPU pool."""

    MISS = "miss"  # absent: not stored, or evicted, or dropped by a reset
    PENDING = "pending"  # its store is in flight: not readable yet
    HIT = "hit"  # ready: a load may read it


@dataclass(frozen=True)
class StorePlan:
    """What ``prepare_store`` decided: copy ``keys[i]`` into CPU block id ``block_ids[i]``.

    ``evicted_keys`` were dropped, in eviction order, to make room; ``evicted_block_ids[i]``
    is the CPU block id ``evicted_keys[i]`` held (its bytes are still there until the new
    store's job writes them: a tier behind the pool reads them first). The identity fields
    (``plan_id``, ``generation``, ``owner``) let ``complete_store`` refuse a plan completed
    twice or issued by another manager, and ignore a plan made before a reset.
    """

    keys: tuple[Key, ...]
    block_ids: tuple[int, ...]
    evicted_keys: tuple[Key, ...]
    plan_id: int
    generation: int
    owner: int = field(compare=False)
    evicted_block_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class LoadPlan:
    """What ``prepare_load`` pinned: read ``keys[i]`` from CPU block id ``block_ids[i]``.

    A key listed twice is pinned twice and appears twice.
    """

    keys: tuple[Key, ...]
    block_ids: tuple[int, ...]
    plan_id: int
    generation: int
    owner: int = field(compare=False)


class RemovalReason(enum.Enum):
    EVICTED = "evicted"  # chosen by the policy to make room
    STORE_FAILED = "store_failed"  # its store job failed or was abandoned; never readable
    RESET = "reset"  # dropped by ``reset_cache``


@dataclass(frozen=True)
class BlocksStored:
    """These keys became readable (their store completed successfully)."""

    keys: tuple[Key, ...]


@dataclass(frozen=True)
class BlocksRemoved:
    """These keys left the CPU pool."""

    keys: tuple[Key, ...]
    reason: RemovalReason


Event = BlocksStored | BlocksRemoved

Plan = StorePlan | LoadPlan
"""Either kind of plan (what ``abandon`` and the checkers take)."""

PlanT = TypeVar("PlanT", StorePlan, LoadPlan)


_owners = itertools.count(1)


def new_owner_id() -> int:
    """A number no other manager or model in this process has: plans carry their owner's."""
    return next(_owners)


@runtime_checkable
class ManagerOperations(Protocol):
    """The operations that drive a manager, and its size: all that the ``Offloader`` facade
    and a trace replay call, so a wrapper of a manager (timing or logging its calls) need
    offer no more. ``isinstance`` checks that the names are there (not their signatures).

    ``is_abandoned(plan)`` is the one query on plans: the manager's ledger of abandoned
    plans is the only one (the ``Offloader`` keeps none of its own). It is True from
    ``abandon(plan)`` until the plan's (late) completion, across resets; False for a plan
    never abandoned and for one completed already. It changes nothing, and raises
    ``ForeignPlanError`` for anything but a plan this manager issued.
    """

    @property
    def num_blocks(self) -> int: ...
    def lookup(self, key: Key) -> Lookup: ...
    def prepare_store(self, keys: Sequence[Key]) -> StorePlan | None: ...
    def complete_store(self, plan: StorePlan, success: bool = True) -> None: ...
    def prepare_load(self, keys: Sequence[Key]) -> LoadPlan: ...
    def complete_load(self, plan: LoadPlan) -> None: ...
    def abandon(self, plan: Plan) -> None: ...
    def is_abandoned(self, plan: Plan) -> bool: ...
    def touch(self, keys: Sequence[Key]) -> None: ...
    def reset_cache(self) -> None: ...


@runtime_checkable
class ManagerSurface(ManagerOperations, Protocol):
    """The public surface that the spec's model and every manager share, name for name: the
    operations, and the gauges, events and invariant check that the checkers read.

    The explorer and the conformance kit drive any object that offers it; ``isinstance``
    checks that the names are there (not their signatures).
    """

    @property
    def num_free_blocks(self) -> int: ...
    @property
    def num_evictable_blocks(self) -> int: ...
    @property
    def num_quarantined_blocks(self) -> int: ...
    def take_events(self) -> list[Event]: ...
    def check_invariants(self) -> None: ...
