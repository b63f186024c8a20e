"""The render server's derender endpoints, in process: replay and live.

`DerenderEngine.post` does what the endpoint handlers in
``vllm/entrypoints/scale_out/derender/api_router.py`` do, including
FastAPI's body validation and vLLM's exception handlers, and returns the
HTTP status and the exact JSON body the server would send.

Replay (the server's own per-call path) and live streaming (`live.py`, parser
state kept between calls) share everything here; they differ only in the
``OnlineDerenderer`` behind ``ServingDerender``.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import gc
import logging
import os
import selectors
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Generator, Iterable, Mapping
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from ..api import CodeAPI
from ..config import RenderConfig
from ..errors import ConfigError
from ..logprob_text import materialized
from ..protocol import Answer, Endpoint, parsed_body
from . import versions
from .answers import json_answer, stream_answer
from .parsers import SHARING
from .renderer import RenderHalf
from .stack import (
    derender_stack,
    lean_start,
    prepare_environment,
    server_args,
    show_warnings_from_now_on,
)

DECODE_MODES = ("fast", "reference")
"""``--decode``: "fast" (the default) or "reference", vLLM's own per-token
path, bug for bug."""
REPLAY_MODES = ("fast", "reference")
"""A parsed stream's replay: "fast" (the default) goes on from this
process's previous call of the stream where the call's state is that call's
(`replay.ReplayStreams`); "reference" replays the whole history on every
call, as vLLM's server does."""

_T = TypeVar("_T")

if TYPE_CHECKING:
    from pydantic import TypeAdapter

    from .live import ChunkLane, KnownRequest
    from .requests import ChatRequests
    from .responses import DirectResponses

REQUESTS_KEPT = 4096
"""Validated stream requests kept for reuse in live mode (one per stream)."""


