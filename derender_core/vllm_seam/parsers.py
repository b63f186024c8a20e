"""vLLM's parser engine (``vllm.parser.engine``): the lexicon of special
tokens a parser drops, built once per engine config and tokenizer while the
fast decode runs, not once per request.

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

Sharing is on only while `SHARING` is set: `render.DerenderEngine.post`
sets it for the fast decode's calls; ``--decode reference`` and the serve
path run vLLM's function as it is.
``tests/test_families.py`` checks, on every family's tokenizer, that each
shared lexicon equals vLLM's fresh build after the family's corpus ran
through it, that the reference decode shares none, and that fast answers
equal the reference's byte for byte.
"""

from __future__ import annotations

import contextvars
import functools
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


@functools.cache
def install() -> None:
    """Put the sharing wrapper where ``StreamingParserEngine.__init__``
    looks the function up (a module global, read at each call)."""
    from vllm.parser.engine import streaming_parser_engine

    streaming_parser_engine._build_drop_info = _sharing_wrapper(streaming_parser_engine._build_drop_info)


def vllm_build_drop_info() -> Callable[[Any, Any], Any]:
    """vLLM's own ``_build_drop_info``, unwrapped: the tests' reference."""
    from vllm.parser.engine import streaming_parser_engine

    built = streaming_parser_engine._build_drop_info
    return getattr(built, "__wrapped__", built)


def lexicons_of(tokenizer: Any) -> Remembered[int, tuple[Any, Any]]:
    """id(config) -> (config, lexicon): the lexicons shared for `tokenizer`.
    An entry holds its config, so no other config can take its id while it
    is kept."""
    kept = vars(tokenizer).get(_KEPT_ON)
    if kept is None:
        kept = Remembered(LEXICONS_KEPT)
        setattr(tokenizer, _KEPT_ON, kept)
    return kept  # type: ignore[no-any-return]


def _sharing_wrapper(build: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    @functools.wraps(build)
    def build_drop_info(config: Any, tokenizer: Any) -> Any:
        if SHARING.get() and hasattr(tokenizer, "__dict__"):
            # Built by vLLM's function on first use, then shared.
            return lexicons_of(tokenizer).get_or_make(id(config), lambda: (config, build(config, tokenizer)))[1]
        return build(config, tokenizer)

    return build_drop_info
