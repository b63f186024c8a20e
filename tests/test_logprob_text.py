"""Logprobs read from a line's text (fast path ``lp_text``,
`derender_core.logprob_text`) against the line's plain loading and vLLM's
validation, and whole job outputs against ``--decode reference``.

Lines are drawn by hypothesis as text, not dumped from dicts, so the
numerals are any JSON writes (exponents, ``-0``, integers where a float
stands, integers past 64 bits, 25 significant digits), with whitespace,
keys in any order, repeated keys, extra and missing fields, values of
other types, two choices with the same logprobs, and text elsewhere in
the line that looks like a logprobs field or like the placeholder.
Claims:

- where `split_body` reads a line, the body it gives, each `LogprobsText`
  loaded, is the plain loading's, value for value and type for type;
- each `LogprobsText`'s lists are what vLLM's ``GenerateLogProbs``
  validates the loaded value to (ids, logprobs with their sign, candidates
  per position);
- a job over such lines writes the bytes ``--decode reference`` writes
  (vLLM's models, the line loaded plainly), strict and ``--lenient``.
"""

from __future__ import annotations

import copy
import io
import math
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from derender_core import DerenderEngine, Endpoint
from derender_core.batch import Job
from derender_core.logprob_text import LogprobsText, materialized, split_body
from derender_core.records import parse_body
from derender_core.writers import JsonlWriter
from tests.helpers import normalized_bytes, requires_fast, run_lines
from tests.test_fast_logprobs import sample  # noqa: F401 - the sample engine and its one-shot bodies

pytestmark = requires_fast("decode", "requests", "logprobs", "lp_text")


def _same(a: Any, b: Any) -> bool:
    """Equal value for value and type for type (``1``, ``1.0`` and ``True``
    apart, ``-0.0`` apart from ``0.0``), keys in the same order."""
    if type(a) is not type(b):
        return False
    if type(a) is dict:
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if type(a) is list:
        return len(a) == len(b) and all(map(_same, a, b))
    if type(a) is float:
        return (a == b and math.copysign(1, a) == math.copysign(1, b)) or (math.isnan(a) and math.isnan(b))
    return bool(a == b)


@st.composite
def numerals(draw: Any, *, integral: bool, odd: bool) -> str:
    """A JSON number as any writer may write it; with `odd`, perhaps
    another value."""
    if odd and draw(st.integers(0, 5)) == 0:
        return draw(st.sampled_from(["1.0", "1e2", "true", '"5"', "null", "[]", "-1E400", '"-1.5"']))
    if integral:
        return draw(
            st.one_of(
                st.integers(0, 160_000).map(str),
                st.integers(0, 160_000).map(str),
                st.sampled_from(["-0", "-3", "151668", str(2**31), str(2**63), str(2**64), str(2**70)]),
            )
        )
    value = draw(st.one_of(st.floats(-40, 0), st.sampled_from([-0.0, -1e-5, -2.5e-7, -1e-300, -5e-324, -1e16])))
    form = draw(st.sampled_from(["repr", "repr", "repr", "exp", "long", "int"]))
    if form == "exp":
        return f"{value:E}".replace("E", draw(st.sampled_from(["e", "E", "e+"])), 1).replace("+-", "-")
    if form == "long":
        return f"{value:.25g}"
    if form == "int":
        return draw(st.sampled_from(["-1", "0", "-0", str(-(2**70)), "-40", str(-(2**53) - 1)]))
    return repr(value)


@st.composite
def candidate_text(draw: Any, *, entry: bool, odd: bool) -> str:
    """One generate logprob object as JSON text."""
    fields = [("token_id", draw(numerals(integral=True, odd=odd))), ("logprob", draw(numerals(integral=False, odd=odd)))]
    if draw(st.booleans()):
        fields.append(("rank", draw(st.sampled_from(["1", "7", "null", str(2**70)] + (["true", "1.5"] if odd else [])))))
    if entry and draw(st.integers(0, 4)) > 0:
        tops = draw(st.lists(candidate_text(entry=False, odd=odd), max_size=draw(st.sampled_from([3, 22]))))
        fields.append(("top_logprobs", "[" + ",".join(tops) + "]"))
    elif entry and odd and draw(st.integers(0, 8)) == 0:
        fields.append(("top_logprobs", "null"))
    change = draw(st.integers(0, 10)) if odd else -1
    if change == 0:
        fields.append((draw(st.sampled_from(["extra", "token", "bytes"])), "1"))
    elif change == 1:
        fields.pop(draw(st.integers(0, 1)))
    if fields and draw(st.integers(0, 10)) == 0:
        fields.insert(0, (fields[-1][0], "0"))  # a repeated key: the last one counts
    order = draw(st.permutations(fields))
    space = draw(st.sampled_from(["", "", " ", "\n  "]))
    return "{" + ",".join(f'{space}"{key}"{space}:{space}{value}' for key, value in order) + space + "}"


