"""`derender parity --minimize`: each divergence on a smallest record that
still shows it.

For each request and each divergence kind it shows (``left vs right:
field``), delta debugging shrinks the request's record while the oracle
holds: the candidate record, read back as `derender parity` reads its input
and run through the pair's paths only (`paths_for`), still shows a
divergence of that kind with the same kind of value on each side
(`likeness`), and no stop-logic finding the record as given did not have
(a record cut short of its stop token, say). The steps, in order, each starting from what the
earlier ones kept:

1. choices: with several, one choice alone (as index 0, ``n`` dropped);
2. output ids: the shortest prefix (tried from one id up by doubling, then
   bisected), then single ids removed (`ddmin`); a one-choice request's
   ``max_tokens`` shrinks with them, keeping its distance to the output's
   length;
3. chunking (stream input): chunk boundaries removed, that is chunks merged;
4. request: fields dropped (``tools`` with ``tool_choice``, ``logprobs``
   with ``top_logprobs`` and the output's logprobs, then each other field
   but the model, the messages or prompt and the stream options), then
   messages and tools one by one. Where the record's prompt ids were its
   request's rendering, the smaller request's prompt is rendered again (so
   the serve path, which renders it itself, takes it), and a request whose
   prompt would grow is not taken;
5. prompt ids: the shortest tail. Not for pairs with a serve path: serve
   renders the request itself and refuses a prompt that is not its
   rendering.

Every candidate is a valid record in the input's own form (stream bodies
stay stream bodies: the finish reason on each choice's last chunk, a
finish-only tail kept as a chunk of its own, the usage chunk's counts
recomputed; a one-shot body stays one), and is read back through
`parity.requests_of`, so what `--minimize` writes is what `derender parity`
reads with the same flags. The request id gets the kind as a suffix
(``stream-n2~replay-serve-role_frame``), so one request's several minimal
records stay apart. Each oracle run counts against a budget of `steps`
runs per divergence (the same candidate is run once); the search is
deterministic.

Pure orchestration over `Derenderer` objects: no vLLM.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson

from .compare import (
    DEFAULT_NORMALIZATION,
    ENUMERATED_FIELDS,
    Divergence,
    Examination,
    Normalization,
    Observed,
    value_kind,
)
from .logs import SERVE_LOGGER, collected_vllm_logs, quieted
from .parity import (
    DERENDER_MODES,
    PATHS,
    Chunking,
    Parity,
    Request,
    one_response,
    requests_of,
)
from .prompts import PromptRenderer, rendered_token_ids
from .protocol import Derenderer, Endpoint
from .records import Record

DEFAULT_STEPS = 300
"""Oracle runs per divergence, by default."""
_KEPT_FIELDS = frozenset({"model", "messages", "prompt", "stream", "stream_options"})
"""Request fields never dropped: what makes the record a request at all,
and the stream options its usage chunk follows."""
_DROPPED_TOGETHER = (("tools", "tool_choice"), ("logprobs", "top_logprobs"))
_SERVE_PATHS = frozenset({"serve", "serve-oneshot"})
_TOKEN_LIMITS = ("max_tokens", "max_completion_tokens")

T = TypeVar("T")



class _Exhausted(Exception):
    """The step budget is spent: the search stops with what it has."""


# --- a record as parts that can shrink ---------------------------------------------


@dataclass(frozen=True)
class Choice:
    """One choice's output: its ids, how they were chunked, its finish."""

    index: int
    token_ids: tuple[int, ...]
    sizes: tuple[int, ...]
    """Ids per chunk, in order; 0 is a chunk without ids (a finish-only tail)."""
    logprobs: tuple[Any, ...] | None
    """One entry per id, or None."""
    finish_reason: Any
    stop_reason: Any

    def keeping(self, positions: Iterable[int]) -> Choice:
        """Only the ids at `positions`; a chunk that loses all its ids goes
        (one that had none stays: a tail), and the finish moves to the last
        chunk left."""
        kept = set(positions)
        sizes: list[int] = []
        start = 0
        for size in self.sizes:
            left = sum(1 for position in range(start, start + size) if position in kept)
            if left or size == 0:
                sizes.append(left)
            start += size
        order = sorted(kept)
        return dataclasses.replace(
            self,
            token_ids=tuple(self.token_ids[p] for p in order),
            sizes=tuple(sizes) or (0,),
            logprobs=None if self.logprobs is None else tuple(self.logprobs[p] for p in order),
        )

    def merged(self, boundaries: Iterable[int]) -> Choice:
        """Chunks joined at every boundary but `boundaries` (boundary ``i``
        lies between chunk ``i - 1`` and chunk ``i``)."""
        kept = set(boundaries)
        sizes = [self.sizes[0]]
        for number, size in enumerate(self.sizes[1:], 1):
            if number in kept:
                sizes.append(size)
            else:
                sizes[-1] += size
        return dataclasses.replace(self, sizes=tuple(sizes))

    def chunks(self) -> list[dict[str, Any]]:
        """The generate stream chunks' choices, the finish on the last."""
        events = []
        start = 0
        for number, size in enumerate(self.sizes):
            last = number == len(self.sizes) - 1
            event: dict[str, Any] = {
                "index": self.index,
                "token_ids": list(self.token_ids[start : start + size]),
                "finish_reason": self.finish_reason if last else None,
            }
            if last and self.stop_reason is not None:
                event["stop_reason"] = self.stop_reason
            if self.logprobs is not None:
                event["logprobs"] = {"content": list(self.logprobs[start : start + size])}
            start += size
            events.append(event)
        return events

    def whole(self) -> dict[str, Any]:
        """The one-shot generate response's choice."""
        choice: dict[str, Any] = {"index": self.index, "token_ids": list(self.token_ids), "finish_reason": self.finish_reason}
        if self.stop_reason is not None:
            choice["stop_reason"] = self.stop_reason
        if self.logprobs is not None:
            choice["logprobs"] = {"content": list(self.logprobs)}
        return choice


