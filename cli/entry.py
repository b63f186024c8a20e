"""The `derender` console entry point, and the warm server's client.

Standard library only, and it decides before anything heavy is imported:
a `chat`, `completion`, `stream`, `render`, `parity` or `diff` call goes to a running
`derender server` (``cli/server.py``) when there is one; everything else,
and every call the server cannot take, runs fresh in this process
(`run_fresh`), exactly as before.

The call is handed over whole: argv, the working directory, the
environment, the umask, the CPU affinity and niceness, the resource limits
(``ulimit``), the signals this process ignores, and stdin, stdout and stderr
themselves (their file descriptors, over the Unix socket with SCM_RIGHTS; a
closed one is closed in the child too). The server's child writes to the
same pipe, file or terminal this process would have, so ``| head``, a TTY
progress bar and redirections behave as in a fresh process. Ctrl-C, SIGTERM
and SIGHUP sent here are passed on to the child, and its exit status (or
the signal that ended it) becomes this process's. The call also says which
code it would run (`wire.code_identity`): a server started from other code
sends it back to run fresh.

Nothing here may hang: no server, a stale socket, a directory another user
could write to, or a server that does not answer in time all make the call
run fresh; ``-v`` says why when a server was found but not used.
"""

from __future__ import annotations

import os
import resource
import signal
import sys

from .wire import (
    NO_SERVER_VARIABLE,
    PROTOCOL,
    Replies,
    code_identity,
    connect,
    say,
    send_message,
    server_directory,
)

WARM_COMMANDS = frozenset({"chat", "completion", "stream", "render", "parity", "diff"})
NO_SERVER_FLAG = "--no-server"
ACCEPT_TIMEOUT = 30.0
"""Seconds to wait for a busy server (building another call's engine) to
take the call, before running it fresh."""
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_SET_BY_PYTHON = {signal.SIGPIPE, signal.SIGXFSZ}
"""Ignored by every Python at start-up, the server's child included."""


def occupy_closed_standard_fds() -> list[int]:
    """Of stdin, stdout and stderr, those closed when this process started,
    each now held open on /dev/null.

    Python starts with ``sys.stdin`` (or ``sys.stdout``, ``sys.stderr``)
    None for a closed descriptor, and that stays the sign that it is
    closed. The descriptor itself must not stay free: the next file or
    socket opened would take it, and a worker, a child or the warm server
    would take that for the standard stream.
    """
    closed = []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            closed.append(fd)
    for fd in closed:
        placeholder = os.open(os.devnull, os.O_RDWR)
        if placeholder != fd:  # the lowest free number is this one, unless something raced us
            os.dup2(placeholder, fd)
            os.close(placeholder)
    return closed


def _ignored_signals() -> list[int]:
    """Signals this process was started with ignored (``nohup``, a
    background job with SIGINT ignored): a fresh run keeps ignoring them,
    so the server's child must too."""
    ignored = []
    for signum in signal.valid_signals():
        if signum in _SET_BY_PYTHON:
            continue
        try:
            if signal.getsignal(signum) == signal.SIG_IGN:
                ignored.append(int(signum))
        except (OSError, ValueError):
            continue
    return ignored


def _limits() -> dict[str, list[int]]:
    """Every resource limit (``ulimit``) of this process, soft and hard."""
    found = {}
    for name in dir(resource):
        if name.startswith("RLIMIT_"):
            try:
                found[name] = list(resource.getrlimit(getattr(resource, name)))
            except (OSError, ValueError):
                continue
    return found


def _verbose(argv: list[str]) -> bool:
    return any(arg in ("-v", "--verbose") for arg in argv)


def forward(argv: list[str], closed: list[int]) -> int | None:
    """Run the call on the warm server; its exit status, or None to run
    it fresh here (nothing of the call has happened yet). `closed`: the
    standard descriptors this process started without
    (`occupy_closed_standard_fds`), which the child closes too."""
    sock, problem = connect(server_directory())
    if sock is None:
        if problem is not None and _verbose(argv):
            say(f"derender: running fresh, not on the warm server: {problem}")
        return None
    with sock:
        umask = os.umask(0)
        os.umask(umask)
        fds = [fd for fd in (0, 1, 2) if fd not in closed]
        ignored = _ignored_signals()
        call = {
            "protocol": PROTOCOL,
            "command": "call",
            "argv": argv,
            "cwd": os.getcwd(),
            "env": dict(os.environ),
            "umask": umask,
            # What a fresh process would inherit and the child must too:
            # `-j`'s default counts the CPUs this process may use, its
            # limit the files it may open (`ulimit -n`).
            "affinity": sorted(os.sched_getaffinity(0)),
            "niceness": os.getpriority(os.PRIO_PROCESS, 0),
            "limits": _limits(),
            "ignored_signals": ignored,
            # The standard descriptors that are open; the child closes the rest.
            "fds": fds,
            "code": code_identity(),
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
                say(f"derender: running fresh, the warm server did not answer: {exc}")
            return None
        if reply is None or reply.get("event") != "started":
            if _verbose(argv):
                why = "it went away" if reply is None else reply.get("reason", reply)
                say(f"derender: running fresh, not on the warm server: {why}")
            return None
        return _follow(replies, int(reply["pid"]), ignored)


def _follow(replies: Replies, child: int, ignored: list[int]) -> int:
    """Pass signals on to the server's child until it ends; its status.
    A signal this process was started with ignored stays ignored, as the
    child ignores it."""

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
        if signum not in ignored:
            signal.signal(signum, pass_on)
    if signal.SIGTSTP not in ignored:
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
            say("derender: the warm server went away mid-call; the run could not finish")
            return 3
        if reply.get("event") != "exit":
            continue
        if reply.get("signal"):
            # Die of the same signal, as the fresh process would have.
            signum = int(reply["signal"])
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
    # Before any file or socket is opened, so none takes a standard
    # descriptor's number.
    closed = occupy_closed_standard_fds()
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
        status = forward(argv, closed)
        if status is not None:
            sys.exit(status)
    run_fresh(argv)


if __name__ == "__main__":
    main()
