"""Input records: reading JSONL and SSE captures lazily, joining bare
generate output with the original requests, and the output files.

An input is either JSONL, one record per line, or a raw SSE capture of
``/inference/v1/generate``. A record is one of:

- a derender body, exactly what a client would ``POST`` to
  ``/v1/chat/completions/derender`` or ``/v1/completions/derender``;
- with ``--requests``, a bare ``GenerateResponse`` or generate stream chunk,
  joined with its request by ``request_id``.

In an SSE capture ``data: {...}`` lines are records; ``data: [DONE]``,
``event:``/``id:``/``retry:`` fields and ``:`` comments are not. Whether an
input is a capture is decided once, from its first lines, so a JSONL line
that merely looks like an SSE field is a (bad) record, never dropped.

In JSONL, output line *i* answers input line *i*: a blank or
whitespace-only line followed by a record is a record of its own (not JSON,
so it gets the server's JSON error); blank lines after the last record are
not records. In an SSE capture blank lines separate events and are never
records. Lines end in LF, CRLF or a lone CR. Inputs are read in chunks,
never whole.

Each record carries a digest of the input's bytes up to and including its
line (`Record.digest`), so a resumed run can check that it continues the
input the earlier run read (`resume`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import gzip
import hashlib
import io
import json
import os
import shutil
import stat
import sys
import tempfile
import time
import zlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache
from itertools import chain
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from .errors import InputError, RecordError, StreamFailure
from .protocol import Endpoint, JsonString

GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_SSE_FRAMING = (b"event:", b"id:", b"retry:", b":")
"""SSE lines that are never records: fields other than data, and comments."""
# Digits to "0", so a run of 19 digits is a plain substring search (15x
# faster than a regular expression on a long line of token ids).
_DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"000000000")
_LONG_DIGIT_RUN = b"0" * 19
_READ_SIZE = 1 << 16
SSE_SNIFF_LINES = 64
"""How many leading blank, comment and non-data field lines may precede the
line that decides whether an input is an SSE capture."""
_ZSTD_FEED = 1 << 13
"""Compressed bytes handed to the zstd decoder at a time: bounds what one
call can expand to."""


class CorruptInput(ValueError):
    """Compressed data that cannot be decoded."""


_READ_ERRORS = (OSError, EOFError, zlib.error, CorruptInput)
"""What reading a file or a compressed stream raises when it cannot go on:
a read error, a truncated gzip or zstd stream (EOFError), corrupt
compressed data."""


@dataclass(frozen=True)
class JsonProblem:
    """Why a line is not JSON, in the words of Python's json module (the
    parser FastAPI uses, so the error record matches the server's)."""

    message: str
    position: int | None
    """Where parsing failed; None when the server's parser gives up on the
    body as a whole (not text, nested too deeply, an integer too long),
    answering only "There was an error parsing the body"."""


class Record:
    """One input record and where it came from.

    A record read from text keeps its text and parses it when first asked
    (`payload`, `problem`), and travels between processes as that text: the
    worker pool's parent only routes one-shot records, so it never parses
    them, and a worker parses each once.
    """

    __slots__ = ("number", "line", "digest", "_text", "_payload", "_problem")

    number: int
    """1-based position among the records; output record `number` answers it."""
    line: int
    """1-based line number in the input file."""
    digest: bytes | None
    """SHA-256 of the input up to and including this record's line (for
    Parquet, its rows up to this one): what ``--resume`` checks."""

    def __init__(
        self,
        number: int,
        line: int,
        payload: Any = None,
        problem: JsonProblem | None = None,
        digest: bytes | None = None,
        *,
        text: bytes | None = None,
    ) -> None:
        self.number = number
        self.line = line
        self.digest = digest
        self._text = text
        """The record's JSON text (`record_body`), until it is parsed."""
        self._payload = payload
        self._problem = problem

    def _parse(self) -> None:
        if self._text is not None:
            self._payload, self._problem = parse_body(self._text)
            self._text = None

    @property
    def payload(self) -> Any:
        self._parse()
        return self._payload

    @property
    def unparsed(self) -> bytes | None:
        """The record's JSON text while it is not parsed yet, else None."""
        return self._text

    @property
    def problem(self) -> JsonProblem | None:
        self._parse()
        return self._problem

    def __reduce__(self) -> tuple[Any, ...]:
        if self._text is not None:
            return (_record_of_text, (self.number, self.line, self._text, self.digest))
        return (Record, (self.number, self.line, self._payload, self._problem, self.digest))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Record):
            return NotImplemented
        return (self.number, self.line, self.payload, self.problem) == (
            other.number,
            other.line,
            other.payload,
            other.problem,
        )

    def __hash__(self) -> int:
        return hash((self.number, self.line))

    def __repr__(self) -> str:
        return f"Record(number={self.number!r}, line={self.line!r}, payload={self.payload!r}, problem={self.problem!r})"