@dataclass(frozen=True)
class Case:
    """One request's record, as the parts the search shrinks."""

    endpoint: Endpoint
    stream: bool
    template: Mapping[str, Any]
    """The body's other keys, kept as given."""
    generate: Mapping[str, Any]
    """The generate chunk's (response's) other keys, kept as given."""
    request: Mapping[str, Any] | None
    prompt: tuple[int, ...] | None
    prompt_tokens: Any
    prompt_in_generate: bool
    """The prompt ids travel in the generate chunk rather than the body."""
    choices: tuple[Choice, ...]
    usage: Mapping[str, Any] | None
    """The stream's usage chunk's usage; None without one."""
    rendered: bool = False
    """The prompt ids are the request's rendering: a smaller request gets its own."""

    @property
    def output_ids(self) -> int:
        return sum(len(choice.token_ids) for choice in self.choices)

    def records(self, request_id: str) -> list[dict[str, Any]]:
        """The record in the input's form: stream bodies (choices
        interleaved one chunk at a time, then the usage chunk), or one
        one-shot body."""
        request_key = self.endpoint.request_key
        prompt_fields: dict[str, Any] = {}
        if self.prompt is not None and not self.prompt_in_generate:
            prompt = list(self.prompt)
            prompt_fields["prompt_token_ids"] = prompt if self.stream or self.endpoint is Endpoint.CHAT else [prompt]
        if self.prompt_tokens is not None:
            single = self.stream or self.endpoint is Endpoint.CHAT
            prompt_fields["prompt_tokens"] = self.prompt_tokens if single else [self.prompt_tokens]
        generate = dict(self.generate)
        if self.prompt is not None and self.prompt_in_generate:
            generate["prompt_token_ids"] = list(self.prompt)
        request = {} if self.request is None else {request_key: dict(self.request)}

        def body(**output: Any) -> dict[str, Any]:
            return {**self.template, **output, **prompt_fields, **request}

        if not self.stream:
            response = {**generate, "request_id": request_id, "choices": [c.whole() for c in self.choices]}
            if self.endpoint is Endpoint.CHAT:
                return [body(generate_response=response)]
            return [body(generate_responses=[response])]
        per_choice = [choice.chunks() for choice in self.choices]
        bodies = [
            body(generate_chunk={**generate, "request_id": request_id, "choices": [events[turn]]})
            for turn in range(max((len(events) for events in per_choice), default=0))
            for events in per_choice
            if turn < len(events)
        ]
        if self.usage is not None:
            completion = self.output_ids
            prompt = self.prompt_tokens if isinstance(self.prompt_tokens, int) else len(self.prompt or ())
            usage = {**self.usage, "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
            bodies.append(body(generate_chunk={**generate, "request_id": request_id, "choices": [], "usage": usage}))
        return bodies


class NotMinimizable(ValueError):
    """A record the search cannot take apart (its reason)."""


def case_of(request: Request, endpoint: Endpoint) -> Case:
    """The parts of a request's record as the input gave it.

    Raises:
        NotMinimizable: for recorded serve answers, and records whose
            parts are not where a derender body keeps them.

    """
    if request.recorded is not None:
        raise NotMinimizable("recorded serve answers (--from-serve) are not minimized")
    stream = bool(request.streams) and request.streams[0][0] is None
    try:
        if stream:
            return _stream_case(request.streams[0][1], endpoint)
        return _one_shot_case(request.one_shot, endpoint)
    except (KeyError, TypeError, AttributeError, IndexError, ValueError) as exc:
        raise NotMinimizable(f"the record cannot be taken apart: {exc}") from None


_BODY_PARTS = ("generate_chunk", "generate_response", "generate_responses", "stream_state", "prompt_token_ids", "prompt_tokens")


def _template(body: Mapping[str, Any], endpoint: Endpoint) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in _BODY_PARTS and k != endpoint.request_key}


