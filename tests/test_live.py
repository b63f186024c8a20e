"""Live streaming equals replay: every chunk and every stream_state.

Live mode keeps each parsed chat stream's parser between calls; replay is
vLLM's own per-call path, which the parity tests hold equal to the real
render server. Equality is checked call for call on every stream of the
corpus (all chunkings, n=2, finish-only tails, usage chunks, unicode, tool
calls, truncation at `length`, logprobs, hidden reasoning, "required" and
named tool choice, rejected calls mid-stream, captured states), for every
model family and both endpoints, and for any chunking under hypothesis.
Only `created` and the random tool-call id suffix are normalised.
"""

from __future__ import annotations

import gc
import json
import weakref
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from derender_core import DerenderEngine, Endpoint
from derender_core.batch import Job, RecordProcessor
from derender_core.records import Record
from tests.conftest import Stack
from tests.helpers import ParserSteps, jsonl_answers, normalize, requires_fast, server_stream_answers
from tests.sample_inputs import (
    WEATHER_TOOL,
    StreamPlan,
    chunks_of,
    completion_stream_plans,
    generate_chunks,
    parser_corner_plans,
    split_unicode_text,
    stream_bodies,
    stream_body,
    stream_plans,
    with_rejected_calls,
)


def answers(engine: DerenderEngine, endpoint: Endpoint, bodies: list[Any]) -> list[Any]:
    lines = [orjson.dumps(body) for body in bodies]
    return jsonl_answers(engine, Job(endpoint, stream=True), lines)[0]


def assert_live_equals_replay(engine: DerenderEngine, endpoint: Endpoint, bodies: list[Any]) -> list[Any]:
    live = answers(engine.in_mode(live=True), endpoint, bodies)
    replay = answers(engine.in_mode(live=False), endpoint, bodies)
    for number, (live_answer, replay_answer) in enumerate(zip(live, replay, strict=True), start=1):
        assert normalize(live_answer) == normalize(replay_answer), f"call {number}"
    return live


def chat_corpus(stack: Stack) -> list[Any]:
    b = stack.builder
    bodies = stream_bodies(b, stream_plans(b) + parser_corner_plans(b))
    rejected = with_rejected_calls(bodies, "stream-tool-call")
    # A captured call: the 5th call of stream-n2 with the state replay gave
    # the call before it on its index, as a body that brings its own state.
    n2 = [body for body in bodies if body["generate_chunk"]["request_id"] == "stream-n2"]
    states = answers(stack.engine.in_mode(live=False), Endpoint.CHAT, n2[:4])
    index = n2[4]["generate_chunk"]["choices"][0]["index"]
    previous = max(i for i in range(4) if n2[i]["generate_chunk"]["choices"][0]["index"] == index)
    captured = {**n2[4], "generate_chunk": {**n2[4]["generate_chunk"], "request_id": "stream-captured"},
                "stream_state": states[previous]["stream_state"]}  # fmt: skip
    return bodies + [captured] + [{**body, "generate_chunk": {**body["generate_chunk"], "request_id": "rejected"}}
                                  for body in rejected]  # fmt: skip


def deltas(answers: list[Any], field: str) -> list[Any]:
    return [
        choice["delta"][field]
        for answer in answers
        if "chunk" in answer
        for choice in answer["chunk"]["choices"]
        if choice["delta"].get(field)
    ]


@requires_fast("live")
def test_chat_streams_live_equal_replay(stack: Stack) -> None:
    bodies = chat_corpus(stack)
    live = assert_live_equals_replay(stack.engine, Endpoint.CHAT, bodies)
    # The corpus reaches what it is meant to reach.
    assert deltas(live, "tool_calls"), "no tool call was streamed"
    if stack.builder.family.reasoning is not None:
        assert deltas(live, "reasoning"), "no reasoning was streamed"
    errors = [answer for answer in live if "error" in answer]
    assert len(errors) == 6  # the rejected calls, and only them
    with_logprobs = [a for a in live if "chunk" in a and any(c["logprobs"] for c in a["chunk"]["choices"])]
    assert with_logprobs


