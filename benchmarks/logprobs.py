"""Records that carry logprobs against their logprob floor.

    python benchmarks/logprobs.py [--repeat 5] [--quick] [--profile CASE]

Records are Qwen3 + hermes one-shot answers (a reasoning trace, a short
answer, one tool call) of N output tokens, each position with the sampled
id and its alternatives as generate sends them (integer ids; the sampled
id first, then `top` others, `tests.sample_inputs.logprobs_for`). Cases:
chat at 400 and 8,000 tokens with ``logprobs: true`` and ``top_logprobs``
0, 5 and 20, and completion at 8,000 tokens with ``logprobs: 5``.

Per case, the best of --repeat runs, the measures taking turns
(`record_floor.best`):

- record: one record of a one-shot job (``batch.run`` over JSONL lines to a
  JSONL writer: read, check, validate, derender, write), per record, the
  engine in the live mode every ``derender`` job runs it in;
- logprob floor: ``orjson.loads`` of the line, the job floor (one decode of
  the ids and, for chat, vLLM's parser class built and ``parse()`` called
  once, `floor.Floor.work`), and ``orjson.dumps`` of the answer derender
  writes, parsed back into a dict; at the collector's pace a job runs at
  (`collector.records_pace`), so neither pays a collection the other does
  not.

Beside them, "loaded": the same job with fast path ``lp_text`` off
(``DERENDER_FAST_PATHS=off:lp_text``), its lines' logprobs loaded as dicts
and checked there rather than read from the text (`logprob_text`).

Checked before timing: the floor's message (or text) is derender's, and
derender's answer is, byte for byte, the one ``--decode reference`` (vLLM's
own handlers and functions) gives, but for ``created`` and tool call ids;
so are the job's outputs with and without ``lp_text``.

Target: every case at most 2x its logprob floor.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import io
import os
import pstats
import time
from collections.abc import Callable, Iterator
from typing import Any

import orjson
from _common import REPO, plan_of_length, sample_config
from floor import Floor
from record_floor import best

from derender_core import DerenderEngine, Endpoint
from derender_core.batch import Job, run
from derender_core.collector import records_pace
from derender_core.records import iter_records
from derender_core.vllm_seam.versions import OFF_ENV
from derender_core.writers import JsonlWriter
from tests.helpers import normalized_bytes
from tests.sample_inputs import SampleBuilder, logprobs_for, one_shot_body, qwen3_family

MAX_CANDIDATES = 20
"""The sample server's ``max_logprobs``: candidates a position may hold."""
TARGET = 2.0
"""A record with logprobs at most this multiple of its logprob floor."""


@dataclasses.dataclass(frozen=True)
class Case:
    """One record shape: the endpoint, its output length and the top
    alternatives it asks for."""

    endpoint: Endpoint
    tokens: int
    top: int

    @property
    def name(self) -> str:
        asks = f"top_logprobs {self.top}" if self.endpoint is Endpoint.CHAT else f"logprobs {self.top}"
        return f"{self.endpoint.value} {self.tokens:,} tokens, {asks}"


CASES = (
    *(Case(Endpoint.CHAT, tokens, top) for tokens in (400, 8000) for top in (0, 5, 20)),
    Case(Endpoint.COMPLETION, 8000, 5),
)


def case_body(b: SampleBuilder, case: Case) -> dict[str, Any]:
    """The case's one-shot body: generate's logprobs hold the sampled id and
    `case.top` alternatives per position, as the engine sends them for that
    request (at most `MAX_CANDIDATES` in all)."""
    plan = plan_of_length(b, case.tokens)
    if case.endpoint is Endpoint.COMPLETION:
        prompt_text = "Think hard, then call the weather tool."
        plan = dataclasses.replace(
            plan, request={"model": b.family.served_name, "prompt": prompt_text}, request_key="completion_request"
        )
    body = one_shot_body(plan, b.family.served_name)
    if case.endpoint is Endpoint.CHAT:
        body["chat_request"].update(logprobs=True, top_logprobs=case.top)
        choice = body["generate_response"]["choices"][0]
    else:
        body["completion_request"]["logprobs"] = case.top
        choice = body["generate_responses"][0]["choices"][0]
    # The server refuses more candidates a position than its max_logprobs
    # (20 by default): at top 20, the sampled id and 19 others.
    choice["logprobs"] = logprobs_for(choice["token_ids"], top=min(case.top + 1, MAX_CANDIDATES))
    return orjson.loads(orjson.dumps(body))


class LogprobFloor(Floor):
    """The work a record with logprobs needs: read its line, decode (and for
    chat parse) once, write the answer."""

    def __init__(self, engine: DerenderEngine, case: Case, body: dict[str, Any], answer: dict[str, Any]) -> None:
        super().__init__(engine)
        self.case = case
        self.answer = answer
        copied = orjson.loads(orjson.dumps(body))
        self.validated = engine._bodies[case.endpoint].validate_python(copied, from_attributes=True)

    def work_once(self) -> Any:
        if self.case.endpoint is Endpoint.CHAT:
            return self.work(self.validated, logprobs=False)
        choice = self.validated.generate_responses[0].choices[0]
        return self.backend.decode(choice.token_ids, skip_special_tokens=True)

    def check(self) -> None:  # type: ignore[override]
        """The floor's message (chat) or text (completion) is derender's."""
        if self.case.endpoint is Endpoint.CHAT:
            super().check(self.validated, self.answer)
        elif self.work_once() != self.answer["choices"][0]["text"]:
            raise SystemExit(f"{self.case.name}: the floor's text is not derender's")

    def record(self, line: bytes) -> bytes:
        orjson.loads(line)
        self.work_once()
        return orjson.dumps(self.answer)


