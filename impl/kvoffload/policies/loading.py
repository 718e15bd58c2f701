"""Turn ``policy=`` (a built-in name, a class, or a ``"module:Class"`` string) into a class."""

from __future__ import annotations

import importlib
import inspect

from kvoffload.policies.arc import ArcPolicy
from kvoffload.policies.base import EvictionPolicy
from kvoffload.policies.duel import DuelPolicy
from kvoffload.policies.lru import LruPolicy
from kvoffload_spec.errors import UnknownPolicyError

BUILTIN_POLICIES: dict[str, type[EvictionPolicy]] = {
    "lru": LruPolicy,
    "arc": ArcPolicy,
    "duel": DuelPolicy,
}


def resolve_policy(policy: object) -> type[EvictionPolicy]:
    """The policy class ``policy`` names; raises ``UnknownPolicyError`` if there is none.

    Accepted: a built-in name (``"lru"``, ``"arc"``, ``"duel"``), a concrete subclass of
    :class:`EvictionPolicy`, or ``"package.module:ClassName"``, which imports the module.
    """
    if isinstance(policy, str):
        builtin = BUILTIN_POLICIES.get(policy)
        if builtin is not None:
            return builtin
        if ":" in policy:
            return _usable(_import(policy), policy)
    elif isinstance(policy, type):
        return _usable(policy, policy.__qualname__)
    raise UnknownPolicyError(
        f"unknown policy {policy!r}: choose one of {', '.join(BUILTIN_POLICIES)}, "
        "an EvictionPolicy subclass, or 'module:Class'"
    )


def _import(path: str) -> object:
    module_name, _, attribute = path.partition(":")
    try:
        found: object = importlib.import_module(module_name)
    except (ImportError, ValueError) as error:
        raise UnknownPolicyError(f"policy {path!r}: cannot import {module_name!r}") from error
    for name in attribute.split("."):
        if not hasattr(found, name):
            raise UnknownPolicyError(f"policy {path!r}: {module_name!r} has no {attribute!r}")
        found = getattr(found, name)
    return found


def _usable(candidate: object, label: str) -> type[EvictionPolicy]:
    if not (isinstance(candidate, type) and issubclass(candidate, EvictionPolicy)):
        raise UnknownPolicyError(f"policy {label!r} is not an EvictionPolicy subclass")
    if inspect.isabstract(candidate):
        raise UnknownPolicyError(f"policy {label!r} leaves abstract methods unimplemented")
    return candidate
