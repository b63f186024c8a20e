"""One-shot chat and completion logprobs written from the loaded body, with
no model per position: fast path ``logprobs`` (`versions.PROVEN`).

vLLM validates a generate response's logprobs into a ``GenerateLogProbs``
(a ``GenerateLogProbsContent`` per position and a ``GenerateLogProb`` per
candidate), resolves them into a ``ChatCompletionLogProbs`` of as many
models again (``_resolve_logprobs``), and the response serialises those.
For an 8,000-token answer with 5 candidates a position that is some 100,000
models, where the answer is a few megabytes of JSON.

Here the usual shape is recognised in the loaded body (or, in a job, read
from the line's text, `logprob_text`) by one structural check over whole
lists at a time (`usual_content`): every entry and
candidate a dict with an int id in range, a float logprob, a rank that is
an int or null, within the server's bounds. Pydantic's validation
accepts exactly such a body and keeps each value as it is (an int id, the
float as loaded), so nothing of its answer is lost by skipping it. The
choice's logprobs are then carried through validation as a `RawLogProbs`
(a ``GenerateLogProbs`` pydantic passes on as it is, holding the checked
content), and `chat_json` or `completion_json` writes the ``logprobs`` JSON
the response model would serialise to, straight from per-id fragments
(`Fragments`). Anything else, a body of another shape (so every 400 is
worded by vLLM), a non-finite logprob (the response then fails as vLLM's
does), or vLLM 0.34's ``return_tokens_as_token_ids``, takes vLLM's models
as before (`validated`).
"""

from __future__ import annotations

import functools
import json
import math
import operator
import re
from bisect import bisect_right
from collections.abc import Callable, Sequence
from itertools import accumulate, chain, compress, count, islice, repeat
from operator import itemgetter
from typing import Any, NamedTuple, TypeVar

import orjson
from pydantic import PrivateAttr
from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateLogProbs

from ..logprob_text import ID_BOUND, LogprobsText, materialized

_ID_BOUND = ID_BOUND
"""Ids the fast path takes: 0 up to this (past the vocabulary included, as
vLLM decodes them: ""). Others (negative, huge) take vLLM's path."""

_REPLACEMENT = "\ufffd"

_W = TypeVar("_W")

json_str = json.JSONEncoder(ensure_ascii=False).encode
"""A string as the response's ``json.dumps(ensure_ascii=False)`` writes it."""


class Piece:
    """One id's ``token`` and ``bytes`` for logprobs, and their JSON."""

    __slots__ = ("token", "needs_correction", "token_json", "fields_before", "fields_after")

    def __init__(self, token: str, token_bytes: list[int] | None) -> None:
        self.token = token
        self.needs_correction = token.endswith(_REPLACEMENT)
        self.token_json = json_str(token)
        # ChatCompletionLogProb's fields in order, around the logprob.
        self.fields_before = '{"token":' + self.token_json + ',"logprob":'
        rendered_bytes = "null" if token_bytes is None else "[" + ",".join(map(str, token_bytes)) + "]"
        self.fields_after = ',"bytes":' + rendered_bytes


_token_ids = itemgetter("token_id")
_logprobs = itemgetter("logprob")
_RANK_TYPES = frozenset((int, type(None)))
_TOPS_TYPES = frozenset((list, tuple))


class Usual(NamedTuple):
    """A choice's logprobs content of the usual shape, with the lists the
    check read off it (`usual_content`)."""

    source: list[dict[str, Any]] | LogprobsText
    """The content as loaded, or the logprobs' text it was read from."""
    ids: list[int]
    logprobs: list[float]
    counts: list[int]
    """Per position, the candidates it holds."""
    candidate_ids: list[int]
    candidate_logprobs: list[float]
    """Every position's candidates' ids and logprobs, in order."""


class RawLogProbs(GenerateLogProbs):
    """A choice's logprobs as the body held them, of the usual shape
    (`usual_content`): kept unvalidated in `usual`, ``content`` None. Only
    the fast derenderer reads it (`chat_json`); anything else gets the
    model validation would have built (`validated`)."""

    _usual: Usual = PrivateAttr()

    @classmethod
    def of(cls, usual: Usual) -> RawLogProbs:
        made = cls.model_construct(content=None)
        made._usual = usual
        return made

    @property
    def usual(self) -> Usual:
        return self._usual

    def validated(self) -> GenerateLogProbs:
        """The ``GenerateLogProbs`` pydantic builds from the body's field."""
        source = self._usual.source
        return GenerateLogProbs.model_validate(source.loaded() if type(source) is LogprobsText else {"content": source})


def validated(logprobs: Any) -> Any:
    """generate's logprobs as vLLM's code reads them: a `RawLogProbs`
    validated, anything else as it is."""
    return logprobs.validated() if type(logprobs) is RawLogProbs else logprobs


