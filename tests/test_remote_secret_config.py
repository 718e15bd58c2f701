"""Where a tenant's secret comes from, end to end on a real server: ``ValkeyStore(secret=)``,
``$KVOFFLOAD_REMOTE_SECRET``, and ``kvoffload simulate --remote-secret-file PATH``.

The rule everywhere: the secret given (an argument, a file named by a flag or a config
entry) wins over the environment; without either, no secret (the plain format). Which one
was used is read off the server: every key a store writes starts with its format's prefix,
``kvo2:<owner id of that secret>:`` or ``kvo1:...``. The secret is never printed: not in a
title, the JSON, a warning or an error (each test's output is searched for it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import valkey

from kvoffload.tiers import ValkeyStore
from kvoffload.tiers.values import Namespace, value_format
from kvoffload_spec.errors import InvalidArgumentError
from tests.helpers import run_cli
from tests.remote_support import LAYOUT
from tests.valkey_server import ValkeyServer

ENV = "KVOFFLOAD_REMOTE_SECRET"
FILE_SECRET = "the secret in the file, 32 bytes"
ENV_SECRET = "the secret in the environment..."
# A few requests on small blocks: seconds, a real server behind two engines.
SIMULATE = ["simulate", "--trace", "conversation", "--requests", "200", "--gpu-blocks", "256",
            "--cpu-blocks", "32", "--block-bytes", "1KiB", "--instances", "2"]  # fmt: skip


def prefix(secret: str | None) -> bytes:
    return value_format(Namespace.of(LAYOUT), secret).key_prefix


def server_keys(server: ValkeyServer) -> list[bytes]:
    return list(valkey.Valkey.from_url(server.url).scan_iter(count=10_000))


def secret_file(tmp_path: Path, text: str, mode: int = 0o600, name: str = "secret") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    path.chmod(mode)
    return path


def assert_never_shown(*outputs: str) -> None:
    for output in outputs:
        for secret in (FILE_SECRET, ENV_SECRET):
            assert secret not in output and secret[:16] not in output, output


# -- the store ------------------------------------------------------------------------------


def test_the_argument_wins_over_the_environment_and_the_environment_over_nothing(
    valkey_server: ValkeyServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    def written_by(store: ValkeyStore) -> bytes:
        assert store.put(["k"], [b"block"]) == [True]
        (name,) = [key for key in server_keys(valkey_server) if b"#" not in key]
        valkey.Valkey.from_url(valkey_server.url).flushall()
        return name

    monkeypatch.delenv(ENV, raising=False)
    plain = ValkeyStore(valkey_server.url, namespace=LAYOUT)
    assert not plain.authenticated and written_by(plain).startswith(prefix(None))
    monkeypatch.setenv(ENV, ENV_SECRET)
    from_env = ValkeyStore(valkey_server.url, namespace=LAYOUT)
    assert from_env.authenticated and written_by(from_env).startswith(prefix(ENV_SECRET))
    given = ValkeyStore(valkey_server.url, namespace=LAYOUT, secret=FILE_SECRET)
    assert written_by(given).startswith(prefix(FILE_SECRET))
    # Engines of one tenant read each other's values whichever way each got the secret.
    assert from_env.put(["shared"], [b"bytes"]) == [True]
    monkeypatch.delenv(ENV)
    same = ValkeyStore(valkey_server.url, namespace=LAYOUT, secret=ENV_SECRET + "\n")
    assert [v and v.tobytes() for v in same.get(["shared"])] == [b"bytes"]
    for store in (plain, from_env, given, same):
        assert_never_shown(repr(store), store.url, str(store.stats()))


def test_a_bad_secret_is_refused_at_construction_naming_its_source_not_its_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    short = "too short"
    monkeypatch.setenv(ENV, short)
    with pytest.raises(InvalidArgumentError, match=ENV) as caught:
        ValkeyStore("redis://127.0.0.1:1/0", namespace=LAYOUT)
    assert short not in str(caught.value)
    monkeypatch.setenv(ENV, "")
    with pytest.raises(InvalidArgumentError, match=ENV):
        ValkeyStore("redis://127.0.0.1:1/0", namespace=LAYOUT)


# -- kvoffload simulate ----------------------------------------------------------------------


def simulate(
    server: ValkeyServer, capsys: pytest.CaptureFixture[str], *more: str
) -> tuple[int, str, str]:
    return run_cli([*SIMULATE, "--remote", server.url, *more], capsys)


def test_simulate_seals_with_the_secret_file_and_says_so(
    valkey_server: ValkeyServer,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.setenv(ENV, ENV_SECRET)  # the flag wins over it
    path = secret_file(tmp_path, FILE_SECRET + "\n")  # the final newline is not the secret
    code, out, err = simulate(valkey_server, capsys, "--remote-secret-file", str(path), "--json")
    assert (code, err) == (0, "")
    report = json.loads(out)
    assert report["remote_sealed"] is True
    assert report["total"]["remote"]["blocks_written"] > 0
    assert report["total"]["remote"]["hits"] > 0  # read back, through the seal
    names = server_keys(valkey_server)
    owner = value_format(Namespace.of("any"), FILE_SECRET).key_prefix  # one per secret
    assert names and all(name.startswith(owner) for name in names)
    code, out, err = simulate(valkey_server, capsys, "--remote-secret-file", str(path))
    assert code == 0 and "values sealed with the tenant secret" in " ".join(out.split())
    assert_never_shown(out, err)


def test_simulate_takes_the_environments_secret_without_a_file(
    valkey_server: ValkeyServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV, ENV_SECRET)
    code, out, err = simulate(valkey_server, capsys, "--json")
    assert (code, err) == (0, "") and json.loads(out)["remote_sealed"] is True
    owner = value_format(Namespace.of("any"), ENV_SECRET).key_prefix
    assert all(name.startswith(owner) for name in server_keys(valkey_server))
    monkeypatch.delenv(ENV)
    valkey.Valkey.from_url(valkey_server.url).flushall()
    code, out, err = simulate(valkey_server, capsys, "--json")
    assert (code, err) == (0, "") and json.loads(out)["remote_sealed"] is False
    assert all(name.startswith(b"kvo1:") for name in server_keys(valkey_server))
    assert_never_shown(out, err)


def test_simulate_warns_of_a_secret_file_others_can_read(
    valkey_server: ValkeyServer,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.delenv(ENV, raising=False)
    path = secret_file(tmp_path, FILE_SECRET, mode=0o644)
    code, out, err = simulate(valkey_server, capsys, "--remote-secret-file", str(path), "--json")
    assert code == 0 and json.loads(out)["remote_sealed"] is True
    assert err.startswith("kvoffload simulate: warning: the secret file") and "chmod 600" in err
    assert_never_shown(out, err)


@pytest.mark.parametrize(
    "problem", ["too short", "missing", "empty", "without --remote", "a directory"]
)
def test_simulate_refuses_a_bad_secret_file_before_it_runs(
    valkey_server: ValkeyServer,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    problem: str,
) -> None:
    monkeypatch.setenv(ENV, ENV_SECRET)  # never a fallback for a file that does not do
    path = {
        "too short": lambda: secret_file(tmp_path, FILE_SECRET[:15]),
        "missing": lambda: tmp_path / "no such file",
        "empty": lambda: secret_file(tmp_path, "\n"),
        "without --remote": lambda: secret_file(tmp_path, FILE_SECRET),
        "a directory": lambda: tmp_path,
    }[problem]()
    if problem == "without --remote":
        code, out, err = run_cli([*SIMULATE, "--remote-secret-file", str(path)], capsys)
        assert "does nothing without --remote" in err
    else:
        code, out, err = simulate(valkey_server, capsys, "--remote-secret-file", str(path))
        assert str(path) in err
    assert code != 0 and out == ""
    assert server_keys(valkey_server) == []  # nothing ran
    assert FILE_SECRET[:15] not in err
    assert_never_shown(out, err)
    assert os.environ[ENV] == ENV_SECRET
