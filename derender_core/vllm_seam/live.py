"""Live streaming: vLLM's parsed streaming chat derender with the parser kept.

The render server cannot keep parser state between calls, so on every call
``OnlineDerenderer._derender_chat_stream_parsed`` builds a fresh
``ChatStreamProcessor`` and replays the whole history through it: O(n) per
call, O(n²) per stream. An offline run sees the whole stream in one
process, so `LiveDerenderer` keeps, per stream, what that method rebuilds:
the processor with its parser, and the incremental detokenizer window.

Each call then steps only its own chunk. The answer is built exactly as the
replay path builds it, from vLLM's own helpers (stop-token dropping,
incremental detokenization, logprob resolution, tool-call id pinning), and
the state it returns is a `LiveState`: the replay state, kept as a view of
the stream instead of a copy of its history. `to_model` gives the
``DerenderStreamState`` replay would have returned, so a stream begun here
can be finished by a render server and the other way round.

A call continues a live stream only when its state is the last one that
stream gave, for the same request and prompt, and nothing was stepped with
a finish reason yet. Anything else (a captured state, a call after a
failed step, chunks after the finish) is rebuilt by replaying the state's
history exactly as vLLM does, and goes live from there.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, overload

import orjson
from vllm.entrypoints.generate.base.protocol import DeltaMessage
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
)
from vllm.entrypoints.openai.chat_completion.stream_processor import ChatStreamProcessor
from vllm.entrypoints.openai.completion.protocol import (
    CompletionRequest,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
)
from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
    DerenderChatStreamRequest,
    DerenderCompletionStreamRequest,
    DerenderStreamState,
    GenerateTokensStreamResponse,
)
from vllm.entrypoints.serve.engine.protocol import UsageInfo
from vllm.parser import Parser
from vllm.renderers.online_derenderer import (
    _chat_top_logprobs_limit,
    _completion_top_logprobs_limit,
    _decode_params,
    _logprob_context_tail,
    _resolve_logprobs,
    _seed_stream_state,
)

from ..protocol import Answer, Endpoint, StreamAnswer
from . import logprobs as raw_logprobs
from . import versions
from .answers import dump_state, json_answer, stream_answer
from .fast import WINDOW_IDS, FastDerenderer
from .responses import SupportedModels


class LiveDerenderer(FastDerenderer):
    """`FastDerenderer` whose parsed chat streams step each chunk once
    while `live` is set, and replay as vLLM does while it is not, so one
    stack serves both modes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.live = False
        # derender_chat_stream dispatches the parser path through this
        # attribute; vLLM's replay runs it in the renderer's thread pool.
        self._replay_chat_stream_parsed_async = self._derender_chat_stream_parsed_async
        self._derender_chat_stream_parsed_async = self._derender_chat_stream_live
        self.completion_streams: OrderedDict[tuple[str, int], CompletionStream] = OrderedDict()
        """Per live completion stream (request id and choice index, as a
        client keeps a state per index), the state last handed out, which
        the chunk lane may go on from (`ChunkLane.answer_completion`)."""

    async def derender_completion_stream(
        self,
        model: str,
        generate_chunk: GenerateTokensStreamResponse,
        state: DerenderStreamState | None = None,
        prompt_tokens: int | None = None,
        completion_request: CompletionRequest | None = None,
        prompt_token_ids: list[int] | None = None,
    ) -> tuple[CompletionStreamResponse, DerenderStreamState]:
        """vLLM's, the state it answers with noted, while live on the fast
        decode, as the stream's last (`hand_out`): the chunk lane takes the
        stream's next call from it."""
        chunk, new_state = await super().derender_completion_stream(
            model, generate_chunk, state, prompt_tokens, completion_request, prompt_token_ids
        )
        if self.live and self.fast and generate_chunk.choices and type(new_state) is DerenderStreamState:
            self.hand_out((generate_chunk.request_id, generate_chunk.choices[0].index), new_state, completion_request)
        return chunk, new_state

    def hand_out(
        self, key: tuple[str, int], state: DerenderStreamState, request: CompletionRequest | None
    ) -> CompletionStream:
        """Note `state` as the completion stream's last, the most recently
        used of `STREAMS_KEPT`."""
        streams = self.completion_streams
        stream = streams.get(key)
        if stream is None or stream.request is not request:
            stream = streams[key] = CompletionStream(self, request)
        stream.hand_out(state)
        streams.move_to_end(key)
        if len(streams) > STREAMS_KEPT:
            streams.popitem(last=False)
        return stream

    async def _derender_chat_stream_live(
        self,
        parser_cls: type[Parser],
        model: str,
        generate_chunk: GenerateTokensStreamResponse,
        state: DerenderStreamState | LiveState,
        chat_request: ChatCompletionRequest,
        prompt_tokens: int | None,
        prompt_token_ids: list[int] | None,
    ) -> tuple[ChatCompletionStreamResponse, DerenderStreamState | LiveState]:
        if not self.live:
            if isinstance(state, LiveState):
                state = state.to_model()
            return await self._replay_chat_stream_parsed_async(  # type: ignore[no-any-return]
                parser_cls, model, generate_chunk, state, chat_request, prompt_tokens, prompt_token_ids
            )
        if isinstance(state, LiveState) and (
            # A chunk without a choice (usage) steps nothing: any state will do.
            not generate_chunk.choices or state.continues(chat_request, prompt_token_ids)
        ):
            stream = state.stream
        else:
            base = state.to_model() if isinstance(state, LiveState) else state
            stream = _LiveStream(self, parser_cls, base, chat_request, prompt_token_ids)
            state = stream.snapshot()
        return stream.step(generate_chunk, state, model, prompt_tokens)


