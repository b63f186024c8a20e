"""vLLM's derender stack, built once and called like the render server.

This is the only module that imports vLLM. It builds the stack the way
`vllm launch render` does (``vllm/entrypoints/launchers/render/entry.py`` and
``app_state.py``): vLLM's own argument parser turns the settings into the
server's ``Namespace``, then ``AsyncEngineArgs``, ``VllmConfig``,
``renderer_from_config``, ``OnlineDerenderer`` and ``ServingDerender``.

`DerenderEngine.post` then does what the endpoint handlers in
``vllm/entrypoints/scale_out/derender/api_router.py`` do, including FastAPI's
body validation and vLLM's exception handlers, and returns the HTTP status
and the exact JSON body the server would send. A vLLM upgrade touches this
file only.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from collections.abc import Callable, Coroutine, Mapping
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from .config import RenderConfig
from .errors import ConfigError
from .protocol import Answer, Endpoint

_T = TypeVar("_T")

if TYPE_CHECKING:
    from argparse import Namespace

    from pydantic import TypeAdapter


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


def _show_warnings_from_now_on() -> None:
    """After start-up, per-record warnings (a missing prompt_token_ids, say)
    are worth seeing."""
    logging.getLogger("vllm").setLevel(logging.WARNING)


def _server_args(config: RenderConfig) -> Namespace:
    """Parse the settings with the parser `vllm launch render` uses, so every
    flag not mirrored here keeps the server's default."""
    from vllm.entrypoints.common.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class _RaisingParser(FlexibleArgumentParser):
        def error(self, message: str) -> NoReturn:
            raise ConfigError(message)

    parser = make_arg_parser(_RaisingParser(prog="derender"))
    args = parser.parse_args(config.to_vllm_argv())
    try:
        validate_parsed_serve_args(args)
    except (TypeError, ValueError) as exc:
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


