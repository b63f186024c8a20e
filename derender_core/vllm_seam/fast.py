"""vLLM's per-token decode and logprob functions, computed exactly in bulk.

vLLM decodes an output one token at a time (``_detokenize_delta`` over
``detokenize_incrementally``): per token, two list slices, two calls of the
tokenizer's ``convert_tokens_to_string`` and a round trip through its
thread-pool queue. Logprobs decode every id of every position afresh
(``decode_token_ids``) and build seven pydantic models per position. The
answers are right; the cost is 30 to 400 µs per output token where the work
is about 1 µs.

`TokenTable` gives the same results with the same tokenizer primitives,
called in bulk:

- `TokenTable.detokenize_delta` is vLLM's incremental loop, step for step,
  with the token pieces looked up once per id and the tokenizer's Rust
  decoder called directly (what ``convert_tokens_to_string`` does for a
  fast tokenizer). It holds for every fast tokenizer; streams use it.
- `TokenTable.decode_whole` decodes a complete output with one decoder call
  and proves on the spot that the answer equals the incremental one, for the
  decoder kinds where that identity holds (`decoder_kind`; the argument is in
  ``docs/decoding.md``). It answers None when a guard fails, and the caller
  runs the incremental loop instead.
- `TokenTable.logprob_piece` is ``decode_token_ids`` for one id, computed once
  per id (it decodes each id independently); `render_chat_logprobs` and
  `render_completion_logprobs` write the ``logprobs`` JSON the response
  models would serialise.

A tokenizer these do not cover (Mistral's tekken, slow tokenizers, a class
that overrides the decode methods) gets no table, and vLLM's own functions run.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from transformers.tokenization_utils_base import PreTrainedTokenizerBase
from transformers.tokenization_utils_tokenizers import TokenizersBackend
from vllm.entrypoints.generate.base.serving import decode_token_ids, format_token_id_placeholder
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponseChoice,
    ChatMessage,
)
from vllm.entrypoints.openai.completion.protocol import CompletionRequest, CompletionResponseChoice
from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
    DerenderStreamState,
    GenerateTokensResponse,
)
from vllm.entrypoints.serve.utils.tool_calls_utils import resolve_finish_reason
from vllm.renderers import online_derenderer as vllm_derenderer
from vllm.renderers.online_derenderer import (
    OnlineDerenderer,
    _chat_top_logprobs_limit,
    _completion_top_logprobs_limit,
    _convert_chat_logprobs_to_completion_logprobs,
    _correct_decoded_token,
    _decode_params,
    _resolve_logprobs,
    _seed_stream_state,
    _stop_strings,
)
from vllm.tokenizers.detokenizer_utils import INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET
from vllm.tokenizers.hf import ThreadSafeHFTokenizerMixin
from vllm.v1.engine.detokenizer import check_stop_strings

from ..errors import ConfigError
from . import parsers
from . import logprobs as raw_logprobs
from .logprobs import Piece
from .logprobs import json_str as _json_str

# What moved between the supported releases, each read off vLLM's own code
# (not its version string), so one code path is exact on both.
WINDOW_IDS = "prev_token_ids" in DerenderStreamState.model_fields
"""0.34: the stream state's decode window holds ids (``prev_token_ids``),
re-converted to pieces on each call; an id out of the vocabulary is skipped
and a skipped special token leaves the window. 0.33: it holds the pieces
(``prev_tokens``)."""
RESOLVES_PROMPT = hasattr(vllm_derenderer, "_resolve_prompt_logprobs")
"""0.34: the derenderer fills prompt logprobs' decoded tokens, chat's
``_derender_chat`` returns them beside the choices, a missing prompt count
falls back to the generate usage's, and the parser reads the engine's
prompt ids before the caller's. 0.33: prompt logprobs pass as given and a
missing count is 0."""
TOKENS_AS_IDS = hasattr(OnlineDerenderer, "_return_tokens_as_token_ids")
"""0.34: ``return_tokens_as_token_ids`` (the server flag, or the request's
field) writes logprob tokens as ``token_id:N`` placeholders. 0.33 ignores it."""


def resolved_prompt_logprobs(prompt_logprobs: Any, tokenizer: Any) -> Any:
    """The prompt logprobs a response carries (`RESOLVES_PROMPT`)."""
    if RESOLVES_PROMPT:
        return vllm_derenderer._resolve_prompt_logprobs(prompt_logprobs, tokenizer)
    return prompt_logprobs


def prompt_count(prompt_tokens: int | None, usage: Any) -> int:
    """Usage's ``prompt_tokens`` for a caller's count (`RESOLVES_PROMPT`)."""
    if RESOLVES_PROMPT:
        return vllm_derenderer.resolve_prompt_tokens(prompt_tokens, usage)  # type: ignore[no-any-return]
    return prompt_tokens if prompt_tokens is not None else 0


_REPLACEMENT = "\ufffd"

# The methods the table stands in for, as the class that defines them for a
# fast tokenizer has them; a subclass overriding one decodes its own way.
_BYPASSED = ("convert_ids_to_tokens", "convert_tokens_to_string")


def decoder_kind(tokenizer: Any) -> str | None:
    """The decoder family whose whole-sequence decode is proven equal to the
    incremental one, or None.

    - ``byte-level``: the ByteLevel decoder maps each piece to bytes on its
      own and decodes the concatenation as lossy UTF-8.
    - ``sentencepiece``: Metaspace alone, or a Sequence of per-piece Replace
      steps, ByteFallback, Fuse and a Strip of at most one leading space:
      per-piece maps, a fold over the joined string, and a change at the
      first character only.
    """
    decoder = tokenizer.backend_tokenizer.decoder
    if decoder is None:
        return None
    state = json.loads(decoder.__getstate__())
    kind = state.get("type")
    if kind == "ByteLevel":
        return "byte-level"
    if kind == "Metaspace":
        return "sentencepiece"
    if kind == "Sequence" and all(_per_piece_or_first_char(step) for step in state.get("decoders", ())):
        return "sentencepiece"
    return None


def _per_piece_or_first_char(step: dict[str, Any]) -> bool:
    kind = step.get("type")
    if kind in ("ByteFallback", "Fuse"):
        return True
    if kind == "Replace":
        # A literal pattern, replaced by something: no piece decodes to "".
        return "String" in (step.get("pattern") or {}) and bool(step.get("content"))
    if kind == "Strip":
        return step.get("content") == " " and step.get("start", 0) <= 1 and step.get("stop", 0) == 0
    return False


def token_table(tokenizer: Any) -> TokenTable | None:
    """A table for a fast tokenizer that decodes as its base class does."""
    if not isinstance(tokenizer, TokenizersBackend) or not tokenizer.is_fast:
        return None
    cls = type(tokenizer)
    for name in _BYPASSED:
        if getattr(cls, name) is not getattr(TokenizersBackend, name):
            return None
    return TokenTable(tokenizer)


SEED_WINDOW = INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET + 2
"""The prompt ids ``convert_prompt_ids_to_tokens`` reads: its last ones."""

KEPT = 4096
"""Seed states and seed texts a table remembers, each; then it starts over."""


class TokenTable:
    """What vLLM's per-token functions compute for each id, computed once."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        backend = tokenizer.backend_tokenizer
        decoder = backend.decoder
        # TokenizersBackend.convert_tokens_to_string, without the call layers.
        self._decode_pieces = decoder.decode if decoder is not None else " ".join
        self._id_to_token = backend.id_to_token
        self.size = len(tokenizer)
        """``detokenize_incrementally`` decodes an id at or above this as ""."""
        self.special_ids = frozenset(tokenizer.all_special_ids)
        self.kind = decoder_kind(tokenizer)
        self._pieces: dict[int, str] = {}
        self._logprob_pieces: dict[int, Piece] = {}
        self._placeholders: dict[int, Piece] = {}
        self._decoding = _Decoding(tokenizer)
        self._seeds: parsers.Remembered[tuple[tuple[int, ...], bool], DerenderStreamState] = parsers.Remembered(KEPT)
        self._heads: parsers.Remembered[tuple[str, ...], str] = parsers.Remembered(KEPT)
        self._windows: parsers.Remembered[tuple[tuple[int, ...], bool], list[str]] = parsers.Remembered(KEPT)

    def seed_state(self, prompt_token_ids: list[int] | None, skip_special_tokens: bool) -> DerenderStreamState:
        """vLLM's ``_seed_stream_state``, remembered per prompt tail: it
        reads only the last `SEED_WINDOW` ids, and a dataset's prompts
        mostly end alike (the chat template's assistant header). The fast
        path only reads the state. Without a prompt, vLLM's function runs
        each time (it may warn)."""
        if not prompt_token_ids:
            return _seed_stream_state(self.tokenizer, prompt_token_ids, skip_special_tokens=skip_special_tokens)
        return self._seeds.get_or_make(
            (tuple(prompt_token_ids[-SEED_WINDOW:]), skip_special_tokens),
            lambda: _seed_stream_state(self.tokenizer, prompt_token_ids, skip_special_tokens=skip_special_tokens),
        )

    def window(self, state: DerenderStreamState, skip_special_tokens: bool) -> list[str]:
        """The decode window's pieces as vLLM's ``_detokenize_delta`` reads
        them off `state`: held there on 0.33; on 0.34 (`WINDOW_IDS`) its ids
        converted as vLLM converts them, remembered per window (a seed's
        is read by every output of the prompt). Not to be changed."""
        if not WINDOW_IDS:
            return state.prev_tokens  # type: ignore[no-any-return]
        ids = state.prev_token_ids
        return self._windows.get_or_make(
            (tuple(ids), skip_special_tokens),
            lambda: [
                token or ""
                for token in self.tokenizer.convert_ids_to_tokens(ids, skip_special_tokens=skip_special_tokens)
            ],
        )

    def _seed_text(self, seed: list[str]) -> str:
        """The text of a seed window's pieces, remembered as `seed_state`."""
        return self._heads.get_or_make(tuple(seed), lambda: self._decode_pieces(seed))  # type: ignore[no-any-return]

    # --- text -----------------------------------------------------------

    def piece(self, token_id: int) -> str:
        """``convert_ids_to_tokens([id])`` with None as "", for an id in range."""
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._id_to_token(token_id) or ""
            self._pieces[token_id] = piece
        return piece

    def pieces(self, token_ids: Sequence[int], skip_special_tokens: bool) -> list[str]:
        """The pieces ``detokenize_incrementally`` appends for these ids, in
        one list.

        The usual output (every id in range, no special token to skip) is
        looked up in one batched pass over the remembered pieces; anything
        else, or an id not looked up before, takes the per-id steps
        (`_steps`), which also remember the new ids' pieces. Only `_steps`
        remembers pieces, and only for ids in range, so an id out of range
        is never found: the lookup raises KeyError and the steps answer,
        with no separate range check."""
        if not (skip_special_tokens and not self.special_ids.isdisjoint(token_ids)):
            with contextlib.suppress(KeyError):
                return list(map(self._pieces.__getitem__, token_ids))
        return [piece for step in self._steps(token_ids, skip_special_tokens) for piece in step]

    def detokenize_delta(
        self,
        token_ids: Sequence[int],
        prev_tokens: Sequence[str],
        prefix_offset: int,
        read_offset: int,
        skip_special_tokens: bool,
        prev_ids: Sequence[int] | None = None,
    ) -> tuple[Any, ...]:
        """``OnlineDerenderer._detokenize_delta`` for a fast tokenizer, step
        for step: (text, prev_tokens, prefix_offset, read_offset).

        With the window's ids, `prev_ids` (vLLM 0.34, `WINDOW_IDS`), its
        steps: an id out of the vocabulary is skipped, and the window's ids
        are kept beside its pieces (a skipped special token leaves neither)
        and returned last."""
        decode = self._decode_pieces
        prev = list(prev_tokens)
        ids = None if prev_ids is None else list(prev_ids)
        if ids is not None:
            token_ids = [t for t in token_ids if 0 <= t < self.size]
        parts: list[str] = []
        for token_id, new_tokens in zip(token_ids, self._steps(token_ids, skip_special_tokens), strict=True):
            output_token_count = len(prev) + len(new_tokens)
            window_start = min(prefix_offset, read_offset, len(prev))
            output_tokens = (prev[window_start:] if window_start else prev) + new_tokens
            prefix_text = decode(output_tokens[prefix_offset - window_start : read_offset - window_start])
            new_text = decode(output_tokens[prefix_offset - window_start :])
            if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
                text = ""
            else:
                text = new_text[len(prefix_text) :]
                prefix_offset, read_offset = read_offset, output_token_count
            if ids is not None:
                ids = (ids + [token_id] if new_tokens else ids)[prefix_offset:]
            prev = (prev + new_tokens)[prefix_offset:]
            read_offset -= prefix_offset
            prefix_offset = 0
            parts.append(text)
        if ids is not None:
            return "".join(parts), prev, prefix_offset, read_offset, ids
        return "".join(parts), prev, prefix_offset, read_offset

    def _steps(self, token_ids: Sequence[int], skip_special_tokens: bool) -> list[list[str]]:
        """Per id, the pieces one ``detokenize_incrementally`` step appends:
        none for a skipped special token, "" for an id out of range."""
        size, piece = self.size, self.piece
        special = self.special_ids if skip_special_tokens else frozenset()
        return [([] if t in special else [piece(t)]) if 0 <= t < size else [""] for t in token_ids]

    def decode_whole(
        self,
        token_ids: Sequence[int],
        prev_tokens: Sequence[str],
        prefix_offset: int,
        read_offset: int,
        skip_special_tokens: bool,
    ) -> str | None:
        """The text `detokenize_delta` gives for a seed state and these ids,
        from one decode of the seed window and the output, or None where the
        identity is not proven for this input.

        The guards (``docs/decoding.md``): a proven decoder kind; a seed
        window that is the whole readable tail; no empty piece (an empty
        first piece would let a leading Strip reach past it); no U+FFFD in
        the decoded window (every hold-back ends, nothing is cut at the end);
        and the seed's own text a prefix of the window's.
        """
        if self.kind is None or not 0 <= prefix_offset <= read_offset == len(prev_tokens):
            return None
        seed = list(prev_tokens[prefix_offset:])
        pieces = seed + self.pieces(token_ids, skip_special_tokens)
        if "" in pieces:
            return None
        whole = self._decode_pieces(pieces)
        if _REPLACEMENT in whole:
            return None
        head = self._seed_text(seed) if seed else ""
        if not whole.startswith(head):
            return None
        return whole[len(head) :]

    # --- logprobs ---------------------------------------------------------

    def logprob_piece(self, token_id: int) -> Piece:
        """``decode_token_ids([id])``, computed once per id: each id decodes
        on its own there, so a batch is the concatenation of its ids'."""
        known = self._logprob_pieces.get(token_id)
        if known is None:
            ((token, token_bytes),) = decode_token_ids([token_id], self.tokenizer)
            known = Piece(token, token_bytes)
            self._logprob_pieces[token_id] = known
        return known

    def placeholder(self, token_id: int) -> Piece:
        """A logprob token written as its id (vLLM 0.34's
        ``return_tokens_as_token_ids``): its placeholder and no bytes."""
        known = self._placeholders.get(token_id)
        if known is None:
            known = self._placeholders[token_id] = Piece(format_token_id_placeholder(token_id), None)
        return known

    def resolve_logprobs(
        self,
        logprobs: Any,
        initial_context_token_ids: Sequence[int],
        top_limit: int | None,
        tokens_as_ids: bool = False,
    ) -> list[Position] | None:
        """``_resolve_logprobs``' content, as `Position`s; None for no
        content. A piece ending in U+FFFD is corrected by vLLM's own
        ``_correct_decoded_token`` with the same context (the sampled ids
        before the position). With `tokens_as_ids`, each token is its
        `placeholder`."""
        content = logprobs.content
        if content is None:
            return None
        context = list(initial_context_token_ids)
        resolved = []
        if tokens_as_ids:
            placeholders = self._placeholders.get
            for entry in content:
                tops = entry.top_logprobs if top_limit is None else entry.top_logprobs[:top_limit]
                kept = [(placeholders(top.token_id) or self.placeholder(top.token_id), top.logprob) for top in tops]
                piece = placeholders(entry.token_id) or self.placeholder(entry.token_id)
                resolved.append(Position(piece, entry.logprob, kept, bool(entry.top_logprobs)))
            return resolved
        known = self._logprob_pieces.get
        for entry in content:
            tops = entry.top_logprobs if top_limit is None else entry.top_logprobs[:top_limit]
            kept = []
            for top in tops:
                piece = known(top.token_id) or self.logprob_piece(top.token_id)
                if piece.needs_correction:
                    piece = self._corrected(top.token_id, context)
                kept.append((piece, top.logprob))
            piece = known(entry.token_id) or self.logprob_piece(entry.token_id)
            if piece.needs_correction:
                piece = self._corrected(entry.token_id, context)
            resolved.append(Position(piece, entry.logprob, kept, bool(entry.top_logprobs)))
            context.append(entry.token_id)
        return resolved

    def _corrected(self, token_id: int, context: list[int]) -> Piece:
        token = _correct_decoded_token(token_id, context, self._decoding)
        return Piece(token, list(token.encode("utf-8")))


