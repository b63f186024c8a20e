"""The one-shot chat logprobs written from the loaded body (fast path
``logprobs``, `derender_core.vllm_seam.logprobs`) against vLLM's own
validation, bounds and ``_resolve_logprobs``, over every family's real
tokenizer, and whole answers against ``--decode reference``.

Logprobs are drawn by hypothesis: sizes, ids (ordinary, special, byte and
cut pieces, past the vocabulary, negative, huge, of other types), logprobs
(finite, ``-0.0``, tiny, ``nan`` and the infinities, ints, bools, strings),
ranks, missing and extra keys, candidates past ``max_logprobs``, and the
endpoint's cut (``top_logprobs`` 0 to 20, -1, none). Where the structural
check takes a field, pydantic must validate it to the same values and
vLLM's bounds must pass; the JSON written must be the bytes vLLM's models
serialise to, or None exactly where they cannot be serialised.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from derender_core import DerenderEngine, Endpoint
from derender_core.batch import Job
from derender_core.coverage import families_here
from tests.conftest import sample_config
from tests.decode_proof import _pools, outcome
from tests.families import CASES, SPECS, render_config
from tests.helpers import jsonl_answers, normalize, requires_fast
from tests.sample_inputs import SampleBuilder, chat_bodies, completion_bodies, qwen3_family

pytestmark = requires_fast("decode", "requests", "responses", "logprobs")

TOKENIZERS = ["qwen3", *(case.key for case in families_here() if case.key != "qwen3")]


@pytest.fixture(scope="module", params=TOKENIZERS)
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DerenderEngine]:
    """One family's engine (the bundled sample's for qwen3)."""
    if request.param == "qwen3":
        config = sample_config()
    else:
        model_dir = tmp_path_factory.mktemp("models") / request.param
        SPECS[request.param].build(model_dir)
        config = render_config(CASES[request.param], model_dir)
    built = DerenderEngine.build(config)
    yield built
    built.close()


def _dumps(content: Any) -> str:
    """As the endpoints' ``JSONResponse`` serialises."""
    return json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))


FLOATS = st.one_of(
    st.floats(-40, 0),
    st.floats(-40, 0),
    st.sampled_from([0.0, -0.0, -1e-5, -2.5e-7, -1e-300, -9999.0, -1e16, 1.5]),
    st.sampled_from([math.nan, math.inf, -math.inf]),
)
ODD_VALUES = st.sampled_from([True, False, 3, -2, "1", "x", None, 1.0, [], {}])


def _candidate(data: Any, ids: Any, *, entry: bool, odd: bool) -> Any:
    """One generate logprob dict: of the usual shape unless `odd`, then
    perhaps not."""
    if odd and data.draw(st.integers(0, 30), label="odd candidate") == 0:
        return data.draw(st.sampled_from([None, 1, "x", [], {}]), label="not a dict")
    item: dict[str, Any] = {"token_id": data.draw(ids, label="token_id"), "logprob": data.draw(FLOATS, label="logprob")}
    ranks = ["absent", "absent", None, 1, 7, 2**70] + (["2", True, 1.0] if odd else [])
    rank = data.draw(st.sampled_from(ranks), label="rank")
    if rank != "absent":
        item["rank"] = rank
    change = data.draw(st.integers(0, 12), label="odd field") if odd else -1
    if change == 0:
        item[data.draw(st.sampled_from(["token_id", "logprob"]))] = data.draw(ODD_VALUES, label="odd value")
    elif change == 1:
        del item[data.draw(st.sampled_from(["token_id", "logprob"]))]
    elif change == 2:
        item[data.draw(st.sampled_from(["extra", "top_logprobs" if not entry else "token"]))] = 1
    return item