class DerenderEngine(CodeAPI):
    """One render server's derender endpoints, in process.

    With ``live=True`` the chat streams of a parser-configured model keep
    their parser between calls (`live.LiveDerenderer`) and a stream's
    unchanged request is validated once; every answer, and every state, is
    still the one the server's replay path gives. `in_mode` gives the other
    mode over the same stack, without a second start-up.
    """

    _answers_directly = True
    """Whether one-shot calls take the fast decode's own handlers where
    that path is proven (`responses.DirectResponses`)."""

    def __init__(
        self,
        serving: Any,
        startup_seconds: float,
        *,
        live: bool = False,
        decode: str = "fast",
        loop: asyncio.AbstractEventLoop | None = None,
        replay: str = "fast",
    ) -> None:
        from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
            DerenderChatRequest,
            DerenderChatRequestUnion,
            DerenderChatStreamRequest,
            DerenderCompletionRequest,
            DerenderCompletionRequestUnion,
            DerenderCompletionStreamRequest,
        )

        self._serving = serving
        # The server hands the CPU-bound derender calls to the renderer's
        # thread pool to keep its event loop free for other requests. Here
        # calls come one at a time, so the hop to a thread and back (two
        # context switches and a self-pipe wake-up per call, far worse on a
        # busy machine) buys nothing: the same functions run inline. With no
        # pool threads a fork needs no repair either.
        executor = serving.online_derenderer.renderer._executor
        if not hasattr(executor, "_inner"):  # vLLM's _SwappableExecutor
            if versions.proven("startup"):
                raise ConfigError(f"vLLM's renderer executor changed shape: {type(executor).__name__}")
        elif versions.proven("startup"):
            executor._inner = _InlineExecutor()
        if not isinstance(getattr(executor, "_inner", None), _InlineExecutor):
            _fresh_pool_in_forked_children(executor)
        self.startup_seconds = startup_seconds
        self._fast_paths = _fast_paths(serving)
        """Which fast paths this engine may take: proven on the installed
        vLLM (`versions`) and built into its stack."""
        self._direct = _direct_responses(serving) if self._answers_directly and self._fast_paths.responses else None
        """The fast decode's one-shot handlers, made once per stack and
        shared by its modes (`in_mode`); they go with the engine."""
        self.live = live and self._fast_paths.live
        """Live streaming (parser state kept between calls); on a vLLM the
        live path was not proven on, every call runs the server's replay."""
        self.decode = self._allowed_decode(decode)
        """"fast": exact batched decode (`fast.TokenTable`) where the
        tokenizer allows; "reference": vLLM's own per-token path."""
        if self._fast_paths.replay:
            from .replay import ReplayStreams

            ReplayStreams.install(serving.online_derenderer)
        self.replay = self._allowed_replay(replay)
        """"fast": a stream's replay goes on from its previous call here
        (`replay.ReplayStreams`); "reference": vLLM's replay of the whole
        history per call."""
        self.vocab_size = _vocab_size(self.tokenizer)
        """The tokenizer's full size, added tokens included: ids at or above
        it decode as nothing."""
        self._bodies: dict[Endpoint, TypeAdapter[Any]] = {
            Endpoint.CHAT: _body_adapter(DerenderChatRequestUnion),
            Endpoint.COMPLETION: _body_adapter(DerenderCompletionRequestUnion),
        }
        # A body that is not a stream call succeeds only as the union's
        # one-shot member (`_validated`).
        self._one_shot_bodies: dict[Endpoint, tuple[frozenset[str], TypeAdapter[Any]]] = {
            endpoint: (frozenset(member.model_fields), _body_adapter(member))
            for endpoint, member in ((Endpoint.CHAT, DerenderChatRequest), (Endpoint.COMPLETION, DerenderCompletionRequest))
        }
        # A body known to be a stream call succeeds only as the union's
        # streaming member, so live mode validates it against that alone.
        self._stream_bodies: dict[Endpoint, TypeAdapter[Any]] = {
            Endpoint.CHAT: _body_adapter(DerenderChatStreamRequest),
            Endpoint.COMPLETION: _body_adapter(DerenderCompletionStreamRequest),
        }
        # One loop for the engine and its `in_mode` copies, across calls like
        # the server's; a stack whose tasks live on a loop brings that loop.
        self._loop = loop or _new_loop()
        # request_id -> its stream's request and prompt ids, raw and validated
        self._stream_requests: OrderedDict[str, KnownRequest] = OrderedDict()
        self._lane: ChunkLane | None = None
        """Live streams' usual calls, answered without the pydantic round
        trip (`live.ChunkLane`); built on the first live call."""
        self._render_half: RenderHalf | None = None
        """The render endpoints, given the server flags (`build`)."""

    @classmethod
    def build(
        cls, config: RenderConfig, *, live: bool = False, decode: str = "fast", replay: str = "fast"
    ) -> DerenderEngine:
        """Build the stack from a local model directory, as the server does.

        Raises:
            ConfigError: for a bad setting, with the valid choices where
                there is a fixed set.

        """
        started = time.perf_counter()
        quiet_startup = prepare_environment()
        config.check_paths()

        with lean_start():
            args = server_args(config)
            try:
                # On a vLLM the fast paths were not proven on, vLLM's own
                # OnlineDerenderer, as its server builds it (`versions`).
                derenderer_class: type | None = None
                if versions.proven("decode") and versions.proven("live"):
                    from .live import LiveDerenderer

                    derenderer_class = LiveDerenderer
                elif versions.proven("decode"):
                    # The fast decode (and the requests and responses paths
                    # over it) proven without live streams.
                    from .fast import FastDerenderer

                    derenderer_class = FastDerenderer
                serving = derender_stack(args, derenderer_class, single_threaded=True)
            except Exception as exc:
                # Whatever stops vLLM's stack from starting stops the server
                # too: a configuration problem, reported without a traceback.
                raise ConfigError(f"cannot start the derender stack for {config.model}: {exc}") from None
        if quiet_startup:
            show_warnings_from_now_on()
        engine = cls(serving, startup_seconds=time.perf_counter() - started, live=live, decode=decode, replay=replay)
        engine._render_half = RenderHalf(args)
        engine._check_tokenizer(config.tokenizer or config.model or "")
        return engine

    @property
    def tokenizer(self) -> Any:
        """vLLM's tokenizer for the model, as the derenderer decodes with it."""
        return self._serving.online_derenderer.renderer.get_tokenizer()

    def token_pieces(self, ids: Iterable[int]) -> dict[int, str]:
        """Each id's piece in the tokenizer's vocabulary (``Ġthe``,
        ``<0xE4>``, ``▁the``), to show which tokens a chunk carried; ids the
        tokenizer does not hold are left out."""
        known = sorted({i for i in ids if isinstance(i, int) and 0 <= i < self.vocab_size})
        try:
            pieces = self.tokenizer.convert_ids_to_tokens(known)
        except (AttributeError, NotImplementedError, TypeError, ValueError, IndexError):
            return {}  # a tokenizer without a vocabulary to show
        return {i: piece for i, piece in zip(known, pieces, strict=False) if isinstance(piece, str)}

    def _check_tokenizer(self, directory: str) -> None:
        """Refuse a tokenizer that can only decode its special tokens.

        Given a directory with ``config.json`` but no tokenizer files,
        transformers builds an empty tokenizer of the model's class and
        every answer would have empty content; the server starts anyway.

        Raises:
            ConfigError: naming the directory.

        """
        try:
            special = len(set(self.tokenizer.all_special_ids))
        except (AttributeError, NotImplementedError):
            special = 1
        if self.vocab_size <= special:
            raise ConfigError(
                f"{directory}: the tokenizer holds {self.vocab_size} token(s), only special "
                "ones, so every answer would be empty. Are its tokenizer files "
                "(tokenizer.json, tokenizer.model, vocab.json, ...) missing?"
            )

    def in_mode(
        self, *, live: bool | None = None, decode: str | None = None, replay: str | None = None
    ) -> DerenderEngine:
        """This engine in another stream mode, decode mode or replay mode,
        sharing the stack."""
        other = copy.copy(self)
        if live is not None:
            other.live = live and self._fast_paths.live
        if decode is not None:
            other.decode = self._allowed_decode(decode)
        if replay is not None:
            other.replay = self._allowed_replay(replay)
        return other

    def _allowed_replay(self, replay: str) -> str:
        """`replay`, checked, or "reference" where the fast replay may not
        run (`versions`)."""
        if replay not in REPLAY_MODES:
            raise ConfigError(f"--replay: unknown mode {replay!r}. Valid modes: {', '.join(REPLAY_MODES)}.")
        return replay if self._fast_paths.replay else "reference"

    def _allowed_decode(self, decode: str) -> str:
        """`decode`, checked, or "reference" where the fast decode may not
        run (`versions`): the answers stay vLLM's own."""
        decode = _checked_decode(decode)
        return decode if self._fast_paths.decode else "reference"

    @property
    def reads_logprob_text(self) -> bool:
        """Whether one-shot bodies may hold logprobs as their text
        (`logprob_text`): where the fast decode writes the usual ones
        (`logprobs.carried`); every other route loads them first
        (`logprob_text.materialized`). Read from this engine's own mode and
        the stack's token table, not from the derenderer's ``fast``, which
        follows the mode of whichever engine of the stack posted last."""
        return (
            self.decode == "fast"
            and self._fast_paths.logprobs
            and versions.proven("lp_text")
            and getattr(self._serving.online_derenderer, "table", None) is not None
        )

    @property
    def decoder_kind(self) -> str:
        """How this engine decodes: the proven decoder kind of a fast path
        ("byte-level", "sentencepiece"), "incremental" for a fast tokenizer
        of another kind (vLLM's steps, batched), or "reference"."""
        derenderer = self._serving.online_derenderer
        if self.decode == "reference" or getattr(derenderer, "table", None) is None:
            return "reference"
        return derenderer.table.kind or "incremental"

    def post(self, endpoint: Endpoint, body: Any) -> Answer:
        """Answer one call as ``POST endpoint.path`` would: a derender
        call, or a render call (`renderer.RenderHalf`). `endpoint` may be
        given by its value ("chat"); anything else raises ValueError. A
        body given as JSON text raises TypeError (`protocol.parsed_body`)."""
        endpoint = Endpoint.of(endpoint)
        if type(body) is not dict:
            body = parsed_body(body)
        if endpoint.renders:
            with collector_paused():
                return self._rendering().post(self, self._serving, endpoint, body)
        derenderer = self._serving.online_derenderer
        derenderer.live = self.live
        derenderer.decode_mode = self.decode
        derenderer.replay_mode = self.replay
        derenderer.spliced = []
        # A response is thousands of short-lived containers; the collector's
        # full passes over the heap (the tokenizer's vocabulary and merges
        # among it) would otherwise cost more than the record itself.
        # (`collector_paused`, inlined: this runs once per record.)
        enabled = gc.isenabled()
        gc.disable()
        # The fast decode's parsers share their lexicon (`parsers`).
        sharing = SHARING.set(self.decode == "fast")
        try:
            return self._post(endpoint, body)
        finally:
            SHARING.reset(sharing)
            if enabled:
                gc.enable()

    def _post(self, endpoint: Endpoint, body: Any) -> Answer:
        from pydantic import ValidationError

        if body is None:  # FastAPI reports a null body as missing
            return self._validation_answer(
                [{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}]
            )
        if endpoint is Endpoint.CHAT:
            if self.live:
                if self.decode == "fast":
                    answer = self._chunk_lane().answer(body)
                    if answer is not None:
                        return answer
            elif self.replay == "fast" and type(body) is dict:
                # A replay call that goes on from this process's last answer
                # takes the lane as a live call would (`replay.ReplayStreams`),
                # on either decode: the lane steps the stream on the decode it
                # was built on (vLLM's own in ``--decode reference``), and
                # leaves out only the per-call validation, handler checks and
                # response models, whose answer it gives.
                replays = getattr(self._serving.online_derenderer, "replay_streams", None)
                if replays is not None and replays.lane_takes(body.get("stream_state")):
                    answer = self._chunk_lane().answer(body)
                    if answer is not None:
                        replays.gone_on += 1
                        return answer
        elif self.live and self.decode == "fast":
            # A live completion stream's usual call (fast path live_cmpl).
            answer = self._chunk_lane().answer_completion(body)
            if answer is not None:
                return answer
        # A stream's request is validated once, as in live mode, where a
        # stream's calls go on from the previous one (`replay.ReplayStreams`).
        keeps = self._keeps_stream_requests()
        request = self._known_stream_request(endpoint, body) if keeps else None
        if request is None:
            checked = _materialized(body)
            if (
                keeps
                and isinstance(body, Mapping)
                and body.get("stream", False) is not False
                and isinstance(body.get(endpoint.request_key), dict)
            ):
                # vLLM's request validators fill defaults into the dict they
                # are given (tool_choice, say); the request to remember is the
                # one the caller sent. Only a stream's request is remembered,
                # and a body whose stream is absent or false validates only
                # as the one-shot member: it is not copied (a one-shot
                # record of a live engine, as every CLI job runs, paid 16
                # to 34 µs for the copy).
                checked = {**checked, endpoint.request_key: copy.deepcopy(body[endpoint.request_key])}
            try:
                request = self._validated(endpoint, checked)
            except ValidationError as exc:
                # FastAPI reports body errors under a leading "body" location.
                errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
                return self._validation_answer(errors)
            except Exception as exc:  # RecursionError, say: the app's catch-all
                return self.internal_error(exc)
            if keeps:
                self._remember_stream_request(endpoint, body, request)
        try:
            return self._run(self._dispatch(endpoint, request))
        except Exception as exc:  # the app's catch-all handlers, in order
            return self.internal_error(exc)

    def _validated(self, endpoint: Endpoint, body: Any) -> Any:
        """The body validated as FastAPI validates it, against the union of
        the one-shot and the streaming request.

        Pydantic's smart union validates a body against every member (the
        request inside it twice) and keeps the one that succeeds. A body
        whose ``stream`` is absent or False cannot succeed as the streaming
        member (``stream: Literal[True]``, required), so where the one-shot
        member alone accepts it, that is the union's result, and it is
        taken without the second pass. The body must hold only the one-shot
        member's fields: the streaming member reads those with the same
        request class or as plain ints and lists, so its pass can fail only
        with a ValidationError, never with an exception that would make the
        union's answer a 500. Anything else (a failure, a body of
        another shape) is validated against the whole union, which words
        the errors as today; vLLM's validators only fill defaults into the
        body, the same ones again on a second pass. The second pass also
        logs the validators' debug lines a second time, so while the
        validators' loggers show debug lines (and in ``--decode
        reference``) every body takes the whole union.
        """
        fields, one_shot = self._one_shot_bodies[endpoint]
        if (
            self.decode == "fast"
            and self._fast_paths.requests
            and type(body) is dict
            and body.get("stream", False) is False
            and body.keys() <= fields
            and not any(logger.isEnabledFor(logging.DEBUG) for logger in _validation_loggers())
        ):
            fast_body = body
            if endpoint is Endpoint.CHAT:
                # The usual chat request, built as validation builds it
                # (`requests.ChatRequests`); a request object passes
                # pydantic's validation of the body as it is. A failure
                # below is worded by the union, from the body as sent.
                request = _chat_requests().build(body.get("chat_request"))
                if request is not None:
                    fast_body = {**body, "chat_request": request}
            if self._fast_paths.logprobs:
                # Logprobs of the usual shape pass validation unbuilt, for
                # the derenderer to write (`logprobs.carried`).
                from .logprobs import carried

                fast_body = carried(fast_body, self._serving)
            else:
                fast_body = materialized(fast_body)
            try:
                return one_shot.validate_python(fast_body, from_attributes=True)
            except Exception:  # noqa: BLE001 - the union answers it, as today
                pass
        return self._bodies[endpoint].validate_python(materialized(body), from_attributes=True)

    def _keeps_stream_requests(self) -> bool:
        """Whether a stream's request is validated on its first call only
        and reused by its later ones (`_known_stream_request`): where the
        stream's calls go on from each other (live, the fast replay)."""
        return self.live or self.replay == "fast"

    def _known_stream_request(self, endpoint: Endpoint, body: Any) -> Any:
        """A streaming body whose request and prompt are those of an earlier
        call of its stream: validate only the rest and reuse the validated
        request, so a live stream's parser sees the very same request
        object. None when that does not apply or the rest does not
        validate (full validation then words the errors)."""
        from pydantic import ValidationError

        if not isinstance(body, Mapping) or body.get("stream") is not True:
            return None
        chunk = body.get("generate_chunk")
        request_id = chunk.get("request_id") if isinstance(chunk, Mapping) else None
        known = self._stream_requests.get(request_id) if isinstance(request_id, str) else None
        if known is None:
            return None
        key = endpoint.request_key
        if not known.same(body.get(key), body.get("prompt_token_ids")):
            return None
        state = body.get("stream_state")
        rest = {k: v for k, v in body.items() if k not in (key, "prompt_token_ids", "stream_state")}
        if state is not None and not _is_state_object(state):
            rest["stream_state"] = state
        try:
            request = self._stream_bodies[endpoint].validate_python(rest, from_attributes=True)
        except ValidationError:
            return None
        setattr(request, key, known.request)
        request.prompt_token_ids = known.prompt_token_ids
        if state is not None and _is_state_object(state):
            request.stream_state = state
        self._stream_requests.move_to_end(request_id)  # type: ignore[arg-type]
        return request

    def _remember_stream_request(self, endpoint: Endpoint, body: Any, request: Any) -> None:
        key = endpoint.request_key
        if not getattr(request, "stream", False) or getattr(request, key) is None:
            return
        from .live import KnownRequest

        request_id = request.generate_chunk.request_id
        self._stream_requests[request_id] = KnownRequest.of(
            body.get(key), body.get("prompt_token_ids"), getattr(request, key), request.prompt_token_ids
        )
        self._stream_requests.move_to_end(request_id)
        if len(self._stream_requests) > REQUESTS_KEPT:
            self._stream_requests.popitem(last=False)

    def _chunk_lane(self) -> ChunkLane:
        """The lane for live streams' usual calls (`live.ChunkLane`), or
        one that takes no call while vLLM's handler would log."""
        if self._lane is None:
            from .live import ChunkLane

            self._lane = ChunkLane(self._serving, self._stream_requests)
        return self._lane

    def _rendering(self) -> RenderHalf:
        if self._render_half is None:
            raise ConfigError("this engine was built without the server flags its render endpoints need")
        return self._render_half

    def prepare_render(self) -> None:
        """Build the render endpoints now (about a second, once), so that
        workers forked from this process, or the warm server's children,
        inherit them instead of building them each."""
        self._rendering().prepare(self._serving)

    def prompt_matters(self, endpoint: Endpoint) -> bool:
        """Whether a record's ``prompt_token_ids`` can change its answer
        here: with a tool or reasoning parser, a chat answer's parse (the
        parsers read the prompt: a template that opens ``<think>``, a
        stream's initial state); with a tokenizer whose pre-tokenizer marks
        a leading space (Metaspace), the first token's text, which vLLM
        seeds from the prompt's tail."""
        from vllm.tokenizers.detokenizer_utils import get_leading_space_marker

        if endpoint.renders:
            return False
        if endpoint is Endpoint.CHAT and self._serving.online_derenderer.parser is not None:
            return True
        return get_leading_space_marker(self.tokenizer) is not None

    def invalid_json(self, message: str, position: int | None) -> Answer:
        """The answer to a body that is not JSON, as FastAPI words it; a
        body its parser gives up on as a whole (not text, nested too deeply,
        an integer too long: position None) gets its generic 400.

        FastAPI raises Starlette's ``HTTPException`` for that one, and vLLM
        registers its handler for FastAPI's subclass only, so FastAPI's own
        default handler answers: ``{"detail": ...}``, not vLLM's error shape.
        """
        if position is None:
            from fastapi.exception_handlers import http_exception_handler
            from starlette.exceptions import HTTPException

            return self._handled(
                http_exception_handler,
                HTTPException(status_code=400, detail="There was an error parsing the body"),
            )
        return self._validation_answer(
            [
                {
                    "type": "json_invalid",
                    "loc": ("body", position),
                    "msg": "JSON decode error",
                    "input": {},
                    "ctx": {"error": message},
                }
            ]
        )

    def bad_request(self, message: str) -> Answer:
        """A 400 in the server's error shape, for problems found before the
        call (a chunk whose request is unknown, say)."""
        from vllm.entrypoints.serve.exception_handling.error_response import (
            create_error_response,
        )

        response = create_error_response(message)
        # vLLM hides file paths from a server's clients; these messages are
        # derender's own, for the user who named the files (--requests).
        response.error.message = message.strip()
        return json_answer(response.model_dump(), 400)

    @staticmethod
    def chat_response(fields: Mapping[str, Any]) -> dict[str, Any]:
        """A full ``ChatCompletionResponse`` from assembled fields, with
        vLLM's defaults for the rest, so it lines up with a one-shot answer."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse

        return ChatCompletionResponse.model_validate(fields).model_dump()

    @staticmethod
    def completion_response(fields: Mapping[str, Any]) -> dict[str, Any]:
        """A full ``CompletionResponse`` from assembled fields."""
        from vllm.entrypoints.openai.completion.protocol import CompletionResponse

        return CompletionResponse.model_validate(fields).model_dump()

    def close(self) -> None:
        """Close the event loop; the engine opens a new one if used again."""
        self._loop.close()

    def after_fork(self) -> None:
        """Use the engine in a process forked from the one that built it.

        A fork copies memory, not threads. With the start-up proven
        (`versions`), the renderer's work runs inline (`_InlineExecutor`),
        so no pool thread is missing; elsewhere it runs on vLLM's own pool,
        as in its server, and any fork gives the child a fresh one
        (`_fresh_pool_in_forked_children`). The event loop was closed before
        the fork (`close`), so the child opens its own and shares no
        descriptors. Nothing is left to repair.
        """

    def _run(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        """Run a handler coroutine to its end.

        Most calls never wait on anything (a live stream steps in place),
        so the coroutine is first stepped here, without the cost of an
        event-loop turn; one that awaits vLLM's thread pool (its
        ``make_async`` helpers) finishes on the engine's event loop.
        """
        if self._loop.is_closed():
            self._loop = _new_loop()
        # make_async binds its futures to the current event loop.
        asyncio.set_event_loop(self._loop)
        try:
            awaited = coroutine.send(None)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        return self._loop.run_until_complete(_finish(coroutine, awaited))

    async def _dispatch(self, endpoint: Endpoint, request: Any) -> Answer:
        """The body of the api_router handlers for the derender paths."""
        (chat_stream, completion_stream), ErrorResponse = _dispatch_types()  # noqa: N806 - a class
        if type(request) is chat_stream or type(request) is completion_stream:
            if type(request) is chat_stream:
                result = await self._serving.derender_chat_stream_response(request)
            else:
                result = await self._serving.derender_completion_stream_response(request)
            if isinstance(result, ErrorResponse):
                return json_answer(result.model_dump(), result.error.code)
            chunk, stream_state = result
            return stream_answer(chunk.model_dump(), stream_state)

        if self.decode == "fast" and self._fast_paths.responses:
            # vLLM's handlers, writing the dict their models would only be
            # dumped to (`responses.DirectResponses`).
            direct = self._direct
            assert direct is not None  # made where the path is proven
            result = await (direct.chat(request) if endpoint is Endpoint.CHAT else direct.completion(request))
        elif endpoint is Endpoint.CHAT:
            result = await self._serving.derender_chat_response(request)
        else:
            result = await self._serving.derender_completion_response(request)
        if isinstance(result, ErrorResponse):
            return json_answer(result.model_dump(), result.error.code)
        spliced = self._serving.online_derenderer.spliced
        if isinstance(result, dict):  # a plain response, as its model dumps it
            return json_answer(result, spliced=spliced, plain=True)
        return json_answer(result.model_dump(), spliced=spliced)

    def _validation_answer(self, errors: list[dict[str, Any]]) -> Answer:
        from fastapi.exceptions import RequestValidationError
        from vllm.entrypoints.serve.exception_handling.handlers.validation import (
            validation_exception_handler,
        )

        return self._handled(validation_exception_handler, RequestValidationError(errors))

    def internal_error(self, exc: Exception) -> Answer:
        """What the app's catch-all exception handler answers for `exc`."""
        from vllm.entrypoints.serve.exception_handling.handlers.exception import (
            exception_handler,
        )

        return self._handled(exception_handler, exc, fallback=False)

    def _handled(
        self,
        handler: Callable[[Any, Any], Coroutine[Any, Any, Any]],
        exc: Exception,
        *,
        fallback: bool = True,
    ) -> Answer:
        """The answer one of the app's exception handlers gives for `exc`."""
        try:
            response = self._run(handler(_HANDLER_REQUEST, exc))
        except Exception as failure:
            # A handler that fails itself (echoing a deeply nested input, say)
            # gets the server's bare "Internal Server Error" text; a JSONL
            # output needs JSON, so it gets the catch-all handler's shape.
            if not fallback:
                raise
            return self.internal_error(failure)
        return Answer(response.status_code, bytes(response.body))


