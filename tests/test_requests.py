"""The usual chat request built without validation's round trip
(`vllm_seam.requests.ChatRequests`), against vLLM's own validation of the
same dict: hypothesis-drawn requests that mix the usual fields with values
vLLM refuses, converts or keeps, and every chat request of the sample and
of every family's corpus. A request is built only where validation accepts
it, and then equals it in every field's value, type and order, the fields
set, the extras, the private attributes and the dump, and leaves the dict
it came from as validation leaves it. The whole answers are compared with
the reference path's (which validates every request) in
``tests/test_families.py::test_fast_answers_are_the_reference_answers``."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from derender_core import Endpoint
from derender_core.vllm_seam.render import _chat_requests
from derender_core.vllm_seam.requests import ChatCompletionRequest
from tests.conftest import sample_config
from tests.helpers import REPO, offline_env
from tests.sample_inputs import SampleBuilder, chat_bodies, qwen3_family

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def strictly_equal(a: Any, b: Any) -> bool:
    """Equal, and of the same types all the way down, dicts in the same
    order (Python's ``==`` holds ``1 == 1.0 == True`` and ignores order)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, BaseModel):
        return (
            strictly_equal(a.__dict__, b.__dict__)
            and a.__pydantic_fields_set__ == b.__pydantic_fields_set__
            and strictly_equal(a.__pydantic_extra__, b.__pydantic_extra__)
            and strictly_equal(a.__pydantic_private__, b.__pydantic_private__)
        )
    if type(a) is dict:
        return list(a) == list(b) and all(strictly_equal(a[k], b[k]) for k in a)
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(strictly_equal(x, y) for x, y in zip(a, b, strict=True))
    if type(a) is float and math.isnan(a):
        return math.isnan(b)
    return bool(a == b)


def same_request(built: ChatCompletionRequest, validated: ChatCompletionRequest) -> bool:
    """Strictly equal but for the request id, random by vLLM's factory."""
    ours, theirs = dict(built.__dict__), dict(validated.__dict__)
    ids = ours.pop("request_id"), theirs.pop("request_id")
    return (
        all(type(i) is str and len(i) == len(ids[1]) for i in ids)
        and strictly_equal(ours, theirs)
        and built.__pydantic_fields_set__ == validated.__pydantic_fields_set__
        and strictly_equal(built.__pydantic_extra__, validated.__pydantic_extra__)
        and strictly_equal(built.__pydantic_private__, validated.__pydantic_private__)
        and built.model_dump_json(exclude={"request_id"}) == validated.model_dump_json(exclude={"request_id"})
    )


def check(raw: dict[str, Any]) -> ChatCompletionRequest | None:
    """Build `raw` and validate it; whatever is built equals validation."""
    ours_raw, theirs_raw = copy.deepcopy(raw), copy.deepcopy(raw)
    built = _chat_requests().build(ours_raw)
    try:
        validated: ChatCompletionRequest | None = ChatCompletionRequest.model_validate(theirs_raw)
    except Exception:  # noqa: BLE001 - any refusal
        validated = None
    if built is not None:
        assert validated is not None, f"built a request vLLM refuses: {raw!r}"
        assert same_request(built, validated), raw
        assert strictly_equal(ours_raw, theirs_raw), "the dict is left as validation leaves it"
    return built


# --- drawn requests ------------------------------------------------------------

ODD = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 5), st.integers(), st.floats(allow_nan=True), st.text(max_size=3),
    st.just([]), st.just({}), st.just([1]), st.just({"a": 1}), st.integers(1 << 62, 1 << 66), st.just(1.0),
)  # fmt: skip
ROLES = st.sampled_from(["system", "developer", "user", "assistant", "tool", "function", "other", ""])
CALL = st.fixed_dictionaries(
    {"id": st.text(max_size=3), "type": st.just("function"),
     "function": st.fixed_dictionaries({"name": st.text(max_size=3), "arguments": st.text(max_size=6)})},
)  # fmt: skip
ODD_CALL = st.one_of(
    ODD, st.fixed_dictionaries({"id": ODD, "type": st.sampled_from(["function", "other"]), "function": st.one_of(ODD, st.just({"name": "n"}), st.just({"name": "n", "arguments": {}}))}),
    st.just({"id": "i", "type": "function", "function": {"name": "n", "arguments": "{}"}, "index": 0}),
)  # fmt: skip
SHAPED = st.fixed_dictionaries(
    {"role": ROLES},
    optional={
        "content": st.one_of(st.text(max_size=6), st.none()), "name": st.text(max_size=3),
        "tool_call_id": st.text(max_size=3), "reasoning": st.text(max_size=3),
        "tool_calls": st.one_of(st.lists(CALL, min_size=1, max_size=2), st.lists(ODD_CALL, max_size=2), st.just([])),
    },
)  # fmt: skip


