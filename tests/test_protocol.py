"""Answers are the server's bytes: our serialisers against Starlette's.

`render_json` is what the endpoint handlers' ``JSONResponse`` writes;
`render_state` writes stream states with orjson for speed, and must give
the same bytes for anything a ``DerenderStreamState`` can hold.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from starlette.responses import JSONResponse

from derender_core.protocol import StreamAnswer, render_json, render_state

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)

token_ids = st.lists(st.integers(0, 2**31 - 1), max_size=50)
# What DerenderStreamState.model_dump() holds: token strings, offsets, flags, ids.
states = st.fixed_dictionaries(
    {
        "prev_tokens": st.lists(st.text(), max_size=8),
        "prefix_offset": st.integers(0, 2**31),
        "read_offset": st.integers(0, 2**31),
        "role_sent": st.booleans(),
        "logprob_context_token_ids": st.lists(st.integers(0, 2**31), max_size=4),
        "logprob_text_offset": st.integers(0, 2**31),
        "output_token_ids": token_ids,
        "output_chunk_lens": st.lists(st.integers(1, 8), max_size=50),
        "tools_streamed": st.booleans(),
        "last_tool_call_ids": st.lists(st.text(max_size=40), max_size=3),
    }
)


def starlette(content: Any) -> bytes | type[Exception]:
    try:
        return bytes(JSONResponse(content=content).body)
    except ValueError as exc:
        return type(exc)


def ours(serialise: Any, content: Any) -> bytes | type[Exception]:
    try:
        return serialise(content)  # type: ignore[no-any-return]
    except ValueError as exc:
        return type(exc)


@given(json_values)
def test_render_json_is_starlettes(content: Any) -> None:
    assert ours(render_json, content) == starlette(content)


@given(states)
def test_render_state_is_starlettes(state: dict[str, Any]) -> None:
    assert ours(render_state, state) == starlette(state)


@given(json_values, states)
def test_stream_answer_bytes_are_the_whole_body_rendered(chunk: Any, state: dict[str, Any]) -> None:
    expected = starlette({"chunk": chunk, "stream_state": state})
    if not isinstance(expected, bytes):
        return  # a body the server cannot send never becomes a StreamAnswer
    answer = StreamAnswer(chunk, render_json(chunk), state, render_state)
    assert answer.raw == expected
    assert json.loads(answer.raw)["stream_state"] == state
    assert answer.stream_state is state