class _Decoding:
    """``tokenizer.decode`` of short id lists, for vLLM's byte-fallback
    correction (``_correct_decoded_token`` calls nothing else): remembered
    per list, and, where transformers' ``decode`` comes down to the Rust
    tokenizer's alone (no clean-up, no override), that call without the
    Python layers around it."""

    KEPT = 1 << 16

    def __init__(self, tokenizer: Any) -> None:
        cls = type(tokenizer)
        plain = (
            cls.decode is PreTrainedTokenizerBase.decode
            and cls._decode is TokenizersBackend._decode
            and not tokenizer.clean_up_tokenization_spaces
        )
        self.plain = plain
        """Whether `decode` is the Rust tokenizer's own decode."""
        backend_decode = tokenizer.backend_tokenizer.decode
        self._decode: Any = (lambda ids: backend_decode(ids, skip_special_tokens=False)) if plain else tokenizer.decode
        self.uncached: Any = (
            functools.partial(backend_decode, skip_special_tokens=False) if plain else tokenizer.decode
        )
        """`_decode` itself, with no memo and no Python frame around the
        Rust call: the same strings as `decode`."""
        self._known: parsers.Remembered[tuple[int, ...], str] = parsers.Remembered(self.KEPT)

    def decode(self, token_ids: list[int]) -> str:
        return self._known.get_or_make(tuple(token_ids), lambda: self._decode(token_ids))  # type: ignore[no-any-return]