def _values_fit(dicts: list[Any]) -> tuple[list[int], list[float]] | None:
    """The ids and logprobs of these items where every one is a dict (not
    a subclass) with an int ``token_id`` in [0, `_ID_BOUND`), a float
    ``logprob``, and an int or None ``rank`` if any; else None. Other keys
    pydantic ignores (the models' ``extra`` is ``ignore``), and so does
    the writer."""
    if not dicts:
        return [], []
    if set(map(type, dicts)) != {dict}:
        return None
    try:
        ids = list(map(_token_ids, dicts))
        logprobs = list(map(_logprobs, dicts))
    except KeyError:  # a required field missing: pydantic words it
        return None
    if set(map(type, ids)) != {int} or min(ids) < 0 or max(ids) >= _ID_BOUND or set(map(type, logprobs)) != {float}:
        return None
    if not set(map(type, map(dict.get, dicts, repeat("rank")))) <= _RANK_TYPES:
        return None
    return ids, logprobs


def usual_content(logprobs: Any, max_model_len: int, max_logprobs: int) -> Usual | None:
    """A choice's ``logprobs`` field as loaded, where it is of the usual
    shape and within the bounds vLLM's ``_validate_derender_bounds``
    checks; else None (vLLM's validation and checks then see it as sent).

    The usual shape is what pydantic validates with no conversion: a dict
    whose only key is ``content``, a list of entries; each entry a dict of
    ``token_id`` (an int, not a bool), ``logprob`` (a float), an optional
    ``rank`` (an int or None) and optional ``top_logprobs`` (a list of
    candidates of the same fields but ``top_logprobs``; `_values_fit`).
    A `LogprobsText` was read as that shape: only its bounds are left."""
    if type(logprobs) is LogprobsText:
        return _usual_text(logprobs, max_model_len, max_logprobs)
    if type(logprobs) is not dict or logprobs.keys() != {"content"}:
        return None
    content = logprobs["content"]
    if type(content) is not list or len(content) > max_model_len:
        return None
    sampled = _values_fit(content)
    if sampled is None:
        return None
    tops = list(map(dict.get, content, repeat("top_logprobs"), repeat(())))
    if not set(map(type, tops)) <= _TOPS_TYPES:
        return None
    counts = list(map(len, tops))
    if counts and max_logprobs >= 0 and max(counts) > max_logprobs:
        return None
    candidates = _values_fit(list(chain.from_iterable(tops)))
    if candidates is None:
        return None
    return Usual(content, *sampled, counts, *candidates)


def _usual_text(text: LogprobsText, max_model_len: int, max_logprobs: int) -> Usual | None:
    """`usual_content` of logprobs read from their text (every id in [0,
    `_ID_BOUND`)): within the bounds."""
    if len(text.ids) > max_model_len or (text.counts and max_logprobs >= 0 and max(text.counts) > max_logprobs):
        return None
    return Usual(text, text.ids, text.logprobs, text.counts, text.candidate_ids, text.candidate_logprobs)


class _ByCount(dict[int, tuple[dict[int, str], ...]]):
    """Per number of kept candidates, the fragment table each entry of a
    position takes its closing from, made on first use."""

    def __init__(self, make: Callable[[int], tuple[dict[int, str], ...]]) -> None:
        super().__init__()
        self._make = make

    def __missing__(self, count: int) -> tuple[dict[int, str], ...]:
        made = self[count] = self._make(count)
        return made


def _wire(text: str) -> str:
    """`text`'s UTF-8, each byte a character (latin-1): joined with others
    of its kind and ASCII, one ``encode("latin-1")`` gives the UTF-8 of
    the whole, and the join and that encode copy one byte a character,
    where mixed text would be joined wide and encoded character by
    character."""
    return text.encode("utf-8").decode("latin-1")


