"""The serve path (`--flavor serve`): `vllm serve`'s own stack on a scripted
engine core.

The oracle is `vllm serve` itself: vLLM's API server entry point, run as a
process on 127.0.0.1 with the same flags, its engine core playing a tape of
the record's engine steps (`tests.serve_oracle`). Each request goes to it
over HTTP as a client sends it, with the record's request id as
``X-Request-Id``; its SSE bytes and JSON bodies must equal the serve path's,
normalising only ``created`` and the random tool-call ids.

The engine steps come from the record: one token per step for one-shot
bodies, one chunk per step for streams, a finish-only tail folded into its
choice's previous step, and a stop string left for the output processor to
find. Separate tests check the serve path's own stop handling against
vLLM's documented behaviour, its prompt against the render endpoint's, and
its logprobs against the derender endpoint's.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import importlib
import inspect
import io
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import tokenizers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from derender_core import Endpoint, ServeEngine
from derender_core.batch import Job
from derender_core.parity import DERENDER_MODES, Chunking, Parity, requests_of
from derender_core.protocol import DERENDER_ENDPOINTS, WINDOW, FramesAnswer
from derender_core.records import Record
from derender_core.vllm_seam import serve
from derender_core.vllm_seam.stack import prepare_environment
from derender_core.vllm_seam.versions import installed, proven
from derender_core.writers import AssembledWriter, JsonlWriter, SseWriter
from tests.conftest import ServeStack, Stack
from tests.helpers import (
    SAMPLE,
    jsonl_answers,
    normalize,
    normalized_bytes,
    one_token_a_step,
    requires_fast,
    run_cli,
    run_lines,
    transcript_name,
)
from tests.parity_corpus import corpus_bodies
from tests.sample_inputs import (
    SampleBuilder,
    StreamPlan,
    chat_bodies,
    chunks_of,
    completion_bodies,
    completion_stream_plans,
    family_plans,
    generate_chunks,
    one_shot_body,
    parser_corner_plans,
    stream_bodies,
    stream_plans,
    with_rejected_calls,
)
from tests.serve_oracle import one_shot_steps, oracle_body, stream_steps

# --- the corpus ----------------------------------------------------------------


def one_shot_chat_corpus(b: SampleBuilder) -> list[dict[str, Any]]:
    eos = b.family.eos_id
    messages = [{"role": "user", "content": "hi"}]
    prompt = b.prompt_ids(messages)
    hello = b.encode(b.answer("Hello there!", reasoning="Greet back.")) + [eos]

    def body(request_id: str, ids: list[int], stop_reason: int | None = None, **request: Any) -> dict[str, Any]:
        choice = {"index": 0, "token_ids": ids, "stop_reason": stop_reason}
        return {
            "generate_response": {"request_id": request_id, "choices": [choice]},
            "prompt_token_ids": prompt,
            "chat_request": b.chat_request(messages, **request),
        }

    return [
        *chat_bodies(b),
        body("hidden-reasoning", hello, include_reasoning=False),
        body("token-ids", hello, return_token_ids=True),
        body("stop-token-id", hello[:-1], stop_reason=hello[-2], stop_token_ids=[hello[-2]]),
    ]


def chat_stream_corpus(b: SampleBuilder) -> list[StreamPlan]:
    return [*stream_plans(b), *parser_corner_plans(b)]


def one_shot_completion_corpus(b: SampleBuilder) -> list[dict[str, Any]]:
    return [body for body in completion_bodies(b) if len(body["generate_responses"]) == 1]


# --- equality with `vllm serve` over HTTP -----------------------------------


def test_serve_seam_names_exist() -> None:
    """The private vLLM 0.33 names the serve path drives, as it calls them."""
    prepare_environment()  # before vLLM picks its platform
    for module_name, path in serve.SEAM_NAMES:
        target: Any = importlib.import_module(module_name)
        for part in path.split("."):
            assert hasattr(target, part), f"{module_name}.{path} is gone"
            target = getattr(target, part)
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.sched.utils import check_stop
    from vllm.v1.engine.core_client import EngineCoreClient

    assert list(inspect.signature(Scheduler._update_request_with_output).parameters) == [
        "self", "request", "new_token_ids", "is_stale",
    ]  # fmt: skip
    assert list(inspect.signature(check_stop).parameters) == ["request", "max_model_len"]
    assert isinstance(EngineCoreClient.__dict__["make_async_mp_client"], staticmethod)
    import asyncio

    loop = asyncio.new_event_loop()
    assert hasattr(loop, "_ready"), "asyncio's ready queue, read to know a step is answered"
    loop.close()


@pytest.mark.parametrize("endpoint", list(DERENDER_ENDPOINTS))
def test_one_shot_equals_vllm_serve(qwen3_serve: ServeStack, endpoint: Endpoint) -> None:
    b = qwen3_serve.builder
    if endpoint is Endpoint.CHAT:
        bodies = one_shot_chat_corpus(b)
        responses = [body["generate_response"] for body in bodies]
    else:
        bodies = one_shot_completion_corpus(b)
        responses = [body["generate_responses"][0] for body in bodies]
    answers, code = jsonl_answers(qwen3_serve.engine, Job(endpoint), [orjson.dumps(x) for x in bodies])
    assert code == 0, answers
    for body, response, answer in zip(bodies, responses, answers, strict=True):
        http = qwen3_serve.oracle.request(
            endpoint,
            response["request_id"],
            oracle_body(body[endpoint.request_key], stream=False),
            one_shot_steps(response["choices"]),
        )
        assert http.status_code == 200, http.text
        assert normalized_bytes(orjson.dumps(answer)) == normalized_bytes(orjson.dumps(http.json()))
        prefix = "chatcmpl-" if endpoint is Endpoint.CHAT else "cmpl-"
        assert answer["id"] == prefix + response["request_id"]


@pytest.mark.parametrize("endpoint", list(DERENDER_ENDPOINTS))
def test_streams_equal_vllm_serve_sse(qwen3_serve: ServeStack, endpoint: Endpoint, tmp_path: Path) -> None:
    b = qwen3_serve.builder
    plans = chat_stream_corpus(b) if endpoint is Endpoint.CHAT else completion_stream_plans(b)
    bodies = stream_bodies(b, plans)
    report = run_lines(
        qwen3_serve.engine,
        Job(endpoint, stream=True),
        [orjson.dumps(x) for x in bodies],
        SseWriter(directory=tmp_path),
    )
    assert report.errors == 0
    for plan in plans:
        http = qwen3_serve.oracle.request(
            endpoint,
            plan.request_id,
            oracle_body(plan.request, stream=True),
            stream_steps(generate_chunks(plan)),
        )
        assert http.status_code == 200
        ours = (tmp_path / transcript_name(plan.request_id)).read_bytes()
        assert normalized_bytes(ours) == normalized_bytes(http.content), plan.request_id


def _say_hi(b: SampleBuilder, request_id: str, text: str, sizes: list[int], *, finish_only_tail: bool = False) -> StreamPlan:
    """A streamed request to say hi (thinking off, usage asked for),
    answered with `text` and the eos id in chunks of `sizes`."""
    messages = [{"role": "user", "content": "Say hi."}]
    return StreamPlan(
        request_id=request_id,
        prompt=b.prompt_ids(messages, **b.family.thinking_off),
        request=b.chat_request(
            messages, chat_template_kwargs=b.family.thinking_off, stream=True, stream_options={"include_usage": True},
        ),  # fmt: skip
        choices=[chunks_of(b.encode(text) + [b.family.eos_id], sizes)],
        finish_only_tail=finish_only_tail,
    )


def test_each_call_answers_the_frames_serve_sent_for_it(qwen3_serve: ServeStack) -> None:
    """A chunk is held until its choice's next chunk, so call k answers
    chunk k - 1's frames; a finish-only tail finishes the held step, which
    carries finish_reason on the last token's frame, then the usage."""
    b = qwen3_serve.builder
    bodies = stream_bodies(b, [_say_hi(b, "tail", "Hi there, friend!", [2], finish_only_tail=True)])
    answers = [qwen3_serve.engine.post(Endpoint.CHAT, body) for body in bodies]
    assert all(isinstance(a, FramesAnswer) for a in answers)
    frames = [[json.loads(p) for p in a.payloads] for a in answers]
    assert frames[0] == []  # held
    assert frames[1][0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert frames[1][1]["choices"][0]["delta"]["content"] == "Hi there"
    tail, usage_call = frames[-2], frames[-1]
    assert [c["choices"][0]["delta"] for c in tail[:-1]] == [{"content": "!"}]
    assert tail[0]["choices"][0]["finish_reason"] == "stop"  # on the last token's frame
    assert tail[-1]["choices"] == [] and tail[-1]["usage"]["completion_tokens"] == 6
    assert usage_call == []

    # As output: a JSON line per call holds serve's chunks, byte for byte;
    # the SSE transcript is the frames; assembled, the stream reads as the
    # content serve sent.
    jsonl, sse, assembled = io.BytesIO(), io.BytesIO(), io.BytesIO()
    lines = [orjson.dumps(x) for x in bodies]
    job = Job(Endpoint.CHAT, stream=True)
    run_lines(qwen3_serve.engine, job, lines, JsonlWriter(jsonl))
    run_lines(qwen3_serve.engine, job, lines, SseWriter(sse))
    run_lines(qwen3_serve.engine, job, lines, AssembledWriter(assembled, Endpoint.CHAT, qwen3_serve.engine.chat_response))
    calls = jsonl.getvalue().splitlines()
    assert len(calls) == len(bodies) and calls[0] == b'{"chunks":[]}'
    events = [line.removeprefix(b"data: ") for line in sse.getvalue().split(b"\n\n") if line]
    assert events[-1] == b"[DONE]"
    in_calls = [chunk for call in calls for chunk in json.loads(normalized_bytes(call))["chunks"]]
    assert in_calls == [json.loads(normalized_bytes(event)) for event in events[:-1]]
    message = json.loads(assembled.getvalue())["choices"][0]["message"]
    assert (message["role"], message["content"]) == ("assistant", "Hi there, friend!")


def test_a_streams_request_is_validated_once(qwen3_serve: ServeStack, monkeypatch: pytest.MonkeyPatch) -> None:
    """Serve reads a stream's request once, when it opens, so the serve path
    validates it on the stream's first call and only the rest of each later
    call whose request and prompt ids are the first call's (the `requests`
    fast path). What every call answers is what it answers with each call
    validated whole, and a later call whose request changed (here to one
    that does not validate) is validated whole again."""
    if not proven("requests"):
        pytest.skip("the requests fast path is off on this vLLM")
    b = qwen3_serve.builder
    bodies = copy.deepcopy(stream_bodies(b, chat_stream_corpus(b)))
    for body in bodies:  # ids no earlier test's stream had on this engine
        body["generate_chunk"]["request_id"] = "once-" + body["generate_chunk"]["request_id"]
    streams = _streams_by_request(bodies)
    edited = copy.deepcopy(streams[0][1])
    edited["chat_request"] = {**edited["chat_request"], "n": "two"}
    bodies = [body for stream in streams for body in stream]
    bodies.insert(bodies.index(streams[0][1]) + 1, edited)
    engine = qwen3_serve.engine
    validated: list[Any] = []
    whole = engine._validated
    monkeypatch.setattr(engine, "_validated", lambda endpoint, body: validated.append(body) or whole(endpoint, body))

    kept = _seen([engine.post(Endpoint.CHAT, copy.deepcopy(body)) for body in bodies])
    assert len(validated) == len(streams) + 1  # each stream's first call, and the edited one
    assert kept[bodies.index(edited)][0] == 400
    validated.clear()
    monkeypatch.setattr(engine, "_keeps_stream_requests", lambda: False)
    assert _seen([engine.post(Endpoint.CHAT, copy.deepcopy(body)) for body in bodies]) == kept
    assert len(validated) == len(bodies)


# --- a stream's usual call without validation (fast path serve_lane) ------------
#
# A stream's call of one choice of ids, no finish, stop reason or
# logprobs, whose request and prompt ids are its first call's, goes to the
# stream without the per-call validation (`ServeEngine._usual_chunk`).
# These tests hold every answer to the one the same call gets validated
# (the lane off), findings and lateness included, and count the calls the
# lane took, so that they would fail if it took none.


@contextlib.contextmanager
def _lane_off(engine: serve.ServeEngine) -> Iterator[None]:
    """Every call of `engine` validated while active (``serve_lane`` off)."""
    was, engine._lane_on = engine._lane_on, False
    try:
        yield
    finally:
        engine._lane_on = was


def _lane_as_validated(engine: serve.ServeEngine, work: list[tuple[Endpoint, list[Any]]], window: int) -> int:
    """Each script answered as with the lane off, in a window and alone;
    how many calls the lane took."""
    usual = engine._usual_chunk
    taken = []

    def counted(endpoint: Endpoint, body: Any) -> Any:
        found = usual(endpoint, body)
        if found is not None:
            taken.append(found)
        return found

    with _lane_off(engine):
        validated = [_seen(answers) for answers in engine.drive((_calls(e, b) for e, b in work), window=1)]
    engine._usual_chunk = counted  # type: ignore[method-assign]
    try:
        for size in (1, window):
            laned = [_seen(answers) for answers in engine.drive((_calls(e, b) for e, b in copy.deepcopy(work)), window=size)]
            assert laned == validated, size
    finally:
        del engine._usual_chunk
    return len(taken)


@requires_fast("serve_lane", "requests")
def test_usual_calls_answer_as_validated(qwen3_serve: ServeStack) -> None:
    """The stream corpora (chat and completions, n > 1, logprobs, tool
    calls, finish-only tails), the sample's streams, and calls the server
    rejects between a stream's calls."""
    b = qwen3_serve.builder
    chat = _streams_by_request(stream_bodies(b, chat_stream_corpus(b)))
    completion = _streams_by_request(stream_bodies(b, completion_stream_plans(b)))
    sample = _streams_by_request([json.loads(line) for line in (SAMPLE / "stream.jsonl").read_text().splitlines()])
    first = chat[0]
    rejected = with_rejected_calls(first, first[0]["generate_chunk"]["request_id"])
    work = _scripts_of(Endpoint.CHAT, [], [*chat, *sample, rejected]) + _scripts_of(Endpoint.COMPLETION, [], completion)
    calls = sum(len(bodies) for _, bodies in work)
    assert _lane_as_validated(qwen3_serve.engine, work, window=32) > calls // 2
    # A body the lane takes, posted to a render endpoint, is a request to
    # render there (an error, here), never a stream call.
    engine = qwen3_serve.engine
    taken = [(e.render, body) for e, bodies in work for body in bodies if engine._usual_chunk(e, body) is not None]
    some = [call for kind in (Endpoint.RENDER_CHAT, Endpoint.RENDER_COMPLETION) for call in taken if call[0] is kind][::20]
    rendered = [_seen([engine.post(endpoint, body)]) for endpoint, body in some]
    with _lane_off(engine):
        assert rendered == [_seen([engine.post(endpoint, body)]) for endpoint, body in some]
    assert {endpoint for endpoint, _ in some} == {Endpoint.RENDER_CHAT, Endpoint.RENDER_COMPLETION}
    assert all(status >= 400 for ((status, *_),) in rendered)


_NOT_IDS: list[Any] = [None, [], [2**40], [1.0], ["1"], [True], [-1], "1", {}]
_ODD: dict[str, list[Any]] = {
    "index": [1, 5, -1, True, "0", 0.0, None],
    "token_ids": _NOT_IDS,
    "finish_reason": [None, "stop", "length", "abort", 3],
    "stop_reason": [None, 7, "END", 1.5],
    "logprobs": [None, {}, {"content": None}, []],
}
"""A choice's values, the usual among them, drawn in place of a call's."""


@st.composite
def _drawn_calls(draw: st.DrawFn, bodies: list[dict[str, Any]], model: str) -> list[dict[str, Any]]:
    """A stream's calls, each after the first maybe changed: a choice's
    field, the chunk's or the body's (their values the usual ones or not),
    the request or prompt ids another's, the stream's own state field."""
    calls = copy.deepcopy(bodies)
    for body in calls[1:]:
        for _ in range(draw(st.integers(0, 2))):
            where = draw(st.sampled_from(["choice", "chunk", "body", "request", "prompt"]))
            chunk = body["generate_chunk"]
            choices = chunk.get("choices")
            if where == "choice" and isinstance(choices, list) and choices and isinstance(choices[0], dict):
                key = draw(st.sampled_from(sorted(_ODD)))
                chunk["choices"][0][key] = draw(st.sampled_from(_ODD[key]))
            elif where == "chunk":
                key = draw(st.sampled_from(["prompt_token_ids", "usage", "output_mode", "extra", "choices"]))
                chunk[key] = draw(st.sampled_from([None, [1, 2], "tokens", 3, []]))
            elif where == "body":
                key = draw(st.sampled_from(["model", "prompt_tokens", "stream_state", "stream", "extra"]))
                body[key] = draw(st.sampled_from([None, "nope", model, 3, "3", True, 1, {}]))
            elif where == "request":
                body["chat_request"] = {**body["chat_request"], "temperature": draw(st.sampled_from([0.5, 1, "x"]))}
            else:
                body["prompt_token_ids"] = draw(st.sampled_from([None, [], bodies[0]["prompt_token_ids"][:-1], [1.0]]))
    return calls


@requires_fast("serve_lane", "requests")
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_drawn_calls_answer_as_validated(qwen3_serve: ServeStack, data: st.DataObject) -> None:
    """Drawn changes to a stream's later calls, of the lane's fields or
    beside them: each call's answer is the one it gets validated."""
    b = qwen3_serve.builder
    plan = _say_hi(b, "drawn-lane", "Hi there, friend! Bye.", [1, 2])
    calls = data.draw(_drawn_calls(stream_bodies(b, [plan]), b.family.served_name))
    _lane_as_validated(qwen3_serve.engine, [(Endpoint.CHAT, calls)], window=2)


# --- known serve behaviour --------------------------------------------------------


def test_prompt_is_the_render_endpoints(qwen3_stack: Stack, qwen3_serve: ServeStack) -> None:
    """The record's prompt ids are what `/v1/chat/completions/render` gives
    for its request, and the serve path checks its own rendering against
    them: a record whose prompt differs gets an error record."""
    b = qwen3_serve.builder
    cases = [(body["chat_request"], body["prompt_token_ids"]) for body in one_shot_chat_corpus(b)]
    cases += [(plan.request, plan.prompt) for plan in chat_stream_corpus(b)]
    for request, prompt in cases:
        assert qwen3_stack.server.rendered_prompt(request) == prompt
    body = copy.deepcopy(next(chat_bodies(b)))
    body["prompt_token_ids"][5] += 1
    answer = qwen3_serve.engine.post(Endpoint.CHAT, body)
    assert answer.status == 400
    assert "serve renders this request to 171 prompt tokens" in answer.error_message
    assert "differ from token 5 on" in answer.error_message


def _findings_of(serve_stack: ServeStack, post: Any) -> tuple[Any, list[serve.StopFinding]]:
    before = len(serve_stack.engine.findings)
    result = post()
    return result, serve_stack.engine.findings[before:]


def _hello_body(b: SampleBuilder, request_id: str, ids: list[int], finish: str, **request: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": "Count to three, then say END."}]
    return {
        "generate_response": {
            "request_id": request_id,
            "choices": [{"index": 0, "token_ids": ids, "finish_reason": finish, **request.pop("choice", {})}],
        },
        "prompt_token_ids": b.prompt_ids(messages, **b.family.thinking_off),
        "chat_request": b.chat_request(messages, chat_template_kwargs=b.family.thinking_off, **request),
    }


def test_stop_token_and_stop_token_ids(qwen3_serve: ServeStack) -> None:
    b = qwen3_serve.builder
    ids = b.encode("One, two, three.")
    eos = _hello_body(b, "eos", [*ids, b.family.eos_id], "stop")
    answer, findings = _findings_of(qwen3_serve, lambda: qwen3_serve.engine.post(Endpoint.CHAT, eos))
    choice = answer.body["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"], choice["stop_reason"]) == (
        "One, two, three.", "stop", None,
    )  # fmt: skip
    assert findings == []
    # A stop token id from the request: serve reports it as stop_reason.
    stop_id = ids[-1]
    listed = _hello_body(b, "stop-id", ids, "stop", stop_token_ids=[stop_id], choice={"stop_reason": stop_id})
    answer, findings = _findings_of(qwen3_serve, lambda: qwen3_serve.engine.post(Endpoint.CHAT, listed))
    choice = answer.body["choices"][0]
    assert (choice["message"]["content"], choice["stop_reason"]) == ("One, two, three", stop_id)
    assert findings == []


def test_stop_string_one_shot_and_streamed(qwen3_serve: ServeStack, qwen3_stack: Stack) -> None:
    """Serve cuts the stop string in both modes; the derender endpoint
    refuses stop strings when streaming."""
    b = qwen3_serve.builder
    ids = b.encode("One, two, three. END")
    body = _hello_body(b, "stop-string", ids, "stop", stop=["END"], choice={"stop_reason": "END"})
    answer = qwen3_serve.engine.post(Endpoint.CHAT, body)
    choice = answer.body["choices"][0]
    assert (choice["message"]["content"], choice["stop_reason"]) == ("One, two, three. ", "END")

    request = {**body["chat_request"], "stream": True}
    plan = StreamPlan("stop-string-stream", body["prompt_token_ids"], request, [chunks_of(ids, [1])], usage=False)
    chunks = generate_chunks(plan)
    chunks[-1]["choices"][0]["stop_reason"] = "END"
    streamed = [{"stream": True, "generate_chunk": c, "prompt_token_ids": plan.prompt, "chat_request": request}
                for c in chunks]  # fmt: skip
    answers = [qwen3_serve.engine.post(Endpoint.CHAT, x) for x in streamed]
    deltas = [c["choices"][0] for a in answers for c in a.chunks if c["choices"]]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == "One, two, three. "
    assert (deltas[-1]["finish_reason"], deltas[-1]["stop_reason"]) == ("stop", "END")
    refused = qwen3_stack.engine.post(Endpoint.CHAT, streamed[0])
    assert refused.status == 400 and "stop strings are not supported" in refused.error_message


def test_length_and_a_disagreeing_record(qwen3_serve: ServeStack) -> None:
    """max_tokens reached: finish "length", as vLLM's stop logic decides. A
    record cut at "length" below max_tokens keeps its finish, and the
    disagreement is a finding."""
    b = qwen3_serve.builder
    ids = b.encode("One, two, three. Four, five.")
    capped = _hello_body(b, "capped", ids, "length", max_tokens=len(ids))
    answer, findings = _findings_of(qwen3_serve, lambda: qwen3_serve.engine.post(Endpoint.CHAT, capped))
    assert answer.body["choices"][0]["finish_reason"] == "length"
    assert findings == []
    early = _hello_body(b, "early", ids, "length", max_tokens=len(ids) + 5)
    answer, findings = _findings_of(qwen3_serve, lambda: qwen3_serve.engine.post(Endpoint.CHAT, early))
    assert answer.body["choices"][0]["finish_reason"] == "length"
    assert answer.body["usage"]["completion_tokens"] == len(ids)
    assert [str(f) for f in findings] == [
        f"request 'early' choice 0: the record has length at token {len(ids)}, "
        f"vLLM's stop logic has not finished at token {len(ids)}"
    ]
    late = _hello_body(b, "late", ids, "length", max_tokens=len(ids) - 2)
    answer, findings = _findings_of(qwen3_serve, lambda: qwen3_serve.engine.post(Endpoint.CHAT, late))
    assert answer.body["usage"]["completion_tokens"] == len(ids)
    assert [(f.recorded, f.vllm) for f in findings] == [
        (f"not finished at token {len(ids) - 2}", f"length at token {len(ids) - 2}")
    ]


def test_hidden_reasoning(qwen3_serve: ServeStack) -> None:
    """include_reasoning: false drops the reasoning (and, streamed, the
    metadata of reasoning steps); the content stays."""
    b = qwen3_serve.builder
    body = next(x for x in one_shot_chat_corpus(b) if x["generate_response"]["request_id"] == "hidden-reasoning")
    message = qwen3_serve.engine.post(Endpoint.CHAT, body).body["choices"][0]["message"]
    assert message["reasoning"] is None and message["content"] == "\n\nHello there!"
    shown = copy.deepcopy(body)
    del shown["chat_request"]["include_reasoning"]
    message = qwen3_serve.engine.post(Endpoint.CHAT, shown).body["choices"][0]["message"]
    assert message["reasoning"] == "\nGreet back.\n"


def test_logprobs_equal_the_derender_endpoints(qwen3_serve: ServeStack, qwen3_stack: Stack) -> None:
    b = qwen3_serve.builder
    body = next(x for x in chat_bodies(b) if x["generate_response"]["request_id"] == "chat-n2-logprobs")
    ours = qwen3_serve.engine.post(Endpoint.CHAT, body).body
    theirs = qwen3_stack.engine.post(Endpoint.CHAT, body).body
    assert [c["logprobs"] for c in ours["choices"]] == [c["logprobs"] for c in theirs["choices"]]
    assert ours["choices"][0]["logprobs"]["content"][0]["top_logprobs"]


def test_unsupported_requests_get_error_records(qwen3_serve: ServeStack) -> None:
    b = qwen3_serve.builder
    body = next(chat_bodies(b))
    multi = next(x for x in completion_bodies(b) if len(x["generate_responses"]) > 1)
    cases = [
        (Endpoint.CHAT, {**body, "chat_request": {**body["chat_request"], "use_beam_search": True}}, "beam search"),
        (Endpoint.CHAT, {**body, "chat_request": {**body["chat_request"], "prompt_logprobs": 1}}, "prompt_logprobs"),
        (Endpoint.COMPLETION, multi, "one prompt per completion body"),
        (Endpoint.CHAT, {k: v for k, v in body.items() if k != "chat_request"}, "needs chat_request"),
    ]
    for endpoint, case, message in cases:
        answer = qwen3_serve.engine.post(endpoint, case)
        assert answer.status == 400 and message in answer.error_message, answer.raw


# --- the command --------------------------------------------------------------------


def test_flavor_serve_on_the_command_line(qwen3_serve: ServeStack, tmp_path: Path) -> None:
    done = run_cli(
        "stream", "sample_data/stream.jsonl", "--config", "sample_data/qwen3.yaml",
        "--flavor", "serve", "--format", "sse", "-o", f"{tmp_path}/",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()
    # The sample's unicode stream is cut at 33 tokens with max_tokens 30.
    assert b"stream-speculative-unicode' choice 0: the record has not finished at token 30" in done.stderr
    out = io.BytesIO()
    bodies = [json.loads(line) for line in (SAMPLE / "stream.jsonl").read_text().splitlines()]
    run_lines(qwen3_serve.engine, Job(Endpoint.CHAT, stream=True), [orjson.dumps(x) for x in bodies], SseWriter(out))
    ours = sorted(p.name for p in tmp_path.iterdir())
    assert ours == sorted(transcript_name(r) for r in ("stream-n2", "stream-speculative-unicode", "stream-tool-call"))
    # serve's fingerprint hashes its config, model path as given included.
    fingerprint = re.compile(rb'"system_fingerprint":"vllm-' + re.escape(installed().encode()) + rb'-[0-9a-f]{8}"')
    in_process = fingerprint.sub(b"", normalized_bytes(out.getvalue()))
    for name in ours:
        transcript = fingerprint.sub(b"", normalized_bytes((tmp_path / name).read_bytes()))
        assert transcript.endswith(b"data: [DONE]\n\n") and transcript in in_process
    assert b'"id":"chatcmpl-stream-n2"' in in_process

    chat = run_cli("chat", "sample_data/chat.jsonl", "--config", "sample_data/qwen3.yaml", "--flavor", "serve")
    assert chat.returncode == 0, chat.stderr.decode()
    lines = [json.loads(line) for line in chat.stdout.splitlines()]
    assert [line["id"] for line in lines] == [
        "chatcmpl-chat-tool-call", "chatcmpl-chat-n2-logprobs", "chatcmpl-chat-unicode", "chatcmpl-chat-stop-string",
    ]  # fmt: skip
    assert all(line["system_fingerprint"].startswith(f"vllm-{installed()}-") for line in lines)
    assert normalize(lines[3]["choices"]) == normalize(
        qwen3_serve.engine.post(Endpoint.CHAT, list(chat_bodies(qwen3_serve.builder))[3]).body["choices"]
    )

    # The serve path runs in one process: it refuses what would fork or ship it.
    for scale in (["-j", "2"], ["--ray"]):
        refused = run_cli("chat", "sample_data/chat.jsonl", "--config", "sample_data/qwen3.yaml", "--flavor", "serve", *scale)
        assert refused.returncode == 2 and refused.stdout == b""
        assert b"--flavor serve runs" in refused.stderr


# --- many requests at once ------------------------------------------------------------
#
# Why batching cannot change a frame (`serve` module docstring): each
# request's engine steps are fixed by its own record and its own
# `v1.Request`; it gets one output per engine step and the stack settles
# before the next step, so its collector never merges two; everything
# below is per request in vLLM and in the serve path. These tests check
# the consequence: a batch's answers are the answers each request gets
# alone, byte for byte but for `created` and the random tool-call ids.


def _calls(endpoint: Endpoint, bodies: list[Any]) -> Any:
    """A script (`protocol.Script`): the calls in order, their answers back."""
    answers = []
    for body in bodies:
        answers.append((yield endpoint, body))
    return answers


def _scripts_of(endpoint: Endpoint, one_shots: list[Any], streams: list[list[Any]]) -> list[tuple[Endpoint, list[Any]]]:
    return [(endpoint, [body]) for body in one_shots] + [(endpoint, bodies) for bodies in streams]


def _streams_by_request(bodies: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    streams: dict[str, list[dict[str, Any]]] = {}
    for body in bodies:
        streams.setdefault(body["generate_chunk"]["request_id"], []).append(body)
    return list(streams.values())


def _seen(answers: list[Any]) -> list[tuple[int, bytes, tuple[Any, ...], Any]]:
    """What a client reads of each answer, and the findings it carried."""
    return [(a.status, normalized_bytes(a.raw), a.findings, getattr(a, "late", None)) for a in answers]


def _batched_as_alone(engine: serve.ServeEngine, work: list[tuple[Endpoint, list[Any]]]) -> None:
    """The scripts in windows of 32 and of 5 answer as one at a time, and as
    `post` (what the oracle tests check) answers them."""
    alone = [_seen(answers) for answers in engine.drive((_calls(e, b) for e, b in work), window=1)]
    posted = [_seen([engine.post(e, body) for body in b]) for e, b in work]
    assert alone == posted
    for window in (32, 5):
        batched = [_seen(answers) for answers in engine.drive((_calls(e, b) for e, b in work), window=window)]
        assert batched == alone, window


def test_a_batch_answers_each_request_as_alone(qwen3_serve: ServeStack) -> None:
    """One-shot and streamed, chat and completions, errors, stop-logic
    findings, the same request id several times at once: each answer of a
    batched run is the one-at-a-time run's."""
    b = qwen3_serve.builder
    chat = one_shot_chat_corpus(b)
    body = next(chat_bodies(b))
    refused = [
        {**body, "chat_request": {**body["chat_request"], "use_beam_search": True}},
        {k: v for k, v in body.items() if k != "chat_request"},
    ]
    ids = b.encode("One, two, three. Four, five.")
    findings = [_hello_body(b, "early", ids, "length", max_tokens=len(ids) + 5),
                _hello_body(b, "late", ids, "length", max_tokens=len(ids) - 2)]  # fmt: skip
    chat_streams = _streams_by_request(stream_bodies(b, chat_stream_corpus(b)))
    work = _scripts_of(Endpoint.CHAT, chat + chat + refused + findings, chat_streams + chat_streams)
    completions = one_shot_completion_corpus(b)
    completion_streams = _streams_by_request(stream_bodies(b, completion_stream_plans(b)))
    work += _scripts_of(Endpoint.COMPLETION, completions, completion_streams)
    sample_streams = _streams_by_request([json.loads(line) for line in (SAMPLE / "stream.jsonl").read_text().splitlines()])
    sample_chat = [json.loads(line) for line in (SAMPLE / "chat.jsonl").read_text().splitlines()]
    work += _scripts_of(Endpoint.CHAT, sample_chat, sample_streams)
    _batched_as_alone(qwen3_serve.engine, work)
    # The findings came with the answers that found them, in a batch too.
    answers = list(qwen3_serve.engine.post_many(Endpoint.CHAT, findings))
    assert [[f.request_id for f in a.findings] for a in answers] == [["early"], ["late"]]
    # `derender chat --flavor serve` takes its records a window at a time:
    # two full windows and one record, each answered as `post` answers it.
    records = (chat * (2 * WINDOW))[: 2 * WINDOW + 1]
    lines, code = jsonl_answers(qwen3_serve.engine, Job(Endpoint.CHAT), [orjson.dumps(x) for x in records])
    assert code == 0
    posted = [qwen3_serve.engine.post(Endpoint.CHAT, x).body for x in records]
    assert normalize(lines) == normalize(posted)


@pytest.mark.parametrize("name", ["llama3", "deepseek_v4"])
def test_a_batch_answers_a_familys_corpus_as_alone(name: str, request: pytest.FixtureRequest) -> None:
    """Another family's parsers (tool calls, reasoning) behind serve's
    handlers: its corpus, one-shot and streamed, batched as alone."""
    family: Stack = request.getfixturevalue(f"{name}_stack")
    engine = serve.ServeEngine.build(family.config)
    try:
        plans = family_plans(family.builder)
        one_shots = [one_shot_body(plan, family.builder.family.served_name) for plan in plans]
        streams = _streams_by_request(stream_bodies(family.builder, plans))
        _batched_as_alone(engine, _scripts_of(Endpoint.CHAT, one_shots + one_shots, streams + streams))
    finally:
        engine.close()


def test_parity_in_windows_is_parity_one_request_at_a_time(qwen3_stack: Stack, qwen3_serve: ServeStack) -> None:
    """Parity over the parity corpus and the sample, every path, in windows
    (the serve paths batched): each request's examination (answers,
    divergences, findings, log lines) is the one it gets alone."""
    b = qwen3_serve.builder
    engines: dict[str, Any] = {path: qwen3_stack.engine.in_mode(**mode) for path, mode in DERENDER_MODES.items()}
    engines.update({"serve": qwen3_serve.engine, "serve-oneshot": qwen3_serve.engine})
    records = [Record(n, n, body) for n, body in enumerate(corpus_bodies(b), 1)]
    requests = list(requests_of(records, Endpoint.CHAT, stream=True, requests=None, chunkings=[]))
    sample = [Record(n, n, json.loads(line)) for n, line in enumerate((SAMPLE / "chat.jsonl").read_text().splitlines(), 1)]
    requests += list(requests_of(sample, Endpoint.CHAT, stream=False, requests=None, chunkings=Chunking.parse_list("1,3+tail")))
    requests += requests[:3]  # the same request ids again, in one window

    def examined(window: int | None) -> list[Any]:
        checker = Parity(engines, Endpoint.CHAT)
        if window is None:
            found = [checker.examine(r) for r in requests]
        else:
            found = [e for _, e in checker.examined(requests, window=window)]
        return [
            (e.request_id, normalize(orjson.loads(orjson.dumps(e.divergences, default=vars))), e.logs,
             normalize(orjson.loads(orjson.dumps([(k, o.response, o.chunks, o.calls, o.error) for k, o in e.observed.items()]))))
            for e in found
        ] + [[(kind.key, kind.count, first) for kind, first in checker.logs]]  # fmt: skip

    alone = examined(None)
    assert any(e[1] for e in alone[:-1]) and any(e[2] for e in alone[:-1])  # divergences and log lines to keep
    assert examined(32) == alone
    assert examined(4) == alone


# --- a one-shot body's tokens as one engine step ------------------------------------
#
# Fast path ``serve_bulk``: a one-shot request without stop strings hands
# each choice's tokens to the output processor as one step, vLLM's stop
# logic still run per token (`_ScriptedEngineCore.advance_merged`). These
# tests hold it to one token a step, the engine the oracle tests replay
# (`serve_oracle.one_shot_steps`), answer by answer, findings included.


def _merged_as_one_token_a_step(engine: serve.ServeEngine, work: list[tuple[Endpoint, Any]]) -> int:
    """Each body answered (and its findings) as with one token a step, in
    a window of 32 and alone; how many took the merged steps."""
    merged = engine._core.advance_merged
    taken = []

    def counted(request: Any, piece: Any, note: Any) -> Any:
        taken.append(piece)
        return merged(request, piece, note)

    with one_token_a_step(engine):
        stepwise = [_seen([engine.post(e, body)]) for e, body in work]
    engine._core.advance_merged = counted
    try:
        alone = [_seen([engine.post(e, body)]) for e, body in work]
        batched = [_seen(a) for a in engine.drive((_calls(e, [body]) for e, body in work), window=32)]
    finally:
        del engine._core.advance_merged
    assert alone == stepwise
    assert batched == stepwise
    return len(taken)


@requires_fast("serve_bulk")
def test_merged_steps_answer_each_corpus_as_one_token_a_step(qwen3_serve: ServeStack) -> None:
    """The one-shot corpora (chat and completions, n > 1, logprobs, tool
    calls, hidden reasoning, stop token ids, the sample's records, stop
    strings going one token a step) and stop-logic findings."""
    b = qwen3_serve.builder
    ids = b.encode("One, two, three. Four, five.")
    eos = b.family.eos_id
    findings = [
        _hello_body(b, "early", ids, "length", max_tokens=len(ids) + 5),
        _hello_body(b, "late", ids, "length", max_tokens=len(ids) - 2),
        _hello_body(b, "eos-inside", [*ids[:3], eos, *ids[3:], eos], "stop"),
        _hello_body(b, "stop-id-inside", [*ids, eos], "stop", stop_token_ids=[ids[2]], min_tokens=1),
        _hello_body(b, "stop-string", [*ids, eos], "stop", stop=["three"]),
    ]
    sample = [json.loads(line) for line in (SAMPLE / "chat.jsonl").read_text().splitlines()]
    work = [(Endpoint.CHAT, x) for x in [*one_shot_chat_corpus(b), *sample, *findings]]
    work += [(Endpoint.COMPLETION, x) for x in one_shot_completion_corpus(b)]
    taken = _merged_as_one_token_a_step(qwen3_serve.engine, work)
    assert taken >= len(work)  # (n > 1 counts each choice; stop strings none)
    found = [a.findings for a in qwen3_serve.engine.post_many(Endpoint.CHAT, findings[:4])]
    assert [[f.request_id for f in f_] for f_ in found] == [["early"], ["late"], ["eos-inside"], ["stop-id-inside"]]


@st.composite
def _drawn_one_shots(draw: st.DrawFn, b: SampleBuilder) -> dict[str, Any]:
    """A one-shot chat body whose tokens meet vLLM's stop logic anywhere:
    the eos id, a stop token id, max_tokens, min_tokens, ignore_eos, n."""
    words = b.encode("Hi there, one two. <think>no</think> END")
    eos = b.family.eos_id
    stop_id = words[1]
    n = draw(st.integers(1, 2))
    pool = st.sampled_from([*words, eos, stop_id])
    choices = []
    for index in range(n):
        ids = draw(st.lists(pool, max_size=12))
        finish = draw(st.sampled_from(["stop", "length"]))
        stop_reason = draw(st.sampled_from([None, stop_id])) if finish == "stop" else None
        choices.append({"index": index, "token_ids": ids, "finish_reason": finish, "stop_reason": stop_reason})
    request: dict[str, Any] = {"n": n}
    if draw(st.booleans()):
        request["max_tokens"] = draw(st.integers(1, 14))
    if draw(st.booleans()):
        request["min_tokens"] = draw(st.integers(0, 5))
    if draw(st.booleans()):
        request["stop_token_ids"] = [stop_id]
    if draw(st.booleans()):
        request["ignore_eos"] = True
    body = _hello_body(b, "drawn", [], "stop", **request)
    body["generate_response"]["choices"] = choices
    return body


@requires_fast("serve_bulk")
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_merged_steps_answer_drawn_records_as_one_token_a_step(qwen3_serve: ServeStack, data: st.DataObject) -> None:
    """Drawn records, their stops and finishes anywhere: the same answer
    and the same findings as one token a step."""
    bodies = data.draw(st.lists(_drawn_one_shots(qwen3_serve.builder), min_size=1, max_size=3))
    _merged_as_one_token_a_step(qwen3_serve.engine, [(Endpoint.CHAT, body) for body in bodies])


def test_a_closed_serve_stack_leaves_no_tokenizer_behind(qwen3_serve: ServeStack) -> None:
    """A serve stack's tokenizer is a pool of deep copies (vLLM's
    ``maybe_make_thread_pool``), which vLLM's ``supports_kw`` memo held on
    to after the stack closed: about 145 MB a stack for Qwen3's vocabulary,
    up to 128 stacks. A process that builds one stack after another (a
    parity run per configuration, a library loop, this suite) keeps its
    size."""

    def live_tokenizers() -> int:
        gc.collect()
        return sum(1 for o in gc.get_objects() if isinstance(o, tokenizers.Tokenizer))

    ServeEngine.build(qwen3_serve.config).close()
    before = live_tokenizers()
    for _ in range(2):
        ServeEngine.build(qwen3_serve.config).close()
    assert live_tokenizers() == before
