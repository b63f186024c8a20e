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
import contextvars
import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import cache
from typing import Any

VLLM_LOGGER = "vllm"
SERVE_LOGGER = "derender.serve"
"""The serve path's logger, which reports stop-logic findings (parity
reports each as a ``stop_logic`` divergence instead)."""


ROUTE: contextvars.ContextVar[Callable[[LogLine], None] | None] = contextvars.ContextVar(
    "derender_log_route", default=None
)
"""Where the vLLM log records of the current context go instead of the
collection's sink: a batch of requests answered at once on one event loop
(`protocol.Derenderer.drive`) runs each request in its own context (and
the tasks it starts inherit it), so each request's lines stay its own."""


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
        self._verbose = bool(passthrough)
        """Whether it passes records on: set with `_passthrough` while routing."""

    def emit(self, record: logging.LogRecord) -> None:
        (ROUTE.get() or self._sink)(_log_line(record))
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
    `verbose`, on to vLLM's own handlers in full); the block gets `value`.

    A class rather than a generator-based context manager: it is entered
    once per record, and the generator's frame and wrappers cost more
    than the routing itself."""

    __slots__ = ("_sink", "_verbose", "_value", "_original", "_collector", "_outer_sink")

    def __init__(self, sink: Callable[[LogLine], None], verbose: bool, value: Any = None) -> None:
        self._sink = sink
        self._verbose = verbose
        self._value = value

    def __enter__(self) -> Any:
        logger = _vllm_logger()
        original = self._original = logger.handlers
        if len(original) == 1:
            outer = original[0]
            if type(outer) is _Collector and outer._verbose == self._verbose:
                # Inside a run's own collection (a record's, the usual case):
                # its collector passes on to the handlers this one would pass
                # on to, so only its sink changes for the block.
                self._collector = None
                self._outer_sink = outer._sink
                outer._sink = self._sink
                return self._value
        # Nested in another collection, pass on to vLLM's own handlers, not
        # to the outer collector: a record's lines are counted once, through
        # its outcome.
        beneath = [
            inner
            for handler in original
            for inner in (handler._passthrough if isinstance(handler, _Collector) else [handler])
        ]
        # Collectors are reused: this runs once per record, and building a
        # logging.Handler (its lock, its registration) cost more than the rest.
        collector = self._collector = _idle_collectors.pop() if _idle_collectors else _Collector(self._sink, [])
        collector._sink, collector._passthrough = self._sink, beneath if self._verbose else []
        collector._verbose = self._verbose
        logger.handlers = [collector]
        return self._value

    def __exit__(self, *exc: object) -> None:
        collector = self._collector
        if collector is None:
            self._original[0]._sink = self._outer_sink
            return
        _vllm_logger().handlers = self._original
        collector._sink, collector._passthrough = _drop, []
        _idle_collectors.append(collector)


@cache
def _vllm_logger() -> logging.Logger:
    """vLLM's root logger: the same object for the process's life, looked
    up once (``getLogger`` takes the logging module's lock)."""
    return logging.getLogger(VLLM_LOGGER)


_idle_collectors: list[_Collector] = []


def _drop(line: LogLine) -> None:
    """The sink of an idle collector."""


def collected_vllm_logs(
    *, verbose: bool, sink: Callable[[LogLine], None] | None = None
) -> AbstractContextManager[list[LogLine]]:
    """The vLLM log records of the block, as lines (handed to `sink` instead, if given)."""
    lines: list[LogLine] = []
    return _Routed(sink or lines.append, verbose, lines)


def tally_vllm_logs(
    kinds: list[LogKind], current_record: Callable[[], int], *, verbose: bool
) -> AbstractContextManager[None]:
    """Count into `kinds` the vLLM log records of a whole run that no
    record's own collection took (those of writing the output, say)."""
    return _Routed(lambda line: count_logs(kinds, [line], current_record()), verbose)


@contextlib.contextmanager
def quieted(name: str) -> Iterator[None]:
    """The logger `name` says nothing below errors, for the while."""
    chosen = logging.getLogger(name)
    level = chosen.level
    chosen.setLevel(logging.ERROR)
    try:
        yield
    finally:
        chosen.setLevel(level)