class Fragments:
    """Per id, the JSON around a logprob in ``ChatCompletionLogProb``'s
    serialisation (`Piece`'s fields) and its completion token, looked up
    by the list: made from the table's `fast.TokenTable.logprob_piece`,
    once per id. JSON fragments are kept as UTF-8 in latin-1 (`_wire`).

    A piece vLLM corrects by context (`_corrections`) is looked up the same
    way, by a negative key given per corrected token (`key_of`), so the
    writing is the same lookups whatever was corrected."""

    KEPT = 1 << 16
    """Corrected tokens keyed at most, forgotten together past this."""

    def __init__(self, table: Any) -> None:
        self.table = table
        self.opening: dict[int, str] = {}
        """``{"token":...,"logprob":`` per key (as all but `token`, in
        `_wire` form)."""
        # A chat entry's ``,"bytes":[...]`` and what follows it: for a
        # position's sampled entry, its candidates' list opened (or, with
        # none kept, closed, and the position with it); for a candidate,
        # its end (and, the position's last, the position's).
        self.head: dict[int, str] = {}
        self.alone: dict[int, str] = {}
        self.inner: dict[int, str] = {}
        self.last: dict[int, str] = {}
        self.token: dict[int, str] = {}
        """The token per key (completion logprobs' text offsets)."""
        self.token_json: dict[int, str] = {}
        """The token's JSON string per key."""
        self.chat_closings = _ByCount(self._chat_closings)
        self.corrected: set[int] = set()
        """Ids whose piece ends in U+FFFD: vLLM corrects them by context."""
        self.settled: set[int] = set()
        """Corrected ids vLLM's correction makes "" of in any context
        (`ByteLevelBytes.settled`)."""
        self.trailing: set[int] = set()
        """Corrected ids of continuation bytes alone, which it makes "" of
        after an id ending in ASCII (`ByteLevelBytes.trailing`)."""
        self.ascii_ended: set[int] = set()
        """Ids spelled, their bytes ending in ASCII
        (`ByteLevelBytes.ends_in_ascii`)."""
        self.byte_level = ByteLevelBytes(table) if ByteLevelBytes.applies(table) else None
        self._corrected_keys: dict[str, int] = {}
        self.empty = self.key_of("")
        """The key of what vLLM's correction makes "" (``bytes`` [])."""

    def _tables(self) -> tuple[dict[int, str], ...]:
        return (
            self.opening, self.head, self.alone, self.inner, self.last,
            self.token, self.token_json,
        )  # fmt: skip

    def _chat_closings(self, count: int) -> tuple[dict[int, str], ...]:
        """A chat position's entries' closing tables, for `count` kept
        candidates."""
        return (self.alone,) if count == 0 else (self.head, *repeat(self.inner, count - 1), self.last)

    def key_of(self, token: str) -> int:
        """The negative key of a corrected token (``bytes`` its UTF-8, as
        vLLM writes a corrected one)."""
        key = self._corrected_keys.get(token)
        if key is None:
            key = self._corrected_keys[token] = -1 - len(self._corrected_keys)
            self._store(key, Piece(token, list(token.encode("utf-8"))))
        return key

    def forget_corrected(self) -> None:
        """Drop the corrected tokens' keys past `KEPT` (between calls)."""
        if len(self._corrected_keys) > self.KEPT:
            for table in self._tables():
                for key in self._corrected_keys.values():
                    del table[key]
            self._corrected_keys.clear()
            self.empty = self.key_of("")

    def learn(self, ids: list[int], kept_ids: list[int], ends: list[int]) -> None:
        """Make the fragments of the ids not met before, in the order vLLM
        decodes them (per position the sampled id, then the kept
        candidates), so its one warning per id out of the vocabulary comes
        in its order."""
        new = set(ids).union(kept_ids).difference(self.opening)
        if not new:
            return
        for position, token_id in enumerate(ids):
            for each in (token_id, *kept_ids[ends[position] : ends[position + 1]]):
                if each in new and each not in self.opening:
                    self._learn(each)

    def _learn(self, token_id: int) -> None:
        piece = self.table.logprob_piece(token_id)
        self._store(token_id, piece)
        byte_level = self.byte_level
        if byte_level is not None and byte_level.ends_in_ascii(token_id):
            self.ascii_ended.add(token_id)
        if piece.needs_correction:
            self.corrected.add(token_id)
            if byte_level is not None and byte_level.settled(token_id):
                self.settled.add(token_id)
            elif byte_level is not None and byte_level.trailing(token_id):
                self.trailing.add(token_id)

    def _store(self, key: int, piece: Piece) -> None:
        closing, token_json = _wire(piece.fields_after), _wire(piece.token_json)
        self.opening[key] = _wire(piece.fields_before)
        self.head[key] = closing + ',"top_logprobs":['
        self.alone[key] = closing + ',"top_logprobs":[]},'
        self.inner[key] = closing + "},"
        self.last[key] = closing + "}]},"
        self.token[key] = piece.token
        self.token_json[key] = token_json


class _Kept(NamedTuple):
    """One choice's positions after the endpoint's cut, as fragment keys:
    ids, or where vLLM corrects a piece by context, its corrected key
    (`_corrections`)."""

    keys: list[int]
    logprobs: list[float]
    counts: list[int]
    """The number of candidates kept per position."""
    candidate_keys: list[int]
    candidate_logprobs: list[float]
    ends: list[int]
    """Where each position's kept candidates end in the flat lists (after
    a leading 0)."""
    width: int | None
    """The number every position kept, where they kept as many (the
    candidates then stand in columns: the j-th of each, every width-th)."""


