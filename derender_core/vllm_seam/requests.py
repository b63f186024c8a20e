"""vLLM's chat request model (``ChatCompletionRequest``): a usual request
built as validation builds it, without validation's Python round trip.

Validating a chat request cost about 20 µs of a 30-token record's 260,
the largest part of a record the job floor does not pay: twelve Python
model validators, a wrap validator, a default factory and a private
attribute's deep copy, around pydantic's own pass over 69 fields. For the
request a dataset sends (text messages, tool calls and their results,
tools, stop strings, the usual sampling fields, each of the exact JSON
type its field keeps), that work comes out as the raw values and the
defaults, with one default filled in (``tool_choice`` becomes "auto" when
tools are given, in the request and in the dict it came from, as vLLM's
``check_tool_usage`` does).

`ChatRequests.build` makes that request directly: the defaults are read
off a request vLLM validated at start-up, the tools go through pydantic
(their own models), and each message's form (the order of its keys) is
read off vLLM's validation of a probe message of its shape. Anything else
(another field, another type, a value vLLM's validators refuse or change,
content that is not a string or null) gives None, and the caller
validates as before, which words every error as today. The fast decode
uses it; ``--decode reference`` validates every request.

``tests/test_requests.py`` checks, on hypothesis-drawn requests mixing the
usual fields and messages with odd values, that every request built here
equals vLLM's validation of it: each field's value, type and order, the
fields set, the extras, the private attributes, the dump, and the dict it
came from afterwards.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin

import annotated_types
from pydantic.fields import FieldInfo
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionRequest,
    ChatCompletionToolsParam,
)
from vllm.utils import random_uuid

from .parsers import fast_random_uuid

_ATOMS = (type(None), bool, int, float, str)

_FLOATS = frozenset(
    {"temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"}
)
"""``float | None`` fields: an int comes out as the equal float."""

_INTS = frozenset({"max_tokens", "max_completion_tokens", "top_k", "n", "seed"})
"""``int | None`` fields; their bounds, if any, are read off the model
(`_Limit`)."""

_BOOLS = frozenset(
    {
        "logprobs",
        "stream",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "add_generation_prompt",
        "continue_final_message",
        "include_stop_str_in_output",
        "echo",
        "parallel_tool_calls",
        "include_reasoning",
    }
)
"""Fields that keep a JSON bool as it is."""

_TOOL_CHOICES = frozenset({"none", "auto", "required"})


_BUILT = (
    _FLOATS | _INTS | _BOOLS
    | {"messages", "model", "top_logprobs", "tools", "tool_choice", "stop", "chat_template_kwargs"}
)  # fmt: skip
"""The fields `ChatRequests.build` takes; a request with any other goes
to validation."""

_RULES_KNOW_VALIDATORS = frozenset({"top_logprobs"})
"""Fields whose own validators `build`'s rules already follow (a null
``top_logprobs`` is 0: `build` takes only integers, which it keeps)."""


@dataclass(frozen=True)
class _Limit:
    """The bounds vLLM's model puts on one field: a number's, and a list's
    length (``stop``'s, from VLLM_MAX_STOP_STRINGS)."""

    lower: int | float | None = None
    upper: int | float | None = None
    items: int | None = None

    @classmethod
    def of(cls, name: str, field: FieldInfo) -> _Limit | None:
        """The field's bounds, or None where it has a constraint or
        validator besides these (validation then takes the field)."""
        found: dict[str, Any] = {}
        for owner, item in _metadata(field.annotation, tuple(field.metadata), "value"):
            if type(item) is annotated_types.Ge and owner == "value" and "lower" not in found:
                found["lower"] = item.ge
            elif type(item) is annotated_types.Le and owner == "value" and "upper" not in found:
                found["upper"] = item.le
            elif type(item) is annotated_types.MaxLen and owner == "list" and "items" not in found:
                found["items"] = item.max_length
            elif name not in _RULES_KNOW_VALIDATORS:
                return None
        return cls(**found)

    @property
    def bounded(self) -> bool:
        return self.lower is not None or self.upper is not None or self.items is not None

    def admits(self, value: Any) -> bool:
        """Whether a value `build` took (of its field's exact type) is
        within the bounds."""
        if type(value) is list:
            return self.items is None or len(value) <= self.items
        if type(value) in (int, float):
            return (self.lower is None or value >= self.lower) and (self.upper is None or value <= self.upper)
        return True


def _metadata(annotation: Any, metadata: tuple[Any, ...], owner: str) -> Iterator[tuple[str, Any]]:
    """Each constraint and validator on a field, with what it bounds: the
    field's value, or a list member of its type (``Annotated[list[str],
    Field(max_length=4)]``)."""
    for item in metadata:
        if isinstance(item, FieldInfo):
            yield from ((owner, inner) for inner in item.metadata)
        else:
            yield owner, item
    origin = get_origin(annotation)
    if origin is Annotated:
        base, *extra = get_args(annotation)
        yield from _metadata(base, tuple(extra), "list" if get_origin(base) is list else owner)
    elif origin in (Union, UnionType):
        for member in get_args(annotation):
            yield from _metadata(member, (), owner)
    elif origin is not None:  # a list's or dict's items: bounds `build` does not read
        for member in get_args(annotation):
            yield from _metadata(member, (), "item")


class ChatRequests:
    """Builds the usual chat request as vLLM's validation would, or says it
    cannot (None). One per process; nothing in it changes after start-up."""

    def __init__(self) -> None:
        from pydantic import TypeAdapter

        template = ChatCompletionRequest.model_validate({"messages": []})
        fields = ChatCompletionRequest.model_fields
        # Every field in vLLM's order; `build` copies it and sets the rest.
        self._state: dict[str, Any] = dict(template.__dict__)
        self._fresh: list[tuple[str, Callable[[], Any]]] = []
        for name, value in template.__dict__.items():
            factory = fields[name].default_factory
            if factory is random_uuid:  # the request's id, made as vLLM makes it, faster
                self._fresh.append((name, fast_random_uuid))
            elif factory is not None:
                self._fresh.append((name, factory))  # type: ignore[arg-type]
            elif type(value) not in _ATOMS and name != "messages":
                # A mutable default: pydantic gives each request its own
                # copy, an empty one of the same type where it is empty.
                self._fresh.append((name, type(value) if not value else _copies(value)))
        self._private = dict(template.__pydantic_private__ or {})
        self._private_flat = all(
            type(value) in _ATOMS or (type(value) is dict and all(type(v) in _ATOMS for v in value.values()))
            for value in self._private.values()
        )
        self._tools = TypeAdapter(list[ChatCompletionToolsParam])
        self._messages = _Messages()
        # The bounds vLLM's model puts on the fields built here (the stop
        # list's length comes from VLLM_MAX_STOP_STRINGS, read as vLLM
        # imports its protocol), read off the model so that they are the
        # ones validation applies; a field with a constraint not read here
        # is left to validation.
        self._limits: dict[str, _Limit] = {}
        self._unbuilt: set[str] = set()
        for name in _BUILT:
            limit = _Limit.of(name, fields[name])
            if limit is None:
                self._unbuilt.add(name)
            elif limit.bounded:
                self._limits[name] = limit
        self.usable = (
            template.__pydantic_extra__ == {}
            and template.__pydantic_fields_set__ == {"messages"}
            and set(self._state) == set(fields)
        )

    def build(self, raw: Any) -> ChatCompletionRequest | None:
        """The request vLLM's validation makes of `raw`, or None where it
        is not the usual request. Like validation, it fills ``tool_choice``
        into `raw` when tools are given without one."""
        if type(raw) is not dict or not self.usable:
            return None
        values: dict[str, Any] = {}
        tools = None
        unbuilt = self._unbuilt
        for key, value in raw.items():
            if key in unbuilt:
                return None
            if key == "messages":
                if type(value) is not list:
                    return None
                messages = []
                for message in value:
                    kept = self._messages.kept(message)
                    if kept is None:
                        return None
                    messages.append(kept)
                values[key] = messages
            elif key in _FLOATS:
                if value is None or type(value) is float:
                    values[key] = value
                elif type(value) is int and abs(value) <= 1 << 53:
                    values[key] = float(value)
                else:
                    return None
            elif key in _INTS:
                if value is not None and type(value) is not int:
                    return None
                values[key] = value
            elif key in _BOOLS:
                if type(value) is not bool:
                    return None
                values[key] = value
            elif key == "model":
                if value is not None and type(value) is not str:
                    return None
                values[key] = value
            elif key == "top_logprobs":
                if type(value) is not int or value < 0:
                    return None
                values[key] = value
            elif key == "tools":
                if type(value) is not list or not value:
                    return None
                tools = value
            elif key == "tool_choice":
                if type(value) is not str or value not in _TOOL_CHOICES:
                    return None
                values[key] = value
            elif key == "stop":
                if value is None or type(value) is str:
                    values[key] = value
                elif type(value) is list and all(type(stop) is str for stop in value):
                    values[key] = list(value)
                else:
                    return None
            elif key == "chat_template_kwargs":
                if value is not None and not (type(value) is dict and all(type(k) is str for k in value)):
                    return None
                values[key] = None if value is None else dict(value)
            else:
                return None
        if "messages" not in values:
            return None
        for name, limit in self._limits.items():
            value = values.get(name)
            if value is not None and not limit.admits(value):
                return None
        # vLLM's model validators, for these fields: what they refuse goes
        # the slow way, which words it.
        if values.get("top_logprobs", 0) > 0 and not raw.get("logprobs"):
            return None
        if raw.get("continue_final_message") and raw.get("add_generation_prompt"):
            return None
        choice = values.get("tool_choice")
        if choice is not None and choice != "none" and tools is None:
            return None
        if tools is not None:
            try:
                values["tools"] = self._tools.validate_python(tools)
            except Exception:  # noqa: BLE001 - validation words it
                return None
        fields_set = set(raw)
        if tools is not None and "tool_choice" not in raw:
            raw["tool_choice"] = values["tool_choice"] = "auto"  # check_tool_usage
            fields_set.add("tool_choice")
        state = self._state.copy()
        for name, make in self._fresh:
            state[name] = make()
        state.update(values)  # fields only: the order stays vLLM's
        request = ChatCompletionRequest.__new__(ChatCompletionRequest)
        private = (
            {k: (v.copy() if type(v) is dict else v) for k, v in self._private.items()}
            if self._private_flat
            else copy.deepcopy(self._private)
        )
        object.__setattr__(request, "__dict__", state)
        object.__setattr__(request, "__pydantic_fields_set__", fields_set)
        object.__setattr__(request, "__pydantic_extra__", {})
        object.__setattr__(request, "__pydantic_private__", private)
        return request


def _copies(value: Any) -> Callable[[], Any]:
    """A maker of fresh copies of a mutable default, as pydantic gives each
    model its own."""
    return lambda: copy.deepcopy(value)


class _Messages:
    """Messages as vLLM's validation keeps them: a new dict of the same
    values, its keys in the order of the message type pydantic's union
    picks, which depends on the role, the keys given and whether content is
    null. That order is read off vLLM's validation of a probe message of
    the same shape, once per shape; a shape whose probe comes out as
    anything else (not a plain dict of the same values) is not kept here.

    A shape is a role, and keys among ``content`` (a string or null),
    ``name``, ``tool_call_id`` and ``reasoning`` (strings) and
    ``tool_calls``: a non-empty list of ``{"id", "type": "function",
    "function": {"name", "arguments"}}``, strings all."""

    _TEXT_KEYS = frozenset({"name", "tool_call_id", "reasoning"})

    def __init__(self) -> None:
        self._orders: dict[tuple[str, ...], tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]] | None] = {}

    def kept(self, message: Any) -> dict[str, Any] | None:
        if type(message) is not dict:
            return None
        role = message.get("role")
        if type(role) is not str or role not in _ROLES:
            return None
        shape: list[str] = []
        calls = None
        for key, value in message.items():
            if key == "role":
                continue
            if key == "content":
                if value is None:
                    shape.append("content=null")
                elif type(value) is str:
                    shape.append("content")
                else:
                    return None
            elif key in self._TEXT_KEYS:
                if type(value) is not str:
                    return None
                shape.append(key)
            elif key == "tool_calls":
                if type(value) is not list or not value or not all(_plain_call(call) for call in value):
                    return None
                calls = value
                shape.append(key)
            else:
                return None
        known = (role, *sorted(shape))
        orders = self._orders.get(known, False)
        if orders is False:
            orders = self._orders[known] = _probed(role, shape)
        if orders is None:
            return None
        order, call_order, function_order = orders
        kept = {name: message[name] for name in order}
        if calls is not None:
            kept["tool_calls"] = [
                {
                    name: ({k: call[name][k] for k in function_order} if name == "function" else call[name])
                    for name in call_order
                }
                for call in calls
            ]
        return kept


