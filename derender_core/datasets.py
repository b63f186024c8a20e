"""Dataset files: inputs and outputs by suffix, Parquet rows, shard names.

Text inputs (JSONL, SSE captures; plain, gzip or zstd, detected by content)
are read line by line by `records.iter_records`. A ``.parquet`` input is
read a row group slice at a time, in one of two forms:

- a ``body`` (or ``text``) column holding one input line per row, parsed
  with the same line parser, so its error wording and big-integer handling
  carry over;
- columns for one-shot records: ``token_ids`` (the generated ids) and
  ``request`` (the original chat or completion request as JSON), with
  optional ``prompt_token_ids``, ``prompt_tokens``, ``request_id`` (or
  ``key``), ``finish_reason``, ``stop_reason`` and ``model``. A row is
  joined into a derender body exactly as ``--requests`` joins a bare
  GenerateResponse. For ``derender render``, a ``request`` column alone
  holds each row's request.

Every row is a record (an empty body gets the server's JSON error), so
output row *i* answers input row *i*. A body column that is not text
(string or binary) is refused before anything runs (`check_input`).

A ``.parquet`` output holds one row per answer: ``record`` (the input
record it answers, from 1), ``status`` (the HTTP status) and ``response``
(the exact body bytes, as a string). It is written to ``<path>.partial``
and renamed when the run ends or stops, so a Parquet output is never half
written.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from .batch import Job
from .errors import InputError
from .protocol import Answer
from .records import JsonProblem, Record, iter_records, joined_body, open_input, record_body
from .streams import ChunkFacts

if TYPE_CHECKING:
    import pyarrow as pa

COMPRESSION_SUFFIXES = (".gz", ".zst")
TEXT_SUFFIXES = (".jsonl", ".json", ".ndjson", ".sse", ".txt")
PARQUET_SUFFIX = ".parquet"
BODY_COLUMNS = ("body", "text")
KEY_COLUMNS = ("request_id", "key")
ROWS_PER_READ = 1024
ROWS_PER_GROUP = 8192


def is_parquet(path: str) -> bool:
    return path.endswith(PARQUET_SUFFIX)


@dataclass
class Input:
    """An opened input: its records, and how much of it has been read."""

    records: Iterator[Record]
    size: int | None
    """Bytes in the file, None for stdin or a pipe."""
    _descriptor: int | None = None

    def bytes_read(self) -> int | None:
        """The file's position: bytes read so far (compressed bytes for a
        compressed file), for an ETA."""
        if self._descriptor is None:
            return None
        try:
            return os.lseek(self._descriptor, 0, os.SEEK_CUR)
        except OSError:
            return None


@contextlib.contextmanager
def open_records(path: str, job: Job, *, digests: bool = True) -> Iterator[Input]:
    """Open any input by suffix and content: Parquet, or text lines.
    `digests`: whether each text record carries its digest, which only a
    manifest (``--resume``) needs (`records.iter_records`)."""
    if is_parquet(path):
        parquet = _parquet_file(path)
        size = os.path.getsize(path)
        yield Input(_parquet_records(parquet, job, path), size)
        return
    with open_input(path) as source:
        try:
            descriptor = source.fileno() if path != "-" else None
        except OSError:  # io.UnsupportedOperation: a slow pipe, sniffed through a prefix
            descriptor = None
        size = None
        if descriptor is not None:
            size = os.fstat(descriptor).st_size or None
        yield Input(iter_records(source, digests=digests), size, descriptor)


def _parquet_file(path: str) -> Any:
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except OSError as exc:
        raise InputError(f"cannot open input {path}: {exc.strerror or exc}") from None
    except Exception as exc:  # pyarrow's ArrowInvalid for a file that is not Parquet
        raise InputError(f"cannot read {path} as Parquet: {exc}") from None


def check_input(path: str) -> None:
    """What can be told about an input before the model loads: a Parquet
    input must be readable and its body column text.

    Raises:
        InputError: naming the input, and the column and its type.

    """
    if is_parquet(path):
        _check_body_column(_parquet_file(path).schema_arrow, path)


def _check_body_column(schema: pa.Schema, origin: str) -> None:
    import pyarrow as pa

    body_column = next((name for name in BODY_COLUMNS if name in schema.names), None)
    if body_column is None:
        return
    kind = schema.field(body_column).type
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    text = (pa.types.is_string, pa.types.is_large_string, pa.types.is_binary, pa.types.is_large_binary, pa.types.is_null)
    if not any(is_text(kind) for is_text in text):
        raise InputError(
            f"{origin}: column {body_column!r} is {schema.field(body_column).type}, not text: "
            "it must hold one input line (a JSON body) per row, as a string or binary"
        )


def _parquet_records(parquet: Any, job: Job, path: str) -> Iterator[Record]:
    number = 0
    trail = hashlib.sha256()
    for batch in parquet.iter_batches(batch_size=ROWS_PER_READ):
        for record in records_from_table(batch, job, first_number=number + 1, origin=path, trail=trail):
            number = record.number
            yield record


def records_from_table(
    table: pa.Table | pa.RecordBatch,
    job: Job,
    first_number: int,
    origin: str,
    trail: Any = None,
) -> Iterator[Record]:
    """The records of an Arrow table's rows (see the module doc for its
    columns), numbered from `first_number`; ``line`` is the row number.
    `trail` (a hashlib object) is updated with each row, for
    `Record.digest`, across the tables of one input."""
    names = set(table.schema.names)
    # A render input's rows are requests: a ``request`` column is its body.
    columns = (*BODY_COLUMNS, "request") if job.endpoint.renders else BODY_COLUMNS
    body_column = next((name for name in columns if name in names), None)
    trail = trail or hashlib.sha256()
    if body_column is not None:
        _check_body_column(table.schema, origin)
        for offset, value in enumerate(table.column(body_column).to_pylist()):
            number = first_number + offset
            raw = value.encode("utf-8") if isinstance(value, str) else (value or b"")
            trail.update(len(raw).to_bytes(8, "little") + raw)
            yield _body_record(number, raw, trail.digest())
        return
    if job.endpoint.renders:
        raise InputError(f"{origin}: a render input needs a body, text or request column: one request per row")
    if job.stream:
        raise InputError(
            f"{origin}: a stream input needs a body column ({' or '.join(BODY_COLUMNS)}): "
            "one streaming derender call per row"
        )
    missing = [name for name in ("token_ids", "request") if name not in names]
    if missing:
        raise InputError(
            f"{origin}: no {' or '.join(BODY_COLUMNS)} column, and no {' and '.join(missing)} "
            f"column for the columnar form (columns: {', '.join(sorted(names))})"
        )
    rows = table.to_pylist()
    key_column = next((name for name in KEY_COLUMNS if name in names), None)
    for offset, row in enumerate(rows):
        number = first_number + offset
        key = row.get(key_column) if key_column else None
        trail.update(repr(sorted(row.items())).encode() + b"\n")
        record = _columnar_record(number, row, key, job, origin)
        record.digest = trail.digest()
        yield record


def _body_record(number: int, raw: bytes, digest: bytes) -> Record:
    # Every row is a record: an empty body is not JSON.
    return Record(number, number, digest=digest, text=record_body(raw, keep_blank=True))


def _columnar_record(number: int, row: Mapping[str, Any], key: Any, job: Job, origin: str) -> Record:
    request_text = row.get("request")
    try:
        request = json.loads(request_text) if isinstance(request_text, (str, bytes)) else None
    except json.JSONDecodeError as exc:
        return Record(number, number, problem=JsonProblem(exc.msg, exc.pos))
    choice: dict[str, Any] = {"index": 0, "token_ids": row.get("token_ids")}
    for name in ("finish_reason", "stop_reason"):
        if row.get(name) is not None:
            choice[name] = row[name]
    request_id = str(key) if key is not None else f"row-{number}"
    generate = {"request_id": request_id, "choices": [choice]}
    key_name = job.endpoint.request_key
    joined = {
        # A null request is a body without one (fine without a parser).
        key_name: {} if request is None else request,
        **{name: row[name] for name in ("prompt_token_ids", "prompt_tokens", "model") if row.get(name) is not None},
    }
    body = joined_body(generate, joined, job.endpoint, stream=False, origin=f"{origin} row {number}")
    if request is None:
        del body[key_name]
    return Record(number, number, payload=body)


class ParquetWriter:
    """Answers as Parquet rows: ``record``, ``status``, ``response``.

    Written to ``<path>.partial`` and renamed over `path` at `close`;
    `resume` first copies the rows a valid `path` already holds.
    """

    def __init__(self, path: str, *, resume: bool = False) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        self._pa = pa
        self.path = path
        self.schema = pa.schema([("record", pa.int64()), ("status", pa.int32()), ("response", pa.string())])
        self._partial = path + ".partial"
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        if not resume:
            # Replaced now, as a JSONL output is truncated: an earlier run's
            # file left until this one ends could pass for this run's
            # (its manifest is this run's) if this run is killed.
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        try:
            self._writer = pq.ParquetWriter(self._partial, self.schema)
        except OSError as exc:
            raise InputError(f"cannot write {path}: {exc.strerror or exc}") from None
        self.records = 0
        if resume and os.path.exists(path):
            for batch in _parquet_file(path).iter_batches(batch_size=ROWS_PER_GROUP):
                self._writer.write_batch(batch.cast(self.schema))
                self.records += batch.num_rows
        self._rows: tuple[list[int], list[int], list[str]] = ([], [], [])
        self._flushed = 0
        self._in_place = False

    def add(self, answer: Answer, facts: ChunkFacts | None) -> None:
        self.records += 1
        numbers, statuses, responses = self._rows
        numbers.append(self.records)
        statuses.append(answer.status)
        responses.append(answer.raw.decode("utf-8"))
        if len(numbers) >= ROWS_PER_GROUP:
            self._flush()

    def complete(self, request_id: str | None) -> None:
        pass

    def close(self) -> None:
        self._flush()
        self._writer.close()
        os.replace(self._partial, self.path)
        self._in_place = True

    @property
    def records_written(self) -> int:
        """The rows this run put in the output: none until it is closed,
        since the file takes its place whole (`Writer.records_written`)."""
        return self._flushed if self._in_place else 0

    def _flush(self) -> None:
        numbers, statuses, responses = self._rows
        if numbers:
            self._writer.write_table(
                self._pa.table([numbers, statuses, responses], schema=self.schema)
            )
            self._flushed += len(numbers)
            self._rows = ([], [], [])


def answers_in(path: str) -> Iterator[Answer]:
    """The answers an output holds (JSONL, plain or compressed, or
    Parquet), in order: what an earlier run wrote, read back for
    ``--resume``. Text lines without their newline are left out."""
    if is_parquet(path):
        for batch in _parquet_file(path).iter_batches(batch_size=ROWS_PER_READ, columns=["status", "response"]):
            for status, response in zip(
                batch.column(0).to_pylist(), batch.column(1).to_pylist(), strict=True
            ):
                yield Answer(status, response.encode("utf-8"))
        return
    with open_input(path) as source:
        for line in _complete_lines(source):
            yield Answer(answer_status(line), line[:-1])


def _complete_lines(source: BinaryIO) -> Iterator[bytes]:
    """Lines with their newline, up to where a compressed stream breaks off."""
    try:
        for line in source:
            if not line.endswith(b"\n"):
                return
            yield line
    except (EOFError, OSError, ValueError):
        # A truncated gzip or zstd stream: what decoded in full stands.
        return
    except Exception as exc:
        if type(exc).__name__ == "ZstdError":
            return
        raise


def answer_status(raw: bytes) -> int:
    """The HTTP status of an answer body read back from JSONL: an error
    body carries its code (vLLM's ErrorResponse), anything else was a 200."""
    try:
        body = json.loads(raw)
    except ValueError:
        return 200
    error = body.get("error") if isinstance(body, Mapping) else None
    code = error.get("code") if isinstance(error, Mapping) else None
    return code if isinstance(code, int) else 200


def output_name(input_path: str, output_format: str | None) -> str:
    """The file an input's output gets in an output directory: the input's
    name with the output's extension, its compression suffix carried over
    (``part-0.jsonl.zst`` -> ``part-0.jsonl.zst``; ``capture.sse.gz`` ->
    ``capture.jsonl.gz``; ``part-0.parquet`` -> ``part-0.parquet``)."""
    name = Path(input_path).name
    compression = next((s for s in COMPRESSION_SUFFIXES if name.endswith(s)), "")
    stem = name[: len(name) - len(compression)]
    if stem.endswith(PARQUET_SUFFIX):
        return stem if output_format in (None, "jsonl") else stem[: -len(PARQUET_SUFFIX)] + f".{output_format}"
    for suffix in TEXT_SUFFIXES:
        if stem.endswith(suffix):
            stem = stem[: -len(suffix)]
            break
    extension = ".sse" if output_format == "sse" else ".jsonl"
    return stem + extension + compression
