"""`derender parity`: the same token ids through every path, field by field.

Paths (`PATHS`):

- ``oneshot``: the one-shot derender endpoint (derender's fast decode);
- ``reference``: the same endpoint on vLLM's own per-token decode
  (``--decode reference``), the oracle of the fast one;
- ``replay`` and ``live``: the streaming derender endpoint in each mode,
  the stream assembled: replay is vLLM's own per-call path, decode
  included, and live derender's;
- ``serve`` and ``serve-oneshot``: `vllm serve`'s own handlers (the serve
  path), streamed (assembled) and not.

A request given as a one-shot body runs as it is on the one-shot paths and,
cut into a generate stream by each `Chunking` (``1``, ``3``, ``tail``,
``3+tail``), on the stream paths. A request given as stream bodies runs
with its own chunking on the stream paths and, joined into one generate
response (the way vLLM's own ``test_derender_parity.py`` joins a coupled
stream), on the one-shot paths.

Pairs compared (`pairs`), each when both paths run: ``oneshot`` with
``reference``; ``oneshot`` with ``serve-oneshot``; ``oneshot`` with the stream derender (``replay``, else
``live``); ``replay`` with ``live``; the stream derender with ``serve``;
``serve-oneshot`` with ``serve``. With recorded serve answers
(`from_serve`), the recording (``recorded``) is compared with every path.
Where the record and vLLM's stop logic disagree, the serve path's finding
is reported too, as field ``stop_logic`` between ``record`` and the serve
path that found it; where the record's prompt ids are not its request's
rendering, field ``prompt_token_ids`` between ``record`` and ``render``
(`prompts.prompt_divergences`).

Everything here is pure orchestration over `Derenderer` objects: no vLLM.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import orjson

from .compare import (
    DEFAULT_NORMALIZATION,
    Divergence,
    Examination,
    Normalization,
    Observed,
    compare,
)
from .errors import ConfigError, RecordError
from .logs import ROUTE, SERVE_LOGGER, LogKind, LogLine, collected_vllm_logs, count_logs, quieted
from .prompts import PromptRenderer, prompt_divergences
from .protocol import Answer, Call, Derenderer, Endpoint, FramesAnswer
from .records import Record, RequestIndex, call_body, derender_body
from .responses import Item, error_text
from .streams import ChunkFacts, StreamLedger
from .writers import Assembly

PATHS = ("oneshot", "reference", "replay", "live", "serve", "serve-oneshot")
STREAM_PATHS = frozenset({"replay", "live", "serve"})
SERVE_PATHS = frozenset({"serve", "serve-oneshot"})
"""The paths `vllm serve`'s own stack answers (one serve engine for both)."""
DERENDER_MODES: dict[str, dict[str, Any]] = {
    "oneshot": {"live": False, "decode": "fast"},
    "reference": {"live": False, "decode": "reference"},
    "replay": {"live": False, "decode": "reference"},
    "live": {"live": True, "decode": "fast"},
}
"""How the one render stack runs each derender path (`DerenderEngine.in_mode`)."""
RECORDED = "recorded"
"""The name of recorded serve answers in reports."""
RECORD = "record"
"""The name of the record itself, in stop-logic findings."""


@dataclass(frozen=True)
class Chunking:
    """How a one-shot response is cut into a generate stream: `size` tokens
    per chunk, and with `tail` the finish reason on a chunk of its own."""

    size: int = 1
    tail: bool = False

    @property
    def name(self) -> str:
        if self.tail:
            return "tail" if self.size == 1 else f"{self.size}+tail"
        return str(self.size)

    @classmethod
    def parse_list(cls, spec: str) -> list[Chunking]:
        """``"1,3,tail,3+tail"`` as chunkings."""
        chunkings = []
        for part in (p.strip() for p in spec.split(",")):
            size_text, _, rest = part.partition("+")
            tail = part == "tail" or rest == "tail"
            size_text = "1" if part == "tail" else size_text
            if not size_text.isdigit() or int(size_text) < 1 or (rest and rest != "tail"):
                raise ConfigError(
                    f"--chunking {spec!r}: each item is a chunk size (1, 3, ...), "
                    "'tail' or '<size>+tail'"
                )
            chunkings.append(cls(int(size_text), tail))
        return chunkings


