"""The `derender` command: a thin Typer layer over `derender_core`.

It parses flags, opens inputs and outputs, shows progress and the summary on
stderr, and exits with the status the core decides (`ExitStatus`): 0 all
records fine, 1 some records got error records, 2 usage or configuration
error (nothing processed), 3 the run could not finish (an input or output
failed mid-run, a worker died), 4 (`diff`) an input holds no answer, 128 + N
stopped by signal N (Ctrl-C: 130).
vLLM is imported only once a command runs, never for ``--help``.
"""

import contextlib
import dataclasses
import functools
import inspect
import io
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from derender_core import (
    PATHS,
    AssembledWriter,
    Chunking,
    ConfigError,
    DerenderEngine,
    Derenderer,
    DerenderError,
    Divergence,
    Endpoint,
    ErrorLog,
    ExitStatus,
    InputError,
    Job,
    JsonlWriter,
    Normalization,
    OutcomeSource,
    Parity,
    RenderConfig,
    Report,
    RequestIndex,
    RunIncomplete,
    ServeEngine,
    SseWriter,
    StreamFailure,
    Writer,
    diff_items,
    from_serve,
    iter_records,
    open_input,
    open_output,
    read_items,
    refuse_overwriting,
    requests_of,
    run,
)
from derender_core.datasets import ParquetWriter, answers_in, check_input, is_parquet, open_records, output_name
from derender_core.interrupt import StopRequest, stop_on_signals, until_stopped
from derender_core.parity import DERENDER_MODES
from derender_core.resume import (
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
from derender_core.vllm_seam.render import DECODE_MODES
from derender_core.workers import WorkerPool, check_workers, usable_cpus

from .progress import ProgressDisplay, Summary, print_summary
from .report import print_table, write_report

app = typer.Typer(
    name="derender",
    help=(
        "Turn token-in/token-out generate output back into the OpenAI responses "
        "`vllm serve` would return, offline, with vLLM's own derender core."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

RENDER_PANEL = "Render server flags (as `vllm launch render`)"


class OutputFormat(str, Enum):
    jsonl = "jsonl"
    sse = "sse"
    assembled = "assembled"


class StreamMode(str, Enum):
    live = "live"
    replay = "replay"


DecodeMode = Enum("DecodeMode", {mode: mode for mode in DECODE_MODES}, type=str)  # type: ignore[misc]


class Flavor(str, Enum):
    derender = "derender"
    serve = "serve"


def _render_flag(name: str, kind: type, metavar: str, help_text: str) -> Any:
    """A render-server flag in vLLM's spelling; booleans get a --no- form so
    the command line can turn off what --config turned on."""
    flag = "--" + name.replace("_", "-")
    if kind is bool:
        option = typer.Option(
            f"{flag}/--no-{flag[2:]}", help=help_text, show_default=False, rich_help_panel=RENDER_PANEL
        )
    else:
        option = typer.Option(flag, metavar=metavar, help=help_text, rich_help_panel=RENDER_PANEL)
    return Annotated[kind | None, option]  # type: ignore[valid-type]


# The render server's flags, each command takes them all; None means "not given".
_RENDER_OPTIONS: dict[str, Any] = {
    "config": Annotated[
        Path | None,
        typer.Option(
            "--config",
            metavar="FILE",
            help="YAML file of the flags below, as `vllm serve --config` reads it. "
            "Flags given here override it.",
            rich_help_panel=RENDER_PANEL,
        ),
    ],
    **{
        name: _render_flag(name, kind, metavar, help_text)
        for name, kind, metavar, help_text in (
            ("model", str, "DIR|ID", "Local model directory (tokenizer, config.json, generation_config.json), "
             "or a Hub id found in the local Hugging Face cache (never downloaded)."),
            ("tokenizer", str, "DIR|ID", "Tokenizer directory or cached Hub id, if not the model's."),
            ("revision", str, "REV", "The Hub id's revision (branch, tag or commit) in the cache."),
            ("tokenizer_revision", str, "REV", "The tokenizer Hub id's revision, if not --revision."),
            ("served_model_name", list[str], "NAME", "Model name requests may use; repeat for several. Default: --model."),
            ("tokenizer_mode", str, "MODE", "auto, hf, mistral, ... as vLLM registers them."),
            ("trust_remote_code", bool, "", "Trust code in the model directory."),
            ("max_model_len", str, "LEN", "Context length bound checked before decoding (e.g. 4096, 32k)."),
            ("tool_call_parser", str, "NAME", "vLLM tool call parser, e.g. hermes."),
            ("reasoning_parser", str, "NAME", "vLLM reasoning parser, e.g. qwen3."),
            ("enable_auto_tool_choice", bool, "", "Parse tool calls for tool_choice=auto."),
            ("exclude_tools_when_tool_choice_none", bool, "", "Drop tools from the request when tool_choice is none."),
            ("chat_template", str, "TEMPLATE", "Chat template file or inline template."),
            ("chat_template_content_format", str, "FORMAT", "auto, string or openai."),
            ("default_chat_template_kwargs", str, "JSON", 'JSON object, e.g. \'{"enable_thinking": false}\'.'),
        )
    },
}

InputArg = Annotated[
    list[str],
    typer.Argument(
        metavar="INPUT...",
        help="JSONL, SSE capture or .parquet to read; - for stdin. Gzip and zstd are detected. "
        "Several inputs (shards) need -o DIR/: each gets DIR/<input name>.",
        show_default=False,
    ),
]
OneInputArg = Annotated[
    str,
    typer.Argument(
        metavar="INPUT",
        help="JSONL or SSE capture to read; - for stdin. Gzip and zstd are detected.",
        show_default=False,
    ),
]
OutputOpt = Annotated[
    str,
    typer.Option(
        "--output",
        "-o",
        metavar="PATH",
        help="Where to write; - for stdout. A .gz or .zst path is compressed, a .parquet path "
        "gets Parquet rows; DIR/ gets one output per input, named after it.",
    ),
]
RequestsOpt = Annotated[
    Path | None,
    typer.Option(
        "--requests",
        metavar="FILE",
        help="JSONL of the original requests (request_id, chat_request or completion_request, "
        "prompt_token_ids, optional prompt_tokens and model), to join bare generate output by request_id.",
    ),
]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress or summary on stderr.")]
FlavorOpt = Annotated[
    Flavor,
    typer.Option(
        "--flavor",
        help="derender: what the render server's derender endpoint answers. "
        "serve: what a client of `vllm serve` reads for the same request and tokens, "
        "through vLLM's own serving stack on a scripted engine core (ids are "
        "chatcmpl-<request_id> / cmpl-<request_id>). Prompt logprobs, beam search and "
        "completions with several prompts get an error record under serve.",
    ),
]
LenientOpt = Annotated[
    bool,
    typer.Option(
        "--lenient",
        help="Answer every record exactly as the render server would, bug for bug, "
        "skipping derender's own checks. Risky: out-of-vocabulary token ids then "
        "decode as nothing, true/false count as tokens 1/0, negative ids in stream "
        "chunks and negative prompt_tokens pass, and bad or missing choice indices "
        "go through, so an answer can look fine and have lost data.",
    ),
]
DecodeOpt = Annotated[
    DecodeMode,
    typer.Option(
        "--decode",
        help="fast: decode and resolve logprobs in bulk, exactly as vLLM's per-token "
        "path does (proven per tokenizer kind; other tokenizers run vLLM's path). "
        "reference: vLLM's own per-token path, bug for bug, for comparison.",
    ),
]
FailFastOpt = Annotated[
    bool, typer.Option("--fail-fast", help="Stop at the first failed record (exit 1).")
]
ErrorsOpt = Annotated[
    Path | None,
    typer.Option(
        "--errors",
        metavar="FILE",
        help="Also write each failed record to FILE (JSONL: input, line, record, "
        "status, error), for triage. A .gz path is gzipped.",
    ),
]
VerboseOpt = Annotated[
    bool,
    typer.Option(
        "--verbose",
        "-v",
        help="Show vLLM's log messages in full, and the traceback of any record "
        "or failure that hit a bug.",
    ),
]
WorkersOpt = Annotated[
    int | None,
    typer.Option(
        "--workers",
        "-j",
        min=1,
        metavar="N",
        help="Worker processes, forked after the model loads. 1 runs in this process. "
        "Default: the CPU cores this process may use (1 with --flavor serve).",
        show_default=False,
    ),
]
ResumeOpt = Annotated[
    bool,
    typer.Option(
        "--resume",
        help="Continue the outputs an earlier, stopped run left: the records they hold are "
        "skipped, the rest appended, and --errors rebuilt. JSONL (plain, .gz, .zst) and Parquet "
        "outputs. Refused when the output's manifest (.NAME.derender.json beside it) names another "
        "input, other answer-shaping flags or other versions, or is missing.",
    ),
]
RayOpt = Annotated[
    bool,
    typer.Option(
        "--ray",
        help="Run on a Ray cluster with Ray Data (pip install 'derender[ray]'); one engine per actor.",
        rich_help_panel="Ray",
    ),
]
RayAddressOpt = Annotated[
    str | None,
    typer.Option(
        "--ray-address",
        metavar="ADDRESS",
        help="Cluster to join, as ray.init(address=...) takes it. Default: a local cluster.",
        rich_help_panel="Ray",
    ),
]
RayActorsOpt = Annotated[
    int | None,
    typer.Option(
        "--ray-actors",
        min=1,
        metavar="N",
        help="Actors (engines) in the pool. Default: the cluster's CPUs less one, at least one.",
        rich_help_panel="Ray",
    ),
]


@dataclasses.dataclass(frozen=True)
class RunFlags:
    """How records are judged and reported: the flags every command shares."""

    quiet: bool = False
    lenient: bool = False
    fail_fast: bool = False
    errors: Path | None = None
    verbose: bool = False


@dataclasses.dataclass(frozen=True)
class Scale:
    """How a command runs: where, on how many workers, resuming or not."""

    workers: int | None = None
    resume: bool = False
    ray: bool = False
    ray_address: str | None = None
    ray_actors: int | None = None


def with_render_options(command: Callable[..., int]) -> Callable[..., None]:
    """Give a command every render-server flag; they reach it as one
    `RenderConfig`, built from ``--config`` and the flags given."""
    own = [p for p in inspect.signature(command).parameters.values() if p.name != "config"]
    extra = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation, default=None)
        for name, annotation in _RENDER_OPTIONS.items()
    ]

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> None:
        config_path = kwargs.pop("config")
        flags = {name: kwargs.pop(name) for name in _RENDER_OPTIONS if name != "config"}
        console = Console(stderr=True, highlight=False, soft_wrap=True)
        verbose = bool(kwargs.get("verbose"))
        try:
            config = render_config(config_path, flags)
            code = command(config=config, console=console, **kwargs)
        except DerenderError as exc:
            console.print(f"derender: error: {exc}", markup=False)
            raise typer.Exit(exc.exit_status) from None
        except KeyboardInterrupt:
            # A second Ctrl-C: stop at once; whole lines are written whole.
            console.print("derender: aborted", markup=False)
            _discard_stdout()
            raise typer.Exit(130) from None
        except BrokenPipeError:
            # The reader went away (`| head`): stop quietly, as shell tools
            # do, and keep Python's exit-time flush from failing again.
            _discard_stdout()
            raise typer.Exit(141) from None
        except StreamFailure as exc:
            # Closing an output failed after the run (a gzip trailer on a full disk).
            console.print(f"derender: the run could not finish: {exc}", markup=False)
            _discard_stdout()
            raise typer.Exit(exc.exit_status) from None
        except Exception as exc:
            # Not the input's fault: a bug. The exit status says the run
            # could not finish, never "some records failed".
            if verbose:
                console.print(traceback.format_exc(), markup=False)
            console.print(
                f"derender: internal error, the run could not finish: {type(exc).__name__}: {exc}"
                + ("" if verbose else " (--verbose shows the traceback)"),
                markup=False,
            )
            raise typer.Exit(ExitStatus.INCOMPLETE) from None
        if code == ExitStatus.INCOMPLETE:
            _discard_stdout()
        raise typer.Exit(code)

    wrapper.__signature__ = inspect.Signature([p for p in own if p.name != "console"] + extra)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {
        **{p.name: p.annotation for p in own if p.name != "console"},
        **_RENDER_OPTIONS,
    }
    return wrapper


def render_config(config_path: Path | str | None, flags: dict[str, Any]) -> RenderConfig:
    """The settings a command runs with: ``--config``, then the flags given."""
    config = RenderConfig.from_yaml(config_path) if config_path else RenderConfig()
    return config.overridden_by(flags)


WarmEngines = Callable[[RenderConfig], DerenderEngine | None]
warm_engines: WarmEngines | None = None
"""Set by the warm server (``cli/server.py``) in the child it forks per
call: the engine it already built for these settings, if any."""


def _build_engine(
    engine_class: type[DerenderEngine], config: RenderConfig, live: bool, decode: str = "fast"
) -> tuple[DerenderEngine, str]:
    """The engine for the run, and how the summary names its start-up:
    the warm server's, when it holds one for exactly these settings."""
    if warm_engines is not None and engine_class is DerenderEngine:
        started = time.perf_counter()
        engine = warm_engines(config)
        if engine is not None:
            engine = engine.in_mode(live=live, decode=decode)
            engine.startup_seconds = time.perf_counter() - started
            return engine, "model (warm)"
    return engine_class.build(config, live=live, decode=decode), "model"


def _discard_stdout() -> None:
    """Point stdout at /dev/null, so that Python's exit-time flush of bytes
    a closed pipe or a full disk refused does not fail a second time."""
    with contextlib.suppress(OSError, ValueError, io.UnsupportedOperation):
        stdout = sys.stdout.fileno()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stdout)
        os.close(devnull)


