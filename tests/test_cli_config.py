"""The configuration file and ``KVOFFLOAD_<OPTION>`` variables (kvoffload.cli_config):
the command line wins over the environment, which wins over the file, which wins over the
defaults; a key no command has, or a value its option refuses, is one line and status 2."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from kvoffload.cli import build_parser
from kvoffload.cli_config import ConfigError, keys_of, layer, leaf_parsers
from tests.helpers import run_cli as run
from tests.valkey_server import ValkeyServer


def parsed(argv: list[str], environ: dict[str, str]) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    layer(parser, argv, args, environ)
    return args


def config_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "kvoffload.toml"
    path.write_text(text)
    return str(path)


def test_the_command_line_wins_over_the_environment_over_the_file(tmp_path: Path) -> None:
    path = config_file(
        tmp_path,
        'cpu_blocks = "2k"\ngpu_blocks = 700\npolicy = "arc"\nblock_bytes = "8KiB"\n'
        '[simulate]\ngpu_blocks = "900"\n',
    )
    environ = {"KVOFFLOAD_CONFIG": path, "KVOFFLOAD_POLICY": "duel", "KVOFFLOAD_CPU_BLOCKS": "3k"}
    args = parsed(["simulate", "--cpu-blocks", "4000"], environ)
    assert args.cpu_blocks == 4000  # the command line
    assert args.policy == "duel"  # the environment
    assert args.block_bytes == 8192  # the file's top level
    assert args.gpu_blocks == 900  # the file's [simulate] table, over its top level
    assert args.requests is None and args.instances == 1  # the defaults
    defaults = parsed(["simulate"], {})
    assert (defaults.cpu_blocks, defaults.policy) != (4000, "duel")
    # the top level applies to every command with the option, and --config wins over the variable
    (tmp_path / "other").mkdir()
    other = config_file(tmp_path / "other", 'policy = "lru"\n')
    assert parsed(["verify", "--config", other], environ).policy == "duel"
    assert parsed(["verify", "--config", other], {}).policy == "lru"
    assert parsed(["sweep"], {"KVOFFLOAD_CONFIG": path}).gpu_blocks == 700


def test_a_list_and_a_switch_are_written_as_toml_says(tmp_path: Path) -> None:
    path = config_file(tmp_path, 'capacities = [1000, "4k"]\npolicies = ["lru", "belady"]\n')
    args = parsed(["sweep", "--config", path], {})
    assert (args.capacities, args.policies) == ([1000, 4000], ["lru", "belady"])


def test_an_option_added_to_a_command_is_configurable_with_no_code() -> None:
    """As ``--remote-secret-file`` was: a flag is a key and a variable by its name alone."""
    parser = build_parser()
    simulate = leaf_parsers(parser)["simulate"]
    simulate.add_argument("--example-key-file", default=None, type=Path)
    simulate.add_argument("--example-switch", action="store_true")
    args = parser.parse_args(["simulate"])
    environ = {"KVOFFLOAD_EXAMPLE_KEY_FILE": "/etc/key", "KVOFFLOAD_EXAMPLE_SWITCH": "yes"}
    layered = layer(parser, ["simulate"], args, environ)
    assert args.example_key_file == Path("/etc/key") and args.example_switch is True
    assert layered.sources["example_key_file"] == "KVOFFLOAD_EXAMPLE_KEY_FILE"
    assert ("simulate", "example_key_file", "--example-key-file") in set(keys_of(parser))


def test_a_variable_set_to_nothing_is_not_set(tmp_path: Path) -> None:
    path = config_file(tmp_path, 'policy = "arc"\n')
    assert parsed(["verify", "--config", path], {"KVOFFLOAD_POLICY": ""}).policy == "arc"
    assert parsed(["simulate"], {"KVOFFLOAD_REMOTE": ""}).remote is None


def test_what_is_per_run_is_not_configurable(tmp_path: Path) -> None:
    args = parsed(["sweep"], {"KVOFFLOAD_JSON": "1", "KVOFFLOAD_YES": "1"})
    assert args.json is False
    with pytest.raises(ConfigError, match="unknown key 'json'"):
        parsed(["sweep", "--config", config_file(tmp_path, "json = true\n")], {})
    assert not {key for _, key, _ in keys_of(build_parser())} & {"json", "yes", "config", "help"}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("cpu_block = 1\n", "unknown key 'cpu_block' (did you mean 'cpu_blocks'?)"),
        ("[verify]\ncpu_blocks = 1\n", "[verify] has no option 'cpu_blocks'"),
        ("simulate = 3\n", "simulate must be a table ([simulate]) of its options"),
        ('block_bytes = "4k"\n', "block_bytes: '4k' is not a size in bytes: give"),
        ('remote_mode = "sometimes"\n', "remote_mode: 'sometimes' is not one of write-back"),
        ("cpu_blocks = true\n", "cpu_blocks: True is not a value for --cpu-blocks"),
        ("cpu_blocks = [\n", "is not valid TOML"),
    ],
)
def test_a_file_that_cannot_be_used_is_one_line_and_status_2(
    text: str, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = config_file(tmp_path, text)
    code, out, err = run(["simulate", "--config", path, "--trace", "nosuchtrace"], capsys)
    assert (code, out) == (2, "")
    assert err.startswith("kvoffload simulate: error: ") and expected in err, err
    assert err.count("\n") == 1 and path in err


def test_a_variable_that_cannot_be_used_names_itself(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVOFFLOAD_BLOCK_BYTES", "4k")
    code, _, err = run(["simulate"], capsys)
    assert code == 2 and err.startswith(
        "kvoffload simulate: error: KVOFFLOAD_BLOCK_BYTES: '4k' is not a size in bytes"
    )
    monkeypatch.setenv("KVOFFLOAD_CONFIG", "/nonexistent/kvoffload.toml")
    monkeypatch.delenv("KVOFFLOAD_BLOCK_BYTES")
    code, _, err = run(["verify"], capsys)
    assert (code, err) == (
        2,
        "kvoffload verify: error: config file not found: /nonexistent/kvoffload.toml\n",
    )


def test_a_file_is_refused_where_there_is_no_toml_parser(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python 3.10 without tomli: said, not a traceback."""
    monkeypatch.setitem(sys.modules, "tomllib", None)
    monkeypatch.setitem(sys.modules, "tomli", None)
    with pytest.raises(ConfigError, match="needs tomli: pip install tomli"):
        parsed(["sweep", "--config", config_file(tmp_path, "")], {})


