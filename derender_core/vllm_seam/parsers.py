"""vLLM's parser engine (``vllm.parser.engine``): the lexicon of special
tokens a parser drops, and the rest of what its ``StreamingParserEngine``
derives from the config, built once per engine config and tokenizer while
the fast decode runs, not once per request.

vLLM builds one parser per request, as it must: a parser is stateful. Every
engine-based parser's ``StreamingParserEngine.__init__`` calls
``_build_drop_info(config, tokenizer)``, which turns the tokenizer's special
tokens that the config does not name into "drop" terminals and builds a
``LexerShape`` over all terminals. That is nearly half of building a Qwen3
parser (24 of 60 µs here), and a sixth of a 30-token record's floor.

Its result depends on nothing but the config and the tokenizer's special
tokens, and nothing writes to it: the engine copies ``extra_token_ids`` into
its own dict, and ``LexerShape`` is, in vLLM's words, immutable data shared
by every lexer of a config (vLLM itself caches the shape of a config without
drops, ``ParserEngineConfig.lexer_shape``). The configs come from
``functools.cache``d builders, one object per set of options, so the config
object and the tokenizer object are the key. Parsers stay vLLM's, built per
request as vLLM builds them; only this pure part is shared.

The rest of ``StreamingParserEngine.__init__`` is the same kind of work
(another 14 µs of a Qwen3 parser): it resolves the config's token-id
terminals against the vocabulary and derives three sets of terminal names
from the config's transitions. The engine itself writes in place only to
its ``TokenIDScanner`` and ``IncrementalLexer``; everything else it holds
is either read-only after ``__init__`` or set anew by ``reset()``, which
vLLM documents as reuse across requests ("preserves cached immutable
structures"). So `fresh_engine` builds an engine from a template that
vLLM's own ``__init__`` built for that config, tokenizer and vocabulary:
the template's attributes, a new scanner and lexer made by their own
constructors with the arguments ``__init__`` gives them, and vLLM's
``reset()``. Each engine still gets its own state.

Every parser's ``__init__`` also asks ``get_tool_call_id_type(model_config)``
which form its tool-call ids take (4 µs of a record: it reads the model's
type through transformers' configuration attributes, twice per parser).
The answer depends on nothing but the model config's ``hf_overrides`` and
its Hugging Face configs' ``model_type``, which vLLM sets as it builds the
config and never changes, so it is asked once per model config
(`ID_TYPES`).

A tool call's id is ``chatcmpl-tool-`` and vLLM's ``random_uuid()``: the
low 64 bits of a ``uuid.uuid4()``, in hex. Building the ``UUID`` object
costs 1 µs of the 1.8 an id takes; `fast_random_uuid` computes the same
bits from the same 8 random bytes they come from, as vLLM's ``make_tool_call_id``
calls it while the fast decode runs (and `requests.ChatRequests` for a
request's own id).

Sharing is on only while `SHARING` is set: `render.DerenderEngine.post`
sets it for the fast decode's calls; ``--decode reference`` and the serve
path run vLLM's functions as they are.
``tests/test_families.py`` checks, on every family's tokenizer, that each
remembered tool-call id type is vLLM's answer, that each
shared lexicon equals vLLM's fresh build after the family's corpus ran
through it, that each engine made from a template is, attribute for
attribute, the engine vLLM's ``__init__`` builds, with no container it
writes to shared with another, that the reference decode shares none,
and that fast answers (one-shot and live, streams interleaved) equal the
reference's byte for byte.
"""

from __future__ import annotations

import contextvars
import functools
import os
from collections.abc import Callable
from typing import Any, TypeVar

LEXICONS_KEPT = 256
"""Lexicons kept per tokenizer: a handful of configs per parser in use (a
thinking toggle, say). A builder that made a new config per request would
fill it; then it is emptied and starts again."""

_K = TypeVar("_K")
_V = TypeVar("_V")