def _derender(
    config: RenderConfig,
    console: Console,
    input_paths: list[str],
    output: str,
    job_endpoint: Endpoint,
    requests_path: Path | None,
    flags: RunFlags,
    scale: Scale,
    stream_format: OutputFormat | None = None,
    live: bool = False,
    flavor: Flavor = Flavor.derender,
    decode: DecodeMode = DecodeMode("fast"),
) -> int:
    """Open everything the run needs, cheapest checks first, then run it:
    each input in turn, on one engine (and one pool of workers)."""
    plan = _plan_outputs(input_paths, output, stream_format, scale.resume)
    errors_path = str(flags.errors) if flags.errors is not None else None
    if errors_path == "-":
        raise InputError("--errors needs a file path: stdout carries the output")
    manifested = [out for _, out, directory in plan if directory is None and keeps_manifest(out)]
    refuse_overwriting(
        [*(("INPUT", path) for path in input_paths), ("--requests", None if requests_path is None else str(requests_path))],
        [*(("-o", out) for _, out, _ in plan), ("--errors", errors_path),
         *((f"the manifest of {out}", manifest_path(out)) for out in manifested)],
    )  # fmt: skip
    for path in input_paths:
        # exists, not isfile: a pipe (`<(zcat ...)`, /dev/stdin) is an input too.
        if path != "-" and not os.path.exists(path):
            raise InputError(f"cannot open input {path}: no such file")
        check_input(path)
    if not scale.ray and scale.workers is not None:
        check_workers(scale.workers)
    engine_class = DerenderEngine
    if flavor is Flavor.serve:
        # The serve path drives a live AsyncLLM on its own event loop, which
        # neither a fork nor a Ray actor's pickling carries over.
        if scale.ray:
            raise InputError("--flavor serve runs on this machine: drop --ray")
        if scale.workers not in (None, 1):
            raise InputError("--flavor serve runs in one process: drop --workers or use --workers 1")
        scale = dataclasses.replace(scale, workers=1)
        engine_class = ServeEngine
    if scale.ray:
        summary = _derender_on_ray(
            config, plan, job_endpoint, requests_path, flags, scale, stream_format, live, decode.value
        )  # fmt: skip
    else:
        manifests = {
            out: _checked_manifest(config, path, out, job_endpoint, requests_path, flags, scale, stream_format, flavor)
            for path, out, directory in plan
            if out in manifested and stream_format in (None, OutputFormat.jsonl)
        }
        # -o DIR/ names its outputs: say which it replaces (-o FILE names its own).
        replaced = [out for _, out, directory in plan if out != output and not scale.resume and os.path.exists(out)]
        if replaced and not flags.quiet:
            console.print(
                f"derender: replacing {len(replaced)} output(s) in {output} that an earlier run left "
                "(--resume continues them instead)",
                markup=False,
            )
        summary = _derender_here(
            config, plan, job_endpoint, requests_path, flags, console, scale, stream_format, live, engine_class,
            manifests, decode.value,
        )  # fmt: skip
    _summarise(console, summary, flags)
    return summary.return_code


