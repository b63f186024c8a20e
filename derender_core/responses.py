"""Response files read back: what a server or an earlier run answered.

`derender diff` and `derender parity --from-serve` read what was answered
rather than what was asked: one-shot responses (JSONL, one per line, error
records included), streams as SSE transcripts (``data:`` lines, one file or
a directory of ``.sse`` transcripts), and this tool's own stream output
(``{"chunk", "stream_state"}`` per call, or ``{"chunks"}`` under the serve
flavour). Each becomes an `Item`: a response, or a stream's chunks, or an
error. Chunks are grouped into streams by their ``id``, in the order
streams first appear.

A one-shot response is compared whatever its values (a choice ``index``
that is not an integer is a choice of its own). A stream frame must be one a
client can assemble (`frame_problem`); one that is not ends the read with
an `InputError` naming its file and line.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .compare import (
    DEFAULT_NORMALIZATION,
    Divergence,
    Examination,
    Normalization,
    Observed,
    compare,
)
from .errors import InputError
from .naming import DIGEST_CHARS, file_stem
from .protocol import Endpoint
from .records import open_input, parse_line, sniff_lines
from .writers import Assembly

EXPECTED = "expected"
ACTUAL = "actual"
_NOT_A_RESPONSE = "not a response: "


@dataclass
class Item:
    """One answered request: its key (id or file name) and what it got."""

    key: str
    response: dict[str, Any] | None = None
    chunks: list[dict[str, Any]] | None = None
    error: str | None = None
    line: int = 0
    """Where the item starts in its file (1-based)."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def streamed(self) -> bool:
        return self.chunks is not None

    @property
    def holds_answer(self) -> bool:
        """Whether the item is an answer at all (a response, a stream, an
        error record) rather than other JSON (a request, a derender body):
        a file of none has nothing to compare."""
        if self.chunks is not None:
            return True
        if self.error is not None:
            return not self.error.startswith(_NOT_A_RESPONSE)
        return isinstance(self.response, Mapping) and isinstance(self.response.get("choices"), list)

    @property
    def endpoint(self) -> Endpoint:
        sample = self.chunks[0] if self.chunks else (self.response or {})
        return Endpoint.CHAT if str(sample.get("object", "")).startswith("chat.") else Endpoint.COMPLETION

    def observed(self) -> Observed:
        """As compared: a stream also as the response it assembles to (an
        error event in it makes it that error, as a client reads it)."""
        if self.error is not None:
            return Observed(error=self.error)
        if self.chunks is None:
            return Observed(response=self.response)
        failed = next((chunk for chunk in self.chunks if "error" in chunk), None)
        if failed is not None:
            return Observed(error=error_text(failed))
        assembly = Assembly(self.endpoint)
        for chunk in self.chunks:
            assembly.take_chunk(chunk)
        return Observed(response=assembly.fields(self.key), chunks=self.chunks)


def error_text(body: Any) -> str:
    """An error record as one line: ``<code> <message>``."""
    error = body.get("error") if isinstance(body, Mapping) else None
    if isinstance(error, Mapping):
        return f"{error.get('code')} {error.get('message')}"
    return str(body)


