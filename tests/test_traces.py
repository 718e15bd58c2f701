"""Trace loading: the bundled Mooncake traces, and every way a trace file can be wrong."""

from __future__ import annotations

import doctest
import gzip
from pathlib import Path

import pytest

import kvoffload.replay.traces
from kvoffload.replay.traces import (
    BUNDLED_TRACES,
    TraceError,
    bundled_trace,
    load_trace,
    parse_trace,
    resolve_trace,
)
from kvoffload_spec.errors import InvalidArgumentError


def test_module_examples() -> None:
    assert doctest.testmod(kvoffload.replay.traces).failed == 0


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
    notice = Path(kvoffload.replay.traces.__file__).parent.parent / "data" / "NOTICE"
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


# -- repeated ids, gzip, token ids -------------------------------------------------------------


def test_a_request_that_repeats_an_id_is_refused_with_its_line(tmp_path: Path) -> None:
    # {"hash_ids": [1, 1, 2]} once gave an infinite cache 0.3333 and Belady 0 at any size
    path = tmp_path / "repeats.jsonl"
    path.write_text('{"hash_ids": [1, 2]}\n\n{"hash_ids": [1, 1, 2]}\n')
    with pytest.raises(TraceError, match=r"repeats.jsonl:3: hash_ids\[1\] repeats hash_ids\[0\]"):
        load_trace(path)
    with pytest.raises(TraceError, match=r"requests\[1\]: hash_ids\[2\] repeats hash_ids\[0\]"):
        kvoffload.replay.traces.Trace("t", ((1, 2), (3, 4, 3)))


def test_the_command_names_the_repeated_id_and_its_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvoffload.cli import main

    path = tmp_path / "repeats.jsonl"
    path.write_text('{"hash_ids": ["a", "b", "a"]}\n')
    assert main(["sweep", "--trace", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and 'repeats.jsonl:1: hash_ids[2] repeats hash_ids[0] ("a")' in err


def test_a_gzipped_trace_reads_as_the_plain_one(tmp_path: Path) -> None:
    trace = bundled_trace("synthetic")
    zipped = tmp_path / "mine.jsonl.gz"
    kvoffload.replay.traces.save_trace(trace, zipped)
    kvoffload.replay.traces.save_trace(trace, tmp_path / "mine.jsonl")
    assert zipped.read_bytes()[:2] == b"\x1f\x8b"  # really gzip
    named_mine = kvoffload.replay.traces.Trace("mine", trace.requests)  # named after the file
    assert load_trace(zipped) == load_trace(tmp_path / "mine.jsonl") == named_mine
    assert resolve_trace(str(zipped)).requests == trace.requests


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"not gzip at all", "not a complete gzip file"),
        (gzip.compress(b'{"hash_ids": [1, 2]}\n')[:-6], "not a complete gzip file"),
        (gzip.compress(b"\xff\xfe"), "not a text file"),
        (gzip.compress(b'{"hash_ids": [1, 2]\n'), "t.jsonl.gz:1: not valid JSON"),
    ],
    ids=["not-gzip", "truncated", "not-text", "bad-json"],
)
def test_a_broken_gzipped_trace_says_what_is_wrong(
    tmp_path: Path, content: bytes, expected: str
) -> None:
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(content)
    with pytest.raises(TraceError, match=expected):
        load_trace(path)


def test_block_hashes_are_prefix_chained_full_blocks() -> None:
    from kvoffload.replay.traces import block_hashes

    a = block_hashes([5, 6, 7, 8, 9, 10, 11], 2)
    b = block_hashes([5, 6, 7, 8, 1, 2], 2)
    assert len(a) == 3 and len(b) == 3  # the last, partial block of a has no hash
    assert a[:2] == b[:2] and a[2] != b[2]
    # a block's hash depends on everything before it, not only on its own tokens
    assert block_hashes([7, 8], 2)[0] != a[1]
    assert block_hashes([5, 6, 7, 8], 4) != a[:1]  # another block size, other blocks
    assert len(set(a + b)) == 4
    assert all(isinstance(h, int) and 0 <= h < 2**63 for h in a)
    assert block_hashes([1, 2], 3) == []
    # the same on every machine and run: a trace written today replays tomorrow
    assert block_hashes([1, 2, 3, 4], 2) == [4450782424123420391, 2572445548072920505]


def test_block_hashes_take_numpy_arrays_and_refuse_what_is_not_a_token() -> None:
    import numpy as np

    from kvoffload.replay.traces import block_hashes

    assert block_hashes(np.arange(10, dtype=np.int32), 4) == block_hashes(range(10), 4)
    for bad_size in (0, -2, 2.0, True):
        with pytest.raises(InvalidArgumentError, match="block_size"):
            block_hashes([1, 2], bad_size)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="sequence of integers"):
        block_hashes("hello", 2)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match=r"token_ids\[3\] is 2.5"):
        block_hashes([1, 2, 3, 2.5], 2)  # type: ignore[list-item]
    with pytest.raises(InvalidArgumentError, match=r"token_ids\[1\] is True"):
        block_hashes([1, True], 2)
    with pytest.raises(InvalidArgumentError, match="64-bit"):
        block_hashes([1, 2**64], 2)


def test_a_trace_from_token_logs_replays_like_any_other(tmp_path: Path) -> None:
    from kvoffload.replay.sweep import sweep
    from kvoffload.replay.traces import trace_from_tokens

    system = list(range(100, 164))  # a 64-token system prompt shared by every request
    logs = [system + [turn] * 40 for turn in range(5)] * 2
    trace = trace_from_tokens(logs, block_size=16, name="logs")
    assert trace.num_requests == 10 and trace.longest_request == 6  # 104 tokens: 6 full blocks
    assert len({request[:4] for request in trace.requests}) == 1  # the shared prefix
    path = tmp_path / "logs.jsonl.gz"
    kvoffload.replay.traces.save_trace(trace, path)
    assert load_trace(path) == trace
    hits = [p.hit_ratio for p in sweep(load_trace(path), [64], ["lru", "belady"]).points]
    # every request but the first reuses the 4 prefix blocks; the second round hits whole
    assert hits == [pytest.approx((9 * 4 + 5 * 2) / 60)] * 2