def _stream_case(bodies: list[Any], endpoint: Endpoint) -> Case:
    first = bodies[0]
    chunk = first["generate_chunk"]
    ids: dict[int, list[int]] = {}
    sizes: dict[int, list[int]] = {}
    logprobs: dict[int, list[Any] | None] = {}
    finish: dict[int, tuple[Any, Any]] = {}
    usage = None
    for body in bodies:
        generate = body["generate_chunk"]
        choices = generate.get("choices") or []
        if not choices and generate.get("usage") is not None:
            usage = generate["usage"]
        for choice in choices:
            index = int(choice.get("index", 0))
            tokens = list(choice.get("token_ids") or [])
            ids.setdefault(index, []).extend(tokens)
            sizes.setdefault(index, []).append(len(tokens))
            entries = (choice.get("logprobs") or {}).get("content")
            if index not in logprobs:
                logprobs[index] = []
            if entries is None or len(entries) != len(tokens):
                logprobs[index] = None if tokens or entries is not None else logprobs[index]
            elif logprobs[index] is not None:
                logprobs[index] += entries  # type: ignore[operator]
            if choice.get("finish_reason") is not None:
                finish[index] = (choice["finish_reason"], choice.get("stop_reason"))
    prompt = first.get("prompt_token_ids")
    in_generate = prompt is None and chunk.get("prompt_token_ids") is not None
    prompt = chunk.get("prompt_token_ids") if in_generate else prompt
    choices = tuple(
        Choice(index, tuple(ids[index]), tuple(sizes[index]),
               None if not logprobs.get(index) else tuple(logprobs[index] or ()), *finish.get(index, (None, None)))  # fmt: skip
        for index in sorted(ids)
    )
    return Case(
        endpoint, True, _template(first, endpoint),
        {k: v for k, v in chunk.items() if k not in ("request_id", "choices", "usage", "prompt_token_ids")},
        first.get(endpoint.request_key), None if prompt is None else tuple(prompt), first.get("prompt_tokens"),
        in_generate, choices, usage,
    )  # fmt: skip


