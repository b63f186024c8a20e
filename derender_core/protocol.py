"""The contract every path answers to: which endpoint, and what it answered.

Every path that derenders (replay and live on the render endpoints, the serve
path), and the render endpoints that turn requests into prompts, behave like
an HTTP endpoint: a JSON body goes in, a status and the
exact bytes of a JSON body come out. Batch execution, workers and the CLI
only ever see `Derenderer` and `Answer`, so they never branch on the path.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from enum import Enum
from functools import cached_property
from typing import Any, Protocol, TypeVar

import orjson


class Endpoint(str, Enum):
    """The endpoints of `vllm launch render`: its two derender endpoints;
    the four render endpoints that turn a request (OpenAI chat or
    completion, Anthropic Messages, OpenAI Responses) into its prompt; and
    ``/tokenize`` and ``/detokenize``."""

    CHAT = "chat"
    COMPLETION = "completion"
    RENDER_CHAT = "render-chat"
    RENDER_COMPLETION = "render-completion"
    RENDER_MESSAGES = "render-messages"
    RENDER_RESPONSES = "render-responses"
    TOKENIZE = "tokenize"
    DETOKENIZE = "detokenize"

    @classmethod
    def of(cls, value: Endpoint | str) -> Endpoint:
        """The endpoint `value` names (a member, or its value as text):
        what every entry point taking an endpoint accepts.

        Raises:
            ValueError: naming the endpoints, for anything else.

        """
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                f"unknown endpoint {value!r}: {', '.join(repr(member.value) for member in cls)}"
            ) from None

    @property
    def path(self) -> str:
        """The HTTP path of the endpoint on the render server."""
        return _PATHS[self]

    @property
    def renders(self) -> bool:
        """An endpoint of the server's preprocessing half: the body is a
        request as a client sends it, answered as it is, with nothing to
        join or check (a render endpoint's answer is its
        ``GenerateRequest``, a list of them for completions; ``/tokenize``
        and ``/detokenize`` answer their own responses)."""
        return self._value_ not in _DERENDER_VALUES

    @property
    def request_key(self) -> str:
        """The body field that carries the original OpenAI request."""
        return "chat_request" if self._value_ in _CHAT_VALUES else "completion_request"

    @property
    def render(self) -> Endpoint:
        """The render endpoint for this endpoint's kind of request."""
        return Endpoint.RENDER_CHAT if self.request_key == "chat_request" else Endpoint.RENDER_COMPLETION


_DERENDER_VALUES = frozenset({"chat", "completion"})
_CHAT_VALUES = frozenset({"chat", "render-chat"})
_PATHS = {
    Endpoint.CHAT: "/v1/chat/completions/derender",
    Endpoint.COMPLETION: "/v1/completions/derender",
    Endpoint.RENDER_CHAT: "/v1/chat/completions/render",
    Endpoint.RENDER_COMPLETION: "/v1/completions/render",
    Endpoint.RENDER_MESSAGES: "/v1/messages/render",
    Endpoint.RENDER_RESPONSES: "/v1/responses/render",
    Endpoint.TOKENIZE: "/tokenize",
    Endpoint.DETOKENIZE: "/detokenize",
}
DERENDER_ENDPOINTS = (Endpoint.CHAT, Endpoint.COMPLETION)
"""The endpoints that derender token ids (`derender chat`, `completion`, `stream`)."""


class JsonString(str):
    """A body that is a JSON string (a line such as ``"hello"``), parsed:
    `post` answers it as the server answers any body that is not an object.
    A plain `str` given to `post` is taken for a line's JSON text not yet
    parsed, and refused (`parsed_body`)."""

    __slots__ = ()


def parsed_body(body: Any) -> Any:
    """The body `post` validates, as the server's JSON parser would have
    given it: a `JsonString` as the plain string it stands for, anything
    else but text as it is.

    Raises:
        TypeError: for a body given as JSON text (`str`, `bytes`) rather
            than parsed (a dict, for any call the server answers): the
            server's answer to a body that is a string, a 400 about
            ``model_attributes_type``, would name none of this.

    """
    kind = type(body)
    if kind is JsonString:
        return str(body)
    if isinstance(body, (str, bytes, bytearray, memoryview)):
        raise TypeError(
            f"post takes the body parsed from JSON (a dict: json.loads(line)), not its text as {kind.__name__}"
            + ("; a body that is a JSON string is protocol.JsonString(text)" if isinstance(body, str) else "")
        )
    return body


