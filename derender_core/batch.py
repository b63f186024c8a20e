"""Batch execution: records in, answers out, in order, with a report.

Like vLLM's ``run_batch`` every input record gets exactly one answer, a
response or an error record; unlike it, nothing is read ahead, so memory
does not grow with the input. A bad record never ends a run: it gets an
error record naming the field and the problem, and the run goes on. Only
an input or output that fails mid-run stops it (`RunIncomplete`), after
writing what was answered.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .checks import check_body
from .errors import ExitStatus, RecordError, RunIncomplete, StreamFailure
from .logs import LogKind, tally_vllm_logs
from .protocol import Answer, Derenderer, Endpoint
from .records import Record, RequestIndex, derender_body
from .streams import ChunkFacts, StreamLedger
from .writers import ErrorLog, Writer

FAILURES_KEPT = 20
"""How many failed records the report keeps, for the summary."""


@dataclass(frozen=True)
class Failure:
    """A record that got an error record, and why."""

    record: int
    line: int
    status: int
    message: str
    detail: str | None = None
    """What the error record cannot say: why the server's parser gave up on
    the body, when it answered only its generic 400."""
    traceback: str | None = None
    """For a record that hit a bug rather than a bad input."""


@dataclass
class Report:
    """What a run did; `return_code` is the process exit status."""

    records: int = 0
    """Records read and answered."""
    errors: int = 0
    elapsed: float = 0.0
    failures: list[Failure] = field(default_factory=list)
    internal_errors: int = 0
    """Records that hit a bug (a traceback), not a bad input."""
    logs: list[LogKind] = field(default_factory=list)
    """vLLM's log records during the run, per kind."""
    stopped_at_failure: bool = False
    """``fail_fast`` stopped the run at its first failed record."""
    unfinished: str | None = None
    """Why the run could not finish: an input or output that failed."""
    written: int | None = None
    """Output records the output holds in full, when known (set at the end)."""

    @property
    def return_code(self) -> int:
        if self.unfinished is not None:
            return ExitStatus.INCOMPLETE
        return ExitStatus.RECORDS_FAILED if self.errors else ExitStatus.OK

    @property
    def records_per_second(self) -> float:
        return self.records / self.elapsed if self.elapsed > 0 else 0.0

    def count(self, record: Record, outcome: Outcome) -> None:
        self.records += 1
        answer = outcome.answer
        if answer.ok:
            return
        self.errors += 1
        if outcome.traceback is not None:
            self.internal_errors += 1
        if len(self.failures) < FAILURES_KEPT:
            self.failures.append(
                Failure(
                    record.number,
                    record.line,
                    answer.status,
                    answer.error_message,
                    outcome.detail,
                    outcome.traceback,
                )
            )


@dataclass(frozen=True)
class Job:
    """Which endpoint the records go to, how they are joined, and whether
    our own checks (`checks.check_body`) run before each call."""

    endpoint: Endpoint
    stream: bool = False
    requests: RequestIndex | None = None
    lenient: bool = False
    """Skip the checks: every record is answered as the render server
    answers it, out-of-vocabulary ids and all."""


@dataclass(frozen=True)
class Outcome:
    """What one record came to: its answer, and for a streamed call the
    facts of its chunk and whether it completed its request's stream."""

    answer: Answer
    facts: ChunkFacts | None = None
    completed: bool = False
    detail: str | None = None
    """Why the server's parser gave up on the line, when it says only that."""
    traceback: str | None = None
    """The traceback of a bug this record hit."""


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
        """The outcome of one record; never raises for a record, whatever
        it holds. A bug gets the server's catch-all answer (a 500) and
        keeps its traceback for ``--verbose``."""
        try:
            return self._process(record)
        except Exception as exc:
            return Outcome(self.engine.internal_error(exc), traceback=traceback.format_exc())

    def _process(self, record: Record) -> Outcome:
        engine, job = self.engine, self.job
        if record.problem is not None:
            problem = record.problem
            answer = engine.invalid_json(problem.message, problem.position)
            return Outcome(answer, detail=problem.message if problem.position is None else None)
        try:
            body = derender_body(record.payload, job.endpoint, stream=job.stream, requests=job.requests)
        except RecordError as exc:
            return Outcome(engine.bad_request(str(exc)))
        if not job.lenient:
            problem_found = check_body(body, job.endpoint, stream=job.stream, vocab_size=engine.vocab_size)
            if problem_found is not None:
                return self._refused(body, engine.bad_request(problem_found))
        if not job.stream:
            return Outcome(engine.post(job.endpoint, body))
        facts = ChunkFacts.of(body, job.endpoint)
        answer = engine.post(job.endpoint, self.ledger.with_state(body, facts))
        return Outcome(answer, facts, self.ledger.settle(facts, answer))

    def _refused(self, body: Any, answer: Answer) -> Outcome:
        """A call our checks refused: never sent, so no stream state moves,
        but a chunk's stream still shows (and may end with) the failed call,
        as it would for a call the server refused."""
        if not self.job.stream or not isinstance(body.get("generate_chunk"), Mapping):
            return Outcome(answer)
        facts = ChunkFacts.of(body, self.job.endpoint)
        return Outcome(answer, facts, self.ledger.settle(facts, answer))


def run(
    engine: Derenderer,
    records: Iterable[Record],
    job: Job,
    writer: Writer,
    on_progress: Callable[[Report], None] | None = None,
    *,
    fail_fast: bool = False,
    error_log: ErrorLog | None = None,
    verbose: bool = False,
) -> Report:
    """Derender every record and hand each answer to `writer`, in order.

    `fail_fast` stops after the first failed record; `error_log` gets every
    failed record with its line. vLLM's log records are counted per kind in
    the report; with `verbose` they also reach vLLM's handlers in full.

    Raises:
        RunIncomplete: when the input or an output failed mid-run. The
            records answered before it are written; its report says how
            far the run got.

    """
    report = Report()
    processor = RecordProcessor(engine, job)
    started = time.perf_counter()
    with tally_vllm_logs(report.logs, lambda: report.records + 1, verbose=verbose):
        try:
            for record in records:
                outcome = processor.process(record)
                writer.add(outcome.answer, outcome.facts)
                if outcome.completed:
                    assert outcome.facts is not None
                    writer.complete(outcome.facts.request_id)
                report.count(record, outcome)
                if error_log is not None and not outcome.answer.ok:
                    error_log.add(record, outcome.answer, outcome.detail)
                report.elapsed = time.perf_counter() - started
                if on_progress is not None:
                    on_progress(report)
                if fail_fast and not outcome.answer.ok:
                    report.stopped_at_failure = True
                    break
        except StreamFailure as failure:
            report.unfinished = str(failure)
        # What was answered is written even when the input failed.
        for output in (writer, error_log):
            try:
                if output is not None:
                    output.close()
            except StreamFailure as failure:
                report.unfinished = report.unfinished or str(failure)
    report.written = writer.records_written
    report.elapsed = time.perf_counter() - started
    if report.unfinished is not None:
        raise RunIncomplete(report)
    return report
