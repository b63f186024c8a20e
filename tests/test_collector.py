"""The collector's pace while records are answered (`collector.records_pace`):
raised for a run, the caller's thresholds back after it, whatever else
runs beside it."""

from __future__ import annotations

import gc
import io
import threading
from collections.abc import Iterator

import pytest

from derender_core import DerenderEngine, Endpoint
from derender_core.batch import Job, run
from derender_core.collector import YOUNG_THRESHOLD, records_pace
from derender_core.records import iter_records
from derender_core.writers import JsonlWriter
from tests.conftest import REPO


@pytest.fixture
def thresholds() -> Iterator[tuple[int, int, int]]:
    saved = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield gc.get_threshold()
    gc.set_threshold(*saved)


def test_a_block_raises_the_young_threshold_and_puts_the_callers_back(thresholds: tuple[int, int, int]) -> None:
    with records_pace():
        assert gc.get_threshold() == (YOUNG_THRESHOLD, 10, 10)
        with records_pace():
            assert gc.get_threshold() == (YOUNG_THRESHOLD, 10, 10)
        assert gc.get_threshold() == (YOUNG_THRESHOLD, 10, 10)
    assert gc.get_threshold() == (700, 10, 10)


def test_the_callers_threshold_is_back_after_a_failure(thresholds: tuple[int, int, int]) -> None:
    with pytest.raises(RuntimeError), records_pace():
        raise RuntimeError("a run that ends by an error")
    assert gc.get_threshold() == (700, 10, 10)


@pytest.mark.parametrize("young", [0, YOUNG_THRESHOLD * 2])
def test_a_threshold_the_caller_chose_is_left_as_it_is(thresholds: tuple[int, int, int], young: int) -> None:
    gc.set_threshold(young, 5, 5)
    with records_pace():
        assert gc.get_threshold() == (young, 5, 5)
    assert gc.get_threshold() == (young, 5, 5)


def test_overlapping_blocks_in_threads_put_the_callers_threshold_back(thresholds: tuple[int, int, int]) -> None:
    """The first block in raises it, the last one out puts it back, in
    whatever order they leave."""
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen: list[tuple[int, int, int]] = []

    def first() -> None:
        with records_pace():
            first_in.set()
            second_in.wait(10)
        first_out.set()

    def second() -> None:
        first_in.wait(10)
        with records_pace():
            second_in.set()
            first_out.wait(10)
            seen.append(gc.get_threshold())

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert seen == [(YOUNG_THRESHOLD, 10, 10)]
    assert gc.get_threshold() == (700, 10, 10)


def test_a_run_answers_at_the_raised_pace_and_puts_the_callers_back(
    sample_engine: DerenderEngine, thresholds: tuple[int, int, int]
) -> None:
    lines = (REPO / "sample_data" / "chat.jsonl").read_bytes()
    seen: list[tuple[int, int, int]] = []
    report = run(
        sample_engine.in_mode(live=True),
        iter_records(io.BytesIO(lines), digests=False),
        Job(Endpoint.CHAT, stream=False),
        JsonlWriter(target=io.BytesIO()),
        on_progress=lambda _: seen.append(gc.get_threshold()),
    )
    assert report.records == 4 and report.errors == 0
    assert set(seen) == {(YOUNG_THRESHOLD, 10, 10)}
    assert gc.get_threshold() == (700, 10, 10)


def test_answering_records_leaves_no_cyclic_garbage(sample_engine: DerenderEngine) -> None:
    """What the raised threshold relies on: a record's containers are freed
    by reference counting alone, so nothing a record leaves waits for a
    collection (which, at the raised threshold, comes later). One-shot
    records, refused and malformed ones among them, and a live stream's
    calls, with the collector off while they are answered (after a first
    run, which builds what is built once)."""
    chat = (REPO / "sample_data" / "chat.jsonl").read_bytes()
    refused = b'{"generate_response": {"choices": []}}\n{"generate_response": [1, 2\n'
    streams = (REPO / "sample_data" / "stream.jsonl").read_bytes()
    for lines, job in ((chat + refused, Job(Endpoint.CHAT, stream=False)), (streams, Job(Endpoint.CHAT, stream=True))):
        engine = sample_engine.in_mode(live=True)
        for _ in range(2):
            gc.collect()
            enabled = gc.isenabled()
            gc.disable()
            try:
                report = run(engine, iter_records(io.BytesIO(lines), digests=False), job, JsonlWriter(target=io.BytesIO()))
                left = gc.collect()
            finally:
                if enabled:
                    gc.enable()
            assert report.records > 0
        assert left == 0, f"{left} objects in cycles after {report.records} records ({job})"
