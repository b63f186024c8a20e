"""Our own pre-call checks (`derender_core.checks`), on bodies built here.

The checks are pure, so these run without vLLM; what the server answers
for the same bodies with `--lenient` is checked against the real server in
test_hardening.py.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from derender_core import Endpoint
from derender_core.checks import check_body
from derender_core.protocol import DERENDER_ENDPOINTS

VOCAB = 1000


def chat(**fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "generate_response": {
            "request_id": "r",
            "choices": [
                {
                    "index": 0,
                    "token_ids": [1, 2, 999],
                    "logprobs": {
                        "content": [
                            {"token_id": 1, "logprob": -0.1, "top_logprobs": [{"token_id": 1, "logprob": -0.1}, {"token_id": 7, "logprob": -2.0}]}
                        ]
                    },
                }
            ],
            "prompt_token_ids": [5, 6],
        },
        "prompt_tokens": 2,
        "prompt_token_ids": [5, 6],
        "chat_request": {"messages": []},
    }
    body.update(fields)
    return body


def chat_n2(**fields: Any) -> dict[str, Any]:
    body = chat(**fields)
    body["chat_request"]["n"] = 2
    first = body["generate_response"]["choices"][0]
    body["generate_response"]["choices"].append({**copy.deepcopy(first), "index": 1})
    return body


def completion(**fields: Any) -> dict[str, Any]:
    response = {"request_id": "p", "choices": [{"index": 0, "token_ids": [3]}, {"index": 1, "token_ids": [4]}]}
    body: dict[str, Any] = {
        "generate_responses": [response, copy.deepcopy(response)],
        "prompt_tokens": [1, 1],
        "prompt_token_ids": [[8], [9]],
        "completion_request": {"prompt": ["a", "b"], "n": 2},
    }
    body.update(fields)
    return body


def chunk_body(**fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "stream": True,
        "generate_chunk": {"request_id": "s", "choices": [{"index": 0, "token_ids": [10, 11]}]},
        "prompt_token_ids": [5],
        "prompt_tokens": 1,
        "chat_request": {"messages": [], "stream": True},
    }
    body.update(fields)
    return body


def changed(body: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """`body` with the value at a dotted path (list indices as numbers) replaced."""
    body = copy.deepcopy(body)
    *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
    target: Any = body
    for key in parents:
        target = target[key]
    target[last] = value
    return body


@pytest.mark.parametrize(
    ("body", "endpoint", "stream"),
    [(chat(), Endpoint.CHAT, False), (chat_n2(), Endpoint.CHAT, False), (completion(), Endpoint.COMPLETION, False),
     (chunk_body(), Endpoint.CHAT, True), (chunk_body(generate_chunk={"request_id": "s", "choices": [], "usage": {}}), Endpoint.CHAT, True)],
)  # fmt: skip
def test_good_bodies_pass(body: dict[str, Any], endpoint: Endpoint, stream: bool) -> None:
    assert check_body(body, endpoint, stream=stream, vocab_size=VOCAB) is None


GR = "generate_response"
CHOICE = f"{GR}.choices.0"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (changed(chat(), f"{CHOICE}.token_ids.2", 1000), f"{GR}.choices[0].token_ids[2]: token id 1000 is out of vocabulary (size 1000)"),
        (changed(chat(), f"{CHOICE}.token_ids.1", 2**80), f"{GR}.choices[0].token_ids[1]: token id {2**80} is out of vocabulary"),
        (changed(chat(), f"{CHOICE}.token_ids.0", True), f"{GR}.choices[0].token_ids[0]: true is a boolean, not a token id (the server would read it as 1)"),
        (changed(chat(), f"{CHOICE}.token_ids.0", False), "false is a boolean, not a token id (the server would read it as 0)"),
        (changed(chat(), f"{CHOICE}.token_ids.0", "12"), '"12" is a string, not a token id (the server would read it as 12)'),
        (changed(chat(), f"{CHOICE}.token_ids.0", 12.0), "12.0 is a float, not a token id"),
        (changed(chat(), f"{CHOICE}.logprobs.content.0.token_id", 1234), f"{GR}.choices[0].logprobs.content[0].token_id: token id 1234 is out of vocabulary"),
        (changed(chat(), f"{CHOICE}.logprobs.content.0.top_logprobs.1.token_id", 5000), f"{GR}.choices[0].logprobs.content[0].top_logprobs[1].token_id: token id 5000 is out of vocabulary"),
        (changed(chat(), f"{CHOICE}.logprobs.content.0.top_logprobs.1.token_id", -3), "top_logprobs[1].token_id: token id -3 is negative"),
        (changed(chat(), "prompt_token_ids.1", 1000), "prompt_token_ids[1]: token id 1000 is out of vocabulary"),
        (changed(chat(), f"{GR}.prompt_token_ids.0", 1001), f"{GR}.prompt_token_ids[0]: token id 1001 is out of vocabulary"),
        (changed(chat(), "prompt_tokens", -1), "prompt_tokens: -1 is negative"),
        (changed(chat(), "prompt_tokens", True), "prompt_tokens: true is a boolean, not a count"),
        (changed(chat(), f"{CHOICE}.index", 1), f"{GR}.choices[0].index: 1 is outside 0..0 (chat_request.n is 1)"),
        (changed(chat(), f"{CHOICE}.index", True), f"{GR}.choices[0].index: true is a boolean, not an integer"),
        (changed(chat_n2(), f"{GR}.choices.1.index", 0), f"{GR}.choices[1].index: 0 repeats {GR}.choices[0].index"),
        (changed(chat_n2(), f"{GR}.choices", chat_n2()[GR]["choices"][:1]), f"{GR}.choices: no choice with index 1 (chat_request.n is 2, 1 choice given)"),
        (changed(chat_n2(), f"{GR}.choices.1.index", 2), f"{GR}.choices[1].index: 2 is outside 0..1 (chat_request.n is 2)"),
        (changed(changed(chat_n2(), "chat_request", None), f"{GR}.choices.1.index", 5), f"{GR}.choices[1].index: 5 is outside 0..1 (2 choices)"),
        (chat(generate_chunk={"request_id": "r", "choices": []}), "generate_chunk: the body also holds generate_response"),
    ],
)  # fmt: skip
def test_chat_problems_name_the_field(body: dict[str, Any], message: str) -> None:
    found = check_body(body, Endpoint.CHAT, stream=False, vocab_size=VOCAB)
    assert found is not None and message in found


def plain(body: dict[str, Any]) -> dict[str, Any]:
    """`body` without logprobs: the usual one-shot body, checked in one pass."""
    body = copy.deepcopy(body)
    for choice in body[GR]["choices"]:
        del choice["logprobs"]
    return body


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (changed(plain(chat()), f"{CHOICE}.token_ids.2", 1000), f"{GR}.choices[0].token_ids[2]: token id 1000 is out of vocabulary (size 1000)"),
        (changed(plain(chat()), f"{CHOICE}.token_ids", [7]), None),
        (changed(plain(chat()), f"{CHOICE}.index", 1), f"{GR}.choices[0].index: 1 is outside 0..0 (chat_request.n is 1)"),
        (changed(plain(chat_n2()), f"{GR}.choices.1.index", 0), f"{GR}.choices[1].index: 0 repeats {GR}.choices[0].index"),
        (changed(plain(chat_n2()), f"{GR}.choices", plain(chat_n2())[GR]["choices"][:1]), f"{GR}.choices: no choice with index 1 (chat_request.n is 2, 1 choice given)"),
        (changed(changed(plain(chat_n2()), "chat_request", None), f"{GR}.choices.1.index", 5), f"{GR}.choices[1].index: 5 is outside 0..1 (2 choices)"),
        (changed(plain(chat()), "prompt_token_ids.1", 1000), "prompt_token_ids[1]: token id 1000 is out of vocabulary"),
        (changed(plain(chat()), "prompt_tokens", -1), "prompt_tokens: -1 is negative"),
        (changed(plain(chat()), f"{GR}.prompt_token_ids.0", 1001), f"{GR}.prompt_token_ids[0]: token id 1001 is out of vocabulary"),
        (plain(chat_n2()), None),
    ],
)  # fmt: skip
def test_the_usual_chat_body_gets_the_full_walks_verdict(body: dict[str, Any], message: str | None) -> None:
    """The usual body (no logprobs) is checked in one pass: good ones pass,
    and each problem is named as the full walk names it."""
    from derender_core.checks import PassedPrompts

    for passed in (None, PassedPrompts()):
        found = check_body(body, Endpoint.CHAT, stream=False, vocab_size=VOCAB, passed=passed)
        assert found is None if message is None else (found is not None and message in found)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (changed(completion(), "generate_responses.1.choices.1.token_ids.0", 1000), "generate_responses[1].choices[1].token_ids[0]: token id 1000 is out of vocabulary"),
        (changed(changed(completion(), "generate_responses.0.choices.0.index", 1), "generate_responses.0.choices.1.index", 0),
         "generate_responses[0].choices[0].index: 1 at position 0; completion choices are numbered by position"),
        (changed(completion(), "prompt_token_ids.1.0", 4000), "prompt_token_ids[1][0]: token id 4000 is out of vocabulary"),
        (changed(completion(), "prompt_tokens.1", -2), "prompt_tokens[1]: -2 is negative"),
        (changed(completion(), "generate_responses.0.choices", [{"index": 0, "token_ids": [3]}]), "generate_responses[0].choices: no choice with index 1 (completion_request.n is 2"),
    ],
)  # fmt: skip
def test_completion_problems_name_the_field(body: dict[str, Any], message: str) -> None:
    found = check_body(body, Endpoint.COMPLETION, stream=False, vocab_size=VOCAB)
    assert found is not None and message in found


CHUNK = "generate_chunk.choices.0"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (changed(chunk_body(), f"{CHUNK}.token_ids.1", -1), "generate_chunk.choices[0].token_ids[1]: token id -1 is negative"),
        (changed(chunk_body(), f"{CHUNK}.token_ids.0", 1000), "generate_chunk.choices[0].token_ids[0]: token id 1000 is out of vocabulary"),
        (changed(chunk_body(), f"{CHUNK}.token_ids.0", True), "generate_chunk.choices[0].token_ids[0]: true is a boolean"),
        # The usual chunk: one id.
        (changed(chunk_body(), f"{CHUNK}.token_ids", [-1]), "generate_chunk.choices[0].token_ids[0]: token id -1 is negative"),
        (changed(chunk_body(), f"{CHUNK}.token_ids", [1000]), "generate_chunk.choices[0].token_ids[0]: token id 1000 is out of vocabulary"),
        (changed(chunk_body(), f"{CHUNK}.token_ids", [2.0]), "generate_chunk.choices[0].token_ids[0]: 2.0 is a float"),
        (changed(chunk_body(), f"{CHUNK}.index", 1), "generate_chunk.choices[0].index: 1 is outside 0..0 (chat_request.n is 1)"),
        (changed(chunk_body(), "generate_chunk.prompt_token_ids", [1000]), "generate_chunk.prompt_token_ids[0]: token id 1000 is out of vocabulary"),
        (chunk_body(stream_state={"output_token_ids": [3, 1000], "output_chunk_lens": [2]}), "stream_state.output_token_ids[1]: token id 1000 is out of vocabulary"),
        (changed(chunk_body(), "prompt_tokens", -7), "prompt_tokens: -7 is negative"),
        (changed(chunk_body(), "stream", False), "stream: false, so this is a one-shot call"),
        ({k: v for k, v in chat().items()}, "stream: not set, so this is a one-shot call"),
    ],
)  # fmt: skip
def test_stream_problems_name_the_field(body: dict[str, Any], message: str) -> None:
    found = check_body(body, Endpoint.CHAT, stream=True, vocab_size=VOCAB)
    assert found is not None and message in found


@pytest.mark.parametrize(
    "body",
    [
        changed(chat(), f"{CHOICE}.token_ids.0", -1),  # vLLM: "token_ids must not contain negative values"
        changed(chat(), f"{CHOICE}.token_ids.0", "abc"),
        changed(chat(), f"{CHOICE}.token_ids.0", 1.5),
        changed(chat(), f"{CHOICE}.token_ids", None),
        changed(chat(), "prompt_token_ids.0", -4),
        changed(chat(), f"{CHOICE}.index", "first"),
        changed(chat(), GR, "not a response"),
    ],
)
def test_what_vllm_rejects_is_left_for_vllm_to_word(body: dict[str, Any]) -> None:
    assert check_body(body, Endpoint.CHAT, stream=False, vocab_size=VOCAB) is None


def test_a_chunk_with_two_choices_is_left_for_vllm_to_word() -> None:
    """vLLM refuses more than one choice per stream chunk ("expects at most
    one choice per chunk"), whatever the choices hold."""
    body = chunk_body()
    body["generate_chunk"]["choices"].append({"index": 5, "token_ids": [VOCAB, -1]})
    assert check_body(body, Endpoint.CHAT, stream=True, vocab_size=VOCAB) is None


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(
        ["index", "token_ids", "choices", "generate_response", "generate_responses", "generate_chunk", "logprobs",
         "content", "top_logprobs", "token_id", "prompt_token_ids", "prompt_tokens", "n", "chat_request",
         "completion_request", "stream", "stream_state", "output_token_ids"]) | st.text(max_size=3), inner, max_size=5),
    max_leaves=25,
)  # fmt: skip


