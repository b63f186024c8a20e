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

import contextlib
import dataclasses
import functools
import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from .batch import Job, OutcomeSource, Report, RunIncomplete, run
from .compare import DEFAULT_NORMALIZATION, Divergence, Examination, Normalization
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
from .interrupt import StopRequest, stop_on_signals, until_stopped
from .logs import LogKind
from .minimize import DEFAULT_STEPS, Minimal, Minimizer, json_bytes
from .outputs import RunPaths
from .parity import DERENDER_MODES, PATHS, Chunking, Parity, Request, from_serve, requests_of
from .protocol import Derenderer, Endpoint
from .records import (
    RequestIndex,
    iter_records,
    open_input,
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
from .workers import WorkerPool, check_workers, usable_cpus
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
            engine = engine.in_mode(live=live, decode=decode)
            engine.startup_seconds = time.perf_counter() - started
            return engine, "model (warm)"
    from .vllm_seam.render import DerenderEngine

    return DerenderEngine.build(config, live=live, decode=decode), "model"


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
            config, flavor=spec.flavor, live=spec.live, decode=spec.decode, warm=warm
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
            fail_fast=spec.fail_fast, error_log=_error_log(spec, plan, resources),
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

    input: str
    """Derender bodies, bare generate output (with `requests`), or with
    `recorded` the requests file."""
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
    """Keep each request's `Examination` (what every path answered) and the
    pieces of its token ids, for a page that shows them; without it memory
    stays flat."""
    minimize: str | None = None
    """Write each divergence's smallest record here (`minimize`), in the
    input's form."""
    minimize_steps: int = DEFAULT_STEPS
    """Oracle runs per divergence the minimization may spend."""
    repro: str | None = None
    """Write a report per minimal divergence into this directory (`repro`)."""
    outputs: Sequence[tuple[str, str | None]] = ()
    """Files the caller writes from the result (flag, path; the command
    line's ``--report`` and ``--html``), checked with the run's own outputs
    before anything runs (`RunPaths`)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "paths", parity_paths(self.paths))
        object.__setattr__(self, "endpoint", _checked_endpoint(self.endpoint))
        if (self.minimize is not None or self.repro is not None) and self.recorded is not None:
            raise InputError("--minimize and --repro take derender bodies, not recorded serve answers (--from-serve)")
        if self.minimize == "-":
            raise InputError("--minimize needs a file path: stdout is not used by parity")
        if isinstance(self.minimize_steps, bool) or not isinstance(self.minimize_steps, int) or self.minimize_steps < 1:
            raise ConfigError(f"--minimize-steps must be a whole number of at least 1, got {self.minimize_steps!r}")

    @property
    def minimizing(self) -> bool:
        return self.minimize is not None or self.repro is not None


@dataclass
class ParityResult:
    divergences: list[Divergence] = field(default_factory=list)
    requests: int = 0
    not_compared: int = 0
    examinations: list[Examination] = field(default_factory=list)
    """With `ParitySpec.examine`: every compared request's examination, in order."""
    pieces: dict[int, str] = field(default_factory=dict)
    """With `ParitySpec.examine`: each token id's piece in the tokenizer's vocabulary."""
    minimized: list[Minimal] = field(default_factory=list)
    """With `ParitySpec.minimize` or `repro`: each request's smallest record per divergence kind."""
    logs: list[tuple[LogKind, str]] = field(default_factory=list)
    """vLLM's log records while the paths ran, counted per kind, with the
    request that first logged each (`Parity.logs`)."""


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
) -> ParityResult:
    """Every request of the input through every path, compared. `on_skip`
    hears of each request that cannot be compared (and why). With
    `spec.minimize` or `spec.repro`, each request's divergences are then
    minimized kind by kind (`on_minimized` hears of each), and written."""
    result = ParityResult()
    run_paths = RunPaths(
        [("INPUT", spec.input), ("--requests", spec.requests)],
        [("--minimize", spec.minimize), *spec.outputs],
        [("--repro", spec.repro)],
        read=[("--from-serve", spec.recorded), *config_files(config)],
    )  # fmt: skip
    if spec.repro is not None:
        prepare_repro(spec.repro)
    diverging: list[tuple[Request, list[Divergence]]] = []
    with contextlib.ExitStack() as resources:
        engines = _parity_engines(config, spec.paths, resources, warm)
        checker = Parity(engines, spec.endpoint, ignore=spec.ignore, normalization=spec.normalization)
        requests = None
        if spec.recorded is not None or spec.requests is not None:
            requests = RequestIndex(spec.input if spec.recorded is not None else str(spec.requests))
            resources.callback(requests.close)
        if spec.recorded is not None:
            assert requests is not None
            inputs = from_serve(read_items(spec.recorded), spec.endpoint, requests)
        else:
            source = resources.enter_context(open_input(spec.input))
            inputs = requests_of(
                iter_records(source), spec.endpoint, stream=spec.stream, requests=requests, chunkings=list(spec.chunkings)
            )  # fmt: skip
        pieces_of = getattr(next(iter(engines.values())), "token_pieces", None)
        for request in inputs:
            result.requests += 1
            if request.problem is not None:
                result.not_compared += 1
                if on_skip is not None:
                    on_skip(request)
                continue
            if spec.examine:
                examination = checker.examine(request)
                found = examination.divergences
                result.examinations.append(examination)
                if pieces_of is not None:
                    result.pieces.update(pieces_of(_new_ids(examination, result.pieces)))
            else:
                found = checker.run(request)
            result.divergences += found
            if found and spec.minimizing:
                diverging.append((request, found))
        result.logs = checker.logs
        if spec.minimizing:
            minimizer = Minimizer(
                engines, spec.endpoint, chunkings=spec.chunkings, ignore=spec.ignore,
                normalization=spec.normalization, steps=spec.minimize_steps,
            )  # fmt: skip
            for request, found in diverging:
                for divergence in minimizer.kinds(found):
                    minimal = minimizer.minimize(request, divergence, found)
                    result.minimized.append(minimal)
                    if on_minimized is not None:
                        on_minimized(minimal)
    if spec.minimize is not None:
        write_minimal(spec.minimize, result.minimized)
    if spec.repro is not None:
        write_repro(spec.repro, result.minimized, config, spec.endpoint, parity_flags(spec), run_paths.claimed)
    return result


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
    config: RenderConfig, paths: Sequence[str], resources: contextlib.ExitStack, warm: WarmEngines | None
) -> dict[str, Derenderer]:
    """One render stack for the derender paths, one serve stack for the serve paths."""
    engines: dict[str, Derenderer] = {}
    if set(DERENDER_MODES) & set(paths):
        derender, _ = build_engine(config, warm=warm)
        resources.callback(derender.close)
        engines.update({path: derender.in_mode(**DERENDER_MODES[path]) for path in paths if path in DERENDER_MODES})
    if {"serve", "serve-oneshot"} & set(paths):
        serve, _ = build_engine(config, flavor="serve")
        resources.callback(serve.close)
        engines.update({path: serve for path in paths if path.startswith("serve")})
    return {path: engines[path] for path in paths}