def _one_shot_case(body: Mapping[str, Any], endpoint: Endpoint) -> Case:
    response, prompt_tokens, prompt = one_response(body, endpoint)
    in_generate = prompt is None and response.get("prompt_token_ids") is not None
    prompt = response.get("prompt_token_ids") if in_generate else prompt
    choices = []
    for choice in response.get("choices") or []:
        tokens = tuple(choice.get("token_ids") or ())
        entries = (choice.get("logprobs") or {}).get("content")
        choices.append(
            Choice(int(choice.get("index", 0)), tokens, (len(tokens),),
                   tuple(entries) if entries is not None and len(entries) == len(tokens) else None,
                   choice.get("finish_reason"), choice.get("stop_reason"))  # fmt: skip
        )
    return Case(
        endpoint, False, _template(body, endpoint),
        {k: v for k, v in response.items() if k not in ("request_id", "choices", "prompt_token_ids")},
        body.get(endpoint.request_key), None if prompt is None else tuple(prompt), prompt_tokens,
        in_generate, tuple(choices), None,
    )  # fmt: skip


# --- sizes -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Size:
    """How large a record is, by what the search shrinks."""

    output_ids: int
    calls: int
    """Derender calls: stream bodies, or 1 for a one-shot body."""
    request_bytes: int
    prompt_ids: int

    @classmethod
    def of(cls, records: Sequence[Mapping[str, Any]], endpoint: Endpoint) -> Size:
        output = 0
        for record in records:
            generates = [record.get("generate_chunk") or record.get("generate_response")]
            generates += list(record.get("generate_responses") or [])
            for generate in generates:
                for choice in (generate or {}).get("choices") or []:
                    output += len(choice.get("token_ids") or [])
        first = records[0] if records else {}
        request = first.get(endpoint.request_key)
        prompt = first.get("prompt_token_ids")
        if prompt is None:
            generate = first.get("generate_chunk") or first.get("generate_response") or {}
            prompt = generate.get("prompt_token_ids")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            prompt = prompt[0]
        return cls(
            output, len(records), 0 if request is None else len(json_bytes(request)),
            len(prompt) if isinstance(prompt, list) else 0,
        )  # fmt: skip

    def within(self, other: Size) -> bool:
        """No larger than `other` by any measure."""
        return all(getattr(self, f.name) <= getattr(other, f.name) for f in dataclasses.fields(self))


# --- the search -----------------------------------------------------------------------------


@dataclass
class Minimal:
    """One request's smallest record for one divergence kind."""

    request_id: str
    """The original request's id."""
    divergence: Divergence
    """The first divergence of the kind in the original run."""
    records: list[dict[str, Any]]
    """The minimal record, in the input's form, under `minimal_id`."""
    minimal_id: str
    before: Size
    after: Size
    runs: int
    """Oracle runs spent."""
    seconds: float
    exhausted: bool = False
    """The step budget ran out before the search ended."""
    problem: str | None = None
    """Why the record was kept as given, when it was."""
    paths: list[str] = field(default_factory=list)
    """The paths the oracle ran."""
    found: list[Divergence] = field(default_factory=list)
    """The kind's divergences on the minimal record."""
    observed: dict[tuple[str, str | None], Observed] = field(default_factory=dict)
    """What each of `paths` answered for the minimal record."""
    stream: bool = False
    request: Request | None = None
    """The minimal record as `derender parity` reads it: its one-shot body
    and its streams (per chunking, for one-shot input)."""

    @property
    def kind(self) -> str:
        return self.divergence.kind


def json_bytes(value: Any) -> bytes:
    """`value` as compact JSON bytes; a string orjson refuses (a lone
    surrogate, which a record's JSON may hold) as an escape."""
    try:
        return orjson.dumps(value)
    except TypeError:
        return json.dumps(value, separators=(",", ":")).encode("ascii")


def minimal_id(request_id: str, divergence: Divergence) -> str:
    """The minimal record's request id: the original's, then ``~`` and the
    kind (``stream-n2~replay-serve-role_frame``)."""
    return f"{request_id}~{divergence.left}-{divergence.right}-{divergence.field}"