@given(json_values, st.sampled_from(list(DERENDER_ENDPOINTS)), st.booleans())
@settings(max_examples=300)
def test_any_body_gets_an_answer_not_an_exception(body: Any, endpoint: Endpoint, stream: bool) -> None:
    found = check_body(body, endpoint, stream=stream, vocab_size=VOCAB)
    assert found is None or (isinstance(found, str) and ": " in found)


@given(
    n=st.integers(1, 4),
    ids=st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6), min_size=4, max_size=4),
    order=st.permutations(range(4)),
)
def test_well_formed_chat_responses_pass_in_any_choice_order(n: int, ids: list[list[int]], order: list[int]) -> None:
    choices = [{"index": i, "token_ids": ids[i]} for i in order if i < n]
    body = {"generate_response": {"choices": choices}, "chat_request": {"n": n}, "prompt_token_ids": ids[0]}
    assert check_body(body, Endpoint.CHAT, stream=False, vocab_size=VOCAB) is None


odd_values = st.sampled_from([None, True, False, -3, -1, 0, 1, VOCAB - 1, VOCAB, VOCAB + 2, 1.0, 2.5, "7", "x", [], {}]) | (
    st.integers() | st.floats(allow_nan=False) | st.text(max_size=2)
)  # fmt: skip
odd_ids = st.lists(odd_values, min_size=1, max_size=3) | odd_values
good_ids = st.lists(st.integers(0, VOCAB - 1), max_size=3)
CHUNK_FIELDS: dict[str, tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]] = {
    # field: (its usual values, anything else)
    "index": (st.integers(0, 1), odd_values),
    "token_ids": (good_ids, odd_ids),
    "logprobs": (st.none(), st.just({"content": [{"token_id": VOCAB, "logprob": -1.0}]}) | st.just({"content": [{"token_id": 3, "logprob": -1.0}]})),
    "chunk_prompt": (st.none(), odd_ids),
    "prompt": (good_ids, odd_ids),
    "prompt_tokens": (st.integers(0, 9), odd_values),
    "n": (st.integers(1, 2), odd_values),
    "state": (st.none(), st.just({"output_token_ids": [VOCAB]}) | st.just({"output_token_ids": [2]}) | st.just([1])),
    "choices": (st.just(1), st.integers(0, 2)),
}  # fmt: skip


