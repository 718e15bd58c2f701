"""Planted bugs in the run planner (transfer/runs.py): each an edit of the source (old text,
new text, which must match once), of the kind a refactor of the numpy path makes. The
mixed-layout property of tests/test_run_planner.py must find each."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PlannerBug:
    name: str
    bug: str
    edit: tuple[str, str]


PLANNER_BUGS = (
    PlannerBug(
        "the numpy planner merges runs in rows that are not packed",
        "Jobs large enough for the numpy path merge consecutive ids in every row, packed or "
        "not: on a strided row a run copies the gap bytes of other segments too.",
        ("~(follows & self._packed[:, None])", "~(follows & np.ones_like(self._packed)[:, None])"),
    ),
    PlannerBug(
        "the numpy planner merges runs across CPU blocks of several rows",
        "Jobs large enough for the numpy path merge a run into the next CPU block although a "
        "CPU block holds several rows: the run lands on the next row's bytes.",
        ("follows[1:] &= sub[1:] % k != 0", "follows[1:] &= sub[1:] % k >= 0"),
    ),
    PlannerBug(
        "the plain planner merges runs in rows that are not packed",
        "Small jobs merge consecutive ids in every row, packed or not (the twin of the numpy "
        "path's slip).",
        ("if packed and previous == (device - 1, sub - 1)", "if previous == (device - 1, sub - 1)"),
    ),
)