class _LiveStream:
    """One choice's stream, as the replay path rebuilds it on every call."""

    def __init__(
        self,
        derenderer: FastDerenderer,
        parser_cls: type[Parser],
        base: DerenderStreamState,
        request: ChatCompletionRequest,
        prompt_token_ids: list[int] | None,
    ) -> None:
        self.derenderer = derenderer
        self.request = request
        self.prompt_token_ids = prompt_token_ids
        self.base = base
        self.tokenizer = derenderer.tokenizer
        self.processor = ChatStreamProcessor(
            request,
            parser_cls(
                self.tokenizer,
                request.tools,
                chat_template_kwargs=derenderer._resolve_chat_template_kwargs(request),
                model_config=derenderer.model_config,
            ),
            enable_auto_tools=derenderer.enable_auto_tools,
            parser_cls=parser_cls,
        )
        self.skip_special, self.spaces_between = _decode_params(
            self.tokenizer, request, preserve_special=True
        )
        self.detok = _seed_stream_state(
            self.tokenizer, prompt_token_ids, skip_special_tokens=self.skip_special
        )
        # With the fast decode, the window is kept as it is, not as a state
        # model rebuilt per chunk (`_decode`).
        self.table = derenderer.table if derenderer.fast else None
        # (pieces, prefix_offset, read_offset), and the pieces' ids where
        # vLLM steps those too (`fast.WINDOW_IDS`).
        self.window: tuple[Any, ...] = ()
        if self.table is not None:
            self.window = (
                self.table.window(self.detok, self.skip_special),
                self.detok.prefix_offset,
                self.detok.read_offset,
                *((self.detok.prev_token_ids,) if WINDOW_IDS else ()),
            )
        # What `_resolve_logprobs` takes besides 0.33's arguments, and the
        # endpoint's cut of the candidates.
        self.logprob_options = derenderer.logprob_options(request)
        self.top_limit = _chat_top_logprobs_limit(request)
        # The history, replayed as vLLM replays it: one step per chunk,
        # none finished, text decoded with special tokens kept.
        start = 0
        for chunk_len in base.output_chunk_lens:
            chunk = base.output_token_ids[start : start + chunk_len]
            start += chunk_len
            self.processor.step(self._decode(chunk), chunk, None, prompt_token_ids)
        # Replay rebuilds the same flag; the carried one stays authoritative.
        self.processor.tools_streamed = base.tools_streamed

        # Append-only, so every snapshot is a prefix of these.
        self.token_ids: list[int] = list(base.output_token_ids)
        self.chunk_lens: list[int] = list(base.output_chunk_lens)
        self.tool_call_ids: list[str] = list(base.last_tool_call_ids)
        self.role_sent = base.role_sent
        self.logprob_context: list[int] = list(base.logprob_context_token_ids)
        self.version = 0
        # Replay steps the history without finish reasons and with the
        # stop token still in: after a finished step, or a step that
        # failed halfway, only a replay gives the same parser state.
        self.live = True
        # Whether its states serialise (`answers._checked_state`): that
        # depends on `base` alone, so `ChunkLane` checks it once.
        self.state_checked = False

    def snapshot(self) -> LiveState:
        return LiveState(
            stream=self,
            version=self.version,
            token_count=len(self.token_ids),
            chunk_count=len(self.chunk_lens),
            tool_call_id_count=len(self.tool_call_ids),
            role_sent=self.role_sent,
            tools_streamed=self.processor.tools_streamed,
            logprob_context_token_ids=tuple(self.logprob_context),
        )

    def _decode(self, token_ids: list[int]) -> str:
        if self.table is not None:
            pieces, prefix_offset, read_offset, *ids = self.window
            text, *window = self.table.detokenize_delta(
                token_ids, pieces, prefix_offset, read_offset, self.skip_special, *ids
            )
            self.window = tuple(window)
            return text  # type: ignore[no-any-return]
        text, self.detok = self.derenderer._detokenize_delta(
            self.tokenizer,
            token_ids,
            self.detok,
            skip_special_tokens=self.skip_special,
            spaces_between_special_tokens=self.spaces_between,
        )
        return text

    def step(
        self,
        generate_chunk: GenerateTokensStreamResponse,
        state: LiveState,
        model: str,
        prompt_tokens: int | None,
    ) -> tuple[ChatCompletionStreamResponse, LiveState]:
        """The current chunk, as the replay path processes it after its
        replay (``_derender_chat_stream_parsed``), with vLLM's helpers."""
        return_token_ids = self.request.return_token_ids and not self.processor.hide_metadata
        stream_choices: list[ChatCompletionResponseStreamChoice] = []
        if generate_chunk.choices:
            choice = generate_chunk.choices[0]
            delta_message, finish_reason, stop_reason, resolved_logprobs, state = self.advance(
                choice.token_ids or [], choice.finish_reason, choice.stop_reason, choice.logprobs, state
            )
            stream_choices.append(
                ChatCompletionResponseStreamChoice(
                    index=choice.index,
                    delta=delta_message,
                    logprobs=resolved_logprobs,
                    finish_reason=finish_reason,
                    stop_reason=stop_reason,
                    token_ids=choice.token_ids if return_token_ids else None,
                )
            )

        usage: UsageInfo | None = None
        if generate_chunk.usage is not None:
            reported = generate_chunk.usage
            prompt = prompt_tokens if prompt_tokens is not None else (reported.prompt_tokens or 0)
            completion = reported.completion_tokens or 0
            usage = UsageInfo(
                prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
            )
        chunk = ChatCompletionStreamResponse(
            id=generate_chunk.request_id,
            model=model,
            choices=stream_choices,
            usage=usage,
            metrics=generate_chunk.metrics,
        )
        return chunk, state

    def advance(
        self,
        delta_tids: list[int],
        chunk_finish_reason: str | None,
        chunk_stop_reason: int | str | None,
        logprobs: Any,
        state: LiveState,
    ) -> tuple[DeltaMessage, str | None, int | str | None, Any, LiveState]:
        """Step one choice's chunk: its delta, finish reason, stop reason,
        resolved logprobs and the state after it, as the replay path
        computes them for its current chunk."""
        request = self.request
        processor = self.processor
        hide_metadata = processor.hide_metadata
        self.live = False  # until the step has gone through
        delta_message: DeltaMessage | None = None
        finish_reason: str | None = None
        text_tids, stop_reason = self.derenderer._drop_stop_token(
            delta_tids, chunk_finish_reason, chunk_stop_reason, request
        )
        if delta_tids or chunk_finish_reason is not None:
            text = self._decode(text_tids) if delta_tids else ""
            delta_message, finish_reason = processor.step(
                text, delta_tids, chunk_finish_reason, self.prompt_token_ids
            )
        if delta_tids:
            self.token_ids.extend(delta_tids)
            self.chunk_lens.append(len(delta_tids))

        resolved_logprobs = None
        if logprobs is not None and not hide_metadata:
            resolved_logprobs = _resolve_logprobs(
                logprobs,
                self.tokenizer,
                initial_context_token_ids=list(state.logprob_context_token_ids),
                top_limit=self.top_limit,
                **self.logprob_options,
            )
        self.logprob_context = _logprob_context_tail(list(state.logprob_context_token_ids), delta_tids)
        if delta_message is None:
            delta_message = DeltaMessage()
        for call in delta_message.tool_calls or ():
            if call.id is None:
                continue
            if call.index < len(self.tool_call_ids):
                # Pinned, as replay pins the id a fresh parser regenerates.
                call.id = self.tool_call_ids[call.index]
            else:
                self.tool_call_ids.append(call.id)
        if not self.role_sent:
            delta_message.role = "assistant"
            self.role_sent = True
        self.version += 1
        self.live = chunk_finish_reason is None
        return delta_message, finish_reason, stop_reason, resolved_logprobs, self.snapshot()


