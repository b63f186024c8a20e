"""Divergences on stderr, as a Rich table grouped by kind, as JSONL, and as a page."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from derender_core import Divergence
from derender_core.compare import Classes, Examination, json_text, report_line
from derender_core.html_report import Shown, build_page
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
    classes: Classes | None = None
    """Every divergence counted by class and kind (parity's, kept as it
    ran); else counted here from `divergences`."""
    shown: Shown | None = None
    """Where `examinations` sit in a larger run (parity: the page's examples)."""
    report_written: bool = False
    """The report was written as the run went (parity)."""

    def tally(self) -> Classes:
        if self.classes is None:
            classes = Classes()
            for examination in self.examinations or [Examination(None, divergences=self.divergences)]:
                classes.add(examination.divergences)
            self.classes = classes
        return self.classes


def write_page(path: str, title: str, findings: Findings) -> None:
    """The ``--html`` page: one self-contained file."""
    page = build_page(
        findings.examinations, title=title, subtitle=findings.subtitle, pieces=findings.pieces, skipped=findings.skipped,
        shown=findings.shown,
    )  # fmt: skip
    with open_output(path) as target:
        target.write(page.encode())


def write_report(path: str, divergences: list[Divergence]) -> None:
    """One JSON line per divergence (`compare.report_line`), its values whole."""
    with open_output(path) as target:
        for divergence in divergences:
            target.write(report_line(divergence))


def print_table(console: Console, classes: Classes) -> None:
    """The classes (divergences, requests, first request ids), then the
    divergences by kind (paths and field), largest groups first, each
    with its first `compare.ROWS_KEPT` rows."""
    if not classes.divergences:
        return
    summary = Table(title="classes of divergences", show_lines=False, expand=False)
    for column in ("class", "divergences", "requests", "first requests"):
        summary.add_column(column, overflow="fold")
    for tally in classes.ordered():
        ids = ", ".join("—" if i is None else _cell(str(i), VALUE_WIDTH // 2) for i in tally.ids)
        more = "" if tally.requests <= len(tally.ids) else ", …"
        summary.add_row(Text(_cell(tally.name, 2 * VALUE_WIDTH)), str(tally.divergences), str(tally.requests), Text(ids + more))
    table = Table(title="divergences", show_lines=False, expand=False)
    for column in ("request", "index", "chunking", "left", "right"):
        table.add_column(column, overflow="fold")
    for kind, group in sorted(classes.kinds.items(), key=lambda item: (-item[1].count, item[0])):
        table.add_section()
        table.add_row(Text(_cell(f"{kind} ({group.count})", 2 * VALUE_WIDTH), style="bold"), "", "", "", "")
        for divergence in group.rows:
            left, right = _differing(divergence.left_value, divergence.right_value)
            table.add_row(
                Text(_cell(str(divergence.request_id), 2 * VALUE_WIDTH)),
                Text("" if divergence.index is None else _cell(str(divergence.index))),
                Text(divergence.chunking or ""),
                Text(_short(left)),
                Text(_short(right)),
            )
        if group.count > len(group.rows):
            table.add_row(Text(f"… {group.count - len(group.rows)} more (in --report)"), "", "", "", "")
    # Wide enough for a kind and two values per row, on a terminal or not.
    wide = Console(
        file=console.file,
        width=max(console.width, TABLE_WIDTH),
        highlight=False,
        force_terminal=console.is_terminal,
    )
    wide.print(summary)
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
