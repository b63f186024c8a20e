"""``ServingDerender``'s one-shot responses, written as the dict their
models dump to (the fast decode).

vLLM's ``derender_chat_response`` and ``derender_completion_response``
check the call, derender its choices, and wrap them in ``UsageInfo`` and a
``ChatCompletionResponse`` or ``CompletionResponse``, which the handler
only serialises (``JSONResponse(content=response.model_dump())``). Building
and dumping those models cost about 15 µs of a 30-token record, where the
dict they dump to costs 5.

`DirectResponses` runs the two handlers line for line, with vLLM's own
checks, derenderer and log lines, and writes that dict itself: the fields
vLLM sets, in place in a template the models dumped at first use, so keys,
order and defaults are theirs. It does so only where the result is a plain
tree (`answers.plain_model` vouches for each choice, and the fields that
may hold anything, ``prompt_logprobs``, ``kv_transfer_params`` and
``metrics``, are None); otherwise it builds vLLM's models exactly as the
handler does. ``--decode reference`` runs vLLM's handlers themselves.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatMessage,
    FunctionCall,
    ToolCall,
)
from vllm.entrypoints.openai.completion.protocol import CompletionResponse
from vllm.entrypoints.scale_out.derender import serving as vllm_serving
from vllm.entrypoints.serve.engine.protocol import UsageInfo

from .answers import plain_model
from .fast import RESOLVES_PROMPT, prompt_count


class DirectResponses:
    """The one-shot derender handlers of `serving` (a ``ServingDerender``).

    Each answers what vLLM's handler answers (an ``ErrorResponse`` or the
    response model), or, where that model would only be dumped to a plain
    tree, the dict it dumps to: a dict is always such a response.
    """

    def __init__(self, serving: Any) -> None:
        self.serving = serving
        self.models = SupportedModels(serving)
        usage = _usage(0, 0)
        self._usage_fields = usage.model_dump()
        self._templates = {
            cls: cls(model="", choices=[], usage=usage).model_dump() for cls in (ChatCompletionResponse, CompletionResponse)
        }
        self._chat_choice = ChatCompletionResponseChoice(index=0, message=ChatMessage(role="")).model_dump()
        self._message = _message_template()

    def _usage_dict(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        """What `_usage(prompt_tokens, completion_tokens).model_dump()` gives."""
        return {
            **self._usage_fields,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    def _choice_dump(self, fields: dict[str, Any], message: dict[str, Any] | None) -> dict[str, Any]:
        """What ``ChatCompletionResponseChoice(**fields).model_dump()``
        gives, for a `_plain_choice` whose message dumps to `message`
        (None: its own ``model_dump()``)."""
        token_ids = fields["token_ids"]
        return {
            **self._chat_choice,
            **fields,
            "message": fields["message"].model_dump() if message is None else message,
            "token_ids": None if token_ids is None else list(token_ids),
        }

    def _message_dump(self, message: Any) -> dict[str, Any] | None:
        """What ``message.model_dump()`` gives, for the usual message: a
        ``ChatMessage`` of strings (role, content, reasoning) and tool
        calls of strings, every other field None, no extras; the fields set
        in place in the template its class dumped (`_message_template`),
        keys in its order. None for any other message. (3 µs less than the
        model's dump and the check that it is plain.)"""
        template = self._message
        if template is None or type(message) is not ChatMessage or message.__pydantic_extra__:
            return None
        values = vars(message)
        if not all(values[name] is None for name in template.unset):
            return None
        role, content, reasoning, calls = values["role"], values["content"], values["reasoning"], values["tool_calls"]
        if type(role) is not str or type(calls) is not list:
            return None
        if type(content) not in _TEXT or type(reasoning) not in _TEXT:
            return None
        dumped = {**template.fields, "role": role, "content": content, "reasoning": reasoning}
        if not calls:
            del dumped["tool_calls"]  # as ChatMessage's serializer drops an empty list
            return dumped
        written = []
        for call in calls:
            if type(call) is not ToolCall or call.__pydantic_extra__:
                return None
            function = call.function
            if type(function) is not FunctionCall or function.__pydantic_extra__:
                return None
            call_id, kind, name, arguments = call.id, call.type, function.name, function.arguments
            if type(call_id) is not str or type(kind) is not str or type(name) is not str or type(arguments) is not str:
                return None
            written.append({"id": call_id, "type": kind, "function": {"name": name, "arguments": arguments}})
        dumped["tool_calls"] = written
        return dumped

    async def chat(self, request: Any) -> Any:
        """vLLM's ``derender_chat_response``, line for line."""
        serving = self.serving
        if not self.models.checks_nothing(request.model):
            error_check_ret = await serving._check_model(request)
            if error_check_ret is not None:
                return error_check_ret
        bounds_error = serving._validate_derender_bounds([request.generate_response])
        if bounds_error is not None:
            return bounds_error
        prompt_ids_error = serving._validate_prompt_token_ids([request.prompt_token_ids])
        if prompt_ids_error is not None:
            return prompt_ids_error
        derenderer = serving.online_derenderer
        if derenderer.parser is not None and request.chat_request is None:
            return serving.create_error_response(
                "chat_request is required when a tool or reasoning parser is "
                "configured because plain detokenization would leak raw parser "
                "markup into content."
            )
        choice_fields: list[dict[str, Any]] | None = None
        gen = request.generate_response
        try:
            # The fast decode's choices as the fields their models are built
            # from (`FastDerenderer.chat_choice_fields`), built into models
            # below only where they are not written directly.
            if getattr(derenderer, "fast", False):
                choice_fields, prompt_logprobs = derenderer.chat_choice_fields(
                    gen, request.chat_request, request.prompt_token_ids
                )
            elif RESOLVES_PROMPT:
                choices, prompt_logprobs = await derenderer.derender_chat(
                    gen, request.chat_request, request.prompt_token_ids
                )
            else:
                choices = await derenderer.derender_chat(gen, request.chat_request, request.prompt_token_ids)
                prompt_logprobs = gen.prompt_logprobs
        except ValueError as exc:
            return serving.create_error_response(str(exc))

        prompt_tokens = prompt_count(request.prompt_tokens, gen.usage)
        completion_tokens = sum(len(ch.token_ids) for ch in gen.choices if ch.token_ids)
        model_name = request.model or serving.models.model_name()
        vllm_serving.logger.debug(
            "derender_chat request_id=%s model=%s choices=%d completion_tokens=%d",
            gen.request_id,
            model_name,
            len(choices) if choice_fields is None else len(choice_fields),
            completion_tokens,
        )
        prompt_token_ids = (
            gen.prompt_token_ids
            if request.chat_request is not None and request.chat_request.return_token_ids
            else None
        )
        plain = (
            prompt_logprobs is None
            and gen.kv_transfer_params is None
            and gen.metrics is None
            and type(gen.request_id) is str
            and type(model_name) is str
        )
        if choice_fields is not None:
            # Each message's dump, written directly where it is the usual
            # one (`_message_dump`); only a plain response is dumped.
            messages = [self._message_dump(f["message"]) for f in choice_fields] if plain else []
            plain = plain and all(map(_plain_choice, choice_fields, messages))
            choices = (
                list(map(self._choice_dump, choice_fields, messages))
                if plain
                else [ChatCompletionResponseChoice(**fields) for fields in choice_fields]
            )
        elif plain and all(map(plain_model, choices)):
            choices = [choice.model_dump() for choice in choices]
        else:
            plain = False
        return self._response(
            ChatCompletionResponse,
            plain,
            choices,
            (prompt_tokens, completion_tokens),
            id=gen.request_id,
            model=model_name,
            created=int(time.time()),
            prompt_logprobs=prompt_logprobs,
            prompt_token_ids=None if prompt_token_ids is None else list(prompt_token_ids),
            kv_transfer_params=gen.kv_transfer_params,
            metrics=gen.metrics,
        )

    async def completion(self, request: Any) -> Any:
        """vLLM's ``derender_completion_response``, line for line."""
        serving = self.serving
        if not self.models.checks_nothing(request.model):
            error_check_ret = await serving._check_model(request)
            if error_check_ret is not None:
                return error_check_ret
        if not request.generate_responses:
            return serving.create_error_response("generate_responses must not be empty")
        bounds_error = serving._validate_derender_bounds(request.generate_responses)
        if bounds_error is not None:
            return bounds_error
        if request.prompt_token_ids is not None:
            prompt_ids_error = serving._validate_prompt_token_ids(request.prompt_token_ids)
            if prompt_ids_error is not None:
                return prompt_ids_error
        choices, total_prompt_tokens, total_completion_tokens = await serving.online_derenderer.derender_completion(
            request.generate_responses,
            request.prompt_tokens,
            completion_request=request.completion_request,
            prompt_token_ids=request.prompt_token_ids,
        )
        first = request.generate_responses[0]
        kv_params = first.kv_transfer_params
        if any(r.kv_transfer_params != kv_params for r in request.generate_responses[1:]):
            vllm_serving.logger.warning(
                "derender_completion: kv_transfer_params differ across responses; "
                "setting to None on the aggregated response"
            )
            kv_params = None
        model_name = request.model or serving.models.model_name()
        vllm_serving.logger.debug(
            "derender_completion request_id=%s model=%s choices=%d completion_tokens=%d",
            first.request_id,
            model_name,
            len(choices),
            total_completion_tokens,
        )
        metrics = first.metrics if len(request.generate_responses) == 1 else None
        plain = (
            kv_params is None
            and metrics is None
            and type(first.request_id) is str
            and type(model_name) is str
            and all(map(plain_model, choices))
        )
        return self._response(
            CompletionResponse,
            plain,
            [choice.model_dump() for choice in choices] if plain else choices,
            (total_prompt_tokens, total_completion_tokens),
            id=first.request_id,
            model=model_name,
            created=int(time.time()),
            kv_transfer_params=kv_params,
            metrics=metrics,
        )

    def _response(
        self, cls: type, plain: bool, choices: list[Any], counts: tuple[int, int], **fields: Any
    ) -> Any:
        """The handler's response of class `cls`, as its model; or, where
        `plain` (`choices` then dumped already), the dict the model dumps
        to: the fields set in place in the template, where every field
        given that is not set is None, as the template has it."""
        if plain:
            return {**self._templates[cls], **fields, "choices": choices, "usage": self._usage_dict(*counts)}
        return cls(**fields, choices=choices, usage=_usage(*counts))


class SupportedModels:
    """``BaseServing._is_model_supported``, once per model name: it reads
    the served names and vLLM's environment, which a server caches after
    start-up too (``envs.enable_envs_cache``), 2 µs a call."""

    def __init__(self, serving: Any) -> None:
        self.serving = serving
        self._supported: dict[str | None, bool] = {}

    def supported(self, model: str | None) -> bool:
        supported = self._supported.get(model)
        if supported is None:
            supported = self._supported[model] = bool(self.serving._is_model_supported(model))
        return supported

    def checks_nothing(self, model: str | None) -> bool:
        """Whether ``_check_model`` answers None for a request naming
        `model` and does nothing else: a supported model, and no request
        logger to log the request's body."""
        return self.serving.request_logger is None and self.supported(model)


def _usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    """The handlers' ``UsageInfo``."""
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


_PLAIN_SCALARS = (str, int, type(None))


def _plain_choice(fields: dict[str, Any], message: dict[str, Any] | None) -> bool:
    """Whether a ``ChatCompletionResponseChoice`` of these fields would
    dump to a plain tree, the fields as they are: a plain message (one
    `DirectResponses._message_dump` wrote, `message`, is), no logprobs
    model (the fast decode's are spliced in as JSON), and plain scalars,
    which its validation keeps as they are."""
    return (
        fields["logprobs"] is None
        and type(fields["index"]) is int
        and type(fields["finish_reason"]) in _PLAIN_SCALARS
        and type(fields["stop_reason"]) in _PLAIN_SCALARS
        and (fields["token_ids"] is None or type(fields["token_ids"]) is list)
        and (message is not None or plain_model(fields["message"]))
    )


_TEXT = (str, type(None))


class _MessageTemplate(NamedTuple):
    fields: dict[str, Any]
    """A ``ChatMessage``'s dump with one tool call: its keys in order."""
    unset: tuple[str, ...]
    """The fields `DirectResponses._message_dump` does not write: None in
    the message it writes."""


_WRITTEN = ("role", "content", "reasoning", "tool_calls")


def _message_template() -> _MessageTemplate | None:
    """What `DirectResponses._message_dump` writes into, read off vLLM's
    dump of a probe message; None where the models are not of the shape
    it writes (a field it does not know that is not None by default, a
    tool call or function of other keys), so that every message takes
    its own ``model_dump()``."""
    call = ToolCall(id="i", function=FunctionCall(name="n", arguments="{}"))
    probe = ChatMessage(role="assistant", content="c", reasoning="r", tool_calls=[call])
    dumped = probe.model_dump()
    unset = tuple(name for name in ChatMessage.model_fields if name not in _WRITTEN)
    if (
        set(_WRITTEN) - set(ChatMessage.model_fields)
        or any(vars(probe)[name] is not None for name in unset)
        or any(dumped.get(name, None) is not None for name in unset)
        or dumped["tool_calls"] != [{"id": "i", "type": "function", "function": {"name": "n", "arguments": "{}"}}]
        or list(dumped["tool_calls"][0]) != ["id", "type", "function"]
        or list(dumped["tool_calls"][0]["function"]) != ["name", "arguments"]
        or set(ToolCall.model_fields) != {"id", "type", "function"}
    ):
        return None
    return _MessageTemplate(dumped, unset)
