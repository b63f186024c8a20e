"""A whole one-shot record against its job floor: the per-record fixed costs.

    python benchmarks/record_floor.py [--tokens 30 400 8000] [--records 100] [--repeat 20] [--logprobs]

Records are Qwen3 + hermes answers (a reasoning trace, a short answer, one
tool call) of N output tokens. Per length, the best of --repeat runs of
--records records each, the measures taking turns:

- record: one record of a one-shot chat job (``batch.run`` over JSONL lines
  to a JSONL writer: read, check, validate, derender, write), per record,
  the engine in the live mode every ``derender`` job runs it in;
- post: ``DerenderEngine.post`` on the parsed body, per record;
- job floor: the work itself, per record: read the line, ``orjson.loads``,
  one tokenizers decode of the ids, vLLM's own parser class built and
  ``parse()`` called once, ``orjson.dumps`` of a response-shaped dict;
  its message is checked equal to derender's; at the collector's pace a
  job runs at (`collector.records_pace`). With --logprobs each length
  runs again with 5 top logprobs per token (integer ids, as generate sends
  them): the floor also writes each sampled id and its alternatives as
  token, logprob and bytes (each id decoded once per process, as
  derender's table does; a piece of a cut character corrected by vLLM's
  own rule), checked equal to derender's logprobs.

Then ``engine.chat`` on a 16-token answer against its floor (the same work
less reading and writing JSON: decode, parser, parse, the response dict).

Targets: record at most 1.5x its job floor at 30 and 400 tokens; engine.chat
at most 1.5x its floor. On a shared machine, read the best-of-N ratios.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import io
import time
from collections.abc import Callable, Sequence
from operator import attrgetter
from types import SimpleNamespace
from typing import Any

import orjson
from _common import REPO, plan_of_length, sample_config
from floor import Floor, with_logprobs

from derender_core import DerenderEngine, Endpoint
from derender_core.batch import Job, run
from derender_core.collector import records_pace
from derender_core.records import iter_records
from derender_core.vllm_seam.render import collector_paused
from derender_core.writers import JsonlWriter
from tests.sample_inputs import SampleBuilder, one_shot_body, qwen3_family


_TOKEN_ID = attrgetter("token_id")
_LOGPROB = attrgetter("logprob")


def best(fns: Sequence[Callable[[], Any]], repeat: int, clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Each function's best time, the functions taking turns round by
    round, so that a busy spell on a shared machine weighs on all alike.
    `clock` may be ``time.process_time``: this process's CPU time, which
    other processes on a shared machine disturb less than the wall's."""
    for fn in fns:
        fn()  # warm: the table's pieces, lazy imports
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for fn, kept in zip(fns, times, strict=True):
            started = clock()
            fn()
            kept.append(clock() - started)
    return [min(kept) for kept in times]


class LogprobPieces:
    """Each sampled id and alternative written as token, logprob and bytes,
    as vLLM writes them: each id decoded once per process, as derender's
    table remembers them (decoding every id per record would be more than
    the work); a piece of a character cut across tokens corrected by
    vLLM's own rule (its text from the sampled ids before it, at most 4,
    else ""), its decodes made by the tokenizers library directly."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self._decoded: dict[int, str] = {}
        self._vllm = SimpleNamespace(
            tokenizer=SimpleNamespace(decode=lambda ids: backend.decode(ids, skip_special_tokens=False))
        )

    def content(
        self,
        chosen: list[tuple[Any, ...]],
        token_id: Callable[[Any], int],
        logprob: Callable[[Any], float],
        context: Sequence[int] = (),
    ) -> list[dict[str, Any]]:
        """The logprobs content of `chosen` (per position the sampled
        candidate, then the kept alternatives; their fields read by
        `token_id` and `logprob`), after the sampled ids `context` (a
        stream's earlier chunks)."""
        from vllm.v1.engine.logprobs import LogprobsProcessor

        ids = [token_id(c) for row in chosen for c in row]
        known = self._decoded
        missing = list({i for i in ids if i not in known})
        known.update(zip(missing, self.backend.decode_batch([[i] for i in missing], skip_special_tokens=False), strict=True))
        texts = map(known.__getitem__, ids)
        sampled = [*context, *(token_id(row[0]) for row in chosen)]
        offset = len(context)

        def item(c: Any, position: int) -> dict[str, Any]:
            token = next(texts)
            if token.endswith("\ufffd"):
                at = position + offset
                token = LogprobsProcessor._correct_decoded_token(self._vllm, token_id(c), sampled[max(at - 4, 0) : at])  # type: ignore[arg-type]
            return {"token": token, "logprob": logprob(c), "bytes": list(token.encode())}

        return [{**item(row[0], i), "top_logprobs": [item(c, i) for c in row[1:]]} for i, row in enumerate(chosen)]


class JobFloor(Floor):
    """The work one record needs and nothing else (`floor.Floor`: one
    decode, vLLM's parser class built and ``parse()`` called once), with
    the line read and the response written. The request is validated once,
    outside the timing: validation is part of what the floor leaves out."""

    def __init__(self, engine: DerenderEngine, body: dict[str, Any]) -> None:
        super().__init__(engine)
        self.validated = self.request(copy.deepcopy(body))
        chat = self.validated.chat_request
        self.top = (chat.top_logprobs or 0) if chat.logprobs else None
        """Top alternatives per token the body asks for; None: no logprobs."""
        self.pieces = LogprobPieces(self.backend)

    def logprobs(self) -> dict[str, Any] | None:
        """The logprobs content: each sampled id and its first `top`
        alternatives decoded, as token, logprob, bytes."""
        if self.top is None:
            return None
        with collector_paused():  # as derender's call runs: no collection amid the allocations
            entries = self.validated.generate_response.choices[0].logprobs.content
            chosen = [(entry, *entry.top_logprobs[: self.top]) for entry in entries]
            return {"content": self.pieces.content(chosen, _TOKEN_ID, _LOGPROB)}

    def check_logprobs(self, answer: dict[str, Any]) -> None:
        """The floor's logprobs are derender's, token for token."""
        if orjson.dumps(self.logprobs()) != orjson.dumps(answer["choices"][0]["logprobs"]):
            raise SystemExit("the floor's logprobs are not derender's")

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
            "choices": [{"index": 0, "message": message, "logprobs": self.logprobs(), "finish_reason": "tool_calls"}],
            "usage": {"prompt_tokens": 0, "total_tokens": 0, "completion_tokens": 0},
        }  # fmt: skip

    def record(self, line: bytes) -> bytes:
        body = orjson.loads(line)
        return orjson.dumps(self.response(body["chat_request"].get("model")))


