"""Which vLLM releases each fast path has been proven on.

A fast path re-does part of vLLM's work (or skips a step of it) and is
proven equal to vLLM's own code by differential tests on a given release.
On any other release vLLM's private code may have moved, so derender runs
vLLM's own code where its HTTP server runs it (the serving handlers, with
the endpoints' request models): the answers stay exact, only slower.

This module is light: it reads the installed version from the package's
metadata and imports nothing of vLLM, so the command line can say which
paths are on before (or without) loading vLLM.

Adding a release: docs/architecture.md#adding-a-vllm-release.
"""

from __future__ import annotations

import functools
import os
from importlib import metadata

PROVEN: dict[str, tuple[str, ...]] = {
    "decode": ("0.33.0", "0.34.0"),
    "requests": ("0.33.0", "0.34.0"),
    "responses": ("0.33.0", "0.34.0"),
    "live": ("0.33.0", "0.34.0"),
    "replay": ("0.33.0", "0.34.0"),
    "logprobs": ("0.33.0", "0.34.0"),
    "lp_text": ("0.33.0", "0.34.0"),
    "stream_lp": ("0.33.0", "0.34.0"),
    "live_cmpl": ("0.33.0", "0.34.0"),
    "serve": ("0.33.0", "0.34.0"),
    "serve_bulk": ("0.33.0", "0.34.0"),
    "serve_lane": ("0.33.0", "0.34.0"),
    "startup": ("0.33.0", "0.34.0"),
}
"""Each fast path and the vLLM releases its differential tests passed on:

- ``decode``: the batched decode (`fast.FastDerenderer`, `fast.TokenTable`)
  in place of vLLM's per-token steps, the parsers' shared lexicon and
  engine templates, their tool-call id type asked once per model config
  and their ids made without a ``UUID`` object (`parsers`), and the chat
  template kwargs resolved once per key (`fast.template_kwargs_key`);
- ``requests``: the usual chat request built as validation builds it
  (`requests.ChatRequests`) and the one-shot body validated alone;
- ``responses``: the one-shot handlers writing the dicts vLLM's models
  would be dumped to, the usual message among them
  (`responses.DirectResponses`);
- ``live``: live streams (`live.LiveDerenderer`): a stream's parser and
  request kept between calls, its usual chunks answered by the lane;
- ``replay``: a stream's replay (``--mode replay``) going on from this
  process's previous call where the call's state is the one that call
  answered (`replay.ReplayStreams`), in place of replaying the whole
  history, its usual calls answered by ``live``'s lane on either decode
  (needs ``live``'s stream and lane);
- ``logprobs``: a one-shot chat or completion choice's logprobs of the usual shape
  checked in the loaded body and written from it, with no model per
  position (`logprobs`; needs ``decode`` and ``requests``);
- ``lp_text``: a one-shot record's choices' logprobs read from its line's
  text by a typed decode into the lists ``logprobs`` writes from, never
  loaded as dicts (`logprob_text`; needs ``logprobs``);
- ``stream_lp``: a live chat chunk's logprobs of the usual shape taken by
  the chunk lane and written from the loaded chunk as the one-shot path
  writes them (`live.ChunkLane`; needs ``live`` and ``logprobs``);
- ``live_cmpl``: a live completion chunk taken by the chunk lane
  (`live.ChunkLane.answer_completion`): the usual chunk of a stream whose
  state is the one its last answer handed out, stepped by the fast
  decode and written from the loaded chunk, its logprobs of the usual
  shape as the one-shot path writes them (`logprobs`), text offsets
  counted on from the state's (needs ``live``, and ``logprobs`` for
  chunks with logprobs);
- ``serve``: ``--flavor serve``, which drives ``vllm serve``'s handlers on
  a scripted engine core through private internals (no reference path:
  refused on other releases);
- ``serve_bulk``: on the serve path, a one-shot body's tokens handed to
  the output processor as one engine step per choice
  (`serve._ScriptedEngineCore.advance_merged`), vLLM's stop logic still
  run per token, where the request has no stop strings; off, one token a
  step, as an engine without speculative decoding makes them (needs
  ``serve``);
- ``serve_lane``: on the serve path, a stream's usual call (one choice of
  ids, no finish, a request its first call validated) handed to the
  stream without the per-call validation, which is the identity for it
  (`serve.ServeEngine._usual_chunk`; needs ``serve`` and ``requests``);
- ``startup``: the lean start's patches of vLLM's start-up (no tokenizer
  thread pool, the model class inspected in process, the leading-space
  marker cached) and the renderer's work run inline, not on its pool.
"""

