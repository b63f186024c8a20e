"""Ray Data: derender a dataset on a Ray cluster, one engine per actor.

`Derender` is a callable class for ``Dataset.map_batches`` (and, for
streams, ``map_groups``): each actor builds one engine, then answers
batches of rows with a `RecordProcessor`, exactly as a local run does::

    import ray
    from ray.data import ActorPoolStrategy
    from derender_core import RenderConfig
    from derender_core.ray_data import Derender, ModelBundle

    config = RenderConfig.from_yaml("sample_data/qwen3.yaml")
    answers = ray.data.read_parquet("s3://bucket/generations/").map_batches(
        Derender,
        fn_constructor_kwargs={"config": config, "endpoint": "chat",
                               "model": ModelBundle.of(config)},
        batch_format="pyarrow",
        compute=ActorPoolStrategy(size=4),
        num_cpus=1,
    )

Input rows are either text lines of bodies (a ``text`` or ``body``
column, string or binary, parsed with the CLI's own line parser) or the
columnar form (``token_ids`` and ``prompt_token_ids`` as ``list<int32>``,
``request`` as a JSON string; see `datasets`). A ``key`` (or
``request_id``) column is passed through. Output rows: ``key``,
``status`` (the HTTP status) and ``response`` (the exact body bytes as a
string), one per input row, in order; a bad record gets its error record
and never fails its block. Beside them, what the CLI's summary reads:
``tokens``, ``detail`` (a failure in one line), ``traceback`` (a bug's),
``logs`` (vLLM's log lines as JSON) and, for streams, ``facts`` and
``completed``.

Pitfalls found with Ray 2.60, handled by `run_on_ray` (the CLI's
``--ray``): actors that take every CPU starve the read and write tasks and
the job hangs, so actors get fractional CPUs; Ray nices its workers (the
local cluster is started with ``RAY_worker_niceness=0``); blocks come back
out of order unless ``preserve_order`` is set; Arrow's JSON reader adds the
keys of other lines (``max_tokens: null``...), which changes what vLLM sees,
so bodies are read as text lines, never with ``read_json``; a small file is
one block, so one actor (text inputs are cut into blocks of
``LINES_PER_BLOCK``); ``concurrency=`` is deprecated (``compute=
ActorPoolStrategy(size=n)``). Each actor peaks at about 1.7 GB.

The model directory must be at the same path on every node, or shipped:
`ModelBundle` packs it (weights left out: derendering reads only the
tokenizer and configs) and each node unpacks it once into its temporary
directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import hashlib
import io
import json
import logging
import os
import re
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager as ContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from .batch import Job, Outcome, RecordProcessor, Report, RunIncomplete, run, stream_key
from .collector import records_pace
from .config import RenderConfig
from .datasets import is_parquet, records_from_table
from .errors import ConfigError, InputError
from .logs import LogLine
from .protocol import Endpoint
from .records import GZIP_MAGIC, ZSTD_MAGIC, Record, ZstdReader, numbered_lines
from .streams import ChunkFacts
from .workers import answered, decode_outcome
from .writers import ErrorLog, Writer

if TYPE_CHECKING:
    import pyarrow as pa

LINES_PER_BLOCK = 256
"""Records per block read from a text input: the unit an actor takes."""
LIGHT_TASK_CPUS = 0.25
"""CPUs a read or keying task asks for: light work, and a whole CPU may be
left on no node once the actors hold their fractions."""
INSTALL_HINT = "pip install 'derender[ray]'"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack", ".onnx")


def import_ray() -> Any:
    """Ray, or a usage error that says how to install it."""
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise ConfigError(f"--ray needs Ray Data, which is not installed: {INSTALL_HINT}") from None
    return ray


@dataclasses.dataclass(frozen=True)
class ModelBundle:
    """The model (and tokenizer) directories, packed to travel with a job
    to nodes that do not have them at the same path."""

    digest: str
    archive: bytes
    roles: tuple[str, ...]
    """Which settings the archive's top-level folders replace, in order."""

    @classmethod
    def of(cls, config: RenderConfig) -> ModelBundle:
        """Pack `config`'s model and tokenizer directories, weights left out."""
        config.check_paths()
        dirs = config.local_dirs()  # a Hub id: its snapshot in the local cache
        roles = tuple(dirs)
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as archive:
            for index, role in enumerate(roles):
                directory = dirs[role]
                for path in sorted(directory.rglob("*")):
                    if path.is_file() and not path.name.endswith(_WEIGHT_SUFFIXES):
                        info = archive.gettarinfo(str(path), arcname=f"{index}/{path.relative_to(directory)}")
                        info.mtime = 0  # the same directory packs to the same bytes
                        with path.open("rb") as content:
                            archive.addfile(info, content)
        data = buffer.getvalue()
        return cls(hashlib.sha256(data).hexdigest()[:16], data, roles)

    def unpacked(self, config: RenderConfig) -> RenderConfig:
        """`config` pointing at this node's copy, unpacked once per node."""
        target = Path(tempfile.gettempdir()) / "derender-models" / self.digest
        if not target.is_dir():
            staging = Path(tempfile.mkdtemp(prefix=f".{self.digest}-", dir=target.parent if target.parent.is_dir() else _made(target.parent)))
            with tarfile.open(fileobj=io.BytesIO(self.archive)) as archive:
                archive.extractall(staging, filter="data")
            try:
                os.rename(staging, target)  # atomic: another actor may win the race
            except OSError:
                pass
        # The model is served under the name it was given, a Hub id included,
        # as `vllm serve --model ID` serves it; the copy has no revisions.
        names = config.served_model_name or ((config.model,) if config.model else ())
        return dataclasses.replace(
            config,
            served_model_name=names,
            revision=None,
            tokenizer_revision=None,
            **{role: str(target / str(index)) for index, role in enumerate(self.roles)},
        )


