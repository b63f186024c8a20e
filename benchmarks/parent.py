"""How many workers one parent process can feed: the parent's ceiling with
workers that answer instantly, against one real worker.

    python benchmarks/parent.py [--records 20000] [--tokens 400] [--workers 1 2 4]

Records are one Qwen3 + hermes answer (a reasoning trace, a short answer,
one tool call) of exactly --tokens output ids, repeated --records times in
a JSONL file. Every run goes through `jobs.run_job` with a `JobSpec`, the
code path of ``derender chat -j N -o FILE`` (the output keeps its
manifest); the engine comes in through run_job's ``warm=`` seam:

- instant: `InstantEngine` answers every post with the real engine's
  answer to the record, computed once before the fork, so the parent does
  all of its real work (reading, parsing, hashing for the manifest,
  pickling, queue traffic, ordering, writing) and the workers only their
  share of the path around the engine (body checks, framing);
- real: the sample's `DerenderEngine`, on 1 worker (in process) and on
  2 workers.

The parent's CPU is `resource.getrusage(RUSAGE_SELF)` (user + sys, all its
threads) from the moment the run starts reading (after the fork) to the end
of run_job; its main thread's share is `time.thread_time`, the rest is the
queues' feeder threads. The workers' CPU is `RUSAGE_CHILDREN` once they are
joined. CPU seconds are the figures to trust on a busy machine; wall
figures are printed too.

The parent's ceiling is records per parent CPU second with instant
workers; one real worker's rate is records per worker CPU second with real
workers. Targets: the ceiling at least 20x one real worker; with 2 real
workers the parent's CPU per record at most 5% of the workers'; real -j 2
at least 1.8x real -j 1's records/s (wall). `measure_parent` returns the
figures (benchmarks/all.py prints them with the other sections). The profile
(cProfile on the main thread's CPU clock, from the start of reading) groups the parent's
tottime by what it is for; a builtin is charged to its callers' group.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import os
import pstats
import resource
import tempfile
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from _common import sample_config, sample_engine, sample_record

from derender_core import Endpoint
from derender_core.api import CodeAPI
from derender_core.datasets import Input
from derender_core.jobs import JobSpec, Silent, run_job
from derender_core.protocol import Answer
from derender_core.vllm_seam.render import DerenderEngine


class InstantEngine:
    """A `Derenderer` whose every post is answered at once with one fixed
    answer (the real engine's, for the benchmark's record); everything else
    is the real engine's."""

    def __init__(self, real: DerenderEngine, answer: Answer) -> None:
        self._real = real
        self._answer = answer
        self.vocab_size = real.vocab_size
        self.startup_seconds = 0.0

    def in_mode(self, **_: Any) -> InstantEngine:
        return self

    def post(self, endpoint: Endpoint, body: Any) -> Answer:
        return self._answer

    window = CodeAPI.window
    drive = CodeAPI.drive  # one call at a time, each answered by `post`
    post_many = CodeAPI.post_many

    def prompt_matters(self, endpoint: Endpoint) -> bool:
        return self._real.prompt_matters(endpoint)

    def prepare_render(self) -> None:
        pass

    def invalid_json(self, message: str, position: int | None) -> Answer:
        return self._real.invalid_json(message, position)

    def bad_request(self, message: str) -> Answer:
        return self._real.bad_request(message)

    def internal_error(self, exc: Exception) -> Answer:
        return self._real.internal_error(exc)

    def chat_response(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        return self._real.chat_response(fields)

    def completion_response(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        return self._real.completion_response(fields)

    def close(self) -> None:
        pass  # holds nothing; the real engine stays usable for the real runs

    def after_fork(self) -> None:
        pass


class Clock(Silent):
    """The run's observer: marks the start of reading (after the fork),
    and optionally profiles the parent's main thread from there."""

    def __init__(self, profile: cProfile.Profile | None = None) -> None:
        self.profile = profile
        self.start: tuple[float, ...] | None = None

    def start_input(self, path: str, source: Input, resumed: int) -> None:
        self.start = _now()
        if self.profile is not None:
            self.profile.enable()


def _now() -> tuple[float, float, float, float, float]:
    """(wall, parent CPU, parent main-thread CPU, reaped children's CPU,
    parent system CPU), in seconds."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (
        time.perf_counter(),
        me.ru_utime + me.ru_stime,
        time.thread_time(),
        children.ru_utime + children.ru_stime,
        me.ru_stime,
    )


class Measured:
    """One run's figures, per record."""

    def __init__(
        self, name: str, records: int, start: tuple[float, ...], end: tuple[float, ...]
    ) -> None:
        self.name = name
        self.records = records
        self.wall, self.parent, self.main, self.workers, self.system = (
            b - a for a, b in zip(start, end, strict=True)
        )

    def per_record_us(self, seconds: float) -> float:
        return seconds / self.records * 1e6

    def row(self) -> str:
        feeders = max(self.parent - self.main, 0.0)  # none in process: rounding only
        workers = f"{self.per_record_us(self.workers):9.0f}" if self.workers > 0 else f"{'-':>9}"
        return (
            f"{self.name:30} {self.per_record_us(self.parent):9.1f} {self.per_record_us(self.system):9.1f} "
            f"{self.per_record_us(self.main):9.1f} {self.per_record_us(feeders):9.1f} {self.records / self.parent:11,.0f} {workers} "
            f"{self.records / self.wall:10,.0f}"
        )


def measure(
    name: str, engine: Any, input_path: Path, output: Path, workers: int, records: int,
    profile: cProfile.Profile | None = None,
) -> Measured:  # fmt: skip
    clock = Clock(profile)
    spec = JobSpec(
        inputs=[str(input_path)], output=str(output), endpoint=Endpoint.CHAT, workers=workers
    )
    summary = run_job(sample_config(), spec, clock, warm=lambda config: engine)
    if profile is not None:
        profile.disable()
    end = _now()
    total = summary.total
    if total.records != records or total.errors or summary.return_code:
        raise SystemExit(
            f"{name}: {total.records} records, {total.errors} errors, exit {summary.return_code}"
        )
    assert clock.start is not None
    return Measured(name, records, clock.start, end)


# What each part of the parent's time is for, by the file and function it
# is spent in. Anything else (builtins, dataclass __init__s, the standard
# library's helpers) is charged to its callers.
GROUPS = ("reading", "framing/pickling", "queues", "writing", "hashing", "ordering/bookkeeping")


def group_of(key: tuple[str, int, str]) -> str | None:
    path, _, name = key
    file = os.path.basename(path)
    if path == "~":
        if "pickle" in name:
            return "framing/pickling"
        if "_hashlib" in name or "openssl" in name:
            return "hashing"
        if "BufferedReader" in name or "read1" in name:
            return "reading"
        return None
    if "derender_core" in path:
        if file == "records.py":
            return (
                "writing" if name in ("write", "flush", "records_written", "close") else "reading"
            )
        if file in ("datasets.py", "interrupt.py"):
            return "reading"
        if file == "writers.py":
            return "writing"
        if file == "resume.py":
            return "hashing"
        if file == "workers.py":
            if name in ("_pickled", "decode_outcome"):
                return "framing/pickling"
            if name == "_receive":
                return "queues"
            return "ordering/bookkeeping"
        return "ordering/bookkeeping"  # batch.run, the report, jobs, logs
    if "multiprocessing" in path:
        return "framing/pickling" if file == "reduction.py" else "queues"
    if file in ("threading.py", "selectors.py"):
        return "queues"
    if file == "parent.py":
        return "ordering/bookkeeping"  # the observer's calls
    return None


def grouped(stats: pstats.Stats) -> dict[str, float]:
    """Tottime per group; a function without a group of its own is charged
    to its callers' groups in proportion to the time each call site cost."""
    table: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    totals: dict[str, float] = defaultdict(float)

    def charge(key: Any, seconds: float, depth: int) -> None:
        group = group_of(key)
        if group is not None:
            totals[group] += seconds
            return
        callers = table.get(key, (0, 0, 0, 0, {}))[4]
        spent = sum(entry[2] for entry in callers.values())
        if depth > 6 or not callers or spent <= 0:
            totals["other"] += seconds
            return
        for caller, entry in callers.items():
            charge(caller, seconds * entry[2] / spent, depth + 1)

    for key, (_, _, tottime, _, _) in table.items():
        charge(key, tottime, 0)
    return totals


@dataclasses.dataclass
class ParentFigures:
    """What `measure_parent` returns: the runs, and the profiles if taken."""

    records: int
    tokens: int
    line_bytes: int
    answer_bytes: int
    startup: float
    load_before: float
    runs: list[Measured]
    """The instant runs, one per worker count."""
    real_one: Measured
    """Real, -j 1: the one worker in process."""
    real: Measured
    """Real, -j 2."""
    profiles: list[tuple[str, pstats.Stats, int]]
    load_after: float = 0.0

    @property
    def ceiling(self) -> float:
        """Records per parent CPU second with instant workers, best pooled run."""
        pooled = [run for run in self.runs if "in process" not in run.name]
        return max(run.records / run.parent for run in pooled) if pooled else float("nan")

    @property
    def worker_us(self) -> float:
        """One real worker's CPU per record (with 2 real workers)."""
        return self.real.per_record_us(self.real.workers)

    @property
    def worker_rate(self) -> float:
        return 1e6 / self.worker_us

    @property
    def share(self) -> float:
        """The parent's CPU over the workers' with 2 real workers."""
        return self.real.parent / self.real.workers

    @property
    def speedup(self) -> float:
        """-j 2's records/s (wall) over -j 1's."""
        return (self.real.records / self.real.wall) / (self.real_one.records / self.real_one.wall)

    def lines(self) -> list[str]:
        ratio = self.ceiling / self.worker_rate
        return [
            f"{self.records:,} records of {self.tokens} output tokens (Qwen3 + hermes): {self.line_bytes:,} bytes "
            f"in, {self.answer_bytes:,} bytes out each; "
            + (f"start-up {self.startup:.1f} s (excluded)" if self.startup else "the engine warm"),
            f"load average before: {self.load_before:.2f} on {len(os.sched_getaffinity(0))} usable cores "
            "(wall figures are under that load; CPU figures are the ones to trust)",
            "",
            f"{'per record (CPU)':30} {'parent us':>9} {'of it sys':>9} {'main us':>9} {'feeder us':>9} {'parent r/s':>11} "
            f"{'worker us':>9} {'wall r/s':>10}",
            *(run.row() for run in (*self.runs, self.real_one, self.real)),
            "",
            f"parent's ceiling (instant workers, best pooled run): {self.ceiling:,.0f} records/s of parent CPU",
            f"one real worker: {self.worker_rate:,.0f} records/s of worker CPU ({self.worker_us:,.0f} us per record)",
            f"ceiling / one real worker: {ratio:.1f}x   (target >= 20x): one parent feeds about {ratio:.0f} real workers",
            f"parent CPU with 2 real workers: {self.real.per_record_us(self.real.parent):.1f} us per record, "
            f"{self.share:.1%} of the workers' {self.worker_us:,.0f} us   (target <= 5%)",
            f"real -j 2 / real -j 1 (wall records/s): {self.speedup:.2f}x   (target >= 1.8x)",
        ]

    def profile_lines(self, top: int) -> list[str]:
        if not self.profiles:
            return []
        out = [
            "",
            "parent's main thread, cProfile tottime (its CPU clock) per record, by group; "
            "the profiler's own cost inflates every figure",
            f"  {'':22}" + "".join(f" {name:>12} {'share':>6}" for name, _, _ in self.profiles),
        ]
        sums = [(grouped(stats), records) for _, stats, records in self.profiles]
        for group in (*GROUPS, "other", "total"):
            cells = []
            for totals, records in sums:
                seconds = sum(totals.values()) if group == "total" else totals.get(group, 0.0)
                cells.append(f" {seconds / records * 1e6:9.1f} us {seconds / sum(totals.values()):6.1%}")
            out.append(f"  {group:22}" + "".join(cells))
        for name, stats, records in self.profiles:
            table: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
            whole = sum(entry[2] for entry in table.values())
            out.append(f"\ntop {top} entries by tottime, {name} ({records:,} records):")
            ranked = sorted(table.items(), key=lambda item: item[1][2], reverse=True)[:top]
            for key, (_, calls, tottime, _, _) in ranked:
                path, line_number, function = key
                where = function if path == "~" else f"{os.path.basename(path)}:{line_number}({function})"
                group = group_of(key) or "(callers')"
                out.append(
                    f"  {tottime / records * 1e6:6.1f} us {tottime / whole:6.1%} {calls:9,} calls  {group:20} {where}"
                )
        return out


def measure_parent(
    records: int = 20000, tokens: int = 400, workers: Sequence[int] = (1, 2, 4), profile: bool = True,
    engine: DerenderEngine | None = None,
) -> ParentFigures:  # fmt: skip
    """The runs of the module doc; `engine` is the sample's, warm, if the
    caller has one (else built here, its start-up reported)."""
    load_before = os.getloadavg()[0]
    startup = 0.0
    if engine is None:
        engine, startup = sample_engine()
    _, answer, line = sample_record(engine, tokens)
    instant = InstantEngine(engine, Answer(answer.status, answer.raw))

    with tempfile.TemporaryDirectory() as scratch:
        input_path = Path(scratch) / "records.jsonl"
        input_path.write_bytes(line * records)
        output = Path(scratch) / "out.jsonl"
        warm = Path(scratch) / "warm.jsonl"
        warm_records = min(records, 1000)
        warm.write_bytes(line * warm_records)
        measure("warm-up", instant, warm, output, 2, warm_records)
        runs = [
            measure(f"instant, -j {n}" + (" (in process)" if n == 1 else ""), instant, input_path, output, n, records)
            for n in workers
        ]
        real_one = measure("real, -j 1 (in process)", engine, input_path, output, 1, records)
        real = measure("real, -j 2", engine, input_path, output, 2, records)
        profiles: list[tuple[str, pstats.Stats, int]] = []
        if profile:
            # Profiled apart (the profiler doubles the parent's CPU); the real
            # run on a quarter of the records, to spare the busy machine.
            instant_profile = cProfile.Profile(time.thread_time)  # CPU, not the waits
            measure("instant, -j 2, profiled", instant, input_path, output, 2, records, instant_profile)
            short = Path(scratch) / "short.jsonl"
            short_records = max(records // 4, 1)
            short.write_bytes(line * short_records)
            real_profile = cProfile.Profile(time.thread_time)
            measure("real, -j 2, profiled", engine, short, output, 2, short_records, real_profile)
            profiles = [
                ("instant -j 2", pstats.Stats(instant_profile), records),
                ("real -j 2", pstats.Stats(real_profile), short_records),
            ]
    return ParentFigures(
        records, tokens, len(line), len(answer.raw) + 1, startup, load_before, runs, real_one, real, profiles,
        os.getloadavg()[0],
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=20000)
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--top", type=int, default=25, help="profile entries shown")
    args = parser.parse_args()

    engine, startup = sample_engine()
    figures = measure_parent(args.records, args.tokens, args.workers, engine=engine)
    figures.startup = startup
    print("\n".join([*figures.lines(), *figures.profile_lines(args.top)]))
    print(f"\nload average after: {figures.load_after:.2f}")
    engine.close()


if __name__ == "__main__":
    main()
