"""Our own input formats: JSONL and SSE lines, gzip, and --requests joins.

These parse what users hand us, so hypothesis drives them with arbitrary
JSON values, line endings, blank lines and SSE framing.
"""

from __future__ import annotations

import errno
import gzip
import io
import json
import os
import pickle
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from derender_core import Endpoint, InputError, StreamFailure
from derender_core.errors import RecordError
from derender_core.records import (
    JsonProblem,
    OutputFile,
    RequestIndex,
    derender_body,
    iter_records,
    open_input,
    parse_line,
)
from tests.helpers import slow_pipe

json_scalars = st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text() | st.floats(
    allow_nan=False, allow_infinity=False
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)
line_endings = st.sampled_from([b"\n", b"\r\n", b"\r", b""])
padding = st.sampled_from([b"", b" ", b"\t", b"  "])


@given(json_values, line_endings, padding, padding)
def test_json_line_round_trips(value: Any, ending: bytes, before: bytes, after: bytes) -> None:
    parsed = parse_line(before + orjson.dumps(value) + after + ending)
    assert parsed == (value, None)


@given(json_values, line_endings, st.sampled_from([b"data: ", b"data:", b"data:  "]))
def test_sse_data_line_round_trips(value: Any, ending: bytes, prefix: bytes) -> None:
    assert parse_line(prefix + orjson.dumps(value) + ending, sse=True) == (value, None)


@given(
    st.lists(
        st.one_of(
            json_values.map(orjson.dumps),
            st.binary(max_size=40),
            st.sampled_from([b"", b"  ", b"{", b'{"a": NaN}', b"1" * 25, b"[" * 1200]),
        ),
        min_size=1,
        max_size=8,
    ),
    st.booleans(),
)
@settings(max_examples=120)
def test_a_record_parsed_late_or_after_pickling_is_the_line_parsed_now(lines: list[bytes], sse: bool) -> None:
    """A record keeps its text until asked (a worker pool's parent never
    parses it) and travels as that text: whenever and wherever it is
    parsed, it is what `parse_line` gives for its line, problems and all."""
    lines = [line.replace(b"\n", b" ").replace(b"\r", b" ") for line in lines]
    prefix = b"data: " if sse else b""
    text = b"".join(prefix + line + b"\n" for line in lines)
    records = list(iter_records(io.BytesIO(text)))
    # A run without a manifest reads the same records, without hashing.
    unhashed = list(iter_records(io.BytesIO(text), digests=False))
    assert [(r.number, r.line, r.digest) for r in unhashed] == [(r.number, r.line, None) for r in records]
    assert all(r.digest is not None for r in records)
    travelled = pickle.loads(pickle.dumps(records))
    for record, moved in zip(records, travelled, strict=True):
        line = (prefix + lines[record.line - 1]) if prefix else lines[record.line - 1]
        assert moved.digest == record.digest and (moved.number, moved.line) == (record.number, record.line)
        parsed = parse_line(line, sse=sse, keep_blank=True)
        assert (moved.payload, moved.problem) == parsed == (record.payload, record.problem)
        # Once parsed, it travels parsed (nothing is parsed twice).
        again = pickle.loads(pickle.dumps(record))
        assert repr((again.payload, again.problem)) == repr(parsed)  # NaN is not NaN


@pytest.mark.parametrize("line", [b"", b"\n", b"   \r\n", b"\r"])
@pytest.mark.parametrize("sse", [False, True])
def test_blank_lines_are_not_records(line: bytes, sse: bool) -> None:
    assert parse_line(line, sse=sse) is None


SSE_FRAMING = [b"data: [DONE]\n", b"data:[DONE]", b"data:\n", b": keep-alive\n", b"event: message\n", b"id: 7\n", b"retry: 100\n"]


@pytest.mark.parametrize("line", SSE_FRAMING)
def test_sse_framing_is_not_a_record_in_a_capture_but_a_bad_record_in_jsonl(line: bytes) -> None:
    assert parse_line(line, sse=True) is None
    payload, problem = parse_line(line)  # type: ignore[misc]
    assert payload is None and problem is not None


