"""`vllm serve` over HTTP on a taped engine core: the oracle for the serve path.

    python -m tests.serve_oracle TAPES_DIR <vllm serve arguments>

runs vLLM's own API server entry point (``entry.main``: argument parsing,
``build_async_engine_client``, the FastAPI app, ``init_app_state``, uvicorn)
with one change: the engine core is a tape player. When a request reaches it,
the player reads ``TAPES_DIR/<external request id>.json`` and emits its
steps, each once the output handler has taken the previous one and the
request's output collector has been drained (as a server whose engine is
slower than its frontend), with the finish reasons the tape gives. The test writes the tape, then sends the request with
``X-Request-Id``, so the response id, the frames and their bytes are what
`vllm serve` sends.

It shares no code with `derender_core.vllm_seam.serve` but the rebuilding
of engine logprobs from generate's entries (`_logprobs_lists`), which the
tests check separately against the derender endpoint's logprobs.

A tape: ``{"steps": [[piece, ...], ...]}``, each piece ``[choice index,
token ids, generate logprob entries or null, finish reason or null, stop
reason or null]``.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any


class TapeCore:
    """The engine-core client ``AsyncLLM`` gets: it plays tapes."""

    def __init__(self, tapes: Path, async_llm: Any) -> None:
        self.tapes = tapes
        self.async_llm = async_llm
        self.resources = SimpleNamespace(engine_dead=False)
        self.engine_ranks_managed = [0]
        self.outputs: asyncio.Queue[Any] = asyncio.Queue()
        self.children: dict[str, list[Any]] = {}

    def shutdown(self, timeout: float | None = None) -> None:
        pass

    async def get_supported_tasks_async(self) -> tuple[str, ...]:
        return ("generate",)

    async def reset_mm_cache_async(self) -> None:
        pass

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        pass

    async def get_output_async(self) -> Any:
        return await self.outputs.get()

    def tape(self, external_id: str) -> dict[str, Any]:
        return json.loads((self.tapes / f"{external_id}.json").read_text())  # type: ignore[no-any-return]

    async def add_request_async(self, request: Any) -> None:
        children = self.children.setdefault(request.external_req_id, [])
        children.append(request)
        choices = 1 + max(piece[0] for step in self.tape(request.external_req_id)["steps"] for piece in step)
        if len(children) == choices:
            asyncio.ensure_future(self.play(request.external_req_id))

    def drained(self, request_id: str) -> bool:
        state = self.async_llm.output_processor.request_states.get(request_id)
        return state is None or state.queue is None or state.queue.output is None

    async def play(self, external_id: str) -> None:
        from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateLogProbsContent
        from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason

        from derender_core.vllm_seam.serve import _logprobs_lists

        # The children of an n > 1 request are "<index>_<parent id>".
        children = self.children.pop(external_id)
        if len(children) > 1:
            children.sort(key=lambda r: int(r.request_id.split("_", 1)[0]))
        tape = self.tape(external_id)
        for step in tape["steps"]:
            while not all(self.drained(child.request_id) for child in children):
                await asyncio.sleep(0.001)
            outputs = []
            for index, token_ids, logprobs, finish, stop_reason in step:
                child = children[index]
                entries = [GenerateLogProbsContent.model_validate(e) for e in logprobs or []]
                outputs.append(
                    EngineCoreOutput(
                        request_id=child.request_id,
                        new_token_ids=token_ids,
                        new_logprobs=(
                            _logprobs_lists(entries)
                            if child.sampling_params.logprobs is not None
                            else None
                        ),
                        finish_reason=None if finish is None else FinishReason[finish.upper()],
                        stop_reason=stop_reason,
                    )
                )
            self.outputs.put_nowait(EngineCoreOutputs(outputs=outputs))
            # Taken by the output handler, which then hands it to the collector.
            while not self.outputs.empty():
                await asyncio.sleep(0.001)


# --- tapes: the engine steps a record makes (written apart from serve.py) ----


def engine_finish(choice: dict[str, Any], default: str | None = None) -> tuple[str | None, Any]:
    """The finish the engine core reports: a stop string is the output
    processor's to find, so the core's step is unfinished. A one-shot
    choice's finish_reason defaults to "stop", a stream choice's to null."""
    finish, stop_reason = choice.get("finish_reason", default), choice.get("stop_reason")
    if finish == "stop" and isinstance(stop_reason, str):
        return None, None
    return finish, stop_reason


def one_shot_steps(choices: list[dict[str, Any]]) -> list[list[Any]]:
    steps: list[list[Any]] = []
    for position in range(max(len(c["token_ids"]) for c in choices)):
        step = []
        for choice in choices:
            ids = choice["token_ids"]
            if position < len(ids):
                last = position == len(ids) - 1
                finish, stop_reason = engine_finish(choice, "stop") if last else (None, None)
                content = (choice.get("logprobs") or {}).get("content")
                step.append(
                    [choice["index"], ids[position : position + 1],
                     content[position : position + 1] if content else None, finish, stop_reason]
                )  # fmt: skip
        steps.append(step)
    return steps


def stream_steps(chunks: list[dict[str, Any]]) -> list[list[Any]]:
    """One step per chunk with tokens; a finish-only tail finishes its
    choice's previous step."""
    steps: list[list[Any]] = []
    last_of: dict[int, list[Any]] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            finish, stop_reason = engine_finish(choice)
            if choice["token_ids"]:
                content = (choice.get("logprobs") or {}).get("content")
                piece = [choice["index"], choice["token_ids"], content, finish, stop_reason]
                steps.append([piece])
                last_of[choice["index"]] = piece
            elif choice.get("finish_reason") is not None:
                last_of[choice["index"]][3:] = [finish, stop_reason]
    return steps


def oracle_body(request: dict[str, Any], stream: bool) -> dict[str, Any]:
    body = {**request, "stream": stream}
    if not stream:
        body.pop("stream_options", None)
    return body


def main() -> None:
    tapes = Path(sys.argv[1])
    from vllm.entrypoints.launchers.api_server import entry
    from vllm.v1.engine.core_client import EngineCoreClient

    def make_async_mp_client(*args: Any, **kwargs: Any) -> TapeCore:
        # Called from AsyncLLM.__init__, after its output processor exists.
        return TapeCore(tapes, sys._getframe(1).f_locals["self"])

    EngineCoreClient.make_async_mp_client = staticmethod(make_async_mp_client)  # type: ignore[method-assign]
    sys.argv = ["vllm-serve-oracle", *sys.argv[2:]]
    entry.main()


if __name__ == "__main__":
    main()
