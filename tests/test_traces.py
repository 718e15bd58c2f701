"""Trace loading: the bundled Mooncake traces, and every way a trace file can be wrong."""

from __future__ import annotations

import doctest
from pathlib import Path

import pytest

import kvoffload.traces
from kvoffload.traces import (
    BUNDLED_TRACES,
    TraceError,
    bundled_trace,
    load_trace,
    parse_trace,
    resolve_trace,
)
from kvoffload_spec.errors import InvalidArgumentError


def test_module_examples() -> None:
    assert doctest.testmod(kvoffload.traces).failed == 0


@pytest.mark.parametrize(
    ("name", "requests", "refs", "distinct", "ideal"),
    [
        ("conversation", 12_031, 288_500, 182_790, 0.3664),
        ("synthetic", 3_993, 121_877, 43_924, 0.6396),
    ],
)
def test_bundled_traces_match_their_published_table(
    name: str, requests: int, refs: int, distinct: int, ideal: float
) -> None:
    trace = bundled_trace(name)
    assert (trace.name, trace.num_requests, trace.num_refs, trace.num_distinct) == (
        name,
        requests,
        refs,
        distinct,
    )
    assert round(trace.ideal_hit_ratio, 4) == ideal


def test_the_bundled_data_carries_its_attribution() -> None:
    notice = Path(kvoffload.traces.__file__).parent / "data" / "NOTICE"
    text = notice.read_text(encoding="utf-8")
    assert "Apache License 2.0" in text and "Mooncake" in text
    for name in BUNDLED_TRACES:
        assert f"{name}_trace.jsonl" in text


def test_a_trace_file_reads_hash_ids_and_skips_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "mine.jsonl"
    path.write_text(
        '{"timestamp": 0, "hash_ids": [1, 2, 3]}\n\n{"hash_ids": ["a", "b"], "other": 1}\n'
        '{"hash_ids": []}\n'
    )
    trace = load_trace(path)
    assert trace.name == "mine"
    assert trace.requests == ((1, 2, 3), ("a", "b"), ())
    assert (trace.num_refs, trace.num_distinct, trace.longest_request) == (5, 5, 3)


def _error_for(tmp_path: Path, content: str | bytes) -> str:
    path = tmp_path / "bad.jsonl"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with pytest.raises(TraceError) as caught:
        load_trace(path)
    return str(caught.value)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ('{"hash_ids": [1]}\n{"hash_ids": [1, 2\n', "bad.jsonl:2: not valid JSON"),
        ('{"input_length": 5}\n', "bad.jsonl:1: expected an object with a 'hash_ids' list"),
        ("[1, 2, 3]\n", "expected an object with a 'hash_ids' list"),
        ('{"hash_ids": "1 2 3"}\n', "expected an object with a 'hash_ids' list"),
        ('{"hash_ids": [1, 2.5]}\n', "hash_ids[1] is 2.5; block ids must be integers or strings"),
        ('{"hash_ids": [true]}\n', "hash_ids[0] is true"),
        ('{"hash_ids": [null]}\n', "hash_ids[0] is null"),
        ("", "no requests"),
        ("\n  \n", "no requests"),
        (b"\x89PNG\r\n\x1a\n\xff\xfe", "not a text file"),
    ],
)
def test_a_malformed_trace_says_where_and_what(
    tmp_path: Path, content: str | bytes, expected: str
) -> None:
    assert expected in _error_for(tmp_path, content)


def test_a_missing_trace_or_a_directory_is_a_trace_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="trace file not found"):
        load_trace(tmp_path / "nope.jsonl")
    with pytest.raises(TraceError, match="is a directory"):
        load_trace(tmp_path)


def test_trace_errors_are_invalid_argument_errors() -> None:
    with pytest.raises(InvalidArgumentError):
        parse_trace(["not json"], "x")


def test_resolve_takes_a_bundled_name_a_path_or_nothing(tmp_path: Path) -> None:
    assert resolve_trace(None).name == "conversation"
    assert resolve_trace("synthetic").num_requests == 3_993
    path = tmp_path / "one.jsonl"
    path.write_text('{"hash_ids": [7]}\n')
    assert resolve_trace(str(path)).requests == ((7,),)
    with pytest.raises(TraceError, match="no bundled trace"):
        bundled_trace("chat")
