"""Live against replay on parsed streams (Qwen3 reasoning + hermes tools),
one token per chunk, for SSE and for jsonl output.

    python benchmarks/stream_live.py [--tokens 256 1024 4096 8192] [--replay-max 1024]

Replay is vLLM's per-call path: every call replays the whole history, so a
stream costs O(n²); it runs only up to --replay-max tokens. Live keeps each
stream's parser, so a stream costs O(n). jsonl writes every call's full
stream_state, which grows with the stream, so that output is O(n²) bytes by
nature; SSE and assembled output never serialise a state.

Targets (start-up excluded): live at least 100x faster than replay at 1,024
tokens; an 8,192-token stream to SSE in under 2 s; live per-token cost flat
(within 1.5x) from 512 to 8,192 tokens.
"""

from __future__ import annotations

import argparse
import io
import time

import orjson
from _common import REPO, plan_of_length, sample_engine

from derender_core import Endpoint
from derender_core.batch import Job, run
from derender_core.records import iter_records
from derender_core.writers import JsonlWriter, SseWriter, Writer
from tests.sample_inputs import SampleBuilder, qwen3_family, stream_bodies


def timed(engine, data: bytes, writer_of) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    out = io.BytesIO()
    writer: Writer = writer_of(out)
    started = time.perf_counter()
    report = run(engine, iter_records(io.BytesIO(data)), Job(Endpoint.CHAT, stream=True), writer)
    elapsed = time.perf_counter() - started
    assert report.errors == 0, report.failures
    return elapsed, len(out.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 512, 1024, 4096, 8192])
    parser.add_argument("--replay-max", type=int, default=1024)
    args = parser.parse_args()
    engine, startup = sample_engine()
    print(f"start-up (excluded below): {startup:.1f} s")
    live, replay = engine.in_mode(live=True), engine.in_mode(live=False)
    builder = SampleBuilder(qwen3_family(REPO / "sample_data" / "qwen3"))
    writers = {"sse": lambda out: SseWriter(target=out), "jsonl": JsonlWriter}
    # Warm up lazy imports and caches on a short stream.
    warm = b"\n".join(orjson.dumps(b) for b in stream_bodies(builder, [plan_of_length(builder, 64)]))
    timed(live, warm, writers["sse"])
    timed(replay, warm, writers["sse"])

    print(f"{'tokens':>6} {'format':>6} {'live s':>8} {'live us/token':>14} "
          f"{'replay s':>9} {'replay us/token':>16} {'replay/live':>12} {'output MB':>10}")
    for tokens in args.tokens:
        plan = plan_of_length(builder, tokens)
        count = sum(len(c) for c in plan.choices[0])
        data = b"\n".join(orjson.dumps(body) for body in stream_bodies(builder, [plan]))
        for name, writer_of in writers.items():
            live_s, size = timed(live, data, writer_of)
            line = f"{count:6d} {name:>6} {live_s:8.3f} {live_s / count * 1e6:14.1f} "
            if tokens <= args.replay_max:
                replay_s, replay_size = timed(replay, data, writer_of)
                ratio = replay_s / live_s
                line += f"{replay_s:9.2f} {replay_s / count * 1e6:16.1f} {ratio:11.1f}x "
            else:
                line += f"{'-':>9} {'-':>16} {'-':>12} "
            print(line + f"{size / 1e6:10.2f}", flush=True)
    engine.close()


if __name__ == "__main__":
    main()
