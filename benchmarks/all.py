"""Every figure the throughput targets name, in one run, each beside its
target with PASS or MISS, then a summary.

    python benchmarks/all.py [--quick] [--repeat 10] [--skip ray stream ...]

Sections (one warm engine for the sample shared by all; start-up excluded
everywhere):

1. record: a whole one-shot record against its job floor at about 30, 400
   and 8,000 output tokens, without and with 5 top logprobs, and
   ``engine.chat`` on a 16-token answer against its floor
   (`record_floor.record_row`, `record_floor.chat_row`; each floor's
   message, and logprobs, checked equal to derender's);
2. parent: the parent's ceiling with instant workers against one real
   worker, the parent's CPU share with 2 real workers, and real ``-j 1``
   against ``-j 2`` (`parent.measure_parent`, 20,000 records of 400
   tokens);
3. stream: a live 8,192-token stream, one token per chunk, against the work
   vLLM itself must do per chunk (`stream_floor.measure`), then the same
   stream with 5 top logprobs on every chunk (its floor's logprobs checked
   equal to derender's), and a completion stream with ``logprobs: 5``;
4. ray: one Ray actor against one local worker (`ray_actor.measure`);
5. logprobs: one-shot records with logprobs against their logprob floor
   (`logprobs.measure` in benchmarks/logprobs.py: chat at 400 and 8,000 tokens with top 0, 5 and 20,
   completion at 8,000 with 5; each answer checked equal to ``--decode
   reference``'s and the floor's message to derender's).

--quick scales every section down (fewer records and rounds, no profiles)
for a sanity run: its figures are rougher than a full run's. The machine
the figures are quoted from is the idle 2-core development machine; on a
shared one read the CPU figures, and rerun a MISS.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import inspect
import os
import time
from collections.abc import Callable
from typing import Any

import logprobs as logprob_floor
import parent
import ray_actor
import record_floor
from _common import REPO, sample_engine

from derender_core import DerenderEngine
from tests.sample_inputs import SampleBuilder, qwen3_family

SECTIONS = ("record", "parent", "stream", "ray", "logprobs")
RECORD_TARGET = 1.5
"""A whole record at most this multiple of its job floor (30 and 400
tokens, no logprobs), and ``engine.chat`` on a 16-token answer of its."""
PARENT_CEILING_TARGET = 20.0
PARENT_SHARE_TARGET = 0.05
SPEEDUP_TARGET = 1.8
STREAM_TARGET = 2.0
"""A live stream's cost per chunk at most this multiple of vLLM's own."""


@dataclasses.dataclass
class Verdict:
    """One target's figure against it."""

    name: str
    figure: float | None
    """None: not measured (the section failed or is missing)."""
    target: float
    at_most: bool
    """The figure must be at most the target (else at least)."""
    unit: str = "x"

    @property
    def passed(self) -> bool:
        if self.figure is None:
            return False
        return self.figure <= self.target if self.at_most else self.figure >= self.target

    def __str__(self) -> str:
        sign = "<=" if self.at_most else ">="
        if self.figure is None:
            return f"  {self.name:60} {'-':>9}   (target {sign} {self._fmt(self.target)})  MISS (not measured)"
        verdict = "PASS" if self.passed else "MISS"
        return f"  {self.name:60} {self._fmt(self.figure):>9}   (target {sign} {self._fmt(self.target)})  {verdict}"

    def _fmt(self, value: float) -> str:
        return f"{value:.1%}" if self.unit == "%" else f"{value:.2f}x"


def heading(title: str) -> None:
    print(f"\n== {title} (load average {os.getloadavg()[0]:.2f})", flush=True)


