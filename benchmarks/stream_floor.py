"""A live stream against vLLM's own per-chunk work on the same stream.

    python benchmarks/stream_floor.py [--tokens 8192] [--repeat 5] [--top-logprobs 5] [--endpoint completion]

The stream is a Qwen3 + hermes answer of N output tokens (a reasoning
trace, a short answer, one tool call), one token per chunk, then the usage
chunk, as JSONL derender bodies. With --top-logprobs K the request asks
for ``logprobs: true, top_logprobs: K`` and every chunk carries generate's
logprobs (the sampled id, then K alternatives,
`tests.sample_inputs.logprobs_for`). With ``--endpoint completion`` it is a
completion stream of N tokens of text (``logprobs: K`` with
--top-logprobs K), whose floor (`CompletionFloor`) is the same decode step
and the completion chunk's dict written, its logprobs as parallel lists
with text offsets counted on across the chunks.

- derender: the path a user runs, `derender stream --format sse` in
  process: the lines read (`records.iter_records`), `batch.run` with
  ``Job(Endpoint.CHAT, stream=True)`` on the live engine, `SseWriter`;
- floor: what vLLM itself must do per chunk of that stream, and no more:
  one incremental detokenize step (tokenizers' ``DecodeStream`` seeded with
  the prompt, as vLLM's ``FastIncrementalDetokenizer`` is, the stop token
  left out as its detokenizer leaves it out), the ``parse_delta`` of vLLM's
  own parser class for the delta (built once per stream, as vLLM builds
  it), and ``orjson.dumps`` of a chat-completion-chunk-shaped dict. Its
  reasoning, content and tool calls are checked equal to derender's
  assembled answer before anything is timed. With logprobs, each chunk's
  floor also writes its sampled id and alternatives as token, logprob and
  bytes (`record_floor.LogprobPieces`: each id decoded once per process,
  a piece of a cut character corrected by vLLM's own rule from the
  stream's sampled ids before it), checked equal to derender's logprobs.
- `--decode reference`: the same stream on vLLM's own decode and the
  per-call path, for comparison.

Each figure is CPU time, the best of --repeat runs in one warm process
(start-up excluded, printed apart), the measures taking turns. Target: derender at
most 2x the floor per chunk.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import time
from collections.abc import Callable
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

import orjson
from _common import REPO, plan_of_length, sample_engine
from record_floor import LogprobPieces

from derender_core import DerenderEngine, Endpoint
from derender_core.batch import Job, run
from derender_core.collector import records_pace
from derender_core.records import iter_records
from derender_core.writers import AssembledWriter, SseWriter
from tests.sample_inputs import SampleBuilder, StreamPlan, chunks_of, logprobs_for, qwen3_family, stream_bodies

TARGET = 2.0
_TOKEN_ID = itemgetter("token_id")
_LOGPROB = itemgetter("logprob")


@dataclass(frozen=True)
class StreamFloor:
    """CPU per chunk, in µs: derender's live stream to SSE, the floor, and
    the stream on ``--decode reference``."""

    tokens: int
    chunks: int
    derender_us: float
    floor_us: float
    reference_us: float
    top: int | None = None
    """Top logprobs every chunk carries; None: no logprobs."""
    endpoint: str = "chat"

    @property
    def ratio(self) -> float:
        return self.derender_us / self.floor_us

    def lines(self) -> list[str]:
        return [
            f"live {self.endpoint} stream, {self.tokens} tokens, one per chunk, {self.chunks} chunks"
            f"{'' if self.top is None else f', logprobs with top {self.top}'}, to SSE (CPU per chunk):",
            f"  derender                 {self.derender_us:8.1f} us",
            f"  floor (vLLM's own work)  {self.floor_us:8.1f} us",
            f"  derender / floor         {self.ratio:8.2f}x  (target at most {TARGET:.1f}x)",
            f"  --decode reference       {self.reference_us:8.1f} us  ({self.reference_us / self.floor_us:.1f}x the floor)",
        ]


class Floor:
    """vLLM's per-chunk work on one stream, for one engine's model."""

    def __init__(self, engine: DerenderEngine, bodies: list[dict[str, Any]]) -> None:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        derenderer = engine._serving.online_derenderer
        self.derenderer = derenderer
        self.tokenizer = derenderer.tokenizer
        self.backend = self.tokenizer.backend_tokenizer
        first = bodies[0]
        self.request = ChatCompletionRequest.model_validate(first["chat_request"])
        self.prompt = first["prompt_token_ids"]
        self.model = first["model"]
        self.chunks = [body["generate_chunk"] for body in bodies]
        self.top = (self.request.top_logprobs or 0) if self.request.logprobs else None
        self.pieces = LogprobPieces(self.backend)

    def stream(self) -> list[Any]:
        """The stream's chunks as vLLM would make them; the deltas, for the check."""
        return self._stream()[0]

    def _stream(self) -> tuple[list[Any], list[dict[str, Any]]]:
        """The deltas, and each chunk's logprobs content joined."""
        from tokenizers.decoders import DecodeStream

        derenderer, request, prompt, backend, model = self.derenderer, self.request, self.prompt, self.backend, self.model
        parser = derenderer.parser(
            self.tokenizer,
            request.tools,
            chat_template_kwargs=derenderer._resolve_chat_template_kwargs(request),
            model_config=derenderer.model_config,
        )
        decoder = DecodeStream(ids=prompt, skip_special_tokens=False)
        step = decoder.step
        deltas = []
        top, content, context = self.top, self.pieces.content, []
        logprobs: list[dict[str, Any]] = []
        for chunk in self.chunks:
            out: dict[str, Any] = {"id": chunk["request_id"], "object": "chat.completion.chunk",
                                   "created": int(time.time()), "model": model}  # fmt: skip
            if chunk["choices"]:
                choice = chunk["choices"][0]
                ids, finish = choice["token_ids"], choice["finish_reason"]
                # The engine's detokenizer leaves the stop token out of the text.
                text = "".join([step(backend, i) or "" for i in (ids[:-1] if finish == "stop" else ids)])
                delta = parser.parse_delta(text, ids, request, prompt, finished=finish is not None)
                fields: dict[str, Any] = {}
                if delta is not None:
                    deltas.append(delta)
                    for key in ("role", "content", "reasoning"):
                        if getattr(delta, key) is not None:
                            fields[key] = getattr(delta, key)
                    if delta.tool_calls:
                        fields["tool_calls"] = [call.model_dump(exclude_none=True) for call in delta.tool_calls]
                written = None
                if top is not None:
                    # Each position's sampled id and kept alternatives, the
                    # stream's last sampled ids before it as context.
                    chosen = [(entry, *entry["top_logprobs"][:top]) for entry in choice["logprobs"]["content"]]
                    written = {"content": content(chosen, _TOKEN_ID, _LOGPROB, context)}
                    context = (context + ids)[-4:]
                    logprobs += written["content"]
                out["choices"] = [{"index": choice["index"], "delta": fields, "logprobs": written, "finish_reason": finish}]
            else:
                out["choices"] = []
                out["usage"] = chunk["usage"]
            orjson.dumps(out)
        return deltas, logprobs

    def check(self, assembled: dict[str, Any]) -> None:
        """The floor's text and parse are derender's: the same reasoning,
        content and tool calls (names and argument strings), exactly; and
        with logprobs, the same logprobs."""
        deltas, logprobs = self._stream()
        reasoning = "".join(d.reasoning for d in deltas if d.reasoning) or None
        content = "".join(d.content for d in deltas if d.content) or None
        calls: dict[int, list[str]] = {}
        for delta in deltas:
            for call in delta.tool_calls or ():
                merged = calls.setdefault(call.index, ["", ""])
                if call.function is not None:
                    merged[0] += call.function.name or ""
                    merged[1] += call.function.arguments or ""
        message = assembled["choices"][0]["message"]
        got = (message.get("reasoning"), message.get("content"),
               [[c["function"]["name"], c["function"]["arguments"]] for c in message.get("tool_calls") or ()])  # fmt: skip
        want = (reasoning, content, [calls[index] for index in sorted(calls)])
        if got != want:
            raise SystemExit(f"the floor is not derender's answer:\n  derender {got!r}\n  floor    {want!r}")
        if not (reasoning and content and want[2]):
            raise SystemExit(f"the stream lacks reasoning, content or a tool call: {want!r}")
        if self.top is not None:
            got_logprobs = (assembled["choices"][0].get("logprobs") or {}).get("content")
            if orjson.dumps(got_logprobs) != orjson.dumps(logprobs) or not logprobs:
                raise SystemExit("the floor's logprobs are not derender's")


