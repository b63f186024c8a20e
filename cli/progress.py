"""Progress and summary on stderr, as the core's `jobs.Observer`. The live
display shows only on a TTY."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from types import TracebackType

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from derender_core import Report
from derender_core.datasets import Input
from derender_core.jobs import Summary
from derender_core.logs import LogKind
from derender_core.prompts import PROMPT_MISSING

FAILURES_SHOWN = 5
_REFRESH_SECONDS = 0.2


class ProgressDisplay:
    """A spinner while the model loads, then per input a bar over the bytes
    read (when the input's size is known) with records, tokens per second,
    errors so far and an ETA."""

    def __init__(self, console: Console, enabled: bool = True) -> None:
        self._console = console
        self._enabled = enabled
        self._progress: Progress | None = None
        if enabled and console.is_terminal:
            self._progress = Progress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.fields[figures]}"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=console,
                transient=True,
            )
        self._task: TaskID | None = None
        self._source: Input | None = None
        self._last_refresh = 0.0

    def __enter__(self) -> ProgressDisplay:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._progress is not None:
            self._progress.stop()

    def loading(self, model: str) -> None:
        if self._progress is not None:
            self._task = self._progress.add_task(f"loading {model}", total=None, figures="")

    def start_input(self, path: str, source: Input, resumed: int) -> None:
        """A new input begins: the bar follows its bytes read."""
        self._source = source
        if self._progress is None:
            return
        if self._task is not None:
            self._progress.remove_task(self._task)
        name = Path(path).name if path != "-" else "stdin"
        figures = f"resuming after {resumed:,} records" if resumed else ""
        self._task = self._progress.add_task(name, total=source.size, figures=figures)

    def update(self, report: Report) -> None:
        """Called after every record; redraws a few times a second at most."""
        if self._progress is None or self._task is None:
            return
        now = time.monotonic()
        if now - self._last_refresh < _REFRESH_SECONDS:
            return
        self._last_refresh = now
        tokens_per_second = report.tokens / report.elapsed if report.elapsed > 0 else 0.0
        position = self._source.bytes_read() if self._source is not None else None
        self._progress.update(
            self._task,
            completed=position,
            figures=(
                f"{report.records:,} records  {tokens_per_second:,.0f} tokens/s  "
                f"{report.errors:,} errors"
            ),
        )

    def notice(self, message: str) -> None:
        """Something the run wants said (outputs it replaces)."""
        if self._enabled:
            self._console.print(f"derender: {message}", markup=False)

    def stopping(self, signum: int) -> None:
        """The first Ctrl-C or SIGTERM: say what happens next."""
        if self._enabled:
            self._console.print(
                f"derender: {signal.Signals(signum).name}: finishing the records under way "
                "and closing the outputs (again to abort)",
                markup=False,
            )


def print_summary(console: Console, summary: Summary, *, verbose: bool = False) -> None:
    """One screen: totals with start-up apart, where a stopped run stopped,
    the first failed records, vLLM's log messages per kind, and how the run
    ended if it ended early."""
    total = summary.total
    tokens_per_second = total.tokens / total.elapsed if total.elapsed > 0 else 0.0
    inputs = f" from {len(summary.reports)} inputs" if len(summary.reports) > 1 else ""
    startup = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in summary.startup.items())
    console.print(
        f"derender: {total.records} records{inputs}, {total.errors} errors in "
        f"{total.elapsed:.2f} s ({total.records_per_second:,.1f} records/s, "
        f"{tokens_per_second:,.0f} tokens/s); start-up: {startup or 'none'}",
        markup=False,
    )
    if total.resumed:
        were = "record was" if total.resumed == 1 else "records were"
        console.print(f"  resumed: {total.resumed} {were} already in the outputs", markup=False)
    for path, report in summary.reports:
        if report.stopped_by is not None:
            console.print(
                f"  stopped by {signal.Signals(report.stopped_by).name} after record "
                f"{report.resumed + report.records} (input line {report.last_line}) of {path}; "
                "the output holds every record up to it: continue with --resume",
                markup=False,
            )
    shown = 0
    for path, report in summary.reports:
        where = f"{path}: " if len(summary.reports) > 1 else ""
        for failure in report.failures[: FAILURES_SHOWN - shown]:
            detail = f" ({failure.detail})" if failure.detail else ""
            bug = ""
            if failure.traceback is not None:
                bug = " [a bug, not bad input" + ("" if verbose else "; --verbose shows the traceback") + "]"
            console.print(
                f"  {where}record {failure.record} (line {failure.line}): {failure.status} "
                f"{_first_line(failure.message)}{detail}{bug}",
                markup=False,
            )
            if verbose and failure.traceback is not None:
                console.print(failure.traceback.rstrip(), markup=False)
            shown += 1
    hidden = total.errors - shown
    if hidden > 0:
        console.print(f"  ... and {hidden} more errors", markup=False)
    _print_logs(console, summary, verbose)
    if summary.prompts_missing:
        records = "record was" if summary.prompts_missing == 1 else "records were"
        console.print(
            f"derender: {summary.prompts_missing:,} {records} derendered without prompt_token_ids, "
            "which can change the answer here (the parsers read the prompt; a Metaspace tokenizer's "
            "first token is seeded from it); --render-prompts renders them from each record's "
            "request, as the render server's /render endpoints do",
            markup=False,
        )
    for path, report in summary.reports:
        if report.stopped_at_failure and report.failures:
            first = report.failures[0]
            where = f" of {path}" if len(summary.reports) > 1 else ""
            console.print(
                f"derender: stopped at the first failed record, record {first.record} "
                f"(line {first.line}){where}, as --fail-fast asks",
                markup=False,
            )


def _print_logs(console: Console, summary: Summary, verbose: bool) -> None:
    """vLLM's log messages, counted per kind over all inputs."""
    where = len(summary.reports) > 1
    print_log_kinds(
        console,
        [
            (kind, f"record {kind.first_record}{f' of {path}' if where else ''}")
            for path, report in summary.reports
            for kind in report.logs
            if kind.key != PROMPT_MISSING.key
        ],
        "while derendering" + ("" if verbose else " (full text with --verbose)"),
    )


def print_log_kinds(console: Console, kinds: list[tuple[LogKind, str]], during: str) -> None:
    """vLLM's log messages, one line per kind, most frequent first: each
    kind with where it was first logged."""
    if not kinds:
        return
    count = sum(kind.count for kind, _ in kinds)
    console.print(f"derender: vLLM logged {count:,} message{'s' if count != 1 else ''} {during}:", markup=False)
    for kind, first in sorted(kinds, key=lambda item: -item[0].count):
        console.print(f"  {kind.count:,} x {kind.level} {kind.logger}: {kind.example} (first at {first})", markup=False)


def _first_line(message: str, limit: int = 200) -> str:
    line = message.splitlines()[0] if message else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def print_outcome(console: Console, summary: Summary, *, quiet: bool, verbose: bool) -> None:
    """The summary, unless quiet; a run that could not finish says so even then."""
    if not quiet:
        print_summary(console, summary, verbose=verbose)
    for path, report in summary.reports:
        if report.unfinished is None:
            continue
        output = summary.outputs.get(path, "-")
        shown = "stdout" if output == "-" else output
        written = "" if report.written is None else f"; {report.written:,} written in full to {shown}"
        where = f" ({path})" if len(summary.reports) > 1 else ""
        console.print(
            f"derender: the run could not finish{where}: {report.unfinished}. "
            f"{report.records:,} records were answered{written}.",
            markup=False,
        )
