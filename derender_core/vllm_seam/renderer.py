"""The render server's render endpoints, in process: requests in, prompts out.

`vllm launch render` builds one renderer and hands it to both of its halves
(``init_render_app_state``): ``OnlineRenderer`` behind ``ServingRender``
answers ``/v1/chat/completions/render``, ``/v1/completions/render``,
``/v1/messages/render`` (Anthropic Messages) and ``/v1/responses/render``
(OpenAI Responses) with the ``GenerateRequest`` a token-in engine takes,
behind ``ServingTokenization`` ``/tokenize`` and ``/detokenize``, and
``OnlineDerenderer`` behind ``ServingDerender`` answers the derender
endpoints. `RenderHalf` builds the first two over the third's renderer and
model registry, with the same settings, and answers as the handlers of
``vllm/entrypoints/scale_out/render/api_router.py`` and
``vllm/entrypoints/serve/tokenize/api_router.py`` do: FastAPI's body
validation against each route's request model, vLLM's exception handlers,
and each route's response bytes (`Route`).

The render half is built on first use: its first build loads the model's
processor to look for a chat template of its own (vLLM's
``resolve_chat_template``), a second tokenizer load that a derender run
should not pay for. `prepare` builds it ahead, before workers fork.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from ..protocol import Answer, Endpoint
from .stack import online_settings, startup_logs_hidden
from .tokenization import json_answered, tokenization_stack

if TYPE_CHECKING:
    from argparse import Namespace

    from pydantic import TypeAdapter

_T = TypeVar("_T")


class Handlers(Protocol):
    """What the render half borrows from the engine it serves in: its way of
    running handler coroutines and the app's exception handlers."""

    def _run(self, coroutine: Coroutine[Any, Any, _T]) -> _T: ...
    def _validation_answer(self, errors: list[dict[str, Any]]) -> Answer: ...
    def internal_error(self, exc: Exception) -> Answer: ...


class RenderHalf:
    """``ServingRender`` for the stack a `DerenderEngine` holds, built from
    the same server flags (`args`) on first use and shared by every mode
    of the engine (`DerenderEngine.in_mode` copies keep this object)."""

    def __init__(self, args: Namespace) -> None:
        self._args = args
        self._serving: Any = None
        self._routes: dict[Endpoint, Route] = {}

    def prepare(self, serving_derender: Any) -> Any:
        """The render half over `serving_derender`'s renderer, built now if
        it was not: a parent builds it before forking its workers."""
        if self._serving is None:
            with startup_logs_hidden():
                serving = render_stack(self._args, serving_derender)
                tokenization = tokenization_stack(self._args, serving_derender.models, serving.online_renderer)
            self._routes = _routes(serving, tokenization)
            self._serving = serving
        return self._serving

    def post(self, engine: Handlers, serving_derender: Any, endpoint: Endpoint, body: Any) -> Answer:
        """Answer one call to the preprocessing half as ``POST
        endpoint.path`` would."""
        from pydantic import ValidationError

        self.prepare(serving_derender)
        route = self._routes[endpoint]
        if body is None:  # FastAPI reports a null body as missing
            return engine._validation_answer(
                [{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}]
            )
        try:
            # A copy of the top level: vLLM's validators replace fields of the
            # dict they are given (a Responses request's input items, a chat
            # request's defaults), and the caller's body stays as it was sent.
            request = route.body.validate_python(dict(body) if type(body) is dict else body, from_attributes=True)
        except ValidationError as exc:
            # FastAPI reports body errors under a leading "body" location.
            return engine._validation_answer(
                [{**error, "loc": ("body", *error["loc"])} for error in exc.errors(include_url=False)]
            )
        except Exception as exc:  # RecursionError, say: the app's catch-all
            return engine.internal_error(exc)
        try:
            return engine._run(route.answered(route.handler(request)))
        except Exception as exc:  # the app's exception handlers, in order
            return engine.internal_error(exc)


@dataclass(frozen=True)
class Route:
    """One route of the preprocessing half: its body as FastAPI validates
    it, the serving method it calls, and how it turns the result into the
    response's bytes."""

    body: TypeAdapter[Any]
    handler: Callable[[Any], Coroutine[Any, Any, Any]]
    answered: Callable[[Coroutine[Any, Any, Any]], Coroutine[Any, Any, Answer]]


