"""Resuming a run from the output an earlier, stopped run left (``--resume``).

Output record *i* answers input record *i* in JSONL and Parquet outputs, so
the records an output holds in full say how far the earlier run got: those
input records are skipped, nothing after them is, and the new answers are
appended. A plain JSONL output is cut after its last complete line; a
compressed one is rewritten with its complete lines (a killed run can leave
a truncated gzip member or zstd frame); a Parquet output is complete or
absent (it is renamed into place when a run ends or stops).

A stream's later calls need the states of its earlier ones. Those are in
the output (each JSONL answer carries its ``stream_state``), so the skipped
records come back as `Restored` items and the ledger threads their states
as if the calls had just been answered. The same items rebuild the
``--errors`` lines of the skipped records, so a resumed run's errors file
is a clean run's.

An output is only continued by the run that would have written it: next
to each JSONL or Parquet output file ``DIR/NAME`` a sidecar manifest,
``DIR/.NAME.derender.json``, says which input it answers and how (see
`Manifest`). It is written before the output is opened and rewritten as
the output is flushed, so whatever an output holds, its manifest covers
it. ``--resume`` refuses an output without one, or whose manifest differs
from this run (`check_resume`), before the model loads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import stat
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .batch import Job, Restored, failure_detail
from .config import RenderConfig
from .datasets import _complete_lines, _parquet_file, is_parquet, open_records
from .errors import InputError, StreamFailure
from .protocol import Answer
from .records import Record, open_input, open_output
from .writers import ErrorLog

MANIFEST_FORMAT = 1
_NOTHING_READ = hashlib.sha256().hexdigest()
MANIFEST_SECONDS = 0.5
"""How often, at most, a manifest is rewritten while its output grows
(and once more when the output is closed)."""
_PATH_SETTINGS = ("model", "tokenizer", "chat_template")
"""Settings that may name files: compared as absolute paths."""


def prepare_output(path: str) -> int:
    """Make `path` end after its last complete record and say how many
    records it holds (0 when it does not exist yet)."""
    if not os.path.exists(path):
        return 0
    if is_parquet(path):
        try:
            return int(_parquet_file(path).metadata.num_rows)
        except InputError as exc:
            raise InputError(
                f"cannot resume {path}: {exc}. A Parquet output is only written when a run "
                "ends or stops on a signal; remove it to start afresh."
            ) from None
    if path.endswith((".gz", ".zst")):
        return _rewrite_complete_lines(path)
    return _cut_after_last_line(path)


def _cut_after_last_line(path: str) -> int:
    lines, end = 0, 0
    with open(path, "rb") as existing:
        offset = 0
        for line in existing:
            offset += len(line)
            if line.endswith(b"\n"):
                lines, end = lines + 1, offset
    if end != os.path.getsize(path):
        os.truncate(path, end)
    return lines


def _rewrite_complete_lines(path: str) -> int:
    partial = path + ".partial" + path[path.rfind(".") :]
    lines = 0
    with open_input(path) as source, open_output(partial) as target:
        for line in _complete_lines(source):
            target.write(line)
            lines += 1
    os.replace(partial, path)
    return lines


def skip_answered(
    records: Iterable[Record], done: int, answers: Iterator[Answer] | None = None
) -> Iterator[Record | Restored]:
    """The records after the first `done`; with `answers` (the output's,
    in order) each skipped record comes back as `Restored` with its answer.

    Raises:
        InputError: when the input has fewer than `done` records: the output
            is not a partial output of this input.

    """
    seen = 0
    for record in records:
        seen = record.number
        if record.number > done:
            yield record
        elif answers is not None:
            answer = next(answers, None)
            if answer is None:
                raise InputError(f"the output holds fewer answers than the {done} counted")
            yield Restored(record, answer)
    if seen < done:
        raise InputError(
            f"the output already holds {done} records but the input has only {seen}: "
            "it is not a partial output of this input"
        )


def manifest_path(output: str) -> str:
    """The manifest of `output`: hidden beside it, so the tools that read a
    directory of Parquet or JSONL shards (Spark, pyarrow.dataset, a glob of
    ``*.jsonl``) do not take it for a shard."""
    path = Path(output)
    return str(path.with_name(f".{path.name}.derender.json"))


def keeps_manifest(output: str) -> bool:
    """Whether `output` gets a manifest: a file, not stdout, a device
    (``/dev/null``, ``/dev/full``) or a pipe, which cannot be resumed."""
    if output == "-":
        return False
    try:
        return stat.S_ISREG(os.stat(output).st_mode)
    except FileNotFoundError:
        return True
    except OSError:
        return False


@dataclass
class Manifest:
    """What an output's answers depend on, and how far they go.

    Fields, as the JSON file holds them: ``format`` (1); ``versions``
    (``derender``, ``vllm``); ``settings`` (every flag that shapes an
    answer, by its flag name: the command, ``--flavor``, ``--lenient``,
    ``--requests`` as path, size and SHA-256, and each render-server flag);
    ``input`` (``path``, absolute or ``-``, and ``size`` in bytes, null for
    stdin or a pipe); ``records`` (answers the output held when it was last
    written) and ``sha256`` (of the input's bytes up to and including the
    line of record ``records``; for Parquet, of its rows).
    """

    versions: dict[str, str]
    settings: dict[str, Any]
    input: dict[str, Any]
    records: int = 0
    sha256: str = _NOTHING_READ

    def to_json(self) -> bytes:
        fields = {"format": MANIFEST_FORMAT, **dataclasses.asdict(self)}
        return json.dumps(fields, indent=1, sort_keys=True).encode() + b"\n"

    @classmethod
    def read(cls, path: str) -> Manifest:
        """Raises OSError, ValueError, KeyError or TypeError for a file that is not one."""
        with open(path, "rb") as source:
            fields = json.load(source)
        if fields.pop("format") != MANIFEST_FORMAT:
            raise ValueError("unknown manifest format")
        return cls(**fields)

    def write(self, output: str, *, failure: type[Exception] = StreamFailure) -> None:
        """Replace the manifest of `output` whole (written aside, then
        renamed). A failure mid-run stops the run as a failing output does
        (`StreamFailure`); before it, it is a usage error (`InputError`)."""
        path = manifest_path(output)
        partial = path + ".partial"
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)  # -o DIR/ may not exist yet
            with open(partial, "wb") as target:
                target.write(self.to_json())
            os.replace(partial, path)
        except OSError as exc:
            # A full disk leaves the aside copy empty or cut: the manifest
            # in place (if any) is still whole, so only the copy goes.
            with contextlib.suppress(OSError):
                os.unlink(partial)
            raise failure(f"cannot write {path}: {exc.strerror or exc}") from None

    def differences(self, now: Manifest) -> list[str]:
        """What differs from the run `now`, in words; empty when it may continue."""
        found = [
            f"it was written by {name} {self.versions.get(name)}, this is {version}"
            for name, version in now.versions.items()
            if self.versions.get(name) != version
        ]
        for name in sorted(set(self.settings) | set(now.settings)):
            before, after = self.settings.get(name), now.settings.get(name)
            if before != after:
                found.append(f"{name} was {_shown(before)}, now {_shown(after)}")
        size, now_size = self.input.get("size"), now.input.get("size")
        if size is not None and now_size is not None and size != now_size:
            found.append(
                f"the input was {self.input.get('path')} ({size:,} bytes), now {now.input['path']} ({now_size:,} bytes)"
            )
        return found


def _shown(value: Any) -> str:
    return "not set" if value is None else json.dumps(value)


def installed_versions() -> dict[str, str]:
    """The installed derender and vLLM versions: what a manifest records and
    a bug report states."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("derender", "vllm"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "unknown"
    return found


