"""Live chat chunks that carry logprobs (fast path ``stream_lp``): the chunk
lane writes their logprobs from the loaded chunk (`live.ChunkLane`,
`logprobs.chat_json` with the stream's context), and every chunk and every
stream state must be what vLLM's own code gives: its replay on its own
decode (``--mode replay --replay reference --decode reference``), call for
call, over more than one family's tokenizer (byte-level and
sentencepiece with byte fallback).

Drawn by hypothesis: the stream (a family's corpus or ids drawn from the
tokenizer's pools: byte pieces, characters cut across tokens, special ids,
ids past the vocabulary), its chunking, the request's ``logprobs``,
``top_logprobs`` (0 to 20, -1, absent), ``include_reasoning`` and
``return_tokens_as_token_ids``, and per
chunk its logprobs: none, of the usual shape (the chunk's ids or drawn ones
sampled, drawn candidates, finite logprobs or ``nan`` and the infinities
now and then), or any shape `test_fast_logprobs.drawn_logprobs` draws.
Calls are posted one after another, each with the state the previous
answer gave (a failed call keeps it), as a job threads them.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from derender_core import DerenderEngine, Endpoint
from tests.conftest import sample_config
from tests.decode_proof import _pools
from tests.families import CASES, SPECS, family_markup, render_config
from tests.helpers import count_lane_calls, normalized_bytes, requires_fast
from tests.sample_inputs import (
    SampleBuilder,
    chunks_of,
    drawn_chunking,
    family_plans,
    logprobs_for,
    qwen3_family,
    stream_bodies,
)
from tests.test_fast_logprobs import drawn_logprobs

pytestmark = requires_fast("decode", "live", "logprobs", "stream_lp")

FAMILIES = ["qwen3", "gemma4", "deepseek_v4"]
"""Byte-level (two vocabularies) and sentencepiece with byte fallback."""


@dataclasses.dataclass
class Family:
    engine: DerenderEngine
    builder: SampleBuilder


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Family]:
    """One family's engine and sample builder (the bundled sample's for qwen3)."""
    if request.param == "qwen3":
        config = sample_config()
        builder = SampleBuilder(qwen3_family(Path(config.model or "")))
    else:
        case = CASES[request.param]
        model_dir = tmp_path_factory.mktemp("models") / request.param
        SPECS[request.param].build(model_dir)
        config = render_config(case, model_dir)
        builder = SampleBuilder(family_markup(case, model_dir))
    engine = DerenderEngine.build(config)
    if engine.decoder_kind == "reference":
        engine.close()
        pytest.skip("this tokenizer runs vLLM's own path: there is no fast path to compare")
    yield Family(engine, builder)
    engine.close()


def posted(engine: DerenderEngine, bodies: list[dict[str, Any]]) -> list[tuple[int, bytes]]:
    """Each call's status and normalised bytes (chunk and state), each
    call carrying the state the last successful answer gave."""
    state: Any = None
    out = []
    for body in bodies:
        call = copy.deepcopy(body)
        if state is not None:
            call["stream_state"] = state
        answer = engine.post(Endpoint.CHAT, call)
        if answer.is_stream_answer:
            state = answer.stream_state
        out.append((answer.status, normalized_bytes(answer.raw)))
    return out


def reference(engine: DerenderEngine) -> DerenderEngine:
    """vLLM's own code: its replay of the history per call, its decode."""
    return engine.in_mode(live=False, decode="reference", replay="reference")


FINITE = st.floats(-30, 0) | st.sampled_from([0.0, -0.0, -1e-5, -2.5e-7, -1e-300, -1e16])
ANY_FLOAT = FINITE | st.sampled_from([math.nan, math.inf, -math.inf])


def usual_logprobs(data: Any, pools: dict[str, list[int]], ids: list[int]) -> dict[str, Any]:
    """generate's logprobs of the usual shape for a chunk of `ids`: the
    sampled id (the chunk's, or now and then a drawn one) and drawn
    candidates, as many at every position or not."""
    candidates = st.sampled_from(pools["ordinary"] + pools["byte"] + pools["cut"] + pools["special"])
    if data.draw(st.booleans(), label="candidates past the vocabulary"):
        candidates |= st.sampled_from([i for i in pools["oov"] if i >= 0])
    floats = ANY_FLOAT if data.draw(st.integers(0, 6), label="non-finite logprobs") == 0 else FINITE
    width = data.draw(st.integers(0, 6), label="candidates")
    uneven = data.draw(st.integers(0, 3), label="uneven candidates") == 0
    sampled_ids = ids if data.draw(st.integers(0, 4), label="other sampled ids") else [data.draw(candidates) for _ in ids]
    content = []
    for token_id in sampled_ids:
        sampled = {"token_id": token_id, "logprob": data.draw(floats), "rank": 1}
        count = data.draw(st.integers(0, 6)) if uneven else width
        tops = [{"token_id": data.draw(candidates), "logprob": data.draw(floats), "rank": k + 2} for k in range(count)]
        content.append({**sampled, "top_logprobs": [sampled, *tops]})
    return {"content": content}


