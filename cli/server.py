"""`derender server`: a per-user warm server for shell pipelines.

A fresh `derender` pays vLLM's imports and the engine build on every call;
this process pays them once. It listens on a Unix socket in a directory
only its user can open (`entry.server_directory`), takes each call from
`entry.forward` with the caller's stdin, stdout and stderr, and forks a
child per call that runs the ordinary command line on those descriptors,
with an engine already built for the call's settings (`main.warm_engines`).
The child's exit status (or signal) goes back to the client.

Engines are kept by everything that shapes an answer (`engine_key`): the
render settings, the identity of the model, tokenizer and chat template
files, and the derender and vLLM versions; at most ``--engines`` of them,
least recently used first out. Calls that cannot run from a fork (the
serve flavor's live engine core, Ray) are sent back to run fresh.

Single-threaded on purpose: every fork happens from the one thread, so no
lock can be held by a thread the child lacks.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import json
import os
import re
import resource
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time
import traceback
from collections import OrderedDict
from typing import Annotated, Any

import typer

from .entry import (
    _HEADER,
    NO_SERVER_VARIABLE,
    PROTOCOL,
    SOCKET_NAME,
    check_directory,
    request,
    server_directory,
    versions,
)

DEFAULT_IDLE_TIMEOUT = "30m"
DEFAULT_ENGINES = 2
PIDFILE_NAME = "server.pid"
LOG_NAME = "server.log"
# Settings vLLM, transformers and torch read when imported: the server
# imported them with its own, so a call with other values runs fresh.
IMPORT_TIME_VARIABLES = re.compile(r"^(VLLM_|HF_|HUGGINGFACE_|TRANSFORMERS_|TORCH|TIKTOKEN_|OMP_|MKL_|CUDA_)")
_PR_SET_PDEATHSIG = 1


def parse_duration(text: str) -> float:
    """Seconds in ``90``, ``90s``, ``15m``, ``2h``; 0 means never."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if not match:
        raise ValueError(f"not a duration: {text!r} (e.g. 90s, 15m, 2h, 0 for never)")
    return float(match[1]) * {"": 1, "s": 1, "m": 60, "h": 3600}[match[2]]


def engine_key(config: Any, cwd: str) -> tuple[str, ...]:
    """Everything that shapes the answers of an engine built from `config`
    in `cwd`: the settings, the model files' identity, the versions."""
    identity: list[str] = [repr(config)]
    for role, value in (("model", config.model), ("tokenizer", config.tokenizer), ("chat_template", config.chat_template)):
        if not value:
            continue
        path = os.path.join(cwd, value)
        if role != "chat_template" and not os.path.exists(path):
            # A Hub id: its snapshot in the cache (the commit is in the path).
            from derender_core import DerenderError

            with contextlib.suppress(DerenderError), _working_directory(cwd):
                path = str(config.local_dirs()[role])
        if os.path.isdir(path):
            identity.append(os.path.realpath(path))
            with os.scandir(path) as entries:
                for entry in sorted(entries, key=lambda e: e.name):
                    with contextlib.suppress(OSError):
                        info = entry.stat()
                        identity.append(f"{entry.name}:{info.st_size}:{info.st_mtime_ns}:{info.st_ino}")
        elif os.path.isfile(path):
            info = os.stat(path)
            identity.append(f"{os.path.realpath(path)}:{info.st_size}:{info.st_mtime_ns}:{info.st_ino}")
    identity += [f"{name} {version}" for name, version in sorted(versions().items())]
    return tuple(identity)


@dataclasses.dataclass
class Plan:
    """What the server makes of a call before forking for it."""

    config: Any | None = None
    """The settings of the engine the call builds, when it builds one."""
    fresh: str | None = None
    """Why the call must run fresh instead."""
    renders: bool = False
    """The call renders requests (`derender render`, ``--render-prompts``):
    the engine's render half is built here, once, for every child."""


