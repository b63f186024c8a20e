"""Replay in O(n): vLLM's per-call stream replay, gone on from where it stopped.

The render server keeps nothing between the calls of a parsed chat stream:
``OnlineDerenderer._derender_chat_stream_parsed`` builds a fresh
``ChatStreamProcessor`` on every call and replays the stream's whole history
from the client-carried ``stream_state``, O(n) per call, O(n²) per stream.

Here the client is this process. A call whose state is the one this process
answered the stream's previous call with, for the same request and prompt
ids, would rebuild exactly the processor and decode window that previous
call left, so `ReplayStreams` goes on from them and steps only the call's
own chunk (`live._LiveStream`, whose steps the live proofs hold equal to
vLLM's replay). Such a state is answered as live mode answers it: a
`live.LiveState`, an immutable view of the kept stream whose
``to_model()`` is the state vLLM's replay returns, and whose history is not
copied or serialised per call. Every other state (retried, forked, edited,
captured, from another process, after a finished or failed step) is
answered by vLLM's own replay; the state that replay answers with goes on
at the next call, after one replay of its history, if it comes back
unchanged.

Every answer, chunk and state, is the one vLLM's replay gives:
`tests/test_replay.py` holds the two equal call for call over every family's
tokenizer, with drawn chunkings, retries, forks and edited states.
"""

from __future__ import annotations

import copy
import weakref
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionRequest,
    ChatCompletionStreamResponse,
)
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
    """A state vLLM's replay answered a call with, and what that replay was
    given besides."""

    state: DerenderStreamState
    """The state handed out (held, so its id stays its own)."""
    parser_cls: type[Parser]
    request: ChatCompletionRequest
    """The request the stream's processor was built for."""
    prompt_token_ids: list[int] | None
    decode_mode: str
    """The derenderer's decode mode for the call (`fast.FastDerenderer`)."""
    carried: dict[str, Any]
    """The state's other fields as handed out (a copy: edits in place show)."""
    history: tuple[Any, ...]
    """`_HISTORY`'s values as handed out (copies)."""

    def same_request(self, request: ChatCompletionRequest) -> bool:
        """Whether `request` builds the processor `self.request` built: the
        same object (a stream's request is validated once, `render`), or
        equal in Python and as JSON, which together tell apart what either
        alone would take as the same (``1`` and ``true`` are equal in
        Python, NaN is ``null`` in JSON), but for `_FRESH_PER_CALL`."""
        kept = self.request
        if kept is request:
            return True
        if type(kept) is not type(request):
            return False
        mine, theirs = dict(kept.__dict__), dict(request.__dict__)
        for name in _FRESH_PER_CALL:
            mine.pop(name, None)
            theirs.pop(name, None)
        if (
            mine != theirs
            or kept.__pydantic_private__ != request.__pydantic_private__
            or kept.__pydantic_extra__ != request.__pydantic_extra__
        ):
            return False
        written = _request_json(kept)
        return written is not None and written == _request_json(request)