class Position(NamedTuple):
    """One resolved logprobs position."""

    piece: Piece
    logprob: float
    tops: list[tuple[Piece, float]]
    had_candidates: bool
    """Whether generate listed candidates here (before the endpoint's cut)."""

    def finite(self) -> bool:
        """Every logprob finite. A sum is finite only if its terms are; one
        that overflows only sends the answer down vLLM's path, which is exact."""
        return math.isfinite(self.logprob + sum(logprob for _, logprob in self.tops))


def render_chat_logprobs(resolved: list[Position] | None) -> str | None:
    """``ChatCompletionLogProbs``' JSON as the response's ``json.dumps``
    writes it (a float as its repr); None if a logprob is not finite: the
    response then cannot be serialised, and vLLM's path words that error."""
    if resolved is None:
        return '{"content":null}'
    out = []
    for position in resolved:
        if not position.finite():
            return None
        piece, logprob, tops, _ = position
        out.append(
            piece.fields_before + repr(logprob) + piece.fields_after + ',"top_logprobs":['
            + ",".join([p.fields_before + repr(lp) + p.fields_after + "}" for p, lp in tops])
            + "]}"
        )
    return '{"content":[' + ",".join(out) + "]}"


def render_completion_logprobs(resolved: list[Position] | None, text_offset: int = 0) -> str | None:
    """``_convert_chat_logprobs_to_completion_logprobs``' result as JSON:
    parallel lists, a position without candidates as null, candidates as an
    object keyed by token (a repeated token keeps its first place and its
    last logprob, as a dict does)."""
    if resolved is None:
        return '{"text_offset":[],"token_logprobs":[],"tokens":[],"top_logprobs":[]}'
    offsets, logprobs, tokens, tops = [], [], [], []
    for position in resolved:
        if not position.finite():
            return None
        offsets.append(str(text_offset))
        text_offset += len(position.piece.token)
        logprobs.append(repr(position.logprob))
        tokens.append(position.piece.token_json)
        if position.had_candidates:
            candidates = {p.token: (p.token_json, lp) for p, lp in position.tops}
            tops.append("{" + ",".join(f"{key}:{lp!r}" for key, lp in candidates.values()) + "}")
        else:
            tops.append("null")
    return (
        '{"text_offset":[' + ",".join(offsets) + '],"token_logprobs":[' + ",".join(logprobs)
        + '],"tokens":[' + ",".join(tokens) + '],"top_logprobs":[' + ",".join(tops) + "]}"
    )


