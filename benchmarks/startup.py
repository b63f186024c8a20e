"""Start-up costs of the README's quick start, fresh and warm.

    python benchmarks/startup.py [--runs 3] [--skip-steps] [--skip-install]

Every figure is the median of --runs wall-clock runs of a subprocess:

- the target's yardstick, ``python -c "import torch, transformers, vllm.config"``;
- the quick start (``derender chat sample_data/chat.jsonl --config
  sample_data/qwen3.yaml``) run fresh, and its ratio to the yardstick
  (target: at most 1.3x);
- the same call answered by a warm ``derender server`` (target: at most
  1 s), with its output checked against the fresh output;
- what each step of the lean start saves: the quick start with every step
  off, with one step off at a time (``DERENDER_LEAN_OFF``), and with all on;
  the model-info step matters on the first run after install, measured with
  an empty ``VLLM_CACHE_ROOT``;
- where a fresh run's time goes, phase by phase (``--probe``: the quick
  start in one process, vLLM's modules imported up front so that imports
  and the build are timed apart).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DERENDER = Path(sys.executable).with_name("derender")
QUICK_START = ["chat", "sample_data/chat.jsonl", "--config", "sample_data/qwen3.yaml"]
YARDSTICK = [sys.executable, "-c", "import torch, transformers, vllm.config"]
STEPS = ("pool", "gc", "marker", "modelinfo")
_VARYING = re.compile(rb'"created":\d+|chatcmpl-tool-[0-9a-f]+')


def base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DERENDER_LEAN_OFF", "DERENDER_SERVER_DIR")}
    env["DERENDER_NO_SERVER"] = "1"
    env.update(extra)
    return env


def timed(argv: list[str], env: dict[str, str], runs: int) -> tuple[float, bytes]:
    """Median wall seconds of `runs` runs, and the last run's stdout."""
    times = []
    stdout = b""
    for _ in range(runs):
        started = time.perf_counter()
        done = subprocess.run(argv, capture_output=True, cwd=REPO, env=env)
        times.append(time.perf_counter() - started)
        if done.returncode != 0:
            sys.exit(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stderr.decode()[-3000:]}")
        stdout = done.stdout
    return statistics.median(times), stdout


def interleaved(commands: dict[str, tuple[list[str], dict[str, str]]], runs: int) -> dict[str, float]:
    """Median wall seconds of each command, the runs taken in turn (one of
    each, then again), so that a change in the machine's load falls on all
    of them alike."""
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(runs):
        for name, (argv, env) in commands.items():
            times[name].append(timed(argv, env, 1)[0])
    return {name: statistics.median(values) for name, values in times.items()}


def row(label: str, seconds: float, note: str = "") -> None:
    print(f"| {label} | {seconds:.2f} |{' ' + note if note else ''}")


def warm(runs: int, fresh_stdout: bytes) -> tuple[float, float, bool]:
    """(first call, median of later calls, output identical) on a server of
    this script's own."""
    directory = tempfile.mkdtemp(prefix="derender-bench-server-")
    env = base_env(DERENDER_SERVER_DIR=os.path.join(directory, "server"))
    env.pop("DERENDER_NO_SERVER")
    try:
        subprocess.run([str(DERENDER), "server", "start", "--idle-timeout", "10m"], check=True, env=env, cwd=REPO, capture_output=True)
        first, _ = timed([str(DERENDER), *QUICK_START], env, 1)
        later, stdout = timed([str(DERENDER), *QUICK_START], env, runs)
        status = subprocess.run([str(DERENDER), "server", "status"], env=env, capture_output=True, text=True)
        served = re.search(r"calls: (\d+) served", status.stdout)
        if not served or int(served[1]) != runs + 1:
            sys.exit(f"the warm calls did not all run on the server:\n{status.stdout}{status.stderr}")
    finally:
        subprocess.run([str(DERENDER), "server", "stop"], env=env, capture_output=True)
        shutil.rmtree(directory, ignore_errors=True)
    return first, later, _VARYING.sub(b"", stdout) == _VARYING.sub(b"", fresh_stdout)


def probe() -> None:
    """One quick start in this process, timed phase by phase; the marks go
    to stderr as the last line, as JSON of absolute times."""
    marks = {"process": time.time()}
    import gc

    lean = not {"gc", "all"} & set(os.environ.get("DERENDER_LEAN_OFF", "").split(","))
    if lean:
        gc.disable()  # as derender_cli.entry.run_fresh
    sys.path.insert(0, str(REPO))
    from derender_cli import main as cli

    marks["cli imported"] = time.time()
    from derender_core.vllm_seam import stack

    with stack.lean_start():
        stack.prepare_environment()
        import vllm.config  # noqa: F401

        marks["torch, transformers, vllm.config"] = time.time()
        import vllm.renderers

        from derender_core.vllm_seam import render

        render.import_ahead()
    marks["vllm imported"] = time.time()
    gc.enable()

    renderer_from_config = vllm.renderers.renderer_from_config
    spans: dict[str, list[float]] = {"renderer_from_config": [], "records": []}

    def timed_call(name: str, function):  # type: ignore[no-untyped-def]
        def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
            started = time.time()
            try:
                return function(*args, **kwargs)
            finally:
                spans[name] += [started, time.time()]

        return wrapper

    vllm.renderers.renderer_from_config = timed_call("renderer_from_config", renderer_from_config)
    from derender_core import jobs

    jobs.run = timed_call("records", jobs.run)  # the batch loop, as the job calls it
    try:
        cli.main(QUICK_START + ["-o", os.devnull])
    except SystemExit as exc:
        code = exc.code
    finally:
        if lean:
            gc.freeze()
    marks["renderer_from_config start"], marks["renderer_from_config end"] = spans["renderer_from_config"]
    marks["records start"], marks["records end"] = spans["records"]
    marks["exit"] = time.time()
    print(json.dumps(marks), file=sys.stderr)
    sys.exit(code)


