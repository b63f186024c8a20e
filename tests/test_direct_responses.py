"""The fast decode's one-shot handlers (`responses.DirectResponses`), which
write the dict vLLM's response models would only be dumped to, against
vLLM's own handlers (``derender_chat_response`` and
``derender_completion_response``, run by ``--decode reference``).

Bodies are drawn from the sample's corpus with the fields the handlers
read varied: ``kv_transfer_params``, ``metrics`` and ``prompt_logprobs``
(which keep vLLM's models), the generate usage, ``return_token_ids``,
``return_tokens_as_token_ids``, ``include_reasoning``,
logprobs, stop reasons, the model name, prompt counts past 64 bits,
missing request ids, empty outputs, and completions whose responses
disagree on ``kv_transfer_params`` (vLLM warns). The answers must be the
same bytes, ``created`` and random ids blanked, with the same vLLM log
lines; bodies that stay plain must take the direct writer."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from derender_core import DerenderEngine, Endpoint
from derender_core.logs import collected_vllm_logs
from tests.conftest import sample_config
from tests.helpers import normalized_bytes, requires_fast
from tests.sample_inputs import SampleBuilder, chat_bodies, completion_bodies, qwen3_family

Corpus = list[tuple[Endpoint, dict[str, Any]]]

pytestmark = requires_fast("decode", "responses")


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[DerenderEngine, DerenderEngine, Corpus]]:
    engine = DerenderEngine.build(sample_config())
    b = SampleBuilder(qwen3_family(Path(sample_config().model or "")))
    corpus: Corpus = [(Endpoint.CHAT, body) for body in chat_bodies(b)]
    corpus += [(Endpoint.COMPLETION, body) for body in completion_bodies(b)]
    yield engine, engine.in_mode(decode="reference"), corpus
    engine.close()


ANYTHING = st.sampled_from(["absent", None, {}, {"a": 1}, {"a": 1.5}, [], "x", 7])
RESPONSE_FIELDS = {
    "kv_transfer_params": ANYTHING,
    "metrics": st.sampled_from(["absent", None, {}, {"arrival_time": 1.0}]),
    # vLLM 0.34 fills a missing decoded_token, byte fallbacks corrected by
    # the prompt before them (Qwen3: 81250, 243, 237 are the bytes of " 𝕏").
    "prompt_logprobs": st.sampled_from(
        [
            "absent",
            None,
            [None],
            [None, {"7": {"logprob": -0.5}}],
            [
                None,
                {"81250": {"logprob": -0.5}},
                {"243": {"logprob": -1.0, "rank": 2}, "7": {"logprob": -2.0}},
                {"237": {"logprob": -0.25}},
            ],
            [None, {"7": {"logprob": -0.5, "decoded_token": "given"}}],
        ]
    ),
    # vLLM 0.34 counts the prompt from here when the body gives no count.
    "usage": st.sampled_from(["absent", None, {"prompt_tokens": 5}, {"prompt_tokens": 0, "completion_tokens": 2}]),
    "request_id": st.sampled_from(["absent", "r-1", "", "é\u2028"]),
    "model": st.sampled_from(["absent", None, "m"]),
}
REQUEST_FIELDS = {
    "return_token_ids": st.sampled_from(["absent", True, False]),
    "include_reasoning": st.sampled_from(["absent", True, False]),
    "logprobs": st.sampled_from(["absent", True, False]),
    "top_logprobs": st.sampled_from(["absent", 0, 2]),
    # vLLM 0.34 writes logprob tokens as ``token_id:N``; 0.33 ignores it.
    "return_tokens_as_token_ids": st.sampled_from(["absent", None, True, False]),
    "model": st.sampled_from(["absent", None, "qwen3-sample"]),
}
CHOICE_FIELDS = {
    "stop_reason": st.sampled_from(["absent", None, 0, 7, "stop", "</s>"]),
    "finish_reason": st.sampled_from(["absent", None, "stop", "length", "abort"]),
    "token_ids": st.sampled_from(["keep", "keep", []]),
}
BODY_FIELDS = {
    "model": st.sampled_from(["absent", None, "qwen3-sample", "other"]),
    "prompt_tokens": st.sampled_from(["absent", None, 0, 3, 2**70]),
}


def _vary(data: Any, target: dict[str, Any], fields: dict[str, Any], label: str) -> None:
    for key, values in fields.items():
        if not data.draw(st.booleans(), label=f"vary {label}.{key}"):
            continue
        value = data.draw(values, label=f"{label}.{key}")
        if value == "keep":
            continue
        if value == "absent":
            target.pop(key, None)
        else:
            target[key] = copy.deepcopy(value)


def _drawn(data: Any, corpus: Corpus) -> tuple[Endpoint, dict[str, Any]]:
    endpoint, base = data.draw(st.sampled_from(corpus), label="base body")
    body = copy.deepcopy(base)
    _vary(data, body, BODY_FIELDS, "body")
    if isinstance(body.get(endpoint.request_key), dict):
        _vary(data, body[endpoint.request_key], REQUEST_FIELDS, "request")
    responses = [body["generate_response"]] if endpoint is Endpoint.CHAT else body["generate_responses"]
    for response in responses:
        _vary(data, response, RESPONSE_FIELDS, "response")
        for choice in response["choices"]:
            _vary(data, choice, CHOICE_FIELDS, "choice")
    return endpoint, body


def _answer(engine: DerenderEngine, endpoint: Endpoint, body: dict[str, Any]) -> tuple[Any, ...]:
    import vllm.logger

    vllm.logger._print_warning_once.cache_clear()
    with collected_vllm_logs(verbose=False) as logs:
        answer = engine.post(endpoint, copy.deepcopy(body))
    raw = answer.raw
    if _random_id(endpoint, body):  # in the answer's id, or in an error's words
        raw = re.sub(rb"\b[0-9a-f]{16,32}\b", b"<random id>", raw)
    return answer.status, normalized_bytes(raw), [line.key for line in logs]


def _random_id(endpoint: Endpoint, body: dict[str, Any]) -> bool:
    """Whether an id in the answer may be drawn at random: a response
    gives none."""
    responses = [body["generate_response"]] if endpoint is Endpoint.CHAT else body["generate_responses"]
    return any("request_id" not in response for response in responses)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_the_direct_answers_are_vllms_handlers_answers(
    engines: tuple[DerenderEngine, DerenderEngine, Corpus], data: Any
) -> None:
    engine, reference, corpus = engines
    endpoint, body = _drawn(data, corpus)
    answer = _answer(engine, endpoint, body)
    event(f"{endpoint.value} {answer[0]}")
    assert answer == _answer(reference, endpoint, body)


def _handled(engine: DerenderEngine, endpoint: Endpoint, body: dict[str, Any]) -> Any:
    """What the fast decode's handler answers for `body`, before it is
    written: a dict (written directly), a response model or an error."""
    engine.post(endpoint, copy.deepcopy(body))  # the parsers' lexicon, shared
    request = engine._validated(endpoint, copy.deepcopy(body))
    direct = engine._direct
    assert direct is not None
    handler = direct.chat if endpoint is Endpoint.CHAT else direct.completion
    return engine._run(handler(request))


def test_plain_answers_are_written_directly_and_the_rest_keep_vllms_models(
    engines: tuple[DerenderEngine, DerenderEngine, Corpus],
) -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse
    from vllm.entrypoints.openai.completion.protocol import CompletionResponse

    engine, _, corpus = engines
    for endpoint, body in corpus:
        model = ChatCompletionResponse if endpoint is Endpoint.CHAT else CompletionResponse
        handled = _handled(engine, endpoint, body)
        assert type(handled) in (dict, model), (endpoint, type(handled))
        # The sample's own answers carry no logprobs models: all direct.
        assert type(handled) is dict, body
        held = copy.deepcopy(body)
        responses = [held["generate_response"]] if endpoint is Endpoint.CHAT else held["generate_responses"]
        for response in responses:
            response["kv_transfer_params"] = {"k": 1}
        assert type(_handled(engine, endpoint, held)) is model
        for response in responses:
            response["kv_transfer_params"] = None
        responses[0]["metrics"] = {}
        # A completion of several prompts drops the metrics (vLLM: they
        # describe one prompt), and is plain again.
        assert type(_handled(engine, endpoint, held)) is (model if len(responses) == 1 else dict)


_TEXTS = st.none() | st.text(max_size=3)
_CALLS = st.lists(
    st.fixed_dictionaries(
        {
            "id": st.text(max_size=3),
            "function": st.fixed_dictionaries({"name": st.text(max_size=2), "arguments": st.text(max_size=3)}),
        },
        optional={"type": st.just("function"), "index": st.integers(0, 2)},
    ),
    max_size=2,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    fields=st.fixed_dictionaries(
        {"role": st.sampled_from(["assistant", "tool", ""])},
        optional={
            "content": _TEXTS,
            "reasoning": _TEXTS,
            "refusal": _TEXTS,
            "tool_calls": _CALLS,
            "function_call": st.none() | st.just({"name": "f", "arguments": "{}"}),
            "annotations": st.none() | st.just("set"),
            "extra": st.integers(0, 1),
        },
    )
)
def test_messages_written_directly_are_their_models_dumps(
    engines: tuple[DerenderEngine, DerenderEngine, Corpus], fields: dict[str, Any]
) -> None:
    """A message the direct writer writes (`DirectResponses._message_dump`)
    is its model's ``model_dump()``, key for key and type for type; any
    other (a refusal, a function call, annotations, extras) is left to the
    model. The usual message, strings and tool calls of strings, is written."""
    import orjson
    from vllm.entrypoints.openai.chat_completion.protocol import ChatMessage

    direct = engines[0]._direct
    annotated = fields.get("annotations") == "set"
    message = ChatMessage.model_validate({k: v for k, v in fields.items() if k != "annotations"})
    if annotated:  # a list of annotations on 0.34, one on 0.33: any value that is not None
        vars(message)["annotations"] = []
    written = direct._message_dump(message)
    usual = set(fields) <= {"role", "content", "reasoning", "tool_calls"} and all(
        set(call) <= {"id", "type", "function"} for call in fields.get("tool_calls", [])
    )
    event("written" if written is not None else "left to the model")
    if written is None:
        assert not usual or annotated, fields
    else:
        assert orjson.dumps(written) == orjson.dumps(message.model_dump())
