"""Dataset scale: worker processes, resume, zstd, Parquet and progress.

Worker runs fork real engines (one pool per model family, reused by every
test of the family) and are compared with the in-process run of the same
lines, which the parity tests already compare with the render server.
Normalised, as everywhere, are only `created` and the random tool-call ids.
"""

from __future__ import annotations

import atexit
import gzip
import io
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from rich.console import Console

from derender_core import DerenderEngine, Endpoint, Report
from derender_core.batch import Job, run, stream_key
from derender_core.datasets import ParquetWriter, answers_in, open_records, output_name
from derender_core.interrupt import StopRequest, until_stopped
from derender_core.records import iter_records, open_input, open_output
from derender_core.resume import prepare_output, skip_answered
from derender_core.workers import BATCH_RECORDS, WorkerPool
from derender_core.writers import AssembledWriter, JsonlWriter, SseWriter, Writer
from tests.conftest import Stack
from tests.helpers import REPO, normalized_bytes, offline_env
from tests.sample_inputs import (
    chat_bodies,
    chat_error_bodies,
    completion_bodies,
    completion_stream_plans,
    parser_corner_plans,
    stream_bodies,
    stream_plans,
)


@pytest.fixture(scope="module")
def pools(stack: Stack) -> Iterator[dict[str, WorkerPool]]:
    """Two workers forked from each family's engine, replay and live."""
    with WorkerPool(stack.engine, 2) as replay, WorkerPool(stack.engine.in_mode(live=True), 2) as live:
        yield {"replay": replay, "live": live}