class CompletionFloor:
    """vLLM's per-chunk work on one completion stream: the decode step
    (as `Floor`'s, seeded with the prompt) and the completion chunk's dict
    written by orjson; with logprobs, each chunk's sampled id and kept
    alternatives decoded (`record_floor.LogprobPieces`, the stream's
    earlier sampled ids as the correction's context) and written as the
    completion endpoint's parallel lists, text offsets counted on across
    chunks."""

    def __init__(self, engine: DerenderEngine, bodies: list[dict[str, Any]]) -> None:
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        self.backend = engine._serving.online_derenderer.tokenizer.backend_tokenizer
        first = bodies[0]
        self.request = CompletionRequest.model_validate(first["completion_request"])
        self.prompt = first["prompt_token_ids"]
        self.model = first["model"]
        self.chunks = [body["generate_chunk"] for body in bodies]
        self.top = self.request.logprobs
        self.pieces = LogprobPieces(self.backend)

    def stream(self) -> tuple[str, dict[str, list[Any]]]:
        """The text, and the logprobs' lists joined, for the check."""
        from tokenizers.decoders import DecodeStream

        backend, model, top = self.backend, self.model, self.top
        step = DecodeStream(ids=self.prompt, skip_special_tokens=True).step
        content, context, offset = self.pieces.content, [], 0
        texts: list[str] = []
        joined: dict[str, list[Any]] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        for chunk in self.chunks:
            out: dict[str, Any] = {"id": chunk["request_id"], "object": "text_completion",
                                   "created": int(time.time()), "model": model}  # fmt: skip
            if chunk["choices"]:
                choice = chunk["choices"][0]
                ids = choice["token_ids"]
                text = "".join([step(backend, i) or "" for i in ids])
                texts.append(text)
                written = None
                if top is not None:
                    # The completion endpoint keeps ``logprobs + 1`` candidates.
                    chosen = [(entry, *entry["top_logprobs"][: top + 1]) for entry in choice["logprobs"]["content"]]
                    entries = content(chosen, _TOKEN_ID, _LOGPROB, context)
                    context = (context + ids)[-4:]
                    offsets, tokens = [], []
                    for entry in entries:
                        offsets.append(offset)
                        tokens.append(entry["token"])
                        offset += len(entry["token"])
                    written = {
                        "text_offset": offsets,
                        "token_logprobs": [entry["logprob"] for entry in entries],
                        "tokens": tokens,
                        "top_logprobs": [{c["token"]: c["logprob"] for c in entry["top_logprobs"]} for entry in entries],
                    }
                    for key, values in written.items():
                        joined[key] += values
                out["choices"] = [{"index": choice["index"], "text": text, "logprobs": written,
                                   "finish_reason": choice["finish_reason"]}]  # fmt: skip
            else:
                out["choices"] = []
                out["usage"] = chunk["usage"]
            orjson.dumps(out)
        return "".join(texts), joined

    def check(self, assembled: dict[str, Any]) -> None:
        """The floor's text, and with logprobs its logprobs, are derender's."""
        text, logprobs = self.stream()
        choice = assembled["choices"][0]
        if choice["text"] != text or not text:
            raise SystemExit(f"the floor is not derender's answer:\n  derender {choice['text'][:200]!r}\n  floor    {text[:200]!r}")
        if self.top is not None and orjson.dumps(choice["logprobs"]) != orjson.dumps(logprobs):
            raise SystemExit("the floor's logprobs are not derender's")