def phases(runs: int, variants: dict[str, str]) -> dict[str, dict[str, float]]:
    """Median seconds per phase of `probe` runs, per variant (a
    ``DERENDER_LEAN_OFF`` value), the variants' runs taken in turn."""
    found: dict[str, dict[str, list[float]]] = {variant: {} for variant in variants}
    for _ in range(runs):
        for variant, off in variants.items():
            for name, seconds in _probe_once(off).items():
                found[variant].setdefault(name, []).append(seconds)
    return {
        variant: {name: statistics.median(values) for name, values in spans.items()}
        for variant, spans in found.items()
    }


def _probe_once(off: str) -> dict[str, float]:
    started = time.time()
    done = subprocess.run(
        [sys.executable, __file__, "--probe"], capture_output=True, cwd=REPO, env=base_env(DERENDER_LEAN_OFF=off)
    )
    ended = time.time()
    if done.returncode != 0:
        sys.exit(f"probe failed:\n{done.stderr.decode()[-3000:]}")
    marks = json.loads(done.stderr.decode().strip().splitlines()[-1])
    spans = {
        "Python start-up, Typer, Rich, derender": marks["cli imported"] - started,
        "imports: torch, transformers, vllm.config": marks["torch, transformers, vllm.config"] - marks["cli imported"],
        "imports: the rest of vLLM's render stack": marks["vllm imported"] - marks["torch, transformers, vllm.config"],
        "build: vLLM's argument parser, model config, derenderer": (
            marks["records start"] - marks["vllm imported"]
            - (marks["renderer_from_config end"] - marks["renderer_from_config start"])
        ),
        "build: `renderer_from_config`": marks["renderer_from_config end"] - marks["renderer_from_config start"],
        "the first 4 records": marks["records end"] - marks["records start"],
        "summary, exit and teardown": ended - marks["records end"],
        "total": ended - started,
    }
    return spans


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--skip-steps", action="store_true", help="Phases of the lean start only, no step off.")
    parser.add_argument("--skip-install", action="store_true", help="Skip the first-run-after-install comparison.")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        probe()
        return
    runs = args.runs
    cli = [str(DERENDER), *QUICK_START]
    load = os.getloadavg()
    print(f"{len(os.sched_getaffinity(0))} cores, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; "
          f"medians of {runs} runs, wall clock\n")  # fmt: skip

    help_seconds, _ = timed([str(DERENDER), "--help"], base_env(), runs)
    _, fresh_stdout = timed(cli, base_env(), 1)  # also warms the OS's file cache
    against = interleaved({"yardstick": (YARDSTICK, base_env()), "fresh": (cli, base_env())}, runs)
    yardstick, fresh = against["yardstick"], against["fresh"]
    first, later, same = warm(runs, fresh_stdout)
    print("| run | s | |\n| --- | ---: | --- |")
    row("`derender --help`", help_seconds)
    row('`python -c "import torch, transformers, vllm.config"`', yardstick)
    row("quick start, fresh process", fresh, f"{fresh / yardstick:.2f}x the imports (target at most 1.3x)")
    row("quick start, warm server: first call (builds the engine)", first)
    row("quick start, warm server: later calls", later,
        f"(target at most 1 s); output identical to the fresh run's: {'yes' if same else 'NO'}")  # fmt: skip

    if not args.skip_install:
        print("\n| first run after install (empty `VLLM_CACHE_ROOT`) | s |\n| --- | ---: |")
        install = {"vLLM's model-class inspection in a subprocess": "modelinfo", "in process (`modelinfo`)": ""}
        times: dict[str, list[float]] = {label: [] for label in install}
        for _ in range(runs):
            for label, off in install.items():
                cache = tempfile.mkdtemp(prefix="derender-bench-vllm-cache-")
                try:
                    times[label].append(timed(cli, base_env(VLLM_CACHE_ROOT=cache, DERENDER_LEAN_OFF=off), 1)[0])
                finally:
                    shutil.rmtree(cache, ignore_errors=True)
        for label, values in times.items():
            row(label, statistics.median(values))

    variants = {"lean": ""}
    if not args.skip_steps:
        variants.update({f"{step} off": step for step in ("pool", "gc", "marker")})
        variants["all off"] = "all"
    table = phases(runs, variants)
    print("\n| phase of a fresh quick start (`--probe`; s, lean and with steps off, `DERENDER_LEAN_OFF`) | "
          + " | ".join(variants) + " |")  # fmt: skip
    print("| --- |" + " ---: |" * len(variants))
    for name in table["lean"]:
        print(f"| {name} | " + " | ".join(f"{table[variant][name]:.2f}" for variant in variants) + " |")


if __name__ == "__main__":
    main()
