"""Batch execution: records in, answers out, in order, with a report.

Like vLLM's ``run_batch`` every input record gets exactly one answer, a
response or an error record; unlike it, nothing is read ahead, so memory
does not grow with the input.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

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
    tokens: int = 0
    """Generated token ids derendered (prompt ids not counted)."""
    last_line: int = 0
    """Input line of the last record answered, to say where a run stopped."""
    stopped_by: int | None = None
    """The signal (SIGINT, SIGTERM) that stopped the run before its input ended."""
    resumed: int = 0
    """Records an earlier run had answered, skipped by ``--resume``."""
    startup: float = 0.0
    """Seconds before the first answer spent starting up elsewhere (Ray
    actors building their engines), left out of `elapsed`."""

    @property
    def return_code(self) -> int:
        if self.stopped_by is not None:
            return 128 + self.stopped_by  # as the shell reports a signal
        return 1 if self.errors else 0

    @property
    def records_per_second(self) -> float:
        return self.records / self.elapsed if self.elapsed > 0 else 0.0

    def count(self, record: Record, outcome: Outcome) -> None:
        answer = outcome.answer
        self.records += 1
        self.tokens += outcome.tokens
        self.last_line = record.line
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
    tokens: int = 0
    """Generated token ids in the record, for throughput figures."""


@dataclass(frozen=True)
class Restored:
    """A record an earlier run answered (``--resume``): not sent again, but
    its answer's stream state is threaded as if it had just been given."""

    record: Record
    answer: Answer


OutcomeSource = Callable[[Iterable["Record | Restored"]], Iterator[tuple[Record, Outcome]]]
"""Turns records into (record, outcome) pairs in input order: in process
(`in_process`), or spread over worker processes (`workers.WorkerPool`)."""


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
        tokens = generated_tokens(body)
        if not job.stream:
            return Outcome(engine.post(job.endpoint, body), tokens=tokens)
        facts = ChunkFacts.of(body, job.endpoint)
        answer = engine.post(job.endpoint, self.ledger.with_state(body, facts))
        return Outcome(answer, facts, self.ledger.settle(facts, answer), tokens)

    def restore(self, record: Record, answer: Answer) -> None:
        """Take `answer`, given to `record` by an earlier run, as `process`
        would have taken it: a streamed call's state is threaded onward."""
        if not self.job.stream or record.problem is not None:
            return
        try:
            body = derender_body(record.payload, self.job.endpoint, stream=True, requests=self.job.requests)
        except RecordError:
            return
        self.ledger.settle(ChunkFacts.of(body, self.job.endpoint), answer)

    def outcomes(self, items: Iterable[Record | Restored]) -> Iterator[tuple[Record, Outcome]]:
        """The in-process `OutcomeSource`: each record's outcome, in order."""
        for item in items:
            if isinstance(item, Restored):
                self.restore(item.record, item.answer)
            else:
                yield item, self.process(item)


def stream_key(record: Record, job: Job) -> str | None:
    """The stream a record's call belongs to, as the ledger keys it: all
    records with one key must go to one `RecordProcessor`, in input order.
    Read from the record alone (a bare chunk carries its own request_id),
    so work can be routed without joining ``--requests``."""
    if not job.stream or record.problem is not None:
        return None
    try:
        body = derender_body(record.payload, job.endpoint, stream=True, requests=None)
    except RecordError:
        body = {"generate_chunk": record.payload}  # a bare chunk, joined later by its request_id
    return ChunkFacts.of(body, job.endpoint).request_id


def generated_tokens(body: Any) -> int:
    """The generated token ids a derender body carries, in all its choices."""
    if not isinstance(body, Mapping):
        return 0
    responses = body.get("generate_responses")
    if not isinstance(responses, list):
        responses = [body.get("generate_response") or body.get("generate_chunk")]
    total = 0
    for response in responses:
        choices = response.get("choices") if isinstance(response, Mapping) else None
        for choice in choices if isinstance(choices, list) else ():
            token_ids = choice.get("token_ids") if isinstance(choice, Mapping) else None
            total += len(token_ids) if isinstance(token_ids, list) else 0
    return total


def run(
    engine: Derenderer,
    records: Iterable[Record | Restored],
    job: Job,
    writer: Writer,
    on_progress: Callable[[Report], None] | None = None,
    *,
    outcomes: OutcomeSource | None = None,
) -> Report:
    """Derender every record and hand each answer to `writer`, in order.

    `outcomes` answers the records elsewhere (worker processes); by default
    a `RecordProcessor` answers them in this process.
    """
    report = Report()
    answer_all = outcomes or RecordProcessor(engine, job).outcomes
    started = time.perf_counter()
    for record, outcome in answer_all(records):
        writer.add(outcome.answer, outcome.facts)
        if outcome.completed:
            assert outcome.facts is not None
            writer.complete(outcome.facts.request_id)
        report.count(record, outcome)
        report.elapsed = time.perf_counter() - started
        if on_progress is not None:
            on_progress(report)
    writer.close()
    report.elapsed = time.perf_counter() - started
    return report
