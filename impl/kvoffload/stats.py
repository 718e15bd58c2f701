"""What the manager reports about itself: a frozen snapshot, and the tally behind it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Tally:
    """Running event counters the manager bumps as it works (not cache state: a failed call
    may still count, and ``reset_cache`` does not zero them).
    """

    lookup_hits: int = 0
    lookup_misses: int = 0
    lookup_pending: int = 0
    blocks_stored: int = 0
    blocks_loaded: int = 0
    evictions: int = 0
    failed_stores: int = 0
    rejected_stores: int = 0
    fast_fail_rejections: int = 0
    resets: int = 0
    abandoned_plans: int = 0


@dataclass(frozen=True, slots=True)
class ManagerStats:
    """A snapshot of ``OffloadManager.stats()``.

    Gauges (now): ``resident`` blocks (``pending`` + ``pinned`` + ``evictable``), ``free``
    slots, ``quarantined`` slots (of abandoned stores whose jobs have not reported);
    ``resident + free + quarantined == num_blocks``. ``stalled_plans``: open plans older
    than the manager's ``stall_after`` (abandoned ones left out), holding ``stalled_pins``
    pins and ``stalled_pending`` pending blocks; ``abandoned_open``: abandoned plans whose
    completion is still due. Counters (since construction):
    ``lookup_hits`` / ``lookup_misses`` / ``lookup_pending`` by ``lookup`` result;
    ``blocks_stored`` made readable by a successful ``complete_store``; ``blocks_loaded`` by
    completed load plans (one per key occurrence); ``evictions``; ``failed_stores`` (blocks
    whose store job reported failure); ``rejected_stores`` (``prepare_store`` calls that
    returned None), of which ``fast_fail_rejections`` were refused in O(1) without asking the
    policy; ``resets``; ``abandoned_plans``.
    """

    num_blocks: int
    resident: int
    pending: int
    pinned: int
    evictable: int
    free: int
    quarantined: int
    stalled_plans: int
    stalled_pins: int
    stalled_pending: int
    abandoned_open: int
    lookup_hits: int
    lookup_misses: int
    lookup_pending: int
    blocks_stored: int
    blocks_loaded: int
    evictions: int
    failed_stores: int
    rejected_stores: int
    fast_fail_rejections: int
    resets: int
    abandoned_plans: int

    @property
    def hit_ratio(self) -> float:
        """Hits over all lookups (0.0 before the first lookup)."""
        lookups = self.lookup_hits + self.lookup_misses + self.lookup_pending
        return self.lookup_hits / lookups if lookups else 0.0


@dataclass(frozen=True, slots=True)
class TransferStats:
    """What an ``Offloader``'s copy jobs did, per direction, since it was made (a snapshot of
    ``Offloader.transfer_stats()``): jobs finished, of them failed, bytes and seconds of the
    copies (failed ones included), and jobs that finished after their plan was abandoned.
    Fetches from a remote tier are not copies of the device: ``remote_stats()`` has them.
    """

    loads: int = 0
    loads_failed: int = 0
    load_bytes: int = 0
    load_seconds: float = 0.0
    stores: int = 0
    stores_failed: int = 0
    store_bytes: int = 0
    store_seconds: float = 0.0
    finished_abandoned: int = 0