@dataclass
class Request:
    """One request to run through the paths."""

    request_id: str
    one_shot: Any = None
    """The one-shot body (given, or joined from the stream)."""
    streams: list[tuple[str | None, list[Any]]] = field(default_factory=list)
    """Stream bodies per chunking name (None: the record's own chunking)."""
    recorded: Observed | None = None
    problem: str | None = None
    """Why the request cannot run (a body that cannot be converted)."""
    number: int = 0
    """Its place among the run's requests, from 1 (set as it is read)."""


# --- one-shot bodies and generate streams ----------------------------------


def stream_bodies(body: Mapping[str, Any], endpoint: Endpoint, chunking: Chunking) -> list[dict[str, Any]]:
    """A one-shot body as the streaming calls a client makes for the same
    tokens: choices interleaved one chunk at a time, as the engine emits
    them, then the usage chunk. The request streams with usage."""
    response, prompt_tokens, prompt_ids = one_response(body, endpoint)
    request = body.get(endpoint.request_key)
    stream_request = None if request is None else {**request, "stream": True, "stream_options": {"include_usage": True}}
    per_choice: list[list[dict[str, Any]]] = []
    completion_tokens = 0
    for choice in response.get("choices") or []:
        ids = list(choice.get("token_ids") or [])
        completion_tokens += len(ids)
        entries = (choice.get("logprobs") or {}).get("content")
        finish = choice.get("finish_reason", "stop")
        pieces = [ids[i : i + chunking.size] for i in range(0, len(ids), chunking.size)] or [[]]
        events = []
        start = 0
        for number, piece in enumerate(pieces):
            last = number == len(pieces) - 1 and not chunking.tail
            event: dict[str, Any] = {"index": choice.get("index", 0), "token_ids": piece, "finish_reason": finish if last else None}
            if last and choice.get("stop_reason") is not None:
                event["stop_reason"] = choice["stop_reason"]
            if entries is not None:
                event["logprobs"] = {"content": entries[start : start + len(piece)]}
            start += len(piece)
            events.append(event)
        if chunking.tail:
            tail = {"index": choice.get("index", 0), "token_ids": [], "finish_reason": finish}
            if choice.get("stop_reason") is not None:
                tail["stop_reason"] = choice["stop_reason"]
            events.append(tail)
        per_choice.append(events)
    request_id = response.get("request_id")
    chunks = [
        {"request_id": request_id, "choices": [events[turn]]}
        for turn in range(max((len(e) for e in per_choice), default=0))
        for events in per_choice
        if turn < len(events)
    ]
    prompt = prompt_tokens or 0  # what the one-shot endpoint reports without prompt_tokens
    chunks.append(
        {
            "request_id": request_id,
            "choices": [],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion_tokens, "total_tokens": prompt + completion_tokens},
        }
    )
    return [
        call_body(
            endpoint, chunk, stream=True, request=stream_request, prompt_tokens=prompt_tokens,
            prompt_token_ids=prompt_ids, model=body.get("model"),
        )  # fmt: skip
        for chunk in chunks
    ]


def one_response(body: Mapping[str, Any], endpoint: Endpoint) -> tuple[Mapping[str, Any], Any, Any]:
    """The generate response of a one-shot body, its prompt length and ids."""
    if endpoint is Endpoint.CHAT:
        response = body.get("generate_response")
        if not isinstance(response, Mapping):
            raise RecordError("the body has no generate_response")
        return response, body.get("prompt_tokens"), body.get("prompt_token_ids")
    responses = body.get("generate_responses")
    if not isinstance(responses, list) or len(responses) != 1 or not isinstance(responses[0], Mapping):
        raise RecordError("parity takes completion bodies with one generate response (one prompt)")
    prompt_tokens = body.get("prompt_tokens")
    prompt_ids = body.get("prompt_token_ids")
    return (
        responses[0],
        prompt_tokens[0] if isinstance(prompt_tokens, list) and prompt_tokens else None,
        prompt_ids[0] if isinstance(prompt_ids, list) and prompt_ids else None,
    )