def _derender_stack(args: Namespace) -> Any:
    """`init_render_app_state`'s derender half: the served names, the
    renderer and ``OnlineDerenderer``, behind ``ServingDerender``."""
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
    derenderer = OnlineDerenderer(
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


class DerenderEngine:
    """One render server's derender endpoints, in process."""

    def __init__(self, serving: Any, startup_seconds: float) -> None:
        from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
            DerenderChatRequestUnion,
            DerenderCompletionRequestUnion,
        )

        self._serving = serving
        self.startup_seconds = startup_seconds
        self._bodies: dict[Endpoint, TypeAdapter[Any]] = {
            Endpoint.CHAT: _body_adapter(DerenderChatRequestUnion),
            Endpoint.COMPLETION: _body_adapter(DerenderCompletionRequestUnion),
        }
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def build(cls, config: RenderConfig) -> DerenderEngine:
        """Build the stack from a local model directory, as the server does.

        Raises:
            ConfigError: for a bad setting, with the valid choices where
                there is a fixed set.

        """
        started = time.perf_counter()
        config.check_paths()
        quiet_startup = prepare_environment()

        args = _server_args(config)
        try:
            serving = _derender_stack(args)
        except Exception as exc:
            # Whatever stops vLLM's stack from starting stops the server
            # too: a configuration problem, reported without a traceback.
            raise ConfigError(f"cannot start the derender stack for {config.model}: {exc}") from None
        if quiet_startup:
            _show_warnings_from_now_on()
        return cls(serving, startup_seconds=time.perf_counter() - started)

    def post(self, endpoint: Endpoint, body: Any) -> Answer:
        """Answer one derender call as ``POST endpoint.path`` would."""
        from pydantic import ValidationError

        if body is None:  # FastAPI reports a null body as missing
            return self._validation_answer(
                [{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}]
            )
        try:
            request = self._bodies[endpoint].validate_python(body, from_attributes=True)
        except ValidationError as exc:
            # FastAPI reports body errors under a leading "body" location.
            errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
            return self._validation_answer(errors)
        try:
            return self._run(self._dispatch(endpoint, request))
        except Exception as exc:  # the app's catch-all handlers, in order
            return self._exception_answer(exc)

    def invalid_json(self, message: str, position: int | None) -> Answer:
        """The answer to a body that is not JSON, as FastAPI words it; a
        body that is not even text (position None) gets its generic 400."""
        if position is None:
            from fastapi import HTTPException
            from vllm.entrypoints.serve.exception_handling.handlers.http import (
                http_exception_handler,
            )

            return self._handled(
                http_exception_handler,
                HTTPException(status_code=400, detail="There was an error parsing the body"),
            )
        return self._validation_answer(
            [
                {
                    "type": "json_invalid",
                    "loc": ("body", position),
                    "msg": "JSON decode error",
                    "input": {},
                    "ctx": {"error": message},
                }
            ]
        )

    def bad_request(self, message: str) -> Answer:
        """A 400 in the server's error shape, for problems found before the
        call (a chunk whose request is unknown, say)."""
        from vllm.entrypoints.serve.exception_handling.error_response import (
            create_error_response,
        )

        return _json_answer(create_error_response(message).model_dump(), 400)

    def chat_response(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        """A full ``ChatCompletionResponse`` from assembled fields, with
        vLLM's defaults for the rest, so it lines up with a one-shot answer."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse

        return ChatCompletionResponse.model_validate(fields).model_dump()

    def completion_response(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        """A full ``CompletionResponse`` from assembled fields."""
        from vllm.entrypoints.openai.completion.protocol import CompletionResponse

        return CompletionResponse.model_validate(fields).model_dump()

    def close(self) -> None:
        """Close the event loop; the engine opens a new one if used again."""
        if self._loop is not None:
            self._loop.close()
            self._loop = None

    def _run(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        """Run a handler coroutine on the engine's own event loop, which
        lives across calls like the server's."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(coroutine)

    async def _dispatch(self, endpoint: Endpoint, request: Any) -> Answer:
        """The body of the api_router handlers for the derender paths."""
        from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
            DerenderChatStreamRequest,
            DerenderChatStreamResponse,
            DerenderCompletionStreamRequest,
            DerenderCompletionStreamResponse,
        )
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        handlers: dict[type, tuple[Callable[[Any], Any], type]] = {
            DerenderChatStreamRequest: (
                self._serving.derender_chat_stream_response,
                DerenderChatStreamResponse,
            ),
            DerenderCompletionStreamRequest: (
                self._serving.derender_completion_stream_response,
                DerenderCompletionStreamResponse,
            ),
        }
        if type(request) in handlers:
            handler, response_type = handlers[type(request)]
            result = await handler(request)
            if isinstance(result, ErrorResponse):
                return _json_answer(result.model_dump(), result.error.code)
            chunk, stream_state = result
            return _json_answer(response_type(chunk=chunk, stream_state=stream_state).model_dump())

        if endpoint is Endpoint.CHAT:
            result = await self._serving.derender_chat_response(request)
        else:
            result = await self._serving.derender_completion_response(request)
        if isinstance(result, ErrorResponse):
            return _json_answer(result.model_dump(), result.error.code)
        return _json_answer(result.model_dump())

    def _validation_answer(self, errors: list[dict[str, Any]]) -> Answer:
        from fastapi.exceptions import RequestValidationError
        from vllm.entrypoints.serve.exception_handling.handlers.validation import (
            validation_exception_handler,
        )

        return self._handled(validation_exception_handler, RequestValidationError(errors))

    def _exception_answer(self, exc: Exception) -> Answer:
        from vllm.entrypoints.serve.exception_handling.handlers.exception import (
            exception_handler,
        )

        return self._handled(exception_handler, exc)

    def _handled(self, handler: Callable[[Any, Any], Coroutine[Any, Any, Any]], exc: Exception) -> Answer:
        """The answer one of the app's exception handlers gives for `exc`."""
        response = self._run(handler(_HANDLER_REQUEST, exc))
        return Answer(response.status_code, bytes(response.body))


# vLLM's exception handlers read only ``request.app.state.args.log_error_stack``
# (and the request id when that is set), so this stands in for the request.
_HANDLER_REQUEST: Any = SimpleNamespace(
    app=SimpleNamespace(state=SimpleNamespace(args=SimpleNamespace(log_error_stack=False))),
    state=SimpleNamespace(),
)


def _body_adapter(union: Any) -> TypeAdapter[Any]:
    """Validate a body the way FastAPI validates the handlers' body
    parameter: a TypeAdapter over the annotation, from Python objects."""
    from typing import Annotated

    from fastapi import Body
    from pydantic import TypeAdapter

    return TypeAdapter(Annotated[union, Body()])


def _json_answer(content: Any, status: int = 200) -> Answer:
    """Serialize as the handlers' ``JSONResponse(content=...)`` does, so the
    bytes, and the failures on non-finite floats, match the server's."""
    from fastapi.responses import JSONResponse

    try:
        return Answer(status, bytes(JSONResponse(content=content, status_code=status).body))
    except ValueError as exc:  # reaches the app's ValueError handler
        from vllm.entrypoints.serve.exception_handling.error_response import (
            create_error_response,
        )

        error = create_error_response(exc)
        return Answer(error.error.code, bytes(JSONResponse(content=error.model_dump()).body))