def _kept(
    fragments: Fragments, usual: Usual, top_limit: int | None, learn: bool, context: Sequence[int] = ()
) -> _Kept | None:
    """The first `top_limit` candidates of each position (all for None),
    as ``_resolve_logprobs`` keeps them, with the pieces it corrects (after
    the sampled ids `context`, a stream's earlier chunks'); None if a
    logprob kept is not finite (the response cannot be written).

    With `learn`, the fragments of ids not met before are made first;
    without, such an id is left for the writer's lookup to raise KeyError
    on (`_learning`), which saves a pass over the ids where all are known."""
    ids, logprobs, counts = usual.ids, usual.logprobs, usual.counts
    if top_limit is None or not counts or max(counts) <= top_limit:
        kept_ids, kept_logprobs = usual.candidate_ids, usual.candidate_logprobs
    elif top_limit == 0:
        counts, kept_ids, kept_logprobs = [0] * len(counts), [], []
    elif counts.count(counts[0]) == len(counts) and _in_columns(len(counts), top_limit):
        # As many everywhere: the first columns.
        every = counts[0]
        counts = [top_limit] * len(counts)
        kept_ids, kept_logprobs = [0] * (top_limit * len(counts)), [0.0] * (top_limit * len(counts))
        for j in range(top_limit):
            kept_ids[j::top_limit] = usual.candidate_ids[j::every]
            kept_logprobs[j::top_limit] = usual.candidate_logprobs[j::every]
    else:
        starts = list(accumulate(counts, initial=0))
        counts = list(map(min, counts, repeat(top_limit)))
        cuts = list(map(slice, starts, map(operator.add, starts, counts)))
        kept_ids = list(chain.from_iterable(map(usual.candidate_ids.__getitem__, cuts)))
        kept_logprobs = list(chain.from_iterable(map(usual.candidate_logprobs.__getitem__, cuts)))
    if not math.isfinite(sum(logprobs) + sum(kept_logprobs)):
        return None
    ends = list(accumulate(counts, initial=0))
    width = counts[0] if counts and counts.count(counts[0]) == len(counts) else None
    known = fragments.opening.__contains__
    if learn and not (all(map(known, ids)) and all(map(known, kept_ids))):
        fragments.learn(ids, kept_ids, ends)
    fragments.forget_corrected()
    keys, kept_keys = ids, kept_ids
    corrected = fragments.corrected
    if not (corrected.isdisjoint(ids) and corrected.isdisjoint(kept_ids)):
        keys, kept_keys = _corrections(fragments, ids, kept_ids, ends, width, context)
    return _Kept(keys, logprobs, counts, kept_keys, kept_logprobs, ends, width)


_FIVE_DIGITS = re.compile(rb"0\.0000(?<=[-,\[]0\.0000)([1-9])(\d+)")
_FIVE_DIGIT = re.compile(rb"0\.0000(?<=[-,\[]0\.0000)([1-9])(?!\d)")
_ONE_DIGIT_EXPONENT = re.compile(rb"e-(\d)(?!\d)")


def _orjson_floats(values: list[float]) -> bytes:
    """orjson's list of finite floats, mended where it writes them apart
    from ``repr``: both write the shortest digits that round-trip, but
    orjson writes exponent -5 positionally (``0.000015`` for ``1.5e-05``)
    and a one-digit negative exponent unpadded (``1e-7`` for ``1e-07``).
    Every number in the list starts after ``[``, ``,`` or ``-``, so a
    ``0.0000`` there begins one."""
    raw = orjson.dumps(values)
    if b"0.0000" in raw:
        raw = _FIVE_DIGIT.sub(rb"\1e-05", _FIVE_DIGITS.sub(rb"\1.\2e-05", raw))
    if b"e-" in raw:
        raw = _ONE_DIGIT_EXPONENT.sub(rb"e-0\1", raw)
    return raw


def _repr_floats(values: list[float]) -> bytes:
    return ("[" + ",".join(map(repr, values)) + "]").encode()


_FLOAT_PROBES = [
    -0.0, 0.0, -1.0, -0.5, -1e-05, -1.5e-05, -1e-06, -2.5e-07, -3.5762786865234375e-07, -0.0001, -0.00012,
    -9.999999999999999e-05, -1e-10, -1.2e-100, -5e-324, -2.2250738585072014e-308, -1e15, -9999999999999998.0,
    -1e16, -1.5e16, -1.2345678901234568e17, -1e22, -1.7976931348623157e308, -0.1, -0.3, -2.0 / 3, -123.456,
    -1e-5 / 3, -9.5367431640625e-07, -0.000999, 1.5, 1e-05, 1e16,
]  # fmt: skip

floats_json = _orjson_floats if _orjson_floats(_FLOAT_PROBES) == _repr_floats(_FLOAT_PROBES) else _repr_floats
"""The JSON list of finite floats, each as ``json.dumps`` writes it (its
``repr``): orjson's, mended (`_orjson_floats`), where it writes the probes
as ``repr`` does, else by ``repr`` itself (an orjson that writes floats
another way)."""


