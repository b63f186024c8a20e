"""`derender parity` at dataset scale: workers, shards, Ray, resume, classes,
a report in constant memory and a page that stays small.

Runs go through the real CLI (subprocesses) where a user would run them; a
page of 100,000 records is loaded in headless Chromium.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest

from derender_core.compare import Divergence, Examination
from derender_core.html_report import build_page
from derender_core.jobs import EXAMPLES_PER_CLASS, ParityResult
from tests.helpers import REPO, offline_env, read_jsonl, run_cli
from tests.test_html_report import CHROMIUM, _dump_dom

FLAGS = ["--config", "sample_data/qwen3.yaml"]

SAMPLE_CLASSES = {
    # (class, divergences, requests), read off the sample's 22 divergences
    # (docs/parity.md): serve fills completion_tokens_details and its
    # fingerprint on every request; derender puts the role on the first
    # token's frame (both of stream-n2's choices); empty frames in two
    # streams; the unicode stream's finish-only tail and its stop logic.
    ("oneshot vs serve-oneshot: usage: completion_tokens_details absent vs present", 3, 3),
    ("oneshot vs serve-oneshot: system_fingerprint: null vs text", 3, 3),
    ("replay vs serve: usage: completion_tokens_details absent vs present", 3, 3),
    ("replay vs serve: system_fingerprint: null vs text", 3, 3),
    ("replay vs serve: role_frame: with output vs role only", 3, 2),
    ("replay vs serve: empty_frames: N vs 0", 2, 2),
    ("replay vs serve: finish_frame: without output vs with output", 1, 1),
    ("replay vs serve: null_fields: items vs none", 2, 2),
    ("replay vs serve: null_fields: items vs items", 1, 1),
    ("record vs serve: stop_logic: not finished at token N vs length at token N", 1, 1),
}


class _ClassTable(HTMLParser):
    """The rows of the page's classes table: (class, divergences, requests)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[str]] = []
        self._in_table = False
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "table" and ("class", "sum classes") in attrs:
            self._in_table = True
        elif self._in_table and tag == "tr":
            self.rows.append([])
        elif self._in_table and tag == "td":
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "table":
            self._in_table = False
        elif tag == "td" and self._cell is not None:
            self.rows[-1].append("".join(self._cell))
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def page_classes(page: str) -> set[tuple[str, int, int]]:
    table = _ClassTable()
    table.feed(page)
    return {(row[0], int(row[1]), int(row[2])) for row in table.rows if row}


_VOLATILE = [
    # What no two runs share, one process or many: vLLM's random ids and
    # timestamps, and whether two timestamps fell in one second.
    (re.compile(r"(chatcmpl|cmpl)(-tool)?-[0-9a-f]{8,}"), r"\1\2-ID"),
    (re.compile(r"\b1[0-9]{9}(\.[0-9]+)?\b"), "TIME"),
    (re.compile(r' class="same"'), ""),
    (re.compile(r"\b\d+\.\d+ s\b"), "SECONDS"),
]


def stable(text: str) -> str:
    for pattern, replacement in _VOLATILE:
        text = pattern.sub(replacement, text)
    return text


def test_workers_and_shards_give_one_process_run(tmp_path: Path) -> None:
    """The sample in two shards, on 2 workers, against the sample in one
    process: the report, the minimal records and the repro files are the
    same bytes, the page the same but for vLLM's random ids and timestamps;
    the classes, written here from the 22 divergences, lead the page."""
    lines = (REPO / "sample_data" / "stream.jsonl").read_text().splitlines(keepends=True)
    first = [line for line in lines if '"stream-speculative-unicode"' in line]
    (tmp_path / "shard-1.jsonl").write_text("".join(first))
    (tmp_path / "shard-2.jsonl").write_text("".join(line for line in lines if line not in first))
    runs = {}
    for name, inputs, workers in (("one", ["sample_data/stream.jsonl"], "1"), ("two", [str(tmp_path / "shard-1.jsonl"), str(tmp_path / "shard-2.jsonl")], "2")):
        out = tmp_path / name
        done = run_cli(
            "parity", *inputs, *FLAGS, "-j", workers, "--report", str(out / "r.jsonl"), "--html", str(out / "p.html"),
            "--minimize", str(out / "m.jsonl"), "--repro", str(out / "repro"), "-q",
        )  # fmt: skip
        assert done.returncode == 1, done.stderr.decode()[-3000:]
        runs[name] = out
    one, two = runs["one"], runs["two"]
    assert len(read_jsonl(one / "r.jsonl")) == 22
    assert (one / "r.jsonl").read_bytes() == (two / "r.jsonl").read_bytes()
    assert (one / "m.jsonl").read_bytes() == (two / "m.jsonl").read_bytes()
    names = sorted(p.name for p in (one / "repro").iterdir())
    assert names == sorted(p.name for p in (two / "repro").iterdir())
    for name in names:
        reports = [(run / "repro" / name).read_text().replace(str(run), "OUT") for run in (one, two)]
        assert stable(reports[0]) == stable(reports[1]), name
    page = (one / "p.html").read_text()
    assert stable(page) == stable((two / "p.html").read_text().replace(" ".join(
        str(tmp_path / f"shard-{n}.jsonl") for n in (1, 2)), "sample_data/stream.jsonl"))
    assert page_classes(page) == SAMPLE_CLASSES
    assert page.index('class="sum classes"') < page.index('id="d-1"')
    # One minimal record per class, none two of one request and kind.
    minimal = {record["generate_chunk"]["request_id"] for record in read_jsonl(one / "m.jsonl")}
    assert len(minimal) == len(SAMPLE_CLASSES) and len(names) == 2 * len(SAMPLE_CLASSES)


