"""Stopping a run cleanly on Ctrl-C or SIGTERM.

The first signal asks the run to stop taking records: the record at hand
(and, with workers, every record already handed out) is answered and
written, the writers close as at the end of the input, and the report says
where the run stopped. A second signal stops at once.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

Item = TypeVar("Item")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """Set from a signal handler; read between records."""

    def __init__(self) -> None:
        self.signal: int | None = None

    def __bool__(self) -> bool:
        return self.signal is not None


@contextlib.contextmanager
def stop_on_signals(on_first: Callable[[int], None] | None = None) -> Iterator[StopRequest]:
    """While inside, SIGINT and SIGTERM set the returned request instead of
    killing the process (one this process ignores stays ignored); a second
    one raises KeyboardInterrupt. `on_first`
    is told the first signal (to say that the run is stopping). Off the
    main thread (a library call in a thread) Python allows no handlers:
    the run then stops only with its process."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return

    def handle(signum: int, frame: object) -> None:
        if request.signal is not None:
            raise KeyboardInterrupt
        request.signal = signum
        if on_first is not None:
            on_first(signum)

    # A signal the process was started with ignored (a background job in
    # a script, nohup) stays ignored, as it was while the run started up.
    previous = {
        signum: signal.signal(signum, handle)
        for signum in STOP_SIGNALS
        if signal.getsignal(signum) != signal.SIG_IGN
    }
    try:
        yield request
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def until_stopped(items: Iterable[Item], request: StopRequest) -> Iterator[Item]:
    """The items, until a stop is requested."""
    for item in items:
        if request:
            return
        yield item
