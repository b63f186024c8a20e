"""The coupled `vllm serve` path, in process, on CPU, from recorded token ids.

`ServeEngine` answers the derender endpoints' bodies with what a client of
`vllm serve` reads for the same request and tokens: ``POST
/v1/chat/completions`` (or ``/v1/completions``) streamed as SSE, or as the
non-stream JSON. Everything from the HTTP handler down to the engine core
client is vLLM's own, built as `vllm serve` builds it for the same flags
(``build_async_engine_client``, ``init_app_state``): ``OpenAIServingChat``
and ``OpenAIServingCompletion``, the renderer, a real ``AsyncLLM`` with its
input processor, output processor (incremental detokenizer, stop strings)
and request output collectors.

Only the engine core is a script (`_ScriptedEngineCore`, put in place of
``EngineCoreClient.make_async_mp_client`` while the stack is built): it
holds a real ``v1.Request`` per engine request and, per recorded step,
runs vLLM's own stop logic (``Scheduler._update_request_with_output``,
``check_stop``) and emits one ``EngineCoreOutputs``. No executor, model
runner or weights start.

Which recorded tokens make an engine step:

- a one-shot body: one token per step, every choice in the same step, as
  an engine without speculative decoding emits them. With fast path
  ``serve_bulk``, a request without stop strings runs vLLM's stop logic
  per token just so, and hands each choice's tokens to the output
  processor as one step (`_merge_ok` says why serve's answer cannot tell);
- a stream body: its chunk is one step, in the order the chunks come. A
  chunk without a finish reason is held until the next chunk of its choice
  arrives, because a finish-only tail chunk (no tokens, a finish reason)
  cannot be an engine step: it finishes the held step instead. A step that
  is decided waits for undecided steps that came before it, so the order
  stays the record's.

Where the record and vLLM's stop logic disagree (a recorded ``length``
with a larger ``max_tokens``, tokens after a stop token), the recorded
finish wins and the disagreement is kept in `ServeEngine.findings` (and
logged): serve would have ended elsewhere. A stop string is found by the
output processor, as in serving; when it ends a request the record goes on
with, serve's end stands, and that too is a finding.

Steps are paced: after each step the loop runs until every task waits
again, so the collector is drained before the next step and steps never
merge into one frame.

A stream call is validated as the derender endpoint validates it, its
request once per stream (fast path ``requests``), and with fast path
``serve_lane`` a usual call (one choice of ids, no finish, stop reason or
logprobs, the stream's first request and prompt ids) not at all: its
validation is the identity (`ServeEngine._usual_chunk`).

Many requests at once (`ServeEngine.drive`, `post_many`): up to a window of
requests run as tasks on the one event loop and the one ``AsyncLLM``, as
`vllm serve` serves the requests in flight. One pacer (`_Pacer`) makes the
engine steps: when every task waits, it emits the next step of every
request that has one as one ``EngineCoreOutputs``, lets the stack answer
it, then wakes them all. Why that cannot change a request's frames:

- what each request's steps carry is fixed by its own record (token ids,
  logprobs, finish) and decided by its own ``v1.Request``; nothing of
  another request goes into them;
- each request still gets exactly one output per ``EngineCoreOutputs`` and
  the stack settles before the next one, so its collector never merges two
  steps, whatever else the step holds: its sequence of outputs is the one
  it gets alone;
- everything downstream is per request in vLLM (the output processor's
  request state and detokenizer, the collector, the handler's generator
  and parsers; engine request ids are made unique by vLLM), and the serve
  path's own state is per request too: a script's streams are kept under
  its own key, the engine requests a handler adds go to the request whose
  context added them (`_OPENING`), a call's findings to that call;
- ids and ``created`` are the request's own or the clock's, as alone.

The tests compare a batched run with a one-at-a-time run byte for byte.

The answer to a stream call carries the frames serve sent during that call
(`FramesAnswer`): the first released step brings the role frame, a step
whose delta is empty brings none, the last finishing step brings the usage
frame after it. Since a step is held until its choice's next chunk, with
one choice the answer to chunk *k* carries the frames of chunk *k - 1*
and the finishing call carries the rest. Concatenated, a stream's answers
are serve's transcript (less the final ``data: [DONE]``, which the SSE
writer adds).

Not supported, rejected with a 400 error record: prompt logprobs, beam
search, and completions with more than one prompt.

Response ids follow serve's rule, ``chatcmpl-<id>`` (``cmpl-<id>`` for
completions), with the record's ``request_id`` as the id: what serve
answers when the client sends it as ``X-Request-Id``.

All of this drives private vLLM 0.33 internals; `SEAM_NAMES` lists them and
the tests check they still exist.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import gc
import itertools
import logging
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from ..config import RenderConfig
from ..errors import ConfigError
from ..protocol import WINDOW, Answer, Endpoint, FramesAnswer, Script
from . import versions
from .answers import json_answer
from .render import DerenderEngine, _finish, _validation_loggers, collector_paused
from .renderer import RenderHalf
from .stack import prepare_environment, server_args, show_warnings_from_now_on

if TYPE_CHECKING:
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
    from vllm.v1.request import Request

logger = logging.getLogger("derender.serve")
_T = TypeVar("_T")

STREAMS_KEPT = 4096
"""Serve streams kept open at once (and ended ones remembered); the oldest
open one is closed beyond that."""

FINDINGS_KEPT = 10_000
"""Stop-logic findings kept in memory; later ones are counted and logged."""

_SSE_DONE = "data: [DONE]\n\n"
_WAIT_SECONDS = 120.0
"""How long a request may take to reach the engine (rendering runs in
vLLM's thread pool) or to finish after its last step."""

_OPENING: contextvars.ContextVar[_ServeRun | None] = contextvars.ContextVar("serve_opening", default=None)
"""The request whose handler is starting: the engine requests added from
its context (the handler's task, the stream's reader) are its children."""
_RAW: contextvars.ContextVar[Any] = contextvars.ContextVar("serve_raw_body", default=None)
"""The call's body as given: the handler re-reads the original request from it."""
_FOUND: contextvars.ContextVar[list[StopFinding] | None] = contextvars.ContextVar("serve_found", default=None)
"""The current call's stop-logic findings, given with its answer."""
_SCRIPT: contextvars.ContextVar[int | None] = contextvars.ContextVar("serve_script", default=None)
"""The script a call belongs to (`ServeEngine.drive`): its streams are kept
apart from any other's with the same request id; None for `post`."""

SEAM_NAMES: tuple[tuple[str, str], ...] = (
    ("vllm.v1.engine.core_client", "EngineCoreClient.make_async_mp_client"),
    ("vllm.v1.core.sched.scheduler", "Scheduler._update_request_with_output"),
    ("vllm.v1.core.sched.utils", "check_stop"),
    ("vllm.v1.request", "Request.from_engine_core_request"),
    ("vllm.v1.request", "Request.append_output_token_ids"),
    ("vllm.v1.request", "RequestStatus.FINISHED_LENGTH_CAPPED"),
    ("vllm.v1.engine", "EngineCoreOutput"),
    ("vllm.v1.engine", "EngineCoreOutputs"),
    ("vllm.v1.engine", "FinishReason"),
    ("vllm.sampling_params", "RequestOutputKind.FINAL_ONLY"),
    ("vllm.v1.engine.async_llm", "AsyncLLM.generate"),
    ("vllm.entrypoints.launchers.api_server.entry", "build_async_engine_client"),
    ("vllm.entrypoints.launchers.api_server.app_state", "init_app_state"),
    ("vllm.entrypoints.openai.chat_completion.serving", "OpenAIServingChat.create_chat_completion"),
    ("vllm.entrypoints.openai.completion.serving", "OpenAIServingCompletion.create_completion"),
)
"""The vLLM internals the serve path relies on (module, attribute path)."""


@dataclass(frozen=True)
class StopFinding:
    """A place where the record and vLLM's stop logic disagree, each side
    as "<finish> at token <n>" or "not finished at token <n>"."""

    request_id: str
    index: int
    recorded: str
    vllm: str

    def __str__(self) -> str:
        return (
            f"request {self.request_id!r} choice {self.index}: the record has {self.recorded}, "
            f"vLLM's stop logic has {self.vllm}"
        )


@dataclass(frozen=True)
class _Piece:
    """One choice's share of an engine step, as the record has it."""

    index: int
    token_ids: list[int]
    logprobs: list[Any] | None = None
    """Generate logprob entries, one per token (integer token ids)."""
    finish: str | None = None
    stop_reason: int | str | None = None
    call: int = 0
    """The call of its stream that brought it (its frames answer that call)."""


def _at(finish: str | None, stop_reason: int | str | None, tokens: int) -> str:
    """How one side ends a step: "length at token 30", "not finished at token 12"."""
    if finish is None:
        return f"not finished at token {tokens}"
    reason = finish if stop_reason is None else f"{finish} ({stop_reason!r})"
    return f"{reason} at token {tokens}"


class _ScriptedEngineCore:
    """vLLM's engine core as a script: requests are added and aborted as
    usual; outputs come from `advance`, one ``EngineCoreOutputs`` per
    recorded step, through vLLM's own stop logic on a real ``v1.Request``.

    Built by `_scripted_client_class` as a subclass of vLLM's
    ``EngineCoreClient``, so ``AsyncLLM`` sees the interface it expects.
    """

    def __init__(self, max_model_len: int) -> None:
        # What AsyncLLM reads of a client besides its methods.
        self.resources = SimpleNamespace(engine_dead=False)
        self.engine_ranks_managed = [0]
        # The scheduler state _update_request_with_output reads.
        self._scheduler = SimpleNamespace(max_model_len=max_model_len)
        self._outputs: asyncio.Queue[EngineCoreOutputs] | None = None
        self._by_id: dict[str, Request] = {}

    # --- EngineCoreClient, as AsyncLLM calls it ---------------------------

    def shutdown(self, timeout: float | None = None) -> None:
        self._by_id.clear()

    async def get_supported_tasks_async(self) -> tuple[str, ...]:
        return ("generate",)

    async def reset_mm_cache_async(self) -> None:
        pass

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        from vllm.v1.request import Request

        engine_request = Request.from_engine_core_request(request, None)
        opening = _OPENING.get()
        if opening is not None:
            opening.children.append(engine_request)  # a request's n children, by index
        self._by_id[engine_request.request_id] = engine_request

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        from vllm.v1.request import RequestStatus

        for request_id in request_ids:
            request = self._by_id.pop(request_id, None)
            if request is not None and not request.is_finished():
                request.status = RequestStatus.FINISHED_ABORTED

    async def get_output_async(self) -> EngineCoreOutputs:
        return await self._queue().get()

    # --- the script --------------------------------------------------------

    def _queue(self) -> asyncio.Queue[EngineCoreOutputs]:
        if self._outputs is None:
            self._outputs = asyncio.Queue()
        return self._outputs

    def release(self, requests: list[Request]) -> None:
        for request in requests:
            self._by_id.pop(request.request_id, None)

    def emit(self, outputs: list[EngineCoreOutput]) -> None:
        from vllm.v1.engine import EngineCoreOutputs

        self._queue().put_nowait(EngineCoreOutputs(outputs=outputs))

    def advance(
        self, request: Request, piece: _Piece, note: Callable[[str, str], None]
    ) -> EngineCoreOutput | None:
        """One engine step of `request` with the recorded tokens and finish.

        vLLM's stop logic runs first; where it agrees with the record its
        output is emitted as is. Where it does not, the record wins and
        `note` hears of it. A string stop reason is the output processor's
        to find, so at this level the record expects the step unfinished.
        None when serve has already ended the request.
        """
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.engine import EngineCoreOutput, FinishReason
        from vllm.v1.request import RequestStatus

        token_ids, finish, stop_reason = piece.token_ids, piece.finish, piece.stop_reason
        new_logprobs = (
            _logprobs_lists(piece.logprobs or [])
            if request.sampling_params is not None and request.sampling_params.logprobs is not None
            else None
        )
        engine_finish = None if isinstance(stop_reason, str) and finish == "stop" else finish
        engine_stop_reason = stop_reason if engine_finish is not None else None
        if request.is_finished():
            note(
                _at(finish, stop_reason, request.num_output_tokens + len(token_ids)),
                f"stop at token {request.num_output_tokens} (a stop string, found by serve's detokenizer)",
            )
            return None
        if engine_finish is not None and engine_finish.upper() not in FinishReason.__members__:
            raise ValueError(f"unknown finish_reason {finish!r}")

        request.status = RequestStatus.RUNNING
        # As after the scheduler's step: computed covers all but the new last token.
        request.num_computed_tokens = request.num_tokens + len(token_ids) - 1
        kept, stopped = Scheduler._update_request_with_output(
            self._scheduler, request, list(token_ids)
        )
        vllm_finish = request.get_finished_reason() if stopped else None
        vllm_view = (len(kept), None if vllm_finish is None else str(vllm_finish), request.stop_reason)
        # A record without a stop reason leaves it to vLLM (older generate
        # hosts never report one for a stop token id).
        expected_stop_reason = request.stop_reason if engine_stop_reason is None else engine_stop_reason
        if vllm_view == (len(token_ids), engine_finish, expected_stop_reason):
            return EngineCoreOutput(
                request_id=request.request_id,
                new_token_ids=kept,
                new_logprobs=new_logprobs,
                finish_reason=vllm_finish,
                stop_reason=request.stop_reason,
            )

        vllm_said = _at(vllm_view[1], vllm_view[2], request.num_output_tokens)
        if len(kept) < len(token_ids):
            request.append_output_token_ids(token_ids[len(kept) :])
        note(_at(engine_finish, engine_stop_reason, request.num_output_tokens), vllm_said)
        reason = None if engine_finish is None else FinishReason[engine_finish.upper()]
        request.status = RequestStatus.RUNNING if reason is None else _STATUS_OF[reason.name]
        request.stop_reason = engine_stop_reason
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=list(token_ids),
            new_logprobs=new_logprobs,
            finish_reason=reason,
            stop_reason=engine_stop_reason,
        )

    def advance_merged(
        self, request: Request, piece: _Piece, note: Callable[[str, str], None]
    ) -> EngineCoreOutput:
        """`piece`'s tokens taken as `advance` takes them one engine step
        each, handed to the output processor as one output: the same
        tokens, logprobs and finish, as an engine that makes several
        tokens a step hands them over (`_merge_ok` says when serve answers
        that as it answers one token a step).

        vLLM's stop logic runs per token as in one step each: its loop over
        a step's tokens stops at the first stop, which for a token before
        the record's last is a disagreement, noted and overruled as
        `advance` does for that token alone, and the loop goes on after it.
        """
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.request import RequestStatus

        leading = piece.token_ids[:-1]
        while leading:
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = request.num_tokens + len(leading) - 1
            kept, stopped = Scheduler._update_request_with_output(self._scheduler, request, list(leading))
            if not stopped:
                break
            finish = request.get_finished_reason()
            tokens = request.num_output_tokens
            note(_at(None, None, tokens), _at(None if finish is None else str(finish), request.stop_reason, tokens))
            request.status = RequestStatus.RUNNING
            request.stop_reason = None
            leading = leading[len(kept) :]
        output = self.advance(request, replace(piece, token_ids=piece.token_ids[-1:], logprobs=None), note)
        if output is None:
            raise RuntimeError("serve ended a request before its last token with no stop string")
        output.new_token_ids = list(piece.token_ids)
        if request.sampling_params is not None and request.sampling_params.logprobs is not None:
            output.new_logprobs = _logprobs_lists(piece.logprobs or [])
        return output

    def finish_unmatched_stop_string(
        self, request: Request, stop_string: str, note: Callable[[str, str], None]
    ) -> EngineCoreOutput | None:
        """After the step the record ends with a stop string: if the output
        processor did not find it, end the request as the record says."""
        from vllm.v1.engine import EngineCoreOutput, FinishReason
        from vllm.v1.request import RequestStatus

        if request.is_finished():  # found it, and aborted the request
            return None
        tokens = request.num_output_tokens
        note(_at("stop", stop_string, tokens), f"not finished at token {tokens} (no stop string found)")
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = stop_string
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=[],
            finish_reason=FinishReason.STOP,
            stop_reason=stop_string,
        )