def _direct_responses(serving: Any) -> DirectResponses:
    """The fast decode's one-shot handlers over `serving` (vLLM's models
    dump their templates then). Kept by the engine, not in a memo keyed by
    `serving`, which held every stack ever built, its tokenizer and tables
    with it."""
    from .responses import DirectResponses

    return DirectResponses(serving)


@functools.cache
def _dispatch_types() -> tuple[tuple[type, ...], type]:
    """The streaming request classes and vLLM's error response class,
    imported once rather than on every call."""
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
        DerenderChatStreamRequest,
        DerenderCompletionStreamRequest,
    )
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    return (DerenderChatStreamRequest, DerenderCompletionStreamRequest), ErrorResponse


class _FastPaths(NamedTuple):
    """The fast paths an engine may take (`versions.PROVEN`)."""

    decode: bool
    requests: bool
    responses: bool
    live: bool
    replay: bool
    logprobs: bool


def _fast_paths(serving: Any) -> _FastPaths:
    """The fast paths proven on the installed vLLM, given a stack: the
    decode and live paths need derender's derenderer in it."""
    if not versions.proven("decode"):
        # fast.py imports vLLM's private names, which a release never seen
        # may have moved: not even imported then.
        return _FastPaths(decode=False, requests=False, responses=False, live=False, replay=False, logprobs=False)
    from .fast import FastDerenderer

    ours = isinstance(serving.online_derenderer, FastDerenderer)
    decode = ours
    return _FastPaths(
        decode=decode,
        requests=decode and versions.proven("requests"),
        responses=decode and versions.proven("responses"),
        live=ours and decode and versions.proven("live"),
        replay=ours and decode and versions.proven("live") and versions.proven("replay"),
        logprobs=decode and versions.proven("requests") and versions.proven("logprobs"),
    )