def likeness(divergence: Divergence) -> tuple[Any, ...]:
    """What a smaller record's divergence must share with the original's to
    be the same one: its kind, and on each side the same kind of value
    (null, text, number, list, object; for the few-word fields, the same
    word). Without it the search drifts to another bug of the same kind,
    as a one-shot `content: null` against streamed text turning into text
    against a streamed null."""
    if divergence.field in ENUMERATED_FIELDS:
        sides: tuple[Any, ...] = (repr(divergence.left_value), repr(divergence.right_value))
    elif divergence.field == "stop_logic":
        # "not finished at token 30" / "length at token 30": the same
        # disagreement at any token.
        sides = tuple(re.sub(r"\d+", "N", str(value)) for value in (divergence.left_value, divergence.right_value))
    else:
        sides = tuple(value_kind(value) for value in (divergence.left_value, divergence.right_value))
    return (divergence.kind, *sides)


def paths_for(divergence: Divergence, available: Sequence[str]) -> list[str]:
    """The paths a divergence's oracle runs: the pair's own; for a
    ``record`` finding, the path that found it; for ``record vs render``
    (the prompt check), one derender path (any path renders)."""
    named = [path for path in PATHS if path in (divergence.left, divergence.right) and path in available]
    if named:
        return named
    derender = [path for path in available if path in DERENDER_MODES]
    return (derender or list(available))[:1]


class Minimizer:
    """Minimizes divergences over the engines of one parity run."""

    def __init__(
        self,
        engines: Mapping[str, Derenderer],
        endpoint: Endpoint,
        *,
        chunkings: Sequence[Chunking] = (Chunking(1),),
        ignore: Iterable[str] = (),
        normalization: Normalization = DEFAULT_NORMALIZATION,
        steps: int = DEFAULT_STEPS,
    ) -> None:
        self.engines = dict(engines)
        self.endpoint = endpoint
        self.chunkings = list(chunkings)
        self.ignore = frozenset(ignore)
        self.normalization = normalization
        self.steps = steps
        self._parities: dict[tuple[tuple[str, ...], frozenset[str]], Parity] = {}
        first = next(iter(self.engines.values()))
        renderer = next((self.engines[p] for p in DERENDER_MODES if p in self.engines), first)
        self.renderer = PromptRenderer(renderer)

    def kinds(self, divergences: Iterable[Divergence]) -> list[Divergence]:
        """The first divergence of each kind, per request, in report order."""
        seen: dict[tuple[str | None, str], Divergence] = {}
        for divergence in divergences:
            seen.setdefault((divergence.request_id, divergence.kind), divergence)
        return list(seen.values())

    def minimize(self, request: Request, divergence: Divergence, alike: Iterable[Divergence] = ()) -> Minimal:
        """The smallest record of `request` that still shows `divergence`
        (its kind, with values like its own or like those of the request's
        other divergences of the kind, `alike`; `likeness`)."""
        started = time.perf_counter()
        original_id = request.request_id
        new_id = minimal_id(original_id, divergence)
        paths = paths_for(divergence, list(self.engines))
        given = _given_records(request)
        before = Size.of(given, self.endpoint)
        try:
            case = case_of(request, self.endpoint)
        except NotMinimizable as exc:
            return self._kept(request, divergence, new_id, given, before, started, str(exc), paths)
        likes = {likeness(d) for d in [divergence, *alike] if d.kind == divergence.kind}
        oracle = _Oracle(self._parity(paths, divergence), self.endpoint, self.chunkings, likes, new_id, self.steps)
        search = _Search(oracle, self.renderer, self.endpoint, serve=bool(set(paths) & _SERVE_PATHS))
        # The search's candidates make vLLM's parsers log (a cut tool call)
        # and the serve path log stop-logic findings, many times over: the
        # oracle weighs what matters, the logs are dropped.
        with quieted(SERVE_LOGGER), collected_vllm_logs(verbose=False):
            return self._search(request, divergence, case, oracle, search, given, before, started, paths)

    def _search(
        self, request: Request, divergence: Divergence, case: Case, oracle: _Oracle, search: _Search,
        given: list[dict[str, Any]], before: Size, started: float, paths: list[str],
    ) -> Minimal:  # fmt: skip
        new_id = oracle.request_id
        original_id = request.request_id
        try:
            if not oracle(case):
                return self._kept(
                    request, divergence, new_id, given, before, started,
                    "the record, rebuilt, no longer shows the divergence: kept as given", paths, oracle.runs,
                )  # fmt: skip
            case = dataclasses.replace(case, rendered=search.renders_as_given(case))
            search.best = case
            search.run()
        except _Exhausted:
            pass
        best = search.best or case
        records = best.records(new_id)
        examined = oracle.examine(records)
        return Minimal(
            original_id, divergence, records, new_id, before, Size.of(records, self.endpoint), oracle.runs,
            time.perf_counter() - started, exhausted=oracle.exhausted, paths=paths,
            found=[d for d in examined.divergences if likeness(d) in oracle.likes], observed=examined.observed,
            stream=best.stream, request=oracle.read_back(records),
        )  # fmt: skip

    def _kept(
        self, request: Request, divergence: Divergence, new_id: str, given: list[dict[str, Any]], before: Size,
        started: float, problem: str, paths: list[str], runs: int = 0,
    ) -> Minimal:  # fmt: skip
        return Minimal(
            request.request_id, divergence, given, request.request_id, before, before, runs,
            time.perf_counter() - started, problem=problem, paths=paths,
            stream=bool(request.streams) and request.streams[0][0] is None,
        )  # fmt: skip

    def _parity(self, paths: list[str], divergence: Divergence) -> Parity:
        # The prompt check costs a render and says nothing about another
        # field: left out unless it is the field.
        ignore = set(self.ignore) | ({"prompt_token_ids"} - {divergence.field})
        key = (tuple(paths), frozenset(ignore))
        if key not in self._parities:
            engines = {path: self.engines[path] for path in paths}
            self._parities[key] = Parity(engines, self.endpoint, ignore=ignore, normalization=self.normalization)
        return self._parities[key]