def one_shot_lines(stack: Stack, endpoint: Endpoint) -> list[bytes]:
    """Good and failing bodies, a line that is not JSON and a blank line,
    repeated past several worker batches."""
    b = stack.builder
    bodies = list(chat_bodies(b)) + list(chat_error_bodies(b)) if endpoint is Endpoint.CHAT else list(completion_bodies(b))
    lines = [orjson.dumps(body) for body in bodies] + [b'{"generate_response": ', b""]
    return lines * (3 * BATCH_RECORDS // len(lines) + 1)


def stream_lines(stack: Stack, endpoint: Endpoint) -> list[bytes]:
    b = stack.builder
    plans = stream_plans(b) + parser_corner_plans(b) if endpoint is Endpoint.CHAT else completion_stream_plans(b)
    return [orjson.dumps(body) for body in stream_bodies(b, plans)] + [b"not json"]


def writer_for(kind: str, out: io.BytesIO, engine: DerenderEngine, endpoint: Endpoint) -> Writer:
    if kind == "sse":
        return SseWriter(target=out)
    if kind == "assembled":
        finish = engine.chat_response if endpoint is Endpoint.CHAT else engine.completion_response
        return AssembledWriter(out, endpoint, finish)
    return JsonlWriter(out)


def derendered(engine: DerenderEngine, job: Job, lines: list[bytes], kind: str = "jsonl", pool: WorkerPool | None = None) -> tuple[bytes, Report]:
    out = io.BytesIO()
    outcomes = pool.answering(job, whole_stream_answers=kind == "jsonl") if pool else None
    records = iter_records(io.BytesIO(b"\n".join(lines) + b"\n"))
    report = run(engine, records, job, writer_for(kind, out, engine, job.endpoint), outcomes=outcomes)
    return out.getvalue(), report


# --- workers ----------------------------------------------------------------


@pytest.mark.parametrize("endpoint", [Endpoint.CHAT, Endpoint.COMPLETION])
def test_workers_answer_one_shot_records_as_one_process(stack: Stack, pools: dict[str, WorkerPool], endpoint: Endpoint) -> None:
    lines = one_shot_lines(stack, endpoint)
    job = Job(endpoint)
    alone, alone_report = derendered(stack.engine, job, lines)
    spread, spread_report = derendered(stack.engine, job, lines, pool=pools["replay"])
    assert normalized_bytes(spread) == normalized_bytes(alone)
    # Blank lines among records are records; only the last line, blank, is not.
    assert lines[-1] == b"" and spread.count(b"\n") == alone_report.records == len(lines) - 1
    assert (spread_report.records, spread_report.errors, spread_report.tokens) == (
        alone_report.records, alone_report.errors, alone_report.tokens,
    )  # fmt: skip
    assert [(f.record, f.line) for f in spread_report.failures] == [(f.record, f.line) for f in alone_report.failures]


@pytest.mark.parametrize("kind", ["jsonl", "sse", "assembled"])
@pytest.mark.parametrize("endpoint", [Endpoint.CHAT, Endpoint.COMPLETION])
@pytest.mark.parametrize("mode", ["live", "replay"])
def test_workers_keep_each_stream_on_one_worker_in_order(
    stack: Stack, pools: dict[str, WorkerPool], endpoint: Endpoint, kind: str, mode: str
) -> None:
    """Interleaved streams spread over two workers give the very bytes one
    process gives: every call, state, transcript and assembled response."""
    engine = stack.engine.in_mode(live=mode == "live")
    lines = stream_lines(stack, endpoint)
    job = Job(endpoint, stream=True)
    alone, _ = derendered(engine, job, lines, kind)
    spread, report = derendered(engine, job, lines, kind, pool=pools[mode])
    assert normalized_bytes(spread) == normalized_bytes(alone)
    assert report.records == len(lines)


def test_stream_keys_spread_over_both_workers(stack: Stack, pools: dict[str, WorkerPool]) -> None:
    """The test above is only worth something if streams land on both."""
    job = Job(Endpoint.CHAT, stream=True)
    records = list(iter_records(io.BytesIO(b"\n".join(stream_lines(stack, Endpoint.CHAT)))))
    workers = {zlib.crc32(orjson.dumps(stream_key(r, job))) % 2 for r in records if stream_key(r, job)}
    assert workers == {0, 1}


def test_a_pool_left_with_answers_unread_closes_with_its_workers_exiting(qwen3_stack: Stack) -> None:
    """A run that stops reading answers (its output failed, say) leaves
    some on their way, and a worker writing them waits on a full pipe:
    closing the pool breaks those pipes, so every worker exits by itself
    (status 0) rather than being terminated at the deadline."""
    lines = [orjson.dumps(body) for body in chat_bodies(qwen3_stack.builder)] * 1000
    pool = WorkerPool(qwen3_stack.engine, 2)
    try:
        outcomes = pool.answering(Job(Endpoint.CHAT))(iter_records(io.BytesIO(b"\n".join(lines) + b"\n")))
        next(outcomes)
        time.sleep(1)  # the workers answer on and fill their pipes
        outcomes.close()
    finally:
        pool.close()
    assert [process.exitcode for process in pool._processes] == [0, 0]


class _FreedInAChildCrashes:
    """Stands for what Ray's GCS client is after ``ray.init``: held only by
    an exit callback, and fatal to free in a forked child (its destructor
    shuts down a gRPC queue served by threads the child lacks)."""

    def __init__(self) -> None:
        self.parent = os.getpid()

    def __del__(self) -> None:
        if os.getpid() != self.parent:
            os.kill(os.getpid(), signal.SIGSEGV)


@dataclass(frozen=True)
class _ExitCallback:
    """An exit callback that holds `held` and is equal to any other of its
    `name`: unregistered without the test keeping a reference to it."""

    name: str
    held: object = field(default=None, compare=False)

    def __call__(self) -> None:
        pass


def test_workers_free_nothing_the_parents_exit_callbacks_hold(qwen3_stack: Stack) -> None:
    """Issue 37: on Python 3.13 multiprocessing's fork start clears the
    parent's atexit callbacks in each child, which freed what only they
    held; in a process that had run Ray (a test session, a library user)
    every worker died of SIGSEGV. Workers keep the callbacks, unrun, on
    every Python."""
    # Nothing here keeps a reference to it: only the exit callback does.
    atexit.register(_ExitCallback("issue 37", _FreedInAChildCrashes()))
    try:
        lines = [orjson.dumps(body) for body in chat_bodies(qwen3_stack.builder)] * 50
        expected, _ = derendered(qwen3_stack.engine, Job(Endpoint.CHAT), lines)
        with WorkerPool(qwen3_stack.engine, 2) as pool:
            got, _ = derendered(qwen3_stack.engine, Job(Endpoint.CHAT), lines, pool=pool)
        assert normalized_bytes(got) == normalized_bytes(expected)
        assert [process.exitcode for process in pool._processes] == [0, 0]
    finally:
        atexit.unregister(_ExitCallback("issue 37"))


@pytest.mark.parametrize("how", ["killed", "failed", "cut"])
def test_a_worker_lost_mid_run_ends_the_run(qwen3_stack: Stack, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """A worker killed mid-run (its answer pipe at end of file, or cut in
    the middle of a message), or one whose loop hits a bug (it sends its
    traceback), ends the run with `WorkerLost` naming it, while the answers
    before it came out in order."""
    from derender_core import workers

    if how == "cut":
        sent = workers._sent
        messages = [0]

        def cut(outbox: Any, message: bytes) -> bool:
            messages[0] += 1
            if messages[0] < 3:
                return sent(outbox, message)
            # Dies in the middle of writing its third batch of answers.
            os.write(outbox.fileno(), len(message).to_bytes(4, "big") + message[:100])
            os._exit(9)

        monkeypatch.setattr(workers, "_sent", cut)  # the workers are forked with it
    if how == "failed":

        def broken(processor: Any, record: Any, whole_stream_answers: bool) -> Any:
            if record.number > 200:
                raise RuntimeError("a bug in the worker's loop")
            return answered(processor, record, whole_stream_answers)

        answered = workers.answered
        monkeypatch.setattr(workers, "answered", broken)  # the workers are forked with it
    lines = [orjson.dumps(body) for body in chat_bodies(qwen3_stack.builder)] * 1000
    with WorkerPool(qwen3_stack.engine, 2) as pool:
        outcomes = pool.answering(Job(Endpoint.CHAT))(iter_records(io.BytesIO(b"\n".join(lines) + b"\n")))
        numbers: list[int] = []
        # A failed worker's traceback may come in before any answer is
        # taken: the parent takes whatever a worker sends while it waits.
        with pytest.raises(workers.WorkerLost) as lost:
            for record, _ in outcomes:
                numbers.append(record.number)
                if how == "killed" and len(numbers) == 1:
                    os.kill(pool._processes[1].pid, signal.SIGKILL)
    assert numbers == list(range(1, len(numbers) + 1))
    assert numbers or how == "failed"
    if how == "killed":
        assert f"worker process {pool._processes[1].pid} exited with status -9" in str(lost.value)
    elif how == "cut":
        assert "exited with status 9" in str(lost.value)
    else:
        assert "a bug in the worker's loop" in str(lost.value) and len(numbers) <= 200


# --- resume -----------------------------------------------------------------


def stop_after(count: int, request: StopRequest) -> Any:
    def on_progress(report: Report) -> None:
        if report.records >= count:
            request.signal = signal.SIGTERM

    return on_progress


def run_to(path: Path, engine: DerenderEngine, job: Job, lines: list[bytes], pool: WorkerPool | None, stop_at: int | None) -> Report:
    """One run into `path`, resuming what is there, stopped after `stop_at`
    records as a signal would stop it."""
    request = StopRequest()
    done = prepare_output(str(path))
    outcomes = pool.answering(job) if pool else None
    records: Any = until_stopped(iter_records(io.BytesIO(b"\n".join(lines) + b"\n")), request)
    if done:
        records = skip_answered(records, done, answers_in(str(path)) if job.stream else None)
    progress = stop_after(stop_at, request) if stop_at is not None else None
    if path.suffix == ".parquet":
        writer: Any = ParquetWriter(str(path), resume=done > 0)
        return run(engine, records, job, writer, progress, outcomes=outcomes)
    with open_output(str(path), append=done > 0) as target:
        return run(engine, records, job, JsonlWriter(target), progress, outcomes=outcomes)


def output_lines(path: Path) -> list[bytes]:
    if path.suffix == ".parquet":
        return [a.raw for a in answers_in(str(path))]
    with open_input(str(path)) as source:
        return source.read().splitlines()


@pytest.mark.parametrize(
    ("suffix", "stream", "workers"),
    [(".jsonl.gz", False, True), (".parquet", False, False), (".jsonl.zst", True, True), (".jsonl", True, False)],
)
def test_resume_after_a_stop_at_random_points(
    qwen3_stack: Stack, tmp_path: Path, suffix: str, stream: bool, workers: bool
) -> None:
    """Stopped after a random number of records, then resumed (twice): the
    output is the uninterrupted run's, no record redone, lost or doubled."""
    stack = qwen3_stack
    engine = stack.engine.in_mode(live=True)
    endpoint = Endpoint.CHAT
    lines = stream_lines(stack, endpoint) if stream else one_shot_lines(stack, endpoint)
    job = Job(endpoint, stream=stream)
    expected, _ = derendered(engine, job, lines)
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    total = expected.count(b"\n")
    first, second = sorted(rng.sample(range(1, total - 1), 2))
    path = tmp_path / f"out{suffix}"
    # A window smaller than the input, so that the stop bites before every
    # record has been read ahead (what is in flight is still finished).
    pool_cm = WorkerPool(engine, 2, records_in_flight=4) if workers else None
    try:
        reports = [
            run_to(path, engine, job, lines, pool_cm, first),
            run_to(path, engine, job, lines, pool_cm, second),
            run_to(path, engine, job, lines, pool_cm, None),
        ]
    finally:
        if pool_cm is not None:
            pool_cm.close()
    got = output_lines(path)
    assert normalized_bytes(b"\n".join(got) + b"\n") == normalized_bytes(expected), f"seed {seed}"
    assert sum(r.records for r in reports) == total, f"seed {seed}: a record was redone or skipped"
    assert reports[0].records >= first and reports[1].records >= 1


def test_resume_cuts_a_torn_last_line_and_a_truncated_gzip(tmp_path: Path) -> None:
    plain = tmp_path / "out.jsonl"
    plain.write_bytes(b'{"a":1}\n{"b":2}\n{"c":')
    assert prepare_output(str(plain)) == 2
    assert plain.read_bytes() == b'{"a":1}\n{"b":2}\n'
    packed = tmp_path / "out.jsonl.gz"
    whole = gzip.compress(b"".join(b'{"n":%d}\n' % i for i in range(20000)))
    packed.write_bytes(whole[: len(whole) // 2])
    kept = prepare_output(str(packed))
    assert 0 < kept < 20000
    assert gzip.decompress(packed.read_bytes()).splitlines() == [b'{"n":%d}' % i for i in range(kept)]


def test_resume_refuses_an_output_longer_than_the_input(qwen3_stack: Stack) -> None:
    from derender_core import InputError

    records = iter_records(io.BytesIO(b'{"a": 1}\n{"b": 2}\n'))
    with pytest.raises(InputError, match="not a partial output of this input"):
        list(skip_answered(records, 3))


# --- zstd and Parquet ---------------------------------------------------------


def test_zstd_input_and_output_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl.zst"
    with open_output(str(path)) as target:
        target.write(b'{"a": 1}\n')
    with open_output(str(path), append=True) as target:
        target.write(b'{"b": 2}\n')
    assert path.read_bytes()[:4] == b"\x28\xb5\x2f\xfd"
    with open_input(str(path)) as source:  # by content, as gzip
        assert [r.payload for r in iter_records(source)] == [{"a": 1}, {"b": 2}]
    disguised = tmp_path / "data.jsonl"
    disguised.write_bytes(zstandard.ZstdCompressor().compress(b'{"c": 3}\n'))
    with open_input(str(disguised)) as source:
        assert [r.payload for r in iter_records(source)] == [{"c": 3}]


def test_parquet_body_column_and_parquet_output(qwen3_stack: Stack, tmp_path: Path) -> None:
    """A body per row answers as the same JSONL line does; the output rows
    hold the record number, the status and the exact bytes."""
    stack = qwen3_stack
    lines = one_shot_lines(stack, Endpoint.CHAT)
    job = Job(Endpoint.CHAT)
    expected, report = derendered(stack.engine, job, [line for line in lines if line])
    source = tmp_path / "in.parquet"
    pq.write_table(pa.table({"body": [line.decode() for line in lines if line]}), source, row_group_size=7)
    out = tmp_path / "out.parquet"
    with open_records(str(source), job) as opened:
        got = run(stack.engine, opened.records, job, ParquetWriter(str(out)))
    table = pq.read_table(out)
    assert table.schema.names == ["record", "status", "response"]
    assert table.column("record").to_pylist() == list(range(1, report.records + 1))
    assert normalized_bytes("\n".join(table.column("response").to_pylist()).encode() + b"\n") == normalized_bytes(expected)
    assert [s != 200 for s in table.column("status").to_pylist()].count(True) == got.errors == report.errors
    assert not (tmp_path / "out.parquet.partial").exists()


def columnar_rows(bodies: list[dict[str, Any]], endpoint: Endpoint) -> list[dict[str, Any]]:
    rows = []
    for body in bodies:
        response = body["generate_response"] if endpoint is Endpoint.CHAT else body["generate_responses"][0]
        choice = response["choices"][0]
        prompt = body["prompt_token_ids"] if endpoint is Endpoint.CHAT else body["prompt_token_ids"][0]
        rows.append(
            {
                "request_id": response["request_id"],
                "prompt_token_ids": prompt,
                "token_ids": choice["token_ids"],
                "request": json.dumps(body[endpoint.request_key]),
                "finish_reason": choice["finish_reason"],
                "stop_reason": choice.get("stop_reason"),
                "model": body["model"],
            }
        )
    return rows


@pytest.mark.parametrize("endpoint", [Endpoint.CHAT, Endpoint.COMPLETION])
def test_parquet_columnar_rows_answer_as_their_bodies(stack: Stack, tmp_path: Path, endpoint: Endpoint) -> None:
    """Rows of token_ids, prompt_token_ids (list<int32>) and the request as
    JSON answer exactly as the derender bodies they stand for."""
    b = stack.builder
    all_bodies = list(chat_bodies(b)) if endpoint is Endpoint.CHAT else list(completion_bodies(b))
    # One choice and one prompt per row: the columnar form's shape.
    bodies = [
        body for body in all_bodies
        if len((body.get("generate_response") or body.get("generate_responses", [{}])[0])["choices"]) == 1
        and len(body.get("generate_responses", [None])) == 1
    ]  # fmt: skip
    for body in bodies:  # what the join adds: prompt_tokens from the prompt
        prompt = body["prompt_token_ids"]
        body["prompt_tokens"] = len(prompt) if endpoint is Endpoint.CHAT else [len(prompt[0])]
        choice = (body.get("generate_response") or body["generate_responses"][0])["choices"][0]
        choice.setdefault("stop_reason", None)
        choice.pop("logprobs", None)  # the columnar form has no logprobs column
    job = Job(endpoint)
    expected, _ = derendered(stack.engine, job, [orjson.dumps(body) for body in bodies])
    schema = pa.schema(
        [
            ("request_id", pa.string()),
            ("prompt_token_ids", pa.list_(pa.int32())),
            ("token_ids", pa.list_(pa.int32())),
            ("request", pa.string()),
            ("finish_reason", pa.string()),
            ("stop_reason", pa.string()),
            ("model", pa.string()),
        ]
    )
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(columnar_rows(bodies, endpoint), schema=schema), path)
    out = io.BytesIO()
    with open_records(str(path), job) as opened:
        run(stack.engine, opened.records, job, JsonlWriter(out))
    assert normalized_bytes(out.getvalue()) == normalized_bytes(expected)


def test_output_names_follow_their_inputs() -> None:
    assert output_name("shards/part-00000.jsonl.zst", None) == "part-00000.jsonl.zst"
    assert output_name("a/part-1.jsonl.gz", "jsonl") == "part-1.jsonl.gz"
    assert output_name("capture.sse", "jsonl") == "capture.jsonl"
    assert output_name("capture.sse.gz", "sse") == "capture.sse.gz"
    assert output_name("part-0.parquet", None) == "part-0.parquet"
    assert output_name("calls.jsonl", "assembled") == "calls.jsonl"


# --- progress -------------------------------------------------------------------


def test_progress_bar_shows_records_tokens_errors_and_eta(tmp_path: Path) -> None:
    from derender_cli.progress import ProgressDisplay

    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"a": 1}\n' * 1000)
    stream = io.StringIO()
    console = Console(file=stream, force_terminal=True, width=200)
    with open_records(str(path), Job(Endpoint.CHAT)) as source, ProgressDisplay(console) as progress:
        progress.start_input(str(path), source, 0)
        next(source.records)
        assert source.size == path.stat().st_size and 0 < (source.bytes_read() or 0) <= source.size
        progress.update(Report(records=12, errors=3, elapsed=2.0, tokens=1000))
        progress._progress.refresh()  # type: ignore[union-attr]
    shown = stream.getvalue()
    assert "12 records" in shown and "500 tokens/s" in shown and "3 errors" in shown
    assert "in.jsonl" in shown and "ETA" in shown


def test_quiet_progress_shows_nothing_off_a_terminal() -> None:
    from derender_cli.progress import ProgressDisplay

    stream = io.StringIO()
    with ProgressDisplay(Console(file=stream, force_terminal=False)) as progress:
        progress.loading("m")
        progress.update(Report(records=1))
    assert stream.getvalue() == ""


# --- real runs, killed at random points ---------------------------------------


def derender_process(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [str(Path(sys.executable).with_name("derender")), *args, "--config", "sample_data/qwen3.yaml"],
        cwd=REPO, env=offline_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip


def kill_while_writing(
    process: subprocess.Popen[bytes], output: Path, signum: int, rng: random.Random, *, group: bool = False
) -> tuple[int, bytes]:
    """Wait until answers reach `output`, then send `signum` a random
    moment later, to the process or (`group`) to its whole process group,
    its workers with it; the exit status and stderr."""
    deadline = time.monotonic() + 600
    while (not output.exists() or output.stat().st_size == 0) and process.poll() is None:
        assert time.monotonic() < deadline, "no output in 10 minutes"
        time.sleep(0.05)
    time.sleep(rng.uniform(0, 1.5))
    if group:
        os.killpg(process.pid, signum)
    else:
        process.send_signal(signum)
    try:
        _, stderr = process.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise AssertionError(f"the run hung after {signal.Signals(signum).name}") from None
    return process.returncode, stderr


_UNINTERRUPTED: dict[str, bytes] = {}
"""Per command, what an uninterrupted run of the kill test's input writes:
the same lines for every case of that command, derendered once."""


def _uninterrupted(stack: Stack, command: str, job: Job, lines: list[bytes]) -> bytes:
    if command not in _UNINTERRUPTED:
        _UNINTERRUPTED[command], _ = derendered(stack.engine.in_mode(live=True), job, lines)
    return _UNINTERRUPTED[command]


@pytest.mark.parametrize(
    ("command", "signum", "group", "first_workers", "then_workers"),
    [
        ("chat", signal.SIGTERM, False, "2", "2"),
        ("chat", signal.SIGINT, False, "1", "2"),
        ("stream", signal.SIGKILL, False, "2", "1"),
        # ``timeout``, a container's stop, Ctrl-C: the whole group, workers too.
        ("chat", signal.SIGTERM, True, "2", "1"),
        ("stream", signal.SIGINT, True, "2", "2"),
    ],
)
def test_cli_killed_at_a_random_point_then_resumed(
    qwen3_stack: Stack,
    tmp_path: Path,
    command: str,
    signum: int,
    group: bool,
    first_workers: str,
    then_workers: str,
) -> None:
    """A real run killed mid-way leaves complete lines only (and, for a
    signal it can handle, says where it stopped, its workers answering
    what is in flight whether or not the signal reached them too);
    --resume then finishes the output exactly as an uninterrupted run
    writes it."""
    stack = qwen3_stack
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    if command == "chat":
        # Enough records that the run outlasts the kill's random moment (up
        # to 1.5 s after the first answer): 9,600 took 1.3 s with -j 2.
        lines = [orjson.dumps(b) for b in chat_bodies(stack.builder)] * 8000
        job = Job(Endpoint.CHAT)
    else:
        lines = []
        # The sample's interleaved streams, under new request ids; 300 copies
        # for the same reason (CI's machine took 0.23 s for 30 copies, so the
        # signal mostly came after the run).
        for copy in range(300):
            for body in stream_bodies(stack.builder):
                chunk = {**body["generate_chunk"], "request_id": f"{body['generate_chunk']['request_id']}-{copy}"}
                lines.append(orjson.dumps({**body, "generate_chunk": chunk}))
        job = Job(Endpoint.CHAT, stream=True)
    source = tmp_path / "in.jsonl"
    source.write_bytes(b"\n".join(lines) + b"\n")
    output = tmp_path / "out.jsonl"
    expected = _uninterrupted(stack, command, job, lines)

    process = derender_process(command, str(source), "-o", str(output), "-j", first_workers)
    status, stderr = kill_while_writing(process, output, signum, rng, group=group)
    written = output.read_bytes()
    kept = written[: written.rfind(b"\n") + 1]
    finished = status == 0 or (status == -signum and signum != signal.SIGKILL)
    if finished and b"stopped by" not in stderr:
        # The run was done before the signal came: it exited, or the signal
        # came in the interpreter's last moments, when every handler is the
        # default again, as for any program. Either way the output is whole.
        assert normalized_bytes(written) == normalized_bytes(expected), f"seed {seed}"
    elif signum != signal.SIGKILL:
        assert status == 128 + signum, stderr.decode()[-2000:]
        assert b"could not finish" not in stderr, stderr.decode()[-2000:]
        assert kept == written, "a handled signal leaves whole lines only"
        stopped = re.search(rb"stopped by SIG\w+ after record (\d+)", stderr)
        assert stopped and int(stopped.group(1)) == kept.count(b"\n"), stderr.decode()[-2000:]
    assert normalized_bytes(kept) == normalized_bytes(expected[: len(kept)]), f"seed {seed}"

    done = subprocess.run(
        [str(Path(sys.executable).with_name("derender")), command, str(source), "-o", str(output),
         "--resume", "-j", then_workers, "--config", "sample_data/qwen3.yaml"],
        cwd=REPO, env=offline_env(), capture_output=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert normalized_bytes(output.read_bytes()) == normalized_bytes(expected), f"seed {seed}"
    if kept:
        assert b"resumed: %d records" % kept.count(b"\n") in done.stderr


def test_cli_shards_gz_zst_and_parquet_into_a_directory(qwen3_stack: Stack, tmp_path: Path) -> None:
    """Three shards in one run (one start-up, two workers): each output is
    named after its input, compressed as it was, and holds what a run of
    that input alone gives."""
    stack = qwen3_stack
    lines = [orjson.dumps(b) for b in [*chat_bodies(stack.builder), *chat_error_bodies(stack.builder)]]
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "part-0.jsonl.gz").write_bytes(gzip.compress(b"\n".join(lines[:5]) + b"\n"))
    (shards / "part-1.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(b"\n".join(lines[5:]) + b"\n"))
    pq.write_table(pa.table({"body": [line.decode() for line in lines]}), shards / "part-2.parquet")
    out = tmp_path / "out"
    done = subprocess.run(
        [str(Path(sys.executable).with_name("derender")), "chat", *sorted(str(p) for p in shards.iterdir()),
         "-o", f"{out}/", "-j", "2", "--config", "sample_data/qwen3.yaml"],
        cwd=REPO, env=offline_env(), capture_output=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr.decode()[-2000:]  # the error bodies
    names = sorted(p.name for p in out.iterdir())
    shard_outputs = ["part-0.jsonl.gz", "part-1.jsonl.zst", "part-2.parquet"]
    assert names == sorted([*shard_outputs, *(f".{name}.derender.json" for name in shard_outputs)])  # and their manifests
    job = Job(Endpoint.CHAT)
    assert normalized_bytes(gzip.decompress((out / "part-0.jsonl.gz").read_bytes())) == normalized_bytes(derendered(stack.engine, job, lines[:5])[0])
    with open_input(str(out / "part-1.jsonl.zst")) as answers:
        assert normalized_bytes(answers.read()) == normalized_bytes(derendered(stack.engine, job, lines[5:])[0])
    parquet = b"".join(r.encode() + b"\n" for r in pq.read_table(out / "part-2.parquet").column("response").to_pylist())
    assert normalized_bytes(parquet) == normalized_bytes(derendered(stack.engine, job, lines)[0])
    summary = done.stderr.decode()
    assert f"{2 * len(lines)} records from 3 inputs" in summary and summary.count("start-up: model") == 1