def _checked_manifest(
    config: RenderConfig,
    input_path: str,
    output: str,
    endpoint: Endpoint,
    requests_path: Path | None,
    flags: RunFlags,
    scale: Scale,
    stream_format: OutputFormat | None,
    flavor: Flavor,
) -> tuple[Manifest, Manifest | None]:
    """The manifest this run writes for `output`, and with --resume the
    earlier run's, once it is known to describe this run (before the model
    loads: a mismatch is a usage error)."""
    stream = stream_format is not None
    now = run_manifest(
        config, input_path,
        command="stream" if stream else endpoint.value, endpoint=endpoint.value, flavor=flavor.value,
        lenient=flags.lenient, requests=None if requests_path is None else str(requests_path),
    )  # fmt: skip
    earlier = check_resume(output, now) if scale.resume else None
    if earlier is not None:
        check_input_prefix(input_path, Job(endpoint, stream=stream), output, earlier)
    return now, earlier


def _summarise(console: Console, summary: Summary, flags: RunFlags) -> None:
    """The summary, unless --quiet; a run that could not finish says so even then."""
    if not flags.quiet:
        print_summary(console, summary, verbose=flags.verbose)
    for path, report in summary.reports:
        if report.unfinished is None:
            continue
        output = summary.outputs.get(path, "-")
        shown = "stdout" if output == "-" else output
        written = "" if report.written is None else f"; {report.written:,} written in full to {shown}"
        where = f" ({path})" if len(summary.reports) > 1 else ""
        console.print(
            f"derender: the run could not finish{where}: {report.unfinished}. "
            f"{report.records:,} records were answered{written}.",
            markup=False,
        )


