"""The refinement mapping: what a manager's representation stands for, as a spec state.

A manager (the production one, or yours) *refines* the spec when there is a function
``abstract(manager) -> SpecState`` such that, for every operation, applying it to the
manager and then abstracting gives the state the spec's own transition gives from the
abstraction::

    abstract(op(manager)) == spec_op(abstract(manager))

with equal results and errors on both sides. That one commuting square is what every checker
checks: the lockstep driver after each step, the CrossHair contracts for one step from any
reachable state, the explorer when it identifies states by their abstraction.

A system offers the mapping through the hook ``abstract_state() -> SpecState``
(:class:`Refines`); ``OffloadModel`` returns its own state, ``OffloadManager`` builds one
from its tables, and its policy contributes the order (``EvictionPolicy.abstract_order``).
A system without the hook is compared on its public surface alone.
"""

from __future__ import annotations

import copy
from collections.abc import Hashable, Mapping
from typing import NamedTuple, Protocol, TypeVar, runtime_checkable

from kvoffload_spec.policies import DuelOrder
from kvoffload_spec.state import Block, SpecState


@runtime_checkable
class Refines(Protocol):
    """A system that states which spec state it stands for."""

    def abstract_state(self) -> SpecState: ...


def abstract(system: object) -> SpecState | None:
    """The spec state ``system`` stands for, or None when it offers no mapping."""
    # Not isinstance(system, Refines): a runtime protocol check costs more than the mapping
    # of a small state, and checkers ask after every step.
    hook = getattr(system, "abstract_state", None)
    return hook() if callable(hook) else None


def copy_state(state: SpecState) -> SpecState:
    """A deep copy of ``state``, several times faster than ``copy.deepcopy``: plans, events
    and keys are immutable, so the copy shares them and copies only the containers, the
    blocks and the order. A field it does not know is deep-copied."""
    twin = _shallow(state)
    for name, value in vars(state).items():
        if name == "blocks":
            value = {key: _shallow(block) for key, block in value.items()}
        elif name == "order" and isinstance(value, DuelOrder):
            value = value.copy()
        elif name == "order":
            value = _shallow(value, copy_lists=True)
        elif name == "abandoned":
            value = {plan_id: list(block_ids) for plan_id, block_ids in value.items()}
        elif name in _FLAT_FIELDS and value is not None:
            value = type(value)(value)
        elif not isinstance(value, (int, float, str, type(None))):
            value = copy.deepcopy(value)
        setattr(twin, name, value)
    return twin


# Containers of immutable values: a shallow copy is a deep one.
_FLAT_FIELDS = frozenset({"free_block_ids", "open_plans", "offers", "events"})


_T = TypeVar("_T")


def _shallow(obj: _T, *, copy_lists: bool = False) -> _T:
    """``copy.copy`` for a plain object, without its generic machinery (the hot path)."""
    twin = object.__new__(type(obj))
    fields = vars(obj)
    if copy_lists:
        fields = {name: list(v) if isinstance(v, list) else v for name, v in fields.items()}
    vars(twin).update(fields)
    return twin


def state_differences(
    got: SpecState, expected: SpecState, *, compare_order: bool = True
) -> list[str]:
    """Where two spec states differ, field by field, in words (empty when they agree).

    The owner (which manager issued a plan) is identity, not state, and is left out. With
    ``compare_order=False`` the policy's order is left out (a policy the spec does not
    know; which keys are resident is still compared, through the blocks).
    """
    problems: list[str] = []

    def differ(what: str, mine: object, spec: object) -> None:
        if mine != spec:
            problems.append(f"{what}: the system's {mine!r}, the spec's {spec!r}")

    differ(
        "blocks (key: block id, refs, pending on plan)",
        _blocks(got.blocks),
        _blocks(expected.blocks),
    )
    differ("free block ids", got.free_block_ids, expected.free_block_ids)
    differ("evictable counter", got.num_evictable, expected.num_evictable)
    differ("generation", got.generation, expected.generation)
    differ("open plans", got.open_plans, expected.open_plans)
    differ("next plan id", got.next_plan_id, expected.next_plan_id)
    differ("abandoned plans (id: quarantined block ids)", got.abandoned, expected.abandoned)
    differ(
        "settings (num_blocks, store_threshold, max_tracker_size)",
        (got.num_blocks, got.store_threshold, got.max_tracker_size),
        (expected.num_blocks, expected.store_threshold, expected.max_tracker_size),
    )
    differ("offer tracker (oldest first)", list(got.offers.items()), list(expected.offers.items()))
    differ("events not taken yet", got.events, expected.events)
    if compare_order:
        differ("eviction order", got.order.fingerprint(), expected.order.fingerprint())
    return problems


def _blocks(blocks: Mapping[object, Block]) -> dict[object, tuple[int, int, int | None]]:
    return {key: (b.block_id, b.refs, b.store_plan) for key, b in blocks.items()}


class Fingerprint(NamedTuple):
    """A system's state, canonical: equal fingerprints, equal futures.

    ``cache`` is what no failed call may change; ``tracker`` what a refused
    ``prepare_store`` may: its observations (the offers it records, ARC's ghost hits).
    """

    cache: Hashable
    tracker: Hashable = ()


def fingerprint(state: SpecState, plan_names: Mapping[int, int]) -> Fingerprint:
    """The canonical fingerprint of a spec state: blocks, free block ids, counter, order,
    quarantines and tracker.

    ``plan_names`` renames the ids of the plans a checker holds to small numbers: plan ids
    and generations are left out (a pending block names its plan by its renamed number),
    and so are the open plans (the checker holds them).
    """
    blocks = sorted(
        (repr(key), block.block_id, block.refs, _renamed(block.store_plan, plan_names))
        for key, block in state.blocks.items()
    )
    order, observed = state.order.fingerprint()
    abandoned = sorted(
        (_renamed(plan_id, plan_names), tuple(block_ids))
        for plan_id, block_ids in state.abandoned.items()
    )
    cache = (
        tuple(blocks),
        tuple(state.free_block_ids),
        state.num_evictable,
        order,
        tuple(abandoned),
    )
    return Fingerprint(cache, (tuple(state.offers.items()), observed))


def _renamed(plan_id: int | None, plan_names: Mapping[int, int]) -> int | None:
    return None if plan_id is None else plan_names.get(plan_id, -1)
