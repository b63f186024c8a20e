"""The `derender` command: a thin Typer layer over `derender_core`.

It parses flags (`options`), hands the job to the core (`jobs.run_job`,
`jobs.run_parity`), shows progress and the summary on stderr
(`progress`), and exits with the status the core decides (`ExitStatus`):
0 all records fine, 1 some records got error records, 2 usage or
configuration error (nothing processed), 3 the run could not finish (an
input or output failed mid-run, a worker died), 4 (`diff`) an input holds
no answer, 128 + N stopped by signal N (Ctrl-C: 130).
vLLM is imported only once a command runs, never for ``--help``.
"""

import contextlib
import dataclasses
import functools
import inspect
import io
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from derender_core import (
    DerenderError,
    Endpoint,
    ExitStatus,
    Normalization,
    RenderConfig,
    StreamFailure,
    read_items,
)
from derender_core.jobs import JobSpec, ParitySpec, RunStopped, WarmEngines, run_job, run_parity
from derender_core.minimize import DEFAULT_STEPS, Minimal
from derender_core.outputs import RunPaths
from derender_core.parity import PATHS, Chunking
from derender_core.responses import ACTUAL, EXPECTED, diff_examinations

from . import options as opt
from .control import server_app
from .options import (
    COMPARE_OPTIONS,
    JOB_OPTIONS,
    RENDER_JOB_OPTIONS,
    RENDER_OPTIONS,
    job_fields,
    render_config,
)
from .progress import ProgressDisplay, print_log_kinds, print_outcome
from .report import Findings, print_minimal, print_minimized, print_table, write_page, write_report

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

warm_engines: WarmEngines | None = None
"""Set by the warm server (``cli/server.py``) in the child it forks per
call: the engine it already built for these settings, if any."""


