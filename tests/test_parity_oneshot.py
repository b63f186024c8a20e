"""One-shot derender parity: every answer equals the real render server's.

Each case goes through the library's whole path (records, joins, engine,
JSONL writer) and, separately, as an HTTP POST to `vllm launch render`
started with the same flags. Only `created` and random tool-call ids are
normalised.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from derender_core import Endpoint
from derender_core.batch import Job
from derender_core.protocol import DERENDER_ENDPOINTS
from tests.conftest import Stack
from tests.helpers import jsonl_answers, normalize
from tests.sample_inputs import (
    SampleBuilder,
    chat_bodies,
    chat_error_bodies,
    completion_bodies,
    logprobs_for,
)


def assert_matches_server(stack: Stack, endpoint: Endpoint, lines: list[bytes]) -> list[Any]:
    # Bug-for-bug parity is --lenient: our own checks refuse records the
    # server answers (test_hardening covers those).
    answers, _ = jsonl_answers(stack.engine, Job(endpoint, lenient=True), lines)
    for line, answer in zip(lines, answers, strict=True):
        response = stack.server.post_raw(endpoint, line)
        assert normalize(answer) == normalize(response.json()), line[:200]
        if response.status_code != 200:
            assert answer["error"]["code"] == response.status_code
    return answers


def extra_chat_cases(b: SampleBuilder) -> list[dict[str, Any]]:
    """Edge cases beyond the sample, each a body a client could send."""
    eos = b.family.eos_id
    messages = [{"role": "user", "content": "hi"}]
    prompt = b.prompt_ids(messages)
    hello = b.encode(b.answer("Hello there!", reasoning="Greet back.")) + [eos]
    request = b.chat_request(messages)

    def body(choices: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
        return {
            "generate_response": {"request_id": "edge", "choices": choices},
            "prompt_token_ids": prompt,
            "chat_request": request,
            **fields,
        }

    return [
        # include_reasoning=false hides reasoning and logprobs.
        body(
            [{"index": 0, "token_ids": hello, "logprobs": logprobs_for(hello)}],
            chat_request=b.chat_request(messages, include_reasoning=False, logprobs=True),
        ),
        # return_token_ids echoes token ids.
        body(
            [{"index": 0, "token_ids": hello}],
            chat_request=b.chat_request(messages, return_token_ids=True),
        ),
        # The stop token kept with include_stop_str_in_output, length cut.
        body(
            [{"index": 0, "token_ids": hello, "finish_reason": "stop", "stop_reason": eos}],
            chat_request=b.chat_request(messages, include_stop_str_in_output=True),
        ),
        body([{"index": 0, "token_ids": hello[:-1], "finish_reason": "length"}]),
        # Out-of-vocabulary ids are dropped by vLLM, not rejected.
        body([{"index": 0, "token_ids": [*hello[:-1], 10_000_000, eos]}]),
        # No prompt ids at all: derender falls back to unseeded decoding.
        {k: v for k, v in body([{"index": 0, "token_ids": hello}]).items() if k != "prompt_token_ids"},
        # Bound checks the server applies before any decode.
        body([{"index": i, "token_ids": hello} for i in range(300)]),
        body(
            [
                {
                    "index": 0,
                    "token_ids": hello,
                    "logprobs": {
                        "content": [
                            {
                                "token_id": t,
                                "logprob": -1.0,
                                "top_logprobs": [{"token_id": t, "logprob": -1.0}] * 30,
                            }
                            for t in hello
                        ]
                    },
                }
            ]
        ),
        # Generate output the engine already decoded (output_mode "text") or
        # derendered ("derender"): the derender endpoints take token ids only,
        # and the server's own validation words the refusal (docs/formats.md).
        *(
            body([{"index": 0, "token_ids": hello}], generate_response={
                "request_id": "edge", "output_mode": mode, "choices": [{"index": 0, "token_ids": hello}],
            })
            for mode in ("text", "derender", "tokens")
        ),
        # Shapes FastAPI rejects before the handler.
        {"generate_response": {"choices": "nope"}},
        {"stream": False},
        {"generate_response": {"request_id": "edge", "choices": []}, "chat_request": {"messages": "x"}},
    ]


def test_chat_sample_and_errors_match_server(stack: Stack) -> None:
    b = stack.builder
    bodies = [*chat_bodies(b), *chat_error_bodies(b), *extra_chat_cases(b)]
    answers = assert_matches_server(stack, Endpoint.CHAT, [orjson.dumps(x) for x in bodies])
    # The sample answers are real responses, not errors in disguise.
    sample = answers[: len(list(chat_bodies(b)))]
    assert all("choices" in answer for answer in sample)
    tool_call_answer = sample[0]["choices"][0]
    assert tool_call_answer["finish_reason"] == "tool_calls"
    assert tool_call_answer["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    if b.family.reasoning is not None:
        assert "Paris" in tool_call_answer["message"]["reasoning"]
    assert [c["index"] for c in sample[1]["choices"]] == [0, 1]
    assert sample[2]["choices"][0]["message"]["content"].startswith("Weather symbols: 🌦️")
    assert sample[3]["choices"][0]["message"]["content"] == "One, two, three. "
    assert sample[3]["choices"][0]["stop_reason"] == "END"


def test_non_json_object_lines_match_server(stack: Stack) -> None:
    assert_matches_server(stack, Endpoint.CHAT, [b"[1, 2, 3]", b'"text"', b"17", b"null"])


def test_invalid_json_lines_match_server(stack: Stack) -> None:
    lines = [b'{"generate_response": ', b"{'single': 'quotes'}", b'{"a": 1} trailing', b"0\x000\x80"]
    answers, code = jsonl_answers(stack.engine, Job(Endpoint.CHAT), lines)
    assert code == 1
    for line, answer in zip(lines, answers, strict=True):
        response = stack.server.post_raw(Endpoint.CHAT, line)
        assert response.status_code == 400
        assert answer == response.json()


def test_completion_sample_matches_server(stack: Stack) -> None:
    b = stack.builder
    bodies = list(completion_bodies(b))
    prompt = b.encode("Hi")
    bodies += [
        {"generate_responses": []},
        {"generate_responses": [{"request_id": "x", "choices": [{"index": 0, "token_ids": []}]}]},
        {"generate_responses": [{"request_id": "x", "choices": [{"index": 0, "token_ids": prompt}]}], "prompt_tokens": [1, 2]},
        {"model": "other", "generate_responses": [{"request_id": "x", "choices": [{"index": 0, "token_ids": prompt}]}]},
        {
            "generate_responses": [{"request_id": "x", "choices": [{"index": 0, "token_ids": prompt}]}],
            "completion_request": {"prompt": "Hi", "skip_special_tokens": False, "echo": False},
        },
    ]
    answers = assert_matches_server(stack, Endpoint.COMPLETION, [orjson.dumps(x) for x in bodies])
    assert answers[0]["choices"][0]["text"] == " Paris. It is known for the Eiffel Tower."
    assert len(answers[0]["choices"][0]["logprobs"]["tokens"]) > 5
    assert [c["index"] for c in answers[1]["choices"]] == [0, 1, 2, 3]
    assert answers[3]["choices"][0]["text"] == " c, d, "
    assert [a.get("error", {}).get("code") for a in answers[4:8]] == [400, 400, 400, 404]


@pytest.mark.parametrize("endpoint", list(DERENDER_ENDPOINTS))
def test_wrong_endpoint_body_matches_server(stack: Stack, endpoint: Endpoint) -> None:
    """A chat body sent to the completion endpoint, and back."""
    b = stack.builder
    other = next(completion_bodies(b)) if endpoint is Endpoint.CHAT else next(chat_bodies(b))
    assert_matches_server(stack, endpoint, [orjson.dumps(other)])
