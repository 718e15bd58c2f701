"""Helpers that several test modules share (test modules never import one another)."""

from __future__ import annotations

import re

import pytest

from kvoffload.cli import main
from kvoffload.policies.base import EvictionPolicy


def every_field(manager: object) -> str:
    """Every field of a manager (and of its policy) as text: what a refused call of a facade
    over it must leave as it was, down to the representation (opening times, stamps)."""
    fields = []
    for cls in type(manager).__mro__:
        for name in getattr(cls, "__slots__", ()):
            value = getattr(manager, name)
            shown = every_field(value) if isinstance(value, EvictionPolicy) else repr(value)
            fields.append(f"{name}={shown}")
    return "; ".join(fields)


def reported(problems: list[str], pattern: str) -> bool:
    """Whether one of ``problems`` is, word for word, the message ``pattern`` describes."""
    return any(re.fullmatch(pattern, problem) for problem in problems)


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``kvoffload ARGV`` in this process: the exit status, stdout and stderr."""
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err
