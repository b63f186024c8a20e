"""The fast replay is vLLM's replay: every call's chunk and state.

`replay.ReplayStreams` goes on from this process's previous call of a
stream where the call's state is the one that call answered; every other
state (retried, forked, edited, captured) takes vLLM's own replay. Here the
fast replay (``replay="fast"``) is held equal to vLLM's (``replay=
"reference"``), call for call, status, chunk and state, over every family's
tokenizer and corpus, and under hypothesis over drawn chunkings and drawn
walks through a stream that retry calls, fork from earlier states, edit
states in place and send captured (JSON) ones. Only `created` and the
random tool-call ids are normalised. Each test also checks that the fast
path was taken where it may be, and not where it may not.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from derender_core import DerenderEngine, Endpoint
from derender_core.batch import Job
from derender_core.coverage import families_here
from tests.families import CASES, SPECS, family_markup, render_config
from tests.helpers import ParserSteps, count_lane_calls, jsonl_answers, no_network, normalize, requires_fast
from tests.sample_inputs import (
    SampleBuilder,
    StreamPlan,
    drawn_chunking,
    family_plans,
    generate_chunks,
    parser_corner_plans,
    stream_bodies,
    stream_body,
    stream_plans,
)
from tests.test_live_lane import JOB, outputs, varied_stream

pytestmark = requires_fast("live", "replay")

SHARED_STACKS = ("qwen3", "deepseek_v4", "llama3")
FAMILY_KEYS = [case.key for case in families_here()]


@dataclasses.dataclass
class Family:
    key: str
    engine: DerenderEngine
    builder: SampleBuilder


@pytest.fixture(scope="module", params=FAMILY_KEYS)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Family]:
    """Each family's engine (no server: both sides are this process)."""
    key = request.param
    if key in SHARED_STACKS:
        stack = request.getfixturevalue(f"{key}_stack")
        yield Family(key, stack.engine, stack.builder)
        return
    case = CASES[key]
    model_dir = tmp_path_factory.mktemp(f"replay-{key}")
    SPECS[key].build(model_dir)
    with pytest.MonkeyPatch.context() as offline:
        for name, value in no_network().items():
            offline.setenv(name, value)
        engine = DerenderEngine.build(render_config(case, model_dir))
    try:
        yield Family(key, engine, SampleBuilder(family_markup(case, model_dir)))
    finally:
        engine.close()
        from vllm.tokenizers.registry import cached_get_tokenizer

        cached_get_tokenizer.cache_clear()
        gc.collect()


def replays(engine: DerenderEngine) -> Any:
    """The engine's `ReplayStreams` (its counters)."""
    replay = engine._serving.online_derenderer._derender_chat_stream_parsed_async
    return replay.__self__


def fast_and_reference(engine: DerenderEngine, decode: str = "fast") -> tuple[DerenderEngine, DerenderEngine]:
    return (
        engine.in_mode(live=False, decode=decode, replay="fast"),
        engine.in_mode(live=False, decode=decode, replay="reference"),
    )


@pytest.mark.parametrize("decode", ["fast", "reference"])
def test_the_corpus_replays_as_vllm_replays(family: Family, decode: str) -> None:
    """Every call of the family's stream corpus, through the pipeline as
    ``derender stream --mode replay`` runs it (JSONL: chunk and state), on
    either decode (`derender parity`'s replay path runs vLLM's)."""
    plans = family_plans(family.builder)
    lines = [orjson.dumps(body) for body in stream_bodies(family.builder, plans)]
    fast, reference = fast_and_reference(family.engine, decode)
    job = Job(Endpoint.CHAT, stream=True)
    counters = replays(family.engine)
    before = counters.gone_on
    got, got_code = jsonl_answers(fast, job, lines)
    gone_on = counters.gone_on - before
    expected, expected_code = jsonl_answers(reference, job, lines)
    assert counters.gone_on - before == gone_on  # the reference never goes on
    assert got_code == expected_code
    for number, (mine, theirs) in enumerate(zip(got, expected, strict=True), 1):
        assert normalize(mine) == normalize(theirs), f"call {number}"
    if family.engine._serving.online_derenderer.parser is not None:
        # Every call after a stream's second that continues it went on.
        assert gone_on > 0


# --- drawn walks: chunkings, retries, forks, edits, captured states ----------


def _edit(state: Any, how: str) -> None:
    """Edit a state in place, as a library caller might."""
    if how == "drop last token" and state.output_token_ids:
        state.output_token_ids.pop()
        state.output_chunk_lens[-1] -= 1
        if state.output_chunk_lens[-1] == 0:
            state.output_chunk_lens.pop()
    elif how == "merge chunks" and len(state.output_chunk_lens) > 1:
        last = state.output_chunk_lens.pop()
        state.output_chunk_lens[-1] += last
    elif how == "role":
        state.role_sent = not state.role_sent
    elif how == "tools streamed":
        state.tools_streamed = not state.tools_streamed
    else:  # a logprob context it did not have
        state.logprob_context_token_ids.append(0)