_STATUS_OF: dict[str, Any] = {}


def _logprobs_lists(entries: list[Any]) -> Any:
    """The sampler's logprobs for a step, rebuilt from generate's entries.

    Generate lists a position's candidates as the engine's dict has them:
    the sampled token first, then the top-k in rank order, the sampled one
    merged into its rank if it is among them. The engine's row is the
    sampled token, then the top-k by rank (the sampled one again at its
    rank), so the output processor builds the same dict from it.
    """
    import numpy as np
    from vllm.v1.outputs import LogprobsLists

    token_ids, logprobs, ranks = [], [], []
    for entry in entries:
        top = sorted(entry.top_logprobs, key=lambda t: (t.rank is None, t.rank or 0))
        token_ids.append(np.array([entry.token_id, *(t.token_id for t in top)], dtype=np.int64))
        logprobs.append(np.array([entry.logprob, *(t.logprob for t in top)], dtype=np.float64))
        ranks.append(entry.rank or 0)
    return LogprobsLists(token_ids, logprobs, np.array(ranks, dtype=np.int64))


def _scripted_client_class() -> type:
    """`_ScriptedEngineCore` as a subclass of vLLM's ``EngineCoreClient``."""
    from vllm.v1.engine.core_client import EngineCoreClient
    from vllm.v1.request import RequestStatus

    if not _STATUS_OF:
        _STATUS_OF.update(
            STOP=RequestStatus.FINISHED_STOPPED,
            LENGTH=RequestStatus.FINISHED_LENGTH_CAPPED,
            ABORT=RequestStatus.FINISHED_ABORTED,
            ERROR=RequestStatus.FINISHED_ERROR,
            REPETITION=RequestStatus.FINISHED_REPETITION,
        )
    return type("ScriptedEngineCoreClient", (_ScriptedEngineCore, EngineCoreClient), {})


