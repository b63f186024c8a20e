"""Building vLLM's stack the way its servers build it.

Every path (the render endpoints, live streaming, the serve path) starts
from the same settings: vLLM's own argument parser turns a `RenderConfig`
into the server's ``Namespace``, and the pieces below build from it what
`vllm launch render` builds (``vllm/entrypoints/launchers/render/entry.py``
and ``app_state.py``).
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import sys
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, NoReturn

from ..config import RenderConfig
from ..errors import ConfigError
from . import versions

if TYPE_CHECKING:
    from argparse import Namespace


def prepare_environment() -> bool:
    """Settings vLLM reads at import time; the user's own values win.

    The process is CPU-only and offline, and stdout carries data only, so
    vLLM's log stream is moved to stderr even when it was set to stdout.

    Returns:
        Whether start-up warnings are hidden: vLLM and torch warn about the
        missing GPU stack, which does not matter to derendering. They are
        shown when the user chose a log level (``VLLM_LOGGING_LEVEL``).

    """
    os.environ.update(environment_with_defaults(os.environ))
    quiet_startup = "VLLM_LOGGING_LEVEL" not in os.environ
    # vLLM configures its loggers only in its own entry points; without a
    # handler its records would reach Python's last-resort handler.
    vllm_logger = logging.getLogger("vllm")
    if not vllm_logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("derender: vllm %(levelname)s: %(message)s"))
        vllm_logger.addHandler(handler)
        vllm_logger.propagate = False
    level = "ERROR" if quiet_startup else os.environ["VLLM_LOGGING_LEVEL"].upper()
    if level not in logging.getLevelNamesMapping():
        raise ConfigError(f"VLLM_LOGGING_LEVEL={level!r} is not a logging level")
    vllm_logger.setLevel(level)
    return quiet_startup


def environment_with_defaults(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` with the settings `prepare_environment` gives vLLM: what
    vLLM reads at import in a process started with `environ` (the warm
    server compares a call's with its own)."""
    env = dict(environ)
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    # derender never computes on a device. vLLM 0.34's CPU platform refuses
    # to build a config on an x86 machine whose Triton sees no driver unless
    # the visible devices are set (to none), and hiding the GPUs keeps CUDA
    # out of a process that forks its workers.
    env.setdefault("CUDA_VISIBLE_DEVICES", "")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if env.get("VLLM_LOGGING_STREAM", "ext://sys.stdout") == "ext://sys.stdout":
        env["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"
    if "VLLM_LOGGING_LEVEL" not in env:
        env.setdefault("TORCH_LOGS", "-torch")
    return env


@contextlib.contextmanager
def startup_logs_hidden() -> Iterator[None]:
    """vLLM's warnings hidden for a block of start-up work done after the
    engine was built (the render half, say), as `prepare_environment` hides
    them during the build: unless the user chose a log level."""
    logger = logging.getLogger("vllm")
    level = logger.level
    if "VLLM_LOGGING_LEVEL" not in os.environ:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def show_warnings_from_now_on() -> None:
    """After start-up, per-record warnings (a missing prompt_token_ids, say)
    are worth seeing."""
    logging.getLogger("vllm").setLevel(logging.WARNING)


def server_args(config: RenderConfig) -> Namespace:
    """Parse the settings with the parser `vllm launch render` uses, so every
    flag not mirrored here keeps the server's default."""
    from vllm.entrypoints.common.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.exceptions import VLLMError
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class _RaisingParser(FlexibleArgumentParser):
        def error(self, message: str) -> NoReturn:
            raise ConfigError(message)

    parser = make_arg_parser(_RaisingParser(prog="derender"))
    args = parser.parse_args(config.to_vllm_argv())
    try:
        validate_parsed_serve_args(args)
    except (TypeError, ValueError, VLLMError) as exc:
        # A VLLMError here is vLLM's own refusal to start, e.g. a
        # --chat-template path that does not exist.
        raise ConfigError(str(exc).removeprefix("Error: ")) from None
    _check_choices(args)
    return args


def _check_choices(args: Namespace) -> None:
    """Names vLLM looks up in registries only later, deep in start-up, are
    checked here so the error can list what is registered."""
    from vllm.reasoning import ReasoningParserManager
    from vllm.tokenizers.registry import TokenizerRegistry
    from vllm.tool_parsers import ToolParserManager

    for flag, name, registered, kind in (
        ("--tool-call-parser", args.tool_call_parser, ToolParserManager.list_registered(), "parser"),
        (
            "--reasoning-parser",
            args.reasoning_parser,
            ReasoningParserManager.list_registered(),
            "parser",
        ),
        ("--tokenizer-mode", args.tokenizer_mode, ["auto", *TokenizerRegistry.tokenizers], "mode"),
    ):
        if name and name not in registered:
            raise ConfigError(
                f"{flag}: unknown {kind} {name!r}. Valid choices: {', '.join(sorted(registered))}."
            )


def registered_parsers() -> list[tuple[str, str]]:
    """(kind, name) of every tool and reasoning parser vLLM registers."""
    prepare_environment()
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    return sorted(
        [("tool", name) for name in ToolParserManager.list_registered()]
        + [("reasoning", name) for name in ReasoningParserManager.list_registered()]
    )


LEAN_STEPS = ("pool", "gc", "marker", "modelinfo")
"""The lean start-up's steps (`lean_start`, `derender_stack`); each can be
turned off with ``DERENDER_LEAN_OFF=pool,gc,...`` so that
``benchmarks/startup.py`` measures what each one saves."""


def _lean(step: str) -> bool:
    off = {name.strip() for name in os.environ.get("DERENDER_LEAN_OFF", "").split(",")}
    if step != "gc" and not versions.proven("startup"):
        return False  # patches of vLLM's private start-up: proven releases only
    return step not in off and "all" not in off


@contextlib.contextmanager
def lean_start() -> Iterator[None]:
    """Hold the garbage collector off while vLLM is imported and the stack
    built, then freeze the heap.

    Start-up creates millions of long-lived objects (modules, the
    tokenizer's vocabulary and merges), and every collection pass walks
    them all again: about 3 s of a 2-core start-up. Frozen, they are never
    walked again, neither by later collections nor at interpreter exit, and
    forked workers do not copy the pages the collector would touch.
    """
    if not _lean("gc"):
        yield
        return
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()


def derender_stack(
    args: Namespace,
    derenderer_class: type | None = None,
    *,
    renderer: Any | None = None,
    single_threaded: bool = False,
) -> Any:
    """`init_render_app_state`'s derender half: the served names, the
    renderer and ``OnlineDerenderer``, behind ``ServingDerender``.

    `derenderer_class` replaces ``OnlineDerenderer`` with a subclass (live
    streaming keeps parser state across calls); it is built with the same
    arguments.

    `renderer` reuses the renderer (and its model config) of a stack built
    earlier for the same model without parser flags: they do not depend on
    the parsers, and loading them is most of the start-up, so trying every
    registered parser on one tokenizer costs one load.

    `single_threaded` is for a caller that runs the renderer's work inline
    (`DerenderEngine`'s ``_InlineExecutor``) and forks its workers: the
    renderer is built without vLLM's tokenizer thread pool
    (`_no_tokenizer_pool`), and vLLM's model-class inspection runs in this
    process (`_model_info_in_process`).
    """
    from vllm import AsyncEngineArgs, envs
    from vllm.config import VllmConfig
    from vllm.entrypoints.openai.models.protocol import BaseModelPath
    from vllm.entrypoints.openai.models.serving import OpenAIModelRegistry
    from vllm.entrypoints.scale_out.derender.serving import ServingDerender
    from vllm.renderers import renderer_from_config
    from vllm.renderers.online_derenderer import OnlineDerenderer

    if renderer is None:
        engine_args = AsyncEngineArgs.from_cli_args(args)
        with _model_info_in_process() if single_threaded else contextlib.nullcontext():
            model_config = engine_args.create_model_config()
        # As the render server: no inference, so no quantized kernels to
        # validate and no KV cache to size.
        model_config.quantization = None
        envs.VLLM_CPU_KVCACHE_SPACE = 0
        vllm_config = VllmConfig(
            model_config=model_config,
            logging_config=engine_args.create_logging_config(),
            structured_outputs_config=engine_args.create_structured_outputs_config(),
        )
        with _no_tokenizer_pool() if single_threaded else contextlib.nullcontext():
            renderer = renderer_from_config(vllm_config)
        if _lean("marker"):
            _cache_leading_space_marker(renderer.tokenizer)
    vllm_config = renderer.config
    model_config = renderer.model_config
    if model_config.hf_config.model_type == "gpt_oss":
        _load_harmony_encoding()
    served_model_names = args.served_model_name or [args.model]
    registry = OpenAIModelRegistry(
        model_config=model_config,
        base_model_paths=[
            BaseModelPath(name=name, model_path=args.model) for name in served_model_names
        ],
    )
    derenderer = (derenderer_class or OnlineDerenderer)(
        model_config=model_config, renderer=renderer, request_logger=None, **online_settings(args, vllm_config)
    )
    return ServingDerender(registry, derenderer, request_logger=None)


def online_settings(args: Namespace, vllm_config: Any) -> dict[str, Any]:
    """The settings `init_render_app_state` gives both halves of the render
    server, ``OnlineRenderer`` and ``OnlineDerenderer``, from its flags."""
    from vllm.entrypoints.common.cli_args import resolve_default_chat_template_kwargs
    from vllm.renderers.chat_utils import load_chat_template

    return {
        "chat_template": load_chat_template(args.chat_template),
        "chat_template_content_format": args.chat_template_content_format,
        "trust_request_chat_template": args.trust_request_chat_template,
        "enable_auto_tools": args.enable_auto_tool_choice,
        "exclude_tools_when_tool_choice_none": args.exclude_tools_when_tool_choice_none,
        "tool_parser": args.tool_call_parser,
        "tool_strict_level": args.tool_strict_level,
        # The server's order: the flag, then the model's own default.
        "reasoning_parser": args.reasoning_parser or vllm_config.structured_outputs_config.reasoning_parser,
        "default_chat_template_kwargs": resolve_default_chat_template_kwargs(args),
        "reasoning_effort_map": args.reasoning_effort_map,
        "log_error_stack": args.log_error_stack,
    }


def _no_tokenizer_pool() -> contextlib.AbstractContextManager[None]:
    """Build the renderer without vLLM's tokenizer thread pool.

    ``HfRenderer.__init__`` calls ``maybe_make_thread_pool``, which makes
    ``renderer_num_workers + 1`` deep copies of a fast tokenizer (about
    2.6 s each for a 151k vocabulary) so that its executor threads can
    decode at once. A single-threaded caller never uses them; every
    tokenizer method then runs on the tokenizer itself, which the copies
    were copies of, so every result is the same.
    """
    import vllm.renderers.hf as hf_renderer
    from vllm.tokenizers import hf as hf_tokenizers

    if not _lean("pool"):
        return contextlib.nullcontext()
    if getattr(hf_renderer, "maybe_make_thread_pool", None) is not hf_tokenizers.maybe_make_thread_pool:
        raise ConfigError(
            "vLLM's HfRenderer no longer calls vllm.tokenizers.hf.maybe_make_thread_pool: "
            "review derender_core/vllm_seam/stack.py:_no_tokenizer_pool"
        )

    def single_threaded(tokenizer: Any, copies: int = 1) -> Any:
        return tokenizer

    return _patched(hf_renderer, "maybe_make_thread_pool", single_threaded)


def _model_info_in_process() -> contextlib.AbstractContextManager[None]:
    """Let vLLM inspect the model class in this process, on CPU.

    On a cache miss (the first run after install, or after a vLLM upgrade)
    vLLM's registry imports the model's module in a subprocess that imports
    vLLM again, 11 to 15 s, so that the inspection cannot initialise CUDA
    in the server. A CPU-only process has no CUDA to protect: the same
    function runs here, and vLLM still writes its cache
    (``$VLLM_CACHE_ROOT/modelinfos``) from the result.
    """
    import inspect

    from vllm.model_executor.models import registry
    from vllm.platforms import current_platform

    if not _lean("modelinfo") or not current_platform.is_cpu():
        return contextlib.nullcontext()
    run_in_subprocess = getattr(registry, "_run_in_subprocess", None)
    if run_in_subprocess is None or list(inspect.signature(run_in_subprocess).parameters) != ["fn"]:
        raise ConfigError(
            "vLLM's model registry no longer has _run_in_subprocess(fn): "
            "review derender_core/vllm_seam/stack.py:_model_info_in_process"
        )

    def in_process(fn: Any) -> Any:
        return fn()

    return _patched(registry, "_run_in_subprocess", in_process)


@contextlib.contextmanager
def _patched(module: Any, name: str, value: Any) -> Iterator[None]:
    """`module.name` is `value` for the block, then what it was."""
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


def _cache_leading_space_marker(tokenizer: Any) -> None:
    """Store vLLM's leading-space marker on the tokenizer now, cheaply.

    ``get_leading_space_marker`` (the first record with logprobs, and
    streams without prompt ids) serialises the whole tokenizer to JSON and
    parses it, 0.6 to 1.1 s for an 8 MB tokenizer, to read one part of it:
    the pre-tokenizer. Here vLLM's own function reads that part alone, and
    caches its answer where it looks first (``_vllm_space_marker_cache``);
    tests/test_server.py checks the value equals the one vLLM computes on
    every family's tokenizer.
    """
    from vllm.tokenizers import detokenizer_utils

    key = getattr(detokenizer_utils, "_CACHED_MARKER_KEY", None)
    if key != "_vllm_space_marker_cache":
        raise ConfigError(
            "vLLM's get_leading_space_marker no longer caches on the tokenizer: "
            "review derender_core/vllm_seam/stack.py:_cache_leading_space_marker"
        )
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or hasattr(tokenizer, key):
        return  # vLLM's answer is None without a backend; nothing to save
    pre_tokenizer = backend.pre_tokenizer
    pre_json = "null" if pre_tokenizer is None else pre_tokenizer.__getstate__().decode()
    document = '{"pre_tokenizer": ' + pre_json + "}"
    json.loads(document)  # a malformed state fails here, not in vLLM's silent except
    stand_in = _BackendOnly(document)
    setattr(tokenizer, key, detokenizer_utils.get_leading_space_marker(stand_in))  # type: ignore[arg-type]


class _BackendOnly:
    """What ``get_leading_space_marker`` reads of a tokenizer: its backend's
    JSON, here the pre-tokenizer's alone."""

    def __init__(self, document: str) -> None:
        self.backend_tokenizer = self
        self._document = document

    def to_str(self) -> str:
        return self._document


# o200k_base.tiktoken as openai_harmony reads it; the digest is the one
# openai_harmony checks.
HARMONY_VOCABULARY = "o200k_base.tiktoken"
HARMONY_VOCABULARY_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"


def _load_harmony_encoding() -> None:
    """gpt-oss answers go through the harmony encoding, which vLLM loads on
    the first request; load it now, so that a missing vocabulary stops the
    start-up with what to provide instead of failing every record.

    openai_harmony reads ``o200k_base.tiktoken`` from the directory named by
    ``TIKTOKEN_ENCODINGS_BASE``; without it, a build that bundles the file
    uses its own copy, and one that does not downloads it.
    """
    from vllm.entrypoints.openai.parser.harmony_utils import get_encoding

    try:
        get_encoding()
    except Exception as exc:
        base = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
        where = (
            f"TIKTOKEN_ENCODINGS_BASE={base} has no usable {HARMONY_VOCABULARY}"
            if base
            else f"openai_harmony could not load {HARMONY_VOCABULARY} (no download offline)"
        )
        raise ConfigError(
            f"gpt-oss (model_type gpt_oss) needs the harmony encoding, and {where}: {exc}. "
            f"Provide {HARMONY_VOCABULARY} (sha256 {HARMONY_VOCABULARY_SHA256}) in a directory "
            "and set TIKTOKEN_ENCODINGS_BASE to that directory."
        ) from None
