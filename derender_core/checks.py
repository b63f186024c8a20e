"""Our own checks on a derender body, made before it is sent.

The render server answers some wrong records as if they were fine: an
out-of-vocabulary token id decodes as nothing, ``true`` is read as token 1,
a negative id in a stream chunk or a negative ``prompt_tokens`` passes, and
choice indices are taken as given (outside ``0..n-1``, repeated, or with a
choice missing). The answer looks right and the data is gone. These checks
find such records and name the field and the problem, so the record gets an
error record instead. They also refuse bodies that cannot be what the
command derenders (a one-shot body given to ``derender stream``, a body
with both a response and a chunk).

Only what vLLM accepts is checked: what it rejects, it words itself, so the
error records stay the server's. ``--lenient`` turns the checks off and
reproduces the server bug for bug. Batch execution runs them before the
call, whatever path answers it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from itertools import chain, repeat
from operator import itemgetter
from typing import Any

import orjson

from .lax import read_int, requested_choices, streaming
from .logprob_text import LogprobsText
from .protocol import Endpoint

_RESPONSE_KEYS = ("generate_response", "generate_responses")
_TOKEN_ID = itemgetter("token_id")


class _Found(Exception):
    """The first problem found; its message names the field."""


class PassedPrompts:
    """Prompt id lists that passed the checks, as their JSON bytes: every
    call of a stream carries its prompt again, and checking it again on
    every chunk cost more than the chunk's own work. Equal bytes get the
    same verdict: ``1``, ``1.0`` and ``true`` differ in bytes, and the
    values that share theirs (null, NaN and the infinities, all written
    ``null``) are none of them an integer vLLM reads, so the check leaves
    each to vLLM's own words alike (``tests/test_lax.py`` draws them).
    Kept up to `budget` bytes in all, then forgotten at once."""

    def __init__(self, budget: int = 16 << 20) -> None:
        self._passed: set[bytes] = set()
        self._size = 0
        self._budget = budget

    def __contains__(self, key: bytes) -> bool:
        return key in self._passed

    def add(self, key: bytes) -> None:
        if self._size + len(key) > self._budget:
            self._passed.clear()
            self._size = 0
        if key not in self._passed:
            self._passed.add(key)
            self._size += len(key)


def check_body(
    body: Any, endpoint: Endpoint, *, stream: bool, vocab_size: int, passed: PassedPrompts | None = None
) -> str | None:
    """The first problem in a body, as ``field: problem``, or None.

    `vocab_size` is the tokenizer's full size, added tokens included: ids at
    or above it decode as nothing. `passed`, kept by the caller across
    calls (of one vocabulary), spares a stream's prompt a check per chunk.
    """
    if not (type(body) is dict or isinstance(body, Mapping)):
        return None  # the server's validation words this
    checker = _Checker(vocab_size, passed)
    try:
        _check_shape(body, stream)
        # n as vLLM's validation reads it ("2" and 2.0 are 2), so choice 1
        # of such a request is no problem; a value it refuses bounds nothing.
        n = requested_choices(body.get(endpoint.request_key), endpoint.request_key)
        n_source = _N_SOURCES[endpoint] if n is not None else None
        if stream:
            if not checker.usual_stream_call(body, n):
                checker.stream_call(body, n, n_source)
        elif endpoint is Endpoint.CHAT:
            if not checker.usual_chat_call(body, n):
                checker.chat_call(body, n, n_source)
        else:
            checker.completion_call(body, n, n_source)
    except _Found as found:
        return str(found)
    return None


_N_SOURCES = {endpoint: f"{endpoint.request_key}.n" for endpoint in Endpoint}
"""Where a derender call's ``n`` comes from, as its problems name it."""


def _check_shape(body: Mapping[str, Any], stream: bool) -> None:
    response_key = None
    if "generate_chunk" in body:
        for key in _RESPONSE_KEYS:
            if key in body:
                response_key = key
                break
    if response_key is not None:
        raise _Found(
            f"generate_chunk: the body also holds {response_key}; a derender call "
            "takes a whole response or one stream chunk, not both"
        )
    if stream and not streaming(body.get("stream")):
        given = _shown(body["stream"]) if "stream" in body else "not set"
        raise _Found(
            f"stream: {given}, so this is a one-shot call; "
            "`derender stream` takes streaming calls (\"stream\": true with a "
            "generate_chunk). Derender one-shot bodies with `derender chat` or "
            "`derender completion`."
        )


