"""Differential checks of the fast decode against vLLM's own functions.

Each check takes an engine (any family's) and hypothesis' ``data``, draws an
input from the family's real tokenizer, and compares derender's fast path
(`derender_core.vllm_seam.fast`) with vLLM's per-token path on the same
derenderer switched to ``decode_mode = "reference"`` (every override then
hands over to ``OnlineDerenderer``'s own code):

- `check_decode_output`: ``_decode_output`` (stop-token drop, ``min_tokens``,
  stop strings in and across tokens, with and without
  ``include_stop_str_in_output``, the seed window from 0 to 10 prompt ids,
  both ``skip_special_tokens`` settings, a character cut at the end,
  out-of-vocabulary ids);
- `check_detokenize_delta`: ``_detokenize_delta`` over any chunking, text and
  every state (the window, offsets), from a seed or from any state a caller
  may send (special and out-of-vocabulary ids in the window, any offsets);
- `check_logprobs`: ``_resolve_logprobs`` as chat and as completion
  logprobs, byte-fallback pieces and their correction included, and (vLLM
  0.34) tokens written as ids, against the models' own JSON.

Engine-level checks (the assembled response, live chunks and states) run on
whole bodies in the family tests.
"""

from __future__ import annotations

import contextlib
import functools
import json
import weakref
from collections.abc import Iterator
from typing import Any

from hypothesis import strategies as st

# Text a model writes: ASCII, code indentation, CJK, emoji and math letters
# spelled in several byte-level pieces, accents, SentencePiece's spaces.
SAMPLE_TEXT = (
    "Hello world!  def f(x):\n    return x**2\n\tTabs and  double  spaces. "
    "北京多云，气温 12°C。 Weather: 🌦️ 🌪 ☂ — 𝟏𝟐 ünïcödé café naïve "
    "<think>not a tag</think> {\"city\": \"Paris\"} 1,234.5 e=mc² ½ ¾ "
)


@contextlib.contextmanager
def decoding(derenderer: Any, mode: str) -> Iterator[None]:
    before = derenderer.decode_mode
    derenderer.decode_mode = mode
    try:
        yield
    finally:
        derenderer.decode_mode = before


_POOLS: weakref.WeakKeyDictionary[Any, dict[str, list[int]]] = weakref.WeakKeyDictionary()
"""Per derenderer, held weakly: a finished family's tokenizer is freed."""


def _pools(derenderer: Any) -> dict[str, list[int]]:
    """Id pools for one tokenizer: ordinary pieces, special and added ones,
    byte pieces (alone, a byte-level or byte-fallback piece is part of a
    character), the prefix of a character spelled in several pieces, and ids
    out of the vocabulary."""
    known = _POOLS.get(derenderer)
    if known is None:
        known = _POOLS[derenderer] = _id_pools(derenderer.tokenizer)
    return known


def _id_pools(tokenizer: Any) -> dict[str, list[int]]:
    size = len(tokenizer)
    ordinary = list(dict.fromkeys(tokenizer.encode(SAMPLE_TEXT, add_special_tokens=False)))
    special = sorted(set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values()))
    special = [i for i in special if 0 <= i < size]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    byte_pieces: list[int] = []
    if backend is not None:
        for byte in range(0x80, 0x100):
            for piece in (_BYTE_LEVEL[byte], f"<0x{byte:02X}>"):
                token_id = backend.token_to_id(piece)
                if token_id is not None:
                    byte_pieces.append(token_id)
    cut: list[int] = []
    for char in "🌦𝟏北ü":
        ids = tokenizer.encode(char, add_special_tokens=False)
        if len(ids) > 1:
            cut.append(ids[0])
    out_of_vocabulary = [size, size + 1, size + 1000, -1]
    return {
        "ordinary": ordinary,
        "special": special or ordinary,
        "byte": byte_pieces or ordinary,
        "cut": cut or ordinary,
        "oov": out_of_vocabulary,
    }


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: the piece that spells one byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars, strict=True)}


_BYTE_LEVEL = _bytes_to_unicode()


def token_ids(data: Any, derenderer: Any, *, oov: bool = True, max_size: int = 40) -> list[int]:
    pools = _pools(derenderer)
    kinds = ["ordinary", "ordinary", "ordinary", "special", "byte", "cut"] + (["oov"] if oov else [])
    element = st.sampled_from(kinds).flatmap(lambda kind: st.sampled_from(pools[kind]))
    ids = data.draw(st.lists(element, max_size=max_size), label="token_ids")
    if data.draw(st.booleans(), label="end mid-character"):
        ids.append(data.draw(st.sampled_from(pools["cut"] + pools["byte"])))
    return ids


def prompt_ids(data: Any, derenderer: Any) -> list[int] | None:
    ordinary = _pools(derenderer)["ordinary"] + _pools(derenderer)["special"]
    return data.draw(
        st.none() | st.lists(st.sampled_from(ordinary), max_size=10) | st.lists(st.sampled_from(_pools(derenderer)["byte"]), max_size=3),
        label="prompt_token_ids",
    )