def one_shot_body(bodies: list[Mapping[str, Any]], endpoint: Endpoint) -> dict[str, Any]:
    """A request's stream bodies joined into one one-shot body: per choice,
    the chunks' token ids and logprobs concatenated, the finish reason and
    stop reason of the chunk that finished it."""
    choices: dict[int, dict[str, Any]] = {}
    first = bodies[0]
    for body in bodies:
        for choice in body["generate_chunk"].get("choices") or []:
            index = choice.get("index", 0)
            joined = choices.setdefault(index, {"index": index, "token_ids": [], "finish_reason": None})
            joined["token_ids"] += list(choice.get("token_ids") or [])
            entries = (choice.get("logprobs") or {}).get("content")
            if entries is not None:
                joined.setdefault("logprobs", {"content": []})["content"] += entries
            if choice.get("finish_reason") is not None:
                joined["finish_reason"] = choice["finish_reason"]
                joined["stop_reason"] = choice.get("stop_reason")
    response = {"request_id": first["generate_chunk"].get("request_id"), "choices": [choices[i] for i in sorted(choices)]}
    request = first.get(endpoint.request_key)
    if request is not None:
        request = {k: v for k, v in request.items() if k not in ("stream", "stream_options")}
    return call_body(
        endpoint,
        response,
        stream=False,
        request=request,
        prompt_tokens=first.get("prompt_tokens"),
        prompt_token_ids=first.get("prompt_token_ids") or first["generate_chunk"].get("prompt_token_ids"),
        model=first.get("model"),
    )


# --- requests from the input -------------------------------------------------


def requests_of(
    records: Iterable[Record],
    endpoint: Endpoint,
    *,
    stream: bool,
    requests: RequestIndex | None,
    chunkings: list[Chunking],
) -> Iterator[Request]:
    """The input's requests, each once it is complete: a one-shot body at
    once, a stream when all its choices finished (and its usage chunk
    arrived, if asked for), or at the end of the input."""
    open_streams: dict[str | None, list[Any]] = {}
    ledger = StreamLedger()
    for record in records:
        if record.problem is not None:
            yield Request(f"line {record.line}", problem=f"not JSON: {record.problem.message}")
            continue
        try:
            body = derender_body(record.payload, endpoint, stream=stream, requests=requests)
        except RecordError as exc:
            yield Request(f"line {record.line}", problem=str(exc))
            continue
        if not isinstance(body, Mapping):
            yield Request(f"line {record.line}", problem="the record is not a JSON object")
            continue
        if body.get("stream") is True or "generate_chunk" in body:
            facts = ChunkFacts.of(body, endpoint)
            open_streams.setdefault(facts.request_id, []).append(body)
            # The ledger tracks progress only: these calls carry no state.
            if ledger.settle(facts, FramesAnswer([])):
                yield _stream_request(facts.request_id, open_streams.pop(facts.request_id), endpoint)
            continue
        yield _one_shot_request(body, endpoint, chunkings)
    for request_id, bodies in open_streams.items():
        yield _stream_request(request_id, bodies, endpoint)


def _one_shot_request(body: Mapping[str, Any], endpoint: Endpoint, chunkings: list[Chunking]) -> Request:
    try:
        response, _, _ = one_response(body, endpoint)
        request = Request(str(response.get("request_id")), one_shot=body)
        request.streams = [(c.name, stream_bodies(body, endpoint, c)) for c in chunkings]
    except (RecordError, TypeError, AttributeError) as exc:
        return Request(str(body.get("request_id", "?")), one_shot=body, problem=str(exc))
    return request


