"""Building vLLM's stack the way its servers build it.

Every path (the render endpoints, live streaming, the serve path) starts
from the same settings: vLLM's own argument parser turns a `RenderConfig`
into the server's ``Namespace``, and the pieces below build from it what
`vllm launch render` builds (``vllm/entrypoints/launchers/render/entry.py``
and ``app_state.py``).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING, Any, NoReturn

from ..config import RenderConfig
from ..errors import ConfigError

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
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if os.environ.get("VLLM_LOGGING_STREAM", "ext://sys.stdout") == "ext://sys.stdout":
        os.environ["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"
    quiet_startup = "VLLM_LOGGING_LEVEL" not in os.environ
    if quiet_startup:
        os.environ.setdefault("TORCH_LOGS", "-torch")
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


def derender_stack(args: Namespace, derenderer_class: type | None = None) -> Any:
    """`init_render_app_state`'s derender half: the served names, the
    renderer and ``OnlineDerenderer``, behind ``ServingDerender``.

    `derenderer_class` replaces ``OnlineDerenderer`` with a subclass (live
    streaming keeps parser state across calls); it is built with the same
    arguments.
    """
    from vllm import AsyncEngineArgs, envs
    from vllm.config import VllmConfig
    from vllm.entrypoints.common.cli_args import resolve_default_chat_template_kwargs
    from vllm.entrypoints.openai.models.protocol import BaseModelPath
    from vllm.entrypoints.openai.models.serving import OpenAIModelRegistry
    from vllm.entrypoints.scale_out.derender.serving import ServingDerender
    from vllm.renderers import renderer_from_config
    from vllm.renderers.chat_utils import load_chat_template
    from vllm.renderers.online_derenderer import OnlineDerenderer

    engine_args = AsyncEngineArgs.from_cli_args(args)
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
    renderer = renderer_from_config(vllm_config)
    served_model_names = args.served_model_name or [args.model]
    registry = OpenAIModelRegistry(
        model_config=model_config,
        base_model_paths=[
            BaseModelPath(name=name, model_path=args.model) for name in served_model_names
        ],
    )
    derenderer = (derenderer_class or OnlineDerenderer)(
        model_config=model_config,
        renderer=renderer,
        request_logger=None,
        chat_template=load_chat_template(args.chat_template),
        chat_template_content_format=args.chat_template_content_format,
        trust_request_chat_template=args.trust_request_chat_template,
        enable_auto_tools=args.enable_auto_tool_choice,
        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
        tool_parser=args.tool_call_parser,
        tool_strict_level=args.tool_strict_level,
        # The server's order: the flag, then the model's own default.
        reasoning_parser=(
            args.reasoning_parser or vllm_config.structured_outputs_config.reasoning_parser
        ),
        default_chat_template_kwargs=resolve_default_chat_template_kwargs(args),
        reasoning_effort_map=args.reasoning_effort_map,
        log_error_stack=args.log_error_stack,
    )
    return ServingDerender(registry, derenderer, request_logger=None)
