"""Argument checks shared by the spec and the production manager.

Each check raises a typed :class:`~kvoffload_spec.errors.OffloadError` and changes nothing,
so a public method runs all of its checks first and only then touches any state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Container, Mapping, Sequence
from typing import NoReturn

from kvoffload_spec.errors import (
    ForeignPlanError,
    InvalidArgumentError,
    PlanAlreadyAbandonedError,
    PlanAlreadyCompletedError,
    UnknownPolicyError,
)
from kvoffload_spec.surface import Key, LoadPlan, Plan, PlanT, StorePlan


def _fail(message: str) -> NoReturn:
    raise InvalidArgumentError(message)


def check_count(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        _fail(f"{name} must be >= {minimum}, got {value}")
    return value


def check_flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        _fail(f"{name} must be True or False, got {value!r}")
    return value


def check_seconds(name: str, value: object) -> float:
    """A duration: a finite number of seconds > 0 (an int or a float, not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(f"{name} must be a number of seconds, got {type(value).__name__}")
    if not 0 < value < float("inf"):
        _fail(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


def check_seen_misses(seen_misses: object) -> set[Key] | None:
    """``prepare_store``'s record of the misses a requester reported already: a set (it
    is updated in place) or None."""
    if seen_misses is not None and not isinstance(seen_misses, set):
        _fail(f"seen_misses must be a set or None, got {type(seen_misses).__name__}")
    return seen_misses


def check_policy_name(policy: object, known: Sequence[str]) -> str:
    if not isinstance(policy, str) or policy not in known:
        raise UnknownPolicyError(f"unknown policy {policy!r}: choose one of {', '.join(known)}")
    return policy


def check_key(key: object) -> Key:
    try:
        hash(key)
    except TypeError:
        _fail(f"keys must be hashable (bytes, int, str, tuple...), got {type(key).__name__}")
    return key


def check_keys(keys: object) -> Sequence[Key]:
    """A list or tuple of hashable keys. A lone ``bytes``/``str`` is refused rather than
    taken for a sequence of one-character keys: that is nearly always a missing ``[...]``.
    """
    if isinstance(keys, (str, bytes, bytearray, memoryview)) or not isinstance(keys, Sequence):
        _fail(f"keys must be a list or tuple of keys, got {type(keys).__name__}")
    for key in keys:
        check_key(key)
    return keys


def check_open_plan(
    plan: object,
    kind: type[PlanT],
    *,
    owner: int,
    open_plans: Mapping[int, StorePlan | LoadPlan],
    issued: int,
) -> PlanT:
    """``plan`` must be a ``kind`` this manager issued and has not seen completed."""
    if not isinstance(plan, kind):
        raise ForeignPlanError(f"expected a {kind.__name__}, got {type(plan).__name__}")
    if plan.owner != owner:
        raise ForeignPlanError(f"{kind.__name__} {plan.plan_id} was issued by another manager")
    if open_plans.get(plan.plan_id) != plan:
        if plan.plan_id in open_plans or not 0 <= plan.plan_id < issued:
            raise ForeignPlanError(f"{kind.__name__} {plan.plan_id} was not issued like this")
        raise PlanAlreadyCompletedError(f"{kind.__name__} {plan.plan_id} was completed already")
    return plan


def check_abandonable(
    plan: object,
    *,
    owner: int,
    open_plans: Mapping[int, StorePlan | LoadPlan],
    issued: int,
    abandoned: Container[int],
) -> StorePlan | LoadPlan:
    """``plan`` must be an open plan of this manager, of either kind, not abandoned yet."""
    checked = _a_plan(plan)
    _check_open(checked, owner=owner, open_plans=open_plans, issued=issued)
    if checked.plan_id in abandoned:
        raise PlanAlreadyAbandonedError(
            f"{type(checked).__name__} {checked.plan_id} was abandoned already: complete it once "
            "its job reports"
        )
    return checked


def check_issued_plan(
    plan: object,
    *,
    owner: int,
    open_plans: Mapping[int, StorePlan | LoadPlan],
    issued: int,
) -> Plan:
    """``plan`` must be a plan of either kind this manager issued, open or completed; an
    open one must be the very plan issued (a closed one cannot be told from a forgery of
    it: no record of it is kept)."""
    checked = _a_plan(plan)
    # Issued and completed is fine: no record of it is kept to compare it with.
    with contextlib.suppress(PlanAlreadyCompletedError):
        _check_open(checked, owner=owner, open_plans=open_plans, issued=issued)
    return checked


def _check_open(
    plan: Plan, *, owner: int, open_plans: Mapping[int, StorePlan | LoadPlan], issued: int
) -> None:
    """:func:`check_open_plan` of a plan of either kind, as its own kind."""
    if isinstance(plan, StorePlan):
        check_open_plan(plan, StorePlan, owner=owner, open_plans=open_plans, issued=issued)
    else:
        check_open_plan(plan, LoadPlan, owner=owner, open_plans=open_plans, issued=issued)


def _a_plan(plan: object) -> Plan:
    if not isinstance(plan, (StorePlan, LoadPlan)):
        raise ForeignPlanError(f"expected a StorePlan or LoadPlan, got {type(plan).__name__}")
    return plan
