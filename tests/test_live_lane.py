"""The chunk lane: a live stream's usual calls answered without the
per-call pydantic round trip (`live.ChunkLane`), byte for byte what the
slow path and vLLM's replay give.

The family tests (`tests/test_families.py`) hold the lane's answers equal to
replay's for every model family; here the lane is held to the bytes: every
SSE event and every JSONL line (chunk and state, key order and escaping
included) equal to the slow path's with the lane off and to replay's, on the
corpus and on drawn variations of a stream's calls that the lane must leave
to the slow path (or take, and answer the same). Only `created` and the
random tool-call ids are normalised.
"""

from __future__ import annotations

import copy
import io
import json
import math
from collections.abc import Callable, Iterator
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.responses import JSONResponse

from derender_core import DerenderEngine, Endpoint
from derender_core.batch import Job
from derender_core.writers import JsonlWriter, SseWriter
from tests.conftest import Stack
from tests.helpers import (
    count_lane_calls,
    jsonl_answers,
    normalized_bytes,
    requires_fast,
    run_lines,
)
from tests.sample_inputs import parser_corner_plans, stream_bodies, stream_plans

JOB = Job(Endpoint.CHAT, stream=True)


@pytest.fixture
def lane_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bool]]:
    """Per call the lane was offered, whether it answered it."""
    yield count_lane_calls(monkeypatch)


def outputs(engine: DerenderEngine, bodies: list[Any], job: Job = JOB) -> tuple[bytes, bytes]:
    """The SSE and the JSONL output for the bodies, normalised."""
    lines = [orjson.dumps(body) for body in bodies]
    sse, jsonl = io.BytesIO(), io.BytesIO()
    run_lines(engine, job, lines, SseWriter(target=sse))
    run_lines(engine, job, lines, JsonlWriter(jsonl))
    return normalized_bytes(sse.getvalue()), normalized_bytes(jsonl.getvalue())


def without_lane(engine: DerenderEngine, bodies: list[Any], job: Job = JOB) -> tuple[bytes, bytes]:
    from derender_core.vllm_seam.live import ChunkLane

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ChunkLane, "answer", lambda self, body: None)
        return outputs(engine.in_mode(live=True), bodies, job)


def assert_lane_is_the_slow_path_and_replay(engine: DerenderEngine, bodies: list[Any], job: Job = JOB) -> None:
    live = outputs(engine.in_mode(live=True), bodies, job)
    assert live == without_lane(engine, bodies, job)
    assert live == outputs(engine.in_mode(live=False), bodies, job)


@requires_fast("live")
def test_the_lane_gives_the_slow_paths_and_replays_bytes(qwen3_stack: Stack, lane_calls: list[bool]) -> None:
    """The corpus: n=2, unicode cut inside characters, tool calls, logprobs,
    finish-only tails, hidden reasoning, named and required tool choice."""
    b = qwen3_stack.builder
    bodies = stream_bodies(b, stream_plans(b) + parser_corner_plans(b))
    lane_calls.clear()
    outputs(qwen3_stack.engine.in_mode(live=True), bodies)
    assert sum(lane_calls) > len(bodies) // 2, "the lane took too few calls to prove anything"
    assert not all(lane_calls), "the slow path answered no call"
    assert_lane_is_the_slow_path_and_replay(qwen3_stack.engine, bodies)


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def change(body: dict[str, Any]) -> None:
        target = body
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return change


def _drop(key: str) -> Callable[[dict[str, Any]], None]:
    return lambda body: body.pop(key, None)


def _in_prompt(change: Callable[[list[Any]], None]) -> Callable[[dict[str, Any]], None]:
    """A change to the body's prompt ids, where it still has them."""
    return lambda body: change(body["prompt_token_ids"]) if isinstance(body.get("prompt_token_ids"), list) else None


