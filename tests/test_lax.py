"""Every shortcut that reads a record before vLLM validates it reads what
vLLM's validation reads (issue 31, cases 18 to 21).

vLLM's request models validate in pydantic's lax mode: ``"2"``, ``2.0`` and
``true`` are integers, ``1`` and ``1.0`` are ``stream: true``, ``1`` and
``"on"`` are booleans; NaN and the infinities are written as ``null`` by
orjson, so bytes alone cannot tell them from null. Each shortcut (the
readers of `derender_core.lax`, our record checks, the stream ledger's
facts, the prompts the checks remember, the request and prompt a live
stream remembers) is held here to ``model_validate`` of vLLM's own request
classes over drawn values; the last tests hold derender's whole answers to
a real ``vllm launch render``'s, through the library and the command line.
"""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from vllm.entrypoints.generate.base.protocol import StreamOptions
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
    DerenderChatStreamRequest,
    DerenderCompletionStreamRequest,
    GenerateTokensStreamChoice,
)

from derender_core import Endpoint
from derender_core.batch import Job
from derender_core.checks import PassedPrompts, check_body
from derender_core.lax import read_bool, read_int, requested_choices, streaming
from derender_core.streams import ChunkFacts
from derender_core.vllm_seam.live import KnownRequest
from tests.conftest import Stack
from tests.helpers import jsonl_answers, normalize, run_cli, server_stream_answers
from tests.sample_inputs import (
    chat_bodies,
    completion_bodies,
    completion_stream_plans,
    stream_bodies,
    stream_plans,
)

VOCAB = 1000

# --- drawn values ----------------------------------------------------------------

NON_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])
INTEGRAL = st.integers(-3, 6) | st.sampled_from([1 << 63, 1 << 70])
VALUES = st.one_of(
    st.none(), st.booleans(), INTEGRAL, NON_FINITE,
    INTEGRAL.map(float), st.floats(-4, 8), INTEGRAL.map(str), INTEGRAL.map(lambda i: f" {i}.0 "),
    st.sampled_from(["true", "false", "on", "off", "yes", "no", "1.5", "", "x", "nan", "inf"]),
    st.text(max_size=3), st.just([]), st.just([1]), st.just({}), st.just({"n": 1}),
)  # fmt: skip
"""Everything a JSON record can hold where vLLM wants a number or a flag:
the numbers vLLM coerces, the ones it refuses, and their text forms."""


def validated(make: Any) -> tuple[bool, Any]:
    """vLLM's verdict: (True, the value) or (False, None) where it refuses."""
    try:
        return True, make()
    except Exception:  # noqa: BLE001 - any refusal
        return False, None


def vllm_n(endpoint: Endpoint, n: Any) -> int | None:
    """The n vLLM's request class reads, as the checks use it (null is 1
    for chat, less than 1 is 1), or None where it refuses it."""
    if endpoint is Endpoint.CHAT:
        ok, request = validated(lambda: ChatCompletionRequest.model_validate({"messages": [], "n": n}))
    else:
        ok, request = validated(lambda: CompletionRequest.model_validate({"prompt": "x", "n": n}))
    if not ok:
        return None
    read = 1 if request.n is None else request.n
    return read if read >= 1 else 1


@settings(max_examples=400, deadline=None)
@given(n=VALUES, endpoint=st.sampled_from([Endpoint.CHAT, Endpoint.COMPLETION]))
def test_n_is_read_as_vllms_request_class_reads_it(n: Any, endpoint: Endpoint) -> None:
    expected = vllm_n(endpoint, n)
    event(f"{endpoint.value}: {'refused' if expected is None else 'read'}")
    assert requested_choices({"n": n}, endpoint.request_key) == expected


@settings(max_examples=300, deadline=None)
@given(flag=VALUES, endpoint=st.sampled_from([Endpoint.CHAT, Endpoint.COMPLETION]))
def test_a_streaming_call_is_the_one_vllms_streaming_member_takes(flag: Any, endpoint: Endpoint) -> None:
    member = DerenderChatStreamRequest if endpoint is Endpoint.CHAT else DerenderCompletionStreamRequest
    body = {"stream": flag, "generate_chunk": {"request_id": "r", "choices": [{"index": 0, "token_ids": [1]}]}}
    takes, _ = validated(lambda: member.model_validate(body))
    event(f"streaming: {takes}")
    assert streaming(flag) is takes