def with_shared_options(options: dict[str, tuple[Any, Any]], into: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a command a set of flags several commands take (name: (type,
    default)); they reach it as one dict, its keyword argument `into`."""

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        own = [p for p in inspect.signature(command).parameters.values() if p.name != into]
        extra = [
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation, default=default)
            for name, (annotation, default) in options.items()
        ]

        @functools.wraps(command)
        def wrapper(**kwargs: Any) -> Any:
            kwargs[into] = {name: kwargs.pop(name) for name in options}
            return command(**kwargs)

        wrapper.__signature__ = inspect.Signature(own + extra)  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in own + extra}
        return wrapper

    return decorate


def with_render_options(command: Callable[..., int]) -> Callable[..., None]:
    """Give a command every render-server flag; they reach it as one
    `RenderConfig`, built from ``--config`` and the flags given."""
    own = [p for p in inspect.signature(command).parameters.values() if p.name not in ("config", "console")]
    extra = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation, default=None)
        for name, annotation in RENDER_OPTIONS.items()
    ]

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> None:
        config_path = kwargs.pop("config")
        flags = {name: kwargs.pop(name) for name in RENDER_OPTIONS if name != "config"}
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

    wrapper.__signature__ = inspect.Signature(own + extra)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in own + extra}
    return wrapper


def _discard_stdout() -> None:
    """Point stdout at /dev/null, so that Python's exit-time flush of bytes
    a closed pipe or a full disk refused does not fail a second time."""
    if sys.stdout is None:  # closed when the run began: nothing to flush
        return
    with contextlib.suppress(OSError, ValueError, io.UnsupportedOperation):
        stdout = sys.stdout.fileno()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stdout)
        os.close(devnull)


def _derender(config: RenderConfig, console: Console, job: dict[str, Any], **fields: Any) -> int:
    """The job, with progress on stderr while it runs and the summary after."""
    spec = JobSpec(**fields, **job_fields(job))
    with ProgressDisplay(console, enabled=not job["quiet"]) as progress:
        summary = run_job(config, spec, progress, warm=warm_engines)
    print_outcome(console, summary, quiet=job["quiet"], verbose=spec.verbose)
    return summary.return_code


def _one_shot_command(
    endpoint: Endpoint, doc: str, options: dict[str, tuple[Any, Any]] = JOB_OPTIONS
) -> Callable[..., None]:
    """`chat`, `completion`, `render chat|completion|messages|responses`,
    `tokenize` and `detokenize` differ only in their endpoint (and the job
    flags a render takes)."""

    def command(
        input_path: opt.InputArg, output: opt.OutputOpt = "-", *, config: RenderConfig, console: Console, job: dict[str, Any]
    ) -> int:
        return _derender(config, console, job, inputs=input_path, output=output, endpoint=endpoint)

    command.__doc__ = doc
    return with_render_options(with_shared_options(options, "job")(command))


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
@with_shared_options(JOB_OPTIONS, "job")
def stream(
    input_path: opt.InputArg,
    output: opt.StreamOutputOpt = "-",
    output_format: opt.FormatOpt = opt.OutputFormat.jsonl,
    mode: opt.ModeOpt = opt.StreamMode.live,
    replay: opt.ReplayOpt = opt.ReplayMode.fast,
    endpoint: opt.EndpointOpt = opt.DerenderEndpoint.chat,
    *,
    config: RenderConfig,
    console: Console,
    job: dict[str, Any],
) -> int:
    """Derender streams, one call per generate stream chunk.

    Each input line is the JSON body of a streaming derender call
    (stream: true, generate_chunk, ...), or with --requests a bare generate
    stream chunk or a line of a raw /inference/v1/generate SSE capture.
    stream_state is threaded per (request_id, choice index) unless a body
    carries its own.
    """
    return _derender(
        config, console, job, inputs=input_path, output=output, endpoint=Endpoint(endpoint.value),
        stream_format=output_format.value, live=mode is opt.StreamMode.live, replay=replay.value,
    )  # fmt: skip


render_app = typer.Typer(
    name="render",
    help="Render requests into the prompt token ids a token-in engine takes, "
    "as the render server's /v1/chat/completions/render, /v1/completions/render, "
    "/v1/messages/render and /v1/responses/render do.",
    no_args_is_help=True,
    rich_markup_mode=None,
)


# The render server's other endpoints, a command each with its help.
_RENDER_CHAT_HELP = """Render chat completion requests.

        Each input line is the JSON body of POST /v1/chat/completions/render (an
        OpenAI chat completion request). Output line i is the GenerateRequest
        (prompt token_ids, sampling_params, ...), or the server's error, for
        input record i.
        """
_RENDER_COMPLETION_HELP = """Render completion requests.

        Each input line is the JSON body of POST /v1/completions/render (an
        OpenAI completion request). Output line i is the list of
        GenerateRequests (one per prompt), or the server's error, for input
        record i.
        """
_RENDER_MESSAGES_HELP = """Render Anthropic Messages requests.

        Each input line is the JSON body of POST /v1/messages/render (an
        Anthropic Messages request). Output line i is the GenerateRequest, or
        the server's error, for input record i.
        """
_RENDER_RESPONSES_HELP = """Render OpenAI Responses requests.

        Each input line is the JSON body of POST /v1/responses/render (an
        OpenAI Responses request). Output line i is the GenerateRequest, or
        the server's error, for input record i.
        """
_TOKENIZE_HELP = """Tokenize prompts or chats, as the render server's /tokenize does.

        Each input line is the JSON body of POST /tokenize (a prompt, or
        messages rendered by the chat template). Output line i is the
        server's answer (tokens, count, max_model_len, token_strs), or its
        error, for input record i.
        """
_DETOKENIZE_HELP = """Detokenize token ids, as the render server's /detokenize does.

        Each input line is the JSON body of POST /detokenize (tokens). Output
        line i is the server's answer ({"prompt": text}), or its error, for
        input record i.
        """
_RENDER_COMMANDS: list[tuple[typer.Typer, str, Endpoint, str]] = [
    (render_app, "chat", Endpoint.RENDER_CHAT, _RENDER_CHAT_HELP),
    (render_app, "completion", Endpoint.RENDER_COMPLETION, _RENDER_COMPLETION_HELP),
    (render_app, "messages", Endpoint.RENDER_MESSAGES, _RENDER_MESSAGES_HELP),
    (render_app, "responses", Endpoint.RENDER_RESPONSES, _RENDER_RESPONSES_HELP),
    (app, "tokenize", Endpoint.TOKENIZE, _TOKENIZE_HELP),
    (app, "detokenize", Endpoint.DETOKENIZE, _DETOKENIZE_HELP),
]
for _owner, _name, _endpoint, _help in _RENDER_COMMANDS:
    _owner.command(_name)(_one_shot_command(_endpoint, _help, RENDER_JOB_OPTIONS))
app.add_typer(render_app)


@app.command()
def parsers(
    output_format: Annotated[
        opt.ParsersFormat,
        typer.Option(
            "--format",
            help="markdown: the coverage table of docs/families.md. jsonl: one JSON object per parser.",
        ),
    ] = opt.ParsersFormat.markdown,
) -> None:
    """List vLLM's registered tool and reasoning parsers and what the test
    suite proves for each.

    Per parser: the model families it is tested on against a real render
    server (one-shot, streaming, live), the vLLM misbehaviour pinned by a
    test, and what it does with a plain answer on the bundled Qwen3 sample
    (whether it at least loads and passes text through), as recorded for
    this vLLM release. Parsers registered by this vLLM but not in the
    recorded data show as "not probed", and a vLLM with no data recorded
    for it, or data recorded on another version of its release, is named
    on stderr.
    """
    import json
    import warnings

    from derender_core.coverage import markdown_table, probe_note, table_rows
    from derender_core.vllm_seam.versions import installed

    with warnings.catch_warnings():
        # Importing vLLM imports torch, whose deprecation and device warnings
        # say nothing about a list of parsers.
        warnings.simplefilter("ignore")
        from derender_core.vllm_seam.stack import registered_parsers

        rows = table_rows(registered_parsers())
    note = probe_note(installed())
    if note is not None:
        typer.echo(note, err=True)
    if output_format is opt.ParsersFormat.jsonl:
        for row in rows:
            typer.echo(json.dumps(row, ensure_ascii=False))
    else:
        typer.echo(markdown_table(rows))


@dataclasses.dataclass(frozen=True)
class Comparison:
    """What `parity` and `diff` compare, and where their findings go."""

    ignore: tuple[str, ...]
    normalization: Normalization
    report: str | None
    html: str | None
    quiet: bool

    @classmethod
    def of(cls, flags: dict[str, Any]) -> "Comparison":
        """From `options.COMPARE_OPTIONS` as given."""
        normalization = Normalization(flags["ignore_created"], flags["ignore_ids"], flags["null_is_absent"])
        return cls(tuple(flags["ignore"] or ()), normalization, flags["report"], flags["html"], flags["quiet"])

    @property
    def outputs(self) -> tuple[tuple[str, str | None], ...]:
        """The files the findings go to, by flag, for `RunPaths` to check
        with the run's other files before it starts."""
        return (("--report", self.report), ("--html", self.html))

    @contextlib.contextmanager
    def output(self, console: Console, title: str) -> Iterator[Findings]:
        """Collects findings; on the way out, the table, the report and the page."""
        found = Findings()
        yield found
        if self.report is not None and not found.report_written:
            write_report(self.report, found.divergences)
        if self.html is not None:
            write_page(self.html, title, found)
        if not self.quiet:
            print_table(console, found.tally())


@app.command()
@with_render_options
@with_shared_options(COMPARE_OPTIONS, "compare")
def parity(
    input_paths: opt.ParityInputArg,
    endpoint: Annotated[
        opt.DerenderEndpoint, typer.Option("--endpoint", help="Chat or completion requests.")
    ] = opt.DerenderEndpoint.chat,
    paths: opt.PathsOpt = None,
    chunking: opt.ChunkingOpt = "1",
    requests: opt.RequestsOpt = None,
    stream: opt.StreamInputOpt = False,
    recorded: opt.FromServeOpt = None,
    minimize: opt.MinimizeOpt = None,
    minimize_steps: opt.MinimizeStepsOpt = DEFAULT_STEPS,
    repro: opt.ReproOpt = None,
    minimize_all: opt.MinimizeAllOpt = False,
    workers: opt.ParityWorkersOpt = None,
    resume: opt.ParityResumeOpt = False,
    ray: opt.RayOpt = False,
    ray_address: opt.RayAddressOpt = None,
    ray_actors: opt.RayActorsOpt = None,
    *,
    config: RenderConfig,
    console: Console,
    compare: dict[str, Any],
) -> int:
    """Run the same token ids through every path and report where they differ.

    Paths: oneshot (the one-shot derender endpoint), reference (the same on
    vLLM's own per-token decode), replay and live (the streaming derender
    endpoint in each mode, assembled; replay is vLLM's own path), serve and
    serve-oneshot (vllm serve's own handlers, streamed and not). Divergences
    are grouped into classes (pair of paths, field, a signature of the
    values). -j N runs the paths on N forked workers, --ray on a cluster;
    the report, the page and the minimal records are the same. Exit 1 when
    any divergence remains (or a record cannot be compared), 0 when none.
    """
    comparison = Comparison.of(compare)
    spec = ParitySpec(
        input_paths, Endpoint(endpoint.value), paths=paths or PATHS, chunkings=Chunking.parse_list(chunking),
        ignore=comparison.ignore, normalization=comparison.normalization,
        requests=None if requests is None else str(requests), stream=stream, recorded=recorded,
        examine=comparison.html is not None, minimize=minimize, minimize_steps=minimize_steps, repro=repro,
        every_minimal=minimize_all, report=comparison.report, keep_divergences=False, workers=workers or 1,
        resume=resume, ray=ray, ray_address=ray_address, ray_actors=ray_actors,
        outputs=(("--html", comparison.html),),
    )  # fmt: skip
    title = f"derender parity: {recorded or ' '.join(input_paths)}"
    try:
        with comparison.output(console, title) as found:
            found.report_written = True

            def skipped(request: Any) -> None:
                console.print(f"derender: parity: {request.request_id}: not compared: {request.problem}", markup=False)
                found.skipped.append((str(request.request_id), str(request.problem)))

            def minimized(minimal: Minimal) -> None:
                if not comparison.quiet:
                    print_minimal(console, minimal)

            with ProgressDisplay(console, enabled=not comparison.quiet) as progress:
                result = run_parity(config, spec, skipped, warm=warm_engines, on_minimized=minimized, observer=progress)
            found.classes, found.shown = result.classes, result.page_shown()
            found.examinations, found.pieces = result.examinations, result.pieces
            summary = (
                f"{result.requests} requests, {result.divergence_count} divergences, "
                f"{result.not_compared} not compared; paths {', '.join(spec.paths)}"
            )
            if result.resumed:
                summary += f"; {result.resumed} resumed"
            found.subtitle = summary  # the page says how its streams were cut, from what ran
    except RunStopped as stopped:
        # What was compared is in the report; the table and the page are not written.
        console.print(
            f"derender: parity: stopped after {stopped.result.requests} requests"
            + (f"; --resume continues {spec.report}" if spec.report not in (None, "-") else ""),
            markup=False,
        )
        return 128 + stopped.signum
    if not comparison.quiet:
        console.print(f"derender: parity: {summary}", markup=False)
        print_log_kinds(console, [(kind, f"request {first!r}") for kind, first in result.logs], "while the paths ran")
        if spec.minimizing:
            print_minimized(console, result.minimized, spec.minimize, spec.repro)
    return ExitStatus.RECORDS_FAILED if result.divergence_count or result.not_compared else ExitStatus.OK


@app.command()
@with_shared_options(COMPARE_OPTIONS, "compare")
def diff(
    expected: Annotated[str, typer.Argument(metavar="EXPECTED", help="Responses, stream answers or SSE transcripts (file or directory of .sse).")],
    actual: Annotated[str, typer.Argument(metavar="ACTUAL", help="The same requests' answers to compare.")],
    *,
    compare: dict[str, Any],
) -> None:
    """Compare two files of answers request by request.

    Each side is one-shot responses (JSONL, error records included), stream
    answers (derender stream jsonl, {chunk, stream_state} or {chunks} per
    line) or SSE transcripts (a file, or a directory of .sse transcripts, one per request).
    Streams are grouped by their chunks' id and compared assembled and by
    shape. Requests pair up in order, or by file name for two directories.
    Exit 1 when any divergence remains, 0 when none, 4 when an input holds
    no answer at all.
    """
    console = Console(stderr=True, highlight=False, soft_wrap=True)
    try:
        comparison = Comparison.of(compare)
        RunPaths((), comparison.outputs, read=[("EXPECTED", expected), ("ACTUAL", actual)])
        sides = {expected: list(read_items(expected)), actual: list(read_items(actual))}
        empty = [path for path, items in sides.items() if not any(item.holds_answer for item in items)]
        if empty:
            # "0 divergences" would read as agreement; nothing can be compared.
            console.print(f"derender: diff: no answers in {' or '.join(empty)}: nothing to compare", markup=False)
            raise typer.Exit(ExitStatus.NO_ANSWERS)
        with comparison.output(console, f"derender diff: {expected} vs {actual}") as found:
            found.examinations = list(
                diff_examinations(
                    sides[expected], sides[actual], by_key=Path(expected).is_dir() and Path(actual).is_dir(),
                    ignore=comparison.ignore, normalization=comparison.normalization,
                )
            )  # fmt: skip
            found.divergences = [d for examination in found.examinations for d in examination.divergences]
            found.subtitle = f"{EXPECTED}: {expected}; {ACTUAL}: {actual}; {len(found.examinations)} requests"
    except DerenderError as exc:
        console.print(f"derender: error: {exc}", markup=False)
        raise typer.Exit(ExitStatus.USAGE) from None
    except StreamFailure as exc:  # --report or --html could not be written
        console.print(f"derender: the run could not finish: {exc}", markup=False)
        _discard_stdout()
        raise typer.Exit(exc.exit_status) from None
    if not comparison.quiet:
        console.print(f"derender: diff: {len(found.divergences)} divergences", markup=False)
    raise typer.Exit(ExitStatus.RECORDS_FAILED if found.divergences else ExitStatus.OK)


app.add_typer(server_app)


def version_callback(value: bool) -> None:
    if value:
        from importlib.metadata import version

        from derender_core.vllm_seam.versions import describe

        typer.echo(f"derender {version('derender')}")
        typer.echo(describe())
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
