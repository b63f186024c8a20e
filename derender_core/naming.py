"""File names for text a record carries (a request id), derived in one
place, so a hostile or unlucky id can neither escape its directory, nor
make a name too long for the file system, nor share a file with another id
or with one of the run's own inputs.

A name is a readable prefix (the id with everything outside
``A-Z a-z 0-9 . _ ~ -`` made ``_``, cut to `PREFIX_CHARS`, without leading
dots, dashes or tildes) and a short digest of the exact id (`file_stem`).
The digest tells apart the ids the prefix merges (``a/b``, ``a_b``,
``a?b``; ``北京``, ``東京``; ``..`` and the empty id), is lowercase hex, so a
case-insensitive or normalising file system keeps names apart as well, and
never holds a dot, so ``req.1`` and ``req.2`` keep their own names whole
(no `Path.with_suffix`, which cuts at the last dot). A digest is short, so
two ids could still meet on one: `Names` hands out each name once per run,
and never the name of a file the run reads.

Pure: the standard library only.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path

NAME_MAX = 255
"""The longest file name, in bytes, that Linux and macOS file systems take."""
PREFIX_CHARS = 80
"""How much of an id the readable prefix keeps."""
DIGEST_CHARS = 12
"""Hex digits of the id's SHA-256 in a name: 48 bits."""
LONGEST_SUFFIX = 32
"""The longest suffix (``-N.jsonl`` and the like) a stem leaves room for."""

_UNSAFE = re.compile(r"[^A-Za-z0-9._~-]+")


def id_digest(key: str | None) -> str:
    """The first `DIGEST_CHARS` hex digits of the SHA-256 of `key`'s JSON
    text (ASCII), so every string, lone surrogates included, and None each
    have their own."""
    text = json.dumps(key, ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()[:DIGEST_CHARS]


def file_stem(key: str | None) -> str:
    """`key` as a file name stem: ``<readable prefix>-<digest>``, ASCII,
    at most ``PREFIX_CHARS + 1 + DIGEST_CHARS`` characters."""
    prefix = _UNSAFE.sub("_", key or "")[:PREFIX_CHARS].lstrip(".-~") or "id"
    return f"{prefix}-{id_digest(key)}"


def file_name(key: str | None, suffix: str = "") -> str:
    """`key`'s file name with `suffix` (``.md``), within `NAME_MAX` bytes."""
    if len(suffix.encode("utf-8", "surrogateescape")) > LONGEST_SUFFIX:
        raise ValueError(f"suffix {suffix!r} is longer than {LONGEST_SUFFIX} bytes")
    return file_stem(key) + suffix


class Names:
    """The stems of one run's files in `directory`, each handed out once.

    Every stem `take` gives is `file_stem`'s, or that with ``-2``, ``-3``
    ... when the plain one is taken: by another key of this run (a digest
    shared, or the same key twice), or, with any of `suffixes`, by one of
    the run's own files, which `claimed` names (`outputs.RunPaths.claimed`:
    the run's inputs and other outputs, through symlinks and hard links).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        suffixes: Sequence[str],
        claimed: Callable[[str], object] | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.suffixes = list(suffixes)
        for suffix in self.suffixes:
            file_name("", suffix)  # a suffix too long fails here, not mid-run
        self._claimed = claimed
        self._taken: set[str] = set()

    def take(self, key: str | None) -> str:
        """A stem no other key of the run has, none of whose files is one
        the run reads or writes elsewhere."""
        plain = stem = file_stem(key)
        number = 1
        while stem in self._taken or self._touches_claimed(stem):
            number += 1
            stem = f"{plain}-{number}"
        self._taken.add(stem)
        return stem

    def _touches_claimed(self, stem: str) -> bool:
        return self._claimed is not None and any(
            self._claimed(str(self.directory / (stem + suffix))) for suffix in self.suffixes
        )
