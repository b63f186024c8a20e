"""Our own input formats: JSONL and SSE lines, gzip, and --requests joins.

These parse what users hand us, so hypothesis drives them with arbitrary
JSON values, line endings, blank lines and SSE framing.
"""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from derender_core import Endpoint, InputError, RecordError, RequestIndex, iter_records, open_input
from derender_core.records import derender_body, parse_line

json_scalars = st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text() | st.floats(
    allow_nan=False, allow_infinity=False
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)
line_endings = st.sampled_from([b"\n", b"\r\n", b""])
padding = st.sampled_from([b"", b" ", b"\t", b"  "])


@given(json_values, line_endings, padding, padding)
def test_json_line_round_trips(value: Any, ending: bytes, before: bytes, after: bytes) -> None:
    parsed = parse_line(before + orjson.dumps(value) + after + ending)
    assert parsed == (value, None)


@given(json_values, line_endings, st.sampled_from([b"data: ", b"data:", b"data:  "]))
def test_sse_data_line_round_trips(value: Any, ending: bytes, prefix: bytes) -> None:
    assert parse_line(prefix + orjson.dumps(value) + ending) == (value, None)


@pytest.mark.parametrize(
    "line",
    [b"", b"\n", b"   \r\n", b"data: [DONE]\n", b"data:[DONE]", b"data:\n", b": keep-alive\n",
     b"event: message\n", b"id: 7\n", b"retry: 100\n"],
)  # fmt: skip
def test_lines_that_are_not_records(line: bytes) -> None:
    assert parse_line(line) is None


@given(st.text(min_size=1).filter(lambda s: s.strip() and not s.strip().startswith((":", "data:", "event:", "id:", "retry:"))))
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


@given(st.lists(st.one_of(json_values.map(lambda v: ("record", v)), st.sampled_from([("blank", b""), ("blank", b"  "), ("done", b"data: [DONE]")])), max_size=12))
@settings(max_examples=60)
def test_records_are_numbered_and_keep_their_line(items: list[tuple[str, Any]]) -> None:
    lines = [orjson.dumps(v) if kind == "record" else v for kind, v in items]
    records = list(iter_records(io.BytesIO(b"\n".join(lines) + b"\n")))
    expected = [(n, v) for n, (kind, v) in enumerate(items, start=1) if kind == "record"]
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