@given(st.text(min_size=1).filter(lambda s: s.strip()))
def test_invalid_json_reports_pythons_message_and_position(text: str) -> None:
    raw = text.replace("\n", " ").replace("\r", " ").encode()
    try:
        expected = json.loads(raw)
    except json.JSONDecodeError as exc:
        payload, problem = parse_line(raw)  # type: ignore[misc]
        assert payload is None and problem is not None
        assert (problem.message, problem.position) == (exc.msg, exc.pos)
    except UnicodeDecodeError:
        # json.loads guesses UTF-16/32 from NUL bytes; such a body is not text.
        payload, problem = parse_line(raw)  # type: ignore[misc]
        assert payload is None and problem is not None and problem.position is None
    else:
        assert parse_line(raw) == (expected, None)


def test_nan_and_infinity_are_read_as_the_server_reads_them() -> None:
    assert parse_line(b'{"logprob": -Infinity}') == ({"logprob": float("-inf")}, None)


@given(st.integers(2**62, 2**80) | st.integers(-(2**80), -(2**62)))
def test_big_integers_stay_exact_as_the_server_reads_them(number: int) -> None:
    assert parse_line(b'{"token_ids": [%d]}' % number) == ({"token_ids": [number]}, None)


@given(
    st.lists(st.one_of(json_values.map(lambda v: ("record", v)), st.sampled_from([("blank", b""), ("blank", b"  "), ("done", b"data: [DONE]")])), max_size=12),
    st.booleans(),
)
@settings(max_examples=60)
def test_records_are_numbered_and_keep_their_line(items: list[tuple[str, Any]], sse: bool) -> None:
    """In JSONL every line is a record up to the last one that is not blank
    (a blank line among records is a record that is not JSON, so output
    line i answers input line i; blank lines after the last record are not
    records); in an SSE capture (data: lines) blank lines and the [DONE]
    marker are not."""
    if not sse:
        items = [(kind, v) for kind, v in items if kind != "done"]
    prefix = b"data: " if sse else b""
    lines = [prefix + orjson.dumps(v) if kind == "record" else v for kind, v in items]
    records = list(iter_records(io.BytesIO(b"\n".join(lines) + b"\n")))
    if sse:
        expected = [(n, v) for n, (kind, v) in enumerate(items, start=1) if kind == "record"]
    else:
        last = max((n for n, (kind, _) in enumerate(items, start=1) if kind == "record"), default=0)
        expected = [(n, v if kind == "record" else None) for n, (kind, v) in enumerate(items[:last], start=1)]
        assert all((r.problem is None) == (items[r.line - 1][0] == "record") for r in records)
    assert [(r.line, r.payload) for r in records] == expected
    assert [r.number for r in records] == list(range(1, len(expected) + 1))


def test_gzip_input_is_read_transparently(tmp_path: Path) -> None:
    rows = [{"a": i, "text": "é" * i} for i in range(50)]
    data = b"".join(orjson.dumps(r) + b"\n" for r in rows)
    gz = tmp_path / "in.jsonl.gz"
    gz.write_bytes(gzip.compress(data))
    plain = tmp_path / "in.jsonl"
    plain.write_bytes(data)
    # Detected by content, not by name.
    disguised = tmp_path / "in.jsonl"
    for path in (gz, plain, disguised):
        with open_input(str(path)) as stream:
            assert [r.payload for r in iter_records(stream)] == rows


def test_missing_input_is_an_input_error(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="cannot open input"):
        with open_input(str(tmp_path / "absent.jsonl")):
            pass


def _requests_file(tmp_path: Path, rows: list[Any], compress: bool = False) -> Path:
    data = b"".join(orjson.dumps(r) + b"\n\n" for r in rows)
    path = tmp_path / ("requests.jsonl.gz" if compress else "requests.jsonl")
    path.write_bytes(gzip.compress(data) if compress else data)
    return path


