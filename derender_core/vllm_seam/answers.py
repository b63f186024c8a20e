"""Answers as the render server's handlers write them: the exact bytes of
``JSONResponse(content=...)`` for a response, with logprobs spliced in
where the fast derenderer wrote them, or written by orjson where they are
a plain tree; streaming answers with their state; and the errors the
app's handlers give when a response cannot be serialised. Shared by the
replay path (`render`), the live lane (`live`) and the serve path
(`serve`)."""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Sequence
from typing import Any

import orjson

from ..protocol import Answer, StreamAnswer, render_json, render_state


def json_answer(
    content: Any, status: int = 200, spliced: Sequence[str | bytes | None] = (), *, plain: bool = False
) -> Answer:
    """Serialize as the handlers' ``JSONResponse(content=...)`` does, so the
    bytes, and the failures on non-finite floats, match the server's.

    `spliced` holds, per choice, the JSON of its ``logprobs`` (a string or
    its UTF-8) where the derenderer wrote it directly
    (`fast.FastDerenderer`): the choice carries a placeholder string while
    the rest serialises, and the JSON takes the placeholder's place, so the
    bytes are those the models would give.

    `plain` says the content came from a `plain_model` response: it holds
    only dicts with string keys, lists, strings, ints, bools and None, so
    ``orjson.dumps`` writes the bytes ``JSONResponse`` writes (`plain_json`);
    where orjson refuses it (an int past 64 bits, a lone surrogate, a
    subclass), ``JSONResponse`` answers as before. Without splices the
    answer keeps `content` as its body: a JSON round trip of a plain tree
    gives an equal one.
    """
    marks = []
    for index, rendered in enumerate(spliced):
        if rendered is not None:
            content["choices"][index]["logprobs"] = f"{_SPLICE_MARK}{index}"
            written = rendered if type(rendered) is bytes else rendered.encode()  # type: ignore[union-attr]
            marks.append((json.dumps(f"{_SPLICE_MARK}{index}").encode(), written))
    raw = plain_json(content) if plain else None
    if raw is None:
        from fastapi.responses import JSONResponse

        try:
            raw = bytes(JSONResponse(content=content, status_code=status).body)
        except (ValueError, TypeError) as exc:
            return _unserialisable(exc)
    elif not marks:
        answer = Answer(status, raw)
        answer.body = content  # in place of Answer.body's parse (a cached_property)
        return answer
    for mark, rendered in marks:
        raw = raw.replace(mark, rendered, 1)
    return Answer(status, raw)


_PLAIN_OPTIONS = orjson.OPT_PASSTHROUGH_SUBCLASS | orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_DATACLASS


def _refuse(value: Any) -> Any:
    raise TypeError(f"not a plain JSON value: {type(value).__name__}")


def plain_json(content: Any) -> bytes | None:
    """``JSONResponse``'s bytes for a plain tree (dicts with string keys,
    lists, and str, int, bool and None leaves), or None where orjson
    refuses it.

    For these types the two writers agree: compact separators, keys in
    order, integers in decimal, and strings escaped alike (``"``, ``\\``,
    the C0 controls with the same short forms, everything else written as
    UTF-8; checked over every code point in `tests/test_plain_response.py`).
    They differ on floats (``1e-05`` against ``0.00001``), which a plain
    tree does not hold, and orjson refuses what ``JSONResponse`` would write
    differently or fail on: lone surrogates, ints past 64 bits, keys that
    are not strings, and (with these options and `_refuse`) subclasses,
    dataclasses and dates. It would write UUIDs, enums and floats its own
    way, so a caller passes only a tree `plain_model` vouches for.
    """
    try:
        return orjson.dumps(content, default=_refuse, option=_PLAIN_OPTIONS)
    except TypeError:  # orjson.JSONEncodeError among them
        return None


def plain_model(model: Any) -> bool:
    """Whether ``model.model_dump()`` is a plain tree (`plain_json`).

    Each model class's fields are sorted once by their annotation
    (`_field_plan`): str, int, bool, None, string or int literals and lists
    of these dump as themselves once validated; nested models are checked
    the same way; any other field (a float, a dict of anything, a
    ``PerRequestMetrics``) must be None. A model holding extra fields, or
    of a class whose serializers are not known to keep a plain tree plain,
    is not plain.
    """
    plan = _field_plan(type(model))
    if plan is None or model.__pydantic_extra__:
        return False
    for name, kind in plan:
        value = getattr(model, name)
        if value is None:
            continue
        if kind is _FREE:
            return False
        if kind is _MODEL:
            if not plain_model(value):
                return False
        elif not all(plain_model(item) for item in value):  # _MODELS
            return False
    return True