def _in_columns(positions: int, width: int) -> bool:
    """Whether positions that each keep `width` candidates are handled a
    column at a time (a strided slice per column and part) rather than
    position by position: where there are at least half as many positions
    as columns. A stream chunk holds one position or a few, whose columns
    would cost more slices than the entries they place."""
    return 2 * positions >= width


def _float_texts(values: list[float]) -> list[str]:
    """Each finite float's JSON (`floats_json`)."""
    return floats_json(values)[1:-1].decode().split(",") if values else []


def _grouped(items: list[Any], ends: list[int]) -> list[list[Any]]:
    """The items of each position (`ends` as in `_Kept`)."""
    return list(map(items.__getitem__, map(slice, ends, islice(ends, 1, None))))


def _flat(heads: list[Any], groups: list[list[Any]]) -> list[Any]:
    """Per position its head, then its group's items, flat."""
    return list(chain.from_iterable(chain.from_iterable(zip(zip(heads), groups))))


def chat_json(
    fragments: Fragments, usual: Usual, top_limit: int | None, context: Sequence[int] = ()
) -> bytes | None:
    """``_resolve_logprobs``' ``ChatCompletionLogProbs`` for this checked
    content (`usual_content`), as the response's ``json.dumps`` writes it
    (a float as its repr), in UTF-8; None if a logprob is not finite (the
    response then cannot be serialised, and vLLM's path words that error).
    `context` is its ``initial_context_token_ids``: a stream chunk's
    sampled ids before it (the stream state's ``logprob_context_token_ids``).

    Per position vLLM keeps the first `top_limit` candidates (all for
    None) and decodes the sampled id and each kept one on its own
    (`fast.TokenTable.logprob_piece`); a piece ending in U+FFFD is
    corrected by vLLM's own ``_correct_decoded_token`` with the sampled ids
    before the position as context (`_corrections`).

    Written as one join of three parts per entry (each position's sampled
    one, then its candidates): its opening, its float, and its closing
    from the table its place takes, every part list made in C
    (`_chat_columns`, `_chat_entries`)."""
    return _learning(_chat_json, fragments, usual, top_limit, context)


def _learning(
    write: Callable[[Fragments, Usual, int | None, bool, Sequence[int]], _W | None],
    fragments: Fragments,
    usual: Usual,
    top_limit: int | None,
    context: Sequence[int] = (),
) -> _W | None:
    """`write` as if every id were known; where one is not (its lookup
    raised KeyError, `_kept`), again, the fragments of all made first, in
    vLLM's order. The first try has made nothing but corrected keys."""
    try:
        return write(fragments, usual, top_limit, False, context)
    except KeyError:
        return write(fragments, usual, top_limit, True, context)


def _chat_json(
    fragments: Fragments, usual: Usual, top_limit: int | None, learn: bool, context: Sequence[int]
) -> bytes | None:
    kept = _kept(fragments, usual, top_limit, learn, context)
    if kept is None:
        return None
    if not kept.keys:
        return b'{"content":[]}'
    width = kept.width
    in_columns = width is not None and _in_columns(len(kept.keys), width)
    parts = _chat_columns(fragments, kept, width) if in_columns else _chat_entries(fragments, kept)  # type: ignore[arg-type]
    parts[0] = '{"content":[' + parts[0]
    parts[-1] = parts[-1][:-1] + "]}"  # the last position's comma
    return "".join(parts).encode("latin-1")


def _chat_columns(fragments: Fragments, kept: _Kept, width: int) -> list[str]:
    """`chat_json`'s parts where every position kept `width` candidates:
    the sampled entries, then each column of candidates, put in place by
    strided slices."""
    opening = fragments.opening.__getitem__
    step = 3 * (width + 1)
    parts: list[str] = [""] * (step * len(kept.keys))
    parts[0::step] = map(opening, kept.keys)
    parts[1::step] = _float_texts(kept.logprobs)
    parts[2::step] = map((fragments.head if width else fragments.alone).__getitem__, kept.keys)
    values = _float_texts(kept.candidate_logprobs)
    for j in range(width):
        column, start = kept.candidate_keys[j::width], 3 * (j + 1)
        parts[start::step] = map(opening, column)
        parts[start + 1 :: step] = values[j::width]
        parts[start + 2 :: step] = map((fragments.inner if j < width - 1 else fragments.last).__getitem__, column)
    return parts


def _chat_entries(fragments: Fragments, kept: _Kept) -> list[str]:
    """`chat_json`'s parts where positions kept different numbers of
    candidates: the entries in order, each taking its closing from the
    table its place takes (`Fragments.chat_closings`)."""
    keys = _flat(kept.keys, _grouped(kept.candidate_keys, kept.ends))
    parts: list[str] = [""] * (3 * len(keys))
    parts[0::3] = map(fragments.opening.__getitem__, keys)
    parts[1::3] = _float_texts(_flat(kept.logprobs, _grouped(kept.candidate_logprobs, kept.ends)))
    closings = chain.from_iterable(map(fragments.chat_closings.__getitem__, kept.counts))
    parts[2::3] = map(dict.__getitem__, closings, keys)
    return parts


