"""The render half of the server, offline: `derender render`, the
library's ``render_chat`` / ``render_completion``, prompts rendered for
records that lack them (``--render-prompts``), and the whole loop from
requests to responses.

Every answer is checked against the session's real `vllm launch render`
(conftest's stacks), byte for byte up to the request ids the server draws
at random. Every family's corpus runs in tests/test_families.py.
"""

from __future__ import annotations

import copy
import gzip
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from derender_core import (
    DerenderEngine,
    Endpoint,
    ExitStatus,
    JobSpec,
    RenderConfig,
    RenderError,
    run_job,
)
from derender_core.batch import Job, RecordProcessor
from derender_core.compare import DEFAULT_NORMALIZATION, Observed, compare
from derender_core.parity import Parity, requests_of
from derender_core.prompts import PROMPT_MISSING, rendered_token_ids
from derender_core.records import Record, iter_records
from tests.conftest import ServeStack, Stack, sample_config
from tests.helpers import (
    SAMPLE,
    RenderServer,
    invoke,
    jsonl_answers,
    normalize,
    read_jsonl,
    run_cli,
)
from tests.render_corpus import (
    drawn_ids_blanked,
    mismatches,
    posted,
    render_bodies,
    render_chat_bodies,
    render_completion_bodies,
)
from tests.sample_inputs import Family, SampleBuilder

SAMPLE_FLAGS = ["--config", "sample_data/qwen3.yaml"]


def _server_lines(stack: Stack, endpoint: Endpoint, lines: list[bytes]) -> list[tuple[int, bytes]]:
    """The server's answer to each input line, sent as its raw bytes."""
    answers = []
    for line in lines:
        response = stack.server.post_raw(endpoint, line)
        answers.append((response.status_code, response.content))
    return answers


def _same_lines(output: bytes, expected: list[tuple[int, bytes]]) -> None:
    got = output.splitlines()
    assert len(got) == len(expected)
    for number, (line, (_, raw)) in enumerate(zip(got, expected, strict=True), 1):
        assert drawn_ids_blanked(line) == drawn_ids_blanked(raw), f"line {number}"


def _corpus_lines(stack: Stack, endpoint: Endpoint) -> list[bytes]:
    bodies = render_chat_bodies(stack.builder) if endpoint is Endpoint.RENDER_CHAT else render_completion_bodies(stack.builder)
    return [json.dumps(body).encode() for _, body in bodies] + [b'{"messages": [']


@pytest.mark.parametrize("endpoint", [Endpoint.RENDER_CHAT, Endpoint.RENDER_COMPLETION])
def test_render_engine_answers_as_the_server(stack: Stack, endpoint: Endpoint) -> None:
    """The corpus, successes and errors, on the three session families (all
    families: tests/test_families.py), through the engine's one contract."""
    bodies = [(name, body) for kind, name, body in render_bodies(stack.builder) if kind is endpoint]
    ours = [(name, stack.engine.post(endpoint, body)) for name, body in bodies]
    theirs = [(name, *posted(stack.server, endpoint, body)) for name, body in bodies]
    assert mismatches(ours, theirs) == []
    assert {answer.status for _, answer in ours} >= {200, 400, 404}


def test_render_command_answers_as_the_server(cli: CliRunner, qwen3_stack: Stack, tmp_path: Path) -> None:
    """`derender render chat` over a gzipped input with two workers, and
    `render completion` from stdin: line i is the server's answer to line
    i (a line that is not JSON included), exit 1 for the
    errors among them, each counted in the summary."""
    chat_lines = _corpus_lines(qwen3_stack, Endpoint.RENDER_CHAT)
    source = tmp_path / "requests.jsonl.gz"
    source.write_bytes(gzip.compress(b"\n".join(chat_lines) + b"\n"))
    out = tmp_path / "generate_requests.jsonl"
    result = invoke(cli, "render", "chat", str(source), "-o", str(out), "-j", "2", *SAMPLE_FLAGS)
    assert result.exit_code == ExitStatus.RECORDS_FAILED, result.stderr
    expected = _server_lines(qwen3_stack, Endpoint.RENDER_CHAT, chat_lines)
    _same_lines(out.read_bytes(), expected)
    errors = sum(status != 200 for status, _ in expected)
    assert f"derender: {len(chat_lines)} records, {errors} errors in " in result.stderr
    assert "404 The model `no-such-model` does not exist" in result.stderr

    completion_lines = _corpus_lines(qwen3_stack, Endpoint.RENDER_COMPLETION)
    result = invoke(cli, "render", "completion", "-", "-j", "1", *SAMPLE_FLAGS, stdin=b"\n".join(completion_lines) + b"\n")
    assert result.exit_code == ExitStatus.RECORDS_FAILED
    _same_lines(result.stdout_bytes, _server_lines(qwen3_stack, Endpoint.RENDER_COMPLETION, completion_lines))