def _derender_here(
    config: RenderConfig,
    plan: list[tuple[str, str, Path | None]],
    job_endpoint: Endpoint,
    requests_path: Path | None,
    flags: RunFlags,
    console: Console,
    scale: Scale,
    stream_format: OutputFormat | None,
    live: bool,
    engine_class: type[DerenderEngine] = DerenderEngine,
    manifests: dict[str, tuple[Manifest, Manifest | None]] | None = None,
    decode: str = "fast",
) -> Summary:
    """On this machine: one engine, forked into workers, for every input."""
    summary = Summary()
    with contextlib.ExitStack() as resources:
        requests = None
        if requests_path is not None:
            requests = RequestIndex(str(requests_path))
            resources.callback(requests.close)
        error_log = None
        if flags.errors is not None:
            error_log = ErrorLog(resources.enter_context(open_output(str(flags.errors))), plan[0][0])
        progress = resources.enter_context(ProgressDisplay(console, enabled=not flags.quiet))
        progress.loading(config.model or "")
        engine, startup_name = _build_engine(engine_class, config, live, decode)
        resources.callback(engine.close)
        summary.startup[startup_name] = engine.startup_seconds
        job = Job(
            endpoint=job_endpoint,
            stream=stream_format is not None,
            requests=requests,
            lenient=flags.lenient,
            verbose=flags.verbose,
        )
        workers = scale.workers or usable_cpus()
        outcomes = None
        if workers > 1:
            pool = resources.enter_context(WorkerPool(engine, workers, requests))
            summary.startup[f"{workers} workers"] = pool.startup_seconds
            whole = stream_format in (None, OutputFormat.jsonl)
            outcomes = pool.answering(job, whole_stream_answers=whole)
        stop = resources.enter_context(stop_on_signals(progress.stopping))
        for input_path, output_path, directory in plan:
            if error_log is not None:
                error_log.input_name = input_path
            report = _derender_one(
                engine, job, input_path, output_path, directory, stream_format,
                outcomes, stop, progress, scale.resume, flags, error_log,
                (manifests or {}).get(output_path),
            )  # fmt: skip
            summary.add(input_path, report, output_path)
            if stop or report.unfinished is not None or report.stopped_at_failure:
                break
    return summary