def _made(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    return directory


class Derender:
    """A ``map_batches`` callable class: one engine per actor, a batch of
    rows in, a batch of answers out (``key``, ``status``, ``response``).

    For a stream job (``stream=True``) each batch must be the calls of whole
    streams in input order, as ``groupby(...).map_groups`` gives them after
    sorting by ``key``; a batch starts with a fresh stream ledger. Its rows
    also get ``tokens``, ``facts`` (JSON) and ``completed``, which the CLI
    uses to write SSE and assembled output. `whole_stream_answers` False
    returns a successful streamed call's chunk only, not its state.
    """

    def __init__(
        self,
        config: RenderConfig,
        endpoint: str | Endpoint = Endpoint.CHAT,
        *,
        stream: bool = False,
        live: bool = True,
        decode: str = "fast",
        replay: str = "fast",
        model: ModelBundle | None = None,
        whole_stream_answers: bool = True,
        lenient: bool = False,
        render_prompts: bool = False,
    ) -> None:
        from .vllm_seam.render import DerenderEngine

        if model is not None:
            config = model.unpacked(config)
        self.engine = DerenderEngine.build(config, live=live, decode=decode, replay=replay)
        self.job = Job(Endpoint(endpoint), stream=stream, lenient=lenient, render_prompts=render_prompts)
        self.whole_stream_answers = whole_stream_answers
        self._processor = RecordProcessor(self.engine, self.job)

    def __call__(self, batch: pa.Table) -> pa.Table:
        import pyarrow as pa

        names = batch.schema.names
        key_name = next((name for name in ("key", "request_id") if name in names), None)
        keys = batch.column(key_name).to_pylist() if key_name else [None] * batch.num_rows
        if self.job.stream:
            # One group of whole streams: in input order, on a fresh ledger.
            if key_name is not None:
                batch = batch.sort_by(key_name)
                keys = batch.column(key_name).to_pylist()
            self._processor = RecordProcessor(self.engine, self.job)
        processor = self._processor
        columns: dict[str, list[Any]] = {
            "status": [], "response": [], "tokens": [], "facts": [], "completed": [], "detail": [], "traceback": [], "logs": [],
        }  # fmt: skip
        with records_pace():
            self._answer_rows(processor, batch, columns)
        table = {"key": keys, **columns}
        if not self.job.stream:
            del table["facts"], table["completed"]
        return pa.table(table)

    def _answer_rows(self, processor: RecordProcessor, batch: pa.Table, columns: dict[str, list[Any]]) -> None:
        """Each row of `batch` answered, its fields appended to `columns`."""
        for record in records_from_table(batch, self.job, first_number=1, origin="batch"):
            status, raw, chunk_raw, facts, completed, tokens, detail, trace, logs = answered(
                processor, record, self.whole_stream_answers
            )
            columns["status"].append(status)
            columns["response"].append((raw if raw is not None else chunk_raw or b"").decode("utf-8"))
            columns["tokens"].append(tokens)
            columns["facts"].append(None if facts is None else json.dumps(facts._asdict()))
            columns["completed"].append(completed)
            # What the summary shows: a failure's detail, a bug's traceback
            # and vLLM's log lines, counted per kind.
            columns["detail"].append(detail)
            columns["traceback"].append(trace)
            columns["logs"].append(json.dumps([dataclasses.asdict(line) for line in logs]) if logs else None)


def _outcome_of(row: dict[str, Any], stream: bool, whole_stream_answers: bool) -> Outcome:
    """A row of `Derender`'s output as the outcome it came from."""
    facts = ChunkFacts(**json.loads(row["facts"])) if stream and row.get("facts") else None
    body = row["response"].encode("utf-8")
    chunk_only = stream and not whole_stream_answers and row["status"] == 200 and facts is not None
    logs = tuple(
        LogLine(tuple(line.pop("key")), **line)  # type: ignore[arg-type]
        for line in json.loads(row.get("logs") or "[]")
    )
    return decode_outcome(
        (row["status"], None if chunk_only else body, body if chunk_only else None,
         facts, bool(row.get("completed")), row.get("tokens") or 0, row.get("detail"), row.get("traceback"), logs)
    )  # fmt: skip


def _lines_datasource(paths: list[str]) -> Any:
    """Text inputs as rows (``record``, ``key`` = line number, ``text`` as
    binary), compression detected by content as `records.open_input` does,
    records numbered as `records.iter_records` numbers them."""
    from ray.data.datasource import FileBasedDatasource

    class _Lines(FileBasedDatasource):  # type: ignore[misc]
        def resolve_compression(self, path: str, open_args: dict[str, Any]) -> None:
            return None  # by content, below

        def _read_stream(self, f: Any, path: str) -> Iterator[Any]:
            import pyarrow as pa

            stream: Any = io.BufferedReader(_NativeFile(f))
            magic = stream.peek(4)[:4]
            if magic[:2] == GZIP_MAGIC:
                stream = gzip.GzipFile(fileobj=stream)
            elif magic == ZSTD_MAGIC:
                stream = io.BufferedReader(ZstdReader(stream))  # a cut frame fails, as gzip does
            columns: dict[str, list[Any]] = {"record": [], "key": [], "text": []}
            for number, line_number, line, _ in numbered_lines(stream):
                columns["record"].append(number)
                columns["key"].append(line_number)
                columns["text"].append(line)
                if len(columns["text"]) >= LINES_PER_BLOCK:
                    yield pa.table(columns, schema=_LINES_SCHEMA())
                    columns = {"record": [], "key": [], "text": []}
            if columns["text"]:
                yield pa.table(columns, schema=_LINES_SCHEMA())

    return _Lines(paths)


def _LINES_SCHEMA() -> Any:  # noqa: N802 - a constant built on demand (pyarrow imported late)
    import pyarrow as pa

    return pa.schema([("record", pa.int64()), ("key", pa.int64()), ("text", pa.binary())])


class _NativeFile(io.RawIOBase):
    """A pyarrow input stream as a Python raw file."""

    def __init__(self, native: Any) -> None:
        self._native = native

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self._native.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


def _with_stream_key(job: Job) -> Any:
    """A batch function adding ``stream``: the key its calls group by."""

    def add(batch: pa.Table) -> pa.Table:
        import pyarrow as pa

        keys = [
            orjson.dumps(stream_key(record, job)).decode()
            for record in records_from_table(batch, job, first_number=1, origin="batch")
        ]
        return batch.append_column("stream", pa.array(keys, pa.string()))

    return add


@contextlib.contextmanager
def ray_cluster(address: str | None) -> Iterator[tuple[Any, float]]:
    """Join `address`, or start a local cluster with the usable CPUs; yields
    Ray and the seconds it took."""
    ray = import_ray()
    from .workers import usable_cpus

    started = time.perf_counter()
    if not ray.is_initialized():
        if address is None:
            os.environ.setdefault("RAY_worker_niceness", "0")
        logging.getLogger("ray.data").setLevel(logging.WARNING)
        ray.init(
            # "local" starts a cluster of our own, never one left running here.
            address=address or "local",
            num_cpus=None if address else usable_cpus(),
            include_dashboard=False,
            log_to_driver=False,
            logging_level="ERROR",
            configure_logging=True,
        )
        owned = True
    else:
        owned = False
    try:
        yield ray, time.perf_counter() - started
    finally:
        if owned:
            ray.shutdown()


_ACTOR_ARGUMENTS_LINE = re.compile(
    rb"core_worker\.cc:\d+: Actor with class name: .* has constructor arguments in the object store and max_restarts > 0"
)
"""What Ray's C++ core logs on the driver's stderr as each Ray Data actor
is created: Ray Data hands every actor its function and context as
object-store references and asks for endless restarts (named parameters
for neither exist), and keeps those references for the job, so the risk
the line warns of (a restart without its arguments) does not arise."""


@contextlib.contextmanager
def _stderr_without(unwanted: re.Pattern[bytes]) -> Iterator[None]:
    """The process's stderr (file descriptor 2, which Ray's C++ core writes
    to, out of Python logging's reach) less the lines matching `unwanted`.
    Everything else passes at once, in order; a partial line is held only
    while it may be the start of a C++ log line (``[`` first)."""
    try:
        sys.stderr.flush()
        original = os.dup(2)
        read_end, write_end = os.pipe()
    except (OSError, ValueError):
        yield
        return

    def forward() -> None:
        held = b""
        with os.fdopen(read_end, "rb", buffering=0) as pipe:
            while chunk := pipe.read(65536):
                lines = (held + chunk).split(b"\n")
                held = lines.pop()
                passed = b"".join(line + b"\n" for line in lines if not unwanted.search(line))
                if held and not held.startswith(b"["):
                    passed, held = passed + held, b""
                _write_all(original, passed)
        _write_all(original, held)

    os.dup2(write_end, 2)
    os.close(write_end)
    thread = threading.Thread(target=forward, name="derender-stderr", daemon=True)
    thread.start()
    try:
        yield
    finally:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        os.dup2(original, 2)  # the pipe's last write end: the thread reads to its end
        thread.join(timeout=10)
        if not thread.is_alive():  # else it may still write there: the descriptor stays
            os.close(original)


def _write_all(fd: int, data: bytes) -> None:
    with contextlib.suppress(OSError):
        while data:
            data = data[os.write(fd, data) :]


def run_on_ray(
    config: RenderConfig,
    job: Job,
    inputs: list[tuple[str, Callable[[], ContextManager[Writer]]]],
    *,
    address: str | None = None,
    actors: int | None = None,
    whole_stream_answers: bool = True,
    live: bool = True,
    decode: str = "fast",
    replay: str = "fast",
    fail_fast: bool = False,
    error_log: ErrorLog | None = None,
) -> tuple[list[tuple[str, Report]], float]:
    """The CLI's ``--ray``: each input derendered on the cluster and handed,
    in input order, to the writer its opener gives (the same writers as a
    local run).

    Returns:
        A report per input, and the seconds joining the cluster took.

    """
    bundle = ModelBundle.of(config)
    reports: list[tuple[str, Report]] = []
    with ray_cluster(address) as (ray, startup), _stderr_without(_ACTOR_ARGUMENTS_LINE):
        from ray.data import ActorPoolStrategy, DataContext

        context = DataContext.get_current()
        context.execution_options.preserve_order = True
        context.enable_progress_bars = False
        # Ray Data warns that the progress bars this sets off are off.
        logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)
        cpus = float(ray.cluster_resources().get("CPU", 1))
        size = actors or max(1, int(cpus))
        # Leave a CPU for the read and write tasks, or the job hangs.
        actor_cpus = max(0.1, min(1.0, (cpus - 1) / size)) if cpus > 1 else 0.5
        whole = whole_stream_answers
        constructor = {
            "config": config, "endpoint": job.endpoint, "stream": job.stream,
            "live": live, "decode": decode, "replay": replay, "model": bundle, "whole_stream_answers": whole, "lenient": job.lenient,
            "render_prompts": job.render_prompts,
        }  # fmt: skip
        for input_path, open_writer in inputs:
            if input_path == "-":
                raise InputError("--ray reads files the cluster can reach, not stdin")
            dataset = _read(ray, input_path, job)
            compute = ActorPoolStrategy(size=size)
            actor_args = {"compute": compute, "num_cpus": actor_cpus}
            if job.stream:
                answered = (
                    dataset.map_batches(_with_stream_key(job), batch_format="pyarrow", num_cpus=LIGHT_TASK_CPUS)
                    .groupby("stream")
                    .map_groups(Derender, fn_constructor_kwargs=constructor, batch_format="pyarrow", **actor_args)
                    .sort("key")
                )  # fmt: skip
            else:
                answered = dataset.map_batches(
                    Derender, fn_constructor_kwargs=constructor, batch_format="pyarrow", **actor_args
                )
            if error_log is not None:
                error_log.input_name = input_path
            report = _write(answered, job, open_writer, whole, input_path, fail_fast, error_log)
            reports.append((input_path, report))
            if report.stopped_at_failure or report.unfinished is not None:
                break
    return reports, startup


