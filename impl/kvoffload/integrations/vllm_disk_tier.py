"""kvoffload's disk tier (a :class:`~kvoffload.tiers.DiskStore`) as a secondary tier of vLLM
0.33's ``TieringOffloadingSpec``, selected by configuration alone::

    kv_connector_extra_config = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": ...,
        "secondary_tiers": [{
            "type": "KvoffloadDiskTier",
            "module_path": "kvoffload.integrations.vllm_disk_tier",
            "path": "/nvme/kvoffload/engine-0",  # a directory of this engine's own
            "disk_bytes": 512,  # GiB of disk at most
            "namespace": {"deployment": "chat-v3"},  # optional, added to the derived one
        }],
    }

vLLM's primary tier is its CPU pool; this tier writes each chunk the pool holds to the disk
(a cascade) and reads chunks found there back into pool slots (a promotion), as
:mod:`kvoffload.integrations.vllm_tier` does with a server: the transfers are that tier's
(one worker thread, vLLM's slots read and written in place), the store is a disk's. A
lookup is answered at once (the disk's index is in RAM): a hit or a miss, never RETRY. The
blocks outlive the engine: a restarted engine with the same model and layout finds them;
another model or layout is refused at start (a typed error: give it another ``path``).

Importing this module imports vLLM; ``import kvoffload`` never does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.v1.kv_offload.base import Locality, LookupResult, Medium, OffloadKey, ReqContext
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvoffload.integrations.vllm_tier import KvoffloadValkeyTier, namespace_of
from kvoffload.tiers import DiskStore
from kvoffload.tiers.secret import resolve_secret
from kvoffload.units import byte_size
from kvoffload_spec.errors import InvalidArgumentError

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

__all__ = ["KvoffloadDiskTier"]

GiB = 1 << 30


class _IndexLookups:
    """What the Valkey tier asks of its lookup thread, answered from the disk's RAM index."""

    def __init__(self, store: DiskStore) -> None:
        self._store = store

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        return self._store.contains([key])[0]

    def cleanup(self, req_id: str) -> None:
        """Nothing is cached per request: every lookup asks the index."""

    def flush(self) -> None:
        """Nothing is batched."""

    def mark_miss(self, keys: list[OffloadKey]) -> None:
        """A block refused at its load is dropped from the index by the store itself."""

    def shutdown(self) -> None:
        """No thread to stop."""


class KvoffloadDiskTier(KvoffloadValkeyTier):
    """A vLLM secondary tier on a local directory, through kvoffload's ``DiskStore``.

    Configuration keys (the tier's entry in ``secondary_tiers``): ``path`` (required: a
    directory of this engine's own: a second engine on it is refused), ``disk_bytes``
    (required: the disk the tier may take: a number of GiB, 0.5 is 512 MiB, or a size
    such as ``"512MiB"``); ``namespace`` (optional str or mapping, added to the one derived
    from vLLM's configuration); ``secret`` or ``secret_file`` (optional: seal the blocks,
    docs/disk.md; else ``$KVOFFLOAD_REMOTE_SECRET`` if set); ``admission`` (``second-offer``,
    the default, or ``every-offer``); ``max_pending_jobs`` (64: transfers queued beyond it
    fail at once rather than wait).

    The transfers are :class:`KvoffloadValkeyTier`'s, whose class this extends: a chunk
    is written from its slot with no copy, read into its slot with no copy, every value
    checked before its load reports success.
    """

    medium: ClassVar[Medium] = Medium.STORAGE
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        path: str | None = None,
        disk_bytes: float | str | None = None,
        namespace: str | Mapping[str, Any] | None = None,
        secret: str | None = None,
        secret_file: str | None = None,
        admission: str = "second-offer",
        max_pending_jobs: int = 64,
        locality: str | None = None,
        backpressure_detector: BackpressureDetector | None = None,
    ) -> None:
        # The server tier's own setup is not this tier's: vLLM's part of it, then _attach.
        SecondaryTierManager.__init__(
            self,
            offloading_spec=offloading_spec,
            primary_kv_view=primary_kv_view,
            tier_type=tier_type,
            backpressure_detector=backpressure_detector,
        )
        self.locality = Locality.LOCAL
        if not isinstance(path, str) or not path:
            raise InvalidArgumentError("the disk tier needs 'path': a directory of its own")
        capacity_bytes = _capacity(disk_bytes)
        if not primary_kv_view.c_contiguous:
            raise InvalidArgumentError("vLLM's primary KV view must be C-contiguous")
        self.namespace = namespace_of(offloading_spec, self.block_size_bytes, namespace)
        # Made before any view of vLLM's pool: a bad setting raises with nothing held.
        self.disk = DiskStore(
            path,
            capacity_bytes=capacity_bytes,
            namespace=self.namespace,
            secret=resolve_secret(secret, secret_file),
            block_bytes=self.block_size_bytes,
            admission=admission,  # type: ignore[arg-type]
        )
        # One store for both: its lookups never wait behind its transfers' bytes.
        self._attach(
            self.disk, self.disk, _IndexLookups(self.disk), primary_kv_view, max_pending_jobs
        )

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return LookupResult.HIT if self.disk.contains([key])[0] else LookupResult.MISS


def _capacity(disk_bytes: object) -> int:
    """``disk_bytes`` in bytes: a number is GiB (as vLLM's ``cpu_bytes_to_use`` is bytes, a
    disk is sized in GiB), a str a size with its unit."""
    if isinstance(disk_bytes, str):
        return byte_size(disk_bytes, "'disk_bytes'")
    if isinstance(disk_bytes, bool) or not isinstance(disk_bytes, (int, float)):
        raise InvalidArgumentError(
            "the disk tier needs 'disk_bytes': the GiB of disk it may take (a number, or a "
            "size such as '512MiB')"
        )
    if not 0 < disk_bytes < float("inf"):
        raise InvalidArgumentError(f"'disk_bytes' must be a positive number of GiB: {disk_bytes}")
    return int(disk_bytes * GiB)
