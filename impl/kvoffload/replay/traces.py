"""Request traces: the key streams a cache is replayed against.

A trace file holds one JSON object per line, one request per line, whose ``hash_ids`` list
is the request's prefix-chained block keys (the Mooncake format; other fields are ignored).
Two requests that share their first k ids share their first k blocks of prompt, so an id
names a whole prefix and cannot appear twice in one request: a trace that repeats one is
refused, with its line. A file whose name ends in ``.gz`` is read through gzip.

>>> trace = bundled_trace("synthetic")
>>> trace.num_requests, trace.num_refs, trace.num_distinct
(3993, 121877, 43924)
>>> round(trace.ideal_hit_ratio, 4)
0.6396

Logs of token ids become a trace with ``trace_from_tokens``: each full block of
``block_size`` tokens is named by a hash of its tokens and of the block before it, as an
engine's prefix cache names blocks:

>>> prompts = [[7, 8, 9, 10, 11], [7, 8, 9, 10, 99, 98], [1, 2]]
>>> logged = trace_from_tokens(prompts, block_size=2, name="log")
>>> [len(request) for request in logged.requests]  # full blocks only
[2, 3, 1]
>>> logged.requests[0][:2] == logged.requests[1][:2]  # a shared prefix, shared ids
True
>>> logged.requests[0][1] == block_hashes([9, 10], 2)[0]  # the same tokens elsewhere
False
"""

from __future__ import annotations

import difflib
import gzip
import hashlib
import json
import os
import struct
import zlib
from collections.abc import Iterable, Sequence
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

    def __post_init__(self) -> None:
        for number, request in enumerate(self.requests):
            repeat = _repeat_in(request)
            if repeat is not None:
                raise TraceError(f"trace {self.name!r}, requests[{number}]: {repeat}")

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
    """Read a JSON-lines trace file, gzipped if its name ends in ``.gz``; raise
    :class:`TraceError` saying what is wrong. The trace is named after the file, without
    ``.jsonl`` or ``.jsonl.gz``.
    """
    path = Path(path)
    zipped = path.suffix.lower() == ".gz"
    try:
        if zipped:
            with gzip.open(path, "rt", encoding="utf-8") as unzipped:
                text = unzipped.read()
        else:
            text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TraceError(f"trace file not found: {path}") from None
    except IsADirectoryError:
        raise TraceError(f"trace path is a directory, not a file: {path}") from None
    except UnicodeDecodeError:
        raise TraceError(f"{path}: not a text file (expected JSON lines)") from None
    except (gzip.BadGzipFile, EOFError, zlib.error):
        raise TraceError(f"{path}: not a complete gzip file (the name ends in .gz)") from None
    except OSError as error:
        raise TraceError(f"cannot read trace file {path}: {error.strerror}") from None
    stem = Path(path.stem).stem if zipped else path.stem
    return parse_trace(text.splitlines(), name or stem, source=str(path))


def save_trace(trace: Trace, path: str | os.PathLike[str]) -> None:
    """Write ``trace`` as JSON lines that ``load_trace`` and ``--trace`` read, gzipped if
    the name ends in ``.gz``."""
    path = Path(path)
    lines = "".join(json.dumps({"hash_ids": list(request)}) + "\n" for request in trace.requests)
    try:
        if path.suffix.lower() == ".gz":
            with gzip.open(path, "wt", encoding="utf-8") as zipped:
                zipped.write(lines)
        else:
            path.write_text(lines, encoding="utf-8")
    except OSError as error:
        raise TraceError(f"cannot write trace file {path}: {error.strerror}") from None


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
    request = tuple(hash_ids)
    repeat = _repeat_in(request)
    if repeat is not None:
        raise TraceError(f"{where}: {repeat}")
    return request