def _checked_decode(decode: str) -> str:
    if decode not in DECODE_MODES:
        raise ConfigError(f"--decode: unknown mode {decode!r}. Valid modes: {', '.join(DECODE_MODES)}.")
    return decode


async def _finish(coroutine: Coroutine[Any, Any, _T], awaited: Any) -> _T:
    """Await the rest of a coroutine that was stepped once by hand."""
    return await _Resumed(coroutine, awaited)


class _Resumed:
    """An awaitable that goes on driving a coroutine from the point where
    it yielded `awaited`, passing results and exceptions through."""

    def __init__(self, coroutine: Coroutine[Any, Any, Any], awaited: Any) -> None:
        self._coroutine = coroutine
        self._awaited = awaited

    def __await__(self) -> Generator[Any, Any, Any]:
        awaited = self._awaited
        while True:
            try:
                sent = yield awaited
            except BaseException as exc:  # noqa: BLE001 - thrown into the coroutine
                resume: Callable[[Any], Any] = self._coroutine.throw
                argument: Any = exc
            else:
                resume, argument = self._coroutine.send, sent
            try:
                awaited = resume(argument)
            except StopIteration as done:
                return done.value


_REPAIRED_IN_CHILDREN: weakref.WeakSet[Executor] = weakref.WeakSet()
_ENGINE_LOOPS: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()


