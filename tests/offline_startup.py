"""Start every family's engine with nothing cached and no network.

``python -m tests.offline_startup MODELS_DIR`` is run by
``tests/test_families.py`` in a process whose tokenizer caches are empty
directories and whose downloads go to a closed port (`helpers.empty_cache_env`).
For each family of the matrix it builds the engine from
``MODELS_DIR/<key>`` and derenders one plain answer; it prints one JSON line
per family: its key, the engine's start-up time, the answer's status and
content.

Before the families, it starts gpt-oss with ``TIKTOKEN_ENCODINGS_BASE``
pointing at an empty directory and prints the start-up error: harmony's
vocabulary missing must stop the start-up and say what to provide.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from derender_core import ConfigError, DerenderEngine, Endpoint
from derender_core.coverage import FAMILIES
from tests.families import family_markup, render_config
from tests.sample_inputs import SampleBuilder

GREETING = "Hello! How can I help?"


def missing_harmony_vocabulary(models: Path) -> str:
    """The start-up error for gpt-oss without its harmony vocabulary."""
    case = next(case for case in FAMILIES if case.key == "gpt_oss")
    with tempfile.TemporaryDirectory() as empty:
        os.environ["TIKTOKEN_ENCODINGS_BASE"] = empty
        try:
            DerenderEngine.build(render_config(case, models / case.key)).close()
        except ConfigError as exc:
            return str(exc)
        finally:
            del os.environ["TIKTOKEN_ENCODINGS_BASE"]
    return ""


def main(models: Path) -> None:
    print(json.dumps({"missing_harmony_vocabulary": missing_harmony_vocabulary(models)}), flush=True)
    for case in FAMILIES:
        model_dir = models / case.key
        engine = DerenderEngine.build(render_config(case, model_dir))
        b = SampleBuilder(family_markup(case, model_dir))
        messages = [{"role": "user", "content": "Hi!"}]
        body = {
            "model": b.family.served_name,
            "generate_response": {
                "request_id": "offline",
                "choices": [{"index": 0, "token_ids": b.encode(b.answer(GREETING, reasoning="Greet back.")) + b.stop_ids(), "finish_reason": "stop"}],
            },
            "prompt_token_ids": b.prompt_ids(messages),
            "chat_request": b.chat_request(messages),
        }
        answer = engine.post(Endpoint.CHAT, body)
        engine.close()
        content = answer.body["choices"][0]["message"]["content"] if answer.ok else answer.error_message
        print(
            json.dumps(
                {"family": case.key, "startup_seconds": round(engine.startup_seconds, 2), "status": answer.status, "content": content},
                ensure_ascii=False,
            ),
            flush=True,
        )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
