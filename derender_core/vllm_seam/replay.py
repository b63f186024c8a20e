"""Replay in O(n): vLLM's per-call stream replay, gone on from where it stopped.

The render server keeps nothing between the calls of a parsed chat stream:
``OnlineDerenderer._derender_chat_stream_parsed`` builds a fresh
``ChatStreamProcessor`` on every call and replays the stream's whole history
from the client-carried ``stream_state``, O(n) per call, O(n²) per stream.

Here the client is this process. When a call's state is the very object this
process answered the stream's previous call with, unchanged, for the same
request, prompt ids, parser and decode, the replay that call would run
rebuilds exactly the processor and detokenizer window the previous call left
(`live._LiveStream`, held equal to vLLM's replay by the live proofs), so
`ReplayStreams` goes on from those and steps only the call's own chunk. Any
other state (edited, forked, retried, captured, from another process, after
a finish or a failed step) is answered by vLLM's own replay.

Every answer, chunk and state, is the one vLLM's replay gives:
`tests/test_replay.py` holds the two equal call for call over every family's
tokenizer, with drawn chunkings, retries, forks and edited states.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest, ChatCompletionStreamResponse
from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
    DerenderStreamState,
    GenerateTokensStreamResponse,
)
from vllm.parser import Parser

from .live import LiveDerenderer, LiveState, _LiveStream

STREAMS_KEPT = 4096
"""Streams whose next call may go on from here (the most recently used)."""

_HISTORY = (
    "output_token_ids",
    "output_chunk_lens",
    "role_sent",
    "tools_streamed",
    "last_tool_call_ids",
    "logprob_context_token_ids",
)
"""The state's fields the parsed path writes; the rest it carries as given."""

_Replay = Callable[..., Awaitable[tuple[ChatCompletionStreamResponse, DerenderStreamState]]]


@dataclass
class _Kept:
    """What this process answered a stream's last call with, and what it
    needs to go on from there."""

    state: DerenderStreamState
    """The state handed out (held, so its id stays its own)."""
    parser_cls: type[Parser]
    request: ChatCompletionRequest
    request_json: bytes
    prompt_token_ids: list[int] | None
    decode_mode: str
    """The derenderer's decode mode for the call (`fast.FastDerenderer`)."""
    carried: dict[str, Any]
    """The state's other fields as handed out (a copy: edits in place show)."""
    history: tuple[Any, ...] | None
    """`_HISTORY`'s values as handed out, while `stream` is not built yet."""
    stream: _LiveStream | None
    view: LiveState | None