def _new_loop() -> asyncio.AbstractEventLoop:
    loop = asyncio.new_event_loop()
    _ENGINE_LOOPS.add(loop)
    return loop


def _close_inherited_loops() -> None:
    """In a forked child, the engines' open event loops share the parent's
    epoll instance and self-pipe. Closed as they are (here, or at the
    child's exit), they would unregister the parent's self-pipe from that
    shared epoll, and the parent's next call that waits on vLLM's pool
    would never wake (``Dataset.map(num_proc=...)``, then a call in the
    parent). Each gets a selector of its own first; the engines open new
    loops (`DerenderEngine._run`)."""
    for loop in list(_ENGINE_LOOPS):
        if not loop.is_closed() and not loop.is_running() and hasattr(loop, "_selector"):
            loop._selector = selectors.DefaultSelector()
            loop.close()


os.register_at_fork(after_in_child=_close_inherited_loops)


def _fresh_pool_in_forked_children(executor: Executor) -> None:
    """Where the renderer's work runs on vLLM's own thread pool, a forked
    child's copy of the pool counts threads the child does not have, and
    its first call would wait forever. So in every child (a job's workers,
    ``Dataset.map(num_proc=...)``, the warm server's children) the pool gets
    threads of its own, keeping the object (vLLM's ``make_async`` wrappers
    hold it)."""
    if executor in _REPAIRED_IN_CHILDREN:
        return
    _REPAIRED_IN_CHILDREN.add(executor)
    held = weakref.ref(executor)

    def fresh() -> None:
        pool = held()
        if hasattr(pool, "replace_inner"):  # vLLM's _SwappableExecutor
            pool.replace_inner()
        elif isinstance(pool, ThreadPoolExecutor):
            # The stdlib pool's state made anew: no thread, an empty queue.
            pool.__init__(pool._max_workers, pool._thread_name_prefix)  # type: ignore[misc]

    os.register_at_fork(after_in_child=fresh)


