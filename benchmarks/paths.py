"""Cost per request of each parity path, on the parity corpus (Qwen3 sample).

    python benchmarks/paths.py [--repeat 5]

Builds the render stack (oneshot, replay, live) and the serve stack (serve,
serve-oneshot) once, reports how long each build took, then runs the
corpus's requests through every path `--repeat` times: one-shot bodies on
the one-shot paths, their streams (one token per chunk) on the stream
paths. Figures exclude start-up and are medians over the repeats.
"""

from __future__ import annotations

import argparse
import io
import statistics
import time
from collections import defaultdict

import orjson
from _common import REPO, peak_rss_mib, sample_config

from derender_core import DerenderEngine, Endpoint, ServeEngine
from derender_core.batch import Job, run
from derender_core.parity import one_shot_body
from derender_core.records import iter_records
from derender_core.writers import JsonlWriter
from tests.parity_corpus import corpus_bodies
from tests.sample_inputs import SampleBuilder, qwen3_family


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    config = sample_config()
    started = time.perf_counter()
    derender = DerenderEngine.build(config)
    render_build = time.perf_counter() - started
    started = time.perf_counter()
    serve = ServeEngine.build(config)
    serve_build = time.perf_counter() - started
    print(f"build: render stack {render_build:.1f} s (first, includes importing vLLM), serve stack {serve_build:.1f} s")

    streams: dict[str, list[dict]] = defaultdict(list)
    for body in corpus_bodies(SampleBuilder(qwen3_family(REPO / "sample_data" / "qwen3"))):
        streams[body["generate_chunk"]["request_id"]].append(body)
    one_shots = [orjson.dumps(one_shot_body(bodies, Endpoint.CHAT)) for bodies in streams.values()]
    stream_lines = [orjson.dumps(body) for bodies in streams.values() for body in bodies]
    tokens = sum(len(c["token_ids"]) for b in map(orjson.loads, one_shots) for c in b["generate_response"]["choices"])
    paths = {
        "oneshot": (derender, one_shots, False),
        "serve-oneshot": (serve, one_shots, False),
        "replay": (derender.in_mode(live=False), stream_lines, True),
        "live": (derender.in_mode(live=True), stream_lines, True),
        "serve": (serve, stream_lines, True),
    }
    requests = len(streams)
    print(f"{requests} requests, {tokens} output tokens, {len(stream_lines)} stream calls; median of {args.repeat} runs")
    for name, (engine, lines, stream) in paths.items():
        times = []
        for _ in range(args.repeat + 1):  # the first run warms up
            report = run(engine, iter_records(io.BytesIO(b"\n".join(lines))), Job(Endpoint.CHAT, stream=stream), JsonlWriter(io.BytesIO()))
            assert report.errors == 0, name
            times.append(report.elapsed)
        per_request = statistics.median(times[1:]) / requests
        print(f"{name:14} {per_request * 1000:8.1f} ms per request  {per_request / tokens * requests * 1e6:8.0f} µs per token")
    print(f"peak RSS {peak_rss_mib():.0f} MiB")
    serve.close()
    derender.close()


if __name__ == "__main__":
    main()