@settings(max_examples=300, deadline=None)
@given(value=VALUES)
def test_a_chunk_index_and_include_usage_are_read_as_vllm_reads_them(value: Any) -> None:
    ok, choice = validated(lambda: GenerateTokensStreamChoice.model_validate({"index": value, "token_ids": [1]}))
    assert read_int(value) == (choice.index if ok else None)
    ok, options = validated(lambda: StreamOptions.model_validate({"include_usage": value}))
    assert read_bool(value) == (options.include_usage if ok and options.include_usage is not None else None)


# --- the record checks and the ledger -------------------------------------------


def chat_body(n: Any, choices: int) -> dict[str, Any]:
    return {
        "generate_response": {"request_id": "r", "choices": [{"index": i, "token_ids": [1, 2]} for i in range(choices)]},
        "prompt_token_ids": [5, 6],
        "chat_request": {"messages": [], "n": n},
    }  # fmt: skip


def completion_body(n: Any, choices: int) -> dict[str, Any]:
    return {
        "generate_responses": [{"request_id": "p", "choices": [{"index": i, "token_ids": [3]} for i in range(choices)]}],
        "prompt_token_ids": [[8]],
        "completion_request": {"prompt": "a", "n": n},
    }  # fmt: skip


def chunk_body(n: Any, index: int, stream: Any = True) -> dict[str, Any]:
    return {
        "stream": stream,
        "generate_chunk": {"request_id": "s", "choices": [{"index": index, "token_ids": [10]}]},
        "prompt_token_ids": [5],
        "chat_request": {"messages": [], "n": n},
    }


@settings(max_examples=300, deadline=None)
@given(n=VALUES, choices=st.integers(1, 4), endpoint=st.sampled_from([Endpoint.CHAT, Endpoint.COMPLETION]))
def test_the_choice_index_check_bounds_choices_by_vllms_n(n: Any, choices: int, endpoint: Endpoint) -> None:
    """Choices 0..k-1 pass where vLLM reads n as k, and where vLLM refuses
    n (its words then); for any other n the check names the first choice
    outside it or the first missing."""
    body = chat_body(n, choices) if endpoint is Endpoint.CHAT else completion_body(n, choices)
    problem = check_body(body, endpoint, stream=False, vocab_size=VOCAB)
    expected = vllm_n(endpoint, n)
    event(f"vLLM's n {'refused' if expected is None else 'matches' if expected == choices else 'differs'}")
    if expected is None or expected == choices:
        assert problem is None, problem
    else:
        assert problem is not None and f"is {expected}" in problem, problem


@settings(max_examples=200, deadline=None)
@given(n=VALUES, index=st.integers(0, 3), flag=VALUES | st.just(True))
def test_a_chunk_is_checked_and_counted_by_vllms_n_and_stream(n: Any, index: int, flag: Any) -> None:
    body = chunk_body(n, index, flag)
    expected = vllm_n(Endpoint.CHAT, n)
    problem = check_body(body, Endpoint.CHAT, stream=True, vocab_size=VOCAB)
    stream_ok, _ = validated(lambda: DerenderChatStreamRequest.model_validate(body))
    if not streaming(flag):
        assert problem is not None and problem.startswith("stream:"), problem
    elif expected is None or index < expected:
        assert problem is None, problem
    else:
        assert problem is not None and f"outside 0..{expected - 1}" in problem, problem
    facts = ChunkFacts.of(body, Endpoint.CHAT)
    assert facts.expected_choices == (1 if expected is None else expected)
    # The streaming member takes the body exactly where the check lets the
    # stream flag through (n aside: vLLM reads that field alike).
    if expected is not None:
        assert stream_ok is streaming(flag)


PROMPT_ITEMS = st.one_of(st.integers(0, 5), st.just(VOCAB + 1), st.integers(-2, -1), st.none(), NON_FINITE,
                         st.booleans(), st.integers(0, 5).map(float), st.integers(0, 5).map(str))  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(first=st.lists(PROMPT_ITEMS, max_size=3), second=st.lists(PROMPT_ITEMS, max_size=3))
def test_a_remembered_prompt_gives_the_checks_own_verdict(first: list[Any], second: list[Any]) -> None:
    """`PassedPrompts` spares a prompt the check when its bytes passed
    before; NaN, the infinities and null share bytes, so the verdict on the
    second list must be the one the check gives it afresh."""
    passed = PassedPrompts()
    check_body(chat_body(1, 1) | {"prompt_token_ids": first}, Endpoint.CHAT, stream=False, vocab_size=VOCAB, passed=passed)
    remembered = check_body(chat_body(1, 1) | {"prompt_token_ids": second}, Endpoint.CHAT, stream=False, vocab_size=VOCAB, passed=passed)
    fresh = check_body(chat_body(1, 1) | {"prompt_token_ids": second}, Endpoint.CHAT, stream=False, vocab_size=VOCAB)
    assert remembered == fresh