def drawn_logprobs(data: Any, engine: DerenderEngine, *, max_size: int = 10) -> Any:
    """A choice's ``logprobs`` field as a body may hold it."""
    derenderer = engine._serving.online_derenderer
    pools = _pools(derenderer)
    usual_ids = st.sampled_from(pools["ordinary"] + pools["special"] + pools["byte"] + pools["cut"])
    ids = usual_ids | st.sampled_from(pools["oov"] + [2**31, 2**63, 2**70]) if data.draw(st.booleans()) else usual_ids
    odd = data.draw(st.integers(0, 3), label="odd field") == 0
    shape = data.draw(st.integers(0, 30), label="field shape")
    if shape == 0:
        return data.draw(st.sampled_from([{}, {"content": None}, {"content": []}, {"content": [], "x": 1}, [], "x"]))
    content = []
    # As many candidates everywhere (as the engine sends them) half the time.
    same: int | None = None
    uniform = data.draw(st.booleans(), label="as many candidates everywhere")
    every = data.draw(st.sampled_from(["usual", "many"]), label="tops everywhere") if uniform else None
    for _ in range(data.draw(st.integers(0, max_size), label="positions")):
        entry = _candidate(data, ids, entry=True, odd=odd)
        if type(entry) is dict:
            shapes = ["usual", "usual", "usual", "absent", "empty", "many"] + (["none"] if odd else [])
            tops = every or data.draw(st.sampled_from(shapes), label="tops")
            if tops in ("usual", "many"):
                sampled = {k: v for k, v in entry.items() if k in ("token_id", "logprob", "rank")}
                count = data.draw(st.integers(0, 5) if tops == "usual" else st.integers(19, 22), label="candidates")
                if uniform:
                    count = same = count if same is None else same
                entry["top_logprobs"] = [sampled] + [_candidate(data, ids, entry=False, odd=odd) for _ in range(count)]
            elif tops == "empty":
                entry["top_logprobs"] = []
            elif tops == "none":
                entry["top_logprobs"] = None
        content.append(entry)
    return {"content": content}


def _bounds_error(engine: DerenderEngine, validated: Any) -> Any:
    """vLLM's bounds check of a choice carrying these logprobs."""
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
        GenerateTokensChoice,
        GenerateTokensResponse,
    )

    choice = GenerateTokensChoice(index=0, token_ids=[1], logprobs=validated)
    return engine._serving._validate_derender_bounds([GenerateTokensResponse(request_id="r", choices=[choice])])


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_the_written_logprobs_are_vllms(engine: DerenderEngine, data: Any) -> None:
    """Where the structural check takes a field, validation accepts it as
    it is and vLLM's bounds pass; its JSON is the models' JSON."""
    from pydantic import ValidationError
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateLogProbs
    from vllm.renderers.online_derenderer import (
        _convert_chat_logprobs_to_completion_logprobs,
        _resolve_logprobs,
    )

    from derender_core.vllm_seam import logprobs as raw_logprobs

    serving = engine._serving
    derenderer = serving.online_derenderer
    if engine.decoder_kind == "reference":
        body = {"generate_response": {"choices": [{"index": 0, "logprobs": {"content": []}}]}}
        assert raw_logprobs.carried(body, serving) is body  # no table: vLLM's models, as before
        pytest.skip("this tokenizer runs vLLM's own path: there is no fast path to compare")
    field = drawn_logprobs(data, engine)
    top_limit = data.draw(st.sampled_from([None, 0, 1, 2, 5, 20]), label="top_limit")
    config = serving.model_config
    usual = raw_logprobs.usual_content(copy.deepcopy(field), config.max_model_len, config.max_logprobs)
    try:
        validated = GenerateLogProbs.model_validate(copy.deepcopy(field))
    except ValidationError:
        assert usual is None, field
        event("invalid: declined")
        return
    if usual is None:
        event("valid: declined")
        return
    event("taken")
    assert raw_logprobs.RawLogProbs.of(usual).validated() == validated
    assert _bounds_error(engine, validated) is None

    def reference() -> tuple[str | None, str | None]:
        resolved = _resolve_logprobs(validated, derenderer.tokenizer, top_limit=top_limit)
        completion = _convert_chat_logprobs_to_completion_logprobs(resolved, validated)
        return _written(resolved), _written(completion)

    def fast() -> tuple[str | None, str | None]:
        chat = raw_logprobs.chat_json(derenderer.fragments, usual, top_limit)
        completion = raw_logprobs.completion_json(derenderer.fragments, usual, top_limit)
        return (None if chat is None else chat.decode(), None if completion is None else completion.decode())

    got, want = outcome(fast), outcome(reference)
    if got[0] == "returned" and want[0] == "returned" and got[1][1] is None:
        # A non-finite logprob sends the completion to vLLM's own models,
        # which are exact, also where a repeated token hides it.
        got = ("returned", (got[1][0], want[1][1]))
    assert got == want, (field, top_limit)


