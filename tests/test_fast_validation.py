"""The one-shot body validation (`DerenderEngine._validated`) against the
full validation FastAPI does (the TypeAdapter over vLLM's request union):
the same validated request, the same body left behind, the same answer
bytes (200s and 400s) and the same vLLM log lines, over drawn bodies
(extra fields, wrong types, edge values, stream flags, tools, logprobs,
n>1) on the sample's real tokenizer."""

from __future__ import annotations

import copy
import enum
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from derender_core import DerenderEngine, Endpoint
from derender_core.logs import collected_vllm_logs
from derender_core.protocol import Answer
from derender_core.vllm_seam.logprobs import validated
from tests.conftest import sample_config
from tests.helpers import normalize
from tests.sample_inputs import (
    SampleBuilder,
    chat_bodies,
    chat_error_bodies,
    completion_bodies,
    qwen3_family,
)

class _Id(enum.IntEnum):
    SEVEN = 7


ODD_IDS = st.lists(
    st.integers(0, 200)
    | st.sampled_from([-1, True, False, 3.0, 2**63, 2**64, 2**70, "7", None, [1], _Id.SEVEN]),
    max_size=4,
)
"""Token id lists validation keeps or refuses: a bool, a float, a big int,
a subclass, a nested list among plain ids."""

EXTRA_KEYS = ["foo", "guided_json", "generate_chunk", "stream_state", "kv_transfer_params", "stream"]
VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3) | st.sampled_from([2**63, 2**70, 151_000, 10**6]),
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.text(max_size=4),
    st.lists(st.integers(-2, 200), max_size=4),
    ODD_IDS,
    st.dictionaries(st.sampled_from(["a", "type", "prompt_token_ids"]), st.integers(0, 3) | st.text(max_size=2), max_size=2),
)
STREAM_FLAGS = st.sampled_from(["absent", False, True, 0, None, "false"])


@pytest.fixture(scope="module")
def sample() -> Iterator[tuple[DerenderEngine, DerenderEngine, list[tuple[Endpoint, dict[str, Any]]]]]:
    """The sample's engine, the same engine with every body validated
    against the whole union, and the corpus of bodies to vary."""
    config = sample_config()
    engine = DerenderEngine.build(config)
    full = copy.copy(engine)
    full._validated = lambda endpoint, body: full._bodies[endpoint].validate_python(body, from_attributes=True)  # type: ignore[method-assign]
    b = SampleBuilder(qwen3_family(Path(config.model or "")))
    corpus = [(Endpoint.CHAT, body) for body in (*chat_bodies(b), *chat_error_bodies(b))]
    corpus += [(Endpoint.COMPLETION, body) for body in completion_bodies(b)]
    yield engine, full, corpus
    engine.close()


def _containers(body: Any, endpoint: Endpoint) -> list[Any]:
    """The dicts of a body a mutation may touch: the body, its request,
    the generate response and its first choice."""
    found = [body]
    if not isinstance(body, dict):
        return found
    found.append(body.get(endpoint.request_key))
    response = body.get("generate_response")
    if response is None and isinstance(body.get("generate_responses"), list) and body["generate_responses"]:
        response = body["generate_responses"][0]
    found.append(response)
    if isinstance(response, dict) and isinstance(response.get("choices"), list) and response["choices"]:
        found.append(response["choices"][0])
    return [c for c in found if isinstance(c, dict)]


def _drawn_body(data: Any, corpus: list[tuple[Endpoint, dict[str, Any]]]) -> tuple[Endpoint, dict[str, Any]]:
    endpoint, base = data.draw(st.sampled_from(corpus), label="base body")
    body = copy.deepcopy(base)
    flag = data.draw(STREAM_FLAGS, label="stream")
    if flag == "absent":
        body.pop("stream", None)
    else:
        body["stream"] = flag
    for _ in range(data.draw(st.integers(0, 3), label="mutations")):
        container = data.draw(st.sampled_from(_containers(body, endpoint)))
        key = data.draw(st.sampled_from(sorted(container) + EXTRA_KEYS), label="key")
        if data.draw(st.booleans(), label="delete") and key in container:
            del container[key]
        else:
            container[key] = data.draw(VALUES, label=f"value of {key}")
    return endpoint, body


def _outcome(validate: Any, body: dict[str, Any]) -> tuple[str, Any, dict[str, Any]]:
    """What validating `body` gives: the request's dump (its random
    request id blanked), or the error; and the body it leaves behind."""
    try:
        request = validate(body)
    except Exception as exc:  # noqa: BLE001 - compared, not hidden
        errors = exc.errors(include_url=False) if hasattr(exc, "errors") else str(exc)
        return type(exc).__name__, repr(errors), body
    # repr: type for type (True, 1 and 1.0 are equal, and a subclass too).
    return type(request).__name__, repr(_blank_request_ids(_with_logprobs_validated(request))), body


