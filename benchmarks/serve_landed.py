"""The serve paths now against the main that issue 32 found, on the same
records and machine (issue 32's target: at least 5x faster per record).

    python benchmarks/serve_landed.py [--before 8adab3d] [--records 64] [--tokens 400] [--repeat 2]

`--before` is the commit issue 32 measured: the serve path one record at a
time, every stream call's request validated whole (8adab3d, the main before
parity ran on workers and the serve path took windows). It is checked out
in a temporary git worktree, and each side runs in its own process with
its own code on ``PYTHONPATH`` (`measure`, which both trees can run): the
engines are built first (start-up excluded), then ``Parity`` examines the
records through ``oneshot`` and one other path, as ``derender parity``
does, the current tree through ``Parity.examined`` (its windows), the old
one a request at a time (all it had). Per pair, the best of --repeat runs,
in ms a record. The ``oneshot`` half of each pair is the same small cost on
both sides, so the ratios understate the serve paths' own speed-up.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PAIRS = (("reference", False), ("serve-oneshot", False), ("serve", True))
"""The path examined beside ``oneshot``, and whether its request streams."""
TARGET = 5.0


def measure(records: Path, count: int, repeat: int) -> dict[str, float]:
    """Seconds a record for each pair, in this process, over the code on
    ``PYTHONPATH`` (old or new: only API both have is used)."""
    import orjson

    from derender_core import Endpoint, jobs
    from derender_core.config import RenderConfig
    from derender_core.parity import Chunking, Parity, Request, stream_bodies

    repo = Path(os.environ["PYTHONPATH"].split(os.pathsep)[0])
    config = RenderConfig.from_yaml(repo / "sample_data" / "qwen3.yaml")
    config = dataclasses.replace(config, model=str(repo / (config.model or "")))
    bodies = [orjson.loads(line) for line in records.read_bytes().splitlines()[:count]]

    def requests(stream: bool) -> list[Any]:
        chunking = Chunking(1)
        return [
            Request(body["generate_response"]["request_id"], one_shot=body,
                    streams=[(chunking.name, stream_bodies(body, Endpoint.CHAT, chunking))] if stream else [])
            for body in bodies
        ]  # fmt: skip

    figures = {}
    with contextlib.ExitStack() as resources:
        engines = jobs._parity_engines(config, ["oneshot", "reference", "serve", "serve-oneshot"], resources, None)
        for path, stream in PAIRS:
            checker = Parity({"oneshot": engines["oneshot"], path: engines[path]}, Endpoint.CHAT)

            def examine(batch: list[Any], checker: Any = checker) -> list[Any]:
                if hasattr(checker, "examined"):  # the windows, where the tree has them
                    return [e for _, e in checker.examined(batch)]
                return [checker.examine(r) for r in batch]

            examine(requests(stream)[:2])  # warm
            best = float("inf")
            for _ in range(repeat):
                batch = requests(stream)
                started = time.perf_counter()
                examine(batch)
                best = min(best, time.perf_counter() - started)
            figures[path] = best / len(bodies)
    return figures


def _records(path: Path, count: int, tokens: int) -> None:
    """`count` Qwen3 + hermes one-shot chat records of `tokens` output ids,
    each under its own request id."""
    import orjson
    from _common import sample_engine, sample_record

    engine, _ = sample_engine()
    body, _, _ = sample_record(engine, tokens)
    engine.close()
    with path.open("wb") as out:
        for number in range(count):
            one = {**body, "generate_response": {**body["generate_response"], "request_id": f"r-{number}"}}
            out.write(orjson.dumps(one) + b"\n")


def _side(tree: Path, records: Path, count: int, repeat: int) -> dict[str, float]:
    """`measure` run in a fresh process over `tree`'s code."""
    env = {**os.environ, "PYTHONPATH": str(tree), "VLLM_TARGET_DEVICE": "cpu"}
    done = subprocess.run(
        [sys.executable, __file__, "--measure", str(records), "--records", str(count), "--repeat", str(repeat)],
        capture_output=True, cwd=tree, env=env, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"measuring {tree} failed:\n{done.stderr.decode()[-3000:]}")
    return json.loads(done.stdout.decode().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", default="8adab3d", help="the commit issue 32 measured")
    parser.add_argument("--records", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure is not None:
        print(json.dumps(measure(args.measure, args.records, args.repeat)))
        return
    here = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as scratch:
        records = Path(scratch) / "records.jsonl"
        _records(records, args.records, args.tokens)
        old = Path(scratch) / "before"
        subprocess.run(["git", "-C", str(here), "worktree", "add", "--detach", str(old), args.before],
                       check=True, capture_output=True)  # fmt: skip
        try:
            before = _side(old, records, args.records, args.repeat)
        finally:
            subprocess.run(["git", "-C", str(here), "worktree", "remove", "--force", str(old)], check=False)
        now = _side(here, records, args.records, args.repeat)
    print(f"{args.records} records of {args.tokens} output tokens, parity over oneshot and the path, ms a record "
          f"(best of {args.repeat}, start-up excluded)")
    print(f"{'path':<16}{'before (' + args.before + ')':>20}{'now':>10}{'before/now':>12}")
    for path, _ in PAIRS:
        ratio = before[path] / now[path]
        verdict = "" if path == "reference" else f"  (target >= {TARGET:.0f}x: {'PASS' if ratio >= TARGET else 'MISS'})"
        print(f"{path:<16}{before[path] * 1e3:>20.2f}{now[path] * 1e3:>10.2f}{ratio:>11.2f}x{verdict}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
