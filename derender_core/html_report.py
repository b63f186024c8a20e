"""``--html``: one self-contained page to look at divergences.

Pure: no vLLM, no I/O. `build_page` turns the `Examination` of each request
(what every path answered, the token ids it was given, the divergences)
into one HTML string: inline CSS, a little JavaScript for the filters and
for opening the section an anchor points into, and nothing that loads from
anywhere. Everything is rendered here, and every value that comes from an
answer or a record reaches the page through one function, `_esc`
(`tests/test_html_report.py` holds the module to that); each is cut
(`_cut`, `_cut_strings`) so that the page stays linear in what is shown,
whatever a record holds: each request is a collapsed section, each pair of
paths in it shows its transcript (streams, aligned call by call) or its
response fields (one-shot) once, and each divergence is a card with an
anchor ``#d-<n>`` (``n`` its line in ``--report``) that highlights the
frames or fields it is about.
"""

from __future__ import annotations

import html
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

from .compare import (
    DRAWN_FIELDS,
    Classes,
    Divergence,
    Examination,
    Observed,
    choice_fields,
    choice_key,
    choices_by_index,
    json_text,
    null_fields,
    stream_shape,
)

VALUE_CHARS = 1200
"""A divergence's values are cut here on the page (the report keeps them whole)."""
CELL_CHARS = 400
"""A field's value in a response table is cut here."""
TEXT_CHARS = 400
"""The text emitted so far shows its last this many characters."""
TOKENS_SHOWN = 128
"""A chunk's token ids shown at most (a one-shot choice is one chunk)."""
NAME_CHARS = 200
"""A request id, field name or key is cut here (ids are repeated on the
page: in each section, card and filter)."""
FRAME_CHARS = 4000
"""A frame's JSON view is cut here, after each string in it is cut at
`CELL_CHARS`."""
TEXT_FIELDS = ("reasoning", "content", "text")
"""The fields whose text a client sees emitted, in the order shown."""
_CUMULATIVE = frozenset({*TEXT_FIELDS, "token_ids", "logprobs", "tool_calls"})
"""Fields a stream builds up frame by frame: they diverge where the
emitted sequences first disagree, not where two frames differ."""
_SHAPE = frozenset({"role_frame", "finish_frame", "empty_frames"})
_HIDDEN_FRAME_KEYS = ("id", "created")
"""Frame keys the frame summary leaves out (the JSON view keeps them)."""
_UNSAFE = re.compile("[\x00-\x08\x0b\x0c\x0d\x0e-\x1f\x7f\ud800-\udfff]")
"""Characters HTML cannot carry as they are (controls, lone surrogates):
shown as ``\\uXXXX``."""


def _esc(text: str) -> str:
    """`text` as HTML text or attribute value."""
    escaped = html.escape(text, quote=True)
    return _UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", escaped) if _UNSAFE.search(escaped) else escaped


_json = json_text


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text) - limit} more characters)"


def _name(value: Any) -> str:
    """A request id, field name or key as shown: text, cut."""
    return _cut(value if isinstance(value, str) else str(value), NAME_CHARS)


def _cut_strings(value: Any, limit: int) -> Any:
    """`value` with every string in it (keys too) cut at `limit`: a frame's
    JSON view then stays small whatever a record's ids or texts hold."""
    if isinstance(value, str):
        return _cut(value, limit)
    if isinstance(value, Mapping):
        return {_cut(k, limit) if isinstance(k, str) else k: _cut_strings(v, limit) for k, v in value.items()}
    if isinstance(value, list):
        return [_cut_strings(item, limit) for item in value]
    return value


