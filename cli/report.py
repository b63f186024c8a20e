"""Divergences on stderr, as a Rich table grouped by kind, as JSONL, and as a page."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from derender_core import Divergence
from derender_core.compare import Examination, json_text
from derender_core.html_report import build_page
from derender_core.minimize import Minimal
from derender_core.records import open_output

VALUE_WIDTH = 60
TABLE_WIDTH = 160


@dataclass
class Findings:
    """What `parity` and `diff` found, for the table, the report and the page."""

    divergences: list[Divergence] = field(default_factory=list)
    examinations: list[Examination] = field(default_factory=list)
    """Each request as the sides answered it (kept for ``--html`` only)."""
    pieces: dict[int, str] = field(default_factory=dict)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    """(request, why) for each request that could not be compared."""
    subtitle: str = ""


def write_page(path: str, title: str, findings: Findings) -> None:
    """The ``--html`` page: one self-contained file."""
    page = build_page(
        findings.examinations, title=title, subtitle=findings.subtitle, pieces=findings.pieces, skipped=findings.skipped
    )
    with open_output(path) as target:
        target.write(page.encode())


def write_report(path: str, divergences: list[Divergence]) -> None:
    """One JSON line per divergence, its values whole. A lone surrogate an
    answer held is written as its JSON escape (``\\udc80``): the line stays
    UTF-8, and reads back as the same string."""
    with open_output(path) as target:
        for divergence in divergences:
            target.write(json_text(divergence.to_json()).encode("utf-8", "backslashreplace") + b"\n")


def print_table(console: Console, divergences: list[Divergence]) -> None:
    """Grouped by kind (paths and field), largest groups first."""
    if not divergences:
        return
    groups: dict[str, list[Divergence]] = defaultdict(list)
    for divergence in divergences:
        groups[divergence.kind].append(divergence)
    table = Table(title="divergences", show_lines=False, expand=False)
    for column in ("request", "index", "chunking", "left", "right"):
        table.add_column(column, overflow="fold")
    for kind, members in sorted(groups.items(), key=lambda item: (-len(item[1]), item[0])):
        table.add_section()
        table.add_row(Text(_cell(f"{kind} ({len(members)})", 2 * VALUE_WIDTH), style="bold"), "", "", "", "")
        for divergence in members:
            left, right = _differing(divergence.left_value, divergence.right_value)
            table.add_row(
                Text(_cell(str(divergence.request_id), 2 * VALUE_WIDTH)),
                Text("" if divergence.index is None else _cell(str(divergence.index))),
                Text(divergence.chunking or ""),
                Text(_short(left)),
                Text(_short(right)),
            )
    # Wide enough for a kind and two values per row, on a terminal or not.
    wide = Console(
        file=console.file,
        width=max(console.width, TABLE_WIDTH),
        highlight=False,
        force_terminal=console.is_terminal,
    )
    wide.print(table)


def _differing(left: Any, right: Any) -> tuple[Any, Any]:
    """Two objects shown by the keys on which they differ (the report keeps
    them whole)."""
    if not (isinstance(left, dict) and isinstance(right, dict)):
        return left, right
    keys = [k for k in {**left, **right} if left.get(k) != right.get(k)]
    return {k: left[k] for k in keys if k in left}, {k: right[k] for k in keys if k in right}


def _short(value: Any) -> str:
    return _cell(repr(value) if isinstance(value, str) else json_text(value))


def _cell(text: str, width: int = VALUE_WIDTH) -> str:
    """A cell's text: cut at `width`, a lone surrogate as its escape (the
    terminal takes UTF-8 only)."""
    text = text if len(text) <= width else text[: width - 1] + "…"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def print_minimal(console: Console, minimal: Minimal) -> None:
    """One line per minimized divergence: how far its record shrank."""
    before, after = minimal.before, minimal.after
    if minimal.problem is not None:
        shrunk = f"kept as given: {minimal.problem}"
    else:
        shrunk = (
            f"output ids {before.output_ids}→{after.output_ids}, calls {before.calls}→{after.calls}, "
            f"request {before.request_bytes}→{after.request_bytes} bytes, prompt ids {before.prompt_ids}→{after.prompt_ids}"
            f" ({minimal.runs} runs, {minimal.seconds:.1f} s{', step budget spent' if minimal.exhausted else ''})"
        )
    console.print(f"derender: minimize: {minimal.request_id}: {minimal.kind}: {shrunk}", markup=False)


def print_minimized(console: Console, minimized: list[Minimal], path: str | None, repro: str | None) -> None:
    """Where the minimal records and reports went."""
    seconds = sum(minimal.seconds for minimal in minimized)
    where = [f"written to {path}"] if path is not None else []
    where += [f"reports in {repro}"] if repro is not None else []
    console.print(
        f"derender: minimize: {len(minimized)} minimal records in {seconds:.1f} s"
        + (f", {'; '.join(where)}" if where else ""),
        markup=False,
    )