@dataclasses.dataclass
class RecordRow:
    """One length's figures, in seconds per record."""

    tokens: int
    logprobs: bool
    record: float
    post: float
    floor: float

    @property
    def ratio(self) -> float:
        return self.record / self.floor

    def line(self) -> str:
        return (
            f"{self.tokens:7d} {'5 top' if self.logprobs else '-':>8} {self.record * 1e3:7.3f}ms {self.post * 1e3:7.3f}ms "
            f"{self.floor * 1e3:8.3f}ms {self.ratio:12.2f}x {self.post / self.floor:10.2f}x"
        )


HEADER = f"{'tokens':>7} {'logprobs':>8} {'record':>9} {'post':>9} {'job floor':>10} {'record/floor':>13} {'post/floor':>11}"


def record_row(
    engine: DerenderEngine, b: SampleBuilder, tokens: int, records: int, repeat: int, logprobs: bool = False
) -> RecordRow:
    """A record of `tokens` output ids (with 5 top logprobs per token if
    `logprobs`) against its job floor, the floor's answer checked equal."""
    job = Job(Endpoint.CHAT, stream=False)
    n = records
    body = one_shot_body(plan_of_length(b, tokens), b.family.served_name)
    if logprobs:
        body = with_logprobs(body)
    line = orjson.dumps(body)
    data = b"\n".join([line] * n) + b"\n"
    floor = JobFloor(engine, body)
    answer = engine.post(Endpoint.CHAT, body)
    assert answer.ok, answer.raw[:300]
    floor.check(floor.validated, answer.body)
    floor.check_logprobs(answer.body)

    # The engine as a `derender chat` job runs it (`JobSpec.live`).
    job_engine = engine.in_mode(live=True)

    def job_run() -> None:
        # Read as a run to stdout reads it: no manifest, so no digests.
        report = run(job_engine, iter_records(io.BytesIO(data), digests=False), job, JsonlWriter(target=io.BytesIO()))
        assert report.errors == 0

    def posts() -> None:
        for _ in range(n):
            engine.post(Endpoint.CHAT, body)

    def floors() -> None:
        # At the collector's pace a job answers records at (`records_pace`):
        # the floor pays no collection the job does not.
        with records_pace():
            for _ in range(n):
                floor.record(line)

    record_s, post_s, floor_s = (t / n for t in best((job_run, posts, floors), repeat))
    count = len(body["generate_response"]["choices"][0]["token_ids"])
    return RecordRow(count, logprobs, record_s, post_s, floor_s)


def chat_row(engine: DerenderEngine, b: SampleBuilder, records: int, repeat: int) -> tuple[int, float, float]:
    """``engine.chat`` on a 16-token answer against its floor: (tokens,
    seconds per call, the floor's seconds per call)."""
    plan = plan_of_length(b, 16)
    body = one_shot_body(plan, b.family.served_name)
    ids = body["generate_response"]["choices"][0]["token_ids"]
    chat_request, prompt = body["chat_request"], body["prompt_token_ids"]
    floor = JobFloor(engine, body)
    answer = engine.chat(ids, chat_request, prompt)
    floor.check(floor.validated, answer)
    model = chat_request.get("model")

    def chats() -> None:
        for _ in range(records):
            engine.chat(ids, chat_request, prompt)

    def chat_floors() -> None:
        for _ in range(records):
            floor.response(model)

    chat_s, chat_floor_s = (t / records for t in best((chats, chat_floors), repeat))
    return len(ids), chat_s, chat_floor_s


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[30, 400])
    parser.add_argument("--records", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--logprobs", action="store_true", help="also each length with 5 top logprobs per token")
    args = parser.parse_args()

    engine = DerenderEngine.build(sample_config())
    b = SampleBuilder(qwen3_family(REPO / "sample_data" / "qwen3"))
    n = args.records
    print(f"Qwen3 + hermes, one-shot chat, {n} records per run, best of {args.repeat}, per record:")
    print(HEADER)
    for tokens in args.tokens:
        for logprobs in (False, True) if args.logprobs else (False,):
            print(record_row(engine, b, tokens, n, args.repeat, logprobs).line(), flush=True)

    count, chat_s, chat_floor_s = chat_row(engine, b, n, args.repeat)
    print(f"\nengine.chat, {count} tokens: {chat_s * 1e3:.3f}ms, floor {chat_floor_s * 1e3:.3f}ms, "
          f"{chat_s / chat_floor_s:.2f}x")
    engine.close()


if __name__ == "__main__":
    main()
