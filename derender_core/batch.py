"""Batch execution: records in, answers out, in order, with a report.

Like vLLM's ``run_batch`` every input record gets exactly one answer, a
response or an error record; unlike it, nothing is read ahead but the
one-shot records a path answers together (`Derenderer.window`: the serve
path batches them), so memory does not grow with the input. A bad record never ends a run: it gets an
error record naming the field and the problem, and the run goes on; so does
a record that hits a bug anywhere between being read and being handed to
the writer (`RecordProcessor.process`, `Outcome.failed`). Only an input or
output that fails mid-run stops it (`RunIncomplete`), after writing what
was answered.
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from .checks import PassedPrompts, check_body
from .collector import records_pace
from .errors import ExitStatus, RecordError, StreamFailure
from .logprob_text import split_body
from .logs import ROUTE, LogKind, LogLine, collected_vllm_logs, count_logs, tally_vllm_logs
from .prompts import PROMPT_MISSING, PromptRenderer, lacks_prompt, rendered_token_ids
from .protocol import Answer, Call, Derenderer, Endpoint
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
        if self.unfinished is not None:
            return ExitStatus.INCOMPLETE
        if self.stopped_by is not None:
            return 128 + self.stopped_by  # as the shell reports a signal
        return ExitStatus.RECORDS_FAILED if self.errors else ExitStatus.OK

    @property
    def prompts_missing(self) -> int:
        """Records derendered without the prompt ids that could change their
        answers (`prompts.PROMPT_MISSING`): ``--render-prompts`` renders them."""
        return sum(kind.count for kind in self.logs if kind.key == PROMPT_MISSING.key)

    @property
    def records_per_second(self) -> float:
        return self.records / self.elapsed if self.elapsed > 0 else 0.0

    def count(self, record: Record, outcome: Outcome) -> None:
        answer = outcome.answer
        self.records += 1
        self.tokens += outcome.tokens
        self.last_line = record.line
        if outcome.logs:
            count_logs(self.logs, outcome.logs, record.number)
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


class RunIncomplete(Exception):
    """A run stopped before the end of its input because an input or output
    failed. `report` says why, how many records were answered and how many
    the output holds in full."""

    exit_status = ExitStatus.INCOMPLETE

    def __init__(self, report: Report) -> None:
        super().__init__(report.unfinished)
        self.report = report


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
    verbose: bool = False
    """vLLM's log messages also go, in full, to its own handlers."""
    render_prompts: bool = False
    """A derender record with a request and no prompt ids gets them from the
    engine's render endpoint first (`prompts`)."""


@dataclass(frozen=True)
class Outcome:
    """What one record came to: its answer, and for a streamed call the
    facts of its chunk and whether it completed its request's stream."""

    answer: Answer
    facts: ChunkFacts | None = None
    completed: bool = False
    tokens: int = 0
    """Generated token ids in the record, for throughput figures."""
    detail: str | None = None
    """Why the server's parser gave up on the line, when it says only that."""
    traceback: str | None = None
    """The traceback of a bug this record hit."""
    logs: tuple[LogLine, ...] = ()
    """What vLLM logged while the record was derendered."""

    def failed(self, engine: Derenderer, exc: Exception) -> Outcome:
        """This outcome once `exc` hit its answer after it was made (turning
        it into bytes for a worker's message or for the output): the
        server's catch-all answer for it, as for any bug a record hits, so
        the record gets its error record and the run goes on."""
        return dataclasses.replace(self, answer=engine.internal_error(exc), traceback=traceback.format_exc())


@dataclass(frozen=True)
class Restored:
    """A record an earlier run answered (``--resume``): not sent again, but
    its answer's stream state is threaded as if it had just been given."""

    record: Record
    answer: Answer


@dataclass(frozen=True)
class _Pending:
    """A one-shot record checked and ready for its one call."""

    body: Any
    tokens: int
    logs: tuple[LogLine, ...] = ()


