"""`derender server`: the real client (the installed `derender`) against a
real server process, compared with fresh processes.

One server is shared by the module (its engine is built once); the tests
that kill or idle a server start their own. Every server here lives in a
directory of the test's own: the suite never reaches a user's server
(tests/conftest.py sets DERENDER_NO_SERVER and a private
DERENDER_SERVER_DIR for everything else).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from derender_cli.control import process_alive as alive
from derender_cli.wire import SOCKET_NAME, request, send_message

from tests.helpers import REPO, normalized_bytes, offline_env

CLI = str(Path(sys.executable).with_name("derender"))
CONFIG = ["--config", "sample_data/qwen3.yaml"]


@dataclass
class Server:
    directory: Path
    env: dict[str, str]
    fresh_results: dict[str, subprocess.CompletedProcess[bytes]] = field(default_factory=dict)

    def run(
        self, *args: str, fresh: bool = False, env: dict[str, str] | None = None, timeout: float = 600, **kwargs: Any
    ) -> subprocess.CompletedProcess[bytes]:
        env = env or self.env
        if fresh:
            env = {**env, "DERENDER_NO_SERVER": "1"}
        return subprocess.run([CLI, *args], capture_output=True, cwd=REPO, env=env, timeout=timeout, **kwargs)

    def popen(self, *args: str, **kwargs: Any) -> subprocess.Popen[bytes]:
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.PIPE)
        return subprocess.Popen([CLI, *args], cwd=REPO, env=self.env, **kwargs)

    def status(self) -> dict[str, Any] | None:
        return request({"command": "status"}, directory=str(self.directory))

    def served(self) -> int:
        state = self.status()
        assert state is not None, "the server is not running"
        return int(state["calls_served"])

    def start(self, *args: str) -> int:
        started = self.run("server", "start", *args, timeout=600)
        assert started.returncode == 0, started.stderr.decode()
        found = re.search(rb"server ready \(pid (\d+),", started.stderr)
        assert found, started.stderr.decode()
        return int(found[1])


def server_env(directory: Path) -> dict[str, str]:
    env = offline_env(DERENDER_SERVER_DIR=str(directory))
    env.pop("DERENDER_NO_SERVER", None)
    return env


def children_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry))
    return found


def wait_until(condition: Any, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    directory = tmp_path_factory.mktemp("warm") / "server"
    running = Server(directory, server_env(directory))
    pid = running.start("--idle-timeout", "20m")
    yield running
    running.run("server", "stop", timeout=60)
    assert wait_until(lambda: not alive(pid))


@pytest.fixture(scope="module")
def big_input(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sample's chat records, many times over: a run that lasts."""
    records = (REPO / "sample_data" / "chat.jsonl").read_text().splitlines()
    path = tmp_path_factory.mktemp("big") / "big.jsonl"
    path.write_text("\n".join(records * 4000) + "\n")
    return path


_NUMBER = re.compile(rb"\d+(?:[.,]\d+)*")


def summary_shape(stderr: bytes) -> bytes:
    """stderr with the figures that vary run to run (times, rates) blanked,
    and the start-up's warm mark dropped."""
    return _NUMBER.sub(b"N", stderr.replace(b"model (warm)", b"model"))