def _examination(number: int, kind: int) -> Examination:
    """A one-shot request whose usage differs in one of `kind` ways."""
    key = f"detail_{kind}"
    return Examination(
        f"req-{number}",
        divergences=[
            Divergence(f"req-{number}", None, "oneshot", "serve-oneshot", "usage", {"a": 1}, {"a": 1, key: number}),
            Divergence(f"req-{number}", None, "oneshot", "serve-oneshot", "system_fingerprint", None, "fp"),
        ],
    )


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (.ci/run installs Debian's)")
def test_the_page_of_100000_records_stays_small_and_loads(tmp_path: Path) -> None:
    """100,000 diverging requests in 4 classes, taken as a run takes them:
    the page holds each class's first requests in full and the rest as
    ids (200 each), under 1 MB, and Chromium loads it whole."""
    result = ParityResult()
    for number in range(100_000):
        result.take(_examination(number, number % 3), examine=True)
    started = time.perf_counter()
    page = build_page(result.examinations, title="t", shown=result.page_shown())
    built = time.perf_counter() - started
    path = tmp_path / "page.html"
    path.write_text(page)
    started = time.perf_counter()
    dom = _dump_dom(path, "#d-7")
    loaded = time.perf_counter() - started
    print(f"page of 100,000 records: {len(page):,} bytes, built in {built:.2f} s, loaded in Chromium in {loaded:.1f} s")
    assert len(result.examinations) == 3 * EXAMPLES_PER_CLASS
    assert len(page) < 1_000_000  # its size: the time it takes is benchmarks' business, printed above
    assert 'data-ready="18"' in dom  # the cards of the requests shown, every one counted by the script
    assert "200000</b> divergences in <b>100000</b> of 100000 requests" in page.replace('"', "")
    assert "99991 not shown" in page and "33331 not shown" in page
    classes = page_classes(page)
    assert ("oneshot vs serve-oneshot: system_fingerprint: null vs text", 100_000, 100_000) in classes
    assert ("oneshot vs serve-oneshot: usage: detail_0 absent vs present", 33_334, 33_334) in classes


def _sample_copies(given: Path, copies: int) -> Path:
    """The sample's chat records `copies` times over, each copy's request
    ids made its own."""
    sample = (REPO / "sample_data" / "chat.jsonl").read_text().splitlines()
    with given.open("w") as out:
        for n in range(copies):
            for line in sample:
                record = json.loads(line)
                record["generate_response"]["request_id"] += f"-{n}"
                out.write(json.dumps(record) + "\n")
    return given


def test_the_report_streams_in_constant_memory(tmp_path: Path) -> None:
    """Ten times the records, about the same peak memory: each request's
    divergences go to the report as they are found and are not kept."""
    sample = (REPO / "sample_data" / "chat.jsonl").read_text().splitlines()
    peaks = {}
    for copies in (25, 250):
        given = _sample_copies(tmp_path / f"in-{copies}.jsonl", copies)
        report = tmp_path / f"r-{copies}.jsonl"
        # The process's own high-water mark: its ru_maxrss would start from
        # this test process's peak, which Linux hands on across fork and exec.
        script = (
            "import sys\nfrom derender_cli.main import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
            "print(next(l for l in open('/proc/self/status') if l.startswith('VmHWM:')).split()[1], file=sys.stderr)\n"
            "sys.exit(code)\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", script, "parity", str(given), *FLAGS, "--paths", "oneshot,reference,serve-oneshot",
             "--report", str(report), "--html", str(tmp_path / f"p-{copies}.html"), "-q"],
            capture_output=True, cwd=REPO, env=offline_env(), timeout=900,
        )  # fmt: skip
        assert done.returncode == 1, done.stderr.decode()[-3000:]
        peaks[copies] = int(done.stderr.decode().split()[-1])
        assert len(read_jsonl(report)) >= 2 * copies * len(sample)
        assert (tmp_path / f"p-{copies}.html").stat().st_size < 400_000
    assert peaks[250] < 1.1 * peaks[25], peaks


