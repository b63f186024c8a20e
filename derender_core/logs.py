"""vLLM's log records during a run, counted per kind.

vLLM's parsers log a full traceback for ordinary model output (hermes on a
tool call cut at ``length``, which real datasets are full of), so a run can
print thousands of them. While a run derenders, the records of the
``vllm`` logger are counted per kind (logger, level, message, exception
type) with one example line and the record that first caused it; with
`verbose` they also go on, in full, to the handlers vLLM set up.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

VLLM_LOGGER = "vllm"


@dataclass
class LogKind:
    """Log records of one kind, and the first of them, in one line."""

    level: str
    logger: str
    example: str
    first_record: int
    """The input record being derendered when the first one was logged."""
    count: int = 0


class _Tally(logging.Handler):
    def __init__(
        self,
        kinds: list[LogKind],
        current_record: Callable[[], int],
        passthrough: list[logging.Handler],
    ) -> None:
        super().__init__()
        self._kinds = kinds
        self._by_key: dict[tuple[str, int, str, str], LogKind] = {}
        self._current_record = current_record
        self._passthrough = passthrough

    def emit(self, record: logging.LogRecord) -> None:
        error = record.exc_info[1] if record.exc_info else None
        key = (record.name, record.levelno, str(record.msg), type(error).__name__ if error else "")
        kind = self._by_key.get(key)
        if kind is None:
            kind = self._by_key[key] = LogKind(
                record.levelname, record.name, _one_line(record, error), self._current_record()
            )
            self._kinds.append(kind)
        kind.count += 1
        for handler in self._passthrough:
            if record.levelno >= handler.level:
                handler.handle(record)


def _one_line(record: logging.LogRecord, error: BaseException | None) -> str:
    try:
        message = record.getMessage()
    except Exception:  # a bad format string in a log call
        message = str(record.msg)
    line = message.splitlines()[0] if message else ""
    if error is not None:
        detail = str(error).splitlines()[0] if str(error) else ""
        line += f" ({type(error).__name__}: {detail})" if detail else f" ({type(error).__name__})"
    return line if len(line) <= 300 else line[:297] + "..."


@contextlib.contextmanager
def tally_vllm_logs(
    kinds: list[LogKind], current_record: Callable[[], int], *, verbose: bool
) -> Iterator[None]:
    """Count vLLM's log records into `kinds` while the block runs; with
    `verbose`, pass them on in full as well."""
    logger = logging.getLogger(VLLM_LOGGER)
    original = logger.handlers[:]
    tally = _Tally(kinds, current_record, original if verbose else [])
    logger.handlers = [tally]
    try:
        yield
    finally:
        logger.handlers = original