class Remembered(dict[_K, _V]):
    """A memo of at most `limit` entries that starts over when full:
    bounded memory, and no bookkeeping on a hit, which is what it saves.
    (None is never remembered: a value made as None is made again.) The
    lexicons are kept in one, and the fast decode keeps its own memos in
    others (`fast.TokenTable`)."""

    __slots__ = ("limit",)

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def get_or_make(self, key: _K, make: Callable[[], _V]) -> _V:
        value = self.get(key)
        if value is None:
            if len(self) >= self.limit:
                self.clear()
            value = self[key] = make()
        return value


SHARING: contextvars.ContextVar[bool] = contextvars.ContextVar("derender_sharing_lexicons", default=False)
"""True while parser engines built in this context share their lexicon.
(Set per call: a context variable, so a reference call on another thread
or task is never shared.)"""

_KEPT_ON = "_derender_drop_lexicons"
"""The tokenizer attribute that keeps its lexicons, so that they live as
long as the tokenizer does, as vLLM keeps its leading-space marker."""


_ENGINES_ON = "_derender_parser_engines"
"""The tokenizer attribute that keeps its template engines."""

ID_TYPES: Remembered[int, tuple[Any, str]] = Remembered(LEXICONS_KEPT)
"""id(model config) -> (model config, its tool-call id type): an entry
holds its config, so no other config can take its id while it is kept."""


_UUID_VARIANT_CLEAR = ~(0xC000 << 48) & ((1 << 64) - 1)
_UUID_VARIANT = 0x8000 << 48
"""What ``uuid.UUID(..., version=4)`` does to a UUID's low 64 bits: its
variant, RFC 4122's, in their top two (the version is in the high half)."""


def uuid4_low_bits(random_bytes: bytes) -> int:
    """The low 64 bits of ``uuid.UUID(bytes=b, version=4)`` where
    `random_bytes` are the last 8 of its 16 bytes ``b``."""
    return int.from_bytes(random_bytes, "big") & _UUID_VARIANT_CLEAR | _UUID_VARIANT


def fast_random_uuid() -> str:
    """vLLM's ``random_uuid()``, ``f"{uuid.uuid4().int & MASK_64_BITS:016x}"``,
    without the ``UUID`` object: the same bits of the same kind of random
    bytes (``uuid4`` draws ``os.urandom(16)``; the low 64 bits come from
    its last 8)."""
    return f"{uuid4_low_bits(os.urandom(8)):016x}"


@functools.cache
def install() -> None:
    """Put the sharing wrappers where vLLM looks the functions up (module
    globals, read at each call): ``_build_drop_info`` where
    ``StreamingParserEngine.__init__`` calls it, and the engine class where
    ``ParserEngine.__init__``, its one caller, builds it."""
    from vllm.parser import abstract_parser
    from vllm.parser.engine import parser_engine, streaming_parser_engine
    from vllm.renderers.chat_utils import tool_call

    streaming_parser_engine._build_drop_info = _sharing_wrapper(streaming_parser_engine._build_drop_info)
    parser_engine.StreamingParserEngine = _sharing_engines(parser_engine.StreamingParserEngine)
    # The two parser base classes each ask it in __init__, by their own name.
    for module in (abstract_parser, parser_engine):
        module.get_tool_call_id_type = _remembered_id_type(module.get_tool_call_id_type)
    # make_tool_call_id's id, by its module's name for it.
    tool_call.random_uuid = _sharing_uuids(tool_call.random_uuid)


def vllm_build_drop_info() -> Callable[[Any, Any], Any]:
    """vLLM's own ``_build_drop_info``, unwrapped: the tests' reference."""
    from vllm.parser.engine import streaming_parser_engine

    built = streaming_parser_engine._build_drop_info
    return getattr(built, "__wrapped__", built)


def vllm_tool_call_id_type() -> Callable[[Any], str]:
    """vLLM's own ``get_tool_call_id_type``: the tests' reference."""
    from vllm.renderers.chat_utils import get_tool_call_id_type

    return get_tool_call_id_type  # type: ignore[no-any-return]


