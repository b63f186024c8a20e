"""Every file a run reads and writes, checked before the run starts.

`RunPaths` takes a run's inputs and outputs, each under the flag that names
it, and refuses (`InputError`, exit status 2, nothing processed) an output
that

- is an input, by any name: the same path, ``./``, a symlink or a hard link
  (files are told apart by device and inode; a directory input, such as a
  model directory or a directory of ``.sse`` transcripts, counts its files);
- is another output of the same run (their bytes would mix, or one would
  replace the other), or shares stdout (``-``) with another output;
- cannot be created or written: its parent is missing and cannot be made,
  is not a directory, or refuses a new file.

The check never harms what is there: an existing file is opened to append
(not truncated) and closed; a new file, or the directories above it, is
created and removed again. Commands with more outputs than the core writes
(``--report`` and ``--html`` of ``parity`` and ``diff``) name them here too,
so every output of one run is checked against every other in one place.

After the check, `claimed` and `is_input` tell code that names files at run
time (per-request transcripts, ``--repro`` reports) whether a path is
already one of the run's files.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import stat
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from .errors import InputError

Roles = Mapping[str, str | None] | Iterable[tuple[str, str | None]]
"""Flags and the paths they name, as a mapping or as pairs (shards share a
flag); a None path is a flag not given, ``-`` is stdin or stdout."""

Identity = tuple[Any, ...]


class RunPaths:
    """A run's inputs, outputs and output directories, checked on
    construction (see the module's docstring)."""

    def __init__(self, inputs: Roles, outputs: Roles, directories: Roles = (), *, read: Roles = ()) -> None:
        """`inputs` are files the run reads, each in one role (INPUT,
        ``--requests``: one file named in two is refused); `read` other
        files or directories it reads, which may be named twice (``diff``'s
        two sides, the model directory). `outputs` are files the run writes,
        `directories` directories it writes files into (``--repro DIR``,
        ``-o DIR/`` for one ``.sse`` per request). Each comes under the flag
        that names it.

        Raises:
            InputError: naming the flag and the path, before anything is
                opened for writing.

        """
        self._inputs: dict[Identity, str] = {}
        self._outputs: dict[Identity, str] = {}
        for flag, path in _pairs(inputs):
            for identity in _input_identities(path):
                if identity in self._inputs:
                    raise InputError(
                        f"{flag} {path} is the same file as {self._inputs[identity]}; name each file in one role only"
                    )
                self._inputs[identity] = f"{flag} {path}"
        for flag, path in _pairs(read):
            for identity in _input_identities(path):
                self._inputs.setdefault(identity, f"{flag} {path}")
        files = [(flag, path) for flag, path in _pairs(outputs) if path is not None]
        on_stdout = [flag for flag, path in files if path == "-"]
        if len(on_stdout) > 1:
            raise InputError(f"{on_stdout[0]} - and {on_stdout[1]} -: only one of them can go to stdout")
        for flag, path in files:
            self._claim(flag, path)
        for flag, path in files:
            if path != "-":
                _check_writable(flag, path)
        for flag, path in _pairs(directories):
            if path is not None:
                if os.path.exists(path) and not os.path.isdir(path):
                    raise InputError(f"cannot write into {flag} {path}: it is not a directory")
                self._claim(flag, path, directory=True)
                _check_directory(flag, path)

    def _claim(self, flag: str, path: str, *, directory: bool = False) -> None:
        identity = _identity(path, sys.stdout)
        if identity is None:
            return
        name = f"{flag} {path}"
        if identity in self._inputs:
            raise InputError(
                f"{name} is the same file as {self._inputs[identity]}; writing it would destroy it, "
                "so choose another output"
            )
        if identity in self._outputs:
            raise InputError(
                f"{name} is the same file as {self._outputs[identity]}; both would write it, "
                "so choose another output"
            )
        if not directory:
            self._outputs[identity] = name

    def claimed(self, path: str | os.PathLike[str]) -> str | None:
        """The input or output (its flag and path) that `path` names, by
        any name, or None: a file named at run time must not be one."""
        path = os.fspath(path)
        # An output that did not exist when the run began was claimed by
        # its resolved path; by now it may exist (a report streamed to disk).
        for identity in (_identity(path, None), ("path", os.path.realpath(path))):
            if identity is not None:
                found = self._inputs.get(identity) or self._outputs.get(identity)
                if found is not None:
                    return found
        return None

    def is_input(self, path: str | os.PathLike[str]) -> bool:
        """Whether `path` is one of the run's inputs (device and inode:
        symlinks and hard links resolved)."""
        identity = _identity(os.fspath(path), None)
        return identity is not None and identity in self._inputs


def _pairs(roles: Roles) -> Iterable[tuple[str, str | None]]:
    return roles.items() if isinstance(roles, Mapping) else roles


def _identity(path: str, standard: Any) -> Identity | None:
    """Device and inode of an existing regular file (`standard`, stdin or
    stdout, for ``-``), so two names of one file compare equal; for a path
    that does not exist yet, the path it resolves to (through symlinks,
    ``..`` and ``./``). Devices, pipes and directories are not files two
    roles could share; a directory is named by its inode among directories."""
    try:
        if path == "-":
            if standard is None:
                return None
            info = os.fstat(standard.fileno())
        else:
            info = os.stat(path)
    except FileNotFoundError:
        return None if path == "-" else ("path", os.path.realpath(path))
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        return None
    if stat.S_ISDIR(info.st_mode):
        return ("directory", info.st_dev, info.st_ino)
    if not stat.S_ISREG(info.st_mode):
        return None
    return ("file", info.st_dev, info.st_ino)


def _input_identities(path: str | None) -> list[Identity]:
    """An input's file, or a directory input's files (one level: what a
    directory of transcripts or a model directory holds)."""
    if path is None:
        return []
    identity = _identity(path, sys.stdin)
    if identity is None or identity[0] != "directory":
        return [] if identity is None or identity[0] == "path" else [identity]
    try:
        names = os.listdir(path)
    except OSError:
        return []
    found = [_identity(os.path.join(path, name), None) for name in names]
    return [identity for identity in found if identity is not None and identity[0] == "file"]


def _check_writable(flag: str, path: str) -> None:
    """Refuse an output file that cannot be written, leaving what is
    there as it was."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        # Not there yet (or a symlink to nowhere): where opening it creates it.
        real = os.path.realpath(path)
        with _made_parents(flag, path, os.path.dirname(real)):
            _probe(flag, path, lambda: os.close(os.open(real, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)))
            os.unlink(real)
        return
    except OSError as exc:
        raise _cannot(flag, path, exc) from None
    if stat.S_ISDIR(info.st_mode):
        raise InputError(f"cannot write {flag} {path}: it is a directory")
    if stat.S_ISREG(info.st_mode) or stat.S_ISCHR(info.st_mode):
        # O_APPEND, no O_TRUNC: the file keeps its bytes if the run is refused.
        flags = os.O_WRONLY | os.O_APPEND | os.O_NOCTTY | os.O_NONBLOCK
        _probe(flag, path, lambda: os.close(os.open(path, flags)))
    elif not os.access(path, os.W_OK):  # a FIFO or socket: opening it could block or connect
        raise InputError(f"cannot write {flag} {path}: permission denied")


def _check_directory(flag: str, path: str) -> None:
    """Refuse an output directory that cannot be made or take a new file."""
    real = os.path.realpath(path)

    def new_file() -> None:
        descriptor, name = tempfile.mkstemp(dir=real, prefix=".derender-probe-")
        os.close(descriptor)
        os.unlink(name)

    with _made_parents(flag, path, real):
        _probe(flag, path, new_file)


@contextlib.contextmanager
def _made_parents(flag: str, path: str, directory: str) -> Iterator[None]:
    """`directory` and those above it that are missing, made for a probe
    and removed after it (as the run's writers would make them)."""
    missing: list[str] = []
    current = directory
    while current and not os.path.lexists(current):
        missing.append(current)
        current = os.path.dirname(current)
    if current and not os.path.isdir(current):
        raise InputError(f"cannot write {flag} {path}: {current} is not a directory")
    try:
        for made in reversed(missing):
            _probe(flag, path, functools.partial(os.mkdir, made))
        yield
    finally:
        for made in missing:
            with contextlib.suppress(OSError):
                os.rmdir(made)


def _probe(flag: str, path: str, action: Callable[[], object]) -> None:
    try:
        action()
    except OSError as exc:
        raise _cannot(flag, path, exc) from None


def _cannot(flag: str, path: str, exc: OSError) -> InputError:
    return InputError(f"cannot write {flag} {path}: {exc.strerror or exc}")
