"""Worker processes: one run's records spread over N processes, answers in
input order.

The engine is built once, in this process, and each worker is forked from
it, so the start-up (imports, tokenizer, parsers) is paid once. A fork
copies memory, not threads: the engine closes its event loop before the
fork and runs vLLM's renderer work inline, so no thread is missing in a
worker; `Derenderer.after_fork` is where a path that does hold threads
would restore them. The fork is multiprocessing's, less 3.13's clearing
of the parent's exit callbacks in the child (`_ForkPopen`), which freed
objects other libraries had left there (Ray's) and crashed the workers.

Each worker runs a `RecordProcessor`, the same unit `batch.run` runs in
process. One-shot records go in small batches to the least busy worker.
Every call of a stream goes to the worker its stream key hashes to, so one
processor's ledger sees all of a stream's calls, in input order. Answers
come back in batches and are handed out strictly in input order, so the
writers see exactly what one process would have given them. At most
``workers * BATCHES_IN_FLIGHT`` batches are out at a time, so memory stays
bounded on inputs of any size.

Ctrl-C reaches the workers too (they share the terminal's process group);
they ignore it and let this process decide: it stops taking records and
collects every answer already on its way.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import gc
import io
import multiprocessing
import multiprocessing.context
import multiprocessing.popen_fork
import multiprocessing.util
import os
import pickle
import queue
import resource
import selectors
import signal
import sys
import time
import traceback
import zlib
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, NoReturn

import orjson

from .batch import Job, Outcome, OutcomeSource, RecordProcessor, Restored, stream_key
from .collector import records_pace
from .errors import ConfigError, StreamFailure
from .protocol import Answer, Derenderer, StreamAnswer
from .records import Record, RequestIndex

BATCH_RECORDS = 64
"""Records per message to a worker: enough to amortise the hop."""
BATCHES_IN_FLIGHT = 16
"""Batches a worker may hold (queued or in work) at a time: answers are
handed out in input order, so a worker the scheduler holds back for a
moment keeps the others waiting unless they have this much work queued
(with 4, two workers on two cores ran about 7% slower)."""
_POLL_SECONDS = 1.0
_RESET = "reset"
WORKERS_PER_CPU = 4
"""More workers than this per usable core only share the same cores."""
FILES_PER_WORKER = 8
"""Descriptors this process holds per worker (its queue's pipe and locks,
its answer pipe, its sentinel), with room to spare."""
FILES_KEPT = 64
"""Descriptors left for everything else: inputs, outputs, vLLM's own."""
_PR_SET_PDEATHSIG = 1
_PYTHON_PICKLER_RECURSION = 200_000
"""Frames Python's pickler may use for one batch: a few a level of the
deepest value any JSON parser here reads (orjson 1,024 levels, Python's
json at most about 10,000)."""


def usable_cpus() -> int:
    """CPU cores this process may run on (its affinity, not the machine's)."""
    return len(os.sched_getaffinity(0))