def _tail(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"…{text[-limit:]}"


# --- what each frame carries ----------------------------------------------------


@dataclass
class _Frame:
    """One stream frame: its number on its side and what it carries."""

    number: int
    chunk: Mapping[str, Any]
    facts: dict[tuple[int | None, str], list[Any]] = field(default_factory=dict)
    """Non-null values per (choice index, field); request-level under None."""
    shape: dict[tuple[int | None, str], Any] = field(default_factory=dict)
    nulls: set[str] = field(default_factory=set)

    @classmethod
    def of(cls, number: int, chunk: Mapping[str, Any]) -> _Frame:
        frame = cls(number, chunk if isinstance(chunk, Mapping) else {})
        for choice in frame.chunk.get("choices") or []:
            if not isinstance(choice, Mapping):
                continue
            index = choice_key(choice.get("index"), None)
            for key, value in choice.items():
                if key == "delta" and isinstance(value, Mapping):
                    for name, item in value.items():
                        frame._add(index, name, item)
                elif key != "index":
                    frame._add(index, key, value)
        for key, value in frame.chunk.items():
            if key != "choices":
                frame._add(None, key, value)
        frame.shape = stream_shape([dict(frame.chunk)])
        frame.nulls = null_fields([dict(frame.chunk)])
        return frame

    def _add(self, index: int | None, name: str, value: Any) -> None:
        if value is not None:
            self.facts.setdefault((index, name), []).append(value)

    def carries(self, index: int | None, name: str, surplus: frozenset[str]) -> bool:
        """Whether this frame is one the divergence (index, name) is about."""
        if name in _SHAPE:
            if name == "empty_frames":
                return bool(self.shape.get((index, name)))
            return (index, name) in self.shape
        if name == "null_fields":
            return bool(self.nulls & surplus)
        return (index, name) in self.facts

    def emitted(self, index: int | None, name: str) -> Any:
        """What this frame adds to a cumulative field: text, or a list."""
        values = self.facts.get((index, name), [])
        if name in TEXT_FIELDS:
            return "".join(v for v in values if isinstance(v, str))
        items: list[Any] = []
        for value in values:
            if name == "logprobs" and isinstance(value, Mapping):
                value = value.get("content", value.get("tokens", [value]))
            items += value if isinstance(value, list) else [value]
        return items


@dataclass
class _Transcript:
    """Two streams side by side, one row per call (or per frame when the
    calls are unknown or do not line up)."""

    rows: list[tuple[list[_Frame], list[_Frame]]]
    inputs: list[dict[int, list[int]]] | None
    """The token ids each row's call carried, per choice index (parity)."""
    by_call: bool

    @classmethod
    def of(cls, left: Observed, right: Observed, calls: list[dict[int, list[int]]] | None) -> _Transcript:
        left_frames = [_Frame.of(n, c) for n, c in enumerate(left.chunks or [], 1)]
        right_frames = [_Frame.of(n, c) for n, c in enumerate(right.chunks or [], 1)]
        if left.calls is not None and right.calls is not None and len(left.calls) == len(right.calls):
            rows = list(zip(_split(left_frames, left.calls), _split(right_frames, right.calls), strict=True))
            usable = calls if calls is not None and len(calls) == len(rows) else None
            return cls(rows, usable, True)
        length = max(len(left_frames), len(right_frames))
        rows = [(left_frames[k : k + 1], right_frames[k : k + 1]) for k in range(length)]
        return cls(rows, None, False)

    def side(self, number: int) -> list[list[_Frame]]:
        return [row[number] for row in self.rows]


def _split(frames: list[_Frame], counts: list[int]) -> list[list[_Frame]]:
    ends = list(accumulate(counts))
    return [frames[end - count : end] for count, end in zip(counts, ends, strict=True)]


def _marked_rows(transcript: _Transcript, divergence: Divergence) -> tuple[list[int], list[set[int]]]:
    """The rows a divergence is about, and per side the frames in them."""
    index, name = divergence.index, divergence.field
    surplus = (frozenset(_strings(divergence.left_value)), frozenset(_strings(divergence.right_value)))
    sides = (transcript.side(0), transcript.side(1))
    if name in _CUMULATIVE:
        row = _first_split([[f.emitted(index, name) for f in frames] for frames in sides[0]],
                           [[f.emitted(index, name) for f in frames] for frames in sides[1]])  # fmt: skip
        rows = [] if row is None else [row]
    elif name == "null_fields":
        # A side's surplus nulls are usually in every frame: the divergence
        # is shown where each field first comes as null, on each side.
        firsts: tuple[set[int], set[int]] = (set(), set())
        for s in (0, 1):
            pending = set(surplus[s])
            for frame in (f for frames in sides[s] for f in frames):
                if frame.nulls & pending:
                    firsts[s].add(frame.number)
                    pending -= frame.nulls
        rows = [
            k for k, pair in enumerate(transcript.rows)
            if any(f.number in firsts[s] for s in (0, 1) for f in pair[s])
        ]  # fmt: skip
        return rows, [firsts[0], firsts[1]]
    elif name in _SHAPE:
        rows = [
            k for k, pair in enumerate(transcript.rows)
            if any(f.carries(index, name, surplus[s]) for s in (0, 1) for f in pair[s])
        ]  # fmt: skip
    else:
        rows = [
            k for k, (left, right) in enumerate(transcript.rows)
            if [f.facts.get((index, name)) for f in left if (index, name) in f.facts]
            != [f.facts.get((index, name)) for f in right if (index, name) in f.facts]
        ]  # fmt: skip
    frames: list[set[int]] = [set(), set()]
    for k in rows:
        for s in (0, 1):
            frames[s].update(f.number for f in transcript.rows[k][s] if f.carries(index, name, surplus[s]))
    return rows, frames


def _strings(value: Any) -> list[str]:
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []


def _first_split(left: list[list[Any]], right: list[list[Any]]) -> int | None:
    """The first row after which the two sides' emitted sequences disagree
    (neither a prefix of the other), else the row where the longer side
    first emits past the end of the shorter one. Linear: each element is
    compared once."""
    left_seq: list[Any] = []
    right_seq: list[Any] = []
    checked = 0
    for row, (lefts, rights) in enumerate(zip(left, right, strict=False)):
        for part in lefts:
            left_seq += list(part)
        for part in rights:
            right_seq += list(part)
        common = min(len(left_seq), len(right_seq))
        if left_seq[checked:common] != right_seq[checked:common]:
            return row
        checked = common
    if len(left_seq) == len(right_seq):
        return None
    shorter = min(len(left_seq), len(right_seq))
    longer = left if len(left_seq) > len(right_seq) else right
    length = 0
    for row, parts in enumerate(longer):
        length += sum(len(p) for p in parts)
        if length > shorter:
            return row
    return None


# --- the page ------------------------------------------------------------------


@dataclass
class _Context:
    """Where a divergence shows: its chunk's token ids, and per side the
    text emitted up to there."""

    tokens: str
    texts: tuple[str, str]
    label: str


@dataclass
class _Numbered:
    """A divergence with its number on the page (its line in the report)."""

    number: int
    divergence: Divergence


class _Page:
    """Builds the page into a list of strings, joined once."""

    def __init__(self, pieces: Mapping[int, str] | None) -> None:
        self.out: list[str] = []
        self.pieces = pieces or {}
        self.frame_ids = 0
        self.context: dict[int, _Context] = {}
        """Per divergence number: its chunk's token ids and the text so far."""

    def w(self, *parts: str) -> None:
        self.out.extend(parts)

    def new_id(self) -> str:
        self.frame_ids += 1
        return f"f-{self.frame_ids}"

    # -- a request --

    def request(self, number: int, examination: Examination, numbered: list[_Numbered], *, open_: bool) -> None:
        request_id = "—" if examination.request_id is None else _name(examination.request_id)
        pairs = Counter((n.divergence.left, n.divergence.right) for n in numbered)
        self.w(
            f'<details class="request" id="r-{number}" data-request="{_esc(request_id)}"{" open" if open_ else ""}>',
            f'<summary><span class="rid">{_esc(request_id)}</span> ',
            f'<span class="count">{len(numbered)} divergence{"" if len(numbered) == 1 else "s"}</span> ',
            '<span class="kinds">',
            *(f'<span class="chip">{_esc(f"{left} vs {right}")} <b>{count}</b></span>' for (left, right), count in pairs.items()),
            "</span></summary>",
        )
        groups: dict[tuple[str, str, str | None], list[_Numbered]] = {}
        for item in numbered:
            d = item.divergence
            groups.setdefault((d.left, d.right, d.chunking), []).append(item)
        for (left, right, chunking), members in groups.items():
            self.group(examination, left, right, chunking, members)
        self.w("</details>\n")

    def group(self, examination: Examination, left: str, right: str, chunking: str | None, members: list[_Numbered]) -> None:
        left_seen, right_seen = examination.side(left, chunking), examination.side(right, chunking)
        self.w(f'<section class="pair"><h3>{_esc(f"{left} vs {right}" + ("" if chunking is None else f" · chunking {chunking}"))}</h3>')
        body: list[str] = []
        marks: dict[int, tuple[list[str], str]] = {}
        if left_seen is not None and right_seen is not None and left_seen.error is None and right_seen.error is None:
            if left_seen.chunks is not None and right_seen.chunks is not None:
                calls = examination.calls.get(chunking)
                body, marks = self.transcript(_Transcript.of(left_seen, right_seen, calls), left, right, members, left_seen, right_seen)
            else:
                body, marks = self.fields(examination, left_seen, right_seen, left, right, members)
        for item in members:
            self.card(item, marks.get(item.number))
        self.w(*body, "</section>")

    # -- a divergence --

    def card(self, item: _Numbered, mark: tuple[list[str], str] | None) -> None:
        d = item.divergence
        self.w(
            f'<div class="div" id="d-{item.number}" data-kind="{_esc(_kind(d))}" data-left="{_esc(d.left)}" ',
            f'data-right="{_esc(d.right)}" data-field="{_esc(_name(d.field))}" data-request="{_esc(_name(d.request_id))}">',
            f'<div class="dhead"><a class="num" href="#d-{item.number}">#{item.number}</a> ',
            f'<b>{_esc(_name(d.field))}</b> <span class="where">{_esc("request" if d.index is None else f"choice {_name(d.index)}")}</span>',
            "" if d.chunking is None else f' <span class="where">chunking {_esc(d.chunking)}</span>',
        )
        if mark is not None:
            links, label = mark
            self.w(f' <span class="at">at {label}: ', " ".join(links), "</span>")
        context = self.context.get(item.number)
        if context is not None and context.tokens:
            self.w('<div class="toksline">', context.tokens, "</div>")
        self.w("</div>", '<div class="sides">')
        for s, (name, value) in enumerate(((d.left, d.left_value), (d.right, d.right_value))):
            self.w(
                f'<div class="side {"lr"[s]}"><div class="who">{_esc(name)}</div>',
                f'<pre class="val hl">{_esc(_cut(_json(value), VALUE_CHARS))}</pre>',
            )
            if context is not None:
                self.w(f'<div class="lbl">{_esc(context.label)}</div>', context.texts[s])
            self.w("</div>")
        self.w("</div></div>")

    # -- streams --

    def transcript(
        self, transcript: _Transcript, left: str, right: str, members: list[_Numbered], left_seen: Observed, right_seen: Observed
    ) -> tuple[list[str], dict[int, tuple[list[str], str]]]:
        row_ids = [self.new_id() for _ in transcript.rows]
        marked_rows: set[int] = set()
        marked_frames: tuple[set[int], set[int]] = (set(), set())
        marks: dict[int, tuple[list[str], str]] = {}
        texts = (_EmittedText(transcript.side(0)), _EmittedText(transcript.side(1)))
        unit = "call" if transcript.by_call else "frame"
        for item in members:
            rows, frames = _marked_rows(transcript, item.divergence)
            if not rows:
                continue
            marked_rows.update(rows)
            marked_frames[0].update(frames[0])
            marked_frames[1].update(frames[1])
            shown = rows[:8]
            links = [f'<a href="#{row_ids[k]}">{k + 1}</a>' for k in shown] + ([f"… {len(rows) - 8} more"] if len(rows) > 8 else [])
            marks[item.number] = (links, unit + ("s" if len(rows) > 1 else ""))
            self.context[item.number] = self.stream_context(transcript, rows[0], item.divergence, texts, left, right)
        out = [
            f'<details class="frames" open><summary>transcript: {len(transcript.rows)} {unit}s, '
            f"{len(left_seen.chunks or [])} frames from {_esc(left)}, {len(right_seen.chunks or [])} from {_esc(right)}</summary>",
            '<table class="tx"><thead><tr><th>', unit, "</th>",
            "<th>token ids in</th>" if transcript.inputs is not None else "",
            f"<th>{_esc(left)}</th><th>{_esc(right)}</th></tr></thead><tbody>",
        ]  # fmt: skip
        for k, (lefts, rights) in enumerate(transcript.rows):
            cls = ' class="hl"' if k in marked_rows else ""
            out.append(f'<tr id="{row_ids[k]}"{cls}><td class="n">{k + 1}</td>')
            if transcript.inputs is not None:
                out += ['<td class="in">', self.ids_by_choice(transcript.inputs[k], None), "</td>"]
            for frames, marked in ((lefts, marked_frames[0]), (rights, marked_frames[1])):
                out.append("<td>")
                out += [_frame_html(f, f.number in marked) for f in frames]
                out.append("</td>")
            out.append("</tr>")
        out.append("</tbody></table></details>")
        return out, marks

    def stream_context(
        self, transcript: _Transcript, row: int, d: Divergence, texts: tuple[_EmittedText, _EmittedText], left: str, right: str
    ) -> _Context:
        unit = "call" if transcript.by_call else "frame"
        tokens = ""
        if transcript.inputs is not None:
            tokens = f'<span class="lbl">token ids in {unit} {row + 1}</span>' + self.ids_by_choice(transcript.inputs[row], d.index)
        else:
            for s, name in ((0, left), (1, right)):
                carried: dict[int, list[int]] = {}
                for frame in transcript.rows[row][s]:
                    for (index, key), values in frame.facts.items():
                        if key == "token_ids" and index is not None and (d.index is None or index == d.index):
                            carried.setdefault(index, []).extend(i for v in values for i in (v if isinstance(v, list) else [v]))
                if carried:
                    tokens += f'<span class="lbl">token ids in {_esc(name)}’s frame {row + 1}</span>' + self.ids_by_choice(carried, None)
        return _Context(tokens, (texts[0].html(row, d.index), texts[1].html(row, d.index)), f"text emitted up to {unit} {row + 1}")

    # -- one-shot responses --

    def fields(
        self, examination: Examination, left_seen: Observed, right_seen: Observed, left: str, right: str, members: list[_Numbered]
    ) -> tuple[list[str], dict[int, tuple[list[str], str]]]:
        left_fields = _response_fields(left_seen.response or {})
        right_fields = _response_fields(right_seen.response or {})
        keys = list(left_fields) + [k for k in right_fields if k not in left_fields]
        keys.sort(key=lambda k: (k[0] is None, k[0] if isinstance(k[0], int) else 0))  # choices, then the request
        by_key: dict[tuple[int | None, str], list[_Numbered]] = {}
        for item in members:
            by_key.setdefault((item.divergence.index, item.divergence.field), []).append(item)
        row_ids = {key: self.new_id() for key in keys}
        marks: dict[int, tuple[list[str], str]] = {}
        for key, items in by_key.items():
            for item in items:
                if key in row_ids:
                    marks[item.number] = ([f'<a href="#{row_ids[key]}">{_esc(_name(key[1]))}</a>'], "field")
                context = self.one_shot_context(examination, item.divergence, left_fields, right_fields)
                if context is not None:
                    self.context[item.number] = context
        # A drawn field equal on both sides is chance, not agreement: never
        # counted equal, so the page is the same whenever the answers came.
        same = {
            k for k in keys
            if k not in by_key and not (k[0] is None and k[1] in DRAWN_FIELDS)
            and k in left_fields and k in right_fields and left_fields[k] == right_fields[k]
        }  # fmt: skip
        out = [
            f'<details class="frames" open><summary>response fields ({len(keys) - len(same)} shown, '
            f"{len(same)} equal on both sides: tick “equal fields” to show them)</summary>",
            f'<table class="tx"><thead><tr><th>choice</th><th>field</th><th>{_esc(left)}</th><th>{_esc(right)}</th></tr></thead><tbody>',
        ]
        for key in keys:
            cls = ' class="hl"' if key in by_key else ' class="same"' if key in same else ""
            index, name = key
            out.append(
                f'<tr id="{row_ids[key]}"{cls}><td class="n">{_esc("" if index is None else _name(index))}</td><td>{_esc(_name(name))}</td>'
                f'<td><pre class="cell">{_esc(_cut(_json(left_fields.get(key)), CELL_CHARS)) if key in left_fields else "<i>absent</i>"}</pre></td>'
                f'<td><pre class="cell">{_esc(_cut(_json(right_fields.get(key)), CELL_CHARS)) if key in right_fields else "<i>absent</i>"}</pre></td></tr>'
            )
        out.append("</tbody></table></details>")
        return out, marks

    def one_shot_context(
        self, examination: Examination, d: Divergence, left_fields: Mapping[Any, Any], right_fields: Mapping[Any, Any]
    ) -> _Context | None:
        if d.index is None:
            return None
        ids = examination.token_ids.get(d.index)
        tokens = "" if ids is None else '<span class="lbl">token ids (one chunk)</span>' + self.ids_by_choice({d.index: ids}, None)
        texts = tuple(
            "".join(_text_html(f, t) for f in TEXT_FIELDS if isinstance(t := fields.get((d.index, f)), str))
            or '<span class="none">no text</span>'
            for fields in (left_fields, right_fields)
        )
        return _Context(tokens, (texts[0], texts[1]), "text emitted")

    # -- token ids --

    def ids_by_choice(self, ids: Mapping[int, list[int]], only: int | None) -> str:
        parts = []
        for index, tokens in ids.items():
            if only is not None and index != only:
                continue
            shown = tokens[:TOKENS_SHOWN]
            parts.append(f'<div class="toks"><span class="ci">{_esc(f"[{_name(index)}]")}</span>')
            parts += [self.token(t) for t in shown]
            if not tokens:
                parts.append('<span class="none">no tokens</span>')
            if len(tokens) > TOKENS_SHOWN:
                parts.append(f'<span class="none">… {len(tokens) - TOKENS_SHOWN} more</span>')
            parts.append("</div>")
        return "".join(parts) or '<span class="none">no tokens</span>'

    def token(self, token_id: Any) -> str:
        piece = self.pieces.get(token_id) if isinstance(token_id, int) else None
        shown = "" if piece is None else _json(piece)[1:-1]
        return f'<span class="tok"><span class="id">{_esc(str(token_id))}</span><span class="pc">{_esc(shown)}</span></span>'


class _EmittedText:
    """One side's text per choice and field, with where each row ends: the
    text emitted up to a row is a prefix, found in constant time."""

    def __init__(self, rows: list[list[_Frame]]) -> None:
        self.full: dict[tuple[int, str], tuple[str, list[int]]] = {}
        keys = sorted(
            {(i, n) for frames in rows for f in frames for (i, n) in f.facts if i is not None and n in TEXT_FIELDS},
            key=lambda k: (k[0] if isinstance(k[0], int) else -1, TEXT_FIELDS.index(k[1])),
        )
        for key in keys:
            parts = ["".join(f.emitted(*key) for f in frames) for frames in rows]
            self.full[key] = ("".join(parts), list(accumulate(len(p) for p in parts)))

    def html(self, row: int, index: int | None) -> str:
        parts = []
        for (i, name), (full, ends) in self.full.items():
            if index is None or i == index:
                parts.append(_text_html(name, full[: ends[row]], None if index is not None else i))
        return "".join(parts) or '<span class="none">nothing yet</span>'


def _text_html(label: str, text: str, index: Any = None) -> str:
    """One field's text, its last `TEXT_CHARS` characters, labelled by the
    field (and the choice, when `index` is given)."""
    return (
        f'<div class="txt"><span class="fk">{_esc(label if index is None else f"[{_name(index)}] {label}")}</span> '
        f"<code>{_esc(_json(_tail(text, TEXT_CHARS)))}</code></div>"
    )


def _frame_html(frame: _Frame, marked: bool) -> str:
    """A frame as one line per choice (what it emits), the request-level keys
    it carries, and its whole JSON for the JSON view."""
    parts = [f'<div class="fr{" hl" if marked else ""}"><span class="fn">{frame.number}</span>']
    for choice in frame.chunk.get("choices") or []:
        if not isinstance(choice, Mapping):
            continue
        items = []
        delta = choice.get("delta") if isinstance(choice.get("delta"), Mapping) else {}
        for key, value in (*delta.items(), *((k, v) for k, v in choice.items() if k not in ("delta", "index"))):
            if value is None:
                continue
            if key == "logprobs" and isinstance(value, Mapping) and isinstance(value.get("content"), list):
                items.append(f'<span class="fk">logprobs</span> {len(value["content"])}')
            else:
                items.append(f'<span class="fk">{_esc(_name(key))}</span> {_esc(_cut(_json(value), CELL_CHARS))}')
        index = _name(_json(choice.get("index")))
        parts.append(f'<div class="ch"><span class="ci">{_esc(f"[{index}]")}</span> {" · ".join(items) or "<i>empty</i>"}</div>')
    extra = [
        f'<span class="fk">{_esc(_name(key))}</span> {_esc(_cut(_json(value), CELL_CHARS))}'
        for key, value in frame.chunk.items()
        if key not in ("choices", *_HIDDEN_FRAME_KEYS, "object", "model") and value is not None
    ]
    if extra:
        parts.append(f'<div class="ch env">{" · ".join(extra)}</div>')
    parts.append(f'<pre class="json">{_esc(_cut(_json(_cut_strings(frame.chunk, CELL_CHARS)), FRAME_CHARS))}</pre></div>')
    return "".join(parts)


def _response_fields(response: Mapping[str, Any]) -> dict[tuple[int | None, str], Any]:
    """A response's fields by (choice index, name), as `compare` names them."""
    found: dict[tuple[int | None, str], Any] = {}
    for index, choice in choices_by_index(response.get("choices")).items():
        for name, value in choice_fields(choice).items():
            if name != "choice":
                found[(index, name)] = value
    for name, value in response.items():
        if name != "choices":
            found[(None, name)] = value
    return found


@dataclass(frozen=True)
class Shown:
    """Where the examinations a page shows sit in a larger run: each one's
    number among the requests compared and the number of its first
    divergence (its line in the report), the run's classes, how many
    requests it compared, and per class the ids of requests not shown
    (the first `IDS_SHOWN` of them, and how many in all)."""

    numbers: Sequence[tuple[int, int]]
    classes: Classes
    requests: int
    more: Mapping[str, tuple[Sequence[str | None], int]] = field(default_factory=dict)


IDS_SHOWN = 200
"""Request ids a class lists on the page beyond its examples."""


def build_page(
    examinations: Sequence[Examination],
    *,
    title: str,
    subtitle: str = "",
    pieces: Mapping[int, str] | None = None,
    skipped: Iterable[tuple[str, str]] = (),
    shown: Shown | None = None,
) -> str:
    """The page: the classes of divergences, a summary by kind and pair of
    paths, filters, and a collapsed section per request with a divergence;
    divergence ``n`` (from 1, in the examinations' order: the report's) has
    the anchor ``d-<n>``. `pieces` maps token ids to their vocabulary
    pieces; `skipped` lists (request, why) for requests that could not be
    compared. `shown` places the examinations in a larger run, whose
    classes and counts the page then gives (the rest of its requests as
    ids only)."""
    page = _Page(pieces)
    numbered: list[list[_Numbered]] = []
    if shown is None:
        classes = Classes()
        for examination in examinations:
            classes.add(examination.divergences)
        starts = accumulate((len(e.divergences) for e in examinations), initial=1)
        positions = [(n, start) for (n, _), start in zip(enumerate(examinations, 1), starts, strict=False)]
        requests, more = len(examinations), {}
    else:
        classes, positions, requests, more = shown.classes, list(shown.numbers), shown.requests, shown.more
    for examination, (_, start) in zip(examinations, positions, strict=True):
        numbered.append([_Numbered(start + offset, d) for offset, d in enumerate(examination.divergences)])
    every = [n for items in numbered for n in items]
    page.w(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">",
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{_esc(title)}</title><style>{_CSS}</style></head>",
        f'<body data-total="{len(every)}"><header><h1>{_esc(title)}</h1>',
        f'<div class="sub">{_esc(subtitle)}</div>' if subtitle else "",
        *(f'<div class="sub">{_esc(line)}</div>' for line in _chunkings(examinations)),
        "</header>",
    )
    _summary(page, every, classes, requests, more)
    skipped = list(skipped)
    if skipped:
        page.w(f'<details class="skipped"><summary>{len(skipped)} request(s) not compared</summary><ul>')
        page.w(*(f"<li><b>{_esc(_name(r))}</b>: {_esc(_cut(why, CELL_CHARS))}</li>" for r, why in skipped))
        page.w("</ul></details>")
    page.w('<main id="requests">')
    first = True
    for (number, _), examination, items in zip(positions, examinations, numbered, strict=True):
        if items:
            page.request(number, examination, items, open_=first)
            first = False
    page.w("</main>", f"<script>{_JS}</script></body></html>\n")
    return "".join(page.out)


def _chunkings(examinations: Sequence[Examination]) -> list[str]:
    """How the streams compared were cut, from the examinations: a
    stream input runs with its own chunking, a one-shot body cut by each
    ``--chunking`` spec."""
    found = dict.fromkeys(chunking for examination in examinations for chunking in examination.calls)
    names = ["the input's own" if chunking is None else chunking for chunking in found]
    return [f"stream chunking: {', '.join(names)}"] if names else []


def _kind(d: Divergence) -> str:
    """A divergence's kind as the page groups and filters it (its field cut)."""
    return f"{d.left} vs {d.right}: {_name(d.field)}"


def _summary(
    page: _Page, every: list[_Numbered], classes: Classes, requests: int,
    more: Mapping[str, tuple[Sequence[str | None], int]],
) -> None:  # fmt: skip
    count, with_divergences = classes.divergences, classes.requests_with
    paths = list(dict.fromkeys(p for d in (n.divergence for n in every) for p in (d.left, d.right)))
    page.w(
        f'<section class="summary"><p><b>{count}</b> divergence{"" if count == 1 else "s"} in ',
        f"<b>{with_divergences}</b> of {requests} request{'' if requests == 1 else 's'} compared.</p>",
    )
    if not count:
        page.w("<p>No divergences.</p></section>")
        return
    _classes(page, classes, more)
    kinds: dict[tuple[str, str, str], tuple[int, int]] = {}
    for tally in classes.kinds.values():
        d = tally.rows[0]
        count, first = kinds.get((d.left, d.right, _name(d.field)), (0, tally.first_number))
        kinds[(d.left, d.right, _name(d.field))] = (count + tally.count, first)
    pairs: dict[tuple[str, str], list[tuple[str, int, int]]] = {}
    for (left, right, name), (count, first) in kinds.items():
        pairs.setdefault((left, right), []).append((name, count, first))
    page.w(
        '<table class="sum"><thead><tr><th>pair of paths</th><th>divergences</th><th>requests</th>',
        "<th>fields (click: filter and go to the first)</th></tr></thead><tbody>",
    )
    for (left, right), groups in pairs.items():
        groups.sort(key=lambda group: (-group[1], group[0]))
        requests_hit = classes.pairs.get((left, right), 0)
        page.w(
            f"<tr><td>{_esc(left)} vs {_esc(right)}</td><td class=\"n\">{sum(g[1] for g in groups)}</td>",
            f'<td class="n">{requests_hit}</td><td>',
            *(
                f'<a class="kchip" href="#d-{number}" data-kind="{_esc(f"{left} vs {right}: {name}")}">'
                f"{_esc(name)} <b>{count}</b></a>"
                for name, count, number in groups
            ),
            "</td></tr>",
        )
    page.w("</tbody></table>")
    shown_kinds = Counter(_kind(n.divergence) for n in every)
    page.w(
        '<form class="filters" onsubmit="return false"><label>kind <select id="f-kind"><option value="">all</option>',
        *(f'<option value="{_esc(kind)}">{_esc(kind)} ({count})</option>' for kind, count in shown_kinds.items()),
        '</select></label> <label>path <select id="f-path"><option value="">all</option>',
        *(f'<option value="{_esc(p)}">{_esc(p)}</option>' for p in paths),
        '</select></label> <label>request <input id="f-request" type="search" placeholder="id contains"></label> ',
        '<button type="button" id="f-open">open all</button> <button type="button" id="f-close">close all</button> ',
        '<label><input type="checkbox" id="f-json"> frames as JSON</label> ',
        '<label><input type="checkbox" id="f-same"> equal fields</label> ',
        f'<span id="shown">{len(every)} of {len(every)} shown</span></form></section>',
    )


def _classes(page: _Page, classes: Classes, more: Mapping[str, tuple[Sequence[str | None], int]]) -> None:
    """The classes table: per class its divergences, requests, a link to its
    first example and the first request ids; the requests not shown in
    full, as ids."""
    page.w(
        '<table class="sum classes"><thead><tr><th>class</th><th>divergences</th><th>requests</th>',
        "<th>first requests (click: its first divergence)</th></tr></thead><tbody>",
    )
    for tally in classes.ordered():
        number, count, requests = tally.first_number, tally.divergences, tally.requests
        page.w(
            f'<tr><td><a href="#d-{number}">{_esc(_cut(tally.name, CELL_CHARS))}</a></td>',
            f'<td class="n">{count}</td><td class="n">{requests}</td>',
            f"<td>{_esc(', '.join('—' if i is None else _name(i) for i in tally.ids))}",
        )
        ids, count = more.get(tally.name, ((), 0))
        if count:
            listed = ", ".join("—" if i is None else _name(i) for i in ids)
            listed += f" and {count - len(ids)} more (in the report)" if count > len(ids) else ""
            page.w(
                f'<details class="more"><summary>{count} not shown</summary>',
                f'<div class="ids">{_esc(listed)}</div></details>',
            )
        page.w("</td></tr>")
    page.w("</tbody></table>")


_CSS = """
:root{--bg:#fafafa;--fg:#1d2125;--mut:#667;--line:#dde;--l:#1f6feb;--r:#b35900;--hl:#fff1b8;--hlb:#e0a800;--card:#fff}
*{box-sizing:border-box}
body{margin:0;font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:var(--fg);background:var(--bg)}
header{padding:14px 24px 8px;border-bottom:1px solid var(--line);background:#fff}
h1{font-size:20px;margin:0}
.sub{color:var(--mut);margin-top:2px}
.summary,main{padding:8px 24px}
table{border-collapse:collapse}
.sum th,.sum td{padding:3px 10px;border-bottom:1px solid var(--line);text-align:left}
.kchip{display:inline-block;font-size:12px;background:#eef3ff;color:#1c3d7a;border-radius:10px;padding:0 8px;margin:1px 4px 1px 0;text-decoration:none}
.kchip:hover{background:#d6e4ff}
td.n{text-align:right;font-variant-numeric:tabular-nums;color:var(--mut)}
.filters{margin:12px 0 4px;display:flex;gap:12px;flex-wrap:wrap;align-items:center}
.filters select,.filters input[type=search]{font:inherit;padding:2px 4px;max-width:24em}
#shown{color:var(--mut)}
details.request{background:var(--card);border:1px solid var(--line);border-radius:6px;margin:8px 0}
details.request>summary{padding:8px 12px;cursor:pointer;display:flex;gap:10px;align-items:baseline;flex-wrap:wrap}
.rid{font-weight:600;font-family:ui-monospace,SFMono-Regular,Menlo,monospace}
.count{color:var(--mut)}
.chip{display:inline-block;font-size:12px;background:#eef0f4;border-radius:10px;padding:0 8px;margin:1px 3px 1px 0}
section.pair{padding:4px 12px 10px;border-top:1px solid var(--line)}
h3{font-size:15px;margin:8px 0}
.div{border-left:4px solid var(--hlb);background:#fffdf3;margin:8px 0;padding:6px 10px;border-radius:0 4px 4px 0}
.div:target{outline:2px solid var(--l)}
.dhead{margin-bottom:4px}
.num{font-weight:700;text-decoration:none;margin-right:4px}
.where,.at{color:var(--mut);margin-left:6px}
.sides{display:grid;grid-template-columns:1fr 1fr;gap:10px}
.side .who{font-size:12px;font-weight:600}
.side.l .who{color:var(--l)}.side.r .who{color:var(--r)}
pre{margin:0;white-space:pre-wrap;word-break:break-all;font:12px/1.4 ui-monospace,SFMono-Regular,Menlo,monospace}
pre.val{max-height:14em;overflow:auto;padding:4px 6px;border-radius:3px}
pre.val.hl{background:var(--hl)}
.lbl{font-size:12px;color:var(--mut);margin:3px 0 1px}
.toksline{display:flex;flex-wrap:wrap;gap:4px 10px;align-items:center;margin-top:3px}
.toksline .lbl{margin:0}
.toks{display:inline-flex;flex-wrap:wrap;gap:3px;align-items:flex-start;margin:1px 0}
.tok{display:inline-flex;flex-direction:column;align-items:center;border:1px solid var(--line);border-radius:3px;padding:0 4px;background:#fff;font:12px ui-monospace,SFMono-Regular,Menlo,monospace}
.tok .id{color:var(--mut);font-size:10px}.tok .pc{white-space:pre}
.ci{color:var(--mut);font:12px ui-monospace,monospace;margin-right:4px}
.none{color:var(--mut);font-style:italic;font-size:12px}
.txt code{font:12px ui-monospace,SFMono-Regular,Menlo,monospace;white-space:pre-wrap;word-break:break-all}
.fk{color:var(--mut);font-size:12px}
details.frames>summary{cursor:pointer;color:var(--mut);margin:6px 0}
table.tx{width:100%;table-layout:fixed;font-size:12px}
table.tx th{text-align:left;color:var(--mut);font-weight:600;border-bottom:1px solid var(--line);padding:2px 6px}
table.tx th:first-child{width:4em}
table.tx td{vertical-align:top;border-bottom:1px solid #eef;padding:2px 6px;overflow-wrap:anywhere}
table.tx td.in{width:22%}
table.tx tr.hl>td{background:#fff8d6}
table.tx tr:target>td{outline:2px solid var(--l)}
.fr{border-radius:3px;padding:1px 4px;margin:1px 0;font-family:ui-monospace,SFMono-Regular,Menlo,monospace}
.fr.hl{background:var(--hl);box-shadow:inset 3px 0 0 var(--hlb)}
.fn{color:var(--mut);font-size:10px;margin-right:6px}
.ch{display:inline}.ch.env{display:block;color:#445}
.fr .json{display:none}
body.json .fr .json{display:block}body.json .fr .ch{display:none}
pre.cell{max-height:10em;overflow:auto}
table.tx tr.same{display:none}body.same table.tx tr.same{display:table-row}
details>summary{list-style:none}details>summary::-webkit-details-marker{display:none}
details>summary::before{content:"▸";color:var(--mut);display:inline-block;width:1em}
details[open]>summary::before{content:"▾"}
[hidden]{display:none!important}
"""

_JS = """
(function(){
var $=function(id){return document.getElementById(id)};
if(!$('f-kind')){document.body.setAttribute('data-ready','0');return}
var cards=Array.prototype.slice.call(document.querySelectorAll('.div'));
var total=cards.length;
function openTo(el){for(var p=el;p;p=p.parentElement){if(p.tagName==='DETAILS')p.open=true}}
function go(){var h=location.hash.slice(1);try{h=decodeURIComponent(h)}catch(e){}if(!h)return;var el=$(h);if(el){openTo(el);el.scrollIntoView({block:'center'})}}
function apply(){
 var kind=$('f-kind').value,path=$('f-path').value,req=$('f-request').value.trim(),shown=0;
 for(var i=0;i<cards.length;i++){var c=cards[i],d=c.dataset;
  var ok=(!kind||d.kind===kind)&&(!path||d.left===path||d.right===path)&&(!req||d.request.indexOf(req)>=0);
  c.hidden=!ok;if(ok)shown++}
 var groups=document.querySelectorAll('section.pair,details.request');
 for(var j=0;j<groups.length;j++){groups[j].hidden=!groups[j].querySelector('.div:not([hidden])')}
 $('shown').textContent=shown+' of '+total+' shown';
}
['f-kind','f-path'].forEach(function(id){$(id).addEventListener('change',apply)});
$('f-request').addEventListener('input',apply);
$('f-json').addEventListener('change',function(){document.body.classList.toggle('json',this.checked)});
$('f-same').addEventListener('change',function(){document.body.classList.toggle('same',this.checked)});
function all(open){var ds=document.querySelectorAll('details.request');for(var i=0;i<ds.length;i++)if(!ds[i].hidden)ds[i].open=open}
$('f-open').addEventListener('click',function(){all(true)});
$('f-close').addEventListener('click',function(){all(false)});
var chips=document.querySelectorAll('.kchip');
for(var k=0;k<chips.length;k++)chips[k].addEventListener('click',function(){$('f-kind').value=this.dataset.kind;$('f-path').value='';$('f-request').value='';apply()});
window.addEventListener('hashchange',go);
apply();go();
document.body.setAttribute('data-ready',String(total));
})();
"""
