"""Derender against the floor: what one-shot and live derendering cost per
output token, next to vLLM's own path and the work itself.

    python benchmarks/floor.py [--tokens 256 2048 8192 32768] [--repeat 3]
                               [--family gemma4] [--live-tokens 8192]

Records are Qwen3 + hermes answers (a reasoning trace, a short answer, one
tool call) of exactly N output tokens. Per length, best of --repeat, in one
warm process (start-up excluded, and printed apart):

- derender: ``DerenderEngine.post`` with the default fast decode (body
  validation, derender, the response's bytes);
- reference: the same call with ``--decode reference``, vLLM's own path;
- vLLM: ``OnlineDerenderer._derender_chat`` alone, vLLM's function on the
  validated request (no validation, no response);
- floor: the work itself, one decode of the ids and one ``parse()`` with
  vLLM's own parser class on the text, checked equal to derender's message.

With logprobs (5 top alternatives, integer ids as generate sends them), the
floor also decodes every id and alternative once (one batched call).

Live: one token per chunk through the live stream path to SSE, per token,
and as a multiple of the same length's one-shot floor. A second family
(--family, of another decoder kind) repeats the one-shot rows.

Targets: one-shot at most 3x the floor from 2,048 to 32,768 tokens; with
logprobs at most 5x and flat per token; live at most 150 us per token at
8,192 tokens, that stream at most 110x the one-shot floor.
"""

from __future__ import annotations

import argparse
import io
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
from _common import REPO, plan_of_length, sample_config

from derender_core import DerenderEngine, Endpoint
from derender_core.batch import Job, run
from derender_core.records import iter_records
from derender_core.writers import SseWriter
from tests.helpers import normalized_bytes
from tests.sample_inputs import (
    SampleBuilder,
    logprobs_for,
    one_shot_body,
    qwen3_family,
    stream_bodies,
)


def best(fn: Callable[[], Any], repeat: int) -> float:
    fn()  # warm: the table's pieces, lazy imports
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def with_logprobs(body: dict[str, Any]) -> dict[str, Any]:
    body = orjson.loads(orjson.dumps(body))
    body["chat_request"].update(logprobs=True, top_logprobs=5)
    choice = body["generate_response"]["choices"][0]
    choice["logprobs"] = logprobs_for(choice["token_ids"], top=6)
    return body


class Floor:
    """The work itself for one engine's model: one decode, one parse."""

    def __init__(self, engine: DerenderEngine) -> None:
        derenderer = engine._serving.online_derenderer
        self.engine = engine
        self.derenderer = derenderer
        self.tokenizer = derenderer.tokenizer
        self.backend = self.tokenizer.backend_tokenizer

    def request(self, body: dict[str, Any]) -> Any:
        return self.engine._bodies[Endpoint.CHAT].validate_python(body, from_attributes=True)

    def work(self, request: Any, logprobs: bool) -> tuple[str | None, str | None, list[Any]]:
        derenderer = self.derenderer
        chat = request.chat_request
        choice = request.generate_response.choices[0]
        ids = choice.token_ids[:-1]  # the stop token is not text
        text = self.backend.decode(ids, skip_special_tokens=False)
        parser = derenderer.parser(
            self.tokenizer, chat.tools,
            chat_template_kwargs=derenderer._resolve_chat_template_kwargs(chat),
            model_config=derenderer.model_config,
        )  # fmt: skip
        parser.set_prompt_token_ids(request.prompt_token_ids)
        reasoning, content, calls = parser.parse(
            text, chat, enable_auto_tools=derenderer.enable_auto_tools, model_output_token_ids=choice.token_ids
        )
        if logprobs:
            every = [[c.token_id] for entry in choice.logprobs.content for c in (entry, *entry.top_logprobs)]
            self.backend.decode_batch(every, skip_special_tokens=False)
        return reasoning, content, calls or []

    def check(self, request: Any, answer: dict[str, Any]) -> None:
        """The floor's text and parse are derender's: same reasoning,
        content and calls."""
        reasoning, content, calls = self.work(request, logprobs=False)
        message = answer["choices"][0]["message"]
        got = [(c["function"]["name"], orjson.loads(c["function"]["arguments"])) for c in message["tool_calls"]]
        want = [(c.name, orjson.loads(c.arguments)) for c in calls]
        if (message.get("reasoning"), message.get("content")) != (reasoning, content) or got != want:
            raise SystemExit(f"the floor is not derender's answer: {message!r} != {(reasoning, content, want)!r}")


