"""Field-level comparison of what two paths answered for one request.

Pure: no vLLM, no I/O. `derender parity` and `derender diff` both reduce
each side to an `Observed` (a response, the chunks of a stream and its
assembled response, or an error) and report each difference as a
`Divergence`, after the normalisation the user chose.

Fields, per choice index: ``content``, ``reasoning``, ``tool_calls``,
``text`` (completions), ``finish_reason``, ``stop_reason``, ``logprobs``,
and any other choice or message key by its own name (``token_ids``,
``role``, ...); per request: ``usage`` and the envelope keys (``model``,
``object``, ``system_fingerprint``, ``id``, ...), and ``error`` when one
side failed. Two streams are also compared by their shape, which an
assembled response hides:

- ``role_frame`` (per choice): whether the frame that first carries the
  role carries output too (``"with output"``) or nothing else
  (``"role only"``, as `vllm serve`'s leading role frame);
- ``empty_frames`` (per choice): frames that carry nothing at all (no
  output, role, finish reason or logprobs);
- ``finish_frame`` (per choice): whether the frame that carries
  ``finish_reason`` carries output too (``"with output"``) or not;
- ``null_fields``: the frame fields one side writes as ``null`` where the
  other leaves them out (each side's surplus).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

ABSENT = "<absent>"
"""A field one side leaves out, when null and absent are told apart."""
_RANDOM_TOOL_ID = re.compile(r"chatcmpl-tool-[0-9a-f]+")
# The tool-call id formats some parsers draw at random instead: xLAM's
# call_<index>_<16 hex digits>, Mistral's 9 letters and digits. Only an
# "id" field is matched against them; Kimi's ids (functions.<name>:<n>)
# are not random, so they are compared.
_XLAM_TOOL_ID = re.compile(r"(call_\d+_)[0-9a-f]{16}")
_MISTRAL_TOOL_ID = re.compile(r"[A-Za-z0-9]{9}")
_OUTPUT_KEYS = ("content", "reasoning", "tool_calls")


@dataclass(frozen=True)
class Normalization:
    """What comparisons overlook; each is on by default."""

    created: bool = True
    """Timestamps (``created``) are not compared."""
    random_ids: bool = True
    """Response ids and random tool-call ids (vLLM's ``chatcmpl-tool-<hex>``,
    xLAM's and Mistral's) are not compared."""
    null_is_absent: bool = True
    """A field set to null (or ``tool_calls`` set to ``[]``) equals a field
    left out."""


DEFAULT_NORMALIZATION = Normalization()

DRAWN_FIELDS = frozenset({"created", "id"})
"""A response's own fields that each answer draws afresh (its timestamp,
its random id): two answers share them by chance only (both timestamps in
one second, which hangs on how long the paths between took), never as
an agreement."""


@dataclass(frozen=True)
class Divergence:
    """One field on which two paths disagree for one request."""

    request_id: str | None
    index: Any
    """The choice index (an integer, or whatever an answer read back holds
    there); None for request-level fields."""
    left: str
    right: str
    field: str
    left_value: Any
    right_value: Any
    chunking: str | None = None
    """How one-shot tokens were cut into a stream, when that applies."""

    @property
    def kind(self) -> str:
        """What divergences are grouped by."""
        return f"{self.left} vs {self.right}: {self.field}"

    def to_json(self) -> dict[str, Any]:
        record = {
            "request_id": self.request_id,
            "index": self.index,
            "left": self.left,
            "right": self.right,
            "field": self.field,
            "left_value": self.left_value,
            "right_value": self.right_value,
        }
        if self.chunking is not None:
            record["chunking"] = self.chunking
        return record


@dataclass
class Observed:
    """What one path gave for one request: a response (one-shot, or
    assembled from a stream), the stream's chunks when it streamed, or the
    error it answered."""

    response: dict[str, Any] | None = None
    chunks: list[dict[str, Any]] | None = None
    error: str | None = None
    notes: list[str] = field(default_factory=list)
    calls: list[int] | None = None
    """For a stream run call by call: how many of `chunks` answer each call
    (serve sends a call's frames once the next call has come; they count
    with the call they answer), so that two paths' transcripts line up by
    call."""


@dataclass
class Examination:
    """One request examined: what each side answered and where the sides
    differ. Reports keep the divergences only; ``--html`` shows the rest."""

    request_id: str | None
    observed: dict[tuple[str, str | None], Observed] = field(default_factory=dict)
    """Per (path, chunking); the chunking is None for a one-shot path and
    for a stream that ran with its own chunking."""
    divergences: list[Divergence] = field(default_factory=list)
    calls: dict[str | None, list[dict[int, list[int]]]] = field(default_factory=dict)
    """Per chunking: the token ids each stream call carried, per choice index."""
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    """The one-shot body's token ids, per choice index."""
    logs: tuple[Any, ...] = ()
    """vLLM's log records while the paths ran (`logs.LogLine`), counted
    where the examinations come together, in input order."""

    def side(self, path: str, chunking: str | None) -> Observed | None:
        """What `path` answered under `chunking` (a one-shot path under any)."""
        found = self.observed.get((path, chunking))
        return found if found is not None else self.observed.get((path, None))


