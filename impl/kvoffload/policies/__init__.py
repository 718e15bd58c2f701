"""Eviction policies: the interface, the built-in LRU and ARC, and ``policy=`` resolution."""

from kvoffload.policies.arc import ArcPolicy
from kvoffload.policies.base import EvictionPolicy, PolicyContractError
from kvoffload.policies.loading import BUILTIN_POLICIES, resolve_policy
from kvoffload.policies.lru import LruPolicy

__all__ = [
    "BUILTIN_POLICIES",
    "ArcPolicy",
    "EvictionPolicy",
    "LruPolicy",
    "PolicyContractError",
    "resolve_policy",
]
