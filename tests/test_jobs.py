"""The job API (`derender_core.jobs`) as a library user calls it, and the
core's layout: one job, the same outputs the command line writes, checks
before anything loads, and modules that import each other without a
circle."""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest

from derender_core import (
    DerenderEngine,
    Endpoint,
    ExitStatus,
    InputError,
    JobSpec,
    ParitySpec,
    RenderConfig,
    run_job,
    run_parity,
)
from derender_core.batch import Report
from derender_core.datasets import Input
from derender_core.errors import ConfigError
from derender_core.jobs import parity_paths, plan_outputs
from tests.conftest import Stack, sample_config
from tests.helpers import REPO, SAMPLE, normalized_bytes, read_jsonl, run_cli

SAMPLE_FLAGS = ["--config", "sample_data/qwen3.yaml"]


class Recorder:
    """An observer that keeps what it was told, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []

    def loading(self, model: str) -> None:
        self.events.append(("loading", model))

    def start_input(self, path: str, source: Input, resumed: int) -> None:
        self.events.append(("start_input", (path, resumed)))

    def update(self, report: Report) -> None:
        self.events.append(("update", report.records))

    def stopping(self, signum: int) -> None:
        self.events.append(("stopping", signum))

    def notice(self, message: str) -> None:
        self.events.append(("notice", message))


def _warm(stack: Stack) -> Any:
    """The session's engine for the sample's settings, as the warm server
    hands one over; None (build afresh) for any other settings."""

    def warm(config: RenderConfig) -> DerenderEngine | None:
        return stack.engine if config == stack.config else None

    return warm


def test_a_job_writes_what_the_command_line_writes(qwen3_stack: Stack, tmp_path: Path) -> None:
    """One-shot and stream jobs, run from code, write the bytes `derender`
    writes for the same flags (`created` aside), and tell the observer
    what they do, in order."""
    for command, source, stream_format in (("chat", "chat.jsonl", None), ("stream", "stream.jsonl", "jsonl")):
        observer = Recorder()
        spec = JobSpec([str(SAMPLE / source)], str(tmp_path / f"{command}.jsonl"), stream_format=stream_format)
        summary = run_job(qwen3_stack.config, spec, observer, warm=_warm(qwen3_stack))
        assert summary.return_code == ExitStatus.OK
        records = len((SAMPLE / source).read_bytes().splitlines())
        assert summary.total.records == records and "model (warm)" in summary.startup
        done = run_cli(command, str(SAMPLE / source), *SAMPLE_FLAGS, "--workers", "1")
        assert done.returncode == 0, done.stderr.decode()
        assert normalized_bytes((tmp_path / f"{command}.jsonl").read_bytes()) == normalized_bytes(done.stdout)
        kinds = [kind for kind, _ in observer.events]
        assert kinds[:2] == ["loading", "start_input"] and kinds[2:] == ["update"] * records
        assert observer.events[1][1] == (str(SAMPLE / source), 0)


def test_a_failed_record_gets_an_error_record_and_the_summary_says_1(qwen3_stack: Stack, tmp_path: Path) -> None:
    errors = tmp_path / "errors.jsonl"
    spec = JobSpec([str(SAMPLE / "chat_errors.jsonl")], str(tmp_path / "out.jsonl"), errors=str(errors), workers=1)
    summary = run_job(qwen3_stack.config, spec, warm=_warm(qwen3_stack))
    assert summary.return_code == ExitStatus.RECORDS_FAILED
    answers = read_jsonl(tmp_path / "out.jsonl")
    failed = [line for line, answer in enumerate(answers, 1) if "error" in answer]
    assert failed and summary.total.errors == len(failed)
    assert [entry["line"] for entry in read_jsonl(errors)] == failed
    assert summary.reports[0][1].failures[0].status == 404


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (JobSpec(["a.jsonl", "b.jsonl"], "out.jsonl"), "2 inputs need an output directory"),
        (JobSpec(["sample_data/chat.jsonl"], "-", resume=True), "--resume continues an output file"),
        (JobSpec(["no/such/input.jsonl"], "out.jsonl"), "cannot open input no/such/input.jsonl"),
        (JobSpec(["sample_data/chat.jsonl"], "sample_data/chat.jsonl"), "sample_data/chat.jsonl"),
        (JobSpec(["sample_data/stream.jsonl"], "o.parquet", stream_format="sse"), "use --format jsonl"),
        (JobSpec(["sample_data/chat.jsonl"], "o.jsonl", flavor="serve", workers=2), "--flavor serve runs in one process"),
    ],
)
def test_a_job_that_cannot_start_raises_before_the_model_loads(
    spec: JobSpec, message: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(REPO)
    observer = Recorder()
    with pytest.raises(InputError, match=message.replace("(", r"\(")) as raised:
        run_job(sample_config(), spec, observer)
    assert raised.value.exit_status == ExitStatus.USAGE
    assert observer.events == []  # nothing loaded, nothing read
    assert not Path("out.jsonl").exists() and not Path("o.jsonl").exists()


def test_a_spec_refuses_what_no_command_line_could_say() -> None:
    with pytest.raises(ConfigError, match="unknown stream format 'xml'"):
        JobSpec(["in.jsonl"], stream_format="xml")
    with pytest.raises(ConfigError, match="unknown flavor"):
        JobSpec(["in.jsonl"], flavor="openai")
    with pytest.raises(InputError, match="--errors needs a file path"):
        JobSpec(["in.jsonl"], errors="-")
    assert JobSpec("in.jsonl").inputs == ("in.jsonl",)  # one path is one input, not its letters


def test_the_output_plan_names_each_input_s_output(tmp_path: Path) -> None:
    out = str(tmp_path / "out") + "/"
    plan = plan_outputs(["a/chat.jsonl.gz", "b/stream.jsonl"], out, "sse", resume=False)
    assert [(t.input, Path(t.output).name, t.directory) for t in plan] == [
        ("a/chat.jsonl.gz", "chat.sse.gz", None),  # the compression carries over
        ("b/stream.jsonl", "stream.sse", None),
    ]
    (one,) = plan_outputs(["stream.jsonl"], out, "sse", resume=False)
    assert one.directory == Path(out)  # one input, SSE: a file per request in DIR/
    with pytest.raises(InputError, match="two inputs would write the same output name"):
        plan_outputs(["a/chat.jsonl", "b/chat.jsonl"], out, None, resume=False)


def test_a_job_runs_from_a_thread(qwen3_stack: Stack, tmp_path: Path) -> None:
    """Off the main thread no signal handler can be set; the job runs all
    the same (a Ray task or a web worker calls it so)."""
    found: list[Any] = []
    spec = JobSpec([str(SAMPLE / "chat.jsonl")], str(tmp_path / "out.jsonl"), workers=1)
    thread = threading.Thread(target=lambda: found.append(run_job(qwen3_stack.config, spec, warm=_warm(qwen3_stack))))
    thread.start()
    thread.join(timeout=300)
    assert found and found[0].return_code == ExitStatus.OK and found[0].total.records == 4


def test_parity_from_code_finds_what_the_command_line_finds(qwen3_stack: Stack, tmp_path: Path) -> None:
    spec = ParitySpec(str(SAMPLE / "chat.jsonl"), paths=["oneshot,reference", "replay", "live"])
    result = run_parity(qwen3_stack.config, spec, warm=_warm(qwen3_stack))
    assert spec.paths == ["oneshot", "reference", "replay", "live"]
    report = tmp_path / "report.jsonl"
    done = run_cli("parity", "sample_data/chat.jsonl", "--paths", "oneshot,reference,replay,live",
                   "--report", str(report), *SAMPLE_FLAGS)  # fmt: skip
    expected = read_jsonl(report)
    assert done.returncode == (1 if expected else 0), done.stderr.decode()
    assert [json.loads(orjson.dumps(d.to_json(), option=orjson.OPT_NON_STR_KEYS)) for d in result.divergences] == expected
    assert result.requests == 4 and result.not_compared == 0
    # A record that cannot be compared is heard of, and counted.
    broken = tmp_path / "broken.jsonl"
    broken.write_bytes((SAMPLE / "chat.jsonl").read_bytes().splitlines()[0] + b"\n" + b'{"not": "a body"}\n')
    heard: list[Any] = []
    result = run_parity(qwen3_stack.config, ParitySpec(str(broken), paths=["oneshot", "live"]), heard.append, warm=_warm(qwen3_stack))
    assert result.requests == 2 and result.not_compared == 1 and [r.problem is not None for r in heard] == [True]


def test_parity_paths_are_checked() -> None:
    assert parity_paths(["live, oneshot"]) == ["oneshot", "live"]
    with pytest.raises(ConfigError, match="unknown path 'fast'"):
        parity_paths(["oneshot,fast"])
    with pytest.raises(ConfigError, match="at least two paths"):
        parity_paths(["live", "live"])


# --- the layout ---------------------------------------------------------------------


CORE = REPO / "derender_core"


def _core_imports(package: Path = CORE) -> dict[str, set[str]]:
    """Each module of `package` (the core by default) and the modules of it
    that it imports, at any depth of its code, type-checking imports
    included: a circle there is a circle a reader of the code must follow."""
    modules = {
        ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): path
        for path in package.rglob("*.py")
    }
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(max(node.level - 1, 0)):
                    base = base.rpartition(".")[0]
                target = (f"{base}.{node.module}" if node.module else base) if node.level else node.module or ""
                candidates = [target, *(f"{target}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            else:
                continue
            found |= {candidate for candidate in candidates if candidate in modules and candidate != name}
        graph[name] = found
    return graph


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle of imports, if any (the package's ``__init__`` aside: it
    only re-exports, and every module under it is imported through it)."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if target in ("derender_core", "cli"):
                continue
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (found := visit(target)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_core_has_no_import_circle() -> None:
    graph = _core_imports()
    assert "derender_core.jobs" in graph and "derender_core.errors" in graph
    assert graph["derender_core.errors"] == set(), "errors imports nothing of the core: everything may raise its errors"
    assert _circle(graph) is None, " -> ".join(_circle(graph) or [])
    # The check can fail: the circle errors -> batch -> errors that was.
    assert _circle({**graph, "derender_core.errors": {"derender_core.batch"}}) is not None


def test_the_command_line_has_no_import_circle() -> None:
    """The client, the warm server and the commands import one way: the
    protocol they share (`wire`) imports none of them, and the server's
    commands (`control`) none of the server."""
    graph = _core_imports(REPO / "cli")
    assert {"cli.entry", "cli.main", "cli.server", "cli.wire"} <= graph.keys()
    assert _circle(graph) is None, " -> ".join(_circle(graph) or [])
    assert graph["cli.wire"] == set()
    # The check can fail: the circle main -> server -> main that was.
    assert _circle({**graph, "cli.main": graph["cli.main"] | {"cli.server"}}) is not None


def test_only_the_seam_imports_vllm() -> None:
    """A vLLM upgrade is reviewed in `derender_core/vllm_seam/` and nowhere else."""
    outside = []
    for path in [*CORE.rglob("*.py"), *(REPO / "cli").rglob("*.py")]:
        if "vllm_seam" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            outside += [f"{path.relative_to(REPO)}: {name}" for name in names if name.split(".")[0] == "vllm"]
    assert outside == []


def test_the_library_imports_without_the_command_line_or_vllm() -> None:
    probe = (
        "import sys, json\n"
        "import derender_core, derender_core.jobs, derender_core.api\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & {'typer', 'rich', 'click', 'vllm', 'torch', 'derender_cli'})))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr.decode()
    assert json.loads(done.stdout) == []


def test_the_package_exports_what_users_need_and_no_more() -> None:
    import derender_core

    assert len(derender_core.__all__) <= 30
    assert {"RenderConfig", "DerenderEngine", "engine_for", "JobSpec", "run_job", "ExitStatus"} <= set(derender_core.__all__)
    assert all(hasattr(derender_core, name) for name in derender_core.__all__)
    # The rest stays importable from its module.
    from derender_core.batch import Job, run  # noqa: F401
    from derender_core.records import iter_records, open_input  # noqa: F401
    from derender_core.writers import JsonlWriter  # noqa: F401


@pytest.mark.parametrize("workers", [0, -3])
def test_a_job_with_no_workers_is_refused_as_the_command_line_refuses_it(
    workers: int, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``-j 0`` and ``-j -3`` are usage errors on the command line (its
    option's own range); from code they are too, before anything loads or
    is written."""
    monkeypatch.chdir(REPO)
    observer = Recorder()
    out = tmp_path / "out.jsonl"
    with pytest.raises(ConfigError, match=f"--workers must be a whole number of at least 1, got {workers}"):
        run_job(sample_config(), JobSpec(["sample_data/chat.jsonl"], str(out), workers=workers), observer)
    assert observer.events == [] and not out.exists()
    with pytest.raises(ConfigError, match="--ray-actors"):
        JobSpec(["sample_data/chat.jsonl"], ray_actors=0)