def completion_json(fragments: Fragments, usual: Usual, top_limit: int | None) -> bytes | None:
    """``_convert_chat_logprobs_to_completion_logprobs`` of
    ``_resolve_logprobs``' answer for this checked content, as JSON in
    UTF-8 (one call's: text offsets from 0): parallel lists; a position
    generate gave no candidates (before the cut) is null, others an object
    of the kept candidates keyed by token, a repeated token keeping its
    first place and its last logprob, as a dict does. None if a logprob is
    not finite.

    The objects are the dicts themselves, made per position in C and
    written by orjson (`_completion_json`)."""
    written = _learning(_completion_json, fragments, usual, top_limit)
    return None if written is None else written[0]


def completion_stream_json(
    fragments: Fragments, usual: Usual, top_limit: int | None, context: Sequence[int], text_offset: int
) -> tuple[bytes, int] | None:
    """`completion_json` for a stream chunk, as vLLM's stream writes it:
    its pieces corrected after the sampled ids `context` and its text
    offsets counted on from `text_offset` (the state's
    ``logprob_context_token_ids`` and ``logprob_text_offset``); with the
    offset after its last token (the state's next one, where it holds a
    token). None if a logprob is not finite."""
    return _learning(functools.partial(_completion_json, text_offset=text_offset), fragments, usual, top_limit, context)


def _completion_json(
    fragments: Fragments,
    usual: Usual,
    top_limit: int | None,
    learn: bool,
    context: Sequence[int],
    text_offset: int = 0,
) -> tuple[bytes, int] | None:
    kept = _kept(fragments, usual, top_limit, learn, context)
    if kept is None:
        return None
    keys, candidate_keys = kept.keys, kept.candidate_keys
    offsets = list(accumulate(map(len, map(fragments.token.__getitem__, keys)), initial=text_offset))
    end = offsets.pop()
    # Per position the dict vLLM builds ({token: logprob}: a repeated token
    # keeps its first place and takes its last logprob), null where
    # generate gave no candidates, written by orjson, which writes strings
    # as the response's json.dumps does (every character but surrogates,
    # which no decode gives: `tests/test_fast_logprobs.py`) and floats by
    # `_float_values`.
    tokens = list(map(fragments.token.__getitem__, candidate_keys))
    values = _float_values(kept.candidate_logprobs)
    width = kept.width
    if width:
        rows = zip(*[iter(tokens)] * width, strict=True), zip(*[iter(values)] * width, strict=True)
        objects: list[Any] = list(map(dict, map(zip, *rows)))
    else:
        objects = list(map(dict, map(zip, _grouped(tokens, kept.ends), _grouped(values, kept.ends))))
        for position in compress(count(), map(operator.not_, usual.counts)):
            objects[position] = None
    return b"".join((
        b'{"text_offset":', orjson.dumps(offsets), b',"token_logprobs":', floats_json(kept.logprobs),
        b',"tokens":[', ",".join(map(fragments.token_json.__getitem__, keys)).encode("latin-1"),
        b'],"top_logprobs":', orjson.dumps(objects), b"}",
    )), end  # fmt: skip


def _float_values(values: list[float]) -> list[Any]:
    """Finite floats for orjson to write within a document as ``json.dumps``
    writes each (its repr): the floats, where orjson writes them all so
    (none with an exponent of -5 or a one-digit negative one, `floats_json`);
    else each one's text, as an ``orjson.Fragment``."""
    if floats_json is _orjson_floats:
        written = orjson.dumps(values)
        if b"0.0000" not in written and b"e-" not in written:
            return values
    return list(map(orjson.Fragment, _float_texts(values)))


