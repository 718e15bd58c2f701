"""How the manager's tables stand for a spec state, and what the tables must satisfy that
the spec state cannot show.

:func:`abstract_state` is the refinement mapping of :class:`~kvoffload.manager.OffloadManager`
(the Hypothesis lockstep driver, the explorer and ``check_invariants`` compare through it);
:func:`representation_violations` checks what only the tables have: block ids neither
leaked nor shared between resident, free and quarantined, the free heap's order, refs only
on ready blocks. Both read the manager's private tables: they are its own checks, kept
apart so that the manager's module reads as the operations.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvoffload_spec.state import SpecState

# The manager's module imports this one: naming its class here would close an import cycle.
OffloadManager = Any


def abstract_state(manager: OffloadManager) -> SpecState:
    """The spec state ``manager``'s tables stand for (O(n log n)), built fresh."""
    from kvoffload_spec.policies import LruOrder
    from kvoffload_spec.state import Block, SpecState

    refs, storing = manager._refs, manager._storing
    order = manager._policy.abstract_order()
    return SpecState(
        num_blocks=manager._num_blocks,
        order=LruOrder(manager._policy.resident()) if order is None else order,
        blocks={
            key: Block(block_id, refs[block_id], storing.get(key))
            for key, block_id in manager._block_id_of.items()
        },
        free_block_ids=sorted([*manager._freed, *range(manager._fresh, manager._num_blocks)]),
        num_evictable=manager._num_evictable,
        generation=manager._generation,
        open_plans=dict(manager._open_plans.items()),
        next_plan_id=manager._next_plan_id,
        store_threshold=manager._store_threshold,
        max_tracker_size=manager._max_tracker_size,
        offers=dict(manager._offers),
        events=None if manager._events is None else list(manager._events),
        owner=manager._owner,
        abandoned={plan_id: list(block_ids) for plan_id, block_ids in manager._abandoned.items()},
    )


def representation_violations(manager: OffloadManager) -> list[str]:
    """What is wrong with ``manager``'s tables themselves, in words."""
    problems: list[str] = []
    block_ids = list(manager._block_id_of.values())
    quarantined = [block_id for held in manager._abandoned.values() for block_id in held]
    every_block_id = block_ids + manager._freed + quarantined
    if len(set(every_block_id)) != len(every_block_id) or len(every_block_id) != manager._fresh:
        problems.append(
            f"resident block ids {block_ids}, freed {manager._freed} and quarantined "
            f"{quarantined} overlap or leak"
        )
    if any(
        not 0 <= block_id < manager._fresh <= manager._num_blocks for block_id in every_block_id
    ):
        problems.append(f"a block id lies outside [0, {manager._fresh}) or beyond the pool")
    freed = manager._freed
    if any(freed[(child - 1) // 2] > freed[child] for child in range(1, len(freed))):
        problems.append(f"the free heap {freed} is out of order")
    if any(key not in manager._block_id_of for key in manager._storing):
        problems.append(f"pending keys {list(manager._storing)} are not all resident")
    ready = {
        block_id for key, block_id in manager._block_id_of.items() if key not in manager._storing
    }
    stray = [
        block_id for block_id, count in enumerate(manager._refs) if count and block_id not in ready
    ]
    if stray:
        problems.append(f"block ids {stray} have refs but hold no ready block")
    if manager._opened_at.keys() != manager._open_plans.keys():
        problems.append("the open plans and their opening times disagree")
    # A policy whose order misses or adds keys is reported by the spec, through the
    # abstraction; its own checks assume it holds exactly the resident keys.
    order = manager._policy.resident()
    if len(order) == len(manager._block_id_of) and set(order) == set(manager._block_id_of):
        problems += manager._policy.check_invariants(manager._is_evictable)
    return problems


__all__ = ["abstract_state", "representation_violations"]
