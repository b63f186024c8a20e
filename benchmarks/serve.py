"""The serve path batched: records per second one at a time against a
window of requests in flight on the one ``AsyncLLM`` (issue 32, item 2).

    python benchmarks/serve.py [--records 64] [--tokens 400] [--windows 1,8,32]

Records are Qwen3 + hermes one-shot chat bodies of `--tokens` output ids (a
reasoning trace, a short answer, one tool call), each under its own request
id, run as `derender parity` runs them on the serve paths alone
(`Parity.examined`): ``serve-oneshot`` (the one-shot body) and ``serve``
(its stream, one token per chunk). Window 1 is one record at a time, as
before batching; "before" is window 1 with every stream call's request
validated whole, as before a stream's request was validated once
(`ServeEngine._keeps_stream_requests`), and a one-shot body's tokens one
engine step each, as before fast path ``serve_bulk`` handed them over as
one (`ServeEngine._merges_steps`): the serve path as issue 32 found it. Start-up is excluded; each figure is the best of
`--repeat` runs. Every window's answers are checked equal to window 1's
(``created`` and tool-call ids blanked), and the peak RSS is printed.
"""

from __future__ import annotations

import argparse
import time

import orjson
from _common import peak_rss_mib, sample_config, sample_engine, sample_record

from derender_core import Endpoint, ServeEngine
from derender_core.parity import Chunking, Parity, Request, stream_bodies
from tests.helpers import normalize


def requests_of(body: dict, count: int, stream: bool) -> list[Request]:
    chunking = Chunking(1)
    requests = []
    for number in range(count):
        one = {**body, "generate_response": {**body["generate_response"], "request_id": f"r-{number}"}}
        streams = [(chunking.name, stream_bodies(one, Endpoint.CHAT, chunking))] if stream else []
        requests.append(Request(f"r-{number}", one_shot=one, streams=streams))
    return requests


def seen(examinations: list) -> list:
    return [normalize(orjson.loads(orjson.dumps([(o.response, o.chunks, o.calls) for o in e.observed.values()])))
            for e in examinations]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--windows", default="1,8,32")
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    engine, _ = sample_engine()
    body, _, _ = sample_record(engine, args.tokens)
    engine.close()
    started = time.perf_counter()
    serve = ServeEngine.build(sample_config())
    print(f"serve stack {time.perf_counter() - started:.1f} s (excluded below)")
    merges = serve._merges_steps
    windows = [int(w) for w in args.windows.split(",")]
    print(f"{args.records} records of {args.tokens} output tokens, records/s (best of {args.repeat})")
    runs = [("before", 1), *((f"window {w}", w) for w in windows)]
    print(f"{'path':<15}" + "".join(f"{name:>12}" for name, _ in runs) + f"{'last/first':>12}{'last/before':>13}")
    for path in ("serve-oneshot", "serve"):
        requests = requests_of(body, args.records, stream=path == "serve")
        checker = Parity({path: serve}, Endpoint.CHAT, ignore={"prompt_token_ids"})
        list(checker.examined(requests[:8], window=8))  # warm-up
        rates, first = [0.0] * len(runs), None
        for index, (name, window) in [*enumerate(runs)][1:] + [(0, runs[0])]:  # "before" last: no warm-up in its favour
            if name == "before":
                serve._keeps_stream_requests = lambda: False  # type: ignore[method-assign]
                serve._merges_steps = False
            best = 0.0
            for _ in range(args.repeat):
                started = time.perf_counter()
                examinations = [e for _, e in checker.examined(requests, window=window)]
                best = max(best, args.records / (time.perf_counter() - started))
            if name == "before":
                del serve._keeps_stream_requests
                serve._merges_steps = merges
            answers = seen(examinations)
            first = answers if first is None else first
            assert answers == first, f"{name} answered differently"
            rates[index] = best
        print(
            f"{path:<15}" + "".join(f"{r:>12.1f}" for r in rates)
            + f"{rates[-1] / rates[1]:>11.2f}x{rates[-1] / rates[0]:>12.2f}x  (target: last/before >= 5x)"
        )  # fmt: skip
    print(f"every window's answers equal window {windows[0]}'s; peak RSS {peak_rss_mib():.0f} MiB")
    serve.close()


if __name__ == "__main__":
    main()