class Answer:
    """What the endpoint answered: HTTP status and the JSON body's bytes,
    exactly as the server would send them."""

    findings: tuple[Any, ...] = ()
    """What the path found out of band while answering this call: the serve
    path's stop-logic findings (`serve.StopFinding`), where the record and
    vLLM's stop logic disagree. Not part of the answer's bytes."""

    def __init__(self, status: int, raw: bytes) -> None:
        self.status = status
        self.raw = raw

    @cached_property
    def body(self) -> dict[str, Any]:
        return orjson.loads(self.raw)  # type: ignore[no-any-return]

    @property
    def ok(self) -> bool:
        return self.status == 200

    @property
    def error_message(self) -> str:
        """The error's message, or "" for a successful answer. vLLM's error
        shape has ``error.message``; FastAPI's own 400 for a body it cannot
        parse has ``detail``."""
        if self.ok:
            return ""
        error = self.body.get("error")
        if isinstance(error, Mapping):
            return str(error.get("message", ""))
        detail = self.body.get("detail")
        return detail if isinstance(detail, str) else ""

    @property
    def is_stream_answer(self) -> bool:
        """A successful answer to a streaming call: ``{chunk, stream_state}``."""
        return self.ok and "chunk" in self.body and "stream_state" in self.body

    @property
    def chunk(self) -> dict[str, Any]:
        """The derendered stream chunk of a successful streaming answer."""
        return self.body["chunk"]  # type: ignore[no-any-return]

    @cached_property
    def chunk_raw(self) -> bytes:
        """The chunk's bytes as the endpoint wrote them."""
        return render_json(self.chunk)

    @property
    def stream_state(self) -> Any:
        """The state a client carries into the next call of the stream."""
        return self.body["stream_state"]

    @property
    def chunks(self) -> list[dict[str, Any]]:
        """The stream chunks this call answered, in order: the render
        endpoints answer one per call; the serve path may answer none or
        several (`FramesAnswer`)."""
        return [self.chunk]

    @property
    def sse_events(self) -> bytes:
        """The SSE bytes a client reads for this call: the chunk as one
        ``data:`` event, or a failed call as the error event the server
        sends mid-stream (any other answer as its body)."""
        return b"data: " + (self.chunk_raw if self.is_stream_answer else self.raw) + b"\n\n"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Answer):
            return NotImplemented
        return (self.status, self.raw) == (other.status, other.raw)

    def __hash__(self) -> int:
        return hash((self.status, self.raw))

    def __repr__(self) -> str:
        return f"Answer({self.status}, {self.raw[:80]!r}...)"

    def __reduce__(self) -> tuple[Any, ...]:
        # Across processes an answer travels as what the server sent.
        return (Answer, (self.status, self.raw))


class StreamAnswer(Answer):
    """A successful streaming answer, kept as its parts.

    The chunk's bytes are made at once, and the state is tried (serialising
    either can fail, as it can on the server, and the call is then that
    error, in every output format); the state stays an object, carried to
    the next call as is, and a live state, which grows with its stream, is
    serialised only when the whole answer's bytes are read. SSE and
    assembled output never read them, so a live stream costs O(1) per call
    there.
    """

    def __init__(
        self,
        chunk: dict[str, Any] | None,
        chunk_raw: bytes,
        state: Any,
        dump_state: Callable[[Any], bytes],
    ) -> None:
        # No call to Answer.__init__: `raw` is built on demand.
        self.status = 200
        self._chunk = chunk
        self.__dict__["chunk_raw"] = chunk_raw
        self._state = state
        self._dump_state = dump_state

    @property
    def is_stream_answer(self) -> bool:
        return True

    @property
    def chunk(self) -> dict[str, Any]:
        """The chunk; given as None, read from its bytes when asked for
        (SSE output never asks), which gives the same values: the bytes
        hold JSON's own types only."""
        if self._chunk is None:
            self._chunk = orjson.loads(self.chunk_raw)
        return self._chunk

    @property
    def stream_state(self) -> Any:
        return self._state

    @cached_property
    def raw(self) -> bytes:
        # The handlers' JSONResponse over {"chunk", "stream_state"}, in parts.
        return b'{"chunk":' + self.chunk_raw + b',"stream_state":' + self._dump_state(self._state) + b"}"