def read_items(path: str | Path) -> Iterator[Item]:
    """The answered requests in a file, or in a directory's ``*.sse`` files
    (in name order, keyed by the request id the name was made from where
    it gives it back, `_request_key`, else by the name)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.sse"))
        if not files:
            raise InputError(f"{path}: no .sse files in the directory")
        for sse_file in files:
            for number, item in enumerate(_items_of(str(sse_file))):
                key = _request_key(sse_file.stem)
                item.key = key if number == 0 else f"{key}#{number + 1}"
                yield item
        return
    yield from _items_of(str(path))


def _request_key(stem: str) -> str:
    """The request id a transcript's file name was made from
    (`naming.file_stem`) when the name's readable prefix is that id whole,
    so a report names the request; any other name (a ``-N`` one among
    them) as it is. Two directories written by derender pair either way."""
    prefix = stem[: -DIGEST_CHARS - 1]
    return prefix if prefix and file_stem(prefix) == stem else stem


def _items_of(path: str) -> Iterator[Item]:
    streams: dict[str, Item] = {}
    order: list[Item] = []
    last_key: str | None = None
    with open_input(path) as source:
        sse, lines = sniff_lines(source)
        for line_number, line in enumerate(lines, start=1):
            parsed = parse_line(line, sse=sse)
            if parsed is None:
                continue
            payload, problem = parsed
            if problem is not None:
                raise InputError(f"{path}:{line_number}: not JSON ({problem.message})")
            for chunk in _stream_chunks(payload, sse):
                # An error event has no id: it ends the stream it interrupts.
                key = "" if not isinstance(chunk, Mapping) else (
                    str(chunk.get("id", "")) if "error" not in chunk else last_key or f"error@{line_number}"
                )  # fmt: skip
                malformed = frame_problem(chunk, streams[key].endpoint if key in streams else None)
                if malformed is not None:
                    raise InputError(f"{path}:{line_number}: not a stream frame a client can read: {malformed}")
                last_key = key
                if key not in streams:
                    streams[key] = Item(key, chunks=[], line=line_number)
                    order.append(streams[key])
                streams[key].chunks.append(chunk)  # type: ignore[union-attr]
            if not sse and not _is_stream_answer(payload):
                item = Item(str(payload.get("id", f"line {line_number}")) if isinstance(payload, Mapping)
                            else f"line {line_number}", line=line_number)  # fmt: skip
                if isinstance(payload, Mapping) and "error" in payload:
                    item.error = error_text(payload)
                elif isinstance(payload, Mapping):
                    item.response = dict(payload)
                else:
                    item.error = f"{_NOT_A_RESPONSE}{payload!r}"[:200]
                order.append(item)
    yield from order


def _is_stream_answer(payload: Any) -> bool:
    return isinstance(payload, Mapping) and ("chunks" in payload or ("chunk" in payload and "stream_state" in payload))


def _stream_chunks(payload: Any, sse: bool) -> list[Any]:
    """The stream chunks a record holds: an SSE event is one; this tool's
    stream answers hold one (derender) or several (serve). Objects are
    copied; anything else is kept for `frame_problem` to name."""
    if sse:
        return [dict(payload) if isinstance(payload, Mapping) else payload]
    if not isinstance(payload, Mapping):
        return []
    if "chunks" in payload:
        chunks = payload["chunks"]
        return [dict(c) if isinstance(c, Mapping) else c for c in chunks] if isinstance(chunks, list) else [chunks]
    if "chunk" in payload and "stream_state" in payload:
        chunk = payload["chunk"]
        return [dict(chunk) if isinstance(chunk, Mapping) else chunk]
    return []


_TEXT_KEYS = ("role", "content", "reasoning")
_LOGPROB_LISTS = ("content", "text_offset", "token_logprobs", "tokens", "top_logprobs")
_TYPE_NAMES: dict[type, str] = {list: "a list", Mapping: "an object", str: "a string"}


def _kind(value: Any) -> str:
    """What a JSON value is, for a message (its text cut short)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return f"a number ({value!r:.40})" if isinstance(value, float) else "an integer"
    if isinstance(value, str):
        return f"a string ({value[:40]!r})"
    return "a list" if isinstance(value, list) else "an object" if isinstance(value, Mapping) else type(value).__name__


def _not(where: str, value: Any, kind: type) -> str | None:
    """The problem when `value` is neither null nor a `kind`."""
    return None if value is None or isinstance(value, kind) else f"{where} is {_kind(value)}, not {_TYPE_NAMES[kind]}"


def _no_index(where: str, holder: Any) -> str | None:
    """The problem when `holder` (a choice, a tool-call piece) is not an
    object with an integer ``index``: a list's member is never null."""
    if not isinstance(holder, Mapping):
        return f"{where} is {_kind(holder)}, not an object"
    if "index" not in holder:
        return f"{where} has no index"
    index = holder["index"]
    return None if isinstance(index, int) and not isinstance(index, bool) else f"{where}.index is {_kind(index)}, not an integer"