@given(
    st.dictionaries(
        st.text(min_size=1, max_size=8),
        st.lists(st.integers(0, 1000), max_size=5),
        min_size=1,
        max_size=20,
    ),
    st.booleans(),
)
@settings(max_examples=30, deadline=None)
def test_request_index_finds_every_request(tmp_path_factory: pytest.TempPathFactory, prompts: dict[str, list[int]], compress: bool) -> None:
    rows = [{"request_id": rid, "chat_request": {"n": 1}, "prompt_token_ids": ids} for rid, ids in prompts.items()]
    index = RequestIndex(str(_requests_file(tmp_path_factory.mktemp("req"), rows, compress)))
    try:
        assert len(index) == len(rows)
        for row in reversed(rows):
            assert index.lookup(row["request_id"]) == row
        assert index.lookup("\x00not-there") is None
    finally:
        index.close()


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"request_id": "a"}, {"request_id": "a"}], "already on line 1"),
        ([{"chat_request": {}}], "no request_id"),
        ([{"request_id": 5}], "no request_id"),
    ],
)
def test_bad_requests_files_are_input_errors(tmp_path: Path, rows: list[Any], message: str) -> None:
    with pytest.raises(InputError, match=message):
        RequestIndex(str(_requests_file(tmp_path, rows)))


def test_requests_file_must_be_a_path() -> None:
    with pytest.raises(InputError, match="file path"):
        RequestIndex("-")


@pytest.fixture
def requests(tmp_path: Path) -> RequestIndex:
    rows = [
        {"request_id": "c1", "chat_request": {"messages": []}, "prompt_token_ids": [1, 2, 3], "model": "m"},
        {"request_id": "p1", "completion_request": {"prompt": "x"}, "prompt_token_ids": [4, 5], "prompt_tokens": 9},
    ]
    return RequestIndex(str(_requests_file(tmp_path, rows)))


def test_bare_generate_response_joins_a_chat_request(requests: RequestIndex) -> None:
    generate = {"request_id": "c1", "choices": [{"index": 0, "token_ids": [7]}]}
    assert derender_body(generate, Endpoint.CHAT, stream=False, requests=requests) == {
        "model": "m",
        "generate_response": generate,
        "prompt_tokens": 3,
        "prompt_token_ids": [1, 2, 3],
        "chat_request": {"messages": []},
    }


def test_bare_generate_response_joins_a_completion_request(requests: RequestIndex) -> None:
    generate = {"request_id": "p1", "choices": [{"index": 0, "token_ids": [7]}]}
    assert derender_body(generate, Endpoint.COMPLETION, stream=False, requests=requests) == {
        "generate_responses": [generate],
        "prompt_tokens": [9],
        "prompt_token_ids": [[4, 5]],
        "completion_request": {"prompt": "x"},
    }


def test_bare_stream_chunk_joins_its_request(requests: RequestIndex) -> None:
    chunk = {"request_id": "c1", "choices": []}
    body = derender_body(chunk, Endpoint.CHAT, stream=True, requests=requests)
    assert body["stream"] is True and body["generate_chunk"] == chunk
    assert body["prompt_token_ids"] == [1, 2, 3] and body["chat_request"] == {"messages": []}


@pytest.mark.parametrize(
    ("payload", "endpoint", "message"),
    [
        ({"request_id": "zz", "choices": []}, Endpoint.CHAT, "no request with request_id 'zz'"),
        ({"choices": []}, Endpoint.CHAT, "no request with request_id None"),
        ({"request_id": "p1", "choices": []}, Endpoint.CHAT, "use the completion endpoint"),
        ({"request_id": "c1", "choices": []}, Endpoint.COMPLETION, "use the chat endpoint"),
    ],
)
def test_unjoinable_records_are_record_errors(requests: RequestIndex, payload: Any, endpoint: Endpoint, message: str) -> None:
    with pytest.raises(RecordError, match=message):
        derender_body(payload, endpoint, stream=False, requests=requests)


def test_bare_output_without_requests_file_says_how_to_join() -> None:
    with pytest.raises(RecordError, match="--requests"):
        derender_body({"request_id": "x", "choices": []}, Endpoint.CHAT, stream=True, requests=None)


@given(json_values)
def test_anything_that_is_not_bare_output_goes_to_the_endpoint_unchanged(value: Any) -> None:
    if isinstance(value, dict) and "choices" in value:
        return
    assert derender_body(value, Endpoint.CHAT, stream=False, requests=None) is value


# --- hostile lines: deep nesting, huge integers ------------------------------