STREAMS_KEPT = 4096
"""Live completion streams whose next call the lane may take (the most
recently used)."""


class CompletionStream:
    """A live completion stream's last state handed out, for the chunk
    lane to go on from, and what its request sets for every chunk.

    vLLM's completion stream carries everything in its state (a bounded
    decode window, the logprobs' context and text offset); any state it
    validated or answered gives the same answer from the same code. The
    lane takes only the object last handed out, its fields unchanged (a
    copy is kept: an edit in place shows), so it reads a state whose
    every value is one vLLM's code made and whose serialisation the slow
    path already tried (its carried fields) or cannot fail (the window's
    vocabulary pieces, ints)."""

    __slots__ = ("request", "skip_special", "top_limit", "as_ids", "state", "fields")

    def __init__(self, derenderer: LiveDerenderer, request: CompletionRequest | None) -> None:
        self.request = request
        # (spaces_between_special_tokens only matters to slow tokenizers,
        # which have no fast decode.)
        self.skip_special = _decode_params(derenderer.tokenizer, request)[0]
        self.top_limit = _completion_top_logprobs_limit(request)
        self.as_ids = bool(derenderer.logprob_options(request).get("return_tokens_as_token_ids"))
        """Whether vLLM writes logprobs' tokens as ids (0.34's
        ``return_tokens_as_token_ids``): left to the slow path."""
        self.state: DerenderStreamState | None = None
        self.fields: dict[str, Any] = {}

    def hand_out(self, state: DerenderStreamState) -> None:
        self.state = state
        self.fields = {name: value.copy() if type(value) is list else value for name, value in state.__dict__.items()}

    def goes_on(self, state: Any, request: Any) -> bool:
        """Whether a call carrying `state` for `request` may be stepped
        here: the state is the one last handed out, unchanged."""
        return state is self.state and request is self.request and state.__dict__ == self.fields


