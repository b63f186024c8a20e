"""Batch execution: records in, answers out, in order, with a report.

Like vLLM's ``run_batch`` every input record gets exactly one answer, a
response or an error record; unlike it, nothing is read ahead, so memory
does not grow with the input.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from .errors import RecordError
from .protocol import Answer, Derenderer, Endpoint
from .records import Record, RequestIndex, derender_body
from .streams import ChunkFacts, StreamLedger
from .writers import Writer

FAILURES_KEPT = 20
"""How many failed records the report keeps, for the summary."""


@dataclass(frozen=True)
class Failure:
    """A record that got an error record, and why."""

    record: int
    line: int
    status: int
    message: str


@dataclass
class Report:
    """What a run did; `return_code` is the process exit status."""

    records: int = 0
    errors: int = 0
    elapsed: float = 0.0
    failures: list[Failure] = field(default_factory=list)

    @property
    def return_code(self) -> int:
        return 1 if self.errors else 0

    @property
    def records_per_second(self) -> float:
        return self.records / self.elapsed if self.elapsed > 0 else 0.0

    def count(self, record: Record, answer: Answer) -> None:
        self.records += 1
        if not answer.ok:
            self.errors += 1
            if len(self.failures) < FAILURES_KEPT:
                self.failures.append(
                    Failure(record.number, record.line, answer.status, answer.error_message)
                )


@dataclass(frozen=True)
class Job:
    """Which endpoint the records go to, and how they are joined."""

    endpoint: Endpoint
    stream: bool = False
    requests: RequestIndex | None = None


@dataclass(frozen=True)
class Outcome:
    """What one record came to: its answer, and for a streamed call the
    facts of its chunk and whether it completed its request's stream."""

    answer: Answer
    facts: ChunkFacts | None = None
    completed: bool = False


class RecordProcessor:
    """Turns records into outcomes, one at a time, in order.

    It holds the path and, for streams, the ledger that threads their
    states, so it is the unit of work a worker runs: every call of a stream
    must go through the same processor, in input order.
    """

    def __init__(self, engine: Derenderer, job: Job) -> None:
        self.engine = engine
        self.job = job
        self.ledger = StreamLedger()

    def process(self, record: Record) -> Outcome:
        engine, job = self.engine, self.job
        if record.problem is not None:
            return Outcome(engine.invalid_json(record.problem.message, record.problem.position))
        try:
            body = derender_body(record.payload, job.endpoint, stream=job.stream, requests=job.requests)
        except RecordError as exc:
            return Outcome(engine.bad_request(str(exc)))
        if not job.stream:
            return Outcome(engine.post(job.endpoint, body))
        facts = ChunkFacts.of(body, job.endpoint)
        answer = engine.post(job.endpoint, self.ledger.with_state(body, facts))
        return Outcome(answer, facts, self.ledger.settle(facts, answer))


def run(
    engine: Derenderer,
    records: Iterable[Record],
    job: Job,
    writer: Writer,
    on_progress: Callable[[Report], None] | None = None,
) -> Report:
    """Derender every record and hand each answer to `writer`, in order."""
    report = Report()
    processor = RecordProcessor(engine, job)
    started = time.perf_counter()
    for record in records:
        outcome = processor.process(record)
        writer.add(outcome.answer, outcome.facts)
        if outcome.completed:
            assert outcome.facts is not None
            writer.complete(outcome.facts.request_id)
        report.count(record, outcome.answer)
        report.elapsed = time.perf_counter() - started
        if on_progress is not None:
            on_progress(report)
    writer.close()
    report.elapsed = time.perf_counter() - started
    return report