def stream_body(prompt: Any, request: Any) -> dict[str, Any]:
    return {
        "stream": True,
        "generate_chunk": {"request_id": "s", "choices": [{"index": 0, "token_ids": [10]}]},
        "prompt_token_ids": prompt,
        "chat_request": request,
    }


def validated_call(prompt: Any, request: Any) -> tuple[bool, Any]:
    ok, call = validated(lambda: DerenderChatStreamRequest.model_validate(copy.deepcopy(stream_body(prompt, request))))
    if not ok:
        return False, None
    return True, (call.prompt_token_ids, call.chat_request.model_dump(exclude={"request_id"}))


PROMPTS = st.one_of(st.none(), NON_FINITE, st.lists(PROMPT_ITEMS, max_size=3), st.integers(0, 3))
REQUESTS = st.fixed_dictionaries(
    {"messages": st.just([{"role": "user", "content": "x"}])},
    optional={"temperature": st.none() | NON_FINITE | st.floats(0, 2) | st.integers(0, 2),
              "n": VALUES, "seed": st.none() | NON_FINITE | st.integers(0, 3)},
)  # fmt: skip


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(first=st.tuples(PROMPTS, REQUESTS), later=st.tuples(PROMPTS, REQUESTS))
def test_a_remembered_request_and_prompt_are_reused_only_for_what_validates_alike(
    first: tuple[Any, Any], later: tuple[Any, Any]
) -> None:
    """`KnownRequest.same` lets a live stream's later call reuse its first
    call's validated request and prompt: only where vLLM's validation of
    the later call gives the very same (issue 31 case 20: a NaN prompt
    after a null one)."""
    ok, first_call = validated_call(*first)
    if not ok:
        return
    known = KnownRequest.of(first[1], first[0], None, None)
    if known.same(later[1], later[0]):
        event("reused")
        later_ok, later_call = validated_call(*later)
        assert later_ok and repr(later_call) == repr(first_call)


# --- whole answers, against a real render server ---------------------------------


def server_answers(stack: Stack, endpoint: Endpoint, bodies: list[dict[str, Any]]) -> list[Any]:
    return [stack.server.post(endpoint, body).json() for body in bodies]


@pytest.mark.server
@pytest.mark.parametrize("decode", ["fast", "reference"])
def test_a_chat_request_past_the_stop_limit_is_refused_as_on_the_server(qwen3_stack: Stack, decode: str) -> None:
    """Case 18: 4 stop strings are answered, 5 to 8 refused
    (``List should have at most 4 items after validation``), by both decodes."""
    base = next(body for body in chat_bodies(qwen3_stack.builder) if body["generate_response"]["request_id"] == "chat-tool-call")
    bodies = [
        {**base, "chat_request": {**base["chat_request"], "stop": [f"stop{k}" for k in range(count)]}}
        for count in range(4, 9)
    ]
    expected = server_answers(qwen3_stack, Endpoint.CHAT, bodies)
    assert "error" not in expected[0] and all("at most 4 items" in answer["error"]["message"] for answer in expected[1:])
    engine = qwen3_stack.engine.in_mode(decode=decode)
    got = jsonl_answers(engine, Job(Endpoint.CHAT), [orjson.dumps(body) for body in bodies])[0]
    assert normalize(got) == normalize(expected)


N_FORMS = ["2", 2.0, " 2 "]


@pytest.mark.server
@pytest.mark.parametrize("decode", ["fast", "reference"])
@pytest.mark.parametrize("n", N_FORMS)
def test_n_given_as_text_or_float_is_two_choices_as_on_the_server(qwen3_stack: Stack, decode: str, n: Any) -> None:
    """Case 19, one-shot: chat and completion bodies of two choices whose
    request's n is ``"2"`` or ``2.0`` are answered, as the server answers
    them, with our checks on."""
    b = qwen3_stack.builder
    chat = next(body for body in chat_bodies(b) if body["generate_response"]["request_id"] == "chat-n2-logprobs")
    completion = next(body for body in completion_bodies(b) if "n" in body["completion_request"])
    engine = qwen3_stack.engine.in_mode(decode=decode)
    for endpoint, body in ((Endpoint.CHAT, chat), (Endpoint.COMPLETION, completion)):
        body = {**body, endpoint.request_key: {**body[endpoint.request_key], "n": n}}
        expected = server_answers(qwen3_stack, endpoint, [body])
        assert "error" not in expected[0], expected
        got = jsonl_answers(engine, Job(endpoint), [orjson.dumps(body)])[0]
        assert normalize(got) == normalize(expected), endpoint