def _read(ray: Any, path: str, job: Job) -> Any:
    if is_parquet(path):
        if job.stream:
            raise InputError("stream --ray reads JSONL or SSE inputs")
        import pyarrow.parquet as pq

        # Blocks of about LINES_PER_BLOCK rows, so a small file still feeds
        # every actor (a repartition before an actor pool hangs on a
        # multi-node cluster in Ray 2.60).
        rows = pq.ParquetFile(path).metadata.num_rows
        return ray.data.read_parquet(
            os.path.abspath(path), override_num_blocks=max(1, rows // LINES_PER_BLOCK), num_cpus=LIGHT_TASK_CPUS
        )
    return ray.data.read_datasource(_lines_datasource([os.path.abspath(path)]), num_cpus=LIGHT_TASK_CPUS)


def _write(
    answered: Any,
    job: Job,
    open_writer: Callable[[], ContextManager[Writer]],
    whole: bool,
    input_path: str,
    fail_fast: bool = False,
    error_log: ErrorLog | None = None,
) -> Report:
    """Hand the answers to the writer here, in input order."""
    parquet_input = is_parquet(input_path)
    started = time.perf_counter()
    first_answer: list[float] = []

    def pairs(_: Any) -> Iterator[tuple[Record, Outcome]]:
        number = 0
        for batch in answered.iter_batches(batch_format="pyarrow", batch_size=None):
            if not first_answer:
                first_answer.append(time.perf_counter() - started)
            for row in batch.to_pylist():
                number += 1
                line = number if parquet_input or row.get("key") is None else int(row["key"])
                yield Record(number, line), _outcome_of(row, job.stream, whole)

    with open_writer() as writer:
        # The cluster reads the input and answers it; here the answers are
        # only written and counted.
        try:
            report = run(
                None, (), job, writer, outcomes=pairs, fail_fast=fail_fast, error_log=error_log  # type: ignore[arg-type]
            )
        except RunIncomplete as incomplete:
            report = incomplete.report
    # Until the first answer the actors were starting (building engines):
    # start-up, not processing.
    report.startup = first_answer[0] if first_answer else 0.0
    report.elapsed -= report.startup
    return report
