"""The engine's way in for code: token ids and a request in, a response out.

`Derenderer.post` is server-shaped: a derender body in, status and bytes out.
RL and dataset code holds rollouts instead: the generated ids (or generate's
response), the OpenAI request they answer, the prompt ids. `CodeAPI` gives
engines ``chat`` and ``completion`` for that, and batch forms, over the very
same ``post`` (so every answer is the render server's, byte for byte), with
derender's record checks unless ``lenient``; a refused call raises
`RenderError` with the server's status and message. ``render_chat`` and
``render_completion`` go the other way, as the render endpoints do: a
request in, the ``GenerateRequest`` with its prompt ids out; so do
``render_messages`` (Anthropic Messages) and ``render_responses`` (OpenAI
Responses), and ``tokenize`` and ``detokenize`` answer as the server's
``/tokenize`` and ``/detokenize``.

`jobs.engine_for` keeps one engine per process and settings, for
``Dataset.map`` with ``num_proc`` and other process pools.

Nothing here imports vLLM.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from .checks import check_body
from .protocol import WINDOW, Answer, Endpoint, Script

_T = TypeVar("_T")


class RenderError(Exception):
    """A call the server refused: its HTTP status, its error message, and
    the whole error body it answered."""

    def __init__(self, status: int, message: str, body: Any) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.body = body


Output = Mapping[str, Any] | Sequence[int]
"""A generate response (``{"request_id", "choices": [...]}``), or the
generated token ids of one choice."""


class CodeAPI:
    """``chat`` and ``completion`` for any engine with a ``post``."""

    vocab_size: int
    window = 1
    """One call at a time (`protocol.Derenderer.window`)."""
    reads_logprob_text = False
    """Bodies hold logprobs loaded (`protocol.Derenderer.reads_logprob_text`)."""

    def post(self, endpoint: Endpoint, body: Any) -> Answer:  # the engine's
        raise NotImplementedError

    def bad_request(self, message: str) -> Answer:  # the engine's
        raise NotImplementedError

    def drive(self, scripts: Iterable[Script[_T]], *, window: int = WINDOW) -> Iterator[_T]:
        """Each script run to its end, one at a time, its calls answered by
        `post`, each in the script's own context (`protocol.Script`); the
        results in order. An engine that answers many calls together (the
        serve path) overrides this; `window` is its bound there."""
        for script in scripts:
            yield run_script(script, self.post)

    def post_many(self, endpoint: Endpoint, bodies: Iterable[Any], *, window: int = WINDOW) -> Iterator[Answer]:
        """`post` for each of `bodies` (independent calls), in order,
        through `drive`: the serve path answers `window` at once."""
        return self.drive((_one_call(endpoint, body) for body in bodies), window=window)

    def chat(
        self,
        output: Output,
        request: Mapping[str, Any] | None,
        prompt_token_ids: Sequence[int] | None = None,
        *,
        finish_reason: str | None = "stop",
        lenient: bool = False,
    ) -> dict[str, Any]:
        """The ``ChatCompletionResponse`` the server gives for one rollout.

        Args:
            output: generate's response, or the generated ids of one choice
                (then `finish_reason` is the choice's: "stop" drops a final
                stop token as the engine does, "length" keeps every id).
            request: the chat completion request the rollout answers, as
                sent to ``/v1/chat/completions`` (its messages and tools, the
                sampling settings that shape the answer).
            prompt_token_ids: the prompt the render step produced; it seeds
                the decode and some parsers read it.
            lenient: skip derender's record checks (out-of-vocabulary ids...),
                answering bug for bug as the server does.

        Raises:
            RenderError: the call was refused (status 400, 422 or 500).

        """
        return self._rollout(Endpoint.CHAT, output, request, prompt_token_ids, finish_reason, lenient)

    def completion(
        self,
        output: Output,
        request: Mapping[str, Any] | None,
        prompt_token_ids: Sequence[int] | None = None,
        *,
        finish_reason: str | None = "stop",
        lenient: bool = False,
    ) -> dict[str, Any]:
        """The ``CompletionResponse`` the server gives for one prompt's
        output; arguments as for `chat`, with a completion request."""
        return self._rollout(Endpoint.COMPLETION, output, request, prompt_token_ids, finish_reason, lenient)

    def _rollout(
        self,
        endpoint: Endpoint,
        output: Output,
        request: Mapping[str, Any] | None,
        prompt: Sequence[int] | None,
        finish_reason: str | None,
        lenient: bool,
    ) -> dict[str, Any]:
        """The derender body for one rollout (chat takes one generate
        response, completion a list of one per prompt), answered."""
        one = endpoint is Endpoint.CHAT
        response = _generate_response(output, finish_reason)
        body: dict[str, Any] = {"generate_response": response} if one else {"generate_responses": [response]}
        if request is not None:
            body[endpoint.request_key] = dict(request)
        if prompt is not None:
            body["prompt_token_ids"] = list(prompt) if one else [list(prompt)]
            body["prompt_tokens"] = len(prompt) if one else [len(prompt)]
        if not lenient:
            problem = check_body(body, endpoint, stream=False, vocab_size=self.vocab_size)
            if problem is not None:
                refused = self.bad_request(problem)
                raise RenderError(refused.status, refused.error_message, refused.body)
        answer = self.post(endpoint, body)
        if not answer.ok:
            raise RenderError(answer.status, answer.error_message, answer.body)
        return answer.body

    def render_chat(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """The ``GenerateRequest`` the render server's
        ``/v1/chat/completions/render`` gives for a chat completion request:
        the prompt's ``token_ids``, the ``sampling_params``, the
        ``parse_context``, ...

        Raises:
            RenderError: the server refused the request (400, 404, 422, 500).

        """
        return self._rendered(Endpoint.RENDER_CHAT, request)  # type: ignore[no-any-return]

    def render_completion(self, request: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The ``GenerateRequest`` per prompt that the render server's
        ``/v1/completions/render`` gives for a completion request.

        Raises:
            RenderError: the server refused the request.

        """
        return self._rendered(Endpoint.RENDER_COMPLETION, request)  # type: ignore[no-any-return]

    def render_messages(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """The ``GenerateRequest`` the render server's ``/v1/messages/render``
        gives for an Anthropic Messages request.

        Raises:
            RenderError: the server refused the request.

        """
        return self._rendered(Endpoint.RENDER_MESSAGES, request)  # type: ignore[no-any-return]

    def render_responses(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """The ``GenerateRequest`` the render server's ``/v1/responses/render``
        gives for an OpenAI Responses request.

        Raises:
            RenderError: the server refused the request.

        """
        return self._rendered(Endpoint.RENDER_RESPONSES, request)  # type: ignore[no-any-return]

    def tokenize(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """What the render server's ``/tokenize`` answers for a body with a
        ``prompt`` or ``messages``: ``tokens``, ``count``,
        ``max_model_len`` (and ``token_strs`` when asked for).

        Raises:
            RenderError: the server refused the request.

        """
        return self._rendered(Endpoint.TOKENIZE, request)  # type: ignore[no-any-return]

    def detokenize(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """What the render server's ``/detokenize`` answers for a body with
        ``tokens``: ``{"prompt": text}``.

        Raises:
            RenderError: the server refused the request.

        """
        return self._rendered(Endpoint.DETOKENIZE, request)  # type: ignore[no-any-return]

    def _rendered(self, endpoint: Endpoint, request: Mapping[str, Any]) -> Any:
        answer = self.post(endpoint, dict(request))
        if not answer.ok:
            raise RenderError(answer.status, answer.error_message, answer.body)
        return answer.body

    def chat_batch(
        self,
        rollouts: Iterable[tuple[Output, Mapping[str, Any] | None, Sequence[int] | None]],
        *,
        finish_reason: str | None = "stop",
        lenient: bool = False,
        return_exceptions: bool = False,
    ) -> list[Any]:
        """`chat` for each ``(output, request, prompt_token_ids)``, in order.
        With `return_exceptions`, a refused rollout's place holds its
        `RenderError` and the rest are still answered."""
        return self._batch(self.chat, rollouts, finish_reason, lenient, return_exceptions)

    def completion_batch(
        self,
        rollouts: Iterable[tuple[Output, Mapping[str, Any] | None, Sequence[int] | None]],
        *,
        finish_reason: str | None = "stop",
        lenient: bool = False,
        return_exceptions: bool = False,
    ) -> list[Any]:
        """`completion` for each ``(output, request, prompt_token_ids)``."""
        return self._batch(self.completion, rollouts, finish_reason, lenient, return_exceptions)

    def _batch(self, call: Any, rollouts: Iterable[Any], finish_reason: str | None, lenient: bool, keep: bool) -> list[Any]:
        answers: list[Any] = []
        for output, request, prompt in rollouts:
            try:
                answers.append(call(output, request, prompt, finish_reason=finish_reason, lenient=lenient))
            except RenderError as exc:
                if not keep:
                    raise
                answers.append(exc)
        return answers

def run_script(script: Script[_T], post: Any) -> _T:
    """`script` run to its end in a context of its own, each call it makes
    answered by `post(endpoint, body)` in that context; a call that raises
    raises in the script."""
    context = contextvars.copy_context()
    step: Any = script.send
    answer: Any = None
    while True:
        try:
            endpoint, body = context.run(step, answer)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        try:
            step, answer = script.send, context.run(post, endpoint, body)
        except Exception as exc:  # raised in the script, where it made the call
            step, answer = script.throw, exc


def _one_call(endpoint: Endpoint, body: Any) -> Script[Answer]:
    return (yield endpoint, body)


def _generate_response(output: Output, finish_reason: str | None) -> Any:
    if isinstance(output, Mapping):
        return dict(output)
    return {"request_id": "derender", "choices": [{"index": 0, "token_ids": list(output), "finish_reason": finish_reason}]}