def _repeat_in(request: Request) -> str | None:
    """What is wrong with a request that names a block twice, or None.

    A prefix-chained id names its whole prefix, so it cannot come back later in the same
    request; a repeat would count as a hit of an infinite cache but never of a real one.
    """
    first: dict[BlockId, int] = {}
    for index, key in enumerate(request):
        earlier = first.setdefault(key, index)
        if earlier != index:
            return (
                f"hash_ids[{index}] repeats hash_ids[{earlier}] ({json.dumps(key)}); a "
                "prefix-chained block id cannot appear twice in one request"
            )
    return None


# -- traces from token ids -------------------------------------------------------------------

_ROOT_HASH = bytes(8)  # what the first block of every request is chained to


def block_hashes(token_ids: Iterable[int], block_size: int) -> list[int]:
    """The prefix-chained hash of each full block of ``block_size`` tokens in
    ``token_ids``; a last, partial block has none (an engine caches full blocks only).

    Block i's hash is a 64-bit BLAKE2b of block i-1's hash and block i's tokens, so two
    sequences share their first k hashes exactly when they share their first k blocks.
    The values are the same on every machine and run (no ``hash()`` randomization), and
    below 2**63, so any JSON reader takes them. They are not an engine's own hashes (vLLM
    and SGLang use other functions); a trace needs them consistent, not identical.

    >>> block_hashes([1, 2, 3, 4, 5], 2) == block_hashes([1, 2, 3, 4], 2)
    True
    >>> len(block_hashes(range(1000), 16))
    62
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise InvalidArgumentError(f"block_size must be a whole number above 0, got {block_size!r}")
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Iterable):
        raise InvalidArgumentError(
            f"token_ids must be a sequence of integers, got {type(token_ids).__name__}"
        )
    tokens = list(token_ids)  # also a numpy array or a tensor, element by element
    block = struct.Struct(f"<{block_size}q")  # 64-bit little-endian: the same everywhere
    hashes: list[int] = []
    parent = _ROOT_HASH
    for start in range(0, len(tokens) - block_size + 1, block_size):
        chunk = tokens[start : start + block_size]
        try:
            if any(isinstance(token, bool) for token in chunk):
                raise TypeError("a bool is not a token id")
            packed = block.pack(*chunk)
        except (struct.error, TypeError):
            raise _bad_token(chunk, start) from None
        parent = hashlib.blake2b(parent + packed, digest_size=8).digest()
        hashes.append(int.from_bytes(parent, "little") >> 1)
    return hashes


def _bad_token(chunk: Sequence[object], start: int) -> InvalidArgumentError:
    """The error for the first token of ``chunk`` that is not a 64-bit integer."""
    for offset, token in enumerate(chunk):
        if isinstance(token, bool) or not hasattr(token, "__index__"):
            return InvalidArgumentError(
                f"token_ids[{start + offset}] is {token!r}; token ids are integers"
            )
        if not -(2**63) <= token.__index__() < 2**63:
            return InvalidArgumentError(
                f"token_ids[{start + offset}] is {token!r}, outside the 64-bit signed range"
            )
    return InvalidArgumentError(f"token_ids[{start}:{start + len(chunk)}] are not token ids")


def trace_from_tokens(
    requests: Iterable[Sequence[int]], block_size: int, name: str = "tokens"
) -> Trace:
    """A trace of one request per token-id sequence, each the ``block_hashes`` of its
    tokens: replay your own logs with ``sweep``, or ``save_trace`` them for ``--trace``.
    """
    return Trace(name, tuple(tuple(block_hashes(tokens, block_size)) for tokens in requests))


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
    path = Path(spec)
    if spec in BUNDLED_TRACES and not path.exists():
        return bundled_trace(spec)
    if not path.exists() and path.name == spec and not path.suffix:
        # a bare word that is no file: most likely a bundled trace's name, mistyped
        close = difflib.get_close_matches(spec, BUNDLED_TRACES, n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise TraceError(
            f"no trace file or bundled trace {spec!r} ({hint}bundled traces: "
            f"{', '.join(BUNDLED_TRACES)})"
        )
    return load_trace(spec)
