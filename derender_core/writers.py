"""Output writers: JSONL answers, SSE transcripts, assembled responses.

Every writer takes the answers in input order. `JsonlWriter` writes one line
per answer, so output record *i* answers input record *i*. The transcript
writers group a stream's answers by request and write a request when the
ledger reports it complete (or at the end of the input), so only the
streams still open are held in memory.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Generic, Protocol, TypeVar

import orjson

from .errors import StreamFailure
from .naming import Names
from .protocol import Answer, Endpoint
from .streams import ChunkFacts

if TYPE_CHECKING:
    from .records import Record

SSE_DONE = b"data: [DONE]\n\n"
Group = TypeVar("Group")


class Writer(Protocol):
    """Where answers go, in input order."""

    def add(self, answer: Answer, facts: ChunkFacts | None) -> None:
        """Take the answer to the next record; `facts` describe a streamed
        chunk's call, None for one-shot calls or records never sent."""

    def complete(self, request_id: str | None) -> None:
        """The stream of `request_id` has ended in the input."""

    def close(self) -> None:
        """The input has ended."""

    @property
    def records_written(self) -> int | None:
        """Output records the output holds in full, when the output can
        tell (`records.OutputFile` can)."""


def _records_written(target: object) -> int | None:
    return getattr(target, "records_written", None)


class JsonlWriter:
    """One line per answer: the HTTP body the render server would send."""

    def __init__(self, target: BinaryIO) -> None:
        self._target = target

    def add(self, answer: Answer, facts: ChunkFacts | None) -> None:
        self._target.write(answer.raw + b"\n")

    def complete(self, request_id: str | None) -> None:
        pass

    def close(self) -> None:
        self._target.flush()

    @property
    def records_written(self) -> int | None:
        return _records_written(self._target)


class _GroupedWriter(ABC, Generic[Group]):
    """Collects per-request output until the request's stream completes.

    Answers that belong to no request (a line that is not JSON, a chunk
    whose request is unknown) are counted in the run's report and left out
    of the transcripts, which have no line for them.
    """

    def __init__(self) -> None:
        self._open: dict[str | None, Group] = {}

    def add(self, answer: Answer, facts: ChunkFacts | None) -> None:
        if facts is None:
            return
        if facts.request_id not in self._open:
            self._open[facts.request_id] = self._start(facts.request_id)
        self._take(self._open[facts.request_id], answer)

    def complete(self, request_id: str | None) -> None:
        if request_id in self._open:
            self._emit(request_id, self._open.pop(request_id))

    def close(self) -> None:
        # Streams the input left unfinished, in the order they started.
        for request_id in list(self._open):
            self.complete(request_id)
        self._finish()

    @abstractmethod
    def _start(self, request_id: str | None) -> Group:
        """A new, empty group for a request."""

    @abstractmethod
    def _take(self, group: Group, answer: Answer) -> None:
        """Add one answer of the request to its group."""

    @abstractmethod
    def _emit(self, request_id: str | None, group: Group) -> None:
        """Write a finished group."""

    @abstractmethod
    def _finish(self) -> None:
        """Flush after the last group."""