@st.composite
def chunk_fields(draw: st.DrawFn) -> dict[str, Any]:
    """A stream body's fields, usual but for up to two (so a body is often
    the usual chunk with one thing off)."""
    odd = draw(st.sets(st.sampled_from(sorted(CHUNK_FIELDS)), min_size=1, max_size=2) | st.just(set()))
    return {name: draw(strategies[name in odd]) for name, strategies in CHUNK_FIELDS.items()}


@given(fields=chunk_fields(), repeat=st.booleans())
@settings(max_examples=400)
def test_the_usual_chunks_pass_says_what_the_full_walk_says(fields: dict[str, Any], repeat: bool) -> None:
    """A stream's every chunk is checked in one pass (`usual_stream_call`)
    where it can tell; its verdict, and the problem it names, are the full
    walk's for any body, with the passed prompts remembered or not."""
    from derender_core.checks import PassedPrompts

    choice = {"index": fields["index"], "token_ids": fields["token_ids"], "logprobs": fields["logprobs"]}
    body = chunk_body(
        generate_chunk={"request_id": "s", "choices": [copy.deepcopy(choice) for _ in range(fields["choices"])], "prompt_token_ids": fields["chunk_prompt"]},
        prompt_token_ids=fields["prompt"], prompt_tokens=fields["prompt_tokens"], chat_request={"messages": [], "n": fields["n"]},
        stream_state=fields["state"],
    )  # fmt: skip
    one_pass, walked = PassedPrompts(), PassedPrompts()
    found = [check_body(body, Endpoint.CHAT, stream=True, vocab_size=VOCAB, passed=one_pass) for _ in range(1 + repeat)]
    assert found == [full_walk(body, Endpoint.CHAT, True, walked) for _ in range(1 + repeat)]


