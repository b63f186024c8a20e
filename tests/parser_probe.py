"""Does each registered parser at least load and pass text through?

Most of vLLM's parsers have no tokenizer of their own family on the package
index. For each tool and reasoning parser vLLM registers, this builds the
derender stack with that parser on the bundled Qwen3 sample, as
``derender --tool-call-parser NAME`` (with auto tool choice) or
``--reasoning-parser NAME`` would, and derenders one plain answer (text
without reasoning or tool markup) one-shot and as a stream. The result is a
short phrase: ``passes text``, ``text as reasoning``, what came out instead,
or the error at start-up or in the answer.

The stacks share one renderer (`derender_stack`'s ``renderer``): the
parsers do not change it, and loading the tokenizer once keeps a hundred
stacks to seconds.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from typing import Any

import orjson

from derender_core import DerenderEngine, Endpoint, RenderConfig
from derender_core.batch import Job
from derender_core.vllm_seam.stack import registered_parsers
from tests.helpers import SAMPLE, jsonl_answers
from tests.sample_inputs import (
    WEATHER_TOOL,
    SampleBuilder,
    StreamPlan,
    chunks_of,
    one_shot_body,
    qwen3_family,
    stream_bodies,
)

PLAIN_TEXT = "The weather in Paris is sunny, 22 °C."
"""The answer: no markup any parser looks for."""


def sample_config() -> RenderConfig:
    """The bundled sample without its parsers, the model path absolute."""
    config = RenderConfig.from_yaml(SAMPLE / "qwen3.yaml")
    return dataclasses.replace(
        config,
        model=str(SAMPLE.parent / (config.model or "")),
        tool_call_parser=None,
        reasoning_parser=None,
        enable_auto_tool_choice=False,
    )


class ParserProbe:
    """One renderer on the Qwen3 sample; a stack per parser on top of it."""

    def __init__(self) -> None:
        from derender_core.vllm_seam.stack import derender_stack, prepare_environment, server_args

        prepare_environment()  # before vLLM is imported
        from derender_core.vllm_seam.live import LiveDerenderer

        self.config = sample_config()
        self._derenderer_class = LiveDerenderer
        self._server_args = server_args
        self._derender_stack = derender_stack
        base = derender_stack(server_args(self.config), LiveDerenderer)
        self._renderer = base.online_derenderer.renderer
        self.builder = SampleBuilder(qwen3_family(SAMPLE / "qwen3"))

    def engine(self, kind: str, name: str) -> DerenderEngine:
        """The stack ``derender`` builds with this parser, as an engine."""
        if kind == "tool":
            config = dataclasses.replace(self.config, tool_call_parser=name, enable_auto_tool_choice=True)
        else:
            config = dataclasses.replace(self.config, reasoning_parser=name)
        serving = self._derender_stack(
            self._server_args(config), self._derenderer_class, renderer=self._renderer
        )
        return DerenderEngine(serving, startup_seconds=0.0, live=True)

    def plan(self, kind: str) -> StreamPlan:
        b = self.builder
        messages = [{"role": "user", "content": "What's the weather in Paris?"}]
        tools = [WEATHER_TOOL] if kind == "tool" else None
        extra = {"tools": tools, "tool_choice": "auto"} if tools else {}
        return StreamPlan(
            request_id=f"probe-{kind}",
            prompt=b.prompt_ids(messages, tools),
            request=b.chat_request(messages, stream=True, **extra),
            choices=[chunks_of(b.encode(PLAIN_TEXT) + b.stop_ids(), [2])],
            usage=False,
        )

    def outcome(self, kind: str, name: str) -> str:
        """What this parser makes of the plain answer."""
        try:
            engine = self.engine(kind, name)
        except Exception as exc:
            return f"does not start: {_message(exc)}"
        try:
            plan = self.plan(kind)
            served = self.builder.family.served_name
            one_shot = engine.post(Endpoint.CHAT, one_shot_body(plan, served))
            whole = (
                _verdict(one_shot.body["choices"][0]["message"])
                if one_shot.ok
                else f"error {one_shot.status}: {_message(one_shot.error_message)}"
            )
            lines = [orjson.dumps(body) for body in stream_bodies(self.builder, [plan])]
            answers, _ = jsonl_answers(engine, Job(Endpoint.CHAT, stream=True), lines)
            failed = [answer for answer in answers if "error" in answer]
            streamed = (
                f"error {failed[0]['error']['code']}: {_message(failed[0]['error']['message'])}"
                if failed
                else _verdict(dict(_joined(answers)))
            )
        finally:
            engine.close()
        return whole if whole == streamed else f"one-shot: {whole}; stream: {streamed}"


def _joined(answers: list[Any]) -> Iterator[tuple[str, Any]]:
    """A stream's content, reasoning and tool calls, joined."""
    fields: dict[str, Any] = {"content": "", "reasoning": "", "tool_calls": []}
    for answer in answers:
        for choice in answer["chunk"]["choices"]:
            delta = choice["delta"]
            fields["content"] += delta.get("content") or ""
            fields["reasoning"] += delta.get("reasoning") or ""
            fields["tool_calls"] += delta.get("tool_calls") or []
    for key, value in fields.items():
        yield key, value or None


def _verdict(message: dict[str, Any]) -> str:
    content, reasoning, calls = message.get("content"), message.get("reasoning"), message.get("tool_calls")
    if calls:
        return f"tool calls from plain text: {_message(orjson.dumps(calls).decode())}"
    if content == PLAIN_TEXT and not reasoning:
        return "passes text"
    if reasoning == PLAIN_TEXT and not content:
        return "text as reasoning"
    return f"content {_message(repr(content))}, reasoning {_message(repr(reasoning))}"


def _message(error: object, limit: int = 160) -> str:
    """An error's text, stable across runs: no paths, one line, short."""
    text = str(error).replace(str(SAMPLE / "qwen3"), "sample_data/qwen3")
    text = re.sub(r"0x[0-9a-f]+", "0x…", text)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def probe_all() -> dict[tuple[str, str], str]:
    probe = ParserProbe()
    return {(kind, name): probe.outcome(kind, name) for kind, name in registered_parsers()}
