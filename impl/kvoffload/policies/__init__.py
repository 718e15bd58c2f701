"""Eviction policies: the interface, the built-in LRU, ARC and duel, and ``policy=``
resolution."""

from kvoffload.policies.arc import ArcPolicy
from kvoffload.policies.base import EvictionPolicy, PolicyContractError
from kvoffload.policies.duel import DuelPolicy
from kvoffload.policies.loading import BUILTIN_POLICIES, resolve_policy
from kvoffload.policies.lru import LruPolicy

__all__ = [
    "BUILTIN_POLICIES",
    "ArcPolicy",
    "DuelPolicy",
    "EvictionPolicy",
    "LruPolicy",
    "PolicyContractError",
    "resolve_policy",
]