def test_render_shards_parquet_and_resume(cli: CliRunner, qwen3_stack: Stack, tmp_path: Path) -> None:
    """Shards to ``-o DIR/``; a Parquet input with a ``request`` column to a
    Parquet output; a run stopped by ``--fail-fast`` and resumed gives the
    whole run's answers."""
    requests = [json.dumps(body["chat_request"]).encode() for body in read_jsonl(SAMPLE / "chat.jsonl")]
    for number in (1, 2):
        (tmp_path / f"part-{number}.jsonl").write_bytes(b"\n".join(requests) + b"\n")
    shards = [str(tmp_path / f"part-{number}.jsonl") for number in (1, 2)]
    result = invoke(cli, "render", "chat", *shards, "-o", f"{tmp_path}/out/", "-j", "2", *SAMPLE_FLAGS)
    assert result.exit_code == 0, result.stderr
    expected = _server_lines(qwen3_stack, Endpoint.RENDER_CHAT, requests)
    for number in (1, 2):
        _same_lines((tmp_path / "out" / f"part-{number}.jsonl").read_bytes(), expected)

    table = pa.table({"request": [line.decode() for line in requests]})
    pq.write_table(table, tmp_path / "requests.parquet")
    result = invoke(cli, "render", "chat", str(tmp_path / "requests.parquet"), "-o", str(tmp_path / "out.parquet"), *SAMPLE_FLAGS)
    assert result.exit_code == 0, result.stderr
    rows = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert [row["record"] for row in rows] == [1, 2, 3, 4]
    _same_lines(b"\n".join(row["response"].encode() for row in rows), expected)

    failing = [*requests[:2], b'{"model": "no-such-model", "messages": []}', *requests[2:]]
    (tmp_path / "failing.jsonl").write_bytes(b"\n".join(failing) + b"\n")
    out = tmp_path / "resumed.jsonl"
    stopped = invoke(cli, "render", "chat", str(tmp_path / "failing.jsonl"), "-o", str(out), "--fail-fast", "-j", "1", *SAMPLE_FLAGS)
    assert stopped.exit_code == ExitStatus.RECORDS_FAILED
    assert len(out.read_bytes().splitlines()) == 3
    resumed = invoke(cli, "render", "chat", str(tmp_path / "failing.jsonl"), "-o", str(out), "--resume", *SAMPLE_FLAGS)
    assert resumed.exit_code == 0, resumed.stderr
    assert "resumed: 3 records were already in the outputs" in resumed.stderr
    _same_lines(out.read_bytes(), _server_lines(qwen3_stack, Endpoint.RENDER_CHAT, failing))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["render", "chat", "sample_data/chat.jsonl", *SAMPLE_FLAGS, "--requests", "x.jsonl"], "No such option: --requests"),
        (["render", "chat", "sample_data/chat.jsonl", *SAMPLE_FLAGS, "--render-prompts"], "No such option"),
        (["render", "chat", "sample_data/chat.jsonl", "sample_data/completion.jsonl", *SAMPLE_FLAGS], "2 inputs need an output directory"),
        (["render", "completion", "sample_data/chat.jsonl", "--resume", *SAMPLE_FLAGS], "--resume continues an output file"),
        (["render", "chat", "absent.jsonl", *SAMPLE_FLAGS], "cannot open input absent.jsonl"),
        (["stream", "sample_data/stream.jsonl", "--endpoint", "render-chat", *SAMPLE_FLAGS], "render-chat"),
    ],
)
def test_render_usage_errors_exit_2(cli: CliRunner, args: list[str], message: str) -> None:
    result = invoke(cli, *args)
    assert result.exit_code == ExitStatus.USAGE
    assert message in result.stderr
    assert result.stdout_bytes == b""


