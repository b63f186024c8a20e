"""Input records: reading JSONL and SSE captures lazily, and joining bare
generate output with the original requests.

An input line is one of:

- a derender body, exactly what a client would ``POST`` to
  ``/v1/chat/completions/derender`` or ``/v1/completions/derender``;
- with ``--requests``, a bare ``GenerateResponse`` or generate stream chunk,
  joined with its request by ``request_id``;
- a line of a raw SSE capture of ``/inference/v1/generate``: ``data: {...}``
  is a record, ``data: [DONE]``, ``event:``/``id:``/``retry:`` fields and
  ``:`` comments are not.

Blank lines are not records. Inputs are read line by line, never whole.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from .errors import InputError, RecordError
from .protocol import Endpoint

GZIP_MAGIC = b"\x1f\x8b"
_SSE_IGNORED_FIELDS = (b"event:", b"id:", b"retry:", b":")
_LONG_DIGIT_RUN = re.compile(rb"\d{19}")


@dataclass(frozen=True)
class JsonProblem:
    """Why a line is not JSON, in the words of Python's json module (the
    parser FastAPI uses, so the error record matches the server's)."""

    message: str
    position: int | None
    """Where parsing failed; None when the bytes are not text at all."""


@dataclass(frozen=True)
class Record:
    """One input record and where it came from."""

    number: int
    """1-based position among the records; output record `number` answers it."""
    line: int
    """1-based line number in the input file."""
    payload: Any = None
    problem: JsonProblem | None = None


@contextlib.contextmanager
def open_input(path: str) -> Iterator[BinaryIO]:
    """Open a path, or stdin for ``-``; gzip is detected by its magic bytes,
    so ``.gz`` files and gzipped stdin read transparently."""
    if path == "-":
        raw: BinaryIO = sys.stdin.buffer
        owned = False
    else:
        try:
            raw = open(path, "rb")  # noqa: SIM115 - closed below
        except OSError as exc:
            raise InputError(f"cannot open input {path}: {exc.strerror or exc}") from None
        owned = True
    buffered = raw if isinstance(raw, io.BufferedReader) else io.BufferedReader(raw)  # type: ignore[arg-type]
    try:
        if buffered.peek(2)[:2] == GZIP_MAGIC:
            with gzip.GzipFile(fileobj=buffered) as unzipped:
                yield unzipped  # type: ignore[misc]
        else:
            yield buffered
    finally:
        if owned:
            buffered.close()


def parse_line(line: bytes) -> tuple[Any, JsonProblem | None] | None:
    """Parse one input line; None when the line is not a record.

    Returns:
        The JSON payload and None, or None and the reason it is not JSON.

    """
    body = line.rstrip(b"\r\n")
    text = body.strip()
    if not text:
        return None
    if text.startswith(b"data:"):
        # SSE: the field value, less the one space that may follow the colon.
        body = text[5:].removeprefix(b" ")
        if body.strip() in (b"[DONE]", b""):
            return None
    elif text.startswith(_SSE_IGNORED_FIELDS):
        return None
    # orjson turns integers beyond 64 bits into floats; Python's json, the
    # server's parser, keeps them exact, so such lines go to it.
    if not _LONG_DIGIT_RUN.search(body):
        try:
            return orjson.loads(body), None
        except orjson.JSONDecodeError:
            pass
    # Python's json also accepts what orjson refuses (NaN, Infinity), as the
    # server's parser does, and words its errors the way FastAPI reports them.
    try:
        return json.loads(body), None
    except UnicodeDecodeError as exc:
        return None, JsonProblem(f"not text in any JSON encoding: {exc.reason}", None)
    except json.JSONDecodeError as exc:
        return None, JsonProblem(exc.msg, exc.pos)


def iter_records(stream: BinaryIO) -> Iterator[Record]:
    """Yield the records of a JSONL file or SSE capture, one line at a time."""
    number = 0
    for line_number, line in enumerate(stream, start=1):
        parsed = parse_line(line)
        if parsed is None:
            continue
        number += 1
        payload, problem = parsed
        yield Record(number=number, line=line_number, payload=payload, problem=problem)


class RequestIndex:
    """The ``--requests`` file, indexed by ``request_id``.

    Only the byte offset of each line is kept in memory; a request is read
    back from disk when a record joins it. A gzipped file is first unpacked
    to a temporary file so it can be seeked.
    """

    def __init__(self, path: str) -> None:
        if path == "-":
            raise InputError("--requests needs a file path: it is read by offset, not streamed")
        self.path = path
        self._file = self._open_seekable(path)
        self._offsets: dict[str, int] = {}
        self._index()
        self.lookup = lru_cache(maxsize=256)(self._read)

    def __len__(self) -> int:
        return len(self._offsets)

    def close(self) -> None:
        self._file.close()

    def _open_seekable(self, path: str) -> BinaryIO:
        with open_input(path) as source:
            if not isinstance(source, gzip.GzipFile):
                return open(path, "rb")  # noqa: SIM115 - owned by the index
            spooled = tempfile.TemporaryFile()  # noqa: SIM115 - owned by the index
            shutil.copyfileobj(source, spooled)
            spooled.seek(0)
            return spooled  # type: ignore[return-value]

    def _index(self) -> None:
        first_line: dict[str, int] = {}
        offset = 0
        for line_number, line in enumerate(self._file, start=1):
            parsed = parse_line(line)
            if parsed is not None:
                payload, problem = parsed
                if problem is not None:
                    raise InputError(
                        f"{self.path}:{line_number}: not JSON ({problem.message})"
                    )
                request_id = payload.get("request_id") if isinstance(payload, dict) else None
                if not isinstance(request_id, str) or not request_id:
                    raise InputError(f"{self.path}:{line_number}: no request_id")
                if request_id in first_line:
                    raise InputError(
                        f"{self.path}:{line_number}: request_id {request_id!r} "
                        f"already on line {first_line[request_id]}"
                    )
                first_line[request_id] = line_number
                self._offsets[request_id] = offset
            offset += len(line)

    def _read(self, request_id: str) -> dict[str, Any] | None:
        offset = self._offsets.get(request_id)
        if offset is None:
            return None
        self._file.seek(offset)
        payload = parse_line(self._file.readline())
        assert payload is not None and payload[1] is None  # checked by _index
        return payload[0]  # type: ignore[no-any-return]