def compare(
    left_name: str,
    left: Observed,
    right_name: str,
    right: Observed,
    *,
    request_id: str | None,
    ignore: Iterable[str] = (),
    normalization: Normalization = DEFAULT_NORMALIZATION,
    chunking: str | None = None,
) -> list[Divergence]:
    """Every field on which the two sides differ, in a stable order."""
    ignored = set(ignore)
    found: list[Divergence] = []

    def note(index: int | None, name: str, left_value: Any, right_value: Any) -> None:
        if name not in ignored and left_value != right_value:
            found.append(
                Divergence(request_id, index, left_name, right_name, name, left_value, right_value, chunking)
            )

    if left.error is not None or right.error is not None:
        note(None, "error", left.error, right.error)
        return found
    # Without null_is_absent a field left out shows as ABSENT, else as null.
    missing = None if normalization.null_is_absent else ABSENT
    left_response = normalized(left.response or {}, normalization)
    right_response = normalized(right.response or {}, normalization)
    left_choices = choices_by_index(left_response.get("choices"))
    right_choices = choices_by_index(right_response.get("choices"))
    for index in sorted(left_choices.keys() | right_choices.keys(), key=_index_order):
        left_fields = choice_fields(left_choices.get(index))
        right_fields = choice_fields(right_choices.get(index))
        for name in _ordered(left_fields.keys() | right_fields.keys()):
            note(index, name, left_fields.get(name, missing), right_fields.get(name, missing))
    for name in _ordered((left_response.keys() | right_response.keys()) - {"choices"}):
        note(None, name, left_response.get(name, missing), right_response.get(name, missing))
    if left.chunks is not None and right.chunks is not None:
        left_shape, right_shape = stream_shape(left.chunks), stream_shape(right.chunks)
        for (index, name) in sorted(left_shape.keys() | right_shape.keys(), key=_shape_order):
            note(index, name, left_shape.get((index, name)), right_shape.get((index, name)))
        left_nulls, right_nulls = null_fields(left.chunks), null_fields(right.chunks)
        if left_nulls != right_nulls:
            note(None, "null_fields", sorted(left_nulls - right_nulls), sorted(right_nulls - left_nulls))
    return found


_FIELD_ORDER = (
    "content", "reasoning", "tool_calls", "text", "finish_reason", "stop_reason", "logprobs", "usage",
)  # fmt: skip


def _ordered(names: Iterable[str]) -> list[str]:
    """The documented fields first, in their order, then the rest by name."""
    names = set(names)
    return [n for n in _FIELD_ORDER if n in names] + sorted(names - set(_FIELD_ORDER))


def _index_order(index: Any) -> tuple[int, Any]:
    """Integer indexes in order, then any other (an answer read back may
    hold one), by its JSON text."""
    if isinstance(index, int) and not isinstance(index, bool):
        return (0, index)
    return (1, json_text(index))


def _shape_order(key: tuple[Any, str]) -> tuple[tuple[int, Any], str]:
    index, name = key
    return ((-1, 0) if index is None else _index_order(index), name)


def json_text(value: Any) -> str:
    """`value` as compact JSON, whatever an answer read back holds: integers
    past 64 bits and lone surrogates too (orjson takes neither), integer
    keys as strings."""
    try:
        return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode()
    except (orjson.JSONEncodeError, TypeError):
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)


def choice_key(index: Any, position: int | None) -> Any:
    """A choice's key: its ``index`` as given (a list or object by its JSON
    text, so that it can be a key), its position in the list without one."""
    if isinstance(index, (list, Mapping)):
        return json_text(index)
    return position if index is None else index


def choices_by_index(choices: Any) -> dict[Any, Mapping[str, Any]]:
    if not isinstance(choices, list):
        return {}
    return {choice_key(c.get("index"), i): c for i, c in enumerate(choices) if isinstance(c, Mapping)}