def _derender_on_ray(
    config: RenderConfig,
    plan: list[tuple[str, str, Path | None]],
    endpoint: Endpoint,
    requests_path: Path | None,
    flags: RunFlags,
    scale: Scale,
    stream_format: OutputFormat | None,
    live: bool,
    decode: str = "fast",
) -> Summary:
    """``--ray``: the cluster reads and answers, this process writes."""
    from derender_core.ray_data import import_ray, run_on_ray

    import_ray()  # fails at start-up, with the install command, without Ray
    if requests_path is not None:
        raise InputError("--requests is not supported with --ray: put derender bodies in the input")
    if scale.resume:
        raise InputError("--resume is not supported with --ray: start afresh, or resume locally")
    if "-" in (path for path, _, _ in plan):
        raise InputError("--ray reads files the cluster can reach, not stdin")
    job = Job(endpoint=endpoint, stream=stream_format is not None, lenient=flags.lenient, verbose=flags.verbose)
    openers = [
        (path, functools.partial(_open_writer, output, directory, stream_format, endpoint, DerenderEngine))
        for path, output, directory in plan
    ]
    with contextlib.ExitStack() as resources:
        error_log = None
        if flags.errors is not None:
            error_log = ErrorLog(resources.enter_context(open_output(str(flags.errors))), plan[0][0])
        reports, startup = run_on_ray(
            config, job, openers, address=scale.ray_address, actors=scale.ray_actors,
            whole_stream_answers=stream_format in (None, OutputFormat.jsonl), live=live, decode=decode,
            fail_fast=flags.fail_fast, error_log=error_log,
        )  # fmt: skip
    actors = sum(report.startup for _, report in reports)
    outputs = {path: output for path, output, _ in plan}
    return Summary(reports=reports, startup={"ray": startup, "actors": actors}, outputs=outputs)


def _derender_one(
    engine: DerenderEngine,
    job: Job,
    input_path: str,
    output: str,
    directory: Path | None,
    stream_format: OutputFormat | None,
    outcomes: OutcomeSource | None,
    stop: StopRequest,
    progress: ProgressDisplay,
    resume: bool,
    flags: RunFlags,
    error_log: ErrorLog | None,
    manifest: tuple[Manifest, Manifest | None] | None = None,
) -> Report:
    """Derender one input into one output (and its manifest)."""
    done = prepare_output(output) if resume else 0
    keeper = None if manifest is None else ManifestKeeper(output, *manifest, done=done)
    with contextlib.ExitStack() as resources:
        source = resources.enter_context(open_records(input_path, job))
        writer = resources.enter_context(
            _open_writer(output, directory, stream_format, job.endpoint, engine, append=done > 0)
        )
        records: Any = until_stopped(source.records, stop)
        if keeper is not None:
            records = keeper.track(records)
        if done:
            # The skipped records' answers: a stream's states, and the
            # --errors lines of those that failed.
            answers = answers_in(output) if job.stream or error_log is not None else None
            records = skip_answered(records, done, answers)
            if error_log is not None:
                records = logged_restored(records, error_log)
        progress.start_input(input_path, source, done)

        def on_progress(report: Report) -> None:
            progress.update(report)
            if keeper is not None:
                keeper.update(writer.records_written)

        try:
            report = run(
                engine, records, job, writer,
                on_progress=on_progress, outcomes=outcomes,
                fail_fast=flags.fail_fast, error_log=error_log,
            )  # fmt: skip
        except RunIncomplete as incomplete:
            report = incomplete.report
    if keeper is not None:
        keeper.close(writer.records_written)
    report.stopped_by = stop.signal
    report.resumed = done
    return report


def _plan_outputs(
    input_paths: list[str], output: str, stream_format: OutputFormat | None, resume: bool
) -> list[tuple[str, str, Path | None]]:
    """Each input with its output path, and the directory for per-request
    SSE files (one input, ``--format sse``, ``-o DIR/``)."""
    try:
        is_directory = output != "-" and (output.endswith("/") or Path(output).is_dir())
    except OSError as exc:
        raise InputError(f"cannot use -o {output}: {exc.strerror or exc}") from None
    if resume and output == "-":
        raise InputError("--resume continues an output file: pass -o FILE or -o DIR/")
    if resume and stream_format not in (None, OutputFormat.jsonl):
        raise InputError(
            "--resume continues JSONL or Parquet outputs, one record per line; "
            f"--format {stream_format.value if stream_format else ''} output is written per request"
        )
    if not is_directory:
        if len(input_paths) > 1:
            raise InputError(
                f"{len(input_paths)} inputs need an output directory (-o DIR/), one output per input"
            )
        if is_parquet(output) and stream_format not in (None, OutputFormat.jsonl):
            raise InputError("a .parquet output holds one row per record: use --format jsonl")
        return [(input_paths[0], output, None)]
    if len(input_paths) == 1 and stream_format is OutputFormat.sse:
        if resume:
            raise InputError("--resume continues JSONL or Parquet outputs, not per-request SSE files")
        return [(input_paths[0], output, Path(output))]
    if "-" in input_paths:
        raise InputError("-o DIR/ names each output after its input, and stdin has no name")
    names = [output_name(path, stream_format.value if stream_format else None) for path in input_paths]
    if len(set(names)) < len(names):
        raise InputError("two inputs would write the same output name in " + output)
    return [(path, str(Path(output) / name), None) for path, name in zip(input_paths, names, strict=True)]


@contextlib.contextmanager
def _open_writer(
    output: str,
    directory: Path | None,
    stream_format: OutputFormat | None,
    endpoint: Endpoint,
    engine: Any,
    append: bool = False,
) -> Iterator[Writer]:
    """The writer for the output format, over the opened output."""
    if directory is not None:
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InputError(f"cannot write to {directory}/: {exc.strerror or exc}") from None
        yield SseWriter(directory=directory)
        return
    if is_parquet(output):
        yield ParquetWriter(output, resume=append)
        return
    with open_output(output, append=append) as target:
        if stream_format is OutputFormat.sse:
            yield SseWriter(target=target)
        elif stream_format is OutputFormat.assembled:
            finish = engine.chat_response if endpoint is Endpoint.CHAT else engine.completion_response
            yield AssembledWriter(target, endpoint, finish)
        else:
            yield JsonlWriter(target)


