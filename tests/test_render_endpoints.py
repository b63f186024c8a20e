"""The rest of the render server's preprocessing half, offline:
``/v1/messages/render`` (Anthropic Messages), ``/v1/responses/render``
(OpenAI Responses), ``/tokenize`` and ``/detokenize``, as `derender render
messages|responses`, `derender tokenize|detokenize` and the library's
``render_messages``, ``render_responses``, ``tokenize``, ``detokenize``.

Every answer is checked against a real `vllm launch render` of the
installed release, byte for byte up to the request ids the server draws:
every family's corpus (`tests.render_corpus`: system blocks, tool use and
results, thinking blocks, an image, every ``tool_choice``; instructions,
input as a string and as items, function tools, reasoning items,
``previous_response_id``; chats and prompts to tokenize, ids to
detokenize; and the errors) on the sample model here and on every family
in tests/test_families.py (one server each, shared with the rest of that
file), and requests drawn by Hypothesis per endpoint.
"""

from __future__ import annotations

import copy
import gzip
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from derender_core import Endpoint, ExitStatus, RenderError
from tests.conftest import Stack
from tests.helpers import invoke, run_cli
from tests.render_corpus import (
    ANTHROPIC_WEATHER_TOOL,
    PREPROCESSING_CORPORA,
    RESPONSES_WEATHER_TOOL,
    detokenize_bodies,
    drawn_ids_blanked,
    mismatches,
    posted,
    preprocessing_bodies,
)
from tests.sample_inputs import WEATHER_TOOL

SAMPLE_FLAGS = ["--config", "sample_data/qwen3.yaml"]
CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
NEW_ENDPOINTS = list(PREPROCESSING_CORPORA)


def test_corpus_answers_as_the_server(qwen3_stack: Stack) -> None:
    """Each endpoint's corpus on the sample model, the engine asked first:
    the same status and bytes as the server, errors included, and the
    bodies left as they were sent (the server then reads them unchanged).
    Every family runs the corpus in tests/test_families.py
    (``test_render_matches_server``)."""
    bodies = preprocessing_bodies(qwen3_stack.builder)
    sent = copy.deepcopy(bodies)
    ours = [(f"{endpoint.value} {name}", qwen3_stack.engine.post(endpoint, body)) for endpoint, name, body in bodies]
    assert bodies == sent
    theirs = [(f"{endpoint.value} {name}", *posted(qwen3_stack.server, endpoint, body)) for endpoint, name, body in bodies]
    assert mismatches(ours, theirs) == []
    for endpoint in NEW_ENDPOINTS:
        statuses = {answer.status for (kind, _, _), (_, answer) in zip(bodies, ours, strict=True) if kind is endpoint}
        assert 200 in statuses and statuses - {200}, (endpoint, statuses)


# --- drawn requests ------------------------------------------------------------

_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=24)
_MODEL = st.sampled_from(["qwen3-sample", "qwen3-sample", "qwen3-sample", "other-model"]) | st.none()
"""Mostly the served model, so that most drawn requests render."""