def _record_of_text(number: int, line: int, text: bytes, digest: bytes | None) -> Record:
    return Record(number, line, digest=digest, text=text)


class _Prefixed(io.RawIOBase):
    """Bytes already read from a stream, then the rest of it."""

    def __init__(self, prefix: bytes, rest: BinaryIO) -> None:
        self._prefix = prefix
        self._rest = rest
        self.name = getattr(rest, "name", "input")

    def readable(self) -> bool:
        return True

    def fileno(self) -> int:
        # The file read, as for any other input: its position is the bytes read.
        return self._rest.fileno()

    def readinto(self, buffer: Any) -> int:
        if self._prefix:
            size = min(len(buffer), len(self._prefix))
            buffer[:size] = self._prefix[:size]
            self._prefix = self._prefix[size:]
            return size
        data = self._rest.read1(len(buffer))  # type: ignore[attr-defined]
        buffer[: len(data)] = data
        return len(data)


def _sniffed(buffered: io.BufferedReader, size: int) -> tuple[bytes, io.BufferedReader]:
    """The first `size` bytes of a stream (fewer only at its end), and the
    stream to read from, still at its start.

    A single ``peek`` is not enough: a slow pipe may deliver one byte
    first, and peek returns what one read gave.
    """
    head = buffered.peek(size)[:size]
    if len(head) >= size:
        return head, buffered
    head = buffered.read(size)
    return head, io.BufferedReader(_Prefixed(head, buffered))  # type: ignore[arg-type]


@contextlib.contextmanager
def open_input(path: str) -> Iterator[BinaryIO]:
    """Open a path, or stdin for ``-``; gzip and zstd are detected by their
    magic bytes, so ``.gz`` and ``.zst`` files and compressed stdin read
    transparently. ``fileno()`` of what it yields is the file read, so the
    bytes read so far are its OS position."""
    if path == "-":
        raw: BinaryIO = standard_stream("stdin").buffer
        owned = False
    else:
        try:
            raw = open(path, "rb")  # noqa: SIM115 - closed below
        except OSError as exc:
            raise InputError(f"cannot open input {path}: {exc.strerror or exc}") from None
        owned = True
    buffered = raw if isinstance(raw, io.BufferedReader) else io.BufferedReader(raw)  # type: ignore[arg-type]
    try:
        try:
            head, source = _sniffed(buffered, len(ZSTD_MAGIC))
        except OSError as exc:
            raise InputError(f"cannot read input {path}: {exc.strerror or exc}") from None
        if head[: len(GZIP_MAGIC)] == GZIP_MAGIC:
            with gzip.GzipFile(fileobj=source) as unzipped:
                yield unzipped  # type: ignore[misc]
        elif head == ZSTD_MAGIC:
            with io.BufferedReader(ZstdReader(source)) as unzstd:
                yield unzstd  # type: ignore[misc]
        else:
            yield source
    finally:
        if owned:
            buffered.close()


def standard_stream(name: str) -> Any:
    """``sys.stdin`` or ``sys.stdout``, what ``-`` names.

    Raises:
        InputError: when the process was started with it closed (``<&-``,
            ``>&-``: Python then sets it to None), as for a file that
            cannot be opened.

    """
    stream = getattr(sys, name)
    if stream is None:
        raise InputError(f"cannot {'read' if name == 'stdin' else 'write'} {name}: it is closed")
    return stream


