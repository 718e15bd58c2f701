"""The test harness's server starts whatever else holds the port it picked: with test files
running in parallel, another socket can take a free port between the pick and the bind."""

from __future__ import annotations

import socket

import pytest
import valkey

from tests.valkey_server import ValkeyServer, free_port


@pytest.mark.parametrize("held", ["port", "cluster_port"])
def test_a_server_whose_picked_port_is_taken_starts_on_another(held: str) -> None:
    server = ValkeyServer(cluster_enabled="yes", cluster_port=str(free_port()))
    ports = {"port": server.port, "cluster_port": int(server.config["cluster_port"])}
    with socket.create_server(("127.0.0.1", ports[held])), server:
        assert {"port": server.port, "cluster_port": int(server.config["cluster_port"])} != ports
        assert valkey.Valkey(host="127.0.0.1", port=server.port).ping()


def test_a_server_given_its_port_does_not_move() -> None:
    with socket.create_server(("127.0.0.1", 0)) as holder:
        port = holder.getsockname()[1]
        server = ValkeyServer(port)
        try:
            server.start()
        except RuntimeError as error:
            assert f"port {port}" in str(error) and server.port == port
        else:
            raise AssertionError("the server started on a port another socket holds")
        finally:
            server.close()