def test_a_remote_mode_waits_for_a_remote_set_anywhere(capsys: pytest.CaptureFixture[str]) -> None:
    environ = {"KVOFFLOAD_REMOTE_MODE": "write-through"}
    assert parsed(["simulate"], environ).remote_mode == "write-through"  # no error: it waits
    args = parsed(["simulate", "--remote-mode", "write-through"], {"KVOFFLOAD_REMOTE": "x"})
    assert (args.remote, args.remote_mode) == ("x", "write-through")


def test_the_remote_url_is_a_top_level_key_for_every_command(tmp_path: Path) -> None:
    path = config_file(tmp_path, 'remote = "redis://cache-host:6379/0"\ntimeout = 5\n')
    assert parsed(["remote", "stats", "--config", path], {}).remote == "redis://cache-host:6379/0"
    assert parsed(["remote", "ping", "--config", path], {}).timeout == 5.0
    assert parsed(["simulate", "--config", path], {}).remote == "redis://cache-host:6379/0"
    with pytest.raises(ConfigError, match=r"\[remote\] is a table, but remote is an option's key"):
        parsed(["verify", "--config", config_file(tmp_path, "[remote]\ntimeout = 1\n")], {})


def test_the_remote_commands_take_the_configured_url(
    valkey_server: ValkeyServer,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = run(["remote", "ping"], capsys)
    assert code == 1 and "give the server's URL" in err
    monkeypatch.setenv("KVOFFLOAD_REMOTE", valkey_server.url)
    code, out, _ = run(["remote", "ping", "--json"], capsys)
    assert code == 0 and json.loads(out)["url"] == valkey_server.url


def test_a_sweep_runs_with_its_sizes_from_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = config_file(tmp_path, 'trace = "synthetic"\n[sweep]\ncapacities = "100,200"\n')
    code, out, _ = run(["sweep", "--config", path, "--policies", "lru", "--json"], capsys)
    report = json.loads(out)
    assert code == 0 and report["trace"] == "synthetic"
    assert [r["capacity"] for r in report["results"]] == [100, 200]
