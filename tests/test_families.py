"""Every family of the coverage matrix against a real `vllm launch render`.

The matrix is `derender_core.coverage.FAMILIES`: each family's model
directory is built from its package tokenizer (`tests.families`), a render
server is started with the same flags, and the family's corpus
(`sample_inputs.family_plans`) goes through both, one-shot and streaming.
Live streaming must give what replay gives, call for call.

One family's engine is alive at a time: the fixture is module-scoped and
parametrized, so pytest tears one family down before the next starts; the
next family's server starts while the current one runs (`FamilyServers`). The three families the rest of the suite shares come from
conftest's session stacks and run last.

Where vLLM's own one-shot and streaming paths disagree, a test here pins
what vLLM does (the server does the same) and says it is vLLM's.

No family may need the network or a cache: the session's tokenizer caches
are empty (conftest), each family's engine here starts with downloads
failing, and its server with caches of its own, empty, and no network.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import gc
import io
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from derender_core import DerenderEngine, Endpoint, ExitStatus, JobSpec, ServeEngine, run_job
from derender_core.batch import Job, RecordProcessor
from derender_core.coverage import KNOWN_ISSUES, FamilyCase, decode_for, families_here
from derender_core.parity import Parity, requests_of
from derender_core.prompts import PROMPT_MISSING
from derender_core.records import Record
from derender_core.vllm_seam.versions import installed, proven
from derender_core.writers import AssembledWriter, JsonlWriter, SseWriter
from tests import decode_proof
from tests.conftest import EMPTY_TOKENIZER_CACHE, Stack
from tests.families import CASES, SPECS, family_markup, render_config
from tests.helpers import (
    REPO,
    RenderServer,
    ServeOracle,
    count_lane_calls,
    empty_cache_env,
    jsonl_answers,
    no_network,
    normalize,
    normalized_bytes,
    offline_env,
    one_token_a_step,
    requires_fast,
    run_lines,
    server_stream_answers,
    transcript_name,
)
from tests.render_corpus import mismatches, posted, render_bodies
from tests.sample_inputs import (
    FAMILY_REASONING,
    FAMILY_TEXT,
    PARIS_CALL,
    ROME_CALL,
    UNICODE_CALL,
    SampleBuilder,
    StreamPlan,
    chunks_of,
    family_plans,
    one_shot_body,
    stream_bodies,
)
from tests.serve_oracle import one_shot_steps, oracle_body, stream_steps

SHARED_STACKS = ("qwen3", "deepseek_v4", "llama3")
FAMILY_KEYS = [case.key for case in families_here()]
"""The families whose parsers the installed vLLM registers (Granite 4.2's
tool parser is 0.34's)."""
"""Families conftest already serves for the whole session."""


class ModelDirs:
    """Each family's model directory, built once per session on demand,
    all under one root."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def __call__(self, key: str) -> Path:
        target = self.root / key
        if not (target / "config.json").exists():
            SPECS[key].build(target)
        return target


@pytest.fixture(scope="session")
def family_model_dir(tmp_path_factory: pytest.TempPathFactory) -> ModelDirs:
    return ModelDirs(tmp_path_factory.mktemp("family-models"))


class FamilyServers:
    """Each family's render server, started with empty tokenizer caches of
    its own and no way out to the network. Start-up is most of a family's
    time, so taking one family's server starts the next family's (in the
    order the session runs them) in the background, model directory
    included, while this process builds the current family's engine: at
    most two servers are alive."""

    def __init__(self, order: list[str], model_dirs: ModelDirs, tmp_path_factory: pytest.TempPathFactory) -> None:
        self.order = order
        self.model_dirs = model_dirs
        self.tmp_path_factory = tmp_path_factory
        self.logs = tmp_path_factory.mktemp("logs")
        self.waiting: dict[str, Future[RenderServer]] = {}
        self.starter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="family-server")

    def _start(self, key: str) -> RenderServer:
        model_dir = self.model_dirs.root / key
        if not (model_dir / "config.json").exists():
            # In a process of its own: the conversion holds the GIL.
            subprocess.run(
                [sys.executable, "-m", "tests.families", str(model_dir), key],
                check=True, capture_output=True, cwd=REPO, env=offline_env(),
            )  # fmt: skip
        env = empty_cache_env(self.tmp_path_factory.mktemp("empty-cache"))
        return RenderServer(render_config(CASES[key], model_dir), self.logs / f"{key}-server.log", env=env, wait=False)

    def take(self, key: str) -> RenderServer:
        """`key`'s server, perhaps still starting, its model directory
        built; the caller stops it."""
        started = self.waiting.pop(key, None)
        server = started.result() if started is not None else self._start(key)
        position = self.order.index(key) if key in self.order else len(self.order)
        following = self.order[position + 1] if position + 1 < len(self.order) else None
        for other in [other for other in self.waiting if other != following]:
            self.waiting.pop(other).result().stop()
        if following is not None and following not in self.waiting:
            self.waiting[following] = self.starter.submit(self._start, following)
        return server

    def close(self) -> None:
        for started in self.waiting.values():
            if started.exception() is None:  # one that failed to start is reported where it is taken
                started.result().stop()
        self.waiting.clear()


@pytest.fixture(scope="session")
def family_servers(
    request: pytest.FixtureRequest, family_model_dir: ModelDirs, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FamilyServers]:
    # The families this session runs, in its order (only those -k kept).
    order: list[str] = []
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        key = callspec.params.get("family") if callspec is not None else None
        if key is not None and key not in SHARED_STACKS and key not in order:
            order.append(key)
    servers = FamilyServers(order, family_model_dir, tmp_path_factory)
    yield servers
    servers.close()
    servers.starter.shutdown()


@pytest.fixture(scope="module", params=FAMILY_KEYS)
def family(request: pytest.FixtureRequest, family_model_dir: ModelDirs) -> Iterator[Stack]:
    """One family's engine and render server."""
    case: FamilyCase = CASES[request.param]
    if case.key in SHARED_STACKS:
        request.getfixturevalue("family_servers").close()
        yield request.getfixturevalue(f"{case.key}_stack")
        return
    server = request.getfixturevalue("family_servers").take(case.key)
    model_dir = family_model_dir(case.key)
    config = render_config(case, model_dir)
    try:
        # The session's tokenizer caches are empty (conftest); downloads fail.
        with pytest.MonkeyPatch.context() as offline:
            for name, value in no_network().items():
                offline.setenv(name, value)
            engine = DerenderEngine.build(config)
        server.wait_until_ready()
    except BaseException:
        server.stop()
        raise
    try:
        yield Stack(case.key, config, SampleBuilder(family_markup(case, model_dir)), engine, server)
    finally:
        engine.close()
        server.stop()
        _forget_tokenizers()


def _forget_tokenizers() -> None:
    """vLLM caches every tokenizer it loads for the life of the process;
    a finished family's is not needed again."""
    from vllm.tokenizers.registry import cached_get_tokenizer

    cached_get_tokenizer.cache_clear()
    gc.collect()


@dataclass
class Run:
    """A family's corpus through the engine and the server: one-shot, and
    streamed through the server, replay and live."""

    plans: list[StreamPlan]
    one_shot: dict[str, Any]
    """The engine's one-shot answer per stream, through the pipeline."""
    bodies: list[dict[str, Any]]
    server: list[tuple[int, Any]]
    replay: list[Any]
    live: list[Any]
    assembled: dict[str, Any]
    """Each stream assembled into one response, from live streaming."""


def rendered_plans(family: Stack) -> list[StreamPlan]:
    """The family's corpus with each prompt as the render endpoint renders
    it, as a split deployment records it: with the deployment's default
    chat-template kwargs (DeepSeek V3.1/V3.2's and Gemma 4's thinking on),
    and for gpt-oss through harmony, with today's date."""
    return [
        dataclasses.replace(plan, prompt=family.server.rendered_prompt(plan.request))
        for plan in family_plans(family.builder)
    ]


@pytest.fixture(scope="module")
def run(family: Stack) -> Run:
    plans = rendered_plans(family)
    bodies = stream_bodies(family.builder, plans)
    lines = [orjson.dumps(body) for body in bodies]
    job = Job(Endpoint.CHAT, stream=True)
    replay, _ = jsonl_answers(family.engine.in_mode(live=False), job, lines)
    live_engine = family.engine.in_mode(live=True)
    live, _ = jsonl_answers(live_engine, job, lines)
    out = io.BytesIO()
    run_lines(live_engine, job, lines, AssembledWriter(out, Endpoint.CHAT, live_engine.chat_response))
    assembled = {json.loads(line)["id"]: json.loads(line) for line in out.getvalue().splitlines()}
    server = server_stream_answers(family.server, Endpoint.CHAT, bodies)
    name = family.builder.family.served_name
    answers, _ = jsonl_answers(family.engine, Job(Endpoint.CHAT), [orjson.dumps(one_shot_body(p, name)) for p in plans])
    one_shot = {plan.request_id: answer for plan, answer in zip(plans, answers, strict=True)}
    return Run(plans, one_shot, bodies, server, replay, live, assembled)


def message(answer: dict[str, Any]) -> dict[str, Any]:
    return answer["choices"][0]["message"]  # type: ignore[no-any-return]


def arguments(call: dict[str, Any]) -> Any:
    return json.loads(call["function"]["arguments"])


def test_one_shot_matches_server(family: Stack, run: Run) -> None:
    name = family.builder.family.served_name
    for plan in run.plans:
        response = family.server.post(Endpoint.CHAT, one_shot_body(plan, name))
        assert response.status_code == 200, response.text
        assert normalize(run.one_shot[plan.request_id]) == normalize(response.json()), plan.request_id


def test_decodes_as_its_coverage_row_says(family: Stack) -> None:
    """The fast path covers the family's tokenizer kind, or the family runs
    vLLM's own path (as `coverage.FAMILIES` and docs/families.md say)."""
    assert family.engine.decoder_kind == decode_for(CASES[family.name], proven("decode"))
    assert family.engine.in_mode(decode="reference").decoder_kind == "reference"


@pytest.mark.parametrize(
    "check",
    [decode_proof.check_decode_output, decode_proof.check_detokenize_delta, decode_proof.check_logprobs],
    ids=["decode_output", "detokenize_delta", "logprobs"],
)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_fast_decode_is_vllms(family: Stack, check: Any, data: Any) -> None:
    """The fast decode against vLLM's own functions on the family's real
    tokenizer, over drawn ids (`tests.decode_proof`)."""
    if family.engine.decoder_kind == "reference":
        pytest.skip("this tokenizer runs vLLM's own path: there is no fast path to compare")
    check(family.engine, data)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_live_chunks_are_the_reference_chunks_for_any_chunking(family: Stack, run: Run, data: Any) -> None:
    """Live streaming on the fast decode, against replay on vLLM's own,
    call for call, for drawn chunkings of the family's corpus."""
    decode_proof.check_live_chunks(family.engine, run.plans, data)


def _with_tool_ids_of(answer: dict[str, Any], other: Any) -> bytes:
    """`other`'s bytes with its tool-call ids replaced by `answer`'s, call for call."""
    raw = other.raw
    for mine, theirs in zip(answer.get("choices", ()), other.body.get("choices", ()), strict=True):
        calls = zip((mine["message"].get("tool_calls") or ()), (theirs["message"].get("tool_calls") or ()), strict=True)
        for call, their_call in calls:
            raw = raw.replace(json.dumps(their_call["id"]).encode(), json.dumps(call["id"]).encode(), 1)
    return raw


def test_fast_answers_are_the_reference_answers(family: Stack, run: Run) -> None:
    """Whole answers: the family corpus one-shot (logprobs included) and
    every live call equal vLLM's own decode, byte for byte."""
    name = family.builder.family.served_name
    reference = family.engine.in_mode(decode="reference")
    for plan in run.plans:
        body = one_shot_body(plan, name)
        fast, expected = family.engine.post(Endpoint.CHAT, body), reference.post(Endpoint.CHAT, body)
        assert normalize(fast.body) == normalize(expected.body), plan.request_id
        # Byte for byte too, once each call's random tool-call ids (not all
        # of the chatcmpl-tool-… form: Mistral's, xLAM's) and `created` agree.
        assert normalized_bytes(fast.raw) == normalized_bytes(_with_tool_ids_of(fast.body, expected)), plan.request_id
    lines = [orjson.dumps(body) for body in run.bodies]
    replay, _ = jsonl_answers(reference, Job(Endpoint.CHAT, stream=True), lines)
    for number, (live, expected) in enumerate(zip(run.live, replay, strict=True), 1):
        assert normalize(live) == normalize(expected), f"call {number}"


def _lexicon(info: Any) -> Any:
    """Everything a drop lexicon holds, as plain values (a compiled pattern
    by its text and flags), so two builds compare by content."""
    if info is None:
        return None
    shape = info.lexer_shape
    return (
        [(t.name, t.pattern.pattern, t.pattern.flags, t.is_literal, t.literal) for t in shape.terminals],
        shape.literal_strings, shape.max_literal_len, shape.literal_first_chars, shape.has_only_literals,
        shape.prefix_set, shape.literals_by_first, info.extra_token_ids,
    )  # fmt: skip


@requires_fast("decode")
def test_shared_lexicons_are_vllms_fresh_builds(family: Stack, run: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    """The drop lexicon the fast decode shares between a family's parsers
    (`vllm_seam.parsers`) is vLLM's fresh build for that config and
    tokenizer, after the family's whole corpus ran through it: nothing
    wrote to it. The reference decode builds its own every time."""
    from vllm.parser.engine import streaming_parser_engine

    from derender_core.vllm_seam import parsers

    name = family.builder.family.served_name
    tokenizer = family.engine._serving.online_derenderer.tokenizer
    body = one_shot_body(run.plans[0], name)
    built: list[Any] = []
    installed = streaming_parser_engine._build_drop_info

    def counted(config: Any, tokenizer: Any) -> Any:
        built.append(config)
        return installed(config, tokenizer)

    parsers.lexicons_of(tokenizer).clear()
    parsers.engines_of(tokenizer).clear()  # whose templates hold the lexicons they were built with
    with monkeypatch.context() as patch:
        patch.setattr(streaming_parser_engine, "_build_drop_info", counted)
        assert family.engine.in_mode(decode="reference").post(Endpoint.CHAT, body).ok
    assert parsers.lexicons_of(tokenizer) == {}  # vLLM's own function built each one
    for plan in run.plans:  # the corpus again, sharing from its first answer
        family.engine.post(Endpoint.CHAT, one_shot_body(plan, name))
    shared = list(parsers.lexicons_of(tokenizer).values())
    assert bool(shared) == bool(built), (len(built), len(shared))
    build = parsers.vllm_build_drop_info()
    for config, info in shared:
        assert _lexicon(info) == _lexicon(build(config, tokenizer))


@requires_fast("decode")
def test_remembered_tool_call_id_types_are_vllms(family: Stack, run: Run) -> None:
    """The tool-call id type the fast decode remembers per model config
    (`vllm_seam.parsers.ID_TYPES`) is vLLM's own answer for that
    config after the family's whole corpus ran: a Kimi model's
    ``functions.NAME:N`` ids stay Kimi's. The reference decode asks vLLM
    every time."""
    from derender_core.vllm_seam import parsers

    name = family.builder.family.served_name
    model_config = family.engine._serving.online_derenderer.model_config
    parsers.ID_TYPES.clear()
    assert family.engine.in_mode(decode="reference").post(Endpoint.CHAT, one_shot_body(run.plans[0], name)).ok
    assert parsers.ID_TYPES == {}
    for plan in run.plans:
        family.engine.post(Endpoint.CHAT, one_shot_body(plan, name))
    if family.engine._serving.online_derenderer.parser is None:
        return  # no parser, no tool-call ids to type
    assert list(parsers.ID_TYPES) == [id(model_config)]
    remembered_config, id_type = parsers.ID_TYPES[id(model_config)]
    assert remembered_config is model_config
    assert id_type == parsers.vllm_tool_call_id_type()(model_config)


def _engine_state(engine: Any, config: Any, tokenizer: Any) -> dict[str, Any]:
    """Everything a ``StreamingParserEngine`` holds, as plain values: its
    scanner and lexer by their own attributes, a lexer shape by its content
    (`_lexicon`), its config and tokenizer by identity."""

    def plain(value: Any) -> Any:
        if value is config or value is tokenizer:
            return ("same object", id(value))
        if type(value).__name__ == "LexerShape":
            return _lexicon(SimpleNamespace(lexer_shape=value, extra_token_ids=None))
        if type(value).__name__ in ("TokenIDScanner", "IncrementalLexer"):
            return (type(value).__name__, {k: plain(v) for k, v in vars(value).items()})
        if type(value).__name__ == "TerminalDef":  # a compiled pattern by its text and flags
            return (value.name, value.pattern.pattern, value.pattern.flags, value.is_literal, value.literal)
        if type(value) in (list, tuple):
            return type(value)(map(plain, value))
        return value

    return {name: plain(value) for name, value in vars(engine).items()}


_READ_ONLY_SHARED = {"config", "_resolved_token_ids"}
"""What two engines made from one template may hold as the same object:
the config, which vLLM shares between all parsers of a config, and the
token-id terminal map, which neither the engine nor its scanner writes to
after ``__init__`` (frozensets, strings and other immutable values aside)."""


@requires_fast("decode")
def test_shared_parser_engines_are_vllms_fresh_builds(family: Stack, run: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each parser engine the fast decode makes from a template
    (`vllm_seam.parsers.fresh_engine`) is, attribute for attribute, the
    engine vLLM's own ``__init__`` builds for that config, tokenizer and
    vocabulary, after the family's whole corpus ran through the templates;
    two such engines share no container that either writes to; and the
    reference decode makes none."""
    from vllm.parser.engine import parser_engine

    from derender_core.vllm_seam import parsers

    name = family.builder.family.served_name
    tokenizer = family.engine._serving.online_derenderer.tokenizer
    built: list[Any] = []
    installed = parser_engine.StreamingParserEngine

    def counted(*args: Any, **kwargs: Any) -> Any:
        built.append(args)
        return installed(*args, **kwargs)

    parsers.engines_of(tokenizer).clear()
    with monkeypatch.context() as patch:
        patch.setattr(parser_engine, "StreamingParserEngine", counted)
        assert family.engine.in_mode(decode="reference").post(Endpoint.CHAT, one_shot_body(run.plans[0], name)).ok
    assert parsers.engines_of(tokenizer) == {}  # vLLM's own class built each one
    for plan in run.plans:  # the corpus again, from templates after its first answer
        family.engine.post(Endpoint.CHAT, one_shot_body(plan, name))
    templates = list(parsers.engines_of(tokenizer).values())
    assert bool(templates) == bool(built), (len(built), len(templates))
    engine_class = parsers.vllm_engine_class()
    for config, vocab, template in templates:
        for initial_state in (None, config.initial_state):
            made = parsers.fresh_engine(template, tokenizer, initial_state)
            fresh = engine_class(config, tokenizer, initial_state=initial_state, vocab=vocab)
            assert type(made) is type(fresh)
            assert _engine_state(made, config, tokenizer) == _engine_state(fresh, config, tokenizer)
        first, second = (parsers.fresh_engine(template, tokenizer) for _ in range(2))
        for attribute, value in vars(first).items():
            if attribute not in _READ_ONLY_SHARED and value is vars(second)[attribute]:
                assert isinstance(value, (str, int, float, bool, frozenset, tuple, type(None), enum.Enum)), attribute


def release() -> str:
    """The installed vLLM's release, ``major.minor``."""
    return ".".join(installed().split(".")[:2])


KEEPS_SEPARATE_CALLS_AS_TEXT = {("llama3", "0.34")}
"""(family, release) whose one-shot parse keeps two calls on separate lines
as content (`test_llama3_json_stream_drops_the_second_of_two_calls`)."""


def test_one_shot_reads_what_the_model_wrote(family: Stack, run: Run) -> None:
    """The answers are the family's real parse, not errors or raw text:
    tool calls with their arguments, reasoning apart from the reply."""
    markup = family.builder.family
    answers = run.one_shot

    called = message(answers["family-tool-call"])
    assert [call["function"]["name"] for call in called["tool_calls"]] == [PARIS_CALL[0]]
    assert arguments(called["tool_calls"][0]) == PARIS_CALL[1]
    assert answers["family-tool-call"]["choices"][0]["finish_reason"] == "tool_calls"
    assert answers["family-tool-call"]["choices"][0]["logprobs"]["content"]
    if markup.reasoning is not None:
        assert called["reasoning"].strip() == FAMILY_REASONING
    if markup.text_before_tool_call and family.name not in LOSES_TEXT_BEFORE_CALLS:
        assert called["content"].strip() == FAMILY_TEXT.strip()

    two = message(answers["family-two-tool-calls"])
    if (family.name, release()) not in KEEPS_SEPARATE_CALLS_AS_TEXT:
        assert [arguments(call) for call in two["tool_calls"]] == [PARIS_CALL[1], ROME_CALL[1]]

    unicode = message(answers["family-unicode-arguments"])
    if (family.name, release()) not in MANGLES_SPLIT_CHARACTERS:
        assert [arguments(call) for call in unicode["tool_calls"]] == [UNICODE_CALL[1]]

    cut = answers["family-cut-at-length"]["choices"][0]
    assert cut["finish_reason"] == "length"

    hidden = message(answers["family-hidden-reasoning"])
    assert hidden.get("reasoning") is None
    assert arguments(hidden["tool_calls"][0]) == PARIS_CALL[1]

    if "family-thinking-off" in answers:
        off = message(answers["family-thinking-off"])
        assert off.get("reasoning") is None
        assert arguments(off["tool_calls"][0]) == PARIS_CALL[1]

    earlier = message(answers["family-earlier-turn"])
    assert arguments(earlier["tool_calls"][0]) == PARIS_CALL[1]


def test_streams_match_server(run: Run) -> None:
    """Replay, call for call, is what the server answers a client that
    threads stream_state through it."""
    for number, (answer, (status, expected)) in enumerate(zip(run.replay, run.server, strict=True), 1):
        assert status == 200, expected
        assert normalize(answer) == normalize(expected), f"call {number}"


def test_live_equals_replay(run: Run) -> None:
    """Live streaming keeps each stream's parser between calls; every chunk
    and every state is still replay's."""
    for number, (live, replay) in enumerate(zip(run.live, run.replay, strict=True), 1):
        assert normalize(live) == normalize(replay), f"call {number}"


_TOOL_CALL_ID = re.compile(rb'\{"id":("(?:[^"\\]|\\.)*"),"type":"function"')


def _with_streamed_tool_ids_of(mine: bytes, other: bytes) -> bytes:
    """`other`'s bytes with its streamed tool-call ids (each family's own
    form, random per stream) replaced by `mine`'s, in order of appearance."""
    for theirs, ours in dict(zip(_TOOL_CALL_ID.findall(other), _TOOL_CALL_ID.findall(mine), strict=True)).items():
        other = other.replace(theirs, ours)
    return other


@requires_fast("decode", "live")
def test_live_streams_are_replays_bytes(family: Stack, run: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    """Live streaming on the fast decode, its chunk lane taking a stream's
    usual calls (`live.ChunkLane`), gives vLLM's replay's bytes on its own
    decode (its whole per-call path: the fast replay takes the lane too):
    every SSE event, every JSONL line (chunk and state), key order and
    escaping included."""
    taken = count_lane_calls(monkeypatch)
    lines = [orjson.dumps(body) for body in run.bodies]
    job = Job(Endpoint.CHAT, stream=True)

    def outputs(engine: DerenderEngine) -> list[bytes]:
        sse, jsonl = io.BytesIO(), io.BytesIO()
        run_lines(engine, job, lines, SseWriter(target=sse))
        run_lines(engine, job, lines, JsonlWriter(jsonl))
        return [normalized_bytes(sse.getvalue()), normalized_bytes(jsonl.getvalue())]

    live = outputs(family.engine.in_mode(live=True))
    assert sum(taken) > len(lines) // 3, "the lane took too few calls to prove anything"
    replay = outputs(family.engine.in_mode(live=False, decode="reference", replay="reference"))
    for name, mine, other in zip(("sse", "jsonl"), live, replay, strict=True):
        assert mine == _with_streamed_tool_ids_of(mine, other), name


def test_stream_assembles_to_the_one_shot_answer(family: Stack, run: Run) -> None:
    """A stream assembled equals the one-shot answer for the same tokens,
    except where vLLM's two paths disagree: those streams are named in
    `coverage.KNOWN_ISSUES` and pinned by their own tests below."""
    differing = {
        plan.request_id
        for plan in run.plans
        if normalize(run.assembled[plan.request_id]) != normalize(run.one_shot[plan.request_id])
    }
    expected = {stream for issue in KNOWN_ISSUES if issue.case == family.name and issue.holds_on(installed()) for stream in issue.streams}
    assert sorted(differing) == sorted(expected)


# --- the render endpoints ----------------------------------------------------


def test_render_matches_server(family: Stack) -> None:
    """`derender render`'s answers on the family: the render corpus
    (`tests.render_corpus`: tools, template kwargs, reasoning effort,
    generation-prompt modes, sampling settings, completions, the errors)
    through the family's engine and its real server, byte for byte up to
    the request ids the server draws."""
    bodies = render_bodies(family.builder)
    ours = [(f"{endpoint.value} {name}", family.engine.post(endpoint, body)) for endpoint, name, body in bodies]
    theirs = [(f"{endpoint.value} {name}", *posted(family.server, endpoint, body)) for endpoint, name, body in bodies]
    assert mismatches(ours, theirs) == []
    assert sum(answer.ok for _, answer in ours) >= len(ours) // 2


def _without_prompt(body: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in body.items() if key not in ("prompt_token_ids", "prompt_tokens")}


def test_render_prompts_gives_the_answers_of_the_rendered_prompts(family: Stack, run: Run) -> None:
    """The family's corpus without its prompt ids, with ``--render-prompts``:
    one-shot and streamed (live), the answers of the records with the prompt
    the server renders. Without the flag every record carries the notice
    (each family here has a parser) and the streams are refused (their
    parser needs the prompt); vLLM 0.33's one-shot answers do not change on
    any family's corpus (its byte-level and Gemma tokenizers decode alike
    unseeded). Where they do, a Metaspace tokenizer: tests/test_render.py."""
    name = family.builder.family.served_name
    bodies = [_without_prompt(one_shot_body(plan, name)) for plan in run.plans]
    rendered = RecordProcessor(family.engine, Job(Endpoint.CHAT, render_prompts=True))
    for plan, body in zip(run.plans, bodies, strict=True):
        answer = rendered.process(Record(1, 1, body)).answer
        assert normalize(answer.body) == normalize(run.one_shot[plan.request_id]), plan.request_id
    stream_job = Job(Endpoint.CHAT, stream=True, render_prompts=True)
    lines = [orjson.dumps(_without_prompt(body)) for body in run.bodies]
    live, _ = jsonl_answers(family.engine.in_mode(live=True), stream_job, lines)
    assert [normalize(answer) for answer in live] == [normalize(answer) for answer in run.live]

    unseeded = RecordProcessor(family.engine, Job(Endpoint.CHAT))
    changed = set()
    for plan in run.plans:
        # The prompt's length kept: only its ids go missing.
        body = {key: value for key, value in one_shot_body(plan, name).items() if key != "prompt_token_ids"}
        outcome = unseeded.process(Record(1, 1, body))
        assert PROMPT_MISSING in outcome.logs
        if normalize(outcome.answer.body) != normalize(run.one_shot[plan.request_id]):
            changed.add(plan.request_id)
    assert changed == set()
    streamed, _ = jsonl_answers(family.engine.in_mode(live=True), Job(Endpoint.CHAT, stream=True), lines)
    assert {answer["error"]["code"] for answer in streamed} == {400}


# --- vLLM's own disagreements, pinned ---------------------------------------
# Each test below asserts what vLLM 0.33 does where its one-shot and
# streaming paths disagree. The parity tests above show the render server
# answers the same, so these are vLLM's, not derender's. A pin that starts
# failing means vLLM changed: update `coverage.KNOWN_ISSUES` with it.

LOSES_TEXT_BEFORE_CALLS = {"olmo3"}
"""Pinned by `test_olmo3_loses_the_text_before_tool_calls`."""
MANGLES_SPLIT_CHARACTERS = {("mistral", "0.33")}
"""(family, release), pinned by
`test_mistral_mode_decodes_characters_split_across_tokens_as_replacement_characters`."""


def _messages(run: Run, stream: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The one-shot and the assembled streamed message of one stream."""
    return message(run.one_shot[stream]), message(run.assembled[stream])


def _arguments(message_: dict[str, Any]) -> list[str]:
    return [call["function"]["arguments"] for call in message_.get("tool_calls") or []]


@pytest.mark.parametrize(
    "family",
    [key for key in ("glm45", "glm47", "gemma4", "qwen3_coder", "qwen3_xml", "granite42") if key in FAMILY_KEYS],
    indirect=True,
)
def test_one_shot_strips_the_text_before_tool_calls(family: Stack, run: Run) -> None:
    """vLLM 0.33, parsers on its ParserEngine: one-shot strips the
    whitespace around the text ahead of a tool call; the stream sends the
    text as the model wrote it, newlines included. Calls agree."""
    whole, streamed = _messages(run, "family-tool-call")
    assert whole["content"] == FAMILY_TEXT.strip()
    assert streamed["content"] != whole["content"]
    assert streamed["content"].strip() == whole["content"]
    assert normalize(streamed["tool_calls"]) == normalize(whole["tool_calls"])


DROPS_THE_CUT_CALL = "no call, and the content drops it"
"""One-shot: the parser found the call's start but no whole call, so it
returns no call and only the text before it (DeepSeek V3/V3.1)."""

CUT_AT_LENGTH = {
    # family: (one-shot arguments, None for no call with the markup kept in
    # the content, or DROPS_THE_CUT_CALL; the stream's arguments)
    "glm45": ("{}", '{"city": "Par'),
    "glm47": ("{}", '{"city": "Par'),
    "qwen3_coder": ("{}", '{"city": "Par'),
    "qwen3_xml": ("{}", '{"city": "Par'),
    # vLLM 0.33's DSML parsers send a string argument only once it is
    # closed; 0.34's (`_dsml_arg_value_extender`) stream the open value.
    "deepseek_v32": ("{}", '{"city": "' if release() == "0.33" else '{"city": "Par'),
    "deepseek_v4": ("{}", '{"city": "' if release() == "0.33" else '{"city": "Par'),
    "qwen3": (None, '{"city": "Par'),
    "qwen3_json": (None, '{"city": "Par'),
    "mistral": (None, '{"city": "Par'),
    "pythonic": (None, '{"city": "Par'),
    "deepseek_v3": (DROPS_THE_CUT_CALL, '{"city": "Par'),
    "deepseek_v31": (DROPS_THE_CUT_CALL, '{"city": "Par'),
    # vLLM 0.33's llama3_json closes the cut arguments' JSON in the stream.
    "llama3": (None, '{"city": "Par"}' if release() == "0.33" else '{"city": "Par'),
    "xlam": (None, ""),
    "granite42": ("{}", '{"city": "Par'),
}


@pytest.mark.parametrize("family", [key for key in CUT_AT_LENGTH if key in FAMILY_KEYS], indirect=True)
def test_tool_call_cut_at_length(family: Stack, run: Run) -> None:
    """vLLM 0.33 and 0.34: a tool call cut at ``length`` inside its first argument.
    The stream has already sent the call and its partial arguments; the
    one-shot answer has a call with ``{}``, or no call at all, with the
    markup kept in the content or (DeepSeek V3/V3.1) dropped from it."""
    one_shot_arguments, streamed_arguments = CUT_AT_LENGTH[family.name]
    whole, streamed = _messages(run, "family-cut-at-length")
    assert run.one_shot["family-cut-at-length"]["choices"][0]["finish_reason"] == "length"
    no_call = one_shot_arguments in (None, DROPS_THE_CUT_CALL)
    assert _arguments(whole) == ([] if no_call else [one_shot_arguments])
    if one_shot_arguments is None:
        assert "Par" in (whole["content"] or "")
    if one_shot_arguments == DROPS_THE_CUT_CALL:
        assert whole["content"].strip() == FAMILY_TEXT.strip()
    assert _arguments(streamed) == [streamed_arguments]


@pytest.mark.parametrize("family", ["kimi_k2"], indirect=True)
def test_kimi_k2_stream_loses_the_reasoning_split_after_an_earlier_turn(family: Stack, run: Run) -> None:
    """vLLM 0.33, kimi_k2: when the prompt holds an earlier assistant turn
    (with its empty <think></think>), the stream sends the reasoning, and
    its <think>, as content; one-shot splits it. Without the earlier turn
    both split."""
    plan = next(plan for plan in run.plans if plan.request_id == "family-earlier-turn")
    assert "<think></think>" in family.builder.tokenizer.decode(plan.prompt)
    whole, streamed = _messages(run, "family-earlier-turn")
    assert whole["reasoning"] == FAMILY_REASONING
    assert streamed.get("reasoning") is None
    assert streamed["content"] == "<think>" + FAMILY_REASONING + FAMILY_TEXT
    assert _messages(run, "family-tool-call")[1]["reasoning"] == FAMILY_REASONING


@pytest.mark.parametrize("family", ["gpt_oss"], indirect=True)
def test_gpt_oss_one_shot_escapes_non_ascii_tool_arguments(family: Stack, run: Run) -> None:
    """vLLM 0.33, harmony: one-shot re-serialises tool arguments with
    ASCII escapes (``\u00fc``); the stream sends them as the model wrote
    them. Both parse to the same object."""
    whole, streamed = _messages(run, "family-unicode-arguments")
    [one_shot_arguments], [streamed_arguments] = _arguments(whole), _arguments(streamed)
    assert one_shot_arguments == json.dumps(UNICODE_CALL[1])
    assert streamed_arguments == json.dumps(UNICODE_CALL[1], ensure_ascii=False)
    assert json.loads(one_shot_arguments) == json.loads(streamed_arguments) == UNICODE_CALL[1]


@pytest.mark.parametrize("family", ["olmo3"], indirect=True)
def test_olmo3_loses_the_text_before_tool_calls(family: Stack, run: Run) -> None:
    """vLLM 0.33, olmo3: one-shot drops the text ahead of
    <function_calls> (``content: null`` whenever calls parse). The stream,
    whose tool parser only looks for calls at the start of the content,
    sends the text and the calls as content, without the final ``>``, and
    finishes with ``stop``; with thinking off it sends it all as
    reasoning."""
    whole, streamed = _messages(run, "family-tool-call")
    assert whole["content"] is None
    assert [json.loads(a) for a in _arguments(whole)] == [PARIS_CALL[1]]
    assert whole["reasoning"] == FAMILY_REASONING
    assert _arguments(streamed) == []
    assert streamed["content"] == FAMILY_TEXT + '<function_calls>get_weather(city="Paris", unit="celsius")</function_calls'
    assert run.assembled["family-tool-call"]["choices"][0]["finish_reason"] == "stop"
    off_whole, off_streamed = _messages(run, "family-thinking-off")
    assert off_whole["reasoning"] is None and _arguments(off_whole)
    assert off_streamed["content"] is None and off_streamed["reasoning"].startswith(FAMILY_TEXT)


@pytest.mark.parametrize("family", ["mistral"], indirect=True)
def test_mistral_mode_decodes_characters_split_across_tokens_as_replacement_characters(family: Stack, run: Run) -> None:
    """vLLM 0.33, ``--tokenizer-mode mistral`` (tekken): characters whose
    bytes span several tokens (the emoji, the mathematical digits) come
    out as U+FFFD, one-shot and streaming alike, though mistral_common
    decodes the same ids to the right text. vLLM 0.34 decodes them right
    on both paths."""
    plan = next(plan for plan in run.plans if plan.request_id == "family-unicode-arguments")
    ids = [token for chunk in plan.choices[0] for token in chunk][:-1]
    assert UNICODE_CALL[1]["note"] in family.builder.tokenizer.tekken.decode(ids)
    whole, streamed = _messages(run, "family-unicode-arguments")
    for arguments_ in (_arguments(whole), _arguments(streamed)):
        note = json.loads(arguments_[0])["note"]
        if (family.name, release()) in MANGLES_SPLIT_CHARACTERS:
            assert "\ufffd" in note
            assert note.startswith("北京多云 ") and note.endswith("°C, «ß»")
        else:
            assert note == UNICODE_CALL[1]["note"]


TEKKEN_BYTE_PIECE = 1226
"""A tekken id whose piece is a lone byte (0xE2): vLLM's mistral tokenizer
gives it as ``bytes``, which JSON cannot hold."""

REFUSES_BYTE_PIECES_IN_STATES = {"0.33"}
"""Releases whose stream state carries the decode window as token strings,
so that a byte piece in it is the server's 400."""


@pytest.mark.server
@pytest.mark.parametrize("family", ["mistral"], indirect=True)
def test_mistral_byte_piece_in_a_stream_state_is_the_servers_answer_and_the_run_goes_on(
    family: Stack, tmp_path: Path
) -> None:
    """vLLM 0.33, ``--tokenizer-mode mistral``: a streaming call whose decode
    window ends in a byte piece cannot serialise its stream_state, and the
    server answers it with a 400 (``Object of type bytes is not JSON
    serializable``); the next call goes on from the state before it. vLLM
    0.34 carries the window as ids (``prev_token_ids``), so it answers the
    call and the byte piece's id goes on in the state. Each call's answer
    is the server's, in every output format, and the other records are
    answered."""
    name = family.builder.family.served_name

    def body(request_id: str, ids: list[int], finish: str | None = None) -> dict[str, Any]:
        return {
            "stream": True, "model": name, "prompt_token_ids": [1, 1056],
            "completion_request": {"model": name, "prompt": "Count:", "max_tokens": 50},
            "generate_chunk": {"request_id": request_id, "choices": [{"index": 0, "token_ids": ids, "finish_reason": finish}]},
        }  # fmt: skip

    bodies = [
        body("byte-piece", [1049]), body("plain", [1049]), body("byte-piece", [TEKKEN_BYTE_PIECE]),
        body("plain", [1050]), body("byte-piece", [1049]), body("plain", [1051], "stop"), body("byte-piece", [1050], "stop"),
    ]  # fmt: skip
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(orjson.dumps(b) + b"\n" for b in bodies))
    server = server_stream_answers(family.server, Endpoint.COMPLETION, bodies)
    refused = release() in REFUSES_BYTE_PIECES_IN_STATES
    if refused:
        assert [status for status, _ in server] == [200, 200, 400, 200, 200, 200, 200]
        assert server[2][1]["error"]["message"] == "Object of type bytes is not JSON serializable"
    else:
        assert [status for status, _ in server] == [200] * len(bodies)
        assert TEKKEN_BYTE_PIECE in server[2][1]["stream_state"]["prev_token_ids"]

    def warm(config: Any) -> DerenderEngine | None:
        return family.engine if config == family.config else None

    sse = b""
    for request_id in ("plain", "byte-piece"):  # in the order their streams end
        events = [
            b"data: " + (json.dumps(answer["chunk"], ensure_ascii=False, separators=(",", ":")) if status == 200
                         else json.dumps(answer, ensure_ascii=False, separators=(",", ":"))).encode() + b"\n\n"
            for sent, (status, answer) in zip(bodies, server, strict=True)
            if sent["generate_chunk"]["request_id"] == request_id
        ]  # fmt: skip
        sse += b"".join(events) + b"data: [DONE]\n\n"
    for live in (True, False):
        for stream_format in ("jsonl", "sse"):
            out = tmp_path / f"out-{live}.{stream_format}"
            spec = JobSpec([str(path)], str(out), endpoint=Endpoint.COMPLETION, stream_format=stream_format, live=live, workers=1)
            summary = run_job(family.config, spec, warm=warm)
            expected = ExitStatus.RECORDS_FAILED if refused else ExitStatus.OK
            assert summary.return_code == expected, (live, stream_format)
            assert summary.total.records == len(bodies) and summary.total.errors == int(refused)
            if stream_format == "jsonl":
                got = [json.loads(line) for line in out.read_bytes().splitlines()]
                assert normalize(got) == normalize([answer for _, answer in server]), f"live={live}"
            else:
                assert normalized_bytes(out.read_bytes()) == normalized_bytes(sse), f"live={live}"


@pytest.mark.parametrize("family", ["xlam"], indirect=True)
def test_xlam_stream_repeats_the_arguments_of_the_last_call(family: Stack, run: Run) -> None:
    """vLLM 0.33, xlam: with some chunkings the stream sends the last
    call's arguments twice, so they join to invalid JSON; one-shot is
    right."""
    whole, streamed = _messages(run, "family-hidden-reasoning")
    [arguments_] = _arguments(whole)
    assert json.loads(arguments_) == PARIS_CALL[1]
    assert _arguments(streamed) == [arguments_ + arguments_]


@pytest.mark.parametrize("family", ["qwen3_json", "deepseek_v3"], indirect=True)
def test_blank_line_before_tool_calls_is_content_only_in_the_stream(family: Stack, run: Run) -> None:
    """vLLM 0.33 (hermes-style and DeepSeek V3 parsers): with no text
    between the reasoning and the calls, one-shot gives ``content: null``;
    the stream sends the blank line after </think> as content."""
    whole, streamed = _messages(run, "family-unicode-arguments")
    assert whole["content"] is None
    assert streamed["content"] == "\n\n"
    assert normalize(streamed["tool_calls"]) == normalize(whole["tool_calls"])


@pytest.mark.parametrize("family", ["deepseek_v31", "deepseek_v32"], indirect=True)
def test_deepseek_v3_stream_reasoning_follows_the_prompt(family: Stack, run: Run) -> None:
    """vLLM 0.33, ``--reasoning-parser deepseek_v3``, thinking on from the
    deployment's default chat-template kwargs. With the prompt the render
    endpoint renders (ending in <think>) the stream splits the reasoning as
    one-shot does. A record whose prompt was rendered with thinking off
    (ending in </think>: the chat template without the deployment's
    defaults) while the request leaves thinking on: the stream, which reads
    the prompt, sends the reasoning and </think> as content; one-shot, which
    does not, splits it. The render server streams the same."""
    whole, streamed = _messages(run, "family-tool-call")
    assert whole["reasoning"] == streamed["reasoning"] == FAMILY_REASONING
    b = family.builder
    messages = [{"role": "user", "content": "Hi!"}]
    think_start, think_end = b.tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    assert family.server.rendered_prompt(b.chat_request(messages))[-1] == think_start
    plan = StreamPlan(
        request_id="thinking-off-prompt",
        prompt=b.prompt_ids(messages),
        request=b.chat_request(messages, stream=True),
        choices=[chunks_of(b.encode(b.answer(FAMILY_TEXT, reasoning=FAMILY_REASONING)) + b.stop_ids(), [2])],
        usage=False,
    )
    assert plan.prompt[-1] == think_end
    bodies = stream_bodies(b, [plan])
    answers, _ = jsonl_answers(family.engine, Job(Endpoint.CHAT, stream=True), [orjson.dumps(x) for x in bodies])
    server = server_stream_answers(family.server, Endpoint.CHAT, bodies)
    assert [normalize(answer) for answer in answers] == [normalize(expected) for _, expected in server]
    deltas = [answer["chunk"]["choices"][0]["delta"] for answer in answers]
    assert "".join(delta.get("reasoning") or "" for delta in deltas) == ""
    assert "".join(delta.get("content") or "" for delta in deltas) == FAMILY_REASONING + "</think>" + FAMILY_TEXT
    [one_shot], _ = jsonl_answers(family.engine, Job(Endpoint.CHAT), [orjson.dumps(one_shot_body(plan, b.family.served_name))])
    assert (message(one_shot)["reasoning"], message(one_shot)["content"]) == (FAMILY_REASONING, FAMILY_TEXT)


@pytest.mark.parametrize("family", ["deepseek_v31"], indirect=True)
def test_deepseek_v31_stream_cuts_the_end_of_the_first_of_two_calls(family: Stack, run: Run) -> None:
    """vLLM 0.33, deepseek_v31: of two calls in one section, the stream
    never sends the end of the first call's arguments (``"}``); one-shot
    has both whole."""
    whole, streamed = _messages(run, "family-two-tool-calls")
    assert [json.loads(a) for a in _arguments(whole)] == [PARIS_CALL[1], ROME_CALL[1]]
    assert _arguments(streamed) == [json.dumps(PARIS_CALL[1])[:-2], json.dumps(ROME_CALL[1])]


@pytest.mark.parametrize("family", ["llama3"], indirect=True)
def test_llama3_json_stream_drops_the_second_of_two_calls(family: Stack, run: Run) -> None:
    """llama3_json, two JSON calls on separate lines. vLLM 0.33: one-shot
    gives both; the stream sends only the first (vLLM logs an error for
    the second). vLLM 0.34 (``LlamaJsonEngineToolParser``): one-shot keeps
    both as content; the stream sends the first as a call and the second's
    JSON as content."""
    whole, streamed = _messages(run, "family-two-tool-calls")
    assert [json.loads(a) for a in _arguments(streamed)] == [PARIS_CALL[1]]
    assert release() in ("0.33", "0.34"), f"vLLM {installed()}: pin what this release does"
    if release() == "0.33":
        assert [json.loads(a) for a in _arguments(whole)] == [PARIS_CALL[1], ROME_CALL[1]]
    else:
        assert _arguments(whole) == []
        assert [json.loads(line)["parameters"] for line in whole["content"].splitlines()] == [PARIS_CALL[1], ROME_CALL[1]]
        assert json.loads(streamed["content"])["parameters"] == ROME_CALL[1]


# --- derender parity on the families (issue #9) ---------------------------------
# `derender parity` runs each family's corpus through every path: the
# one-shot and streaming derender endpoints (replay and live) and vLLM
# serve's own handlers (streamed and not). It must find the disagreements
# the issue lists for the family, between the two derender modes and, as
# serve runs the same parsers, between serve's two modes; and otherwise
# only serve's own framing, which Qwen3's corpus pins frame by frame
# (tests/test_parity.py).

SERVE_PARITY = {
    # family: the (stream, field) pairs where one-shot and streaming differ.
    # GLM-4.5: one-shot strips the text before a tool call, the stream keeps
    # its newlines; a call cut at length is "{}" one-shot, partial JSON
    # streamed.
    "glm45": {
        *((stream, "content") for stream in (
            "family-tool-call", "family-two-tool-calls", "family-cut-at-length",
            "family-hidden-reasoning", "family-thinking-off", "family-earlier-turn",
        )),
        ("family-cut-at-length", "tool_calls"),
    },
    # Kimi K2: after an earlier <think></think> turn the stream loses the
    # reasoning split.
    "kimi_k2": {("family-earlier-turn", "content"), ("family-earlier-turn", "reasoning")},
    # gpt-oss: one-shot escapes non-ASCII tool arguments, the stream sends
    # them raw.
    "gpt_oss": {("family-unicode-arguments", "tool_calls")},
}  # fmt: skip
SERVE_STOP_LOGIC = {
    # gpt-oss stops at <|call|>, a stop id of its generation config: the
    # corpus's two calls in one answer run past it, which vLLM's stop logic
    # in the serve path reports (the recorded finish still wins).
    "gpt_oss": {("family-two-tool-calls", "record", "serve", "stop_logic")},
}
SERVE_REASONING_COUNT = {
    # Granite 4.2 (vLLM 0.34, granite_thinking_parser): with no text between
    # the thought and the calls, serve's stream counts 12 reasoning tokens
    # in its usage, its one-shot answer 23.
    "granite42": {"family-unicode-arguments"},
}
"""The streams whose usage (its reasoning token count) differs between
serve's own two modes."""
SERVE_FRAMING = {
    "usage",
    "system_fingerprint",
    "null_fields",
    "role_frame",
    "empty_frames",
    "finish_frame",
}
"""What serve writes its own way whatever the family: usage details and
fingerprint, its frame field selection, its role frame, no empty frames,
finish on the last token's frame."""


@pytest.fixture
def serve_engine(family: Stack) -> Iterator[ServeEngine]:
    """The family behind vLLM serve's own handlers."""
    engine = ServeEngine.build(family.config)
    yield engine
    engine.close()


@pytest.mark.parametrize("family", FAMILY_KEYS, indirect=True)
def test_parity_on_every_family(family: Stack, run: Run, serve_engine: ServeEngine) -> None:
    """`derender parity` over the family's corpus. Serve runs the same
    parsers as the derender endpoints, so its two modes disagree exactly as
    the derender's do, on the streams `coverage.KNOWN_ISSUES` names (and,
    for the families issue #9 lists, on its fields); between derender and
    serve there is only serve's own framing; live is replay."""
    records = [Record(number, number, body) for number, body in enumerate(run.bodies, 1)]
    requests = list(requests_of(records, Endpoint.CHAT, stream=True, requests=None, chunkings=[]))
    assert all(request.problem is None for request in requests)
    engines = {
        "oneshot": family.engine.in_mode(live=False), "replay": family.engine.in_mode(live=False),
        "live": family.engine.in_mode(live=True), "serve": serve_engine, "serve-oneshot": serve_engine,
    }  # fmt: skip
    found = [divergence for request in requests for divergence in Parity(engines, Endpoint.CHAT).run(request)]

    def outputs(left: str, right: str) -> set[tuple[str | None, str]]:
        return {(d.request_id, d.field) for d in found if (d.left, d.right) == (left, right) and d.field not in SERVE_FRAMING}

    between_modes = outputs("oneshot", "replay")
    assert outputs("serve-oneshot", "serve") == between_modes
    known = {stream for issue in KNOWN_ISSUES if issue.case == family.name and issue.holds_on(installed()) for stream in issue.streams}
    assert {stream for stream, _ in between_modes} == known
    if family.name in SERVE_PARITY:
        assert between_modes == SERVE_PARITY[family.name]
    mode_pairs = {("oneshot", "replay"), ("serve-oneshot", "serve")}
    others = {(d.request_id, d.left, d.right, d.field) for d in found
              if (d.left, d.right) not in mode_pairs and d.field not in SERVE_FRAMING}  # fmt: skip
    assert others == SERVE_STOP_LOGIC.get(family.name, set())
    between_serve_modes = {d.request_id for d in found if (d.left, d.right) == ("serve-oneshot", "serve") and d.field == "usage"}
    assert between_serve_modes == SERVE_REASONING_COUNT.get(family.name, set())
    framing = {(d.left, d.right) for d in found if d.field in SERVE_FRAMING and (d.left, d.right) != ("serve-oneshot", "serve")}
    assert framing == {("oneshot", "serve-oneshot"), ("replay", "serve")}
    assert {d.field for d in found if (d.left, d.right) == ("serve-oneshot", "serve")} & SERVE_FRAMING <= {"usage"}
    # Serve's fingerprint on every request in both modes; its reasoning
    # token count (usage details) where a reasoning parser counts them.
    additions = ("usage", "system_fingerprint") if family.config.reasoning_parser else ("system_fingerprint",)
    for request in requests:
        for left, right in framing:
            for field in additions:
                assert any(
                    (d.request_id, d.left, d.right, d.field) == (request.request_id, left, right, field) for d in found
                ), (request.request_id, left, right, field)
    # Fast path serve_bulk (each choice's tokens one step): the family's
    # one-shot bodies answered, findings included, as one token a step.
    one_shots = [request.one_shot for request in requests if request.one_shot is not None]
    assert one_shots

    def answered() -> list[tuple[int, bytes, tuple[Any, ...]]]:
        # Byte for byte, in the answer's key order, less what each call draws
        # afresh (`created`, the family's random tool-call ids).
        return [(a.status, orjson.dumps(normalize(orjson.loads(a.raw))), a.findings)
                for a in (serve_engine.post(Endpoint.CHAT, body) for body in one_shots)]  # fmt: skip

    merged = answered()
    with one_token_a_step(serve_engine):
        assert answered() == merged


def reporting_call_stops(choice: dict[str, Any], call_id: int) -> dict[str, Any]:
    """The choice as vLLM's engine core reports it: a stop on <|call|>, a
    stop id of gpt-oss's generation config but not its EOS, names it as the
    stop reason (the corpus, like older generate hosts, leaves it out)."""
    if choice.get("finish_reason") == "stop" and (choice.get("token_ids") or [None])[-1] == call_id:
        return {**choice, "stop_reason": call_id}
    return choice


@pytest.mark.parametrize("family", ["gpt_oss"], indirect=True)
def test_gpt_oss_serve_path_equals_vllm_serve(
    family: Stack, run: Run, serve_engine: ServeEngine, tmp_path: Path
) -> None:
    """gpt-oss goes through serve's harmony path, not the parsers: its
    answers, one-shot and streamed, are `vllm serve`'s own (over HTTP, on a
    taped engine core). A prompt the serve path does not render the same
    way is refused with a hint at the harmony date."""
    call_id = family.builder.family.tool_call_eos_id
    assert call_id is not None
    plans = run.plans
    bodies = stream_bodies(family.builder, plans)
    for body in bodies:
        chunk = body["generate_chunk"]
        chunk["choices"] = [reporting_call_stops(choice, call_id) for choice in chunk["choices"]]
    run_lines(serve_engine, Job(Endpoint.CHAT, stream=True), [orjson.dumps(x) for x in bodies],
              SseWriter(directory=tmp_path))  # fmt: skip
    tapes = tmp_path / "tapes"
    tapes.mkdir()
    oracle = ServeOracle(family.config, tmp_path / "serve-oracle.log", tapes)
    try:
        for plan in plans:
            chunks = [b["generate_chunk"] for b in bodies if b["generate_chunk"]["request_id"] == plan.request_id]
            streamed = oracle.request(Endpoint.CHAT, plan.request_id, oracle_body(plan.request, stream=True),
                                      stream_steps(chunks))  # fmt: skip
            assert streamed.status_code == 200, streamed.text
            ours = (tmp_path / transcript_name(plan.request_id)).read_bytes()
            assert normalized_bytes(ours) == normalized_bytes(streamed.content), plan.request_id
            body = one_shot_body(plan, family.builder.family.served_name)
            response = body["generate_response"]
            response["choices"] = [reporting_call_stops(choice, call_id) for choice in response["choices"]]
            whole = oracle.request(Endpoint.CHAT, plan.request_id, oracle_body(body["chat_request"], stream=False),
                                   one_shot_steps(response["choices"]))  # fmt: skip
            assert whole.status_code == 200, whole.text
            answer = serve_engine.post(Endpoint.CHAT, body)
            assert answer.status == 200, answer.raw
            assert normalized_bytes(answer.raw) == normalized_bytes(orjson.dumps(whole.json())), plan.request_id
    finally:
        oracle.stop()
    body = one_shot_body(plans[0], family.builder.family.served_name)
    body["prompt_token_ids"] = family_plans(family.builder)[0].prompt  # the chat template's, not harmony's
    refused = serve_engine.post(Endpoint.CHAT, body)
    assert refused.status == 400
    assert "VLLM_SYSTEM_START_DATE" in refused.error_message
    # The date in the prompt is the one the hint names: pinned to another
    # day, serve no longer renders today's prompt; pinned to today, it does.
    with pytest.MonkeyPatch.context() as pinned:
        for number, (day, status) in enumerate((("2001-02-03", 400), (datetime.date.today().isoformat(), 200))):
            pinned.setenv("VLLM_SYSTEM_START_DATE", day)
            body = one_shot_body(plans[0], family.builder.family.served_name)
            body["generate_response"]["request_id"] = f"pinned-date-{number}"
            assert serve_engine.post(Endpoint.CHAT, body).status == status, day


# --- start-up ------------------------------------------------------------------


def test_families_start_with_empty_caches_and_no_network(family_model_dir: ModelDirs) -> None:
    """The families above started with empty tokenizer caches (this
    process's, and each server's own) and downloads failing, and nothing was
    fetched into the caches since. gpt-oss without its harmony vocabulary
    stops at start-up and names the file to provide."""
    from huggingface_hub import constants

    assert Path(constants.HF_HUB_CACHE) == EMPTY_TOKENIZER_CACHE
    assert [path for path in EMPTY_TOKENIZER_CACHE.rglob("*") if path.is_file()] == []
    done = subprocess.run(
        [sys.executable, "-m", "tests.offline_startup", str(family_model_dir("gpt_oss"))],
        env=offline_env(**no_network()),
        capture_output=True,
        cwd=REPO,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    error = done.stdout.decode()
    assert "TIKTOKEN_ENCODINGS_BASE" in error and "o200k_base.tiktoken" in error
