"""The warm server behind `derender server start`: a per-user process for
shell pipelines.

A fresh `derender` pays vLLM's imports and the engine build on every call;
this process pays them once. It listens on a Unix socket in a directory
only its user can open (`wire.server_directory`), takes each call from
`entry.forward` with the caller's stdin, stdout and stderr, and forks a
child per call that runs the ordinary command line on those descriptors,
with an engine already built for the call's settings (`main.warm_engines`).
The child takes on everything else of the caller a fresh process would
have: closed standard descriptors, environment, umask, CPU affinity,
niceness, resource limits and ignored signals. The child's exit status (or
signal) goes back to the client.

Engines are kept by everything that shapes an answer (`engine_key`): the
render settings, the resolved model, tokenizer and chat template and the
content of their files; at most ``--engines`` of them, least recently used
first out. Calls the server cannot answer as a fresh process would are sent
back to run fresh (`WarmServer._fresh_reason`, `plan_call`): other code or
versions, other import-time settings, limits a child cannot take on, the
serve flavor's live engine core, Ray.

Single-threaded on purpose: every fork happens from the one thread, so no
lock can be held by a thread the child lacks.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import hashlib
import json
import os
import re
import resource
import selectors
import signal
import socket
import struct
import sys
import time
import traceback
from collections import OrderedDict
from typing import Any

from .wire import HEADER, PIDFILE_NAME, PROTOCOL, SOCKET_NAME, code_differences, code_identity

# Settings vLLM, transformers, torch and huggingface_hub read when imported
# (the Hub cache's place among them): the server imported them with its
# own, so a call with other values runs fresh.
IMPORT_TIME_VARIABLES = re.compile(
    r"^(VLLM_|HF_|HUGGINGFACE_|TRANSFORMERS_|TORCH|TIKTOKEN_|OMP_|MKL_|CUDA_)|^(HOME|XDG_CACHE_HOME|DERENDER_FAST_PATHS)$"
)
MAPPED_LIMITS = ("RLIMIT_AS", "RLIMIT_DATA", "RLIMIT_STACK")
"""Limits on memory the server has mapped already: a child cannot take on
the caller's, so a call with others runs fresh."""
DIGESTED_BYTES = 256 << 20
"""Model files up to this size are keyed by their content; larger ones
(weights, which no answer reads) by name and size."""
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx", ".ckpt")
RACY_SECONDS = 2.0
"""A content digest is reused for a file unchanged in every stat field,
ctime included (which no tool can set back), once its last change is
older than this: a change within the same timestamp tick cannot hide."""
_PR_SET_PDEATHSIG = 1


def engine_key(config: Any, cwd: str) -> tuple[str, ...]:
    """Everything that shapes the answers of an engine built from `config`
    in `cwd`: the settings, and each file the model, tokenizer and chat
    template name, resolved (a Hub id to its cached snapshot, links to
    their targets) and by content, so a file rewritten in place with its
    size and mtime kept (``rsync --inplace -t``) makes another key."""
    identity: list[str] = [repr(config)]
    for role, path in resolved_files(config, cwd).items():
        identity.append(f"{role}={path}")
        if os.path.isdir(path):
            for root, dirs, files in os.walk(path):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                for name in sorted(files):
                    with contextlib.suppress(OSError):
                        identity.append(_file_identity(os.path.join(root, name), path))
        elif os.path.isfile(path):
            identity.append(_file_identity(path, os.path.dirname(path)))
    return tuple(identity)


def resolved_files(config: Any, cwd: str) -> dict[str, str]:
    """The real path of the model, tokenizer and chat template `config`
    names from `cwd` (a Hub id: its snapshot in the cache); an inline
    template or an id not in the cache is left out (its text is in the
    settings)."""
    found = {}
    for role, value in (("model", config.model), ("tokenizer", config.tokenizer), ("chat_template", config.chat_template)):
        if not value:
            continue
        path = os.path.join(cwd, value)
        if role != "chat_template" and not os.path.exists(path):
            from derender_core import DerenderError

            with contextlib.suppress(DerenderError), _working_directory(cwd):
                path = str(config.local_dirs()[role])
        if os.path.exists(path):
            found[role] = os.path.realpath(path)
    return found


_DIGESTS: dict[tuple[Any, ...], str] = {}


