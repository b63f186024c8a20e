"""Requests for the render endpoints, for any model family, and the check
that derender's answers are a real render server's.

The corpus covers what shapes a rendered prompt and its ``GenerateRequest``:
tools and every ``tool_choice``, ``chat_template_kwargs``,
``reasoning_effort``, ``add_generation_prompt`` off and
``continue_final_message``, an earlier assistant turn with a tool call and
its result, sampling settings, streams, logprobs, ``n``, a response
format, given request ids; for completions, text and token prompts, several
prompts, ``echo`` and ``suffix``. And the errors: bodies FastAPI refuses,
an unknown model, bad roles, both ``add_generation_prompt`` and
``continue_final_message``, beam search, a chat template the server does not
trust, an empty body. Beside them, the corpora of ``/v1/messages/render``,
``/v1/responses/render``, ``/tokenize`` and ``/detokenize``
(`preprocessing_bodies`). tests/test_families.py runs them all on every
family, one server each.

Answers are compared byte for byte; the only thing allowed to differ is the
request id the server draws when a request has none (``chatcmpl-<16 hex>``,
``cmpl-<16 hex>``, ``-<i>`` per prompt, a Responses request's
``resp_<16 hex>``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx

from derender_core import Endpoint
from derender_core.protocol import Answer
from tests.sample_inputs import WEATHER_TOOL, SampleBuilder

_DRAWN_ID = re.compile(rb'"request_id":"(chatcmpl-|cmpl-|resp_)[0-9a-f]{16}(-\d+)?"')


def drawn_ids_blanked(raw: bytes) -> bytes:
    """An answer's bytes with the request ids drawn at random blanked
    (``resp_<16 hex>``: a Responses request's own default id)."""
    return _DRAWN_ID.sub(rb'"request_id":"\1<drawn>\2"', raw)


def render_chat_bodies(b: SampleBuilder) -> Iterator[tuple[str, Any]]:
    """(name, body) pairs for ``/v1/chat/completions/render``."""
    model = b.family.served_name
    ask = [{"role": "user", "content": "What's the weather in Paris?"}]
    tools = [WEATHER_TOOL]
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [
        {"role": "system", "content": "You are terse."},
        *ask,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    yield "plain", {"model": model, "messages": ask}
    yield "given-id", {"model": model, "messages": ask, "request_id": "render-given-id"}
    yield "no-model", {"messages": ask}
    yield "tools-auto", {"model": model, "messages": ask, "tools": tools, "tool_choice": "auto"}
    yield "tools-none", {"model": model, "messages": ask, "tools": tools, "tool_choice": "none"}
    yield "tools-required", {"model": model, "messages": ask, "tools": tools, "tool_choice": "required"}
    yield "tools-named", {
        "model": model, "messages": ask, "tools": tools,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }  # fmt: skip
    yield "tool-history", {"model": model, "messages": history, "tools": tools}
    if b.family.thinking_off:
        yield "thinking-off", {"model": model, "messages": ask, "chat_template_kwargs": b.family.thinking_off}
    yield "template-kwargs", {"model": model, "messages": ask, "chat_template_kwargs": {"custom_flag": True}}
    yield "reasoning-effort", {"model": model, "messages": ask, "reasoning_effort": "low"}
    yield "no-generation-prompt", {"model": model, "messages": ask, "add_generation_prompt": False}
    yield "continue-final", {
        "model": model, "add_generation_prompt": False, "continue_final_message": True,
        "messages": [*ask, {"role": "assistant", "content": "It is"}],
    }  # fmt: skip
    yield "sampling", {
        "model": model, "messages": ask, "temperature": 0.2, "top_p": 0.9, "max_tokens": 64, "seed": 7,
        "stop": ["\n\n"], "n": 2, "logprobs": True, "top_logprobs": 3, "presence_penalty": 0.5,
    }  # fmt: skip
    yield "max-completion-tokens", {"model": model, "messages": ask, "max_completion_tokens": 12}
    yield "stream", {
        "model": model, "messages": ask, "stream": True, "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }  # fmt: skip
    yield "json-schema", {
        "model": model, "messages": ask,
        "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}},
    }  # fmt: skip
    yield "unicode", {"model": model, "messages": [{"role": "user", "content": "北京多云 🌧️ «ß»"}]}
    yield "content-parts", {"model": model, "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}
    # Errors.
    yield "error-unknown-model", {"model": "no-such-model", "messages": ask}
    yield "error-no-messages", {"model": model}
    yield "error-messages-not-a-list", {"model": model, "messages": "hello"}
    yield "error-bad-role", {"model": model, "messages": [{"role": "robot", "content": "beep"}]}
    yield "error-both-generation-modes", {
        "model": model, "messages": ask, "add_generation_prompt": True, "continue_final_message": True,
    }  # fmt: skip
    yield "error-beam-search", {"model": model, "messages": ask, "use_beam_search": True}
    yield "error-untrusted-template", {"model": model, "messages": ask, "chat_template": "{{ messages }}"}
    yield "error-bad-temperature", {"model": model, "messages": ask, "temperature": "hot"}
    yield "error-not-an-object", [1, 2]
    yield "error-null", None


def render_completion_bodies(b: SampleBuilder) -> Iterator[tuple[str, Any]]:
    """(name, body) pairs for ``/v1/completions/render``."""
    model = b.family.served_name
    prompt = "The weather in Paris is"
    yield "text", {"model": model, "prompt": prompt}
    yield "given-id", {"model": model, "prompt": prompt, "request_id": "render-given-id", "max_tokens": 5}
    yield "two-prompts", {"model": model, "prompt": [prompt, "Rome is"], "n": 2, "temperature": 0.5}
    yield "token-prompt", {"model": model, "prompt": b.encode(prompt)}
    yield "two-token-prompts", {"model": model, "prompt": [b.encode(prompt), b.encode("Rome")]}
    yield "echo", {"model": model, "prompt": prompt, "echo": True, "logprobs": 2, "stream": True}
    yield "unicode", {"model": model, "prompt": "北京多云 🌧️ «ß»", "stop": ["."], "seed": 3}
    yield "error-unknown-model", {"model": "no-such-model", "prompt": prompt}
    yield "error-no-prompt", {"model": model}
    yield "error-suffix", {"model": model, "prompt": prompt, "suffix": "!"}
    yield "error-beam-search", {"model": model, "prompt": prompt, "use_beam_search": True}
    yield "error-negative-token", {"model": model, "prompt": [-1, 5]}
    yield "error-null", None


ANTHROPIC_WEATHER_TOOL = {
    "name": WEATHER_TOOL["function"]["name"],
    "description": WEATHER_TOOL["function"]["description"],
    "input_schema": WEATHER_TOOL["function"]["parameters"],
}
RESPONSES_WEATHER_TOOL = {"type": "function", **WEATHER_TOOL["function"]}
TINY_PNG = (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
)


def render_messages_bodies(b: SampleBuilder) -> Iterator[tuple[str, Any]]:
    """(name, body) pairs for ``/v1/messages/render`` (Anthropic Messages)."""
    model = b.family.served_name
    ask = [{"role": "user", "content": "What's the weather in Paris?"}]
    tools = [ANTHROPIC_WEATHER_TOOL]
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": '{"temperature": 21}'}
    yield "plain", {"model": model, "max_tokens": 64, "messages": ask}
    yield "system-text", {"model": model, "max_tokens": 64, "system": "You are terse.", "messages": ask}
    yield "system-blocks", {
        "model": model, "max_tokens": 64, "messages": ask,
        "system": [{"type": "text", "text": "You are terse."}, {"type": "text", "text": "Answer in French."}],
    }  # fmt: skip
    yield "content-blocks", {
        "model": model, "max_tokens": 64,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}],
    }  # fmt: skip
    yield "tools-auto", {"model": model, "max_tokens": 64, "messages": ask, "tools": tools, "tool_choice": {"type": "auto"}}
    yield "tools-any", {"model": model, "max_tokens": 64, "messages": ask, "tools": tools, "tool_choice": {"type": "any"}}
    yield "tools-none", {"model": model, "max_tokens": 64, "messages": ask, "tools": tools, "tool_choice": {"type": "none"}}
    yield "tools-named", {
        "model": model, "max_tokens": 64, "messages": ask, "tools": tools,
        "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
    }  # fmt: skip
    yield "tool-use-and-result", {
        "model": model, "max_tokens": 64, "tools": tools,
        "messages": [*ask, {"role": "assistant", "content": [{"type": "text", "text": "Checking."}, use]},
                     {"role": "user", "content": [result]}],
    }  # fmt: skip
    yield "tool-result-blocks", {
        "model": model, "max_tokens": 64, "tools": tools,
        "messages": [*ask, {"role": "assistant", "content": [use]}, {"role": "user", "content": [
            {**result, "content": [{"type": "text", "text": "21 degrees"}], "is_error": False},
            {"type": "text", "text": "And tomorrow?"},
        ]}],
    }  # fmt: skip
    yield "thinking-blocks", {
        "model": model, "max_tokens": 64,
        "messages": [*ask, {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "The user wants weather.", "signature": "sig"},
            {"type": "text", "text": "Sunny."},
        ]}, {"role": "user", "content": "Thanks!"}],
    }  # fmt: skip
    yield "thinking-enabled", {"model": model, "max_tokens": 2048, "messages": ask, "thinking": {"type": "enabled", "budget_tokens": 1024}}
    yield "thinking-disabled", {"model": model, "max_tokens": 64, "messages": ask, "thinking": {"type": "disabled"}}
    yield "sampling", {
        "model": model, "max_tokens": 32, "messages": ask, "temperature": 0.3, "top_p": 0.9, "top_k": 5,
        "stop_sequences": ["\n\n"], "stream": True, "metadata": {"user_id": "u1"},
    }  # fmt: skip
    yield "unicode", {"model": model, "max_tokens": 16, "messages": [{"role": "user", "content": "北京多云 🌧️ «ß»"}]}
    yield "template-kwargs", {"model": model, "max_tokens": 16, "messages": ask, "chat_template_kwargs": {"custom_flag": True}}
    # Errors.
    yield "error-image", {
        "model": model, "max_tokens": 16, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": TINY_PNG}},
            {"type": "text", "text": "What is this?"},
        ]}],
    }  # fmt: skip
    yield "error-unknown-model", {"model": "no-such-model", "max_tokens": 16, "messages": ask}
    yield "error-no-max-tokens", {"model": model, "messages": ask}
    yield "error-bad-role", {"model": model, "max_tokens": 16, "messages": [{"role": "robot", "content": "beep"}]}
    yield "error-small-budget", {"model": model, "max_tokens": 64, "messages": ask, "thinking": {"type": "enabled", "budget_tokens": 10}}
    yield "error-bad-tool-choice", {"model": model, "max_tokens": 16, "messages": ask, "tools": tools, "tool_choice": {"type": "sometimes"}}
    yield "error-null", None


