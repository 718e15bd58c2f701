"""Argument checks shared by the spec and the production manager.

Each check raises a typed :class:`~kvoffload_spec.errors.OffloadError` and changes nothing,
so a public method runs all of its checks first and only then touches any state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NoReturn

from kvoffload_spec.errors import (
    ForeignPlanError,
    InvalidArgumentError,
    PlanAlreadyCompletedError,
    UnknownPolicyError,
)
from kvoffload_spec.surface import Key, LoadPlan, PlanT, StorePlan


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
