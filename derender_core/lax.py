"""What vLLM's validation reads a record's value as, for the fields derender
reads before vLLM does.

vLLM's request models validate in pydantic's lax mode: ``"2"``, ``2.0`` and
``true`` are read as integers (2, 2, 1), and ``1`` and ``1.0`` as the
streaming member's ``stream: Literal[True]``. Our own record checks and the
stream ledger read a call's ``stream`` flag and its request's ``n`` before
the call is validated, so they read them here, with the annotations vLLM's
models give those fields. ``tests/test_lax.py`` holds each reader to
``model_validate`` of vLLM's own request classes over drawn values.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from typing import Any, Literal


def read_int(value: Any) -> int | None:
    """The integer vLLM reads `value` as in an ``int`` field, or None where
    it refuses it (null, a list or object, ``2.5``, NaN, ``"x"``)."""
    if type(value) is int:
        return value
    if value is None or isinstance(value, (list, dict)):
        return None
    try:
        return _adapter(int).validate_python(value)  # type: ignore[no-any-return]
    except ValueError:  # pydantic's ValidationError
        return None


def read_bool(value: Any) -> bool | None:
    """The boolean vLLM reads `value` as in a ``bool`` field (``1``,
    ``"true"``, ``"on"`` are true), or None where it refuses it."""
    if value is True or value is False:
        return value
    if value is None or isinstance(value, (list, dict)):
        return None
    try:
        return _adapter(bool).validate_python(value)  # type: ignore[no-any-return]
    except ValueError:
        return None


def streaming(flag: Any) -> bool:
    """Whether a body's ``stream`` is one the streaming member takes
    (``true``, ``1``, ``1.0``): the call is a streaming one."""
    if flag is True:
        return True
    if flag is None or flag is False or isinstance(flag, (str, list, dict)):
        return False
    try:
        _adapter(Literal[True]).validate_python(flag)
    except ValueError:
        return False
    return True


_NULL_N_IS_ONE = {"chat_request": True, "completion_request": False}
"""Whether the request's ``n`` may be null (``int | None`` in
``ChatCompletionRequest``, read as 1; ``int`` in ``CompletionRequest``)."""


def requested_choices(request: Any, request_key: str) -> int | None:
    """``n`` of a body's original request (the body's `request_key` field)
    as vLLM's validation reads it, its default 1 when unset, and 1 for less
    than 1; None without a request, or where vLLM refuses the value, when
    only the choices themselves can be checked."""
    if not (type(request) is dict or isinstance(request, Mapping)):
        return None
    if "n" not in request:
        return 1
    n = request["n"]
    if n is None:
        return 1 if _NULL_N_IS_ONE[request_key] else None
    read = read_int(n)
    if read is None:
        return None
    return read if read >= 1 else 1


@cache
def _adapter(annotation: Any) -> Any:
    from pydantic import TypeAdapter

    return TypeAdapter(annotation)