def single_thread_view(tokenizer: Any) -> Any:
    """The tokenizer without vLLM's thread-pool wrapper.

    vLLM routes every call of a fast tokenizer through a queue of deep
    copies (``maybe_make_thread_pool``) so that its executor threads can
    decode at once; that queue round trip is half of a per-token decode.
    derender decodes on one thread, so this view calls the same tokenizer
    class's own methods on the same state: every result is the same.
    """
    if not isinstance(tokenizer, ThreadSafeHFTokenizerMixin):
        return tokenizer
    unwrapped = type(tokenizer).__mro__[1]  # TokenizerPool(<the tokenizer's class>, mixin)
    view = object.__new__(unwrapped)
    view.__dict__.update(tokenizer.__dict__)
    return view


_OFFLOADED = (
    "_derender_chat",
    "_derender_text_choices",
    "_derender_completion",
    "_detokenize_delta",
    "_derender_chat_stream_parsed",
)
"""The methods ``OnlineDerenderer.__init__`` wraps in ``make_async``."""


def _called_inline(method: Any) -> Any:
    async def call(*args: Any, **kwargs: Any) -> Any:
        return method(*args, **kwargs)

    return call


def template_kwargs_key(chat_request: ChatCompletionRequest) -> tuple[Any, ...] | None:
    """What vLLM's ``_resolve_chat_template_kwargs`` reads of a request
    (``build_chat_params``: the reasoning effort, the generation-prompt
    flags, the documents and the request's own template kwargs; the rest
    is the derenderer's, fixed at start-up), as a key; None where a value
    is not a plain one (documents given, a kwarg that is a list or dict).
    ``tests/test_fast_validation.py`` draws requests and derenderer
    settings and checks each answer through the key against vLLM's."""
    kwargs = chat_request.chat_template_kwargs
    if kwargs is None:
        items: tuple[Any, ...] | None = None
    elif type(kwargs) is dict and all(type(value) in _KEY_ATOMS for value in kwargs.values()):
        items = tuple((name, type(value), value) for name, value in kwargs.items())
    else:
        return None
    effort = chat_request.reasoning_effort
    if chat_request.documents is not None or type(effort) not in (str, type(None)):
        return None
    return (effort, chat_request.add_generation_prompt, chat_request.continue_final_message, items)