class LiveState(NamedTuple):
    """The ``DerenderStreamState`` replay would return, as a view of a live
    stream: its history is a prefix of the stream's append-only lists.
    (Immutable, and a tuple because one is made per chunk.)"""

    stream: _LiveStream
    version: int
    token_count: int
    chunk_count: int
    tool_call_id_count: int
    role_sent: bool
    tools_streamed: bool
    logprob_context_token_ids: tuple[int, ...]

    @property
    def output_token_ids(self) -> Sequence[int]:
        """Read by the server's ``max_model_len`` check, for its length."""
        return _Prefix(self.stream.token_ids, self.token_count)

    def continues(self, request: ChatCompletionRequest, prompt_token_ids: list[int] | None) -> bool:
        """Whether the stream can step the next chunk from this state."""
        stream = self.stream
        return (
            stream.live
            and stream.version == self.version
            and request is stream.request
            and (prompt_token_ids is stream.prompt_token_ids or prompt_token_ids == stream.prompt_token_ids)
        )

    def to_model(self) -> DerenderStreamState:
        stream = self.stream
        return stream.base.model_copy(
            update={
                "output_token_ids": stream.token_ids[: self.token_count],
                "output_chunk_lens": stream.chunk_lens[: self.chunk_count],
                "role_sent": self.role_sent,
                "tools_streamed": self.tools_streamed,
                "last_tool_call_ids": stream.tool_call_ids[: self.tool_call_id_count],
                "logprob_context_token_ids": list(self.logprob_context_token_ids),
            }
        )

    def model_dump(self) -> dict[str, Any]:
        return self.to_model().model_dump()


class _Prefix(Sequence[int]):
    """The first `length` items of a list that only grows, without a copy."""

    def __init__(self, items: list[int], length: int) -> None:
        self._items = items
        self._length = length

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[int]: ...
    def __getitem__(self, index: int | slice) -> int | Sequence[int]:
        return self._items[: self._length][index]

    def __iter__(self) -> Iterator[int]:
        return iter(self._items[: self._length])


# --- the chunk lane ----------------------------------------------------------


@dataclass(frozen=True)
class KnownRequest:
    """A live stream's request and prompt ids as its first call sent them
    (raw) and as validation gave them, for the calls after it.

    A later call reuses the validated ones only when it sends the very same
    JSON: equal as Python values and as bytes (`same`), so ``1``, ``1.0``
    and ``true``, which Python holds equal, are told apart, and anything
    else is validated anew."""

    raw_request: Any
    raw_prompt: Any
    request: Any
    prompt_token_ids: Any
    request_bytes: bytes | None
    prompt_bytes: bytes | None
    request_has_null: bool
    """Whether the request's bytes hold ``null``, which NaN and the
    infinities are written as too."""
    prompt_has_null: bool
    """The same for the prompt ids: a ``null`` prompt's bytes are NaN's."""

    @classmethod
    def of(cls, raw_request: Any, raw_prompt: Any, request: Any, prompt_token_ids: Any) -> KnownRequest:
        request_bytes = _json_bytes(raw_request)
        prompt_bytes = _json_bytes(raw_prompt)
        return cls(
            raw_request, raw_prompt, request, prompt_token_ids, request_bytes, prompt_bytes,
            _holds_null(request_bytes), _holds_null(prompt_bytes),
        )

    def same(self, raw_request: Any, raw_prompt: Any) -> bool:
        """Whether a call sends this request and these prompt ids.

        Equal bytes are the same JSON, with one exception: orjson writes
        NaN and the infinities as ``null``, so for a request or prompt
        whose bytes hold ``null``, Python's equality must hold too (NaN
        equals nothing, ``null`` is None): a NaN prompt after a ``null``
        one is validated anew, and refused as the server refuses it. Bytes
        without ``null`` come from no NaN, no infinity and no None, and
        tell ``1``, ``1.0`` and ``true`` apart."""
        request_bytes = self.request_bytes
        return (
            request_bytes is not None
            and self.prompt_bytes is not None
            and _json_bytes(raw_prompt) == self.prompt_bytes
            and _json_bytes(raw_request) == request_bytes
            and (not self.request_has_null or raw_request == self.raw_request)
            and (not self.prompt_has_null or raw_prompt == self.raw_prompt)
        )


def _holds_null(data: bytes | None) -> bool:
    """Whether JSON bytes may stand for None, NaN or an infinity (or none
    were written): bytes alone cannot tell those apart."""
    return data is None or b"null" in data


def _json_bytes(value: Any) -> bytes | None:
    try:
        return orjson.dumps(value)
    except TypeError:  # an integer beyond 64 bits, say: never matched
        return None


