"""SSE transcripts and assembled responses.

Golden files pin the formats for the bundled sample; set UPDATE_GOLDEN=1 to
rewrite them after an intended change. Assembled responses are compared with
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
from derender_core.writers import AssembledWriter, SseWriter
from tests.conftest import Stack
from tests.helpers import SAMPLE, normalize, normalized_bytes, read_jsonl, run_lines
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
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(normalized_bytes(data))
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
    """Documented vLLM 0.33 difference (Qwen3 + hermes): with two tool calls
    and no text, one-shot derender gives ``content: null`` while the stream
    sends the blank line between ``</think>`` and ``<tool_call>`` as content.
    Tool calls, reasoning and finish reason agree."""
    plan = _two_tool_calls_plan(qwen3_stack.builder)
    streamed = normalize(assembled(qwen3_stack, Endpoint.CHAT, [plan])[plan.request_id])
    whole = normalize(one_shot(qwen3_stack, Endpoint.CHAT, plan))
    streamed_message = streamed["choices"][0]["message"]
    whole_message = whole["choices"][0]["message"]
    assert whole_message["content"] is None
    assert streamed_message["content"] == "\n\n"
    assert streamed_message["tool_calls"] == whole_message["tool_calls"]
    assert len(whole_message["tool_calls"]) == 2
    assert streamed_message["reasoning"] == whole_message["reasoning"]
    assert streamed["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"] == "tool_calls"


def test_sse_transcripts_golden(qwen3_stack: Stack) -> None:
    out = io.BytesIO()
    run_stream(qwen3_stack, Endpoint.CHAT, read_jsonl(SAMPLE / "stream.jsonl"), SseWriter(target=out))
    data = out.getvalue()
    check_golden("stream.sse", data)
    # Each request's transcript ends in [DONE]; every event is data + blank line.
    assert data.count(b"data: [DONE]\n\n") == 3
    events = [e for e in data.split(b"\n\n") if e]
    assert all(e.startswith(b"data: ") for e in events)


def test_sse_directory_holds_one_file_per_request(qwen3_stack: Stack, tmp_path: Path) -> None:
    # Twice: a second run replaces the first run's files.
    for _ in range(2):
        run_stream(qwen3_stack, Endpoint.CHAT, read_jsonl(SAMPLE / "stream.jsonl"), SseWriter(directory=tmp_path))
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["stream-n2.sse", "stream-speculative-unicode.sse", "stream-tool-call.sse"]
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


def test_streaming_and_one_shot_disagree_on_text_before_a_llama3_tool_call(llama3_stack: Stack) -> None:
    """Documented vLLM 0.33 difference (Llama 3.1 + llama3_json): when text
    precedes the JSON tool call, one-shot derender extracts the call
    (``finish_reason: tool_calls``), while the streaming parser, which
    only looks for a call at the start of the output, streams it all as
    content (``finish_reason: stop``)."""
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
    streamed = assembled(llama3_stack, Endpoint.CHAT, [plan])[plan.request_id]["choices"][0]
    whole = one_shot(llama3_stack, Endpoint.CHAT, plan)["choices"][0]
    assert whole["finish_reason"] == "tool_calls"
    assert whole["message"]["content"] is None
    assert json.loads(whole["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert streamed["finish_reason"] == "stop"
    assert "tool_calls" not in streamed["message"]
    assert streamed["message"]["content"] == text