@dataclasses.dataclass
class Row:
    case: Case
    record: float
    floor: float
    loaded: float

    @property
    def ratio(self) -> float:
        return self.record / self.floor

    def line(self) -> str:
        verdict = "PASS" if self.ratio <= TARGET else "MISS"
        return (
            f"  {self.case.name:38} {self.record * 1e3:9.2f}ms {self.floor * 1e3:9.2f}ms "
            f"{self.ratio:8.2f}x   (target <= {TARGET}x)  {verdict}   loaded {self.loaded * 1e3:.2f}ms, "
            f"{self.loaded / self.floor:.2f}x"
        )


HEADER = f"  {'case':38} {'record':>11} {'floor':>11} {'ratio':>9}"


def measure_case(
    engine: DerenderEngine, b: SampleBuilder, case: Case, repeat: int, records: int, clock: Callable[[], float]
) -> Row:
    """One case's record against its logprob floor, the answers checked."""
    body = case_body(b, case)
    answer = engine.post(case.endpoint, body)
    if not answer.ok:
        raise SystemExit(f"{case.name}: derender failed: {answer.raw[:300]!r}")
    reference = engine.in_mode(decode="reference").post(case.endpoint, body)
    if normalized_bytes(answer.raw) != normalized_bytes(reference.raw):
        raise SystemExit(f"{case.name}: derender's answer is not --decode reference's")
    floor = LogprobFloor(engine, case, body, orjson.loads(answer.raw))
    floor.check()

    line = orjson.dumps(body)
    data = b"\n".join([line] * records) + b"\n"
    job = Job(case.endpoint, stream=False)
    job_engine = engine.in_mode(live=True)

    def job_output() -> bytes:
        out = io.BytesIO()
        report = run(job_engine, iter_records(io.BytesIO(data), digests=False), job, JsonlWriter(target=out))
        assert report.errors == 0
        return out.getvalue()

    def job_run() -> None:
        job_output()

    def loaded_run() -> None:
        with lp_text_off():
            job_output()

    with lp_text_off():
        loaded_bytes = job_output()
    if normalized_bytes(job_output()) != normalized_bytes(loaded_bytes):
        raise SystemExit(f"{case.name}: the job's output with lp_text is not its output without")

    def floors() -> None:
        # At the collector's pace a job answers records at (`records_pace`):
        # the floor pays no collection the job does not.
        with records_pace():
            for _ in range(records):
                floor.record(line)

    record_s, floor_s, loaded_s = (t / records for t in best((job_run, floors, loaded_run), repeat, clock))
    return Row(case, record_s, floor_s, loaded_s)


@contextlib.contextmanager
def lp_text_off() -> Iterator[None]:
    """Fast path ``lp_text`` off while the block runs (the engine asks
    `versions` per record)."""
    before = os.environ.get(OFF_ENV)
    os.environ[OFF_ENV] = "off:lp_text"
    try:
        yield
    finally:
        if before is None:
            del os.environ[OFF_ENV]
        else:
            os.environ[OFF_ENV] = before


def profile_case(engine: DerenderEngine, b: SampleBuilder, case: Case, records: int, top: int = 25) -> list[str]:
    """cProfile of `records` records of `case` in a job: the functions with
    the most time of their own, and the share of the whole each takes."""
    line = orjson.dumps(case_body(b, case))
    data = b"\n".join([line] * records) + b"\n"
    job, job_engine = Job(case.endpoint, stream=False), engine.in_mode(live=True)
    run(job_engine, iter_records(io.BytesIO(data), digests=False), job, JsonlWriter(target=io.BytesIO()))
    profiler = cProfile.Profile()
    profiler.enable()
    run(job_engine, iter_records(io.BytesIO(data), digests=False), job, JsonlWriter(target=io.BytesIO()))
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)
    return out.getvalue().splitlines()


def measure(
    engine: DerenderEngine, repeat: int = 5, quick: bool = False, clock: Callable[[], float] = time.perf_counter
) -> list[Row]:
    """Every case (`CASES`), printed as it is measured."""
    b = SampleBuilder(qwen3_family(REPO / "sample_data" / "qwen3"))
    rows = []
    print(HEADER)
    for case in CASES:
        per_record = case.tokens * (case.top + 2)
        records = max(1 if quick else 2, min(50, 400_000 // per_record) // (5 if quick else 1))
        row = measure_case(engine, b, case, repeat, records, clock)
        print(row.line(), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5, help="rounds per timing, best counted")
    parser.add_argument("--quick", action="store_true", help="fewer records per round")
    parser.add_argument(
        "--clock", choices=("wall", "cpu"), default="wall", help="time by the wall, or by this process's CPU time"
    )
    parser.add_argument(
        "--profile", metavar="TOKENS,TOP", default=None, help="profile one chat case instead, e.g. 8000,5"
    )
    args = parser.parse_args()
    engine = DerenderEngine.build(sample_config())
    if args.profile:
        tokens, top = map(int, args.profile.split(","))
        b = SampleBuilder(qwen3_family(REPO / "sample_data" / "qwen3"))
        print("\n".join(profile_case(engine, b, Case(Endpoint.CHAT, tokens, top), 3)))
    else:
        print(f"Qwen3 + hermes one-shot records with logprobs, per record, best of {args.repeat}, "
              f"{args.clock} time (load average {os.getloadavg()[0]:.2f}):")  # fmt: skip
        measure(engine, args.repeat, args.quick, time.process_time if args.clock == "cpu" else time.perf_counter)
    engine.close()


if __name__ == "__main__":
    main()