@st.composite
def shuffled(draw: st.DrawFn, dicts: st.SearchStrategy[dict[str, Any]]) -> dict[str, Any]:
    """A dict with its keys in any order: a message's form must not hang on it."""
    value = draw(dicts)
    return {key: value[key] for key in draw(st.permutations(list(value)))}


MESSAGE = st.one_of(
    shuffled(SHAPED),
    st.fixed_dictionaries({"role": ROLES, "content": st.text(max_size=8)}),
    st.fixed_dictionaries({"role": ROLES, "content": st.text(max_size=8)}, optional={"name": st.text(max_size=3), "reasoning_content": ODD, "tool_calls": st.just([]), "tool_call_id": st.just("c1")}),
    st.fixed_dictionaries({"role": ROLES, "content": ODD}),
    st.fixed_dictionaries({"content": st.text(max_size=3)}),
    st.just([{"role": "user", "content": "x"}]),
    st.just({"role": "user", "content": [{"type": "text", "text": "hi"}]}),
)  # fmt: skip
TOOLS = st.one_of(
    st.just([WEATHER]), st.just([WEATHER, {**WEATHER, "function": {**WEATHER["function"], "name": "other"}}]),
    st.just([]), st.just([{"type": "function"}]), st.just([{**WEATHER, "extra": 1}]), ODD,
)  # fmt: skip
FLOATS = st.one_of(st.floats(allow_nan=False), st.integers(-3, 3), st.integers(), ODD)
INTS = st.one_of(st.integers(-3, 5), st.integers(), ODD)
BOOLS = st.one_of(st.booleans(), ODD)
OPTIONAL = {
    "model": st.one_of(st.text(max_size=5), ODD),
    "tools": TOOLS,
    "tool_choice": st.one_of(
        st.sampled_from(["auto", "none", "required", "bogus"]),
        st.just({"type": "function", "function": {"name": "get_weather"}}), ODD,
    ),  # fmt: skip
    "temperature": FLOATS,
    "top_p": FLOATS,
    "min_p": FLOATS,
    "presence_penalty": FLOATS,
    "frequency_penalty": FLOATS,
    "repetition_penalty": FLOATS,
    "max_tokens": INTS,
    "max_completion_tokens": INTS,
    "top_k": INTS,
    "n": INTS,
    "seed": st.one_of(INTS, st.sampled_from([-(1 << 63), (1 << 63) - 1, 1 << 63, -(1 << 63) - 1])),
    "top_logprobs": st.one_of(st.integers(-2, 6), ODD),
    "logprobs": BOOLS,
    "stream": BOOLS,
    "skip_special_tokens": BOOLS,
    "spaces_between_special_tokens": BOOLS,
    "add_generation_prompt": BOOLS,
    "continue_final_message": BOOLS,
    "include_stop_str_in_output": BOOLS,
    "echo": BOOLS,
    "parallel_tool_calls": BOOLS,
    "include_reasoning": BOOLS,
    "chat_template_kwargs": st.one_of(
        st.dictionaries(st.text(max_size=4), st.one_of(st.booleans(), st.text(max_size=3))), ODD,
        st.just({1: "not a string key"}),
    ),  # fmt: skip
    # Lists up to past VLLM_MAX_STOP_STRINGS (4 unless set), which the
    # model reads from vLLM's env as it is imported.
    "stop": st.one_of(
        st.lists(st.text(max_size=3), max_size=10), st.lists(st.text(max_size=2), min_size=3, max_size=9),
        st.text(max_size=3), ODD, st.just(["a", 1]),
    ),  # fmt: skip
    "cache_salt": st.one_of(st.just("salt"), st.just("")),
    "stream_options": st.just({"include_usage": True}),
    "unknown_field": ODD,
}