class ReplayStreams:
    """The parsed chat streams of a `LiveDerenderer`: live mode's, and in
    replay mode, while the derenderer's `replay_mode` is "fast", a stream's
    next call gone on from this process's last answer; vLLM's own replay
    answers every other call."""

    def __init__(self, derenderer: LiveDerenderer) -> None:
        self.derenderer = derenderer
        self.live_or_replay: _Replay = derenderer._derender_chat_stream_parsed_async
        """`LiveDerenderer`'s dispatch: live, or vLLM's replay."""
        self.vllm_replay: _Replay = derenderer._replay_chat_stream_parsed_async
        self.kept: OrderedDict[int, _Kept] = OrderedDict()
        """The states vLLM's replay answered with, by id, that may go on."""
        self.streams: weakref.WeakKeyDictionary[_LiveStream, tuple[type[Parser], str]] = weakref.WeakKeyDictionary()
        """The streams this replay built, with the parser and decode mode
        they were built for (live mode's are not gone on from here)."""
        self.gone_on = 0
        """Calls answered by stepping a kept stream, with no replay."""

    @classmethod
    def install(cls, derenderer: Any) -> None:
        """Put the fast replay in the parsed path of `derenderer`, once."""
        if not isinstance(derenderer, LiveDerenderer):
            return
        current = derenderer._derender_chat_stream_parsed_async
        if isinstance(getattr(current, "__self__", None), cls):
            return
        streams = cls(derenderer)
        derenderer._derender_chat_stream_parsed_async = streams.answer
        derenderer.replay_streams = streams
        derenderer.replay_mode = "fast"

    def lane_takes(self, state: Any) -> bool:
        """Whether the live lane (`live.ChunkLane`) may answer a replay call
        carrying `state`: a live state of a stream this replay built on the
        derenderer's current decode, fast or vLLM's own (``--decode
        reference``, as `derender parity`'s replay path runs). The lane then
        steps it as `answer` would (`_LiveStream.advance`, on the stream's
        own decode), if the state goes on, and answers what the slow path
        would, without its per-call validation, handler and models."""
        if type(state) is not LiveState:
            return False
        built = self.streams.get(state.stream)
        return built is not None and built[1] == self.derenderer.decode_mode

    async def answer(
        self,
        parser_cls: type[Parser],
        model: str,
        generate_chunk: GenerateTokensStreamResponse,
        state: DerenderStreamState | LiveState,
        chat_request: ChatCompletionRequest,
        prompt_tokens: int | None,
        prompt_token_ids: list[int] | None,
    ) -> tuple[ChatCompletionStreamResponse, DerenderStreamState | LiveState]:
        """``_derender_chat_stream_parsed``'s answer for this call."""
        derenderer = self.derenderer
        if derenderer.live or getattr(derenderer, "replay_mode", "fast") != "fast":
            return await self.live_or_replay(
                parser_cls, model, generate_chunk, state, chat_request, prompt_tokens, prompt_token_ids
            )
        if isinstance(state, LiveState) and self._goes_on(state, parser_cls, chat_request, prompt_token_ids):
            stream, view = state.stream, state
            self.gone_on += 1
        else:
            if isinstance(state, LiveState):
                state = state.to_model()
            kept = self.kept.pop(id(state), None)
            if kept is None or not self._continues(kept, state, parser_cls, chat_request, prompt_token_ids):
                chunk, new_state = await self.vllm_replay(
                    parser_cls, model, generate_chunk, state, chat_request, prompt_tokens, prompt_token_ids
                )
                if type(new_state) is DerenderStreamState and _may_go_on(generate_chunk):
                    self._keep(new_state, parser_cls, chat_request, prompt_token_ids)
                return chunk, new_state
            # The state vLLM's replay answered the previous call with: its
            # history replayed as that replay would replay it, once.
            stream = _LiveStream(derenderer, parser_cls, state, chat_request, prompt_token_ids)
            self.streams[stream] = (parser_cls, derenderer.decode_mode)
            view = stream.snapshot()
        return stream.step(generate_chunk, view, model, prompt_tokens)

    def _goes_on(
        self,
        state: LiveState,
        parser_cls: type[Parser],
        request: ChatCompletionRequest,
        prompt_token_ids: list[int] | None,
    ) -> bool:
        """Whether a live state is the last a kept stream gave, unfinished,
        for this request object (validated once per stream, `render`) and
        these prompt ids, parser and decode."""
        built = self.streams.get(state.stream)
        return (
            built is not None
            and built[0] is parser_cls
            and built[1] == self.derenderer.decode_mode
            and state.continues(request, prompt_token_ids)
        )

    def _continues(
        self,
        kept: _Kept,
        incoming: DerenderStreamState,
        parser_cls: type[Parser],
        request: ChatCompletionRequest,
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
            or kept.prompt_token_ids != prompt_token_ids
            or not kept.same_request(request)
        ):
            return False
        if any(getattr(state, name) != value for name, value in kept.carried.items()):
            return False
        return kept.history == tuple(getattr(state, name) for name in _HISTORY)

    def _keep(
        self,
        state: DerenderStreamState,
        parser_cls: type[Parser],
        request: ChatCompletionRequest,
        prompt_token_ids: list[int] | None,
    ) -> None:
        """Remember the state vLLM's replay answered a call with."""
        carried = {name: getattr(state, name) for name in type(state).model_fields if name not in _HISTORY}
        self.kept[id(state)] = _Kept(
            state=state,
            parser_cls=parser_cls,
            request=request,
            prompt_token_ids=None if prompt_token_ids is None else list(prompt_token_ids),
            decode_mode=self.derenderer.decode_mode,
            carried=copy.deepcopy(carried),
            history=tuple(copy.copy(getattr(state, name)) for name in _HISTORY),
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
    """The request as JSON, but for `_FRESH_PER_CALL`; None where it
    cannot be written (never the same then)."""
    try:
        return request.model_dump_json(exclude=_FRESH_PER_CALL).encode()
    except Exception:  # noqa: BLE001 - any failure: never taken as the same
        return None
