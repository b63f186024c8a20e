"""Streaming derender parity: every chunk and every stream_state equals what
the real render server answers when a client threads the state through it.

Covers one token per chunk, several tokens per chunk (speculative
decoding), a finish-only tail chunk, the usage-only chunk, interleaved n=2
streams, unicode split across chunks, and reasoning plus tool calls, for
the chat and the completion endpoint.
"""

from __future__ import annotations

from typing import Any

import orjson

from derender_core import Endpoint
from derender_core.batch import Job
from tests.conftest import Stack
from tests.helpers import jsonl_answers, normalize, server_stream_answers
from tests.sample_inputs import completion_stream_plans, stream_bodies, with_rejected_calls


def derender_stream(stack: Stack, endpoint: Endpoint, bodies: list[Any]) -> tuple[list[Any], int]:
    # Bug-for-bug parity is --lenient: our own checks refuse calls the
    # server answers (test_hardening covers those).
    return jsonl_answers(stack.engine, Job(endpoint, stream=True, lenient=True), [orjson.dumps(b) for b in bodies])


def assert_stream_matches_server(stack: Stack, endpoint: Endpoint, bodies: list[Any]) -> list[Any]:
    answers, _ = derender_stream(stack, endpoint, bodies)
    expected = server_stream_answers(stack.server, endpoint, bodies)
    for number, (answer, (status, server_answer)) in enumerate(zip(answers, expected, strict=True), start=1):
        assert normalize(answer) == normalize(server_answer), f"call {number}"
        assert ("error" in answer) == (status != 200)
    return answers


def text_per_request(answers: list[Any], field: str) -> dict[tuple[str, int], str]:
    joined: dict[tuple[str, int], str] = {}
    for answer in answers:
        for choice in answer["chunk"]["choices"]:
            key = (answer["chunk"]["id"], choice["index"])
            piece = choice["delta"].get(field) if "delta" in choice else choice.get(field)
            joined[key] = joined.get(key, "") + (piece or "")
    return joined


def test_chat_streams_match_server(stack: Stack) -> None:
    bodies = stream_bodies(stack.builder)
    answers = assert_stream_matches_server(stack, Endpoint.CHAT, bodies)
    assert all("error" not in answer for answer in answers)

    content = text_per_request(answers, "content")
    reasoning = text_per_request(answers, "reasoning")
    if stack.builder.family.reasoning is not None:
        assert "Paris" in reasoning[("stream-tool-call", 0)]
    assert "𝟏𝟐°C" in content[("stream-speculative-unicode", 0)]
    assert "Blue and green." in content[("stream-n2", 1)]
    # Threading works: the role goes out once per choice, and the tool call
    # arrives as one call with a name and arguments.
    roles = [
        (a["chunk"]["id"], c["index"])
        for a in answers
        for c in a["chunk"]["choices"]
        if c["delta"].get("role")
    ]
    assert sorted(roles) == sorted(set(roles)) and len(roles) == 4
    calls = [
        call
        for a in answers
        if a["chunk"]["id"] == "stream-tool-call"
        for c in a["chunk"]["choices"]
        for call in c["delta"].get("tool_calls", [])
    ]
    assert calls[0]["function"]["name"] == "get_weather"
    assert "Paris" in "".join(call["function"].get("arguments") or "" for call in calls)
    usage_chunks = [a for a in answers if not a["chunk"]["choices"]]
    assert len(usage_chunks) == 3 and all(a["chunk"]["usage"] for a in usage_chunks)


def test_completion_streams_match_server(stack: Stack) -> None:
    bodies = stream_bodies(stack.builder, completion_stream_plans(stack.builder))
    answers = assert_stream_matches_server(stack, Endpoint.COMPLETION, bodies)
    assert all("error" not in answer for answer in answers)
    text = text_per_request(answers, "text")
    assert text[("cmpl-stream-n2", 0)] == " red, violets are blue."
    assert text[("cmpl-stream-n2", 1)] == " fragrant and pretty."
    assert "北京多云" in text[("cmpl-stream-unicode", 0)]
    offsets = [
        offset
        for a in answers
        if a["chunk"]["id"] == "cmpl-stream-n2"
        for c in a["chunk"]["choices"]
        if c["index"] == 0
        for offset in c["logprobs"]["text_offset"]
    ]
    assert offsets == sorted(offsets) and offsets[0] == 0


def test_rejected_calls_keep_the_stream_state(stack: Stack) -> None:
    """Calls the server rejects get aligned error records; the stream's
    state stays as it was and the run goes on."""
    calls = with_rejected_calls(stream_bodies(stack.builder), "stream-tool-call")
    answers = assert_stream_matches_server(stack, Endpoint.CHAT, calls)
    assert ["error" in a for a in answers] == [False, True, True, True, True, True, True, False]
    # The last call continues from the first one's state: no second role.
    assert answers[-1]["chunk"]["choices"][0]["delta"].get("role") is None
    assert answers[-1]["stream_state"]["output_chunk_lens"] == [1, 1]


def test_given_stream_state_is_used_as_is(stack: Stack) -> None:
    """A captured body with its stream_state reproduces that one call."""
    bodies = [b for b in stream_bodies(stack.builder) if b["generate_chunk"]["request_id"] == "stream-n2"]
    threaded, _ = derender_stream(stack, Endpoint.CHAT, bodies)
    # Replay the 5th call alone, with the state the 4th call of its index left.
    index = bodies[4]["generate_chunk"]["choices"][0]["index"]
    previous = max(
        i for i in range(4) if bodies[i]["generate_chunk"]["choices"][0]["index"] == index
    )
    captured = {**bodies[4], "stream_state": threaded[previous]["stream_state"]}
    alone = assert_stream_matches_server(stack, Endpoint.CHAT, [captured])
    assert normalize(alone[0]) == normalize(threaded[4])
