"""A one-shot record's logprobs read from its line's text into the lists
the logprobs writer takes, never loaded as dicts: fast path ``lp_text``.

An 8,000-token choice with 20 candidates a position is 170,000 small
objects. orjson builds a dict of each (65 ms), and the check the logprobs
writer needs before it may skip vLLM's models (`vllm_seam.logprobs.
usual_content`) walks them all again (55 ms), as does our own id check
(`checks`, 21 ms). A typed decode (msgspec, which vLLM depends on) reads
the same text into structs in under half orjson's time, checking every
value's type as it goes. So a line whose choices hold logprobs is read in
three steps (`split_body`):

1. a skeleton decode finds each choice's ``logprobs`` value as raw text,
   skipping the rest of the line;
2. each such value that is an object is cut out of the line, a string no
   line holds in its place, and what is left is loaded as
   `records.parse_body` loads a line;
3. each placeholder is checked to stand in its choice's place, and is
   replaced by a `LogprobsText`: the value's text, and its lists where the
   typed decode reads it as the usual shape (`_Logprobs`).

The body is then, but for those values, the one `parse_body` gives.
Whatever reads a choice's logprobs other than the writer takes
`LogprobsText.loaded` (or `materialized` for a body), which is
`parse_body` of the value's text: JSON values parse alike alone and in
their line, and a line that only Python's parser reads exactly (a digit
run orjson rounds) keeps its plain loading (`split_body` gives None). Any
doubt (a line that is not such a body, a placeholder out of place, a
value the plain loading would word an error for) gives None, and the
line is loaded as before.
"""

from __future__ import annotations

from itertools import chain
from operator import attrgetter
from typing import Annotated, Any

import msgspec
import orjson

from .records import orjson_exact, parse_body

_PLACEHOLDER = b"derender:logprobs:"
"""The start of each placeholder's text; a line holding it anywhere is
loaded as before, so a placeholder found in the body is one put there."""


ID_BOUND = 1 << 31
"""Token ids the logprobs writer takes: 0 up to this. A value holding
others is loaded (and goes vLLM's way)."""
_TokenId = Annotated[int, msgspec.Meta(ge=0, lt=ID_BOUND)]