def test_render_as_a_user_runs_it(qwen3_stack: Stack) -> None:
    """The installed command, fresh: the sample's requests in, what the
    server renders out, and the chat template's own flags in vLLM's
    spelling reach the renderer."""
    requests = b"".join(orjson.dumps(body["chat_request"]) + b"\n" for body in read_jsonl(SAMPLE / "chat.jsonl"))
    done = run_cli("render", "chat", "-", *SAMPLE_FLAGS, "--default-chat-template-kwargs", '{"enable_thinking": false}', stdin=requests)
    assert done.returncode == 0, done.stderr.decode()
    rendered = [json.loads(line) for line in done.stdout.splitlines()]
    think_start, think_end = qwen3_stack.builder.tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    # Thinking off: the template closes an empty reasoning block in the prompt.
    assert all(r["token_ids"][-4:-1] == [think_start, 271, think_end] for r in rendered), rendered[0]["token_ids"][-6:]
    assert [r["request_id"][:9] for r in rendered] == ["chatcmpl-"] * 4
    assert b"derender: 4 records, 0 errors in " in done.stderr


# --- the library ------------------------------------------------------------


def test_library_render_chat_and_completion(qwen3_stack: Stack) -> None:
    engine, server = qwen3_stack.engine, qwen3_stack.server
    request = {"model": "qwen3-sample", "messages": [{"role": "user", "content": "Hi"}], "request_id": "lib"}
    assert engine.render_chat(request) == server.client.post(Endpoint.RENDER_CHAT.path, json=request).json()
    completion = {"model": "qwen3-sample", "prompt": ["Hello", "World"], "request_id": "lib"}
    rendered = engine.render_completion(completion)
    assert rendered == server.client.post(Endpoint.RENDER_COMPLETION.path, json=completion).json()
    assert [r["request_id"] for r in rendered] == ["cmpl-lib-0", "cmpl-lib-1"]
    with pytest.raises(RenderError) as refused:
        engine.render_chat({**request, "model": "nope"})
    assert refused.value.status == 404
    assert refused.value.body == server.client.post(Endpoint.RENDER_CHAT.path, json={**request, "model": "nope"}).json()
    with pytest.raises(RenderError) as invalid:
        engine.render_completion({"model": "qwen3-sample"})
    assert invalid.value.status == 400 and "prompt" in invalid.value.message


def test_drawn_request_ids_look_like_the_servers(qwen3_stack: Stack) -> None:
    """A request without an id gets one drawn as the server draws it: fresh
    each time, 16 hex digits after ``chatcmpl-``."""
    request = {"model": "qwen3-sample", "messages": [{"role": "user", "content": "Hi"}]}
    ids = {qwen3_stack.engine.render_chat(request)["request_id"] for _ in range(3)}
    served = qwen3_stack.server.client.post(Endpoint.RENDER_CHAT.path, json=request).json()["request_id"]
    assert len(ids) == 3
    assert all(drawn_ids_blanked(orjson.dumps({"request_id": i})) == b'{"request_id":"chatcmpl-<drawn>"}' for i in {*ids, served})


# --- prompts rendered for records that lack them -----------------------------


def _without_prompts(body: Any) -> Any:
    body = copy.deepcopy(body)
    body.pop("prompt_token_ids", None)
    body.pop("prompt_tokens", None)
    return body


def _run(stack: Stack, job: Job, bodies: list[Any]) -> tuple[list[Any], Any]:
    processor = RecordProcessor(stack.engine.in_mode(live=job.stream), job)
    outcomes = [processor.process(Record(n, n, body)) for n, body in enumerate(bodies, 1)]
    return [orjson.loads(o.answer.raw) for o in outcomes], outcomes


@pytest.mark.parametrize(("source", "endpoint", "stream"), [
    ("chat.jsonl", Endpoint.CHAT, False), ("completion.jsonl", Endpoint.COMPLETION, False), ("stream.jsonl", Endpoint.CHAT, True),
])  # fmt: skip
def test_render_prompts_gives_the_answers_of_the_real_prompts(
    qwen3_stack: Stack, source: str, endpoint: Endpoint, stream: bool
) -> None:
    """The sample without its prompt ids, derendered with
    ``--render-prompts``, answers as the sample itself (its ids are the
    render server's). Without the flag, every chat record of this
    parser-configured model carries the notice; the parser streams are
    refused outright (the server requires their prompt)."""
    bodies = read_jsonl(SAMPLE / source)
    real, _ = _run(qwen3_stack, Job(endpoint, stream=stream), bodies)
    bare = [_without_prompts(body) for body in bodies]
    rendered, outcomes = _run(qwen3_stack, Job(endpoint, stream=stream, render_prompts=True), bare)
    assert normalize(rendered) == normalize(real)
    assert not any(PROMPT_MISSING in outcome.logs for outcome in outcomes)
    unseeded, outcomes = _run(qwen3_stack, Job(endpoint, stream=stream), bare)
    noticed = [PROMPT_MISSING in outcome.logs for outcome in outcomes]
    # Qwen3's byte-level tokenizer has no leading-space marker: only its
    # parsers read the prompt, and completions have none.
    assert noticed == [endpoint is Endpoint.CHAT] * len(bodies)
    if stream:
        assert {answer["error"]["message"][:32] for answer in unseeded} == {"prompt_token_ids is required whe"}


