"""Progress and summary on stderr. The live display shows only on a TTY."""

import time
from types import TracebackType

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from derender_core import Report

FAILURES_SHOWN = 5
_REFRESH_SECONDS = 0.2


class ProgressDisplay:
    """A spinner while the model loads, then a running count of records."""

    def __init__(self, console: Console, enabled: bool = True) -> None:
        self._progress: Progress | None = None
        if enabled and console.is_terminal:
            self._progress = Progress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                TimeElapsedColumn(),
                console=console,
                transient=True,
            )
        self._task = None
        self._last_refresh = 0.0

    def __enter__(self) -> "ProgressDisplay":
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
            self._task = self._progress.add_task(f"loading {model}")

    def update(self, report: Report) -> None:
        """Called after every record; redraws a few times a second at most."""
        if self._progress is None or self._task is None:
            return
        now = time.monotonic()
        if now - self._last_refresh < _REFRESH_SECONDS:
            return
        self._last_refresh = now
        self._progress.update(
            self._task,
            description=(
                f"{report.records} records, {report.errors} errors, "
                f"{report.records_per_second:,.1f} records/s"
            ),
        )


def print_summary(console: Console, report: Report, startup_seconds: float, *, verbose: bool = False) -> None:
    """One line of figures, then the first failed records, vLLM's log
    messages per kind, and how the run ended if it ended early."""
    console.print(
        f"derender: {report.records} records, {report.errors} errors in "
        f"{report.elapsed:.2f} s ({report.records_per_second:,.1f} records/s); "
        f"model loaded in {startup_seconds:.1f} s",
        markup=False,
    )
    for failure in report.failures[:FAILURES_SHOWN]:
        detail = f" ({failure.detail})" if failure.detail else ""
        bug = ""
        if failure.traceback is not None:
            bug = " [a bug, not bad input" + ("" if verbose else "; --verbose shows the traceback") + "]"
        console.print(
            f"  record {failure.record} (line {failure.line}): {failure.status} "
            f"{_first_line(failure.message)}{detail}{bug}",
            markup=False,
        )
        if verbose and failure.traceback is not None:
            console.print(failure.traceback.rstrip(), markup=False)
    hidden = report.errors - min(len(report.failures), FAILURES_SHOWN)
    if hidden > 0:
        console.print(f"  ... and {hidden} more errors", markup=False)
    if report.logs:
        total = sum(kind.count for kind in report.logs)
        console.print(
            f"derender: vLLM logged {total:,} message{'s' if total != 1 else ''} while derendering"
            + ("" if verbose else " (full text with --verbose)")
            + ":",
            markup=False,
        )
        for kind in sorted(report.logs, key=lambda kind: -kind.count):
            console.print(
                f"  {kind.count:,} x {kind.level} {kind.logger}: {kind.example} "
                f"(first at record {kind.first_record})",
                markup=False,
            )
    if report.stopped_at_failure and report.failures:
        first = report.failures[0]
        console.print(
            f"derender: stopped at the first failed record, record {first.record} "
            f"(line {first.line}), as --fail-fast asks",
            markup=False,
        )


def _first_line(message: str, limit: int = 200) -> str:
    line = message.splitlines()[0] if message else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."
