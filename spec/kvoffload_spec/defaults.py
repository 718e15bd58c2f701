"""The defaults of the manager's knobs, in one place: the spec, the manager, the engine
adapters and the CLI all read them from here."""

from __future__ import annotations

DEFAULT_POLICY = "lru"

DEFAULT_STORE_THRESHOLD = 1
"""Offers a key needs before it is stored (1: store on the first offer)."""

DEFAULT_MAX_TRACKER_SIZE = 64_000
"""How many keys the offer tracker behind ``store_threshold`` remembers (vLLM's default)."""

DEFAULT_STALL_AFTER = 300.0
"""Seconds after which an open plan (a job in flight) counts as stalled."""