def _in_request(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """A change to the body's chat request, where it still has one."""
    return lambda body: body["chat_request"].__setitem__(key, value) if isinstance(body.get("chat_request"), dict) else None


def _in_choice(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """A change to the chunk's first choice, where it still has one."""
    return lambda body: body["generate_chunk"]["choices"][0].__setitem__(key, value) if body["generate_chunk"].get("choices") else None


# What a call of a live stream may carry that the lane must get right:
# leave to the slow path, or take and answer as it does.
VARIATIONS: dict[str, Callable[[dict[str, Any]], None]] = {
    "unknown model": _set(("model",), "no-such-model"),
    "no model": _drop("model"),
    "null model": _set(("model",), None),
    "model not a string": _set(("model",), 7),
    "an extra body field": _set(("extra",), 1),
    "prompt_tokens null": _set(("prompt_tokens",), None),
    "prompt_tokens a float": _set(("prompt_tokens",), 3.0),
    "prompt_tokens true": _set(("prompt_tokens",), True),
    "request changed": _in_request("max_tokens", 50_000),
    "request equal in Python, not in JSON": _in_request("max_tokens", 40_000.0),
    "request true for 1": _in_request("n", True),
    "request with stop strings": _in_request("stop", ["zz"]),
    "request returning token ids": _in_request("return_token_ids", True),
    "no request": _drop("chat_request"),
    "prompt changed": _in_prompt(lambda ids: ids.__setitem__(0, 13)),
    "prompt equal in Python, not in JSON": _in_prompt(lambda ids: ids.__setitem__(-1, float(ids[-1]))),
    "no prompt": _drop("prompt_token_ids"),
    "a token id as a float": _in_choice("token_ids", [1.0]),
    "a negative token id": _in_choice("token_ids", [-1]),
    "no token ids": _in_choice("token_ids", []),
    "null token ids": _in_choice("token_ids", None),
    "index as a float": _in_choice("index", 0.0),
    "index 1 of n=1": _in_choice("index", 1),
    "a stop reason": _in_choice("stop_reason", 7),
    "a finish reason": _in_choice("finish_reason", "length"),
    "an extra choice field": _in_choice("extra", 1),
    "two choices": lambda body: body["generate_chunk"]["choices"].extend(copy.deepcopy(body["generate_chunk"]["choices"][:1])),
    "no choices": _set(("generate_chunk", "choices"), []),
    "usage": _set(("generate_chunk", "usage"), {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}),
    "metrics null": _set(("generate_chunk", "metrics"), None),
    "output_mode tokens": _set(("generate_chunk", "output_mode"), "tokens"),
    "output_mode text": _set(("generate_chunk", "output_mode"), "text"),
    "chunk prompt ids": _set(("generate_chunk", "prompt_token_ids"), [1, 2]),
    "an extra chunk field": _set(("generate_chunk", "extra"), 1),
    "request id not a string": _set(("generate_chunk", "request_id"), 5),
    "stream false": _set(("stream",), False),
    "an explicit null state": _set(("stream_state",), None),
}


def varied_stream(builder: Any, data: st.DataObject) -> list[dict[str, Any]]:
    """A stream (one choice, one token per chunk, usage) with one to three
    drawn `VARIATIONS` made to drawn calls between its first and last."""
    bodies = stream_bodies(builder, [stream_plans(builder)[0]])
    changed = data.draw(st.lists(st.sampled_from(sorted(VARIATIONS)), min_size=1, max_size=3), label="variations")
    places = data.draw(st.lists(st.integers(1, len(bodies) - 2), min_size=1, max_size=3), label="calls")
    for place, name in zip(places, changed, strict=False):
        body = bodies[place] = copy.deepcopy(bodies[place])
        VARIATIONS[name](body)
    return bodies


@requires_fast("live")
@pytest.mark.parametrize("lenient", [False, True], ids=["checked", "lenient"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_variation_of_a_call_is_answered_as_the_slow_path_and_replay_answer_it(
    qwen3_stack: Stack, lenient: bool, data: st.DataObject
) -> None:
    bodies = varied_stream(qwen3_stack.builder, data)
    assert_lane_is_the_slow_path_and_replay(qwen3_stack.engine, bodies, Job(Endpoint.CHAT, stream=True, lenient=lenient))


@requires_fast("live")
def test_a_request_equal_in_python_but_not_in_json_is_validated_anew(qwen3_stack: Stack, lane_calls: list[bool]) -> None:
    """``40000.0`` equals ``40000`` in Python; the lane and the reuse of a
    validated request tell them apart, by their JSON bytes."""
    from derender_core.vllm_seam.live import KnownRequest

    known = KnownRequest.of({"max_tokens": 40_000, "n": 1}, [1, 2], object(), [1, 2])
    assert known.same({"max_tokens": 40_000, "n": 1}, [1, 2])
    assert not known.same({"max_tokens": 40_000.0, "n": 1}, [1, 2])
    assert not known.same({"max_tokens": 40_000, "n": True}, [1, 2])
    assert not known.same({"max_tokens": 40_000, "n": 1}, [1, 2.0])
    assert not known.same({"max_tokens": 40_000, "n": 1}, [True, 2])
    assert not KnownRequest.of({"t": None}, [1], object(), [1]).same({"t": math.nan}, [1])
    assert not KnownRequest.of({"t": math.inf}, [1], object(), [1]).same({"t": -math.inf}, [1])
    # Bytes with null in them (here in a string) are compared in Python too.
    assert KnownRequest.of({"t": "null", "u": None}, [1], object(), [1]).same({"t": "null", "u": None}, [1])
    assert not KnownRequest.of({"t": "null", "u": None}, [1], object(), [1]).same({"t": "null", "u": math.nan}, [1])

    b = qwen3_stack.builder
    bodies = stream_bodies(b, [stream_plans(b)[0]])
    bodies[3] = {**bodies[3], "chat_request": {**bodies[3]["chat_request"], "max_tokens": 40_000.0}}
    bodies[2] = {**bodies[2], "chat_request": {**bodies[2]["chat_request"], "max_tokens": 40_000}}
    lane_calls.clear()
    jsonl_answers(qwen3_stack.engine.in_mode(live=True), JOB, [orjson.dumps(body) for body in bodies])
    assert lane_calls[2] is False and lane_calls[3] is False  # a new request, then another one


def test_a_prompt_that_passed_is_not_checked_again_but_any_other_is(qwen3_stack: Stack) -> None:
    """Our checks remember a stream's prompt ids by their JSON bytes: the
    same list passes at once, a changed one (an id out of vocabulary,
    ``true`` for 1) is refused as before."""
    b = qwen3_stack.builder
    bodies = stream_bodies(b, [stream_plans(b)[0]])
    size = qwen3_stack.engine.vocab_size
    out_of_vocabulary = copy.deepcopy(bodies[2])
    out_of_vocabulary["prompt_token_ids"][5] = size
    boolean = copy.deepcopy(bodies[3])
    boolean["prompt_token_ids"][0] = True
    bodies[2], bodies[3] = out_of_vocabulary, boolean
    answers, _ = jsonl_answers(qwen3_stack.engine.in_mode(live=True), JOB, [orjson.dumps(body) for body in bodies])
    assert answers[2]["error"]["message"] == f"prompt_token_ids[5]: token id {size} is out of vocabulary (size {size})"
    assert answers[3]["error"]["message"].startswith("prompt_token_ids[0]: true is a boolean")
    assert all("error" not in answer for number, answer in enumerate(answers) if number not in (2, 3))


# --- the chunk's bytes ---------------------------------------------------------

texts = st.none() | st.text() | st.text(st.characters(codec=None, categories=["Cs", "Cc", "Zl", "Zp"]))


@requires_fast("live")
@settings(max_examples=300, deadline=None)
@given(role=st.none() | st.just("assistant"), content=texts, reasoning=texts,
       request_id=st.text(), model=st.text(min_size=1), index=st.integers(0, 2**31), created=st.integers(0, 2**40),
       completion=st.booleans())  # fmt: skip
def test_the_lanes_chunk_bytes_are_the_endpoints(
    role: str | None,
    content: str | None,
    reasoning: str | None,
    request_id: str,
    model: str,
    index: int,
    created: int,
    completion: bool,
) -> None:
    """The lane writes a chunk with orjson into the models' field order;
    the endpoint writes ``ChatCompletionStreamResponse(...).model_dump()``
    (or, for a completion stream, ``CompletionStreamResponse``'s, its
    text in place of the delta) with Starlette's JSONResponse (json.dumps,
    ensure_ascii off). Same bytes for any text (control characters, line
    separators, astral characters), and where one fails (a lone
    surrogate) so does the other."""
    from vllm.entrypoints.generate.base.protocol import DeltaMessage
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionResponseStreamChoice,
        ChatCompletionStreamResponse,
    )
    from vllm.entrypoints.openai.completion.protocol import CompletionResponseStreamChoice, CompletionStreamResponse

    from derender_core.protocol import Endpoint, StreamAnswer
    from derender_core.vllm_seam.live import _layout

    layout = _layout(Endpoint.COMPLETION if completion else Endpoint.CHAT)
    assert layout is not None
    delta: Any = {"role": role, "content": content, "reasoning": reasoning}
    if completion:
        delta = content or ""
        model_dump = CompletionStreamResponse(
            id=request_id, created=created, model=model,
            choices=[CompletionResponseStreamChoice(index=index, text=delta)],
        ).model_dump()  # fmt: skip
    else:
        model_dump = ChatCompletionStreamResponse(
            id=request_id, created=created, model=model,
            choices=[ChatCompletionResponseStreamChoice(index=index, delta=DeltaMessage(**delta))],
        ).model_dump()  # fmt: skip
    assert layout.fields(request_id, created, model, index, delta) == model_dump
    assert list(json.dumps(layout.fields(request_id, created, model, index, delta))) == list(json.dumps(model_dump))
    try:
        expected: bytes | None = bytes(JSONResponse(content=model_dump).body)
    except ValueError:
        expected = None
    try:
        got: bytes | None = layout.render(request_id, created, model, index, delta)
    except TypeError:
        got = None
    assert got == expected
    if got is not None:
        assert StreamAnswer(None, got, None, lambda state: b"{}").chunk == model_dump
