"""`derender parity` and `derender diff`.

The corpus (`tests.parity_corpus`) holds one stream per divergence issue #9
lists for the Qwen3 family; `derender parity` must report each of them and
nothing else. The expected report is written here from the issue's list,
not from the tool's output: every request shows serve's own usage details
and fingerprint and its frame field selection, and each request adds the
divergence it was made for.

Recorded `vllm serve` answers come from the serve oracle (`vllm serve` over
HTTP on a taped engine core, `tests.serve_oracle`), made with
``return_token_ids: true``; `--from-serve` must find the serve path equal
to them.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import orjson
from hypothesis import given, settings

from derender_core import Endpoint, Normalization, read_items
from derender_core.batch import Job
from derender_core.compare import Observed, compare
from derender_core.parity import (
    Chunking,
    Parity,
    from_serve,
    one_shot_body,
    requests_of,
    stream_bodies,
)
from derender_core.records import Record, RequestIndex
from derender_core.responses import Item
from derender_core.writers import SseWriter
from tests.conftest import ServeStack, Stack
from tests.helpers import requires_fast, run_cli, run_lines, transcript_name
from tests.parity_corpus import CASES, corpus_bodies
from tests.sample_inputs import write_jsonl
from tests.serve_oracle import one_shot_steps, oracle_body, stream_steps

SAMPLE_FLAGS = ["--config", "sample_data/qwen3.yaml"]

needs_serve = requires_fast("serve")
"""The tests that run the serve flavor: it has no reference path to fall
back to, and refuses where it is not proven."""

# What serve adds to every response (usage.completion_tokens_details, its
# fingerprint) and how its frames select fields, per request.
EVERY_REQUEST = [
    (None, "oneshot", "serve-oneshot", "usage"),
    (None, "oneshot", "serve-oneshot", "system_fingerprint"),
    (None, "replay", "serve", "usage"),
    (None, "replay", "serve", "system_fingerprint"),
    (None, "replay", "serve", "null_fields"),
]
# The list, request by request.
STREAM_LEAKS = [(0, "oneshot", "replay", "content"), (0, "replay", "serve", "content")]
BLANK_LINE_BEFORE_CALLS = [(0, "oneshot", "replay", "content"), (0, "serve-oneshot", "serve", "content")]
EMPTY_FRAMES = [(0, "replay", "serve", "empty_frames")]
EXPECTED = {
    # The stop token leaks into content; a </think> step is an empty frame.
    "tail-im-end": STREAM_LEAKS + EMPTY_FRAMES,
    "tail-endoftext": STREAM_LEAKS + EMPTY_FRAMES
    + [(0, "oneshot", "replay", "stop_reason"), (0, "replay", "serve", "stop_reason")],
    "two-tool-calls": BLANK_LINE_BEFORE_CALLS + EMPTY_FRAMES,
    "text-after-tool-call": BLANK_LINE_BEFORE_CALLS + EMPTY_FRAMES,
    "tool-call-cut-at-length": EMPTY_FRAMES + [
        (0, "oneshot", "replay", "content"), (0, "oneshot", "replay", "tool_calls"),
        (0, "serve-oneshot", "serve", "content"), (0, "serve-oneshot", "serve", "tool_calls"),
    ],
    "plain": [(0, "replay", "serve", "role_frame")],
    "length-tail": [(0, "replay", "serve", "role_frame"), (0, "replay", "serve", "finish_frame")],
}  # fmt: skip


def report_keys(path: Path) -> set[tuple[Any, ...]]:
    return {
        (d["request_id"], d["index"], d["left"], d["right"], d["field"])
        for d in map(json.loads, path.read_text().splitlines())
    }


@needs_serve
def test_parity_finds_every_listed_divergence_and_nothing_else(qwen3_serve: ServeStack, tmp_path: Path) -> None:
    assert set(EXPECTED) == set(CASES)
    corpus = write_jsonl(tmp_path / "corpus.jsonl", corpus_bodies(qwen3_serve.builder))
    report = tmp_path / "report.jsonl"
    done = run_cli("parity", str(corpus), *SAMPLE_FLAGS, "--report", str(report))
    assert done.returncode == 1, done.stderr.decode()
    expected = {
        (request_id, *key) for request_id, keys in EXPECTED.items() for key in EVERY_REQUEST + keys
    }
    assert report_keys(report) == expected
    found = {(d["request_id"], d["left"], d["right"], d["field"]): d for d in map(json.loads, report.read_text().splitlines())}
    leak = found[("tail-endoftext", "oneshot", "replay", "content")]
    assert (leak["left_value"], leak["right_value"]) == ("\n\nIt is sunny in Paris.", "\n\nIt is sunny in Paris.<|endoftext|>")
    assert found[("tail-endoftext", "oneshot", "replay", "stop_reason")]["right_value"] is None
    partial = found[("tool-call-cut-at-length", "oneshot", "replay", "tool_calls")]["right_value"]
    assert partial[0]["function"] == {"name": "get_weather", "arguments": '{"city":'}
    assert "<tool_call>" in found[("tool-call-cut-at-length", "oneshot", "replay", "content")]["left_value"]
    assert found[("plain", "replay", "serve", "role_frame")]["right_value"] == "role only"
    assert found[("length-tail", "replay", "serve", "finish_frame")]["right_value"] == "with output"
    usage = found[("plain", "replay", "serve", "usage")]
    assert usage["right_value"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    assert found[("plain", "replay", "serve", "system_fingerprint")]["left_value"] is None
    stderr = done.stderr.decode()
    assert "replay vs serve: role_frame (2)" in stderr
    assert f"7 requests, {len(expected)} divergences, 0 not compared" in stderr


@needs_serve
def test_chunkings_of_one_shot_input(qwen3_stack: Stack, qwen3_serve: ServeStack) -> None:
    """A one-shot record runs once per chunking on the stream paths; a
    finish-only tail leaks the stop token there, and only there."""
    bodies = [one_shot_body([b for b in corpus_bodies(qwen3_serve.builder)
                             if b["generate_chunk"]["request_id"] == "plain"], Endpoint.CHAT)]  # fmt: skip
    parity = Parity(
        {"oneshot": qwen3_stack.engine, "replay": qwen3_stack.engine, "serve": qwen3_serve.engine},
        Endpoint.CHAT,
        ignore=["usage", "system_fingerprint", "null_fields", "role_frame"],
    )
    (request,) = requests_of(
        [Record(1, 1, bodies[0])], Endpoint.CHAT, stream=False, requests=None,
        chunkings=Chunking.parse_list("1,3,tail"),
    )  # fmt: skip
    found = {(d.left, d.right, d.field, d.chunking) for d in parity.run(request)}
    # The leaked <|im_end|> is content, so its frame is not empty.
    assert found == {("oneshot", "replay", "content", "tail"), ("replay", "serve", "content", "tail")}


@needs_serve
def test_from_serve_recordings(qwen3_stack: Stack, qwen3_serve: ServeStack, tmp_path: Path) -> None:
    """Answers recorded from `vllm serve` with return_token_ids, streamed and
    not: the serve path gives them back exactly; the derender paths differ
    from them as from the serve path."""
    wanted = ["two-tool-calls", "tail-im-end", "plain"]
    by_request: dict[str, list[Any]] = {}
    for body in corpus_bodies(qwen3_serve.builder):
        by_request.setdefault(body["generate_chunk"]["request_id"], []).append(body)
    requests, recorded_lines, sse_dir = [], [], tmp_path / "sse"
    sse_dir.mkdir()
    for request_id in wanted:
        bodies = by_request[request_id]
        chat_request = {**bodies[0]["chat_request"], "return_token_ids": True}
        requests.append({"request_id": request_id, "chat_request": chat_request,
                         "prompt_token_ids": bodies[0]["prompt_token_ids"]})  # fmt: skip
        chunks = [b["generate_chunk"] for b in bodies]
        streamed = qwen3_serve.oracle.request(Endpoint.CHAT, request_id, oracle_body(chat_request, True), stream_steps(chunks))
        (sse_dir / f"chatcmpl-{request_id}.sse").write_bytes(streamed.content)
        joined = one_shot_body(bodies, Endpoint.CHAT)["generate_response"]["choices"]
        answer = qwen3_serve.oracle.request(Endpoint.CHAT, request_id, oracle_body(chat_request, False), one_shot_steps(joined))
        recorded_lines.append(answer.json())
    write_jsonl(tmp_path / "requests.jsonl", requests)
    write_jsonl(tmp_path / "recorded.jsonl", recorded_lines)
    index = RequestIndex(str(tmp_path / "requests.jsonl"))
    engines = {"oneshot": qwen3_stack.engine, "replay": qwen3_stack.engine,
               "serve": qwen3_serve.engine, "serve-oneshot": qwen3_serve.engine}  # fmt: skip
    parity = Parity(engines, Endpoint.CHAT)
    found = []
    # Each recording against the serve path in its own mode: nothing differs.
    for recording, same_mode in ((tmp_path / "recorded.jsonl", "serve-oneshot"), (sse_dir, "serve")):
        for request in from_serve(read_items(recording), Endpoint.CHAT, index):
            assert request.problem is None, request.problem
            divergences = parity.run(request)
            assert [d for d in divergences if d.right == same_mode] == [], request.request_id
            found += divergences
    index.close()
    kinds = {(d.request_id, d.left, d.right, d.field) for d in found}
    # The derender paths differ from serve's answers as from the serve path.
    assert ("plain", "recorded", "replay", "role_frame") in kinds
    assert ("two-tool-calls", "recorded", "replay", "empty_frames") in kinds
    assert ("two-tool-calls", "recorded", "oneshot", "usage") in kinds  # reasoning_tokens
    assert all(d.left == "recorded" for d in found)


@needs_serve
def test_diff_command(qwen3_stack: Stack, qwen3_serve: ServeStack, tmp_path: Path) -> None:
    """`derender diff` compares answers request by request, with the
    normalisation switchable, over files and directories of transcripts."""
    b = qwen3_serve.builder
    lines = [orjson.dumps(x) for x in corpus_bodies(b) if x["generate_chunk"]["request_id"] in ("plain", "length-tail")]
    serve_dir, derender_dir = tmp_path / "serve", tmp_path / "derender"
    for engine, out in ((qwen3_serve.engine, serve_dir), (qwen3_stack.engine, derender_dir)):
        out.mkdir()
        run_lines(engine, Job(Endpoint.CHAT, stream=True), lines, SseWriter(directory=out))
    (derender_dir / transcript_name("length-tail")).rename(derender_dir / "other.sse")  # no pair
    same = run_cli("diff", str(serve_dir), str(serve_dir))
    assert same.returncode == 0 and b"0 divergences" in same.stderr
    report = tmp_path / "diff.jsonl"
    differ = run_cli("diff", str(serve_dir), str(derender_dir), "--report", str(report), "--ignore", "null_fields")
    assert differ.returncode == 1
    keys = {(d["request_id"], d["field"]) for d in map(json.loads, report.read_text().splitlines())}
    assert keys == {("plain", "role_frame"), ("plain", "system_fingerprint"), ("plain", "usage"),
                    ("length-tail", "record"), ("other", "record")}  # fmt: skip
    assert not any(field == "null_fields" for _, field in keys)

    serve_file = serve_dir / transcript_name("plain")
    other = tmp_path / "other.sse"
    other.write_bytes(serve_file.read_bytes().replace(b'"created":', b'"created":1'))
    assert run_cli("diff", str(serve_file), str(other)).returncode == 0
    compared = run_cli("diff", str(serve_file), str(other), "--compare-created", "--report", str(report))
    assert compared.returncode == 1
    assert {d["field"] for d in map(json.loads, report.read_text().splitlines())} == {"created"}
    missing = run_cli("diff", str(tmp_path / "nope.jsonl"), str(other))
    assert missing.returncode == 2 and b"Traceback" not in missing.stderr


# --- the pure parts ------------------------------------------------------------


def test_normalisation_is_switchable() -> None:
    left = Observed(response={"id": "a", "created": 1, "choices": [{"index": 0, "message": {"content": "x", "refusal": None}}]})
    right = Observed(response={"id": "b", "created": 2, "choices": [{"index": 0, "message": {"content": "x"}}]})
    assert compare("l", left, "r", right, request_id="r1") == []
    strict = Normalization(created=False, random_ids=False, null_is_absent=False)
    fields = {(d.field, d.left_value, d.right_value) for d in compare("l", left, "r", right, request_id="r1", normalization=strict)}
    assert fields == {("created", 1, 2), ("id", "a", "b"), ("refusal", None, "<absent>")}


def test_random_tool_call_ids_of_every_format_are_overlooked_and_only_those() -> None:
    """vLLM's, xLAM's and Mistral's tool-call ids are drawn at random;
    Kimi's name the call, so a different one is a divergence."""

    def response(*ids: str) -> Observed:
        calls = [{"id": i, "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in ids]
        return Observed(response={"choices": [{"index": 0, "message": {"tool_calls": calls}}]})

    left = response("chatcmpl-tool-0a1b", "call_0_0123456789abcdef", "TZk4nuzac", "functions.f:0")
    same = response("chatcmpl-tool-ffff", "call_0_fedcba9876543210", "31u0D6IIB", "functions.f:0")
    assert compare("l", left, "r", same, request_id="r1") == []
    other_kimi = response("chatcmpl-tool-ffff", "call_0_fedcba9876543210", "31u0D6IIB", "functions.f:1")
    assert [d.field for d in compare("l", left, "r", other_kimi, request_id="r1")] == ["tool_calls"]
    strict = Normalization(random_ids=False)
    assert [d.field for d in compare("l", left, "r", same, request_id="r1", normalization=strict)] == ["tool_calls"]


def _one_shot(token_ids: list[int], finish: str | None, stop_reason: Any, logprobs: bool) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "token_ids": token_ids, "finish_reason": finish}
    if stop_reason is not None:
        choice["stop_reason"] = stop_reason
    if logprobs:
        choice["logprobs"] = {"content": [{"token_id": t, "logprob": -1.0, "top_logprobs": []} for t in token_ids]}
    return {
        "model": "m",
        "generate_response": {"request_id": "r", "choices": [choice]},
        "prompt_tokens": 3,
        "prompt_token_ids": [1, 2, 3],
        "chat_request": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    }


@settings(max_examples=60, deadline=None)
@given(
    token_ids=st.lists(st.integers(0, 1000), min_size=1, max_size=12),
    finish=st.sampled_from(["stop", "length"]),
    stop_reason=st.one_of(st.none(), st.integers(0, 1000), st.just("END")),
    logprobs=st.booleans(),
    size=st.integers(1, 5),
    tail=st.booleans(),
)
def test_any_chunking_joins_back_to_the_one_shot_body(
    token_ids: list[int], finish: str, stop_reason: Any, logprobs: bool, size: int, tail: bool
) -> None:
    body = _one_shot(token_ids, finish, stop_reason, logprobs)
    streamed = stream_bodies(body, Endpoint.CHAT, Chunking(size, tail))
    chunks = [s["generate_chunk"] for s in streamed]
    assert all(len(c["choices"][0]["token_ids"]) <= size for c in chunks if c["choices"])
    assert chunks[-1]["usage"]["completion_tokens"] == len(token_ids)
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]) == 1
    assert (chunks[-2]["choices"][0]["token_ids"] == []) == tail
    joined = one_shot_body(streamed, Endpoint.CHAT)
    expected = copy.deepcopy(body)
    expected["generate_response"]["choices"][0].setdefault("stop_reason", None)
    assert joined == expected


def test_response_files_are_read_as_items(tmp_path: Path) -> None:
    chunk = {"id": "chatcmpl-r", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "a"}}]}
    sse = tmp_path / "x.sse"
    sse.write_bytes(b"data: " + orjson.dumps(chunk) + b"\n\ndata: " + orjson.dumps({**chunk, "choices": []})
                    + b"\n\ndata: [DONE]\n\n")  # fmt: skip
    (item,) = read_items(sse)
    assert isinstance(item, Item) and item.key == "chatcmpl-r" and len(item.chunks or []) == 2
    assert item.observed().response["choices"][0]["message"]["content"] == "a"  # type: ignore[index]
    jsonl = tmp_path / "x.jsonl"
    jsonl.write_bytes(b'{"id": "r1", "choices": []}\n{"error": {"message": "bad", "code": 400}}\n')
    first, second = read_items(jsonl)
    assert first.response == {"id": "r1", "choices": []} and second.error == "400 bad"
