"""Derender inputs made from real token ids, for the sample and the tests.

Every record here is what a split render/generate deployment would produce:
the prompt ids come from applying the model's chat template, the output ids
from encoding a model answer with the same tokenizer, and the bodies are
what a client would POST to `vllm launch render`'s derender endpoints.

``python -m tests.sample_inputs sample_data`` rewrites the bundled sample
inputs from the bundled Qwen3 model.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}


ToolCallMarkup = str | Callable[[str, Mapping[str, Any], int], str]
"""A tool call as the model writes it: a format string with {name},
{arguments} (JSON), {city} and {index}, or a function of the name, the
arguments and the call's index."""


@dataclass(frozen=True)
class Family:
    """What the inputs need to know about a model family."""

    model_dir: Path
    served_name: str
    eos_id: int
    reasoning: tuple[str, str] | None
    """How the model writes reasoning: (before, after) the thought text."""
    tool_call: ToolCallMarkup
    """The model's tool call markup."""
    thinking_off: dict[str, Any]
    """chat_template_kwargs that turn thinking off."""
    text_before_tool_call: bool = True
    """Whether the model writes text ahead of a tool call (Llama 3.1 emits
    the call's JSON alone)."""
    content: tuple[str, str] = ("", "")
    """How the model wraps its reply (harmony's final channel, Kimi K3's
    response channel)."""
    preamble: tuple[str, str] | None = None
    """How it wraps text ahead of tool calls, where that differs from
    `content` (harmony's commentary channel)."""
    tool_section: tuple[str, str, str] = ("", "\n", "")
    """What goes before, between and after the tool calls of one answer."""
    tool_call_eos_id: int | None = None
    """The token the model stops on after tool calls, where it is not
    `eos_id` (gpt-oss's <|call|>)."""
    load_tokenizer: Callable[[Path], Any] | None = None
    """The family's tokenizer for building inputs, where transformers'
    AutoTokenizer does not read the model directory (Mistral's tekken)."""


def qwen3_family(model_dir: Path, served_name: str = "qwen3-sample") -> Family:
    return Family(
        model_dir=model_dir,
        served_name=served_name,
        eos_id=151645,
        reasoning=("<think>\n", "\n</think>\n\n"),
        tool_call='<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>',
        thinking_off={"enable_thinking": False},
    )


def dsml_call(name: str, arguments: Mapping[str, Any], index: int = 0) -> str:
    """One DSML invoke, as DeepSeek V3.2 and V4 write a call."""
    body = "".join(
        f'<｜DSML｜parameter name="{key}" string="{"true" if isinstance(value, str) else "false"}">'
        f"{value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)}</｜DSML｜parameter>\n"
        for key, value in arguments.items()
    )
    return f'<｜DSML｜invoke name="{name}">\n{body}</｜DSML｜invoke>'


def deepseek_v4_tool_calls(name: str, arguments: Mapping[str, Any], index: int = 0) -> str:
    """A DSML invoke in its own tool_calls block."""
    return f"<｜DSML｜tool_calls>\n{dsml_call(name, arguments, index)}\n</｜DSML｜tool_calls>"


def deepseek_v4_family(model_dir: Path, served_name: str = "deepseek-v4-test") -> Family:
    return Family(
        model_dir=model_dir,
        served_name=served_name,
        eos_id=1,
        reasoning=("", "</think>"),
        tool_call=deepseek_v4_tool_calls,
        thinking_off={"thinking": False},
    )


def llama3_family(model_dir: Path, served_name: str = "llama3-test") -> Family:
    return Family(
        model_dir=model_dir,
        served_name=served_name,
        eos_id=128009,
        reasoning=None,
        tool_call='{{"name": "{name}", "parameters": {arguments}}}',
        thinking_off={},
        text_before_tool_call=False,
    )


