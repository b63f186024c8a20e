"""Shared set-up for the benchmark scripts: the bundled sample's engine."""

from __future__ import annotations

import dataclasses
import resource
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from derender_core import DerenderEngine, RenderConfig  # noqa: E402
from tests.sample_inputs import WEATHER_TOOL, SampleBuilder, StreamPlan, chunks_of  # noqa: E402


def sample_config() -> RenderConfig:
    """The sample's settings, the model path made absolute."""
    config = RenderConfig.from_yaml(REPO / "sample_data" / "qwen3.yaml")
    return dataclasses.replace(config, model=str(REPO / (config.model or "")))


def sample_engine() -> tuple[DerenderEngine, float]:
    """The sample's engine and how long building it took, in seconds."""
    config = sample_config()
    started = time.perf_counter()
    engine = DerenderEngine.build(config)
    return engine, time.perf_counter() - started


def http_seconds(endpoint: Any, lines: list[bytes]) -> float:
    """Seconds a real `vllm launch render` for the sample takes to answer
    `lines` on `endpoint`, posted one after another by one keep-alive
    client, after 50 of them as a warm-up."""
    import tempfile

    from tests.helpers import RenderServer

    with tempfile.TemporaryDirectory() as logs:
        server = RenderServer(sample_config(), Path(logs) / "server.log")
        try:
            for line in lines[:50]:
                server.post_raw(endpoint, line)
            started = time.perf_counter()
            for line in lines:
                assert server.post_raw(endpoint, line).status_code == 200
            return time.perf_counter() - started
        finally:
            server.stop()


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def plan_of_length(b: SampleBuilder, tokens: int) -> StreamPlan:
    """A reasoning answer of exactly `tokens` ids that ends in a tool call."""
    messages = [{"role": "user", "content": "Think hard, then call the weather tool."}]
    reasoning_start = b.family.reasoning[0] if b.family.reasoning else ""
    head = b.encode(reasoning_start)
    tail = b.encode(b.answer("Calling the tool.\n", reasoning="", tool=("get_weather", {"city": "Paris"})).removeprefix(reasoning_start))
    tail.append(b.stop_ids(tool_calls=True)[0])
    filler: list[int] = []
    step = 0
    while len(filler) < tokens:
        filler += b.encode(" ".join(f"step {i} checks the forecast." for i in range(step, step + 500)))
        step += 500
    ids = head + filler[: max(tokens - len(head) - len(tail), 0)] + tail
    return StreamPlan(
        request_id=f"floor-{tokens}",
        prompt=b.prompt_ids(messages, [WEATHER_TOOL]),
        request=b.chat_request(messages, tools=[WEATHER_TOOL], stream=True, stream_options={"include_usage": True}),
        choices=[chunks_of(ids, [1])],
    )


def sample_record(engine: DerenderEngine, tokens: int) -> tuple[dict[str, Any], Any, bytes]:
    """One Qwen3 + hermes one-shot chat body of `tokens` output ids (a
    reasoning trace, a short answer, one tool call), `engine`'s answer to
    it, which must succeed, and the body as a JSONL line."""
    import orjson

    from derender_core import Endpoint
    from tests.sample_inputs import one_shot_body, qwen3_family

    builder = SampleBuilder(qwen3_family(REPO / "sample_data" / "qwen3"))
    body = one_shot_body(plan_of_length(builder, tokens), builder.family.served_name)
    answer = engine.post(Endpoint.CHAT, body)
    if not answer.ok:
        raise SystemExit(f"the record fails: {answer.raw[:300]!r}")
    return body, answer, orjson.dumps(body) + b"\n"
