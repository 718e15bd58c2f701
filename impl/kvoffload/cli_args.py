"""The kinds of values the ``kvoffload`` commands' options take: argparse types (whose
``ArgumentTypeError`` is a usage error, status 2) and the options every command shares."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from kvoffload_spec.errors import InvalidArgumentError

DECIMAL_SUFFIXES = "decimal suffixes: 4k = 4,000"


def count(unit: str, minimum: int = 1) -> Callable[[str], int]:
    """An argument type: a whole number of ``unit`` of at least ``minimum``, where ``4k``
    means 4,000 and ``1m`` 1,000,000 (:func:`kvoffload.units.parse_count`)."""
    from kvoffload.units import parse_count

    def parse(text: str) -> int:
        try:
            return parse_count(text, unit, minimum)
        except InvalidArgumentError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    parse.__name__ = f"number of {unit}"  # argparse names the type in some messages
    return parse


def byte_size(text: str) -> int:
    """An argument type: bytes, plain or with a unit (:func:`kvoffload.units.parse_bytes`)."""
    from kvoffload.units import parse_bytes

    try:
        return parse_bytes(text)
    except InvalidArgumentError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def count_list(text: str) -> list[int]:
    counts = [count("blocks")(part) for part in text.split(",") if part.strip()]
    if not counts:
        raise argparse.ArgumentTypeError("give at least one capacity, e.g. 1000,4k")
    return counts


def name_list(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise argparse.ArgumentTypeError("give at least one policy, e.g. lru,belady")
    return names


def seconds(text: str) -> float:
    from kvoffload_spec.errors import InvalidArgumentError
    from kvoffload_spec.validation import check_seconds

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    try:
        return check_seconds("the value", value)
    except InvalidArgumentError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def port(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (1 to 65535)")
    return int(text)


def add_json_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