def test_the_usual_chunk_is_checked_in_one_pass() -> None:
    """The one pass answers the usual chunk itself (the full walk is not
    needed), and finds what the full walk would in its prompt ids."""
    from derender_core.checks import _Checker

    checker = _Checker(VOCAB)
    assert checker.usual_stream_call(chunk_body(), 1) is True
    assert checker.usual_stream_call(changed(chunk_body(), f"{CHUNK}.token_ids.0", VOCAB), 1) is False
    with pytest.raises(Exception, match=r"prompt_token_ids\[0\]: token id 1000 is out of vocabulary"):
        checker.usual_stream_call(chunk_body(prompt_token_ids=[VOCAB]), 1)


CHAT_FIELDS: dict[str, tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]] = {
    # field: (its usual values, anything else)
    "n": (st.integers(1, 3), odd_values),
    "indices": (
        st.just("in order"),
        st.lists(st.integers(-1, 3), min_size=1, max_size=3, unique=True) | st.lists(st.integers(0, 2), max_size=4)
        | st.lists(odd_values, max_size=4),
    ),
    "token_ids": (good_ids, odd_ids),
    "logprobs": (st.none(), st.just({"content": [{"token_id": VOCAB, "logprob": -1.0}]}) | st.just({"content": [{"token_id": 3, "logprob": -1.0}]})),
    "response_prompt": (st.none(), odd_ids),
    "prompt": (good_ids, odd_ids),
    "prompt_tokens": (st.integers(0, 9), odd_values),
    "request": (st.just(True), st.booleans()),
}  # fmt: skip