def choice_fields(choice: Mapping[str, Any] | None) -> dict[str, Any]:
    """A choice's fields by their report names; a missing choice is one
    field, ``choice``."""
    if choice is None:
        return {"choice": None}
    fields: dict[str, Any] = {"choice": "present"}
    for key, value in choice.items():
        if key == "index":
            continue
        if key == "message" and isinstance(value, Mapping):
            fields.update(value)
        else:
            fields[key] = value
    return fields


def normalized(value: Any, normalization: Normalization, top: bool = True) -> Any:
    """`value` with what the normalisation overlooks taken out."""
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if normalization.created and key == "created":
                continue
            if normalization.random_ids and key == "id":
                if top:
                    continue
                if isinstance(item, str):
                    out[key] = _random_tool_id(item)
                    continue
            if normalization.null_is_absent and (item is None or (key == "tool_calls" and item == [])):
                continue
            out[key] = normalized(item, normalization, top=False)
        return out
    if isinstance(value, list):
        return [normalized(item, normalization, top=False) for item in value]
    if normalization.random_ids and isinstance(value, str):
        return _RANDOM_TOOL_ID.sub("chatcmpl-tool-<id>", value)
    return value


def _random_tool_id(value: str) -> str:
    if _MISTRAL_TOOL_ID.fullmatch(value):
        return "<random-id>"
    return _XLAM_TOOL_ID.sub(r"\1<id>", _RANDOM_TOOL_ID.sub("chatcmpl-tool-<id>", value))


def _has_output(choice: Mapping[str, Any]) -> bool:
    delta = choice.get("delta")
    delta = delta if isinstance(delta, Mapping) else {}
    return bool(
        any(delta.get(key) for key in _OUTPUT_KEYS)
        or choice.get("text")
        or choice.get("logprobs") is not None
    )


def stream_shape(chunks: list[dict[str, Any]]) -> dict[tuple[int | None, str], Any]:
    """The shape fields of one stream, keyed by (choice index, field)."""
    shape: dict[tuple[int | None, str], Any] = {}
    for chunk in chunks:
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, Mapping):
                continue
            index = choice_key(choice.get("index"), None)
            delta = choice.get("delta")
            delta = delta if isinstance(delta, Mapping) else {}
            finish = choice.get("finish_reason") is not None
            output = _has_output(choice)
            if delta.get("role") and (index, "role_frame") not in shape:
                shape[(index, "role_frame")] = "with output" if output or finish else "role only"
            if finish:
                shape[(index, "finish_frame")] = "with output" if output else "without output"
            empty = not (output or finish or delta.get("role"))
            shape[(index, "empty_frames")] = shape.get((index, "empty_frames"), 0) + empty
    return shape


def null_fields(chunks: list[dict[str, Any]]) -> set[str]:
    """The frame fields written as null, as dotted paths (``[]`` for any
    list item), over a whole stream."""
    found: set[str] = set()

    def walk(value: Any, path: str) -> None:
        if isinstance(value, Mapping):
            for key, item in value.items():
                child = f"{path}.{key}" if path else key
                if item is None:
                    found.add(child)
                else:
                    walk(item, child)
        elif isinstance(value, list):
            for item in value:
                walk(item, f"{path}[]")

    for chunk in chunks:
        walk(chunk, "")
    return found


# --- classes of divergences ------------------------------------------------------

ENUMERATED_FIELDS = frozenset({"role_frame", "finish_frame", "finish_reason", "object"})
"""Fields whose values are a few words: a divergence's class (and its
minimal record's likeness) keeps both words."""
SIGNATURE_CHARS = 120
"""A class signature is cut here: a class names a kind of difference, the
report keeps the values."""


def value_kind(value: Any) -> str:
    """What kind of JSON value `value` is: null, boolean, number, text, list, object."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "text"
    return "list" if isinstance(value, list) else "object"


def _side_signature(value: Any) -> str:
    """One side's value, as a class tells it: a count as zero or not, a
    list as empty or not, anything else by its kind."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return "0" if value == 0 else "N"
    if isinstance(value, list):
        return "none" if not value else "items"
    return value_kind(value)


def _object_signature(left: Mapping[str, Any], right: Mapping[str, Any]) -> str:
    """Two objects by the keys on which they differ: ``K absent vs
    present``, ``K present vs absent``, or ``K: <left kind> vs <right kind>``."""
    parts = []
    for key in sorted({*left, *right}, key=str):
        if key not in right:
            parts.append(f"{key} present vs absent")
        elif key not in left:
            parts.append(f"{key} absent vs present")
        elif left[key] != right[key]:
            parts.append(f"{key}: {_side_signature(left[key])} vs {_side_signature(right[key])}")
    return ", ".join(parts)


