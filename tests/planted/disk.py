"""Planted bugs in the disk tier's rules (``kvoffload_spec.disk.DiskRules``): each is what a
plausible slip in a disk tier would do. The exhaustive exploration of the pool over its
disk, through crashes and restarts (``explore_disk``), must find each."""

from __future__ import annotations

from kvoffload_spec.disk import DiskRules
from kvoffload_spec.surface import Key
from kvoffload_spec.tiers import Value


class AcceptsATornWrite(DiskRules):
    """A read checks whose block a slot holds and its namespace, not that it is whole: a
    write torn by a crash, under its new record, is loaded."""

    def accept(self, key: Key, value: Value | None, namespace: int) -> bool:
        return value is not None and value.owner == key and value.namespace == namespace


class ExceedsTheCapacity(DiskRules):
    """A write to a full disk takes one more slot instead of evicting a block."""

    def evicts_when_full(self) -> bool:
        return False


class KeepsBlocksAcrossANamespaceChange(DiskRules):
    """A restarted engine of another model or layout takes the blocks the previous one
    left (the directory's namespace not compared with its own)."""

    def reopens(self, written_under: int, engine: int) -> bool:
        return True
