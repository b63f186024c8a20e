"""One Ray actor against one local worker, start-up excluded.

    python benchmarks/ray_actor.py [--records 8000] [--tokens 400] [--cpus 2] [--repeat 1] [--no-profile]

The same records (one Qwen3 + hermes answer of exactly --tokens output
ids, repeated --records times in a JSONL file) go through `jobs.run_job`
as ``derender chat FILE -o OUT`` runs them:

- local: ``-j 1``, the one worker in process, its engine warm (run_job's
  ``warm=`` seam);
- Ray: ``--ray --ray-actors 1`` on a local cluster started here with
  ``ray.init(num_cpus=--cpus)`` (workers not niced, as the CLI starts
  one), which the job joins as it joins any running cluster; the actor
  builds its engine from the shipped model.

Start-up is left out the same way for both: a thread samples the output
file's size (and the processes' CPU) every 10 ms, and the rate is the
records written between the first samples at 25% and at 75% of the final
size, over the time between them: the steady state. Ray's answers reach
the driver a few blocks behind the actor (about 4 blocks of 256 records at
first, 2 or 3 later), and those held last are written in one burst at the
end, so a window nearer either end would count the burst, not the actor;
hence at least 4,000 records. Both outputs are checked equal, byte for byte up
to ``created`` and tool-call ids. With --repeat, each side runs that many
times, the two in turn, and its best run counts (the machine may be
shared).

CPU per record in that window: for the local run, this process (and what
the idle cluster spent meanwhile: the local runs take turns with the Ray
runs while the cluster is up); for Ray, the actor's process, the driver
(this process: Ray Data's streaming executor and the writer) and the rest
of Ray (raylet, GCS, read tasks).
The actor's CPU per record against the local worker's says what one actor
answers on a core of its own, whatever else the machine runs.

The profile (unless --no-profile) times, in this process and on the same
records, the local worker's path (``batch.run``: read, answer, write)
against the parts of the Ray path: the read task's blocks, the actor's
``Derender.__call__`` on them (its engine the warm one), pickling the
blocks in and out (what the object store carries), and the driver's
handling of the answers (``ray_data._write``: rows to outcomes, written).

Target: one Ray actor at least 0.8x the local worker's records/s.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import pickle
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import psutil
from _common import sample_config, sample_engine, sample_record

from derender_core import DerenderEngine, Endpoint
from derender_core.batch import Job, run
from derender_core.jobs import JobSpec, Silent, run_job
from derender_core.records import iter_records
from derender_core.writers import JsonlWriter
from tests.helpers import normalized_bytes

TARGET = 0.8
"""One Ray actor's records/s at least this share of one local worker's."""


@dataclasses.dataclass
class Window:
    """One run's steady state: the records written between the samples at
    25% and 75% of the output, and the CPU spent meanwhile, by whom."""

    name: str
    records: float
    seconds: float
    cpu: dict[str, float]
    """CPU seconds in the window: "local", or "actor", "driver", "ray (other)"."""
    startup: float
    """Seconds from the start of run_job to the first byte written."""

    @property
    def rate(self) -> float:
        return self.records / self.seconds

    def cpu_us(self, whose: str) -> float:
        return self.cpu.get(whose, 0.0) / self.records * 1e6


@dataclasses.dataclass
class RayFigures:
    """What `measure` returns: one local worker and one Ray actor on the
    same records, and the profile of the parts (us per record)."""

    records: int
    tokens: int
    local: Window
    ray: Window
    profile: dict[str, float]
    load_before: float
    load_after: float

    @property
    def ratio(self) -> float:
        """One Ray actor's records/s over one local worker's."""
        return self.ray.rate / self.local.rate

    @property
    def cpu_ratio(self) -> float:
        """The same on a core each: the local worker's CPU per record over
        the actor's."""
        return self.local.cpu_us("local") / self.ray.cpu_us("actor")

    @property
    def passed(self) -> bool:
        return self.ratio >= TARGET

    def lines(self) -> list[str]:
        out = [
            f"{self.records:,} records of {self.tokens} output tokens (Qwen3 + hermes); steady state "
            f"(25% to 75% of the output), start-up excluded; load average {self.load_before:.2f} before, "
            f"{self.load_after:.2f} after",
            f"  {'':22} {'records/s':>10} {'start-up s':>10}   CPU us per record in the window",
        ]
        for window in (self.local, self.ray):
            parts = ", ".join(f"{whose} {window.cpu_us(whose):,.0f}" for whose in window.cpu)
            out.append(f"  {window.name:22} {window.rate:10,.0f} {window.startup:10.1f}   {parts}")
        verdict = "PASS" if self.passed else "MISS"
        out.append(
            f"  one Ray actor / one local worker: {self.ratio:.2f}x records/s   (target >= {TARGET}x)  {verdict}"
        )
        out.append(
            f"  on a core each (local worker's CPU per record / the actor's): {self.cpu_ratio:.2f}x; Ray's own "
            f"processes beside the actor: {self.ray.cpu['driver'] / self.ray.seconds:.0%} + "
            f"{self.ray.cpu['ray (other)'] / self.ray.seconds:.0%} of a core"
        )
        if self.profile:
            out.append("  in this process, same records, us per record (best of 3):")
            out.extend(f"    {name:58} {us:8.1f}" for name, us in self.profile.items())
        return out