def _request(endpoint_kind: str, fields: dict[str, Any]) -> Any:
    if endpoint_kind == "chat":
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    return CompletionRequest.model_validate({"model": "m", "prompt": "hi", **fields})


def check_decode_output(engine: Any, data: Any) -> None:
    """``_decode_output``: the fast text and stop_reason are vLLM's."""
    from vllm.renderers.online_derenderer import _decode_params, _seed_stream_state

    derenderer = engine._serving.online_derenderer
    tokenizer = derenderer.tokenizer
    ids = token_ids(data, derenderer)
    eos = derenderer._eos_token_id
    if eos is not None and data.draw(st.booleans(), label="ends in EOS"):
        ids.append(eos)
    if not ids:
        ids = [_pools(derenderer)["ordinary"][0]]
    with decoding(derenderer, "reference"):
        plain_text, _ = derenderer._decode_output(
            tokenizer, ids, None, None, None, _seed_stream_state(tokenizer, None, True), True, True
        )
    # Stop strings from the text itself: within a piece and across pieces.
    stops: list[str] = []
    if plain_text and data.draw(st.booleans(), label="stop strings"):
        for _ in range(data.draw(st.integers(1, 2))):
            start = data.draw(st.integers(0, len(plain_text) - 1))
            stops.append(plain_text[start : start + data.draw(st.integers(1, 6))])
    fields: dict[str, Any] = {
        "min_tokens": data.draw(st.integers(0, len(ids) + 1), label="min_tokens"),
        "include_stop_str_in_output": data.draw(st.booleans()),
        "skip_special_tokens": data.draw(st.booleans()),
        "spaces_between_special_tokens": data.draw(st.booleans()),
        "ignore_eos": data.draw(st.booleans()),
    }
    if stops:
        fields["stop"] = stops
    if data.draw(st.booleans()):
        fields["stop_token_ids"] = data.draw(st.lists(st.sampled_from(ids), max_size=2))
    endpoint_kind = data.draw(st.sampled_from(["chat", "completion"]))
    request = data.draw(st.sampled_from([_request(endpoint_kind, fields), None]), label="request")
    preserve = data.draw(st.booleans(), label="a parser keeps special tokens")
    finish = data.draw(st.sampled_from(["stop", "length", None]))
    stop_reason = data.draw(st.sampled_from([None, None, ids[-1], stops[0] if stops else "zz"]))
    skip, spaces = _decode_params(tokenizer, request, preserve_special=preserve)
    prompt = prompt_ids(data, derenderer)
    seed = _seed_stream_state(tokenizer, prompt, skip_special_tokens=skip)
    # The table's remembered seed is vLLM's, for this prompt and for any
    # prompt that ends alike (which finds the state remembered for this one).
    table = derenderer.table
    assert table.seed_state(prompt, skip).model_dump() == seed.model_dump(), prompt
    longer = data.draw(st.lists(st.sampled_from(_pools(derenderer)["ordinary"]), max_size=4), label="other head") + (prompt or [])
    assert (
        table.seed_state(longer, skip).model_dump() == _seed_stream_state(tokenizer, longer, skip_special_tokens=skip).model_dump()
    ), longer
    args: tuple[Any, ...] = (tokenizer, ids, finish, stop_reason, request, seed, skip, spaces)
    with decoding(derenderer, "reference"):
        expected = outcome(lambda: derenderer._decode_output(*args))
    with decoding(derenderer, "fast"):
        got = outcome(lambda: derenderer._decode_output(*args))
    assert got == expected, (ids, prompt, fields, finish, stop_reason)


def check_detokenize_delta(engine: Any, data: Any) -> None:
    """``_detokenize_delta`` over a drawn chunking: every text and state."""
    from vllm.renderers.online_derenderer import _seed_stream_state

    derenderer = engine._serving.online_derenderer
    tokenizer = derenderer.tokenizer
    ids = token_ids(data, derenderer)
    skip = data.draw(st.booleans(), label="skip_special_tokens")
    if data.draw(st.booleans(), label="a caller's state"):
        start_state = _sent_state(data, derenderer)
    else:
        start_state = _seed_stream_state(tokenizer, prompt_ids(data, derenderer), skip_special_tokens=skip)
    states = {mode: start_state for mode in ("fast", "reference")}
    start = 0
    while start < len(ids) or start == 0:
        size = data.draw(st.integers(1, 4), label="chunk")
        chunk = ids[start : start + size]
        start += size
        answers = {}
        for mode in ("fast", "reference"):
            with decoding(derenderer, mode):
                answers[mode] = outcome(
                    functools.partial(derenderer._detokenize_delta, tokenizer, chunk, states[mode], skip, True)
                )
        assert _dumped(answers["fast"]) == _dumped(answers["reference"]), (ids, start_state, start)
        if answers["fast"][0] == "raised":
            break
        states = {mode: answers[mode][1][1] for mode in states}
        if start >= len(ids):
            break