def plan_call(argv: list[str]) -> Plan:
    """Parse the call as the command line will, without running it.

    Anything unparsable is left to the child, which reports it exactly as a
    fresh process would.
    """
    import typer.main

    from derender_core.parity import PATHS

    from . import main as cli
    from .options import RENDER_OPTIONS, render_config

    group = typer.main.get_command(cli.app)
    name, rest = argv[0], argv[1:]  # the client forwards only `derender COMMAND ...`
    try:
        context = group.make_context("derender", list(argv), resilient_parsing=True)
        command = group.get_command(context, name)  # type: ignore[attr-defined]
        if hasattr(command, "get_command") and rest:
            # `render chat ...`: the command is one level down.
            context = command.make_context(name, list(rest), parent=context, resilient_parsing=True)
            name, rest = rest[0], rest[1:]
            command = command.get_command(context, name)
            renders = True
        else:
            renders = False
        if command is None:
            return Plan()
        params = command.make_context(name, rest, parent=context, resilient_parsing=True).params
    except Exception:
        return Plan()
    if name == "diff":
        return Plan()
    if getattr(params.get("flavor"), "value", params.get("flavor")) == "serve":
        return Plan(fresh="--flavor serve drives a live vLLM engine core, which a fork does not carry")
    if params.get("ray"):
        return Plan(fresh="--ray runs on a Ray cluster")
    if name == "parity":
        paths = ",".join(params.get("paths") or PATHS)
        if "serve" in paths:
            return Plan(fresh="parity's serve paths drive a live vLLM engine core (--paths oneshot,replay,live runs warm)")
    flags = {option: params.get(option) for option in RENDER_OPTIONS if option != "config"}
    # click gives a repeatable option as a tuple, () when not given.
    flags = {key: (list(value) or None) if isinstance(value, tuple) else value for key, value in flags.items()}
    try:
        return Plan(config=render_config(params.get("config"), flags), renders=renders or bool(params.get("render_prompts")))
    except Exception:
        return Plan()


@dataclasses.dataclass
class Held:
    """An engine the server keeps."""

    engine: Any
    config: Any
    build_seconds: float
    last_used: float
    calls: int = 0


@dataclasses.dataclass
class Call:
    """A call being answered by a child."""

    conn: socket.socket
    pid: int