def _corrections(
    fragments: Fragments,
    ids: list[int],
    kept_ids: list[int],
    ends: list[int],
    width: int | None,
    context: Sequence[int] = (),
) -> tuple[list[int], list[int]]:
    """The keys of the sampled ids and of the kept candidates, each piece
    vLLM corrects by context (`fast.TokenTable._corrected`, vLLM's rule,
    which reads at most the last 4 sampled ids before the position, the
    sampled ids `context` before the first) replaced by its corrected key
    (`Fragments.key_of`).

    Where vLLM's answer is known without a decode, it is taken so: with
    no sampled id before (no context: vLLM tries nothing and answers ""), and
    for the ids `Fragments` knows it makes "" of (`settled` anywhere,
    `trailing` after an id in `ascii_ended`). Otherwise the decodes run
    (`_corrected`), with the context's bytes made once per position."""
    contains = fragments.corrected.__contains__
    keys, kept_keys = list(ids), list(kept_ids)
    contexts: dict[int, tuple[list[int], list[bytes] | None]] = {}
    # The sampled ids, the context's before them: a position's index in
    # `history` is `offset` on.
    offset = len(context)
    history = [*context, *ids] if offset else ids
    for position in compress(count(), map(contains, ids)):
        keys[position] = _corrected_key(fragments, history, position + offset, ids[position], contexts)
    fixed = list(compress(count(), map(contains, kept_ids)))  # in order: a position's candidates together
    if not fixed:
        return keys, kept_keys
    # The position whose candidates hold each, and whether "" is known.
    if width:
        positions = list(map(operator.floordiv, fixed, repeat(width)))
    else:
        positions = list(map(operator.sub, map(bisect_right, repeat(ends), fixed), repeat(1)))
    fixed_ids = list(map(kept_ids.__getitem__, fixed))
    first_or_after_ascii = [True, *map(fragments.ascii_ended.__contains__, history)][offset:]
    trailing_known = map(
        operator.and_, map(fragments.trailing.__contains__, fixed_ids), map(first_or_after_ascii.__getitem__, positions)
    )
    known = list(map(operator.or_, map(fragments.settled.__contains__, fixed_ids), trailing_known))
    empty = fragments.empty
    for k in compress(fixed, known):
        kept_keys[k] = empty
    for k, position, token_id in compress(zip(fixed, positions, fixed_ids), map(operator.not_, known)):
        kept_keys[k] = _corrected_key(fragments, history, position + offset, token_id, contexts)
    return keys, kept_keys


def _corrected_key(
    fragments: Fragments,
    ids: list[int],
    position: int,
    token_id: int,
    contexts: dict[int, tuple[list[int], list[bytes] | None]],
) -> int:
    """The key of vLLM's correction of `token_id` at `position` (see
    `_corrections`); `contexts` keeps each position's context and its
    suffixes' bytes for the call."""
    if position == 0 or token_id in fragments.settled:
        return fragments.empty
    if token_id in fragments.trailing and ids[position - 1] in fragments.ascii_ended:
        return fragments.empty
    known = contexts.get(position)
    if known is None:
        context = ids[max(position - 4, 0) : position]
        known = contexts[position] = (context, _suffixes(fragments, context))
    return fragments.key_of(_corrected(fragments, token_id, *known))


def _suffixes(fragments: Fragments, context: list[int]) -> list[bytes] | None:
    """The bytes of the context's last 1, 2, 3 and 4 ids, where a
    ByteLevel decoder spells them all (`ByteLevelBytes`); else None."""
    byte_level = fragments.byte_level
    if byte_level is None:
        return None
    spelled = byte_level.spelled(context)
    if spelled is None:
        return None
    suffixes, joined = [], b""
    for raw in reversed(spelled):
        joined = raw + joined
        suffixes.append(joined)
    return suffixes


def _corrected(fragments: Fragments, token_id: int, context: list[int], suffixes: list[bytes] | None) -> str:
    """vLLM's ``_correct_decoded_token`` for a piece ending in U+FFFD
    (`fast.TokenTable._corrected`), its usual answer found first: for
    each context length it tries (1 up to 4 sampled ids), it decodes the
    context and the id and goes on while the text still ends in U+FFFD;
    where every one does, it answers "". Those decodes are made here by
    the very decode it calls (`fast._Decoding`), with no memo between, or
    from the ids' bytes where a ByteLevel decoder spells them all
    (`suffixes`, `ByteLevelBytes`); any other case runs vLLM's function."""
    table = fragments.table
    own = fragments.byte_level.spelled([token_id]) if suffixes is not None else None  # type: ignore[union-attr]
    if own is not None:
        tail = own[0]
        for head in suffixes:  # type: ignore[union-attr]
            if not (head + tail).decode("utf-8", "replace").endswith(_REPLACEMENT):
                return table._corrected(token_id, context).token  # type: ignore[no-any-return]
        return ""
    decode = table._decoding.uncached
    for length in range(1, len(context) + 1):
        if not decode(context[-length:] + [token_id]).endswith(_REPLACEMENT):
            return table._corrected(token_id, context).token  # type: ignore[no-any-return]
    return ""