class SseWriter(_GroupedWriter[list[bytes]]):
    """Per request, the SSE transcript a client of `vllm serve` reads:
    each call's events (`Answer.sse_events`), then ``data: [DONE]``. For the
    render endpoints that is the ``chunk`` each call answered, as a split
    render/generate deployment forwards it; for the serve path, the frames
    `vllm serve` itself sent. A failed call appears as the error event the
    server sends mid-stream.

    To one stream, transcripts follow one another. To a directory, each
    request gets its id's file name (`naming.file_stem`: a readable prefix
    and a digest of the exact id) with ``.sse``, or ``-N.sse`` where that
    name is taken: by another request, or, as `taken` says, by one of the
    run's inputs or other outputs.
    """

    def __init__(
        self,
        target: BinaryIO | None = None,
        directory: Path | None = None,
        taken: Callable[[Path], object] | None = None,
    ) -> None:
        super().__init__()
        if (target is None) == (directory is None):
            raise ValueError("give exactly one of target and directory")
        self._target = target
        self._directory = directory
        self._taken = taken
        self._file_names: dict[str | None, str] = {}
        self._names: Names | None = None
        self._files_written = 0

    def _start(self, request_id: str | None) -> list[bytes]:
        return []

    def _take(self, group: list[bytes], answer: Answer) -> None:
        group.append(answer.sse_events)

    def _emit(self, request_id: str | None, group: list[bytes]) -> None:
        transcript = b"".join(group) + SSE_DONE
        if self._target is not None:
            self._target.write(transcript)
            return
        assert self._directory is not None
        # A file left by an earlier run is replaced; a request that shows up
        # again after it completed in this run appends a second transcript.
        mode = "ab" if request_id in self._file_names else "wb"
        path = self._directory / self._file_name(request_id)
        try:
            with open(path, mode) as sse_file:
                sse_file.write(transcript)
        except OSError as exc:
            raise StreamFailure(f"cannot write {path}: {exc.strerror or exc}") from None
        self._files_written += 1

    @property
    def records_written(self) -> int | None:
        if self._directory is not None:
            return self._files_written
        return _records_written(self._target)

    def _file_name(self, request_id: str | None) -> str:
        if request_id not in self._file_names:
            assert self._directory is not None
            if self._names is None:
                claimed = self._taken
                self._names = Names(self._directory, [".sse"], None if claimed is None else lambda p: claimed(Path(p)))
            self._file_names[request_id] = self._names.take(request_id) + ".sse"
        return self._file_names[request_id]

    def _finish(self) -> None:
        if self._target is not None:
            self._target.flush()


@dataclass
class _ChoiceParts:
    role: str | None = None
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    text: list[str] = field(default_factory=list)
    logprobs: list[Mapping[str, Any]] = field(default_factory=list)
    token_ids: list[int] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class Assembly:
    """One request's stream, assembled as a client accumulates it: content,
    reasoning and text concatenated per choice index, tool calls merged by
    index (id, name, arguments), logprobs and token ids joined, the last
    finish reason, stop reason, usage and system fingerprint kept, and the
    prompt token ids of the chunk that carries them. A failed call, or an
    error event inside the stream, makes the stream that error.
    """

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.first_chunk: Mapping[str, Any] | None = None
        self.choices: dict[int, _ChoiceParts] = {}
        self.usage: Mapping[str, Any] | None = None
        self.system_fingerprint: str | None = None
        self.prompt_token_ids: list[int] | None = None
        self.error: bytes | None = None

    def take(self, answer: Answer) -> None:
        """Add one call's answer."""
        if not answer.is_stream_answer:  # an error, or a one-shot answer with --lenient
            self.error = self.error or answer.raw
            return
        for chunk in answer.chunks:
            self.take_chunk(chunk)

    def take_chunk(self, chunk: Mapping[str, Any]) -> None:
        """Add one chunk, as a client reads it from the stream."""
        if "error" in chunk:
            self.error = self.error or _dump(chunk)
            return
        self.first_chunk = self.first_chunk or chunk
        self.prompt_token_ids = self.prompt_token_ids or chunk.get("prompt_token_ids")
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        self.system_fingerprint = chunk.get("system_fingerprint") or self.system_fingerprint
        for choice in chunk.get("choices") or []:
            _merge_choice(self.choices.setdefault(choice["index"], _ChoiceParts()), choice)

    def fields(self, request_id: str | None = None) -> dict[str, Any]:
        """The assembled response's fields; unset ones are left out."""
        first = self.first_chunk or {}
        fields = {
            "id": first.get("id", request_id),
            "object": "chat.completion" if self.endpoint is Endpoint.CHAT else "text_completion",
            "created": first.get("created"),
            "model": first.get("model", ""),
            "usage": self.usage or {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
            "system_fingerprint": self.system_fingerprint,
            "prompt_token_ids": self.prompt_token_ids,
            "choices": [self._choice(index, parts) for index, parts in sorted(self.choices.items())],
        }
        return {key: value for key, value in fields.items() if value is not None}

    def _choice(self, index: int, parts: _ChoiceParts) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": index,
            "finish_reason": parts.finish_reason,
            "stop_reason": parts.stop_reason,
            "token_ids": parts.token_ids,
        }
        if self.endpoint is Endpoint.CHAT:
            choice["message"] = {
                "role": parts.role or "assistant",
                "content": "".join(parts.content) if parts.content else None,
                "reasoning": "".join(parts.reasoning) if parts.reasoning else None,
            }
            if parts.tool_calls:
                choice["message"]["tool_calls"] = [call for _, call in sorted(parts.tool_calls.items())]
            choice["logprobs"] = (
                {"content": [entry for piece in parts.logprobs for entry in piece["content"] or []]}
                if parts.logprobs
                else None
            )
        else:
            choice["text"] = "".join(parts.text)
            choice["logprobs"] = _joined_completion_logprobs(parts.logprobs)
        return choice


