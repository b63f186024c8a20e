"""vLLM's log records during a run, counted per kind.

vLLM's parsers log a full traceback for ordinary model output (hermes on a
tool call cut at ``length``, which real datasets are full of), so a run can
print thousands of them. While a record is derendered, the records of the
``vllm`` logger are collected as `LogLine`s and travel with its outcome
(from a worker process too); the run's report counts them per kind (logger,
level, message, exception type) with one example line and the record that
first caused it. With `verbose` they also go on, in full, to the handlers
vLLM set up, in the process that logged them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

VLLM_LOGGER = "vllm"


@dataclass(frozen=True)
class LogLine:
    """One log record, reduced to what the summary shows of it."""

    key: tuple[str, int, str, str]
    """Logger, level, message template and exception type: its kind."""
    level: str
    logger: str
    example: str


@dataclass
class LogKind:
    """Log records of one kind, and the first of them, in one line."""

    level: str
    logger: str
    example: str
    first_record: int
    """The input record being derendered when the first one was logged."""
    count: int = 0
    key: tuple[str, int, str, str] = ("", 0, "", "")


def count_logs(kinds: list[LogKind], lines: Iterable[LogLine], record_number: int) -> None:
    """Add `lines`, logged while record `record_number` was derendered, to
    the kinds counted so far."""
    for line in lines:
        kind = next((kind for kind in kinds if kind.key == line.key), None)
        if kind is None:
            kind = LogKind(line.level, line.logger, line.example, record_number, key=line.key)
            kinds.append(kind)
        kind.count += 1


class _Collector(logging.Handler):
    def __init__(self, sink: Callable[[LogLine], None], passthrough: list[logging.Handler]) -> None:
        super().__init__()
        self._sink = sink
        self._passthrough = passthrough

    def emit(self, record: logging.LogRecord) -> None:
        self._sink(_log_line(record))
        for handler in self._passthrough:
            if record.levelno >= handler.level:
                handler.handle(record)


def _log_line(record: logging.LogRecord) -> LogLine:
    error = record.exc_info[1] if record.exc_info else None
    key = (record.name, record.levelno, str(record.msg), type(error).__name__ if error else "")
    return LogLine(key, record.levelname, record.name, _one_line(record, error))


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


class _Routed:
    """vLLM's log records go to `sink` while the block runs (and, with
    `verbose`, on to vLLM's own handlers in full).

    A class rather than a generator: it runs once per record, and the
    generator's machinery cost more than the routing."""

    __slots__ = ("_sink", "_verbose", "_original", "_collector")

    def __init__(self, sink: Callable[[LogLine], None], verbose: bool) -> None:
        self._sink = sink
        self._verbose = verbose

    def __enter__(self) -> None:
        logger = _vllm_logger()
        original = self._original = logger.handlers[:]
        collector = self._collector = _idle_collectors.pop() if _idle_collectors else _Collector(_drop, [])
        collector._sink = self._sink
        # Nested in another collection (a record's, inside its run's), pass
        # on to vLLM's own handlers, not to the outer collector: a record's
        # lines are counted once, through its outcome.
        collector._passthrough = (
            [
                inner
                for handler in original
                for inner in (handler._passthrough if isinstance(handler, _Collector) else [handler])
            ]
            if self._verbose
            else []
        )
        logger.handlers = [collector]

    def __exit__(self, *exc_info: object) -> None:
        _vllm_logger().handlers = self._original
        collector = self._collector
        collector._sink, collector._passthrough = _drop, []
        # Collectors are reused: building a logging.Handler (its lock, its
        # registration) per record cost more than the rest.
        _idle_collectors.append(collector)


_routed = _Routed


@functools.cache
def _vllm_logger() -> logging.Logger:
    return logging.getLogger(VLLM_LOGGER)


_idle_collectors: list[_Collector] = []


def _drop(line: LogLine) -> None:
    """The sink of an idle collector."""


class collected_vllm_logs:  # noqa: N801 - used as the context manager function it was
    """The vLLM log records of the block, as lines: ``with
    collected_vllm_logs(verbose=False) as lines: ...``."""

    __slots__ = ("_lines", "_routed")

    def __init__(self, *, verbose: bool) -> None:
        self._lines: list[LogLine] = []
        self._routed = _Routed(self._lines.append, verbose)

    def __enter__(self) -> list[LogLine]:
        self._routed.__enter__()
        return self._lines

    def __exit__(self, *exc_info: object) -> None:
        self._routed.__exit__()


@contextlib.contextmanager
def tally_vllm_logs(
    kinds: list[LogKind], current_record: Callable[[], int], *, verbose: bool
) -> Iterator[None]:
    """Count into `kinds` the vLLM log records of a whole run that no
    record's own collection took (those of writing the output, say)."""
    with _routed(lambda line: count_logs(kinds, [line], current_record()), verbose):
        yield