_FREE, _MODEL, _MODELS = "free", "model", "models"


@functools.cache
def _field_plan(cls: type) -> tuple[tuple[str, str], ...] | None:
    """The fields of `cls` that `plain_model` must look at, with how; None
    for a class it cannot vouch for."""
    from pydantic import BaseModel

    if not (isinstance(cls, type) and issubclass(cls, BaseModel)):
        return None
    decorators = cls.__pydantic_decorators__
    if decorators.field_serializers or decorators.computed_fields:
        return None
    serializers = {d.func for d in decorators.model_serializers.values()}
    if not serializers <= _known_serializers():
        return None
    plan = []
    for name, field in cls.model_fields.items():
        if field.exclude:
            continue
        kind = _annotation_kind(field.annotation)
        if kind is not None:
            plan.append((name, kind))
    return tuple(plan)


@functools.cache
def _known_serializers() -> frozenset[Any]:
    """Model serializers read and known to keep a plain dump plain:
    ``ChatMessage`` drops an empty ``tool_calls`` from its dump."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatMessage

    return frozenset(d.func for d in ChatMessage.__pydantic_decorators__.model_serializers.values())


_LEAVES = (str, int, bool, type(None))


def _annotation_kind(annotation: Any) -> str | None:
    """None for a field whose validated value dumps as a plain leaf or a
    list of them; `_MODEL` or `_MODELS` for nested models (or None);
    `_FREE` for anything else."""
    import types
    import typing

    from pydantic import BaseModel

    if annotation in _LEAVES:
        return None
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return _MODEL
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return None if all(type(arg) in _LEAVES for arg in args) else _FREE
    if origin in (typing.Union, types.UnionType):
        kinds = {_annotation_kind(arg) for arg in args if arg is not type(None)}
        return kinds.pop() if len(kinds) == 1 else _FREE
    if origin is list and len(args) == 1:
        inner = _annotation_kind(args[0])
        if inner is None:
            return None
        return _MODELS if inner is _MODEL else _FREE
    return _FREE


_SPLICE_MARK = f"\x00derender-logprobs-{uuid.uuid4().hex}-"
"""A placeholder no answer's own text holds: JSON escapes the NUL, and the
nonce is drawn per process."""


def _unserialisable(exc: ValueError | TypeError) -> Answer:
    """What the app's ValueError and TypeError handlers answer when the
    response cannot be serialised (a non-finite float, a byte string)."""
    from fastapi.responses import JSONResponse
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

    error = create_error_response(exc)
    return Answer(error.error.code, bytes(JSONResponse(content=error.model_dump()).body))


def stream_answer(chunk: dict[str, Any], state: Any) -> Answer:
    """A successful streaming answer, or the error the server answers when
    it cannot serialise it: the chunk, then the state, as its one
    ``JSONResponse`` over both fails. Tried now, whatever the output
    format, so every format shows the server's answer for the call and
    the state threads on only from an answer the server gives (a tekken
    byte piece in the decode window is a ``bytes``: a 400).

    The state is kept as the object vLLM returned, with its bytes made now
    where that costs what the call costs anyway (`_checked_state`)."""
    try:
        chunk_raw = render_json(chunk)
        state_raw = _checked_state(state)
    except (ValueError, TypeError) as exc:
        return _unserialisable(exc)
    if state_raw is None:
        return StreamAnswer(chunk, chunk_raw, state, dump_state)
    return StreamAnswer(chunk, chunk_raw, state, lambda _state: state_raw)


_LIVE_HISTORY = frozenset({"output_token_ids", "output_chunk_lens", "logprob_context_token_ids", "last_tool_call_ids"})
"""A live state's fields that grow with its stream."""


def _checked_state(state: Any) -> bytes | None:
    """Raise what serialising `state` raises; its bytes, when made.

    A window state (streams without a parser) is bounded, and a replay
    state is rebuilt in O(n) per call anyway: both are serialised now. A
    live state (`live.LiveState`) grows with its stream, so only what can
    hold a value JSON refuses is tried, in O(1): its growing fields hold
    token ids and counts the chunks carried (validated integers) and the
    parser's tool-call ids (strings), the rest is the carried state it
    started from, and None comes back.
    """
    stream = getattr(state, "stream", None)
    if stream is None:
        return dump_state(state)
    render_state(stream.base.model_dump(exclude=_LIVE_HISTORY))
    return None


def dump_state(state: Any) -> bytes:
    return render_state(state.model_dump())
