"""``kvoffload remote ping|stats|clear`` against a real server (tests/valkey_server.py), and
``kvoffload server`` starting the bundled one."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import valkey

from kvoffload.cli_remote import SCAN_BATCH
from kvoffload.tiers import ValkeyStore
from kvoffload.tiers.values import Namespace, encode_key, frame
from tests.helpers import run_cli as run
from tests.valkey_server import ValkeyServer, free_port, server_binary

MODEL_A = {"model": "a", "block_tokens": 16}
MODEL_B = {"model": "b", "block_tokens": 16}


def client_of(server: ValkeyServer) -> valkey.Valkey:
    return valkey.Valkey.from_url(server.url)


def plain_id(description: object) -> str:
    return f"kvo1:{Namespace.of(description).fingerprint.hex()}"  # type: ignore[arg-type]


def test_ping_reaches_the_server(
    valkey_server: ValkeyServer, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(["remote", "ping", valkey_server.url], capsys)
    assert (code, err) == (0, "")
    assert re.fullmatch(rf"{valkey_server.url}: valkey \d+\.\d+\.\d+, PONG in \d+\.\d\d ms\n", out)
    code, out, _ = run(["remote", "ping", valkey_server.url, "--json"], capsys)
    report = json.loads(out)
    assert code == 0 and report["server"] == "valkey" and report["latency_ms"] > 0
    assert report["url"] == valkey_server.url and report["version"].count(".") == 2


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://127.0.0.1:{port}/0", "Connection refused"),  # nothing listens there
        ("http://127.0.0.1:{port}/0", "not a usable Valkey/Redis URL"),
    ],
)
def test_ping_says_in_one_line_why_it_cannot(
    url: str, expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    url = url.format(port=free_port())
    code, out, err = run(["remote", "ping", url, "--timeout", "1"], capsys)
    assert (code, out) == (1, "")
    assert err.startswith("kvoffload remote ping: error: ") and expected in err
    assert err.count("\n") == 1


def test_ping_names_a_database_that_does_not_exist(
    valkey_server: ValkeyServer, capsys: pytest.CaptureFixture[str]
) -> None:
    url = valkey_server.url.replace("/0", "/99")
    code, _, err = run(["remote", "ping", url], capsys)
    assert code == 1 and "DB index is out of range" in err


def test_ping_hides_the_password(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"redis://user:hunter2@127.0.0.1:{free_port()}/0"
    code, _, err = run(["remote", "ping", url, "--timeout", "1"], capsys)
    assert code == 1 and "hunter2" not in err and "user:***@" in err


def seeded(server: ValkeyServer) -> dict[str, tuple[int, int]]:
    """Two namespaces a store wrote (their descriptions with them), one of an earlier run
    (blocks under a bare fingerprint, no description), one corrupt value, a foreign key;
    the keys and value bytes of each namespace."""
    for description, count in ((MODEL_A, 5), (MODEL_B, 2)):
        with ValkeyStore(server.url, namespace=description, timeout_s=10) as store:
            assert store.put(list(range(count)), [bytes(100)] * count) == [True] * count
    earlier = Namespace.of("an earlier run")
    client = client_of(server)
    values = {i: frame(earlier, encode_key(i), memoryview(bytes(50))) for i in range(3)}
    for key, value in values.items():
        client.set(earlier.key_prefix + encode_key(key), value)
    broken = bytearray(frame(earlier, encode_key(99), memoryview(bytes(50))))
    broken[-1] ^= 1  # a flipped bit
    client.set(earlier.key_prefix + encode_key(99), bytes(broken))
    client.set("somebody else's key", "x")
    block = len(values[0]) + 50  # a store's header (key "i0"...) and 100 bytes
    return {
        plain_id(MODEL_A): (5, 5 * block),
        plain_id(MODEL_B): (2, 2 * block),
        plain_id("an earlier run"): (4, sum(map(len, values.values())) + len(broken)),
    }


def test_stats_lists_every_namespace_with_its_values_checked(
    valkey_server: ValkeyServer, capsys: pytest.CaptureFixture[str]
) -> None:
    expected = seeded(valkey_server)
    code, out, _ = run(["remote", "stats", valkey_server.url, "--json"], capsys)
    assert code == 0
    report = json.loads(out)
    assert report["other_keys"] == 1
    found = {entry["namespace"]: entry for entry in report["namespaces"]}
    assert {name: (e["keys"], e["bytes"]) for name, e in found.items()} == expected
    assert json.loads(found[plain_id(MODEL_A)]["description"]) == MODEL_A
    assert found[plain_id("an earlier run")]["description"] is None
    assert found[plain_id(MODEL_A)]["sample"] == {"checked": 5, "valid": 5}
    assert found[plain_id("an earlier run")]["sample"] == {"checked": 4, "valid": 3, "checksum": 1}
    assert {entry["format"] for entry in found.values()} == {"plain"}

    code, out, _ = run(["remote", "stats", valkey_server.url, "--sample", "1"], capsys)
    assert code == 0 and "3 namespaces, 1 other keys" in out and "(not stored)" in out
    assert plain_id(MODEL_B) in out and "1 valid" in out
    only = ["remote", "stats", valkey_server.url, "--namespace", plain_id(MODEL_B), "--json"]
    code, out, _ = run(only, capsys)
    assert [e["namespace"] for e in json.loads(out)["namespaces"]] == [plain_id(MODEL_B)]


def test_stats_takes_a_key_of_another_type_under_our_prefix_for_no_value(
    valkey_server: ValkeyServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """Anyone who can write to the server can put a list or a hash under a namespace's
    prefix: STRLEN and GET answer WRONGTYPE for it, which must not end the command."""
    expected = seeded(valkey_server)
    earlier = Namespace.of("an earlier run")
    client = client_of(valkey_server)
    client.rpush((earlier.key_prefix + b"a list").decode(), "x")
    client.hset((earlier.key_prefix + b"a hash").decode(), "field", "x")
    code, out, err = run(["remote", "stats", valkey_server.url, "--json"], capsys)
    assert (code, err) == (0, "")
    found = {entry["namespace"]: entry for entry in json.loads(out)["namespaces"]}
    entry = found[plain_id("an earlier run")]
    keys, size = expected[plain_id("an earlier run")]
    assert (entry["keys"], entry["bytes"]) == (keys + 2, size)  # counted, no bytes of value
    assert entry["sample"] == {"checked": 4, "valid": 3, "checksum": 1}  # no value to check
    argv = ["remote", "clear", valkey_server.url, "--namespace", plain_id("an earlier run")]
    code, out, _ = run([*argv, "--yes", "--json"], capsys)
    assert code == 0 and json.loads(out)["deleted"] == keys + 2


def test_stats_checks_sealed_values_as_far_as_it_can_without_the_secret(
    valkey_server: ValkeyServer, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvoffload.tiers.values import SealedFormat

    sealed = SealedFormat(Namespace.of(MODEL_A), b"s" * 32)
    client = client_of(valkey_server)
    for i in range(3):
        encoded = encode_key(i)
        client.set(sealed.server_key(encoded), sealed.frame(encoded, memoryview(bytes(64))))
    client.set(sealed.server_key(encode_key(9)), b"short")
    code, out, _ = run(["remote", "stats", valkey_server.url, "--json"], capsys)
    (entry,) = json.loads(out)["namespaces"]
    assert code == 0 and entry["namespace"] == sealed.key_prefix.decode().rstrip(":")
    assert (entry["format"], entry["keys"]) == ("sealed", 4)
    assert entry["sample"] == {"checked": 4, "sealed": 3, "malformed": 1}


def test_clear_deletes_one_namespace_in_batches_and_nothing_else(
    valkey_server: ValkeyServer, capsys: pytest.CaptureFixture[str]
) -> None:
    expected = seeded(valkey_server)
    earlier = Namespace.of("an earlier run")
    client = client_of(valkey_server)
    pipe = client.pipeline(transaction=False)
    many = 2 * SCAN_BATCH + 7
    for i in range(100, 100 + many):
        pipe.set(earlier.key_prefix + encode_key(i), b"x")
    pipe.execute()  # type: ignore[no-untyped-call]
    argv = ["remote", "clear", valkey_server.url, "--namespace", plain_id("an earlier run")]
    code, out, err = run(argv, capsys)  # no terminal to ask on, no --yes
    assert (code, out) == (1, "") and "needs --yes" in err
    code, out, _ = run([*argv, "--yes", "--json"], capsys)
    assert code == 0
    assert json.loads(out)["deleted"] == expected[plain_id("an earlier run")][0] + many
    assert client.keys(earlier.key_prefix + b"*") == []
    code, out, _ = run(["remote", "stats", valkey_server.url, "--json"], capsys)
    report = json.loads(out)
    left = {e["namespace"]: e["keys"] for e in report["namespaces"]}
    assert left == {plain_id(MODEL_A): 5, plain_id(MODEL_B): 2} and report["other_keys"] == 1
    # the model's description goes with its blocks
    bare = plain_id(MODEL_B).split(":")[1]
    code, out, _ = run(["remote", "clear", valkey_server.url, "--namespace", bare, "--yes"], capsys)
    assert code == 0 and out == f"deleted 3 keys of {plain_id(MODEL_B)} from {valkey_server.url}\n"


def test_clear_refuses_a_namespace_it_cannot_name(
    valkey_server: ValkeyServer, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["remote", "clear", valkey_server.url, "--namespace", "kvo1:*", "--yes"]
    code, _, err = run(argv, capsys)
    assert code == 1 and "is not a namespace as `kvoffload remote stats` lists it" in err
    code, _, err = run(["remote", "clear", valkey_server.url], capsys)
    assert code == 2 and "--namespace" in err


def test_server_runs_the_bundled_valkey_server_on_localhost(tmp_path: Path) -> None:
    port = free_port()
    environment = {**os.environ, "KVOFFLOAD_VALKEY_SERVER": str(server_binary())}
    command = [sys.executable, "-m", "kvoffload", "server", "--port", str(port)]
    command += ["--dir", str(tmp_path), "--maxmemory", "16MiB", "--", "--loglevel", "warning"]
    process = subprocess.Popen(
        command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        client = valkey.Valkey(host="127.0.0.1", port=port, socket_timeout=1.0)
        deadline = time.monotonic() + 15
        while True:
            try:
                client.ping()
                break
            except valkey.ConnectionError:
                assert process.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
        config = client.config_get("*")
        assert isinstance(config, dict)
        assert config["bind"] == "127.0.0.1" and config["maxmemory"] == str(16 << 20)
        assert (config["maxmemory-policy"], config["save"]) == ("allkeys-lru", "")
        assert config["dir"] == str(tmp_path.resolve()) and config["loglevel"] == "warning"
        client.close()  # type: ignore[no-untyped-call]
    finally:
        process.send_signal(signal.SIGTERM)  # the server itself: the command became it
        _, err = process.communicate(timeout=15)
    assert err.startswith(f"kvoffload server: valkey-server on 127.0.0.1:{port} ")


def test_server_refuses_a_directory_that_is_not_there(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(["server", "--dir", str(tmp_path / "nowhere")], capsys)
    assert code == 1 and err.endswith("no such directory\n")


class Terminal(io.StringIO):
    """A stdin that is a terminal, and what the user types into it."""

    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(("answer", "deleted"), [("y\n", True), ("\n", False), ("no\n", False)])
def test_clear_asks_on_a_terminal(
    answer: str,
    deleted: bool,
    valkey_server: ValkeyServer,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    expected = seeded(valkey_server)
    monkeypatch.setattr(sys, "stdin", Terminal(answer))
    namespace = plain_id(MODEL_A)
    code, out, err = run(["remote", "clear", valkey_server.url, "--namespace", namespace], capsys)
    keys = expected[namespace][0]
    question = f"delete every key of {namespace} ({keys:,} blocks) on {valkey_server.url}? [y/N]"
    assert out.startswith(question)
    left = client_of(valkey_server).keys(f"{namespace}:*")
    assert isinstance(left, list)
    if deleted:
        assert code == 0 and left == [] and f"deleted {keys + 1} keys" in out  # and its description
    else:
        assert code == 1 and len(left) == keys + 1 and "nothing deleted" in err


def test_the_admin_session_reads_no_more_than_it_can_use(valkey_server: ValkeyServer) -> None:
    """A value planted to be too long for a sample, or a description too long to show,
    ends the command with one error: it is never read into the operator's memory."""
    from kvoffload.tiers.admin import MAX_NAME_BYTES, AdminError, AdminSession

    client = client_of(valkey_server)
    client.set(b"kvo1:long", b"x" * 4096)
    client.set(b"kvo1:name", b"y" * (MAX_NAME_BYTES + 1))
    with AdminSession(valkey_server.url, timeout_s=5, max_value_bytes=1024) as session:
        session.ping()
        assert session.strlens([b"kvo1:long", b"absent"]) == [4096, 0]
        with pytest.raises(AdminError, match="4,096 bytes"):
            session.values([b"kvo1:long"])
    with AdminSession(valkey_server.url, timeout_s=5, max_value_bytes=8192) as session:
        assert session.values([b"kvo1:long", b"absent"]) == [b"x" * 4096, None]
        with pytest.raises(Exception, match="bytes"):
            session.get_text(b"kvo1:name")
    with AdminSession(valkey_server.url, timeout_s=5, max_value_bytes=8192) as session:
        cursor, keys = session.scan(0, match="kvo1:*", count=1000)
        assert cursor == 0 and sorted(keys) == [b"kvo1:long", b"kvo1:name"]
        assert session.unlink(keys) == 2 and session.dbsize() == 0