class _Checker:
    def __init__(self, vocab_size: int, passed: PassedPrompts | None = None) -> None:
        self.vocab_size = vocab_size
        self.passed = passed

    # --- the three kinds of call -------------------------------------------

    def usual_chat_call(self, body: Mapping[str, Any], n: int | None) -> bool:
        """True when `chat_call` finds no problem in the usual one-shot body
        (choices numbered 0..n-1 with good ids, no logprobs), checked in
        one pass; False when it cannot tell,
        and `chat_call` then checks the body in full. As in
        `usual_stream_call`, the prompt ids, the only problem raised here,
        are checked once the rest is known to be fine."""
        response = body.get("generate_response")
        if type(response) is not dict:
            return False
        choices = response.get("choices")
        count = body.get("prompt_tokens")
        if type(choices) is not list or (count is not None and (type(count) is not int or count < 0)):
            return False
        bound = n if n is not None else len(choices)
        seen: set[int] = set()
        for choice in choices:
            if type(choice) is not dict or choice.get("logprobs") is not None:
                return False
            index = choice.get("index")
            if type(index) is not int or not 0 <= index < bound or index in seen:
                return False
            seen.add(index)
            ids = choice.get("token_ids")
            if ids is not None and (
                type(ids) is not list or (ids and not self.all_good(ids, negatives_checked_by_vllm=True))
            ):
                return False
        if n is not None and seen and len(seen) != n:  # a choice missing
            return False
        ids = response.get("prompt_token_ids")
        if ids is not None and (
            type(ids) is not list or (ids and not self.all_good(ids, negatives_checked_by_vllm=True))
        ):
            return False
        self.prompt_ids(body.get("prompt_token_ids"))
        return True

    def chat_call(self, body: Mapping[str, Any], n: int | None, n_source: str | None) -> None:
        self.response("generate_response", body.get("generate_response"), n, n_source, positional=False)
        self.prompt_ids(body.get("prompt_token_ids"))
        self.count("prompt_tokens", body.get("prompt_tokens"))

    def completion_call(self, body: Mapping[str, Any], n: int | None, n_source: str | None) -> None:
        responses = body.get("generate_responses")
        if isinstance(responses, list):
            for k, response in enumerate(responses):
                # vLLM numbers completion choices by position, not by index.
                self.response(f"generate_responses[{k}]", response, n, n_source, positional=True)
        prompts = body.get("prompt_token_ids")
        if isinstance(prompts, list):
            for k, prompt in enumerate(prompts):
                self.ids(f"prompt_token_ids[{k}]", prompt, negatives_checked_by_vllm=True)
        counts = body.get("prompt_tokens")
        if isinstance(counts, list):
            for k, count in enumerate(counts):
                self.count(f"prompt_tokens[{k}]", count)

    def usual_stream_call(self, body: Mapping[str, Any], n: int | None) -> bool:
        """True when `stream_call` finds no problem in the usual chunk (one
        choice of good ids, no logprobs, no state), checked in one pass:
        every chunk of a stream goes through here. False when it cannot
        tell, and `stream_call` then checks the body in full. A problem
        raised here is the one `stream_call` raises first: the prompt ids
        are checked only once the chunk is known to be fine."""
        chunk = body.get("generate_chunk")
        if type(chunk) is not dict:
            return False
        choices = chunk.get("choices")
        if type(choices) is not list or chunk.get("prompt_token_ids") is not None:
            return False
        if len(choices) == 1:
            choice = choices[0]
            if type(choice) is not dict or choice.get("logprobs") is not None:
                return False
            index = choice.get("index")
            if type(index) is not int or (n is not None and not 0 <= index < n):
                return False
            ids = choice.get("token_ids")
            if ids is not None and (
                type(ids) is not list or (ids and not self.all_good(ids, negatives_checked_by_vllm=False))
            ):
                return False
        count = body.get("prompt_tokens")
        if (count is not None and (type(count) is not int or count < 0)) or body.get("stream_state") is not None:
            return False
        self.prompt_ids(body.get("prompt_token_ids"))
        return True

    def stream_call(self, body: Mapping[str, Any], n: int | None, n_source: str | None) -> None:
        chunk = body.get("generate_chunk")
        if (type(chunk) is dict or isinstance(chunk, Mapping)):
            choices = chunk.get("choices")
            # vLLM refuses more than one choice per chunk in its own words.
            if isinstance(choices, list) and len(choices) == 1:
                choice = choices[0]
                if (type(choice) is dict or isinstance(choice, Mapping)):
                    self.index("generate_chunk.choices[0].index", choice.get("index"), n, n_source)
                    # A stream chunk's ids are plain ints to vLLM: negatives pass.
                    self.ids("generate_chunk.choices[0].token_ids", choice.get("token_ids"), negatives_checked_by_vllm=False)
                    self.logprobs("generate_chunk.choices[0].logprobs", choice.get("logprobs"))
            self.ids("generate_chunk.prompt_token_ids", chunk.get("prompt_token_ids"), negatives_checked_by_vllm=True)
        self.prompt_ids(body.get("prompt_token_ids"))
        self.count("prompt_tokens", body.get("prompt_tokens"))
        state = body.get("stream_state")
        if (type(state) is dict or isinstance(state, Mapping)):  # a captured state, sent as it is
            for key in ("output_token_ids", "logprob_context_token_ids"):
                self.ids(f"stream_state.{key}", state.get(key), negatives_checked_by_vllm=False)

    # --- fields ------------------------------------------------------------

    def response(
        self, path: str, response: Any, n: int | None, n_source: str | None, *, positional: bool
    ) -> None:
        if not (type(response) is dict or isinstance(response, Mapping)):
            return
        choices = response.get("choices")
        if isinstance(choices, list):
            self.choice_indices(f"{path}.choices", choices, n, n_source, positional=positional)
            for i, choice in enumerate(choices):
                if (type(choice) is dict or isinstance(choice, Mapping)):
                    choice_path = f"{path}.choices[{i}]"
                    self.ids(f"{choice_path}.token_ids", choice.get("token_ids"), negatives_checked_by_vllm=True)
                    self.logprobs(f"{choice_path}.logprobs", choice.get("logprobs"))
        self.ids(f"{path}.prompt_token_ids", response.get("prompt_token_ids"), negatives_checked_by_vllm=True)

    def logprobs(self, path: str, logprobs: Any) -> None:
        if type(logprobs) is LogprobsText:
            # Read from the text, every id an int of at least 0.
            if logprobs.max_id() < self.vocab_size:
                return
            logprobs = logprobs.loaded()
        content = logprobs.get("content") if (type(logprobs) is dict or isinstance(logprobs, Mapping)) else None
        if not isinstance(content, list):
            return
        # The common case, every id good, without a call per id; the walk
        # below finds the field to name, and reads what this does not (an
        # entry not a dict, top_logprobs null).
        try:
            ids = list(map(_TOKEN_ID, content))
            ids += map(_TOKEN_ID, chain.from_iterable(map(dict.get, content, repeat("top_logprobs"), repeat(()))))
        except (TypeError, KeyError, AttributeError):
            ids = []
        if ids and self.all_good(ids, negatives_checked_by_vllm=False):
            return
        for k, entry in enumerate(content):
            if not (type(entry) is dict or isinstance(entry, Mapping)):
                continue
            entry_path = f"{path}.content[{k}]"
            # Logprob token ids are plain ints to vLLM: negatives pass.
            self.id(f"{entry_path}.token_id", entry.get("token_id"), negatives_checked_by_vllm=False)
            top = entry.get("top_logprobs")
            if isinstance(top, list):
                for m, alternative in enumerate(top):
                    if (type(alternative) is dict or isinstance(alternative, Mapping)):
                        self.id(
                            f"{entry_path}.top_logprobs[{m}].token_id",
                            alternative.get("token_id"),
                            negatives_checked_by_vllm=False,
                        )

    def choice_indices(
        self, path: str, choices: list[Any], n: int | None, n_source: str | None, *, positional: bool
    ) -> None:
        seen: dict[int, int] = {}
        for i, choice in enumerate(choices):
            if not (type(choice) is dict or isinstance(choice, Mapping)):
                continue
            index = choice.get("index")
            if not self.index(f"{path}[{i}].index", index, n if n is not None else len(choices), n_source):
                continue
            if index in seen:
                raise _Found(f"{path}[{i}].index: {index} repeats {path}[{seen[index]}].index")
            if positional and index != i:
                raise _Found(
                    f"{path}[{i}].index: {index} at position {i}; completion choices are "
                    f"numbered by position, so the server would answer it as choice {i}"
                )
            seen[index] = i
        if n is not None and seen:
            # The first index missing is at most len(seen): found without
            # walking all of a huge n.
            missing = next((index for index in range(n) if index not in seen), None)
            if missing is not None:
                raise _Found(
                    f"{path}: no choice with index {missing} ({n_source} is {n}, "
                    f"{len(seen)} choice{'s' if len(seen) != 1 else ''} given)"
                )

    def index(self, path: str, index: Any, n: int | None, n_source: str | None) -> bool:
        """Check one choice index; False when it is not an integer vLLM
        reads (vLLM's validation words that)."""
        if not self.integer(path, index, "an integer"):
            return False
        if n is not None and not 0 <= index < n:
            bound = f"{n_source} is {n}" if n_source else f"{n} choice{'s' if n != 1 else ''}"
            raise _Found(f"{path}: {index} is outside 0..{n - 1} ({bound})")
        return True

    def all_good(self, ids: list[Any], *, negatives_checked_by_vllm: bool) -> bool:
        """Whether every id is a good integer, at C speed: the common case."""
        if len(ids) == 1:  # a stream's usual chunk
            token_id = ids[0]
            return type(token_id) is int and token_id < self.vocab_size and (negatives_checked_by_vllm or token_id >= 0)
        if set(map(type, ids)) != {int}:
            return False
        return max(ids) < self.vocab_size and (negatives_checked_by_vllm or min(ids) >= 0)

    def ids(self, path: str, ids: Any, *, negatives_checked_by_vllm: bool) -> None:
        if not isinstance(ids, list) or not ids:
            return
        if self.all_good(ids, negatives_checked_by_vllm=negatives_checked_by_vllm):
            return
        for j, token_id in enumerate(ids):
            self.id(f"{path}[{j}]", token_id, negatives_checked_by_vllm=negatives_checked_by_vllm)

    def prompt_ids(self, ids: Any) -> None:
        """A call's ``prompt_token_ids``, checked once per distinct list
        where `passed` remembers the lists that passed: a stream's every
        call, and a dataset's samples of one prompt, carry the same."""
        passed = self.passed
        if passed is None or not isinstance(ids, list):
            self.ids("prompt_token_ids", ids, negatives_checked_by_vllm=True)
            return
        try:
            key = orjson.dumps(ids)
        except TypeError:  # an integer beyond 64 bits, say: checked each time
            key = None
        if key is not None and key in passed:
            return
        self.ids("prompt_token_ids", ids, negatives_checked_by_vllm=True)
        if key is not None:
            passed.add(key)  # reached only when no problem was found

    def id(self, path: str, token_id: Any, *, negatives_checked_by_vllm: bool) -> None:
        if not self.integer(path, token_id, "a token id"):
            return
        if token_id < 0 and not negatives_checked_by_vllm:
            raise _Found(f"{path}: token id {token_id} is negative")
        if token_id >= self.vocab_size:
            raise _Found(f"{path}: token id {token_id} is out of vocabulary (size {self.vocab_size})")

    def count(self, path: str, count: Any) -> None:
        if self.integer(path, count, "a count") and count < 0:
            raise _Found(f"{path}: {count} is negative")

    @staticmethod
    def integer(path: str, value: Any, role: str) -> bool:
        """True for a JSON integer. A value vLLM reads as an integer
        although it is none (``true``, ``2.0``, ``"7"``) is a problem; for
        anything else, False: vLLM refuses it in its own words."""
        if type(value) is int:
            return True
        read_as = read_int(value)
        if read_as is None:
            return False
        raise _Found(
            f"{path}: {_shown(value)} is a {_json_type(value)}, not {role} "
            f"(the server would read it as {_shown(read_as)})"
        )


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "string"
    return type(value).__name__


def _shown(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