def oneshot_table(engine: DerenderEngine, b: SampleBuilder, lengths: list[int], repeat: int, title: str) -> None:
    ref = engine.in_mode(decode="reference")
    floor = Floor(engine)
    derenderer = floor.derenderer
    print(f"\n{title}: decode {engine.decoder_kind}")
    print(f"{'tokens':>7} {'logprobs':>8} {'derender':>10} {'reference':>10} {'vLLM call':>10} {'floor':>9} "
          f"{'der/floor':>9} {'us/token':>9} {'ref/der':>8}")
    for tokens in lengths:
        plain = one_shot_body(plan_of_length(b, tokens), b.family.served_name)
        for logprobs, body in ((False, plain), (True, with_logprobs(plain))):
            answer = engine.post(Endpoint.CHAT, body)
            if not answer.ok:
                raise SystemExit(f"derender failed: {answer.raw[:300]!r}")
            if normalized_bytes(answer.raw) != normalized_bytes(ref.post(Endpoint.CHAT, body).raw):
                raise SystemExit(f"fast and reference answers differ at {tokens} tokens")
            request = floor.request(body)
            floor.check(request, answer.body)
            count = len(body["generate_response"]["choices"][0]["token_ids"])
            # Each lambda is timed at once, inside this iteration (B023 does not apply).
            fast_s = best(lambda: engine.post(Endpoint.CHAT, body), repeat)  # noqa: B023
            ref_s = best(lambda: ref.post(Endpoint.CHAT, body), repeat)  # noqa: B023
            derenderer.decode_mode = "reference"
            vllm_s = best(lambda: derenderer._derender_chat(request.generate_response, request.chat_request, request.prompt_token_ids), repeat)  # noqa: B023
            derenderer.decode_mode = "fast"
            floor_s = best(lambda: floor.work(request, logprobs), repeat)  # noqa: B023
            print(f"{count:7d} {'5 top' if logprobs else '-':>8} {fast_s * 1e3:8.1f}ms {ref_s * 1e3:8.1f}ms "
                  f"{vllm_s * 1e3:8.1f}ms {floor_s * 1e3:7.2f}ms {fast_s / floor_s:8.1f}x "
                  f"{fast_s / count * 1e6:9.2f} {ref_s / fast_s:7.1f}x", flush=True)


def live_row(engine: DerenderEngine, b: SampleBuilder, tokens: int) -> None:
    live = engine.in_mode(live=True)
    plan = plan_of_length(b, tokens)
    data = b"\n".join(orjson.dumps(body) for body in stream_bodies(b, [plan]))
    job = Job(Endpoint.CHAT, stream=True)

    def stream() -> None:
        report = run(live, iter_records(io.BytesIO(data)), job, SseWriter(target=io.BytesIO()))
        assert report.errors == 0, report.failures

    warm = b"\n".join(orjson.dumps(body) for body in stream_bodies(b, [plan_of_length(b, 64)]))
    run(live, iter_records(io.BytesIO(warm)), job, SseWriter(target=io.BytesIO()))
    elapsed = best(stream, 1)
    floor = Floor(engine)
    request = floor.request(one_shot_body(plan, b.family.served_name))
    floor_s = best(lambda: floor.work(request, False), 3)
    count = sum(len(c) for c in plan.choices[0])
    print(f"\nlive, one token per chunk, to SSE: {count} tokens in {elapsed:.2f} s = "
          f"{elapsed / count * 1e6:.1f} us/token, {elapsed / floor_s:.0f}x the one-shot floor ({floor_s * 1e3:.2f} ms)")


def fixed_costs(engine: DerenderEngine, b: SampleBuilder, repeat: int) -> None:
    """Per record, what does not grow with the output: on a short answer
    (16 tokens), the whole call and its parts."""
    from fastapi.responses import JSONResponse

    body = one_shot_body(plan_of_length(b, 16), b.family.served_name)
    floor = Floor(engine)
    derenderer = floor.derenderer
    request = floor.request(body)
    chat = request.chat_request
    kwargs = derenderer._resolve_chat_template_kwargs(chat)
    answer = engine.post(Endpoint.CHAT, body)
    response = engine._run(engine._serving.derender_chat_response(request))
    parts = {
        "the whole call (post)": lambda: engine.post(Endpoint.CHAT, body),
        "body validation (FastAPI's TypeAdapter)": lambda: floor.request(body),
        "parser construction (vLLM's parser class)": lambda: derenderer.parser(
            floor.tokenizer, chat.tools, chat_template_kwargs=kwargs, model_config=derenderer.model_config
        ),
        "derender_chat (decode, parse, message)": lambda: derenderer._derender_chat(
            request.generate_response, chat, request.prompt_token_ids
        ),
        "response building (model_dump + JSONResponse)": lambda: JSONResponse(content=response.model_dump()).body,
    }
    assert answer.ok
    print("\nfixed costs per record (16 output tokens):")
    for name, call in parts.items():
        print(f"  {name:48} {best(call, max(repeat, 200)) * 1e6:8.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 2048, 8192, 32768])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--live-tokens", type=int, default=8192)
    parser.add_argument("--family", default="gemma4", help="a second family (tests.families key), or ''")
    parser.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()) / "derender-family-models")
    args = parser.parse_args()

    started = time.perf_counter()
    engine = DerenderEngine.build(sample_config())
    print(f"start-up (excluded below): {time.perf_counter() - started:.1f} s")
    builder = SampleBuilder(qwen3_family(REPO / "sample_data" / "qwen3"))
    oneshot_table(engine, builder, args.tokens, args.repeat, "Qwen3 + hermes, one-shot chat")
    fixed_costs(engine, builder, args.repeat)
    live_row(engine, builder, args.live_tokens)
    engine.close()

    if args.family:
        from tests.families import CASES, SPECS, family_markup, render_config

        model_dir = args.models / args.family
        if not (model_dir / "config.json").exists():
            SPECS[args.family].build(model_dir)
        case = CASES[args.family]
        other = DerenderEngine.build(render_config(case, model_dir))
        title = f"{args.family} ({case.tool_call_parser} / {case.reasoning_parser}), one-shot chat"
        oneshot_table(other, SampleBuilder(family_markup(case, model_dir)), args.tokens, args.repeat, title)
        other.close()


if __name__ == "__main__":
    main()