def _given_records(request: Request) -> list[dict[str, Any]]:
    if request.streams and request.streams[0][0] is None:
        return [dict(body) for body in request.streams[0][1]]
    return [dict(request.one_shot)] if isinstance(request.one_shot, Mapping) else []


class _Oracle:
    """Whether a candidate still shows the kind: read back as parity reads
    its input, run through the pair's paths. Each distinct candidate runs
    once; past the budget, `_Exhausted`."""

    def __init__(
        self, parity: Parity, endpoint: Endpoint, chunkings: list[Chunking], likes: set[tuple[Any, ...]],
        request_id: str, steps: int,
    ) -> None:
        self.parity = parity
        self.endpoint = endpoint
        self.chunkings = chunkings
        self.likes = likes
        self.request_id = request_id
        self.steps = steps
        self.runs = 0
        self.exhausted = False
        self.stop_logic: set[tuple[Any, ...]] | None = None
        """The record as given's stop-logic findings (`likeness`)."""
        self._seen: dict[bytes, bool] = {}

    def __call__(self, case: Case) -> bool:
        records = case.records(self.request_id)
        key = json_bytes(records)
        if key in self._seen:
            return self._seen[key]
        if self.runs >= self.steps:
            self.exhausted = True
            raise _Exhausted
        self.runs += 1
        # Each run under an id of its own: the serve path remembers the
        # streams it has seen, and the record's own id is kept for the
        # final run (`Minimizer.minimize`).
        examined = self.examine(case.records(f"{self.request_id}~run{self.runs}"))
        stops = {likeness(d) for d in examined.divergences if d.field == "stop_logic"}
        if self.stop_logic is None:  # the first run: the record as given
            self.stop_logic = stops
        # A record that ends where vLLM would not stop (cut short of its
        # stop token, say) shows a divergence of its own: kept out, unless
        # the record as given showed the same.
        holds = any(likeness(d) in self.likes for d in examined.divergences) and stops <= self.stop_logic
        self._seen[key] = holds
        return holds

    def read_back(self, records: list[dict[str, Any]]) -> Request | None:
        """The record as `derender parity` reads it from a file."""
        read = [Record(number, number, record) for number, record in enumerate(records, 1)]
        requests = list(requests_of(read, self.endpoint, stream=False, requests=None, chunkings=self.chunkings))
        return requests[0] if len(requests) == 1 else None

    def examine(self, records: list[dict[str, Any]]) -> Examination:
        request = self.read_back(records)
        return Examination(None) if request is None else self.parity.examine(request)