def test_render_prompts_through_a_requests_join_and_the_summary(cli: CliRunner, tmp_path: Path) -> None:
    """A raw generate capture joined with requests that lack prompt ids:
    with the flag, the answers of the requests with their ids; without it,
    the summary says how many records went without and what the flag does
    (`Summary.prompts_missing` for code)."""
    requests = tmp_path / "requests.jsonl"
    requests.write_bytes(b"".join(orjson.dumps(_without_prompts(r)) + b"\n" for r in read_jsonl(SAMPLE / "requests.jsonl")))
    capture = "sample_data/generate_capture.sse"
    real = invoke(cli, "stream", capture, "--requests", "sample_data/requests.jsonl", *SAMPLE_FLAGS)
    rendered = invoke(cli, "stream", capture, "--requests", str(requests), "--render-prompts", *SAMPLE_FLAGS)
    assert rendered.exit_code == real.exit_code == 0, rendered.stderr
    assert normalize(read_lines(rendered.stdout_bytes)) == normalize(read_lines(real.stdout_bytes))
    assert "without prompt_token_ids" not in rendered.stderr

    bare = invoke(cli, "stream", capture, "--requests", str(requests), *SAMPLE_FLAGS)
    assert bare.exit_code == ExitStatus.RECORDS_FAILED
    calls = len(read_lines(real.stdout_bytes))
    assert f"derender: {calls} records were derendered without prompt_token_ids" in bare.stderr
    assert "--render-prompts renders them" in bare.stderr

    chat = tmp_path / "chat.jsonl"
    chat.write_bytes(b"".join(orjson.dumps(_without_prompts(b)) + b"\n" for b in read_jsonl(SAMPLE / "chat.jsonl")))
    summary = run_job(sample_config(), JobSpec([str(chat)], str(tmp_path / "answers.jsonl"), workers=1))
    assert (summary.return_code, summary.prompts_missing) == (0, 4)
    assert summary.reports[0][1].prompts_missing == 4


def read_lines(data: bytes) -> list[Any]:
    return [json.loads(line) for line in data.splitlines()]


def test_render_prompts_answers_a_refused_render_with_the_render_error(qwen3_stack: Stack) -> None:
    """A request the renderer refuses (an unknown model) gets the render
    endpoint's own answer, and the summary says it came from rendering."""
    body = _without_prompts(read_jsonl(SAMPLE / "chat.jsonl")[0])
    body["chat_request"]["model"] = "no-such-model"
    answers, outcomes = _run(qwen3_stack, Job(Endpoint.CHAT, render_prompts=True), [body])
    expected = qwen3_stack.server.post(Endpoint.RENDER_CHAT, body["chat_request"])
    assert (outcomes[0].answer.status, answers[0]) == (404, expected.json())
    assert outcomes[0].detail == "rendering its prompt (--render-prompts)"


def test_parity_reports_prompt_ids_that_are_not_the_rendering(qwen3_stack: Stack) -> None:
    """`derender parity`'s prompt check: the sample's prompts are their
    rendering (no finding); a record whose ids lost a token is reported,
    field ``prompt_token_ids`` between ``record`` and ``render``."""
    engines = {"oneshot": qwen3_stack.engine.in_mode(live=False), "live": qwen3_stack.engine.in_mode(live=True)}
    parity = Parity(engines, Endpoint.CHAT)
    lines = (SAMPLE / "chat.jsonl").read_bytes()
    requests = list(requests_of(iter_records(io.BytesIO(lines)), Endpoint.CHAT, stream=False, requests=None, chunkings=[]))
    assert [d for r in requests for d in parity.run(r) if d.field == "prompt_token_ids"] == []

    body = read_jsonl(SAMPLE / "chat.jsonl")[0]
    body["prompt_token_ids"] = body["prompt_token_ids"][:-1]
    [request] = requests_of([Record(1, 1, body)], Endpoint.CHAT, stream=False, requests=None, chunkings=[])
    [found] = [d for d in parity.run(request) if d.field == "prompt_token_ids"]
    ids = read_jsonl(SAMPLE / "chat.jsonl")[0]["prompt_token_ids"]
    assert (found.left, found.right, found.request_id) == ("record", "render", "chat-tool-call")
    assert found.left_value == f"{len(ids) - 1} ids, from id {len(ids) - 1}: []"
    assert found.right_value == f"{len(ids)} ids, from id {len(ids) - 1}: {ids[-1:]}"
    assert [d for d in Parity(engines, Endpoint.CHAT, ignore=["prompt_token_ids"]).run(request) if d.field == "prompt_token_ids"] == []


