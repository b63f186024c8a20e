"""Stream state threading across interleaved streaming derender calls.

The streaming endpoints are stateless: a client carries ``stream_state``
from each answer into the next call of the same stream. `StreamLedger`
plays that client for a file of calls, keeping one state per
(``request_id``, choice index):

- the first call of an index goes without a state; each next call gets the
  state from the previous successful answer for that index;
- a chunk without a choice (the usage-only chunk) gets the state of the
  index answered last for its request, as a client carrying one state per
  stream would send;
- a body that carries ``stream_state`` is sent as it is, which reproduces
  one exact captured server call (an explicit ``null`` is a fresh start,
  as the server takes it); its answer's state is threaded onward;
- a failed call leaves the state as it was.

Replay mode: every call goes through vLLM's own per-call path, so outputs and
states are the server's, bug for bug (including its O(n) history replay per
chunk when a parser is configured).

The ledger also tells when a request's stream is complete (all ``n``
choices finished, and the usage chunk arrived when ``include_usage`` asked
for one), so its state can be dropped and its transcript written.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .lax import read_bool, read_int, requested_choices
from .protocol import Answer, Endpoint


class ChunkFacts(NamedTuple):
    """What the ledger needs to know about one streaming call's body.
    (A tuple: one is made per chunk, and a frozen dataclass costs twice as
    much to make.)"""

    request_id: str | None
    index: int | None
    """The choice index the chunk carries; None for a chunk without one."""
    finished: bool
    """The chunk carries a finish_reason."""
    usage_only: bool
    """No choice, but usage: the generate stream's final usage chunk."""
    expected_choices: int
    expects_usage: bool
    has_state: bool
    """The body brings its own stream_state (null included: a fresh start)."""

    @classmethod
    def of(cls, body: Any, endpoint: Endpoint) -> ChunkFacts:
        """Read the facts from a body, tolerating any shape: a malformed
        body still gets its (error) answer from the engine."""
        body = body if (type(body) is dict or isinstance(body, Mapping)) else {}
        chunk = _mapping(body.get("generate_chunk"))
        choices = chunk.get("choices")
        choices = choices if isinstance(choices, list) else []
        first = _mapping(choices[0]) if choices else {}
        index = read_int(first.get("index"))  # as vLLM reads it, as n below
        request = _mapping(body.get(endpoint.request_key))
        # As vLLM reads it: a request's "2" or 2.0 is two choices.
        n = requested_choices(request, endpoint.request_key)
        request_id = chunk.get("request_id")
        stream_options = request.get("stream_options")
        return cls(
            request_id if isinstance(request_id, str) else None,
            index,
            first.get("finish_reason") is not None,
            not choices and chunk.get("usage") is not None,
            1 if n is None else n,
            read_bool(_mapping(stream_options).get("include_usage")) is True,
            # An explicit null is the client's own choice too: the server
            # starts the stream afresh for it.
            "stream_state" in body,
        )


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if (type(value) is dict or isinstance(value, Mapping)) else {}


@dataclass
class _Stream:
    """One request's streams: a state per choice index, and its progress."""

    expected_choices: int
    expects_usage: bool
    states: dict[int | None, Any] = field(default_factory=dict)
    last_index: int | None = None
    finished: set[int | None] = field(default_factory=set)
    usage_seen: bool = False

    @property
    def complete(self) -> bool:
        return len(self.finished) >= self.expected_choices and (
            self.usage_seen or not self.expects_usage
        )


class StreamLedger:
    """Threads ``stream_state`` through the calls of interleaved streams."""

    def __init__(self) -> None:
        self._streams: dict[str | None, _Stream] = {}

    def __len__(self) -> int:
        """Streams open now: the ones whose state is held in memory."""
        return len(self._streams)

    def with_state(self, body: Any, facts: ChunkFacts) -> Any:
        """The body to send: with the carried state, unless it has its own."""
        if facts.has_state or not (type(body) is dict or isinstance(body, Mapping)):
            return body
        stream = self._streams.get(facts.request_id)
        if stream is None:
            return body
        index = facts.index if facts.index is not None else stream.last_index
        state = stream.states.get(index)
        return body if state is None else {**body, "stream_state": state}

    def settle(self, facts: ChunkFacts, answer: Answer) -> bool:
        """Record the answer to a call; True when that completed its request.

        Completion follows the input (a finish_reason or usage chunk seen),
        whether or not the call succeeded, so a failed last call still ends
        the stream.
        """
        stream = self._streams.get(facts.request_id)
        if stream is None:
            stream = self._streams[facts.request_id] = _Stream(
                facts.expected_choices, facts.expects_usage
            )
        if facts.index is not None:
            stream.last_index = facts.index
            if answer.is_stream_answer:  # not a one-shot answer to a stray body
                stream.states[facts.index] = answer.stream_state
            if facts.finished:
                stream.finished.add(facts.index)
        if facts.usage_only:
            stream.usage_seen = True
        if stream.complete:
            del self._streams[facts.request_id]
            return True
        return False
