"""Test helpers: the real render server as an oracle, and normalisation.

`RenderServer` runs `vllm launch render` on 127.0.0.1 with the flags a
`RenderConfig` gives, so the server and the CLI see the same settings.
`normalize` removes only what differs between any two runs: `created`
timestamps and the random ``chatcmpl-tool-…`` ids.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from derender_core import DerenderEngine, Endpoint, RenderConfig, Report
from derender_core.batch import Job, run
from derender_core.records import iter_records
from derender_core.vllm_seam import versions
from derender_core.writers import JsonlWriter, Writer

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "sample_data"

_TOOL_ID = re.compile(r"chatcmpl-tool-[0-9a-f]+")
# xLAM's ids: call_<index>_<16 random hex digits>.
_XLAM_TOOL_ID = re.compile(r"(call_\d+_)[0-9a-f]{16}")
# Mistral's ids: 9 random letters and digits, in a tool call's "id" or a
# stream state's last_tool_call_ids.
_MISTRAL_TOOL_ID = re.compile(r"[A-Za-z0-9]{9}")
_TOOL_ID_BYTES = re.compile(rb"chatcmpl-tool-[0-9a-f]+")
_CREATED_BYTES = re.compile(rb'"created":\d+')


def normalized_bytes(data: bytes) -> bytes:
    """Output bytes (JSONL or SSE) with `created` and the random tool-call
    ids blanked, as `normalize` blanks them in parsed values."""
    return _TOOL_ID_BYTES.sub(b"chatcmpl-tool-<id>", _CREATED_BYTES.sub(b'"created":0', data))


def normalize(value: Any) -> Any:
    """Blank `created` and the random tool-call ids, everywhere."""
    if isinstance(value, dict):
        normalized = {k: 0 if k == "created" else normalize(v) for k, v in value.items()}
        if value.get("type") == "function" and "id" in value:
            normalized["id"] = _mistral_id(normalized["id"])
        if isinstance(value.get("last_tool_call_ids"), list):
            normalized["last_tool_call_ids"] = [_mistral_id(v) for v in normalized["last_tool_call_ids"]]
        return normalized
    if isinstance(value, list):
        return [normalize(v) for v in value]
    if isinstance(value, str):
        return _XLAM_TOOL_ID.sub(r"\1<id>", _TOOL_ID.sub("chatcmpl-tool-<id>", value))
    return value


def _mistral_id(value: Any) -> Any:
    if isinstance(value, str) and _MISTRAL_TOOL_ID.fullmatch(value):
        return "<mistral-id>"
    return value


def requires_fast(*paths: str) -> pytest.MarkDecorator:
    """Mark a test of fast paths `paths` (`versions.PROVEN`'s names): it
    runs where each is proven on the installed vLLM and on, and skips,
    saying why, where derender runs vLLM's own code in their place (a
    release they were not proven on, or ``DERENDER_FAST_PATHS=off``)."""
    unknown = [path for path in paths if path not in versions.PROVEN]
    if unknown or not paths:
        raise ValueError(f"not fast paths: {unknown or paths}; known: {', '.join(versions.PROVEN)}")
    off = [path for path in paths if not versions.proven(path)]
    why = "; ".join(
        f"fast path {path} is proven on vLLM {', '.join(versions.PROVEN[path])}, "
        f"off on {versions.installed() or '(none)'}"
        for path in off
    )
    if os.environ.get(versions.OFF_ENV, "").strip().lower() == "off" or versions.switched_off():
        why = f"{versions.OFF_ENV}={os.environ[versions.OFF_ENV]} turns off fast path {', '.join(off)}"
    return pytest.mark.skipif(bool(off), reason=f"{why}: derender runs vLLM's own code, no fast path to test")


@contextlib.contextmanager
def one_token_a_step(engine: Any) -> Iterator[None]:
    """A serve engine's one-shot bodies one token a step while active: fast
    path ``serve_bulk`` off for it, as the engine the oracle replays."""
    merges, engine._merges_steps = engine._merges_steps, False
    try:
        yield
    finally:
        engine._merges_steps = merges


def read_jsonl(path: Path) -> list[Any]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def run_lines(engine: DerenderEngine, job: Job, lines: list[bytes], writer: Writer) -> Report:
    """Run the library pipeline over input lines, as the CLI does."""
    return run(engine, iter_records(io.BytesIO(b"\n".join(lines) + b"\n")), job, writer)


def jsonl_answers(engine: DerenderEngine, job: Job, lines: list[bytes]) -> tuple[list[Any], int]:
    """The JSONL answers to input lines, one per line, and the exit code."""
    out = io.BytesIO()
    report = run_lines(engine, job, lines, JsonlWriter(out))
    answers = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(answers) == len(lines) == report.records
    return answers, report.return_code


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def offline_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **extra)
    return env


# Where the tokenizer libraries (huggingface_hub, tiktoken, openai_harmony)
# look for downloaded files. huggingface_hub reads its own at import.
TOKENIZER_CACHE_VARIABLES = (
    "HF_HOME", "HF_HUB_CACHE", "HF_XET_CACHE",
    "TIKTOKEN_CACHE_DIR", "TIKTOKEN_RS_CACHE_DIR", "DATA_GYM_CACHE_DIR",
)  # fmt: skip


def no_network() -> dict[str, str]:
    """Proxy settings every HTTP client honours (requests, httpx, urllib,
    huggingface_hub) that send any download to a closed port, so it fails
    at once; local addresses stay direct, for the render servers."""
    closed = "http://127.0.0.1:9"
    return {
        **dict.fromkeys(("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"), closed),
        **dict.fromkeys(("NO_PROXY", "no_proxy"), "127.0.0.1,localhost"),
    }


def empty_cache_env(cache_dir: Path) -> dict[str, str]:
    """`offline_env` with every tokenizer cache pointed at an empty
    directory and no network, so a process that needs anything it was not
    given fails instead of finding it cached or fetching it."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    if any(cache_dir.iterdir()):
        raise RuntimeError(f"{cache_dir} is not empty")
    env = offline_env(**dict.fromkeys(TOKENIZER_CACHE_VARIABLES, str(cache_dir)), **no_network())
    env.pop("TIKTOKEN_ENCODINGS_BASE", None)
    return env