@st.composite
def logprobs_text(draw: Any) -> str:
    """A choice's ``logprobs`` value as JSON text: of the usual shape but
    for its numerals, whitespace and key order, unless drawn odd."""
    odd = draw(st.integers(0, 3)) == 0
    shape = draw(st.integers(0, 20)) if odd else 20
    if shape == 0:
        return draw(st.sampled_from(["null", "{}", '{"content":null}', '{"content":[],"x":1}', "[]", '"x"']))
    content = "[" + ",".join(draw(st.lists(candidate_text(entry=True, odd=odd), max_size=6))) + "]"
    if shape == 1:
        return '{"content":[],"content":' + content + "}"
    return '{"content":' + content + "}"


@st.composite
def lines(draw: Any) -> bytes:
    """A line whose choices hold drawn logprobs text, in one of the places
    a one-shot body or a bare generate response holds them."""
    texts = draw(st.lists(logprobs_text(), min_size=1, max_size=3))
    if draw(st.booleans()) and len(texts) > 1:
        texts[1] = texts[0]  # two choices, the same text
    choices = ",".join(
        f'{{"index":{i},"token_ids":[1,2],"logprobs":{text},"finish_reason":"stop"}}' for i, text in enumerate(texts)
    )
    noise = draw(
        st.sampled_from(
            ["", "", r',"note":"\"logprobs\":{\"content\":[]}"', ',"x":{"logprobs":{"content":[]}}', ',"n":"derender:logprobs:0"']
        )
    )
    place = draw(st.sampled_from(["response", "responses", "bare"]))
    if place == "response":
        text = f'{{"chat_request":{{"model":"m"}}{noise},"generate_response":{{"request_id":"r","choices":[{choices}]}}}}'
    elif place == "responses":
        text = f'{{"generate_responses":[{{"choices":[]}},{{"choices":[{choices}]}}]{noise},"completion_request":{{}}}}'
    else:
        text = f'{{"request_id":"r"{noise},"choices":[{choices}]}}'
    return text.encode()


def _texts(body: Any) -> Iterator[LogprobsText]:
    if isinstance(body, dict):
        for value in body.values():
            yield from _texts(value)
    elif isinstance(body, list):
        for value in body:
            yield from _texts(value)
    elif type(body) is LogprobsText:
        yield body


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(line=lines())
def test_a_split_line_is_its_plain_loading(line: bytes) -> None:
    """Where `split_body` reads a line, its body is the plain loading's, and
    each text's lists are what vLLM validates the loaded value to."""
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateLogProbs

    split = split_body(line)
    plain, problem = parse_body(line)
    if split is None:
        event("loaded as before")
        return
    assert problem is None
    assert _same(materialized(split), plain), line
    texts = list(_texts(split))
    event(f"{len(texts)} read from text")
    for text in texts:
        validated = GenerateLogProbs.model_validate(text.loaded())
        content = validated.content or []
        assert text.ids == [entry.token_id for entry in content]
        assert _same(text.logprobs, [entry.logprob for entry in content])
        assert text.counts == [len(entry.top_logprobs) for entry in content]
        candidates = [top for entry in content for top in entry.top_logprobs]
        assert text.candidate_ids == [top.token_id for top in candidates]
        assert _same(text.candidate_logprobs, [top.logprob for top in candidates])


@pytest.mark.parametrize(
    "numeral",
    ["-0.1000000000000000055511151231257827", "-1E-5", "-2.5e-07", "-0", "-0.0", "-5e-324", "-1e16", "-1",
     str(-(2**53) - 1), str(-(2**70)), "-1.7976931348623157e308", "-0.30000000000000004441"],
)  # fmt: skip
def test_numerals_read_from_text_are_the_plain_loadings(numeral: str) -> None:
    """Logprobs written as JSON allows, read from the text: the float the
    plain loading (Python's json where a digit run needs it) and vLLM's
    validation make of them."""
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateLogProbs

    value = b'{"content":[{"token_id":5,"logprob":%s,"top_logprobs":[{"token_id":6,"logprob":%s}]}]}' % (
        numeral.encode(), numeral.encode())  # fmt: skip
    line = b'{"generate_response":{"choices":[{"index":0,"logprobs":%s}]}}' % value
    split = split_body(line)
    assert split is not None
    (text,) = _texts(split)
    assert _same(materialized(split), parse_body(line)[0])
    validated = GenerateLogProbs.model_validate(parse_body(value)[0])
    assert validated.content is not None
    want = validated.content[0].logprob
    assert _same(text.logprobs, [want]) and _same(text.candidate_logprobs, [want])