class _InlineExecutor(Executor):
    """Runs submitted work at once, in the submitting thread."""

    def submit(self, fn: Callable[..., _T], /, *args: Any, **kwargs: Any) -> Future[_T]:
        future: Future[_T] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:
            future.set_exception(exc)
        return future


# vLLM's exception handlers read only ``request.app.state.args.log_error_stack``
# (and the request id when that is set), so this stands in for the request.
_HANDLER_REQUEST: Any = SimpleNamespace(
    app=SimpleNamespace(state=SimpleNamespace(args=SimpleNamespace(log_error_stack=False))),
    state=SimpleNamespace(),
)


@functools.cache
def _chat_requests() -> ChatRequests:
    from .requests import ChatRequests

    return ChatRequests()


@functools.cache
def _validation_loggers() -> tuple[logging.Logger, ...]:
    """The loggers of the modules whose request models validate a derender
    body (their validators log at debug level), and vLLM's own above them."""
    names = (
        "vllm",
        "vllm.entrypoints.serve.engine.protocol",
        "vllm.entrypoints.openai.chat_completion.protocol",
        "vllm.entrypoints.openai.completion.protocol",
        "vllm.entrypoints.generate.base.protocol",
        "vllm.entrypoints.scale_out.token_in_token_out.protocol",
    )
    return tuple(logging.getLogger(name) for name in names)