class _Search:
    """The steps, each keeping in `best` what holds."""

    def __init__(self, oracle: _Oracle, renderer: PromptRenderer, endpoint: Endpoint, *, serve: bool) -> None:
        self.oracle = oracle
        self.renderer = renderer
        self.endpoint = endpoint
        self.serve = serve
        self.best: Case | None = None

    def test(self, case: Case) -> bool:
        if self.oracle(case):
            self.best = case
            return True
        return False

    def run(self) -> None:
        self.one_choice()
        for position in range(len(self.current.choices)):
            self.output_ids(position)
        if self.current.stream:
            for position in range(len(self.current.choices)):
                self.merge_chunks(position)
        self.request_fields()
        if not self.serve:
            self.prompt_tail()

    @property
    def current(self) -> Case:
        assert self.best is not None
        return self.best

    def one_choice(self) -> None:
        case = self.current
        if len(case.choices) < 2:
            return
        request = None if case.request is None else {k: v for k, v in case.request.items() if k != "n"}
        for choice in case.choices:
            alone = dataclasses.replace(choice, index=0)
            if self.test(dataclasses.replace(case, choices=(alone,), request=request)):
                return

    def _with_choice(self, position: int, choice: Choice) -> Case:
        choices = list(self.current.choices)
        choices[position] = choice
        return dataclasses.replace(self.current, choices=tuple(choices))

    def _cut(self, position: int, choice: Choice, kept: Sequence[int]) -> Case:
        """The case with only the `kept` ids of `choice`; a request of one
        choice with a token limit keeps its distance to the output's length
        (a record cut at ``max_tokens`` stays cut there, one that ran past
        it runs as far past), where the limit stays positive."""
        case = self._with_choice(position, choice.keeping(kept))
        request = case.request
        if request is None or len(case.choices) != 1:
            return case
        limits = {}
        for name in _TOKEN_LIMITS:
            limit = request.get(name)
            if isinstance(limit, int) and not isinstance(limit, bool):
                shorter = limit - (len(choice.token_ids) - len(kept))
                if shorter >= 1:
                    limits[name] = shorter
        return dataclasses.replace(case, request={**request, **limits}) if limits else case

    def output_ids(self, position: int) -> None:
        choice = self.current.choices[position]
        length = len(choice.token_ids)
        _shortest(0, length, lambda k: self.test(self._cut(position, choice, range(k))))
        choice = self.current.choices[position]
        positions = list(range(len(choice.token_ids)))
        ddmin(positions, lambda kept: self.test(self._cut(position, choice, kept)))

    def merge_chunks(self, position: int) -> None:
        choice = self.current.choices[position]
        if len(choice.sizes) < 2:
            return
        if self.test(self._with_choice(position, choice.merged(()))):
            return
        boundaries = list(range(1, len(choice.sizes)))
        ddmin(boundaries, lambda kept: self.test(self._with_choice(position, choice.merged(kept))))

    def with_request(self, case: Case, request: Mapping[str, Any]) -> Case | None:
        """`case` with `request`, its prompt rendered again where the
        record's was its rendering; None where that fails or grows."""
        changed = dataclasses.replace(case, request=request)
        if not case.rendered:
            return changed
        prompt = self._rendering(request)
        if prompt is None or len(prompt) > len(case.prompt or ()):
            return None
        return dataclasses.replace(changed, prompt=tuple(prompt), prompt_tokens=len(prompt))

    def _rendering(self, request: Mapping[str, Any]) -> list[int] | None:
        answer = self.renderer.render(self.endpoint, dict(request))
        if not answer.ok:
            return None
        prompts = rendered_token_ids(answer)
        return prompts[0] if len(prompts) == 1 else None

    def renders_as_given(self, case: Case) -> bool:
        return case.request is not None and case.prompt is not None and self._rendering(case.request) == list(case.prompt)

    def request_fields(self) -> None:
        if self.current.request is None:
            return
        groups: list[tuple[str, ...]] = []
        for name in self.current.request:
            if name in _KEPT_FIELDS:
                continue
            group = next((g for g in _DROPPED_TOGETHER if name in g), (name,))
            for candidate in (group, (name,)):
                if candidate not in groups:
                    groups.append(candidate)
        for group in groups:
            case = self.current
            assert case.request is not None
            if not any(name in case.request for name in group):
                continue
            request = {k: v for k, v in case.request.items() if k not in group}
            candidate = self.with_request(case, request)
            if candidate is None:
                continue
            if "logprobs" in group:
                candidate = dataclasses.replace(
                    candidate, choices=tuple(dataclasses.replace(c, logprobs=None) for c in candidate.choices)
                )
            self.test(candidate)
        for name in ("messages", "tools"):
            self._list_items(name)

    def _list_items(self, name: str) -> None:
        request = self.current.request
        items = None if request is None else request.get(name)
        if not isinstance(items, list) or len(items) < 2:
            return

        def keeps(kept: list[int]) -> bool:
            case = self.current
            assert case.request is not None
            candidate = self.with_request(case, {**case.request, name: [items[i] for i in kept]})
            return candidate is not None and self.test(candidate)

        ddmin(list(range(len(items))), keeps)

    def prompt_tail(self) -> None:
        case = self.current
        if case.prompt is None or len(case.prompt) < 2:
            return
        prompt = case.prompt

        def tail(k: int) -> Case:
            return dataclasses.replace(
                case, prompt=prompt[len(prompt) - k :], prompt_tokens=k if case.prompt_tokens is not None else None
            )

        _shortest(1, len(prompt), lambda k: self.test(tail(k)))


