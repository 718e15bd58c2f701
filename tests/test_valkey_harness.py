"""The test harness's server starts whatever else holds the port it picked: with test files
running in parallel, another socket (another test's server, even) can take a free port
between the pick and the bind, and a server answering there is not taken for ours."""

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


def serving_pid(port: int) -> int:
    info: dict[str, object] = valkey.Valkey(host="127.0.0.1", port=port).info("server")  # type: ignore[assignment]
    return int(str(info["process_id"]))


def test_a_server_whose_picked_port_another_server_answers_on_starts_on_another() -> None:
    """The other server answers PING on the port at once; ours fails to bind it and lives
    a moment more: that answer is not ours."""
    server = ValkeyServer()
    picked = server.port
    with ValkeyServer(picked) as other, server:
        assert server.port != picked
        assert server.process is not None and other.process is not None
        assert serving_pid(server.port) == server.process.pid
        assert serving_pid(picked) == other.process.pid


def test_a_server_given_a_port_another_server_answers_on_fails() -> None:
    with ValkeyServer() as other:
        server = ValkeyServer(other.port)
        try:
            with pytest.raises(RuntimeError, match=f"port {other.port}"):
                server.start()
        finally:
            server.close()
