"""Response bytes written with orjson (`answers.plain_json`) where the
response is a plain tree (`answers.plain_model`), against the bytes the
handlers' ``JSONResponse`` writes: every code point, drawn plain trees,
and drawn vLLM responses (floats, free-form fields, extra fields, tool
calls, logprobs), fallback included. The family tests
(``test_fast_answers_are_the_reference_answers``, the server parity tests)
compare whole answers with the reference path's and the server's."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from fastapi.responses import JSONResponse
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from derender_core import DerenderEngine, Endpoint
from derender_core.vllm_seam.answers import json_answer, plain_json, plain_model
from tests.conftest import sample_config
from tests.helpers import requires_fast
from tests.sample_inputs import SampleBuilder, chat_bodies, completion_bodies, qwen3_family


def server_bytes(content: Any) -> bytes:
    return bytes(JSONResponse(content=content).body)


def test_every_code_point_is_written_as_the_server_writes_it() -> None:
    surrogates = range(0xD800, 0xE000)
    points = [chr(c) for c in range(0x110000) if c not in surrogates]
    for start in range(0, len(points), 4096):
        text = "".join(points[start : start + 4096])
        assert plain_json({"t": [text, *points[start : start + 4096]]}) == server_bytes({"t": [text, *points[start : start + 4096]]})


@pytest.mark.parametrize(
    "content",
    [
        "\ud800",  # a lone surrogate: the server cannot encode it
        2**64,  # past orjson's integers
        -(2**63) - 1,
        {1: "a"},  # a key that is not a string
        {"a": (1, 2)},  # a tuple, written as a list by both
    ],
)
def test_what_orjson_refuses_falls_back_to_the_servers_writer(content: Any) -> None:
    expected: Any
    try:
        expected = (200, server_bytes(content))
    except (ValueError, TypeError):
        expected = "error"
    answer = json_answer(copy.deepcopy(content), plain=True)
    got = (answer.status, answer.raw) if answer.status == 200 else "error"
    assert got == expected
    assert answer == json_answer(copy.deepcopy(content))


class Name(str):
    pass


class Count(int):
    pass


@pytest.mark.parametrize("leaf", [Name("x"), Count(3), {"a": Name("x")}])
def test_subclasses_are_left_to_the_servers_writer(leaf: Any) -> None:
    assert plain_json([leaf]) is None
    assert json_answer([leaf], plain=True) == json_answer([leaf])


def test_responses_holding_floats_or_enums_are_not_plain() -> None:
    """orjson writes floats, enums and UUIDs its own way (``1e-05`` as
    ``0.00001``): a response that can hold them is not plain."""
    from vllm.entrypoints.openai.completion.protocol import CompletionResponse

    fields = {"model": "m", "choices": [{"index": 0, "text": "t"}], "usage": {"prompt_tokens": 0, "total_tokens": 0}}
    assert plain_model(CompletionResponse.model_validate(fields))
    assert plain_json([1e-05]) != server_bytes([1e-05])
    assert not plain_model(CompletionResponse.model_validate({**fields, "metrics": {"generation_time_ms": 1e-05}}))
    assert not plain_model(CompletionResponse.model_validate({**fields, "kv_transfer_params": {"a": 1}}))
    assert not plain_model(CompletionResponse.model_validate({**fields, "note": "an extra field"}))


LEAVES = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text()
TREES = st.recursive(LEAVES, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=30)


@settings(max_examples=400, deadline=None)
@given(TREES)
def test_plain_trees_are_written_as_the_server_writes_them(tree: Any) -> None:
    raw = plain_json(tree)
    try:
        expected = server_bytes(tree)
    except ValueError:  # a lone surrogate
        assert raw is None
        return
    assert raw == expected


# --- drawn vLLM responses ----------------------------------------------------

JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 2**64) | st.floats() | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)


def _maybe(value: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(st.just("absent"), st.none(), value)


@st.composite
def responses(draw: st.DrawFn) -> dict[str, Any]:
    """A chat or completion response's fields, with what makes a tree not
    plain drawn now and then: floats (metrics, logprobs, free-form dicts),
    extra fields on any model, big ints, lone surrogates."""
    text = st.text(max_size=8)
    chat = draw(st.booleans())
    choices = []
    for index in range(draw(st.integers(1, 2))):
        choice: dict[str, Any] = {"index": index, "finish_reason": draw(st.sampled_from(["stop", "length", "tool_calls"]))}
        if chat:
            message: dict[str, Any] = {"role": "assistant", "content": draw(st.none() | text), "reasoning": draw(st.none() | text)}
            message["tool_calls"] = [
                {"id": draw(text), "type": "function", "function": {"name": draw(text), "arguments": draw(text)}}
                for _ in range(draw(st.integers(0, 2)))
            ]
            if draw(st.booleans()):
                message[draw(st.sampled_from(["extra", "guided_json"]))] = draw(JSONISH)
            choice["message"] = message
            choice["logprobs"] = draw(
                st.none()
                | st.builds(
                    lambda token, lp: {"content": [{"token": token, "logprob": lp, "bytes": [1], "top_logprobs": []}]},
                    text,
                    st.floats(allow_nan=False),
                )
            )
        else:
            choice["text"] = draw(text)
            choice["logprobs"] = None
        choice["stop_reason"] = draw(st.none() | st.integers(0, 2**70) | text)
        choice["token_ids"] = draw(st.none() | st.lists(st.integers(0, 2**64), max_size=3))
        choices.append(choice)
    usage = {"prompt_tokens": draw(st.integers(0, 9)), "total_tokens": 3, "completion_tokens": 3}
    if draw(st.booleans()):
        usage["prompt_tokens_details"] = {"cached_tokens": draw(st.none() | st.integers(0, 3))}
    fields: dict[str, Any] = {
        "id": draw(text), "model": draw(text), "created": draw(st.integers(0, 2**40)), "choices": choices, "usage": usage,
    }  # fmt: skip
    for key, value in (
        ("kv_transfer_params", _maybe(st.dictionaries(st.text(max_size=3), JSONISH, max_size=2))),
        ("metrics", _maybe(st.fixed_dictionaries({"generation_time_ms": st.none() | st.floats(allow_nan=False)}))),
        ("system_fingerprint", _maybe(text)),
        ("prompt_token_ids", _maybe(st.lists(st.integers(0, 9), max_size=3))),
        ("extra_field", _maybe(JSONISH)),
    ):
        drawn = draw(value)
        if drawn != "absent":
            fields[key] = drawn
    fields["chat"] = chat
    return fields


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(responses())
def test_a_drawn_response_answers_as_the_servers_writer_does(fields: dict[str, Any]) -> None:
    from pydantic import ValidationError
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse
    from vllm.entrypoints.openai.completion.protocol import CompletionResponse

    cls = ChatCompletionResponse if fields.pop("chat") else CompletionResponse
    try:
        response = cls.model_validate(fields)
    except ValidationError:
        assume(False)
    plain = plain_model(response)
    event(f"plain: {plain}")
    answer = json_answer(response.model_dump(), plain=plain)
    assert answer == json_answer(response.model_dump())
    if plain:
        assert orjson.loads(answer.raw) == answer.body
        assert only_plain_values(response.model_dump())
        assert json.loads(answer.raw) == response.model_dump()


def only_plain_values(value: Any) -> bool:
    """Every container a dict with string keys or a list, every leaf
    exactly a str, int, bool or None: no float, no subclass."""
    if isinstance(value, dict):
        return all(type(k) is str and only_plain_values(v) for k, v in value.items())
    if type(value) is list:
        return all(map(only_plain_values, value))
    return type(value) in (str, int, bool, type(None))


# --- the engine's answers ----------------------------------------------------


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[DerenderEngine, SampleBuilder]]:
    engine = DerenderEngine.build(sample_config())
    yield engine, SampleBuilder(qwen3_family(Path(sample_config().model or "")))
    engine.close()


@requires_fast("decode", "responses")
def test_common_answers_take_the_direct_writer_and_equal_the_reference_answers(
    engines: tuple[DerenderEngine, SampleBuilder],
) -> None:
    """The sample's answers are plain (so the direct writer is what this
    suite proves), and equal the reference path's, which writes with
    ``JSONResponse``, once the random parts are blanked."""
    from tests.helpers import normalized_bytes

    engine, b = engines
    reference = engine.in_mode(decode="reference")
    cases = [(Endpoint.CHAT, body) for body in chat_bodies(b)] + [(Endpoint.COMPLETION, body) for body in completion_bodies(b)]
    direct = 0
    for endpoint, body in cases:
        fast = engine.post(endpoint, copy.deepcopy(body))
        expected = reference.post(endpoint, copy.deepcopy(body))
        assert fast.status == expected.status
        assert normalized_bytes(fast.raw) == normalized_bytes(expected.raw)
        direct += "body" in fast.__dict__  # the direct writer kept its tree
        assert fast.body == orjson.loads(fast.raw)
    assert direct >= len(cases) // 2
