"""One-shot throughput on 1 and 2 workers, against the floor and the HTTP route.

    python benchmarks/scale.py [--records 3000] [--http-records 1000] [--profile]

The corpus is the bundled sample's chat bodies (reasoning, tool calls,
n=2 with logprobs, split unicode, a stop string) repeated to --records
lines. Everything below excludes start-up, and each figure follows a
warm-up on the same records:

- floor: ``OnlineDerenderer.derender_chat`` called directly in a loop on
  requests validated beforehand: no JSON parsing, body validation, response
  model or serialisation;
- serving: ``ServingDerender.derender_chat_response`` on the same
  pre-validated requests (adds the model check, bounds and the response);
- derender, 1 and 2 workers: the library pipeline as the CLI runs it
  (lines, records, engine, JSONL writer), in process and on a `WorkerPool`;
- HTTP: a real `vllm launch render` driven by one keep-alive httpx client
  posting the same lines one after another (what a user would do without
  this tool).

Targets: per worker within 1.2x of the floor; at least 3x the HTTP route;
at least 1.7x from 1 to 2 workers. Another process using the CPUs skews
the 2-worker figure most: the load average is printed with the results.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import os
import pstats
import time

import orjson
from _common import REPO, http_seconds, sample_engine

from derender_core import Endpoint
from derender_core.batch import Job, generated_tokens, run
from derender_core.records import iter_records
from derender_core.workers import WorkerPool
from derender_core.writers import JsonlWriter


def corpus(records: int) -> list[bytes]:
    lines = [line for line in (REPO / "sample_data" / "chat.jsonl").read_bytes().splitlines() if line]
    return (lines * (records // len(lines) + 1))[:records]


def pipeline_seconds(engine, lines: list[bytes], pool: WorkerPool | None = None) -> float:  # type: ignore[no-untyped-def]
    data = b"\n".join(lines) + b"\n"
    job = Job(Endpoint.CHAT)
    outcomes = pool.answering(job) if pool else None
    started = time.perf_counter()
    report = run(engine, iter_records(io.BytesIO(data)), job, JsonlWriter(io.BytesIO()), outcomes=outcomes)
    elapsed = time.perf_counter() - started
    assert report.errors == 0 and report.records == len(lines)
    return elapsed


def floor_seconds(engine, lines: list[bytes]) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """OnlineDerenderer alone, and ServingDerender, on pre-validated requests."""
    adapter = engine._bodies[Endpoint.CHAT]
    requests = [adapter.validate_python(orjson.loads(line), from_attributes=True) for line in lines]
    serving = engine._serving
    derenderer = serving.online_derenderer

    async def derender_all() -> float:
        started = time.perf_counter()
        for request in requests:
            await derenderer.derender_chat(request.generate_response, request.chat_request, request.prompt_token_ids)
        return time.perf_counter() - started

    async def serve_all() -> float:
        started = time.perf_counter()
        for request in requests:
            await serving.derender_chat_response(request)
        return time.perf_counter() - started

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(derender_all())  # warm-up
        floor = loop.run_until_complete(derender_all())
        served = loop.run_until_complete(serve_all())
    finally:
        loop.close()
    return floor, served


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=3000)
    parser.add_argument("--http-records", type=int, default=1000)
    parser.add_argument("--profile", action="store_true", help="profile the in-process per-record path")
    args = parser.parse_args()
    engine, startup = sample_engine()
    lines = corpus(args.records)
    tokens = sum(generated_tokens(orjson.loads(line)) for line in lines)
    print(f"{len(lines)} chat records, {tokens} generated tokens; start-up {startup:.1f} s (excluded)")
    print(f"load average before: {os.getloadavg()[0]:.2f} on {len(os.sched_getaffinity(0))} usable cores")

    pipeline_seconds(engine, lines[:300])  # warm-up
    floor, served = floor_seconds(engine, lines)
    one = pipeline_seconds(engine, lines)
    if args.profile:
        profile = cProfile.Profile()
        profile.runcall(pipeline_seconds, engine, lines)
        pstats.Stats(profile).sort_stats("cumulative").print_stats(45)
    with WorkerPool(engine, 2) as pool:
        pipeline_seconds(engine, lines[:300], pool)  # warm-up
        two = pipeline_seconds(engine, lines, pool)
    http = (
        http_seconds(Endpoint.CHAT, lines[: args.http_records]) * len(lines) / min(len(lines), args.http_records)
        if args.http_records
        else float("nan")
    )

    rows = [
        ("floor: OnlineDerenderer.derender_chat", floor),
        ("ServingDerender.derender_chat_response", served),
        ("derender, 1 worker (in process)", one),
        ("derender, 2 workers", two),
        (f"HTTP: vllm launch render ({min(len(lines), args.http_records)} records)", http),
    ]
    print(f"{'':48} {'records/s':>10} {'tokens/s':>10}")
    for name, seconds in rows:
        print(f"{name:48} {len(lines) / seconds:10.1f} {tokens / seconds:10.0f}")
    print(f"1 worker vs floor:  {one / floor:.2f}x the floor's time per record   (target <= 1.2x)")
    print(f"1 worker vs HTTP:   {http / one:.2f}x faster                       (target >= 3x)")
    print(f"2 workers vs 1:     {one / two:.2f}x faster                       (target >= 1.7x)")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    engine.close()


if __name__ == "__main__":
    main()