@requires_fast("live")
def test_completion_streams_live_equal_replay(stack: Stack) -> None:
    bodies = stream_bodies(stack.builder, completion_stream_plans(stack.builder))
    live = assert_live_equals_replay(stack.engine, Endpoint.COMPLETION, bodies)
    assert all("error" not in answer for answer in live)


@requires_fast("live")
def test_live_steps_each_chunk_once(qwen3_stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    """Live mode and the fast replay step the parser once per chunk; vLLM's
    replay steps the whole history again on every call."""
    steps = ParserSteps(monkeypatch)
    plan = stream_plans(qwen3_stack.builder)[0]  # one choice, one token per chunk
    bodies = stream_bodies(qwen3_stack.builder, [plan])
    chunks = len(plan.choices[0])
    answers(qwen3_stack.engine.in_mode(live=True), Endpoint.CHAT, bodies)
    assert steps.count == chunks
    steps.count = 0
    answers(qwen3_stack.engine.in_mode(live=False, replay="reference"), Endpoint.CHAT, bodies)
    # vLLM's replay: call k replays k - 1 chunks and steps its own; the
    # usage-only chunk at the end replays all of them.
    assert steps.count == chunks * (chunks + 1) // 2 + chunks
    steps.count = 0
    answers(qwen3_stack.engine.in_mode(live=False, replay="fast"), Endpoint.CHAT, bodies)
    # The fast replay steps each chunk once, going on from each call's
    # answer; the second call first rebuilds the first's one chunk from the
    # state vLLM's replay answered, and the usage-only call after the finish
    # is vLLM's replay of all of them (a finished stream does not go on).
    assert steps.count == chunks + 1 + chunks


@requires_fast("live")
def test_live_state_is_freed_when_its_stream_completes(qwen3_stack: Stack) -> None:
    plan = stream_plans(qwen3_stack.builder)[0]
    bodies = stream_bodies(qwen3_stack.builder, [plan])
    processor = RecordProcessor(qwen3_stack.engine.in_mode(live=True), Job(Endpoint.CHAT, stream=True))
    outcome = processor.process(Record(1, 1, bodies[0]))
    stream = weakref.ref(outcome.answer.stream_state.stream)
    del outcome
    for number, body in enumerate(bodies[1:], start=2):
        completed = processor.process(Record(number, number, body)).completed
    assert completed and len(processor.ledger) == 0
    gc.collect()
    assert stream() is None


# --- states carry across modes and servers ----------------------------------


def tool_call_bodies(stack: Stack) -> list[Any]:
    plan = stream_plans(stack.builder)[0]
    return stream_bodies(stack.builder, [plan])


def threaded_through_server(stack: Stack, bodies: list[Any], state: Any) -> list[Any]:
    """The server's answers to a single-choice stream's calls, threading
    from `state`."""
    out = []
    for body in bodies:
        response = stack.server.post(Endpoint.CHAT, {**body, "stream_state": state} if state else body)
        answer = response.json()
        out.append(answer)
        if response.status_code == 200 and body["generate_chunk"]["choices"]:
            state = answer["stream_state"]
    return out


SPLITS = [0.0, 0.4, 0.95]
"""Where a stream changes hands, as a share of its calls (at least one
call on each side)."""


def split_at(bodies: list[Any], share: float) -> int:
    return min(max(1, int(len(bodies) * share)), len(bodies) - 1)


@pytest.mark.server
@pytest.mark.parametrize("share", SPLITS)
def test_stream_begun_live_is_finished_by_the_server(stack: Stack, share: float) -> None:
    bodies = tool_call_bodies(stack)
    split = split_at(bodies, share)
    expected = server_stream_answers(stack.server, Endpoint.CHAT, bodies)
    head = answers(stack.engine.in_mode(live=True), Endpoint.CHAT, bodies[:split])
    tail = threaded_through_server(stack, bodies[split:], head[-1]["stream_state"])
    assert normalize(head + tail) == normalize([answer for _, answer in expected])


@pytest.mark.server
@pytest.mark.parametrize("share", SPLITS)
def test_stream_begun_on_the_server_is_finished_live(stack: Stack, share: float) -> None:
    bodies = tool_call_bodies(stack)
    split = split_at(bodies, share)
    expected = server_stream_answers(stack.server, Endpoint.CHAT, bodies)
    head = threaded_through_server(stack, bodies[:split], None)
    resumed = [{**bodies[split], "stream_state": head[-1]["stream_state"]}, *bodies[split + 1 :]]
    tail = answers(stack.engine.in_mode(live=True), Endpoint.CHAT, resumed)
    assert normalize(head + tail) == normalize([answer for _, answer in expected])


# --- any chunking --------------------------------------------------------------


@pytest.fixture(scope="module")
def chunking_texts(stack: Stack) -> Iterator[list[str]]:
    b = stack.builder
    yield [
        b.answer("Checking now.\n", reasoning="Call the tool.", tool=("get_weather", {"city": "Zürich"})),
        b.answer(split_unicode_text(), reasoning="Symbols."),
    ]


@requires_fast("live")
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.data(),
    n=st.integers(1, 2),
    finish_only_tail=st.booleans(),
    finish_reason=st.sampled_from(["stop", "length"]),
)
def test_any_chunking_is_the_same_live_and_replayed(
    stack: Stack, chunking_texts: list[str], data: st.DataObject, n: int, finish_only_tail: bool, finish_reason: str
) -> None:
    b = stack.builder
    messages = [{"role": "user", "content": "What's the weather in Zürich?"}]
    choices = []
    for _ in range(n):
        text = data.draw(st.sampled_from(chunking_texts))
        sizes = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=4))
        ids = b.encode(text) + ([b.family.eos_id] if finish_reason == "stop" else [])
        choices.append(chunks_of(ids, sizes))
    plan = StreamPlan(
        request_id="chunked",
        prompt=b.prompt_ids(messages, [WEATHER_TOOL]),
        request=b.chat_request(messages, tools=[WEATHER_TOOL], n=n, stream=True,
                               stream_options={"include_usage": True}),  # fmt: skip
        choices=choices,
        finish_only_tail=finish_only_tail,
        finish_reason=finish_reason,
        usage=data.draw(st.booleans()),
    )
    bodies = [stream_body(plan, chunk, b.family.served_name) for chunk in generate_chunks(plan)]
    assert_live_equals_replay(stack.engine, Endpoint.CHAT, bodies)


