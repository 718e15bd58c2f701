"""The public reference model: validates every call, then runs the spec's transition.

>>> from kvoffload_spec import Lookup, OffloadModel
>>> model = OffloadModel(2)
>>> plan = model.prepare_store(["a", "b"])
>>> plan.keys, plan.block_ids, plan.evicted_keys
(('a', 'b'), (0, 1), ())
>>> model.lookup("a")
<Lookup.PENDING: 'pending'>
>>> model.complete_store(plan)
>>> model.num_evictable_blocks
2
"""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload_spec.defaults import (
    DEFAULT_MAX_TRACKER_SIZE,
    DEFAULT_POLICY,
    DEFAULT_STORE_THRESHOLD,
)
from kvoffload_spec.errors import BlockNotFoundError, BlockPendingError, SpecViolation
from kvoffload_spec.policies import POLICY_NAMES, new_order
from kvoffload_spec.state import SpecState, invariant_violations
from kvoffload_spec.surface import Event, Key, LoadPlan, Lookup, PlanT, StorePlan, new_owner_id
from kvoffload_spec.validation import (
    check_abandonable,
    check_count,
    check_flag,
    check_issued_plan,
    check_key,
    check_keys,
    check_open_plan,
    check_policy_name,
    check_seen_misses,
)


class OffloadModel:
    """Reference state machine of a CPU KV-block offloading manager (see docs/spec.md)."""

    def __init__(
        self,
        num_blocks: int,
        policy: str = DEFAULT_POLICY,
        *,
        store_threshold: int = DEFAULT_STORE_THRESHOLD,
        max_tracker_size: int = DEFAULT_MAX_TRACKER_SIZE,
        enable_events: bool = False,
    ) -> None:
        check_count("num_blocks", num_blocks)
        self.policy = check_policy_name(policy, POLICY_NAMES)
        self.state = SpecState.empty(
            num_blocks,
            new_order(policy, num_blocks),
            store_threshold=check_count("store_threshold", store_threshold),
            max_tracker_size=check_count("max_tracker_size", max_tracker_size),
            enable_events=check_flag("enable_events", enable_events),
            owner=new_owner_id(),
        )

    @classmethod
    def from_state(cls, state: SpecState, policy: str = "lru") -> OffloadModel:
        """A model that carries on from ``state`` (which it takes over, not a copy): e.g. the
        abstraction of a manager, to check one step of it against the spec's transition."""
        model = cls.__new__(cls)
        model.policy = policy
        model.state = state
        return model

    def abstract_state(self) -> SpecState:
        """The spec state this model stands for: its own (the refinement mapping's identity)."""
        return self.state

    # -- read-only views -------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.state.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self.state.free_block_ids)

    @property
    def num_evictable_blocks(self) -> int:
        return self.state.num_evictable

    @property
    def num_quarantined_blocks(self) -> int:
        """Slots of abandoned stores whose jobs have not reported yet: not usable."""
        return len(self.state.quarantined())

    def lookup(self, key: Key) -> Lookup:
        return self.state.lookup(check_key(key))

    # -- operations ------------------------------------------------------------------------

    def prepare_store(
        self, keys: Sequence[Key], *, seen_misses: set[Key] | None = None
    ) -> StorePlan | None:
        """Plan to store ``keys``; None when they cannot all be placed (nothing changed).

        ``seen_misses``: the candidates whose store miss the policy already heard from this
        requester (an engine retries a refused store every step): not reported again; the
        ones reported now are added to it.
        """
        checked = check_keys(keys)
        return self.state.prepare_store(checked, seen_misses=check_seen_misses(seen_misses))

    def complete_store(self, plan: StorePlan, success: bool = True) -> None:
        check_flag("success", success)
        self.state.complete_store(self._open_plan(plan, StorePlan), success)

    def prepare_load(self, keys: Sequence[Key]) -> LoadPlan:
        """Pin ``keys`` for reading. Raises ``BlockNotFoundError`` / ``BlockPendingError``
        (subclasses of ``BlockNotReadyError``) if any key is not ready; then nothing changed.
        """
        for key in check_keys(keys):
            self._require_ready(key)
        return self.state.prepare_load(keys)

    def complete_load(self, plan: LoadPlan) -> None:
        self.state.complete_load(self._open_plan(plan, LoadPlan))

    def abandon(self, plan: StorePlan | LoadPlan) -> None:
        """Give up waiting for the job of ``plan`` (it stalled): a load's pins are released,
        a store's keys become absent and its block ids stay quarantined until ``complete_*``
        reports the job over. The plan must still be completed once; that changes nothing
        else. Raises ``PlanAlreadyAbandonedError`` the second time.
        """
        state = self.state
        checked = check_abandonable(
            plan,
            owner=state.owner,
            open_plans=state.open_plans,
            issued=state.next_plan_id,
            abandoned=state.abandoned,
        )
        state.abandon(checked)

    def is_abandoned(self, plan: StorePlan | LoadPlan) -> bool:
        """Whether ``plan`` was abandoned and not completed since (see
        ``SpecState.is_abandoned``): True from ``abandon(plan)`` until ``complete_*(plan)``,
        across resets; False otherwise, a completed plan included. Changes nothing. Raises
        ``ForeignPlanError`` for anything but a plan this model issued (an open one must be
        the very plan issued).
        """
        state = self.state
        checked = check_issued_plan(
            plan, owner=state.owner, open_plans=state.open_plans, issued=state.next_plan_id
        )
        return state.is_abandoned(checked)

    def touch(self, keys: Sequence[Key]) -> None:
        self.state.touch(check_keys(keys))

    def reset_cache(self) -> None:
        self.state.reset_cache()

    def take_events(self) -> list[Event]:
        """The events since the last call, oldest first (always empty unless enabled)."""
        events = self.state.events
        if events is None:
            return []
        taken = list(events)
        events.clear()
        return taken

    def check_invariants(self, abstraction: SpecState | None = None) -> None:
        """Raise ``SpecViolation`` if the state breaks an invariant; ``abstraction`` (what
        :meth:`abstract_state` returned: the state itself) is taken as the manager's is."""
        problems = invariant_violations(self.state if abstraction is None else abstraction)
        if problems:
            raise SpecViolation("; ".join(problems))

    # -- validation ------------------------------------------------------------------------

    def _require_ready(self, key: Key) -> None:
        found = self.state.lookup(key)
        if found is Lookup.MISS:
            raise BlockNotFoundError(f"cannot load {key!r}: it is not in the CPU pool")
        if found is Lookup.PENDING:
            raise BlockPendingError(f"cannot load {key!r}: its store has not completed yet")

    def _open_plan(self, plan: object, kind: type[PlanT]) -> PlanT:
        state = self.state
        return check_open_plan(
            plan, kind, owner=state.owner, open_plans=state.open_plans, issued=state.next_plan_id
        )