def drawn_stream(data: Any, family: Family) -> list[dict[str, Any]]:
    """A live stream's bodies with drawn chunking, request and logprobs."""
    b = family.builder
    pools = _pools(family.engine._serving.online_derenderer)
    plans = [plan for plan in family_plans(b) if len(plan.choices) == 1 and plan.finish_reason == "stop"]
    plan = drawn_chunking(data, plans, largest=4)
    if data.draw(st.integers(0, 2), label="drawn ids") == 0:
        usual_ids = st.sampled_from(pools["ordinary"] + pools["byte"] + pools["cut"] + pools["special"])
        ids = data.draw(st.lists(usual_ids, min_size=1, max_size=16), label="ids")
        plan = dataclasses.replace(plan, choices=[chunks_of(ids, [data.draw(st.integers(1, 4), label="size")])])
    request = dict(plan.request)
    request.pop("logprobs", None), request.pop("top_logprobs", None)
    asks = data.draw(st.sampled_from([True, True, True, False, None]), label="logprobs")
    if asks is not None:
        request["logprobs"] = asks
    if asks:
        top = data.draw(st.sampled_from([0, 1, 2, 5, 20, -1, "absent"]), label="top_logprobs")
        if top != "absent":
            request["top_logprobs"] = top
    if data.draw(st.integers(0, 4), label="include_reasoning") == 0:
        request["include_reasoning"] = False
    if data.draw(st.integers(0, 6), label="return_tokens_as_token_ids") == 0:
        request["return_tokens_as_token_ids"] = True  # 0.34 writes ids as tokens; 0.33 ignores it
    bodies = stream_bodies(b, [dataclasses.replace(plan, request=request, logprobs=False)])
    for body in bodies:
        for choice in body["generate_chunk"]["choices"]:
            kind = data.draw(st.sampled_from(["usual", "usual", "usual", "none", "any shape"]), label="chunk logprobs")
            if kind == "usual":
                choice["logprobs"] = usual_logprobs(data, pools, choice["token_ids"])
            elif kind == "any shape":
                choice["logprobs"] = drawn_logprobs(data, family.engine, max_size=4)
    return bodies


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_live_chunks_with_logprobs_are_vllms_replay(family: Family, data: Any) -> None:
    """Every call's status, chunk and state: the fast live stream's (and
    the fast replay's) equal vLLM's own replay's."""
    bodies = drawn_stream(data, family)
    with pytest.MonkeyPatch.context() as patch:
        taken = count_lane_calls(patch)
        fast = posted(family.engine.in_mode(live=True), bodies)
    event(f"lane took {'some' if any(taken) else 'no'} calls")
    event(f"{sum(bool(c.get('logprobs')) for b in bodies for c in b['generate_chunk']['choices'])} chunks with logprobs")
    want = posted(reference(family.engine), bodies)
    assert fast == want
    # The fast replay goes on from its previous call through the same lane.
    assert posted(family.engine.in_mode(live=False), bodies) == want


def _usual_stream(family: Family) -> list[dict[str, Any]]:
    """The family's first corpus stream, its request asking for 5 top
    logprobs and every chunk carrying the sampled id and 5 others."""
    b = family.builder
    plan = family_plans(b)[0]
    plan = dataclasses.replace(plan, request={**plan.request, "logprobs": True, "top_logprobs": 5}, logprobs=False)
    bodies = stream_bodies(b, [plan])
    for body in bodies:
        for choice in body["generate_chunk"]["choices"]:
            choice["logprobs"] = logprobs_for(choice["token_ids"], top=6)
    return bodies


def test_the_usual_chunk_with_logprobs_takes_the_lane(family: Family, monkeypatch: pytest.MonkeyPatch) -> None:
    """A usual stream's chunks with logprobs are answered by the lane (all
    but the first, whose request is not yet known, and the finishing
    one), their logprobs written from the chunk, and the answers are
    vLLM's replay's."""
    from derender_core.vllm_seam import logprobs as raw_logprobs

    bodies = _usual_stream(family)
    written: list[int] = []
    write = raw_logprobs.chat_json

    def spy(fragments: Any, usual: Any, top_limit: Any, context: Any = ()) -> Any:
        written.append(len(usual.ids))
        return write(fragments, usual, top_limit, context)

    monkeypatch.setattr(raw_logprobs, "chat_json", spy)
    taken = count_lane_calls(monkeypatch)
    fast = posted(family.engine.in_mode(live=True), bodies)
    chunks = [body for body in bodies if body["generate_chunk"]["choices"]]
    assert sum(taken) == len(chunks) - 2
    assert len(written) == len(chunks) - 2
    assert fast == posted(reference(family.engine), bodies)


def test_without_the_path_the_lane_leaves_logprobs_to_vllm(family: Family, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``stream_lp`` off, the lane takes no chunk with logprobs, and the
    answers are the same."""
    from derender_core.vllm_seam import versions

    proven = versions.proven
    monkeypatch.setattr(versions, "proven", lambda path: path != "stream_lp" and proven(path))
    engine = family.engine.in_mode(live=True)
    bodies = _usual_stream(family)
    for body in bodies:
        body["generate_chunk"]["request_id"] = "without-the-path"
    engine._lane = None  # a lane of its own, built on its first live call
    taken = count_lane_calls(monkeypatch)
    fast = posted(engine, bodies)
    assert not any(taken)
    assert fast == posted(reference(family.engine), bodies)
