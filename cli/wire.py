"""What the warm server's client and the server share: where the socket
lives, how messages travel, and what a call must match to run warm.

Standard library only, and it imports nothing else of the command line:
the client (`entry`), the server (`server`) and the ``derender server``
commands (`control`) all import it, and it imports none of them.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import socket
import stat
import struct
import sys
from typing import Any

NO_SERVER_VARIABLE = "DERENDER_NO_SERVER"
"""Set (to anything but empty or 0) to run every call fresh."""
DIRECTORY_VARIABLE = "DERENDER_SERVER_DIR"
"""Where the server's socket lives; default `default_directory()`."""
SOCKET_NAME = "server.sock"
PIDFILE_NAME = "server.pid"
LOG_NAME = "server.log"
PROTOCOL = 2
HEADER = struct.Struct("!I")
CODE_PACKAGES = ("derender_core", "derender_cli")
"""The packages whose sources a warm call must share with the server."""


def say(message: str) -> None:
    """A message on stderr, if there is one: with stderr closed (``2>&-``)
    it goes nowhere, never to stdout, which carries data only."""
    if sys.stderr is not None:
        print(message, file=sys.stderr)


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
    """The installed derender and vLLM versions."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("derender", "vllm"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "unknown"
    return found


def code_identity() -> dict[str, Any]:
    """What decides the code a fresh process would run: the interpreter,
    its module search path (``PYTHONPATH`` included) and, for derender's
    own packages, a digest of every source file where this process finds
    (or found) them, so an edited editable install counts too.

    The first entry of ``sys.path`` is left out: it is the script's
    directory, which differs between the console script and the server
    (``python -m``) but holds no derender code.
    """
    packages = {}
    for name in CODE_PACKAGES:
        module = sys.modules.get(name)
        origin = getattr(module, "__file__", None)
        if origin is None:
            found = importlib.util.find_spec(name)
            origin = found.origin if found is not None else None
        packages[name] = _source_digest(os.path.dirname(origin)) if origin else None
    return {
        "versions": versions(),
        "executable": os.path.realpath(sys.executable),
        "prefix": sys.prefix,
        "path": sys.path[1:],
        "packages": packages,
    }


def _source_digest(directory: str) -> str:
    """The directory and the names and bytes of the Python sources under it."""
    digest = hashlib.sha256(os.path.realpath(directory).encode())
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(root, name)
            digest.update(os.path.relpath(path, directory).encode() + b"\0")
            try:
                with open(path, "rb") as source:
                    digest.update(hashlib.sha256(source.read()).digest())
            except OSError:
                digest.update(b"unreadable")
    return digest.hexdigest()


def code_differences(theirs: Any, ours: dict[str, Any]) -> list[str]:
    """What differs between two `code_identity` values, in words."""
    if not isinstance(theirs, dict):
        return ["the code the call would run"]
    found = []
    if theirs.get("versions") != ours["versions"]:
        found.append(f"versions {ours['versions']}, this call {theirs.get('versions')}")
    if theirs.get("executable") != ours["executable"] or theirs.get("prefix") != ours["prefix"]:
        found.append(f"the interpreter {ours['executable']} ({ours['prefix']}), this call {theirs.get('executable')}")
    if theirs.get("path") != ours["path"]:
        found.append("another module search path (sys.path, PYTHONPATH)")
    for name, digest in ours["packages"].items():
        if (theirs.get("packages") or {}).get(name) != digest:
            found.append(f"other {name} sources (edited since the server started, or found elsewhere)")
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
    prefix = HEADER.pack(len(data))
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
        return json.loads(line)  # type: ignore[no-any-return]


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
