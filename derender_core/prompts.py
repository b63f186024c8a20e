"""A derender record's prompt ids: rendered where the record lacks them,
noticed where it lacks them and they matter, checked against their
rendering.

The prompt ids seed the decode (a Metaspace tokenizer's first token keeps
its leading space only when seeded) and some parsers read them (a template
that opens ``<think>`` in the prompt; a stream's initial reasoning state).
A record without them is answered as the server answers such a body, which
may not be what ``vllm serve`` answered the user. So:

- with ``--render-prompts`` (`Job.render_prompts`), a record with a request
  and no prompt ids gets the ids vLLM's renderer gives its request, as
  ``/v1/chat/completions/render`` (``/v1/completions/render``) would give
  them, through the same engine's render endpoint;
- without it, each such record whose answer the prompt can change
  (`Derenderer.prompt_matters`) carries the notice `PROMPT_MISSING`, which
  the run's `Report` counts (`Report.prompts_missing`) and the summary
  shows. It travels with the record's outcome as a log line does, from
  worker processes and Ray actors too;
- `prompt_divergences` compares a record's ids with their rendering, for
  ``derender parity`` (field ``prompt_token_ids``, between ``record`` and
  ``render``).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import orjson

from .compare import Divergence
from .logs import LogLine
from .protocol import Answer, Derenderer, Endpoint

RENDER = "render"
"""The name of the rendered prompt in parity findings."""
RECORD = "record"
"""The name of the record itself in parity findings."""

PROMPT_MISSING = LogLine(
    key=("derender", logging.WARNING, "prompt_token_ids missing", ""),
    level="WARNING",
    logger="derender",
    example="a record with a request and no prompt_token_ids was derendered unseeded and "
    "unparsed by its prompt; --render-prompts renders them from the request",
)
"""The notice a record derendered without the prompt ids it needed carries."""

RENDERINGS_KEPT = 256
"""Rendered requests kept per processor: a stream's every call, or the n
samples of one prompt, render once."""


def lacks_prompt(body: Any, endpoint: Endpoint) -> bool:
    """A derender body with the request to render a prompt from, and no
    prompt ids for some response: neither the body's own nor, as vLLM falls
    back to them, the generate response's."""
    if not (type(body) is dict or isinstance(body, Mapping)):
        return False
    request = body.get(endpoint.request_key)
    if not (type(request) is dict or isinstance(request, Mapping)):  # a parsed record's is a dict
        return False
    given = body.get("prompt_token_ids")
    responses = body.get("generate_responses")
    if "generate_chunk" in body or not isinstance(responses, list):
        output = body.get("generate_chunk", body.get("generate_response"))
        return given is None and _ids_of(output) is None
    ids = given if isinstance(given, list) and len(given) == len(responses) else [None] * len(responses)
    return any(own is None and _ids_of(response) is None for own, response in zip(ids, responses, strict=True))


def _ids_of(output: Any) -> Any:
    return output.get("prompt_token_ids") if (type(output) is dict or isinstance(output, Mapping)) else None


def rendered_token_ids(answer: Answer) -> list[list[int]]:
    """The prompt ids of a render endpoint's successful answer, one list per
    prompt (a chat request renders one)."""
    rendered = answer.body
    generate_requests = rendered if isinstance(rendered, list) else [rendered]
    return [list(request.get("token_ids") or []) for request in generate_requests]


class PromptRenderer:
    """Renders the prompts of derender bodies through an engine's render
    endpoints, keeping the last `RENDERINGS_KEPT` renderings."""

    def __init__(self, engine: Derenderer) -> None:
        self.engine = engine
        self._kept: OrderedDict[tuple[Endpoint, bytes], Answer] = OrderedDict()

    def render(self, endpoint: Endpoint, request: Any) -> Answer:
        """The render endpoint's answer for the request of a body sent to
        `endpoint`."""
        try:
            key: tuple[Endpoint, bytes] | None = (endpoint, orjson.dumps(request, option=orjson.OPT_SORT_KEYS))
        except TypeError:  # an integer beyond 64 bits: render it, uncached
            key = None
        answer = self._kept.get(key) if key is not None else None
        if answer is None:
            answer = self.engine.post(endpoint.render, request)
            if key is not None:
                self._kept[key] = answer
                if len(self._kept) > RENDERINGS_KEPT:
                    self._kept.popitem(last=False)
        elif key is not None:
            self._kept.move_to_end(key)
        return answer

    def filled(self, endpoint: Endpoint, body: Mapping[str, Any]) -> tuple[Mapping[str, Any], Answer | None]:
        """`body` with the prompt ids it lacks rendered from its request, and
        ``prompt_tokens`` (when not given) their length, as the ``--requests``
        join fills it; or `body` and the render endpoint's error answer."""
        answer = self.render(endpoint, body[endpoint.request_key])
        if not answer.ok:
            return body, answer
        prompts = rendered_token_ids(answer)
        responses = body.get("generate_responses")
        if "generate_chunk" in body or not isinstance(responses, list):
            if len(prompts) != 1:
                return body, None  # a stream of one of several prompts: which one is unknown
            filled = {**body, "prompt_token_ids": prompts[0]}
            if body.get("prompt_tokens") is None:
                filled["prompt_tokens"] = len(prompts[0])
            return filled, None
        if len(prompts) != len(responses):
            return body, None  # the server's validation words the mismatch
        given = body.get("prompt_token_ids")
        own = given if isinstance(given, list) and len(given) == len(responses) else [None] * len(responses)
        ids = [
            mine if mine is not None else _ids_of(response) if _ids_of(response) is not None else prompt
            for mine, response, prompt in zip(own, responses, prompts, strict=True)
        ]
        filled = {**body, "prompt_token_ids": ids}
        if body.get("prompt_tokens") is None:
            filled["prompt_tokens"] = [len(entry) if isinstance(entry, list) else 0 for entry in ids]
        return filled, None


def prompt_divergences(renderer: PromptRenderer, endpoint: Endpoint, request_id: str, body: Any) -> list[Divergence]:
    """Where a derender body's own prompt ids differ from its request's
    rendering (one finding per prompt), or the request cannot be rendered."""
    if not (type(body) is dict or isinstance(body, Mapping)) or not isinstance(body.get(endpoint.request_key), Mapping):
        return []
    given = body.get("prompt_token_ids")
    recorded = given if endpoint is Endpoint.COMPLETION else [given]
    if not isinstance(recorded, list) or all(ids is None for ids in recorded):
        return []
    answer = renderer.render(endpoint, body[endpoint.request_key])
    if not answer.ok:
        return [Divergence(request_id, None, RECORD, RENDER, "prompt_token_ids", _shown(recorded[0]),
                           f"not rendered: {answer.status} {answer.error_message}")]  # fmt: skip
    found = []
    rendered = rendered_token_ids(answer)
    for index, (ids, prompt) in enumerate(zip(recorded, rendered, strict=False)):
        if ids is not None and list(ids) != prompt:
            first = next((i for i, (a, b) in enumerate(zip(ids, prompt, strict=False)) if a != b), min(len(ids), len(prompt)))
            found.append(
                Divergence(request_id, index if endpoint is Endpoint.COMPLETION else None, RECORD, RENDER,
                           "prompt_token_ids", _shown(ids, first), _shown(prompt, first))  # fmt: skip
            )
    return found


def _shown(ids: Any, first: int = 0) -> str:
    """Prompt ids in a line: their count and, from the first difference, a few."""
    if not isinstance(ids, list):
        return repr(ids)
    return f"{len(ids)} ids, from id {first}: {ids[first:first + 6]}"
