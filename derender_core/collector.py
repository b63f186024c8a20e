"""The cyclic garbage collector's pace while records are answered.

A record is tens to hundreds of thousands of short-lived containers: the
dicts and lists of its parsed line (a position of logprobs is one dict per
candidate), the models validated from them, the answer's pieces. None of
them forms a cycle; reference counting frees them all once the answer is
written. CPython counts the young generation net of those frees, but at
its default threshold (700) a large record still sets off many young
collections while it is alive (hundreds while one 8,000-token line with
logprobs is parsed), and each one walks what is alive and promotes it, so
the older generations are walked over and over: 7 to 15% of a record with
logprobs (`benchmarks/logprobs.py`).

`records_pace` raises the young threshold while records are answered, so
that what a record allocates and frees nets out before a collection comes
due. Cycles are still collected, later: at most `YOUNG_THRESHOLD`
surviving containers wait for a pass, and with them whatever a cycle among
them holds; answering a record leaves none
(`tests/test_collector.py`). A threshold the caller set to 0 (automatic
collection off) or above ours is left as it is.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

YOUNG_THRESHOLD = 100_000
"""Surviving containers that set off a young collection while records are
answered (CPython's default is 700)."""

_lock = threading.Lock()
_depth = 0
_saved: tuple[int, ...] | None = None


@contextlib.contextmanager
def records_pace() -> Iterator[None]:
    """The young threshold raised to `YOUNG_THRESHOLD` for the block; the
    caller's thresholds back after it. Runs may nest or overlap in threads:
    the first to enter raises it, the last to leave puts it back."""
    global _depth, _saved
    with _lock:
        if _depth == 0:
            young, *older = gc.get_threshold()
            if young != 0 and young < YOUNG_THRESHOLD:
                _saved = (young, *older)
                gc.set_threshold(YOUNG_THRESHOLD, *older)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _saved is not None:
                gc.set_threshold(*_saved)
                _saved = None