def _remembered_id_type(ask: Callable[[Any], str]) -> Callable[[Any], str]:
    @functools.wraps(ask)
    def get_tool_call_id_type(model_config: Any) -> str:
        if SHARING.get():
            return ID_TYPES.get_or_make(id(model_config), lambda: (model_config, ask(model_config)))[1]
        return ask(model_config)

    return get_tool_call_id_type


def _sharing_uuids(random_uuid: Callable[[], str]) -> Callable[[], str]:
    @functools.wraps(random_uuid)
    def ids() -> str:
        return fast_random_uuid() if SHARING.get() else random_uuid()

    return ids


def vllm_engine_class() -> type:
    """vLLM's own ``StreamingParserEngine``: the tests' reference."""
    from vllm.parser.engine.streaming_parser_engine import StreamingParserEngine

    return StreamingParserEngine


def lexicons_of(tokenizer: Any) -> Remembered[int, tuple[Any, Any]]:
    """id(config) -> (config, lexicon): the lexicons shared for `tokenizer`.
    An entry holds its config, so no other config can take its id while it
    is kept."""
    return _kept_on(tokenizer, _KEPT_ON)


def _sharing_wrapper(build: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    @functools.wraps(build)
    def build_drop_info(config: Any, tokenizer: Any) -> Any:
        if SHARING.get() and hasattr(tokenizer, "__dict__"):
            # Built by vLLM's function on first use, then shared.
            return lexicons_of(tokenizer).get_or_make(id(config), lambda: (config, build(config, tokenizer)))[1]
        return build(config, tokenizer)

    return build_drop_info


def engines_of(tokenizer: Any) -> Remembered[tuple[int, int], tuple[Any, Any, Any]]:
    """(id(config), id(vocab)) -> (config, vocab, template engine): the
    template engines kept for `tokenizer`. An entry holds its config and
    vocabulary, so their ids stay theirs while it is kept."""
    return _kept_on(tokenizer, _ENGINES_ON)


def _kept_on(tokenizer: Any, attribute: str) -> Remembered[Any, Any]:
    """The memo `tokenizer` keeps in `attribute`, made on first use."""
    kept = vars(tokenizer).get(attribute)
    if kept is None:
        kept = Remembered(LEXICONS_KEPT)
        setattr(tokenizer, attribute, kept)
    return kept  # type: ignore[no-any-return]


def fresh_engine(template: Any, tokenizer: Any, initial_state: Any = None) -> Any:
    """A new ``StreamingParserEngine``, as vLLM's ``__init__`` would build
    it for the template's config, `tokenizer` and vocabulary, with
    `initial_state`: the template's read-only parts, a scanner and a lexer
    of its own, and the per-request state set by vLLM's ``reset()``."""
    from vllm.parser.engine.incremental_lexer import IncrementalLexer
    from vllm.parser.engine.token_id_scanner import TokenIDScanner

    engine = object.__new__(type(template))
    vars(engine).update(vars(template))
    lexer = template._lexer
    engine._scanner = TokenIDScanner(template._resolved_token_ids, tokenizer)
    engine._lexer = IncrementalLexer(lexer._shape, content_terminal=lexer.content_terminal)
    engine.skip_tool_parsing = False
    engine.skip_reasoning_parsing = False
    engine.reset(initial_state=initial_state)
    return engine


def _sharing_engines(engine_class: type) -> Callable[..., Any]:
    def StreamingParserEngine(  # noqa: N802 - it stands where the class was named
        config: Any, tokenizer: Any, initial_state: Any = None, vocab: dict[str, int] | None = None
    ) -> Any:
        if SHARING.get() and hasattr(tokenizer, "__dict__"):
            # The template is built by vLLM's own __init__ on first use.
            template = engines_of(tokenizer).get_or_make(
                (id(config), id(vocab)), lambda: (config, vocab, engine_class(config, tokenizer, vocab=vocab))
            )[2]
            return fresh_engine(template, tokenizer, initial_state)
        return engine_class(config, tokenizer, initial_state=initial_state, vocab=vocab)

    StreamingParserEngine.__wrapped__ = engine_class  # type: ignore[attr-defined]
    return StreamingParserEngine
