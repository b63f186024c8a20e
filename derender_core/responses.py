"""Response files read back: what a server or an earlier run answered.

`derender diff` and `derender parity --from-serve` read what was answered
rather than what was asked: one-shot responses (JSONL, one per line, error
records included), streams as SSE transcripts (``data:`` lines, one file or
a directory of ``<request_id>.sse``), and this tool's own stream output
(``{"chunk", "stream_state"}`` per call, or ``{"chunks"}`` under the serve
flavour). Each becomes an `Item`: a response, or a stream's chunks, or an
error. Chunks are grouped into streams by their ``id``, in the order
streams first appear.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from .compare import (
    DEFAULT_NORMALIZATION,
    Divergence,
    Examination,
    Normalization,
    Observed,
    compare,
)
from .errors import InputError
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
        """As compared: a stream also as the response it assembles to."""
        if self.error is not None:
            return Observed(error=self.error)
        if self.chunks is None:
            return Observed(response=self.response)
        assembly = Assembly(self.endpoint)
        for chunk in self.chunks:
            assembly.take_chunk(chunk)
        if assembly.error is not None:
            return Observed(error=error_text(orjson.loads(assembly.error)))
        return Observed(response=assembly.fields(self.key), chunks=self.chunks)


def error_text(body: Any) -> str:
    """An error record as one line: ``<code> <message>``."""
    error = body.get("error") if isinstance(body, Mapping) else None
    if isinstance(error, Mapping):
        return f"{error.get('code')} {error.get('message')}"
    return str(body)


def read_items(path: str | Path) -> Iterator[Item]:
    """The answered requests in a file, or in a directory's ``*.sse`` files
    (keyed by file name, in name order)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.sse"))
        if not files:
            raise InputError(f"{path}: no .sse files in the directory")
        for sse_file in files:
            for number, item in enumerate(_items_of(str(sse_file))):
                item.key = sse_file.stem if number == 0 else f"{sse_file.stem}#{number + 1}"
                yield item
        return
    yield from _items_of(str(path))


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
                key = str(chunk.get("id", "")) if "error" not in chunk else last_key or f"error@{line_number}"
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


def _stream_chunks(payload: Any, sse: bool) -> list[dict[str, Any]]:
    """The stream chunks a record holds: an SSE event is one; this tool's
    stream answers hold one (derender) or several (serve)."""
    if not isinstance(payload, Mapping):
        return []
    if sse:
        return [dict(payload)]
    if "chunks" in payload and isinstance(payload["chunks"], list):
        return [dict(c) for c in payload["chunks"] if isinstance(c, Mapping)]
    if "chunk" in payload and "stream_state" in payload and isinstance(payload["chunk"], Mapping):
        return [dict(payload["chunk"])]
    return []


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