def _stream_request(request_id: str | None, bodies: list[Any], endpoint: Endpoint) -> Request:
    try:
        joined = one_shot_body(bodies, endpoint)
    except (KeyError, TypeError, AttributeError) as exc:
        return Request(str(request_id), streams=[(None, bodies)], problem=f"cannot join the stream: {exc}")
    return Request(str(request_id), one_shot=joined, streams=[(None, bodies)])


# --- recorded serve answers ----------------------------------------------------


def from_serve(items: Iterable[Item], endpoint: Endpoint, requests: RequestIndex) -> Iterator[Request]:
    """Recorded `vllm serve` answers (made with ``return_token_ids: true``)
    as derender inputs, the way vLLM's ``test_derender_parity.py`` derives
    them: the answer's token ids become the generate output (a stream's
    frames one chunk each, its role frame left out), ``tool_calls`` goes back
    to the engine's ``stop``, the prompt comes from the answer or the
    requests file. The request is found by the answer's id less serve's
    ``chatcmpl-`` (``cmpl-``) prefix."""
    prefix = "chatcmpl-" if endpoint is Endpoint.CHAT else "cmpl-"
    for item in items:
        request_id = item.key.removeprefix(prefix)
        recorded = item.observed()
        original = requests.lookup(request_id)
        if original is None or original.get(endpoint.request_key) is None:
            yield Request(request_id, recorded=recorded, problem=f"no {endpoint.request_key} for {request_id!r} in {requests.path}")
            continue
        try:
            if item.streamed:
                bodies = _recorded_stream(item.chunks or [], request_id, original, endpoint)
                yield Request(request_id, one_shot=one_shot_body(bodies, endpoint), streams=[(None, bodies)], recorded=recorded)
            else:
                body = _recorded_response(item.response or {}, request_id, original, endpoint)
                yield Request(request_id, one_shot=body, recorded=recorded)
        except RecordError as exc:
            yield Request(request_id, recorded=recorded, problem=str(exc))


def _engine_choice(choice: Mapping[str, Any]) -> dict[str, Any]:
    token_ids = choice.get("token_ids")
    if token_ids is None:
        raise RecordError("the recorded answer has no token_ids: record it with return_token_ids: true")
    finish = choice.get("finish_reason")
    engine_choice = {
        "index": choice.get("index", 0),
        "token_ids": token_ids,
        "finish_reason": "stop" if finish == "tool_calls" else finish,
    }
    if choice.get("stop_reason") is not None:
        engine_choice["stop_reason"] = choice["stop_reason"]
    return engine_choice


def _recorded_response(
    response: Mapping[str, Any], request_id: str, original: Mapping[str, Any], endpoint: Endpoint
) -> dict[str, Any]:
    choices = [_engine_choice(c) for c in response.get("choices") or []]
    prompt_ids = response.get("prompt_token_ids") or original.get("prompt_token_ids")
    usage = response.get("usage") or {}
    body = one_shot_body(
        [
            {
                "generate_chunk": {"request_id": request_id, "choices": choices},
                "prompt_tokens": usage.get("prompt_tokens"),
                "prompt_token_ids": prompt_ids,
                endpoint.request_key: original[endpoint.request_key],
            }
        ],
        endpoint,
    )
    return body


def _recorded_stream(
    chunks: list[Mapping[str, Any]], request_id: str, original: Mapping[str, Any], endpoint: Endpoint
) -> list[dict[str, Any]]:
    prompt_ids = next((c["prompt_token_ids"] for c in chunks if c.get("prompt_token_ids")), None)
    prompt_ids = prompt_ids or original.get("prompt_token_ids")
    request = {**original[endpoint.request_key], "stream": True}
    bodies = []
    for chunk in chunks:
        for choice in chunk.get("choices") or []:
            if choice.get("token_ids") is None and choice.get("finish_reason") is None:
                continue  # the role frame: no engine step
            generate = {"request_id": request_id, "choices": [_engine_choice({**choice, "token_ids": choice.get("token_ids") or []})]}
            bodies.append(_stream_body(generate, prompt_ids, request, endpoint))
        if not chunk.get("choices") and chunk.get("usage"):
            bodies.append(_stream_body({"request_id": request_id, "choices": [], "usage": chunk["usage"]}, prompt_ids, request, endpoint))
    if not bodies:
        raise RecordError("the recorded stream has no frame with token_ids: record it with return_token_ids: true")
    return bodies