def test_resume_continues_a_stopped_report(tmp_path: Path) -> None:
    """Stopped by SIGINT once its report is being written, then resumed:
    the report is the one a run without a stop writes. (The stop leaves a
    checkpoint of its own. 640 requests take about 2 s here; on CI's
    machine 160 were all answered before the first timed checkpoint, 2 s
    in, which the stop used to wait for.)"""
    copies = 160
    requests = 4 * copies
    given = _sample_copies(tmp_path / "in.jsonl", copies)
    flags = [*FLAGS, "--paths", "oneshot,serve-oneshot", "-q"]
    fresh, stopped = tmp_path / "fresh.jsonl", tmp_path / "stopped.jsonl"
    assert run_cli("parity", str(given), *flags, "--report", str(fresh)).returncode == 1
    command = [str(Path(sys.executable).with_name("derender")), "parity", str(given), *flags, "--report", str(stopped)]
    process = subprocess.Popen(command, cwd=REPO, env=offline_env(), stderr=subprocess.PIPE)
    checkpoint = tmp_path / ".stopped.jsonl.derender-parity.json"
    deadline = time.monotonic() + 300
    while not (stopped.exists() and stopped.stat().st_size > 0):
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    left = json.loads(checkpoint.read_text())
    if process.returncode == 1 or left["finished"]:
        pytest.skip("the run finished before the stop reached it")
    assert process.returncode == 130, stderr.decode()[-2000:]
    assert 0 < left["requests"] < requests
    assert stopped.read_bytes() != fresh.read_bytes()
    refused = run_cli("parity", str(given), *flags, "--report", str(stopped), "--resume", "--html", str(tmp_path / "p.html"))
    assert refused.returncode == 2 and b"--resume continues the report only" in refused.stderr
    resumed = run_cli("parity", str(given), *FLAGS, "--paths", "oneshot,serve-oneshot", "--report", str(stopped), "--resume")
    assert resumed.returncode == 1, resumed.stderr.decode()[-2000:]
    assert stopped.read_bytes() == fresh.read_bytes()
    assert f"{requests} requests, {len(read_jsonl(fresh))} divergences" in resumed.stderr.decode()
    assert f"{left['requests']} resumed" in resumed.stderr.decode()


def test_a_sigterm_to_the_process_group_stops_parity_on_workers(tmp_path: Path) -> None:
    """``timeout`` or a container's stop signals the whole process group:
    ``parity -j 2`` stops as it does on SIGINT (exit 143, its checkpoint
    unfinished), its workers answering what is in flight, rather than
    waiting on workers that died with their chunks. (2,000 requests: far
    more than the run can answer before the stop reaches it, and the stop
    waits only for the few chunks in flight.)"""
    given = _sample_copies(tmp_path / "in.jsonl", 500)
    report = tmp_path / "report.jsonl"
    command = [str(Path(sys.executable).with_name("derender")), "parity", str(given), *FLAGS,
               "--paths", "oneshot,serve", "-q", "-j", "2", "--report", str(report)]  # fmt: skip
    process = subprocess.Popen(command, cwd=REPO, env=offline_env(), stderr=subprocess.PIPE, start_new_session=True)
    checkpoint = tmp_path / ".report.jsonl.derender-parity.json"
    deadline = time.monotonic() + 300
    while not (checkpoint.exists() and 0 < json.loads(checkpoint.read_text())["requests"]):
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGTERM)
    try:
        _, stderr = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise AssertionError("parity -j 2 hung after a SIGTERM to its process group") from None
    assert process.returncode == 128 + signal.SIGTERM, stderr.decode()[-2000:]
    left = json.loads(checkpoint.read_text())
    assert not left["finished"] and 0 < left["requests"] < 2000


def test_ray_gives_one_process_run(tmp_path: Path) -> None:
    """``parity --ray`` on the local cluster it starts itself: one actor
    with its own render and serve stacks; the report and the minimal
    records are the one-process run's bytes."""
    pytest.importorskip("ray")
    flags = ["sample_data/stream.jsonl", *FLAGS, "--paths", "oneshot,live,serve", "-q"]
    outputs = {}
    for name, extra in (("here", []), ("ray", ["--ray", "--ray-actors", "1"])):
        out = tmp_path / name
        done = run_cli("parity", *flags, *extra, "--report", str(out / "r.jsonl"), "--minimize", str(out / "m.jsonl"))
        assert done.returncode == 1, done.stderr.decode()[-3000:]
        outputs[name] = [(out / f).read_bytes() for f in ("r.jsonl", "m.jsonl")]
    assert outputs["ray"] == outputs["here"]
    assert len(outputs["here"][0].splitlines()) > 5
