"""The code-shaped API (`derender_core.api`): rollouts in, responses out,
the same answers as the endpoint's bytes; the ways in the library docs show
(a list of rollouts, Hugging Face ``datasets`` with one engine per process).
The Ray Data way is `test_ray.py::test_map_batches_with_a_shipped_model_answers_as_one_process`."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import weakref
from typing import Any

import pytest

from derender_core import DerenderEngine, Endpoint, RenderError, engine_for, release_engines
from tests.conftest import Stack, sample_config
from tests.helpers import normalize
from tests.sample_inputs import chat_bodies, completion_bodies


def _rollouts(stack: Stack) -> list[tuple[dict[str, Any], dict[str, Any], list[int] | None]]:
    return [
        (body["generate_response"], body["chat_request"], body.get("prompt_token_ids"))
        for body in chat_bodies(stack.builder)
        if "chat_request" in body and "generate_response" in body
    ]


def test_chat_gives_the_endpoints_answer(qwen3_stack: Stack) -> None:
    engine = qwen3_stack.engine
    rollouts = _rollouts(qwen3_stack)
    assert len(rollouts) >= 4
    for output, request, prompt in rollouts:
        body = {"generate_response": output, "chat_request": request}
        if prompt is not None:
            body.update(prompt_token_ids=prompt, prompt_tokens=len(prompt))
        expected = engine.post(Endpoint.CHAT, body)
        if expected.ok:
            assert normalize(engine.chat(output, request, prompt)) == normalize(expected.body)
        else:
            with pytest.raises(RenderError) as refused:
                engine.chat(output, request, prompt)
            assert (refused.value.status, refused.value.message) == (expected.status, expected.error_message)


def test_chat_from_token_ids_alone(qwen3_stack: Stack) -> None:
    """A rollout's ids, request and prompt: the stop token is dropped and
    the reasoning, content and tool call split, as the server does."""
    b, engine = qwen3_stack.builder, qwen3_stack.engine
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    request = b.chat_request(messages)
    text = b.answer("It is sunny.", reasoning="The user wants the weather.")
    ids = b.encode(text) + [b.family.eos_id]
    prompt = b.prompt_ids(messages)

    answer = engine.chat(ids, request, prompt)

    choice = answer["choices"][0]
    assert choice["message"]["reasoning"].strip() == "The user wants the weather."
    assert choice["message"]["content"].strip() == "It is sunny."
    assert choice["finish_reason"] == "stop"
    usage = answer["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(prompt), len(ids))
    cut = engine.chat(ids[:-1], request, prompt, finish_reason="length")
    assert cut["choices"][0]["finish_reason"] == "length"
    assert cut["choices"][0]["message"]["content"].strip() == "It is sunny."


def test_refusals_raise_with_the_servers_status_and_message(qwen3_stack: Stack) -> None:
    b, engine = qwen3_stack.builder, qwen3_stack.engine
    request = b.chat_request([{"role": "user", "content": "hi"}])
    out_of_vocabulary = engine.vocab_size + 5

    with pytest.raises(RenderError) as refused:
        engine.chat([out_of_vocabulary], request)
    assert refused.value.status == 400
    assert "out of vocabulary" in refused.value.message
    # Lenient: the server's own answer, the id decoded as nothing.
    lenient = engine.chat([out_of_vocabulary], request, lenient=True)
    served = engine.post(Endpoint.CHAT, {"generate_response": {"request_id": "derender", "choices": [
        {"index": 0, "token_ids": [out_of_vocabulary], "finish_reason": "stop"}]}, "chat_request": request})
    assert served.ok and normalize(lenient) == normalize(served.body)

    with pytest.raises(RenderError) as refused:
        engine.chat([], request)
    assert refused.value.status == 400
    assert refused.value.message == refused.value.body["error"]["message"]

    answers = engine.chat_batch(
        [(b.encode("Fine."), request, None), ([out_of_vocabulary], request, None), (b.encode("Good."), request, None)],
        finish_reason="length",
        return_exceptions=True,
    )
    assert [type(answer).__name__ for answer in answers] == ["dict", "RenderError", "dict"]
    assert normalize(answers[2]) == normalize(engine.chat(b.encode("Good."), request, finish_reason="length"))
    with pytest.raises(RenderError):
        engine.chat_batch([([out_of_vocabulary], request, None)])


def test_completion_gives_the_endpoints_answer(qwen3_stack: Stack) -> None:
    engine = qwen3_stack.engine
    checked = 0
    for body in completion_bodies(qwen3_stack.builder):
        responses = body.get("generate_responses")
        if not isinstance(responses, list) or len(responses) != 1 or "completion_request" not in body:
            continue
        prompts = body.get("prompt_token_ids")
        prompt = prompts[0] if isinstance(prompts, list) else None
        single = {"generate_responses": responses, "completion_request": body["completion_request"]}
        if prompt is not None:
            single.update(prompt_token_ids=[prompt], prompt_tokens=[len(prompt)])
        expected = engine.post(Endpoint.COMPLETION, single)
        if not expected.ok:
            continue
        got = engine.completion(responses[0], body["completion_request"], prompt)
        assert normalize(got) == normalize(expected.body)
        checked += 1
    assert checked >= 3
    batch = engine.completion_batch([(r[0], r[1], r[2]) for r in [(responses[0], body["completion_request"], prompt)]])
    assert normalize(batch[0]) == normalize(got)


@pytest.mark.parametrize("fast_paths", ["on", "off"])
def test_datasets_map_with_one_engine_per_process(
    qwen3_stack: Stack, request: pytest.FixtureRequest, fast_paths: str
) -> None:
    """The documented `Dataset.map(num_proc=2)` way: the engine built once
    in the parent, the forked workers answer with it, and so does the
    parent after them. With the fast paths off (vLLM's own code and thread
    pool, as on a release they were not proven on), the workers once waited
    forever on their copy of the pool, then, fixed, the parent did: the
    workers' exit closed the event loop whose epoll they shared with it."""
    datasets = pytest.importorskip("datasets")
    # Set and put back by hand: Dataset.map(num_proc=...) leaves a new
    # os.environ object behind, so monkeypatch's undo would clear the
    # setting from the old one and leave it on for every later test.
    before = os.environ.get("DERENDER_FAST_PATHS")
    os.environ["DERENDER_FAST_PATHS"] = fast_paths

    def put_back() -> None:
        if before is None:
            os.environ.pop("DERENDER_FAST_PATHS", None)
        else:
            os.environ["DERENDER_FAST_PATHS"] = before

    request.addfinalizer(put_back)
    release_engines()
    rollouts = _rollouts(qwen3_stack)
    rows = [
        {"output": output, "request": request, "prompt": prompt}
        for output, request, prompt in rollouts
        if len(output["choices"]) == 1
    ]
    config = sample_config()
    engine_for(config)  # built here: Dataset.map's workers are forked from this process
    request.addfinalizer(release_engines)

    def derender(row: dict[str, Any]) -> dict[str, Any]:
        # Messages differ in shape (tool calls or not): kept as JSON text.
        try:
            answer = engine_for(config).chat(row["output"], row["request"], row["prompt"])
        except RenderError as exc:
            return {"message": None, "error": exc.message}
        return {"message": json.dumps(answer["choices"][0]["message"]), "error": None}

    mapped = datasets.Dataset.from_list(rows).map(derender, num_proc=2)

    expected = [derender(row) for row in rows]
    def messages(rows: Any) -> list[Any]:
        return [normalize(json.loads(row["message"])) if row["message"] else None for row in rows]

    assert messages(mapped) == messages(expected)
    assert [row["error"] for row in mapped] == [e["error"] for e in expected]
    assert sum(row["message"] is not None for row in mapped) >= 3


