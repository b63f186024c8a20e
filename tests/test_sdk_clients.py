"""Which client reads which `--flavor`: derender's real output, read by the
real `openai` SDK (the one vLLM installs).

Each flavor's output is made as `derender` makes it (`run_job`, the CLI's
job) from the bundled sample, then served to the SDK through an httpx
`MockTransport` that answers the SDK's request with those bytes, so the SDK
parses them as it parses a server's. What docs/streams.md and
docs/formats.md claim, held here:

- one-shot output, both flavors: `create()` reads every line, field for
  field (chat and completion);
- SSE, both flavors: `create(stream=True)` reads every event, field for
  field (chat and completion);
- the stream helper, `client.chat.completions.stream(...)`, reads serve's
  SSE (`--flavor serve`), tool calls included, but not the derender
  flavor's once a tool call streams: the derender endpoint's continuation
  deltas carry ``"type": null``, on which the helper asserts;
- JSONL: not an SDK format. Its chunks are the SSE events, value for
  value (derender: one ``chunk`` per call; serve: the ``chunks`` each call
  sent), each a chunk the SDK's own model takes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from openai.types.chat import ChatCompletionChunk
from openai.types.completion import Completion

from derender_core import Endpoint, JobSpec, run_job
from derender_core.parity import Chunking, stream_bodies
from tests.conftest import sample_config
from tests.helpers import SAMPLE, normalize, transcript_name

FLAVORS = ("derender", "serve")
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOL_CALL_STREAM = "stream-tool-call"


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Every output the tests read, in both flavors, as `derender` writes
    them: one-shot chat and completion, chat and completion streams as SSE
    (a file per request) and as JSONL."""
    out = tmp_path_factory.mktemp("made")
    completion_stream = out / "completion-stream.jsonl"
    with completion_stream.open("wb") as sink:
        for line in (SAMPLE / "completion.jsonl").read_bytes().splitlines():
            body = orjson.loads(line)
            # One prompt, no stop strings (the streaming derender endpoint
            # refuses those).
            if len(body["generate_responses"]) == 1 and "stop" not in body["completion_request"]:
                for call in stream_bodies(body, Endpoint.COMPLETION, Chunking(2)):
                    sink.write(orjson.dumps(call) + b"\n")
    config = sample_config()
    chat, completion, stream = (str(SAMPLE / name) for name in ("chat.jsonl", "completion.jsonl", "stream.jsonl"))
    for flavor in FLAVORS:
        same = {"flavor": flavor, "workers": 1}
        jobs = [
            JobSpec([chat], f"{out}/{flavor}-chat.jsonl", **same),
            JobSpec([completion], f"{out}/{flavor}-completion.jsonl", endpoint=Endpoint.COMPLETION, **same),
            JobSpec([stream], f"{out}/{flavor}-chat-sse/", stream_format="sse", **same),
            JobSpec([stream], f"{out}/{flavor}-chat-stream.jsonl", stream_format="jsonl", **same),
            JobSpec(
                [str(completion_stream)], f"{out}/{flavor}-completion-sse/", endpoint=Endpoint.COMPLETION,
                stream_format="sse", **same,
            ),  # fmt: skip
        ]
        for spec in jobs:
            # Serve's completion handler refuses a record of two prompts
            # (an error line, which no SDK call reads): everything else is read.
            assert run_job(config, spec).total.errors <= (1 if spec.endpoint is Endpoint.COMPLETION else 0), spec
    yield out


def sdk_reading(answer: bytes, *, sse: bool, path: str) -> openai.OpenAI:
    """An SDK client whose every request is answered with `answer`, as a
    server at ``/v1`` would send it; the request must be for `path`."""

    def respond(request: httpx.Request) -> httpx.Response:
        assert request.url.path == f"/v1{path}"
        assert json.loads(request.content).get("stream", False) is sse
        content_type = "text/event-stream" if sse else "application/json"
        return httpx.Response(200, content=answer, headers={"content-type": content_type})

    transport = httpx.MockTransport(respond)
    return openai.OpenAI(
        api_key="none", base_url="http://127.0.0.1:1/v1", http_client=httpx.Client(transport=transport), max_retries=0
    )


def sse_events(transcript: bytes) -> list[bytes]:
    """The JSON of each ``data:`` event of one transcript, which must end in
    ``[DONE]``."""
    events = transcript.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    assert all(event.startswith(b"data: {") for event in events[:-2])
    return [event.removeprefix(b"data: ") for event in events[:-2]]


def transcripts(directory: Path) -> dict[str, bytes]:
    # Each transcript's file, by the request id its name was made from.
    names = {transcript_name(rid): rid for rid in ("stream-n2", "stream-speculative-unicode", "stream-tool-call")}
    found = {names.get(path.name, path.stem): path.read_bytes() for path in sorted(directory.iterdir())}
    assert found
    return found


