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
trust, an empty body.

Answers are compared byte for byte; the only thing allowed to differ is the
request id the server draws when a request has none (``chatcmpl-<16 hex>``,
``cmpl-<16 hex>``, ``-<i>`` per prompt).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from derender_core import Endpoint
from derender_core.protocol import Answer
from tests.sample_inputs import WEATHER_TOOL, SampleBuilder

_DRAWN_ID = re.compile(rb'"request_id":"(chatcmpl|cmpl)-[0-9a-f]{16}(-\d+)?"')


def drawn_ids_blanked(raw: bytes) -> bytes:
    """An answer's bytes with the request ids drawn at random blanked."""
    return _DRAWN_ID.sub(rb'"request_id":"\1-<drawn>\2"', raw)


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


def render_bodies(b: SampleBuilder) -> list[tuple[Endpoint, str, Any]]:
    """Both endpoints' corpus."""
    return [
        *((Endpoint.RENDER_CHAT, name, body) for name, body in render_chat_bodies(b)),
        *((Endpoint.RENDER_COMPLETION, name, body) for name, body in render_completion_bodies(b)),
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
    response = server.post_raw(endpoint, json.dumps(body).encode())
    return response.status_code, response.content