def completion_plan(builder: SampleBuilder, tokens: int, top: int | None) -> StreamPlan:
    """A completion stream of exactly `tokens` ids of text, one a chunk,
    finished by length; ``logprobs: top`` where `top` is given."""
    filler: list[int] = []
    step = 0
    while len(filler) < tokens:
        filler += builder.encode(" ".join(f"step {i} checks the forecast." for i in range(step, step + 500)))
        step += 500
    prompt = "Think hard about the forecast:"
    request: dict[str, Any] = {"model": builder.family.served_name, "prompt": prompt, "stream": True,
                               "stream_options": {"include_usage": True}}  # fmt: skip
    if top is not None:
        request["logprobs"] = top
    return StreamPlan(
        request_id=f"floor-completion-{tokens}",
        prompt=builder.encode(prompt),
        request=request,
        choices=[chunks_of(filler[:tokens], [1])],
        finish_reason="length",
        request_key="completion_request",
    )


def timed(fn: Callable[[], Any]) -> float:
    """CPU seconds `fn` takes: on a shared machine, what others run does
    not count, as wall time would."""
    started = time.process_time()
    fn()
    return time.process_time() - started


def _paced(work: Callable[[], Any]) -> None:
    with records_pace():
        work()


def measure(
    engine: DerenderEngine, tokens: int = 8192, repeat: int = 5, top: int | None = None, endpoint: str = "chat"
) -> StreamFloor:
    """The figures for one stream of `tokens` output tokens on `engine`
    (the sample's Qwen3 + hermes engine), best of `repeat` each; with
    `top`, every chunk carries logprobs with that many alternatives; a
    chat stream, or with `endpoint` "completion" a completion stream."""
    builder = SampleBuilder(qwen3_family(REPO / "sample_data" / "qwen3"))
    if endpoint == "completion":
        plan = completion_plan(builder, tokens, top)
    else:
        plan = plan_of_length(builder, tokens)
    if top is not None and endpoint == "chat":
        plan = dataclasses.replace(plan, request={**plan.request, "logprobs": True, "top_logprobs": top})
    bodies = stream_bodies(builder, [plan])
    if top is not None:
        for body in bodies:
            for choice in body["generate_chunk"]["choices"]:
                choice["logprobs"] = logprobs_for(choice["token_ids"], top=top + 1)
    data = b"\n".join(orjson.dumps(body) for body in bodies) + b"\n"
    kind = Endpoint.of(endpoint)
    job = Job(kind, stream=True)
    live = engine.in_mode(live=True, decode="fast")
    reference = engine.in_mode(live=True, decode="reference")

    def derender(on: DerenderEngine = live) -> None:
        # Read as a run to stdout reads it: no manifest, so no digests.
        report = run(on, iter_records(io.BytesIO(data), digests=False), job, SseWriter(target=io.BytesIO()))
        if report.errors:
            raise SystemExit(f"derender failed: {report.failures}")

    out = io.BytesIO()
    finish = live.chat_response if kind is Endpoint.CHAT else live.completion_response
    run(live, iter_records(io.BytesIO(data)), job, AssembledWriter(out, kind, finish))
    floor: Floor | CompletionFloor = Floor(engine, bodies) if kind is Endpoint.CHAT else CompletionFloor(engine, bodies)
    floor.check(orjson.loads(out.getvalue()))
    derender()  # warm
    times: dict[str, list[float]] = {"derender": [], "floor": [], "reference": []}
    for _ in range(repeat):
        times["derender"].append(timed(derender))
        # At the collector's pace a job answers records at (`records_pace`).
        times["floor"].append(timed(lambda: _paced(floor.stream)))
    times["reference"].append(timed(lambda: derender(reference)))
    chunks = len(bodies)
    return StreamFloor(
        tokens=tokens,
        chunks=chunks,
        derender_us=min(times["derender"]) / chunks * 1e6,
        floor_us=min(times["floor"]) / chunks * 1e6,
        reference_us=min(times["reference"]) / chunks * 1e6,
        top=top,
        endpoint=endpoint,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--top-logprobs", type=int, default=None, help="every chunk carries logprobs with K alternatives")
    parser.add_argument("--endpoint", choices=("chat", "completion"), default="chat", help="a chat or a completion stream")
    args = parser.parse_args()
    engine, startup = sample_engine()
    print(f"start-up (excluded below): {startup:.1f} s")
    try:
        figures = measure(engine, args.tokens, args.repeat, args.top_logprobs, args.endpoint)
    finally:
        engine.close()
    print("\n".join(figures.lines()))


if __name__ == "__main__":
    main()
