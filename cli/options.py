"""The command line's flags, in vLLM's spelling where vLLM has them, and
how they become the core's settings. Importing this imports neither vLLM
nor the core's engines, so ``--help`` stays fast."""

from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer

from derender_core import RenderConfig
from derender_core.jobs import FLAVORS, STREAM_FORMATS
from derender_core.parity import PATHS
from derender_core.protocol import DERENDER_ENDPOINTS
from derender_core.vllm_seam.render import DECODE_MODES

RENDER_PANEL = "Render server flags (as `vllm launch render`)"


def _choices(name: str, values: tuple[str, ...]) -> Any:
    """A Typer choice over the core's own list, so the two cannot drift."""
    return Enum(name, {value: value for value in values}, type=str)  # type: ignore[misc]


OutputFormat = _choices("OutputFormat", STREAM_FORMATS)
DecodeMode = _choices("DecodeMode", DECODE_MODES)
Flavor = _choices("Flavor", FLAVORS)


class StreamMode(str, Enum):
    live = "live"
    replay = "replay"


class ReplayMode(str, Enum):
    fast = "fast"
    reference = "reference"


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
RENDER_OPTIONS: dict[str, Any] = {
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
            ("trust_request_chat_template", bool, "", "Accept a chat template sent in a request (chat_template, "
             "chat_template_kwargs.chat_template); refused otherwise."),
            ("reasoning_effort_map", str, "JSON", 'JSON object rewriting a request\'s reasoning_effort for the '
             'chat template, e.g. \'{"medium": "low"}\'.'),
            ("generation_config", str, "auto|vllm|DIR", "Where default sampling parameters come from: the "
             "model's generation_config.json (auto), vLLM's defaults (vllm), or a directory."),
            ("override_generation_config", str, "JSON", "JSON object overriding generation config values, "
             'e.g. \'{"temperature": 0.5}\'.'),
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
ParityInputArg = Annotated[
    list[str],
    typer.Argument(
        metavar="INPUT...",
        help="JSONL, SSE capture or .parquet to read; - for stdin. Gzip and zstd are detected. "
        "Several inputs (shards) are compared as one input, in order.",
        show_default=False,
    ),
]
ParityResumeOpt = Annotated[
    bool,
    typer.Option(
        "--resume",
        help="Continue the --report FILE.jsonl an earlier, stopped parity run left: the requests it "
        "covers (its checkpoint .FILE.jsonl.derender-parity.json says how many) are skipped. Refused "
        "for another run's report, and with --html, --minimize or --repro.",
    ),
]
MinimizeAllOpt = Annotated[
    bool,
    typer.Option(
        "--minimize-all",
        help="--minimize and --repro take every request's every kind of divergence, not one "
        "record per class (the first request that shows it).",
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
def _workers_option(help_text: str) -> Any:
    """``--workers``/``-j``, as a command explains it."""
    return typer.Option("--workers", "-j", min=1, metavar="N", help=help_text, show_default=False)


WorkersOpt = Annotated[
    int | None,
    _workers_option(
        "Worker processes, forked after the model loads. 1 runs in this process. "
        "Default: the CPU cores this process may use (1 with --flavor serve)."
    ),
]
ParityWorkersOpt = Annotated[
    int | None,
    _workers_option(
        "Worker processes that run the paths, forked after the render stack is built (each "
        "builds its own serve stack). Default: 1, in this process."
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


RenderPromptsOpt = Annotated[
    bool,
    typer.Option(
        "--render-prompts",
        help="A record with a request and no prompt_token_ids gets them from vLLM's renderer "
        "first, as the render server's /v1/chat/completions/render (/v1/completions/render) gives "
        "them for its request, so the decode is seeded and the parsers see the prompt. Without "
        "it such records are derendered as the server derenders them, and the summary counts "
        "those whose answer the prompt could change.",
    ),
]

JOB_OPTIONS: dict[str, tuple[Any, Any]] = {
    "requests": (RequestsOpt, None),
    "flavor": (FlavorOpt, Flavor.derender),
    "lenient": (LenientOpt, False),
    "fail_fast": (FailFastOpt, False),
    "errors": (ErrorsOpt, None),
    "verbose": (VerboseOpt, False),
    "quiet": (QuietOpt, False),
    "workers": (WorkersOpt, None),
    "resume": (ResumeOpt, False),
    "ray": (RayOpt, False),
    "ray_address": (RayAddressOpt, None),
    "ray_actors": (RayActorsOpt, None),
    "decode": (DecodeOpt, DecodeMode.fast),
    "render_prompts": (RenderPromptsOpt, False),
}
"""The flags every derender job takes (`chat`, `completion`, `stream`), with
their defaults: each becomes the `JobSpec` field of its name (``quiet``
aside, which is the display's)."""

RENDER_JOB_OPTIONS: dict[str, tuple[Any, Any]] = {
    name: JOB_OPTIONS[name]
    for name in ("fail_fast", "errors", "verbose", "quiet", "workers", "resume", "ray", "ray_address", "ray_actors")
}
"""The job flags `derender render` takes: it reads requests, so there is
nothing to join (--requests), decode (--decode), check (--lenient) or
answer as serve (--flavor)."""


def job_fields(flags: dict[str, Any]) -> dict[str, Any]:
    """`JOB_OPTIONS` as given, as `JobSpec` fields: choices by value, paths as text."""
    return {
        name: value.value if isinstance(value, Enum) else str(value) if isinstance(value, Path) else value
        for name, value in flags.items()
        if name != "quiet"
    }


class ParsersFormat(str, Enum):
    markdown = "markdown"
    jsonl = "jsonl"


IgnoreOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--ignore",
        metavar="FIELD",
        help="A field not to compare (content, reasoning, tool_calls, finish_reason, "
        "stop_reason, usage, logprobs, system_fingerprint, role_frame, empty_frames, "
        "finish_frame, null_fields, stop_logic, prompt_token_ids, ...); repeat for several.",
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
HtmlOpt = Annotated[
    str | None,
    typer.Option(
        "--html",
        metavar="FILE.html",
        help="Write one self-contained page (no network needed) to look at the divergences: "
        "a summary by kind and pair of paths, filters, and per request what each side answered "
        "(streams call by call, one-shot answers field by field), each divergence highlighted, "
        "with its token ids and the text emitted so far, at anchor #d-N (N: its line in --report). "
        "- for stdout.",
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


def render_config(config_path: Path | str | None, flags: dict[str, Any]) -> RenderConfig:
    """The settings a command runs with: ``--config``, then the flags given."""
    config = RenderConfig.from_yaml(config_path) if config_path else RenderConfig()
    return config.overridden_by(flags)


# --- derender stream ------------------------------------------------------------------

StreamOutputOpt = Annotated[
    str,
    typer.Option(
        "--output",
        "-o",
        metavar="PATH",
        help="Where to write; - for stdout. A .gz or .zst path is compressed, a .parquet "
        "path gets Parquet rows (--format jsonl). DIR/: with one input and --format sse, "
        "one .sse file per request; otherwise one output per input, named after it.",
    ),
]
FormatOpt = Annotated[
    OutputFormat,
    typer.Option(
        "--format",
        help="jsonl: the endpoint's answer per call ({chunk, stream_state}; "
        "with --flavor serve, {chunks}: the chunks serve sent during that call). "
        "sse: per request, the SSE transcript vllm serve would stream. "
        "assembled: per request, one response built from its stream.",
    ),
]
ModeOpt = Annotated[
    StreamMode,
    typer.Option(
        "--mode",
        help="live: each stream's parser kept between calls, O(n) per stream; "
        "answers and states equal replay's. replay: every call through vLLM's "
        "own per-call path, for bug-for-bug reproduction of the render server "
        "(--replay). Not used with --flavor serve.",
    ),
]
ReplayOpt = Annotated[
    ReplayMode,
    typer.Option(
        "--replay",
        help="With --mode replay: fast goes on from this process's answer to a stream's previous "
        "call, O(n) per stream, with every answer and state vLLM's replay's (any other state takes "
        "vLLM's replay). reference: vLLM's own replay of the whole history on every call, O(n^2).",
    ),
]
DerenderEndpoint = _choices("DerenderEndpoint", tuple(endpoint.value for endpoint in DERENDER_ENDPOINTS))
"""`Endpoint`'s derender members, for ``--endpoint``."""
EndpointOpt = Annotated[DerenderEndpoint, typer.Option("--endpoint", help="Which derender endpoint the calls go to.")]

# --- derender parity ------------------------------------------------------------------

PathsOpt = Annotated[
    list[str] | None,
    typer.Option("--paths", metavar="PATH,...", help=f"Which paths run: {', '.join(PATHS)} (all by default)."),
]
ChunkingOpt = Annotated[
    str,
    typer.Option(
        "--chunking",
        metavar="SPEC,...",
        help="For one-shot input: how the stream paths cut the tokens into chunks: "
        "N tokens per chunk, 'tail' (one per chunk, then the finish reason on a chunk "
        "of its own) or 'N+tail'; each spec is one run.",
    ),
]
StreamInputOpt = Annotated[
    bool,
    typer.Option("--stream", help="With --requests: INPUT holds generate stream chunks (or a raw SSE capture)."),
]
FromServeOpt = Annotated[
    str | None,
    typer.Option(
        "--from-serve",
        metavar="RECORDED",
        help="Recorded vllm serve answers (non-stream JSONL, or SSE transcripts: a file or a "
        "directory of .sse transcripts) made with return_token_ids: true; INPUT is then the "
        "requests file (request_id, chat_request or completion_request, prompt_token_ids). "
        "The answers' tokens run through every path and each path is compared with the recording.",
    ),
]

MinimizeOpt = Annotated[
    str | None,
    typer.Option(
        "--minimize",
        metavar="FILE",
        help="Then shrink each request's record, per divergence kind, to a smallest one that still "
        "shows it (output ids, chunks, request fields, prompt ids), and write those records to FILE "
        "in the input's form, each under its request id and ~<left>-<right>-<field>: "
        "`derender parity FILE` with the same flags finds them again.",
    ),
]
MinimizeStepsOpt = Annotated[
    int,
    typer.Option(
        "--minimize-steps",
        min=1,
        metavar="N",
        help="Parity runs each divergence's minimization may spend (the search stops with what it has).",
    ),
]
ReproOpt = Annotated[
    str | None,
    typer.Option(
        "--repro",
        metavar="DIR",
        help="Per minimal divergence, a Markdown report for a vLLM issue in DIR (versions, flags, the "
        "record, each path's answer with the divergent part marked) and, where the one-shot and "
        "streaming derender endpoints disagree, a script that reproduces it on `vllm launch render`.",
    ),
]

COMPARE_OPTIONS: dict[str, tuple[Any, Any]] = {
    "ignore": (IgnoreOpt, None),
    "report": (ReportOpt, None),
    "html": (HtmlOpt, None),
    "ignore_created": (CreatedOpt, True),
    "ignore_ids": (IdsOpt, True),
    "null_is_absent": (NullOpt, True),
    "quiet": (QuietOpt, False),
}
"""The flags of the commands that compare answers (`parity`, `diff`)."""