def test_a_spec_takes_an_endpoint_by_its_name(qwen3_stack: Stack, tmp_path: Path) -> None:
    spec = JobSpec([str(SAMPLE / "completion.jsonl")], str(tmp_path / "out.jsonl"), endpoint="completion", workers=1)
    assert spec.endpoint is Endpoint.COMPLETION
    summary = run_job(qwen3_stack.config, spec, warm=_warm(qwen3_stack))
    assert summary.return_code == ExitStatus.OK
    assert {answer["object"] for answer in read_jsonl(tmp_path / "out.jsonl")} == {"text_completion"}
    with pytest.raises(ConfigError, match="unknown endpoint 'nope'"):
        JobSpec(["in.jsonl"], endpoint="nope")


def test_a_run_started_with_sigint_ignored_keeps_ignoring_it(qwen3_stack: Stack, tmp_path: Path) -> None:
    """A background job in a script starts with SIGINT ignored: a run keeps
    ignoring it while it answers records, as while it started up (SIGTERM
    still stops it cleanly)."""
    records = (SAMPLE / "chat.jsonl").read_bytes() * 50
    (tmp_path / "in.jsonl").write_bytes(records)
    spec = JobSpec([str(tmp_path / "in.jsonl")], str(tmp_path / "out.jsonl"), workers=1)

    class Interrupting(Recorder):
        def update(self, report: Report) -> None:
            super().update(report)
            if report.records == 3:
                os.kill(os.getpid(), signal.SIGINT)

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        observer = Interrupting()
        summary = run_job(qwen3_stack.config, spec, observer, warm=_warm(qwen3_stack))
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
    assert ("stopping", signal.SIGINT) not in observer.events
    assert summary.return_code == ExitStatus.OK and summary.total.stopped_by is None
    assert len(read_jsonl(tmp_path / "out.jsonl")) == summary.total.records == 200


def test_a_parity_worker_that_cannot_start_ends_the_run(
    qwen3_stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The parity pool waits for its workers to start (each builds a serve
    stack: start-up, left out of the run's elapsed time). A worker whose
    start fails still says it has started, so the wait ends, and the run
    ends with `WorkerLost` carrying the worker's traceback, not a hang."""
    from derender_core import jobs
    from derender_core.workers import WorkerLost

    parent = os.getpid()
    build = jobs._parity_engines

    def failing_in_children(*args: Any, **kwargs: Any) -> Any:
        if os.getpid() != parent:
            raise RuntimeError("the serve stack could not start here")
        return build(*args, **kwargs)

    monkeypatch.setattr(jobs, "_parity_engines", failing_in_children)  # the workers are forked with it

    def hung(signum: int, frame: object) -> None:
        raise AssertionError("the parity pool hung waiting for its workers")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(240)
    try:
        spec = ParitySpec(str(SAMPLE / "chat.jsonl"), paths=["oneshot", "serve"], workers=2)
        with pytest.raises(WorkerLost, match="the serve stack could not start here"):
            run_parity(qwen3_stack.config, spec, warm=_warm(qwen3_stack))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