# --- the whole loop -----------------------------------------------------------


def _fixed_ids_engine(generate_requests: list[dict[str, Any]], outputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stand-in for a token-in engine: it answers each GenerateRequest
    with fixed output ids (the sample's), echoing its request id, as
    ``/inference/v1/generate`` answers."""
    responses = []
    for generate_request, output in zip(generate_requests, outputs, strict=True):
        assert generate_request["token_ids"], "the engine needs the rendered prompt"
        responses.append({**output, "request_id": generate_request["request_id"]})
    return responses


def test_the_whole_loop_offline(qwen3_stack: Stack, qwen3_serve: ServeStack, tmp_path: Path) -> None:
    """Requests -> `derender render` -> GenerateRequests -> an engine ->
    GenerateResponses -> `derender chat --requests` -> responses: the
    sample's answers, and serve's for the same tokens but where serve
    writes its own (a system fingerprint; the ``chatcmpl-`` id serve makes
    of the request id; the reasoning token count in usage)."""
    sample = read_jsonl(SAMPLE / "chat.jsonl")
    requests = tmp_path / "requests.jsonl"
    requests.write_bytes(b"".join(orjson.dumps({**body["chat_request"], "request_id": body["generate_response"]["request_id"]}) + b"\n" for body in sample))
    warm = lambda config: qwen3_stack.engine if config == qwen3_stack.config else None  # noqa: E731
    config = qwen3_stack.config
    summary = run_job(config, JobSpec([str(requests)], str(tmp_path / "generate_requests.jsonl"), endpoint=Endpoint.RENDER_CHAT, workers=1), warm=warm)
    assert summary.return_code == 0
    generate_requests = read_jsonl(tmp_path / "generate_requests.jsonl")
    # The prompts are those the server rendered for the sample.
    assert [g["token_ids"] for g in generate_requests] == [body["prompt_token_ids"] for body in sample]

    responses = _fixed_ids_engine(generate_requests, [body["generate_response"] for body in sample])
    (tmp_path / "generate_responses.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in responses))
    # The --requests join: each rendered request's id, the request, the prompt.
    joined = [
        {"request_id": g["request_id"], "chat_request": json.loads(line), "prompt_token_ids": g["token_ids"]}
        for g, line in zip(generate_requests, requests.read_bytes().splitlines(), strict=True)
    ]
    (tmp_path / "joined.jsonl").write_bytes(b"".join(orjson.dumps(j) + b"\n" for j in joined))
    spec = JobSpec([str(tmp_path / "generate_responses.jsonl")], str(tmp_path / "responses.jsonl"), requests=str(tmp_path / "joined.jsonl"), workers=1)
    assert run_job(config, spec, warm=warm).return_code == 0
    final = read_jsonl(tmp_path / "responses.jsonl")

    direct, _ = jsonl_answers(qwen3_stack.engine, Job(Endpoint.CHAT), [orjson.dumps(body) for body in sample])
    ids = [body["generate_response"]["request_id"] for body in sample]
    assert normalize([{**a, "id": i} for a, i in zip(final, ids, strict=True)]) == normalize(direct)

    serve_bodies = [
        {"generate_response": r, "chat_request": j["chat_request"], "prompt_token_ids": j["prompt_token_ids"], "prompt_tokens": len(j["prompt_token_ids"])}
        for r, j in zip(responses, joined, strict=True)
    ]
    differing = set()
    for ours, body in zip(final, serve_bodies, strict=True):
        served = qwen3_serve.engine.post(Endpoint.CHAT, body)
        assert served.ok, served.raw
        found = compare("derender", Observed(response=ours), "serve", Observed(response=served.body),
                        request_id=body["generate_response"]["request_id"], ignore=(), normalization=DEFAULT_NORMALIZATION)  # fmt: skip
        differing |= {d.field for d in found}
    assert differing <= {"system_fingerprint", "usage"}, differing

    # --flavor serve with --render-prompts: serve renders prompts itself;
    # the ids rendered first are the ones it renders.
    real = {**serve_bodies[0], "generate_response": {**serve_bodies[0]["generate_response"], "request_id": "real"}}
    bare = {**_without_prompts(real), "generate_response": {**real["generate_response"], "request_id": "bare"}}
    outcome = RecordProcessor(qwen3_serve.engine, Job(Endpoint.CHAT, render_prompts=True)).process(Record(1, 1, bare))
    served = qwen3_serve.engine.post(Endpoint.CHAT, real)
    assert outcome.answer.ok, outcome.answer.raw
    assert normalize({**outcome.answer.body, "id": ""}) == normalize({**served.body, "id": ""})


# --- a Metaspace tokenizer: where the prompt changes the answer ---------------


@pytest.fixture(scope="module")
def metaspace(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Mistral 7B v0.1's SentencePiece tokenizer (Metaspace, its decoder
    strips a leading space), with its engine and a real render server."""
    from tests.model_factory import build_mistral_v1_sentencepiece

    model_dir = build_mistral_v1_sentencepiece(tmp_path_factory.mktemp("models") / "mistral_v1")
    config = RenderConfig(model=str(model_dir), served_model_name=("mistral-v1-test",))
    server = RenderServer(config, tmp_path_factory.mktemp("logs") / "mistral-v1-server.log", wait=False)
    try:
        engine = DerenderEngine.build(config)
        server.wait_until_ready()
    except BaseException:
        server.stop()
        raise
    family = Family(model_dir, "mistral-v1-test", eos_id=2, reasoning=None, tool_call="", thinking_off={})
    try:
        yield Stack("mistral_v1", config, SampleBuilder(family), engine, server)
    finally:
        engine.close()
        server.stop()


def test_metaspace_render_matches_server(metaspace: Stack) -> None:
    bodies = render_bodies(metaspace.builder)
    ours = [(f"{endpoint.value} {name}", metaspace.engine.post(endpoint, body)) for endpoint, name, body in bodies]
    theirs = [(f"{endpoint.value} {name}", *posted(metaspace.server, endpoint, body)) for endpoint, name, body in bodies]
    assert mismatches(ours, theirs) == []
    assert metaspace.engine.prompt_matters(Endpoint.COMPLETION) and metaspace.engine.prompt_matters(Endpoint.CHAT)


def test_metaspace_answers_lose_their_first_space_without_the_prompt(metaspace: Stack) -> None:
    """The family where leaving ``--render-prompts`` off changes the answer:
    with the prompt's ids the first output token is decoded after the
    prompt's tail and keeps its leading space, as `vllm serve` sends it;
    without them it is decoded alone and the decoder strips it. The server
    answers both bodies the same way derender does; the flag gives the
    first answer for the second body."""
    b, name = metaspace.builder, "mistral-v1-test"
    output = b.encode("sunny today.") + [2]
    completion_request = {"model": name, "prompt": "The weather in Paris is"}
    chat_request = {"model": name, "messages": [{"role": "user", "content": "How is the weather in Paris?"}]}
    cases = [
        (Endpoint.COMPLETION, "completion_request", completion_request, lambda a: a["choices"][0]["text"]),
        (Endpoint.CHAT, "chat_request", chat_request, lambda a: a["choices"][0]["message"]["content"]),
    ]
    for endpoint, key, request, text in cases:
        [prompt] = rendered_token_ids(metaspace.engine.post(endpoint.render, request))
        response = {"request_id": "sunny", "choices": [{"index": 0, "token_ids": output, "finish_reason": "stop"}]}
        if endpoint is Endpoint.CHAT:
            real = {"generate_response": response, "prompt_token_ids": prompt, "prompt_tokens": len(prompt), key: request}
        else:
            real = {"generate_responses": [response], "prompt_token_ids": [prompt], "prompt_tokens": [len(prompt)], key: request}
        bare = _without_prompts(real)
        with_ids, without_ids = (metaspace.server.post(endpoint, body).json() for body in (real, bare))
        assert (text(with_ids), text(without_ids)) == (" sunny today.", "sunny today.")
        answers, outcomes = _run(metaspace, Job(endpoint), [real, bare])
        assert normalize(answers) == normalize([with_ids, without_ids])
        assert [PROMPT_MISSING in outcome.logs for outcome in outcomes] == [False, True]
        rendered, _ = _run(metaspace, Job(endpoint, render_prompts=True), [bare])
        assert normalize(rendered) == normalize([with_ids])
