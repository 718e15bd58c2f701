"""Tiers behind the CPU block pool: a remote block store shared by engines, a local disk.

- ``RemoteStore``: the contract (:mod:`kvoffload.tiers.store`);
- ``ValkeyStore``: the store on a Valkey or Redis server (:mod:`kvoffload.tiers.valkey_store`,
  needs ``kvoffload[remote]``);
- ``DiskStore``: the store on a local directory, bounded and restart-safe
  (:mod:`kvoffload.tiers.disk_store`, needs ``kvoffload[disk]``);
- ``RemoteTier``: a store's calls on a worker thread behind a bounded queue
  (:mod:`kvoffload.tiers.background`);
- ``Namespace`` keeps two models or KV layouts apart on one server, and the value format makes
  a stale, foreign, truncated or corrupt value a miss (:mod:`kvoffload.tiers.values`); with a
  tenant's secret (:mod:`kvoffload.tiers.secret`), a forged one too;
- ``acl_rule``: the least-privilege ACL user of one tenant's store.

The modules that need the client library are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvoffload.tiers.store import RemoteStats, RemoteStore, StoreClosedError

if TYPE_CHECKING:
    from kvoffload.tiers.acl import acl_rule as acl_rule
    from kvoffload.tiers.background import JobNotDoneError as JobNotDoneError
    from kvoffload.tiers.background import RemoteJob as RemoteJob
    from kvoffload.tiers.background import RemoteTier as RemoteTier
    from kvoffload.tiers.background import RemoteTierStats as RemoteTierStats
    from kvoffload.tiers.cluster_map import ClusterModeError as ClusterModeError
    from kvoffload.tiers.disk_layout import DiskInUseError as DiskInUseError
    from kvoffload.tiers.disk_layout import DiskLayoutError as DiskLayoutError
    from kvoffload.tiers.disk_stats import DiskStats as DiskStats
    from kvoffload.tiers.disk_store import DiskStore as DiskStore
    from kvoffload.tiers.secret import SECRET_ENV as SECRET_ENV
    from kvoffload.tiers.secret import read_secret_file as read_secret_file
    from kvoffload.tiers.secret import resolve_secret as resolve_secret
    from kvoffload.tiers.valkey_store import ValkeyStore as ValkeyStore
    from kvoffload.tiers.values import Namespace as Namespace
    from kvoffload.tiers.values import Rejection as Rejection

__all__ = [
    "SECRET_ENV",
    "ClusterModeError",
    "DiskInUseError",
    "DiskLayoutError",
    "DiskStats",
    "DiskStore",
    "JobNotDoneError",
    "Namespace",
    "Rejection",
    "RemoteJob",
    "RemoteStats",
    "RemoteStore",
    "RemoteTier",
    "RemoteTierStats",
    "StoreClosedError",
    "ValkeyStore",
    "acl_rule",
    "read_secret_file",
    "resolve_secret",
]

_LAZY: dict[str, str] = {
    "ClusterModeError": "kvoffload.tiers.cluster_map",
    "DiskInUseError": "kvoffload.tiers.disk_layout",
    "DiskLayoutError": "kvoffload.tiers.disk_layout",
    "DiskStats": "kvoffload.tiers.disk_stats",
    "DiskStore": "kvoffload.tiers.disk_store",
    "JobNotDoneError": "kvoffload.tiers.background",
    "RemoteJob": "kvoffload.tiers.background",
    "RemoteTier": "kvoffload.tiers.background",
    "RemoteTierStats": "kvoffload.tiers.background",
    "Namespace": "kvoffload.tiers.values",
    "Rejection": "kvoffload.tiers.values",
    "ValkeyStore": "kvoffload.tiers.valkey_store",
    "acl_rule": "kvoffload.tiers.acl",
    "SECRET_ENV": "kvoffload.tiers.secret",
    "read_secret_file": "kvoffload.tiers.secret",
    "resolve_secret": "kvoffload.tiers.secret",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvoffload.tiers' has no attribute {name!r}")
    try:
        loaded = importlib.import_module(module)
    except ImportError as error:
        extra = "disk" if module.startswith("kvoffload.tiers.disk") else "remote"
        raise ImportError(
            f"kvoffload.tiers.{name} needs the {extra} tier's dependencies "
            f"(pip install 'kvoffload[{extra}]'): {error}"
        ) from error
    return getattr(loaded, name)
