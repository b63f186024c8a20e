"""The `derender` command as users run it.

End-to-end tests run the installed console script in a subprocess over the
bundled sample and compare with the real render server. The rest drive the
Typer app in process with CliRunner; to keep them fast they reuse the
session's real engine instead of building an identical one per call.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
from typer.testing import CliRunner

from derender_core import Endpoint, RenderConfig
from derender_core.vllm_seam import versions
from tests.conftest import Stack
from tests.helpers import (
    REPO,
    SAMPLE,
    RenderServer,
    invoke,
    normalize,
    offline_env,
    read_jsonl,
    run_cli,
    server_stream_answers,
    transcript_name,
)
from tests.sample_inputs import SampleBuilder, completion_stream_plans, qwen3_family, stream_bodies

SAMPLE_FLAGS = ["--config", "sample_data/qwen3.yaml"]


def lines_of(data: bytes) -> list[Any]:
    return [json.loads(line) for line in data.splitlines()]


def server_answers(stack: Stack, endpoint: Endpoint, path: Path) -> list[Any]:
    return [stack.server.post_raw(endpoint, line).json() for line in path.read_bytes().splitlines() if line.strip()]


# --- end to end, as the README runs it ------------------------------------


def test_readme_quick_start_matches_the_server(qwen3_stack: Stack) -> None:
    done = run_cli("chat", "sample_data/chat.jsonl", *SAMPLE_FLAGS)
    assert done.returncode == 0, done.stderr.decode()
    expected = server_answers(qwen3_stack, Endpoint.CHAT, SAMPLE / "chat.jsonl")
    assert normalize(lines_of(done.stdout)) == normalize(expected)
    assert b"derender: 4 records, 0 errors" in done.stderr


def test_error_sample_gives_aligned_server_errors_and_exit_1(qwen3_stack: Stack) -> None:
    done = run_cli("chat", "sample_data/chat_errors.jsonl", *SAMPLE_FLAGS)
    assert done.returncode == 1
    answers = lines_of(done.stdout)
    assert answers == server_answers(qwen3_stack, Endpoint.CHAT, SAMPLE / "chat_errors.jsonl")
    assert all("error" in answer for answer in answers)
    assert b"record 1 (line 1): 404 The model `no-such-model` does not exist" in done.stderr
    assert b"Traceback" not in done.stderr


def test_stream_sample_and_generate_capture_match_the_server(qwen3_stack: Stack, tmp_path: Path) -> None:
    """The stream bodies, and the raw generate capture joined with
    requests.jsonl, both give the chunks and states the server gives."""
    out = tmp_path / "stream.jsonl"
    done = run_cli("stream", "sample_data/stream.jsonl", "-o", str(out), *SAMPLE_FLAGS)
    assert done.returncode == 0, done.stderr.decode()
    expected = server_stream_answers(qwen3_stack.server, Endpoint.CHAT, read_jsonl(SAMPLE / "stream.jsonl"))
    assert normalize(read_jsonl(out)) == normalize([answer for _, answer in expected])

    joined = run_cli(
        "stream", "sample_data/generate_capture.sse", "--requests", "sample_data/requests.jsonl", *SAMPLE_FLAGS
    )
    assert joined.returncode == 0, joined.stderr.decode()
    assert normalize(lines_of(joined.stdout)) == normalize(read_jsonl(out))


def test_help_never_imports_vllm() -> None:
    probe = (
        "import sys\n"
        "from derender_cli.main import main\n"
        "for argv in (['--help'], ['chat', '--help'], ['stream', '--help'], ['parsers', '--help']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit as exit:\n"
        "        assert exit.code == 0, exit.code\n"
        "assert not [m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch')]\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, cwd=REPO)
    assert done.returncode == 0, done.stderr.decode()
    assert b"--tool-call-parser" in done.stdout


def test_unknown_parser_lists_the_choices() -> None:
    done = run_cli("chat", "sample_data/chat.jsonl", *SAMPLE_FLAGS, "--tool-call-parser", "hermez")
    assert done.returncode == 2
    assert done.stdout == b""
    message = done.stderr.decode()
    assert "--tool-call-parser: unknown parser 'hermez'. Valid choices:" in message
    assert "hermes" in message and "llama3_json" in message
    assert "Traceback" not in message


# --- in process ------------------------------------------------------------


def test_stdin_gzip_to_gzip_file(cli: CliRunner, tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl.gz"
    result = invoke(cli, "chat", "-", "-o", str(out), *SAMPLE_FLAGS, stdin=gzip.compress((SAMPLE / "chat.jsonl").read_bytes()))
    assert result.exit_code == 0
    answers = lines_of(gzip.decompress(out.read_bytes()))
    assert [a["id"] for a in answers] == ["chat-tool-call", "chat-n2-logprobs", "chat-unicode", "chat-stop-string"]


def test_completion_sample_stdout_carries_only_the_servers_answers(cli: CliRunner, qwen3_stack: Stack) -> None:
    result = invoke(cli, "completion", "sample_data/completion.jsonl", *SAMPLE_FLAGS)
    assert result.exit_code == 0
    answers = lines_of(result.stdout_bytes)
    assert normalize(answers) == normalize(server_answers(qwen3_stack, Endpoint.COMPLETION, SAMPLE / "completion.jsonl"))
    assert all(a["object"] == "text_completion" for a in answers)
    # Not a terminal: no progress display, only the summary line, after
    # the one line saying the fast paths are off where they are.
    notice = versions.notice()
    *before, summary = result.stderr.splitlines()
    assert before == ([f"derender: {notice}"] if notice else [])
    assert summary.startswith("derender: 4 records, 0 errors in ")


def test_quiet_leaves_stderr_empty(cli: CliRunner) -> None:
    result = invoke(cli, "completion", "sample_data/completion.jsonl", "-q", *SAMPLE_FLAGS)
    assert result.exit_code == 0 and result.stderr == ""


def test_bare_generate_responses_join_requests(cli: CliRunner, tmp_path: Path) -> None:
    bodies = read_jsonl(SAMPLE / "chat.jsonl")
    generate = tmp_path / "generate.jsonl"
    generate.write_bytes(b"".join(orjson.dumps(b["generate_response"]) + b"\n" for b in bodies))
    requests = tmp_path / "requests.jsonl"
    requests.write_bytes(
        b"".join(
            orjson.dumps(
                {
                    "request_id": b["generate_response"]["request_id"],
                    "chat_request": b["chat_request"],
                    "prompt_token_ids": b["prompt_token_ids"],
                }
            )
            + b"\n"
            for b in bodies
        )
    )
    joined = invoke(cli, "chat", str(generate), "--requests", str(requests), *SAMPLE_FLAGS)
    direct = invoke(cli, "chat", "sample_data/chat.jsonl", *SAMPLE_FLAGS)
    assert joined.exit_code == direct.exit_code == 0
    assert normalize(lines_of(joined.stdout_bytes)) == normalize(lines_of(direct.stdout_bytes))


def test_bare_generate_response_without_requests_is_an_error_record(cli: CliRunner) -> None:
    body = read_jsonl(SAMPLE / "chat.jsonl")[0]
    result = invoke(cli, "chat", "-", *SAMPLE_FLAGS, stdin=orjson.dumps(body["generate_response"]) + b"\n\nnot json\n")
    assert result.exit_code == 1
    first, blank, second = lines_of(result.stdout_bytes)  # the blank line among records is one
    assert "--requests" in first["error"]["message"]
    assert blank["error"]["code"] == 400 and "JSON decode error" in blank["error"]["message"]
    assert second["error"]["type"] == "Bad Request" and "JSON decode error" in second["error"]["message"]
    assert "record 3 (line 3)" in result.stderr


def test_sse_to_a_directory(cli: CliRunner, tmp_path: Path) -> None:
    result = invoke(cli, "stream", "sample_data/stream.jsonl", "--format", "sse", "-o", f"{tmp_path}/sse/", *SAMPLE_FLAGS)
    assert result.exit_code == 0
    assert sorted(p.name for p in (tmp_path / "sse").iterdir()) == sorted(
        transcript_name(rid) for rid in ("stream-n2", "stream-speculative-unicode", "stream-tool-call")
    )


def test_assembled_completion_stream(cli: CliRunner, tmp_path: Path) -> None:
    builder = SampleBuilder(qwen3_family(SAMPLE / "qwen3"))
    bodies = stream_bodies(builder, completion_stream_plans(builder))
    stdin = b"".join(orjson.dumps(b) + b"\n" for b in bodies)
    result = invoke(cli, "stream", "-", "--endpoint", "completion", "--format", "assembled", *SAMPLE_FLAGS, stdin=stdin)
    assert result.exit_code == 0
    texts = {a["id"]: [c["text"] for c in a["choices"]] for a in lines_of(result.stdout_bytes)}
    assert texts["cmpl-stream-n2"] == [" red, violets are blue.", " fragrant and pretty."]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["chat", "absent.jsonl", *SAMPLE_FLAGS], "cannot open input absent.jsonl"),
        (["chat", "sample_data/chat.jsonl", "--model", "no/such/dir"], "--model no/such/dir: no such directory"),
        (["chat", "sample_data/chat.jsonl"], "no model given"),
        (["chat", "sample_data/chat.jsonl", "--config", "sample_data/missing.yaml"], "config file not found"),
        (["chat", "sample_data/chat.jsonl", *SAMPLE_FLAGS, "--requests", "absent.jsonl"], "cannot open input absent.jsonl"),
        (["chat", "sample_data/chat.jsonl", "sample_data/chat_errors.jsonl", *SAMPLE_FLAGS], "2 inputs need an output directory"),
        (["stream", "sample_data/stream.jsonl", "--format", "sse", "-o", "x.sse", "--resume", *SAMPLE_FLAGS], "--resume continues JSONL or Parquet outputs"),
        (["chat", "sample_data/chat.jsonl", "--resume", *SAMPLE_FLAGS], "--resume continues an output file"),
        (["chat", "sample_data/chat.jsonl", *SAMPLE_FLAGS, "--default-chat-template-kwargs", "{nope"], "not valid JSON"),
    ],
)
def test_usage_errors_exit_2_before_processing(cli: CliRunner, args: list[str], message: str) -> None:
    result = invoke(cli, *args)
    assert result.exit_code == 2
    assert message in result.stderr
    assert result.stdout_bytes == b""


def test_bad_flag_values_exit_2(cli: CliRunner) -> None:
    result = invoke(cli, "stream", "sample_data/stream.jsonl", "--format", "xml", *SAMPLE_FLAGS)
    assert result.exit_code == 2 and "xml" in result.stderr
    result = invoke(cli, "chat", "sample_data/chat.jsonl", *SAMPLE_FLAGS, "--tokenizer-mode", "fancy")
    assert result.exit_code == 2
    assert "--tokenizer-mode: unknown mode 'fancy'. Valid choices:" in result.stderr
    assert "mistral" in result.stderr
    assert "Traceback" not in result.stderr


def test_parser_the_tokenizer_cannot_serve_is_a_usage_error(cli: CliRunner, deepseek_dir: Path, tmp_path: Path) -> None:
    """Where vLLM refuses to start the server for this pairing (0.33: the
    DeepSeek tokenizer lacks llama3_json's ``<|python_tag|>``), so do we,
    exit 2. Where it starts (0.34's LlamaJsonEngineToolParser needs no
    such token), we answer as it does: bug for bug, so with ``--lenient``
    (derender's own checks refuse the sample's Qwen3 ids here before the
    server's model check would answer)."""
    flags = ["--model", str(deepseek_dir), "--tool-call-parser", "llama3_json", "--enable-auto-tool-choice"]
    result = invoke(cli, "chat", "sample_data/chat.jsonl", *flags)
    try:
        server = RenderServer(
            RenderConfig(model=str(deepseek_dir), tool_call_parser="llama3_json", enable_auto_tool_choice=True),
            tmp_path / "server.log",
        )
    except RuntimeError:  # the server exited
        assert result.exit_code == 2
        assert "--tool-call-parser llama3_json cannot be used with the tokenizer" in result.stderr
        assert "<|python_tag|>" in result.stderr
        assert result.stdout_bytes == b""
        return
    try:
        lines = (SAMPLE / "chat.jsonl").read_bytes().splitlines()
        expected = [server.post_raw(Endpoint.CHAT, line).json() for line in lines if line.strip()]
    finally:
        server.stop()
    result = invoke(cli, "chat", "sample_data/chat.jsonl", *flags, "--lenient")
    assert result.exit_code == (1 if any("error" in answer for answer in expected) else 0), result.stderr
    assert normalize(lines_of(result.stdout_bytes)) == normalize(expected)


def test_broken_pipe_ends_quietly_with_141(tmp_path: Path) -> None:
    """`derender ... | head`: the reader leaves, the run stops, no traceback."""
    many = tmp_path / "many.jsonl"
    many.write_bytes((SAMPLE / "chat.jsonl").read_bytes() * 200)
    process = subprocess.Popen(
        [str(Path(sys.executable).with_name("derender")), "chat", str(many), *SAMPLE_FLAGS],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=offline_env(),
    )  # fmt: skip
    assert process.stdout is not None and process.stderr is not None
    first = process.stdout.readline()
    process.stdout.close()
    stderr = process.stderr.read()
    assert process.wait(timeout=300) == 141
    assert json.loads(first)["id"] == "chat-tool-call"
    assert b"Traceback" not in stderr and b"BrokenPipe" not in stderr