class WarmServer:
    def __init__(self, directory: str, idle_timeout: float, max_engines: int) -> None:
        self.directory = directory
        self.idle_timeout = idle_timeout
        self.max_engines = max(1, max_engines)
        self.path = os.path.join(directory, SOCKET_NAME)
        self.engines: OrderedDict[tuple[str, ...], Held] = OrderedDict()
        self.calls: dict[int, Call] = {}
        self.started = time.time()
        self.last_activity = time.monotonic()
        self.served = 0
        self.stopping = False
        self.environment: dict[str, str] = {}
        """The import-time settings vLLM and torch run with here (`warm_up`)."""
        self.versions = versions()
        self.selector = selectors.DefaultSelector()
        self.listener: socket.socket | None = None
        self.wakeup_r, self.wakeup_w = os.pipe()

    # -- set-up ---------------------------------------------------------

    def bind(self) -> None:
        """Listen, replacing a socket no server answers on."""
        if os.path.exists(self.path):
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(self.path)
            except OSError:
                os.unlink(self.path)
            else:
                raise RuntimeError(f"a server already listens on {self.path}")
            finally:
                probe.close()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.path)
        os.chmod(self.path, 0o600)
        listener.listen(64)
        listener.setblocking(False)
        self.listener = listener
        self.selector.register(listener, selectors.EVENT_READ, "accept")
        os.set_blocking(self.wakeup_w, False)
        os.set_blocking(self.wakeup_r, False)
        signal.set_wakeup_fd(self.wakeup_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, lambda *_: self._request_stop())
        signal.signal(signal.SIGINT, lambda *_: self._request_stop())
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        self.selector.register(self.wakeup_r, selectors.EVENT_READ, "wakeup")
        with open(os.path.join(self.directory, PIDFILE_NAME), "w") as pidfile:
            pidfile.write(f"{os.getpid()}\n")

    def warm_up(self) -> None:
        """Import what every call needs (the command line, vLLM's stack),
        with the collector held off, then freeze it all."""
        # Before vLLM and torch import, which set some for themselves.
        self.environment = _import_time_settings(os.environ)
        from derender_core.vllm_seam import stack

        with stack.lean_start():
            from . import main  # noqa: F401

            stack.prepare_environment()
            from derender_core.vllm_seam import render

            render.import_ahead()

    # -- the loop -------------------------------------------------------

    def serve_forever(self) -> None:
        self.last_activity = time.monotonic()  # idle from now, not from before the warm-up
        while True:
            self._reap()
            if self.stopping:
                break
            idle = not self.calls and time.monotonic() - self.last_activity
            if self.idle_timeout and idle and idle > self.idle_timeout:
                print(f"derender server: idle for {self.idle_timeout:.0f} s, exiting", file=sys.stderr)
                break
            for key, _ in self.selector.select(timeout=1.0):
                if key.data == "accept":
                    self._accept()
                elif key.data == "wakeup":
                    with contextlib.suppress(BlockingIOError):
                        os.read(self.wakeup_r, 4096)
                else:
                    self._client_gone(key.data)
        self.shutdown()

    def _request_stop(self) -> None:
        self.stopping = True

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()  # type: ignore[union-attr]
        except BlockingIOError:
            return
        self.last_activity = time.monotonic()
        conn.setblocking(True)
        conn.settimeout(10)
        fds: list[int] = []
        try:
            pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            if uid != os.getuid():
                print(f"derender server: refused a connection from uid {uid} (pid {pid})", file=sys.stderr)
                self._reply(conn, {"event": "refused", "reason": f"this server serves uid {os.getuid()} only"})
                conn.close()
                return
            prefix, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 3)
            if len(prefix) < _HEADER.size:
                raise ValueError("short message")
            (length,) = _HEADER.unpack(prefix)
            data = b""
            while len(data) < length:
                chunk = conn.recv(length - len(data))
                if not chunk:
                    raise ValueError("short message")
                data += chunk
            message = json.loads(data)
        except (OSError, ValueError) as exc:
            print(f"derender server: dropped a connection: {exc}", file=sys.stderr)
            for fd in fds:
                os.close(fd)
            conn.close()
            return
        try:
            self._dispatch(conn, message, fds)
        except Exception:
            traceback.print_exc()
            with contextlib.suppress(OSError):
                self._reply(conn, {"event": "fresh", "reason": "the warm server hit a bug (see its log)"})
            conn.close()
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)

    @staticmethod
    def _reply(conn: socket.socket, message: dict[str, Any]) -> None:
        conn.sendall(json.dumps(message).encode() + b"\n")

    def _dispatch(self, conn: socket.socket, message: dict[str, Any], fds: list[int]) -> None:
        if message.get("protocol") != PROTOCOL:
            self._reply(conn, {"event": "fresh", "reason": "the warm server speaks another protocol: restart it"})
            conn.close()
            return
        command = message.get("command")
        if command == "status":
            self._reply(conn, self.status())
            conn.close()
        elif command == "stop":
            self._reply(conn, {"event": "stopping", "pid": os.getpid()})
            conn.close()
            self.stopping = True
        elif command == "call":
            self._call(conn, message, fds)
        else:
            conn.close()

    def _call(self, conn: socket.socket, message: dict[str, Any], fds: list[int]) -> None:
        self._reply(conn, {"event": "accepted"})
        reason = self._fresh_reason(message)
        plan = Plan(fresh=reason) if reason else self._plan(message)
        if plan.fresh:
            self._reply(conn, {"event": "fresh", "reason": plan.fresh})
            conn.close()
            return
        if plan.config is not None:
            self._engine_for(plan.config, message["cwd"], renders=plan.renders)
        conn.settimeout(None)
        pid = os.fork()
        if pid == 0:
            self._child(conn, message, fds)  # never returns
        self.served += 1
        self.calls[pid] = Call(conn, pid)
        self.selector.register(conn, selectors.EVENT_READ, pid)
        try:
            self._reply(conn, {"event": "started", "pid": pid})
        except OSError:
            self._client_gone(pid)

    def _fresh_reason(self, message: dict[str, Any]) -> str | None:
        if message.get("versions") != self.versions:
            return f"the server runs {self.versions}, this call {message.get('versions')}: restart the server"
        theirs = _import_time_settings(message.get("env", {}))
        differing = sorted(k for k in theirs.keys() | self.environment.keys() if theirs.get(k) != self.environment.get(k))
        if differing:
            return f"the server was started with other {', '.join(differing)}"
        return None

    def _plan(self, message: dict[str, Any]) -> Plan:
        with _working_directory(message["cwd"]):
            return plan_call(message["argv"])

    def _engine_for(self, config: Any, cwd: str, *, renders: bool = False) -> None:
        """Build the engine for `config` unless one is held; a failed build
        is left to the child, which reports it as a fresh process would."""
        from derender_core import DerenderEngine, DerenderError

        try:
            key = engine_key(config, cwd)
        except OSError:
            return
        held = self.engines.get(key)
        if held is None:
            started = time.perf_counter()
            try:
                with _working_directory(cwd):
                    engine = DerenderEngine.build(config)
            except DerenderError as exc:
                print(f"derender server: not kept: {exc}", file=sys.stderr)
                return
            except Exception:
                traceback.print_exc()
                return
            # The children open their own event loops.
            engine.close()
            held = Held(engine, config, time.perf_counter() - started, time.monotonic())
            self.engines[key] = held
            self._evict()
        if renders:
            try:
                held.engine.prepare_render()
            except Exception:
                traceback.print_exc()  # the child builds it, and reports what fails
        self.engines.move_to_end(key)
        held.last_used = time.monotonic()
        held.calls += 1

    def _evict(self) -> None:
        if len(self.engines) <= self.max_engines:
            return
        while len(self.engines) > self.max_engines:
            self.engines.popitem(last=False)
        # The build froze its objects; thaw them so the evicted engine's
        # cycles can be collected, then freeze what is left again.
        gc.unfreeze()
        gc.collect()
        gc.freeze()

    def lookup(self, cwd: str) -> Any:
        """`main.warm_engines` for a child whose call runs in `cwd`."""

        def warm_engines(config: Any) -> Any:
            try:
                held = self.engines.get(engine_key(config, cwd))
            except OSError:
                return None
            if held is None:
                return None
            held.engine.after_fork()
            return held.engine

        return warm_engines

    # -- the child ------------------------------------------------------

    def _child(self, conn: socket.socket, message: dict[str, Any], fds: list[int]) -> None:
        status = 3
        try:
            # The call's own process group, which its workers join: whoever
            # ends the call for good (the client, when this server dies)
            # ends them all.
            os.setpgid(0, 0)
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
            signal.set_wakeup_fd(-1)
            for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
                signal.signal(signum, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            self.selector.close()
            for fd in (self.wakeup_r, self.wakeup_w):
                os.close(fd)
            self.listener.close()  # type: ignore[union-attr]
            for call in self.calls.values():
                call.conn.close()
            conn.close()
            passed = list(message["fds"])
            for target, fd in zip(passed, fds, strict=True):
                os.dup2(fd, target)
                os.close(fd)
            for target in {0, 1, 2} - set(passed):
                os.close(target)
            os.chdir(message["cwd"])
            os.umask(int(message["umask"]))
            with contextlib.suppress(OSError, KeyError, ValueError):
                os.sched_setaffinity(0, message["affinity"])
            with contextlib.suppress(OSError, KeyError, ValueError):
                os.setpriority(os.PRIO_PROCESS, 0, int(message["niceness"]))
            os.environ.clear()
            os.environ.update(message["env"])
            for stream, fd in ((sys.stdout, 1), (sys.stderr, 2)):
                with contextlib.suppress(OSError, ValueError):
                    stream.reconfigure(line_buffering=fd == 2 or os.isatty(fd))  # type: ignore[attr-defined]
            sys.argv = ["derender", *message["argv"]]
            gc.enable()
            status = _run_command_line(message["argv"], self.lookup(message["cwd"]))
        except BaseException:
            with contextlib.suppress(Exception):
                traceback.print_exc()
        finally:
            os._exit(status)

    # -- children and clients --------------------------------------------

    def _reap(self) -> None:
        while self.calls:
            try:
                pid, wait_status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            call = self.calls.pop(pid, None)
            if call is None:
                continue
            self.last_activity = time.monotonic()
            reply: dict[str, Any] = {"event": "exit"}
            if os.WIFSIGNALED(wait_status):
                reply["signal"] = os.WTERMSIG(wait_status)
            else:
                reply["status"] = os.waitstatus_to_exitcode(wait_status)
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(call.conn)
            with contextlib.suppress(OSError):
                self._reply(call.conn, reply)
            call.conn.close()

    def _client_gone(self, pid: int) -> None:
        """The client closed its end mid-call (killed, say): stop its
        child, as the client's own death would have stopped a fresh run."""
        call = self.calls.get(pid)
        if call is None:
            return
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(call.conn)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "event": "status",
            "pid": os.getpid(),
            "socket": self.path,
            "uptime_seconds": time.time() - self.started,
            "idle_seconds": 0.0 if self.calls else now - self.last_activity,
            "idle_timeout_seconds": self.idle_timeout,
            "rss_mib": _rss_mib(),
            "calls_served": self.served,
            "calls_running": len(self.calls),
            "children": sorted(self.calls),
            "max_engines": self.max_engines,
            "versions": self.versions,
            "engines": [
                {
                    "model": held.config.model,
                    "settings": {k: v for k, v in held.config.given().items() if k != "model"},
                    "build_seconds": held.build_seconds,
                    "idle_seconds": now - held.last_used,
                    "calls": held.calls,
                }
                for held in reversed(self.engines.values())
            ],
        }

    def shutdown(self) -> None:
        """End every child, then the server; nothing is left behind."""
        for pid in list(self.calls):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        while self.calls and time.monotonic() < deadline:
            self._reap()
            time.sleep(0.05)
        for pid in list(self.calls):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        while self.calls:
            self._reap()
            time.sleep(0.01)
        for name in (SOCKET_NAME, PIDFILE_NAME):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.directory, name))
        if self.listener is not None:
            self.listener.close()