OutcomeSource = Callable[[Iterable["Record | Restored"]], Iterator[tuple[Record, Outcome]]]
"""Turns records into (record, outcome) pairs in input order: in process
(`RecordProcessor.outcomes`), or spread over worker processes
(`workers.WorkerPool`)."""


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
        self.prompts = PromptRenderer(engine)
        self.passed = PassedPrompts()
        # (An engine written before `reads_logprob_text` holds loaded bodies.)
        self.splits = not job.stream and not job.endpoint.renders and getattr(engine, "reads_logprob_text", False)
        """Whether a one-shot record's logprobs are read from its text
        (`logprob_text`), for a path whose writer takes them so."""

    def process(self, record: Record) -> Outcome:
        """The outcome of one record; never raises for a record, whatever
        it holds. A bug gets the server's catch-all answer (a 500) and
        keeps its traceback for ``--verbose``."""
        with collected_vllm_logs(verbose=self.job.verbose) as logged:
            try:
                outcome = self._process(record)
            except Exception as exc:
                outcome = Outcome(self.engine.internal_error(exc), traceback=traceback.format_exc())
        return dataclasses.replace(outcome, logs=(*outcome.logs, *logged)) if logged else outcome

    def _process(self, record: Record) -> Outcome:
        prepared = self._prepared(record)
        if isinstance(prepared, Outcome):
            return prepared
        return Outcome(self.engine.post(self.job.endpoint, prepared.body), tokens=prepared.tokens, logs=prepared.logs)

    def _prepared(self, record: Record) -> Outcome | _Pending:
        """The record's outcome, or for a one-shot derender record that
        passed the checks, the call still to make."""
        engine, job = self.engine, self.job
        text = record.unparsed if self.splits else None
        payload = split_body(text) if text is not None and b'"logprobs"' in text else None
        if payload is None:
            if record.problem is not None:
                problem = record.problem
                return Outcome(engine.invalid_json(problem.message, problem.position), detail=failure_detail(record))
            payload = record.payload
        if job.endpoint.renders:
            # A request in, its GenerateRequest out: nothing to join or check.
            answer = engine.post(job.endpoint, payload)
            return Outcome(answer, tokens=_tokens_handled(job.endpoint, payload, answer) if answer.ok else 0)
        try:
            body = derender_body(payload, job.endpoint, stream=job.stream, requests=job.requests)
        except RecordError as exc:
            return Outcome(engine.bad_request(str(exc)))
        if lacks_prompt(body, job.endpoint):
            if job.render_prompts:
                body, refused = self.prompts.filled(job.endpoint, body)
                if refused is not None:
                    return dataclasses.replace(self._refused(body, refused), detail="rendering its prompt (--render-prompts)")
            elif engine.prompt_matters(job.endpoint):
                derendered = self._derendered(body)
                return dataclasses.replace(derendered, logs=(PROMPT_MISSING,))
        return self._derendered(body)

    def _derendered(self, body: Any) -> Outcome | _Pending:
        """The outcome of a derender body: checked, then answered (a
        one-shot body's call left to the caller)."""
        engine, job = self.engine, self.job
        if not job.lenient:
            problem_found = check_body(
                body, job.endpoint, stream=job.stream, vocab_size=engine.vocab_size, passed=self.passed
            )
            if problem_found is not None:
                return self._refused(body, engine.bad_request(problem_found))
        tokens = generated_tokens(body)
        if not job.stream:
            return _Pending(body, tokens)
        facts = ChunkFacts.of(body, job.endpoint)
        answer = engine.post(job.endpoint, self.ledger.with_state(body, facts))
        return Outcome(answer, facts, self.ledger.settle(facts, answer), tokens)

    def _refused(self, body: Any, answer: Answer) -> Outcome:
        """A call our checks refused: never sent, so no stream state moves,
        but a chunk's stream still shows (and may end with) the failed call,
        as it would for a call the server refused."""
        if not self.job.stream or not isinstance(body.get("generate_chunk"), Mapping):
            return Outcome(answer)
        facts = ChunkFacts.of(body, self.job.endpoint)
        return Outcome(answer, facts, self.ledger.settle(facts, answer))

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
        """The in-process `OutcomeSource`: each record's outcome, in order.
        One-shot records go as many at a time as the path answers together
        (`Derenderer.window`, `window`); a stream's calls, each threading
        the last one's state, one at a time."""
        size = self.engine.window
        if self.job.stream or self.job.endpoint.renders or size == 1:
            for item in items:
                if isinstance(item, Restored):
                    self.restore(item.record, item.answer)
                else:
                    yield item, self.process(item)
            return
        records: list[Record] = []
        for item in items:
            if isinstance(item, Restored):
                continue  # a one-shot answer threads nothing onward
            records.append(item)
            if len(records) == size:
                yield from zip(records, self.window(records), strict=True)
                records = []
        if records:
            yield from zip(records, self.window(records), strict=True)

    def window(self, records: list[Record]) -> list[Outcome]:
        """`process` for each of the one-shot records, their calls made
        together (`Derenderer.post_many`'s way: the serve path batches
        them). Each outcome is the one `process` gives: its own log lines
        (routed by the context its call runs in, `logs.ROUTE`; a line
        logged outside every record's context, by a thread, goes to the
        record whose work started last: on a path that answers one call at
        a time, the one running), a bug its own error record."""
        if not records:
            return []
        outcomes: list[Outcome | _Pending] = []
        lines: list[list[LogLine]] = [[] for _ in records]
        current = [lines[0]]
        with collected_vllm_logs(verbose=self.job.verbose, sink=lambda line: current[-1].append(line)):
            for record, logged in zip(records, lines, strict=True):
                current.append(logged)
                route = ROUTE.set(logged.append)
                try:
                    outcomes.append(self._prepared(record))
                except Exception as exc:
                    outcomes.append(Outcome(self.engine.internal_error(exc), traceback=traceback.format_exc()))
                finally:
                    ROUTE.reset(route)
            calls = [(n, o) for n, o in enumerate(outcomes) if isinstance(o, _Pending)]
            scripts = (self._call(pending, lines[n], current) for n, pending in calls)
            for (n, _), outcome in zip(calls, self.engine.drive(scripts, window=len(records)), strict=True):
                outcomes[n] = outcome
        done = []
        for outcome, logged in zip(outcomes, lines, strict=True):
            assert isinstance(outcome, Outcome)
            done.append(dataclasses.replace(outcome, logs=(*outcome.logs, *logged)) if logged else outcome)
        return done

    def _call(
        self, pending: _Pending, logged: list[LogLine], current: list[list[LogLine]]
    ) -> Generator[Call, Answer, Outcome]:
        """A one-shot record's call, as a script (`protocol.Script`)."""
        ROUTE.set(logged.append)  # in the script's own context
        current.append(logged)
        try:
            answer = yield self.job.endpoint, pending.body
        except Exception as exc:
            return Outcome(self.engine.internal_error(exc), traceback=traceback.format_exc(), logs=pending.logs)
        return Outcome(answer, tokens=pending.tokens, logs=pending.logs)