def run_manifest(
    config: RenderConfig,
    input_path: str,
    *,
    command: str,
    endpoint: str,
    flavor: str,
    lenient: bool,
    requests: str | None,
    render_prompts: bool = False,
) -> Manifest:
    """The manifest a run of these settings over `input_path` writes, before
    it has answered anything."""
    versions = installed_versions()
    render = {}
    for name, value in dataclasses.asdict(config).items():
        if name in _PATH_SETTINGS and isinstance(value, str) and os.path.exists(value):
            value = os.path.abspath(value)
        render["--" + name.replace("_", "-")] = value
    settings = {
        "command": command,
        "--endpoint": endpoint,
        "--flavor": flavor,
        "--lenient": lenient,
        "--requests": None if requests is None else {**_file_facts(requests), "sha256": _file_sha256(requests)},
        # Set only when given, so outputs of runs that predate the flag resume.
        **({"--render-prompts": True} if render_prompts else {}),
        **render,
    }
    # Through JSON, so tuples and lists compare as they will when read back.
    settings = json.loads(json.dumps(settings))
    return Manifest(versions, settings, _file_facts(input_path))


def _file_facts(path: str) -> dict[str, Any]:
    if path == "-":
        return {"path": "-", "size": None}
    try:
        info = os.stat(path)
    except OSError:
        return {"path": os.path.abspath(path), "size": None}
    return {"path": os.path.abspath(path), "size": info.st_size if stat.S_ISREG(info.st_mode) else None}


@functools.lru_cache(maxsize=8)
def _file_sha256(path: str) -> str | None:
    # Cached: every shard's manifest names the one --requests file.
    try:
        with open(path, "rb") as source:
            return hashlib.file_digest(source, "sha256").hexdigest()
    except OSError:
        return None