@contextlib.contextmanager
def _scripted_engine_core(max_model_len: Callable[[Any], int]) -> Iterator[list[Any]]:
    """While active, ``AsyncLLM`` gets a scripted engine core instead of
    starting an engine process; the clients made are appended to the list."""
    from vllm.v1.engine.core_client import EngineCoreClient

    made: list[Any] = []
    client_class = _scripted_client_class()

    def make_async_mp_client(vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
        client = client_class(max_model_len(vllm_config))
        made.append(client)
        return client

    original = EngineCoreClient.__dict__["make_async_mp_client"]
    EngineCoreClient.make_async_mp_client = staticmethod(make_async_mp_client)  # type: ignore[method-assign]
    try:
        yield made
    finally:
        EngineCoreClient.make_async_mp_client = original  # type: ignore[method-assign]


async def _serve_stack(args: Any, resources: contextlib.AsyncExitStack) -> tuple[Any, Any]:
    """What `vllm serve` builds for `args` (engine client, then app state),
    on a scripted engine core. Returns the app state and the core."""
    from starlette.datastructures import State
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client

    with _scripted_engine_core(lambda config: config.model_config.max_model_len) as made:
        engine_client = await resources.enter_async_context(build_async_engine_client(args))
    (core,) = made
    state = State()
    await init_app_state(engine_client, state, args, await engine_client.get_supported_tasks())
    return state, core


def _forget_signatures() -> None:
    """Empty vLLM's ``supports_kw`` memo, so that a closed stack's
    tokenizer copies go with it.

    The stack's renderer reads its tokenizer's ``apply_chat_template``
    signature through that memo (an ``lru_cache`` of 128 entries), keyed
    by the function. The tokenizer is a pool (vLLM's
    ``maybe_make_thread_pool``): a class made per stack, whose method's
    closure holds the pool's deep copies of the tokenizer. So every stack
    built and closed left them pinned until 128 later entries pushed them
    out, about 145 MB a stack for Qwen3's vocabulary. The memo only spares
    a signature read; a live stack reads its own again once."""
    from vllm.utils import func_utils

    cache_clear = getattr(getattr(func_utils, "_supports_kw", None), "cache_clear", None)
    if cache_clear is not None:
        cache_clear()


async def _until_idle() -> None:
    """Run the loop until every task waits for something only a new engine
    step (or a thread) can give.

    Once a request is in the engine, serving it is synchronous between
    awaits on the loop (output handler, collector, stream generator), so an
    empty ready queue means the step has been fully answered.
    """
    loop = asyncio.get_running_loop()
    for _ in range(1_000_000):
        await asyncio.sleep(0)
        if not loop._ready:  # type: ignore[attr-defined]
            return
    raise RuntimeError("the serve stack did not settle")


class _Pacer:
    """The engine core's steps for every request in flight.

    A request's task hands in its step's outputs (`step`) or only waits for
    the stack to settle (`settled`), and waits. When every task on the loop
    waits, the pacer emits all the outputs handed in as one
    ``EngineCoreOutputs`` (one engine step of the batch), runs the loop
    until the stack has answered it, and wakes every waiting task. A task
    hands in at most one step before it is woken, so a request never has
    two outputs in one step. Alone, this is one request's step, then the
    loop run until every task waits: the pacing of a single request.
    """

    def __init__(self, core: _ScriptedEngineCore) -> None:
        self._core = core
        self._outputs: list[EngineCoreOutput] = []
        self._waiting: list[asyncio.Future[None]] = []
        self._wanted: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    async def step(self, outputs: list[EngineCoreOutput]) -> None:
        """Put `outputs` into the next engine step; back once serve has answered it."""
        self._outputs += outputs
        await self.settled()

    async def settled(self) -> None:
        """Back once every task has waited (and the step due, if any, is answered)."""
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done():
            self._wanted = asyncio.Event()
            # A context of its own: none of a request's (its log route) is the pacer's.
            self._task = loop.create_task(self._pace(), context=contextvars.Context())
        waiter = loop.create_future()
        self._waiting.append(waiter)
        assert self._wanted is not None
        self._wanted.set()
        await waiter

    async def _pace(self) -> None:
        assert self._wanted is not None
        waiting: list[asyncio.Future[None]] = []
        try:
            while True:
                await self._wanted.wait()
                await _until_idle()
                self._wanted.clear()
                outputs, self._outputs = self._outputs, []
                waiting, self._waiting = self._waiting, []
                if outputs:
                    self._core.emit(outputs)
                    await _until_idle()
                for waiter in waiting:
                    if not waiter.done():
                        waiter.set_result(None)
                waiting = []
        except Exception as exc:
            # No task may wait forever on a pacer that stopped.
            for waiter in waiting + self._waiting:
                if not waiter.done():
                    waiter.set_exception(exc)
            self._waiting = []
            raise

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task


@dataclass
class _Queued:
    """A stream chunk waiting to be an engine step; `decided` once it is
    known whether it finishes its choice."""

    piece: _Piece
    decided: bool = False


@dataclass
class _ServeRun:
    """One request inside serve: the handler's task, the engine requests it
    added (one per choice), and for a stream the frames not yet answered."""

    request_id: str
    task: asyncio.Task[Any] | None = None
    children: list[Any] = field(default_factory=list)
    frames: list[bytes] = field(default_factory=list)
    queue: list[_Queued] = field(default_factory=list)
    """A stream's chunks not yet stepped, in arrival order."""
    disagreed: set[int] = field(default_factory=set)
    """Choices whose record and vLLM's stop logic have disagreed."""
    calls: int = 0
    """A stream's calls so far."""
    frame_calls: list[int] = field(default_factory=list)
    """The call each of `frames` answers, for those stepped so far."""

    @property
    def ended(self) -> bool:
        return self.task is not None and self.task.done()

    def queue_chunk(self, piece: _Piece) -> None:
        """Queue a stream chunk as an engine step.

        A chunk with tokens is undecided until its choice's next chunk: a
        finish-only tail finishes it (the tail is no step of its own), a
        chunk with tokens leaves it unfinished. Steps go to the engine in
        arrival order, so a decided step waits for undecided earlier ones.
        """
        previous = next(
            (q for q in reversed(self.queue) if q.piece.index == piece.index and not q.decided),
            None,
        )
        if piece.token_ids:
            if previous is not None:
                previous.decided = True
            self.queue.append(_Queued(piece, decided=piece.finish is not None))
        elif piece.finish is not None:
            if previous is not None:
                previous.piece = replace(previous.piece, finish=piece.finish, stop_reason=piece.stop_reason)
                previous.decided = True
            else:
                self.queue.append(_Queued(piece, decided=True))

    def take_frames(self) -> list[bytes]:
        frames, self.frames = self.frames, []
        return frames

    def take_late_frames(self) -> FramesAnswer:
        """The frames not yet answered, each with how late it comes: a
        frame of a step answers its piece's call, any other this one."""
        owners = self.frame_calls + [self.calls] * (len(self.frames) - len(self.frame_calls))
        self.frame_calls = []
        return FramesAnswer(self.take_frames(), [self.calls - call for call in owners])

    async def pump(self, generator: AsyncIterator[str]) -> None:
        """Read serve's SSE stream as a client does."""
        async for frame in generator:
            if frame != _SSE_DONE:
                self.frames.append(frame.encode("utf-8"))


class ServeEngine(DerenderEngine):
    """The serve path behind the derender endpoints' bodies.

    It takes the same bodies as `DerenderEngine` (one-shot bodies, and
    streaming bodies one generate chunk per call) and validates them the
    same way; a valid body goes to `vllm serve`'s own handler instead of the
    derender endpoint. Streams are kept here, per request id, so
    ``stream_state`` plays no part (answers carry none).

    `drive` (and `post_many`) answers a window of scripts at once, their
    engine steps batched (`_Pacer`); each script's streams are its own.
    """

    window = WINDOW
    _answers_directly = False  # every call goes to vllm serve's handlers (`_dispatch`)
    reads_logprob_text = False  # type: ignore[assignment]  # vllm serve's handlers read the bodies

    def __init__(
        self,
        state: Any,
        core: Any,
        resources: contextlib.AsyncExitStack,
        startup_seconds: float,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        super().__init__(state.serving_derender, startup_seconds, loop=loop)
        self._state = state
        self._core = core
        self._resources = resources
        self._runs: OrderedDict[tuple[int | None, str], _ServeRun | Answer] = OrderedDict()
        """Streams by (script, request id): `post`'s under None."""
        self._pacer = _Pacer(core)
        self._scripts = itertools.count()
        self.findings: list[StopFinding] = []
        self.findings_total = 0
        self._keeps_requests = versions.proven("requests")
        self._merges_steps = versions.proven("serve_bulk")
        self._lane_on = versions.proven("serve_lane")

    @classmethod
    def build(cls, config: RenderConfig, *, live: bool = False, decode: str = "fast") -> ServeEngine:
        """Build `vllm serve`'s stack for the settings, on a scripted engine
        core, from a local model directory. `live` and `decode` are accepted
        for a uniform call and ignored: the serve path is vLLM's serving
        classes themselves, decoding with the engine's own detokenizer.

        Raises:
            ConfigError: for a bad setting, or a stack that cannot start.

        """
        started = time.perf_counter()
        quiet_startup = prepare_environment()
        config.check_paths()
        args = server_args(config)
        from vllm.config.logging import LoggingConfig

        # derender has configured vLLM's logger already (prepare_environment).
        args.logging_config = LoggingConfig(configure_logging=False)
        loop = asyncio.new_event_loop()
        resources = contextlib.AsyncExitStack()
        try:
            state, core = loop.run_until_complete(_serve_stack(args, resources))
        except Exception as exc:
            loop.run_until_complete(resources.aclose())
            loop.close()
            raise ConfigError(f"cannot start the serve stack for {config.model}: {exc}") from None
        if quiet_startup:
            show_warnings_from_now_on()
        engine = cls(state, core, resources, time.perf_counter() - started, loop)
        engine._render_half = RenderHalf(args)
        engine._check_tokenizer(config.tokenizer or config.model or "")
        return engine

    def in_mode(self, *, live: bool) -> DerenderEngine:
        return self  # the serve path has one mode

    def prompt_matters(self, endpoint: Endpoint) -> bool:
        return False  # serve renders every request's prompt itself

    def _keeps_stream_requests(self) -> bool:
        # A stream's calls after its first feed only their chunk to serve
        # (the request went to serve's handler once, from the raw body), so
        # its request validates once, as on the live path: a later call
        # whose request and prompt ids are the first call's validates only
        # the rest. With the `requests` fast path off, every call is
        # validated whole, as the derender endpoint validates it. (Serve's
        # stack holds vLLM's own derenderer, so `_fast_paths` says no decode
        # and no requests here: the release is asked directly, once, as
        # `_fast_paths` is read once: per call, the environment lookup was
        # 2% of the serve path.)
        return self._keeps_requests

    def _run(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        if self._loop.is_running():
            # Inside a task (`_post_async`): what finishes at once (an error
            # handler's answer) is returned, the rest of the call is awaited
            # there, in that task.
            try:
                awaited = coroutine.send(None)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            return _Deferred(_finish(coroutine, awaited))  # type: ignore[return-value]
        # Every call drives tasks on the stack's loop (the output handler,
        # serve's stream generator), so none may start outside it.
        if self._loop.is_closed():
            coroutine.close()
            raise RuntimeError("the serve stack is closed")
        return self._loop.run_until_complete(coroutine)

    def post(self, endpoint: Endpoint, body: Any) -> Answer:
        endpoint = Endpoint.of(endpoint)
        with collector_paused():
            return self._run(self._post_async(endpoint, body))

    def drive(self, scripts: Iterable[Script[_T]], *, window: int = WINDOW) -> Iterator[_T]:
        """Up to `window` scripts at once, each a task on the stack's loop,
        their engine steps batched (`_Pacer`); results in the scripts'
        order, taken from the input only as the window has room."""
        if window < 1:
            raise ValueError(f"window must be at least 1, not {window}")
        if self._loop.is_closed():
            raise RuntimeError("the serve stack is closed")
        scripts = iter(scripts)
        running: deque[asyncio.Task[_T]] = deque()
        try:
            while True:
                for script in itertools.islice(scripts, window - len(running)):
                    # Each its own context: what the script sets there (its log route) is its own.
                    task = self._loop.create_task(self._script(script), context=contextvars.copy_context())
                    running.append(task)
                if not running:
                    return
                with collector_paused():
                    result = self._loop.run_until_complete(running.popleft())
                yield result
        finally:
            if running and not self._loop.is_closed():
                for task in running:
                    task.cancel()
                self._loop.run_until_complete(asyncio.gather(*running, return_exceptions=True))

    async def _script(self, script: Script[_T]) -> _T:
        """One script run to its end, its calls answered in this task; then
        its streams are forgotten (an unfinished one is cancelled)."""
        key = next(self._scripts)
        _SCRIPT.set(key)
        step: Any = script.send
        answer: Any = None
        try:
            while True:
                try:
                    endpoint, body = step(answer)
                except StopIteration as done:
                    return done.value  # type: ignore[no-any-return]
                try:
                    step, answer = script.send, await self._post_async(Endpoint.of(endpoint), body)
                except Exception as exc:  # raised in the script, where it made the call
                    step, answer = script.throw, exc
        finally:
            for stream in [k for k in self._runs if k[0] == key]:
                run = self._runs.pop(stream)
                if isinstance(run, _ServeRun):
                    await self._cancel(run)

    async def _post_async(self, endpoint: Endpoint, body: Any) -> Answer:
        """`post`, in the caller's task: the body validated as the
        derender endpoint does, then the call made to serve's handler
        (`_run` leaves what waits to this task)."""
        # The handler re-reads the original request from the raw body, as
        # the client would send it to serve.
        _RAW.set(body)
        found: list[StopFinding] = []
        _FOUND.set(found)
        usual = self._usual_chunk(endpoint, body)
        if usual is not None:
            try:
                answer = await self._dispatch(endpoint, usual)
            except Exception as exc:  # the app's catch-all handlers, as `_post`
                answer = self.internal_error(exc)
        else:
            answer = super().post(endpoint, body)
        if isinstance(answer, _Deferred):
            try:
                answer = await answer.coroutine
            except Exception as exc:  # the app's catch-all handlers, as `_post`
                answer = self.internal_error(exc)
        if found:
            answer.findings = tuple(found)
        return answer

    def _usual_chunk(self, endpoint: Endpoint, body: Any) -> _UsualRequest | None:
        """A stream's usual call (fast path ``serve_lane``) as the request
        its validation gives, without validating it: one choice of ids, no
        finish, stop reason or logprobs, of a stream whose request and
        prompt ids its first call validated (`live.ChunkLane.stateless`:
        validation is the identity for such a body). None for any other
        call (a render endpoint's among them), where a stream's calls are each validated whole
        (`_keeps_stream_requests`), and while vLLM's validators would log:
        `DerenderEngine.post` validates it."""
        if not self._lane_on or endpoint.renders or not self._keeps_stream_requests():
            return None
        call = self._chunk_lane().stateless(endpoint, body)
        if call is None or any(logger.isEnabledFor(logging.DEBUG) for logger in _validation_loggers()):
            return None
        self._stream_requests.move_to_end(call.request_id)  # in use, as `_known_stream_request` keeps it
        chunk = _UsualChunk(call.request_id, [_UsualChoice(call.index, call.token_ids)])
        return _UsualRequest(chunk, call.prompt_token_ids)

    def close(self) -> None:
        """Close the open streams and shut the stack down."""
        if self._loop.is_closed():
            return
        self._loop.run_until_complete(self._shutdown())
        self._loop.close()
        # vLLM's AsyncLLM shuts down again when collected; let that happen
        # now rather than at interpreter exit, when its imports are gone.
        self._state = self._serving = self._core = None
        _forget_signatures()
        gc.collect()

    async def _shutdown(self) -> None:
        for run in list(self._runs.values()):
            if isinstance(run, _ServeRun):
                await self._cancel(run)
        self._runs.clear()
        await self._pacer.close()
        await self._resources.aclose()

    # --- dispatch ------------------------------------------------------------

    async def _dispatch(self, endpoint: Endpoint, request: Any) -> Answer:
        raw = _RAW.get()
        raw = raw if isinstance(raw, Mapping) else {}
        original = raw.get(endpoint.request_key)
        if not isinstance(original, Mapping):
            return self.bad_request(
                f"the serve path needs {endpoint.request_key}: the request a client sent to vllm serve"
            )
        if getattr(request, "stream", False):
            return await self._stream_call(endpoint, request, original)
        return await self._one_shot(endpoint, request, original)

    async def _one_shot(self, endpoint: Endpoint, request: Any, original: Mapping[str, Any]) -> Answer:
        if endpoint is Endpoint.CHAT:
            response = request.generate_response
            prompt_ids = request.prompt_token_ids
        else:
            if len(request.generate_responses) != 1:
                return self.bad_request(_UNSUPPORTED_PROMPTS)
            response = request.generate_responses[0]
            prompt_ids = (request.prompt_token_ids or [None])[0]
        if prompt_ids is None:
            prompt_ids = response.prompt_token_ids
        choices = sorted(response.choices, key=lambda choice: choice.index)
        opened = await self._open(
            endpoint, original, response.request_id, stream=False, prompt_ids=prompt_ids
        )
        if isinstance(opened, Answer):
            return opened
        run = opened
        if [choice.index for choice in choices] != list(range(len(run.children))):
            await self._cancel(run)
            return self.bad_request(
                f"the generate response has choices {[c.index for c in choices]}; "
                f"the request asks for {len(run.children)} (indices 0 to {len(run.children) - 1})"
            )
        if any(choice.finish_reason is None for choice in choices):
            await self._cancel(run)
            return self.bad_request(
                "the serve path needs a finished generate response: a choice has no finish_reason"
            )
        wants_logprobs = run.children[0].sampling_params.logprobs is not None
        for choice in choices:
            problem = _logprobs_problem(wants_logprobs, choice)
            if problem:
                await self._cancel(run)
                return self.bad_request(problem)
        if self._merges_steps and _merge_ok(run.children, choices):
            await self._pacer.step(self._merged_outputs(run, choices))
        else:
            # One token per step, every choice in the same step.
            steps = max((len(choice.token_ids or []) for choice in choices), default=0)
            for position in range(max(steps, 1)):
                batch = []
                for choice in choices:
                    token_ids = choice.token_ids or []
                    last = max(len(token_ids), 1) - 1
                    if position > last:
                        continue
                    content = choice.logprobs.content if choice.logprobs is not None else None
                    batch.append(
                        _Piece(
                            choice.index,
                            token_ids[position : position + 1],
                            content[position : position + 1] if content else None,
                            choice.finish_reason if position == last else None,
                            choice.stop_reason if position == last else None,
                        )
                    )
                await self._step(run, batch)
        if not await self._until(lambda: run.ended, seconds=5.0):
            await self._cancel(run)
            return self.bad_request("serve did not finish the request after its last recorded token")
        return _handler_answer(run.task.result())  # type: ignore[union-attr]

    def _merged_outputs(self, run: _ServeRun, choices: list[Any]) -> list[EngineCoreOutput]:
        """Each choice's tokens as one output (`advance_merged`), the
        findings told in the order one token a step tells them: by the
        step they come at (a finding at token n comes at the step that
        brings token n, the first step for a choice with none), then by
        choice."""
        heard: list[tuple[int, int, int, str, str]] = []
        outputs = []
        for order, choice in enumerate(choices):
            request = run.children[choice.index]

            def note(recorded: str, vllm: str, order: int = order, index: int = choice.index, request: Any = request) -> None:
                heard.append((max(request.num_output_tokens - 1, 0), order, index, recorded, vllm))

            content = choice.logprobs.content if choice.logprobs is not None else None
            piece = _Piece(choice.index, list(choice.token_ids or []), content, choice.finish_reason, choice.stop_reason)
            outputs.append(self._core.advance_merged(request, piece, note))
        for _, _, index, recorded, vllm in sorted(heard, key=lambda h: h[:2]):
            self._noter(run, index)(recorded, vllm)
        return outputs

    async def _stream_call(self, endpoint: Endpoint, request: Any, original: Mapping[str, Any]) -> Answer:
        chunk = request.generate_chunk
        request_id = chunk.request_id
        choice = chunk.choices[0] if chunk.choices else None
        if len(chunk.choices) > 1:
            return self.bad_request("a generate stream chunk carries one choice; this one has several")
        key = (_SCRIPT.get(), request_id)
        run = self._runs.get(key)
        if isinstance(run, Answer):
            return run  # the stream failed at its start
        tokens = list(choice.token_ids or []) if choice is not None else []
        if run is None or (run.ended and tokens):
            if choice is None or (not tokens and choice.finish_reason is None):
                return FramesAnswer([])
            opened = await self._open(
                endpoint,
                original,
                request_id,
                stream=True,
                prompt_ids=request.prompt_token_ids or chunk.prompt_token_ids,
            )
            self._remember(key, opened)
            if isinstance(opened, Answer):
                return opened
            run = opened
        self._runs.move_to_end(key)
        run.calls += 1
        if choice is not None and not run.ended:
            if choice.index >= len(run.children):
                return self.bad_request(
                    f"choice index {choice.index} is out of range: the request asks for "
                    f"{len(run.children)} choices"
                )
            problem = _logprobs_problem(run.children[0].sampling_params.logprobs is not None, choice)
            if problem:
                return self.bad_request(problem)
            content = choice.logprobs.content if choice.logprobs is not None else None
            run.queue_chunk(
                _Piece(choice.index, tokens, content, choice.finish_reason, choice.stop_reason, run.calls)
            )
            while run.queue and run.queue[0].decided:
                piece = run.queue.pop(0).piece
                await self._step(run, [piece])
                run.frame_calls += [piece.call] * (len(run.frames) - len(run.frame_calls))
        answer = run.take_late_frames()
        if run.ended:
            self._core.release(run.children)
            run.children, run.queue = [], []
        return answer

    # --- serve requests ------------------------------------------------------

    async def _open(
        self,
        endpoint: Endpoint,
        original: Mapping[str, Any],
        request_id: str,
        *,
        stream: bool,
        prompt_ids: list[int] | None,
    ) -> _ServeRun | Answer:
        """Send the original request to serve's handler and wait until it
        reaches the engine; an answer instead when serve answers at once
        (an error) or the request cannot go through this path."""
        from pydantic import ValidationError
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        fields = {**original, "stream": stream, "request_id": request_id}
        if not stream:
            fields.pop("stream_options", None)
        model = ChatCompletionRequest if endpoint is Endpoint.CHAT else CompletionRequest
        try:
            serve_request = model.model_validate(fields)
        except ValidationError as exc:
            errors = [
                {**e, "loc": ("body", endpoint.request_key, *e["loc"])}
                for e in exc.errors(include_url=False)
            ]
            return self._validation_answer(errors)
        unsupported = _unsupported(endpoint, serve_request)
        if unsupported:
            return self.bad_request(f"the serve path does not support {unsupported} yet")

        if endpoint is Endpoint.CHAT:
            handler = self._state.openai_serving_chat.create_chat_completion
        else:
            handler = self._state.openai_serving_completion.create_completion
        run = _ServeRun(request_id)
        # The engine requests the handler adds (from its task, or the
        # stream's reader) are this run's (`_ScriptedEngineCore.add_request_async`).
        opening = _OPENING.set(run)
        try:
            if stream:
                result = await handler(serve_request, None)
                if not hasattr(result, "__anext__"):
                    return _handler_answer(result)
                run.task = asyncio.ensure_future(run.pump(result))
            else:
                run.task = asyncio.ensure_future(handler(serve_request, None))
        finally:
            _OPENING.reset(opening)
        expected = serve_request.n or 1
        if not await self._until(lambda: len(run.children) >= expected or run.ended):
            await self._cancel(run)
            return self.bad_request("serve did not pass the request to the engine in time")
        if not run.children:
            # Serve answered before the engine (an error): a stream says it
            # in a frame, a one-shot request as its response.
            if stream:
                return FramesAnswer(run.take_frames())
            return _handler_answer(run.task.result())
        rendered = list(run.children[0].prompt_token_ids or [])
        if prompt_ids is not None and rendered != list(prompt_ids):
            await self._cancel(run)
            harmony = self._state.openai_serving_chat.model_config.hf_config.model_type == "gpt_oss"
            return self.bad_request(_prompt_mismatch(rendered, list(prompt_ids), harmony=harmony))
        return run

    async def _step(self, run: _ServeRun, pieces: list[_Piece]) -> None:
        """One engine step made of the recorded pieces, then wait until serve
        has answered it."""
        outputs = []
        for piece in pieces:
            output = self._core.advance(run.children[piece.index], piece, self._noter(run, piece.index))
            if output is not None:
                outputs.append(output)
        if outputs:
            await self._pacer.step(outputs)
        tails = []
        for piece in pieces:
            if piece.finish == "stop" and isinstance(piece.stop_reason, str):
                tail = self._core.finish_unmatched_stop_string(
                    run.children[piece.index], piece.stop_reason, self._noter(run, piece.index)
                )
                if tail is not None:
                    tails.append(tail)
        if tails:
            await self._pacer.step(tails)

    async def _until(self, condition: Callable[[], bool], seconds: float = _WAIT_SECONDS) -> bool:
        """Wait until `condition` holds, letting threads (vLLM renders in a
        thread pool) finish; False on time-out."""
        deadline = time.monotonic() + seconds
        while True:
            await self._pacer.settled()
            if condition():
                return True
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.001)

    def _noter(self, run: _ServeRun, index: int) -> Callable[[str, str], None]:
        """Where findings go: the first disagreement of each choice (once the
        record has won, later steps of that choice disagree as a result)."""

        def note(recorded: str, vllm: str) -> None:
            if index in run.disagreed:
                return
            run.disagreed.add(index)
            finding = StopFinding(run.request_id, index, recorded, vllm)
            found = _FOUND.get()
            if found is not None:
                found.append(finding)
            self.findings_total += 1
            if len(self.findings) < FINDINGS_KEPT:
                self.findings.append(finding)
            logger.warning("serve finding: %s", finding)

        return note

    def _remember(self, key: tuple[int | None, str], run: _ServeRun | Answer) -> None:
        self._runs[key] = run
        self._runs.move_to_end(key)
        while len(self._runs) > STREAMS_KEPT:
            _, oldest = self._runs.popitem(last=False)
            if isinstance(oldest, _ServeRun) and not oldest.ended:
                asyncio.ensure_future(self._cancel(oldest))

    async def _cancel(self, run: _ServeRun) -> None:
        """Stop a request inside serve, as a client that disconnects does."""
        if run.task is not None and not run.task.done():
            run.task.cancel()
            with contextlib.suppress(BaseException):
                await run.task
        await self._pacer.settled()
        self._core.release(run.children)


class _UsualChoice(NamedTuple):
    """A usual stream call's choice, as validation gives what `_stream_call` reads."""

    index: int
    token_ids: list[int]
    finish_reason: None = None
    stop_reason: None = None
    logprobs: None = None


class _UsualChunk(NamedTuple):
    request_id: str
    choices: list[_UsualChoice]
    prompt_token_ids: None = None


class _UsualRequest(NamedTuple):
    """A usual stream call's validated body (`ServeEngine._usual_chunk`)."""

    generate_chunk: _UsualChunk
    prompt_token_ids: Any
    stream: bool = True


@dataclass(frozen=True)
class _Deferred:
    """A validated call not yet made: `ServeEngine._post_async` awaits it."""

    coroutine: Coroutine[Any, Any, Answer]


_UNSUPPORTED_PROMPTS = "the serve path takes one prompt per completion body"


def _unsupported(endpoint: Endpoint, request: Any) -> str | None:
    """What of the request the serve path cannot reproduce yet, or None."""
    if getattr(request, "use_beam_search", False):
        return "beam search"
    if request.prompt_logprobs is not None:
        return "prompt_logprobs"
    if endpoint is Endpoint.COMPLETION:
        prompt = request.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                return "completions with more than one prompt"
    return None


def _merge_ok(children: list[Any], choices: list[Any]) -> bool:
    """Whether a one-shot body's choices may each go to the output processor
    as one step (`_ScriptedEngineCore.advance_merged`) with the answer of
    one token a step.

    The request is not streamed, so serve's handler reads only the final
    output (``RequestOutputKind.FINAL_ONLY``: the output processor makes
    no output before the finish, and the n choices are gathered by index),
    and the detokenizer and the logprobs take a step's tokens one by one
    as they take one token. What a step's size can change is the stop
    strings' search (the request's window, ``min_tokens``, the tokens
    after a match): a request with stop strings, or a choice the record
    ends on a string, goes one token a step.
    """
    from vllm.sampling_params import RequestOutputKind

    return all(
        child.sampling_params.output_kind == RequestOutputKind.FINAL_ONLY and not child.sampling_params.stop
        for child in children
    ) and not any(isinstance(choice.stop_reason, str) for choice in choices)


def _logprobs_problem(wanted: bool, choice: Any) -> str | None:
    """Why the choice's logprobs cannot feed an engine step that must have
    them, or None."""
    if not wanted or not choice.token_ids:
        return None
    content = choice.logprobs.content if choice.logprobs is not None else None
    if content is None or len(content) != len(choice.token_ids):
        return (
            f"the request asks for logprobs, and choice {choice.index} has "
            f"{0 if content is None else len(content)} logprob entries for "
            f"{len(choice.token_ids)} tokens"
        )
    return None


def _prompt_mismatch(rendered: list[int], recorded: list[int], *, harmony: bool) -> str:
    first = next(
        (i for i, (a, b) in enumerate(zip(rendered, recorded, strict=False)) if a != b),
        min(len(rendered), len(recorded)),
    )
    message = (
        f"serve renders this request to {len(rendered)} prompt tokens, the record's "
        f"prompt_token_ids has {len(recorded)}; they differ from token {first} on "
        f"(serve: {rendered[first:first + 5]}, record: {recorded[first:first + 5]})"
    )
    if harmony:
        # vLLM writes the conversation's start date into every harmony
        # system message: today's, unless this variable pins it.
        message += (
            "; gpt-oss prompts carry the date they were rendered on: set "
            "VLLM_SYSTEM_START_DATE=YYYY-MM-DD to the recording's date"
        )
    return message


def _handler_answer(result: Any) -> Answer:
    """What serve's route answers for a handler's result: the response, or
    the error with its status."""
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    if isinstance(result, ErrorResponse):
        return json_answer(result.model_dump(), result.error.code)
    return json_answer(result.model_dump())