def test_what_is_not_read_from_text() -> None:
    """Lines loaded as before: no logprobs object, a placeholder's text in
    the line, a digit run orjson would round, not JSON, a skeleton of other
    types, not JSON at all, nesting deeper than msgspec reads."""
    usual = b'{"content":[{"token_id":1,"logprob":-0.5}]}'
    body = b'{"generate_response":{"choices":[{"index":0,"logprobs":%s}]}%s}'
    assert split_body(body % (usual, b"")) is not None
    for line in (
        body % (b"null", b""),
        body % (usual, b',"x":"derender:logprobs:7"'),
        body % (usual, b',"prompt_token_ids":[1234567890123456789012]'),
        body % (usual, b",}"),
        b'{"generate_response":{"choices":{"0":{"logprobs":%s}}}}' % usual,
        b'"a string"',
        body % (usual, b',"deep":' + b"[" * 5000 + b"]" * 5000),
    ):
        assert split_body(line) is None, line
    # Deeper than msgspec reads inside the value: the value alone is loaded
    # as the line would be (Python 3.11's parser refuses it, 3.13's reads it).
    deep = body % (b'{"content":[{"token_id":1,"logprob":-0.5,"x":%s}]}' % (b"[" * 5000 + b"]" * 5000), b"")
    split, (plain, problem) = split_body(deep), parse_body(deep)
    assert (split is None) is (problem is not None)
    if split is not None:
        assert type(split["generate_response"]["choices"][0]["logprobs"]) is dict
        assert split.keys() == plain.keys()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_jobs_over_logprobs_text_write_the_reference_bytes(sample: Any, data: Any) -> None:  # noqa: F811
    """A job over sample records whose choices carry drawn logprobs text
    writes what ``--decode reference`` writes, strict and ``--lenient``."""
    engine, bodies = sample
    endpoint, base = data.draw(st.sampled_from(bodies), label="base body")
    body = copy.deepcopy(base)
    responses = [body["generate_response"]] if endpoint is Endpoint.CHAT else body["generate_responses"]
    texts: dict[bytes, bytes] = {}
    for r, response in enumerate(responses):
        for c, choice in enumerate(response["choices"]):
            if data.draw(st.integers(0, 3), label="logprobs on the choice") > 0:
                texts[f'"@{r}:{c}@"'.encode()] = data.draw(logprobs_text(), label="logprobs").encode()
                choice["logprobs"] = f"@{r}:{c}@"
    request = body[endpoint.request_key]
    if endpoint is Endpoint.CHAT:
        request["logprobs"] = True
        request["top_logprobs"] = data.draw(st.sampled_from([0, 1, 5, 20, None]), label="top_logprobs")
    else:
        request["logprobs"] = data.draw(st.sampled_from([0, 1, 5, 19]), label="logprobs")
    line = orjson.dumps(body)
    for mark, text in texts.items():
        line = line.replace(mark, text)
    event("read from text" if split_body(line) is not None and list(_texts(split_body(line))) else "loaded")
    job = Job(endpoint, stream=False, lenient=data.draw(st.booleans(), label="lenient"))
    assert _job_bytes(engine.in_mode(live=True), job, line) == _job_bytes(
        engine.in_mode(live=True, decode="reference"), job, line
    ), line


def _job_bytes(engine: DerenderEngine, job: Job, line: bytes) -> tuple[bytes, int]:
    """A job's JSONL output over one line (`created` and tool-call ids
    blanked), and its exit code."""
    out = io.BytesIO()
    report = run_lines(engine, job, [line], JsonlWriter(out))
    return normalized_bytes(out.getvalue()), report.return_code


@pytest.mark.parametrize("lp_text", [True, False])
def test_a_job_hands_the_writer_the_logprobs_read_from_text(
    sample: Any,  # noqa: F811
    lp_text: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A job over a record with usual logprobs hands the writer the lists
    read from the line's text; with ``off:lp_text``, the loaded dicts. The
    output is the same."""
    from derender_core.vllm_seam import logprobs as raw_logprobs
    from derender_core.vllm_seam.versions import OFF_ENV
    from tests.sample_inputs import logprobs_for

    engine, bodies = sample
    body = copy.deepcopy(next(body for endpoint, body in bodies if endpoint is Endpoint.CHAT))
    choice = body["generate_response"]["choices"][0]
    choice["logprobs"] = logprobs_for(choice["token_ids"], top=6)
    body["chat_request"].update(logprobs=True, top_logprobs=5)
    if not lp_text:
        monkeypatch.setenv(OFF_ENV, "off:lp_text")
    sources: list[type] = []
    write = raw_logprobs.chat_json

    def spy(fragments: Any, usual: Any, top_limit: Any) -> Any:
        sources.append(type(usual.source))
        return write(fragments, usual, top_limit)

    monkeypatch.setattr(raw_logprobs, "chat_json", spy)
    got = _job_bytes(engine.in_mode(live=True), Job(Endpoint.CHAT, stream=False), orjson.dumps(body))
    assert sources == [LogprobsText if lp_text else list]
    monkeypatch.undo()
    assert got == _job_bytes(engine.in_mode(live=True, decode="reference"), Job(Endpoint.CHAT, stream=False), orjson.dumps(body))