class FramesAnswer(Answer):
    """A successful streaming answer made of the SSE frames a server sent
    for the call, kept as the exact bytes it wrote (``data: <json>\\n\\n``).

    The serve path answers this way: `vllm serve` sends a role frame, no
    frame for steps whose delta is empty, and the usage frame after the
    last step, so a call may answer zero, one or several chunks. As JSON
    (`raw`) the answer is ``{"chunks": [...]}``, each chunk exactly as the
    server serialised it. There is no state to carry: the path keeps each
    stream itself.
    """

    def __init__(self, frames: list[bytes], late: list[int] | None = None) -> None:
        self.status = 200
        self.frames = frames
        self.late = late
        """Per frame, how many calls before this one came the call it
        answers (serve answers a chunk once the next one says whether it
        finishes); None: each answers this call."""

    @property
    def is_stream_answer(self) -> bool:
        return True

    @cached_property
    def payloads(self) -> list[bytes]:
        """Each frame's JSON, as the server serialised it."""
        return [frame.removeprefix(b"data: ").removesuffix(b"\n\n") for frame in self.frames]

    @property
    def chunk(self) -> dict[str, Any]:
        raise AttributeError("a frames answer has no single chunk; read `chunks`")

    @cached_property
    def chunks(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [orjson.loads(payload) for payload in self.payloads]

    @property
    def stream_state(self) -> Any:
        return None

    @property
    def sse_events(self) -> bytes:
        return b"".join(self.frames)

    @cached_property
    def raw(self) -> bytes:  # type: ignore[override]
        return b'{"chunks":[' + b",".join(self.payloads) + b"]}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (FramesAnswer, (self.frames, self.late))


def render_json(content: Any) -> bytes:
    """Serialise as Starlette's ``JSONResponse.render`` does, so the bytes
    are the server's (and non-finite floats fail as they fail there)."""
    return json.dumps(
        content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
    ).encode("utf-8")


def render_state(state: Mapping[str, Any]) -> bytes:
    """A stream state's bytes, exactly as `render_json` writes them.

    A state holds only integers, booleans and token strings, for which
    orjson writes the same bytes as ``json.dumps`` (tests/test_protocol.py
    checks this), many times faster; jsonl output writes a state that grows
    with its stream on every call.
    """
    try:
        return orjson.dumps(state)
    except TypeError:  # e.g. a string that is not UTF-8: json words the failure
        return render_json(state)


WINDOW = 32
"""Calls in flight at once where a path answers many together
(`Derenderer.drive`): the serve path's engine core steps them as one batch."""

_T = TypeVar("_T")

Call = tuple[Endpoint, Any]
"""One call a script makes: the endpoint and the body."""

Script = Generator[Call, Answer, _T]
"""The calls one unit of work makes, in order, each answer sent back in
before the next call is made (a stream threads each answer's state into
its next call), a call that raises raising there; what it returns is its
result. A script runs in a context
of its own (`contextvars`), so what it sets there (`logs.ROUTE`) is its
own while the path answers it."""


class Derenderer(Protocol):
    """One path's answers to derender calls, as an HTTP endpoint gives them."""

    startup_seconds: float
    vocab_size: int
    """The tokenizer's full size, added tokens included; batch execution
    refuses token ids at or above it (`checks`)."""
    window: int
    """How many independent calls the path answers together (`drive`): 1
    where it answers one at a time, so callers read no further ahead than
    that; `WINDOW` on the serve path."""
    reads_logprob_text: bool
    """Whether a one-shot body may hold its choices' logprobs as their text
    (`logprob_text.LogprobsText`), for the path's writer to read: batch
    execution then reads them so (fast path ``lp_text``)."""

    def post(self, endpoint: Endpoint, body: Any) -> Answer:
        """Answer one call as ``POST endpoint.path`` would."""

    def drive(self, scripts: Iterable[Script[_T]], *, window: int = WINDOW) -> Iterator[_T]:
        """Run `scripts` and give their results in order. A path that
        batches (the serve path) runs up to `window` of them at once, as
        `vllm serve` batches the requests in flight; any other runs them
        one at a time (`api.CodeAPI.drive`). Scripts must not depend on one
        another: only their order of results is kept."""

    def post_many(self, endpoint: Endpoint, bodies: Iterable[Any], *, window: int = WINDOW) -> Iterator[Answer]:
        """`post` for each of `bodies`, independent calls, answered in order
        (`drive` with one call per script)."""

    def prompt_matters(self, endpoint: Endpoint) -> bool:
        """Whether a record's ``prompt_token_ids`` can change this path's
        answers on `endpoint`: derender says so when a record has none."""

    def prepare_render(self) -> None:
        """Build what the render endpoints need now, before workers fork."""

    def invalid_json(self, message: str, position: int | None) -> Answer:
        """The answer to a body that is not JSON."""

    def bad_request(self, message: str) -> Answer:
        """A 400 in the server's error shape, for problems found before the call."""

    def internal_error(self, exc: Exception) -> Answer:
        """What the server's catch-all handler answers for an unexpected
        exception, for a record that hit a bug rather than a bad input."""

    def chat_response(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        """A full chat response from assembled fields, vLLM's defaults for the rest."""

    def completion_response(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        """A full completion response from assembled fields."""

    def close(self) -> None:
        """Release what the path holds."""

    def after_fork(self) -> None:
        """Make the path usable in a process forked from the one that built
        it (and closed it just before forking): threads do not survive a fork."""