def _body_adapter(union: Any) -> TypeAdapter[Any]:
    """Validate a body the way FastAPI validates the handlers' body
    parameter: a TypeAdapter over the annotation, from Python objects."""
    from typing import Annotated

    from fastapi import Body
    from pydantic import TypeAdapter

    return TypeAdapter(Annotated[union, Body()])


class collector_paused:  # noqa: N801 - a context manager, named as one
    """The cyclic garbage collector off for one call, as it was after.
    (A class: a generator's machinery cost a live stream's chunk more than
    the pause itself.)"""

    __slots__ = ("_enabled",)

    def __enter__(self) -> None:
        self._enabled = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc_info: object) -> None:
        if self._enabled:
            gc.enable()


def _vocab_size(tokenizer: Any) -> int:
    """Every id the tokenizer can decode is below this: its length counts
    added tokens, and its highest id covers any gap."""
    size = len(tokenizer)
    try:
        return max(size, int(tokenizer.max_token_id) + 1)
    except (AttributeError, NotImplementedError):
        return size


def _is_state_object(state: Any) -> bool:
    """A state carried as the object an earlier answer returned (vLLM's
    state model, or a live state), rather than as JSON."""
    return hasattr(state, "model_dump")


def _materialized(body: Any) -> Any:
    """The body with a live state turned into vLLM's state model, for full
    validation (a live state's history is not kept as a list)."""
    if isinstance(body, Mapping) and hasattr(body.get("stream_state"), "to_model"):
        return {**body, "stream_state": body["stream_state"].to_model()}
    return body


def import_ahead() -> None:
    """Import the rest of what every derender call needs, for a process
    (the warm server) that imports once and forks per call. Call it after
    `stack.prepare_environment`."""
    import vllm.entrypoints.common.cli_args  # noqa: F401
    import vllm.renderers  # noqa: F401
    import vllm.renderers.online_derenderer  # noqa: F401

    from . import live  # noqa: F401
