"""One rule for every record: whatever goes wrong while a record is
answered or written becomes that record's error record, and the other
records are answered as in a clean run. Only I/O on the run's own files
ends a run.

The failures are injected into derender's own stages, one record at a
time (the record is picked by its generate output, which every stage sees
in some form): joining the record into its body, our checks, the derender
call, turning the answer (a stream's state with it) into bytes, and the
writer's formatting before the file write. The job runs through the job
API (`run_job`) on the session's engine, in process and on two workers.
Nothing of vLLM is replaced: the answers compared are its own.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from derender_core import Answer, DerenderEngine, ExitStatus, JobSpec, RenderConfig, batch, run_job
from derender_core.logprob_text import materialized
from derender_core.writers import JsonlWriter
from tests.conftest import Stack
from tests.helpers import SAMPLE, normalized_bytes

GENERATE_KEYS = ("generate_response", "generate_responses", "generate_chunk")
STAGES = ("joining", "checks", "call", "serialising", "writing")
INPUTS = {
    "one-shot": (SAMPLE / "chat.jsonl").read_bytes() + (SAMPLE / "chat_errors.jsonl").read_bytes(),
    "stream": (SAMPLE / "stream.jsonl").read_bytes(),
}


class Injected(RuntimeError):
    """The failure a test injects."""


def generate_part(value: Any) -> Any:
    """What picks a record out in every stage: its generate output (its
    logprobs loaded where a stage holds them as their text)."""
    value = materialized(value)
    return {key: value.get(key) for key in GENERATE_KEYS} if isinstance(value, Mapping) else None


class Unserialisable(Answer):
    """An answer whose bytes cannot be made, as a stream state holding a
    value JSON refuses; everything else is the real answer's."""

    def __init__(self, real: Answer) -> None:
        self.status = real.status
        self._real = real

    @property
    def raw(self) -> bytes:  # type: ignore[override]
        raise TypeError("injected: the answer cannot be serialised")

    @property
    def is_stream_answer(self) -> bool:
        return self._real.is_stream_answer

    @property
    def stream_state(self) -> Any:
        return self._real.stream_state


def inject(stage: str, target: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make `stage` fail for the record whose generate output is `target`
    (in this process and in workers forked from it)."""

    def failing(function: Callable[..., Any], position: int) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if generate_part(args[position]) == target:
                raise Injected(f"injected: {stage} failed")
            return function(*args, **kwargs)

        return wrapper

    if stage == "joining":
        monkeypatch.setattr(batch, "derender_body", failing(batch.derender_body, 0))
    elif stage == "checks":
        monkeypatch.setattr(batch, "check_body", failing(batch.check_body, 0))
    elif stage == "call":
        monkeypatch.setattr(DerenderEngine, "post", failing(DerenderEngine.post, 2))
    elif stage == "serialising":
        post = DerenderEngine.post

        def unserialisable(self: DerenderEngine, endpoint: Any, body: Any) -> Answer:
            answer = post(self, endpoint, body)
            return Unserialisable(answer) if generate_part(body) == target else answer

        monkeypatch.setattr(DerenderEngine, "post", unserialisable)
    else:
        add = JsonlWriter.add
        expected = target  # here: the clean run's answer line, normalised

        def formatting(self: JsonlWriter, answer: Answer, facts: Any) -> None:
            if normalized_bytes(answer.raw) == expected:
                raise Injected("injected: writing failed")
            add(self, answer, facts)

        monkeypatch.setattr(JsonlWriter, "add", formatting)


@dataclasses.dataclass
class Clean:
    lines: list[dict[str, Any]]
    """The input records."""
    answers: list[bytes]
    """The clean run's output lines, normalised."""
    status: int


def run(stack: Stack, path: Path, out: Path, kind: str, workers: int) -> tuple[list[bytes], int]:
    spec = JobSpec([str(path)], str(out), stream_format="jsonl" if kind == "stream" else None, workers=workers)

    def warm(config: RenderConfig) -> DerenderEngine | None:
        return stack.engine if config == stack.config else None

    summary = run_job(stack.config, spec, warm=warm)
    return [normalized_bytes(line) for line in out.read_bytes().splitlines()], summary.return_code


@pytest.fixture(scope="module")
def clean(qwen3_stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Clean]]:
    found = {}
    directory = tmp_path_factory.mktemp("one-rule")
    for kind, data in INPUTS.items():
        path = directory / f"{kind}.jsonl"
        path.write_bytes(data)
        answers, status = run(qwen3_stack, path, directory / f"{kind}-clean.jsonl", kind, workers=1)
        found[kind] = (path, Clean([json.loads(line) for line in data.splitlines()], answers, status))
    return found


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("kind", list(INPUTS))
def test_a_failure_at_any_stage_of_one_record_is_that_record_s_error_record(
    kind: str, workers: int, data: Any, qwen3_stack: Stack, clean: dict[str, tuple[Path, Clean]], tmp_path_factory: pytest.TempPathFactory
) -> None:
    path, done = clean[kind]
    # Records every stage sees (answered fine in the clean run), picked out
    # by a generate output no other record has.
    parts = [generate_part(line) for line in done.lines]
    candidates = [
        number for number, (part, answer) in enumerate(zip(parts, done.answers, strict=True))
        if parts.count(part) == 1 and b'"error"' not in answer[:10] and done.answers.count(answer) == 1
    ]  # fmt: skip
    target = data.draw(st.sampled_from(candidates), label="record")
    stage = data.draw(st.sampled_from(STAGES), label="stage")
    with pytest.MonkeyPatch.context() as patch:
        inject(stage, done.answers[target] if stage == "writing" else parts[target], patch)
        out = tmp_path_factory.mktemp("injected") / "out.jsonl"
        answers, status = run(qwen3_stack, path, out, kind, workers)

    assert len(answers) == len(done.answers), "one output line per input line"
    failed = json.loads(answers[target])
    assert failed["error"]["message"].startswith("injected: "), failed
    assert status == ExitStatus.RECORDS_FAILED
    request_id = (parts[target].get("generate_chunk") or {}).get("request_id")
    for number, (answer, expected) in enumerate(zip(answers, done.answers, strict=True)):
        later_in_its_stream = (
            # A failed call leaves its stream's state as it was, as a client
            # of the server carries it: the stream's later calls differ.
            kind == "stream" and number > target and (parts[number].get("generate_chunk") or {}).get("request_id") == request_id
        )  # fmt: skip
        if number != target and not later_in_its_stream:
            assert answer == expected, f"record {number + 1} ({stage} failed for record {target + 1})"