def test_post_takes_an_endpoint_by_its_name_and_refuses_an_unknown_one(qwen3_stack: Stack) -> None:
    """`Endpoint` is a str enum: "chat" and "completion" name the endpoints
    wherever one is taken, and anything else is a ValueError naming them,
    not a 500 for the record."""
    engine = qwen3_stack.engine
    chat = next(body for body in chat_bodies(qwen3_stack.builder) if engine.post(Endpoint.CHAT, body).ok)
    completion = next(body for body in completion_bodies(qwen3_stack.builder) if engine.post(Endpoint.COMPLETION, body).ok)
    for name, body in (("chat", chat), ("completion", completion)):
        by_name, by_member = engine.post(name, body), engine.post(Endpoint(name), body)
        assert by_name.status == by_member.status == 200, by_name.raw[:300]
        assert normalize(by_name.body) == normalize(by_member.body)
    with pytest.raises(ValueError, match="unknown endpoint 'nope': 'chat', 'completion'"):
        engine.post("nope", chat)
    with pytest.raises(ValueError, match="unknown endpoint"):
        engine.in_mode(live=True).post("/v1/chat/completions/derender", chat)


@pytest.mark.parametrize("kind", [str, bytes, bytearray, memoryview])
def test_post_refuses_a_line_not_yet_parsed(qwen3_stack: Stack, kind: type) -> None:
    """`post` takes the parsed body: the JSONL line itself, as text or
    bytes, is a TypeError that says so, not the server's 400 about a body
    that is a string (``model_attributes_type``)."""
    from derender_core.protocol import JsonString

    body = next(iter(chat_bodies(qwen3_stack.builder)))
    line = json.dumps(body)
    given = line if kind is str else kind(line.encode())
    for engine in (qwen3_stack.engine, qwen3_stack.engine.in_mode(live=False, decode="reference")):
        for endpoint in (Endpoint.CHAT, Endpoint.RENDER_CHAT):
            with pytest.raises(TypeError, match=r"post takes the body parsed from JSON \(a dict: json\.loads\(line\)\)"):
                engine.post(endpoint, given)
    assert engine.post(Endpoint.CHAT, json.loads(line)).ok
    # A body that is a JSON string, parsed, is answered as the server does.
    served = qwen3_stack.server.post_raw(Endpoint.CHAT, json.dumps(line).encode())
    answer = qwen3_stack.engine.post(Endpoint.CHAT, JsonString(line))
    assert (answer.status, answer.body) == (served.status_code, served.json())
    assert "model_attributes_type" in answer.error_message