def _maybe(required: dict[str, st.SearchStrategy[Any]] | None = None, **fields: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    """A dict holding the `required` fields and any subset of `fields`,
    each drawn."""
    return st.fixed_dictionaries(required or {}, optional=fields)


def _without_none(body: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in body.items() if value is not None}


_ANTHROPIC_BLOCK = st.one_of(
    st.builds(lambda text: {"type": "text", "text": text}, _TEXT),
    st.builds(lambda text: {"type": "thinking", "thinking": text, "signature": "s"}, _TEXT),
    st.just({"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}),
    st.builds(lambda text: {"type": "tool_result", "tool_use_id": "toolu_1", "content": text}, _TEXT),
)
_MESSAGES = st.builds(
    lambda common, turns, system: _without_none({**common, "messages": turns, "system": system}),
    _maybe(
        {"model": _MODEL, "max_tokens": st.integers(0, 50_000)},
        temperature=st.floats(0, 2),
        top_k=st.integers(-1, 50),
        stop_sequences=st.lists(_TEXT, max_size=2),
        stream=st.booleans(),
        tools=st.just([ANTHROPIC_WEATHER_TOOL]),
        tool_choice=st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "none"}, {"type": "tool", "name": "get_weather"}]),
        thinking=st.sampled_from([{"type": "disabled"}, {"type": "enabled", "budget_tokens": 1024}]),
    ),
    st.lists(
        st.builds(
            lambda role, content: {"role": role, "content": content},
            st.sampled_from(["user", "assistant"]),
            _TEXT | st.lists(_ANTHROPIC_BLOCK, min_size=1, max_size=3),
        ),
        min_size=1,
        max_size=4,
    ),
    st.none() | _TEXT | st.lists(st.builds(lambda text: {"type": "text", "text": text}, _TEXT), max_size=2),
)
_RESPONSES_ITEM = st.one_of(
    st.builds(lambda role, text: {"role": role, "content": text}, st.sampled_from(["user", "assistant", "system", "developer"]), _TEXT),
    st.builds(lambda text: {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}, _TEXT),
    st.just({"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}),
    st.builds(lambda text: {"type": "function_call_output", "call_id": "call_1", "output": text}, _TEXT),
    st.builds(
        lambda text: {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": text}]},
        _TEXT,
    ),
)
_RESPONSES = st.builds(
    lambda common, given: {**common, "input": given},
    _maybe(
        {"model": _MODEL},
        instructions=_TEXT,
        max_output_tokens=st.integers(0, 50_000),
        temperature=st.floats(0, 2),
        top_p=st.floats(0, 1),
        stream=st.booleans(),
        tools=st.just([RESPONSES_WEATHER_TOOL]),
        tool_choice=st.sampled_from(["auto", "none", "required"]),
        request_id=st.just("drawn"),
        previous_response_id=st.none() | st.just("resp_1"),
    ),
    _TEXT | st.lists(_RESPONSES_ITEM, min_size=1, max_size=4),
)
_TOKENIZE = st.one_of(
    st.builds(
        lambda common, prompt: {**common, "prompt": prompt},
        _maybe(model=_MODEL, add_special_tokens=st.booleans(), return_token_strs=st.booleans()),
        _TEXT,
    ),
    st.builds(
        lambda common, turns: {**common, "messages": turns},
        _maybe(
            model=_MODEL,
            add_generation_prompt=st.booleans(),
            continue_final_message=st.booleans(),
            return_token_strs=st.booleans(),
            tools=st.just([WEATHER_TOOL]),
        ),
        st.lists(
            st.builds(lambda role, text: {"role": role, "content": text}, st.sampled_from(["system", "user", "assistant"]), _TEXT),
            min_size=1,
            max_size=3,
        ),
    ),
)


def _detokenize(vocab_size: int) -> st.SearchStrategy[dict[str, Any]]:
    ids = st.integers(0, vocab_size - 1) | st.sampled_from([-1, vocab_size, 2**31])
    return st.builds(lambda common, tokens: {**common, "tokens": tokens}, _maybe(model=_MODEL), st.lists(ids, max_size=12))


def _same_as_server(stack: Stack, endpoint: Endpoint, body: dict[str, Any]) -> None:
    ours = stack.engine.post(endpoint, body)
    status, raw = posted(stack.server, endpoint, body)
    assert (ours.status, drawn_ids_blanked(ours.raw)) == (status, drawn_ids_blanked(raw)), body


_DRAWN = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@_DRAWN
@given(body=_MESSAGES)
def test_drawn_messages_answer_as_the_server(qwen3_stack: Stack, body: dict[str, Any]) -> None:
    _same_as_server(qwen3_stack, Endpoint.RENDER_MESSAGES, body)


@_DRAWN
@given(body=_RESPONSES)
def test_drawn_responses_answer_as_the_server(qwen3_stack: Stack, body: dict[str, Any]) -> None:
    _same_as_server(qwen3_stack, Endpoint.RENDER_RESPONSES, body)


@_DRAWN
@given(body=_TOKENIZE)
def test_drawn_tokenize_answers_as_the_server(qwen3_stack: Stack, body: dict[str, Any]) -> None:
    _same_as_server(qwen3_stack, Endpoint.TOKENIZE, body)


@_DRAWN
@given(data=st.data())
def test_drawn_detokenize_answers_as_the_server(qwen3_stack: Stack, data: st.DataObject) -> None:
    _same_as_server(qwen3_stack, Endpoint.DETOKENIZE, data.draw(_detokenize(qwen3_stack.engine.vocab_size)))


# --- the commands and the library ------------------------------------------------


def _lines(stack: Stack, endpoint: Endpoint) -> list[bytes]:
    """The endpoint's corpus on the sample model as input lines, and a line
    that is not JSON."""
    return [json.dumps(body).encode() for _, body in PREPROCESSING_CORPORA[endpoint](stack.builder)] + [b'{"model": [']


def _expected(stack: Stack, endpoint: Endpoint, lines: list[bytes]) -> list[bytes]:
    return [drawn_ids_blanked(stack.server.post_raw(endpoint, line).content) for line in lines]


def _blanked(output: bytes) -> list[bytes]:
    return [drawn_ids_blanked(line) for line in output.splitlines()]


def test_commands_answer_as_the_server(cli: CliRunner, qwen3_stack: Stack, tmp_path: Path) -> None:
    """`render messages` over a gzipped input with two workers, `render
    responses` from stdin, `tokenize` from Parquet to Parquet, `detokenize`
    over two shards into a directory, stopped by ``--fail-fast`` and
    resumed: line i is the server's answer to line i, exit 1 where some
    failed, each error counted."""
    lines = _lines(qwen3_stack, Endpoint.RENDER_MESSAGES)
    source = tmp_path / "messages.jsonl.gz"
    source.write_bytes(gzip.compress(b"\n".join(lines) + b"\n"))
    out = tmp_path / "messages-out.jsonl"
    result = invoke(cli, "render", "messages", str(source), "-o", str(out), "-j", "2", *SAMPLE_FLAGS)
    assert result.exit_code == ExitStatus.RECORDS_FAILED, result.stderr
    expected = _expected(qwen3_stack, Endpoint.RENDER_MESSAGES, lines)
    assert _blanked(out.read_bytes()) == expected
    errors = sum(not line.startswith(b'{"request_id"') for line in expected)
    assert f"derender: {len(lines)} records, {errors} errors in " in result.stderr

    lines = _lines(qwen3_stack, Endpoint.RENDER_RESPONSES)
    result = invoke(cli, "render", "responses", "-", "-j", "1", *SAMPLE_FLAGS, stdin=b"\n".join(lines) + b"\n")
    assert result.exit_code == ExitStatus.RECORDS_FAILED
    assert _blanked(result.stdout_bytes) == _expected(qwen3_stack, Endpoint.RENDER_RESPONSES, lines)

    lines = _lines(qwen3_stack, Endpoint.TOKENIZE)
    pq.write_table(pa.table({"request": [line.decode() for line in lines]}), tmp_path / "tokenize.parquet")
    result = invoke(cli, "tokenize", str(tmp_path / "tokenize.parquet"), "-o", str(tmp_path / "tokens.parquet"), *SAMPLE_FLAGS)
    assert result.exit_code == ExitStatus.RECORDS_FAILED
    rows = pq.read_table(tmp_path / "tokens.parquet").to_pylist()
    assert [row["response"].encode() for row in rows] == _expected(qwen3_stack, Endpoint.TOKENIZE, lines)

    lines = [json.dumps(body).encode() for name, body in detokenize_bodies(qwen3_stack.builder) if not name.startswith("error-")]
    failing = [*lines[:2], b'{"tokens": "x"}', *lines[2:]]
    for number in (1, 2):
        (tmp_path / f"ids-{number}.jsonl").write_bytes(b"\n".join(failing) + b"\n")
    shards = [str(tmp_path / f"ids-{number}.jsonl") for number in (1, 2)]
    stopped = invoke(cli, "detokenize", *shards, "-o", f"{tmp_path}/text/", "--fail-fast", "-j", "1", *SAMPLE_FLAGS)
    assert stopped.exit_code == ExitStatus.RECORDS_FAILED
    resumed = invoke(cli, "detokenize", *shards, "-o", f"{tmp_path}/text/", "--resume", *SAMPLE_FLAGS)
    assert resumed.exit_code == ExitStatus.RECORDS_FAILED, resumed.stderr
    assert "resumed: " in resumed.stderr
    expected = _expected(qwen3_stack, Endpoint.DETOKENIZE, failing)
    for number in (1, 2):
        assert (tmp_path / "text" / f"ids-{number}.jsonl").read_bytes().splitlines() == expected


def test_installed_command_tokenizes_as_the_server(qwen3_stack: Stack) -> None:
    """The installed `derender`, fresh, as a user runs it."""
    lines = _lines(qwen3_stack, Endpoint.TOKENIZE)
    done = run_cli("tokenize", "-", *SAMPLE_FLAGS, stdin=b"\n".join(lines) + b"\n")
    assert done.returncode == ExitStatus.RECORDS_FAILED, done.stderr.decode()
    assert done.stdout.splitlines() == _expected(qwen3_stack, Endpoint.TOKENIZE, lines)
    assert b"Traceback" not in done.stderr


def test_library_calls(qwen3_stack: Stack) -> None:
    """``render_messages``, ``render_responses``, ``tokenize`` and
    ``detokenize`` return the server's answer, and raise its refusal."""
    engine, server = qwen3_stack.engine, qwen3_stack.server
    ask = [{"role": "user", "content": "Hi"}]
    calls = [
        (engine.render_messages, Endpoint.RENDER_MESSAGES, {"model": "qwen3-sample", "max_tokens": 9, "messages": ask}),
        (
            engine.render_responses,
            Endpoint.RENDER_RESPONSES,
            {"model": "qwen3-sample", "input": [{"role": "user", "content": "Hi"}, CALL], "request_id": "lib"},
        ),
        (engine.tokenize, Endpoint.TOKENIZE, {"model": "qwen3-sample", "prompt": "Hi", "return_token_strs": True}),
        (engine.detokenize, Endpoint.DETOKENIZE, {"model": "qwen3-sample", "tokens": [13048, 0]}),
    ]
    for call, endpoint, request in calls:
        sent = copy.deepcopy(request)
        answer = call(request)
        assert request == sent  # the caller's request is left as it was
        expected = server.client.post(endpoint.path, json=request).json()
        if endpoint is Endpoint.RENDER_MESSAGES:  # an id the request lacks is drawn
            assert answer.pop("request_id").startswith("chatcmpl-")
            expected.pop("request_id")
        assert answer == expected
        with pytest.raises(RenderError) as refused:
            call({**request, "model": "nope"})
        assert refused.value.status == 404
        assert refused.value.body == server.client.post(endpoint.path, json={**request, "model": "nope"}).json()
