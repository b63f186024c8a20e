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

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

from vllm.entrypoints.generate.base.protocol import DeltaMessage
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
)
from vllm.entrypoints.openai.chat_completion.stream_processor import ChatStreamProcessor
from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
    DerenderStreamState,
    GenerateTokensStreamResponse,
)
from vllm.entrypoints.serve.engine.protocol import UsageInfo
from vllm.parser import Parser
from vllm.renderers.online_derenderer import (
    _chat_top_logprobs_limit,
    _decode_params,
    _logprob_context_tail,
    _resolve_logprobs,
    _seed_stream_state,
)

from .fast import FastDerenderer


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
        self.window = (list(self.detok.prev_tokens), self.detok.prefix_offset, self.detok.read_offset)
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
            text, *window = self.table.detokenize_delta(token_ids, *self.window, self.skip_special)
            self.window = tuple(window)  # type: ignore[assignment]
            return text
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
        request = self.request
        processor = self.processor
        hide_metadata = processor.hide_metadata
        return_token_ids = request.return_token_ids and not hide_metadata
        stream_choices: list[ChatCompletionResponseStreamChoice] = []
        if generate_chunk.choices:
            self.live = False  # until the step has gone through
            choice = generate_chunk.choices[0]
            delta_tids = choice.token_ids or []
            delta_message: DeltaMessage | None = None
            finish_reason: str | None = None
            text_tids, stop_reason = self.derenderer._drop_stop_token(
                delta_tids, choice.finish_reason, choice.stop_reason, request
            )
            if delta_tids or choice.finish_reason is not None:
                text = self._decode(text_tids) if delta_tids else ""
                delta_message, finish_reason = processor.step(
                    text, delta_tids, choice.finish_reason, self.prompt_token_ids
                )
            if delta_tids:
                self.token_ids.extend(delta_tids)
                self.chunk_lens.append(len(delta_tids))

            resolved_logprobs = None
            if choice.logprobs is not None and not hide_metadata:
                resolved_logprobs = _resolve_logprobs(
                    choice.logprobs,
                    self.tokenizer,
                    initial_context_token_ids=list(state.logprob_context_token_ids),
                    top_limit=_chat_top_logprobs_limit(request),
                )
            self.logprob_context = _logprob_context_tail(
                list(state.logprob_context_token_ids), delta_tids
            )
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
            self.version += 1
            self.live = choice.finish_reason is None
            state = self.snapshot()

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


@dataclass(frozen=True)
class LiveState:
    """The ``DerenderStreamState`` replay would return, as a view of a live
    stream: its history is a prefix of the stream's append-only lists."""

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
            and prompt_token_ids == stream.prompt_token_ids
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