class ZstdReader(io.RawIOBase):
    """A zstd stream (all its frames) as a raw file, so it reads by lines
    and still reports the file descriptor it reads from.

    Decoded frame by frame with zstandard's ``decompressobj`` rather
    than ``stream_reader(read_across_frames=True)``, which reports a frame
    cut short as a clean end: a truncated input must fail as a truncated
    gzip does (EOFError), not pass as complete.
    """

    def __init__(self, compressed: BinaryIO) -> None:
        import zstandard

        self._compressed = compressed
        self._decompressor = zstandard.ZstdDecompressor()
        self._frame = self._decompressor.decompressobj()
        self._in_frame = False
        """Bytes of the current frame have been fed and its end not seen."""
        self._zstd_error = zstandard.ZstdError
        self._ready = memoryview(b"")
        self.name = getattr(compressed, "name", "input")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._ready:
            read = getattr(self._compressed, "read1", self._compressed.read)
            data = read(_ZSTD_FEED)
            if not data:
                if self._in_frame:
                    raise EOFError("the last zstd frame is cut short")
                return 0
            self._ready = memoryview(self._decoded(data))
        size = min(len(buffer), len(self._ready))
        buffer[:size] = self._ready[:size]
        self._ready = self._ready[size:]
        return size

    def _decoded(self, data: bytes) -> bytes:
        pieces = []
        while data:
            try:
                pieces.append(self._frame.decompress(data))
            except self._zstd_error as exc:
                raise CorruptInput(f"corrupt zstd data ({exc})") from None
            self._in_frame = True
            if not self._frame.eof:
                break
            # A frame ended: what follows it starts the next one.
            data = self._frame.unused_data
            self._frame = self._decompressor.decompressobj()
            self._in_frame = False
        return b"".join(pieces)

    def fileno(self) -> int:
        return self._compressed.fileno()


def iter_lines(stream: BinaryIO) -> Iterator[bytes]:
    """The lines of a stream, each with its ending (LF, CRLF or a lone CR).

    Reads in chunks of what is available, so a record is handled as soon as
    its line arrives on a pipe.

    Raises:
        StreamFailure: when the stream cannot be read on (a read error, a
            truncated or corrupt gzip stream).

    """
    read = getattr(stream, "read1", stream.read)
    name = getattr(stream, "name", None) or "the input"
    if name == "<stdin>":
        name = "stdin"
    unfinished: list[bytes] = []
    try:
        while chunk := read(_READ_SIZE):
            while chunk.endswith(b"\r"):
                # A CRLF split between two reads is one line ending.
                more = stream.read(1)
                if not more:
                    break
                chunk += more
            lines = chunk.splitlines(keepends=True)
            if unfinished:
                if len(lines) == 1 and not chunk.endswith((b"\n", b"\r")):
                    # Still within a long line: joined once, when it ends,
                    # not once per chunk (quadratic in its length).
                    unfinished.append(chunk)
                    continue
                lines[0] = b"".join([*unfinished, lines[0]])
                unfinished.clear()
            if not lines[-1].endswith((b"\n", b"\r")):
                unfinished.append(lines.pop())
            yield from lines
    except _READ_ERRORS as exc:
        raise StreamFailure(f"cannot read {name}: {_describe(exc)}") from None
    if unfinished:
        yield b"".join(unfinished)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, EOFError):
        return f"it ends early ({exc})"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


def _is_sse_framing(text: bytes) -> bool:
    return text.startswith(_SSE_FRAMING)


def record_body(line: bytes, *, sse: bool = False, keep_blank: bool = False) -> bytes | None:
    """The JSON text of one input line, or None when the line is not a
    record; told without parsing it (`numbered_lines` counts records by it).

    In an SSE capture (`sse`), ``data:`` lines carry the records and other
    fields and comments are not records; elsewhere every line that is not
    blank is a record, JSON or not. With `keep_blank` a blank line is
    parsed too (a record that is not JSON), for inputs where every line or
    row is a record.
    """
    body = line.rstrip(b"\r\n")
    text = body.strip()
    if not text and not keep_blank:
        return None
    if sse:
        if text.startswith(b"data:"):
            # The field value, less the one space that may follow the colon.
            body = text[5:].removeprefix(b" ")
            if body.strip() in (b"[DONE]", b""):
                return None
        elif _is_sse_framing(text):
            return None
    return body


def parse_line(
    line: bytes, *, sse: bool = False, keep_blank: bool = False
) -> tuple[Any, JsonProblem | None] | None:
    """Parse one input line; None when the line is not a record
    (`record_body`).

    Returns:
        The JSON payload and None, or None and the reason it is not JSON.

    """
    body = record_body(line, sse=sse, keep_blank=keep_blank)
    return None if body is None else parse_body(body)