def record_section(engine: DerenderEngine, quick: bool, repeat: int) -> list[Verdict]:
    """Section 1: records of about 30, 400 and 8,000 tokens, +/- logprobs."""
    builder = SampleBuilder(qwen3_family(REPO / "sample_data" / "qwen3"))
    verdicts = []
    print(f"{record_floor.HEADER} {'target':>8}  verdict")
    for tokens in (30, 400, 8000):
        for logprobs in (False, True):
            # About the same time per row: fewer records where each costs more.
            records = min(100, max(5, 400_000 // (tokens * (6 if logprobs else 1))))
            if quick:
                records = max(2, records // 10)
            row = record_floor.record_row(engine, builder, tokens, records, repeat, logprobs)
            if tokens <= 400 and not logprobs:
                verdict = Verdict(f"record / job floor, {row.tokens} tokens", row.ratio, RECORD_TARGET, at_most=True)
                verdicts.append(verdict)
                print(f"{row.line()} {f'<= {RECORD_TARGET}x':>8}  {'PASS' if verdict.passed else 'MISS'}", flush=True)
            else:
                print(f"{row.line()} {'-':>8}  (no target)", flush=True)
    count, chat_s, floor_s = record_floor.chat_row(engine, builder, 20 if quick else 100, repeat)
    verdict = Verdict(f"engine.chat / its floor, {count} tokens", chat_s / floor_s, RECORD_TARGET, at_most=True)
    print(
        f"\nengine.chat, {count} tokens: {chat_s * 1e3:.3f}ms, floor {floor_s * 1e3:.3f}ms, "
        f"{chat_s / floor_s:.2f}x   (target <= {RECORD_TARGET}x)  {'PASS' if verdict.passed else 'MISS'}"
    )
    return [*verdicts, verdict]


def parent_section(engine: DerenderEngine, quick: bool) -> list[Verdict]:
    """Section 2: the parent's ceiling, its share, -j 1 against -j 2."""
    records = 2000 if quick else 20000
    figures = parent.measure_parent(records, 400, (1, 2, 4), profile=not quick, engine=engine)
    print("\n".join([*figures.lines(), *figures.profile_lines(10)]))
    return [
        Verdict("parent's ceiling / one real worker", figures.ceiling / figures.worker_rate, PARENT_CEILING_TARGET, False),
        Verdict("parent's CPU / the workers', -j 2", figures.share, PARENT_SHARE_TARGET, True, unit="%"),
        Verdict(f"-j 2 / -j 1 records/s ({records:,} records)", figures.speedup, SPEEDUP_TARGET, False),
    ]


def _call_with(function: Callable[..., Any], **offered: Any) -> Any:
    """`function` called with those of `offered` it takes."""
    accepted = inspect.signature(function).parameters
    return function(**{name: value for name, value in offered.items() if name in accepted})


def stream_section(engine: DerenderEngine, quick: bool, repeat: int) -> list[Verdict]:
    """Section 3: a live 8k stream against vLLM's own per-chunk work, as
    benchmarks/stream_floor.py measures it."""
    name = "live 8k stream / vLLM's per-chunk work"
    try:
        import stream_floor
    except ImportError as exc:
        print(f"  not measured: benchmarks/stream_floor.py is missing or broken ({exc}); it should expose "
              "measure(engine, tokens=8192, repeat=5) returning figures with .ratio (derender's "
              "cost per chunk over vLLM's) and .lines()")  # fmt: skip
        return [Verdict(name, None, STREAM_TARGET, at_most=True)]
    verdicts = []
    streams = (
        (None, "chat", name),
        (5, "chat", "live 8k stream, top 5 logprobs / vLLM's per-chunk work"),
        (5, "completion", "live 8k completion, logprobs 5 / vLLM's per-chunk work"),
    )
    for top, endpoint, label in streams:
        figures = _call_with(
            stream_floor.measure, tokens=8192, repeat=1 if quick else min(repeat, 3), engine=engine, quick=quick,
            top=top, endpoint=endpoint,
        )  # fmt: skip
        lines = figures.lines() if hasattr(figures, "lines") else [repr(figures)]
        print("\n".join(lines))
        ratio = figures["ratio"] if isinstance(figures, dict) else getattr(figures, "ratio", None)
        verdicts.append(Verdict(label, ratio, STREAM_TARGET, at_most=True))
    return verdicts


def ray_section(engine: DerenderEngine, quick: bool) -> list[Verdict]:
    """Section 4: one Ray actor against one local worker."""
    if importlib.util.find_spec("ray") is None:
        print("  not measured: Ray is not installed (pip install 'derender[ray]')")
        return [Verdict("one Ray actor / one local worker, records/s", None, ray_actor.TARGET, at_most=False)]
    figures = ray_actor.measure(
        4000 if quick else 8000, 400, cpus=2, repeat=1 if quick else 2, profile=not quick, engine=engine
    )
    print("\n".join(figures.lines()))
    return [Verdict("one Ray actor / one local worker, records/s", figures.ratio, ray_actor.TARGET, at_most=False)]


def logprobs_section(engine: DerenderEngine, quick: bool, repeat: int) -> list[Verdict]:
    """Section 5: records with logprobs against their logprob floor."""
    rows = logprob_floor.measure(engine, repeat=2 if quick else min(repeat, 5), quick=quick)
    return [Verdict(f"record / logprob floor, {row.case.name}", row.ratio, logprob_floor.TARGET, at_most=True) for row in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a sanity run: every section scaled down")
    parser.add_argument("--repeat", type=int, default=None, help="rounds per timing, best counted (10; quick: 2)")
    parser.add_argument("--skip", nargs="+", choices=SECTIONS, default=[], help="sections left out")
    args = parser.parse_args()
    repeat = args.repeat or (2 if args.quick else 10)

    started = time.perf_counter()
    engine, startup = sample_engine()
    print(f"{'quick run (figures rough)' if args.quick else 'full run'}; the sample's engine built in "
          f"{startup:.1f} s (excluded); {len(os.sched_getaffinity(0))} usable cores")  # fmt: skip
    sections: list[tuple[str, str, Callable[[], list[Verdict]]]] = [
        ("record", "1. A whole record vs its job floor (Qwen3 + hermes one-shot chat, per record)",
         lambda: record_section(engine, args.quick, repeat)),
        ("parent", "2. The parent's ceiling, and -j 1 vs -j 2",
         lambda: parent_section(engine, args.quick)),
        ("stream", "3. A live 8k stream vs vLLM's own per-chunk work",
         lambda: stream_section(engine, args.quick, repeat)),
        ("ray", "4. One Ray actor vs one local worker",
         lambda: ray_section(engine, args.quick)),
        ("logprobs", "5. Records with logprobs vs their logprob floor (Qwen3 + hermes one-shot, per record)",
         lambda: logprobs_section(engine, args.quick, repeat)),
    ]  # fmt: skip
    verdicts: list[Verdict] = []
    for key, title, section in sections:
        if key in args.skip:
            continue
        heading(title)
        verdicts.extend(section())
    engine.close()

    heading(f"Summary, {time.perf_counter() - started:.0f} s in all")
    for verdict in verdicts:
        print(verdict)
    passed = sum(verdict.passed for verdict in verdicts)
    print(f"  {passed} of {len(verdicts)} targets met")


if __name__ == "__main__":
    main()