SUPPORTED = (">=0.33", "<0.35")
"""The releases derender installs with (pyproject.toml's pin)."""

OFF_ENV = "DERENDER_FAST_PATHS"
"""``off`` runs every path as on a release never seen (vLLM's own code),
for proving the reference on a known release. ``off:serve_bulk,logprobs``
(names from `PROVEN`) turns only the named paths off, to tell which one a
difference comes from. ``prove:decode,live`` turns the named paths on where
they are not yet proven: the step of adding a release in which their
differential tests are run on it, before the release joins their tuples.
Anything else, or unset, keeps the proven fast paths on."""

_PROVE = "prove:"
_OFF = "off:"


def _setting() -> str:
    return os.environ.get(OFF_ENV, "").strip().lower()


def _named(prefix: str) -> frozenset[str]:
    """The paths named after `prefix` in the setting (``prove:a,b``)."""
    setting = _setting()
    if not setting.startswith(prefix):
        return frozenset()
    return frozenset(name.strip() for name in setting[len(prefix) :].split(",") if name.strip() in PROVEN)


def proving() -> frozenset[str]:
    """The paths ``DERENDER_FAST_PATHS=prove:...`` turns on unproven."""
    return _named(_PROVE)


def switched_off() -> frozenset[str]:
    """The paths ``DERENDER_FAST_PATHS=off:...`` turns off."""
    return _named(_OFF)


@functools.cache
def installed() -> str:
    """The installed vLLM's version, from its metadata ("" if absent)."""
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return ""


def proven(path: str) -> bool:
    """Whether fast path `path` runs here: proven on the installed vLLM,
    and not switched off by ``DERENDER_FAST_PATHS=off``."""
    if _setting() == "off" or path in switched_off():
        return False
    return installed() in PROVEN[path] or path in proving()


def notice() -> str | None:
    """The one line a run prints when it steps aside to vLLM's own code,
    or None when every fast path is on."""
    off = [path for path in PROVEN if not proven(path)]
    trying = sorted(path for path in proving() if installed() not in PROVEN[path])
    if trying and not off:
        return f"fast paths {', '.join(trying)} on unproven, on vLLM {installed()}, by {OFF_ENV}={_setting()}"
    if not off:
        return None
    if _setting() == "off" or switched_off():
        why = f"{OFF_ENV}={_setting()}"
    else:
        proven_on = sorted({v for path in off for v in PROVEN[path]})
        why = f"they were proven on vLLM {', '.join(proven_on)}, and this is {installed() or 'no vLLM'}"
    return (
        f"fast paths off ({', '.join(off)}): {why}; running vLLM's own code, "
        "exact but slower"
    )


def describe() -> str:
    """`derender --version`'s lines: vLLM's version and each fast path."""
    lines = [f"vLLM {installed() or '(not installed)'} (supported: {','.join(SUPPORTED)})"]
    states = {path: _state(path) for path in PROVEN}
    width = max(len("off"), *(len(state) for state in states.values()))
    for path, versions in PROVEN.items():
        lines.append(f"  fast path {path:<10} {states[path]:<{width}} (proven on vLLM {', '.join(versions)})")
    return "\n".join(lines)


def _state(path: str) -> str:
    """A path's state in `describe`: on, off, or on while being proven."""
    if path in proving() and installed() not in PROVEN[path]:
        return "on, being proven"
    return "on" if proven(path) else "off"