def _servers_parser_reads(line: bytes) -> bool:
    """Whether Python's json, the render server's parser (Starlette's
    ``Request.json``), reads `line` on this interpreter: how deep it goes
    differs by version (about 1,000 levels on 3.11, 1,500 on 3.12, 10,000
    on 3.13), so the expectation is this Python's, not one version's."""
    try:
        json.loads(line)
    except RecursionError:
        return False
    return True


@pytest.mark.parametrize("depth", [1030, 5000, 12000])
@pytest.mark.parametrize("wrapped", [False, True])
def test_deep_lines_are_read_as_the_servers_parser_reads_them(depth: int, wrapped: bool) -> None:
    """A line nested beyond orjson's 1,024 levels is read exactly when
    this Python's json reads it; where it gives up, FastAPI answers its
    generic 400 (position None), and the line is a bad record, never a
    crash. Each depth is far from every version's limit, so the probe here
    and the parser's call, a few frames apart, agree."""
    line = b"[" * depth + b"]" * depth
    if wrapped:
        line = b'{"a": ' + line + b"}"
    payload, problem = parse_line(line)  # type: ignore[misc]
    if _servers_parser_reads(line):
        assert problem is None and payload == json.loads(line)
    else:
        assert payload is None and problem is not None
        assert problem.position is None and "nested too deeply" in problem.message
    good = orjson.dumps({"ok": 1})
    records = list(iter_records(io.BytesIO(good + b"\n" + line + b"\n" + good + b"\n")))
    assert [(r.number, r.line) for r in records] == [(1, 1), (2, 2), (3, 3)]
    assert [records[0].payload, records[2].payload] == [{"ok": 1}, {"ok": 1}]
    assert records[1].payload == payload and records[1].problem == problem


def test_every_python_gives_up_somewhere() -> None:
    """The deepest line above is beyond every supported Python's parser,
    so each run checks the bad-record path, not only the reading one."""
    assert not _servers_parser_reads(b"[" * 12000 + b"]" * 12000)


@pytest.mark.parametrize(
    ("line", "detail"),
    [
        (b'{"token_ids": [' + b"9" * 4301 + b"]}", "4300 digits"),
        (b'{"x": "' + b"1" * 30 + b'", "n": -' + b"7" * 5000 + b"}", "4300 digits"),
    ],
)
def test_lines_the_servers_parser_gives_up_on_are_bad_records(line: bytes, detail: str) -> None:
    """FastAPI answers a body its JSON parser gives up on with its generic
    400 (position None); the line is a bad record, never a crash."""
    payload, problem = parse_line(line)  # type: ignore[misc]
    assert payload is None and problem is not None
    assert problem.position is None and detail in problem.message
    good = orjson.dumps({"ok": 1})
    records = list(iter_records(io.BytesIO(good + b"\n" + line + b"\n" + good + b"\n")))
    assert [(r.number, r.line, r.payload) for r in records] == [(1, 1, {"ok": 1}), (2, 2, None), (3, 3, {"ok": 1})]


# --- what an input is: JSONL or an SSE capture --------------------------------


@given(st.lists(st.one_of(json_values.map(orjson.dumps), st.sampled_from(SSE_FRAMING).map(lambda line: line.rstrip(b"\n"))), min_size=1, max_size=12))
@settings(max_examples=60)
def test_jsonl_lines_that_look_like_sse_are_bad_records_not_dropped(lines: list[bytes]) -> None:
    """Output line i answers input line i: nothing that is not blank is
    dropped from a JSONL input, whatever it looks like."""
    data = orjson.dumps({"first": "record"}) + b"\n" + b"\n".join(lines) + b"\n"
    records = list(iter_records(io.BytesIO(data)))
    assert [r.line for r in records] == list(range(1, len(lines) + 2))


def test_an_sse_capture_is_recognised_after_comments_and_fields() -> None:
    capture = b": ping\nevent: message\nid: 1\n\ndata: {\"a\": 1}\n\nid: 2\ndata: {\"a\": 2}\n\ndata: [DONE]\n"
    records = list(iter_records(io.BytesIO(capture)))
    assert [(r.line, r.payload) for r in records] == [(5, {"a": 1}), (8, {"a": 2})]


