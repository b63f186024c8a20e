"""Replay against live for the same parsed stream (Qwen3 reasoning + hermes
tool call), one token per chunk, start-up excluded.

    python benchmarks/replay.py [--tokens 1024 8192] [--reference-max 1024] [--repeat 3]

`--mode replay` answers each call as vLLM's replay does; the fast replay
(`replay.ReplayStreams`, the default) goes on from this process's previous
call where the call's state is that call's, so a stream costs O(n) calls'
work plus the state each call returns (its whole history, as vLLM's). vLLM's
own replay (``--replay reference``, the engine's ``replay="reference"``)
replays the whole history on every call, O(n²); it runs only up to
--reference-max tokens.

Target: the fast replay of an 8,192-token stream at most 2x live's cost for
the same stream (SSE output, best of --repeat).
"""

from __future__ import annotations

import argparse

import orjson
from _common import REPO, plan_of_length, sample_engine
from stream_live import timed

from derender_core.writers import JsonlWriter, SseWriter
from tests.sample_inputs import SampleBuilder, qwen3_family, stream_bodies


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--reference-max", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    engine, startup = sample_engine()
    print(f"start-up (excluded below): {startup:.1f} s")
    live = engine.in_mode(live=True)
    replay = engine.in_mode(live=False, replay="fast")
    reference = engine.in_mode(live=False, replay="reference")
    builder = SampleBuilder(qwen3_family(REPO / "sample_data" / "qwen3"))
    writers = {"sse": lambda out: SseWriter(target=out), "jsonl": JsonlWriter}
    warm = b"\n".join(orjson.dumps(b) for b in stream_bodies(builder, [plan_of_length(builder, 64)]))
    for mode in (live, replay, reference):
        timed(mode, warm, writers["sse"])

    print(f"{'tokens':>6} {'format':>6} {'live s':>8} {'replay s':>9} {'replay/live':>12} "
          f"{'vLLM replay s':>14} {'vLLM/replay':>12}")  # fmt: skip
    for tokens in args.tokens:
        plan = plan_of_length(builder, tokens)
        count = sum(len(c) for c in plan.choices[0])
        data = b"\n".join(orjson.dumps(body) for body in stream_bodies(builder, [plan]))
        for name, writer_of in writers.items():
            if name == "jsonl" and tokens > args.reference_max:
                continue  # O(n²) bytes by nature: 211 MB at 8,192 tokens
            live_s = min(timed(live, data, writer_of)[0] for _ in range(args.repeat))
            replay_s = min(timed(replay, data, writer_of)[0] for _ in range(args.repeat))
            line = f"{count:6d} {name:>6} {live_s:8.3f} {replay_s:9.3f} {replay_s / live_s:11.2f}x "
            if tokens <= args.reference_max:
                reference_s = timed(reference, data, writer_of)[0]
                line += f"{reference_s:14.2f} {reference_s / replay_s:11.1f}x"
            else:
                line += f"{'-':>14} {'-':>12}"
            print(line, flush=True)
    engine.close()


if __name__ == "__main__":
    main()
