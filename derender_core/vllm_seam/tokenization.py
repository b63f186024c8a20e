"""The render server's ``/tokenize`` and ``/detokenize``, in process.

`init_render_app_state` builds ``ServingTokenization`` over the same
``OnlineRenderer`` as the render endpoints, with the server's chat
template settings; ``vllm/entrypoints/serve/tokenize/api_router.py``
answers its results as Starlette's ``JSONResponse`` of the model's dump
(not ``create_json_response``: these routes serialise with ``json``), an
error with its own status. `RenderHalf` drives both routes through here.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from ..protocol import Answer

if TYPE_CHECKING:
    from argparse import Namespace


def tokenization_stack(args: Namespace, models: Any, online_renderer: Any) -> Any:
    """`init_render_app_state`'s ``ServingTokenization``: over the render
    half's ``OnlineRenderer`` and model registry, with the server's chat
    template, its content format and default kwargs."""
    from vllm.entrypoints.serve.tokenize.serving import ServingTokenization

    from .stack import online_settings

    settings = online_settings(args, online_renderer.renderer.config)
    return ServingTokenization(
        models,
        online_renderer,
        request_logger=None,
        chat_template=settings["chat_template"],
        chat_template_content_format=settings["chat_template_content_format"],
        default_chat_template_kwargs=settings["default_chat_template_kwargs"],
        trust_request_chat_template=settings["trust_request_chat_template"],
    )


async def json_answered(call: Coroutine[Any, Any, Any]) -> Answer:
    """The tokenize routes' body: ``JSONResponse`` of the result's dump,
    an ``ErrorResponse`` with its own code."""
    from fastapi.responses import JSONResponse
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    result = await call
    status = result.error.code if isinstance(result, ErrorResponse) else 200
    response = JSONResponse(content=result.model_dump(), status_code=status)
    return Answer(response.status_code, bytes(response.body))