class SampleBuilder:
    """Makes bodies for one model family with its real tokenizer."""

    def __init__(self, family: Family) -> None:
        from transformers import AutoTokenizer

        self.family = family
        load = family.load_tokenizer or AutoTokenizer.from_pretrained
        self.tokenizer = load(family.model_dir)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        rendered = self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True, **template_kwargs
        )
        return self.encode(rendered)

    def tool_call_text(self, name: str, arguments: Mapping[str, Any], index: int = 0) -> str:
        """One tool call as the model writes it."""
        markup = self.family.tool_call
        if callable(markup):
            return markup(name, arguments, index)
        return markup.format(
            name=name,
            arguments=json.dumps(arguments, ensure_ascii=False),
            city=arguments.get("city", ""),
            index=index,
        )

    def answer(
        self,
        content: str,
        reasoning: str | None = None,
        tool: tuple[str, dict[str, Any]] | None = None,
        tools: Sequence[tuple[str, dict[str, Any]]] = (),
    ) -> str:
        """The raw text a model of this family writes for such an answer:
        reasoning, then text, then tool calls (`tool`, or several)."""
        family = self.family
        calls = [tool] if tool is not None else list(tools)
        text = ""
        if reasoning is not None and family.reasoning is not None:
            before, after = family.reasoning
            text += before + reasoning + after
        if content and (not calls or family.text_before_tool_call):
            before, after = (family.preamble or family.content) if calls else family.content
            text += before + content + after
        if calls:
            before, between, after = family.tool_section
            text += before
            text += between.join(
                self.tool_call_text(name, arguments, index) for index, (name, arguments) in enumerate(calls)
            )
            text += after
        return text

    def stop_ids(self, tool_calls: bool = False) -> list[int]:
        """The token the model stops on after such an answer."""
        family = self.family
        return [family.tool_call_eos_id if tool_calls and family.tool_call_eos_id is not None else family.eos_id]

    def chat_request(self, messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
        return {"model": self.family.served_name, "messages": messages, **fields}


def _choice(index: int, token_ids: list[int], **fields: Any) -> dict[str, Any]:
    return {"index": index, "token_ids": token_ids, "finish_reason": "stop", **fields}


def logprobs_for(token_ids: Sequence[int], top: int = 2) -> dict[str, Any]:
    """Generate-style logprobs: integer token ids, the sampled one first,
    then alternatives; derender resolves them to token strings and bytes."""
    content = []
    for token_id in token_ids:
        alternatives = [
            {"token_id": (token_id + step) % 150000, "logprob": -1.5 * step - 0.25, "rank": step + 1}
            for step in range(1, top)
        ]
        # A function of the id alone, so a stream's chunks and the whole
        # output get the same values.
        sampled = {"token_id": token_id, "logprob": -0.125 * (token_id % 4), "rank": 1}
        content.append({**sampled, "top_logprobs": [sampled, *alternatives]})
    return {"content": content}


def split_unicode_text() -> str:
    """Characters that byte-level BPE vocabularies spell in several tokens."""
    return "Weather symbols: 🌦️ 🌪 ☂ — in Kyiv it is 𝟏𝟐°C; 北京多云。"


# --- one-shot chat --------------------------------------------------------


def chat_bodies(b: SampleBuilder) -> Iterator[dict[str, Any]]:
    eos = [b.family.eos_id]
    name = b.family.served_name

    # 1. Reasoning, content and a tool call, ended by EOS.
    messages = [{"role": "user", "content": "What's the weather in Paris?"}]
    text = b.answer(
        "Let me check the weather for you.\n",
        reasoning="The user wants the weather in Paris, so I call get_weather.",
        tool=("get_weather", {"city": "Paris", "unit": "celsius"}),
    )
    output = b.encode(text) + eos
    yield {
        "model": name,
        "generate_response": {
            "request_id": "chat-tool-call",
            "choices": [_choice(0, output, finish_reason="stop")],
        },
        "prompt_tokens": len(prompt := b.prompt_ids(messages, [WEATHER_TOOL])),
        "prompt_token_ids": prompt,
        "chat_request": b.chat_request(messages, tools=[WEATHER_TOOL], tool_choice="auto"),
    }

    # 2. n=2 with logprobs and top_logprobs.
    messages = [{"role": "user", "content": "Name a colour."}]
    prompt = b.prompt_ids(messages)
    answers = [
        b.encode(b.answer("Blue.", reasoning="One word is enough.")) + eos,
        b.encode(b.answer("Green, like grass.", reasoning="Pick something vivid.")) + eos,
    ]
    yield {
        "model": name,
        "generate_response": {
            "request_id": "chat-n2-logprobs",
            "choices": [
                _choice(i, ids, logprobs=logprobs_for(ids, top=3)) for i, ids in enumerate(answers)
            ],
        },
        "prompt_tokens": len(prompt),
        "prompt_token_ids": prompt,
        "chat_request": b.chat_request(messages, n=2, logprobs=True, top_logprobs=2),
    }

    # 3. Thinking off, unicode split across tokens, cut by max_tokens.
    messages = [{"role": "user", "content": "Describe the weather with symbols."}]
    prompt = b.prompt_ids(messages, **b.family.thinking_off)
    output = b.encode(split_unicode_text())
    yield {
        "model": name,
        "generate_response": {
            "request_id": "chat-unicode",
            "choices": [_choice(0, output, finish_reason="length")],
        },
        "prompt_tokens": len(prompt),
        "prompt_token_ids": prompt,
        "chat_request": b.chat_request(
            messages, max_tokens=len(output), chat_template_kwargs=b.family.thinking_off
        ),
    }

    # 4. A stop string: generation stopped at "END", which is cut away.
    messages = [{"role": "user", "content": "Count to three, then say END."}]
    prompt = b.prompt_ids(messages, **b.family.thinking_off)
    output = b.encode("One, two, three. END")
    yield {
        "model": name,
        "generate_response": {
            "request_id": "chat-stop-string",
            "choices": [_choice(0, output, finish_reason="stop", stop_reason="END")],
        },
        "prompt_tokens": len(prompt),
        "prompt_token_ids": prompt,
        "chat_request": b.chat_request(
            messages, stop=["END"], chat_template_kwargs=b.family.thinking_off
        ),
    }


def chat_error_bodies(b: SampleBuilder) -> Iterator[dict[str, Any]]:
    """Bodies the render server answers with an error."""
    messages = [{"role": "user", "content": "hi"}]
    prompt = b.prompt_ids(messages)
    good = {"request_id": "err", "choices": [_choice(0, b.encode("Hello!") + [b.family.eos_id])]}
    request = b.chat_request(messages)
    yield {"model": "no-such-model", "generate_response": good, "chat_request": request}
    yield {"generate_response": good, "prompt_token_ids": prompt}  # no chat_request
    yield {"generate_response": {"request_id": "err", "choices": [_choice(0, [-1])]}}
    yield {"generate_response": {"request_id": "err", "choices": [_choice(0, [])]}, "chat_request": request}
    # More top_logprobs than the server's max_logprobs (20) allows.
    ids = good["choices"][0]["token_ids"]
    yield {
        "generate_response": {
            "request_id": "err",
            "choices": [_choice(0, ids, logprobs=logprobs_for(ids, top=21))],
        },
        "chat_request": request,
    }


# --- one-shot completion ---------------------------------------------------


def one_prompt_completion(
    b: SampleBuilder,
    request_id: str,
    prompt_text: str,
    output_text: str,
    request: dict[str, Any] | None = None,
    **choice_fields: Any,
) -> dict[str, Any]:
    """A completion derender body for one prompt and one choice."""
    name = b.family.served_name
    prompt = b.encode(prompt_text)
    output = b.encode(output_text)
    if choice_fields.pop("with_logprobs", False):
        choice_fields["logprobs"] = logprobs_for(output, top=3)
    return {
        "model": name,
        "generate_responses": [
            {"request_id": request_id, "choices": [_choice(0, output, **choice_fields)]}
        ],
        "prompt_tokens": [len(prompt)],
        "prompt_token_ids": [prompt],
        "completion_request": {"model": name, "prompt": prompt_text, **(request or {})},
    }


def completion_bodies(b: SampleBuilder) -> Iterator[dict[str, Any]]:
    yield one_prompt_completion(
        b,
        "cmpl-logprobs",
        "The capital of France is",
        " Paris. It is known for the Eiffel Tower.",
        {"logprobs": 2},
        finish_reason="length",
        with_logprobs=True,
    )

    # Two prompts, n=2 each: one GenerateResponse per prompt.
    name = b.family.served_name
    prompts = ["Roses are", "2 + 2 ="]
    outputs = [[" red", " blue"], [" 4", " four"]]
    yield {
        "model": name,
        "generate_responses": [
            {
                "request_id": f"cmpl-multi-{p}",
                "choices": [
                    _choice(i, b.encode(text), finish_reason="length")
                    for i, text in enumerate(outputs[p])
                ],
            }
            for p in range(len(prompts))
        ],
        "prompt_tokens": [len(b.encode(p)) for p in prompts],
        "prompt_token_ids": [b.encode(p) for p in prompts],
        "completion_request": {"model": name, "prompt": prompts, "n": 2, "max_tokens": 2},
    }

    yield one_prompt_completion(
        b, "cmpl-unicode", "Symbols:", " " + split_unicode_text(), finish_reason="length"
    )
    yield one_prompt_completion(
        b,
        "cmpl-stop",
        "List: a, b,",
        " c, d, STOP e",
        {"stop": ["STOP"]},
        finish_reason="stop",
        stop_reason="STOP",
    )


# --- streams ---------------------------------------------------------------


def chunks_of(token_ids: list[int], sizes: Sequence[int]) -> list[list[int]]:
    """Cut ids into consecutive chunks, cycling through `sizes`."""
    chunks, position, turn = [], 0, 0
    while position < len(token_ids):
        size = sizes[turn % len(sizes)]
        chunks.append(token_ids[position : position + size])
        position += size
        turn += 1
    return chunks


def drawn_chunking(data: Any, plans: Sequence[StreamPlan], largest: int) -> StreamPlan:
    """One of `plans` (one choice each) cut into Hypothesis-drawn chunk
    sizes up to `largest`, its finish maybe on a chunk of its own, with or
    without logprobs (`data`: Hypothesis's ``st.data()``)."""
    from hypothesis import strategies as st

    plan = data.draw(st.sampled_from(list(plans)), label="plan")
    sizes = data.draw(st.lists(st.integers(1, largest), min_size=1, max_size=4), label="chunk sizes")
    ids = [t for chunk in plan.choices[0] for t in chunk]
    return dataclasses.replace(
        plan,
        choices=[chunks_of(ids, sizes)],
        finish_only_tail=data.draw(st.booleans(), label="finish on a chunk of its own"),
        logprobs=data.draw(st.booleans(), label="logprobs"),
    )


@dataclass
class StreamPlan:
    """One request's generate stream, before it is interleaved."""

    request_id: str
    prompt: list[int]
    request: dict[str, Any]
    """The chat or completion request, per `request_key`."""
    choices: list[list[list[int]]]
    """Per choice index, the token ids of each chunk."""
    finish_only_tail: bool = False
    usage: bool = True
    logprobs: bool = False
    finish_reason: str = "stop"
    request_key: str = "chat_request"


def generate_chunks(plan: StreamPlan) -> list[dict[str, Any]]:
    """The chunks /inference/v1/generate streams for the plan, choices
    interleaved round-robin as the engine emits them, then usage."""
    per_choice: list[list[dict[str, Any]]] = []
    for index, chunks in enumerate(plan.choices):
        events = []
        for position, ids in enumerate(chunks):
            last = position == len(chunks) - 1 and not plan.finish_only_tail
            choice: dict[str, Any] = {
                "index": index,
                "token_ids": ids,
                "finish_reason": plan.finish_reason if last else None,
            }
            if plan.logprobs:
                choice["logprobs"] = logprobs_for(ids)
            events.append({"request_id": plan.request_id, "choices": [choice]})
        if plan.finish_only_tail:
            events.append(
                {
                    "request_id": plan.request_id,
                    "choices": [{"index": index, "token_ids": [], "finish_reason": plan.finish_reason}],
                }
            )
        per_choice.append(events)
    out = []
    for turn in range(max(len(events) for events in per_choice)):
        out.extend(events[turn] for events in per_choice if turn < len(events))
    if plan.usage:
        completion = sum(len(ids) for chunks in plan.choices for ids in chunks)
        out.append(
            {
                "request_id": plan.request_id,
                "choices": [],
                "usage": {
                    "prompt_tokens": len(plan.prompt),
                    "completion_tokens": completion,
                    "total_tokens": len(plan.prompt) + completion,
                },
            }
        )
    return out


def stream_plans(b: SampleBuilder) -> list[StreamPlan]:
    eos = [b.family.eos_id]
    usage = {"stream": True, "stream_options": {"include_usage": True}}

    messages = [{"role": "user", "content": "What's the weather in Paris?"}]
    tool_text = b.answer(
        "Checking now.\n",
        reasoning="I should call get_weather for Paris.",
        tool=("get_weather", {"city": "Paris"}),
    )
    tool_call = StreamPlan(
        request_id="stream-tool-call",
        prompt=b.prompt_ids(messages, [WEATHER_TOOL]),
        request=b.chat_request(messages, tools=[WEATHER_TOOL], tool_choice="auto", **usage),
        choices=[chunks_of(b.encode(tool_text) + eos, [1])],
    )

    messages = [{"role": "user", "content": "Name two colours."}]
    n2 = StreamPlan(
        request_id="stream-n2",
        prompt=b.prompt_ids(messages),
        request=b.chat_request(messages, n=2, logprobs=True, top_logprobs=1, **usage),
        choices=[
            chunks_of(b.encode(b.answer("Red.", reasoning="Short answer.")) + eos, [1]),
            chunks_of(b.encode(b.answer("Blue and green.", reasoning="Two of them.")) + eos, [2, 1]),
        ],
        logprobs=True,
    )

    messages = [{"role": "user", "content": "Describe the weather with symbols."}]
    speculative = StreamPlan(
        request_id="stream-speculative-unicode",
        prompt=b.prompt_ids(messages, **b.family.thinking_off),
        request=b.chat_request(
            messages, chat_template_kwargs=b.family.thinking_off, max_tokens=30, **usage
        ),
        # Cut by max_tokens: the engine sends the finish reason on its own.
        choices=[chunks_of(b.encode(split_unicode_text()), [3, 1, 4, 2])],
        finish_only_tail=True,
        finish_reason="length",
    )
    return [tool_call, n2, speculative]


def parser_corner_plans(b: SampleBuilder) -> list[StreamPlan]:
    """Streams for the parser path's corners: hidden reasoning, "required"
    and named tool choice, two tool calls, and a tool call cut at `length`,
    in several chunkings."""
    eos = [b.family.eos_id]
    usage = {"stream": True, "stream_options": {"include_usage": True}}
    tools = [WEATHER_TOOL]
    messages = [{"role": "user", "content": "What's the weather in Paris and in Rome?"}]
    prompt = b.prompt_ids(messages, tools)
    call = b.answer("Checking.\n", reasoning="Paris first.", tool=("get_weather", {"city": "Paris"}))
    second = b.tool_call_text("get_weather", {"city": "Rome"}, index=1)
    request = b.chat_request(messages, tools=tools, tool_choice="auto", **usage)
    hidden = StreamPlan(
        request_id="stream-hidden-reasoning",
        prompt=prompt,
        request={**request, "include_reasoning": False, "logprobs": True, "top_logprobs": 1},
        choices=[chunks_of(b.encode(call) + eos, [1, 2])],
        logprobs=True,
    )
    two_calls = StreamPlan(
        request_id="stream-two-tool-calls",
        prompt=prompt,
        request=request,
        choices=[chunks_of(b.encode(call + "\n" + second) + eos, [3, 1])],
    )
    cut_ids = b.encode(call)
    cut = StreamPlan(
        request_id="stream-tool-call-cut-at-length",
        prompt=prompt,
        request={**request, "max_tokens": len(cut_ids) - 4},
        choices=[chunks_of(cut_ids[:-4], [2])],
        finish_reason="length",
    )
    reasoning = b.answer("", reasoning="The tool must be called.")
    required = StreamPlan(
        request_id="stream-tool-choice-required",
        prompt=prompt,
        request={**request, "tool_choice": "required"},
        choices=[
            chunks_of(
                b.encode(reasoning + '[{"name": "get_weather", "parameters": {"city": "Paris"}}]') + eos,
                [1],
            )
        ],
        finish_only_tail=True,
    )
    named = StreamPlan(
        request_id="stream-tool-choice-named",
        prompt=prompt,
        request={
            **request,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        },
        choices=[chunks_of(b.encode(reasoning + '{"city": "Rome"}') + eos, [2, 1, 3])],
    )
    return [hidden, two_calls, cut, required, named]


FAMILY_REASONING = "The user wants the weather, so I call get_weather."
FAMILY_TEXT = "Let me check the weather for you.\n"
PARIS_CALL = ("get_weather", {"city": "Paris", "unit": "celsius"})
ROME_CALL = ("get_weather", {"city": "Rome"})
UNICODE_CALL = ("get_weather", {"city": "Zürich", "note": "北京多云 🌦️ — 𝟏𝟐°C, «ß»"})


def family_plans(b: SampleBuilder) -> list[StreamPlan]:
    """The corpus every model family is run through, one-shot and
    streaming: reasoning, text and a tool call (with logprobs); two tool
    calls; a tool call cut at `length`; unicode in the arguments; reasoning
    hidden with include_reasoning=false; thinking switched off (where the
    family has a switch); and a prompt holding an earlier assistant turn."""
    usage = {"stream": True, "stream_options": {"include_usage": True}}
    tools = [WEATHER_TOOL]
    messages = [{"role": "user", "content": "What's the weather in Paris?"}]
    prompt = b.prompt_ids(messages, tools)
    request = b.chat_request(messages, tools=tools, tool_choice="auto", **usage)
    stop = b.stop_ids(tool_calls=True)
    call_text = b.answer(FAMILY_TEXT, reasoning=FAMILY_REASONING, tool=PARIS_CALL)
    call = b.encode(call_text)
    two_calls = b.encode(b.answer(FAMILY_TEXT, reasoning=FAMILY_REASONING, tools=[PARIS_CALL, ROME_CALL]))
    unicode = b.encode(b.answer("", reasoning=FAMILY_REASONING, tool=UNICODE_CALL))
    # Cut inside the first argument's value: "...Par".
    cut = b.encode(call_text[: call_text.index("Paris") + 3])
    plans = [
        StreamPlan(
            request_id="family-tool-call",
            prompt=prompt,
            request={**request, "logprobs": True, "top_logprobs": 1},
            choices=[chunks_of(call + stop, [1])],
            logprobs=True,
        ),
        StreamPlan("family-two-tool-calls", prompt, request, [chunks_of(two_calls + stop, [3, 1])]),
        StreamPlan(
            request_id="family-cut-at-length",
            prompt=prompt,
            request={**request, "max_tokens": len(cut)},
            choices=[chunks_of(cut, [2])],
            finish_reason="length",
        ),
        StreamPlan("family-unicode-arguments", prompt, request, [chunks_of(unicode + stop, [1, 3])]),
        StreamPlan(
            "family-hidden-reasoning",
            prompt,
            {**request, "include_reasoning": False},
            [chunks_of(call + stop, [2])],
        ),
    ]
    thinking_off = b.family.thinking_off
    if thinking_off:
        plans.append(
            StreamPlan(
                request_id="family-thinking-off",
                prompt=b.prompt_ids(messages, tools, **thinking_off),
                request={**request, "chat_template_kwargs": thinking_off},
                choices=[chunks_of(b.encode(b.answer(FAMILY_TEXT, tool=PARIS_CALL)) + stop, [2])],
            )
        )
    history = [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        *messages,
    ]
    plans.append(
        StreamPlan(
            request_id="family-earlier-turn",
            prompt=b.prompt_ids(history, tools),
            request=b.chat_request(history, tools=tools, tool_choice="auto", **usage),
            choices=[chunks_of(call + stop, [2])],
        )
    )
    return plans


def completion_stream_plans(b: SampleBuilder) -> list[StreamPlan]:
    usage = {"stream": True, "stream_options": {"include_usage": True}}
    name = b.family.served_name
    text = b.encode("Roses are")
    logprobs = StreamPlan(
        request_id="cmpl-stream-n2",
        prompt=text,
        request={"model": name, "prompt": "Roses are", "n": 2, "logprobs": 1, **usage},
        choices=[
            chunks_of(b.encode(" red, violets are blue."), [1]),
            chunks_of(b.encode(" fragrant and pretty."), [2]),
        ],
        logprobs=True,
        finish_reason="length",
        request_key="completion_request",
    )
    unicode = StreamPlan(
        request_id="cmpl-stream-unicode",
        prompt=b.encode("Symbols:"),
        request={"model": name, "prompt": "Symbols:", **usage},
        choices=[chunks_of(b.encode(" " + split_unicode_text()), [1, 3])],
        finish_only_tail=True,
        finish_reason="length",
        request_key="completion_request",
    )
    return [logprobs, unicode]


def one_shot_body(plan: StreamPlan, model: str) -> dict[str, Any]:
    """The plan's tokens as one one-shot derender call, to compare a
    stream with."""
    choices = []
    for index, chunks in enumerate(plan.choices):
        ids = [t for chunk in chunks for t in chunk]
        choice: dict[str, Any] = {"index": index, "token_ids": ids, "finish_reason": plan.finish_reason}
        if plan.logprobs:
            choice["logprobs"] = logprobs_for(ids)
        choices.append(choice)
    request = {k: v for k, v in plan.request.items() if k not in ("stream", "stream_options")}
    response = {"request_id": plan.request_id, "choices": choices}
    if plan.request_key == "chat_request":
        return {
            "model": model,
            "generate_response": response,
            "prompt_token_ids": plan.prompt,
            "prompt_tokens": len(plan.prompt),
            "chat_request": request,
        }
    return {
        "model": model,
        "generate_responses": [response],
        "prompt_token_ids": [plan.prompt],
        "prompt_tokens": [len(plan.prompt)],
        "completion_request": request,
    }


def interleave(streams: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Round-robin the chunks of several requests, as a shared capture has them."""
    out = []
    for turn in range(max(len(s) for s in streams)):
        out.extend(s[turn] for s in streams if turn < len(s))
    return out


def stream_body(plan: StreamPlan, chunk: dict[str, Any], model: str) -> dict[str, Any]:
    return {
        "stream": True,
        "model": model,
        "generate_chunk": chunk,
        "prompt_tokens": len(plan.prompt),
        "prompt_token_ids": plan.prompt,
        plan.request_key: plan.request,
    }


def stream_bodies(b: SampleBuilder, plans: list[StreamPlan] | None = None) -> list[dict[str, Any]]:
    plans = plans if plans is not None else stream_plans(b)
    by_id = {plan.request_id: plan for plan in plans}
    chunks = interleave([generate_chunks(plan) for plan in plans])
    return [stream_body(by_id[c["request_id"]], c, b.family.served_name) for c in chunks]


def with_rejected_calls(bodies: list[dict[str, Any]], request_id: str) -> list[dict[str, Any]]:
    """The first two calls of a stream with, between them, calls the server
    rejects: two choices in one chunk, a stop string, no chat_request, no
    prompt_token_ids, an inconsistent stream_state, an unknown model."""
    first, second = [b for b in bodies if b["generate_chunk"]["request_id"] == request_id][:2]
    two_choices = copy.deepcopy(second)
    extra = copy.deepcopy(two_choices["generate_chunk"]["choices"][0])
    two_choices["generate_chunk"]["choices"].append({**extra, "index": 1})
    with_stop = copy.deepcopy(second)
    with_stop["chat_request"] = {**with_stop["chat_request"], "stop": ["x"]}
    no_request = {k: v for k, v in second.items() if k != "chat_request"}
    no_prompt = {k: v for k, v in second.items() if k != "prompt_token_ids"}
    bad_state = {**second, "stream_state": {"output_token_ids": [1, 2], "output_chunk_lens": [1]}}
    wrong_model = {**second, "model": "nope"}
    return [first, two_choices, with_stop, no_request, no_prompt, bad_state, wrong_model, second]


def requests_lines(plans: list[StreamPlan]) -> list[dict[str, Any]]:
    return [
        {"request_id": p.request_id, p.request_key: p.request, "prompt_token_ids": p.prompt}
        for p in plans
    ]


def write_jsonl(path: Path, rows: list[dict[str, Any]] | Iterator[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for row in rows:
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def write_sample(directory: Path) -> None:
    """The bundled sample: inputs for every command against sample_data/qwen3."""
    b = SampleBuilder(qwen3_family(directory / "qwen3"))
    write_jsonl(directory / "chat.jsonl", chat_bodies(b))
    write_jsonl(directory / "chat_errors.jsonl", chat_error_bodies(b))
    write_jsonl(directory / "completion.jsonl", completion_bodies(b))
    plans = stream_plans(b)
    write_jsonl(directory / "stream.jsonl", stream_bodies(b, plans))
    write_jsonl(directory / "requests.jsonl", requests_lines(plans))
    capture = interleave([generate_chunks(plan) for plan in plans])
    (directory / "generate_capture.sse").write_text(
        "".join(f"data: {json.dumps(c, ensure_ascii=False)}\n\n" for c in capture)
        + "data: [DONE]\n\n",
        encoding="utf-8",
    )


if __name__ == "__main__":
    write_sample(Path(sys.argv[1] if len(sys.argv) > 1 else "sample_data"))
