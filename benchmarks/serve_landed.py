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

Beside them, in the current tree, vLLM's own work for the streamed records
(`stream_floor`): the same requests through serve's handler, the output
processor and the stream generator with its parsers, with as little of
derender around them as drives them (no chunk bodies, no validation per
call, no pacer, no parity), checked to write the serve path's bytes. It
bounds what the streamed serve path can come to: the 5x target is met only
where derender's share is what the target leaves above it. Then the same
streams' calls alone (`stream_calls`: each chunk body through the derender
contract, without parity), to show how much of that share the calls take.
Last, what the pair would cost if every call cost nothing: the floor, plus
parity's reading of those answers (`parity_reading`) and the ``oneshot``
half alone, which the pair needs whatever its calls cost. The four take
turns, each figure the best of --repeat (`record_floor.best`).
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


def floor_inputs(bodies: list[dict[str, Any]]) -> list[tuple[Any, Any, Any, list[Any]]]:
    """Per one-shot body, what `stream_floor` hands serve: the streamed
    request and its prompt ids as the serve path gets them (the first of
    parity's stream bodies), the request id, and one engine step per
    token (`_Piece`)."""
    from derender_core import Endpoint
    from derender_core.parity import Chunking, stream_bodies
    from derender_core.vllm_seam.serve import _Piece

    inputs = []
    for body in bodies:
        choice = body["generate_response"]["choices"][0]
        ids, finish = list(choice["token_ids"]), choice["finish_reason"]
        first = stream_bodies(body, Endpoint.CHAT, Chunking(len(ids)))[0]
        chunk = first["generate_chunk"]
        steps = [_Piece(0, ids[k : k + 1], None, finish if k == len(ids) - 1 else None) for k in range(len(ids))]
        inputs.append((first["chat_request"], first.get("prompt_token_ids") or chunk.get("prompt_token_ids"),
                       chunk["request_id"], steps))  # fmt: skip
    return inputs


def stream_floor(serve: Any, inputs: list[tuple[Any, Any, Any, list[Any]]], window: int = 32) -> list[bytes]:
    """vLLM's own work for each record streamed one token a chunk
    (`floor_inputs`), `window` requests at a time as the serve path batches
    them: each request opened through serve's handler (`ServeEngine._open`),
    then per step every request's token through vLLM's stop logic
    (`_ScriptedEngineCore.advance`) and one ``EngineCoreOutputs`` for all,
    the loop run until serve has answered it. Each request's SSE bytes, for
    the check."""
    from derender_core import Endpoint
    from derender_core.vllm_seam.serve import _until_idle

    def unheard(recorded: str, vllm: str) -> None:
        raise AssertionError(f"the floor's records stop where vLLM does: {recorded} against {vllm}")

    async def window_of(batch: list[tuple[Any, Any, Any, list[Any]]]) -> list[bytes]:
        runs = [
            await serve._open(Endpoint.CHAT, original, request_id, stream=True, prompt_ids=prompt)
            for original, prompt, request_id, _ in batch
        ]
        steps = [pieces for *_, pieces in batch]
        for k in range(max(map(len, steps))):
            outputs = [serve._core.advance(run.children[0], pieces[k], unheard)
                       for run, pieces in zip(runs, steps, strict=True) if k < len(pieces)]  # fmt: skip
            serve._core.emit([output for output in outputs if output is not None])
            await _until_idle()
        for run in runs:
            await run.task
            serve._core.release(run.children)
        return [b"".join(run.frames) for run in runs]

    written = []
    for start in range(0, len(inputs), window):
        written += serve._loop.run_until_complete(window_of(inputs[start : start + window]))
    return written


def stream_calls(serve: Any, streams: list[list[dict[str, Any]]]) -> list[list[Any]]:
    """The serve path's calls alone: each stream's chunk bodies posted in
    turn through the derender contract (`ServeEngine.drive`, its windows),
    with nothing of parity's reading or comparing; each stream's answers."""
    from derender_core import Endpoint

    def script(chunks: list[dict[str, Any]]) -> Any:
        answers = []
        for chunk in chunks:
            answers.append((yield Endpoint.CHAT, chunk))
        return answers

    return list(serve.drive([script(chunks) for chunks in streams]))


