"""Live completion stream chunks (fast path ``live_cmpl``): the chunk
lane answers the usual chunk of a live completion stream without the
per-call validation, handler and response models (`live.ChunkLane.
answer_completion`), plain or with logprobs written from the loaded chunk
(`logprobs.completion_stream_json`, text offsets counted on from the
state's), and every chunk and every stream state must be what vLLM's own
code gives: the engine on its own decode and per-call path (``--mode
replay --replay reference --decode reference``), call for call, over more
than one family's tokenizer (byte-level and sentencepiece with byte
fallback).

Drawn by hypothesis: the stream (a family's corpus or ids drawn from the
tokenizer's pools: byte pieces, characters cut across tokens, special ids,
ids past the vocabulary), one or two choices (a state per index, as a
client keeps them), its chunking and finish, the request's ``logprobs``
(absent, 0, 1, 5, 20, a large one, -1), ``skip_special_tokens``,
``return_tokens_as_token_ids``, and per chunk its logprobs: none, of the
usual shape (the chunk's ids or drawn ones sampled, drawn candidates,
finite logprobs or ``nan`` and the infinities now and then), or any shape
`test_fast_logprobs.drawn_logprobs` draws; now and then a call retried
with the state before it, or its state edited in place before the next
call, as a client may do. Calls are posted one after another, each with
the state the previous answer for its index gave (a failed call keeps it).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from derender_core import DerenderEngine, Endpoint
from tests.decode_proof import _pools
from tests.helpers import count_lane_calls, normalized_bytes, requires_fast
from tests.sample_inputs import (
    SampleBuilder,
    StreamPlan,
    chunks_of,
    family_plans,
    logprobs_for,
    split_unicode_text,
    stream_bodies,
)
from tests.test_fast_logprobs import drawn_logprobs
from tests.test_live_logprobs import Family, usual_logprobs
from tests.test_live_logprobs import family  # noqa: F401 - the fixture: an engine per family

pytestmark = requires_fast("decode", "live", "logprobs", "live_cmpl")


@dataclasses.dataclass
class Call:
    """One call, and what the client does around it."""

    body: dict[str, Any]
    retried: bool = False
    """Posted a second time with the state it was first posted with."""
    edit: tuple[str, Any] | None = None
    """A field of the answer's state set in place (name, value) before the
    next call carries it."""


def posted(engine: DerenderEngine, calls: list[Call]) -> list[tuple[int, bytes]]:
    """Each call's status and normalised bytes (chunk and state), each
    call carrying the state the last successful answer for its choice
    index gave; a usage chunk carries the one answered last."""
    states: dict[int | None, Any] = {}
    last: Any = None
    out = []
    for call in calls:
        choices = call.body["generate_chunk"]["choices"]
        index = choices[0]["index"] if choices else None
        state = states.get(index) if choices else last
        for _ in range(2 if call.retried else 1):
            body = copy.deepcopy(call.body)
            if state is not None:
                body["stream_state"] = state
            answer = engine.post(Endpoint.COMPLETION, body)
            out.append((answer.status, normalized_bytes(answer.raw)))
        if answer.is_stream_answer:
            last = states[index] = answer.stream_state
            if call.edit is not None:
                setattr(answer.stream_state, *call.edit)
    return out


def reference(engine: DerenderEngine) -> DerenderEngine:
    """vLLM's own code: its decode, its handler and models per call."""
    return engine.in_mode(live=False, decode="reference", replay="reference")


def corpus_ids(builder: SampleBuilder) -> list[list[int]]:
    """The output ids of the family's corpus streams, as completion text,
    and a text whose characters are spelled in several tokens (a piece's
    logprob token then depends on the sampled ids before it, in earlier
    chunks too)."""
    plans = family_plans(builder)
    return [*([t for chunk in plan.choices[0] for t in chunk] for plan in plans), builder.encode(split_unicode_text())]