class Sampler:
    """Samples (time, output size, CPU seconds by whom) every `interval`
    seconds in a thread, from entry to exit."""

    def __init__(self, output: Path, interval: float = 0.01) -> None:
        self.output = output
        self.interval = interval
        self.samples: list[tuple[float, int, dict[str, float]]] = []
        self._stop = threading.Event()
        self._me = psutil.Process()
        self._actor: psutil.Process | None = None
        self._children: list[psutil.Process] = []
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> Sampler:
        self.started = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()  # the end: every record written and flushed

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def _sample(self) -> None:
        try:
            size = self.output.stat().st_size
        except OSError:
            size = 0
        self.samples.append((time.perf_counter(), size, self._cpu()))

    def _cpu(self) -> dict[str, float]:
        def seconds(process: psutil.Process) -> float:
            try:
                times = process.cpu_times()
            except psutil.Error:
                return 0.0
            return times.user + times.system + times.children_user + times.children_system

        # Listing the processes reads all of /proc: now and then, not every
        # sample, so that the sampler stays light next to the run.
        if len(self.samples) % 50 == 0:
            with contextlib.suppress(psutil.Error):
                self._children = self._me.children(recursive=True)
            for child in self._children if self._actor is None else ():
                with contextlib.suppress(psutil.Error):
                    if any("Derender" in part for part in child.cmdline()):
                        self._actor = child
        others = [child for child in self._children if child != self._actor]
        return {
            "this process": seconds(self._me),
            "actor": seconds(self._actor) if self._actor is not None else 0.0,
            "ray (other)": sum(seconds(child) for child in others),
        }

    def window(self, name: str, record_bytes: float, whose: dict[str, str]) -> Window:
        """The steady state: from the first sample at 25% of the final size
        to the first at 75%; `whose` maps the CPU counters kept to labels."""
        final = self.samples[-1][1]
        first = next(s for s in self.samples if s[1] >= 0.25 * final)
        last = next(s for s in self.samples if s[1] >= 0.75 * final)
        written = next(s for s in self.samples if s[1] > 0)
        cpu = {label: last[2][key] - first[2][key] for key, label in whose.items()}
        return Window(
            name,
            (last[1] - first[1]) / record_bytes,
            last[0] - first[0],
            cpu,
            written[0] - self.started,
        )


def _run(spec: JobSpec, records: int, warm: Callable[[Any], Any] | None) -> Sampler:
    """`spec` run through run_job, sampled; its output is its one file."""
    with Sampler(Path(spec.output)) as sampler:
        summary = run_job(sample_config(), spec, Silent(), warm=warm)
    total = summary.total
    if total.records != records or total.errors or summary.return_code:
        raise SystemExit(
            f"{spec.output}: {total.records} records, {total.errors} errors, exit {summary.return_code}"
        )
    return sampler


@contextlib.contextmanager
def local_cluster(cpus: int) -> Iterator[Any]:
    """A local Ray cluster of `cpus` CPUs, its workers not niced (as the
    CLI starts one), no usage collection; the job joins it."""
    import ray

    os.environ.setdefault("RAY_worker_niceness", "0")
    os.environ.setdefault("RAY_DATA_USAGE_DISABLED", "1")
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        yield ray
    finally:
        ray.shutdown()