_BODY_FIELDS = frozenset(DerenderChatStreamRequest.model_fields)
_COMPLETION_BODY_FIELDS = frozenset(DerenderCompletionStreamRequest.model_fields)


@dataclass(frozen=True)
class _Layout:
    """What vLLM's models make of a stream chunk with one choice and no
    usage or token ids: the fields, in their order, and the defaults the
    slow path writes."""

    chunk: dict[str, Any]
    choice: dict[str, Any]
    generate_fields: frozenset[str]
    """The generate chunk's fields, each None unless it is one of
    ``request_id``, ``choices`` and ``output_mode``."""
    generate_choice_fields: frozenset[str]
    """The generate choice's fields, each None unless it is ``index`` or
    ``token_ids``."""
    parts: tuple[bytes, ...]
    """The chunk's bytes between the id, created, model, index, the
    choice's own field (a chat chunk's delta, a completion's text) and
    logprobs."""
    field: str
    """The choice's own field: ``delta`` or ``text``."""

    def render(
        self, request_id: str, created: int, model: str, index: int, value: Any, logprobs: bytes = b"null"
    ) -> bytes:
        """`chunk` and `choice` with these values, as orjson writes the dict,
        `logprobs` as written (`ChunkLane._logprobs_json`)."""
        p = self.parts
        return b"".join(
            (p[0], orjson.dumps(request_id), p[1], b"%d" % created, p[2], orjson.dumps(model),
             p[3], b"%d" % index, p[4], orjson.dumps(value), p[5], logprobs, p[6])  # fmt: skip
        )

    def fields(
        self, request_id: str, created: int, model: str, index: int, value: Any, logprobs: Any = None
    ) -> dict[str, Any]:
        """The chunk's fields, as the response models dump them."""
        choice = {**self.choice, "index": index, self.field: value, "logprobs": logprobs}
        return {**self.chunk, "id": request_id, "created": created, "model": model, "choices": [choice]}


def _layout(endpoint: Endpoint = Endpoint.CHAT) -> _Layout | None:
    """The layout of a chat or a completion stream chunk, read off vLLM's
    own models once; None (no lane) when they are not what the lane
    writes: a field whose default is not None, a delta of other fields, a
    generate chunk that refuses null."""
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateTokensStreamChoice

    if endpoint is Endpoint.CHAT:
        field = "delta"
        probe = ChatCompletionStreamResponse(
            id="", model="", choices=[ChatCompletionResponseStreamChoice(index=0, delta=DeltaMessage())]
        ).model_dump()
        if list(DeltaMessage(role="r", content="c", reasoning="x").model_dump().items()) != list(
            zip(_PLAIN_DELTA, ("r", "c", "x"), strict=True)
        ):
            return None
    else:
        field = "text"
        probe = CompletionStreamResponse(
            id="", model="", choices=[CompletionResponseStreamChoice(index=0, text="")]
        ).model_dump()
    choice = probe["choices"][0]
    fixed = {"id", "object", "created", "model", "choices"}
    if any(value is not None for key, value in probe.items() if key not in fixed):
        return None
    if any(value is not None for key, value in choice.items() if key not in ("index", field)):
        return None
    generate_fields = frozenset(GenerateTokensStreamResponse.model_fields)
    generate_choice_fields = frozenset(GenerateTokensStreamChoice.model_fields)
    # Null is accepted for every field the lane lets be null.
    nulls = {key: None for key in generate_fields - {"request_id", "choices", "output_mode"}}
    choice_nulls = {key: None for key in generate_choice_fields - {"index"}}
    try:
        GenerateTokensStreamResponse.model_validate({**nulls, "request_id": "", "output_mode": "tokens", "choices": [{**choice_nulls, "index": 0}]})
    except Exception:  # noqa: BLE001 - any refusal means: no lane
        return None
    chunk_template = {**probe, "choices": None}
    choice_template = {**choice, field: None}
    # The chunk's bytes around what varies: the rest as orjson writes it.
    marks = ("\x00id\x00", 987_654_321_987_654, "\x00model\x00", 123_456_789_123_456, "\x00value\x00", "\x00lp\x00")
    marked = orjson.dumps(
        {**chunk_template, "id": marks[0], "created": marks[1], "model": marks[2],
         "choices": [{**choice_template, "index": marks[3], field: marks[4], "logprobs": marks[5]}]}  # fmt: skip
    )
    parts = []
    for mark in marks:
        head, found, marked = marked.partition(orjson.dumps(mark))
        if not found:
            return None
        parts.append(head)
    parts.append(marked)
    return _Layout(
        chunk=chunk_template,
        choice=choice_template,
        generate_fields=generate_fields,
        generate_choice_fields=generate_choice_fields,
        parts=tuple(parts),
        field=field,
    )


class _Call(NamedTuple):
    """A usual call's values, read off its body (`ChunkLane._usual`)."""

    state: Any
    request_id: str
    index: int
    token_ids: list[int]
    logprobs: Any
    """The choice's logprobs as loaded; None where it has none."""
    model: str | None
    request: Any
    """The request the stream's first call validated (`KnownRequest`)."""
    prompt_token_ids: Any