_KEY_ATOMS = frozenset({type(None), bool, int, float, str})
"""Template kwarg values a key holds (with their type: ``1``, ``1.0`` and
``True`` are equal keys in a dict, but not the same kwarg)."""


class FastDerenderer(OnlineDerenderer):
    """``OnlineDerenderer`` whose decode and logprobs run through a
    `TokenTable` while `decode_mode` is "fast", and as vLLM's own code,
    bug for bug, while it is "reference".

    One-shot logprobs are not built as pydantic models: `spliced` holds, per
    choice of the current call, the JSON the models would serialise to, and
    the endpoint writes it into the response (`render.DerenderEngine`).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.decode_mode = "fast"
        self.tokenizer = single_thread_view(self.renderer.get_tokenizer())
        self.table = token_table(self.tokenizer)
        self.fragments = raw_logprobs.Fragments(self.table) if self.table is not None else None
        """The table's logprob fragments (`raw_logprobs.Fragments`)."""
        self.spliced: list[str | bytes | None] = []
        self._template_kwargs: parsers.Remembered[tuple[Any, ...], dict[str, Any]] = parsers.Remembered(KEPT)
        """`template_kwargs_key` -> vLLM's chat template kwargs for it."""
        parsers.install()
        # vLLM hands each call to the renderer's executor (inline here,
        # `render._InlineExecutor`) and awaits it, which costs an event-loop
        # turn per call; the same functions are called directly instead.
        for name in _OFFLOADED:
            if not hasattr(self, f"{name}_async"):
                raise ConfigError(f"vLLM's OnlineDerenderer no longer offloads {name}: review fast.py")
            setattr(self, f"{name}_async", _called_inline(getattr(self, name)))

    @property
    def fast(self) -> bool:
        return self.table is not None and self.decode_mode == "fast"

    def _resolve_chat_template_kwargs(self, chat_request: ChatCompletionRequest) -> dict[str, Any]:
        """vLLM's, once per set of the request fields it reads
        (`template_kwargs_key`), a copy each time: building the chat
        params it takes them from costs 4 µs of a record, and a parser is
        handed its own dict, as vLLM hands it a new one."""
        key = template_kwargs_key(chat_request) if self.fast else None
        if key is None:
            return super()._resolve_chat_template_kwargs(chat_request)
        resolve = OnlineDerenderer._resolve_chat_template_kwargs
        return dict(self._template_kwargs.get_or_make(key, lambda: resolve(self, chat_request)))

    def _detokenize_delta(
        self,
        tokenizer: Any,
        delta_token_ids: list[int],
        state: DerenderStreamState,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> tuple[str, DerenderStreamState]:
        if self.table is None or not self.fast:
            return super()._detokenize_delta(
                tokenizer, delta_token_ids, state, skip_special_tokens, spaces_between_special_tokens
            )
        text, update = self.window_step(delta_token_ids, state, skip_special_tokens)
        return text, state.model_copy(update=update)

    def window_step(
        self, delta_token_ids: list[int], state: DerenderStreamState, skip_special_tokens: bool
    ) -> tuple[str, dict[str, Any]]:
        """The fast `_detokenize_delta` (a table needed) as the text and the
        state's fields it updates, for a caller that updates more of them
        in the same copy (`live.ChunkLane.answer_completion`).
        spaces_between_special_tokens only matters to slow tokenizers."""
        table: TokenTable = self.table  # type: ignore[assignment]
        window = table.window(state, skip_special_tokens)
        if WINDOW_IDS:
            text, _, prefix_offset, read_offset, ids = table.detokenize_delta(
                delta_token_ids, window, state.prefix_offset, state.read_offset, skip_special_tokens,
                state.prev_token_ids,
            )  # fmt: skip
            return text, {"prev_token_ids": ids, "prefix_offset": prefix_offset, "read_offset": read_offset}
        text, prev_tokens, prefix_offset, read_offset = table.detokenize_delta(
            delta_token_ids, window, state.prefix_offset, state.read_offset, skip_special_tokens
        )
        return text, {"prev_tokens": prev_tokens, "prefix_offset": prefix_offset, "read_offset": read_offset}

    def logprob_options(self, request: ChatCompletionRequest | CompletionRequest | None) -> dict[str, Any]:
        """What vLLM's ``_resolve_logprobs`` takes for `request` besides
        0.33's arguments (`TOKENS_AS_IDS`)."""
        if TOKENS_AS_IDS:
            return {"return_tokens_as_token_ids": self._return_tokens_as_token_ids(request)}
        return {}

    def _decode_output(
        self,
        tokenizer: Any,
        token_ids: list[int],
        finish_reason: str | None,
        stop_reason: int | str | None,
        request: ChatCompletionRequest | CompletionRequest | None,
        seed_state: DerenderStreamState,
        skip_special_tokens: bool,
        spaces_between_special_tokens: bool,
    ) -> tuple[str, int | str | None]:
        """vLLM's ``_decode_output`` with the text from one whole decode
        where `TokenTable.decode_whole` proves it equal."""
        table = self.table
        if table is None or not self.fast:
            return super()._decode_output(
                tokenizer, token_ids, finish_reason, stop_reason, request, seed_state,
                skip_special_tokens, spaces_between_special_tokens,
            )  # fmt: skip
        ids, dropped_reason = self._drop_stop_token(token_ids, finish_reason, stop_reason, request)
        min_tokens = request.min_tokens if request is not None else 0
        seed = (table.window(seed_state, skip_special_tokens), seed_state.prefix_offset, seed_state.read_offset)
        text = table.decode_whole(ids, *seed, skip_special_tokens)
        head = table.decode_whole(ids[:min_tokens], *seed, skip_special_tokens) if min_tokens else ""
        if text is None or head is None or not text.startswith(head):
            # Not proven for this input: the incremental loop (the same
            # steps as vLLM's, through _detokenize_delta) decides.
            return super()._decode_output(
                tokenizer, token_ids, finish_reason, stop_reason, request, seed_state,
                skip_special_tokens, spaces_between_special_tokens,
            )  # fmt: skip
        if finish_reason != "stop" or isinstance(stop_reason, int):
            stop_strings: list[str] = []
        elif isinstance(stop_reason, str):
            stop_strings = [stop_reason]
        else:
            stop_strings = _stop_strings(request)
        include_stop = request is not None and request.include_stop_str_in_output
        match = check_stop_strings(text, len(text) - len(head), stop_strings, include_stop)
        if match is None:
            return text, dropped_reason
        matched, truncate_to = match
        return (text if truncate_to == -1 else text[:truncate_to]), matched

    def _logprobs_json(
        self,
        generate_logprobs: Any,
        top_limit: int | None,
        options: dict[str, Any],
        write_checked: Callable[..., bytes | None],
        render: Callable[[Any], str | None],
    ) -> tuple[Any, str | bytes | None]:
        """A choice's logprobs JSON (None where vLLM's models must fail as
        they do), and its logprobs as read for that: written from the body
        where the body was checked there (`raw_logprobs`), else validated
        and resolved over the table."""
        as_ids = options.get("return_tokens_as_token_ids", False)
        if type(generate_logprobs) is raw_logprobs.RawLogProbs and not as_ids:
            return generate_logprobs, write_checked(self.fragments, generate_logprobs.usual, top_limit)
        generate_logprobs = raw_logprobs.validated(generate_logprobs)
        return generate_logprobs, render(self.table.resolve_logprobs(generate_logprobs, (), top_limit, as_ids))

    def _derender_chat(
        self,
        generate_response: GenerateTokensResponse,
        chat_request: ChatCompletionRequest | None = None,
        prompt_token_ids: list[int] | None = None,
    ) -> Any:
        """vLLM's ``_derender_chat``, with the table's logprobs written as
        JSON (`spliced`) instead of models: the choices, and on 0.34
        (`RESOLVES_PROMPT`) the prompt logprobs beside them."""
        if self.table is None or not self.fast:
            self.spliced = []
            return super()._derender_chat(generate_response, chat_request, prompt_token_ids)
        fields, prompt_logprobs = self.chat_choice_fields(generate_response, chat_request, prompt_token_ids)
        choices = [ChatCompletionResponseChoice(**choice) for choice in fields]
        return (choices, prompt_logprobs) if RESOLVES_PROMPT else choices

    def chat_choice_fields(
        self,
        generate_response: GenerateTokensResponse,
        chat_request: ChatCompletionRequest | None = None,
        prompt_token_ids: list[int] | None = None,
    ) -> tuple[list[dict[str, Any]], Any]:
        """vLLM's ``_derender_chat``, line for line, up to each
        ``ChatCompletionResponseChoice``: the fields it is built from, for
        `responses.DirectResponses` to write where the model would only be
        dumped, and the response's prompt logprobs
        (`resolved_prompt_logprobs`). Only for the fast decode (`fast`)."""
        assert self.table is not None
        self.spliced = []
        tokenizer = self.tokenizer
        choices: list[dict[str, Any]] = []
        has_parser = self.parser is not None and chat_request is not None
        skip_special, spaces_between = _decode_params(tokenizer, chat_request, preserve_special=has_parser)
        seed_ids = prompt_token_ids if prompt_token_ids is not None else generate_response.prompt_token_ids
        seed_state = self.table.seed_state(seed_ids, skip_special)
        chat_template_kwargs = (
            self._resolve_chat_template_kwargs(chat_request) if has_parser and chat_request is not None else {}
        )
        hide_metadata = has_parser and chat_request is not None and not chat_request.include_reasoning
        return_token_ids = chat_request is not None and chat_request.return_token_ids and not hide_metadata
        top_limit = _chat_top_logprobs_limit(chat_request)
        options = self.logprob_options(chat_request)
        # 0.34 hands the parser the engine's prompt ids, else the caller's.
        parser_prompt_ids = (
            generate_response.prompt_token_ids or prompt_token_ids
            if RESOLVES_PROMPT
            else generate_response.prompt_token_ids
        )

        for choice in generate_response.choices:
            if not choice.token_ids:
                raise ValueError(f"choice {choice.index} has empty or null token_ids")
            resolved_logprobs, spliced = None, None
            if choice.logprobs is not None and not hide_metadata:
                generate_logprobs, spliced = self._logprobs_json(
                    choice.logprobs, top_limit, options, raw_logprobs.chat_json, render_chat_logprobs
                )
                if spliced is None:  # not serialisable: vLLM's models fail as they do
                    resolved_logprobs = _resolve_logprobs(
                        raw_logprobs.validated(generate_logprobs), tokenizer, top_limit=top_limit, **options
                    )
            decoded_text, stop_reason = self._decode_output(
                tokenizer, choice.token_ids, choice.finish_reason, choice.stop_reason, chat_request,
                seed_state, skip_special_tokens=skip_special, spaces_between_special_tokens=spaces_between,
            )  # fmt: skip
            if has_parser:
                assert chat_request is not None
                message = self._parse_and_assemble(
                    tokenizer, decoded_text, choice.token_ids, chat_request, chat_template_kwargs, parser_prompt_ids,
                )  # fmt: skip
            else:
                message = ChatMessage(role="assistant", content=decoded_text)
            choices.append(
                {
                    "index": choice.index,
                    "message": message,
                    "logprobs": resolved_logprobs,
                    "finish_reason": resolve_finish_reason(choice.finish_reason, chat_request, bool(message.tool_calls)),
                    "stop_reason": stop_reason,
                    "token_ids": choice.token_ids if return_token_ids else None,
                }
            )
            self.spliced.append(spliced)
        return choices, resolved_prompt_logprobs(generate_response.prompt_logprobs, tokenizer)

    def _derender_completion(
        self,
        generate_responses: list[GenerateTokensResponse],
        prompt_tokens: list[int] | None = None,
        completion_request: CompletionRequest | None = None,
        prompt_token_ids: list[list[int] | None] | None = None,
    ) -> tuple[list[CompletionResponseChoice], int, int]:
        """vLLM's ``_derender_completion``, line for line, with the table's
        logprobs written as JSON (`spliced`)."""
        self.spliced = []
        if self.table is None or not self.fast:
            return super()._derender_completion(generate_responses, prompt_tokens, completion_request, prompt_token_ids)
        n = len(generate_responses)
        prompt_tokens_list = (
            prompt_tokens if prompt_tokens is not None else [prompt_count(None, gen.usage) for gen in generate_responses]
        )
        prompt_token_ids_list = prompt_token_ids if prompt_token_ids is not None else [None] * n
        tokenizer = self.tokenizer
        skip_special, spaces_between = _decode_params(tokenizer, completion_request)
        choices: list[CompletionResponseChoice] = []
        total_prompt_tokens = total_completion_tokens = index = 0
        top_limit = _completion_top_logprobs_limit(completion_request)
        options = self.logprob_options(completion_request)
        return_token_ids = completion_request is not None and completion_request.return_token_ids
        # strict=False: as vLLM zips them
        for gen, pt, seed_ids_override in zip(generate_responses, prompt_tokens_list, prompt_token_ids_list, strict=False):
            seed_ids = seed_ids_override if seed_ids_override is not None else gen.prompt_token_ids
            seed_state = self.table.seed_state(seed_ids, skip_special)
            prompt_logprobs = resolved_prompt_logprobs(gen.prompt_logprobs, tokenizer) if RESOLVES_PROMPT else None
            for choice in gen.choices:
                if not choice.token_ids:
                    raise ValueError(
                        f"choice {choice.index} in response {gen.request_id} has empty or null token_ids"
                    )
                decoded_text, stop_reason = self._decode_output(
                    tokenizer, choice.token_ids, choice.finish_reason, choice.stop_reason, completion_request,
                    seed_state, skip_special_tokens=skip_special, spaces_between_special_tokens=spaces_between,
                )  # fmt: skip
                completion_logprobs, spliced = None, None
                if choice.logprobs is not None:
                    generate_logprobs, spliced = self._logprobs_json(
                        choice.logprobs, top_limit, options, raw_logprobs.completion_json, render_completion_logprobs
                    )
                    if spliced is None:
                        generate_logprobs = raw_logprobs.validated(generate_logprobs)
                        resolved = _resolve_logprobs(generate_logprobs, tokenizer, top_limit=top_limit, **options)
                        completion_logprobs = _convert_chat_logprobs_to_completion_logprobs(resolved, generate_logprobs)
                choices.append(
                    CompletionResponseChoice(
                        index=index,
                        text=decoded_text,
                        finish_reason=choice.finish_reason,
                        stop_reason=stop_reason,
                        logprobs=completion_logprobs,
                        prompt_token_ids=gen.prompt_token_ids if return_token_ids else None,
                        token_ids=choice.token_ids if return_token_ids else None,
                        prompt_logprobs=prompt_logprobs,
                    )
                )
                self.spliced.append(spliced)
                total_completion_tokens += len(choice.token_ids)
                index += 1
            total_prompt_tokens += pt
        return choices, total_prompt_tokens, total_completion_tokens