def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet, read backwards: the byte each of its
    256 characters spells (the ByteLevel decoder's ``CHAR_BYTES``)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(char): byte for byte, char in zip(printable, chars, strict=True)}


class ByteLevelBytes:
    """Per id, the bytes a ByteLevel decoder makes of its piece: each
    character through the byte-level alphabet, or, where one is not in it,
    the piece's UTF-8. The decoder joins its pieces' bytes and decodes them
    as lossy UTF-8 (`fast.decoder_kind`'s ``byte-level``), and Python's
    ``decode("utf-8", "replace")`` substitutes U+FFFD for the same maximal
    ill-formed subsequences as Rust's ``String::from_utf8_lossy``, so a
    decode of ids is the join of their bytes, decoded so. An id is spelled
    only if it is in the vocabulary, not an added or special token (which
    the tokenizer decodes apart), and its bytes decode to what the decoder
    itself makes of it alone (checked once per id); any other id leaves the
    decodes to the tokenizer."""

    _CHAR_BYTES = _byte_of_char()

    @staticmethod
    def applies(table: Any) -> bool:
        """A ByteLevel decoder, reached with no Python decode around it."""
        return table.kind == "byte-level" and table._decoding.plain

    def __init__(self, table: Any) -> None:
        self.table = table
        tokenizer = table.tokenizer
        self.apart = frozenset(tokenizer.get_added_vocab().values()) | table.special_ids
        self._bytes: dict[int, bytes | None] = {}

    def spelled(self, ids: list[int]) -> list[bytes] | None:
        """The bytes of each id, or None where one is not spelled."""
        found = self._bytes
        spelled = [found[i] if i in found else self._spell(i) for i in ids]
        return None if None in spelled else spelled  # type: ignore[return-value]

    def _spell(self, token_id: int) -> bytes | None:
        spelled = None
        table = self.table
        if 0 <= token_id < table.size and token_id not in self.apart:
            piece = table.tokenizer.backend_tokenizer.id_to_token(token_id)
            if piece is not None:
                chars = self._CHAR_BYTES
                raw = bytes(chars[c] for c in piece) if all(c in chars for c in piece) else piece.encode("utf-8")
                if raw.decode("utf-8", "replace") == table._decoding.uncached([token_id]):
                    spelled = raw
        self._bytes[token_id] = spelled
        return spelled

    def settled(self, token_id: int) -> bool:
        """Whether vLLM's correction makes "" of this id in any context: it
        is spelled, its bytes decode alone to a text ending in U+FFFD, and
        one of them is not a continuation byte (10xxxxxx). UTF-8 decoding
        starts afresh at such a byte whatever came before (a sequence
        under way ends there, as an error), so the text of any ids ending
        in this one ends as this one's does: every decode the correction
        tries ends in U+FFFD."""
        spelled = self.spelled([token_id])
        if spelled is None:
            return False
        raw = spelled[0]
        fresh = any(byte < 0x80 or byte >= 0xC0 for byte in raw)
        return fresh and raw.decode("utf-8", "replace").endswith(_REPLACEMENT)

    def trailing(self, token_id: int) -> bool:
        """Whether this id is spelled as continuation bytes alone. After an
        id whose bytes end in ASCII (`ends_in_ascii`), each such byte is an
        error of its own, so every decode the correction tries, its
        context ending in that id, ends in U+FFFD: vLLM makes "" of it."""
        spelled = self.spelled([token_id])
        return spelled is not None and bool(spelled[0]) and all(0x80 <= byte < 0xC0 for byte in spelled[0])

    def ends_in_ascii(self, token_id: int) -> bool:
        """Whether this id is spelled, its bytes ending in ASCII."""
        spelled = self.spelled([token_id])
        return spelled is not None and bool(spelled[0]) and spelled[0][-1] < 0x80


def carried(body: dict[str, Any], serving: Any) -> dict[str, Any]:
    """A one-shot chat or completion body whose choices' logprobs of the
    usual shape (`usual_content`) are replaced by `RawLogProbs`, for
    validation to pass on as they are, and any other read from their text
    (`LogprobsText`) by the dict it stands for: a new body, the caller's
    left as sent. The same body where none is, or where the derenderer
    cannot write them (no token table: vLLM's functions would read the
    models)."""
    if not getattr(serving.online_derenderer, "fast", False):
        return materialized(body)
    bounds = (serving.model_config.max_model_len, serving.model_config.max_logprobs)
    response = body.get("generate_response")
    if type(response) is dict:
        replaced = _carried_response(response, bounds)
        return body if replaced is response else {**body, "generate_response": replaced}
    responses = body.get("generate_responses")
    if type(responses) is list:
        each = [_carried_response(r, bounds) if type(r) is dict else r for r in responses]
        if any(map(operator.is_not, each, responses)):
            return {**body, "generate_responses": each}
    return body


def _carried_response(response: dict[str, Any], bounds: tuple[int, int]) -> dict[str, Any]:
    """One generate response, its usual logprobs carried (`carried`), or
    the same dict where none is."""
    choices = response.get("choices")
    if type(choices) is not list:
        return response
    replaced, any_replaced = list(choices), False
    for index, choice in enumerate(choices):
        if type(choice) is dict and choice.get("logprobs") is not None:
            logprobs = choice["logprobs"]
            usual = usual_content(logprobs, *bounds)
            if usual is not None:
                replaced[index] = {**choice, "logprobs": RawLogProbs.of(usual)}
                any_replaced = True
            elif type(logprobs) is LogprobsText:
                replaced[index] = {**choice, "logprobs": logprobs.loaded()}
                any_replaced = True
    return {**response, "choices": replaced} if any_replaced else response