class ChunkLane:
    """The calls of a live stream, answered without the per-call pydantic
    round trip: the usual chunk (one choice, tokens, no finish, no usage
    or token ids; logprobs only of the usual shape, where fast path
    ``stream_lp`` is on) of a stream whose request is known and whose
    state continues; and the same of a live completion stream
    (`answer_completion`, fast path ``live_cmpl``).

    For such a body, validation is the identity: every field the lane takes
    is of the exact JSON type the models keep as is (a str, an int, a list
    of ints, null where null is accepted), the request and prompt ids are
    the ones the stream's first call validated (`KnownRequest.same`), and
    the state is the object the previous answer gave. The handler's checks
    (`ServingDerender.derender_chat_stream_response`) come out the same for
    it as on the slow path, which answers anything else: a model vLLM does
    not serve, stop strings, more than ``max_model_len`` tokens. The step
    itself is `_LiveStream.advance`, the slow path's, its logprobs written
    from the loaded chunk as the one-shot path writes them
    (`_logprobs_json`), and the chunk's
    bytes are the response models' dump as the endpoint writes it,
    written with orjson in the models' field order (`_layout`), a failure
    to serialise going the slow path's way (`answers.stream_answer`).

    `answer` gives None for any body the lane does not take; the caller
    then runs the slow path, which gives the same answer for every body.
    """

    def __init__(self, serving: Any, known: OrderedDict[str, KnownRequest]) -> None:
        from vllm.entrypoints.scale_out.derender import serving as serving_module

        self.serving = serving
        self.derenderer = serving.online_derenderer
        self.known = known
        self.max_model_len = serving.model_config.max_model_len
        self.handler_logger = serving_module.logger
        self.layout = _layout(Endpoint.CHAT)
        self.completion_layout = _layout(Endpoint.COMPLETION)
        self.models = SupportedModels(serving)
        self.logprobs = versions.proven("logprobs") and versions.proven("stream_lp")
        """Whether chunks with logprobs are taken (fast path ``stream_lp``)."""
        self.completions = versions.proven("live_cmpl") and isinstance(self.derenderer, LiveDerenderer)
        """Whether live completion chunks are taken (fast path ``live_cmpl``)."""
        self.completion_logprobs = self.completions and versions.proven("logprobs")
        """Whether completion chunks with logprobs are taken too."""

    def usable(self) -> bool:
        """Whether the lane answers as the slow path would in this process
        now: vLLM's handler would log nothing (no request logger, its debug
        lines off) and its derenderer is a live, parsed one."""
        return self.layout is not None and self.derenderer.parser is not None and self._quiet()

    def _quiet(self) -> bool:
        """Whether vLLM's handler would log nothing for the call: no
        request logger, its debug lines off."""
        return self.serving.request_logger is None and not self.handler_logger.isEnabledFor(logging.DEBUG)

    def _usual(
        self,
        body: Any,
        state_type: type,
        fields: frozenset[str],
        request_key: str,
        layout: _Layout | None,
        logprobs: bool,
    ) -> _Call | None:
        """The values of a usual call (a stream body of these `fields`, a
        state of `state_type`, one choice of ids, logprobs only where
        `logprobs` allows, a known request), or None (and where there is
        no `layout`). The checks the chat and completion lanes share."""
        if type(body) is not dict or layout is None:
            return None
        chunk = body.get("generate_chunk")
        state = body.get("stream_state")
        if (
            type(state) is not state_type
            or type(chunk) is not dict
            or body.get("stream") is not True
            or not body.keys() <= fields
        ):
            return None
        request_id = chunk.get("request_id")
        choices = chunk.get("choices")
        if type(request_id) is not str or type(choices) is not list or len(choices) != 1:
            return None
        if not chunk.keys() <= _PLAIN_CHUNK:
            if not chunk.keys() <= layout.generate_fields or chunk.get("output_mode", "tokens") != "tokens":
                return None
            for key, value in chunk.items():
                if value is not None and key not in _PLAIN_CHUNK and key != "output_mode":
                    return None
        choice = choices[0]
        if type(choice) is not dict or not choice.keys() <= layout.generate_choice_fields:
            return None
        index = choice.get("index")
        token_ids = choice.get("token_ids")
        if type(index) is not int:
            return None
        if token_ids is None:
            token_ids = []
        elif type(token_ids) is not list:
            return None
        for token_id in token_ids:
            if type(token_id) is not int:
                return None
        chosen = None
        for key, value in choice.items():
            if value is not None and key != "index" and key != "token_ids":
                if key != "logprobs" or not logprobs:
                    return None
                chosen = value
        model = body.get("model")
        prompt_tokens = body.get("prompt_tokens")
        if not (model is None or type(model) is str) or not (prompt_tokens is None or type(prompt_tokens) is int):
            return None
        known = self.known.get(request_id)
        if known is None or not known.same(body.get(request_key), body.get("prompt_token_ids")):
            return None
        return _Call(state, request_id, index, token_ids, chosen, model, known.request, known.prompt_token_ids)

    def stateless(self, endpoint: Endpoint, body: Any) -> _Call | None:
        """The values of a stream's usual call that carries no state (the
        serve path's, which keeps its streams itself): a body of the
        streaming request's fields without ``stream_state`` (or with it
        null), one choice of ids with no finish, stop reason or logprobs,
        and the request and prompt ids its stream's first call validated
        (`KnownRequest.same`); None for anything else. For such a body
        the streaming request's validation is the identity (`_usual`)."""
        if endpoint is Endpoint.CHAT:
            return self._usual(body, type(None), _BODY_FIELDS, "chat_request", self.layout, False)
        return self._usual(
            body, type(None), _COMPLETION_BODY_FIELDS, "completion_request", self.completion_layout, False
        )

    def answer(self, body: Any) -> Answer | None:
        call = self._usual(body, LiveState, _BODY_FIELDS, "chat_request", self.layout, self.logprobs)
        if call is None:
            return None
        state: LiveState = call.state
        request, prompt_token_ids, token_ids, request_id = call.request, call.prompt_token_ids, call.token_ids, call.request_id
        layout: _Layout = self.layout  # type: ignore[assignment]  # `_usual` saw it
        if (
            request.stop
            or request.return_token_ids
            or prompt_token_ids is None
            or not state.continues(request, prompt_token_ids)
            or len(prompt_token_ids) + state.token_count + len(token_ids) > self.max_model_len
            or not self.models.supported(call.model)
            or not self.usable()
        ):
            return None
        stream = state.stream
        written_logprobs = b"null"
        if call.logprobs is not None:
            written = self._logprobs_json(stream, call.logprobs, state)
            if written is None:
                return None
            written_logprobs = written
        self.known.move_to_end(request_id)  # in use: the last to be forgotten
        try:
            delta, _, _, _, new_state = stream.advance(token_ids, None, None, None, state)
        except Exception as exc:
            # The handler's answer when the derenderer raises.
            self.handler_logger.debug("derender stream replay failed: %s: %s", type(exc).__name__, exc)
            error = self.serving.create_error_response("invalid stream_state: derender failed")
            return json_answer(error.model_dump(), error.error.code)
        plain = (
            type(delta) is DeltaMessage
            and not delta.tool_calls
            and not delta.__pydantic_extra__
            and type(delta.role) in _TEXT
            and type(delta.content) in _TEXT
            and type(delta.reasoning) in _TEXT
        )
        if plain:
            delta_fields: dict[str, Any] = {"role": delta.role, "content": delta.content, "reasoning": delta.reasoning}
        else:
            delta_fields = delta.model_dump()
        created, index = int(time.time()), call.index
        model_name = call.model or self.serving.models.model_name()
        # Anything but text (a tool call, a parser's extra field, which may
        # hold a float orjson writes otherwise) is written as the slow path
        # writes it.
        if plain and stream.state_checked:
            try:
                raw = layout.render(request_id, created, model_name, index, delta_fields, written_logprobs)
            except TypeError:  # a string that is not UTF-8: json words the failure
                pass
            else:
                return StreamAnswer(None, raw, new_state, dump_state)
        # The logprobs read back: json writes what it reads as it was
        # written (floats as their repr, strings as json_str wrote them).
        fields = layout.fields(request_id, created, model_name, index, delta_fields, json.loads(written_logprobs))
        answer = stream_answer(fields, new_state)
        stream.state_checked = answer.ok
        return answer

    def answer_completion(self, body: Any) -> Answer | None:
        """A live completion stream's usual call, answered as vLLM's
        ``derender_completion_stream`` and its handler answer it on the
        slow path: the state's decode window stepped by the derenderer's
        own fast decode (`fast.FastDerenderer.window_step`), the logprobs written from
        the loaded chunk (`_completion_logprobs_json`), the state updated
        as vLLM updates it, the chunk written in the models' field order.
        Taken only where the state is the one the stream last handed out,
        unchanged (`CompletionStream`), for the request it was made for,
        and the handler's checks pass (a served model, no stop strings,
        prompt ids within ``max_model_len``; it bounds nothing else). None
        for anything else, and where a step raises: the slow path, which
        changes nothing the lane reads, answers it (its error, say)."""
        if not self.completions:
            return None
        call = self._usual(
            body, DerenderStreamState, _COMPLETION_BODY_FIELDS, "completion_request", self.completion_layout,
            self.completion_logprobs,
        )  # fmt: skip
        if call is None:
            return None
        layout: _Layout = self.completion_layout  # type: ignore[assignment]  # `_usual` saw it
        state: DerenderStreamState = call.state
        request, token_ids, logprobs, request_id = call.request, call.token_ids, call.logprobs, call.request_id
        derenderer = self.derenderer
        key = (request_id, call.index)
        stream = derenderer.completion_streams.get(key)
        if (
            stream is None
            or not stream.goes_on(state, request)
            or request.stop
            or request.return_token_ids
            or (call.prompt_token_ids is not None and len(call.prompt_token_ids) > self.max_model_len)
            or not derenderer.fast
            or not self.models.supported(call.model)
            or not self._quiet()
        ):
            return None
        written_logprobs, end = b"null", None
        try:
            text, update = derenderer.window_step(token_ids, state, stream.skip_special)
            if logprobs is not None:
                written = self._completion_logprobs_json(stream, logprobs, state)
                if written is None:
                    return None
                written_logprobs, end = written
        except Exception:  # noqa: BLE001 - the slow path answers it as vLLM does
            return None
        # vLLM's next offset: after the last token where the chunk's
        # logprobs hold one, else after the chunk's text.
        text_offset = end if end is not None and logprobs["content"] else state.logprob_text_offset + len(text)
        # vLLM's two copies (the window's, then the logprobs' fields), as one.
        update["logprob_context_token_ids"] = _logprob_context_tail(state.logprob_context_token_ids, token_ids)
        update["logprob_text_offset"] = text_offset
        new_state = state.model_copy(update=update)
        self.known.move_to_end(request_id)  # in use: the last to be forgotten
        created, index = int(time.time()), call.index
        model_name = call.model or self.serving.models.model_name()
        try:
            raw = layout.render(request_id, created, model_name, index, text, written_logprobs)
        except TypeError:  # a string that is not UTF-8: json words the failure
            fields = layout.fields(request_id, created, model_name, index, text, json.loads(written_logprobs))
            answer = stream_answer(fields, new_state)
        else:
            answer = StreamAnswer(None, raw, new_state, dump_state)
        if answer.ok:
            derenderer.hand_out(key, new_state, request)
        return answer

    def _logprobs_json(self, stream: _LiveStream, logprobs: Any, state: LiveState) -> bytes | None:
        """The chunk's ``logprobs`` JSON, for generate's logprobs as loaded,
        as `_LiveStream.advance` resolves them and the endpoint writes them:
        ``null`` where the processor hides them; written from the per-id
        fragments (`logprobs.chat_json`, the state's context before the
        chunk's ids) where they are of the usual shape, which validation
        keeps as it is. None, for the slow path to answer, where they are
        not, where vLLM writes tokens as ids (0.34's
        ``return_tokens_as_token_ids``), where the stream does not run the
        fast decode (no table: vLLM's own functions), where the context
        holds an id the one-shot path never sees there, or where they
        cannot be written (a logprob not finite: the slow path's error)."""
        derenderer = self.derenderer
        fragments = getattr(derenderer, "fragments", None)
        if (
            stream.table is None
            or fragments is None
            or not derenderer.fast
            or stream.logprob_options.get("return_tokens_as_token_ids")
        ):
            return None
        usual = _usual_logprobs(logprobs, state.logprob_context_token_ids)
        if usual is None:
            return None
        if stream.processor.hide_metadata:
            return b"null"
        return raw_logprobs.chat_json(fragments, usual, stream.top_limit, state.logprob_context_token_ids)

    def _completion_logprobs_json(
        self, stream: CompletionStream, logprobs: Any, state: DerenderStreamState
    ) -> tuple[bytes, int] | None:
        """A completion chunk's ``logprobs`` JSON and the text offset after
        its last token, as vLLM resolves and converts them
        (``_convert_chat_logprobs_to_completion_logprobs``, offsets from the
        state's) and the endpoint writes them, written from the per-id
        fragments (`logprobs.completion_stream_json`). None, for the slow
        path, as for `_logprobs_json`, and where the state's offset is not
        an int the models would write as it is (``true`` is ``1`` there) or
        the offsets could pass what orjson writes."""
        fragments = getattr(self.derenderer, "fragments", None)
        offset = state.logprob_text_offset
        if fragments is None or stream.as_ids or type(offset) is not int or not 0 <= offset < _OFFSET_BOUND:
            return None
        context = state.logprob_context_token_ids
        usual = _usual_logprobs(logprobs, context)
        if usual is None:
            return None
        return raw_logprobs.completion_stream_json(fragments, usual, stream.top_limit, context, offset)


def _usual_logprobs(logprobs: Any, context: Sequence[int]) -> raw_logprobs.Usual | None:
    """A stream chunk's logprobs as loaded, where they are of the usual
    shape (the stream endpoints check no bound on them) and the state's
    context holds only ids the one-shot path sees there; else None."""
    usual = raw_logprobs.usual_content(logprobs, sys.maxsize, -1)
    bound = raw_logprobs._ID_BOUND
    if usual is None or not all(type(token_id) is int and 0 <= token_id < bound for token_id in context):
        return None
    return usual


_OFFSET_BOUND = 1 << 62
"""Text offsets the lane writes from: orjson writes ints below 2**64."""
_PLAIN_CHUNK = frozenset({"request_id", "choices"})
_PLAIN_DELTA = ("role", "content", "reasoning")
"""A text delta's fields, in the order ``DeltaMessage`` dumps them."""
_TEXT = (str, type(None))
