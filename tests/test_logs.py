"""vLLM's log records routed per record (`logs`): a record's lines reach
its own collection, once, inside a run's collection or alone, and with
verbose also vLLM's own handlers, once."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from _pytest.logging import LogCaptureHandler

from derender_core.logs import VLLM_LOGGER, LogKind, collected_vllm_logs, tally_vllm_logs


class Kept(logging.Handler):
    """A handler like vLLM's own: keeps what reaches it."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def vllm_handler() -> Iterator[Kept]:
    logger = logging.getLogger(VLLM_LOGGER)
    kept, before = Kept(), logger.handlers[:]
    logger.handlers = [kept]
    yield kept
    # pytest 9 attaches its capture handlers to non-propagating loggers for
    # each phase and detaches them from the list it finds then: the setup
    # phase's are in `before`, and would stay on vLLM's logger for good.
    logger.handlers = [handler for handler in before if not isinstance(handler, LogCaptureHandler)]


def log(message: str) -> None:
    logging.getLogger(f"{VLLM_LOGGER}.test").warning(message)


@pytest.mark.parametrize("verbose", [False, True])
@pytest.mark.parametrize("in_run", [False, True])
def test_a_records_lines_reach_its_collection_once(vllm_handler: Kept, verbose: bool, in_run: bool) -> None:
    # What the logger holds as the test starts: the fixture's handler, and
    # pytest's own where it attaches to non-propagating loggers (pytest 9).
    handlers = logging.getLogger(VLLM_LOGGER).handlers[:]
    assert vllm_handler in handlers
    kinds: list[LogKind] = []
    run = tally_vllm_logs(kinds, lambda: 7, verbose=verbose) if in_run else None
    if run is not None:
        run.__enter__()
    try:
        log("before")
        with collected_vllm_logs(verbose=verbose) as first:
            log("one")
            with collected_vllm_logs(verbose=verbose) as inner:
                log("inner")
            log("two")
        with collected_vllm_logs(verbose=not verbose) as other:
            log("other")
        log("after")
    finally:
        if run is not None:
            run.__exit__(None, None, None)
    log("outside")
    assert [line.example for line in first] == ["one", "two"]
    assert [line.example for line in inner] == ["inner"]
    assert [line.example for line in other] == ["other"]
    # The run counts what no record took; without a run, vLLM's handler had it.
    assert [kind.example for kind in kinds] == (["before", "after"] if in_run else [])
    # With verbose, vLLM's handler gets every line once; a collection of the
    # other verbosity passes on to what is beneath it: vLLM's handler alone,
    # or the run's collector's (none when the run is not verbose).
    if verbose:
        expected = ["before", "one", "inner", "two", "after", "outside"]
    elif in_run:
        expected = ["outside"]
    else:
        expected = ["before", "other", "after", "outside"]
    assert vllm_handler.messages == expected
    assert logging.getLogger(VLLM_LOGGER).handlers == handlers