def frame_problem(chunk: Any, endpoint: Endpoint | None = None) -> str | None:
    """What keeps a client from assembling this stream frame, or None.

    The frame's reader (`writers.Assembly`, as a client does) joins text,
    tool-call pieces, logprobs and token ids per choice ``index``; each of
    those must have the type a server writes, or be null; a chat stream's
    logprobs are joined by their ``content`` list (`endpoint`: the
    stream's, from its first frame; by default this frame's). An error
    event (``{"error": ...}``) is read as the error it is.
    """
    return next((problem for problem in _frame_problems(chunk, endpoint) if problem is not None), None)


def _frame_problems(chunk: Any, endpoint: Endpoint | None) -> Iterator[str | None]:
    if not isinstance(chunk, Mapping):
        yield f"the frame is {_kind(chunk)}, not an object"
        return
    if "error" in chunk:
        return
    chat = (endpoint or Item("", chunks=[chunk]).endpoint) is Endpoint.CHAT
    choices = chunk.get("choices")
    yield _not("choices", choices, list)
    for number, choice in enumerate(choices or []):
        where = f"choices[{number}]"
        yield _no_index(where, choice)
        delta = choice.get("delta")
        yield _not(f"{where}.delta", delta, Mapping)
        for key in _TEXT_KEYS:
            yield _not(f"{where}.delta.{key}", (delta or {}).get(key), str)
        yield _not(f"{where}.text", choice.get("text"), str)
        yield _not(f"{where}.token_ids", choice.get("token_ids"), list)
        calls = (delta or {}).get("tool_calls")
        yield _not(f"{where}.delta.tool_calls", calls, list)
        for place, call in enumerate(calls or []):
            name = f"{where}.delta.tool_calls[{place}]"
            yield _no_index(name, call) or _not(f"{name}.function", call.get("function"), Mapping)
            for key in ("name", "arguments"):
                yield _not(f"{name}.function.{key}", (call.get("function") or {}).get(key), str)
        logprobs = choice.get("logprobs")
        yield _not(f"{where}.logprobs", logprobs, Mapping)
        for key in _LOGPROB_LISTS:
            yield _not(f"{where}.logprobs.{key}", (logprobs or {}).get(key), list)
        if chat and logprobs is not None and "content" not in logprobs:
            yield f"{where}.logprobs has no content list (a chat stream's logprobs)"


def diff_items(
    expected: Iterable[Item],
    actual: Iterable[Item],
    *,
    by_key: bool = False,
    ignore: Iterable[str] = (),
    normalization: Normalization = DEFAULT_NORMALIZATION,
) -> list[Divergence]:
    """Compare answered requests pairwise: in order, or by key (file name)
    when `by_key`. A request on one side only is a divergence of field
    ``record``."""
    return [
        divergence
        for examination in diff_examinations(expected, actual, by_key=by_key, ignore=ignore, normalization=normalization)
        for divergence in examination.divergences
    ]


def diff_examinations(
    expected: Iterable[Item],
    actual: Iterable[Item],
    *,
    by_key: bool = False,
    ignore: Iterable[str] = (),
    normalization: Normalization = DEFAULT_NORMALIZATION,
) -> Iterator[Examination]:
    """`diff_items`, request by request: each pair as both sides observed
    it (under `EXPECTED` and `ACTUAL`) with its divergences."""
    ignored = frozenset(ignore)
    if by_key:
        left = {item.key: item for item in expected}
        right = {item.key: item for item in actual}
        keys = list(left) + [key for key in right if key not in left]
        paired = [(left.get(key), right.get(key)) for key in keys]
    else:
        paired = list(itertools.zip_longest(expected, actual))
    for left_item, right_item in paired:
        key = (left_item or right_item).key  # type: ignore[union-attr]
        if left_item is None or right_item is None:
            examination = Examination(key)
            if "record" not in ignored:
                examination.divergences.append(
                    Divergence(key, None, EXPECTED, ACTUAL, "record",
                               None if left_item is None else "present",
                               None if right_item is None else "present")
                )  # fmt: skip
            yield examination
            continue
        left_seen, right_seen = left_item.observed(), right_item.observed()
        yield Examination(
            key,
            {(EXPECTED, None): left_seen, (ACTUAL, None): right_seen},
            compare(
                EXPECTED, left_seen, ACTUAL, right_seen,
                request_id=key, ignore=ignored, normalization=normalization,
            ),
        )  # fmt: skip
