"""SSE transcripts and assembled responses.

Golden files pin the formats for the bundled sample, one set per vLLM
release (tests/golden/<major.minor>/: the answers in them are that
release's); set UPDATE_GOLDEN=1 to write the installed release's after an
intended change, or for a new release once its answers are proven equal to
its server's (the stream's chunks here, the one-shot answers in the parity
tests). Assembled responses are compared with
one-shot derendering of the same tokens; where vLLM's streaming and one-shot
paths disagree, the test states the difference instead of hiding it.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import orjson
import pytest

from derender_core import Endpoint
from derender_core.batch import Job
from derender_core.protocol import DERENDER_ENDPOINTS
from derender_core.vllm_seam import versions
from derender_core.writers import AssembledWriter, SseWriter
from tests.conftest import Stack
from tests.helpers import (
    SAMPLE,
    jsonl_answers,
    normalize,
    normalized_bytes,
    read_jsonl,
    run_lines,
    server_stream_answers,
    transcript_name,
)
from tests.sample_inputs import (
    WEATHER_TOOL,
    SampleBuilder,
    StreamPlan,
    chunks_of,
    completion_stream_plans,
    one_shot_body,
    stream_bodies,
    stream_plans,
)

GOLDEN = Path(__file__).parent / "golden"


def check_golden(name: str, data: bytes) -> None:
    """Compare with (or write) the installed vLLM release's golden file."""
    path = GOLDEN / release() / name
    if os.environ.get("UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(normalized_bytes(data))
    assert path.exists(), f"no golden {name} for vLLM {versions.installed()}: see this module's docstring"
    assert normalized_bytes(data) == path.read_bytes()


def run_stream(stack: Stack, endpoint: Endpoint, bodies: list[Any], writer: Any) -> None:
    run_lines(stack.engine, Job(endpoint, stream=True), [orjson.dumps(b) for b in bodies], writer)


def assembled(stack: Stack, endpoint: Endpoint, plans: list[StreamPlan]) -> dict[str, Any]:
    out = io.BytesIO()
    finish = stack.engine.chat_response if endpoint is Endpoint.CHAT else stack.engine.completion_response
    bodies = stream_bodies(stack.builder, plans)
    run_stream(stack, endpoint, bodies, AssembledWriter(out, endpoint, finish))
    return {json.loads(line)["id"]: json.loads(line) for line in out.getvalue().splitlines()}


def one_shot(stack: Stack, endpoint: Endpoint, plan: StreamPlan) -> dict[str, Any]:
    """The same tokens, derendered in one call."""
    answer = stack.engine.post(endpoint, one_shot_body(plan, stack.builder.family.served_name))
    assert answer.ok, answer.raw
    return answer.body


def served(stack: Stack, plan: StreamPlan) -> tuple[dict[str, Any], dict[str, Any]]:
    """A chat plan assembled from its stream, and its one-shot answer, once
    derender's stream chunks and one-shot answer are checked to be the
    installed vLLM's server's: a difference between the two is vLLM's."""
    bodies = stream_bodies(stack.builder, [plan])
    ours, _ = jsonl_answers(stack.engine, Job(Endpoint.CHAT, stream=True), [orjson.dumps(body) for body in bodies])
    assert normalize(ours) == normalize([answer for _, answer in server_stream_answers(stack.server, Endpoint.CHAT, bodies)])
    whole = one_shot(stack, Endpoint.CHAT, plan)
    expected = stack.server.post(Endpoint.CHAT, one_shot_body(plan, stack.builder.family.served_name))
    assert normalize(whole) == normalize(expected.json())
    return assembled(stack, Endpoint.CHAT, [plan])[plan.request_id], whole


def release() -> str:
    """The installed vLLM's release, ``major.minor``."""
    return ".".join(versions.installed().split(".")[:2])


@pytest.mark.parametrize("endpoint", list(DERENDER_ENDPOINTS))
def test_assembled_equals_one_shot(stack: Stack, endpoint: Endpoint) -> None:
    plans = stream_plans(stack.builder) if endpoint is Endpoint.CHAT else completion_stream_plans(stack.builder)
    streams = assembled(stack, endpoint, plans)
    assert sorted(streams) == sorted(plan.request_id for plan in plans)
    for plan in plans:
        assert normalize(streams[plan.request_id]) == normalize(one_shot(stack, endpoint, plan))


def _two_tool_calls_plan(b: SampleBuilder) -> StreamPlan:
    messages = [{"role": "user", "content": "Weather in Rome and Oslo?"}]
    text = b.answer("", reasoning="Two cities, two calls.", tool=("get_weather", {"city": "Rome"}))
    text += "\n" + b.tool_call_text("get_weather", {"city": "Oslo"}, index=1)
    return StreamPlan(
        request_id="two-tools",
        prompt=b.prompt_ids(messages, [WEATHER_TOOL]),
        request=b.chat_request(messages, tools=[WEATHER_TOOL], stream=True),
        choices=[chunks_of(b.encode(text) + [b.family.eos_id], [1])],
        usage=False,
    )


def test_streaming_and_one_shot_disagree_on_whitespace_before_tool_calls(qwen3_stack: Stack) -> None:
    """Documented vLLM difference, in 0.33 and 0.34 alike (Qwen3 + hermes):
    with two tool calls and no text, one-shot derender gives ``content:
    null`` while the stream sends the blank line between ``</think>`` and
    ``<tool_call>`` as content. Tool calls, reasoning and finish reason
    agree."""
    plan = _two_tool_calls_plan(qwen3_stack.builder)
    streamed, whole = map(normalize, served(qwen3_stack, plan))
    streamed_message = streamed["choices"][0]["message"]
    whole_message = whole["choices"][0]["message"]
    assert whole_message["content"] is None
    assert streamed_message["content"] == "\n\n"
    assert streamed_message["tool_calls"] == whole_message["tool_calls"]
    assert len(whole_message["tool_calls"]) == 2
    assert streamed_message["reasoning"] == whole_message["reasoning"]
    assert streamed["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"] == "tool_calls"


def test_sse_transcripts_golden(qwen3_stack: Stack) -> None:
    bodies = read_jsonl(SAMPLE / "stream.jsonl")
    out = io.BytesIO()
    run_stream(qwen3_stack, Endpoint.CHAT, bodies, SseWriter(target=out))
    data = out.getvalue()
    # Each request's transcript ends in [DONE]; every event is data + blank line.
    assert data.count(b"data: [DONE]\n\n") == 3
    events = [e for e in data.split(b"\n\n") if e]
    assert all(e.startswith(b"data: ") for e in events)
    # Each transcript's events are the installed vLLM's server's chunks for
    # that request, in order: what makes the golden file this release's.
    served: dict[str, list[Any]] = {}
    for body, (status, answer) in zip(bodies, server_stream_answers(qwen3_stack.server, Endpoint.CHAT, bodies), strict=True):
        assert status == 200, answer
        served.setdefault(body["generate_chunk"]["request_id"], []).append(answer["chunk"])
    transcripts = [
        [json.loads(event.removeprefix(b"data: ")) for event in transcript.split(b"\n\n") if event]
        for transcript in data.split(b"data: [DONE]\n\n")
        if transcript
    ]
    assert sorted(json.dumps(normalize(t)) for t in transcripts) == sorted(json.dumps(normalize(c)) for c in served.values())
    check_golden("stream.sse", data)


def test_sse_directory_holds_one_file_per_request(qwen3_stack: Stack, tmp_path: Path) -> None:
    # Twice: a second run replaces the first run's files.
    for _ in range(2):
        run_stream(qwen3_stack, Endpoint.CHAT, read_jsonl(SAMPLE / "stream.jsonl"), SseWriter(directory=tmp_path))
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == sorted(transcript_name(rid) for rid in ("stream-n2", "stream-speculative-unicode", "stream-tool-call"))
    together = io.BytesIO()
    run_stream(qwen3_stack, Endpoint.CHAT, read_jsonl(SAMPLE / "stream.jsonl"), SseWriter(target=together))
    for path in tmp_path.iterdir():
        assert normalized_bytes(path.read_bytes()) in normalized_bytes(together.getvalue())
        assert path.read_bytes().count(b"data: [DONE]\n\n") == 1
        assert path.read_bytes().endswith(b"data: [DONE]\n\n")


def test_assembled_golden(qwen3_stack: Stack) -> None:
    out = io.BytesIO()
    writer = AssembledWriter(out, Endpoint.CHAT, qwen3_stack.engine.chat_response)
    run_stream(qwen3_stack, Endpoint.CHAT, read_jsonl(SAMPLE / "stream.jsonl"), writer)
    check_golden("stream_assembled.jsonl", out.getvalue())


def test_failed_call_is_an_sse_error_event_and_the_assembled_error(qwen3_stack: Stack) -> None:
    bodies = [b for b in read_jsonl(SAMPLE / "stream.jsonl") if b["generate_chunk"]["request_id"] == "stream-n2"]
    broken = {**bodies[3], "model": "nope"}
    calls = [*bodies[:3], broken, *bodies[4:]]
    sse = io.BytesIO()
    run_stream(qwen3_stack, Endpoint.CHAT, calls, SseWriter(target=sse))
    error_events = [e for e in sse.getvalue().split(b"\n\n") if e.startswith(b'data: {"error"')]
    assert len(error_events) == 1 and b"does not exist" in error_events[0]
    out = io.BytesIO()
    run_stream(qwen3_stack, Endpoint.CHAT, calls, AssembledWriter(out, Endpoint.CHAT, qwen3_stack.engine.chat_response))
    assert json.loads(out.getvalue())["error"]["code"] == 404


def test_text_before_a_llama3_tool_call(llama3_stack: Stack) -> None:
    """Documented vLLM difference (Llama 3.1 + llama3_json), text before the
    JSON tool call. In 0.33, one-shot derender extracts the call
    (``finish_reason: tool_calls``), while the streaming parser, which only
    looks for a call at the start of the output, streams it all as content
    (``finish_reason: stop``). In 0.34 (``LlamaJsonEngineToolParser``), both
    keep it all as content."""
    b = llama3_stack.builder
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    text = 'Checking now.\n{"name": "get_weather", "parameters": {"city": "Paris"}}'
    plan = StreamPlan(
        request_id="text-then-tool",
        prompt=b.prompt_ids(messages, [WEATHER_TOOL]),
        request=b.chat_request(messages, tools=[WEATHER_TOOL], stream=True),
        choices=[chunks_of(b.encode(text) + [b.family.eos_id], [1])],
        usage=False,
    )
    streamed, whole = (answer["choices"][0] for answer in served(llama3_stack, plan))
    assert streamed["finish_reason"] == "stop"
    assert "tool_calls" not in streamed["message"]
    assert streamed["message"]["content"] == text
    assert release() in ("0.33", "0.34"), f"vLLM {versions.installed()}: document what this release does"
    if release() == "0.33":
        assert whole["finish_reason"] == "tool_calls"
        assert whole["message"]["content"] is None
        assert json.loads(whole["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    else:
        assert whole["finish_reason"] == "stop"
        assert whole["message"]["content"] == text
        assert not whole["message"].get("tool_calls")
