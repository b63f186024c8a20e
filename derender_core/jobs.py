"""A whole job: these inputs, to these outputs, answered this way, here, on
worker processes or on a Ray cluster.

`run_job` is what ``derender chat|completion|stream`` runs; `run_parity` is
``derender parity``. The command line only turns flags into a `JobSpec`,
shows progress through an `Observer` and maps the `Summary` to an exit
status, so a library user gets the same run, checks and outputs by calling
these directly.

Checks run cheapest first, before the model loads: a bad output plan,
an input that does not exist or a resume that does not match is a usage
error (`DerenderError`) with nothing processed.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import gc
import json
import multiprocessing.context
import os
import pickle
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from .batch import Job, OutcomeSource, Report, RunIncomplete, run
from .collector import records_pace
from .compare import (
    DEFAULT_NORMALIZATION,
    Classes,
    Divergence,
    Examination,
    Normalization,
    class_of,
    report_line,
)
from .config import RenderConfig
from .datasets import (
    Input,
    ParquetWriter,
    answers_in,
    check_input,
    is_parquet,
    open_records,
    output_name,
)
from .errors import ConfigError, InputError, StreamFailure
from .html_report import IDS_SHOWN, Shown
from .interrupt import StopRequest, stop_on_signals, until_stopped
from .logs import LogKind
from .minimize import DEFAULT_STEPS, Minimal, Minimizer, json_bytes
from .outputs import RunPaths
from .parity import (
    DERENDER_MODES,
    PATHS,
    SERVE_PATHS,
    Chunking,
    LogTally,
    Parity,
    Request,
    from_serve,
    requests_of,
)
from .protocol import WINDOW, Derenderer, Endpoint
from .records import (
    RequestIndex,
    open_output,
    standard_stream,
)
from .repro import prepare_repro, write_repro
from .responses import read_items
from .resume import (
    Manifest,
    ManifestKeeper,
    check_input_prefix,
    check_resume,
    keeps_manifest,
    logged_restored,
    manifest_path,
    prepare_output,
    run_manifest,
    skip_answered,
)
from .workers import WorkerLost, WorkerPool, check_workers, freeze_for_fork, usable_cpus
from .workers import _die_with_parent as die_with_parent
from .writers import AssembledWriter, ErrorLog, JsonlWriter, SseWriter, Writer

if TYPE_CHECKING:
    from .vllm_seam.render import DerenderEngine

STREAM_FORMATS = ("jsonl", "sse", "assembled")
"""How a stream's answers are written: one line per call, an SSE
transcript per request, or one response assembled per request."""
FLAVORS = ("derender", "serve")
"""Whose answer: the render server's derender endpoint, or what a client
of ``vllm serve`` reads for the same request and tokens."""

WarmEngines = Callable[[RenderConfig], "DerenderEngine | None"]
"""An engine already built for these settings (the warm server's), or None."""


@dataclass(frozen=True)
class JobSpec:
    """What a derender command line asks for, flag by flag."""

    inputs: Sequence[str]
    """JSONL, SSE captures or Parquet files; ``-`` is stdin."""
    output: str = "-"
    """A file, ``-`` for stdout, or ``DIR/`` for one output per input (or,
    one input with ``stream_format="sse"``, one ``.sse`` file per request)."""
    endpoint: Endpoint = Endpoint.CHAT
    stream_format: str | None = None
    """None: one-shot records. Otherwise a stream, written as one of
    `STREAM_FORMATS`."""
    live: bool = True
    """Streams: keep each stream's parser between calls (else vLLM's own
    per-call replay)."""
    flavor: str = "derender"
    decode: str = "fast"
    replay: str = "fast"
    """Streams with ``live=False``: "fast" goes on from this process's
    answer to a stream's previous call (vLLM's replay answers any other
    state); "reference" is vLLM's replay of the whole history on every call."""
    requests: str | None = None
    """JSONL of the original requests, to join bare generate output."""
    lenient: bool = False
    fail_fast: bool = False
    errors: str | None = None
    """A file that also gets each failed record, for triage."""
    verbose: bool = False
    workers: int | None = None
    """Worker processes; None: the usable CPUs (1 with the serve flavor)."""
    resume: bool = False
    ray: bool = False
    ray_address: str | None = None
    ray_actors: int | None = None
    render_prompts: bool = False
    """Derender records with a request and no prompt ids get them from
    vLLM's renderer first, as the render endpoint gives them (`prompts`)."""

    def __post_init__(self) -> None:
        if isinstance(self.inputs, str):
            object.__setattr__(self, "inputs", (self.inputs,))
        object.__setattr__(self, "endpoint", _checked_endpoint(self.endpoint))
        for name, flag in (("workers", "--workers"), ("ray_actors", "--ray-actors")):
            count = getattr(self, name)
            if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
                raise ConfigError(f"{flag} must be a whole number of at least 1, got {count!r}")
        if not self.inputs:
            raise InputError("no input: name at least one file, or - for stdin")
        if self.stream_format not in (None, *STREAM_FORMATS):
            raise ConfigError(f"unknown stream format {self.stream_format!r}: {', '.join(STREAM_FORMATS)}")
        if self.flavor not in FLAVORS:
            raise ConfigError(f"unknown flavor {self.flavor!r}: {', '.join(FLAVORS)}")
        if self.errors == "-":
            raise InputError("--errors needs a file path: stdout carries the output")
        if self.endpoint.renders and (self.stream_format is not None or self.requests is not None or self.render_prompts):
            raise InputError("a render job reads requests, one per record: no stream format, --requests or --render-prompts")

    @property
    def stream(self) -> bool:
        return self.stream_format is not None

    @property
    def line_per_record(self) -> bool:
        """One output line per input record (one-shot, or a stream's calls
        as JSONL): such outputs keep a manifest and can be resumed."""
        return self.stream_format in (None, "jsonl")

    def job(self, requests: RequestIndex | None = None) -> Job:
        """What each record goes through."""
        return Job(
            self.endpoint, stream=self.stream, requests=requests, lenient=self.lenient, verbose=self.verbose,
            render_prompts=self.render_prompts,
        )  # fmt: skip

    @property
    def renders(self) -> bool:
        """The job's engine answers render calls: it renders requests, or
        the prompts records lack."""
        return self.endpoint.renders or self.render_prompts


def _checked_endpoint(value: Endpoint | str) -> Endpoint:
    """The endpoint a spec names, given as a member or its value.

    Raises:
        ConfigError: naming the endpoints.

    """
    try:
        return Endpoint.of(value)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


class Target(NamedTuple):
    """One input and where its answers go."""

    input: str
    output: str
    directory: Path | None
    """Per-request ``.sse`` files go here (one input, SSE, ``-o DIR/``)."""


class Observer(Protocol):
    """Told what a run is doing, to show it; `Silent` ignores it all."""

    def loading(self, model: str) -> None: ...
    def start_input(self, path: str, source: Input, resumed: int) -> None: ...
    def update(self, report: Report) -> None: ...
    def stopping(self, signum: int) -> None: ...
    def notice(self, message: str) -> None: ...


class Silent:
    """The observer for library calls: nothing shown."""

    def loading(self, model: str) -> None:
        pass

    def start_input(self, path: str, source: Input, resumed: int) -> None:
        pass

    def update(self, report: Report) -> None:
        pass

    def stopping(self, signum: int) -> None:
        pass

    def notice(self, message: str) -> None:
        pass


@dataclass
class Summary:
    """Every input's report, and what start-up cost, apart from processing."""

    reports: list[tuple[str, Report]] = field(default_factory=list)
    startup: dict[str, float] = field(default_factory=dict)
    """Seconds per start-up step: the model, the workers, a Ray cluster."""
    outputs: dict[str, str] = field(default_factory=dict)
    """Where each input's answers went (``-`` for stdout)."""

    def add(self, input_path: str, report: Report, output: str) -> None:
        self.reports.append((input_path, report))
        self.outputs[input_path] = output

    @property
    def total(self) -> Report:
        total = Report()
        for _, report in self.reports:
            total.records += report.records
            total.errors += report.errors
            total.internal_errors += report.internal_errors
            total.elapsed += report.elapsed
            total.tokens += report.tokens
            total.resumed += report.resumed
            total.stopped_by = total.stopped_by or report.stopped_by
            total.unfinished = total.unfinished or report.unfinished
            total.stopped_at_failure = total.stopped_at_failure or report.stopped_at_failure
        return total

    @property
    def return_code(self) -> int:
        """The process exit status (`ExitStatus`) the run comes to."""
        return self.total.return_code

    @property
    def prompts_missing(self) -> int:
        """Records derendered without the prompt ids that could change their
        answers (`Report.prompts_missing`); ``render_prompts`` renders them."""
        return sum(report.prompts_missing for _, report in self.reports)


def run_job(
    config: RenderConfig,
    spec: JobSpec,
    observer: Observer | None = None,
    *,
    warm: WarmEngines | None = None,
) -> Summary:
    """Derender every input of `spec` into its output, on one engine (and
    one pool of workers) or on Ray. Raises `DerenderError` before anything
    is processed when the job cannot start; a run that starts ends in a
    `Summary` (whose `return_code` says how it went)."""
    observer = observer or Silent()
    plan = plan_outputs(spec.inputs, spec.output, spec.stream_format, spec.resume)
    manifested = [target.output for target in plan if target.directory is None and keeps_manifest(target.output)]
    paths = RunPaths(
        [*(("INPUT", path) for path in spec.inputs), ("--requests", spec.requests)],
        [*(("-o", target.output) for target in plan if target.directory is None), ("--errors", spec.errors),
         *((f"the manifest of {out}", manifest_path(out)) for out in manifested)],
        [("-o", str(target.directory)) for target in plan if target.directory is not None],
        read=config_files(config),
    )  # fmt: skip
    if "-" in spec.inputs:
        standard_stream("stdin")
    if any(target.output == "-" for target in plan):
        standard_stream("stdout")
    for path in spec.inputs:
        # exists, not isfile: a pipe (`<(zcat ...)`, /dev/stdin) is an input too.
        if path != "-" and not os.path.exists(path):
            raise InputError(f"cannot open input {path}: no such file")
        check_input(path)
    if not spec.ray and spec.workers is not None:
        check_workers(spec.workers)
    if spec.flavor == "serve":
        # The serve path drives a live AsyncLLM on its own event loop, which
        # neither a fork nor a Ray actor's pickling carries over.
        if spec.ray:
            raise InputError("--flavor serve runs on this machine: drop --ray")
        if spec.workers not in (None, 1):
            raise InputError("--flavor serve runs in one process: drop --workers or use --workers 1")
        spec = dataclasses.replace(spec, workers=1)
    if spec.ray:
        return _run_on_ray(config, spec, plan, paths)
    manifests = {
        target.output: _checked_manifest(config, spec, target)
        for target in plan
        if target.output in manifested and spec.line_per_record
    }
    # -o DIR/ names its outputs: say which it replaces (-o FILE names its own).
    replaced = [t.output for t in plan if t.output != spec.output and not spec.resume and os.path.exists(t.output)]
    if replaced:
        observer.notice(
            f"replacing {len(replaced)} output(s) in {spec.output} that an earlier run left "
            "(--resume continues them instead)"
        )
    return _run_here(config, spec, plan, observer, manifests, warm, paths)


def config_files(config: RenderConfig) -> list[tuple[str, str | None]]:
    """The local files and directories the settings read (the model and
    tokenizer directories, a chat template file, a generation config
    directory), as inputs no output may replace. A Hub id or an inline
    template names no local file and is passed over by `RunPaths`."""
    return [
        ("--model", config.model), ("--tokenizer", config.tokenizer), ("--chat-template", config.chat_template),
        ("--generation-config", config.generation_config),
    ]  # fmt: skip


def _say_fast_paths(observer: Observer) -> None:
    """Say once per run that the fast paths are off (a vLLM they were not
    proven on, or ``DERENDER_FAST_PATHS=off``): the answers are vLLM's own."""
    from .vllm_seam.versions import notice

    message = notice()
    if message is not None:
        observer.notice(message)


def build_engine(
    config: RenderConfig,
    *,
    flavor: str = "derender",
    live: bool = False,
    decode: str = "fast",
    replay: str = "fast",
    warm: WarmEngines | None = None,
) -> tuple[Derenderer, str]:
    """The engine for a run, and how the summary names its start-up: the
    warm server's, when it holds one for exactly these settings."""
    if flavor == "serve":
        from .vllm_seam import versions
        from .vllm_seam.serve import ServeEngine

        if not versions.proven("serve"):
            raise ConfigError(
                f"--flavor serve drives vllm serve's private handlers, proven on vLLM "
                f"{', '.join(versions.PROVEN['serve'])} only; vLLM {versions.installed()} is installed"
                + (f" ({versions.OFF_ENV}=off)" if versions.installed() in versions.PROVEN["serve"] else "")
            )

        return ServeEngine.build(config), "model"
    if warm is not None:
        started = time.perf_counter()
        engine = warm(config)
        if engine is not None:
            engine = engine.in_mode(live=live, decode=decode, replay=replay)
            engine.startup_seconds = time.perf_counter() - started
            return engine, "model (warm)"
    from .vllm_seam.render import DerenderEngine

    return DerenderEngine.build(config, live=live, decode=decode, replay=replay), "model"


def _checked_manifest(config: RenderConfig, spec: JobSpec, target: Target) -> tuple[Manifest, Manifest | None]:
    """The manifest this run writes for the target's output, and with
    resume the earlier run's, once it is known to describe this run
    (before the model loads: a mismatch is a usage error)."""
    now = run_manifest(
        config, target.input,
        command="stream" if spec.stream else spec.endpoint.value, endpoint=spec.endpoint.value,
        flavor=spec.flavor, lenient=spec.lenient, requests=spec.requests, render_prompts=spec.render_prompts,
    )  # fmt: skip
    earlier = check_resume(target.output, now) if spec.resume else None
    if earlier is not None:
        check_input_prefix(target.input, spec.job(), target.output, earlier)
    return now, earlier


def _run_here(
    config: RenderConfig,
    spec: JobSpec,
    plan: list[Target],
    observer: Observer,
    manifests: dict[str, tuple[Manifest, Manifest | None]],
    warm: WarmEngines | None,
    paths: RunPaths,
) -> Summary:
    """On this machine: one engine, forked into workers, for every input."""
    summary = Summary()
    with contextlib.ExitStack() as resources:
        requests = None
        if spec.requests is not None:
            requests = RequestIndex(spec.requests)
            resources.callback(requests.close)
        error_log = _error_log(spec, plan, resources)
        observer.loading(config.model or "")
        _say_fast_paths(observer)
        engine, startup_name = build_engine(
            config, flavor=spec.flavor, live=spec.live, decode=spec.decode, replay=spec.replay, warm=warm
        )  # fmt: skip
        resources.callback(engine.close)
        if spec.renders:
            # Built once here, before workers fork, rather than in each.
            started = time.perf_counter()
            engine.prepare_render()
            engine.startup_seconds += time.perf_counter() - started
        summary.startup[startup_name] = engine.startup_seconds
        job = spec.job(requests)
        workers = spec.workers or usable_cpus()
        outcomes = None
        if workers > 1:
            pool = resources.enter_context(WorkerPool(engine, workers, requests))
            summary.startup[f"{workers} workers"] = pool.startup_seconds
            outcomes = pool.answering(job, whole_stream_answers=spec.line_per_record)
        stop = resources.enter_context(stop_on_signals(observer.stopping))
        for target in plan:
            if error_log is not None:
                error_log.input_name = target.input
            report = _run_one(
                engine, job, spec, target, outcomes, stop, observer, error_log, manifests.get(target.output), paths
            )  # fmt: skip
            summary.add(target.input, report, target.output)
            if stop or report.unfinished is not None or report.stopped_at_failure:
                break
    return summary


def _error_log(spec: JobSpec, plan: list[Target], resources: contextlib.ExitStack) -> ErrorLog | None:
    if spec.errors is None:
        return None
    return ErrorLog(resources.enter_context(open_output(spec.errors)), plan[0].input)


def _run_on_ray(config: RenderConfig, spec: JobSpec, plan: list[Target], paths: RunPaths) -> Summary:
    """On a Ray cluster: the cluster reads and answers, this process writes."""
    from .ray_data import import_ray, run_on_ray

    import_ray()  # fails at start-up, with the install command, without Ray
    if spec.requests is not None:
        raise InputError("--requests is not supported with --ray: put derender bodies in the input")
    if spec.resume:
        raise InputError("--resume is not supported with --ray: start afresh, or resume locally")
    if "-" in spec.inputs:
        raise InputError("--ray reads files the cluster can reach, not stdin")
    # Assembled answers need a response builder, which every engine has.
    from .vllm_seam.render import DerenderEngine

    openers = [
        (target.input, functools.partial(open_writer, target, spec.stream_format, spec.endpoint, DerenderEngine, taken=paths.claimed))
        for target in plan
    ]
    with contextlib.ExitStack() as resources:
        reports, startup = run_on_ray(
            config, spec.job(), openers, address=spec.ray_address, actors=spec.ray_actors,
            whole_stream_answers=spec.line_per_record, live=spec.live, decode=spec.decode,
            replay=spec.replay, fail_fast=spec.fail_fast, error_log=_error_log(spec, plan, resources),
        )  # fmt: skip
    actors = sum(report.startup for _, report in reports)
    outputs = {target.input: target.output for target in plan}
    return Summary(reports=reports, startup={"ray": startup, "actors": actors}, outputs=outputs)


def _run_one(
    engine: Derenderer,
    job: Job,
    spec: JobSpec,
    target: Target,
    outcomes: OutcomeSource | None,
    stop: StopRequest,
    observer: Observer,
    error_log: ErrorLog | None,
    manifest: tuple[Manifest, Manifest | None] | None,
    paths: RunPaths,
) -> Report:
    """Derender one input into one output (and its manifest)."""
    done = prepare_output(target.output) if spec.resume else 0
    keeper = None if manifest is None else ManifestKeeper(target.output, *manifest, done=done)
    with contextlib.ExitStack() as resources:
        source = resources.enter_context(open_records(target.input, job, digests=keeper is not None))
        writer = resources.enter_context(
            open_writer(target, spec.stream_format, job.endpoint, engine, append=done > 0, taken=paths.claimed)
        )
        records: Any = until_stopped(source.records, stop)
        if keeper is not None:
            records = keeper.track(records)
        if done:
            # The skipped records' answers: a stream's states, and the
            # --errors lines of those that failed.
            answers = answers_in(target.output) if job.stream or error_log is not None else None
            records = skip_answered(records, done, answers)
            if error_log is not None:
                records = logged_restored(records, error_log)
        observer.start_input(target.input, source, done)

        def on_progress(report: Report) -> None:
            observer.update(report)
            if keeper is not None and keeper.due():
                keeper.update(writer.records_written)

        try:
            report = run(
                engine, records, job, writer,
                on_progress=on_progress, outcomes=outcomes, fail_fast=spec.fail_fast, error_log=error_log,
            )  # fmt: skip
        except RunIncomplete as incomplete:
            report = incomplete.report
    if keeper is not None:
        try:
            keeper.close(writer.records_written)
        except StreamFailure as failure:
            # The run's own file, as a failing output: the summary says how
            # far the run got.
            report.unfinished = report.unfinished or str(failure)
    report.stopped_by = stop.signal
    report.resumed = done
    return report


def plan_outputs(inputs: Sequence[str], output: str, stream_format: str | None, resume: bool) -> list[Target]:
    """Each input with its output path, and the directory for per-request
    SSE files (one input, SSE, ``-o DIR/``)."""
    try:
        is_directory = output != "-" and (output.endswith("/") or Path(output).is_dir())
    except OSError as exc:
        raise InputError(f"cannot use -o {output}: {exc.strerror or exc}") from None
    if resume and output == "-":
        raise InputError("--resume continues an output file: pass -o FILE or -o DIR/")
    if resume and stream_format not in (None, "jsonl"):
        raise InputError(
            "--resume continues JSONL or Parquet outputs, one record per line; "
            f"--format {stream_format} output is written per request"
        )
    if not is_directory:
        if len(inputs) > 1:
            raise InputError(f"{len(inputs)} inputs need an output directory (-o DIR/), one output per input")
        if is_parquet(output) and stream_format not in (None, "jsonl"):
            raise InputError("a .parquet output holds one row per record: use --format jsonl")
        return [Target(inputs[0], output, None)]
    if len(inputs) == 1 and stream_format == "sse":
        return [Target(inputs[0], output, Path(output))]
    if "-" in inputs:
        raise InputError("-o DIR/ names each output after its input, and stdin has no name")
    names = [output_name(path, stream_format) for path in inputs]
    if len(set(names)) < len(names):
        raise InputError("two inputs would write the same output name in " + output)
    return [Target(path, str(Path(output) / name), None) for path, name in zip(inputs, names, strict=True)]


@contextlib.contextmanager
def open_writer(
    target: Target,
    stream_format: str | None,
    endpoint: Endpoint,
    engine: Any,
    append: bool = False,
    taken: Callable[[Path], object] | None = None,
) -> Iterator[Writer]:
    """The writer for the output format, over the opened output. `engine`
    builds assembled responses (an engine, or its class). `taken` tells
    which paths of a directory of transcripts are the run's other files
    (`RunPaths.claimed`)."""
    if target.directory is not None:
        try:
            target.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InputError(f"cannot write to {target.directory}/: {exc.strerror or exc}") from None
        yield SseWriter(directory=target.directory, taken=taken)
        return
    if is_parquet(target.output):
        yield ParquetWriter(target.output, resume=append)
        return
    with open_output(target.output, append=append) as sink:
        if stream_format == "sse":
            yield SseWriter(target=sink)
        elif stream_format == "assembled":
            finish = engine.chat_response if endpoint is Endpoint.CHAT else engine.completion_response
            yield AssembledWriter(sink, endpoint, finish)
        else:
            yield JsonlWriter(sink)


# --- engines for code -------------------------------------------------------------

_ENGINES: dict[tuple[str, bool, str], tuple[int, DerenderEngine]] = {}
_ENGINES_LOCK = threading.Lock()


def engine_for(config: RenderConfig, *, live: bool = False, decode: str = "fast") -> DerenderEngine:
    """This process's engine for these settings, built on first use: a
    worker of ``Dataset.map(num_proc=N)`` or any process pool builds one
    engine and answers every row it gets with it. A worker forked from a
    process that had built it takes it over (its memory came with the
    fork) on an event loop of its own."""
    from .vllm_seam.render import DerenderEngine

    key = (json.dumps(dataclasses.asdict(config), sort_keys=True, default=str), live, decode)
    with _ENGINES_LOCK:
        built = _ENGINES.get(key)
        if built is None:
            built = (os.getpid(), DerenderEngine.build(config, live=live, decode=decode))
        elif built[0] != os.getpid():
            built[1].close()  # this process's copy of the parent's loop
            built = (os.getpid(), built[1])
        _ENGINES[key] = built
        return built[1]


def release_engines() -> None:
    """Close and forget the engines `engine_for` built in this process
    (about 1.5 GB each), once a job is done with them."""
    with _ENGINES_LOCK:
        for _, engine in _ENGINES.values():
            engine.close()
        _ENGINES.clear()


# --- derender parity ------------------------------------------------------------------


@dataclass(frozen=True)
class ParitySpec:
    """What ``derender parity`` compares: an input's token ids run through
    `paths`, or recorded ``vllm serve`` answers (`recorded`) through them."""

    input: str | Sequence[str]
    """Derender bodies, bare generate output (with `requests`), or with
    `recorded` the requests file; several inputs (shards) run as one
    input, in order."""
    endpoint: Endpoint = Endpoint.CHAT
    paths: Sequence[str] = PATHS
    chunkings: Sequence[Chunking] = (Chunking(1),)
    """How the stream paths cut one-shot tokens into chunks; each is one run."""
    ignore: Iterable[str] = ()
    normalization: Normalization = DEFAULT_NORMALIZATION
    requests: str | None = None
    stream: bool = False
    """With `requests`: the input holds generate stream chunks."""
    recorded: str | None = None
    examine: bool = False
    """Keep the `Examination` (what every path answered) of each class's
    first `EXAMPLES_PER_CLASS` requests and the pieces of their token ids,
    for a page that shows them; memory stays flat either way."""
    minimize: str | None = None
    """Write each divergence class's smallest record here (`minimize`), in
    the input's form."""
    minimize_steps: int = DEFAULT_STEPS
    """Oracle runs per divergence the minimization may spend."""
    repro: str | None = None
    """Write a report per minimal divergence into this directory (`repro`)."""
    every_minimal: bool = False
    """Minimize every request's every kind, not one record per class (memory
    then grows with the diverging requests)."""
    report: str | None = None
    """Write every divergence here as it is found, one JSON line each."""
    keep_divergences: bool = True
    """Keep every divergence in `ParityResult.divergences` (for library
    callers); the command line streams them to `report` instead."""
    workers: int = 1
    """Processes that run the paths: 1 in this one; more are forked after
    the render stack is built (each builds its own serve stack)."""
    resume: bool = False
    """Continue the `report` an earlier, stopped run left (its checkpoint
    beside it): the requests it covers are skipped."""
    ray: bool = False
    ray_address: str | None = None
    ray_actors: int | None = None
    outputs: Sequence[tuple[str, str | None]] = ()
    """Files the caller writes from the result (flag, path; the command
    line's ``--html``), checked with the run's own outputs before anything
    runs (`RunPaths`)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "paths", parity_paths(self.paths))
        object.__setattr__(self, "endpoint", _checked_endpoint(self.endpoint))
        if not self.inputs:
            raise InputError("no input: name at least one file, or - for stdin")
        if (self.minimize is not None or self.repro is not None) and self.recorded is not None:
            raise InputError("--minimize and --repro take derender bodies, not recorded serve answers (--from-serve)")
        if self.minimize == "-":
            raise InputError("--minimize needs a file path: stdout is not used by parity")
        if isinstance(self.minimize_steps, bool) or not isinstance(self.minimize_steps, int) or self.minimize_steps < 1:
            raise ConfigError(f"--minimize-steps must be a whole number of at least 1, got {self.minimize_steps!r}")
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise ConfigError(f"--workers must be a whole number of at least 1, got {self.workers!r}")
        if self.resume:
            if self.report is None or self.report == "-" or self.report.endswith((".gz", ".zst")):
                raise InputError("--resume continues a plain --report FILE.jsonl: name one")
            if self.examine or self.minimizing:
                raise InputError(
                    "--resume continues the report only: --html, --minimize and --repro need what every path "
                    "answered for the requests already done; run them afresh"
                )
        if self.ray and (self.requests is not None or self.recorded is not None or "-" in self.inputs):
            raise InputError("--ray reads derender bodies from files: no --requests, --from-serve or stdin")
        if self.ray and self.resume:
            raise InputError("--resume is not supported with --ray: start afresh, or resume locally")

    @property
    def inputs(self) -> tuple[str, ...]:
        return (self.input,) if isinstance(self.input, str) else tuple(self.input)

    @property
    def minimizing(self) -> bool:
        return self.minimize is not None or self.repro is not None


EXAMPLES_PER_CLASS = 3
"""Requests of each class the page shows in full (`ParitySpec.examine`)."""
_CHECKPOINT_SECONDS = 2.0
_POOL_CHUNK = 4
"""Requests per message to a parity worker (or Ray actor) where no path
batches; a serve path gets a window of them (`ParityWork.chunk`)."""
_WORKER_START_LIMIT = 900.0
"""Seconds the parity pool waits for its workers to start (each builds a
serve stack) before it goes on regardless: a worker that never starts then
shows as a failed chunk, not as a hang."""


@dataclass
class ParityResult:
    divergences: list[Divergence] = field(default_factory=list)
    """Every divergence, with `ParitySpec.keep_divergences`."""
    requests: int = 0
    not_compared: int = 0
    classes: Classes = field(default_factory=Classes)
    """Every divergence counted by class and by kind."""
    examinations: list[Examination] = field(default_factory=list)
    """With `ParitySpec.examine`: the examinations the page shows (each
    class's first `EXAMPLES_PER_CLASS` requests), in order."""
    shown: list[tuple[int, int]] = field(default_factory=list)
    """Per kept examination: its number among the requests compared, and
    its first divergence's number (its line in the report)."""
    more: dict[str, tuple[list[str | None], int]] = field(default_factory=dict)
    """Per class: the first `html_report.IDS_SHOWN` requests beyond its
    examples, and how many there are."""
    compared: int = 0
    """Requests compared (those that could run)."""
    pieces: dict[int, str] = field(default_factory=dict)
    """With `ParitySpec.examine`: the pieces of the shown token ids."""
    minimized: list[Minimal] = field(default_factory=list)
    """With `ParitySpec.minimize` or `repro`: a smallest record per class
    (per request and kind with `every_minimal`)."""
    logs: list[tuple[LogKind, str]] = field(default_factory=list)
    """vLLM's log records while the paths ran, counted per kind, with the
    request that first logged each (`LogTally`)."""
    resumed: int = 0
    """Requests an earlier run had compared (`ParitySpec.resume`)."""

    @property
    def divergence_count(self) -> int:
        return self.classes.divergences

    def take(self, examination: Examination, *, examine: bool) -> list[str]:
        """Count one compared request's divergences by class (their classes,
        in order); with `examine`, keep its examination for the page while
        it is among the first `EXAMPLES_PER_CLASS` of one of its classes,
        else list its id under each of its classes."""
        self.compared += 1
        first = self.classes.divergences + 1
        names = self.classes.add(examination.divergences)
        if not examine or not names:
            return names
        classes = self.classes.classes
        if any(classes[name].requests <= EXAMPLES_PER_CLASS for name in names):
            self.examinations.append(examination)
            self.shown.append((self.compared, first))
            return names
        for name in dict.fromkeys(names):
            ids, count = self.more.get(name, ([], 0))
            if len(ids) < IDS_SHOWN:
                ids.append(examination.request_id)
            self.more[name] = (ids, count + 1)
        return names

    def page_shown(self) -> Shown:
        """Where the kept examinations sit in the run, for `build_page`."""
        return Shown(self.shown, self.classes, self.compared, self.more)


def parity_paths(names: Iterable[str]) -> list[str]:
    """The paths named (comma lists allowed), in `PATHS` order."""
    wanted = [name.strip() for value in names for name in value.split(",") if name.strip()]
    unknown = [name for name in wanted if name not in PATHS]
    if unknown:
        raise ConfigError(f"--paths: unknown path {unknown[0]!r}. Valid paths: {', '.join(PATHS)}.")
    if len(set(wanted)) < 2:
        raise ConfigError("--paths: name at least two paths to compare")
    return [name for name in PATHS if name in wanted]


def run_parity(
    config: RenderConfig,
    spec: ParitySpec,
    on_skip: Callable[[Request], None] | None = None,
    *,
    warm: WarmEngines | None = None,
    on_minimized: Callable[[Minimal], None] | None = None,
    observer: Observer | None = None,
) -> ParityResult:
    """Every request of the inputs through every path, compared, here, on
    forked workers or on Ray: each examination comes back in input order and
    is taken the same way wherever it ran, so the report, the page and the
    minimal records are the same. `on_skip` hears of each request that
    cannot be compared (and why). With `spec.minimize` or `spec.repro`, the
    first request of each class (every request's every kind with
    `spec.every_minimal`) is then minimized (`on_minimized` hears of each),
    and written."""
    observer = observer or Silent()
    result = ParityResult()
    plain = spec.report is not None and spec.report != "-" and not spec.report.endswith((".gz", ".zst"))
    checkpoint = _checkpoint_path(spec.report) if plain and spec.report is not None else None
    run_paths = RunPaths(
        [*(("INPUT", path) for path in spec.inputs), ("--requests", spec.requests)],
        [("--minimize", spec.minimize), ("--report", spec.report), ("the checkpoint of --report", checkpoint),
         *spec.outputs],
        [("--repro", spec.repro)],
        read=[("--from-serve", spec.recorded), *config_files(config)],
    )  # fmt: skip
    for path in spec.inputs:
        if path != "-" and not os.path.exists(path):
            raise InputError(f"cannot open input {path}: no such file")
        check_input(path)
    if spec.workers > 1 and not spec.ray:
        check_workers(spec.workers)
    run_key = _parity_run_key(config, spec)
    done, report_bytes = _resumed(spec, checkpoint, run_key) if spec.resume else (0, 0)
    if spec.repro is not None:
        prepare_repro(spec.repro)
    minimize: dict[str, tuple[Request, list[Divergence]]] = {}
    every: list[tuple[Request, list[Divergence]]] = []
    tally = LogTally()
    with contextlib.ExitStack() as resources:
        # Before any worker forks, which inherits it (`collector.records_pace`).
        resources.enter_context(records_pace())
        if spec.report is not None:
            if done:
                _read_back(spec.report, report_bytes, result)
            sink = resources.enter_context(open_output(spec.report, append=done > 0))
        observer.loading(config.model or "")
        pooled = spec.workers > 1 and not spec.ray
        engines = {} if spec.ray else _parity_engines(config, spec.paths, resources, warm, serve=not pooled)
        requests = None
        if spec.recorded is not None or spec.requests is not None:
            requests = RequestIndex(spec.input if spec.recorded is not None else str(spec.requests))  # type: ignore[arg-type]
            resources.callback(requests.close)
        stop = resources.enter_context(stop_on_signals(observer.stopping))
        inputs: Iterator[Request] = until_stopped(_parity_requests(spec, requests, resources, observer), stop)
        work = ParityWork(tuple(spec.paths), spec.endpoint, frozenset(spec.ignore), spec.normalization)
        if spec.ray:
            examined = _parity_on_ray(config, spec, work, inputs, result, done, on_skip)
        elif pooled:
            pool = resources.enter_context(_ParityPool(config, engines, work, spec.workers, requests, stop))
            examined = pool.examined(_skipping(inputs, result, done, on_skip))
        else:
            checker = work.checker(engines)
            examined = checker.examined(_skipping(inputs, result, done, on_skip))
        progress = Report()
        started = time.perf_counter()
        last_checkpoint = started
        through = done
        for request, examination in examined:
            through = request.number
            tally.add(request.request_id, examination.logs)
            found = examination.divergences
            names = result.take(examination, examine=spec.examine)
            if spec.report is not None:
                for divergence in found:
                    report_bytes += sink.write(report_line(divergence))
            if spec.keep_divergences:
                result.divergences += found
            if found and spec.minimizing:
                if spec.every_minimal:
                    every.append((request, found))
                for name in dict.fromkeys(names):
                    if result.classes.classes[name].requests == 1:
                        minimize[name] = (request, found)
            progress.records = result.requests
            progress.elapsed = time.perf_counter() - started
            observer.update(progress)
            if checkpoint is not None and progress.elapsed + started - last_checkpoint >= _CHECKPOINT_SECONDS:
                last_checkpoint = time.perf_counter()
                sink.flush()
                _write_checkpoint(checkpoint, run_key, through, report_bytes)
        if checkpoint is not None:
            sink.flush()
            _write_checkpoint(checkpoint, run_key, through if stop else result.requests, report_bytes, finished=not stop)
        result.logs = tally.kinds
        if stop:
            raise RunStopped(stop.signal or 0, result)
        if spec.examine or spec.minimizing:
            # Workers and actors kept their stacks: what is still needed here is built now.
            missing = [path for path in spec.paths if path not in engines]
            if missing and (spec.minimizing or not engines):
                engines.update(_parity_engines(config, missing if spec.minimizing else missing[:1], resources, warm))
        if spec.examine:
            pieces_of = getattr(next(iter(engines.values())), "token_pieces", None)
            if pieces_of is not None:
                for examination in result.examinations:
                    result.pieces.update(pieces_of(_new_ids(examination, result.pieces)))
        if spec.minimizing:
            minimizer = Minimizer(
                engines, spec.endpoint, chunkings=spec.chunkings, ignore=spec.ignore,
                normalization=spec.normalization, steps=spec.minimize_steps,
            )  # fmt: skip
            for request, divergence, alike in _to_minimize(spec, minimize, every, minimizer):
                minimal = minimizer.minimize(request, divergence, alike)
                result.minimized.append(minimal)
                if on_minimized is not None:
                    on_minimized(minimal)
    if spec.minimize is not None:
        write_minimal(spec.minimize, result.minimized)
    if spec.repro is not None:
        write_repro(spec.repro, result.minimized, config, spec.endpoint, parity_flags(spec), run_paths.claimed)
    return result


class RunStopped(Exception):
    """A parity run stopped by a signal: the report (and its checkpoint)
    holds the requests compared before it, for ``--resume``."""

    def __init__(self, signum: int, result: ParityResult) -> None:
        super().__init__(signum)
        self.signum = signum
        self.result = result


def _to_minimize(
    spec: ParitySpec,
    firsts: Mapping[str, tuple[Request, list[Divergence]]],
    every: list[tuple[Request, list[Divergence]]],
    minimizer: Minimizer,
) -> Iterator[tuple[Request, Divergence, list[Divergence]]]:
    """What to minimize, in report order: each class's first divergence on
    the first request that shows it, or with `every_minimal` the first
    divergence of each kind on every request. A class whose request already
    has a minimal record of its kind is left to that record (it would get
    the same id)."""
    if spec.every_minimal:
        for request, found in every:
            for divergence in minimizer.kinds(found):
                yield request, divergence, found
        return
    taken: set[tuple[str | None, str]] = set()
    for name, (request, found) in firsts.items():  # filled in report order
        members = [d for d in found if class_of(d) == name]
        key = (request.request_id, members[0].kind)
        if key not in taken:
            taken.add(key)
            yield request, members[0], members


def _skipping(
    inputs: Iterable[Request], result: ParityResult, done: int, on_skip: Callable[[Request], None] | None
) -> Iterator[Request]:
    """The requests that can be compared; the others are counted and told
    to `on_skip`, and the first `done` (a resumed run's) are passed over."""
    for request in inputs:
        result.requests += 1
        request.number = result.requests
        if result.requests <= done:
            result.resumed += 1
            if request.problem is not None:
                result.not_compared += 1
            continue
        if request.problem is not None:
            result.not_compared += 1
            if on_skip is not None:
                on_skip(request)
            continue
        yield request


def _parity_requests(
    spec: ParitySpec, requests: RequestIndex | None, resources: contextlib.ExitStack, observer: Observer
) -> Iterator[Request]:
    """Every input's requests, in order (recorded serve answers, or records
    joined into requests)."""
    if spec.recorded is not None:
        assert requests is not None
        yield from from_serve(read_items(spec.recorded), spec.endpoint, requests)
        return
    job = Job(spec.endpoint, stream=spec.stream, requests=requests, lenient=True)
    for path in spec.inputs:
        with open_records(path, job, digests=False) as source:
            observer.start_input(path, source, 0)
            yield from requests_of(
                source.records, spec.endpoint, stream=spec.stream, requests=requests, chunkings=list(spec.chunkings)
            )  # fmt: skip


@dataclass(frozen=True)
class ParityWork:
    """What every process that examines requests runs: the same paths,
    compared the same way."""

    paths: tuple[str, ...]
    endpoint: Endpoint
    ignore: frozenset[str]
    normalization: Normalization

    def checker(self, engines: Mapping[str, Derenderer]) -> Parity:
        return Parity(engines, self.endpoint, ignore=self.ignore, normalization=self.normalization)

    @property
    def chunk(self) -> int:
        """Requests per message to a worker: the serve path answers a
        window of requests as one batch (`Derenderer.drive`), which a
        smaller message would cut short; the other paths answer one at a
        time, and small messages keep the workers evenly loaded."""
        return WINDOW if SERVE_PATHS & set(self.paths) else _POOL_CHUNK


# --- parity on forked workers ------------------------------------------------------------

_PARITY_WORKER: dict[str, Any] = {}
"""In a parity worker: its checker (set up in `_parity_worker_start`)."""


class _ParityPool:
    """Forked processes that examine requests, each over the parent's
    render stack (forked) and a serve stack of its own (an engine core
    cannot be forked); examinations come back in input order, at most a
    few chunks per worker in flight, so memory stays flat."""

    def __init__(
        self, config: RenderConfig, engines: Mapping[str, Derenderer], work: ParityWork, workers: int,
        requests: RequestIndex | None, stop: StopRequest,
    ) -> None:  # fmt: skip
        import multiprocessing.pool

        self.workers = workers
        self._chunk = work.chunk
        # At most a few chunks a worker in flight, two at least (one being
        # examined, one waiting), so memory stays flat.
        self._in_flight = max(2, 16 // self._chunk) * workers
        for engine in {id(e): e for e in engines.values()}.values():
            engine.close()  # no event loop is shared with the children
        _PARITY_WORKER.update(config=config, engines=dict(engines), work=work)
        freeze_for_fork()
        context = _KillingForkContext()
        ready = context.Semaphore(0)
        self._pool = multiprocessing.pool.Pool(
            workers, initializer=_parity_worker_start, initargs=(os.getpid(), ready), context=context
        )
        _PARITY_WORKER.clear()
        # The workers' start-up is over before the run's clock starts, so
        # records/s, the progress and its ETA leave it out, as the other
        # commands' pools and Ray's actors do.
        self._wait_started(ready, stop)

    def _wait_started(self, ready: Any, stop: StopRequest) -> None:
        """Until every worker has started (built its serve stack), a stop
        is asked for, or `_WORKER_START_LIMIT` passes. A worker that fails
        to start signals too (its chunks then carry the failure), and one
        that dies starting is replaced by the pool, whose successor
        signals."""
        deadline = time.monotonic() + _WORKER_START_LIMIT
        for _ in range(self.workers):
            while not ready.acquire(timeout=0.25):
                if stop.signal is not None or time.monotonic() > deadline:
                    return

    def __enter__(self) -> _ParityPool:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        if exc_type is None:
            # Every examination is in: the workers end on the pool's own
            # sentinels.
            self._pool.close()
        else:
            self._pool.terminate()
        self._pool.join()
        gc.unfreeze()

    def examined(self, requests: Iterable[Request]) -> Iterator[tuple[Request, Examination]]:
        pending: collections.deque[tuple[list[Request], Any]] = collections.deque()
        chunk: list[Request] = []

        def sent() -> None:
            pending.append((chunk, self._pool.apply_async(_parity_worker_examine, (chunk,))))

        for request in requests:
            chunk.append(request)
            if len(chunk) >= self._chunk:
                sent()
                chunk = []
                while len(pending) >= self._in_flight:
                    yield from self._received(pending.popleft())
        if chunk:
            sent()
        while pending:
            yield from self._received(pending.popleft())

    @staticmethod
    def _received(item: tuple[list[Request], Any]) -> Iterator[tuple[Request, Examination]]:
        chunk, answer = item
        outcome = answer.get()
        if isinstance(outcome, str):
            raise WorkerLost(f"a parity worker failed:\n{outcome}")
        yield from zip(chunk, pickle.loads(outcome), strict=True)


class _KillingForkProcess(multiprocessing.context.ForkProcess):
    """A parity worker, whose ``terminate`` (the pool's, when a run ends by
    an error) is SIGKILL: the worker keeps the run's SIGTERM handler, which
    only notes a stop, so a SIGTERM would leave the pool waiting on it for
    ever."""

    def terminate(self) -> None:
        self.kill()


class _KillingForkContext(multiprocessing.context.ForkContext):
    """The fork context whose processes are `_KillingForkProcess`."""

    Process = _KillingForkProcess  # type: ignore[assignment]


def _parity_worker_start(parent: int, ready: Any) -> None:
    """A parity worker's start: it dies with the parent, leaves Ctrl-C to
    it, and builds the serve stack the parent could not fork; then it tells
    the parent it has started (`ready`), whether or not that succeeded.
    It keeps the run's SIGTERM handler (`interrupt.stop_on_signals`, which
    only notes a stop): a SIGTERM to the whole process group (``timeout``,
    a container's stop) leaves it answering what the parent has in flight
    while the parent stops, as a SIGINT does."""
    import signal

    die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    config, engines, work = _PARITY_WORKER["config"], _PARITY_WORKER["engines"], _PARITY_WORKER["work"]
    try:
        for engine in {id(e): e for e in engines.values()}.values():
            engine.after_fork()
        missing = [path for path in work.paths if path not in engines]
        if missing:
            with contextlib.ExitStack() as kept:
                engines.update(_parity_engines(config, missing, kept, None, serve=True))
                kept.pop_all()
        _PARITY_WORKER["checker"] = work.checker({path: engines[path] for path in work.paths})
    except Exception:
        _PARITY_WORKER["failed"] = traceback.format_exc()
    finally:
        ready.release()


def _parity_worker_examine(chunk: list[Request]) -> bytes | str:
    """A chunk's examinations, pickled; a worker that could not start or
    hit a bug sends its traceback instead."""
    if "failed" in _PARITY_WORKER:
        return str(_PARITY_WORKER["failed"])
    try:
        checker = _PARITY_WORKER["checker"]
        with records_pace():
            return pickle.dumps([e for _, e in checker.examined(chunk)], protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        return traceback.format_exc()


# --- parity on Ray ---------------------------------------------------------------------------------


def _parity_on_ray(
    config: RenderConfig, spec: ParitySpec, work: ParityWork, inputs: Iterable[Request], result: ParityResult,
    done: int, on_skip: Callable[[Request], None] | None,
) -> Iterator[tuple[Request, Examination]]:  # fmt: skip
    """On a Ray cluster: this process reads the requests, a pool of actors
    (each with its own stacks, the model shipped to it) examines them in
    chunks, a few per actor in flight, taken back in input order."""
    from .ray_data import ModelBundle, ray_cluster

    bundle = ModelBundle.of(config)
    with ray_cluster(spec.ray_address) as (ray, _):
        from ray.util import ActorPool

        cpus = float(ray.cluster_resources().get("CPU", 1))
        size = spec.ray_actors or max(1, int(cpus))
        actor = ray.remote(num_cpus=max(0.1, min(1.0, cpus / size)))(_ParityActor)
        pool = ActorPool([actor.remote(config, bundle, work, os.getcwd()) for _ in range(size)])
        pending: collections.deque[list[Request]] = collections.deque()

        def received() -> Iterator[tuple[Request, Examination]]:
            outcome = pool.get_next()
            if isinstance(outcome, str):
                raise WorkerLost(f"a parity actor failed:\n{outcome}")
            yield from zip(pending.popleft(), pickle.loads(outcome), strict=True)

        chunk: list[Request] = []
        for request in _skipping(inputs, result, done, on_skip):
            chunk.append(request)
            if len(chunk) >= work.chunk:
                pool.submit(lambda a, c: a.examine.remote(c), chunk)
                pending.append(chunk)
                chunk = []
                while len(pending) >= 2 * size:
                    yield from received()
        if chunk:
            pool.submit(lambda a, c: a.examine.remote(c), chunk)
            pending.append(chunk)
        while pending:
            yield from received()


class _ParityActor:
    """A Ray actor that examines requests: the render and serve stacks of
    its own, over the model where the driver has it when this node has it
    there too (vLLM's system fingerprint hashes the model's path, so the
    answers are a local run's), else over its node's copy of the bundle."""

    def __init__(self, config: RenderConfig, bundle: Any, work: ParityWork, directory: str) -> None:
        import asyncio

        # A Ray worker runs uvloop's policy; the serve stack steps asyncio's own loop.
        asyncio.set_event_loop_policy(asyncio.DefaultEventLoopPolicy())
        if os.path.isdir(directory):
            os.chdir(directory)  # the driver's relative paths
        try:
            config.check_paths()
        except ConfigError:
            config = bundle.unpacked(config)
        self._kept = contextlib.ExitStack()
        engines = _parity_engines(config, work.paths, self._kept, None)
        self.checker = work.checker(engines)

    def examine(self, chunk: list[Request]) -> bytes | str:
        try:
            with records_pace():
                return pickle.dumps([e for _, e in self.checker.examined(chunk)], protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            return traceback.format_exc()


# --- resuming a parity report ---------------------------------------------------------------------


def _checkpoint_path(report: str) -> str:
    """Beside the report: ``.NAME.derender-parity.json``."""
    path = Path(report)
    return str(path.with_name(f".{path.name}.derender-parity.json"))


def _parity_run_key(config: RenderConfig, spec: ParitySpec) -> dict[str, Any]:
    """What a resumed run must share with the one it continues."""
    from importlib.metadata import version

    return {
        "inputs": [os.path.abspath(p) for p in spec.inputs],
        "flags": parity_flags(spec),
        "requests": spec.requests, "stream": spec.stream,
        "config": json.loads(json.dumps(dataclasses.asdict(config), default=str)),
        "versions": {"derender": version("derender"), "vllm": version("vllm")},
    }  # fmt: skip


def _write_checkpoint(path: str, key: dict[str, Any], requests: int, size: int, *, finished: bool = False) -> None:
    """How far the report got: the requests it covers (compared or passed
    over) and its bytes so far (written in place, atomically)."""
    text = json.dumps({"run": key, "requests": requests, "bytes": size, "finished": finished})
    temporary = f"{path}.tmp"
    with open(temporary, "w") as out:
        out.write(text)
    os.replace(temporary, path)


def _resumed(spec: ParitySpec, checkpoint: str | None, key: dict[str, Any]) -> tuple[int, int]:
    """The requests and report bytes an earlier run of the same parity
    left, from its checkpoint."""
    assert checkpoint is not None and spec.report is not None
    try:
        with open(checkpoint) as source:
            earlier = json.load(source)
    except (OSError, ValueError):
        raise InputError(f"--resume: {spec.report} has no checkpoint ({checkpoint}): start afresh") from None
    if earlier.get("run") != key:
        raise InputError(f"--resume: {spec.report} was written by another parity run (inputs, flags, settings or versions)")
    try:
        size = os.path.getsize(spec.report)
    except OSError:
        size = -1
    if size < earlier["bytes"]:
        raise InputError(f"--resume: {spec.report} is shorter than its checkpoint says: start afresh")
    os.truncate(spec.report, earlier["bytes"])
    return int(earlier["requests"]), int(earlier["bytes"])


def _read_back(report: str, size: int, result: ParityResult) -> None:
    """The divergences an earlier run wrote, counted again by class, a
    request (a run of lines with one request id) at a time."""
    with open(report, "rb") as source:
        group: list[Divergence] = []
        for line in source.read(size).splitlines():
            divergence = Divergence(**json.loads(line))
            if group and group[-1].request_id != divergence.request_id:
                result.classes.add(group)
                group = []
            group.append(divergence)
        if group:
            result.classes.add(group)


def parity_flags(spec: ParitySpec) -> list[str]:
    """The `derender parity` flags (besides the render settings) that shape
    what a run of `spec` finds, for the command a report shows."""
    flags: list[str] = []
    if spec.endpoint is not Endpoint.CHAT:
        flags += ["--endpoint", spec.endpoint.value]
    if list(spec.paths) != list(PATHS):
        flags += ["--paths", ",".join(spec.paths)]
    if [c.name for c in spec.chunkings] != ["1"]:
        flags += ["--chunking", ",".join(c.name for c in spec.chunkings)]
    for name in spec.ignore:
        flags += ["--ignore", name]
    normalization = spec.normalization
    flags += [] if normalization.created else ["--compare-created"]
    flags += [] if normalization.random_ids else ["--compare-ids"]
    flags += [] if normalization.null_is_absent else ["--null-is-not-absent"]
    return flags


def write_minimal(path: str, minimized: Iterable[Minimal]) -> None:
    """The minimal records, one JSON record a line, in the input's form."""
    with open_output(path) as sink:
        for minimal in minimized:
            for record in minimal.records:
                sink.write(json_bytes(record) + b"\n")


def _new_ids(examination: Examination, known: Mapping[int, str]) -> set[int]:
    """The token ids an examination's inputs carry that `known` lacks."""
    per_choice = [*examination.token_ids.values()]
    per_choice += [ids for calls in examination.calls.values() for call in calls for ids in call.values()]
    return {i for ids in per_choice for i in ids if i not in known}


def _parity_engines(
    config: RenderConfig, paths: Sequence[str], resources: contextlib.ExitStack, warm: WarmEngines | None,
    *, serve: bool = True,
) -> dict[str, Derenderer]:
    """One render stack for the derender paths, one serve stack for the
    serve paths (unless not `serve`: forked workers build their own)."""
    engines: dict[str, Derenderer] = {}
    if set(DERENDER_MODES) & set(paths):
        derender, _ = build_engine(config, warm=warm)
        resources.callback(derender.close)
        engines.update({path: derender.in_mode(**DERENDER_MODES[path]) for path in paths if path in DERENDER_MODES})
    if serve and SERVE_PATHS & set(paths):
        built, _ = build_engine(config, flavor="serve")
        resources.callback(built.close)
        engines.update({path: built for path in paths if path.startswith("serve")})
    return {path: engines[path] for path in paths if path in engines}