def _one_shot_command(endpoint: Endpoint, doc: str) -> Callable[..., None]:
    """`chat` and `completion` differ only in their endpoint."""

    def command(
        input_path: InputArg,
        output: OutputOpt = "-",
        requests: RequestsOpt = None,
        flavor: FlavorOpt = Flavor.derender,
        lenient: LenientOpt = False,
        fail_fast: FailFastOpt = False,
        errors: ErrorsOpt = None,
        verbose: VerboseOpt = False,
        quiet: QuietOpt = False,
        workers: WorkersOpt = None,
        resume: ResumeOpt = False,
        ray: RayOpt = False,
        ray_address: RayAddressOpt = None,
        ray_actors: RayActorsOpt = None,
        decode: DecodeOpt = DecodeMode("fast"),
        *,
        config: RenderConfig,
        console: Console,
    ) -> int:
        flags = RunFlags(quiet, lenient, fail_fast, errors, verbose)
        scale = Scale(workers, resume, ray, ray_address, ray_actors)
        return _derender(
            config, console, input_path, output, endpoint, requests, flags, scale, flavor=flavor, decode=decode
        )

    command.__doc__ = doc
    return with_render_options(command)


app.command("chat")(
    _one_shot_command(
        Endpoint.CHAT,
        """Derender one-shot chat completions.

        Each input line is the JSON body of POST /v1/chat/completions/derender
        (or, with --requests, a bare GenerateResponse). Output line i is the
        ChatCompletionResponse, or the server's error, for input record i.
        """,
    )
)
app.command("completion")(
    _one_shot_command(
        Endpoint.COMPLETION,
        """Derender one-shot completions.

        Each input line is the JSON body of POST /v1/completions/derender (or,
        with --requests, a bare GenerateResponse). Output line i is the
        CompletionResponse, or the server's error, for input record i.
        """,
    )
)


@app.command()
@with_render_options
def stream(
    input_path: InputArg,
    output: Annotated[
        str,
        typer.Option(
            "--output",
            "-o",
            metavar="PATH",
            help="Where to write; - for stdout. A .gz or .zst path is compressed, a .parquet "
            "path gets Parquet rows (--format jsonl). DIR/: with one input and --format sse, "
            "one .sse file per request; otherwise one output per input, named after it.",
        ),
    ] = "-",
    output_format: Annotated[
        OutputFormat,
        typer.Option(
            "--format",
            help="jsonl: the endpoint's answer per call ({chunk, stream_state}; "
            "with --flavor serve, {chunks}: the chunks serve sent during that call). "
            "sse: per request, the SSE transcript vllm serve would stream. "
            "assembled: per request, one response built from its stream.",
        ),
    ] = OutputFormat.jsonl,
    mode: Annotated[
        StreamMode,
        typer.Option(
            "--mode",
            help="live: each stream's parser kept between calls, O(n) per stream; "
            "answers and states equal replay's. replay: every call through vLLM's "
            "own per-call path, O(n) per call, for bug-for-bug reproduction of the "
            "render server. Not used with --flavor serve.",
        ),
    ] = StreamMode.live,
    endpoint: Annotated[
        Endpoint, typer.Option("--endpoint", help="Which derender endpoint the calls go to.")
    ] = Endpoint.CHAT,
    requests: RequestsOpt = None,
    flavor: FlavorOpt = Flavor.derender,
    lenient: LenientOpt = False,
    fail_fast: FailFastOpt = False,
    errors: ErrorsOpt = None,
    verbose: VerboseOpt = False,
    quiet: QuietOpt = False,
    workers: WorkersOpt = None,
    resume: ResumeOpt = False,
    ray: RayOpt = False,
    ray_address: RayAddressOpt = None,
    ray_actors: RayActorsOpt = None,
    decode: DecodeOpt = DecodeMode("fast"),
    *,
    config: RenderConfig,
    console: Console,
) -> int:
    """Derender streams, one call per generate stream chunk.

    Each input line is the JSON body of a streaming derender call
    (stream: true, generate_chunk, ...), or with --requests a bare generate
    stream chunk or a line of a raw /inference/v1/generate SSE capture.
    stream_state is threaded per (request_id, choice index) unless a body
    carries its own.
    """
    return _derender(
        config,
        console,
        input_path,
        output,
        endpoint,
        requests,
        RunFlags(quiet, lenient, fail_fast, errors, verbose),
        Scale(workers, resume, ray, ray_address, ray_actors),
        stream_format=output_format,
        live=mode is StreamMode.live,
        flavor=flavor,
        decode=decode,
    )


class ParsersFormat(str, Enum):
    markdown = "markdown"
    jsonl = "jsonl"


@app.command()
def parsers(
    output_format: Annotated[
        ParsersFormat,
        typer.Option(
            "--format",
            help="markdown: the README's coverage table. jsonl: one JSON object per parser.",
        ),
    ] = ParsersFormat.markdown,
) -> None:
    """List vLLM's registered tool and reasoning parsers and what the test
    suite proves for each.

    Per parser: the model families it is tested on against a real render
    server (one-shot, streaming, live), the vLLM misbehaviour pinned by a
    test, and what it does with a plain answer on the bundled Qwen3 sample
    (whether it at least loads and passes text through). Parsers registered
    by this vLLM but not in the recorded data show as "not probed".
    """
    import json
    import warnings

    from derender_core.coverage import markdown_table, table_rows

    with warnings.catch_warnings():
        # Importing vLLM imports torch, whose deprecation and device warnings
        # say nothing about a list of parsers.
        warnings.simplefilter("ignore")
        from derender_core.vllm_seam.stack import registered_parsers

        rows = table_rows(registered_parsers())
    if output_format is ParsersFormat.jsonl:
        for row in rows:
            typer.echo(json.dumps(row, ensure_ascii=False))
    else:
        typer.echo(markdown_table(rows))


IgnoreOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--ignore",
        metavar="FIELD",
        help="A field not to compare (content, reasoning, tool_calls, finish_reason, "
        "stop_reason, usage, logprobs, system_fingerprint, role_frame, empty_frames, "
        "finish_frame, null_fields, stop_logic, ...); repeat for several.",
    ),
]
ReportOpt = Annotated[
    str | None,
    typer.Option(
        "--report",
        metavar="FILE.jsonl",
        help="Write one JSON line per divergence: request_id, index, left, right, field, "
        "left_value, right_value (and chunking, where one applies).",
    ),
]
CreatedOpt = Annotated[
    bool,
    typer.Option("--ignore-created/--compare-created", help="Whether `created` timestamps are compared."),
]
IdsOpt = Annotated[
    bool,
    typer.Option(
        "--ignore-ids/--compare-ids",
        help="Whether response ids and random tool-call ids (vLLM's chatcmpl-tool-<hex>, "
        "xLAM's call_<n>_<hex>, Mistral's 9 characters) are compared.",
    ),
]
NullOpt = Annotated[
    bool,
    typer.Option(
        "--null-is-absent/--null-is-not-absent",
        help="Whether a field set to null equals a field left out (the per-frame field "
        "selection is still compared, as null_fields).",
    ),
]


@contextlib.contextmanager
def _comparison_output(console: Console, report: str | None, quiet: bool) -> Iterator[list[Divergence]]:
    """Collects divergences; on the way out, the table and the report."""
    found: list[Divergence] = []
    yield found
    if report is not None:
        write_report(report, found)
    if not quiet:
        print_table(console, found)


@app.command()
@with_render_options
def parity(
    input_path: OneInputArg,
    endpoint: Annotated[
        Endpoint, typer.Option("--endpoint", help="Chat or completion requests.")
    ] = Endpoint.CHAT,
    paths: Annotated[
        list[str] | None,
        typer.Option(
            "--paths",
            metavar="PATH,...",
            help=f"Which paths run: {', '.join(PATHS)} (all by default).",
        ),
    ] = None,
    chunking: Annotated[
        str,
        typer.Option(
            "--chunking",
            metavar="SPEC,...",
            help="For one-shot input: how the stream paths cut the tokens into chunks: "
            "N tokens per chunk, 'tail' (one per chunk, then the finish reason on a chunk "
            "of its own) or 'N+tail'; each spec is one run.",
        ),
    ] = "1",
    ignore: IgnoreOpt = None,
    report: ReportOpt = None,
    requests: RequestsOpt = None,
    stream: Annotated[
        bool,
        typer.Option("--stream", help="With --requests: INPUT holds generate stream chunks (or a raw SSE capture)."),
    ] = False,
    recorded: Annotated[
        str | None,
        typer.Option(
            "--from-serve",
            metavar="RECORDED",
            help="Recorded vllm serve answers (non-stream JSONL, or SSE transcripts: a file or a "
            "directory of <request_id>.sse) made with return_token_ids: true; INPUT is then the "
            "requests file (request_id, chat_request or completion_request, prompt_token_ids). "
            "The answers' tokens run through every path and each path is compared with the recording.",
        ),
    ] = None,
    ignore_created: CreatedOpt = True,
    ignore_ids: IdsOpt = True,
    null_is_absent: NullOpt = True,
    quiet: QuietOpt = False,
    *,
    config: RenderConfig,
    console: Console,
) -> int:
    """Run the same token ids through every path and report where they differ.

    Paths: oneshot (the one-shot derender endpoint), reference (the same on
    vLLM's own per-token decode), replay and live (the streaming derender
    endpoint in each mode, assembled; replay is vLLM's own path), serve and
    serve-oneshot (vllm serve's own handlers, streamed and not). Exit 1 when
    any divergence remains (or a record cannot be compared), 0 when none.
    """
    selected = _parity_paths(paths)
    chunkings = Chunking.parse_list(chunking)
    normalization = Normalization(ignore_created, ignore_ids, null_is_absent)
    requests_seen = skipped = 0
    with contextlib.ExitStack() as resources:
        engines = _parity_engines(config, selected, resources)
        checker = Parity(engines, endpoint, ignore=ignore or (), normalization=normalization)
        if recorded is not None:
            index = RequestIndex(input_path)
            resources.callback(index.close)
            inputs = from_serve(read_items(recorded), endpoint, index)
        else:
            source = resources.enter_context(open_input(input_path))
            index = None
            if requests is not None:
                index = RequestIndex(str(requests))
                resources.callback(index.close)
            inputs = requests_of(iter_records(source), endpoint, stream=stream, requests=index, chunkings=chunkings)
        with _comparison_output(console, report, quiet) as found:
            for request in inputs:
                requests_seen += 1
                if request.problem is not None:
                    skipped += 1
                    console.print(f"derender: parity: {request.request_id}: not compared: {request.problem}", markup=False)
                    continue
                found += checker.run(request)
    if not quiet:
        console.print(
            f"derender: parity: {requests_seen} requests, {len(found)} divergences, "
            f"{skipped} not compared; paths {', '.join(selected)}",
            markup=False,
        )
    return ExitStatus.RECORDS_FAILED if found or skipped else ExitStatus.OK