def drawn_stream(data: Any, family: Family) -> list[Call]:
    """A live completion stream's calls with drawn ids, chunking, request
    and logprobs, and now and then a retried call or an edited state."""
    b = family.builder
    pools = _pools(family.engine._serving.online_derenderer)
    usual_ids = st.sampled_from(pools["ordinary"] + pools["byte"] + pools["cut"] + pools["special"])
    choices = []
    for _ in range(data.draw(st.integers(1, 2), label="choices")):
        if data.draw(st.integers(0, 2), label="drawn ids") == 0:
            pool = usual_ids | st.sampled_from(pools["oov"]) if data.draw(st.booleans(), label="oov") else usual_ids
            ids = data.draw(st.lists(pool, min_size=1, max_size=16), label="ids")
        else:
            ids = data.draw(st.sampled_from(corpus_ids(b)), label="corpus ids")
        sizes = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=4), label="chunk sizes")
        choices.append(chunks_of(ids, sizes))
    prompt = "Tell me about the weather:"
    request: dict[str, Any] = {"model": b.family.served_name, "prompt": prompt, "stream": True}
    if data.draw(st.booleans(), label="usage"):
        request["stream_options"] = {"include_usage": True}
    top = data.draw(st.sampled_from([None, 0, 1, 5, 20, 200, -1]), label="logprobs")
    if top is not None:
        request["logprobs"] = top
    if data.draw(st.integers(0, 3), label="skip_special_tokens") == 0:
        request["skip_special_tokens"] = False
    if data.draw(st.integers(0, 6), label="return_tokens_as_token_ids") == 0:
        request["return_tokens_as_token_ids"] = True  # 0.34 writes ids as tokens; 0.33 ignores it
    if len(choices) > 1:
        request["n"] = len(choices)
    plan = StreamPlan(
        request_id=data.draw(st.sampled_from(["cmpl-drawn", "cmpl-drawn-é"]), label="request id"),
        prompt=b.encode(prompt),
        request=request,
        choices=choices,
        finish_only_tail=data.draw(st.booleans(), label="finish on a chunk of its own"),
        finish_reason=data.draw(st.sampled_from(["length", "stop"]), label="finish reason"),
        request_key="completion_request",
    )
    calls = [Call(body) for body in stream_bodies(b, [plan])]
    for call in calls:
        for choice in call.body["generate_chunk"]["choices"]:
            kind = data.draw(st.sampled_from(["usual", "usual", "usual", "none", "any shape"]), label="chunk logprobs")
            if kind == "usual":
                choice["logprobs"] = usual_logprobs(data, pools, choice["token_ids"])
            elif kind == "any shape":
                choice["logprobs"] = drawn_logprobs(data, family.engine, max_size=4)
        if data.draw(st.integers(0, 12), label="retried") == 0:
            call.retried = True
        if data.draw(st.integers(0, 12), label="edited state") == 0:
            call.edit = data.draw(
                st.sampled_from([
                    ("logprob_text_offset", 7), ("logprob_context_token_ids", [3]),
                    ("prefix_offset", 0), ("read_offset", 0),
                    # Values validation would not give: as vLLM's code takes them.
                    ("logprob_text_offset", True), ("logprob_context_token_ids", [True, 2**70]),
                ]),
                label="edit",
            )  # fmt: skip
    return calls


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_live_completion_chunks_are_vllms(family: Family, data: Any) -> None:
    """Every call's status, chunk and state: the live stream's (the lane's
    where it takes the call) equal vLLM's own code's."""
    calls = drawn_stream(data, family)
    with pytest.MonkeyPatch.context() as patch:
        taken = count_lane_calls(patch, "answer_completion")
        fast = posted(family.engine.in_mode(live=True), calls)
    event(f"lane took {'some' if any(taken) else 'no'} calls")
    assert fast == posted(reference(family.engine), calls)


def _usual_stream(family: Family, top: int | None, request_id: str = "cmpl-usual") -> list[Call]:
    """A usual completion stream: the family's first corpus output, two
    tokens a chunk, finished by length, then usage; with `top`, the
    request asks for ``logprobs: top`` and every chunk carries the sampled
    id and `top` others."""
    b = family.builder
    request: dict[str, Any] = {
        "model": b.family.served_name, "prompt": "Once", "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    if top is not None:
        request["logprobs"] = top
    plan = StreamPlan(
        request_id=request_id,
        prompt=b.encode("Once"),
        request=request,
        choices=[chunks_of(corpus_ids(b)[0], [2])],
        finish_reason="length",
        request_key="completion_request",
    )
    bodies = stream_bodies(b, [plan])
    if top is not None:
        for body in bodies:
            for choice in body["generate_chunk"]["choices"]:
                choice["logprobs"] = logprobs_for(choice["token_ids"], top=top + 1)
    return [Call(body) for body in bodies]


@pytest.mark.parametrize("top", [None, 5])
def test_the_usual_chunk_takes_the_lane(family: Family, top: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A usual stream's chunks, plain or with logprobs, are answered by the
    lane (all but the first, whose request is not yet known, and the
    finishing one), their logprobs written from the chunk, and the
    answers are vLLM's."""
    from derender_core.vllm_seam import logprobs as raw_logprobs

    calls = _usual_stream(family, top, request_id=f"cmpl-usual-{top}")
    written: list[int] = []
    write = raw_logprobs.completion_stream_json

    def spy(fragments: Any, usual: Any, *args: Any) -> Any:
        written.append(len(usual.ids))
        return write(fragments, usual, *args)

    monkeypatch.setattr(raw_logprobs, "completion_stream_json", spy)
    taken = count_lane_calls(monkeypatch, "answer_completion")
    fast = posted(family.engine.in_mode(live=True), calls)
    chunks = [call for call in calls if call.body["generate_chunk"]["choices"]]
    assert sum(taken) == len(chunks) - 2
    assert len(written) == (0 if top is None else len(chunks) - 2)
    assert fast == posted(reference(family.engine), calls)


def test_without_the_path_the_lane_leaves_completions_to_vllm(
    family: Family, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``live_cmpl`` off, the lane takes no completion chunk, and
    the answers are the same."""
    from derender_core.vllm_seam import versions

    proven = versions.proven
    monkeypatch.setattr(versions, "proven", lambda path: path != "live_cmpl" and proven(path))
    engine = family.engine.in_mode(live=True)
    engine._lane = None  # a lane of its own, built on its first live call
    calls = _usual_stream(family, 5, request_id="without-the-path")
    taken = count_lane_calls(monkeypatch, "answer_completion")
    fast = posted(engine, calls)
    assert not any(taken)
    assert fast == posted(reference(family.engine), calls)