@pytest.mark.server
@pytest.mark.parametrize("endpoint", [Endpoint.CHAT, Endpoint.COMPLETION])
def test_an_explicit_null_state_starts_the_stream_afresh_as_on_the_server(qwen3_stack: Stack, endpoint: Endpoint) -> None:
    """A body with ``"stream_state": null`` is a fresh start for the server
    (the role again, ``output_chunk_lens`` [1]); a missing state is not:
    the client's threaded one goes with it. Every later call threads from
    the fresh start's answer, live and replayed alike."""
    b = qwen3_stack.builder
    plans = stream_plans(b)[:1] if endpoint is Endpoint.CHAT else completion_stream_plans(b)[:1]
    bodies = stream_bodies(b, plans)
    middle = len(bodies) // 2
    bodies[middle] = {**bodies[middle], "stream_state": None}
    expected = [answer for _, answer in server_stream_answers(qwen3_stack.server, endpoint, bodies)]
    if endpoint is Endpoint.CHAT:
        assert expected[middle]["stream_state"]["output_chunk_lens"] == [len(bodies[middle]["generate_chunk"]["choices"][0]["token_ids"])]
        assert expected[middle]["chunk"]["choices"][0]["delta"]["role"] == "assistant"
    for live in (True, False):
        got = answers(qwen3_stack.engine.in_mode(live=live), endpoint, bodies)
        assert normalize(got) == normalize(expected), f"live={live}"


