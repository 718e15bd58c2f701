"""What operators set once: a configuration file and ``KVOFFLOAD_<FLAG>`` environment
variables, under the command line.

Every option of every command is a key, named after its flag (``--cpu-blocks`` is
``cpu_blocks`` in the file and ``KVOFFLOAD_CPU_BLOCKS`` in the environment), read with the
flag's own parser, so a flag added to a command is configurable with no code here. The
exceptions are what is per run by nature (``--json``, ``--yes``, ``--config``, ``--help``).
Precedence: the command line, then the environment, then the file, then the defaults.

The file is TOML, named by ``--config PATH`` or ``KVOFFLOAD_CONFIG``. Its top-level keys
apply to every command that has the option; a table named after a command applies to it
only, and wins over the top level (the ``remote`` commands have none: ``remote`` is the
URL's key)::

    policy = "arc"
    remote = "redis://cache-host:6379/0"

    [simulate]
    cpu_blocks = "16k"
    block_bytes = "2MiB"

A key that no command has is refused, with the closest one suggested; so is a value the
flag would refuse, naming where it came from.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_ENV = "KVOFFLOAD_CONFIG"
ENV_PREFIX = "KVOFFLOAD_"
# Options that change what one run does or prints, never an operator's standing choice
# (a KVOFFLOAD_YES would let every ``remote clear`` delete without asking).
PER_RUN = frozenset({"help", "version", "config", "json", "yes"})
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


class ConfigError(Exception):
    """A configuration file or variable that cannot be used (exit status 2, one line)."""


@dataclass(frozen=True)
class Layered:
    """Where each option of the command that runs got its value."""

    given: frozenset[str]  # the options on the command line
    sources: Mapping[str, str]  # option -> the variable or file key that set it


def leaf_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Each command's parser by its name (``simulate``, ``remote ping``)."""
    leaves: dict[str, argparse.ArgumentParser] = {}

    def walk(node: argparse.ArgumentParser, prefix: str) -> None:
        children = [a for a in node._actions if isinstance(a, argparse._SubParsersAction)]
        if not children:
            leaves[prefix] = node
        for action in children:
            for name, child in action.choices.items():
                walk(child, f"{prefix} {name}".strip())

    walk(parser, "")
    return leaves


