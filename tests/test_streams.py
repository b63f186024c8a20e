"""Stream state threading rules, on synthetic answers.

The answers here are plain `Answer` values (status and JSON bytes), the
shape the engine returns; the parity tests check the same rules against
the real server.
"""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import given
from hypothesis import strategies as st

from derender_core import Answer, Endpoint
from derender_core.streams import ChunkFacts, StreamLedger


def body(request_id: str, index: int | None, finish: str | None = None, n: int = 1,
         usage: bool = False, include_usage: bool = False, state: Any = None) -> dict[str, Any]:
    choices = [] if index is None else [{"index": index, "token_ids": [1], "finish_reason": finish}]
    chunk: dict[str, Any] = {"request_id": request_id, "choices": choices}
    if usage:
        chunk["usage"] = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    request = {"n": n, "stream_options": {"include_usage": include_usage}}
    out = {"stream": True, "generate_chunk": chunk, "chat_request": request}
    if state is not None:
        out["stream_state"] = state
    return out


def ok(state: Any) -> Answer:
    return Answer(200, orjson.dumps({"chunk": {}, "stream_state": state}))


FAILED = Answer(400, orjson.dumps({"error": {"message": "no", "type": "BadRequestError", "param": None, "code": 400}}))


def call(ledger: StreamLedger, sent: dict[str, Any], answer: Answer) -> tuple[Any, bool]:
    facts = ChunkFacts.of(sent, Endpoint.CHAT)
    threaded = ledger.with_state(sent, facts)
    return threaded.get("stream_state"), ledger.settle(facts, answer)


def test_state_is_threaded_per_request_and_index() -> None:
    ledger = StreamLedger()
    n2 = dict(n=2, include_usage=True)
    assert call(ledger, body("a", 0, **n2), ok("a0-1")) == (None, False)
    assert call(ledger, body("a", 1, **n2), ok("a1-1")) == (None, False)
    assert call(ledger, body("b", 0), ok("b0-1")) == (None, False)
    assert call(ledger, body("a", 0, **n2), ok("a0-2")) == ("a0-1", False)
    assert call(ledger, body("a", 1, "stop", **n2), ok("a1-2")) == ("a1-1", False)
    assert call(ledger, body("a", 0, "stop", **n2), ok("a0-3")) == ("a0-2", False)
    # The usage chunk takes the state of the index answered last.
    assert call(ledger, body("a", None, usage=True, **n2), ok("ignored")) == ("a0-3", True)
    assert len(ledger) == 1
    assert call(ledger, body("b", 0, "stop"), ok("b0-2")) == ("b0-1", True)
    assert len(ledger) == 0


def test_a_failed_call_leaves_the_state_and_still_ends_the_stream() -> None:
    ledger = StreamLedger()
    call(ledger, body("a", 0), ok("s1"))
    assert call(ledger, body("a", 0), FAILED) == ("s1", False)
    assert call(ledger, body("a", 0, "stop"), FAILED) == ("s1", True)


def test_a_given_state_is_sent_as_is_and_its_answer_threaded_on() -> None:
    ledger = StreamLedger()
    call(ledger, body("a", 0), ok("s1"))
    assert call(ledger, body("a", 0, state="captured"), ok("s2")) == ("captured", False)
    assert call(ledger, body("a", 0), ok("s3")) == ("s2", False)


@given(st.recursive(st.none() | st.integers() | st.text() | st.booleans(),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
                    max_leaves=10))
def test_any_body_shape_is_tolerated(value: Any) -> None:
    facts = ChunkFacts.of(value, Endpoint.COMPLETION)
    ledger = StreamLedger()
    assert ledger.with_state(value, facts) is value
    ledger.settle(facts, FAILED)


def test_an_explicit_null_state_is_sent_as_is_and_its_answer_threaded_on() -> None:
    """``"stream_state": null`` is the client's own choice (a fresh start
    for the server), not a missing state to fill in."""
    ledger = StreamLedger()
    call(ledger, body("a", 0), ok("s1"))
    fresh = {**body("a", 0), "stream_state": None}
    facts = ChunkFacts.of(fresh, Endpoint.CHAT)
    assert facts.has_state and ledger.with_state(fresh, facts) is fresh
    ledger.settle(facts, ok("s2"))
    assert call(ledger, body("a", 0), ok("s3")) == ("s2", False)