def profile_parts(
    engine: DerenderEngine, line: bytes, records: int, repeat: int = 3
) -> dict[str, float]:
    """Us per record, in this process: the local worker's path against the
    Ray path's parts, on the same records (module doc)."""
    import pyarrow as pa

    from derender_core.ray_data import Derender, _lines_datasource, _write

    job = Job(Endpoint.CHAT)
    data = line * records
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "records.jsonl"
        path.write_bytes(data)
        source = _lines_datasource([str(path)])
        # The actor's own __init__, its engine the warm one (not a second).
        with mock.patch.object(DerenderEngine, "build", return_value=engine):
            derender = Derender(sample_config(), "chat")
        blocks: list[Any] = []
        answers: list[Any] = []

        def local() -> None:
            run(engine, iter_records(io.BytesIO(data)), job, JsonlWriter(io.BytesIO()))

        def read() -> None:
            blocks[:] = source._read_stream(pa.OSFile(str(path)), str(path))

        def actor() -> None:
            answers[:] = [derender(block) for block in blocks]

        def pickling() -> None:
            for table in (*blocks, *answers):
                pickle.loads(pickle.dumps(table, protocol=5))

        class Answered:  # the dataset `_write` iterates, its blocks made here
            def iter_batches(self, **_: Any) -> Iterator[Any]:
                return iter(answers)

        @contextlib.contextmanager
        def writer() -> Iterator[JsonlWriter]:
            yield JsonlWriter(io.BytesIO())

        def driver() -> None:
            report = _write(Answered(), job, writer, True, str(path))
            assert report.records == records and not report.errors

        parts = {
            "local worker: batch.run (read, answer, write)": local,
            "Ray read task: lines to Arrow blocks": read,
            "Ray actor: Derender.__call__ on the blocks": actor,
            "object store: the blocks in and out pickled and unpickled": pickling,
            "Ray driver: ray_data._write (rows to outcomes, written)": driver,
        }
        best = dict.fromkeys(parts, float("inf"))
        for _ in range(repeat + 1):  # the first round warms up
            for name, fn in parts.items():
                started = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - started)
        out = {name: seconds / records * 1e6 for name, seconds in best.items()}
        out["Ray path, summed"] = sum(
            us for name, us in out.items() if name.startswith(("Ray", "object"))
        )
        return out


def measure(
    records: int = 8000, tokens: int = 400, cpus: int = 2, repeat: int = 1, profile: bool = True,
    engine: DerenderEngine | None = None,
) -> RayFigures:  # fmt: skip
    """The same records through one local worker and one Ray actor (module
    doc). `engine` is the sample's, warm, if the caller has one."""
    load_before = os.getloadavg()[0]
    own = engine is None
    if engine is None:
        engine, _ = sample_engine()
    _, answer, line = sample_record(engine, tokens)
    with tempfile.TemporaryDirectory() as name:
        scratch = Path(name)
        path = scratch / "records.jsonl"
        path.write_bytes(line * records)
        outputs: list[Path] = []

        def spec(**flags: Any) -> JobSpec:
            outputs.append(scratch / f"out-{len(outputs)}.jsonl")
            return JobSpec([str(path)], output=str(outputs[-1]), **flags)

        def warm(_: Any) -> DerenderEngine:
            return engine

        locals_: list[Sampler] = []
        remotes: list[Sampler] = []
        with local_cluster(cpus):
            # In the cluster: Ray Data's datasource joins one when made.
            parts = profile_parts(engine, line, min(records, 1024)) if profile else {}
            for _ in range(repeat):  # the two sides in turn, so a busy spell weighs on both
                locals_.append(_run(spec(workers=1), records, warm))
                remotes.append(_run(spec(ray=True, ray_actors=1), records, None))
        if own:
            engine.close()
        want = outputs[0].read_bytes()
        for output in outputs[1:]:
            if normalized_bytes(output.read_bytes()) != normalized_bytes(want):
                raise SystemExit(f"{output.name} is not the first local run's output")
        record_bytes = len(want) / records
        local = max(
            (
                s.window("local worker (-j 1)", record_bytes, {"this process": "local", "ray (other)": "ray (idle)"})
                for s in locals_
            ),
            key=lambda window: window.rate,
        )
        ray_whose = {"actor": "actor", "this process": "driver", "ray (other)": "ray (other)"}
        remote = max(
            (s.window("one Ray actor", record_bytes, ray_whose) for s in remotes),
            key=lambda w: w.rate,
        )
    return RayFigures(records, tokens, local, remote, parts, load_before, os.getloadavg()[0])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=8000)
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--cpus", type=int, default=2, help="the local cluster's CPUs")
    parser.add_argument("--repeat", type=int, default=1, help="runs per side, the best counted")
    parser.add_argument("--no-profile", action="store_true")
    args = parser.parse_args()
    figures = measure(
        args.records, args.tokens, args.cpus, args.repeat, profile=not args.no_profile
    )
    print("\n".join(figures.lines()))


if __name__ == "__main__":
    main()
