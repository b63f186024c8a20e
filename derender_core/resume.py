"""Resuming a run from the output an earlier, stopped run left (``--resume``).

Output record *i* answers input record *i* in JSONL and Parquet outputs, so
the records an output holds in full say how far the earlier run got: those
input records are skipped, nothing after them is, and the new answers are
appended. A plain JSONL output is cut after its last complete line; a
compressed one is rewritten with its complete lines (a killed run can leave
a truncated gzip member or zstd frame); a Parquet output is complete or
absent (it is renamed into place when a run ends or stops).

A stream's later calls need the states of its earlier ones. Those are in
the output (each JSONL answer carries its ``stream_state``), so the skipped
records come back as `Restored` items and the ledger threads their states
as if the calls had just been answered.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator

from .batch import Restored
from .datasets import _complete_lines, _parquet_file, is_parquet
from .errors import InputError
from .protocol import Answer
from .records import Record, open_input, open_output


def prepare_output(path: str) -> int:
    """Make `path` end after its last complete record and say how many
    records it holds (0 when it does not exist yet)."""
    if not os.path.exists(path):
        return 0
    if is_parquet(path):
        try:
            return int(_parquet_file(path).metadata.num_rows)
        except InputError as exc:
            raise InputError(
                f"cannot resume {path}: {exc}. A Parquet output is only written when a run "
                "ends or stops on a signal; remove it to start afresh."
            ) from None
    if path.endswith((".gz", ".zst")):
        return _rewrite_complete_lines(path)
    return _cut_after_last_line(path)


def _cut_after_last_line(path: str) -> int:
    lines, end = 0, 0
    with open(path, "rb") as existing:
        offset = 0
        for line in existing:
            offset += len(line)
            if line.endswith(b"\n"):
                lines, end = lines + 1, offset
    if end != os.path.getsize(path):
        os.truncate(path, end)
    return lines


def _rewrite_complete_lines(path: str) -> int:
    partial = path + ".partial" + path[path.rfind(".") :]
    lines = 0
    with open_input(path) as source, open_output(partial) as target:
        for line in _complete_lines(source):
            target.write(line)
            lines += 1
    os.replace(partial, path)
    return lines


def skip_answered(
    records: Iterable[Record], done: int, answers: Iterator[Answer] | None = None
) -> Iterator[Record | Restored]:
    """The records after the first `done`; with `answers` (the output's,
    in order) each skipped record comes back as `Restored` with its answer.

    Raises:
        InputError: when the input has fewer than `done` records: the output
            is not a partial output of this input.

    """
    seen = 0
    for record in records:
        seen = record.number
        if record.number > done:
            yield record
        elif answers is not None:
            answer = next(answers, None)
            if answer is None:
                raise InputError(f"the output holds fewer answers than the {done} counted")
            yield Restored(record, answer)
    if seen < done:
        raise InputError(
            f"the output already holds {done} records but the input has only {seen}: "
            "it is not a partial output of this input"
        )