def _routes(serving: Any, tokenization: Any) -> dict[Endpoint, Route]:
    """Each endpoint's route, as its ``api_router`` declares it: the body
    model, the handler called with the request alone (no HTTP request: no
    ``X-Request-Id`` header, so an id the request lacks is drawn), and the
    response (``create_json_response`` on the render routes, a plain
    ``JSONResponse`` on the tokenize routes)."""
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest, TokenizeRequest

    def tokenize(request: Any) -> Coroutine[Any, Any, Any]:
        return tokenization.create_tokenize(request, None)  # type: ignore[no-any-return]

    def detokenize(request: Any) -> Coroutine[Any, Any, Any]:
        return tokenization.create_detokenize(request, None)  # type: ignore[no-any-return]

    return {
        Endpoint.RENDER_CHAT: Route(_request_adapter(ChatCompletionRequest), serving.render_chat_request, _answered),
        Endpoint.RENDER_COMPLETION: Route(
            _request_adapter(CompletionRequest), serving.render_completion_request, _answered
        ),
        Endpoint.RENDER_MESSAGES: Route(
            _request_adapter(AnthropicMessagesRequest), serving.render_messages_request, _answered
        ),
        Endpoint.RENDER_RESPONSES: Route(
            _request_adapter(ResponsesRequest), serving.render_responses_request, _answered
        ),
        Endpoint.TOKENIZE: Route(_request_adapter(TokenizeRequest), tokenize, json_answered),
        Endpoint.DETOKENIZE: Route(_request_adapter(DetokenizeRequest), detokenize, json_answered),
    }


async def _answered(call: Coroutine[Any, Any, Any]) -> Answer:
    """The route's body: the handler's result through ``create_json_response``
    (orjson, or Starlette's JSON for what orjson refuses; an error
    response with its own status)."""
    from vllm.entrypoints.serve.utils.api_utils import create_json_response

    response = create_json_response(await call)
    return Answer(response.status_code, bytes(response.body))


def render_stack(args: Namespace, serving_derender: Any) -> Any:
    """`init_render_app_state`'s render half: ``OnlineRenderer`` over the
    derender half's renderer, warmed up as the server warms it, behind
    ``ServingRender`` with the same model registry."""
    from vllm.entrypoints.scale_out.render.serving import ServingRender
    from vllm.renderers.online_renderer import OnlineRenderer

    renderer = serving_derender.online_derenderer.renderer
    online_renderer = OnlineRenderer(
        model_config=renderer.model_config,
        renderer=renderer,
        request_logger=None,
        trust_request_mm_kwargs=args.trust_request_mm_kwargs,
        **online_settings(args, renderer.config),
    )
    online_renderer.warmup()
    serving = ServingRender(
        serving_derender.models,
        online_renderer,
        request_logger=None,
        # No tool server: the render server has one only with --tool-server,
        # which the Responses API alone reads.
        tool_server=None,
        disabled_thinking_effort=args.anthropic_disabled_thinking_effort,
    )
    _forget_processors()
    return serving


def _forget_processors() -> None:
    """Drop the processors vLLM loaded to look for their chat templates.

    vLLM keeps what it found (`_PROCESSOR_CHAT_TEMPLATES`), so it never loads
    them again for that; the processor itself (a second copy of the
    tokenizer for a text-only model, about as large as the first) would
    otherwise stay cached for the life of the process, and every worker and
    warm-server child would carry it.
    """
    from vllm.transformers_utils import processor

    cached = getattr(processor, "cached_get_processor", None)
    if cached is not None and hasattr(cached, "cache_clear"):
        cached.cache_clear()


def _request_adapter(model: Any) -> TypeAdapter[Any]:
    """The route's body parameter (a model, or a union of them as
    ``TokenizeRequest``), validated as FastAPI validates it."""
    from typing import Annotated

    from fastapi import Body
    from pydantic import TypeAdapter

    return TypeAdapter(Annotated[model, Body()])