@st.composite
def usual_requests(draw: st.DrawFn) -> dict[str, Any]:
    """Requests of the usual fields with good values only: each is built."""
    roles = st.sampled_from(["system", "developer", "user", "assistant"])
    text = st.fixed_dictionaries({"role": roles, "content": st.text()}, optional={"name": st.text(max_size=4)})
    calls = st.fixed_dictionaries(
        {"role": st.just("assistant"), "content": st.one_of(st.none(), st.text()), "tool_calls": st.lists(CALL, min_size=1, max_size=3)},
        optional={"reasoning": st.text(max_size=5)},
    )  # fmt: skip
    results = st.fixed_dictionaries({"role": st.just("tool"), "content": st.text(), "tool_call_id": st.text(max_size=4)})
    raw: dict[str, Any] = {"messages": draw(st.lists(shuffled(st.one_of(text, calls, results)), max_size=5))}
    if draw(st.booleans()):
        raw["tools"] = [WEATHER]
        if draw(st.booleans()):
            raw["tool_choice"] = draw(st.sampled_from(["auto", "none", "required"]))
    good = {
        "model": st.one_of(st.none(), st.text()),
        "temperature": st.one_of(st.none(), st.floats(allow_nan=False, allow_infinity=False), st.integers(-(1 << 53), 1 << 53)),
        "max_tokens": st.one_of(st.none(), st.integers()),
        "seed": st.integers(-(1 << 63), (1 << 63) - 1),
        "logprobs": st.just(True),
        "top_logprobs": st.integers(0, 20),
        "skip_special_tokens": st.booleans(),
        "chat_template_kwargs": st.dictionaries(st.text(max_size=6), st.one_of(st.booleans(), st.none(), st.text())),
    }
    for key in draw(st.lists(st.sampled_from(sorted(good)), unique=True)):
        raw[key] = draw(good[key])
    if "top_logprobs" in raw:
        raw["logprobs"] = True
    return raw


@st.composite
def wild_requests(draw: st.DrawFn) -> dict[str, Any]:
    raw: dict[str, Any] = {}
    chosen = draw(st.lists(st.sampled_from(sorted(OPTIONAL)), max_size=6, unique=True))
    messages = draw(st.one_of(st.lists(MESSAGE, max_size=4), ODD))
    keys = ["messages", *chosen]
    for key in draw(st.permutations(keys)):
        raw[key] = messages if key == "messages" else draw(OPTIONAL[key])
    if draw(st.integers(0, 9)) == 0:
        del raw["messages"]
    return raw


@st.composite
def nearly_usual_requests(draw: st.DrawFn) -> dict[str, Any]:
    """A usual request with a field or a message changed to anything."""
    raw = draw(usual_requests())
    for key in draw(st.lists(st.sampled_from(sorted(OPTIONAL)), min_size=1, max_size=2, unique=True)):
        raw[key] = draw(OPTIONAL[key])
    if raw["messages"] and draw(st.booleans()):
        raw["messages"][draw(st.integers(0, len(raw["messages"]) - 1))] = draw(MESSAGE)
    return raw


def requests() -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(wild_requests(), nearly_usual_requests(), usual_requests())


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests())
def test_a_built_request_is_vllms_validation_of_it(raw: dict[str, Any]) -> None:
    built = check(raw)
    event("built" if built is not None else "validated as before")
    if built is not None and any("tool_calls" in message for message in built.messages):
        event("built, with tool calls")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(usual_requests())
def test_the_usual_request_is_built(raw: dict[str, Any]) -> None:
    assert check(raw) is not None, raw


def test_every_chat_request_of_the_sample_is_built_as_validated() -> None:
    builder = SampleBuilder(qwen3_family(sample_config().model))
    requests = [body["chat_request"] for body in chat_bodies(builder) if isinstance(body.get("chat_request"), dict)]
    assert requests
    # The sample's requests are usual ones: each is built.
    assert all(check(raw) is not None for raw in requests), requests