def orjson_exact(text: bytes) -> bool:
    """Whether orjson reads every number in `text` as the server's parser
    (Python's json) does: it turns integers beyond 64 bits into floats,
    which Python keeps exact, so text with a run of 19 digits is not."""
    return text.translate(_DIGITS_AS_ZERO).find(_LONG_DIGIT_RUN) < 0


def parse_body(body: bytes) -> tuple[Any, JsonProblem | None]:
    """Parse a record's JSON text (`record_body`) as the server's parser
    would: the payload and None, or None and the reason it is not JSON."""
    if orjson_exact(body):
        try:
            payload = orjson.loads(body)
            return (JsonString(payload) if type(payload) is str else payload), None
        except orjson.JSONDecodeError:
            pass
    # Python's json also accepts what orjson refuses (NaN, Infinity), as the
    # server's parser does, and words its errors the way FastAPI reports them.
    try:
        payload = json.loads(body)
        # A line that is a JSON string is answered as the server answers it
        # (`post` refuses a plain str as text not yet parsed).
        return (JsonString(payload) if type(payload) is str else payload), None
    except UnicodeDecodeError as exc:
        return None, JsonProblem(f"not text in any JSON encoding: {exc.reason}", None)
    except json.JSONDecodeError as exc:
        return None, JsonProblem(exc.msg, exc.pos)
    except RecursionError:
        # FastAPI answers any other failure of the parser with its generic 400.
        return None, JsonProblem("JSON nested too deeply for the server's parser", None)
    except ValueError as exc:
        # Python refuses integers of more than sys.get_int_max_str_digits() digits.
        return None, JsonProblem(f"not readable by the server's parser: {exc}", None)


def is_sse_capture(lines: Iterable[bytes]) -> bool:
    """Whether lines open an SSE capture: the first line that is not blank,
    a comment or a non-data field is a ``data:`` line."""
    for line in lines:
        text = line.strip()
        if not text:
            continue
        if text.startswith(b"data:"):
            return True
        if not _is_sse_framing(text):
            return False
    return False


def sniff_lines(stream: BinaryIO) -> tuple[bool, Iterator[bytes]]:
    """Whether the stream is an SSE capture, judged from its first lines,
    and all its lines (those read to judge first)."""
    lines = iter_lines(stream)
    head: list[bytes] = []
    for line in lines:
        head.append(line)
        text = line.strip()
        if (text and not _is_sse_framing(text)) or len(head) >= SSE_SNIFF_LINES:
            break
    return is_sse_capture(head), chain(head, lines)


def numbered_lines(
    lines: Iterable[bytes], *, sse: bool = False, trail: Any = None
) -> Iterator[tuple[int, int, bytes, bytes | None]]:
    """The record lines among `lines`: (record number, line number, line,
    digest), the one rule every reader of text inputs numbers records by.

    In JSONL a blank line is a record once a later line is one (see the
    module doc), so output line *i* answers input line *i*; blank lines
    wait for that, and are dropped at the end. `trail`, a hashlib object,
    is fed every line; the digest is its value after the record's line."""
    for number, line_number, line, _, digest in _numbered_bodies(lines, sse, trail):
        yield number, line_number, line, digest


def _numbered_bodies(
    lines: Iterable[bytes], sse: bool, trail: Any
) -> Iterator[tuple[int, int, bytes, bytes, bytes | None]]:
    """`numbered_lines`, with each record's JSON text (`record_body`, blank
    lines kept) after its line."""
    number = 0
    waiting: list[tuple[int, bytes, bytes | None]] = []
    update = trail.update if trail is not None else None
    digest = None
    for line_number, line in enumerate(lines, start=1):
        if update is not None:
            update(line)
            digest = trail.digest()
        body = record_body(line, sse=sse)
        if body is None:
            if not sse:
                waiting.append((line_number, line, digest))
            continue
        for blank_number, blank, blank_digest in waiting:
            number += 1
            yield number, blank_number, blank, record_body(blank, keep_blank=True) or b"", blank_digest
        waiting.clear()
        number += 1
        yield number, line_number, line, body, digest


