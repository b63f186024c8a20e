"""The `derender` command: a thin Typer layer over `derender_core`.

It parses flags, opens inputs and outputs, shows progress and the summary on
stderr, and maps errors to exit codes: 0 all records fine, 1 some records
got error records, 2 usage or configuration error (nothing processed).
vLLM is imported only once a command runs, never for ``--help``.
"""

import contextlib
import functools
import inspect
import os
import sys
from collections.abc import Callable, Iterator
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from derender_core import (
    AssembledWriter,
    DerenderEngine,
    DerenderError,
    Endpoint,
    InputError,
    Job,
    JsonlWriter,
    RenderConfig,
    RequestIndex,
    ServeEngine,
    SseWriter,
    Writer,
    iter_records,
    open_input,
    open_output,
    run,
)

from .progress import ProgressDisplay, print_summary

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
            ("model", str, "DIR", "Local model directory (tokenizer, config.json, generation_config.json)."),
            ("tokenizer", str, "DIR", "Tokenizer directory, if not the model's."),
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
    str,
    typer.Argument(
        metavar="INPUT",
        help="JSONL or SSE capture to read; - for stdin. Gzip is detected.",
        show_default=False,
    ),
]
OutputOpt = Annotated[
    str,
    typer.Option(
        "--output", "-o", metavar="PATH", help="Where to write; - for stdout. A .gz path is gzipped."
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
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No summary on stderr.")]
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
        try:
            config = RenderConfig.from_yaml(config_path) if config_path else RenderConfig()
            config = config.overridden_by(flags)
            code = command(config=config, console=console, **kwargs)
        except DerenderError as exc:
            console.print(f"derender: error: {exc}", markup=False)
            raise typer.Exit(2) from None
        except BrokenPipeError:
            # The reader went away (`| head`): stop quietly, as shell tools
            # do, and keep Python's exit-time flush from failing again.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise typer.Exit(141) from None
        raise typer.Exit(code)

    wrapper.__signature__ = inspect.Signature([p for p in own if p.name != "console"] + extra)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {
        **{p.name: p.annotation for p in own if p.name != "console"},
        **_RENDER_OPTIONS,
    }
    return wrapper


def _derender(
    config: RenderConfig,
    console: Console,
    input_path: str,
    output: str,
    job_endpoint: Endpoint,
    requests_path: Path | None,
    quiet: bool,
    stream_format: OutputFormat | None = None,
    live: bool = False,
    flavor: Flavor = Flavor.derender,
) -> int:
    """Open everything the run needs, cheapest checks first, then run it."""
    directory = _sse_directory(output, stream_format)
    with contextlib.ExitStack() as resources:
        source = resources.enter_context(open_input(input_path))
        requests = None
        if requests_path is not None:
            requests = RequestIndex(str(requests_path))
            resources.callback(requests.close)
        progress = resources.enter_context(ProgressDisplay(console, enabled=not quiet))
        progress.loading(config.model or "")
        engine_class = ServeEngine if flavor is Flavor.serve else DerenderEngine
        engine = engine_class.build(config, live=live)
        resources.callback(engine.close)
        job = Job(endpoint=job_endpoint, stream=stream_format is not None, requests=requests)
        writer = resources.enter_context(
            _open_writer(output, directory, stream_format, job_endpoint, engine)
        )
        report = run(engine, iter_records(source), job, writer, on_progress=progress.update)
    if not quiet:
        print_summary(console, report, engine.startup_seconds)
    return report.return_code


def _sse_directory(output: str, stream_format: OutputFormat | None) -> Path | None:
    """``-o DIR/`` (or an existing directory) asks for one file per request."""
    if output == "-" or not (output.endswith("/") or Path(output).is_dir()):
        return None
    if stream_format is not OutputFormat.sse:
        raise InputError(f"-o {output} is a directory; only --format sse writes one file per request")
    return Path(output)


@contextlib.contextmanager
def _open_writer(
    output: str,
    directory: Path | None,
    stream_format: OutputFormat | None,
    endpoint: Endpoint,
    engine: Any,
) -> Iterator[Writer]:
    """The writer for the output format, over the opened output."""
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
        yield SseWriter(directory=directory)
        return
    with open_output(output) as target:
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
        quiet: QuietOpt = False,
        *,
        config: RenderConfig,
        console: Console,
    ) -> int:
        return _derender(
            config, console, input_path, output, endpoint, requests, quiet, flavor=flavor
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
            help="Where to write; - for stdout; DIR/ for one .sse file per request.",
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
    quiet: QuietOpt = False,
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
        quiet,
        stream_format=output_format,
        live=mode is StreamMode.live,
        flavor=flavor,
    )


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