def check_resume(output: str, now: Manifest) -> Manifest | None:
    """The manifest of the output `--resume` is to continue, once it is
    known to be this run's (None when there is nothing to continue).

    Raises:
        InputError: when the output has no manifest or answers another
            input, other settings, or other versions; saying what differs.

    """
    if not os.path.exists(output) or os.path.getsize(output) == 0:
        return None
    path = manifest_path(output)
    try:
        earlier = Manifest.read(path)
    except FileNotFoundError:
        raise InputError(
            f"cannot resume {output}: it has no manifest ({path}), so nothing says which input "
            "and settings its answers are for; remove it to start afresh"
        ) from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"cannot resume {output}: its manifest {path} is not readable ({exc})") from None
    differences = earlier.differences(now)
    if differences:
        raise InputError(
            f"cannot resume {output}: it answers another run: {'; '.join(differences)}. "
            f"Resume with that run's input and flags, or remove {output} to start afresh"
        )
    return earlier


def check_input_prefix(input_path: str, job: Job, output: str, earlier: Manifest) -> None:
    """Read the records `earlier` covers and check they are the ones the
    earlier run read, before anything runs. Stdin cannot be read twice: its
    records are checked as the run reads them (`ManifestKeeper.track`).

    Raises:
        InputError: when they differ.

    """
    if input_path == "-" or earlier.records == 0:
        return
    with open_records(input_path, job) as source:
        for record in _verified(source.records, earlier, output):
            if record.number >= earlier.records:
                return


def _verified(records: Iterable[Record], earlier: Manifest, output: str) -> Iterator[Record]:
    for record in records:
        if record.number == earlier.records and (record.digest or b"").hex() != earlier.sha256:
            raise InputError(
                f"cannot resume {output}: the input is not the one it answers: its first "
                f"{earlier.records:,} records differ from those the earlier run read "
                f"({earlier.input.get('path')}); remove {output} to start afresh"
            )
        yield record
        if record.number == earlier.records:
            earlier = dataclasses.replace(earlier, records=0)  # checked
    if earlier.records:
        raise InputError(
            f"cannot resume {output}: the input has fewer records than the {earlier.records:,} "
            "the earlier run read; it is not the input it answers"
        )


@dataclass
class ManifestKeeper:
    """Keeps the manifest of one output up with it: `track` the records as
    they are read, `update` with the records written in full as the run
    goes, `close` once the output is closed."""

    output: str
    manifest: Manifest
    earlier: Manifest | None = None
    """The manifest of the output being resumed, checked by `track`."""
    done: int = 0
    """Records the output held when this run began."""
    _digests: deque[tuple[int, bytes]] = field(default_factory=deque)
    _last_write: float = 0.0

    def __post_init__(self) -> None:
        if self.earlier is None:
            # Before the output is opened (truncated): no output exists
            # that its manifest does not describe.
            self.manifest.write(self.output, failure=InputError)
        else:
            self.manifest.records, self.manifest.sha256 = self.earlier.records, self.earlier.sha256

    def track(self, records: Iterable[Record]) -> Iterator[Record]:
        """The records, each digest kept until its answer is written."""
        if self.earlier is not None:
            records = _verified(records, self.earlier, self.output)
        for record in records:
            if record.number >= self.done:
                self._digests.append((record.number, record.digest or b""))
            yield record

    def due(self) -> bool:
        """Whether `update` may write now: called after every record, it is
        asked before the output counts what it holds."""
        return time.monotonic() - self._last_write >= MANIFEST_SECONDS

    def update(self, written: int | None, *, final: bool = False) -> None:
        """The output holds `written` more records in full than it did."""
        if written is None:
            return
        total = self.done + written
        now = time.monotonic()
        if total == self.manifest.records or (not final and now - self._last_write < MANIFEST_SECONDS):
            return
        while self._digests and self._digests[0][0] < total:
            self._digests.popleft()
        if total and not (self._digests and self._digests[0][0] == total):
            return  # not read here (cannot happen): the older manifest stands
        self.manifest.records = total
        self.manifest.sha256 = self._digests[0][1].hex() if total else _NOTHING_READ
        self.manifest.write(self.output)
        self._last_write = now

    def close(self, written: int | None) -> None:
        self.update(written, final=True)


def logged_restored(items: Iterable[Record | Restored], error_log: ErrorLog) -> Iterator[Record | Restored]:
    """The items, with the ``--errors`` line of each skipped record whose
    answer failed written as the earlier run wrote it, so the errors file
    of a resumed run is the one a clean run writes."""
    for item in items:
        if isinstance(item, Restored) and not item.answer.ok:
            error_log.add(item.record, item.answer, failure_detail(item.record))
        yield item
