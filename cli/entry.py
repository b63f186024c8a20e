"""The `derender` console entry point, and the warm server's client.

Standard library only, and it decides before anything heavy is imported:
a `chat`, `completion`, `stream`, `render`, `parity` or `diff` call goes to a running
`derender server` (``cli/server.py``) when there is one; everything else,
and every call the server cannot take, runs fresh in this process
(`run_fresh`), exactly as before.

The call is handed over whole: argv, the working directory, the
environment, the umask, and stdin, stdout and stderr themselves (their file
descriptors, over the Unix socket with SCM_RIGHTS). The server's child
writes to the same pipe, file or terminal this process would have, so
``| head``, a TTY progress bar and redirections behave as in a fresh
process. Ctrl-C, SIGTERM and SIGHUP sent here are passed on to the child,
and its exit status (or the signal that ended it) becomes this process's.

Nothing here may hang: no server, a stale socket, a directory another user
could write to, or a server that does not answer in time all make the call
run fresh; ``-v`` says why when a server was found but not used.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import struct
import sys
from typing import Any

WARM_COMMANDS = frozenset({"chat", "completion", "stream", "render", "parity", "diff"})
NO_SERVER_FLAG = "--no-server"
NO_SERVER_VARIABLE = "DERENDER_NO_SERVER"
"""Set (to anything but empty or 0) to run every call fresh."""
DIRECTORY_VARIABLE = "DERENDER_SERVER_DIR"
"""Where the server's socket lives; default `default_directory()`."""
SOCKET_NAME = "server.sock"
PROTOCOL = 1
ACCEPT_TIMEOUT = 30.0
"""Seconds to wait for a busy server (building another call's engine) to
take the call, before running it fresh."""
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_HEADER = struct.Struct("!I")