def _outcome(answer: Any) -> tuple[int, Any, Any]:
    if not answer.ok:
        return answer.status, answer.body, None
    return answer.status, normalize(answer.chunk), normalize(orjson.loads(answer.raw)["stream_state"])


def walk(engine: DerenderEngine, bodies: list[dict[str, Any]], steps: list[tuple[str, Any]]) -> list[Any]:
    """Post a stream's calls as `steps` say, states carried as objects:
    ``next`` sends the next call with the last answer's state, ``retry``
    sends the last call again with the state it was sent with, ``fork``
    goes back to an earlier call and its state, ``edit`` edits the state
    in place before the next call, ``captured`` sends it as JSON."""
    states: list[Any] = [None]  # the state each call was sent with, by position
    position = 0
    outcomes = []
    for action, arg in steps:
        if action == "retry" and position > 0:
            position -= 1
        elif action == "fork" and position > 0:
            position = arg % position
        if position >= len(bodies):
            break
        state = states[position]
        if action == "edit" and state is not None:
            if hasattr(state, "to_model"):  # a live view: edited as a model
                state = states[position] = state.to_model()
            _edit(state, arg)
        elif action == "captured" and state is not None:
            state = orjson.loads(orjson.dumps(state.model_dump()))
        body = dict(bodies[position])
        if state is not None:
            body["stream_state"] = state
        answer = engine.post(Endpoint.CHAT, body)
        outcomes.append(_outcome(answer))
        position += 1
        if answer.ok:
            del states[position:]
            states.append(answer.stream_state)
        else:
            del states[position:]
            states.append(state)
    return outcomes


ACTIONS = st.one_of(
    st.tuples(st.just("next"), st.none()),
    st.tuples(st.just("next"), st.none()),
    st.tuples(st.just("next"), st.none()),
    st.tuples(st.just("retry"), st.none()),
    st.tuples(st.just("fork"), st.integers(0, 1000)),
    st.tuples(st.just("edit"), st.sampled_from(["drop last token", "merge chunks", "role", "tools streamed", "context"])),
    st.tuples(st.just("captured"), st.none()),
)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_walk_replays_as_vllm_replays(family: Family, data: st.DataObject) -> None:
    """A corpus stream cut at drawn chunk sizes, with or without logprobs,
    walked with retries, forks, in-place edits and captured states, on
    either decode: every call the same on both replays."""
    plans = [plan for plan in family_plans(family.builder) if len(plan.choices) == 1]
    plan: StreamPlan = drawn_chunking(data, plans, 6)
    model = family.engine._serving.models.model_name()
    bodies = [stream_body(plan, chunk, model) for chunk in generate_chunks(plan)]
    steps = data.draw(st.lists(ACTIONS, min_size=len(bodies), max_size=2 * len(bodies) + 4), label="walk")
    decode = data.draw(st.sampled_from(["fast", "reference"]), label="decode")
    fast, reference = fast_and_reference(family.engine, decode)
    got = walk(fast, copy.deepcopy(bodies), steps)
    expected = walk(reference, copy.deepcopy(bodies), steps)
    assert got == expected


@pytest.fixture
def qwen3(qwen3_stack: Any) -> Family:
    return Family("qwen3", qwen3_stack.engine, qwen3_stack.builder)


def _tool_stream(family: Family) -> list[dict[str, Any]]:
    b = family.builder
    plan = next(p for p in family_plans(b) if len(p.choices) == 1 and len(p.choices[0]) > 4)
    model = family.engine._serving.models.model_name()
    return [stream_body(plan, chunk, model) for chunk in generate_chunks(plan)]


def test_only_the_state_this_process_answered_goes_on(qwen3: Family) -> None:
    """Goes on exactly for the state the previous call answered, unchanged;
    an edited, captured or retried state replays (and answers the same)."""
    fast, reference = fast_and_reference(qwen3.engine)
    bodies = _tool_stream(qwen3)
    counters = replays(qwen3.engine)

    def gone_on(steps: list[tuple[str, Any]]) -> int:
        before = counters.gone_on
        got = walk(fast, copy.deepcopy(bodies), steps)
        count = counters.gone_on - before
        assert got == walk(reference, copy.deepcopy(bodies), steps)
        return count

    # The first call and the second (which rebuilds once) replay; the rest go on.
    assert gone_on([("next", None)] * 5) == 3
    # A retried call replays, and the call after it goes on from its answer.
    assert gone_on([("next", None)] * 3 + [("retry", None), ("next", None)]) == 1
    # An edited state replays, whatever the edit.
    for how in ("drop last token", "merge chunks", "role", "tools streamed", "context"):
        assert gone_on([("next", None)] * 3 + [("edit", how)]) == 1, how
    # A captured state (JSON) is not this process's answer.
    assert gone_on([("next", None)] * 3 + [("captured", None)]) == 1