_BODY_KEYS = ("generate_response", "generate_responses", "generate_chunk")


def _is_bare_generate_output(payload: Any) -> bool:
    """A GenerateResponse or stream chunk has choices and is no derender
    body; anything else goes to the endpoint as it is, to be validated there."""
    return (
        isinstance(payload, Mapping)
        and "choices" in payload
        and not any(key in payload for key in _BODY_KEYS)
    )


def derender_body(
    payload: Any,
    endpoint: Endpoint,
    *,
    stream: bool,
    requests: RequestIndex | None,
) -> Any:
    """The derender body for one record.

    A payload that is not bare generate output is used as it is, so what the
    server would answer for it is what comes out. A bare generate response or
    stream chunk is joined with its request from `requests`.

    Raises:
        RecordError: for a bare payload that cannot be joined.

    """
    if not _is_bare_generate_output(payload):
        return payload
    kind = "generate stream chunk" if stream else "GenerateResponse"
    if requests is None:
        raise RecordError(
            f"the record is a bare {kind}, not a derender body; pass "
            "--requests FILE with the original requests to join it by request_id"
        )
    request_id = payload.get("request_id")
    request = requests.lookup(request_id) if isinstance(request_id, str) else None
    if request is None:
        raise RecordError(f"no request with request_id {request_id!r} in {requests.path}")
    original = request.get(endpoint.request_key)
    if original is None:
        other = Endpoint.COMPLETION if endpoint is Endpoint.CHAT else Endpoint.CHAT
        hint = (
            f"; it has a {other.request_key}, so use the {other.value} endpoint"
            if request.get(other.request_key) is not None
            else ""
        )
        raise RecordError(
            f"request {request_id!r} in {requests.path} has no {endpoint.request_key}{hint}"
        )
    prompt_token_ids = request.get("prompt_token_ids")
    prompt_tokens = request.get("prompt_tokens")
    if prompt_tokens is None and isinstance(prompt_token_ids, list):
        # What the render step reports: the prompt's length.
        prompt_tokens = len(prompt_token_ids)

    return call_body(
        endpoint,
        payload,
        stream=stream,
        request=original,
        prompt_tokens=prompt_tokens,
        prompt_token_ids=prompt_token_ids,
        model=request.get("model"),
    )


def call_body(
    endpoint: Endpoint,
    generate: Any,
    *,
    stream: bool,
    request: Any = None,
    prompt_tokens: int | None = None,
    prompt_token_ids: list[int] | None = None,
    model: str | None = None,
) -> dict[str, Any]:
    """The derender body that sends one generate response (or, with
    `stream`, one generate stream chunk) with the original request and its
    prompt; unset fields are left out."""
    body: dict[str, Any] = {}
    if model is not None:
        body["model"] = model
    if stream:
        body.update(stream=True, generate_chunk=generate)
        fields = {"prompt_tokens": prompt_tokens, "prompt_token_ids": prompt_token_ids}
    elif endpoint is Endpoint.CHAT:
        body["generate_response"] = generate
        fields = {"prompt_tokens": prompt_tokens, "prompt_token_ids": prompt_token_ids}
    else:
        # One GenerateResponse per prompt: a bare response is a one-prompt call.
        body["generate_responses"] = [generate]
        fields = {
            "prompt_tokens": None if prompt_tokens is None else [prompt_tokens],
            "prompt_token_ids": None if prompt_token_ids is None else [prompt_token_ids],
        }
    body.update({key: value for key, value in fields.items() if value is not None})
    if request is not None:
        body[endpoint.request_key] = request
    return body


@contextlib.contextmanager
def open_output(path: str) -> Iterator[BinaryIO]:
    """Open an output path, or stdout for ``-``; ``.gz`` paths are gzipped."""
    if path == "-":
        yield sys.stdout.buffer
        sys.stdout.buffer.flush()
        return
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        target: BinaryIO = (
            gzip.open(path, "wb") if path.endswith(".gz") else open(path, "wb")  # type: ignore[assignment]
        )
    except OSError as exc:
        raise InputError(f"cannot write {path}: {exc.strerror or exc}") from None
    with target:
        yield target