def test_the_request_filled_in_is_the_one_the_engine_answers(qwen3_stack: Any) -> None:
    """Through `DerenderEngine._validated`: the request object is the built
    one, passed through the body's validation as it is; the reference
    decode validates it."""
    engine = qwen3_stack.engine
    body = next(body for body in chat_bodies(qwen3_stack.builder) if body.get("chat_request", {}).get("tools"))
    raw = copy.deepcopy(body)
    fast = engine.in_mode(decode="fast")._validated(Endpoint.CHAT, raw)
    assert raw["chat_request"]["tool_choice"] == "auto"  # filled in, as validation does
    reference = engine.in_mode(decode="reference")._validated(Endpoint.CHAT, copy.deepcopy(body))
    assert same_request(fast.chat_request, reference.chat_request)
    assert strictly_equal(
        fast.model_dump(exclude={"chat_request"}), reference.model_dump(exclude={"chat_request"})
    )


@pytest.mark.parametrize(
    "raw",
    [
        # An empty list: refused by vLLM 0.33, dropped by 0.34 (tool_choice
        # "auto" or "required" becoming "none").
        {"messages": [{"role": "user", "content": "x"}], "tools": []},
        {"messages": [{"role": "user", "content": "x"}], "tools": [], "tool_choice": "required"},
        {"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"},  # no tools
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},  # without logprobs
        {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True, "add_generation_prompt": True},
        {"messages": [{"role": "user", "content": "x"}], "temperature": True},  # a bool, not a number
        {"messages": [{"role": "user", "content": "x", "reasoning_content": "r"}]},  # renamed by vLLM
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]},  # content parts: not built
    ],
)
def test_what_validation_refuses_or_changes_is_left_to_it(raw: dict[str, Any]) -> None:
    assert _chat_requests().build(copy.deepcopy(raw)) is None
    check(raw)


STOP_LIMIT_PROBE = """
import json, sys
from tests.test_requests import check
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
for raw in json.loads(sys.argv[1]):
    built = check(raw) is not None
    try:
        ChatCompletionRequest.model_validate(raw)
        validated = True
    except Exception:
        validated = False
    print(json.dumps([len(raw["stop"]), built, validated]))
"""


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    limit=st.integers(0, 9),
    stops=st.lists(st.lists(st.text(max_size=2), max_size=12), min_size=1, max_size=12),
)
def test_the_stop_list_limit_is_the_one_vllm_reads_from_its_env(limit: int, stops: list[list[str]]) -> None:
    """``VLLM_MAX_STOP_STRINGS`` is read as vLLM imports its protocol: in a
    process started with a drawn limit, a request is built exactly where
    vLLM's own validation accepts its stop list (issue 31 case 18)."""
    requests = [{"messages": [{"role": "user", "content": "x"}], "stop": stop} for stop in stops]
    done = subprocess.run(
        [sys.executable, "-c", STOP_LIMIT_PROBE, json.dumps(requests)],
        capture_output=True, cwd=REPO, env=offline_env(VLLM_MAX_STOP_STRINGS=str(limit)), timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-3000:]
    seen = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(seen) == len(stops)
    for length, built, validated in seen:
        assert built == validated == (length <= limit), (limit, length, built, validated)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(usual_requests(), st.lists(st.text(max_size=3), max_size=10))
def test_a_usual_request_with_stop_strings_is_built_where_validation_takes_it(raw: dict[str, Any], stop: list[str]) -> None:
    """A usual request with a drawn stop list is built exactly where vLLM's
    validation accepts it: not past VLLM_MAX_STOP_STRINGS (issue 31 case 18)."""
    raw["stop"] = stop
    try:
        ChatCompletionRequest.model_validate(copy.deepcopy(raw))
        accepted = True
    except Exception:  # noqa: BLE001 - any refusal
        accepted = False
    event(f"{len(stop)} stop strings, {'accepted' if accepted else 'refused'}")
    assert (check(raw) is not None) == accepted


@pytest.mark.parametrize("past", [0, 1, 4])
def test_a_stop_list_past_the_limit_is_left_to_validation(past: int) -> None:
    """Past the limit of this process's vLLM the request is not built, and
    validation refuses it (`List should have at most 4 items after
    validation`, with the default limit)."""
    import vllm.envs

    length = vllm.envs.VLLM_MAX_STOP_STRINGS + past
    raw = {"messages": [{"role": "user", "content": "x"}], "stop": [f"s{k}" for k in range(length)]}
    assert (check(raw) is not None) == (past == 0)