@pytest.mark.parametrize("flavor", FLAVORS)
def test_one_shot_answers_are_read_by_create(made: Path, flavor: str) -> None:
    """Chat and completion, one line per record: the SDK's `create()` reads
    each, every field kept."""
    lines = (made / f"{flavor}-chat.jsonl").read_bytes().splitlines()
    assert len(lines) == 4
    for line in lines:
        response = sdk_reading(line, sse=False, path="/chat/completions").chat.completions.create(
            model="qwen3-sample", messages=MESSAGES
        )  # type: ignore[call-overload]
        assert response.to_dict(mode="json") == json.loads(line)
    tool_call = sdk_reading(lines[0], sse=False, path="/chat/completions").chat.completions.create(
        model="qwen3-sample", messages=MESSAGES
    )  # type: ignore[call-overload]
    assert tool_call.choices[0].finish_reason == "tool_calls"
    assert tool_call.choices[0].message.tool_calls[0].function.name == "get_weather"  # type: ignore[index,union-attr]

    lines = [line for line in (made / f"{flavor}-completion.jsonl").read_bytes().splitlines() if b'"error"' not in line[:10]]
    assert len(lines) == (4 if flavor == "derender" else 3)
    for line in lines:
        completion = sdk_reading(line, sse=False, path="/completions").completions.create(model="qwen3-sample", prompt="Paris is")
        assert isinstance(completion, Completion)
        assert completion.to_dict(mode="json") == json.loads(line)


@pytest.mark.parametrize("flavor", FLAVORS)
def test_sse_is_read_by_create_stream(made: Path, flavor: str) -> None:
    """Every chat and completion transcript, iterated as `create(stream=True)`
    gives it: one SDK chunk per event, every field kept."""
    chats = transcripts(made / f"{flavor}-chat-sse")
    assert set(chats) == {"stream-n2", "stream-speculative-unicode", TOOL_CALL_STREAM}
    for transcript in chats.values():
        client = sdk_reading(transcript, sse=True, path="/chat/completions")
        chunks = list(client.chat.completions.create(model="qwen3-sample", messages=MESSAGES, stream=True))  # type: ignore[call-overload]
        assert [chunk.to_dict(mode="json") for chunk in chunks] == [json.loads(event) for event in sse_events(transcript)]
    completions = transcripts(made / f"{flavor}-completion-sse")
    assert len(completions) == 2
    for transcript in completions.values():
        client = sdk_reading(transcript, sse=True, path="/completions")
        chunks = list(client.completions.create(model="qwen3-sample", prompt="Paris is", stream=True))  # type: ignore[call-overload]
        assert [chunk.to_dict(mode="json") for chunk in chunks] == [json.loads(event) for event in sse_events(transcript)]
        assert "".join(choice.text for chunk in chunks for choice in chunk.choices)


def final_completion(transcript: bytes) -> Any:
    client = sdk_reading(transcript, sse=True, path="/chat/completions")
    with client.chat.completions.stream(model="qwen3-sample", messages=MESSAGES) as stream:
        return stream.get_final_completion()


def test_the_stream_helper_reads_serve_flavor_tool_calls(made: Path) -> None:
    """`--flavor serve` is what a client of `vllm serve` reads: the
    helper assembles the streamed tool call and content."""
    final = final_completion(transcripts(made / "serve-chat-sse")[TOOL_CALL_STREAM])
    message = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls"
    assert [(call.type, call.function.name, json.loads(call.function.arguments)) for call in message.tool_calls] == [
        ("function", "get_weather", {"city": "Paris"})
    ]
    assert message.content == "\n\nChecking now.\n"


def test_the_stream_helper_refuses_derender_flavor_tool_calls(made: Path) -> None:
    """The derender flavor is the render server's derender endpoint: its
    tool-call continuation deltas carry ``"type": null``, which the
    helper asserts against; a stream without a tool call it reads."""
    derender = transcripts(made / "derender-chat-sse")
    continuations = [
        call
        for event in sse_events(derender[TOOL_CALL_STREAM])
        for choice in json.loads(event)["choices"]
        for call in choice["delta"].get("tool_calls") or []
        if call["id"] is None
    ]
    assert continuations and all("type" in call and call["type"] is None for call in continuations)
    with pytest.raises(AssertionError):
        final_completion(derender[TOOL_CALL_STREAM])
    assert [choice.message.content for choice in final_completion(derender["stream-n2"]).choices] == [
        choice.message.content for choice in final_completion(transcripts(made / "serve-chat-sse")["stream-n2"]).choices
    ]


@pytest.mark.parametrize("flavor", FLAVORS)
def test_jsonl_chunks_are_the_sse_events(made: Path, flavor: str) -> None:
    """JSONL is for a client of the render server (derender) or for
    comparing calls (serve), not for the SDK: its chunks, in call order per
    request, are the SSE transcript's events, each a chunk the SDK's model
    takes."""
    per_request: dict[str, list[Any]] = {}
    for line in (made / f"{flavor}-chat-stream.jsonl").read_bytes().splitlines():
        answer = orjson.loads(line)
        if flavor == "derender":
            assert set(answer) == {"chunk", "stream_state"}
            chunks = [answer["chunk"]]
        else:
            assert set(answer) == {"chunks"}
            chunks = answer["chunks"]
        for chunk in chunks:
            ChatCompletionChunk.model_validate(chunk)
            per_request.setdefault(chunk["id"], []).append(chunk)
    by_id = {json.loads(sse_events(t)[0])["id"]: t for t in transcripts(made / f"{flavor}-chat-sse").values()}
    assert set(per_request) == set(by_id)
    for request_id, chunks in per_request.items():
        # Two runs: `created` and the random tool-call ids differ.
        assert normalize(chunks) == normalize([json.loads(event) for event in sse_events(by_id[request_id])])
