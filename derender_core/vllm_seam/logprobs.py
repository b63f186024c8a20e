"""One-shot chat and completion logprobs written from the loaded body, with
no model per position: fast path ``logprobs`` (`versions.PROVEN`).

vLLM validates a generate response's logprobs into a ``GenerateLogProbs``
(a ``GenerateLogProbsContent`` per position and a ``GenerateLogProb`` per
candidate), resolves them into a ``ChatCompletionLogProbs`` of as many
models again (``_resolve_logprobs``), and the response serialises those.
For an 8,000-token answer with 5 candidates a position that is some 100,000
models, where the answer is a few megabytes of JSON.

Here the usual shape is recognised in the loaded body by one structural
check over whole lists at a time (`usual_content`): every entry and
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

import json
import math
import operator
from bisect import bisect_right
from itertools import accumulate, chain, compress, count, repeat
from operator import add, itemgetter
from typing import Any, NamedTuple

from pydantic import PrivateAttr
from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateLogProbs

_ID_BOUND = 1 << 31
"""Ids the fast path takes: 0 up to this (past the vocabulary included, as
vLLM decodes them: ""). Others (negative, huge) take vLLM's path."""

_REPLACEMENT = "\ufffd"

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
    """A choice's logprobs content of the usual shape, as loaded, with the
    lists the check read off it (`usual_content`)."""

    content: list[dict[str, Any]]
    ids: list[int]
    logprobs: list[float]
    tops: list[Any]
    """Per position, its candidates (a list; ``()`` where absent)."""
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
        return GenerateLogProbs.model_validate({"content": self._usual.content})


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
    candidates of the same fields but ``top_logprobs``; `_values_fit`)."""
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
    if tops and max_logprobs >= 0 and max(map(len, tops)) > max_logprobs:
        return None
    candidates = _values_fit(list(chain.from_iterable(tops)))
    if candidates is None:
        return None
    return Usual(content, *sampled, tops, *candidates)


class Fragments:
    """Per id, the JSON around a logprob in ``ChatCompletionLogProb``'s
    serialisation (`fast.Piece`'s fields), looked up by the list: made from
    the table's `fast.TokenTable.logprob_piece`, once per id."""

    def __init__(self, table: Any) -> None:
        self.table = table
        self.opening: dict[int, str] = {}
        """``{"token":...,"logprob":`` per id."""
        self.closing: dict[int, str] = {}
        """``,"bytes":[...]`` per id (a position's, before its candidates)."""
        self.closed: dict[int, str] = {}
        """``,"bytes":[...]}`` per id (a candidate's)."""
        self.token: dict[int, str] = {}
        self.token_json: dict[int, str] = {}
        """The token and its JSON string per id (completion logprobs)."""
        self.corrected: set[int] = set()
        """Ids whose piece ends in U+FFFD: vLLM corrects them by context."""
        self.empty = Piece("", [])
        """What vLLM's correction makes of "": ``bytes`` []."""
        self.byte_level = ByteLevelBytes(table) if ByteLevelBytes.applies(table) else None

    def learn(self, ids: list[int], kept_ids: list[int], ends: list[int], seen: set[int]) -> None:
        """Make the fragments of the ids in `seen` not met before, in the
        order vLLM decodes them (per position the sampled id, then the kept
        candidates), so its one warning per id out of the vocabulary comes
        in its order."""
        new = seen.difference(self.opening)
        if not new:
            return
        for position, token_id in enumerate(ids):
            for each in (token_id, *kept_ids[ends[position] : ends[position + 1]]):
                if each in new and each not in self.opening:
                    self._learn(each)

    def _learn(self, token_id: int) -> None:
        piece = self.table.logprob_piece(token_id)
        self.opening[token_id] = piece.fields_before
        self.closing[token_id] = piece.fields_after
        self.closed[token_id] = piece.fields_after + "}"
        self.token[token_id] = piece.token
        self.token_json[token_id] = piece.token_json
        if piece.needs_correction:
            self.corrected.add(token_id)


class _Kept(NamedTuple):
    """One choice's positions after the endpoint's cut, their fragments
    made (`_kept`)."""

    ids: list[int]
    logprobs: list[float]
    counts: set[int]
    """The numbers of candidates kept per position, as a set."""
    candidate_ids: list[int]
    candidate_logprobs: list[float]
    ends: list[int]
    """Where each position's kept candidates end in the flat lists (after
    a leading 0)."""
    sampled_fixes: dict[int, Piece]
    candidate_fixes: dict[int, Piece]
    """Per position, and per flat candidate, the piece vLLM corrects by
    context where it does (`_corrections`)."""


def _kept(fragments: Fragments, usual: Usual, top_limit: int | None) -> _Kept | None:
    """The first `top_limit` candidates of each position (all for None),
    as ``_resolve_logprobs`` keeps them, with the pieces it corrects; None
    if a logprob kept is not finite (the response cannot be written)."""
    ids, logprobs, tops = usual.ids, usual.logprobs, usual.tops
    counts = set(map(len, tops))
    if top_limit is None or not counts or max(counts) <= top_limit:
        kept, kept_ids, kept_logprobs = tops, usual.candidate_ids, usual.candidate_logprobs
    else:
        kept = list(map(itemgetter(slice(0, top_limit)), tops))
        counts = set(map(len, kept))
        candidates = list(chain.from_iterable(kept))
        kept_ids = list(map(_token_ids, candidates))
        kept_logprobs = list(map(_logprobs, candidates))
    if not math.isfinite(sum(logprobs) + sum(kept_logprobs)):
        return None
    ends = list(accumulate(map(len, kept), initial=0))
    seen = set(ids)
    seen.update(kept_ids)
    fragments.learn(ids, kept_ids, ends, seen)
    fixes: tuple[dict[int, Piece], dict[int, Piece]] = ({}, {})
    if not fragments.corrected.isdisjoint(seen):
        fixes = _corrections(fragments, ids, kept_ids, ends)
    return _Kept(ids, logprobs, counts, kept_ids, kept_logprobs, ends, *fixes)


def chat_json(fragments: Fragments, usual: Usual, top_limit: int | None) -> str | None:
    """``_resolve_logprobs``' ``ChatCompletionLogProbs`` for this checked
    content (`usual_content`), as the response's ``json.dumps`` writes it
    (a float as its repr); None if a logprob is not finite (the response
    then cannot be serialised, and vLLM's path words that error).

    Per position vLLM keeps the first `top_limit` candidates (all for
    None) and decodes the sampled id and each kept one on its own
    (`fast.TokenTable.logprob_piece`); a piece ending in U+FFFD is
    corrected by vLLM's own ``_correct_decoded_token`` with the sampled ids
    before the position as context (`_corrections`)."""
    kept = _kept(fragments, usual, top_limit)
    if kept is None:
        return None
    ids, logprobs, kept_ids, kept_logprobs = kept.ids, kept.logprobs, kept.candidate_ids, kept.candidate_logprobs
    # Each written as ``opening + repr(logprob) + closing``, list by list.
    opening, closing, closed = fragments.opening.__getitem__, fragments.closing.__getitem__, fragments.closed.__getitem__
    heads = list(map(add, map(add, map(opening, ids), map(repr, logprobs)), map(closing, ids)))
    written = list(map(add, map(add, map(opening, kept_ids), map(repr, kept_logprobs)), map(closed, kept_ids)))
    for position, piece in kept.sampled_fixes.items():
        heads[position] = piece.fields_before + repr(logprobs[position]) + piece.fields_after
    for k, piece in kept.candidate_fixes.items():
        written[k] = piece.fields_before + repr(kept_logprobs[k]) + piece.fields_after + "}"
    counts = kept.counts
    if counts <= {0}:
        positions: Any = map(add, heads, repeat(',"top_logprobs":[]}'))
    elif len(counts) == 1:  # as many candidates everywhere: grouped in C
        groups = map(",".join, zip(*[iter(written)] * next(iter(counts))))
        positions = map(add, map(add, heads, repeat(',"top_logprobs":[')), map(add, groups, repeat("]}")))
    else:
        joined, ends = ",".join, kept.ends
        positions = [
            head + ',"top_logprobs":[' + joined(written[start:end]) + "]}"
            for head, start, end in zip(heads, ends, ends[1:])
        ]
    return '{"content":[' + ",".join(positions) + "]}"


def completion_json(fragments: Fragments, usual: Usual, top_limit: int | None) -> str | None:
    """``_convert_chat_logprobs_to_completion_logprobs`` of
    ``_resolve_logprobs``' answer for this checked content, as JSON (one
    call's: text offsets from 0): parallel lists; a position generate gave
    no candidates (before the cut) is null, others an object of the kept
    candidates keyed by token, a repeated token keeping its first place and
    its last logprob, as a dict does. None if a logprob is not finite."""
    kept = _kept(fragments, usual, top_limit)
    if kept is None:
        return None
    ids, kept_ids = kept.ids, kept.candidate_ids
    tokens = list(map(fragments.token.__getitem__, ids))
    tokens_json = list(map(fragments.token_json.__getitem__, ids))
    for position, piece in kept.sampled_fixes.items():
        tokens[position], tokens_json[position] = piece.token, piece.token_json
    keys = list(map(fragments.token.__getitem__, kept_ids))
    values = map(add, repeat(":"), map(repr, kept.candidate_logprobs))
    entries = list(map(add, map(fragments.token_json.__getitem__, kept_ids), values))  # '"token":logprob'
    for k, piece in kept.candidate_fixes.items():
        keys[k], entries[k] = piece.token, piece.token_json + ":" + repr(kept.candidate_logprobs[k])
    offsets = list(accumulate(map(len, tokens), initial=0))
    offsets.pop()
    ends = kept.ends
    objects = [
        _candidates_object(keys, entries, start, end) if had else "null"
        for had, start, end in zip(usual.tops, ends, ends[1:])
    ]
    return (
        '{"text_offset":[' + ",".join(map(str, offsets)) + '],"token_logprobs":[' + ",".join(map(repr, kept.logprobs))
        + '],"tokens":[' + ",".join(tokens_json) + '],"top_logprobs":[' + ",".join(objects) + "]}"
    )  # fmt: skip


def _candidates_object(keys: list[str], entries: list[str], start: int, end: int) -> str:
    """One position's kept candidates as the dict vLLM builds of them
    (``{token: logprob}``), written: where a token repeats, its first
    place and its last logprob."""
    if len(set(keys[start:end])) == end - start:
        return "{" + ",".join(entries[start:end]) + "}"
    last = {keys[k]: k for k in range(start, end)}
    return "{" + ",".join([entries[k] for k in last.values()]) + "}"


def _corrections(
    fragments: Fragments, ids: list[int], kept_ids: list[int], ends: list[int]
) -> tuple[dict[int, Piece], dict[int, Piece]]:
    """The pieces vLLM corrects by context (`fast.TokenTable._corrected`,
    vLLM's rule, which reads at most the last 4 sampled ids before the
    position): per position for its sampled id, and per flat candidate."""
    contains = fragments.corrected.__contains__
    sampled = {}
    for position in compress(count(), map(contains, ids)):
        context = ids[max(position - 4, 0) : position]
        sampled[position] = _corrected(fragments, ids[position], context, _suffixes(fragments, context))
    candidates = {}
    last, context, suffixes = -1, [], None
    for k in compress(count(), map(contains, kept_ids)):  # in order: a position's candidates together
        position = bisect_right(ends, k) - 1  # the position whose candidates hold k
        if position != last:
            last, context = position, ids[max(position - 4, 0) : position]
            suffixes = _suffixes(fragments, context)
        candidates[k] = _corrected(fragments, kept_ids[k], context, suffixes)
    return sampled, candidates


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


def _corrected(fragments: Fragments, token_id: int, context: list[int], suffixes: list[bytes] | None) -> Piece:
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
                return table._corrected(token_id, context)
        return fragments.empty
    decode = table._decoding.uncached
    for length in range(1, len(context) + 1):
        if not decode(context[-length:] + [token_id]).endswith(_REPLACEMENT):
            return table._corrected(token_id, context)
    return fragments.empty


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


def carried(body: dict[str, Any], serving: Any) -> dict[str, Any]:
    """A one-shot chat or completion body whose choices' logprobs of the
    usual shape (`usual_content`) are replaced by `RawLogProbs`, for
    validation to pass on as they are: a new body, the caller's left as
    sent. The same body where none is, or where the derenderer cannot
    write them (no token table: vLLM's functions would read the models)."""
    if not getattr(serving.online_derenderer, "fast", False):
        return body
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
            usual = usual_content(choice["logprobs"], *bounds)
            if usual is not None:
                replaced[index] = {**choice, "logprobs": RawLogProbs.of(usual)}
                any_replaced = True
    return {**response, "choices": replaced} if any_replaced else response