class ReplayStreams:
    """The replay path of a `LiveDerenderer` whose streams' next calls go on
    from this process's last answer, while the derenderer's `replay_mode`
    is "fast"; vLLM's own replay answers every other call."""

    def __init__(self, derenderer: LiveDerenderer, vllm_replay: _Replay) -> None:
        self.derenderer = derenderer
        self.vllm_replay = vllm_replay
        self.kept: OrderedDict[int, _Kept] = OrderedDict()
        self.gone_on = 0
        """Calls answered by stepping a kept stream, with no replay."""

    @classmethod
    def install(cls, derenderer: Any) -> None:
        """Put the fast replay in the replay path of `derenderer`, once."""
        if not isinstance(derenderer, LiveDerenderer):
            return
        current = derenderer._replay_chat_stream_parsed_async
        if isinstance(getattr(current, "__self__", None), cls):
            return
        derenderer._replay_chat_stream_parsed_async = cls(derenderer, current).answer
        derenderer.replay_mode = "fast"

    async def answer(
        self,
        parser_cls: type[Parser],
        model: str,
        generate_chunk: GenerateTokensStreamResponse,
        state: DerenderStreamState,
        chat_request: ChatCompletionRequest,
        prompt_tokens: int | None,
        prompt_token_ids: list[int] | None,
    ) -> tuple[ChatCompletionStreamResponse, DerenderStreamState]:
        """``_derender_chat_stream_parsed``'s answer for this call."""
        derenderer = self.derenderer
        if getattr(derenderer, "replay_mode", "fast") != "fast":
            return await self.vllm_replay(
                parser_cls, model, generate_chunk, state, chat_request, prompt_tokens, prompt_token_ids
            )
        kept = self.kept.pop(id(state), None)
        request_json = _request_json(chat_request)
        if kept is None or not self._continues(kept, state, parser_cls, chat_request, request_json, prompt_token_ids):
            chunk, new_state = await self.vllm_replay(
                parser_cls, model, generate_chunk, state, chat_request, prompt_tokens, prompt_token_ids
            )
            if request_json is not None and type(new_state) is DerenderStreamState and _may_go_on(generate_chunk):
                self._keep(new_state, parser_cls, chat_request, request_json, prompt_token_ids)
            return chunk, new_state
        stream, view = kept.stream, kept.view
        if stream is None or view is None:
            # The state vLLM's replay answered the previous call with: the
            # history replayed as that replay would replay it, once.
            stream = _LiveStream(derenderer, parser_cls, state, chat_request, prompt_token_ids)
            view = stream.snapshot()
        else:
            self.gone_on += 1
        chunk, new_view = stream.step(generate_chunk, view, model, prompt_tokens)
        new_state = new_view.to_model()
        if stream.live and _may_go_on(generate_chunk):
            self.kept[id(new_state)] = dataclasses.replace(
                kept, state=new_state, request=chat_request, history=None, stream=stream, view=new_view
            )
            self._bound()
        return chunk, new_state

    def _continues(
        self,
        kept: _Kept,
        incoming: DerenderStreamState,
        parser_cls: type[Parser],
        request: ChatCompletionRequest,
        request_json: bytes | None,
        prompt_token_ids: list[int] | None,
    ) -> bool:
        """Whether vLLM's replay of this call would rebuild what `kept`
        holds: the same state object, unchanged, and the same inputs to the
        processor and the decode."""
        state = kept.state
        if (
            state is not incoming
            or type(state) is not DerenderStreamState
            or state.__pydantic_extra__
            or kept.parser_cls is not parser_cls
            or kept.decode_mode != self.derenderer.decode_mode
            or kept.request_json != request_json
            or kept.prompt_token_ids != prompt_token_ids
            or not _same_request(kept.request, request)
        ):
            return False
        if any(getattr(state, name) != value for name, value in kept.carried.items()):
            return False
        if kept.stream is None or kept.view is None:
            return kept.history == tuple(getattr(state, name) for name in _HISTORY)
        stream, view = kept.stream, kept.view
        return (
            stream.live
            and stream.version == view.version
            and state.role_sent is view.role_sent
            and state.tools_streamed is view.tools_streamed
            and state.output_token_ids == stream.token_ids
            and state.output_chunk_lens == stream.chunk_lens
            and state.last_tool_call_ids == stream.tool_call_ids
            and tuple(state.logprob_context_token_ids) == view.logprob_context_token_ids
        )

    def _keep(
        self,
        state: DerenderStreamState,
        parser_cls: type[Parser],
        request: ChatCompletionRequest,
        request_json: bytes,
        prompt_token_ids: list[int] | None,
    ) -> None:
        """Remember the state vLLM's replay answered a call with."""
        carried = {name: getattr(state, name) for name in type(state).model_fields if name not in _HISTORY}
        self.kept[id(state)] = _Kept(
            state=state,
            parser_cls=parser_cls,
            request=request,
            request_json=request_json,
            prompt_token_ids=None if prompt_token_ids is None else list(prompt_token_ids),
            decode_mode=self.derenderer.decode_mode,
            carried=copy.deepcopy(carried),
            history=tuple(copy.copy(getattr(state, name)) for name in _HISTORY),
            stream=None,
            view=None,
        )
        self._bound()

    def _bound(self) -> None:
        if len(self.kept) > STREAMS_KEPT:
            self.kept.popitem(last=False)


def _may_go_on(generate_chunk: GenerateTokensStreamResponse) -> bool:
    """Whether a next call may go on from this one: vLLM's replay steps
    every past chunk unfinished, so after a finished step it must replay
    (`live._LiveStream.advance` marks such a stream not live)."""
    return all(choice.finish_reason is None for choice in generate_chunk.choices)


_FRESH_PER_CALL = frozenset({"request_id"})
"""Request fields validation fills afresh on every call (a random id where
the caller sent none), which neither the processor nor the parsers read
(on 0.33 and 0.34 alike), so vLLM's replay of any call rebuilds the same
processor whatever they hold."""


def _request_json(request: ChatCompletionRequest) -> bytes | None:
    """The validated request as JSON, which with Python's equality
    (`_same_request`) tells apart what either alone would take as the same
    (``1`` and ``true`` are equal in Python, NaN is ``null`` in JSON); None
    where it cannot be written (never the same then)."""
    try:
        return request.model_dump_json(exclude=_FRESH_PER_CALL).encode()
    except Exception:  # noqa: BLE001 - any failure: never taken as the same
        return None


def _same_request(kept: ChatCompletionRequest, request: ChatCompletionRequest) -> bool:
    """Python's equality of two validated requests (pydantic's: the class,
    the fields, the private and extra values), but for `_FRESH_PER_CALL`."""
    if kept is request:
        return True
    if type(kept) is not type(request):
        return False
    mine, theirs = dict(kept.__dict__), dict(request.__dict__)
    for name in _FRESH_PER_CALL:
        mine.pop(name, None)
        theirs.pop(name, None)
    return (
        mine == theirs
        and kept.__pydantic_private__ == request.__pydantic_private__
        and kept.__pydantic_extra__ == request.__pydantic_extra__
    )