def _shortest(start: int, length: int, holds: Callable[[int], bool]) -> int:
    """The smallest k in [start, length] for which `holds(k)` is true
    (true at `length`, taken as known): tried from `start` up by doubling,
    then bisected between the last that failed and the first that held.
    When none held below `length`, the long candidates a bisection would
    try are not: `length` it is."""
    failed = start - 1
    k = start
    while k < length:
        if holds(k):
            break
        failed = k
        k = max(1, k * 2)
    if k >= length:
        return length
    low, high = failed + 1, k
    while low < high:
        middle = (low + high) // 2
        if holds(middle):
            high = middle
        else:
            low = middle + 1
    return high


def ddmin(items: list[T], holds: Callable[[list[T]], bool]) -> list[T]:
    """Zeller's delta debugging: a 1-minimal sublist of `items` (which
    holds) for which `holds` is still true: subsets, then complements, at
    ever finer granularity."""
    granularity = 2
    while len(items) >= 2:
        size = len(items)
        parts = [items[size * i // granularity : size * (i + 1) // granularity] for i in range(granularity)]
        parts = [part for part in parts if part]
        reduced = False
        for part in parts:
            if holds(part):
                items, granularity, reduced = part, 2, True
                break
        if not reduced and len(parts) > 2:
            for number in range(len(parts)):
                complement = [item for other, part in enumerate(parts) if other != number for item in part]
                if holds(complement):
                    items, granularity, reduced = complement, max(granularity - 1, 2), True
                    break
        if not reduced:
            if granularity >= len(items):
                break
            granularity = min(len(items), granularity * 2)
    return items