def test_leading_framing_beyond_the_sniff_window_reads_as_jsonl() -> None:
    from derender_core.records import SSE_SNIFF_LINES

    data = b": comment\n" * SSE_SNIFF_LINES + b'data: {"a": 1}\n'
    records = list(iter_records(io.BytesIO(data)))
    assert len(records) == SSE_SNIFF_LINES + 1 and all(r.problem is not None for r in records)


# --- line endings and chunking ------------------------------------------------


class Trickle(io.RawIOBase):
    """A stream that hands out its bytes in the given read sizes, as a pipe
    or a slow network mount does."""

    def __init__(self, data: bytes, sizes: list[int]) -> None:
        self._data = data
        self._sizes = sizes or [1]
        self._reads = 0
        self.name = "trickle"

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        size = min(len(buffer), self._sizes[self._reads % len(self._sizes)], len(self._data))
        self._reads += 1
        buffer[:size] = self._data[:size]
        self._data = self._data[size:]
        return size


@given(
    st.lists(st.tuples(st.binary(max_size=20).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"")), st.sampled_from([b"\n", b"\r\n", b"\r"])), max_size=10),
    st.lists(st.integers(1, 7), min_size=1, max_size=5),
)
def test_lines_end_in_lf_crlf_or_cr_however_the_reads_split_them(lines: list[tuple[bytes, bytes]], sizes: list[int]) -> None:
    from derender_core.records import iter_lines

    data = b"".join(text + ending for text, ending in lines)
    stream = io.BufferedReader(Trickle(data, sizes), buffer_size=8)
    assert list(iter_lines(stream)) == data.splitlines(keepends=True)


def test_cr_only_line_endings_are_lines() -> None:
    data = b'{"a": 1}\r{"a": 2}\r\r{"a": 3}'
    records = list(iter_records(io.BytesIO(data)))
    assert [(r.line, r.payload) for r in records] == [(1, {"a": 1}), (2, {"a": 2}), (3, None), (4, {"a": 3})]
    assert records[2].problem == JsonProblem("Expecting value", 0)  # the blank line between


# --- gzip: detection on a slow pipe, truncated and corrupt streams ---------------