def iter_records(stream: BinaryIO, *, digests: bool = True) -> Iterator[Record]:
    """Yield the records of a JSONL file or SSE capture, one line at a time
    (numbered by `numbered_lines`). Without `digests` a record's digest is
    None: a run that keeps no manifest does not hash its input.

    Raises:
        StreamFailure: when the stream cannot be read on.

    """
    sse, lines = sniff_lines(stream)
    trail = hashlib.sha256() if digests else None
    for number, line_number, _, text, digest in _numbered_bodies(lines, sse, trail):
        yield Record(number, line_number, digest=digest, text=text)


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
            try:
                shutil.copyfileobj(source, spooled)
            except _READ_ERRORS as exc:
                spooled.close()
                raise InputError(f"cannot read --requests {path}: {_describe(exc)}") from None
            spooled.seek(0)
            return spooled  # type: ignore[return-value]

    def _index(self) -> None:
        first_line: dict[str, int] = {}
        offset = 0
        try:
            for line_number, line in enumerate(iter_lines(self._file), start=1):
                self._index_line(line, line_number, offset, first_line)
                offset += len(line)
        except StreamFailure as failure:
            raise InputError(f"--requests {self.path}: {failure}") from None

    def _index_line(self, line: bytes, line_number: int, offset: int, first_line: dict[str, int]) -> None:
        parsed = parse_line(line)
        if parsed is None:
            return
        payload, problem = parsed
        if problem is not None:
            raise InputError(f"{self.path}:{line_number}: not JSON ({problem.message})")
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

    def _read(self, request_id: str) -> dict[str, Any] | None:
        offset = self._offsets.get(request_id)
        if offset is None:
            return None
        payload = parse_line(self._line_at(offset))
        assert payload is not None and payload[1] is None  # checked by _index
        return payload[0]  # type: ignore[no-any-return]


    def _line_at(self, offset: int) -> bytes:
        """The line at `offset` (ended by LF, CRLF or a lone CR, as
        `iter_lines` reads them), read without moving the file's shared
        offset, so worker processes forked with the index never race."""
        descriptor, pieces = self._file.fileno(), []
        while True:
            piece = os.pread(descriptor, 65536, offset)
            ends = [end for end in (piece.find(b"\n"), piece.find(b"\r")) if end >= 0]
            if ends or not piece:
                pieces.append(piece[: min(ends) + 1] if ends else piece)
                return b"".join(pieces)
            pieces.append(piece)
            offset += len(piece)


_BODY_KEYS = ("generate_response", "generate_responses", "generate_chunk")


