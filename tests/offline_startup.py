"""Start gpt-oss without its harmony vocabulary, in a fresh process.

``python -m tests.offline_startup MODEL_DIR`` builds the engine for a gpt-oss
model directory with ``TIKTOKEN_ENCODINGS_BASE`` pointing at an empty
directory, and prints the start-up error (nothing if it started). It needs
its own process: vLLM keeps the harmony encoding once loaded.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from derender_core import ConfigError, DerenderEngine
from tests.families import CASES, render_config


def missing_harmony_vocabulary(model_dir: Path) -> str:
    with tempfile.TemporaryDirectory() as empty:
        os.environ["TIKTOKEN_ENCODINGS_BASE"] = empty
        try:
            DerenderEngine.build(render_config(CASES["gpt_oss"], model_dir)).close()
        except ConfigError as exc:
            return str(exc)
    return ""


if __name__ == "__main__":
    print(missing_harmony_vocabulary(Path(sys.argv[1])))
