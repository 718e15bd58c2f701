"""Sizes as people write them: ``4k`` blocks, ``2MiB`` or ``16GB`` of bytes.

Counts (blocks, requests) take decimal suffixes, as in the reference tables: ``4k`` is
4,000 and ``1m`` 1,000,000. Byte sizes take a unit, binary (``KiB``, ``MiB``, ``GiB``,
``TiB``: powers of 1,024) or decimal (``KB``, ``MB``, ``GB``, ``TB``: powers of 1,000), or
none (a plain number of bytes). A bare ``4k`` is refused as a byte size: it reads as 4,000
to some and 4,096 to others, and the error says what is accepted. Units ignore case
(``2mib``) and a space before them (``16 GiB``); a fraction is fine when the result is a
whole number of bytes (``1.5GiB``).

The command line, the configuration file and the engines' ``cpu_bytes_to_use`` all read
sizes here, so that one spelling works everywhere.
"""

from __future__ import annotations

import re
from fractions import Fraction

from kvoffload_spec.errors import InvalidArgumentError

COUNT_SUFFIXES = {"": 1, "k": 1000, "m": 1_000_000}
BYTE_UNITS = {
    "": 1,
    "b": 1,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
BYTES_ACCEPTED = (
    "a whole number of bytes (4096) or a number with a unit: KiB, MiB, GiB, TiB "
    "(1 KiB = 1,024 bytes) or KB, MB, GB, TB (1 KB = 1,000 bytes), e.g. 64KiB, 2MiB, 16GB"
)
_SIZE = re.compile(r"(?P<number>\d+(?:\.\d+)?)\s*(?P<unit>[a-z]*)")


def parse_count(text: str, unit: str = "blocks", minimum: int = 1) -> int:
    """``text`` as a whole number of ``unit`` (``4k`` = 4,000), at least ``minimum``;
    ``InvalidArgumentError`` saying what is wrong otherwise."""
    cleaned = text.strip().lower().replace("_", "")
    suffix = cleaned[-1:] if cleaned[-1:] in COUNT_SUFFIXES else ""
    digits = cleaned[: len(cleaned) - len(suffix)]
    negative = digits.startswith("-") and digits[1:].isdigit()
    if not digits.isdigit() and not negative:
        raise InvalidArgumentError(
            f"{text!r} is not a whole number of {unit} (e.g. 1000 or 4k; 4k = 4,000)"
        )
    value = int(digits) * COUNT_SUFFIXES[suffix]
    if value < minimum:
        raise InvalidArgumentError(f"{text!r}: must be at least {minimum}")
    return value


def parse_bytes(text: str, minimum: int = 1) -> int:
    """``text`` as a number of bytes (``2MiB``, ``16GB``, ``4096``), at least ``minimum``;
    ``InvalidArgumentError`` naming the accepted forms otherwise."""
    cleaned = text.strip().lower().replace("_", "")
    match = _SIZE.fullmatch(cleaned)
    factor = BYTE_UNITS.get(match.group("unit")) if match else None
    if match is None or factor is None:
        raise InvalidArgumentError(f"{text!r} is not a size in bytes: give {BYTES_ACCEPTED}")
    value = Fraction(match.group("number")) * factor
    if value.denominator != 1:
        raise InvalidArgumentError(f"{text!r} is not a whole number of bytes")
    if value < minimum:
        raise InvalidArgumentError(f"{text!r}: must be at least {minimum} bytes")
    return int(value)


def byte_size(value: object, what: str, minimum: int = 1) -> int:
    """A size in bytes given as an int or a str (:func:`parse_bytes`), as configuration
    files and engine configs give them; the error names ``what``."""
    if isinstance(value, float) and value.is_integer():  # JSON configs write 1e10
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        if value < minimum:
            raise InvalidArgumentError(f"{what} must be at least {minimum} bytes, got {value}")
        return value
    if isinstance(value, str):
        try:
            return parse_bytes(value, minimum)
        except InvalidArgumentError as error:
            raise InvalidArgumentError(f"{what}: {error}") from None
    raise InvalidArgumentError(
        f"{what} must be a number of bytes (an int, or a str such as '16GiB'), "
        f"got {type(value).__name__}"
    )
