"""A whole one-shot record against its job floor: the per-record fixed costs.

    python benchmarks/record_floor.py [--tokens 30 400] [--records 100] [--repeat 20]

Records are Qwen3 + hermes answers (a reasoning trace, a short answer, one
tool call) of N output tokens. Per length, the best of --repeat runs of
--records records each, the measures taking turns:

- record: one record of a one-shot chat job (``batch.run`` over JSONL lines
  to a JSONL writer: read, check, validate, derender, write), per record;
- post: ``DerenderEngine.post`` on the parsed body, per record;
- job floor: the work itself, per record: read the line, ``orjson.loads``,
  one tokenizers decode of the ids, vLLM's own parser class built and
  ``parse()`` called once, ``orjson.dumps`` of a response-shaped dict;
  its message is checked equal to derender's.

Then ``engine.chat`` on a 16-token answer against its floor (the same work
less reading and writing JSON: decode, parser, parse, the response dict).

Targets: record at most 1.5x its job floor at 30 and 400 tokens; engine.chat
at most 1.5x its floor. On a shared machine, read the best-of-N ratios.
"""

from __future__ import annotations

import argparse
import copy
import io
import time
from collections.abc import Callable, Sequence
from typing import Any

import orjson
from _common import REPO, plan_of_length, sample_config
from floor import Floor

from derender_core import DerenderEngine, Endpoint
from derender_core.batch import Job, run
from derender_core.records import iter_records
from derender_core.writers import JsonlWriter
from tests.sample_inputs import SampleBuilder, one_shot_body, qwen3_family


def best(fns: Sequence[Callable[[], Any]], repeat: int) -> list[float]:
    """Each function's best time, the functions taking turns round by
    round, so that a busy spell on a shared machine weighs on all alike."""
    for fn in fns:
        fn()  # warm: the table's pieces, lazy imports
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for fn, kept in zip(fns, times, strict=True):
            started = time.perf_counter()
            fn()
            kept.append(time.perf_counter() - started)
    return [min(kept) for kept in times]


class JobFloor(Floor):
    """The work one record needs and nothing else (`floor.Floor`: one
    decode, vLLM's parser class built and ``parse()`` called once), with
    the line read and the response written. The request is validated once,
    outside the timing: validation is part of what the floor leaves out."""

    def __init__(self, engine: DerenderEngine, body: dict[str, Any]) -> None:
        super().__init__(engine)
        self.validated = self.request(copy.deepcopy(body))

    def response(self, model: Any) -> dict[str, Any]:
        reasoning, content, calls = self.work(self.validated, logprobs=False)
        message = {
            "role": "assistant", "content": content, "reasoning": reasoning,
            "tool_calls": [
                {"id": "call", "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in calls
            ],
        }
        return {
            "id": "chatcmpl-x", "object": "chat.completion", "created": 0, "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": "tool_calls"}],
            "usage": {"prompt_tokens": 0, "total_tokens": 0, "completion_tokens": 0},
        }  # fmt: skip

    def record(self, line: bytes) -> bytes:
        body = orjson.loads(line)
        return orjson.dumps(self.response(body["chat_request"].get("model")))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[30, 400])
    parser.add_argument("--records", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()

    engine = DerenderEngine.build(sample_config())
    b = SampleBuilder(qwen3_family(REPO / "sample_data" / "qwen3"))
    job = Job(Endpoint.CHAT, stream=False)
    n = args.records
    print(f"Qwen3 + hermes, one-shot chat, {n} records per run, best of {args.repeat}, per record:")
    print(f"{'tokens':>7} {'record':>9} {'post':>9} {'job floor':>10} {'record/floor':>13} {'post/floor':>11}")
    for tokens in args.tokens:
        body = one_shot_body(plan_of_length(b, tokens), b.family.served_name)
        line = orjson.dumps(body)
        data = b"\n".join([line] * n) + b"\n"
        floor = JobFloor(engine, body)
        answer = engine.post(Endpoint.CHAT, body)
        assert answer.ok, answer.raw[:300]
        floor.check(floor.validated, answer.body)

        def job_run() -> None:
            report = run(engine, iter_records(io.BytesIO(data)), job, JsonlWriter(target=io.BytesIO()))  # noqa: B023
            assert report.errors == 0

        def posts() -> None:
            for _ in range(n):
                engine.post(Endpoint.CHAT, body)  # noqa: B023

        def floors() -> None:
            for _ in range(n):
                floor.record(line)  # noqa: B023

        record_s, post_s, floor_s = (t / n for t in best((job_run, posts, floors), args.repeat))
        count = len(body["generate_response"]["choices"][0]["token_ids"])
        print(f"{count:7d} {record_s * 1e3:7.3f}ms {post_s * 1e3:7.3f}ms {floor_s * 1e3:8.3f}ms "
              f"{record_s / floor_s:12.2f}x {post_s / floor_s:10.2f}x", flush=True)

    plan = plan_of_length(b, 16)
    body = one_shot_body(plan, b.family.served_name)
    ids = body["generate_response"]["choices"][0]["token_ids"]
    chat_request, prompt = body["chat_request"], body["prompt_token_ids"]
    floor = JobFloor(engine, body)
    answer = engine.chat(ids, chat_request, prompt)
    floor.check(floor.validated, answer)
    model = chat_request.get("model")

    def chats() -> None:
        for _ in range(n):
            engine.chat(ids, chat_request, prompt)

    def chat_floors() -> None:
        for _ in range(n):
            floor.response(model)

    chat_s, chat_floor_s = (t / n for t in best((chats, chat_floors), args.repeat))
    print(f"\nengine.chat, {len(ids)} tokens: {chat_s * 1e3:.3f}ms, floor {chat_floor_s * 1e3:.3f}ms, "
          f"{chat_s / chat_floor_s:.2f}x")
    engine.close()


if __name__ == "__main__":
    main()