class RenderServer:
    """A real `vllm launch render` process, started and stopped by tests."""

    def __init__(
        self,
        config: RenderConfig,
        log_path: Path,
        *,
        env: dict[str, str] | None = None,
        wait: bool = True,
    ) -> None:
        """Start the server; with ``wait=False`` the caller does other work
        (building an engine, say) and calls `wait_until_ready` later."""
        self.config = config
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        command = [
            *self.launcher(),
            *config.to_vllm_argv(),
            "--host", "127.0.0.1", "--port", str(self.port),
        ]  # fmt: skip
        self._log = log_path.open("wb")
        self.process = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, env=env or offline_env(), cwd=REPO
        )
        self.client = httpx.Client(base_url=self.url, timeout=120)
        if wait:
            self.wait_until_ready()

    def launcher(self) -> list[str]:
        """The command, before the settings' flags."""
        return [sys.executable, "-m", "vllm.entrypoints.cli.main", "launch", "render"]

    def wait_until_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"render server exited:\n{self.log_tail()}")
            try:
                if self.client.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        tail = self.log_tail()  # before stop() closes the log
        self.stop()
        raise RuntimeError(f"render server not ready in {timeout} s:\n{tail}")

    def log_tail(self, lines: int = 40) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def post(self, endpoint: Endpoint, body: Any) -> httpx.Response:
        return self.client.post(endpoint.path, json=body)

    def rendered_prompt(self, chat_request: dict[str, Any]) -> list[int]:
        """The prompt ids `/v1/chat/completions/render` gives for the
        request: what a split deployment records as ``prompt_token_ids``."""
        rendered = self.client.post("/v1/chat/completions/render", json=chat_request)
        assert rendered.status_code == 200, rendered.text
        return list(rendered.json()["token_ids"])

    def post_raw(self, endpoint: Endpoint, raw: bytes) -> httpx.Response:
        return self.client.post(
            endpoint.path, content=raw, headers={"content-type": "application/json"}
        )

    def stop(self) -> None:
        self.client.close()
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()


class ServeOracle(RenderServer):
    """`vllm serve` itself over HTTP, its engine core playing tapes the
    test writes (`tests.serve_oracle`): the oracle for the serve path."""

    def __init__(self, config: RenderConfig, log_path: Path, tapes: Path) -> None:
        self.tapes = tapes
        super().__init__(config, log_path)

    def launcher(self) -> list[str]:
        return [sys.executable, "-m", "tests.serve_oracle", str(self.tapes)]

    def request(
        self, endpoint: Endpoint, request_id: str, body: dict[str, Any], steps: list[Any]
    ) -> httpx.Response:
        """POST `body` as a client of `vllm serve` does, with the record's
        request id as ``X-Request-Id``, after taping the engine's steps."""
        external_id = f"chatcmpl-{request_id}" if endpoint is Endpoint.CHAT else f"cmpl-{request_id}-0"
        (self.tapes / f"{external_id}.json").write_text(json.dumps({"steps": steps}))
        path = "/v1/chat/completions" if endpoint is Endpoint.CHAT else "/v1/completions"
        return self.client.post(path, json=body, headers={"X-Request-Id": request_id})