def signature(divergence: Divergence) -> str:
    """A short signature of a divergence's two values, the same for every
    divergence of one kind of difference: the words of an enumerated field
    (``with output vs role only``), the keys two objects differ on
    (``completion_tokens_details absent vs present``), a stop-logic finding
    with its token numbers as N, else each side's kind of value (``null vs
    text``; counts as ``0`` or ``N``, lists as ``none`` or ``items``)."""
    left, right = divergence.left_value, divergence.right_value
    if divergence.field in ENUMERATED_FIELDS and isinstance(left, str | None) and isinstance(right, str | None):
        text = f"{left} vs {right}"
    elif divergence.field == "stop_logic":
        text = re.sub(r"\d+", "N", f"{left} vs {right}")
    elif isinstance(left, Mapping) and isinstance(right, Mapping):
        text = _object_signature(left, right)
    else:
        text = f"{_side_signature(left)} vs {_side_signature(right)}"
    return text if len(text) <= SIGNATURE_CHARS else text[: SIGNATURE_CHARS - 1] + "…"


def class_of(divergence: Divergence) -> str:
    """A divergence's class: its pair of paths, field and `signature`
    (``replay vs serve: usage: completion_tokens_details absent vs present``)."""
    return f"{divergence.kind}: {signature(divergence)}"


IDS_KEPT = 5
"""Request ids a class tally keeps, for the summary and the table."""
ROWS_KEPT = 5
"""Divergences a kind keeps for the table on stderr."""


@dataclass
class ClassTally:
    """One class of divergences over a run: how many, in how many requests,
    the first few request ids and its first divergence (and its number:
    its line in the report)."""

    name: str
    first: Divergence
    first_number: int
    divergences: int = 0
    requests: int = 0
    ids: list[str | None] = field(default_factory=list)
    """The first `IDS_KEPT` requests that show it, in input order."""


@dataclass
class KindTally:
    """One kind (pair of paths and field) over a run: its count, its first
    rows for the table and its first divergence's number."""

    count: int = 0
    first_number: int = 0
    rows: list[Divergence] = field(default_factory=list)


@dataclass
class Classes:
    """Every divergence of a run, counted by class and by kind, in memory
    that grows with the classes, not the divergences: `add` takes one
    request's divergences at a time, in input order."""

    classes: dict[str, ClassTally] = field(default_factory=dict)
    kinds: dict[str, KindTally] = field(default_factory=dict)
    pairs: dict[tuple[str, str], int] = field(default_factory=dict)
    """Requests per pair of paths."""
    divergences: int = 0
    requests_with: int = 0
    """Requests with at least one divergence."""

    def add(self, divergences: Iterable[Divergence]) -> list[str]:
        """Count one request's divergences; their classes, in order."""
        names: list[str] = []
        seen: set[str] = set()
        pairs: set[tuple[str, str]] = set()
        for divergence in divergences:
            self.divergences += 1
            name = class_of(divergence)
            names.append(name)
            tally = self.classes.get(name)
            if tally is None:
                tally = self.classes[name] = ClassTally(name, divergence, self.divergences)
            tally.divergences += 1
            if name not in seen:
                seen.add(name)
                tally.requests += 1
                if len(tally.ids) < IDS_KEPT:
                    tally.ids.append(divergence.request_id)
            kind = self.kinds.get(divergence.kind)
            if kind is None:
                kind = self.kinds[divergence.kind] = KindTally(first_number=self.divergences)
            kind.count += 1
            if len(kind.rows) < ROWS_KEPT:
                kind.rows.append(divergence)
            pairs.add((divergence.left, divergence.right))
        self.requests_with += bool(names)
        for pair in pairs:
            self.pairs[pair] = self.pairs.get(pair, 0) + 1
        return names

    def ordered(self) -> list[ClassTally]:
        """The classes, most divergences first, then by name."""
        return sorted(self.classes.values(), key=lambda tally: (-tally.divergences, tally.name))


def report_line(divergence: Divergence) -> bytes:
    """One ``--report`` line, its values whole. A lone surrogate an answer
    held is written as its JSON escape (``\\udc80``): the line stays UTF-8,
    and reads back as the same string."""
    return json_text(divergence.to_json()).encode("utf-8", "backslashreplace") + b"\n"
