"""``kvoffload verify``: check a policy, built in or your own, against the spec.

The policy runs inside the production ``OffloadManager``, which is checked two ways:

1. **exhaustive exploration** (:mod:`kvoffload_spec.explore`): every state a pool of two
   blocks reaches with keys a, b, c, d in a few calls, each call checked (invariants, what the
   plans predict, events, failed calls changing nothing, every load reading its own
   bytes), breadth first, so a violation comes with a shortest history;
2. **conformance** (:mod:`kvoffload.checking.conformance`): the manager and the spec's
   ``OffloadModel`` side by side on random histories, in rounds, until the time budget is
   spent.

A built-in policy must choose exactly the spec's victims; a policy of your own must choose
legal ones (evictable, unprotected, and a store refused only when there is truly no room),
and everything else must be the spec's. The exploration gets half of the budget, at most
what it needs to finish its depth bound; the conformance machine gets the rest.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvoffload_spec.policies import POLICY_NAMES
from kvoffload_spec.validation import check_seconds

if TYPE_CHECKING:
    from kvoffload.checking.conformance import ManagerLike
    from kvoffload.policies.base import EvictionPolicy

EXPLORE_BLOCKS = 2
# Four keys, so that a store can need two victims (two absent keys, two evictable others);
# with three it never does, and a policy that fails multi-victim evictions goes unseen.
EXPLORE_KEYS = ("a", "b", "c", "d")
# Depth 3 takes ~2.5 s and depth 4 ~20 s on a busy 2-core machine; each level multiplies
# the states held in memory by 5-6. Deeper histories are the conformance machine's job.
EXPLORE_MAX_DEPTH = 5
CONFORMANCE_ROUND = 50  # histories per round: small, so the budget is kept closely
CONFORMANCE_STEPS = 30  # calls per history


@dataclass(frozen=True)
class CheckResult:
    """One check: what it covered, how long it took, whether it passed."""

    name: str
    covered: str
    seconds: float
    passed: bool
    # what was covered, as numbers: exploration {depth, complete, states, transitions},
    # conformance {histories, max_steps}
    coverage: dict[str, int | bool] = field(default_factory=dict)


@dataclass
class VerifyReport:
    """The checks run on ``policy``, and the first counterexample found, if any."""

    policy: str
    budget_s: float
    checks: list[CheckResult] = field(default_factory=list)
    counterexample: str | None = None

    @property
    def passed(self) -> bool:
        return self.counterexample is None and all(check.passed for check in self.checks)

    def to_json(self) -> dict[str, object]:
        """The format of ``kvoffload verify --json``."""
        return {
            "policy": self.policy,
            "budget_s": self.budget_s,
            "passed": self.passed,
            "checks": [
                {
                    "name": c.name,
                    "covered": c.covered,
                    "seconds": round(c.seconds, 3),
                    "passed": c.passed,
                    "coverage": c.coverage,
                }
                for c in self.checks
            ],
            "counterexample": self.counterexample,
        }

    def summary_rows(self) -> list[tuple[str, str]]:
        rows = [
            (c.name, f"{'passed' if c.passed else 'FAILED'}: {c.covered} in {c.seconds:.1f} s")
            for c in self.checks
        ]
        rows.append(("verdict", "conforms to the spec" if self.passed else "DOES NOT CONFORM"))
        return rows


StageHook = Callable[[str], None]
"""``hook(description)``: a check is starting."""


def verify(
    policy: str | type[EvictionPolicy],
    budget_s: float = 60.0,
    on_stage: StageHook | None = None,
) -> VerifyReport:
    """Check ``policy`` ("lru", "arc", "duel", "module:Class" or an ``EvictionPolicy`` subclass)
    within ``budget_s`` seconds.

    An unknown or unusable policy raises ``UnknownPolicyError`` before anything runs.
    """
    from kvoffload.policies.loading import resolve_policy

    check_seconds("budget_s", budget_s)
    policy_class = resolve_policy(policy)
    name = policy if isinstance(policy, str) else policy.__qualname__
    # only a built-in name promises the spec's own victims
    exact = policy if isinstance(policy, str) and policy in POLICY_NAMES else None
    report = VerifyReport(name, budget_s)
    started = time.monotonic()
    if on_stage is not None:
        on_stage(f"exhaustive exploration: {name}")
    report.checks.append(_exploration(policy_class, started + budget_s / 2, report))
    if report.counterexample is not None:
        return report
    if on_stage is not None:
        on_stage(f"conformance: {name} against the spec")
    report.checks.append(_conformance(exact, policy_class, started + budget_s, report))
    return report


def _exploration(
    policy_class: type[EvictionPolicy], deadline: float, report: VerifyReport
) -> CheckResult:
    from kvoffload.manager import OffloadManager
    from kvoffload_spec.explore import explore

    explored = explore(
        lambda: OffloadManager(EXPLORE_BLOCKS, policy_class, enable_events=True),
        keys=EXPLORE_KEYS,
        depth=EXPLORE_MAX_DEPTH,
        max_seconds=max(deadline - time.monotonic(), 0.01),
    )
    pool = f"a pool of {EXPLORE_BLOCKS} blocks, keys {', '.join(EXPLORE_KEYS)}"
    if explored.violation is not None:
        report.counterexample = (
            f"a shortest history (exhaustive exploration of {pool}):\n{explored.violation}"
        )
        return CheckResult(
            "exploration",
            f"a violation after {explored.states:,} states",
            explored.seconds,
            False,
            _explored(explored.depth, explored.complete, explored.states, explored.transitions),
        )
    reach = (
        f"every state within {explored.depth} calls"
        if explored.complete
        else f"every state within {explored.depth} calls (the budget ended the next level)"
    )
    return CheckResult(
        "exploration",
        f"{reach} on {pool}: {explored.states:,} states, {explored.transitions:,} checked calls",
        explored.seconds,
        True,
        _explored(explored.depth, explored.complete, explored.states, explored.transitions),
    )


def _explored(depth: int, complete: bool, states: int, transitions: int) -> dict[str, int | bool]:
    return {"depth": depth, "complete": complete, "states": states, "transitions": transitions}


def _conformance(
    exact: str | None, policy_class: type[EvictionPolicy], deadline: float, report: VerifyReport
) -> CheckResult:
    import hypothesis
    from hypothesis import Phase

    from kvoffload.checking.conformance import check_conformance
    from kvoffload.manager import OffloadManager

    def make_manager(
        num_blocks: int, *, store_threshold: int, max_tracker_size: int, enable_events: bool
    ) -> ManagerLike:
        return OffloadManager(
            num_blocks,
            policy_class,
            store_threshold=store_threshold,
            max_tracker_size=max_tracker_size,
            enable_events=enable_events,
        )

    settings = hypothesis.settings(
        max_examples=CONFORMANCE_ROUND,
        stateful_step_count=CONFORMANCE_STEPS,
        deadline=None,
        database=None,  # a command run in the user's directory leaves no .hypothesis/ behind
        print_blob=False,
        # no explain phase: it reruns the failure many times to point at lines, and the
        # minimal history is what a policy author needs
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
        suppress_health_check=list(hypothesis.HealthCheck),
    )
    started = time.monotonic()
    rounds = 0
    with _hypothesis_files_elsewhere():
        while rounds == 0 or time.monotonic() < deadline:
            try:
                check_conformance(make_manager, policy=exact, settings=settings)
            except AssertionError as failure:
                report.counterexample = _describe(failure)
                return CheckResult(
                    "conformance",
                    f"a counterexample within {(rounds + 1) * CONFORMANCE_ROUND} histories",
                    time.monotonic() - started,
                    False,
                    {"histories": (rounds + 1) * CONFORMANCE_ROUND, "max_steps": CONFORMANCE_STEPS},
                )
            rounds += 1
    victims = "the spec's victims" if exact else "legal victims"
    return CheckResult(
        "conformance",
        f"{rounds * CONFORMANCE_ROUND:,} random histories of up to {CONFORMANCE_STEPS} calls "
        f"({victims}, every result, counter and event compared)",
        time.monotonic() - started,
        True,
        {"histories": rounds * CONFORMANCE_ROUND, "max_steps": CONFORMANCE_STEPS},
    )


@contextmanager
def _hypothesis_files_elsewhere() -> Iterator[None]:
    """Keep Hypothesis' cache files out of the user's working directory (it would create
    ``.hypothesis/`` there), then give it back its default place.
    """
    from hypothesis.configuration import set_hypothesis_home_dir

    with tempfile.TemporaryDirectory(prefix="kvoffload-verify-") as scratch:
        set_hypothesis_home_dir(scratch)
        try:
            yield
        finally:
            set_hypothesis_home_dir(None)


def _describe(failure: AssertionError) -> str:
    """The failing history: the kit's own words (numbered manager calls, the results that
    differed), or, for any other assertion, the failure and what Hypothesis attached."""
    from kvoffload.checking.conformance import ConformanceError

    if isinstance(failure, ConformanceError):
        return str(failure)
    notes = getattr(failure, "__notes__", [])
    return "\n".join([f"{type(failure).__name__}: {failure}", *notes]).strip()
