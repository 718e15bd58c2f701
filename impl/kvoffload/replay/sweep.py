"""Hit ratio against CPU capacity: every built-in policy and Belady's optimum on one trace.

The engine's call order, per request, for a cache tier (the reference figures'):

1. the hits are the longest prefix of ids the tier holds (``lookup`` says HIT);
2. the absent ids are stored in request order (``prepare_store`` of the request's ids);
3. all of the request's ids are touched (``touch``: the first id ends most recent);
4. the stores complete (``complete_store`` with success).

The copy of a store is asynchronous, so in an engine it finishes after the scheduler's
touch. For LRU the moment changes nothing (completion does not move recency), so this is
exactly the order of the reference figures. For ARC it matters: a block touched while its
store is in flight was only just inserted, not used twice, and stays in T1; completing
first would promote every new block to T2 at once and make ARC an LRU.

With a device tier in front (``gpu_blocks > 0``), the device is an LRU prefix cache in the
same call order, and the CPU tier sees, per request, only the ids after the device's hit
prefix: the blocks the device did not have. That suffix stream is the CPU tier's key
stream, for every policy and for Belady alike, so the three are compared on equal terms.
Ratios are over all block references of the trace, so the tiers' ratios add up.

>>> from kvoffload_spec import OffloadModel
>>> from kvoffload.replay.traces import Trace
>>> trace = Trace("tiny", ((1, 2, 3), (1, 2, 4), (1, 2, 3)))
>>> model = lambda policy, capacity: OffloadModel(capacity, policy)
>>> for point in sweep(trace, [3], new_tier=model).points:
...     print(point.policy, point.capacity, round(point.hit_ratio, 3))
lru 3 0.444
arc 3 0.444
duel 3 0.444
belady 3 0.556

A policy is named as everywhere else: a built-in name, ``"module:Class"`` or an
``EvictionPolicy`` subclass; the results of one of your own carry its class name:

>>> from kvoffload.policies import LruPolicy
>>> class Renamed(LruPolicy):
...     pass
>>> [point.policy for point in sweep(trace, [3], [Renamed, "belady"]).points]
['Renamed', 'belady']
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvoffload.policies.base import EvictionPolicy
from kvoffload.policies.loading import BUILTIN_POLICIES, resolve_policy
from kvoffload.replay.belady import belady_hits
from kvoffload.replay.device_cache import DevicePrefixCache
from kvoffload.replay.traces import Request, Trace
from kvoffload_spec.errors import InvalidArgumentError, UnknownPolicyError
from kvoffload_spec.surface import Key, Lookup, ManagerOperations
from kvoffload_spec.validation import check_count

BELADY = "belady"  # the offline optimum: not a policy a manager runs, computed on the side
SWEEP_POLICIES = (*BUILTIN_POLICIES, BELADY)  # the registry's policies, and the optimum
DEFAULT_CAPACITIES = (1000, 4000, 16000, 64000)

PolicyName = str | type[EvictionPolicy]
"""A built-in name, ``"belady"``, ``"module:Class"`` or an ``EvictionPolicy`` subclass."""


TierFactory = Callable[[PolicyName, int], ManagerOperations]
"""Builds a CPU tier from a policy (a built-in name or a policy class) and a capacity in
blocks."""


def new_manager(policy: PolicyName, capacity: int) -> ManagerOperations:
    """The production manager: fast enough for whole traces at any capacity."""
    from kvoffload.manager import OffloadManager

    manager: ManagerOperations = OffloadManager(capacity, policy)
    return manager


@dataclass
class TierCounts:
    """What one tier did over a replay."""

    refs: int = 0  # block references the tier was asked about
    hits: int = 0
    stored: int = 0  # blocks that became resident
    evicted: int = 0
    rejected_stores: int = 0  # prepare_store calls that could not place their blocks


def longest_resident_prefix(request: Sequence[Key], tier: ManagerOperations) -> int:
    for hits, key in enumerate(request):
        if tier.lookup(key) is not Lookup.HIT:
            return hits
    return len(request)


def replay(requests: Sequence[Request], tier: ManagerOperations) -> TierCounts:
    """Drive ``tier`` through ``requests`` in the engine's call order (module docstring)."""
    counts = TierCounts()
    for request in requests:
        counts.refs += len(request)
        counts.hits += longest_resident_prefix(request, tier)
        plan = tier.prepare_store(request)
        tier.touch(request)
        if plan is None:
            counts.rejected_stores += 1
        else:
            tier.complete_store(plan, True)
            counts.stored += len(plan.keys)
            counts.evicted += len(plan.evicted_keys)
    return counts


def cpu_stream(requests: Sequence[Request], gpu_blocks: int) -> tuple[list[Request], int]:
    """The CPU tier's key stream behind a device cache of ``gpu_blocks`` (0: none), and the
    device's hits."""
    if gpu_blocks == 0:
        return list(requests), 0
    device = DevicePrefixCache(gpu_blocks)
    stream: list[Request] = []
    device_hits = 0
    for request in requests:
        hits = device.admit(request)
        device_hits += hits
        stream.append(request[hits:])
    return stream, device_hits


@dataclass(frozen=True)
class SweepPoint:
    """The CPU tier's hit ratio under one policy at one capacity."""

    policy: str
    capacity: int
    hit_ratio: float