def server_stream_answers(
    server: RenderServer, endpoint: Endpoint, bodies: Iterable[dict[str, Any]]
) -> list[tuple[int, Any]]:
    """Thread stream_state through the real server as a client does: one
    state per (request_id, choice index), the first call without one, each
    next call with the state of the previous successful answer for that
    index; a chunk without a choice takes the state of its request's last
    answered index. Written independently of `derender_core.streams`."""
    states: dict[tuple[str, int], Any] = {}
    last_index: dict[str, int] = {}
    answers = []
    for body in bodies:
        chunk = body["generate_chunk"]
        request_id = chunk["request_id"]
        index = chunk["choices"][0]["index"] if chunk["choices"] else last_index.get(request_id)
        sent = dict(body)
        if "stream_state" not in body and (request_id, index) in states:
            sent["stream_state"] = states[(request_id, index)]
        response = server.post(endpoint, sent)
        answers.append((response.status_code, response.json()))
        if chunk["choices"]:
            last_index[request_id] = index
            if response.status_code == 200:
                states[(request_id, index)] = response.json()["stream_state"]
    return answers


def invoke(cli: Any, *args: str, stdin: bytes | None = None) -> Any:
    """Run the Typer app in process (with the `cli` fixture's CliRunner)."""
    from derender_cli.main import app

    return cli.invoke(app, list(args), input=stdin, catch_exceptions=False)


@contextlib.contextmanager
def slow_pipe(data: bytes, pause: float = 0.3) -> Iterator[str]:
    """A pipe, as a path, that delivers one byte of `data`, pauses, then
    the rest: a reader that peeks once sees only the first byte.

    The writer is a process of its own, and this one keeps no write end: a
    worker forked from this process before the pause ends would otherwise
    hold the pipe open, and the reader would never see its end.
    """
    read_end, write_end = os.pipe()
    script = (
        "import sys, time; data = sys.stdin.buffer.read(); out = sys.stdout.buffer; "
        "out.write(data[:1]); out.flush(); time.sleep(float(sys.argv[1])); out.write(data[1:]); out.flush()"
    )
    writer = subprocess.Popen([sys.executable, "-c", script, str(pause)], stdin=subprocess.PIPE, stdout=write_end)
    os.close(write_end)
    assert writer.stdin is not None
    writer.stdin.write(data)
    writer.stdin.close()
    try:
        yield f"/dev/fd/{read_end}"
    finally:
        writer.wait(timeout=60)
        os.close(read_end)


def run_cli(
    *args: str, stdin: bytes | None = None, cwd: Path = REPO, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[bytes]:
    """Run the installed `derender` command as a user would (`env`: extra
    variables)."""
    return subprocess.run(
        [str(Path(sys.executable).with_name("derender")), *args],
        input=stdin,
        capture_output=True,
        cwd=cwd,
        env=offline_env(**(env or {})),
        timeout=600,
    )


def hub_cache(hub: Path, repo_id: str, source: Path, revision: str = "main") -> str:
    """Lay `source`'s files into `hub` as ``huggingface_hub`` caches a
    downloaded model: content-addressed blobs, a snapshot per commit whose
    files link to them, and a ref naming the commit. Returns the commit."""
    import hashlib

    repo = hub / ("models--" + repo_id.replace("/", "--"))
    files = sorted(path for path in source.rglob("*") if path.is_file())
    commit = hashlib.sha1(b"".join(path.read_bytes() for path in files)).hexdigest()
    for path in files:
        data = path.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = repo / "snapshots" / commit / path.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return commit


def count_lane_calls(monkeypatch: Any, method: str = "answer") -> list[bool]:
    """Patch the live chunk lane (`live.ChunkLane.answer`, or its
    ``answer_completion``) to record, per call offered to it, whether it
    answered it; the list fills as calls go."""
    from derender_core.vllm_seam.live import ChunkLane

    taken: list[bool] = []
    answer = getattr(ChunkLane, method)

    def counted(self: ChunkLane, body: Any) -> Any:
        result = answer(self, body)
        taken.append(result is not None)
        return result

    monkeypatch.setattr(ChunkLane, method, counted)
    return taken


def transcript_name(request_id: str | None) -> str:
    """The file a request's transcript gets under ``-o DIR/``, by the rule
    docs/streams.md states: the id with every character outside
    ``A-Z a-z 0-9 . _ ~ -`` made ``_`` (80 at most, without leading ``.``,
    ``-`` or ``~``; ``id`` if nothing is left), ``-``, the first 12 hex
    digits of the SHA-256 of the id's JSON text (ASCII), ``.sse``."""
    import hashlib
    import json as _json

    prefix = re.sub(r"[^A-Za-z0-9._~-]+", "_", request_id or "")[:80].lstrip(".-~") or "id"
    digest = hashlib.sha256(_json.dumps(request_id, ensure_ascii=True).encode("ascii")).hexdigest()[:12]
    return f"{prefix}-{digest}.sse"


class ParserSteps:
    """vLLM's ``ChatStreamProcessor.step`` calls in this process, counted
    from construction (set `count` to 0 to start again): how many chunks a
    stream's parser stepped, so a test tells O(n) from O(n²) replays."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from vllm.entrypoints.openai.chat_completion.stream_processor import ChatStreamProcessor

        self.count = 0
        step = ChatStreamProcessor.step

        def counted(processor: Any, *args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return step(processor, *args, **kwargs)

        monkeypatch.setattr(ChatStreamProcessor, "step", counted)