def _file_identity(path: str, top: str) -> str:
    info = os.stat(path)
    name = os.path.relpath(path, top)
    if info.st_size > DIGESTED_BYTES or name.endswith(WEIGHT_SUFFIXES):
        return f"{name}:{info.st_size}"
    key = (path, info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
    digest = _DIGESTS.get(key)
    if digest is None:
        with open(path, "rb") as source:
            digest = hashlib.file_digest(source, "sha256").hexdigest()
        if time.time_ns() - max(info.st_mtime_ns, info.st_ctime_ns) > RACY_SECONDS * 1e9:
            _DIGESTS[key] = digest
    return f"{name}:{digest}"


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
            renders = name in ("tokenize", "detokenize")  # the render half's endpoints
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
    model_path: str
    """The model directory the engine was built from, resolved (a Hub
    id's snapshot, links followed): two engines from different
    directories show different paths, whatever the caller typed."""
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
        self.code = code_identity()
        """The code this server runs: taken before anything of it is
        imported, so a file edited from then on shows as a difference."""
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
            prefix, fds, _, _ = socket.recv_fds(conn, HEADER.size, 3)
            if len(prefix) < HEADER.size:
                raise ValueError("short message")
            (length,) = HEADER.unpack(prefix)
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
        """Why the call cannot run here as it would in a fresh process."""
        differences = code_differences(message.get("code"), self.code)
        if differences:
            return f"the server runs other code than this call would ({'; '.join(differences)}): restart the server"
        theirs = _import_time_settings(message.get("env", {}))
        differing = sorted(k for k in theirs.keys() | self.environment.keys() if theirs.get(k) != self.environment.get(k))
        if differing:
            return f"the server was started with other {', '.join(differing)}"
        return _limits_problem(message.get("limits", {}))

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
            model_path = resolved_files(config, cwd).get("model", config.model)
            held = Held(engine, config, model_path, time.perf_counter() - started, time.monotonic())
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
            for signum in message.get("ignored_signals", ()):
                # As the caller was started: a fresh process keeps them ignored.
                with contextlib.suppress(OSError, ValueError):
                    signal.signal(signum, signal.SIG_IGN)
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
                _closed_standard_stream(target)
            os.chdir(message["cwd"])
            os.umask(int(message["umask"]))
            with contextlib.suppress(OSError, KeyError, ValueError):
                os.sched_setaffinity(0, message["affinity"])
            with contextlib.suppress(OSError, KeyError, ValueError):
                os.setpriority(os.PRIO_PROCESS, 0, int(message["niceness"]))
            for name, (soft, hard) in message.get("limits", {}).items():
                if name not in MAPPED_LIMITS:  # those are equal (`_limits_problem`)
                    with contextlib.suppress(OSError, ValueError, AttributeError):
                        resource.setrlimit(getattr(resource, name), (soft, hard))
            os.environ.clear()
            os.environ.update(message["env"])
            for stream, fd in ((sys.stdout, 1), (sys.stderr, 2)):
                with contextlib.suppress(OSError, ValueError, AttributeError):
                    stream.reconfigure(line_buffering=fd == 2 or os.isatty(fd))  # type: ignore[union-attr]
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
            "versions": self.code["versions"],
            "engines": [
                {
                    "model": held.model_path,
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


_STANDARD_STREAMS = {0: "stdin", 1: "stdout", 2: "stderr"}


def _closed_standard_stream(fd: int) -> None:
    """Make standard descriptor `fd` closed as Python sees a closed one at
    start-up (``sys.stdin`` and the rest None), held on /dev/null so no
    file or socket this process opens takes its number (as
    `entry.occupy_closed_standard_fds` does in a fresh process)."""
    placeholder = os.open(os.devnull, os.O_RDWR)
    os.dup2(placeholder, fd)
    os.close(placeholder)
    name = _STANDARD_STREAMS[fd]
    setattr(sys, name, None)
    setattr(sys, f"__{name}__", None)


def _limits_problem(limits: dict[str, Any]) -> str | None:
    """Why the caller's resource limits cannot be this server's child's,
    or None: a limit above what this process may raise to, or another
    limit on memory this process has mapped already."""
    privileged = os.geteuid() == 0
    for name, (soft, hard) in sorted(limits.items()):
        which = getattr(resource, name, None)
        if which is None:
            continue
        ours = resource.getrlimit(which)
        if name in MAPPED_LIMITS:
            if [soft, hard] != list(ours):
                return f"the call's {name} ({_shown_limit(soft)}) is not the server's ({_shown_limit(ours[0])})"
        elif not privileged and _above(hard, ours[1]):
            return f"the call's {name} hard limit ({_shown_limit(hard)}) is above the server's ({_shown_limit(ours[1])})"
    return None


def _above(limit: int, bound: int) -> bool:
    if bound == resource.RLIM_INFINITY:
        return False
    return limit == resource.RLIM_INFINITY or limit > bound


def _shown_limit(limit: int) -> str:
    return "unlimited" if limit == resource.RLIM_INFINITY else str(limit)


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
        if stream is not None:  # None: closed when the call began
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


if __name__ == "__main__":
    _serve(sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