def label_policies(policies: Sequence[PolicyName]) -> dict[str, PolicyName]:
    """Each policy by the label of its results: a built-in name (and ``"belady"``) as it
    is, a policy of your own by its class name, resolved to its class. Raises
    ``UnknownPolicyError`` for a policy that is not there, ``InvalidArgumentError`` for
    none at all or two policies that would share a label.
    """
    if isinstance(policies, str) or not policies:
        raise InvalidArgumentError(
            f"give at least one policy in a list, e.g. {list(SWEEP_POLICIES)}, got {policies!r}"
        )
    labelled: dict[str, PolicyName] = {}
    for policy in policies:
        resolved: PolicyName
        if policy == BELADY or (isinstance(policy, str) and policy in BUILTIN_POLICIES):
            label, resolved = str(policy), policy
        elif isinstance(policy, str) and ":" not in policy:
            known = ", ".join(SWEEP_POLICIES)
            raise UnknownPolicyError(
                f"unknown policy {policy!r}: choose among {known}, or name your own as "
                "'module:Class'"
            )
        else:
            policy_class = resolve_policy(policy)
            label, resolved = policy_class.__name__, policy_class
        if label in labelled:
            raise InvalidArgumentError(f"two policies are labelled {label!r}: name each once")
        labelled[label] = resolved
    return labelled


def check_sweep_args(
    trace: Trace, capacities: Sequence[int], policies: Sequence[PolicyName], gpu_blocks: int
) -> dict[str, PolicyName]:
    """The policies by label (``label_policies``); raise ``InvalidArgumentError`` for any
    impossible size, ``UnknownPolicyError`` for an unknown policy."""
    if not capacities:
        raise InvalidArgumentError("give at least one CPU capacity")
    for capacity in capacities:
        check_count("capacity", capacity)
    labelled = label_policies(policies)
    check_count("gpu_blocks", gpu_blocks, minimum=0)
    if 0 < gpu_blocks < trace.longest_request:
        raise InvalidArgumentError(
            f"--gpu-blocks {gpu_blocks} cannot hold the longest request of trace "
            f"{trace.name!r} ({trace.longest_request} blocks); use 0 for a single tier"
        )
    return labelled


@dataclass(frozen=True)
class SweepResult:
    """A sweep's points, capacity-major, the hit ratio of the device tier in front, and
    the trace they were measured on (what the table's title shows)."""

    points: tuple[SweepPoint, ...]
    device_hit_ratio: float
    trace: str = ""
    requests: int = 0
    block_refs: int = 0
    gpu_blocks: int = 0
    infinite_cache_hit_ratio: float = 0.0
    partial: bool = False  # interrupted: the points done before it

    def to_json(self) -> dict[str, object]:
        """The format of ``kvoffload sweep --json`` (with ``"partial": true`` added when the
        sweep was interrupted)."""
        return {
            **({"partial": True} if self.partial else {}),
            "trace": self.trace,
            "requests": self.requests,
            "block_refs": self.block_refs,
            "gpu_blocks": self.gpu_blocks,
            "device_hit_ratio": self.device_hit_ratio,
            "infinite_cache_hit_ratio": self.infinite_cache_hit_ratio,
            "results": [
                {"policy": p.policy, "capacity": p.capacity, "hit_ratio": p.hit_ratio}
                for p in self.points
            ],
        }


class SweepInterrupted(KeyboardInterrupt):
    """Ctrl-C during a sweep, with the points it had finished (``result.partial``)."""

    def __init__(self, result: SweepResult) -> None:
        super().__init__(f"interrupted after {len(result.points)} points")
        self.result = result


def sweep(
    trace: Trace,
    capacities: Sequence[int],
    policies: Sequence[PolicyName] = SWEEP_POLICIES,
    *,
    gpu_blocks: int = 0,
    new_tier: TierFactory = new_manager,
    on_point: Callable[[SweepPoint], None] | None = None,
) -> SweepResult:
    """The CPU tier's hit ratio for each capacity and policy; ``on_point`` hears each one.

    Every argument is checked before any work: see ``check_sweep_args``. Ctrl-C (or any
    ``KeyboardInterrupt``) raises :class:`SweepInterrupted` with the points done so far.
    """
    labelled = check_sweep_args(trace, capacities, policies, gpu_blocks)
    stream, device_hits = cpu_stream(trace.requests, gpu_blocks)
    refs = trace.num_refs or 1  # an all-empty trace has no hits either way
    points: list[SweepPoint] = []

    def result(partial: bool = False) -> SweepResult:
        return SweepResult(
            tuple(points),
            device_hits / refs,
            trace=trace.name,
            requests=trace.num_requests,
            block_refs=trace.num_refs,
            gpu_blocks=gpu_blocks,
            infinite_cache_hit_ratio=trace.ideal_hit_ratio,
            partial=partial,
        )

    try:
        for capacity in capacities:
            for label, policy in labelled.items():
                if policy == BELADY:
                    hits = belady_hits(stream, capacity)
                else:
                    hits = replay(stream, new_tier(policy, capacity)).hits
                points.append(SweepPoint(label, capacity, hits / refs))
                if on_point is not None:
                    on_point(points[-1])
    except KeyboardInterrupt as interrupt:
        raise SweepInterrupted(result(partial=True)) from interrupt
    return result()