def test_orjson_writes_every_string_as_the_response_does() -> None:
    """The completion writer leaves its dicts' keys, the tokens, to orjson
    (`logprobs._completion_json`): it writes every character but the
    surrogates (which it refuses, and no decode gives) as the response's
    ``json.dumps(ensure_ascii=False)`` does."""
    encode = json.JSONEncoder(ensure_ascii=False).encode
    differ = [
        code
        for code in range(0x110000)
        if not 0xD800 <= code <= 0xDFFF and orjson.dumps(chr(code)) != encode(chr(code)).encode()
    ]
    assert differ == []
    with pytest.raises(TypeError):
        orjson.dumps("\ud800")


def _written(model: Any) -> str | None:
    """A response model's JSON, None where a non-finite float stops it."""
    try:
        return _dumps(model.model_dump())
    except ValueError:
        return None


@pytest.fixture(scope="module")
def sample() -> Iterator[tuple[DerenderEngine, list[tuple[Endpoint, dict[str, Any]]]]]:
    """The sample's engine and its one-shot bodies with choices."""
    engine = DerenderEngine.build(sample_config())
    b = SampleBuilder(qwen3_family(Path(sample_config().model or "")))
    bodies = [(Endpoint.CHAT, body) for body in chat_bodies(b) if body.get("generate_response", {}).get("choices")]
    bodies += [(Endpoint.COMPLETION, body) for body in completion_bodies(b)]
    yield engine, bodies
    engine.close()


def _answer(engine: DerenderEngine, body: dict[str, Any], endpoint: Endpoint = Endpoint.CHAT) -> tuple[Any, ...]:
    import vllm.logger

    from derender_core.logs import collected_vllm_logs
    from tests.helpers import normalized_bytes

    vllm.logger._print_warning_once.cache_clear()
    with collected_vllm_logs(verbose=False) as logs:
        answer = engine.post(endpoint, copy.deepcopy(body))
    # vLLM warns once per process for each id past the vocabulary; the
    # token table decodes each id once per process, so the fast decode
    # says it the first time only, where this test clears vLLM's memory.
    lines = [line.key for line in logs if not line.key[2].startswith(_NO_VOCAB_ENTRY)]
    return answer.status, normalized_bytes(answer.raw), lines


_NO_VOCAB_ENTRY = "decode_token_ids: token_id %d has no vocab entry"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_answers_with_logprobs_are_the_reference_answers(sample: Any, data: Any) -> None:
    """Whole one-shot chat answers with drawn logprobs and requests: the
    same status, bytes and vLLM log lines as ``--decode reference``, and
    the same records through a job, strict and ``--lenient``."""
    engine, bodies = sample
    endpoint, base = data.draw(st.sampled_from(bodies), label="base body")
    body = copy.deepcopy(base)
    responses = [body["generate_response"]] if endpoint is Endpoint.CHAT else body["generate_responses"]
    for choice in (choice for response in responses for choice in response["choices"]):
        if data.draw(st.booleans(), label="logprobs on the choice"):
            choice["logprobs"] = drawn_logprobs(data, engine, max_size=6)
    request = body.get(endpoint.request_key)
    if isinstance(request, dict) and endpoint is Endpoint.CHAT:
        request["logprobs"] = data.draw(st.sampled_from([True, True, False, None]), label="logprobs")
        if request["logprobs"]:
            request["top_logprobs"] = data.draw(st.sampled_from([0, 1, 5, 20, -1, None]), label="top_logprobs")
        if data.draw(st.booleans(), label="vary include_reasoning"):
            request["include_reasoning"] = data.draw(st.booleans())
        if data.draw(st.integers(0, 8), label="logprob_token_ids") == 0:
            request["logprob_token_ids"] = [1, 2]
    elif isinstance(request, dict):
        request["logprobs"] = data.draw(st.sampled_from([None, 0, 1, 5, 19, -1]), label="logprobs")
    fast = _answer(engine, body, endpoint)
    assert fast == _answer(engine.in_mode(decode="reference"), body, endpoint), body
    event(f"status {fast[0]}" + (f": {orjson.loads(fast[1])['error']['message'][:40]}" if fast[0] != 200 else ""))
    if data.draw(st.integers(0, 4), label="through a job") == 0:
        line = orjson.dumps(body) if _finite(body) else None
        if line is not None:
            lenient = data.draw(st.booleans(), label="lenient")
            job = Job(endpoint, stream=False, lenient=lenient)
            got, code = jsonl_answers(engine.in_mode(live=True), job, [line])
            want, want_code = jsonl_answers(engine.in_mode(live=True, decode="reference"), job, [line])
            assert (normalize(got), code) == (normalize(want), want_code)