CALLS: dict[str, list[str]] = {
    "chat": ["chat", "sample_data/chat.jsonl", *CONFIG],
    "chat-errors": ["chat", "sample_data/chat_errors.jsonl", *CONFIG, "-j", "1"],
    "completion": ["completion", "sample_data/completion.jsonl", *CONFIG],
    "stream-jsonl": ["stream", "sample_data/stream.jsonl", *CONFIG],
    "stream-sse": ["stream", "sample_data/stream.jsonl", *CONFIG, "--format", "sse"],
    "stream-assembled": ["stream", "sample_data/stream.jsonl", *CONFIG, "--format", "assembled", "-j", "1"],
    "stream-replay": ["stream", "sample_data/stream.jsonl", *CONFIG, "--mode", "replay"],
    "stream-capture": ["stream", "sample_data/generate_capture.sse", "--requests", "sample_data/requests.jsonl", *CONFIG],
    "parity": ["parity", "sample_data/stream.jsonl", *CONFIG, "--paths", "oneshot,replay,live"],
    "diff": ["diff", "sample_data/chat.jsonl", "sample_data/chat_errors.jsonl"],
    "usage-error": ["chat", "sample_data/chat.jsonl", "--no-such-flag"],
    "missing-input": ["chat", "no/such/input.jsonl", *CONFIG],
    "bad-parser": ["chat", "sample_data/chat.jsonl", *CONFIG, "--tool-call-parser", "no-such-parser"],
}
ENGINE_CALLS = {"chat", "chat-errors", "completion", "stream-jsonl", "stream-sse", "stream-assembled",
                "stream-replay", "stream-capture"}  # fmt: skip


@pytest.mark.parametrize("name", CALLS)
def test_a_warm_call_answers_as_a_fresh_process(name: str, server: Server) -> None:
    fresh = server.fresh_results.get(name) or server.run(*CALLS[name], fresh=True)
    server.fresh_results[name] = fresh
    before = server.served()
    warm = server.run(*CALLS[name])
    assert server.served() == before + 1, "the call did not run on the server"
    assert warm.returncode == fresh.returncode, warm.stderr.decode()
    assert normalized_bytes(warm.stdout) == normalized_bytes(fresh.stdout)
    assert summary_shape(warm.stderr) == summary_shape(fresh.stderr)
    if name in ENGINE_CALLS:
        assert b"start-up: model (warm)" in warm.stderr
        assert b"(warm)" not in fresh.stderr


def test_the_exit_statuses_are_the_fresh_ones(server: Server) -> None:
    statuses = {name: result.returncode for name, result in server.fresh_results.items()}
    if len(statuses) < len(CALLS):
        pytest.skip("needs the comparisons above")
    # 0 fine, 1 some records failed (or divergences), 2 usage.
    assert statuses["chat"] == 0 and statuses["chat-errors"] == 1
    assert statuses["usage-error"] == statuses["missing-input"] == statuses["bad-parser"] == 2


def test_files_are_written_as_by_a_fresh_process(server: Server, tmp_path: Path) -> None:
    fresh = server.run(*CALLS["stream-sse"], "-o", str(tmp_path / "fresh") + "/", fresh=True)
    warm = server.run(*CALLS["stream-sse"], "-o", str(tmp_path / "warm") + "/")
    assert fresh.returncode == warm.returncode == 0, warm.stderr.decode()
    names = sorted(path.name for path in (tmp_path / "fresh").iterdir())
    assert names and names == sorted(path.name for path in (tmp_path / "warm").iterdir())
    for name in names:
        assert (tmp_path / "warm" / name).stat().st_mode == (tmp_path / "fresh" / name).stat().st_mode
        assert normalized_bytes((tmp_path / "warm" / name).read_bytes()) == normalized_bytes((tmp_path / "fresh" / name).read_bytes())


def test_render_and_render_prompts_run_warm(server: Server) -> None:
    """`derender render` and ``--render-prompts`` on the warm server, which
    builds the engine's render half for them: the output, exit status and
    summary of a fresh process."""
    sample = [json.loads(line) for line in (REPO / "sample_data" / "chat.jsonl").read_bytes().splitlines()]
    requests = "".join(json.dumps({**b["chat_request"], "request_id": b["generate_response"]["request_id"]}) + "\n" for b in sample)
    bare = "".join(json.dumps({k: v for k, v in b.items() if k != "prompt_token_ids"}) + "\n" for b in sample)
    for args, data in ((["render", "chat", "-", *CONFIG], requests), (["chat", "-", "--render-prompts", *CONFIG], bare)):
        fresh = server.run(*args, fresh=True, input=data.encode())
        before = server.served()
        warm = server.run(*args, input=data.encode())
        assert server.served() == before + 1, "the call did not run on the server"
        assert warm.returncode == fresh.returncode == 0, warm.stderr.decode()
        assert normalized_bytes(warm.stdout) == normalized_bytes(fresh.stdout)
        assert summary_shape(warm.stderr) == summary_shape(fresh.stderr)
        assert b"start-up: model (warm)" in warm.stderr