def _stream_body(chunk: dict[str, Any], prompt_ids: Any, request: Mapping[str, Any], endpoint: Endpoint) -> dict[str, Any]:
    return call_body(
        endpoint, chunk, stream=True, request=request,
        prompt_tokens=None if prompt_ids is None else len(prompt_ids), prompt_token_ids=prompt_ids,
    )  # fmt: skip


# --- running and comparing ---------------------------------------------------


def pairs(paths: Iterable[str], recorded: bool = False) -> list[tuple[str, str]]:
    """The (left, right) path pairs compared, in report order."""
    chosen = [p for p in PATHS if p in set(paths)]
    if recorded:
        return [(RECORDED, path) for path in chosen]
    stream_derender = next((p for p in ("replay", "live") if p in chosen), None)
    candidates = [
        ("oneshot", "reference"),
        ("oneshot", "serve-oneshot"),
        ("oneshot", stream_derender),
        ("replay", "live"),
        (stream_derender, "serve"),
        ("serve-oneshot", "serve"),
    ]
    found: list[tuple[str, str]] = []
    for left, right in candidates:
        if left in chosen and right in chosen and (left, right) not in found:
            found.append((left, right))  # type: ignore[arg-type]
    return found


class LogTally:
    """vLLM's log records while the paths ran, counted per kind, each with
    the id of the request that first logged it: a parser's traceback for a
    cut tool call comes once per path, so a run would otherwise print it
    many times. Requests are added in input order, wherever they ran."""

    def __init__(self) -> None:
        self._logs: list[LogKind] = []
        self._first_logged_by: dict[int, str] = {}
        self._examined = 0

    def add(self, request_id: str, logged: Sequence[Any]) -> None:
        self._examined += 1
        if logged:
            kinds = len(self._logs)
            count_logs(self._logs, list(logged), self._examined)
            if len(self._logs) > kinds:
                self._first_logged_by[self._examined] = request_id

    @property
    def kinds(self) -> list[tuple[LogKind, str]]:
        return [(kind, self._first_logged_by[kind.first_record]) for kind in self._logs]


