"""Planted bugs in the data path's block-id checks: each stands in for a real check (in
every module that uses it) and lets through a bad id the checks must report."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvoffload import offloader as offloader_module
from kvoffload.transfer import copiers as copiers_module
from kvoffload.transfer import engine as engine_module
from kvoffload.transfer.engine import SMALL, as_block_ids, require_distinct
from kvoffload.transfer.runs import IdArray
from kvoffload_spec.errors import InvalidArgumentError


def bound_off_by_one(name: str, ids: object, limit: int) -> IdArray:
    """Lets ``limit`` itself through: the block just past the pool or the device cache."""
    return as_block_ids(name, ids, limit + 1)


def bound_off_by_one_when_vectorized(name: str, ids: object, limit: int) -> IdArray:
    """The same slip on the numpy path only (more than ``SMALL`` ids)."""
    array = as_block_ids(name, ids, limit + 1)
    if len(array) <= SMALL:
        return as_block_ids(name, ids, limit)
    return array


def planned_bound_off_by_one(name: str, ids: object, limit: int) -> IdArray:
    """The slip on CPU ids only: the block ids a manager planned, not the device ids."""
    return as_block_ids(name, ids, limit + (name == "cpu_block_ids"))


def distinct_neighbours_only(name: str, ids: IdArray) -> None:
    """Compares each id with the next one only: ``[1, 2, 1]`` passes."""
    if bool((ids[1:] == ids[:-1]).any()):
        raise InvalidArgumentError(f"{name} are written to and must not repeat")


def distinct_neighbours_only_when_short(name: str, ids: IdArray) -> None:
    """Sorts before comparing neighbours on the numpy path, forgets to on the short one."""
    if len(ids) <= SMALL:
        distinct_neighbours_only(name, ids)
    else:
        require_distinct(name, ids)


def copier_bound_off_by_one(runs: Any, segment_end: Any, pool_end: int) -> None:
    """The raw copiers' last-resort check refuses a run that ends exactly at the end of
    its buffer: every copy of the pool's last block fails."""
    if not len(runs):
        return
    device_end = runs.device_offset + runs.nbytes
    if (device_end >= segment_end[runs.segment]).any() or int(
        (runs.cpu_offset + runs.nbytes).max()
    ) >= pool_end:
        raise RuntimeError("a copy run lies outside its buffer: refusing to copy")


@dataclass(frozen=True)
class PlantedIdBug:
    """``replacement`` stands in for ``target`` (``module.name``, in every module that uses
    it); ``caught_as`` is a phrase the checker's report must contain."""

    name: str
    targets: tuple[tuple[Any, str], ...]
    replacement: Callable[..., Any]
    caught_as: str


BOTH = (engine_module, offloader_module)
PLANTED_ID_BUGS = (
    PlantedIdBug(
        "bound off by one",
        tuple((module, "as_block_ids") for module in BOTH),
        bound_off_by_one,
        "with one past the last block: accepted",
    ),
    PlantedIdBug(
        "bound off by one on the numpy path",
        tuple((module, "as_block_ids") for module in BOTH),
        bound_off_by_one_when_vectorized,
        f"{SMALL + 4} ids): store into CPU ids with one past the last block: accepted",
    ),
    PlantedIdBug(
        "distinctness of neighbours only",
        tuple((module, "require_distinct") for module in BOTH),
        distinct_neighbours_only,
        "with the first id again at the end: accepted",
    ),
    PlantedIdBug(
        "distinctness of neighbours only on the short path",
        tuple((module, "require_distinct") for module in BOTH),
        distinct_neighbours_only_when_short,
        "3 ids): store into CPU ids with an id again two places later: accepted",
    ),
    PlantedIdBug(
        "the offloader's bound off by one",
        ((offloader_module, "as_block_ids"),),
        bound_off_by_one,
        "(3 keys): store from device ids with one past the last block: accepted",
    ),
    PlantedIdBug(
        "the offloader's bound off by one on the numpy path",
        ((offloader_module, "as_block_ids"),),
        bound_off_by_one_when_vectorized,
        f"({SMALL + 4} keys): store from device ids with one past the last block: accepted",
    ),
    PlantedIdBug(
        "the offloader's bound off by one for planned ids only",
        ((offloader_module, "as_block_ids"),),
        planned_bound_off_by_one,
        "(3 keys): store into planned CPU ids with one past the last block: accepted",
    ),
    PlantedIdBug(
        "the offloader's distinctness of neighbours only",
        ((offloader_module, "require_distinct"),),
        distinct_neighbours_only,
        "(3 keys): load into device ids with the first id again at the end: accepted",
    ),
    PlantedIdBug(
        "the offloader's distinctness of neighbours only on the short path, for planned ids",
        ((offloader_module, "require_distinct"),),
        distinct_neighbours_only_when_short,
        "(3 keys): store into planned CPU ids with the first id again at the end: accepted",
    ),
    PlantedIdBug(
        "raw-copy bounds backstop off by one",
        ((copiers_module, "require_in_bounds"),),
        copier_bound_off_by_one,
        "(memmove, 3 ids): job 0 failed",
    ),
)