def failure_detail(record: Record) -> str | None:
    """What an error record cannot say about `record`: why the server's
    parser gave up on the line, when its answer is only the generic 400.
    Told from the record alone, so a resumed run logs it as the first did."""
    problem = record.problem
    return problem.message if problem is not None and problem.position is None else None


def stream_key(record: Record, job: Job) -> str | None:
    """The stream a record's call belongs to, as the ledger keys it: all
    records with one key must go to one `RecordProcessor`, in input order.
    Read from the record alone (a bare chunk carries its own request_id),
    so work can be routed without joining ``--requests``."""
    if not job.stream or record.problem is not None:
        return None
    try:
        body = derender_body(record.payload, job.endpoint, stream=True, requests=None)
    except Exception:
        # A bare chunk, joined later by its request_id (or a record that
        # fails here too: its worker answers it with its error record).
        body = {"generate_chunk": record.payload}
    return ChunkFacts.of(body, job.endpoint).request_id


def generated_tokens(body: Any) -> int:
    """The generated token ids a derender body carries, in all its choices."""
    if not (type(body) is dict or isinstance(body, Mapping)):
        return 0
    responses = body.get("generate_responses")
    if not isinstance(responses, list):
        responses = [body.get("generate_response") or body.get("generate_chunk")]
    total = 0
    for response in responses:
        choices = response.get("choices") if (type(response) is dict or isinstance(response, Mapping)) else None
        for choice in choices if isinstance(choices, list) else ():
            token_ids = choice.get("token_ids") if (type(choice) is dict or isinstance(choice, Mapping)) else None
            total += len(token_ids) if isinstance(token_ids, list) else 0
    return total


def run(
    engine: Derenderer,
    records: Iterable[Record | Restored],
    job: Job,
    writer: Writer,
    on_progress: Callable[[Report], None] | None = None,
    *,
    fail_fast: bool = False,
    error_log: ErrorLog | None = None,
    outcomes: OutcomeSource | None = None,
) -> Report:
    """Derender every record and hand each answer to `writer`, in order.

    `fail_fast` stops after the first failed record; `error_log` gets every
    failed record with its line. vLLM's log records are counted per kind in
    the report; with `job.verbose` they also reach vLLM's handlers in full.
    `outcomes` answers the records elsewhere (worker processes); by default
    a `RecordProcessor` answers them in this process.

    Raises:
        RunIncomplete: when the input or an output failed mid-run. The
            records answered before it are written; its report says how
            far the run got.

    """
    report = Report()
    answer_all = outcomes or RecordProcessor(engine, job).outcomes
    started = time.perf_counter()
    with records_pace(), tally_vllm_logs(report.logs, lambda: report.records + 1, verbose=job.verbose):
        try:
            for record, outcome in answer_all(records):
                try:
                    writer.add(outcome.answer, outcome.facts)
                except (StreamFailure, BrokenPipeError):
                    # A record the output refused was still answered.
                    report.count(record, outcome)
                    raise
                except Exception as exc:
                    # Not the output's failure but the record's: its answer
                    # could not be made into the output's bytes.
                    outcome = outcome.failed(engine, exc)
                    writer.add(outcome.answer, outcome.facts)
                report.count(record, outcome)
                if outcome.completed:
                    assert outcome.facts is not None
                    writer.complete(outcome.facts.request_id)
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


def _tokens_handled(endpoint: Endpoint, payload: Any, answer: Answer) -> int:
    """The tokens a successful preprocessing call handled, for the
    summary's rate: the prompt tokens rendered or tokenized, the ids
    detokenized."""
    if endpoint is Endpoint.TOKENIZE:
        return int(answer.body["count"])
    if endpoint is Endpoint.DETOKENIZE:
        return len(payload["tokens"])
    return sum(map(len, rendered_token_ids(answer)))