def test_stdin_is_the_callers(server: Server) -> None:
    data = (REPO / "sample_data" / "chat.jsonl").read_bytes()
    fresh = server.fresh_results.get("chat") or server.run(*CALLS["chat"], fresh=True)
    warm = server.run("chat", "-", *CONFIG, input=data)
    assert warm.returncode == 0, warm.stderr.decode()
    assert normalized_bytes(warm.stdout) == normalized_bytes(fresh.stdout)


def test_no_server_bypasses_it(server: Server) -> None:
    before = server.served()
    bypassed = server.run(*CALLS["diff"], "--no-server")
    # Two files of bodies, not answers: diff says so (exit 4), fresh.
    assert bypassed.returncode == 4 and server.served() == before


def test_paths_that_cannot_run_warm_run_fresh_and_say_why(server: Server) -> None:
    before = server.served()
    serve = server.run("chat", "sample_data/chat.jsonl", *CONFIG, "--flavor", "serve", "-v")
    assert serve.returncode == 0, serve.stderr.decode()[-2000:]
    assert b"running fresh, not on the warm server: --flavor serve" in serve.stderr
    assert server.served() == before
    assert len(serve.stdout.splitlines()) == 4


def test_head_closes_the_pipe_as_for_a_fresh_process(server: Server, big_input: Path) -> None:
    done = subprocess.run(
        ["bash", "-c", f'set -o pipefail; "{CLI}" chat {big_input} {" ".join(CONFIG)} | head -c 300 >/dev/null; echo "$?"'],
        capture_output=True, cwd=REPO, env=server.env, timeout=300,
    )  # fmt: skip
    assert done.stdout.strip() == b"141", done.stderr.decode()
    assert b"Traceback" not in done.stderr


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_to_the_client_stops_the_run_as_a_fresh_one(
    signum: int, status: int, server: Server, big_input: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out.jsonl"
    client = server.popen("chat", str(big_input), *CONFIG, "-j", "1", "-o", str(out))
    assert wait_until(lambda: out.exists() and out.stat().st_size > 0, 120), client.stderr.read().decode()  # type: ignore[union-attr]
    client.send_signal(signum)
    _, stderr = client.communicate(timeout=120)
    assert client.returncode == status, stderr.decode()
    assert f"stopped by {signal.Signals(signum).name}".encode() in stderr
    lines = out.read_bytes().splitlines()
    assert 0 < len(lines) < 16000
    assert all(json.loads(line)["object"] == "chat.completion" for line in lines)


def _on_a_terminal(server: Server, args: list[str], fresh: bool) -> tuple[int, bytes]:
    """Run with stderr on a pseudo-terminal; the exit status and what the
    terminal showed."""
    master, slave = os.openpty()
    env = {**server.env, "TERM": "xterm", "COLUMNS": "120"}
    if fresh:
        env["DERENDER_NO_SERVER"] = "1"
    client = subprocess.Popen([CLI, *args], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    shown = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: every writer closed the terminal
            break
        if not chunk:
            break
        shown += chunk
    os.close(master)
    return client.wait(timeout=300), shown


def test_the_progress_display_reaches_the_callers_terminal(server: Server, big_input: Path) -> None:
    args = ["chat", str(big_input), *CONFIG, "-j", "1", "-o", os.devnull]
    fresh_status, fresh_shown = _on_a_terminal(server, args, fresh=True)
    warm_status, warm_shown = _on_a_terminal(server, args, fresh=False)
    assert fresh_status == warm_status == 0
    # The live display (cursor control, a bar) on the terminal, as fresh.
    for shown in (fresh_shown, warm_shown):
        assert b"\x1b[" in shown and b"records" in shown, shown[-500:]
    assert b"model (warm)" in warm_shown


def test_the_callers_cpus_are_the_calls(server: Server) -> None:
    """`-j`'s default counts the CPUs the caller may use, not the server's."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs")
    one_cpu = server.run(*CALLS["chat"], preexec_fn=lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}))
    all_cpus = server.run(*CALLS["chat"])
    assert one_cpu.returncode == all_cpus.returncode == 0
    assert b"model (warm)" in one_cpu.stderr and b"workers" not in one_cpu.stderr
    assert f"{len(os.sched_getaffinity(0))} workers".encode() in all_cpus.stderr


def test_two_concurrent_clients(server: Server) -> None:
    expected = {name: server.fresh_results.get(name) or server.run(*CALLS[name], fresh=True) for name in ("chat", "stream-sse")}
    clients = {name: server.popen(*CALLS[name]) for name in expected}
    for name, client in clients.items():
        stdout, stderr = client.communicate(timeout=300)
        assert client.returncode == 0, stderr.decode()
        assert normalized_bytes(stdout) == normalized_bytes(expected[name].stdout)
        assert b"model (warm)" in stderr


def _linked_socket(server: Server, directory: Path, mode: int) -> None:
    directory.mkdir()
    os.link(server.directory / SOCKET_NAME, directory / SOCKET_NAME)
    directory.chmod(mode)


def test_a_directory_others_can_open_is_not_trusted(server: Server, tmp_path: Path) -> None:
    """The server's own socket, reached through a directory other users
    could have planted it in: the client does not connect."""
    exposed = tmp_path / "exposed"
    _linked_socket(server, exposed, 0o755)
    before = server.served()
    # A usage error runs fresh in a second; -v asks why it was not warm.
    done = server.run(*CALLS["usage-error"], "-v", env={**server.env, "DERENDER_SERVER_DIR": str(exposed)})
    assert done.returncode == 2
    assert b"running fresh, not on the warm server:" in done.stderr and b"open to other users" in done.stderr
    assert server.served() == before


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to own files as another user")
def test_another_users_socket_is_refused(server: Server, tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    _linked_socket(server, theirs, 0o700)
    os.chown(theirs, 65534, 65534)
    before = server.served()
    done = server.run(*CALLS["usage-error"], "-v", env={**server.env, "DERENDER_SERVER_DIR": str(theirs)})
    assert done.returncode == 2
    assert b"belongs to uid 65534" in done.stderr
    assert server.served() == before


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to connect as another user")
def test_the_server_refuses_another_users_connection(server: Server, tmp_path: Path) -> None:
    """A peer of another uid that reaches the socket (here through a
    directory and socket opened up on purpose) is refused by the server's
    own check (SO_PEERCRED), before it reads anything."""
    # pytest's own temporary directories are the user's alone.
    reachable = Path(tempfile.mkdtemp(prefix="derender-test-reachable-")) / "server"
    reachable.parent.chmod(0o711)
    _linked_socket(server, reachable, 0o711)
    socket_path = reachable / SOCKET_NAME
    socket_path.chmod(0o666)
    read_end, write_end = os.pipe()
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports through the pipe
            try:
                import socket as sockets

                os.setgid(65534)
                os.setuid(65534)
                with sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM) as sock:
                    sock.settimeout(10)
                    sock.connect(str(socket_path))
                    with open(os.devnull, "rb") as devnull:
                        try:
                            send_message(sock, {"protocol": 1, "command": "call", "argv": ["diff"]}, [devnull.fileno()])
                        except OSError:
                            pass
                    os.write(write_end, sock.makefile("rb").readline())
            except BaseException as exc:
                os.write(write_end, repr(exc).encode())
            finally:
                os._exit(0)
        os.close(write_end)
        write_end = -1
        reply = b""
        while chunk := os.read(read_end, 4096):
            reply += chunk
        os.waitpid(pid, 0)
    finally:
        socket_path.chmod(0o600)
        shutil.rmtree(reachable.parent)
        os.close(read_end)
        if write_end >= 0:
            os.close(write_end)
    assert json.loads(reply)["event"] == "refused", reply
    assert server.status() is not None


def test_a_server_killed_mid_call_then_a_stale_socket_then_the_idle_exit(tmp_path: Path, big_input: Path) -> None:
    own = Server(tmp_path / "own", server_env(tmp_path / "own"))
    pid = own.start("--idle-timeout", "0")
    out = tmp_path / "out.jsonl"
    client = own.popen("chat", str(big_input), *CONFIG, "-j", "2", "-o", str(out))
    assert wait_until(lambda: out.exists() and out.stat().st_size > 0, 120), client.stderr.read().decode()  # type: ignore[union-attr]
    state = own.status()
    assert state is not None
    (child,) = state["children"]
    workers = children_of(child)
    os.kill(pid, signal.SIGKILL)
    _, stderr = client.communicate(timeout=60)
    assert client.returncode == 3, stderr.decode()
    assert b"the warm server went away mid-call" in stderr
    # Nothing of the call lives on: its child and the child's workers.
    assert wait_until(lambda: not any(alive(p) for p in [child, *workers]), 30), [child, *workers]

    # The socket it left answers nobody: the client runs fresh, and says why.
    assert (own.directory / SOCKET_NAME).exists()
    stale = own.run(*CALLS["chat"], "-v")
    assert stale.returncode == 0
    assert b"running fresh, not on the warm server: stale server socket" in stale.stderr
    assert len(stale.stdout.splitlines()) == 4
    assert own.run("server", "status").returncode == 1

    # A new server takes the stale socket's place, and exits when idle.
    pid = own.start("--idle-timeout", "3s")
    assert alive(pid)
    assert wait_until(lambda: not alive(pid), 60)
    assert not (own.directory / SOCKET_NAME).exists()
    assert own.run("server", "status").returncode == 1


def _in_a_shell(server: Server, script: str, *, fresh: bool, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[bytes]:
    """`script` in bash, ``$DERENDER`` the client: redirections and
    ``ulimit`` as a user types them. A hang fails the test (timeout)."""
    env = {**(env or server.env), "DERENDER": CLI}
    if fresh:
        env["DERENDER_NO_SERVER"] = "1"
    return subprocess.run(["bash", "-c", script], capture_output=True, cwd=REPO, env=env, timeout=120)


def _same_as_fresh(server: Server, script: str, tmp_path: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[bytes]:
    """Run `script` fresh, then warm (on the server), each writing into a
    directory of its own (``$OUT``): the same exit status, stdout, stderr
    and files. The warm run's result."""
    results = {}
    for mode in ("fresh", "warm"):
        out = tmp_path / mode
        out.mkdir()
        before = server.served()
        results[mode] = _in_a_shell(server, script, fresh=mode == "fresh", env={**(env or server.env), "OUT": str(out)})
        assert server.served() == before + (mode == "warm"), f"{mode}: {results[mode].stderr.decode()}"
    fresh, warm = results["fresh"], results["warm"]
    assert warm.returncode == fresh.returncode, (fresh.stderr.decode(), warm.stderr.decode())
    assert normalized_bytes(warm.stdout) == normalized_bytes(fresh.stdout)
    assert summary_shape(warm.stderr.replace(bytes(tmp_path / "warm"), b"$OUT")) == summary_shape(
        fresh.stderr.replace(bytes(tmp_path / "fresh"), b"$OUT")
    )
    assert b"Traceback" not in warm.stderr + fresh.stderr
    names = sorted(path.name for path in (tmp_path / "fresh").iterdir())
    assert names == sorted(path.name for path in (tmp_path / "warm").iterdir())
    for name in names:
        assert normalized_bytes((tmp_path / "warm" / name).read_bytes()) == normalized_bytes((tmp_path / "fresh" / name).read_bytes())
    return warm


@pytest.mark.parametrize(
    ("script", "status", "message"),
    [
        ('"$DERENDER" chat - --config sample_data/qwen3.yaml -o "$OUT/o.jsonl" <&-', 2, b"cannot read stdin: it is closed"),
        ('"$DERENDER" chat sample_data/chat_errors.jsonl --config sample_data/qwen3.yaml -j 1 -o "$OUT/o.jsonl" 2>&-', 1, b""),
        ('"$DERENDER" chat sample_data/chat.jsonl --config sample_data/qwen3.yaml >&-', 2, b"cannot write stdout: it is closed"),
    ],
    ids=["stdin", "stderr", "stdout"],
)
def test_a_closed_standard_descriptor_is_closed_in_the_call(
    server: Server, tmp_path: Path, script: str, status: int, message: bytes
) -> None:
    """The client's socket never takes the place of a closed stdin, stdout
    or stderr, and the call's child has them closed as a fresh process
    does: the same answer, at once (no hang, no SIGTERM)."""
    warm = _same_as_fresh(server, script, tmp_path)
    assert warm.returncode == status, warm.stderr.decode()
    assert message in warm.stderr
    if status == 1:  # stderr closed: the summary went nowhere, the answers to the file
        assert warm.stderr == b""
        assert len((tmp_path / "warm" / "o.jsonl").read_bytes().splitlines()) == 5


@pytest.mark.parametrize(
    ("script", "status", "message"),
    [
        ('ulimit -n 96; "$DERENDER" chat sample_data/chat.jsonl --config sample_data/qwen3.yaml -j 8', 2,
         b"the open-file limit (ulimit -n) is 96"),
        # About 128 KB of answers under a 100 KB limit; the manifest (a path-dependent
        # kilobyte or so, written first) fits, so the answers are what hit it.
        ('for _ in $(seq 60); do cat sample_data/chat.jsonl; done > "$OUT/../in.jsonl"; ulimit -f 100; '
         '"$DERENDER" chat "$OUT/../in.jsonl" --config sample_data/qwen3.yaml -j 1 -o "$OUT/o.jsonl"', 3,
         b"File too large"),
    ],
    ids=["open-files", "file-size"],
)
def test_the_callers_resource_limits_are_the_calls(server: Server, tmp_path: Path, script: str, status: int, message: bytes) -> None:
    warm = _same_as_fresh(server, script, tmp_path)
    assert warm.returncode == status, warm.stderr.decode()
    assert message in warm.stderr


def test_a_signal_the_caller_ignores_stays_ignored(server: Server, tmp_path: Path) -> None:
    """A background job in a script starts with SIGINT ignored: Ctrl-C's
    signal reaches the warm call as it would a fresh one, and is ignored."""
    records = (REPO / "sample_data" / "chat.jsonl").read_bytes() * 500
    (tmp_path / "in.jsonl").write_bytes(records)
    out = tmp_path / "out.jsonl"
    client = server.popen(
        "chat", str(tmp_path / "in.jsonl"), *CONFIG, "-j", "1", "-o", str(out),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )  # fmt: skip
    assert wait_until(lambda: out.exists() and out.stat().st_size > 0, 120), client.stderr.read().decode()  # type: ignore[union-attr]
    client.send_signal(signal.SIGINT)
    _, stderr = client.communicate(timeout=120)
    assert client.returncode == 0, stderr.decode()
    assert b"model (warm)" in stderr and b"stopped by" not in stderr
    assert len(out.read_bytes().splitlines()) == 2000


@pytest.mark.parametrize("variable", ["XDG_CACHE_HOME", "HOME"])
def test_another_cache_home_runs_fresh_and_says_why(server: Server, tmp_path: Path, variable: str) -> None:
    """Where huggingface_hub looks for a Hub id is settled when it is
    imported, from these: the server's would not be the caller's."""
    before = server.served()
    done = server.run(*CALLS["usage-error"], "-v", env={**server.env, variable: str(tmp_path)})
    assert done.returncode == 2
    assert f"running fresh, not on the warm server: the server was started with other {variable}".encode() in done.stderr
    assert server.served() == before


def test_a_memory_limit_the_server_cannot_take_on_runs_fresh_and_says_why(server: Server, tmp_path: Path) -> None:
    """``ulimit -v``: the server's memory is mapped already, so its child
    cannot run under the caller's limit as a fresh process would."""
    before = server.served()
    done = _in_a_shell(server, 'ulimit -v 50000000; "$DERENDER" chat sample_data/chat.jsonl --no-such-flag -v', fresh=False)
    assert done.returncode == 2
    assert b"running fresh, not on the warm server: the call's RLIMIT_AS (51200000000)" in done.stderr
    assert server.served() == before


def test_other_code_runs_fresh_and_says_why(server: Server, tmp_path: Path) -> None:
    """PYTHONPATH at another copy of derender (as an editable install edited
    since the server started): the call runs that code, fresh."""
    copy = tmp_path / "code"
    shutil.copytree(REPO / "derender_core", copy / "derender_core", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "cli", copy / "derender_cli", ignore=shutil.ignore_patterns("__pycache__"))
    progress = copy / "derender_cli" / "progress.py"
    progress.write_text(progress.read_text().replace('f"derender: {total.records} records', 'f"derender (edited): {total.records} records'))
    before = server.served()
    done = server.run(*CALLS["chat"], "-v", env={**server.env, "PYTHONPATH": str(copy)})
    assert done.returncode == 0, done.stderr.decode()
    assert b"running fresh, not on the warm server: the server runs other code than this call would" in done.stderr
    assert b"derender (edited): 4 records" in done.stderr
    assert server.served() == before


def test_a_model_file_edited_in_place_gets_an_engine_of_its_own(server: Server, tmp_path: Path) -> None:
    """`rsync --inplace -t` rewrites a file keeping its size, mtime and
    inode: the server keys engines by content, and shows each by its real
    path (here behind a link)."""
    model = tmp_path / "qwen3"
    shutil.copytree(REPO / "sample_data" / "qwen3", model)
    (tmp_path / "link").symlink_to(model)
    call = ["chat", "sample_data/chat.jsonl", *CONFIG, "--model", str(tmp_path / "link"), "-j", "1"]
    first = server.run(*call)
    assert first.returncode == 0, first.stderr.decode()
    config = model / "config.json"
    info = config.stat()
    text = config.read_bytes()
    edited = text.replace(b'"max_position_embeddings": 40960', b'"max_position_embeddings":    16')
    assert edited != text and len(edited) == len(text)
    with open(config, "r+b") as in_place:
        in_place.write(edited)
    os.utime(config, ns=(info.st_atime_ns, info.st_mtime_ns))
    assert (config.stat().st_size, config.stat().st_mtime_ns, config.stat().st_ino) == (info.st_size, info.st_mtime_ns, info.st_ino)
    second = server.run(*call)
    assert second.returncode == 1, second.stderr.decode()
    assert b"exceeds max_model_len (16)" in second.stderr and b"model (warm)" in second.stderr
    shown = server.run("server", "status").stdout.decode()
    assert f"    {model.resolve()} " in shown and str(tmp_path / "link") not in shown


def test_stop_leaves_no_process_behind(server: Server, big_input: Path, tmp_path: Path) -> None:
    """Last in the module: it stops the shared server, mid-call."""
    state = server.status()
    assert state is not None
    pid = int(state["pid"])
    out = tmp_path / "out.jsonl"
    client = server.popen("chat", str(big_input), *CONFIG, "-j", "2", "-o", str(out))
    assert wait_until(lambda: out.exists() and out.stat().st_size > 0, 120)
    running = server.status()
    assert running is not None and running["children"]
    stopped = server.run("server", "stop", timeout=60)
    assert stopped.returncode == 0, stopped.stderr.decode()
    _, stderr = client.communicate(timeout=60)
    assert client.returncode == 143, stderr.decode()  # the call was stopped as by SIGTERM
    assert not alive(pid)
    assert not children_of(pid)
    assert not (server.directory / SOCKET_NAME).exists()
    assert server.run("server", "status").returncode == 1
