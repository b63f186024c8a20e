"""The CLI tried as a hostile user would: bad records, hostile lines, failing
inputs and outputs, and records the server accepts although they are wrong.

Every run goes through the real CLI with the session's real engine (the
`cli` fixture), or as a subprocess where the process itself is the subject
(stdout on a full disk, a user without permissions). `--lenient` answers
are compared with the real render server.
"""

from __future__ import annotations

import copy
import gzip
import io
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
from typer.testing import CliRunner

from derender_core import Endpoint
from tests.conftest import Stack
from tests.helpers import (
    REPO,
    SAMPLE,
    invoke,
    normalize,
    normalized_bytes,
    offline_env,
    read_jsonl,
    run_cli,
    server_stream_answers,
    slow_pipe,
    transcript_name,
)
from tests.render_corpus import drawn_ids_blanked

FLAGS = ["--config", "sample_data/qwen3.yaml"]
CHAT = read_jsonl(SAMPLE / "chat.jsonl")
STREAM = read_jsonl(SAMPLE / "stream.jsonl")
VOCAB = 151669
"""The sample tokenizer's full size: 151,643 ids and 26 added tokens."""


def jsonl(rows: list[Any]) -> bytes:
    return b"".join(orjson.dumps(row) + b"\n" for row in rows)


def lines_of(data: bytes) -> list[Any]:
    return [json.loads(line) for line in data.splitlines()]