class Parity:
    """Runs requests through the chosen paths and compares them.

    `engines` maps each path to the `Derenderer` that runs it (one engine in
    two modes serves ``replay`` and ``live``; one serve engine serves both
    serve paths). An engine that keeps stop-logic findings (a ``findings``
    list, as the serve path's) has them reported.
    """

    def __init__(
        self,
        engines: Mapping[str, Derenderer],
        endpoint: Endpoint,
        *,
        ignore: Iterable[str] = (),
        normalization: Normalization = DEFAULT_NORMALIZATION,
    ) -> None:
        self.engines = dict(engines)
        self.endpoint = endpoint
        self.ignore = frozenset(ignore)
        self.normalization = normalization
        # The record's prompt ids are checked against the render endpoint
        # of a derender path's engine (the serve path's renders the same).
        renderer = next((engines[p] for p in DERENDER_MODES if p in engines), next(iter(engines.values()), None))
        self.prompts = None if renderer is None else PromptRenderer(renderer)
        self.tally = LogTally()
        self._logging_to: list[LogLine] = []
        """The log lines of the request whose script started last (`_examine_window`)."""

    @property
    def logs(self) -> list[tuple[LogKind, str]]:
        """vLLM's log records while the paths ran (`LogTally`)."""
        return self.tally.kinds

    def run(self, request: Request) -> list[Divergence]:
        """Every divergence between the paths for one request (one that
        cannot run, `Request.problem`, has none: the caller reports it)."""
        return self.examine(request).divergences

    def examine(self, request: Request) -> Examination:
        """What every path answered for one request, the token ids it was
        given, and every divergence between the paths (none, and nothing
        observed, for a request that cannot run)."""
        return self._examine_window([request])[0]

    def examined(
        self, requests: Iterable[Request], *, window: int | None = None
    ) -> Iterator[tuple[Request, Examination]]:
        """`examine` for each request, in order, `window` requests at a
        time (by default the most any path answers together,
        `Derenderer.window`): each path gets the window's requests together
        (`Derenderer.drive`: the serve path answers them as one batch), so
        only a window is held at once. Each examination is the one
        `examine` gives the request alone."""
        window = window or max((engine.window for engine in self.engines.values()), default=1)
        requests = iter(requests)
        while chunk := list(islice(requests, window)):
            yield from zip(chunk, self._examine_window(chunk, window=window), strict=True)

    def _examine_window(self, requests: list[Request], *, window: int = 1) -> list[Examination]:
        """Each request through every path, path by path over the window.

        Each request's answers, stop-logic findings (carried by the answers
        that found them) and vLLM log lines (routed by the context each
        request's calls run in, `logs.ROUTE`) are its own, in path order, as
        when it runs alone. Lines logged outside any request's context
        (vLLM's output handler, a thread) go to the request whose script
        started last: on a path that answers one request at a time, the
        one whose call is running, as when it runs alone.
        """
        runnable = [request for request in requests if request.problem is None]
        observed: dict[int, dict[tuple[str, str | None], Observed]] = {id(r): {} for r in runnable}
        findings: dict[int, list[Divergence]] = {id(r): [] for r in runnable}
        seen_findings: dict[int, set[tuple[Any, ...]]] = {id(r): set() for r in runnable}
        logged: dict[int, list[LogLine]] = {id(r): [] for r in runnable}
        # The serve path logs each stop-logic finding as it runs (once per
        # serve path); here each is one `stop_logic` divergence instead.
        self._logging_to = logged[id(runnable[0])] if runnable else []
        with quieted(SERVE_LOGGER), collected_vllm_logs(verbose=False, sink=self._log_elsewhere):
            for path, engine in self.engines.items():
                scripts = (self._path_script(path, r, logged[id(r)]) for r in runnable)
                for request, (seen, found) in zip(runnable, engine.drive(scripts, window=window), strict=True):
                    observed[id(request)].update(seen)
                    for finding in found:
                        key = (finding.index, finding.recorded, finding.vllm)
                        if key not in seen_findings[id(request)] and "stop_logic" not in self.ignore:
                            seen_findings[id(request)].add(key)
                            findings[id(request)].append(
                                Divergence(request.request_id, finding.index, RECORD, path, "stop_logic", finding.recorded, finding.vllm)
                            )
            if self.prompts is not None and "prompt_token_ids" not in self.ignore:
                for request in runnable:
                    self._logging_to = logged[id(request)]
                    route = ROUTE.set(logged[id(request)].append)
                    try:
                        findings[id(request)] += prompt_divergences(
                            self.prompts, self.endpoint, request.request_id, request.one_shot
                        )
                    finally:
                        ROUTE.reset(route)
        examinations = []
        for request in requests:
            if request.problem is not None:
                examinations.append(Examination(request.request_id))
                continue
            self.tally.add(request.request_id, logged[id(request)])
            examinations.append(self._compared(request, observed[id(request)], findings[id(request)], logged[id(request)]))
        return examinations

    def _compared(
        self, request: Request, observed: dict[tuple[str, str | None], Observed], findings: list[Divergence],
        logged: list[LogLine],
    ) -> Examination:  # fmt: skip
        divergences: list[Divergence] = []
        if request.recorded is not None:
            observed[(RECORDED, None)] = request.recorded
        for left, right in pairs(self.engines, recorded=request.recorded is not None):
            for (lpath, lchunk), left_seen in observed.items():
                for (rpath, rchunk), right_seen in observed.items():
                    if lpath != left or rpath != right:
                        continue
                    if lchunk is not None and rchunk is not None and lchunk != rchunk:
                        continue
                    divergences += compare(
                        left, left_seen, right, right_seen,
                        request_id=request.request_id, ignore=self.ignore,
                        normalization=self.normalization, chunking=lchunk or rchunk,
                    )  # fmt: skip
        return Examination(
            request.request_id, observed, divergences + findings,
            calls={chunking: [_call_token_ids(body) for body in bodies] for chunking, bodies in request.streams},
            token_ids=self._one_shot_token_ids(request.one_shot), logs=tuple(logged),
        )  # fmt: skip

    def _log_elsewhere(self, line: LogLine) -> None:
        """Where a line logged outside every request's context goes."""
        self._logging_to.append(line)

    def _one_shot_token_ids(self, body: Any) -> dict[int, list[int]]:
        try:
            response, _, _ = one_response(body, self.endpoint)
        except (RecordError, AttributeError):
            return {}
        return _choice_ids(response.get("choices"))

    def _path_script(
        self, path: str, request: Request, logged: list[LogLine]
    ) -> Generator[Call, Answer, tuple[dict[tuple[str, str | None], Observed], list[Any]]]:
        """The calls one path makes for one request (a `protocol.Script`):
        what it observed, and the stop-logic findings its answers carried."""
        ROUTE.set(logged.append)  # in the script's own context
        self._logging_to = logged
        observed: dict[tuple[str, str | None], Observed] = {}
        found: list[Any] = []
        if path in STREAM_PATHS:
            for chunking, bodies in request.streams:
                observed[(path, chunking)] = yield from self._stream(bodies, found)
        elif request.one_shot is not None:
            observed[(path, None)] = yield from self._one_shot(request.one_shot, found)
        return observed, found

    def _one_shot(self, body: Any, found: list[Any]) -> Generator[Call, Answer, Observed]:
        answer = yield self.endpoint, body
        found += answer.findings
        if not answer.ok:
            return Observed(error=error_text(answer.body))
        return Observed(response=answer.body)

    def _stream(self, bodies: list[Any], found: list[Any]) -> Generator[Call, Answer, Observed]:
        ledger = StreamLedger()
        assembly = Assembly(self.endpoint)
        chunks: list[dict[str, Any]] = []
        calls: list[int] = []
        for body in bodies:
            facts = ChunkFacts.of(body, self.endpoint)
            answer = yield self.endpoint, ledger.with_state(body, facts)
            found += answer.findings
            ledger.settle(facts, answer)
            if not answer.ok:
                return Observed(error=error_text(answer.body))
            assembly.take(answer)
            chunks += answer.chunks
            # Each frame counts with the call it answers, which serve's may precede.
            calls.append(0)
            for late in getattr(answer, "late", None) or [0] * len(answer.chunks):
                calls[max(len(calls) - 1 - late, 0)] += 1
        if assembly.error is not None:
            return Observed(error=error_text(orjson.loads(assembly.error)))
        # As a client assembles it, the same way recorded streams are read.
        return Observed(response=assembly.fields(), chunks=chunks, calls=calls)


def _call_token_ids(body: Any) -> dict[int, list[int]]:
    """The token ids one stream call carries, per choice index."""
    chunk = body.get("generate_chunk") if isinstance(body, Mapping) else None
    return _choice_ids(chunk.get("choices") if isinstance(chunk, Mapping) else None)


def _choice_ids(choices: Any) -> dict[int, list[int]]:
    """The token ids of generate choices, per index, whatever a record put
    there (they are shown, never compared: what is not ids is left out)."""
    found: dict[int, list[int]] = {}
    for choice in choices if isinstance(choices, list) else []:
        index = choice.get("index", 0) if isinstance(choice, Mapping) else None
        if isinstance(index, int):
            token_ids = choice.get("token_ids")  # type: ignore[union-attr]
            found[index] = [i for i in token_ids if isinstance(i, int)] if isinstance(token_ids, list) else []
    return found