def _finite(body: Any) -> bool:
    """Whether the body can be written as a JSON line (no non-finite float)."""
    try:
        orjson.dumps(body)
        json.dumps(body, allow_nan=False)
    except (TypeError, ValueError, orjson.JSONEncodeError):
        return False
    return True


def test_the_usual_record_takes_the_fast_path(sample: Any) -> None:
    """A usual body's logprobs reach the derenderer unvalidated, and the
    answer is the reference one."""
    engine, bodies = sample
    body = copy.deepcopy(bodies[0][1])
    choice = body["generate_response"]["choices"][0]
    from tests.sample_inputs import logprobs_for

    choice["logprobs"] = logprobs_for(choice["token_ids"], top=6)
    body["chat_request"].update(logprobs=True, top_logprobs=5)
    with _writes("chat_json") as written:
        fast = _answer(engine, body)
    assert written == [len(choice["token_ids"])]
    assert body["generate_response"]["choices"][0]["logprobs"]["content"][0]["token_id"] == choice["token_ids"][0]
    assert fast == _answer(engine.in_mode(decode="reference"), body)


@contextlib.contextmanager
def _writes(writer: str) -> Iterator[list[int]]:
    """The positions each call of `raw_logprobs`'s `writer` (``chat_json``
    or ``completion_json``) wrote, while the block runs: the fast path's
    writes, where vLLM's models would have been built."""
    from derender_core.vllm_seam import logprobs as raw_logprobs

    written: list[int] = []
    write = getattr(raw_logprobs, writer)

    def spy(fragments: Any, usual: Any, top_limit: Any) -> Any:
        written.append(len(usual.ids))
        return write(fragments, usual, top_limit)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(raw_logprobs, writer, spy)
        yield written


def test_the_usual_completion_takes_the_fast_path(sample: Any) -> None:
    """A usual completion body's logprobs, too."""
    from tests.sample_inputs import logprobs_for

    engine, bodies = sample
    body = copy.deepcopy(next(body for endpoint, body in bodies if endpoint is Endpoint.COMPLETION))
    choice = body["generate_responses"][0]["choices"][0]
    choice["logprobs"] = logprobs_for(choice["token_ids"], top=6)
    body["completion_request"]["logprobs"] = 5
    with _writes("completion_json") as written:
        fast = _answer(engine, body, Endpoint.COMPLETION)
    assert written == [len(choice["token_ids"])]
    assert fast == _answer(engine.in_mode(decode="reference"), body, Endpoint.COMPLETION)


def _byte_level(engine: DerenderEngine) -> Any:
    """The engine's per-id bytes (`logprobs.ByteLevelBytes`), or a skip."""
    byte_level = engine._serving.online_derenderer.fragments
    byte_level = getattr(byte_level, "byte_level", None)
    if byte_level is None:
        pytest.skip("not a byte-level tokenizer decoded by Rust alone: the correction decodes by the tokenizer")
    return byte_level


def test_byte_pieces_in_pairs_decode_as_the_tokenizer(engine: DerenderEngine) -> None:
    """Every pair (and a spread of triples) of the byte pieces and the cut
    characters' first pieces: the joined bytes decode to the tokenizer's
    own text, U+FFFD and all."""
    byte_level = _byte_level(engine)
    derenderer = engine._serving.online_derenderer
    pools = _pools(derenderer)
    ids = list(dict.fromkeys(pools["byte"] + pools["cut"] + pools["ordinary"][:20]))
    decode = derenderer.table._decoding.uncached
    checked = 0
    for first in ids:
        for second in ids:
            for sequence in ([first, second], [second, first, ids[(first + second) % len(ids)]]):
                spelled = byte_level.spelled(sequence)
                if spelled is not None:
                    assert b"".join(spelled).decode("utf-8", "replace") == decode(sequence), sequence
                    checked += 1
    assert checked > len(ids) ** 2


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_spelled_ids_decode_as_the_tokenizer(engine: DerenderEngine, data: Any) -> None:
    """Drawn runs of up to 5 ids of every kind: where every id is spelled,
    the joined bytes decode to the tokenizer's own text."""
    byte_level = _byte_level(engine)
    derenderer = engine._serving.online_derenderer
    pools = _pools(derenderer)
    kinds = st.sampled_from(["ordinary", "special", "byte", "byte", "cut", "oov"])
    element = kinds.flatmap(lambda kind: st.sampled_from(pools[kind]))
    sequence = data.draw(st.lists(element, min_size=1, max_size=5), label="ids")
    spelled = byte_level.spelled(sequence)
    event("spelled" if spelled is not None else "left to the tokenizer")
    if spelled is not None:
        assert b"".join(spelled).decode("utf-8", "replace") == derenderer.table._decoding.uncached(sequence)


