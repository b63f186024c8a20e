"""Batch execution: records in, answers out, in order, with a report.

Like vLLM's ``run_batch`` every input record gets exactly one answer, a
response or an error record; unlike it, nothing is read ahead, so memory
does not grow with the input.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .errors import RecordError
from .protocol import Answer, Endpoint
from .records import Record, RequestIndex, derender_body
from .streams import ChunkFacts, StreamLedger
from .writers import Writer

if TYPE_CHECKING:
    from .engine import DerenderEngine

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


def run(
    engine: DerenderEngine,
    records: Iterable[Record],
    job: Job,
    writer: Writer,
    on_progress: Callable[[Report], None] | None = None,
) -> Report:
    """Derender every record and hand each answer to `writer`, in order."""
    report = Report()
    ledger = StreamLedger()
    started = time.perf_counter()
    for record in records:
        facts: ChunkFacts | None = None
        completed = False
        if record.problem is not None:
            answer = engine.invalid_json(record.problem.message, record.problem.position)
        else:
            try:
                body = derender_body(
                    record.payload, job.endpoint, stream=job.stream, requests=job.requests
                )
            except RecordError as exc:
                answer = engine.bad_request(str(exc))
            else:
                if job.stream:
                    facts = ChunkFacts.of(body, job.endpoint)
                    body = ledger.with_state(body, facts)
                answer = engine.post(job.endpoint, body)
                if facts is not None:
                    completed = ledger.settle(facts, answer)
        writer.add(answer, facts)
        if completed:
            assert facts is not None
            writer.complete(facts.request_id)
        report.count(record, answer)
        report.elapsed = time.perf_counter() - started
        if on_progress is not None:
            on_progress(report)
    writer.close()
    report.elapsed = time.perf_counter() - started
    return report