def test_a_changed_request_or_prompt_replays(qwen3: Family) -> None:
    """The same state with a different request or prompt is another
    replay: vLLM's, answered as vLLM answers it."""
    fast, reference = fast_and_reference(qwen3.engine)
    bodies = _tool_stream(qwen3)
    counters = replays(qwen3.engine)
    for change in ("request", "prompt"):
        changed = copy.deepcopy(bodies)
        if change == "request":
            changed[3]["chat_request"] = {**changed[3]["chat_request"], "tool_choice": "none"}
        else:
            changed[3]["prompt_token_ids"] = changed[3]["prompt_token_ids"][1:]
        before = counters.gone_on
        got = walk(fast, changed, [("next", None)] * 5)
        # Call 3 goes on; 4 (changed) and 5 (after a change) replay.
        assert counters.gone_on - before == 1, change
        assert got == walk(reference, copy.deepcopy(changed), [("next", None)] * 5)


@pytest.mark.parametrize("decode", ["fast", "reference"])
def test_the_lane_answers_a_replays_usual_calls_on_either_decode(
    qwen3: Family, decode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream's usual calls that go on take the live lane, on the stream's
    own decode, vLLM's included: every SSE event and JSONL line (chunk and
    state, key order and escaping included) is the slow path's and vLLM's
    replay's. The corpus: n=2, unicode cut inside characters, tool calls,
    logprobs, finish-only tails, hidden reasoning, named and required tool
    choice."""
    from derender_core.vllm_seam.live import ChunkLane

    b = qwen3.builder
    bodies = stream_bodies(b, stream_plans(b) + parser_corner_plans(b))
    fast, reference = fast_and_reference(qwen3.engine, decode)
    taken = count_lane_calls(monkeypatch)
    got = outputs(fast, bodies, JOB)
    assert sum(taken) > len(bodies) // 2, "the lane took too few calls to prove anything"
    assert not all(taken), "the slow path answered no call"
    assert got == outputs(reference, bodies, JOB)
    with pytest.MonkeyPatch.context() as lane_off:
        lane_off.setattr(ChunkLane, "answer", lambda self, body: None)
        assert got == outputs(fast, bodies, JOB)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_variation_of_a_replay_call_is_answered_as_vllms_replay_answers_it(qwen3: Family, data: st.DataObject) -> None:
    """Calls the lane must leave to the slow path, or take and answer as it
    does (`tests.test_live_lane.VARIATIONS`), on vLLM's decode, checked or
    lenient: the fast replay's bytes are vLLM's replay's."""
    bodies = varied_stream(qwen3.builder, data)
    fast, reference = fast_and_reference(qwen3.engine, "reference")
    job = Job(Endpoint.CHAT, stream=True, lenient=data.draw(st.booleans(), label="lenient"))
    assert outputs(fast, bodies, job) == outputs(reference, bodies, job)


def test_replay_reference_is_vllms_own(qwen3: Family, tmp_path: Path) -> None:
    """``replay="reference"`` never goes on; an unknown mode is refused."""
    from derender_core.errors import ConfigError

    fast, reference = fast_and_reference(qwen3.engine)
    assert (fast.replay, reference.replay) == ("fast", "reference")
    counters = replays(qwen3.engine)
    before = counters.gone_on
    walk(reference, _tool_stream(qwen3), [("next", None)] * 6)
    assert counters.gone_on == before
    with pytest.raises(ConfigError, match="--replay"):
        qwen3.engine.in_mode(replay="bogus")


def test_the_command_takes_vllms_replay_one_flag_away(cli: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``derender stream --mode replay`` goes on from each call's answer;
    ``--replay reference`` replays the whole history on every call, as
    vLLM's replay does, and writes the same bytes."""
    from cli.main import app

    steps = ParserSteps(monkeypatch)
    outputs, counts = {}, {}
    for replay in ("fast", "reference"):
        steps.count = 0
        result = cli.invoke(
            app,
            ["stream", "sample_data/stream.jsonl", "--config", "sample_data/qwen3.yaml", "--mode", "replay", "--replay", replay, "-q", "-j", "1"],
        )
        assert result.exit_code == 0, result.output
        outputs[replay], counts[replay] = [normalize(orjson.loads(line)) for line in result.stdout.splitlines()], steps.count
    assert outputs["fast"] == outputs["reference"]
    assert len(outputs["fast"]) == 71
    # The sample's streams hold 20 to 36 calls: O(n²) steps against O(n).
    assert counts["reference"] > 5 * counts["fast"] > 0