@pytest.mark.server
@pytest.mark.parametrize("endpoint", [Endpoint.CHAT, Endpoint.COMPLETION])
@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity"])
def test_a_non_finite_prompt_after_a_null_one_is_refused_as_on_the_server(
    qwen3_stack: Stack, endpoint: Endpoint, number: str
) -> None:
    """A stream's first call sends ``"prompt_token_ids": null``, the next
    NaN or an infinity. The live engine remembers a stream's request and
    prompt by their JSON bytes, and orjson writes all four as ``null``:
    the later call must still be validated, and refused as the server
    refuses it (``Input should be a valid list``). Each call brings its
    own (null) state, so no threading differs between the two sides."""
    b = qwen3_stack.builder
    plans = stream_plans(b)[:1] if endpoint is Endpoint.CHAT else completion_stream_plans(b)[:1]
    first, second = stream_bodies(b, plans)[:2]
    mark = '"a number JSON has no literal for"'
    lines = [
        json.dumps({**first, "prompt_token_ids": None, "stream_state": None}).encode(),
        json.dumps({**second, "prompt_token_ids": json.loads(mark), "stream_state": None}).replace(mark, number).encode(),
    ]
    expected = [qwen3_stack.server.post_raw(endpoint, line) for line in lines]
    assert expected[1].status_code == 400 and "valid list" in expected[1].text, expected[1].text
    for live in (True, False):
        got = jsonl_answers(qwen3_stack.engine.in_mode(live=live), Job(endpoint, stream=True), lines)[0]
        assert normalize(got) == normalize([response.json() for response in expected]), f"live={live}"


@requires_fast("live")
@pytest.mark.parametrize("as_ids", [None, True, False])
def test_odd_ids_and_tokens_as_ids_are_the_same_live_and_replayed(qwen3_stack: Stack, as_ids: bool | None) -> None:
    """What vLLM 0.34 changed in the parsed stream's decode, live and
    replayed alike: the detokenizer window carried as ids (seeded from a
    prompt tail ending in a special token, read back as pieces), ids past the vocabulary skipped in a chunk, and
    logprob tokens as ``token_id:N`` where the request asks (0.33 has
    none of these and must still agree with itself)."""
    b = qwen3_stack.builder
    vocab = qwen3_stack.engine.vocab_size
    messages = [{"role": "user", "content": "Say hi."}]
    prompt = [*b.prompt_ids(messages), b.family.eos_id]
    text = b.encode(b.answer("Hi ünïcödé 🌍 there."))
    ids = [*text[:3], vocab + 7, *text[3:6], 10**6, *text[6:], b.family.eos_id]
    request = b.chat_request(messages, stream=True, logprobs=True, top_logprobs=1)
    if as_ids is not None:
        request["return_tokens_as_token_ids"] = as_ids
    plan = StreamPlan(
        request_id="odd-ids", prompt=prompt, request=request, choices=[chunks_of(ids, [2, 3, 1, 4])], logprobs=True
    )
    bodies = [stream_body(plan, chunk, b.family.served_name) for chunk in generate_chunks(plan)]
    live = assert_live_equals_replay(qwen3_stack.engine, Endpoint.CHAT, bodies)
    tokens = [
        entry["token"]
        for answer in live
        if "chunk" in answer
        for choice in answer["chunk"]["choices"]
        for entry in (choice["logprobs"] or {}).get("content") or ()
    ]
    assert tokens, [answer for answer in live if "error" in answer]
    written_as_ids = all(token.startswith("token_id:") for token in tokens)
    assert written_as_ids == (bool(as_ids) and _tokens_as_ids_supported()), tokens


def _tokens_as_ids_supported() -> bool:
    """Whether the installed vLLM's derender writes logprob tokens as ids
    on request (0.34 on)."""
    from vllm.renderers.online_derenderer import OnlineDerenderer

    return hasattr(OnlineDerenderer, "_return_tokens_as_token_ids")