def default_directory() -> str:
    """Per user: under ``$XDG_RUNTIME_DIR`` when it is this user's, else
    ``/tmp/derender-<uid>``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        try:
            info = os.stat(runtime)
        except OSError:
            info = None
        if info is not None and info.st_uid == os.getuid() and not info.st_mode & 0o077:
            return os.path.join(runtime, "derender")
    return os.path.join("/tmp", f"derender-{os.getuid()}")


def server_directory() -> str:
    return os.environ.get(DIRECTORY_VARIABLE) or default_directory()


def check_directory(directory: str) -> str | None:
    """Why the socket in `directory` must not be trusted, or None.

    Only a directory this user owns and no one else can open keeps another
    user from planting a socket there (and reading every call's input).
    """
    try:
        info = os.lstat(directory)
    except FileNotFoundError:
        return "no server directory"
    except OSError as exc:
        return f"cannot read {directory}: {exc.strerror}"
    if not stat.S_ISDIR(info.st_mode):
        return f"{directory} is not a directory"
    if info.st_uid != os.getuid():
        return f"{directory} belongs to uid {info.st_uid}, not to this user"
    if info.st_mode & 0o077:
        return f"{directory} is open to other users (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def versions() -> dict[str, str]:
    """What the server must match to answer for this installation."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("derender", "vllm"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "unknown"
    return found


def connect(directory: str, timeout: float = 2.0) -> tuple[socket.socket | None, str | None]:
    """A connection to the server in `directory`, or why there is none.

    The second item is None when simply no server runs (nothing worth
    saying), a reason when one seemed to be there but cannot be used.
    """
    problem = check_directory(directory)
    if problem == "no server directory":
        return None, None
    if problem is not None:
        return None, problem
    path = os.path.join(directory, SOCKET_NAME)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
    except FileNotFoundError:
        sock.close()
        return None, None
    except OSError as exc:
        sock.close()
        # A socket left by a server that died: nobody listens.
        return None, f"stale server socket {path} ({exc.strerror or exc})"
    return sock, None


def send_message(sock: socket.socket, message: dict[str, Any], fds: list[int] = ()) -> None:  # type: ignore[assignment]
    """A length-prefixed JSON message; descriptors travel with its prefix."""
    data = json.dumps(message).encode()
    prefix = _HEADER.pack(len(data))
    if fds:
        socket.send_fds(sock, [prefix], list(fds))
    else:
        sock.sendall(prefix)
    sock.sendall(data)


class Replies:
    """The server's replies: one JSON object per line."""

    def __init__(self, sock: socket.socket) -> None:
        self._file = sock.makefile("rb")

    def next(self) -> dict[str, Any] | None:
        """The next reply, None at end of connection."""
        line = self._file.readline()
        if not line.endswith(b"\n"):
            return None
        return json.loads(line)


def request(
    message: dict[str, Any], timeout: float = 10.0, directory: str | None = None
) -> dict[str, Any] | None:
    """A control call (status, stop); None when no server answers."""
    sock, _ = connect(directory or server_directory(), timeout)
    if sock is None:
        return None
    with sock:
        try:
            send_message(sock, {"protocol": PROTOCOL, **message})
            return Replies(sock).next()
        except (OSError, ValueError):
            return None


def _open_standard_fds() -> list[int]:
    """Of stdin, stdout and stderr, those open (a closed one stays closed
    in the server's child)."""
    found = []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            continue
        found.append(fd)
    return found


def _verbose(argv: list[str]) -> bool:
    return any(arg in ("-v", "--verbose") for arg in argv)


def forward(argv: list[str]) -> int | None:
    """Run the call on the warm server; its exit status, or None to run
    it fresh here (nothing of the call has happened yet)."""
    sock, problem = connect(server_directory())
    if sock is None:
        if problem is not None and _verbose(argv):
            print(f"derender: running fresh, not on the warm server: {problem}", file=sys.stderr)
        return None
    with sock:
        umask = os.umask(0)
        os.umask(umask)
        fds = _open_standard_fds()
        call = {
            "protocol": PROTOCOL,
            "command": "call",
            "argv": argv,
            "cwd": os.getcwd(),
            "env": dict(os.environ),
            "umask": umask,
            # What a fresh process would inherit and the child must too:
            # `-j`'s default counts the CPUs this process may use.
            "affinity": sorted(os.sched_getaffinity(0)),
            "niceness": os.getpriority(os.PRIO_PROCESS, 0),
            "fds": fds,
            "versions": versions(),
        }
        try:
            sock.settimeout(ACCEPT_TIMEOUT)
            send_message(sock, call, fds)
            replies = Replies(sock)
            reply = replies.next()
            while reply is not None and reply.get("event") == "accepted":
                sock.settimeout(None)  # it works on the call: building takes what it takes
                reply = replies.next()
        except (OSError, ValueError) as exc:
            if _verbose(argv):
                print(f"derender: running fresh, the warm server did not answer: {exc}", file=sys.stderr)
            return None
        if reply is None or reply.get("event") != "started":
            if _verbose(argv):
                why = "it went away" if reply is None else reply.get("reason", reply)
                print(f"derender: running fresh, not on the warm server: {why}", file=sys.stderr)
            return None
        return _follow(replies, int(reply["pid"]))


def _follow(replies: Replies, child: int) -> int:
    """Pass signals on to the server's child until it ends; its status."""

    def pass_on(signum: int, frame: object) -> None:
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    def suspend(signum: int, frame: object) -> None:
        # Ctrl-Z: stop the child with this process, continue it with it.
        pass_on(signal.SIGSTOP, None)
        signal.signal(signal.SIGTSTP, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTSTP)
        signal.signal(signal.SIGTSTP, suspend)
        pass_on(signal.SIGCONT, None)

    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, pass_on)
    signal.signal(signal.SIGTSTP, suspend)
    while True:
        try:
            reply = replies.next()
        except InterruptedError:
            continue
        except (OSError, ValueError):
            reply = None
        if reply is None:
            # The server died mid-call and took its child with it; the
            # child's workers (its process group) follow.
            try:
                os.killpg(child, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass_on(signal.SIGKILL, None)
            print("derender: the warm server went away mid-call; the run could not finish", file=sys.stderr)
            return 3
        if reply.get("event") != "exit":
            continue
        if reply.get("signal"):
            # Die of the same signal, as the fresh process would have.
            signum = int(reply["signal"])
            sys.stdout.flush()
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return 128 + signum
        return int(reply["status"])


def run_fresh(argv: list[str]) -> None:
    """The real command line, in this process, started lean.

    The collector is held off while Typer, Rich, derender and vLLM are
    imported and the engine is built (`lean_start` freezes the heap after
    the build and turns it back on); whatever the run left is frozen before
    exit, so the interpreter does not walk the whole heap again on the way
    out.
    """
    import gc

    # DERENDER_LEAN_OFF=gc (or all) is benchmarks/startup.py measuring
    # what this saves (`derender_core.vllm_seam.stack.LEAN_STEPS`).
    lean = not {"gc", "all"} & set(os.environ.get("DERENDER_LEAN_OFF", "").split(","))
    if lean:
        gc.disable()
    try:
        from .main import main as cli_main

        gc.enable()  # the build turns it off again while it runs
        cli_main(argv)
    finally:
        if lean:
            gc.freeze()


def main() -> None:
    """Console entry point."""
    argv = sys.argv[1:]
    bypass = NO_SERVER_FLAG in argv
    if bypass:
        argv = [arg for arg in argv if arg != NO_SERVER_FLAG]
    if (
        not bypass
        and os.environ.get(NO_SERVER_VARIABLE, "") in ("", "0")
        and argv
        and argv[0] in WARM_COMMANDS
    ):
        status = forward(argv)
        if status is not None:
            sys.exit(status)
    run_fresh(argv)


if __name__ == "__main__":
    main()