def test_gzip_is_detected_when_a_pipe_delivers_one_byte_first() -> None:
    rows = [{"n": i} for i in range(20)]
    packed = gzip.compress(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    with slow_pipe(packed) as path, open_input(path) as stream:
        assert [r.payload for r in iter_records(stream)] == rows


def _gzip_lines(count: int) -> bytes:
    return gzip.compress(b"".join(orjson.dumps({"n": i, "pad": "x" * 200}) + b"\n" for i in range(count)))


@pytest.mark.parametrize(
    ("mangle", "message"),
    [
        (lambda packed: packed[: len(packed) * 2 // 3], "ends early"),
        (lambda packed: packed[:200] + bytes(b ^ 0x5A for b in packed[200:400]) + packed[400:], "cannot read"),
    ],
    ids=["truncated", "corrupt"],
)
def test_a_broken_gzip_input_fails_the_stream_after_the_good_records(tmp_path: Path, mangle: Any, message: str) -> None:
    path = tmp_path / "broken.jsonl.gz"
    path.write_bytes(mangle(_gzip_lines(500)))
    seen = []
    with pytest.raises(StreamFailure, match=message) as failure, open_input(str(path)) as stream:
        for record in iter_records(stream):
            seen.append(record.payload["n"])
    assert str(path) in str(failure.value)
    assert seen == list(range(len(seen)))


def _zstd_frames(count: int, per_frame: int) -> bytes:
    import zstandard

    lines = [orjson.dumps({"n": i, "pad": "x" * 200}) + b"\n" for i in range(count)]
    compressor = zstandard.ZstdCompressor()
    return b"".join(compressor.compress(b"".join(lines[i : i + per_frame])) for i in range(0, count, per_frame))


@pytest.mark.parametrize(
    ("mangle", "message"),
    [
        (lambda packed: packed[: len(packed) * 2 // 3], "ends early \\(the last zstd frame is cut short\\)"),
        (lambda packed: packed[:-3], "ends early \\(the last zstd frame is cut short\\)"),
        (lambda packed: packed[:300] + bytes(b ^ 0x5A for b in packed[300:500]) + packed[500:], "corrupt zstd data"),
        (lambda packed: packed + b"trailing garbage", "corrupt zstd data"),
    ],
    ids=["truncated", "last-frame-cut", "corrupt", "garbage-after"],
)
@pytest.mark.parametrize("per_frame", [500, 7])
def test_a_broken_zstd_input_fails_the_stream_after_the_good_records(tmp_path: Path, mangle: Any, message: str, per_frame: int) -> None:
    """As gzip: one frame or many, a cut or corrupt stream never reads as
    a complete one."""
    path = tmp_path / "broken.jsonl.zst"
    path.write_bytes(mangle(_zstd_frames(500, per_frame)))
    seen = []
    with pytest.raises(StreamFailure, match=message) as failure, open_input(str(path)) as stream:
        for record in iter_records(stream):
            seen.append(record.payload["n"])
    assert str(path) in str(failure.value)
    assert seen == list(range(len(seen))) and len(seen) < 500


def test_a_whole_zstd_input_of_many_frames_reads_in_full(tmp_path: Path) -> None:
    path = tmp_path / "whole.jsonl.zst"
    path.write_bytes(_zstd_frames(500, 7))
    with open_input(str(path)) as stream:
        assert [record.payload["n"] for record in iter_records(stream)] == list(range(500))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (_gzip_lines(300)[:-40], "ends early"),
        (b'{"request_id": "a", "x": ' + b"[" * 12000 + b"]" * 12000 + b"}\n", "2:|1: not JSON"),  # beyond every Python's json
        (b'{"request_id": "a", "n": ' + b"9" * 5000 + b"}\n", "1: not JSON"),
    ],
    ids=["truncated-gzip", "deep", "huge-integer"],
)
def test_a_broken_requests_file_is_a_usage_error(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "requests.jsonl"
    path.write_bytes(content)
    with pytest.raises(InputError, match=message):
        RequestIndex(str(path))


def test_requests_file_with_cr_line_endings(tmp_path: Path) -> None:
    rows = [{"request_id": f"r{i}", "chat_request": {}, "prompt_token_ids": [i]} for i in range(5)]
    path = tmp_path / "requests.jsonl"
    path.write_bytes(b"\r".join(orjson.dumps(r) for r in rows))
    index = RequestIndex(str(path))
    try:
        assert [index.lookup(f"r{i}") for i in (4, 0, 2)] == [rows[4], rows[0], rows[2]]
    finally:
        index.close()


# --- outputs: what was written, and outputs that are inputs -------------------


class FillingDisk(io.RawIOBase):
    """A file on a disk that fills up after `room` bytes."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.data = b""

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        if len(self.data) + len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.data += bytes(data)
        return len(data)


@given(st.lists(st.binary(min_size=1, max_size=3000), min_size=1, max_size=60), st.integers(0, 50_000))
@settings(max_examples=60, deadline=None)
def test_records_written_counts_only_records_the_file_holds_in_full(records: list[bytes], room: int) -> None:
    disk = FillingDisk(room)
    output = OutputFile(io.BufferedWriter(disk, buffer_size=1024), "disk")
    output.BATCH_BYTES = 4096
    failure = None
    try:
        for record in records:
            output.write(record)
        output.flush()
    except StreamFailure as exc:
        failure = exc
    held = b"".join(records[: output.records_written])
    assert disk.data.startswith(held)
    if failure is None:
        assert output.records_written == len(records) and disk.data == b"".join(records)
    else:
        assert "cannot write disk: No space left on device" in str(failure)
        assert output.records_written < len(records)
        with pytest.raises(StreamFailure):
            output.write(b"more")


def test_a_closed_pipe_is_not_an_output_failure() -> None:
    class ClosedPipe(io.RawIOBase):
        def writable(self) -> bool:
            return True

        def write(self, data: Any) -> int:
            raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    output = OutputFile(ClosedPipe(), "stdout")  # type: ignore[arg-type]
    output.write(b"x")
    with pytest.raises(BrokenPipeError):
        output.flush()