def parity_reading(streams: list[list[dict[str, Any]]], answers: list[list[Any]]) -> None:
    """Parity's reading of the serve path's answers to the streams, as
    ``derender parity`` reads them (`Parity._stream`: the ledger, each
    frame loaded, the stream assembled), fed the answers `stream_calls`
    gave (copies, so that no frame comes loaded)."""
    from derender_core import Endpoint
    from derender_core.parity import Parity
    from derender_core.protocol import FramesAnswer

    checker = Parity({}, Endpoint.CHAT)
    for bodies, given in zip(streams, answers, strict=True):
        script = checker._stream(bodies, [])
        script.send(None)
        try:
            for answer in given:
                script.send(FramesAnswer(answer.frames, answer.late))
        except StopIteration:
            continue
        raise AssertionError("parity's reading asked for more calls than the stream has")


def measure(records: Path, count: int, repeat: int, floor: bool = False) -> dict[str, float]:
    """Seconds a record for each pair, in this process, over the code on
    ``PYTHONPATH`` (old or new: only API both have is used); with `floor`
    (the current tree), `stream_floor`'s too."""
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
        if floor:
            from record_floor import best as best_in_turns

            from tests.helpers import normalized_bytes

            serve, inputs = engines["serve"], floor_inputs(bodies)
            streams = [stream_bodies(body, Endpoint.CHAT, Chunking(1)) for body in bodies]
            written, called = stream_floor(serve, inputs[:1])[0], stream_calls(serve, streams[:1])[0]
            if normalized_bytes(written) != normalized_bytes(b"".join(f for answer in called for f in answer.frames)):
                raise SystemExit("the floor's bytes are not the serve path's")
            answers = stream_calls(serve, streams)
            one_shot = Parity({"oneshot": engines["oneshot"]}, Endpoint.CHAT)
            # They take turns, so that a busy spell weighs on all alike.
            timed = best_in_turns(
                (lambda: stream_floor(serve, inputs), lambda: stream_calls(serve, streams),
                 lambda: parity_reading(streams, answers), lambda: list(one_shot.examined(requests(False)))),
                repeat,
            )  # fmt: skip
            figures["floor"], figures["calls"], figures["reading"], figures["oneshot"] = (
                seconds / len(bodies) for seconds in timed
            )
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


def _side(tree: Path, records: Path, count: int, repeat: int, floor: bool = False) -> dict[str, float]:
    """`measure` run in a fresh process over `tree`'s code."""
    env = {**os.environ, "PYTHONPATH": str(tree), "VLLM_TARGET_DEVICE": "cpu"}
    done = subprocess.run(
        [sys.executable, __file__, "--measure", str(records), "--records", str(count), "--repeat", str(repeat),
         *(["--floor"] if floor else [])],
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
    parser.add_argument("--floor", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure is not None:
        print(json.dumps(measure(args.measure, args.records, args.repeat, args.floor)))
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
        now = _side(here, records, args.records, args.repeat, floor=True)
    print(f"{args.records} records of {args.tokens} output tokens, parity over oneshot and the path, ms a record "
          f"(best of {args.repeat}, start-up excluded)")
    print(f"{'path':<16}{'before (' + args.before + ')':>20}{'now':>10}{'before/now':>12}")
    for path, _ in PAIRS:
        ratio = before[path] / now[path]
        verdict = "" if path == "reference" else f"  (target >= {TARGET:.0f}x: {'PASS' if ratio >= TARGET else 'MISS'})"
        print(f"{path:<16}{before[path] * 1e3:>20.2f}{now[path] * 1e3:>10.2f}{ratio:>11.2f}x{verdict}")
    allowed = before["serve"] / TARGET
    print(f"serve's own work for a streamed record (vLLM's stream generator, parsers and output processor, "
          f"with as little around it as drives it): {now['floor'] * 1e3:.2f} ms, the serve path "
          f"{now['serve'] / now['floor']:.2f}x it; the target needs at most {allowed * 1e3:.2f} ms, of which the "
          f"floor is {now['floor'] / allowed:.0%}")  # fmt: skip
    bound = now["floor"] + now["reading"] + now["oneshot"]
    print(f"with every call free: the floor, parity's reading of the same answers ({now['reading'] * 1e3:.2f} ms) "
          f"and the oneshot half ({now['oneshot'] * 1e3:.2f} ms) come to {bound * 1e3:.2f} ms, {bound / allowed:.0%} of "
          f"what the target allows")  # fmt: skip
    calls = args.tokens + 1  # one chunk a token, then the usage chunk
    print(f"the same streams' calls alone, through the derender contract without parity: {now['calls'] * 1e3:.2f} ms, "
          f"{(now['calls'] - now['floor']) / calls * 1e6:.0f} us a call above the floor; the target leaves the calls "
          f"{(allowed - bound) / calls * 1e6:.0f} us a call, and parity's comparing nothing")  # fmt: skip


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