def with_request_field(bodies: list[dict[str, Any]], key: str, **fields: Any) -> list[dict[str, Any]]:
    return [{**body, key: {**body[key], **fields}} for body in bodies]


@pytest.mark.server
@pytest.mark.parametrize("n", N_FORMS)
def test_a_stream_of_two_choices_with_n_as_text_or_float_is_the_servers(qwen3_stack: Stack, n: Any) -> None:
    """Case 19, streams: every call of a two-choice stream whose n is
    ``"2"`` or ``2.0`` is answered as the server answers it, each decode
    and mode (the ledger keeps the stream open for both choices)."""
    b = qwen3_stack.builder
    plans = [plan for plan in stream_plans(b) if plan.request_id == "stream-n2"]
    bodies = with_request_field(stream_bodies(b, plans), "chat_request", n=n)
    expected = [answer for _, answer in server_stream_answers(qwen3_stack.server, Endpoint.CHAT, bodies)]
    assert all("error" not in answer for answer in expected), expected
    lines = [orjson.dumps(body) for body in bodies]
    for live in (True, False):
        for decode in ("fast", "reference"):
            engine = qwen3_stack.engine.in_mode(live=live, decode=decode)
            got = jsonl_answers(engine, Job(Endpoint.CHAT, stream=True), lines)[0]
            assert normalize(got) == normalize(expected), (live, decode)


@pytest.mark.server
@pytest.mark.parametrize("endpoint", [Endpoint.CHAT, Endpoint.COMPLETION])
@pytest.mark.parametrize("flag", [1, 1.0])
def test_stream_one_is_a_streaming_call_as_on_the_server(qwen3_stack: Stack, endpoint: Endpoint, flag: Any) -> None:
    """Case 21: ``"stream": 1`` and ``1.0`` are streaming calls to the
    server's lax validation; `derender stream` answers them so, live and
    replayed."""
    b = qwen3_stack.builder
    plans = stream_plans(b)[:1] if endpoint is Endpoint.CHAT else completion_stream_plans(b)[:1]
    bodies = [{**body, "stream": flag} for body in stream_bodies(b, plans)]
    expected = [answer for _, answer in server_stream_answers(qwen3_stack.server, endpoint, bodies)]
    assert all("chunk" in answer for answer in expected), expected
    lines = [orjson.dumps(body) for body in bodies]
    for live in (True, False):
        got = jsonl_answers(qwen3_stack.engine.in_mode(live=live), Job(endpoint, stream=True), lines)[0]
        assert normalize(got) == normalize(expected), f"live={live}"


@pytest.mark.server
def test_the_command_line_answers_coerced_values_as_the_server(qwen3_stack: Stack, tmp_path: Any) -> None:
    """As a user runs it: `derender chat` on a body with ``"n": "2"`` and
    `derender stream` on calls with ``"stream": 1``, each a real process,
    exit 0 with the server's answers."""
    b = qwen3_stack.builder
    chat = next(body for body in chat_bodies(b) if body["generate_response"]["request_id"] == "chat-n2-logprobs")
    chat = {**chat, "chat_request": {**chat["chat_request"], "n": "2"}}
    streams = [{**body, "stream": 1} for body in stream_bodies(b, stream_plans(b)[:1])]
    for command, bodies in (("chat", [chat]), ("stream", streams)):
        done = run_cli(command, "-", "--config", "sample_data/qwen3.yaml", stdin=b"".join(orjson.dumps(x) + b"\n" for x in bodies))
        assert done.returncode == 0, done.stderr.decode(errors="replace")[-2000:]
        got = [json.loads(line) for line in done.stdout.splitlines()]
        if command == "chat":
            expected = server_answers(qwen3_stack, Endpoint.CHAT, bodies)
        else:
            expected = [answer for _, answer in server_stream_answers(qwen3_stack.server, Endpoint.CHAT, bodies)]
        assert normalize(got) == normalize(expected), command