def _is_bare_generate_output(payload: Any) -> bool:
    """A GenerateResponse or stream chunk has choices and is no derender
    body; anything else goes to the endpoint as it is, to be validated there."""
    return (
        (type(payload) is dict or isinstance(payload, Mapping))
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
    return joined_body(payload, request, endpoint, stream=stream, origin=requests.path)


def joined_body(
    payload: Mapping[str, Any],
    request: Mapping[str, Any],
    endpoint: Endpoint,
    *,
    stream: bool,
    origin: str,
) -> dict[str, Any]:
    """A bare generate response or stream chunk joined with its original
    request (a ``--requests`` line, or a columnar row's request), into the
    derender body the render step would send.

    Raises:
        RecordError: when the request has no request for `endpoint`;
            `origin` names where it came from.

    """
    request_id = payload.get("request_id")
    original = request.get(endpoint.request_key)
    if original is None:
        other = Endpoint.COMPLETION if endpoint is Endpoint.CHAT else Endpoint.CHAT
        hint = (
            f"; it has a {other.request_key}, so use the {other.value} endpoint"
            if request.get(other.request_key) is not None
            else ""
        )
        raise RecordError(f"request {request_id!r} in {origin} has no {endpoint.request_key}{hint}")
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


class OutputFile:
    """An output that knows how many records it holds in full.

    Each `write` is one output record (a JSONL line, an SSE transcript, an
    assembled response). Records are handed on in batches, and after each
    batch the file is flushed, so `records_written` counts records that
    reached the file whole; a run that fails to write can say so. A write
    that fails raises `StreamFailure` naming the output; a closed pipe
    (``BrokenPipeError``) passes through, since the reader chose to stop.
    """

    BATCH_BYTES = 1 << 16
    BATCH_SECONDS = 0.5
    """A batch goes out at this size or age, so a slow run still shows its
    output as it goes."""

    def __init__(self, target: BinaryIO, name: str) -> None:
        self._target = target
        self.name = name
        self.records_written = 0
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._last_flush = time.monotonic()
        self._failure: StreamFailure | None = None
        self._offset = _plain_offset(target)
        """Where the next batch starts in an uncompressed file (None where
        that cannot be told), to count the whole records of a batch the
        file took only in part (a full disk, ``ulimit -f``)."""

    def write(self, record: bytes) -> int:
        if self._failure is not None:
            raise self._failure
        self._pending.append(record)
        self._pending_bytes += len(record)
        if (
            self._pending_bytes >= self.BATCH_BYTES
            or time.monotonic() - self._last_flush >= self.BATCH_SECONDS
        ):
            self.flush()
        return len(record)

    def flush(self) -> None:
        if self._failure is not None:
            raise self._failure
        records, self._pending = self._pending, []
        batch = b"".join(records)
        self._pending_bytes = 0
        try:
            _write_all(self._target, batch)
            self._target.flush()
        except BrokenPipeError:
            raise
        except OSError as exc:
            self.records_written += _whole_records(records, self._offset, self._target)
            self._failure = StreamFailure(f"cannot write {self.name}: {exc.strerror or exc}")
            raise self._failure from None
        self.records_written += len(records)
        if self._offset is not None:
            self._offset += len(batch)
        self._last_flush = time.monotonic()

    @property
    def failed(self) -> bool:
        return self._failure is not None


def _write_all(target: BinaryIO, batch: bytes) -> None:
    """All of `batch`: a raw file (stdout under ``python -u`` or
    ``PYTHONUNBUFFERED``) may take only part of it, and say so only in the
    count it returns, never as an error."""
    if not isinstance(target, io.RawIOBase):
        target.write(batch)  # a buffered or compressing writer takes all, or raises
        return
    view = memoryview(batch)
    while view:
        written = target.write(view)
        if not written:
            raise OSError(errno.EAGAIN if written is None else errno.EIO, "the output took none of the bytes")
        view = view[written:]


def _plain_offset(target: BinaryIO) -> int | None:
    """The file position of an uncompressed, seekable output (a plain file,
    stdout redirected to one); None for a pipe or a compressed stream."""
    if not isinstance(target, (io.BufferedWriter, io.FileIO)):
        return None
    try:
        descriptor = target.fileno()
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            return None
        # Opened to append (``>>``), the descriptor's position is not yet the end.
        return info.st_size if fcntl.fcntl(descriptor, fcntl.F_GETFL) & os.O_APPEND else target.tell()
    except (OSError, ValueError):
        return None


def _whole_records(records: list[bytes], offset: int | None, target: BinaryIO) -> int:
    """How many of a failed batch's records reached the file whole: those
    that end within the bytes the file took (0 where that cannot be told)."""
    if offset is None:
        return 0
    try:
        reached = os.lseek(target.fileno(), 0, os.SEEK_CUR) - offset
    except OSError:
        return 0
    whole, end = 0, 0
    for record in records:
        end += len(record)
        if end > reached:
            break
        whole += 1
    return whole


@contextlib.contextmanager
def open_output(path: str, *, append: bool = False) -> Iterator[OutputFile]:
    """Open an output path, or stdout for ``-``; ``.gz`` paths are gzipped,
    ``.zst`` paths zstd-compressed. `append` adds to the file (a new gzip
    member or zstd frame, which readers join).

    What was written is flushed on the way out, also when an exception
    ends the run, so records already answered are not lost.

    Raises:
        InputError: when the path cannot be opened for writing.
        StreamFailure: when the last records or the compression trailer
            cannot be written.

    """
    if path == "-":
        output = OutputFile(standard_stream("stdout").buffer, "stdout")
        with _flushed(output):
            yield output
        return
    mode = "ab" if append else "wb"
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        target: BinaryIO
        if path.endswith(".gz"):
            target = gzip.open(path, mode)  # type: ignore[assignment]
        elif path.endswith(".zst"):
            import zstandard

            target = zstandard.open(path, mode)  # type: ignore[assignment]
        else:
            target = open(path, mode)  # noqa: SIM115 - closed below
    except OSError as exc:
        raise InputError(f"cannot write {path}: {exc.strerror or exc}") from None
    output = OutputFile(target, path)
    try:
        with _flushed(output):
            yield output
    finally:
        try:
            target.close()
        except OSError as exc:
            # After a failure, the bytes the file refused are still in its
            # buffer; that failure has been reported already.
            if not output.failed:
                raise StreamFailure(f"cannot write {path}: {exc.strerror or exc}") from None


@contextlib.contextmanager
def _flushed(output: OutputFile) -> Iterator[None]:
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):
            output.flush()
        raise
    if not output.failed:  # a failure was raised, and reported, when it happened
        output.flush()