def render_responses_bodies(b: SampleBuilder) -> Iterator[tuple[str, Any]]:
    """(name, body) pairs for ``/v1/responses/render`` (OpenAI Responses)."""
    model = b.family.served_name
    question = "What's the weather in Paris?"
    tools = [RESPONSES_WEATHER_TOOL]
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    output = {"type": "function_call_output", "call_id": "call_1", "output": '{"temperature": 21}'}
    reasoning = {
        "type": "reasoning", "id": "rs_1", "summary": [],
        "content": [{"type": "reasoning_text", "text": "The user wants the weather."}],
    }  # fmt: skip
    yield "input-string", {"model": model, "input": question, "request_id": "resp-given-id"}
    yield "drawn-id", {"model": model, "input": question}
    yield "instructions", {"model": model, "input": question, "instructions": "You are terse."}
    yield "input-items", {"model": model, "input": [{"role": "user", "content": question}]}
    yield "input-message-parts", {
        "model": model,
        "input": [
            {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "You are terse."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": question}]},
        ],
    }  # fmt: skip
    yield "tools-auto", {"model": model, "input": question, "tools": tools, "tool_choice": "auto"}
    yield "tools-required", {"model": model, "input": question, "tools": tools, "tool_choice": "required"}
    yield "tools-none", {"model": model, "input": question, "tools": tools, "tool_choice": "none"}
    yield "function-call-history", {
        "model": model, "tools": tools, "input": [{"role": "user", "content": question}, call, output],
    }  # fmt: skip
    yield "reasoning-item", {
        "model": model, "tools": tools,
        "input": [{"role": "user", "content": question}, reasoning, call, output],
    }  # fmt: skip
    yield "reasoning-effort", {"model": model, "input": question, "reasoning": {"effort": "low"}}
    yield "sampling", {
        "model": model, "input": question, "temperature": 0.2, "top_p": 0.9, "max_output_tokens": 20,
        "stream": True, "truncation": "auto",
    }  # fmt: skip
    yield "unicode", {"model": model, "input": "北京多云 🌧️ «ß»"}
    # Errors.
    yield "error-previous-response-id", {"model": model, "input": question, "previous_response_id": "resp_1"}
    yield "error-unknown-model", {"model": "no-such-model", "input": question}
    yield "error-no-input", {"model": model}
    yield "error-bad-temperature", {"model": model, "input": question, "temperature": "hot"}
    yield "error-bad-item", {"model": model, "input": [{"type": "no_such_item"}]}
    yield "error-null", None


def tokenize_bodies(b: SampleBuilder) -> Iterator[tuple[str, Any]]:
    """(name, body) pairs for ``/tokenize``."""
    model = b.family.served_name
    ask = [{"role": "user", "content": "What's the weather in Paris?"}]
    yield "prompt", {"model": model, "prompt": "The weather in Paris is"}
    yield "no-model", {"prompt": "The weather in Paris is", "return_token_strs": True}
    yield "no-special-tokens", {"model": model, "prompt": "Paris", "add_special_tokens": False}
    yield "unicode", {"model": model, "prompt": "北京多云 🌧️ «ß»", "return_token_strs": True}
    yield "messages", {"model": model, "messages": ask}
    yield "messages-tools", {"model": model, "messages": ask, "tools": [WEATHER_TOOL], "return_token_strs": True}
    yield "messages-empty-tools", {"model": model, "messages": ask, "tools": []}
    yield "messages-no-generation-prompt", {"model": model, "messages": ask, "add_generation_prompt": False}
    yield "messages-continue-final", {
        "model": model, "add_generation_prompt": False, "continue_final_message": True,
        "messages": [*ask, {"role": "assistant", "content": "It is"}],
    }  # fmt: skip
    yield "messages-template-kwargs", {"model": model, "messages": ask, "chat_template_kwargs": {"custom_flag": True}}
    yield "error-unknown-model", {"model": "no-such-model", "prompt": "x"}
    yield "error-neither", {"model": model}
    yield "error-untrusted-template", {"model": model, "messages": ask, "chat_template": "{{ messages }}"}
    yield "error-both-generation-modes", {
        "model": model, "messages": ask, "add_generation_prompt": True, "continue_final_message": True,
    }  # fmt: skip
    yield "error-null", None


def detokenize_bodies(b: SampleBuilder) -> Iterator[tuple[str, Any]]:
    """(name, body) pairs for ``/detokenize``."""
    model = b.family.served_name
    ids = b.encode("The weather in Paris is 北京多云 🌧️")
    yield "tokens", {"model": model, "tokens": ids}
    yield "no-model", {"tokens": ids[:3]}
    yield "empty", {"model": model, "tokens": []}
    yield "split-character", {"model": model, "tokens": ids[-1:]}
    yield "error-out-of-vocabulary", {"model": model, "tokens": [10**9]}
    yield "error-negative", {"model": model, "tokens": [-1]}
    yield "error-unknown-model", {"model": "no-such-model", "tokens": ids}
    yield "error-not-a-list", {"model": model, "tokens": "hello"}
    yield "error-null", None


PREPROCESSING_CORPORA = {
    Endpoint.RENDER_MESSAGES: render_messages_bodies,
    Endpoint.RENDER_RESPONSES: render_responses_bodies,
    Endpoint.TOKENIZE: tokenize_bodies,
    Endpoint.DETOKENIZE: detokenize_bodies,
}
"""The corpus of each endpoint beyond chat and completion rendering."""


def preprocessing_bodies(b: SampleBuilder) -> list[tuple[Endpoint, str, Any]]:
    """The corpora of messages, responses, tokenize and detokenize."""
    return [(endpoint, name, body) for endpoint, bodies in PREPROCESSING_CORPORA.items() for name, body in bodies(b)]


def render_bodies(b: SampleBuilder) -> list[tuple[Endpoint, str, Any]]:
    """Every preprocessing endpoint's corpus: chat and completion rendering,
    then messages, responses, tokenize and detokenize."""
    return [
        *((Endpoint.RENDER_CHAT, name, body) for name, body in render_chat_bodies(b)),
        *((Endpoint.RENDER_COMPLETION, name, body) for name, body in render_completion_bodies(b)),
        *preprocessing_bodies(b),
    ]


def mismatches(answers: list[tuple[str, Answer]], server: list[tuple[str, int, bytes]]) -> list[str]:
    """Where derender's answers are not the server's, byte for byte up to
    drawn request ids: one line each, for the assertion message."""
    found = []
    for (name, ours), (_, status, raw) in zip(answers, server, strict=True):
        if (ours.status, drawn_ids_blanked(ours.raw)) != (status, drawn_ids_blanked(raw)):
            found.append(f"{name}: derender {ours.status} {ours.raw[:300]!r}\n    server {status} {raw[:300]!r}")
    return found


def posted(server: Any, endpoint: Endpoint, body: Any) -> tuple[int, bytes]:
    """The server's status and exact bytes for a body (``null`` for None)."""
    raw = json.dumps(body).encode()
    try:
        response = server.post_raw(endpoint, raw)
    except httpx.TransportError:
        # After an exception escapes vLLM's app (it answers the 500 first:
        # Mistral's tokenizer decoding an unknown id), uvicorn closes the
        # connection, and the client's pool may send the next call on it.
        response = server.post_raw(endpoint, raw)
    return response.status_code, response.content