LOGPROB_LIKE = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False),
    st.floats(-1e-3, 0),
    st.floats(-40, 0, width=32),
    st.integers(-30, 30).flatmap(lambda exponent: st.floats(-(10.0**exponent), 0)),
)


@settings(max_examples=400, deadline=None)
@given(values=st.lists(LOGPROB_LIKE, max_size=40))
def test_floats_are_written_as_json_dumps_writes_them(values: list[float]) -> None:
    """The written floats (orjson's, mended where it writes them apart from
    ``repr``) are the response's ``json.dumps`` of them, byte for byte:
    exponent -5, one-digit exponents, -0.0, subnormals, the largest."""
    from derender_core.vllm_seam import logprobs as raw_logprobs

    values += raw_logprobs._FLOAT_PROBES
    want = json.dumps(values, separators=(",", ":")).encode()
    assert raw_logprobs.floats_json(values) == want
    if raw_logprobs.floats_json is raw_logprobs._orjson_floats:
        event("orjson, mended")
    assert raw_logprobs._float_texts(values) == [repr(value).encode().decode() for value in values]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_corrections_are_vllms(engine: DerenderEngine, data: Any) -> None:
    """A byte or cut piece after drawn sampled ids of every kind, as the
    sampled id and as a candidate: the token `_corrections` gives it,
    with or without a decode (``""`` at the first position, for a
    `settled` id, and for a `trailing` one after an id ending in ASCII),
    is vLLM's own ``_correct_decoded_token``'s."""
    from vllm.renderers.online_derenderer import _correct_decoded_token

    from derender_core.vllm_seam import logprobs as raw_logprobs

    derenderer = engine._serving.online_derenderer
    fragments = derenderer.fragments
    if fragments is None:
        pytest.skip("this tokenizer runs vLLM's own path: there is no fast path to compare")
    pools = _pools(derenderer)
    kinds = st.sampled_from(["ordinary", "ordinary", "special", "byte", "byte", "cut", "oov"])
    element = kinds.flatmap(lambda kind: st.sampled_from(pools[kind]) if pools[kind] else st.nothing())
    # The ids the structural check takes (`logprobs._ID_BOUND`).
    taken = element.filter(lambda token_id: 0 <= token_id < raw_logprobs._ID_BOUND)
    context = data.draw(st.lists(taken, max_size=6), label="context")
    pieces = pools["byte"] + pools["cut"]
    if not pieces:
        pytest.skip("no byte or cut pieces")
    token_id = data.draw(st.sampled_from(pieces), label="token_id")
    ids = [*context, token_id]
    # The piece as the one candidate of the last position, or of every
    # position (candidates in a column: `width` 1).
    every = data.draw(st.booleans(), label="a candidate at every position")
    candidates = [token_id] * len(ids) if every else [token_id]
    ends = list(range(len(ids) + 1)) if every else [0] * len(ids) + [1]
    fragments.learn(ids, candidates, ends)
    if token_id not in fragments.corrected:
        event("not corrected")
        return
    kind = (
        "first" if not context
        else "settled" if token_id in fragments.settled
        else "trailing after ASCII" if token_id in fragments.trailing and context[-1] in fragments.ascii_ended
        else "decoded"
    )  # fmt: skip
    event(kind)
    keys, candidate_keys = raw_logprobs._corrections(fragments, ids, candidates, ends, 1 if every else None)
    tokenizer = derenderer.tokenizer
    for position in range(len(ids)) if every else [len(context)]:
        want = _correct_decoded_token(token_id, ids[:position], tokenizer)
        key = candidate_keys[position if every else 0]
        written = ',"bytes":' + json.dumps(list(want.encode("utf-8")), separators=(",", ":")) + "},"
        assert (fragments.token[key], fragments.inner[key]) == (want, written), (ids, position)
        sampled = ids[position]
        if sampled in fragments.corrected:
            assert fragments.token[keys[position]] == _correct_decoded_token(sampled, ids[:position], tokenizer)
        else:
            assert keys[position] == sampled