def _sent_state(data: Any, derenderer: Any) -> Any:
    """A stream state as a caller may send it: the window's ids (0.34) or
    their pieces (0.33) drawn from every pool, any offsets."""
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import DerenderStreamState

    from derender_core.vllm_seam.fast import WINDOW_IDS

    pools = _pools(derenderer)
    element = st.sampled_from(["ordinary", "special", "byte", "cut", "oov"]).flatmap(
        lambda kind: st.sampled_from([i for i in pools[kind] if i >= 0] or pools["ordinary"])
    )
    window = data.draw(st.lists(element, max_size=8), label="window")
    prefix_offset = data.draw(st.integers(0, len(window) + 1), label="prefix_offset")
    read_offset = data.draw(st.integers(0, len(window) + 1), label="read_offset")
    if WINDOW_IDS:
        fields: dict[str, Any] = {"prev_token_ids": window}
    else:
        pieces = [derenderer.tokenizer.convert_ids_to_tokens(i) or "" for i in window]
        fields = {"prev_tokens": pieces}
    return DerenderStreamState(**fields, prefix_offset=prefix_offset, read_offset=read_offset)


def _dumped(result: tuple[str, Any]) -> tuple[str, Any]:
    """A `_detokenize_delta` outcome with its state dumped."""
    if result[0] == "raised":
        return result
    text, state = result[1]
    return result[0], (text, state.model_dump())


def check_logprobs(engine: Any, data: Any) -> None:
    """Chat and completion logprobs: the fast JSON is the models' JSON."""
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateLogProbs
    from vllm.renderers.online_derenderer import (
        _convert_chat_logprobs_to_completion_logprobs,
        _resolve_logprobs,
    )

    from derender_core.vllm_seam.fast import (
        TOKENS_AS_IDS,
        render_chat_logprobs,
        render_completion_logprobs,
    )

    derenderer = engine._serving.online_derenderer
    table = derenderer.table
    ids = token_ids(data, derenderer, max_size=12) or [_pools(derenderer)["ordinary"][0]]
    pools = _pools(derenderer)
    candidates = st.sampled_from(pools["ordinary"] + pools["byte"] + pools["cut"] + pools["special"] + pools["oov"][:2])
    logprob = st.floats(-30, 0, allow_nan=False) | st.sampled_from([0.0, -0.0, -1e-5, -9999.0, -1, -2.5e-7])
    content = []
    for token_id in ids:
        top = data.draw(st.lists(st.tuples(candidates, logprob), max_size=5), label="top")
        sampled = {"token_id": token_id, "logprob": data.draw(logprob)}
        content.append({**sampled, "top_logprobs": ([sampled] if top else []) + [{"token_id": t, "logprob": lp} for t, lp in top]})
    logprobs = GenerateLogProbs.model_validate({"content": content})
    context = data.draw(st.lists(st.sampled_from(pools["byte"] + pools["ordinary"]), max_size=4), label="context")
    top_limit = data.draw(st.sampled_from([None, 0, 1, 3, 5]))
    as_ids = TOKENS_AS_IDS and data.draw(st.booleans(), label="return_tokens_as_token_ids")
    options = {"return_tokens_as_token_ids": as_ids} if TOKENS_AS_IDS else {}

    def reference() -> tuple[str, str]:
        resolved = _resolve_logprobs(
            logprobs, derenderer.tokenizer, initial_context_token_ids=context, top_limit=top_limit, **options
        )
        completion = _convert_chat_logprobs_to_completion_logprobs(resolved, logprobs)
        return _dumps(resolved.model_dump()), _dumps(completion.model_dump())

    def fast() -> tuple[str | None, str | None]:
        resolved = table.resolve_logprobs(logprobs, context, top_limit, as_ids)
        return render_chat_logprobs(resolved), render_completion_logprobs(resolved)

    # An id vLLM cannot decode (a negative one) fails the same way in both.
    assert outcome(fast) == outcome(reference), (ids, context, top_limit, as_ids)


def outcome(call: Any) -> tuple[str, Any]:
    """A call's result, or the type of what it raised."""
    try:
        return "returned", call()
    except Exception as exc:  # noqa: BLE001 - the comparison is the point
        return "raised", type(exc)


def _dumps(content: Any) -> str:
    """As the endpoints' ``JSONResponse`` serialises."""
    return json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))


def check_live_chunks(engine: Any, plans: list[Any], data: Any) -> None:
    """A corpus stream cut at drawn chunk sizes, with or without logprobs:
    every live call (fast decode) equals replay on vLLM's own decode, chunk
    and state."""
    import orjson

    from derender_core import Endpoint
    from derender_core.batch import Job
    from tests.helpers import jsonl_answers, normalize
    from tests.sample_inputs import drawn_chunking, stream_body

    plan = drawn_chunking(data, plans, 5)
    from tests.sample_inputs import generate_chunks

    model = engine._serving.models.model_name()
    lines = [orjson.dumps(stream_body(plan, chunk, model)) for chunk in generate_chunks(plan)]
    job = Job(Endpoint.CHAT, stream=True)
    live, _ = jsonl_answers(engine.in_mode(live=True, decode="fast"), job, lines)
    replay, _ = jsonl_answers(engine.in_mode(live=False, decode="reference"), job, lines)
    for number, (got, expected) in enumerate(zip(live, replay, strict=True), 1):
        assert normalize(got) == normalize(expected), (plan.request_id, number)