@st.composite
def chat_fields(draw: st.DrawFn) -> dict[str, Any]:
    """A one-shot chat body's fields, usual but for up to two."""
    odd = draw(st.sets(st.sampled_from(sorted(CHAT_FIELDS)), min_size=1, max_size=2) | st.just(set()))
    return {name: draw(strategies[name in odd]) for name, strategies in CHAT_FIELDS.items()}


def full_walk(body: Any, endpoint: Endpoint, stream: bool, passed: Any) -> str | None:
    """`check_body` with neither one-pass check: the full walk alone."""
    from derender_core.checks import _Checker

    usual = _Checker.usual_stream_call, _Checker.usual_chat_call
    _Checker.usual_stream_call = _Checker.usual_chat_call = lambda self, body, n: False  # type: ignore[method-assign]
    try:
        return check_body(body, endpoint, stream=stream, vocab_size=VOCAB, passed=passed)
    finally:
        _Checker.usual_stream_call, _Checker.usual_chat_call = usual  # type: ignore[method-assign]


@given(fields=chat_fields(), repeat=st.booleans())
@settings(max_examples=400)
def test_the_usual_chat_calls_pass_says_what_the_full_walk_says(fields: dict[str, Any], repeat: bool) -> None:
    """A one-shot chat body is checked in one pass (`usual_chat_call`)
    where it can tell; its verdict, and the problem it names, are the full
    walk's for any body, with the passed prompts remembered or not."""
    from derender_core.checks import PassedPrompts

    n = fields["n"]
    indices = fields["indices"] if fields["indices"] != "in order" else list(range(n if type(n) is int and 0 < n < 5 else 1))
    choices = [{"index": index, "token_ids": fields["token_ids"], "logprobs": fields["logprobs"]} for index in indices]
    body = chat(
        generate_response={"request_id": "r", "choices": copy.deepcopy(choices), "prompt_token_ids": fields["response_prompt"]},
        prompt_token_ids=fields["prompt"], prompt_tokens=fields["prompt_tokens"],
    )  # fmt: skip
    if fields["request"]:
        body["chat_request"]["n"] = n
    else:
        del body["chat_request"]
    one_pass, walked = PassedPrompts(), PassedPrompts()
    found = [check_body(body, Endpoint.CHAT, stream=False, vocab_size=VOCAB, passed=one_pass) for _ in range(1 + repeat)]
    assert found == [full_walk(body, Endpoint.CHAT, False, walked) for _ in range(1 + repeat)]