_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})

_CALL_KEYS = frozenset({"id", "type", "function"})
_FUNCTION_KEYS = frozenset({"name", "arguments"})


def _plain_call(call: Any) -> bool:
    """A tool call of strings only, as chat datasets write them."""
    if type(call) is not dict or call.keys() != _CALL_KEYS or call["type"] != "function":
        return False
    function = call["function"]
    return (
        type(call["id"]) is str
        and type(call["type"]) is str
        and type(function) is dict
        and function.keys() == _FUNCTION_KEYS
        and type(function["name"]) is str
        and type(function["arguments"]) is str
    )


def _probed(role: str, keys: list[str]) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]] | None:
    """The key orders vLLM's validation gives a message of this shape (the
    message's, a tool call's, its function's), or None where it does not
    keep the message as a plain dict of the same values."""
    probe: dict[str, Any] = {"role": role}
    for key in keys:
        if key == "content=null":
            probe["content"] = None
        elif key == "tool_calls":
            probe[key] = [{"id": "i", "type": "function", "function": {"name": "n", "arguments": "{}"}}]
        else:
            probe[key] = "probe"
    try:
        kept = ChatCompletionRequest.model_validate({"messages": [copy.deepcopy(probe)]}).messages[0]
    except Exception:  # noqa: BLE001 - a shape validation refuses
        return None
    if type(kept) is not dict or kept != probe or any(type(kept[k]) is not type(probe[k]) for k in probe):
        return None
    if "tool_calls" not in kept:
        return tuple(kept), (), ()
    call = kept["tool_calls"][0]
    if type(call) is not dict or type(call["function"]) is not dict:
        return None
    return tuple(kept), tuple(call), tuple(call["function"])