def worker_limit() -> tuple[int, str]:
    """How many workers this machine can hold, and why: a few per usable
    core, within the open-file and process limits. Checked before the model
    loads, so ``-j 10000`` is a usage error, not a crash after start-up."""
    cpus = usable_cpus()
    limits = [(max(WORKERS_PER_CPU, WORKERS_PER_CPU * cpus), f"{WORKERS_PER_CPU} per usable CPU core, {cpus} cores")]
    files, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if files != resource.RLIM_INFINITY:
        limits.append(((files - FILES_KEPT) // FILES_PER_WORKER, f"the open-file limit (ulimit -n) is {files}"))
    processes, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if processes != resource.RLIM_INFINITY:
        limits.append((processes - 1, f"the process limit (ulimit -u) is {processes}"))
    count, reason = min(limits)
    return max(count, 1), reason


def check_workers(workers: int) -> None:
    """Refuse a worker count the machine cannot hold.

    Raises:
        ConfigError: with the limit and what sets it.

    """
    limit, reason = worker_limit()
    if workers > limit:
        raise ConfigError(f"--workers {workers}: at most {limit} on this machine ({reason})")


class WorkerLost(StreamFailure):
    """A worker process died or hit a bug; the run cannot finish (exit
    status 3). Answers handed out before it are complete and in order."""


@dataclass(frozen=True)
class _Failed:
    """A worker's report of an unexpected exception."""

    worker: int
    traceback: str


# An outcome as it travels back: status, whole body (or None), chunk bytes
# (or None), chunk facts, completed, tokens.
_Wire = tuple[int, bytes | None, bytes | None, Any, bool, int, str | None, str | None, tuple[Any, ...]]


def freeze_for_fork() -> None:
    """Freeze every object built so far (`gc.freeze`) before children are
    forked: their collector then never touches, and so never copies, the
    parent's pages. Only the young generations are collected first. A full
    pass over a long-lived process's heap (the warm server's, a library
    user's, a test session's) cost more than a second a job, and buys
    nothing: what is garbage in the old generation stays frozen only until
    the pool's `close` unfreezes it, and is collected then."""
    gc.collect(1)
    gc.freeze()


class WorkerPool:
    """N forked processes, each answering records with its own
    `RecordProcessor` over a copy of `engine`. One pool serves any number of
    runs (one per input file), one at a time; `requests` is the
    ``--requests`` index every run's job joins with (inherited by the
    workers, as it cannot travel in a message).
    """

    def __init__(
        self,
        engine: Derenderer,
        workers: int,
        requests: RequestIndex | None = None,
        *,
        records_in_flight: int | None = None,
    ) -> None:
        if workers < 2:
            raise ValueError("a pool has at least two workers; one runs in process")
        check_workers(workers)
        started = time.perf_counter()
        self.size = workers
        self.records_in_flight = records_in_flight or workers * BATCHES_IN_FLIGHT * BATCH_RECORDS
        """Records read ahead of the output: what bounds memory, and what a
        stop still lets finish (they are answered and written, not lost)."""
        context = multiprocessing.get_context("fork")
        self._inboxes: list[Any] = [context.Queue() for _ in range(workers)]
        # Answers come back over a plain pipe each, written by the worker's
        # own thread: a queue's feeder thread cost a worker a few µs of CPU
        # a record in thread hand-offs, and its lock a syscall a batch. A
        # worker blocked on a full pipe waits only for this process, whose
        # own writes go through the inboxes' feeder threads, never blocked.
        pipes = [context.Pipe(duplex=False) for _ in range(workers)]
        self._outboxes: list[Connection] = [reader for reader, _ in pipes]
        writers = [writer for _, writer in pipes]
        # No event loop may be shared with the children; the engine opens a
        # new one when it is next used here.
        engine.close()
        # Objects built so far are never collected again, so the children
        # do not copy the pages the collector would touch (`freeze_for_fork`).
        freeze_for_fork()
        self._processes = [
            _ForkProcess(
                target=_work,
                args=(index, engine, requests, self._inboxes[index], writers[index], os.getpid(), [*self._outboxes, *writers]),
                name=f"derender-worker-{index}",
                daemon=True,
            )
            for index in range(workers)
        ]
        for process in self._processes:
            process.start()
        # Each answer pipe's only writer is its worker now, so a worker that
        # dies leaves its pipe at end of file.
        for writer in writers:
            writer.close()
        self._answers = selectors.DefaultSelector()
        """The answer pipes, each keyed to its worker, watched together."""
        for worker, outbox in enumerate(self._outboxes):
            self._answers.register(outbox, selectors.EVENT_READ, worker)
        self.startup_seconds = time.perf_counter() - started

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def answering(self, job: Job, *, whole_stream_answers: bool = True) -> OutcomeSource:
        """The `OutcomeSource` for one run of `job` (``batch.run(...,
        outcomes=...)``); the workers' processors start afresh.

        `whole_stream_answers` says whether the writer reads a streamed
        call's whole answer, state included (JSONL output); SSE and
        assembled output read only the chunk, so the state, which grows
        with the stream, stays in the worker.
        """
        return functools.partial(self._outcomes, job, whole_stream_answers)

    def _outcomes(
        self, job: Job, whole_stream_answers: bool, items: Iterable[Record | Restored]
    ) -> Iterator[tuple[Record, Outcome]]:
        """Every record's outcome, in input order."""
        # The index stays behind: each worker has the one it was forked with.
        for inbox in self._inboxes:
            inbox.put((_RESET, dataclasses.replace(job, requests=None), whole_stream_answers))
        size = self.size
        order: deque[tuple[int, Record | None]] = deque()
        batches: list[list[Record | Restored]] = [[] for _ in range(size)]
        ready: list[deque[Outcome | None]] = [deque() for _ in range(size)]
        outstanding = [0] * size
        limit = self.records_in_flight
        target = 0

        def send(worker: int) -> None:
            if batches[worker]:
                self._inboxes[worker].put(_pickled(batches[worker]))
                batches[worker] = []
                outstanding[worker] += 1

        def answered(keep: int) -> Iterator[tuple[Record, Outcome]]:
            """Outcomes, in order, until at most `keep` records are in flight."""
            while len(order) > keep:
                worker, record = order.popleft()
                if not ready[worker]:
                    send(worker)  # what is awaited may still sit in its batch
                    self._collect(worker, outstanding, ready)
                outcome = ready[worker].popleft()
                if record is not None and outcome is not None:
                    yield record, outcome

        def drain() -> Iterator[tuple[Record, Outcome]]:
            for worker in range(size):
                send(worker)
            yield from answered(0)

        reading = iter(items)
        stream = job.stream
        while True:
            try:
                item = next(reading)
            except StopIteration:
                break
            except Exception:
                # The input broke (a truncated gzip, say): what was read
                # before it is still answered and written, as in process.
                yield from drain()
                raise
            restored = isinstance(item, Restored)
            record = item.record if restored else item
            if stream:
                worker = zlib.crc32(orjson.dumps(stream_key(record, job))) % size
            elif restored:
                continue  # a one-shot record has nothing to restore
            else:
                worker = target
            batch = batches[worker]
            batch.append(item)
            order.append((worker, None if restored else record))
            if len(batch) >= BATCH_RECORDS:
                send(worker)
                if not stream:
                    target = min(range(size), key=lambda index: (outstanding[index], index))
            if len(order) >= limit:  # then a batch's worth, not one a record
                yield from answered(max(limit - BATCH_RECORDS, 0))
        yield from drain()

    def _collect(self, wanted: int, outstanding: list[int], ready: list[deque[Outcome | None]]) -> None:
        """Receive batches of outcomes until worker `wanted` has sent one,
        waiting as long as it lives.

        Whatever another worker has sent meanwhile is taken too: a worker
        writes its answers itself, so one whose pipe is full waits, and it
        must not wait on this process waiting on `wanted`.
        """
        while not ready[wanted]:
            assert outstanding[wanted], "an awaited answer has no batch on its way"
            sent = self._answers.select(timeout=_POLL_SECONDS)
            if not sent and not self._processes[wanted].is_alive():
                self._lost(wanted)
            for key, _ in sent:
                worker = key.data
                if not outstanding[worker]:  # it sent nothing: its pipe is at end of file
                    self._lost(worker)
                ready[worker].extend(self._receive(worker))
                outstanding[worker] -= 1

    def _receive(self, worker: int) -> list[Outcome | None]:
        """The batch of outcomes `worker` has sent (its pipe is readable)."""
        try:
            message = pickle.loads(self._outboxes[worker].recv_bytes())
        except (EOFError, OSError):
            # The worker is gone: its pipe closed, or cut mid-message (a
            # worker killed while it wrote).
            self._lost(worker)
        if isinstance(message, _Failed):
            raise WorkerLost(f"worker {message.worker} failed:\n{message.traceback}")
        return [None if wire is None else decode_outcome(wire) for wire in message]

    def _lost(self, worker: int) -> NoReturn:
        process = self._processes[worker]
        process.join(timeout=_POLL_SECONDS)
        raise WorkerLost(f"worker process {process.pid} exited with status {process.exitcode}") from None

    def close(self) -> None:
        """Stop the workers: they finish the batch at hand and exit."""
        # Answers still on their way are not read now (a run that failed
        # leaves some): a worker waiting to write them finds its pipe broken
        # and exits, rather than waiting for the deadline below.
        self._answers.close()
        for outbox in self._outboxes:
            outbox.close()
        for inbox in self._inboxes:
            inbox.put(None)
        deadline = time.monotonic() + 10
        for process in self._processes:
            process.join(timeout=max(deadline - time.monotonic(), 0.1))
            if process.is_alive():
                # SIGKILL: a worker ignores SIGTERM (`_work`).
                process.kill()
                process.join()
        for inbox in self._inboxes:
            inbox.cancel_join_thread()
            inbox.close()
        gc.unfreeze()


class _ForkPopen(multiprocessing.popen_fork.Popen):
    """A fork start as Python 3.11 and 3.12 make it.

    From 3.13, multiprocessing's fork start clears, in the child, the
    atexit callbacks the parent had registered. Dropping them frees what
    only they held: after ``ray.init`` (in a test session, a library user's
    process), Ray's GCS client, whose destructor shuts down a gRPC
    completion queue served by threads the child does not have, and the
    worker dies of SIGSEGV before it answers. This child keeps them and
    never runs them (it leaves by ``os._exit``), so it frees nothing it did
    not make; multiprocessing's own exit work still runs."""

    def _launch(self, process_obj: Any) -> None:
        code = 1
        parent_r, child_w = os.pipe()
        child_r, parent_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            try:
                os.close(parent_r)
                os.close(parent_w)
                code = process_obj._bootstrap(parent_sentinel=child_r)
                if sys.version_info >= (3, 13):
                    # 3.13's _bootstrap leaves this to the atexit it cleared.
                    multiprocessing.util._exit_function()  # type: ignore[attr-defined]
            finally:
                os._exit(code)
        else:
            os.close(child_w)
            os.close(child_r)
            self.finalizer = multiprocessing.util.Finalize(self, multiprocessing.util.close_fds, (parent_r, parent_w))
            self.sentinel = parent_r


class _ForkProcess(multiprocessing.context.ForkProcess):
    """A worker process started by `_ForkPopen`."""

    @staticmethod
    def _Popen(process_obj: Any) -> _ForkPopen:
        return _ForkPopen(process_obj)


def _work(
    index: int,
    engine: Derenderer,
    requests: RequestIndex | None,
    inbox: Any,
    outbox: Connection,
    parent: int,
    answer_pipes: list[Connection],
) -> None:
    """A worker's loop: batches of records in, batches of outcomes out."""
    _die_with_parent(parent)
    # Ctrl-C, ``timeout`` and a container's stop signal the whole process
    # group: the parent stops the run (`interrupt.stop_on_signals`), and the
    # workers answer what is in flight until it ends them (`close`). A worker
    # killed by such a signal would end the run as lost, its answers with it.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    # Of the answer pipes, only the writing end of its own stays open here:
    # a parent gone leaves no reader (the write fails, where the kernel does
    # not kill this worker first), and no other worker's pipe is held open.
    for end in answer_pipes:
        if end is not outbox:
            end.close()
    engine.after_fork()
    # The worker answers records until it ends (`collector.records_pace`).
    with records_pace():
        _answer_batches(engine, requests, inbox, outbox, parent, index)


def _answer_batches(
    engine: Derenderer, requests: RequestIndex | None, inbox: Any, outbox: Connection, parent: int, index: int
) -> None:
    """Each batch from `inbox` answered into `outbox`, until the parent
    ends the work or is gone."""
    processor: RecordProcessor | None = None
    whole_stream_answers = True
    while True:
        try:
            message = inbox.get(timeout=_POLL_SECONDS)
        except queue.Empty:
            if os.getppid() != parent:  # orphaned: nobody reads our answers
                return
            continue
        if message is None:
            return
        if isinstance(message, tuple) and message[0] == _RESET:
            _, job, whole_stream_answers = message
            processor = RecordProcessor(engine, dataclasses.replace(job, requests=requests))
            continue
        assert processor is not None
        try:
            results: list[_Wire | None] = []
            batch: list[Record | Restored | None] = pickle.loads(message)
            for position, item in enumerate(batch):
                # Each record's parsed line freed once answered, not with the batch.
                batch[position] = None
                if isinstance(item, Restored):
                    processor.restore(item.record, item.answer)
                    results.append(None)
                else:
                    results.append(answered(processor, item, whole_stream_answers))
                del item
            answers = pickle.dumps(results, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            _sent(outbox, pickle.dumps(_Failed(index, traceback.format_exc())))
            return
        if not _sent(outbox, answers):
            return


def _sent(outbox: Connection, message: bytes) -> bool:
    """Write a message to the parent; False where the pipe is broken: the
    parent no longer reads (`WorkerPool.close`), and the worker should end."""
    try:
        outbox.send_bytes(message)
    except OSError:
        return False
    return True


def _die_with_parent(parent: int) -> None:
    """Have the kernel kill this worker when the parent dies (Linux
    ``PR_SET_PDEATHSIG``), even in the middle of a batch: an orphan would
    otherwise work on for minutes, holding the run's stdout and stderr.
    Elsewhere the loop's poll of the parent still notices, between batches."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the request took hold
        os._exit(0)


def _pickled(batch: list[Record | Restored]) -> bytes:
    """A batch of records as bytes, pickled here rather than in the
    queue's feeder thread, which drops what it cannot pickle and leaves the
    run waiting for its answers.

    A record's value may be nested as deeply as this Python's JSON parser
    reads (about 1,000 levels on 3.11, 1,500 on 3.12, 10,000 on 3.13), and
    the C pickler recurses twice a level: on 3.11 a raised recursion limit
    lets it through, but from 3.12 its depth is bounded by a fixed C limit
    (about 750 levels on 3.12, 5,000 on 3.13). What it cannot take goes
    through Python's own pickler, whose frames cost no C stack, with room
    for any depth the parser gave. Unpickling recurses on neither."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 4 * limit + 1000))
    try:
        return pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
    except RecursionError:
        sys.setrecursionlimit(max(limit, _PYTHON_PICKLER_RECURSION))
        buffer = io.BytesIO()
        pickle._Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(batch)  # type: ignore[attr-defined]
        return buffer.getvalue()
    finally:
        sys.setrecursionlimit(limit)


def answered(processor: RecordProcessor, record: Record, whole_stream_answers: bool) -> _Wire:
    """A record's outcome, as it travels back (`encode_outcome`). An answer
    that cannot be made into bytes is the record's failure, not the
    worker's: it travels as the record's error record (`Outcome.failed`)."""
    outcome = processor.process(record)
    try:
        return encode_outcome(outcome, whole_stream_answers)
    except Exception as exc:
        return encode_outcome(outcome.failed(processor.engine, exc), whole_stream_answers)


def encode_outcome(outcome: Outcome, whole_stream_answers: bool) -> _Wire:
    """An outcome as it travels between processes: the answer's bytes (for
    a streamed call, only its chunk unless `whole_stream_answers`)."""
    answer = outcome.answer
    chunk_only = answer.is_stream_answer and not whole_stream_answers
    return (
        answer.status,
        None if chunk_only else answer.raw,
        answer.chunk_raw if chunk_only else None,
        outcome.facts,
        outcome.completed,
        outcome.tokens,
        outcome.detail,
        outcome.traceback,
        outcome.logs,
    )


def decode_outcome(wire: _Wire) -> Outcome:
    """The outcome `encode_outcome` sent."""
    status, raw, chunk_raw, facts, completed, tokens, detail, trace, logs = wire
    answer: Answer
    if raw is not None:
        answer = Answer(status, raw)
    else:
        assert chunk_raw is not None
        answer = StreamAnswer(orjson.loads(chunk_raw), chunk_raw, None, _state_left_in_worker)
    return Outcome(answer, facts, completed, tokens, detail, trace, logs)


def _state_left_in_worker(state: Any) -> Any:
    raise RuntimeError(
        "this answer's stream_state stayed in its worker process; "
        "a pool built with whole_stream_answers=True sends it"
    )
