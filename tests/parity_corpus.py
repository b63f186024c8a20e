"""A corpus for `derender parity`: one stream per divergence issue #9 lists.

Each request is a generate stream a split render/generate deployment could
record (real prompt ids from the chat template, output ids from the
family's tokenizer), as stream bodies; `derender parity` joins each into a
one-shot body for the one-shot paths. `CASES` says which divergence each
request is there for.

``python -m tests.parity_corpus OUT.jsonl`` writes the Qwen3 corpus from
the bundled sample.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tests.sample_inputs import (
    WEATHER_TOOL,
    SampleBuilder,
    StreamPlan,
    chunks_of,
    qwen3_family,
    stream_bodies,
    write_jsonl,
)

CASES = {
    "tail-im-end": "a finish-only tail after <|im_end|>: the stream leaks it into content",
    "tail-endoftext": "a finish-only tail after <|endoftext|>, a stop token id the host did not report: "
    "leaked, and stop_reason lost",
    "two-tool-calls": "two tool calls and no text: the stream sends the blank line before them as content",
    "text-after-tool-call": "text after a tool call: dropped by both, but the stream sends the blank line",
    "tool-call-cut-at-length": "a <tool_call> cut at length: a partial call in the stream, raw markup one-shot",
    "plain": "plain content from the first token: serve's own role frame",
    "length-tail": "cut at length, the finish on a tail chunk: serve puts it on the last token's frame",
}


def corpus_plans(b: SampleBuilder) -> list[StreamPlan]:
    usage = {"stream": True, "stream_options": {"include_usage": True}}
    tools = [WEATHER_TOOL]
    weather = [{"role": "user", "content": "What's the weather in Paris and in Rome?"}]
    weather_prompt = b.prompt_ids(weather, tools)
    tool_request = b.chat_request(weather, tools=tools, tool_choice="auto", **usage)
    eos = b.family.eos_id
    call = b.family.tool_call.format(name="get_weather", arguments=json.dumps({"city": "Paris"}), city="Paris")
    second = b.family.tool_call.format(name="get_weather", arguments=json.dumps({"city": "Rome"}), city="Rome")
    sunny = b.answer("It is sunny in Paris.", reasoning="The user asks about the weather.")
    plain_messages = [{"role": "user", "content": "Describe the weather."}]
    plain_prompt = b.prompt_ids(plain_messages, **b.family.thinking_off)
    plain_request = b.chat_request(plain_messages, chat_template_kwargs=b.family.thinking_off, **usage)
    cut = b.encode(b.answer("Checking.\n", reasoning="Paris first.") + call)[:-4]  # ...{"city":
    text = b.encode("Sunny and warm, with a light breeze from the west.")
    endoftext = b.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    return [
        StreamPlan(
            "tail-im-end", weather_prompt, tool_request, [chunks_of(b.encode(sunny) + [eos], [1])],
            finish_only_tail=True,
        ),
        StreamPlan(
            "tail-endoftext", weather_prompt, tool_request, [chunks_of(b.encode(sunny) + [endoftext], [1])],
            finish_only_tail=True,
        ),
        StreamPlan(
            "two-tool-calls", weather_prompt, tool_request,
            [chunks_of(b.encode(b.answer("", reasoning="Both cities.") + call + "\n" + second) + [eos], [1])],
        ),
        StreamPlan(
            "text-after-tool-call", weather_prompt, tool_request,
            [chunks_of(b.encode(b.answer("", reasoning="Paris.") + call + "\nI asked for Paris.") + [eos], [1])],
        ),
        StreamPlan(
            "tool-call-cut-at-length", weather_prompt, {**tool_request, "max_tokens": len(cut)},
            [chunks_of(cut, [1])], finish_reason="length",
        ),
        StreamPlan("plain", plain_prompt, plain_request, [chunks_of(text + [eos], [1])]),
        StreamPlan(
            "length-tail", plain_prompt, {**plain_request, "max_tokens": len(text)},
            [chunks_of(text, [2])], finish_only_tail=True, finish_reason="length",
        ),
    ]  # fmt: skip


def corpus_bodies(b: SampleBuilder) -> list[dict[str, Any]]:
    """The corpus as stream bodies, the requests interleaved. The stop
    token's id is not reported as stop_reason, as older generate hosts do."""
    return stream_bodies(b, corpus_plans(b))


if __name__ == "__main__":
    sample = Path(__file__).resolve().parents[1] / "sample_data" / "qwen3"
    write_jsonl(Path(sys.argv[1]), corpus_bodies(SampleBuilder(qwen3_family(sample))))