def test_a_line_that_is_a_json_string_is_answered_as_the_server_does(qwen3_stack: Stack, tmp_path: Any) -> None:
    """Such lines reach `post` as `JsonString`s: derender's answers stay the
    server's, in process and from workers."""
    from tests.helpers import run_cli

    lines = [json.dumps("hello"), json.dumps(json.dumps(next(iter(chat_bodies(qwen3_stack.builder)))))]
    path = tmp_path / "strings.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    served = [qwen3_stack.server.post_raw(Endpoint.CHAT, line.encode()).json() for line in lines]
    for workers in ("1", "2"):
        done = run_cli("chat", str(path), "--config", "sample_data/qwen3.yaml", "-q", "-j", workers, env={"DERENDER_NO_SERVER": "1"})
        assert done.returncode == 1, done.stderr.decode()
        assert [json.loads(line) for line in done.stdout.splitlines()] == served


FORKED_FROM_A_USED_ENGINE = """
import json, sys
from derender_core import DerenderEngine, Endpoint, JobSpec, RenderConfig, run_job

config = RenderConfig.from_yaml("sample_data/qwen3.yaml")
engine = DerenderEngine.build(config)
with open(sys.argv[1], "rb") as lines:
    first = json.loads(next(lines))
assert engine.post(Endpoint.CHAT, first).ok  # vLLM's pool, if it has one, now has threads
spec = JobSpec([sys.argv[1]], sys.argv[2], workers=2)
print(run_job(config, spec, warm=lambda asked: engine if asked == config else None).return_code)
"""


@pytest.mark.parametrize("fast_paths", ["on", "off"])
def test_workers_forked_from_a_used_engine_answer_as_the_server(qwen3_stack: Stack, tmp_path: Any, fast_paths: str) -> None:
    """A library user's engine, used, then handed to a job's forked workers
    (`run_job`'s ``warm``). Where derender runs vLLM's own code (a release
    the start-up was not proven on, or ``DERENDER_FAST_PATHS=off``), the
    renderer's work runs on vLLM's thread pool, and the fork copies that
    pool without its threads: each worker's first call once waited forever.
    The workers answer, and the answers are the server's."""
    from tests.helpers import REPO, SAMPLE, offline_env, read_jsonl

    out = tmp_path / "out.jsonl"
    env = offline_env(DERENDER_FAST_PATHS=fast_paths)
    done = subprocess.run(
        [sys.executable, "-c", FORKED_FROM_A_USED_ENGINE, str(SAMPLE / "chat.jsonl"), str(out)],
        capture_output=True, env=env, cwd=REPO, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert done.stdout.decode().split() == ["0"]
    served = [qwen3_stack.server.post(Endpoint.CHAT, body).json() for body in read_jsonl(SAMPLE / "chat.jsonl")]
    assert normalize(read_jsonl(out)) == normalize(served)


def test_a_closed_engine_goes_with_its_stack(qwen3_stack: Stack) -> None:
    """An engine closed and dropped takes its stack with it (vLLM's serving
    objects, the derenderer and its token tables): a process that builds
    engine after engine, for one model or many (a library loop, this
    suite), keeps only the live ones. A memo keyed by the stack (the fast
    decode's one-shot handlers) used to hold every one used."""
    body = next(iter(chat_bodies(qwen3_stack.builder)))

    def used_and_closed(mode: dict[str, Any]) -> weakref.ref[Any]:
        engine = DerenderEngine.build(qwen3_stack.config)
        assert engine.in_mode(**mode).post(Endpoint.CHAT, json.loads(json.dumps(body))).ok
        stack = weakref.ref(engine._serving)
        engine.close()
        return stack

    stacks = [used_and_closed(mode) for mode in ({}, {"live": True}, {"decode": "reference"})]
    gc.collect()
    assert [stack() for stack in stacks] == [None, None, None]