def _import_time_settings(environ: Any) -> dict[str, str]:
    from derender_core.vllm_seam.stack import environment_with_defaults

    return {k: v for k, v in environment_with_defaults(environ).items() if IMPORT_TIME_VARIABLES.match(k)}


def _run_command_line(argv: list[str], warm_engines: Any) -> int:
    """The command line in this child, as `derender ARGV` would run it;
    its exit status."""
    from . import main as cli

    cli.warm_engines = warm_engines
    try:
        cli.main(argv)
        status = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            status = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            status = 1
    except KeyboardInterrupt:
        # Uncaught in a fresh process: a traceback, then death by SIGINT.
        traceback.print_exc()
        _flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        raise
    _flush()
    return status


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()


@contextlib.contextmanager
def _working_directory(path: str) -> Any:
    previous = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(previous)


def _rss_mib() -> float:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- `derender server start | status | stop` --------------------------------


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
        print(f"derender: error: --idle-timeout: {exc}", file=sys.stderr)
        return 2
    directory = server_directory()
    problem = _prepare_directory(directory)
    if problem:
        print(f"derender: error: cannot start the server: {problem}", file=sys.stderr)
        return 2
    running = request({"command": "status"})
    if running is not None:
        print(f"derender: a server already runs (pid {running['pid']}, {running['socket']})", file=sys.stderr)
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
        print(
            f"derender: error: the server did not start (exit {process.returncode}); "
            f"see {os.path.join(directory, LOG_NAME)}",
            file=sys.stderr,
        )
        return 3
    print(
        f"derender: server ready (pid {process.pid}, {os.path.join(directory, SOCKET_NAME)}, "
        f"idle timeout {idle_timeout if idle else 'none'})",
        file=sys.stderr,
    )
    return 0


def status() -> int:
    """Print the running server's state; exit 0 only while one runs."""
    state = request({"command": "status"})
    if state is None:
        print("derender: no server running", file=sys.stderr)
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
        print("derender: no server running", file=sys.stderr)
        return 0
    pid = int(reply["pid"])
    deadline = time.monotonic() + wait
    while process_alive(pid):
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            break
        time.sleep(0.05)
    print(f"derender: server stopped (pid {pid})", file=sys.stderr)
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


def _serve(directory: str, idle_timeout: float, engines: int, ready_fd: int) -> None:
    """The server process: ``python -m derender_cli.server ...``."""
    server = WarmServer(directory, idle_timeout, engines)
    try:
        server.bind()
        server.warm_up()
    except Exception:
        traceback.print_exc()
        with contextlib.suppress(OSError):
            os.unlink(server.path)
        sys.exit(3)
    os.write(ready_fd, b"ready\n")
    os.close(ready_fd)
    print(f"derender server: pid {os.getpid()} ready on {server.path}", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    finally:
        server.shutdown()
    sys.stderr.flush()
    os._exit(0)



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


if __name__ == "__main__":
    _serve(sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
