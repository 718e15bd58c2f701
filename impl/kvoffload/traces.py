"""Request traces: the key streams a cache is replayed against.

A trace file holds one JSON object per line, one request per line, whose ``hash_ids`` list
is the request's prefix-chained block keys (the Mooncake format; other fields are ignored).
Two requests that share their first k ids share their first k blocks of prompt.

>>> trace = bundled_trace("synthetic")
>>> trace.num_requests, trace.num_refs, trace.num_distinct
(3993, 121877, 43924)
>>> round(trace.ideal_hit_ratio, 4)
0.6396
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from importlib import resources
from pathlib import Path

from kvoffload_spec.errors import InvalidArgumentError

BlockId = int | str
"""A block key as a trace spells it: a JSON integer (Mooncake) or string."""

Request = tuple[BlockId, ...]

BUNDLED_TRACES = ("conversation", "synthetic")
DEFAULT_TRACE = "conversation"


class TraceError(InvalidArgumentError):
    """A trace file is missing, unreadable or malformed."""


@dataclass(frozen=True)
class Trace:
    """A named sequence of requests, each the tuple of its block ids."""

    name: str
    requests: tuple[Request, ...]

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @cached_property
    def num_refs(self) -> int:
        """Block references: the denominator of every hit ratio."""
        return sum(len(request) for request in self.requests)

    @cached_property
    def num_distinct(self) -> int:
        return len({key for request in self.requests for key in request})

    @property
    def longest_request(self) -> int:
        return max((len(request) for request in self.requests), default=0)

    @property
    def ideal_hit_ratio(self) -> float:
        """The hit ratio of an infinite cache: every reference but the first of each id.

        With prefix-chained ids a repeated id implies its whole prefix was seen before, so
        this is also the infinite cache's prefix hit ratio.
        """
        return 1.0 - self.num_distinct / self.num_refs if self.num_refs else 0.0


def load_trace(path: str | os.PathLike[str], name: str | None = None) -> Trace:
    """Read a JSON-lines trace file; raise :class:`TraceError` saying what is wrong."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TraceError(f"trace file not found: {path}") from None
    except IsADirectoryError:
        raise TraceError(f"trace path is a directory, not a file: {path}") from None
    except UnicodeDecodeError:
        raise TraceError(f"{path}: not a text file (expected JSON lines)") from None
    except OSError as error:
        raise TraceError(f"cannot read trace file {path}: {error.strerror}") from None
    return parse_trace(text.splitlines(), name or path.stem, source=str(path))


def parse_trace(lines: Sequence[str], name: str, source: str = "<trace>") -> Trace:
    """Parse JSON lines (blank lines are skipped); ``source`` names them in errors."""
    requests: list[Request] = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            requests.append(_parse_request(line, f"{source}:{number}"))
    if not requests:
        raise TraceError(f"{source}: no requests (expected one JSON object per line)")
    return Trace(name, tuple(requests))


def _parse_request(line: str, where: str) -> Request:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise TraceError(f"{where}: not valid JSON ({error.msg})") from None
    hash_ids = record.get("hash_ids") if isinstance(record, dict) else None
    if not isinstance(hash_ids, list):
        raise TraceError(f"{where}: expected an object with a 'hash_ids' list")
    for index, key in enumerate(hash_ids):
        # bool is an int to Python, but true/false in a trace is a mistake, not a hash
        if isinstance(key, bool) or not isinstance(key, (int, str)):
            raise TraceError(
                f"{where}: hash_ids[{index}] is {json.dumps(key)}; "
                "block ids must be integers or strings"
            )
    return tuple(hash_ids)


def bundled_trace(name: str = DEFAULT_TRACE) -> Trace:
    """One of the Mooncake traces shipped with the package (see ``kvoffload/data/NOTICE``)."""
    if name not in BUNDLED_TRACES:
        raise TraceError(f"no bundled trace {name!r}: choose one of {', '.join(BUNDLED_TRACES)}")
    data = resources.files("kvoffload") / "data" / f"{name}_trace.jsonl"
    return parse_trace(data.read_text(encoding="utf-8").splitlines(), name, source=name)


def resolve_trace(spec: str | None) -> Trace:
    """A trace file path, or the name of a bundled trace; None means the default trace.

    An existing file wins over a bundled name, so a file called ``synthetic`` is still read.
    """
    if spec is None:
        return bundled_trace()
    if spec in BUNDLED_TRACES and not Path(spec).exists():
        return bundled_trace(spec)
    return load_trace(spec)
