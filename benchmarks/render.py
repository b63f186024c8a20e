"""Rendering requests: `derender render` against the floor and the HTTP route.

    python benchmarks/render.py [--records 2000] [--http-records 1000]

The corpus is the bundled sample's four chat requests (tools with
``tool_choice: auto``, n=2 with logprobs, split unicode, a stop string),
repeated to --records lines; each renders to a GenerateRequest of about 170
prompt tokens through Qwen3's chat template. Start-up is excluded (the
render half's own build, about a second, is reported apart), and each
figure follows a warm-up on the same records:

- floor: ``ServingRender.render_chat_request`` awaited in a loop on
  requests validated beforehand: no JSON parsing, body validation or
  serialisation;
- derender render, 1 and 2 workers: the library pipeline as the CLI runs
  it (lines, records, engine, JSONL writer), in process and on a
  `WorkerPool`;
- HTTP: a real `vllm launch render` driven by one keep-alive httpx client
  posting the same lines to ``/v1/chat/completions/render`` one after
  another (what a user does without this tool).

The same weather question as an Anthropic Messages request and as an
OpenAI Responses request (`MESSAGES`, `RESPONSES`: a system prompt, the
tool, a tool call and its result in the history), repeated to --records
lines, go through `derender render messages|responses` (1 worker) and
through ``/v1/messages/render`` and ``/v1/responses/render`` over HTTP.

`measure()` returns the figures for code (the lead's reports); `main`
prints them.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import time
from typing import Any

import orjson
from _common import REPO, http_seconds, sample_engine

from derender_core import Endpoint
from derender_core.batch import Job, run
from derender_core.records import iter_records
from derender_core.workers import WorkerPool
from derender_core.writers import JsonlWriter

JOB = Job(Endpoint.RENDER_CHAT)
_TOOL = {
    "name": "get_weather",
    "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
MESSAGES = [
    {"model": "qwen3-sample", "max_tokens": 256, "system": [{"type": "text", "text": "You are terse."}],
     "messages": [{"role": "user", "content": "What's the weather in Paris?"}]},
    {"model": "qwen3-sample", "max_tokens": 256, "tools": [{**{k: v for k, v in _TOOL.items() if k != "parameters"},
                                                             "input_schema": _TOOL["parameters"]}],
     "tool_choice": {"type": "auto"},
     "messages": [{"role": "user", "content": "What's the weather in Paris?"},
                  {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                     "input": {"city": "Paris"}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                "content": '{"temperature": 21}'}]}]},
]  # fmt: skip
"""Anthropic Messages requests: a system block; a tool, its call and its result."""
RESPONSES = [
    {"model": "qwen3-sample", "instructions": "You are terse.", "input": "What's the weather in Paris?"},
    {"model": "qwen3-sample", "tools": [{"type": "function", **_TOOL}], "tool_choice": "auto",
     "input": [{"role": "user", "content": "What's the weather in Paris?"},
               {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
               {"type": "function_call_output", "call_id": "call_1", "output": '{"temperature": 21}'}]},
]  # fmt: skip
"""OpenAI Responses requests: instructions and a string; a tool, its call and its output."""


def corpus(records: int, requests: list[dict[str, Any]] | None = None) -> list[bytes]:
    """`requests` (the sample's chat requests by default), repeated to
    `records` lines."""
    lines = (
        [orjson.dumps(request) for request in requests]
        if requests is not None
        else [
            orjson.dumps(orjson.loads(line)["chat_request"])
            for line in (REPO / "sample_data" / "chat.jsonl").read_bytes().splitlines()
            if line.strip()
        ]
    )
    return (lines * (records // len(lines) + 1))[:records]


def pipeline_seconds(
    engine: Any, lines: list[bytes], pool: WorkerPool | None = None, job: Job = JOB
) -> tuple[float, int]:
    """Seconds for the pipeline over `lines`, and the prompt tokens rendered."""
    data = b"\n".join(lines) + b"\n"
    outcomes = pool.answering(job) if pool else None
    started = time.perf_counter()
    report = run(engine, iter_records(io.BytesIO(data)), job, JsonlWriter(io.BytesIO()), outcomes=outcomes)
    elapsed = time.perf_counter() - started
    assert report.errors == 0 and report.records == len(lines), report.failures[:1]
    return elapsed, report.tokens


def floor_seconds(engine: Any, lines: list[bytes]) -> float:
    """``ServingRender.render_chat_request`` alone, on pre-validated requests."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    serving = engine._render_half.prepare(engine._serving)

    async def render_all() -> float:
        # Validated per pass: vLLM's parsers adjust a request in place.
        requests = [ChatCompletionRequest.model_validate(orjson.loads(line)) for line in lines]
        started = time.perf_counter()
        for request in requests:
            await serving.render_chat_request(request)
        return time.perf_counter() - started

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(render_all())  # warm-up
        return loop.run_until_complete(render_all())
    finally:
        loop.close()


def measure(records: int = 2000, http_records: int = 1000) -> dict[str, Any]:
    """Records a second for each way of rendering `records` requests (HTTP
    over the first `http_records`), with the prompt tokens rendered and the
    start-up apart."""
    engine, startup = sample_engine()
    started = time.perf_counter()
    engine.prepare_render()
    render_startup = time.perf_counter() - started
    lines = corpus(records)
    load_before = os.getloadavg()[0]
    pipeline_seconds(engine, lines[:200])  # warm-up
    floor = floor_seconds(engine, lines)
    one, tokens = pipeline_seconds(engine, lines)
    with WorkerPool(engine, 2) as pool:
        pipeline_seconds(engine, lines[:200], pool)  # warm-up
        two, _ = pipeline_seconds(engine, lines, pool)
    others: dict[Endpoint, tuple[list[bytes], float, int]] = {}
    for endpoint, requests in ((Endpoint.RENDER_MESSAGES, MESSAGES), (Endpoint.RENDER_RESPONSES, RESPONSES)):
        their_lines = corpus(records, requests)
        job = Job(endpoint)
        pipeline_seconds(engine, their_lines[:200], job=job)  # warm-up
        others[endpoint] = (their_lines, *pipeline_seconds(engine, their_lines, job=job))
    engine.close()
    http_lines = lines[:http_records]
    http = http_seconds(Endpoint.RENDER_CHAT, http_lines) if http_lines else float("nan")
    kinds = {Endpoint.RENDER_MESSAGES: "messages", Endpoint.RENDER_RESPONSES: "responses"}
    other_rates: dict[str, float] = {}
    other_tokens: dict[str, int] = {}
    for endpoint, (their_lines, seconds, their_tokens) in others.items():
        other_rates[f"derender render {kinds[endpoint]}, 1 worker"] = len(their_lines) / seconds
        other_tokens[kinds[endpoint]] = their_tokens
        posted = their_lines[:http_records]
        if posted:
            other_rates[f"HTTP: /v1/{kinds[endpoint]}/render ({len(posted)} records)"] = len(posted) / http_seconds(
                endpoint, posted
            )
    return {
        "records": len(lines),
        "prompt_tokens": tokens,
        "startup_seconds": startup,
        "render_startup_seconds": render_startup,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "records_per_second": {
            "floor: ServingRender.render_chat_request": len(lines) / floor,
            "derender render, 1 worker (in process)": len(lines) / one,
            "derender render, 2 workers": len(lines) / two,
            f"HTTP: vllm launch render ({len(http_lines)} records)": len(http_lines) / http,
        },
        "other_records_per_second": other_rates,
        "other_prompt_tokens": other_tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=2000)
    parser.add_argument("--http-records", type=int, default=1000)
    args = parser.parse_args()
    figures = measure(args.records, args.http_records)
    print(
        f"{figures['records']} chat requests, {figures['prompt_tokens']} prompt tokens rendered; start-up "
        f"{figures['startup_seconds']:.1f} s + render half {figures['render_startup_seconds']:.1f} s (excluded)"
    )
    print(f"load average before: {figures['load_before']:.2f} on {len(os.sched_getaffinity(0))} usable cores")
    rates = figures["records_per_second"]
    print(f"{'':48} {'records/s':>10} {'tokens/s':>10}")
    per_record = figures["prompt_tokens"] / figures["records"]
    for name, rate in rates.items():
        print(f"{name:48} {rate:10.1f} {rate * per_record:10.0f}")
    one = rates["derender render, 1 worker (in process)"]
    http = next(rate for name, rate in rates.items() if name.startswith("HTTP"))
    print(f"1 worker vs floor:  {rates['floor: ServingRender.render_chat_request'] / one:.2f}x the floor's rate")
    print(f"1 worker vs HTTP:   {one / http:.2f}x faster")
    print(f"2 workers vs 1:     {rates['derender render, 2 workers'] / one:.2f}x faster")
    tokens = ", ".join(f"{kind} {count}" for kind, count in figures["other_prompt_tokens"].items())
    print(f"Messages and Responses requests, {figures['records']} each; prompt tokens rendered: {tokens}")
    print(f"{'':48} {'records/s':>10}")
    for name, rate in figures["other_records_per_second"].items():
        print(f"{name:48} {rate:10.1f}")
    print(f"load average after: {figures['load_after']:.2f}")


if __name__ == "__main__":
    main()