def _with_logprobs_validated(request: Any) -> dict[str, Any]:
    """The request's dump, each choice's logprobs as vLLM's code reads them:
    the fast path carries the usual shape unvalidated (`RawLogProbs`, held
    equal to vLLM's validation by test_fast_logprobs) and validates it
    where vLLM's code reads it."""
    dump: dict[str, Any] = request.model_dump()
    # A chat body's generate_response; a completion body's generate_responses.
    responses = [(getattr(request, "generate_response", None), dump.get("generate_response"))]
    responses += zip(getattr(request, "generate_responses", None) or [], dump.get("generate_responses") or [])
    for generate, dumped in responses:
        for choice, dumped_choice in zip(getattr(generate, "choices", None) or [], (dumped or {}).get("choices") or []):
            if choice.logprobs is not None:
                dumped_choice["logprobs"] = validated(choice.logprobs).model_dump()
    return dump


def _blank_request_ids(value: Any) -> Any:
    """A request id left out is drawn at random: blanked everywhere."""
    if isinstance(value, dict):
        return {k: None if k == "request_id" else _blank_request_ids(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_blank_request_ids(v) for v in value]
    return value


def _answer(engine: DerenderEngine, endpoint: Endpoint, body: dict[str, Any]) -> tuple[Any, list[Any]]:
    import vllm.logger

    vllm.logger._print_warning_once.cache_clear()
    with collected_vllm_logs(verbose=False) as logs:
        answer: Answer = engine.post(endpoint, body)
    shown: Any = answer.raw
    if answer.ok:
        shown = normalize({**answer.body, "id": None})
    else:
        shown = _drawn_ids_blanked(shown, body)
    return (answer.status, shown), [line.key for line in logs]


def _drawn_ids_blanked(raw: bytes, body: dict[str, Any]) -> bytes:
    """An error's text with the request ids vLLM drew itself blanked: a
    generate response sent without ``request_id`` gets ``random_uuid()``'s
    16 hex digits, which an error about it names. An id the body carries
    stays, so a wrong one still differs."""
    sent = repr(body).encode()
    return re.sub(rb"\b[0-9a-f]{16}\b", lambda m: m.group() if m.group() in sent else b"<drawn id>", raw)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_the_one_shot_validation_is_the_unions(sample: Any, data: Any) -> None:
    engine, _, corpus = sample
    endpoint, body = _drawn_body(data, corpus)
    fast = _outcome(lambda b: engine._validated(endpoint, b), copy.deepcopy(body))
    full = _outcome(lambda b: engine._bodies[endpoint].validate_python(b, from_attributes=True), copy.deepcopy(body))
    event(f"{endpoint.value}: {fast[0]}")
    assert fast == full


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_answers_and_logs_are_the_full_validations(sample: Any, data: Any) -> None:
    engine, full, corpus = sample
    endpoint, body = _drawn_body(data, corpus)
    assert _answer(engine, endpoint, copy.deepcopy(body)) == _answer(full, endpoint, copy.deepcopy(body))


def test_an_error_naming_a_request_id_vllm_drew_compares_with_it_blanked(sample: Any) -> None:
    """The drawn test's comparison holds where vLLM names an id it drew:
    a generate response sent without ``request_id`` gets a random one, and
    the error about its empty choice names it, a new one each time."""
    engine, full, corpus = sample
    endpoint, body = next((e, b) for e, b in corpus if e is Endpoint.COMPLETION and len(b["generate_responses"]) > 1)
    body = copy.deepcopy(body)
    del body["generate_responses"][0]["request_id"]
    del body["generate_responses"][0]["choices"][0]["token_ids"]
    raws = [e.post(endpoint, copy.deepcopy(body)).raw for e in (engine, full)]
    assert raws[0] != raws[1] and b"has empty or null token_ids" in raws[0]
    fast, whole = (_answer(e, endpoint, copy.deepcopy(body)) for e in (engine, full))
    assert fast == whole
    assert b"<drawn id>" in fast[0][1]


def test_the_corpus_takes_the_one_shot_member(sample: Any) -> None:
    """The fast path is taken: a good one-shot body validates once, as the
    one-shot member alone, not as the union (which validates the request
    inside it twice)."""
    engine, _, corpus = sample
    seen = []
    for endpoint, body in corpus[:3]:
        _, member = engine._one_shot_bodies[endpoint]
        calls: list[Any] = []
        original = member.validate_python
        member.validate_python = _counted(original, calls)  # type: ignore[method-assign]
        try:
            assert engine.post(endpoint, copy.deepcopy(body)).ok
        finally:
            member.validate_python = original  # type: ignore[method-assign]
        seen.append(len(calls))
    assert seen == [1, 1, 1]


def _counted(validate: Any, calls: list[Any]) -> Any:
    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return validate(*args, **kwargs)

    return counted


def test_debug_logging_takes_the_union(sample: Any) -> None:
    """With vLLM's validators logging at debug level, the union's second
    pass logs its lines too, so every body takes the union."""
    engine, full, corpus = sample
    endpoint, body = corpus[0]
    body = {**copy.deepcopy(body), "foo": 1}
    body[endpoint.request_key] = {**body[endpoint.request_key], "bar": 2}
    vllm_logger = logging.getLogger("vllm")
    level = vllm_logger.level
    vllm_logger.setLevel(logging.DEBUG)
    try:
        fast = _answer(engine, endpoint, copy.deepcopy(body))
        union = _answer(full, endpoint, copy.deepcopy(body))
    finally:
        vllm_logger.setLevel(level)
    assert fast == union
    assert len(fast[1]) >= 2  # the extra field is logged by each member's pass


_TEMPLATE_KWARG_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-1, 2),
    st.floats(allow_nan=False, width=16),
    st.sampled_from(["auto", "none", "low", ""]),
    st.lists(st.integers(0, 2), max_size=2),
    st.dictionaries(st.sampled_from(["a", "b"]), st.integers(0, 2), max_size=2),
)
_TEMPLATE_FIELDS = {
    "reasoning_effort": st.sampled_from([None, "none", "low", "medium", "high"]),
    "add_generation_prompt": st.booleans(),
    "continue_final_message": st.booleans(),
    "documents": st.sampled_from([None, [], [{"title": "t", "text": "x"}]]),
    "chat_template_kwargs": st.none()
    | st.dictionaries(
        st.sampled_from(["enable_thinking", "thinking", "custom", "reasoning_effort"]), _TEMPLATE_KWARG_VALUES, max_size=3
    ),
    "chat_template": st.sampled_from([None, "{{ messages }}"]),
    "tool_choice": st.sampled_from(["none", "auto"]),
}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_remembered_template_kwargs_are_vllms(sample: Any, data: Any) -> None:
    """The chat template kwargs the fast decode remembers per key
    (`fast.template_kwargs_key`) are vLLM's ``_resolve_chat_template_kwargs``
    answer for each request, whatever requests came before (each field it
    reads drawn), under drawn derenderer settings; each call hands out a
    dict of its own."""
    from pydantic import ValidationError
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.exceptions import VLLMValidationError
    from vllm.renderers.online_derenderer import OnlineDerenderer

    engine = sample[0]
    derenderer = engine._serving.online_derenderer
    if not derenderer.fast:
        pytest.skip("the fast decode is off: vLLM's function answers every call")
    settings_kept = (derenderer.reasoning_effort_map, derenderer.default_chat_template_kwargs)
    derenderer.reasoning_effort_map = data.draw(st.sampled_from([None, {}, {"low": "minimal", "none": "off"}]))
    derenderer.default_chat_template_kwargs = data.draw(
        st.sampled_from([None, {}, {"enable_thinking": False}, {"custom": "default", "thinking": None}])
    )
    derenderer._template_kwargs.clear()
    try:
        for _ in range(data.draw(st.integers(1, 6), label="requests")):
            raw: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}
            for name, values in _TEMPLATE_FIELDS.items():
                if data.draw(st.booleans(), label=f"set {name}"):
                    raw[name] = data.draw(values, label=name)
            try:
                request = ChatCompletionRequest.model_validate(raw)
            except (ValidationError, VLLMValidationError):  # vLLM refuses it (a tool choice without tools)
                continue
            want = repr(OnlineDerenderer._resolve_chat_template_kwargs(derenderer, request))
            got = derenderer._resolve_chat_template_kwargs(request)
            assert repr(got) == want  # repr: True, 1 and 1.0 are told apart
            got["written by a parser"] = True
            assert repr(derenderer._resolve_chat_template_kwargs(request)) == want
        event(f"remembered: {len(derenderer._template_kwargs)}")
    finally:
        derenderer.reasoning_effort_map, derenderer.default_chat_template_kwargs = settings_kept
        derenderer._template_kwargs.clear()


@settings(max_examples=200, deadline=None)
@given(random_bytes=st.binary(min_size=16, max_size=16))
def test_fast_random_uuid_is_vllms_for_the_same_bytes(random_bytes: bytes, monkeypatch_module: Any) -> None:
    """The fast decode's ids (`parsers.fast_random_uuid`: a request's own
    id, each tool call's) are vLLM's ``random_uuid()`` for the same random
    bytes: vLLM's function run on drawn bytes gives the bits ours makes
    of the 8 it draws."""
    import os

    from vllm.utils import random_uuid

    from derender_core.vllm_seam import parsers

    monkeypatch_module.setattr(os, "urandom", lambda size: random_bytes[-size:])
    try:
        assert random_uuid() == f"{parsers.uuid4_low_bits(random_bytes[8:]):016x}"
        assert parsers.fast_random_uuid() == random_uuid()
    finally:
        monkeypatch_module.undo()


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    """A monkeypatch a hypothesis test may use across its examples."""
    with pytest.MonkeyPatch.context() as patch:
        yield patch

