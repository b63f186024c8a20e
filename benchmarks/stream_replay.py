"""Replay-mode cost of a parsed stream (Qwen3 reasoning + hermes tools),
one token per chunk, for growing lengths.

    python benchmarks/stream_replay.py [--tokens 91 283 1051]

Replay runs vLLM's own per-call path, which replays the whole history on
every chunk: total work grows with the square of the length.
"""

from __future__ import annotations

import argparse
import io
import sys
import time

import orjson
from _common import REPO, sample_engine

from derender_core import Endpoint, Job, JsonlWriter, iter_records, run

sys.path.insert(0, str(REPO))
from tests.sample_inputs import (  # noqa: E402
    WEATHER_TOOL,
    SampleBuilder,
    StreamPlan,
    chunks_of,
    qwen3_family,
    stream_bodies,
)


def plan_of_length(b: SampleBuilder, tokens: int) -> StreamPlan:
    """A reasoning stream of exactly `tokens` ids that ends in a tool call."""
    messages = [{"role": "user", "content": "Think hard, then call the weather tool."}]
    head = b.encode("<think>\n")
    tail = b.encode(
        "\n</think>\n\n" + b.answer("Calling the tool.\n", tool=("get_weather", {"city": "Paris"}))
    ) + [b.family.eos_id]
    filler = b.encode(" ".join(f"step {i} checks the forecast." for i in range(tokens)))
    ids = head + filler[: max(tokens - len(head) - len(tail), 0)] + tail
    return StreamPlan(
        request_id=f"replay-{tokens}",
        prompt=b.prompt_ids(messages, [WEATHER_TOOL]),
        request=b.chat_request(
            messages, tools=[WEATHER_TOOL], stream=True, stream_options={"include_usage": True}
        ),
        choices=[chunks_of(ids, [1])],
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[91, 283, 1051])
    args = parser.parse_args()
    engine, _ = sample_engine()
    builder = SampleBuilder(qwen3_family(REPO / "sample_data" / "qwen3"))
    for tokens in args.tokens:
        plan = plan_of_length(builder, tokens)
        bodies = stream_bodies(builder, [plan])
        data = b"\n".join(orjson.dumps(body) for body in bodies)
        started = time.perf_counter()
        report = run(engine, iter_records(io.BytesIO(data)), Job(Endpoint.CHAT, stream=True), JsonlWriter(io.BytesIO()))
        elapsed = time.perf_counter() - started
        assert report.errors == 0
        token_count = sum(len(c) for c in plan.choices[0])
        print(f"{token_count:5d} tokens, {report.records:5d} calls: {elapsed:7.2f} s "
              f"({elapsed / report.records * 1000:6.1f} ms per call)")
    engine.close()


if __name__ == "__main__":
    main()