def configurable(leaf: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The options of one command that a file or a variable may set, by key."""
    return {
        action.dest: action
        for action in leaf._actions
        if action.dest not in PER_RUN
        and action.dest != argparse.SUPPRESS
        and not isinstance(action, argparse._SubParsersAction)
        and action.nargs != argparse.REMAINDER  # what a command passes on, as it is
    }


def layer(
    parser: argparse.ArgumentParser,
    argv: Sequence[str],
    args: argparse.Namespace,
    environ: Mapping[str, str],
) -> Layered:
    """Fill the options of ``args`` (parsed from ``argv``) not on the command line from the
    environment, then the configuration file; raise :class:`ConfigError` for a file or a
    value that cannot be used."""
    leaves = leaf_parsers(parser)
    command: str = args.command_name
    options = configurable(leaves[command])
    given = _given(leaves[command], parser, argv)
    path = args.config if getattr(args, "config", None) else environ.get(CONFIG_ENV) or None
    config = _read(Path(path), leaves) if path else {}
    section = command.split()[0]
    if section in options:
        section = ""  # no table of its own (see _read)
    sources: dict[str, str] = {}
    for key, action in options.items():
        if key in given:
            continue
        env_name = ENV_PREFIX + key.upper()
        table = config.get(section) if section else None
        if environ.get(env_name, "") != "":  # set to nothing is not set, as KVOFFLOAD_CONFIG
            raw: object = environ[env_name]
            where = env_name
        elif isinstance(table, dict) and key in table:
            raw, where = table[key], f"{path}: [{section}] {key}"
        elif key in config:
            raw, where = config[key], f"{path}: {key}"
        else:
            continue
        setattr(args, key, _value(action, raw, where))
        sources[key] = where
    return Layered(frozenset(given), sources)


def _given(
    leaf: argparse.ArgumentParser, parser: argparse.ArgumentParser, argv: Sequence[str]
) -> set[str]:
    """The options on the command line: ``argv`` parsed again with no defaults at all."""
    saved = [(action, action.default) for action in leaf._actions]
    try:
        for action, _ in saved:
            action.default = argparse.SUPPRESS
        bare = parser.parse_args(argv)
    finally:
        for action, default in saved:
            action.default = default
    return set(vars(bare))


def _read(path: Path, leaves: Mapping[str, argparse.ArgumentParser]) -> dict[str, Any]:
    toml = _toml()
    try:
        with path.open("rb") as file:
            config: dict[str, Any] = toml.load(file)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory") from None
    except OSError as error:
        raise ConfigError(f"cannot read config file {path}: {error.strerror}") from None
    except toml.TOMLDecodeError as error:
        raise ConfigError(f"config file {path} is not valid TOML: {error}") from None
    config = {key.replace("-", "_"): value for key, value in config.items()}
    sections: dict[str, set[str]] = {}
    for command, leaf in leaves.items():
        sections.setdefault(command.split()[0], set()).update(configurable(leaf))
    every = set().union(*sections.values())
    # `remote` is an option's key (the URL) as well as a command: the key wins, and the
    # remote commands take their options from the top level
    sections = {name: keys for name, keys in sections.items() if name not in every}
    for key, value in config.items():
        if key in sections and isinstance(value, dict):
            config[key] = {name.replace("-", "_"): item for name, item in value.items()}
            for name in config[key]:
                if name not in sections[key]:
                    raise ConfigError(
                        f"{path}: [{key}] has no option {name!r}{_suggest(name, sections[key])}"
                    )
        elif key in sections:
            raise ConfigError(f"{path}: {key} must be a table ([{key}]) of its options")
        elif key in every and isinstance(value, dict):
            raise ConfigError(f"{path}: [{key}] is a table, but {key} is an option's key")
        elif key not in every:
            known = every | set(sections)
            raise ConfigError(f"{path}: unknown key {key!r}{_suggest(key, known)}")
    return config


def _toml() -> Any:
    import importlib

    for name in ("tomllib", "tomli"):  # Python 3.10 has no tomllib: the same parser as tomli
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    # tomli is a dependency on 3.10: only an install that left it out gets here
    raise ConfigError("reading a config file on Python 3.10 needs tomli: pip install tomli")


def _suggest(name: str, known: set[str]) -> str:
    close = difflib.get_close_matches(name, sorted(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(sorted(known))})"


def _value(action: argparse.Action, raw: object, where: str) -> object:
    """``raw`` read as the command line would read the option's text."""
    if action.nargs == 0:  # a switch: --remote-cluster and the like
        if isinstance(raw, bool):
            return action.const if raw else action.default
        if isinstance(raw, str) and raw.strip().lower() in _TRUE | _FALSE:
            return action.const if raw.strip().lower() in _TRUE else action.default
        raise ConfigError(f"{where}: {raw!r} is not true or false")
    if isinstance(raw, bool) or (isinstance(raw, (dict, list)) and not _flat(raw)):
        raise ConfigError(f"{where}: {raw!r} is not a value for {flag_of(action)}")
    text = ",".join(map(str, raw)) if isinstance(raw, list) else str(raw)
    try:
        value = action.type(text) if callable(action.type) else text
    except (argparse.ArgumentTypeError, ValueError, TypeError) as error:
        raise ConfigError(f"{where}: {error}") from None
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise ConfigError(f"{where}: {raw!r} is not one of {choices}")
    return value


def _flat(raw: object) -> bool:
    return isinstance(raw, list) and all(isinstance(item, (str, int)) for item in raw)


def flag_of(action: argparse.Action) -> str:
    """How the command line spells ``action`` (its long flag; a positional, its metavar)."""
    if action.option_strings:
        return action.option_strings[-1]
    return str(action.metavar or action.dest)


def keys_of(parser: argparse.ArgumentParser) -> Iterator[tuple[str, str, str]]:
    """(command, key, flag) for every configurable option."""
    for command, leaf in leaf_parsers(parser).items():
        for key, action in configurable(leaf).items():
            yield command, key, flag_of(action)
