"""``derender server start | status | stop``: the warm server's commands.

They start the server process (``python -m derender_cli.server``, in
`server`) and talk to it over its socket (`wire`); they import nothing of
the server itself, so the command line (`main`) can offer them while the
server imports the command line to run its calls.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from typing import Annotated

import typer

from .wire import (
    LOG_NAME,
    NO_SERVER_VARIABLE,
    SOCKET_NAME,
    check_directory,
    request,
    say,
    server_directory,
)

DEFAULT_IDLE_TIMEOUT = "30m"
DEFAULT_ENGINES = 2


def parse_duration(text: str) -> float:
    """Seconds in ``90``, ``90s``, ``15m``, ``2h``; 0 means never."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if not match:
        raise ValueError(f"not a duration: {text!r} (e.g. 90s, 15m, 2h, 0 for never)")
    return float(match[1]) * {"": 1, "s": 1, "m": 60, "h": 3600}[match[2]]


def _prepare_directory(directory: str) -> str | None:
    """Create the socket directory, owner-only; why it cannot be used."""
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
    except OSError as exc:
        return f"cannot create {directory}: {exc.strerror}"
    info = os.lstat(directory)
    if info.st_uid == os.getuid() and info.st_mode & 0o077:
        os.chmod(directory, 0o700)
    return check_directory(directory)


def start(idle_timeout: str, engines: int, wait: float = 600.0) -> int:
    """Start the server in the background; return once it answers."""
    try:
        idle = parse_duration(idle_timeout)
    except ValueError as exc:
        say(f"derender: error: --idle-timeout: {exc}")
        return 2
    directory = server_directory()
    problem = _prepare_directory(directory)
    if problem:
        say(f"derender: error: cannot start the server: {problem}")
        return 2
    running = request({"command": "status"})
    if running is not None:
        say(f"derender: a server already runs (pid {running['pid']}, {running['socket']})")
        return 0
    ready_r, ready_w = os.pipe()
    env = {k: v for k, v in os.environ.items() if k != NO_SERVER_VARIABLE}
    with open(os.path.join(directory, LOG_NAME), "ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "derender_cli.server", directory, str(idle), str(engines), str(ready_w)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            pass_fds=(ready_w,),
            start_new_session=True,
            env=env,
            cwd="/",
        )
    os.close(ready_w)
    with os.fdopen(ready_r, "rb") as ready:
        # The server writes one line once it listens, or dies trying.
        line = ready.readline()
    if not line.startswith(b"ready"):
        process.wait(timeout=wait)
        say(
            f"derender: error: the server did not start (exit {process.returncode}); "
            f"see {os.path.join(directory, LOG_NAME)}"
        )
        return 3
    say(
        f"derender: server ready (pid {process.pid}, {os.path.join(directory, SOCKET_NAME)}, "
        f"idle timeout {idle_timeout if idle else 'none'})"
    )
    return 0


def status() -> int:
    """Print the running server's state; exit 0 only while one runs."""
    state = request({"command": "status"})
    if state is None:
        say("derender: no server running")
        return 1
    print(
        f"derender server: pid {state['pid']}, {state['socket']}\n"
        f"  up {state['uptime_seconds']:.0f} s, idle {state['idle_seconds']:.0f} s "
        f"(exits after {state['idle_timeout_seconds']:.0f} s idle; 0 = never), "
        f"RSS {state['rss_mib']:.0f} MiB\n"
        f"  calls: {state['calls_served']} served, {state['calls_running']} running; "
        f"derender {state['versions']['derender']}, vLLM {state['versions']['vllm']}\n"
        f"  engines held: {len(state['engines'])} of at most {state['max_engines']}"
    )
    for engine in state["engines"]:
        settings = json.dumps(engine["settings"], default=str)
        print(
            f"    {engine['model']} {settings}: built in {engine['build_seconds']:.1f} s, "
            f"{engine['calls']} calls, idle {engine['idle_seconds']:.0f} s"
        )
    return 0


def stop(wait: float = 10.0) -> int:
    """Stop the server and its children; return once they are gone."""
    reply = request({"command": "stop"})
    if reply is None:
        say("derender: no server running")
        return 0
    pid = int(reply["pid"])
    deadline = time.monotonic() + wait
    while process_alive(pid):
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            break
        time.sleep(0.05)
    say(f"derender: server stopped (pid {pid})")
    return 0


def process_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, ended but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat_file:
            return stat_file.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


# --- the `derender server` commands -------------------------------------------------

server_app = typer.Typer(
    name="server",
    help=(
        "A per-user warm server for shell pipelines: it keeps vLLM imported and built "
        "engines in memory, and answers every chat, completion, stream, render, parity and diff "
        "call while it runs (pass --no-server, or set DERENDER_NO_SERVER=1, to run one "
        "fresh). Output and exit statuses are a fresh process's."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


@server_app.command("start")
def server_start(
    idle_timeout: Annotated[
        str,
        typer.Option("--idle-timeout", metavar="DURATION", help="Exit after this long without calls: 90s, 15m, 2h; 0 never."),
    ] = DEFAULT_IDLE_TIMEOUT,
    engines: Annotated[
        int,
        typer.Option("--engines", min=1, metavar="N", help="Built engines kept (least recently used out first); each holds a tokenizer, ~1.4 GB for Qwen3."),
    ] = DEFAULT_ENGINES,
) -> None:
    """Start the server in the background; returns once it answers."""
    raise typer.Exit(start(idle_timeout, engines))


@server_app.command("status")
def server_status() -> None:
    """Show the engines held, memory and idle time; exit 0 only while a server runs."""
    raise typer.Exit(status())


@server_app.command("stop")
def server_stop() -> None:
    """Stop the server and every call it is answering."""
    raise typer.Exit(stop())