def edited(body: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """`body` with the value at a dotted path (numbers index lists) replaced;
    a path ending in ``+`` appends to the list."""
    body = copy.deepcopy(body)
    *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
    target: Any = body
    for key in parents:
        target = target[key]
    if last == "+":
        target.append(value)
    else:
        target[last] = value
    return body


@pytest.fixture(scope="module")
def good_answers(qwen3_stack: Stack) -> list[Any]:
    """The server's answers to the sample chat bodies."""
    return [qwen3_stack.server.post(Endpoint.CHAT, body).json() for body in CHAT]


# --- 1. records the server accepts although they are wrong ---------------------

GR = "generate_response"
WRONG_BUT_ACCEPTED = {
    "oov-output": (edited(CHAT[0], f"{GR}.choices.0.token_ids.3", VOCAB),
                   f"{GR}.choices[0].token_ids[3]: token id {VOCAB} is out of vocabulary (size {VOCAB})"),
    "oov-padding-id": (edited(CHAT[2], f"{GR}.choices.0.token_ids.+", 151935),
                       f"{GR}.choices[0].token_ids[{len(CHAT[2][GR]['choices'][0]['token_ids'])}]: token id 151935 is out of vocabulary"),
    "oov-prompt": (edited(CHAT[0], "prompt_token_ids.5", VOCAB + 7), f"prompt_token_ids[5]: token id {VOCAB + 7} is out of vocabulary"),
    "oov-sampled-logprob": (edited(CHAT[1], f"{GR}.choices.1.logprobs.content.2.token_id", 10**9),
                            f"{GR}.choices[1].logprobs.content[2].token_id: token id 1000000000 is out of vocabulary"),
    "oov-top-logprob": (edited(CHAT[1], f"{GR}.choices.0.logprobs.content.0.top_logprobs.2.token_id", VOCAB),
                        f"{GR}.choices[0].logprobs.content[0].top_logprobs[2].token_id: token id {VOCAB} is out of vocabulary"),
    "boolean-id": (edited(CHAT[2], f"{GR}.choices.0.token_ids.0", True), f"{GR}.choices[0].token_ids[0]: true is a boolean, not a token id"),
    "negative-prompt-tokens": (edited(CHAT[2], "prompt_tokens", -5), "prompt_tokens: -5 is negative"),
    "index-outside": (edited(CHAT[2], f"{GR}.choices.0.index", 3), f"{GR}.choices[0].index: 3 is outside 0..0 (chat_request.n is 1)"),
    "index-repeated": (edited(CHAT[1], f"{GR}.choices.1.index", 0), f"{GR}.choices[1].index: 0 repeats {GR}.choices[0].index"),
    "choice-missing": (edited(CHAT[1], f"{GR}.choices", CHAT[1][GR]["choices"][1:]),
                       f"{GR}.choices: no choice with index 0 (chat_request.n is 2, 1 choice given)"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(WRONG_BUT_ACCEPTED))
def test_wrong_records_the_server_accepts_get_error_records(cli: CliRunner, qwen3_stack: Stack, good_answers: list[Any], case: str) -> None:
    bad, message = WRONG_BUT_ACCEPTED[case]
    stdin = jsonl([CHAT[3], bad, CHAT[2]])
    result = invoke(cli, "chat", "-", *FLAGS, stdin=stdin)
    assert result.exit_code == 1
    first, error, last = lines_of(result.stdout_bytes)
    assert message in error["error"]["message"]
    assert error["error"]["code"] == 400 and error["error"]["type"] == "BadRequestError"
    assert normalize([first, last]) == normalize([good_answers[3], good_answers[2]])
    assert "record 2 (line 2): 400 " + message in result.stderr

    # --lenient: the server's own answer, bug for bug.
    lenient = invoke(cli, "chat", "-", "--lenient", *FLAGS, stdin=stdin)
    assert lenient.exit_code == 0
    server = qwen3_stack.server.post(Endpoint.CHAT, bad).json()
    assert normalize(lines_of(lenient.stdout_bytes)[1]) == normalize(server)


def _stream_with(index: int, path: str, value: Any) -> list[dict[str, Any]]:
    bodies = copy.deepcopy(STREAM)
    bodies[index] = edited(bodies[index], path, value)
    return bodies


WRONG_CHUNKS = {
    # Call 5 is the second chunk of stream-n2 (choice 1).
    "negative-id": (4, "generate_chunk.choices.0.token_ids.1", -1, "generate_chunk.choices[0].token_ids[1]: token id -1 is negative"),
    "oov-id": (4, "generate_chunk.choices.0.token_ids.0", VOCAB, f"generate_chunk.choices[0].token_ids[0]: token id {VOCAB} is out of vocabulary"),
    "index-outside": (4, "generate_chunk.choices.0.index", 2, "generate_chunk.choices[0].index: 2 is outside 0..1 (chat_request.n is 2)"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(WRONG_CHUNKS))
def test_wrong_stream_chunks_get_error_records_and_lenient_threads_as_the_server(
    cli: CliRunner, qwen3_stack: Stack, case: str
) -> None:
    index, path, value, message = WRONG_CHUNKS[case]
    bodies = _stream_with(index, path, value)
    clean = lines_of(invoke(cli, "stream", "-", *FLAGS, stdin=jsonl(STREAM)).stdout_bytes)
    result = invoke(cli, "stream", "-", *FLAGS, stdin=jsonl(bodies))
    assert result.exit_code == 1
    answers = lines_of(result.stdout_bytes)
    assert len(answers) == len(bodies)
    assert message in answers[index]["error"]["message"]
    # Other streams are untouched; the refused call moved no state.
    others = [i for i, b in enumerate(bodies) if b["generate_chunk"]["request_id"] != "stream-n2"]
    assert normalize([answers[i] for i in others]) == normalize([clean[i] for i in others])

    lenient = invoke(cli, "stream", "-", "--lenient", *FLAGS, stdin=jsonl(bodies))
    expected = [answer for _, answer in server_stream_answers(qwen3_stack.server, Endpoint.CHAT, bodies)]
    assert normalize(lines_of(lenient.stdout_bytes)) == normalize(expected)


# --- 2. every bad record gets an aligned error record, the run goes on -----------

def _chunk(index: int, **changes: Any) -> dict[str, Any]:
    body = copy.deepcopy(STREAM[index])
    body.update(changes)
    return body


BAD_RECORDS: dict[str, tuple[bytes, str]] = {
    "invalid-json": (b'{"model": "qwen3-sample", ', "JSON decode error"),
    "invalid-utf8": (b'{"model": "qwen3-\xff\xfe"}', "There was an error parsing the body"),
    "not-an-object": (b"[1, 2, 3]", "Input should be a valid dictionary"),
    "schema-error": (orjson.dumps({"model": "qwen3-sample", "chat_request": CHAT[0]["chat_request"]}), "body.DerenderChatRequest.generate_response"),
    "negative-id": (orjson.dumps(edited(CHAT[2], f"{GR}.choices.0.token_ids.0", -3)), "token_ids must not contain negative values"),
    "non-integer-id": (orjson.dumps(edited(CHAT[2], f"{GR}.choices.0.token_ids.0", 1.5)), "int_from_float"),
    "over-long-tokens": (orjson.dumps(edited(CHAT[2], f"{GR}.choices.0.token_ids", [11] * 40961)), "token_ids length (40961) in choice 0 exceeds max_model_len (40960)"),
    "wrong-model": (orjson.dumps(edited(CHAT[2], "model", "gpt-5")), "The model `gpt-5` does not exist"),
    "null-token-ids-in-one-choice": (orjson.dumps(edited(CHAT[1], f"{GR}.choices.1.token_ids", None)), "choice 1 has empty or null token_ids"),
    "unknown-field-vllm-rejects": (orjson.dumps(edited(CHAT[2], "chat_request.structured_outputs", {"bogus": 1})), "structured outputs"),
    # Beyond every Python's json (3.13's reads 10,000 levels); depths some
    # read: test_deep_values_get_the_servers_answer_through_workers.
    "deeply-nested": (b'{"model": ' + b"[" * 12000 + b"]" * 12000 + b"}", "There was an error parsing the body"),
    "huge-integer": (b'{"prompt_tokens": ' + b"7" * 4400 + b"}", "There was an error parsing the body"),
}  # fmt: skip


def test_every_bad_record_gets_an_aligned_error_record(cli: CliRunner, qwen3_stack: Stack, good_answers: list[Any], tmp_path: Path) -> None:
    """Bad records between good ones: each gets the server's own error
    record (compared with the server, given the same bytes), the good ones
    their answers, and --errors lists every failure with its line."""
    good = orjson.dumps(CHAT[3])
    lines = [good]
    for line, _ in BAD_RECORDS.values():
        lines += [line, b"", good]
    errors = tmp_path / "errors.jsonl.gz"
    result = invoke(cli, "chat", "-", "--errors", str(errors), *FLAGS, stdin=b"\n".join(lines) + b"\n")
    assert result.exit_code == 1
    answers = lines_of(result.stdout_bytes)
    assert len(answers) == 1 + 3 * len(BAD_RECORDS)  # a blank line among records is a record too
    assert normalize(answers[0::3]) == normalize([good_answers[3]] * (len(BAD_RECORDS) + 1))
    assert all(blank["error"]["code"] == 400 for blank in answers[2::3])
    for (name, (line, message)), answer in zip(BAD_RECORDS.items(), answers[1::3], strict=True):
        # The server's parser gives up on some bodies as a whole; FastAPI's
        # own 400 then says only {"detail": ...}.
        assert message in answer.get("detail", "") or message in answer["error"]["message"], name
        assert answer == qwen3_stack.server.post_raw(Endpoint.CHAT, line).json(), name
    assert "Traceback" not in result.stderr

    logged = lines_of(gzip.decompress(errors.read_bytes()))
    failed_lines = [line for k in range(len(BAD_RECORDS)) for line in (2 + 3 * k, 3 + 3 * k)]
    assert [(e["input"], e["line"], e["record"]) for e in logged] == [("-", line, line) for line in failed_lines]
    assert [e["error"] for e in logged] == [answers[line - 1].get("error", answers[line - 1]) for line in failed_lines]
    details = {e["line"]: e.get("detail") for e in logged}
    assert "nested too deeply" in details[2 + 3 * list(BAD_RECORDS).index("deeply-nested")]
    assert "4300 digits" in details[2 + 3 * list(BAD_RECORDS).index("huge-integer")]


DEEP_LEVELS = (900, 1100, 4000, 12000)
"""Deep enough for each Python's limits to tell apart: orjson reads 1,024
levels, Python's json about 1,000 on 3.11, 1,500 on 3.12 and 10,000 on
3.13, and the C pickler about 500, 750 and 5,000."""
_DEEP = b'"<deep>"'


def _deep_lines(body: dict[str, Any], inner: str) -> list[bytes]:
    """`body` with a list nested at each of `DEEP_LEVELS` in three places:
    the model, an extra field, and an extra field of its `inner` object."""
    spots = [edited(body, "model", "<deep>"), {**body, "deep_extra": "<deep>"}, edited(body, f"{inner}.deep_extra", "<deep>")]
    return [
        orjson.dumps(spot).replace(_DEEP, b"[" * depth + b"]" * depth)
        for depth in DEEP_LEVELS
        for spot in spots
    ]


@pytest.mark.parametrize("command", ["chat", "completion", "stream", "render chat"])
def test_deep_values_get_the_servers_answer_through_workers(cli: CliRunner, qwen3_stack: Stack, command: str) -> None:
    """A value nested as deep as any Python's parser reads, or deeper, in
    the model, an extra field or a nested one, between good records, with
    two workers: each line gets what the render server running on this
    same Python answers it (issue 37: on 3.12 the parent could not pickle
    such a record for its worker and the run ended with exit 3)."""
    if command == "stream":
        # Each a stream of its own, first call: the server needs no state.
        first = edited(STREAM[0], "generate_chunk.request_id", "deep")
        deep = [line.replace(b'"deep"', f'"deep-{k}"'.encode(), 1) for k, line in enumerate(_deep_lines(first, "generate_chunk"))]
        good, endpoint = orjson.dumps(STREAM[0]), Endpoint.CHAT
    elif command == "render chat":
        body = {"model": "qwen3-sample", "messages": [{"role": "user", "content": "Hi"}]}
        deep, good, endpoint = _deep_lines(body, "messages.0"), orjson.dumps(body), Endpoint.RENDER_CHAT
    else:
        body = read_jsonl(SAMPLE / f"{command}.jsonl")[0]
        endpoint = Endpoint.CHAT if command == "chat" else Endpoint.COMPLETION
        inner = "generate_response" if "generate_response" in body else "generate_responses.0"
        deep, good = _deep_lines(body, inner), orjson.dumps(body)
    lines = [line for deep_line in deep for line in (good, deep_line)] + [good]
    result = invoke(cli, *command.split(), "-", "--workers", "2", *FLAGS, stdin=b"\n".join(lines) + b"\n")
    assert result.exit_code in (0, 1), result.stderr
    assert "Traceback" not in result.stderr
    got = result.stdout_bytes.splitlines()
    assert len(got) == len(lines)
    for number, (line, answer) in enumerate(zip(lines, got, strict=True), 1):
        if line is good and command == "stream":
            continue  # later calls of one stream, with the state derender threads
        expected = qwen3_stack.server.post_raw(endpoint, line).content
        assert drawn_ids_blanked(normalized_bytes(answer)) == drawn_ids_blanked(normalized_bytes(expected)), f"line {number}"


def test_an_inconsistent_stream_state_fails_one_call_and_the_streams_go_on(cli: CliRunner, qwen3_stack: Stack) -> None:
    bodies = copy.deepcopy(STREAM)
    bodies[6] = _chunk(6, stream_state={"output_token_ids": [1, 2, 3], "output_chunk_lens": [1]})
    result = invoke(cli, "stream", "-", *FLAGS, stdin=jsonl(bodies))
    assert result.exit_code == 1
    answers = lines_of(result.stdout_bytes)
    assert "output_chunk_lens must sum to len(output_token_ids)" in answers[6]["error"]["message"]
    expected = [answer for _, answer in server_stream_answers(qwen3_stack.server, Endpoint.CHAT, bodies)]
    assert normalize(answers) == normalize(expected)


def test_fail_fast_stops_at_the_first_bad_record(cli: CliRunner, good_answers: list[Any]) -> None:
    bad = orjson.dumps(edited(CHAT[2], "model", "gpt-5"))
    stdin = b"\n".join([orjson.dumps(CHAT[0]), bad, orjson.dumps(CHAT[1])]) + b"\n"
    result = invoke(cli, "chat", "-", "--fail-fast", *FLAGS, stdin=stdin)
    assert result.exit_code == 1
    first, error = lines_of(result.stdout_bytes)
    assert normalize(first) == normalize(good_answers[0]) and error["error"]["code"] == 404
    assert "derender: 2 records, 1 errors" in result.stderr
    assert "stopped at the first failed record, record 2 (line 2), as --fail-fast asks" in result.stderr


def test_errors_file_must_not_be_stdout_or_an_input(cli: CliRunner) -> None:
    result = invoke(cli, "chat", "sample_data/chat.jsonl", "--errors", "-", *FLAGS)
    assert result.exit_code == 2 and "--errors needs a file path" in result.stderr
    result = invoke(cli, "chat", "sample_data/chat.jsonl", "--errors", "sample_data/chat.jsonl", *FLAGS)
    assert result.exit_code == 2 and "--errors sample_data/chat.jsonl is the same file as INPUT" in result.stderr
    assert (SAMPLE / "chat.jsonl").read_bytes().count(b"\n") == 4


def test_a_bug_on_one_record_is_a_500_for_that_record_with_verbose_traceback(
    cli: CliRunner, monkeypatch: pytest.MonkeyPatch, good_answers: list[Any]
) -> None:
    """A bug (simulated here in our own checks) costs its record, not the
    run; its traceback shows only with --verbose."""
    import derender_core.batch as batch

    real = batch.check_body

    def buggy(body: Any, *args: Any, **kwargs: Any) -> str | None:
        if body.get("generate_response", {}).get("request_id") == "chat-unicode":
            raise KeyError("simulated bug")
        return real(body, *args, **kwargs)

    monkeypatch.setattr(batch, "check_body", buggy)
    result = invoke(cli, "chat", "sample_data/chat.jsonl", *FLAGS)
    assert result.exit_code == 1
    answers = lines_of(result.stdout_bytes)
    assert answers[2]["error"] == {"message": "'simulated bug'", "type": "InternalServerError", "param": None, "code": 500}
    assert normalize(answers[3]) == normalize(good_answers[3])
    assert "a bug, not bad input; --verbose shows the traceback" in result.stderr
    assert "Traceback" not in result.stderr
    verbose = invoke(cli, "chat", "sample_data/chat.jsonl", "--verbose", *FLAGS)
    assert "Traceback (most recent call last)" in verbose.stderr and "KeyError: 'simulated bug'" in verbose.stderr


def test_a_bug_outside_records_ends_the_run_with_exit_3_not_1(cli: CliRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    from derender_core.writers import JsonlWriter

    def broken(self: Any, answer: Any, facts: Any) -> None:
        raise RuntimeError("simulated writer bug")

    monkeypatch.setattr(JsonlWriter, "add", broken)
    result = invoke(cli, "chat", "sample_data/chat.jsonl", *FLAGS)
    assert result.exit_code == 3
    assert "internal error, the run could not finish: RuntimeError: simulated writer bug (--verbose shows the traceback)" in result.stderr
    assert "Traceback" not in result.stderr
    verbose = invoke(cli, "chat", "sample_data/chat.jsonl", "-v", *FLAGS)
    assert verbose.exit_code == 3 and "Traceback (most recent call last)" in verbose.stderr


# --- 3. the defects found as a hostile user -----------------------------------


def test_hostile_lines_in_the_requests_file_are_a_usage_error(cli: CliRunner, tmp_path: Path) -> None:
    for name, line in (("deep", b"[" * 12000 + b"]" * 12000), ("huge", b'{"request_id": "a", "n": ' + b"1" * 5000 + b"}")):
        requests = tmp_path / f"{name}.jsonl"
        requests.write_bytes((SAMPLE / "requests.jsonl").read_bytes() + line + b"\n")
        result = invoke(cli, "stream", "sample_data/generate_capture.sse", "--requests", str(requests), *FLAGS)
        assert result.exit_code == 2, name
        assert f"{requests}:4: not JSON" in result.stderr and result.stdout_bytes == b""


def test_a_model_directory_without_tokenizer_files_fails_at_start_up(cli: CliRunner, tmp_path: Path) -> None:
    model = tmp_path / "no-tokenizer"
    model.mkdir()
    for name in ("config.json", "generation_config.json"):
        shutil.copy(SAMPLE / "qwen3" / name, model / name)
    result = invoke(cli, "chat", "sample_data/chat.jsonl", "--model", str(model))
    assert result.exit_code == 2
    assert f"{model}: the tokenizer holds 1 token(s), only special ones" in result.stderr
    assert result.stdout_bytes == b""


def test_an_output_that_is_the_input_is_refused_and_the_input_kept(cli: CliRunner, tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    shutil.copy(SAMPLE / "chat.jsonl", source)
    before = source.read_bytes()
    (tmp_path / "alias.jsonl").symlink_to(source)
    for output in (str(source), str(tmp_path / "alias.jsonl")):
        result = invoke(cli, "chat", str(source), "-o", output, *FLAGS)
        assert result.exit_code == 2 and "is the same file as INPUT" in result.stderr
    result = invoke(cli, "stream", "sample_data/generate_capture.sse", "--requests", str(source), "-o", str(source), *FLAGS)
    assert result.exit_code == 2 and "is the same file as --requests" in result.stderr
    assert source.read_bytes() == before


@pytest.mark.parametrize("output_format", ["sse", "assembled", "jsonl"])
@pytest.mark.parametrize("lenient", [False, True])
def test_one_shot_and_mixed_bodies_given_to_stream_never_crash(cli: CliRunner, output_format: str, lenient: bool) -> None:
    both = _chunk(0, generate_response=CHAT[0][GR])
    one_shot_with_chunk = {k: v for k, v in both.items() if k != "stream"}
    stdin = jsonl([STREAM[0], CHAT[0], both, one_shot_with_chunk, *STREAM[1:]])
    args = ["stream", "-", "--format", output_format, *FLAGS] + (["--lenient"] if lenient else [])
    result = invoke(cli, *args, stdin=stdin)
    assert result.exit_code in (0, 1)
    assert "Traceback" not in result.stderr
    if output_format == "jsonl":
        answers = lines_of(result.stdout_bytes)
        assert len(answers) == len(STREAM) + 3
        if not lenient:
            assert "stream: not set, so this is a one-shot call" in answers[1]["error"]["message"]
            assert "generate_chunk: the body also holds generate_response" in answers[2]["error"]["message"]
            assert "generate_chunk: the body also holds generate_response" in answers[3]["error"]["message"]
    if not lenient:
        assert result.exit_code == 1
        assert "record 2 (line 2): 400 stream: not set, so this is a one-shot call" in result.stderr


@pytest.mark.parametrize(
    ("mangle", "message"),
    [
        (lambda packed: packed[: len(packed) - 100], "it ends early (Compressed file ended before the end-of-stream marker was reached)"),
        (lambda packed: packed[:300] + b"\x00" * 64 + packed[364:], "cannot read"),
    ],
    ids=["truncated", "corrupt"],
)
def test_a_broken_gzip_input_is_a_run_that_could_not_finish(cli: CliRunner, tmp_path: Path, mangle: Any, message: str) -> None:
    body = orjson.dumps(CHAT[2]) + b"\n"
    path = tmp_path / "in.jsonl.gz"
    path.write_bytes(mangle(gzip.compress(body * 60)))
    out = tmp_path / "out.jsonl"
    result = invoke(cli, "chat", str(path), "-o", str(out), *FLAGS)
    assert result.exit_code == 3
    written = out.read_bytes().splitlines()
    assert 0 < len(written) < 60 or message == "cannot read"
    assert f"derender: the run could not finish: cannot read {path}: " in result.stderr and message in result.stderr
    assert f"{len(written)} records were answered; {len(written)} written in full to {out}." in result.stderr
    assert "Aborted" not in result.stderr and "Traceback" not in result.stderr


def test_a_truncated_gzip_requests_file_is_a_usage_error(cli: CliRunner, tmp_path: Path) -> None:
    requests = tmp_path / "requests.jsonl.gz"
    requests.write_bytes(gzip.compress((SAMPLE / "requests.jsonl").read_bytes())[:-30])
    result = invoke(cli, "stream", "sample_data/generate_capture.sse", "--requests", str(requests), *FLAGS)
    assert result.exit_code == 2
    assert f"cannot read --requests {requests}: it ends early" in result.stderr


def test_a_full_disk_is_a_run_that_could_not_finish(cli: CliRunner, tmp_path: Path) -> None:
    for args in (["chat", "sample_data/chat.jsonl", "-o", "/dev/full"],
                 ["stream", "sample_data/stream.jsonl", "--format", "sse", "-o", "/dev/full"],
                 ["chat", "sample_data/chat_errors.jsonl", "--errors", "/dev/full", "-o", str(tmp_path / "out.jsonl")]):  # fmt: skip
        result = invoke(cli, *args, *FLAGS)
        assert result.exit_code == 3, args
        assert "derender: the run could not finish: cannot write /dev/full: No space left on device." in result.stderr
        assert "Traceback" not in result.stderr
    assert re.search(r"[1-5] records were answered; [0-5] written in full to .*out.jsonl", result.stderr)
    result = invoke(cli, "chat", "sample_data/chat.jsonl", "-o", "/dev/full", *FLAGS)
    assert re.search(r"[1-4] records were answered; 0 written in full to /dev/full", result.stderr)


def test_a_full_disk_while_the_manifest_is_written_says_how_far_the_run_got(
    cli: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fills up after the output's last record is written, as the
    manifest beside it is rewritten: the run could not finish (exit 3), the
    summary says how many records were answered and written, and the
    manifest's aside copy (``.NAME.derender.json.partial``), which the
    full disk left empty, is gone."""
    from derender_core import resume

    written = []

    def full_after_the_first(path: str, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if str(path).endswith(".derender.json.partial"):
            written.append(path)
            if len(written) > 1:
                Path(path).touch()  # opened, as on a full disk, and nothing fits
                return open("/dev/full", mode)  # noqa: SIM115 - closed by the caller
        return open(path, mode, *args, **kwargs)  # noqa: SIM115 - closed by the caller

    monkeypatch.setattr(resume, "open", full_after_the_first, raising=False)
    out = tmp_path / "out.jsonl"
    result = invoke(cli, "chat", "sample_data/chat.jsonl", "-o", str(out), "-j", "1", *FLAGS)
    assert len(written) > 1, "the manifest was written once only"
    assert result.exit_code == 3, result.stderr
    manifest = tmp_path / ".out.jsonl.derender.json"
    assert (
        f"derender: the run could not finish: cannot write {manifest}: No space left on device. "
        f"4 records were answered; 4 written in full to {out}."
    ) in result.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == [manifest.name, out.name]
    assert "Traceback" not in result.stderr


def test_stdout_on_a_full_disk_exits_3_quietly() -> None:
    """A real process: Python's own exit-time flush of stdout must not fail
    again once the run has said it could not finish."""
    with open("/dev/full", "wb") as full:
        done = subprocess.run(
            [str(Path(sys.executable).with_name("derender")), "chat", "sample_data/chat.jsonl", *FLAGS],
            stdout=full, stderr=subprocess.PIPE, cwd=REPO, env=offline_env(), timeout=600,
        )  # fmt: skip
    stderr = done.stderr.decode()
    assert done.returncode == 3, stderr
    # The run stops at the first batch the disk refuses (by size or age).
    assert re.search(
        r"derender: the run could not finish: cannot write stdout: No space left on device\. "
        r"[1-4] records were answered; 0 written in full to stdout\.",
        stderr,
    ), stderr
    assert "Traceback" not in stderr and "Exception ignored" not in stderr


def test_gzip_on_a_slow_pipe_is_detected(cli: CliRunner, good_answers: list[Any]) -> None:
    with slow_pipe(gzip.compress((SAMPLE / "chat.jsonl").read_bytes())) as path:
        result = invoke(cli, "chat", path, *FLAGS)
    assert result.exit_code == 0
    assert normalize(lines_of(result.stdout_bytes)) == normalize(good_answers)


def test_hostile_config_files_are_usage_errors(cli: CliRunner, tmp_path: Path) -> None:
    cases = {
        "latin1.yaml": ("model: sample_data/qwen3\nserved-model-name: caf\xe9\n".encode("latin-1"), "is not UTF-8 text"),
        "deep.yaml": (b"model: " + b"[" * 5000 + b"]" * 5000 + b"\n", "is nested too deeply to read"),
        "huge.yaml": (b"max-model-len: " + b"9" * 5000 + b"\n", "cannot read config file"),
    }
    for name, (content, message) in cases.items():
        (tmp_path / name).write_bytes(content)
        result = invoke(cli, "chat", "sample_data/chat.jsonl", "--config", str(tmp_path / name))
        assert result.exit_code == 2, name
        assert message in result.stderr and "Traceback" not in result.stderr


def test_a_missing_chat_template_is_a_usage_error(cli: CliRunner) -> None:
    result = invoke(cli, "chat", "sample_data/chat.jsonl", *FLAGS, "--chat-template", "templates/missing.jinja")
    assert result.exit_code == 2
    assert "templates/missing.jinja" in result.stderr and "doesn't exist" in result.stderr


def test_an_output_path_that_cannot_be_looked_up_is_a_usage_error(cli: CliRunner, tmp_path: Path) -> None:
    too_long = tmp_path / ("d" * 300) / "out.jsonl"
    for args in (["chat", "sample_data/chat.jsonl", "-o", str(too_long)],
                 ["stream", "sample_data/stream.jsonl", "--format", "sse", "-o", f"{too_long}/"]):  # fmt: skip
        result = invoke(cli, *args, *FLAGS)
        assert result.exit_code == 2, args
        assert "File name too long" in result.stderr and result.stdout_bytes == b""


def test_an_unsearchable_output_parent_is_a_usage_error(tmp_path: Path) -> None:
    """As a user without rights on the output's parent. Root bypasses
    permissions, so as root the process runs without that capability."""
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0)
    prefix: list[str] = []
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv to drop CAP_DAC_OVERRIDE")
        prefix = [setpriv, "--bounding-set", "-dac_override,-dac_read_search", "--"]
    try:
        done = subprocess.run(
            [*prefix, str(Path(sys.executable).with_name("derender")), "stream", "sample_data/stream.jsonl",
             "--format", "sse", "-o", str(locked / "inner" / "out.sse"), *FLAGS],
            capture_output=True, cwd=REPO, env=offline_env(), timeout=600,
        )  # fmt: skip
    finally:
        locked.chmod(0o755)
    stderr = done.stderr.decode()
    assert done.returncode == 2, stderr
    assert f"cannot use -o {locked}/inner/out.sse: Permission denied" in stderr
    assert "Traceback" not in stderr


def test_a_300_character_request_id_gets_a_short_distinct_file(cli: CliRunner, tmp_path: Path) -> None:
    bodies = copy.deepcopy(STREAM)
    long_ids = {"stream-n2": "n" * 300, "stream-tool-call": "n" * 299 + "m"}
    for body in bodies:
        body["generate_chunk"]["request_id"] = long_ids.get(body["generate_chunk"]["request_id"], body["generate_chunk"]["request_id"])
    result = invoke(cli, "stream", "-", "--format", "sse", "-o", f"{tmp_path}/sse/", *FLAGS, stdin=jsonl(bodies))
    assert result.exit_code == 0, result.stderr
    names = sorted(p.name for p in (tmp_path / "sse").iterdir())
    assert len(names) == 3 and all(len(name) <= 255 for name in names)
    long_names = [name for name in names if name.startswith("n" * 80)]
    assert len(long_names) == 2 and long_names[0] != long_names[1]
    assert sorted(long_names) == sorted(transcript_name(rid) for rid in long_ids.values())
    assert all((tmp_path / "sse" / name).read_bytes().endswith(b"data: [DONE]\n\n") for name in names)


def test_parser_tracebacks_are_counted_per_kind_with_one_example(cli: CliRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hermes logs a traceback for every tool call cut at `length`."""
    cut = edited(CHAT[0], f"{GR}.choices.0.token_ids", CHAT[0][GR]["choices"][0]["token_ids"][:-8])
    cut = edited(cut, f"{GR}.choices.0.finish_reason", "length")
    stdin = jsonl([CHAT[2], cut, cut, CHAT[3], cut])
    result = invoke(cli, "chat", "-", *FLAGS, stdin=stdin)
    assert result.exit_code == 0
    assert "Traceback" not in result.stderr
    assert "derender: vLLM logged 3 messages while derendering (full text with --verbose):" in result.stderr
    assert (
        "  3 x ERROR vllm.tool_parsers.hermes_tool_parser: Error in extracting tool call from response. "
        "(JSONDecodeError: Unterminated string starting at: line 2 column 56 (char 56)) (first at record 2)"
    ) in result.stderr
    # With --verbose they go on, in full, to the handlers vLLM's logger has
    # (in a real run, its stderr handler; here one that keeps them).
    # In process (-j 1) the test can hold those handlers.
    kept = io.StringIO()
    handler = logging.StreamHandler(kept)
    monkeypatch.setattr(logging.getLogger("vllm"), "handlers", [handler])
    verbose = invoke(cli, "chat", "-", "--verbose", "-j", "1", *FLAGS, stdin=stdin)
    assert "derender: vLLM logged 3 messages while derendering:" in verbose.stderr
    assert kept.getvalue().count("Traceback (most recent call last)") == 3
    assert logging.getLogger("vllm").handlers == [handler]
    # Worker processes log through the handlers they were forked with:
    # vLLM's own, on the real stderr.
    workers = run_cli("chat", "-", "--verbose", "-j", "2", *FLAGS, stdin=stdin)
    stderr = workers.stderr.decode()
    assert workers.returncode == 0, stderr
    assert "derender: vLLM logged 3 messages while derendering:" in stderr
    assert stderr.count("Traceback (most recent call last)") == 3


def test_jsonl_lines_that_look_like_sse_fields_are_answered_not_dropped(cli: CliRunner) -> None:
    good = orjson.dumps(CHAT[3])
    stdin = b"\n".join([good, b": looks like a comment", b"id: 7", b"event: x", good]) + b"\n"
    result = invoke(cli, "chat", "-", *FLAGS, stdin=stdin)
    assert result.exit_code == 1
    answers = lines_of(result.stdout_bytes)
    assert len(answers) == 5
    assert [("error" in a) for a in answers] == [False, True, True, True, False]
    assert "record 2 (line 2): 400" in result.stderr


def test_cr_only_line_endings(cli: CliRunner, good_answers: list[Any]) -> None:
    stdin = b"\r".join(orjson.dumps(body) for body in CHAT) + b"\r"
    result = invoke(cli, "chat", "-", *FLAGS, stdin=stdin)
    assert result.exit_code == 0
    assert normalize(lines_of(result.stdout_bytes)) == normalize(good_answers)


# --- 4. hypothesis through the CLI: no crash, alignment, isolation --------------

from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_KEYS = ["model", "stream", "generate_response", "generate_chunk", "choices", "index", "token_ids", "logprobs",
         "prompt_token_ids", "prompt_tokens", "chat_request", "stream_state", "request_id", "finish_reason", "usage"]  # fmt: skip
hostile_values = st.one_of(
    st.sampled_from([VOCAB, VOCAB + 1, 2**63, 2**64 + 1, -1, True, False, None, "", 1.5, 2.0, "7", [], {}, [None], [VOCAB]]),
    st.recursive(
        st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=6),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(_KEYS) | st.text(max_size=4), inner, max_size=3),
        max_leaves=8,
    ),
)
_PREFIXES = [b": ", b"id: ", b"data: ", b"event: ", b"retry: 5 ", b"data: [DONE] ", b"\xef\xbb\xbf", b"\xff"]


def _paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a body a value can be replaced or removed."""
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return []
    found = []
    for key, child in items:
        found.append((*path, key))
        found += _paths(child, (*path, key))
    return found


def _no_line_break(data: bytes) -> bytes:
    return data.replace(b"\n", b" ").replace(b"\r", b" ")


@st.composite
def mutated(draw: st.DrawFn, base: dict[str, Any]) -> bytes:
    """One hostile version of a body, as one input line."""
    kind = draw(st.sampled_from(["replace", "replace", "delete", "add", "bytes", "prefix", "deep", "huge"]))
    raw = json.dumps(base).encode()
    if kind in ("replace", "delete", "add"):
        body = copy.deepcopy(base)
        if kind == "add":
            body[draw(st.sampled_from(_KEYS))] = draw(hostile_values)
        else:
            *parents, last = draw(st.sampled_from(_paths(base)))
            target: Any = body
            for key in parents:
                target = target[key]
            if kind == "replace":
                target[last] = draw(hostile_values)
            else:
                del target[last]
        # json, not orjson: integers beyond 64 bits stay integers.
        line = json.dumps(body).encode()
    elif kind == "bytes":
        start = draw(st.integers(0, len(raw)))
        line = raw[:start] + draw(st.binary(max_size=6)) + raw[start + draw(st.integers(0, 12)) :]
    elif kind == "prefix":
        line = draw(st.sampled_from(_PREFIXES)) + raw
    elif kind == "deep":
        depth = draw(st.sampled_from([5, 900, 1100, 4000]))
        line = b'{"model": ' + b"[" * depth + raw + b"]" * depth + b"}"
    else:
        line = raw.replace(b'"token_ids": [', b'"token_ids": [' + b"9" * draw(st.sampled_from([19, 4300, 4301, 6000])) + b", ", 1)
    line = _no_line_break(line)
    assume(line.strip())
    return line


line_endings = st.sampled_from([b"\n", b"\r\n", b"\r"])


_CLEAN_RUNS: dict[tuple[str, ...], bytes] = {}


def _clean_run(cli: CliRunner, *args: str, stdin: bytes) -> bytes:
    """The output of a run over good input, made once per session."""
    if args not in _CLEAN_RUNS:
        result = invoke(cli, *args, *FLAGS, stdin=stdin)
        assert result.exit_code == 0, result.stderr
        _CLEAN_RUNS[args] = result.stdout_bytes
    return _CLEAN_RUNS[args]




def _by_request(output_format: str, output: bytes) -> dict[str, Any]:
    """Each request's output: its answers in order (jsonl), its transcript
    (sse) or its assembled response; records with no request id are left out."""
    grouped: dict[str, Any] = {}
    if output_format == "jsonl":
        for answer in normalize(lines_of(output)):
            if "chunk" in answer:
                grouped.setdefault(answer["chunk"]["id"], []).append(answer)
    elif output_format == "sse":
        for block in output.split(b"data: [DONE]\n\n")[:-1]:
            ids = re.findall(rb'^data: \{"id":"([^"]*)"', block, flags=re.M)
            if ids:
                grouped.setdefault(ids[0].decode(), []).append(normalized_bytes(block))
    else:
        for answer in normalize(lines_of(output)):
            grouped.setdefault(answer.get("id", "<error>"), []).append(answer)
    return grouped


_FUZZ = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])


@_FUZZ
@given(data=st.data())
def test_fuzzed_one_shot_records_through_the_cli(cli: CliRunner, data: st.DataObject) -> None:
    """Random and mutated records among good ones: no crash, one output
    record per input record, and good records answered as in a clean run."""
    clean_chat = normalize(lines_of(_clean_run(cli, "chat", "-", stdin=jsonl(CHAT))))
    plan = data.draw(st.lists(st.one_of(st.integers(0, 3), st.tuples(st.integers(0, 3))), min_size=1, max_size=8))
    lines, expected = [orjson.dumps(CHAT[0])], [clean_chat[0]]
    for item in plan:
        if isinstance(item, int):
            lines.append(orjson.dumps(CHAT[item]))
            expected.append(clean_chat[item])
        else:
            lines.append(data.draw(mutated(CHAT[item[0]])))
            expected.append(None)
        if data.draw(st.booleans()):
            lines.append(data.draw(st.sampled_from([b"", b"  ", b"\t"])))
            expected.append(None)  # a blank line among records is a record (not JSON)
    while not lines[-1].strip():  # blank lines after the last record are not records
        lines.pop()
        expected.pop()
    endings = [data.draw(line_endings) for _ in lines]
    for position in range(len(lines) - 1):
        # A lone CR then a blank line ended by LF would be one CRLF, not two lines.
        if endings[position] == b"\r" and lines[position + 1] == b"" and endings[position + 1].startswith(b"\n"):
            endings[position] = b"\r\n"
    stdin = b"".join(line + ending for line, ending in zip(lines, endings, strict=True))
    lenient = data.draw(st.booleans())
    result = invoke(cli, "chat", "-", *FLAGS, *(["--lenient"] if lenient else []), stdin=stdin)
    assert result.exit_code in (0, 1), result.stderr
    assert "Traceback" not in result.stderr
    answers = normalize(lines_of(result.stdout_bytes))
    assert len(answers) == len(expected)
    for answer, clean in zip(answers, expected, strict=True):
        assert isinstance(answer, dict)
        if clean is not None:
            assert answer == clean


@_FUZZ
@given(data=st.data())
def test_fuzzed_streams_through_the_cli(cli: CliRunner, data: st.DataObject) -> None:
    """Interleaved streams in any order, one of them fed mutated calls and
    bad states, and stray bad lines: no crash, one output record per input
    record, and the other streams' answers, transcripts and assembled
    responses exactly those of a clean run."""
    streams: dict[str, list[dict[str, Any]]] = {}
    for body in STREAM:
        streams.setdefault(body["generate_chunk"]["request_id"], []).append(body)
    target = data.draw(st.sampled_from(sorted(streams)))
    order = data.draw(st.permutations([request_id for request_id, calls in streams.items() for _ in calls]))
    position = dict.fromkeys(streams, 0)
    lines: list[bytes] = []
    for request_id in order:
        body = streams[request_id][position[request_id]]
        position[request_id] += 1
        if request_id == target and data.draw(st.integers(0, 9)) < 2:
            if data.draw(st.booleans()):
                state = data.draw(hostile_values | st.fixed_dictionaries({"output_token_ids": st.lists(st.integers(-2, VOCAB + 2), max_size=4), "output_chunk_lens": st.lists(st.integers(-1, 3), max_size=3)}))
                line = json.dumps({**body, "stream_state": state}).encode()
            else:
                line = data.draw(mutated(body))
                try:
                    chunk = json.loads(line).get("generate_chunk")
                    stolen = isinstance(chunk, dict) and chunk.get("request_id") in set(streams) - {target}
                except Exception:
                    stolen = False
                assume(not stolen)  # a call of another stream is that stream's call
            lines.append(line)
        else:
            lines.append(orjson.dumps(body))
        if data.draw(st.integers(0, 19)) == 0:
            lines.append(data.draw(st.sampled_from([b"not json", orjson.dumps(CHAT[2]), b"[]", b": x", b'{"stream": true}'])))
    stdin = b"".join(line + b"\n" for line in lines)
    lenient = ["--lenient"] if data.draw(st.booleans()) else []
    others = set(streams) - {target}
    for output_format in ("jsonl", "sse", "assembled"):
        result = invoke(cli, "stream", "-", "--format", output_format, *FLAGS, *lenient, stdin=stdin)
        assert result.exit_code in (0, 1), result.stderr
        assert "Traceback" not in result.stderr
        if output_format == "jsonl":
            assert len(lines_of(result.stdout_bytes)) == len(lines)
        grouped = _by_request(output_format, result.stdout_bytes)
        clean = _by_request(output_format, _clean_run(cli, "stream", "-", "--format", output_format, stdin=jsonl(STREAM)))
        assert {k: grouped.get(k) for k in others} == {k: clean[k] for k in others}, output_format