def _parity_paths(paths: list[str] | None) -> list[str]:
    names = [name.strip() for value in paths or [",".join(PATHS)] for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in PATHS]
    if unknown:
        raise ConfigError(f"--paths: unknown path {unknown[0]!r}. Valid paths: {', '.join(PATHS)}.")
    if len(set(names)) < 2:
        raise ConfigError("--paths: name at least two paths to compare")
    return [name for name in PATHS if name in names]


def _parity_engines(config: RenderConfig, paths: list[str], resources: contextlib.ExitStack) -> dict[str, Derenderer]:
    """One render stack for the derender paths, one serve stack for the serve paths."""
    engines: dict[str, Derenderer] = {}
    if set(DERENDER_MODES) & set(paths):
        derender, _ = _build_engine(DerenderEngine, config, live=False)
        resources.callback(derender.close)
        engines.update({path: derender.in_mode(**DERENDER_MODES[path]) for path in paths if path in DERENDER_MODES})
    if {"serve", "serve-oneshot"} & set(paths):
        serve = ServeEngine.build(config)
        resources.callback(serve.close)
        engines.update({path: serve for path in paths if path.startswith("serve")})
    return {path: engines[path] for path in paths}


@app.command()
def diff(
    expected: Annotated[str, typer.Argument(metavar="EXPECTED", help="Responses, stream answers or SSE transcripts (file or directory of .sse).")],
    actual: Annotated[str, typer.Argument(metavar="ACTUAL", help="The same requests' answers to compare.")],
    ignore: IgnoreOpt = None,
    report: ReportOpt = None,
    ignore_created: CreatedOpt = True,
    ignore_ids: IdsOpt = True,
    null_is_absent: NullOpt = True,
    quiet: QuietOpt = False,
) -> None:
    """Compare two files of answers request by request.

    Each side is one-shot responses (JSONL, error records included), stream
    answers (derender stream jsonl, {chunk, stream_state} or {chunks} per
    line) or SSE transcripts (a file, or a directory of <request_id>.sse).
    Streams are grouped by their chunks' id and compared assembled and by
    shape. Requests pair up in order, or by file name for two directories.
    Exit 1 when any divergence remains, 0 when none, 4 when an input holds
    no answer at all.
    """
    console = Console(stderr=True, highlight=False, soft_wrap=True)
    normalization = Normalization(ignore_created, ignore_ids, null_is_absent)
    try:
        sides = {expected: list(read_items(expected)), actual: list(read_items(actual))}
        empty = [path for path, items in sides.items() if not any(item.holds_answer for item in items)]
        if empty:
            # "0 divergences" would read as agreement; nothing can be compared.
            console.print(f"derender: diff: no answers in {' or '.join(empty)}: nothing to compare", markup=False)
            raise typer.Exit(ExitStatus.NO_ANSWERS)
        with _comparison_output(console, report, quiet) as found:
            found += diff_items(
                sides[expected],
                sides[actual],
                by_key=Path(expected).is_dir() and Path(actual).is_dir(),
                ignore=ignore or (),
                normalization=normalization,
            )
    except DerenderError as exc:
        console.print(f"derender: error: {exc}", markup=False)
        raise typer.Exit(ExitStatus.USAGE) from None
    if not quiet:
        console.print(f"derender: diff: {len(found)} divergences", markup=False)
    raise typer.Exit(ExitStatus.RECORDS_FAILED if found else ExitStatus.OK)


server_app = typer.Typer(
    name="server",
    help=(
        "A per-user warm server for shell pipelines: it keeps vLLM imported and built "
        "engines in memory, and answers every chat, completion, stream, parity and diff "
        "call while it runs (pass --no-server, or set DERENDER_NO_SERVER=1, to run one "
        "fresh). Output and exit statuses are a fresh process's."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
app.add_typer(server_app)


@server_app.command("start")
def server_start(
    idle_timeout: Annotated[
        str,
        typer.Option("--idle-timeout", metavar="DURATION", help="Exit after this long without calls: 90s, 15m, 2h; 0 never."),
    ] = "30m",
    engines: Annotated[
        int,
        typer.Option("--engines", min=1, metavar="N", help="Built engines kept (least recently used out first); each holds a tokenizer, ~1.4 GB for Qwen3."),
    ] = 2,
) -> None:
    """Start the server in the background; returns once it answers."""
    from .server import start

    raise typer.Exit(start(idle_timeout, engines))


@server_app.command("status")
def server_status() -> None:
    """Show the engines held, memory and idle time; exit 0 only while a server runs."""
    from .server import status

    raise typer.Exit(status())


@server_app.command("stop")
def server_stop() -> None:
    """Stop the server and every call it is answering."""
    from .server import stop

    raise typer.Exit(stop())


def version_callback(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"derender {version('derender')}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool,
        typer.Option("--version", callback=version_callback, is_eager=True, help="Show the version."),
    ] = False,
) -> None:
    """Turn generate output back into OpenAI responses, offline."""


def main(argv: list[str] | None = None) -> None:
    """Console entry point."""
    app(args=argv, prog_name="derender")


if __name__ == "__main__":
    main()