class _Candidate(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    token_id: _TokenId
    logprob: float
    rank: int | None = None


class _Entry(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    token_id: _TokenId
    logprob: float
    rank: int | None = None
    top_logprobs: list[_Candidate] = []


class _Logprobs(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """The usual shape, as `vllm_seam.logprobs.usual_content` takes it from
    a loaded dict, with no other key anywhere, but for one reading msgspec
    and pydantic's validation make alike: a logprob written as a JSON
    integer is its float. Any other key, type, a token id out of [0, 2**31)
    or a missing field fails the decode, and the value is loaded as a dict
    (a repeated key's last value counts, in msgspec as in orjson)."""

    content: list[_Entry]


class _SkeletonChoice(msgspec.Struct, gc=False):
    logprobs: msgspec.Raw = msgspec.Raw(b"null")


class _SkeletonResponse(msgspec.Struct, gc=False):
    choices: list[_SkeletonChoice] | None = None


class _Skeleton(msgspec.Struct, gc=False):
    """Where a one-shot body (or a bare generate response, joined with
    ``--requests``) holds its choices' logprobs; the rest is skipped."""

    choices: list[_SkeletonChoice] | None = None
    generate_response: _SkeletonResponse | None = None
    generate_responses: list[_SkeletonResponse] | None = None


_SKELETON = msgspec.json.Decoder(_Skeleton)
_UNREAD = (msgspec.MsgspecError, RecursionError)
"""A decode's failures: the text is not of that shape, or nests deeper
than msgspec reads (the plain loading then words what it finds)."""
_LOGPROBS = msgspec.json.Decoder(_Logprobs)
_token_id = attrgetter("token_id")
_logprob = attrgetter("logprob")
_tops = attrgetter("top_logprobs")


class LogprobsText:
    """A choice's ``logprobs`` value of the usual shape (`_Logprobs`) as
    its JSON text, standing in the body for the dict `loaded` gives, with
    the lists the typed decode read from it."""

    __slots__ = ("text", "ids", "logprobs", "counts", "candidate_ids", "candidate_logprobs", "_max_id")

    def __init__(self, text: bytes, read: _Logprobs) -> None:
        self.text = text
        content = read.content
        tops = list(map(_tops, content))
        candidates = list(chain.from_iterable(tops))
        self.ids: list[int] = list(map(_token_id, content))
        self.logprobs: list[float] = list(map(_logprob, content))
        self.counts: list[int] = list(map(len, tops))
        """Per position, the candidates it holds."""
        self.candidate_ids: list[int] = list(map(_token_id, candidates))
        self.candidate_logprobs: list[float] = list(map(_logprob, candidates))
        """Every position's candidates, in order."""
        self._max_id: int | None = None

    def loaded(self) -> Any:
        """The value as the plain loading of its line gives it."""
        return parse_body(self.text)[0]

    def max_id(self) -> int:
        """The greatest token id, sampled or candidate (-1 where none; every
        one is at least 0); worked out once."""
        if self._max_id is None:
            self._max_id = max(max(self.ids, default=-1), max(self.candidate_ids, default=-1))
        return self._max_id

    def __repr__(self) -> str:
        return f"LogprobsText({len(self.text)} bytes, {len(self.ids)} positions)"


def split_body(text: bytes) -> Any | None:
    """The body in `text` with each choice's ``logprobs`` object a
    `LogprobsText`, or None where the line is to be loaded as before."""
    if _PLACEHOLDER in text:
        return None
    try:
        skeleton = _SKELETON.decode(text)
    except _UNREAD:
        return None
    places = list(_places(skeleton))
    if not places:
        return None
    spans: list[tuple[int, int, tuple[Any, ...], bytes]] = []
    for path, value in places:
        # Two choices may hold the same text: each takes a place not taken.
        start = _find(text, value, 0)
        while start >= 0 and any(taken <= start < end for taken, end, _, _ in spans):
            start = _find(text, value, start + 1)
        if start < 0:
            return None
        spans.append((start, start + len(value), path, value))
    spans.sort(key=lambda span: span[0])
    pieces: list[bytes] = []
    at = 0
    for number, (start, end, _, _) in enumerate(spans):
        if start < at:
            return None
        pieces += (text[at:start], b'"', _placeholder(number), b'"')
        at = end
    pieces.append(text[at:])
    rest = b"".join(pieces)
    if not orjson_exact(rest):
        return None
    try:
        body = orjson.loads(rest)
    except orjson.JSONDecodeError:
        return None
    for number, (_, _, path, value) in enumerate(spans):
        try:
            read: _Logprobs | None = _LOGPROBS.decode(value)
        except _UNREAD:
            read = None
        if read is None:
            loaded, problem = parse_body(value)
            if problem is not None:
                return None
            stand_in: Any = loaded
        else:
            stand_in = LogprobsText(value, read)
        if not _put(body, path, _placeholder(number).decode(), stand_in):
            return None
    return body


def _placeholder(number: int) -> bytes:
    """The text standing in the line for the `number`-th value cut out."""
    return _PLACEHOLDER + str(number).encode()


def _places(skeleton: _Skeleton) -> Any:
    """Each choice's (path, logprobs text) where the value is an object."""
    responses: list[tuple[tuple[Any, ...], _SkeletonResponse]] = []
    if skeleton.choices is not None:
        responses.append(((), _SkeletonResponse(skeleton.choices)))
    if skeleton.generate_response is not None:
        responses.append((("generate_response",), skeleton.generate_response))
    for index, response in enumerate(skeleton.generate_responses or ()):
        responses.append((("generate_responses", index), response))
    for path, response in responses:
        for index, choice in enumerate(response.choices or ()):
            value = bytes(choice.logprobs)
            if value[:1] == b"{":
                yield (*path, "choices", index, "logprobs"), value


def _find(text: bytes, value: bytes, start: int) -> int:
    """Where `value` next stands in `text` from `start`: found by its first
    bytes, then compared whole."""
    head = value[:64]
    at = text.find(head, start)
    while at >= 0 and not text.startswith(value, at):
        at = text.find(head, at + 1)
    return at


def _put(body: Any, path: tuple[Any, ...], placeholder: str, value: Any) -> bool:
    """Put `value` where `placeholder` stands at `path`; False if it does
    not stand there."""
    holder = body
    for step in path[:-1]:
        if type(holder) is dict and type(step) is str and step in holder:
            holder = holder[step]
        elif type(holder) is list and type(step) is int and step < len(holder):
            holder = holder[step]
        else:
            return False
    if type(holder) is not dict or holder.get(path[-1]) != placeholder:
        return False
    holder[path[-1]] = value
    return True


def holds_text(body: Any) -> bool:
    """Whether a body holds a `LogprobsText` anywhere `split_body` puts one."""
    return any(True for _ in _texts(body))


def _texts(body: Any) -> Any:
    """Each (choice dict, its `LogprobsText`) in the places `split_body`
    puts them."""
    if type(body) is not dict:
        return
    responses: list[Any] = [body, body.get("generate_response")]
    if type(body.get("generate_responses")) is list:
        responses += body["generate_responses"]
    for response in responses:
        choices = response.get("choices") if type(response) is dict else None
        for choice in choices if type(choices) is list else ():
            if type(choice) is dict and type(choice.get("logprobs")) is LogprobsText:
                yield choice, choice["logprobs"]


def materialized(body: Any) -> Any:
    """`body` with every `LogprobsText` loaded (`LogprobsText.loaded`): the
    body the plain loading gives, for anything but the logprobs writer.
    The body itself where it holds none; else a copy along the way to each
    (the caller's body left as it was)."""
    if not holds_text(body):
        return body
    copied = {**_loaded_response(body)}
    if "generate_response" in copied:
        copied["generate_response"] = _loaded_response(copied["generate_response"])
    if type(copied.get("generate_responses")) is list:
        copied["generate_responses"] = list(map(_loaded_response, copied["generate_responses"]))
    return copied


def _loaded_response(response: Any) -> Any:
    """A response with its choices' `LogprobsText` loaded, as a copy; the
    response itself where its choices are not a list."""
    choices = response.get("choices") if type(response) is dict else None
    if type(choices) is not list:
        return response
    loaded = [
        {**choice, "logprobs": choice["logprobs"].loaded()}
        if type(choice) is dict and type(choice.get("logprobs")) is LogprobsText
        else choice
        for choice in choices
    ]
    return {**response, "choices": loaded}
