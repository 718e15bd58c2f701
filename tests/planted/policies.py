"""Planted bugs in a user's own policy, the kind ``kvoffload verify --policy module:Class``
exists to catch: each with the symptom its counterexample must show."""

from __future__ import annotations

from collections.abc import Container, Iterator, Sequence
from dataclasses import dataclass

from kvoffload.policies.base import EvictionPolicy
from kvoffload.policies.lru import LruPolicy
from kvoffload_spec.surface import Key


class IgnoresProtection(LruPolicy):
    """Victims may be keys of the very store that needs the room."""

    def _candidates(self, protected: Container[Key]) -> Iterator[Key]:
        return iter(self._evictable)


class RefusesToEvictTwo(LruPolicy):
    """A silent bug: a store that needs two victims is refused, room or not."""

    def choose_victims(self, need: int, protected: Container[Key]) -> list[Key] | None:
        return None if need > 1 else super().choose_victims(need, protected)


class RaisesOnEviction(LruPolicy):
    """A crash: the first eviction raises (a bug in the author's own code)."""

    def evict(self, victims: Sequence[Key]) -> None:
        raise ZeroDivisionError("the author divided by the pool's free blocks")


@dataclass(frozen=True)
class UserPolicyBug:
    policy: type[EvictionPolicy]
    symptom: str


USER_POLICY_BUGS = (
    UserPolicyBug(IgnoresProtection, "raised PolicyContractError"),
    UserPolicyBug(RefusesToEvictTwo, "prepare_store refused 2 absent keys"),
    UserPolicyBug(RaisesOnEviction, "raised ZeroDivisionError(the author divided"),
)