class AssembledWriter(_GroupedWriter[Assembly]):
    """Per request, one response assembled from its stream (`Assembly`),
    comparable with a one-shot answer. A stream with a failed call, or with
    an error event, is written as that error.

    `finish` turns the assembled fields into the full response (vLLM's own
    response model fills the remaining fields).
    """

    def __init__(
        self,
        target: BinaryIO,
        endpoint: Endpoint,
        finish: Callable[[Mapping[str, Any]], dict[str, Any]],
    ) -> None:
        super().__init__()
        self._target = target
        self._endpoint = endpoint
        self._finish_response = finish

    def _start(self, request_id: str | None) -> Assembly:
        return Assembly(self._endpoint)

    def _take(self, group: Assembly, answer: Answer) -> None:
        group.take(answer)

    def _emit(self, request_id: str | None, group: Assembly) -> None:
        if group.error is not None:
            self._target.write(group.error + b"\n")
            return
        response = self._finish_response(group.fields(request_id))
        self._target.write(_dump(response) + b"\n")

    def _finish(self) -> None:
        self._target.flush()

    @property
    def records_written(self) -> int | None:
        return _records_written(self._target)


def _dump(value: Any) -> bytes:
    """Compact JSON, as the server writes it (integer keys become strings)."""
    return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS)


def _merge_choice(parts: _ChoiceParts, choice: Mapping[str, Any]) -> None:
    delta = choice.get("delta") or {}
    parts.role = parts.role or delta.get("role")
    if delta.get("content"):
        parts.content.append(delta["content"])
    if delta.get("reasoning"):
        parts.reasoning.append(delta["reasoning"])
    for call in delta.get("tool_calls") or []:
        merged = parts.tool_calls.setdefault(
            call["index"], {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
        )
        merged["id"] = merged["id"] or call.get("id")
        function = call.get("function") or {}
        merged["function"]["name"] += function.get("name") or ""
        merged["function"]["arguments"] += function.get("arguments") or ""
    if choice.get("text"):
        parts.text.append(choice["text"])
    if choice.get("logprobs") is not None:
        parts.logprobs.append(choice["logprobs"])
    if choice.get("token_ids") is not None:
        parts.token_ids = (parts.token_ids or []) + list(choice["token_ids"])
    if choice.get("finish_reason") is not None:
        parts.finish_reason = choice["finish_reason"]
        parts.stop_reason = choice.get("stop_reason")


def _joined_completion_logprobs(pieces: list[Mapping[str, Any]]) -> dict[str, Any] | None:
    """Completion logprobs are parallel lists; a stream's pieces already
    carry absolute text offsets, so joining is concatenation."""
    if not pieces:
        return None
    keys = ("text_offset", "token_logprobs", "tokens", "top_logprobs")
    return {key: [value for piece in pieces for value in piece.get(key) or []] for key in keys}


class ErrorLog:
    """``--errors FILE``: one JSON line per failed record, for triage: the
    input file and line, the record's number, the HTTP status and the
    error record's ``error`` object, and a ``detail`` where the server's
    message is generic."""

    def __init__(self, target: BinaryIO, input_name: str) -> None:
        self._target = target
        self.input_name = input_name
        """The input the next records come from."""

    def add(self, record: Record, answer: Answer, detail: str | None = None) -> None:
        error = answer.body.get("error") if isinstance(answer.body, Mapping) else None
        entry: dict[str, Any] = {
            "input": self.input_name,
            "line": record.line,
            "record": record.number,
            "status": answer.status,
            "error": error if error is not None else answer.body,
        }
        if detail is not None:
            entry["detail"] = detail
        self._target.write(_dump(entry) + b"\n")

    def close(self) -> None:
        self._target.flush()
