"""A real Valkey Cluster for the tests: 3 primaries and 3 replicas on 127.0.0.1, made from
the same server binary as :mod:`tests.valkey_server` (``cluster-enabled yes``), its slots
assigned with ``CLUSTER ADDSLOTSRANGE``, the nodes introduced with ``CLUSTER MEET`` and the
replicas attached with ``CLUSTER REPLICATE``, all from Python (no ``valkey-cli``)."""

from __future__ import annotations

import time
from typing import Any

import valkey

from tests.valkey_server import ValkeyServer, free_port

SLOTS = 16384
READY_S = 20.0


def command(server: ValkeyServer, *args: object) -> Any:
    """One admin command to one node (the client library: these are not the store's)."""
    with valkey.Valkey(host="127.0.0.1", port=server.port, socket_timeout=10.0) as client:
        return client.execute_command(*args)


class ValkeyCluster:
    """``primaries`` primaries, each with ``replicas_each`` replicas; ``start()`` waits for
    ``cluster_state:ok`` on every node."""

    def __init__(self, primaries: int = 3, replicas_each: int = 1, node_timeout_ms: int = 500):
        self.servers = [
            # The bus port named: the default (port + 10000) may be past 65535 or taken.
            ValkeyServer(
                cluster_enabled="yes",
                cluster_node_timeout=str(node_timeout_ms),
                cluster_port=str(free_port()),
                # a replica's first sync at once (the default waits 5 s for more replicas)
                repl_diskless_sync_delay="0",
            )
            for _ in range(primaries * (1 + replicas_each))
        ]
        self.primary_count = primaries

    @property
    def url(self) -> str:
        return "redis://" + ",".join(f"127.0.0.1:{s.port}" for s in self.servers[:2])

    def start(self) -> ValkeyCluster:
        for server in self.servers:
            server.start()
        primaries = self.servers[: self.primary_count]
        size = SLOTS // len(primaries)
        for i, server in enumerate(primaries):
            last = SLOTS - 1 if i == len(primaries) - 1 else (i + 1) * size - 1
            command(server, "CLUSTER ADDSLOTSRANGE", i * size, last)
        for server in self.servers[1:]:
            bus = server.config["cluster_port"]
            command(self.servers[0], "CLUSTER MEET", "127.0.0.1", server.port, bus)
        self.wait_ok()
        for i, replica in enumerate(self.servers[self.primary_count :]):
            primary = primaries[i % len(primaries)]
            node_id = command(primary, "CLUSTER MYID")
            self._until(
                lambda r=replica, n=node_id: _knows(r, n), f"{replica.port} to learn {node_id}"
            )
            command(replica, "CLUSTER REPLICATE", node_id)
        self.wait_ok()
        for replica in self.servers[self.primary_count :]:
            # Its first full sync over: before that, WAIT may count it while it holds nothing.
            self._until(lambda r=replica: _synced(r), f"{replica.port}'s first sync")
        return self

    def wait_ok(self) -> None:
        def ok() -> bool:
            for server in self.servers:
                if server.process is None:
                    continue
                try:
                    info = command(server, "CLUSTER INFO")
                except valkey.ValkeyError:
                    return False
                if isinstance(info, dict):  # the client parses CLUSTER INFO
                    if info.get("cluster_state") != "ok":
                        return False
                elif b"cluster_state:ok" not in info:
                    return False
            return True

        self._until(ok, "cluster_state:ok")

    @staticmethod
    def _until(condition: object, what: str) -> None:
        deadline = time.monotonic() + READY_S
        while not condition():  # type: ignore[operator]
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster did not get to {what}")
            time.sleep(0.02)

    def owner(self, slot: int) -> ValkeyServer:
        """The live server that is the slot's primary now (asked of a live node)."""
        live = next(s for s in self.servers if s.process is not None)
        for start, stop, primary, *_ in command(live, "CLUSTER SLOTS"):
            if start <= slot <= stop:
                port = int(primary[1])
                return next(s for s in self.servers if s.port == port)
        raise LookupError(slot)

    def replica_of(self, primary: ValkeyServer) -> ValkeyServer:
        node_id = command(primary, "CLUSTER MYID")
        for server in self.servers:
            if server is primary or server.process is None:
                continue
            role = command(server, "ROLE")
            if role[0] in (b"slave", "slave") and int(role[2]) == primary.port:
                return server
        raise LookupError(f"no replica of {node_id}")

    def close(self) -> None:
        for server in self.servers:
            server.close()

    def __enter__(self) -> ValkeyCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _synced(server: ValkeyServer) -> bool:
    info = command(server, "INFO", "replication")
    if isinstance(info, dict):
        return info.get("master_link_status") == "up" and not info.get("master_sync_in_progress")
    return b"master_link_status:up" in info and b"master_sync_in_progress:0" in info


def _knows(server: ValkeyServer, node_id: bytes | str) -> bool:
    text = command(server, "CLUSTER NODES")
    text = text.decode() if isinstance(text, bytes) else str(text)
    wanted = node_id.decode() if isinstance(node_id, bytes) else node_id
    return wanted in text
