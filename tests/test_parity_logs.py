"""`derender parity` counts vLLM's log lines as `derender chat` does.

A tool call cut at ``length`` makes hermes log a whole ``JSONDecodeError``
traceback on every path that parses it, and the serve path logs its
stop-logic finding on each of its two paths. Run as a user runs them
(subprocesses, stderr captured): `--quiet` prints none of it; without it
the tracebacks are one counted line, as `derender chat` prints for the same
record, and the finding is the table's one ``stop_logic`` row.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import REPO, run_cli

FLAGS = ("--config", "sample_data/qwen3.yaml")
COUNTED = (
    "ERROR vllm.tool_parsers.hermes_tool_parser: Error in extracting tool call from response. "
    "(JSONDecodeError: Unterminated string starting at: line 2 column 56 (char 56))"
)


@pytest.fixture(scope="module")
def cut_tool_call(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sample's tool-call record, its last 8 ids cut, finished at length."""
    record = json.loads((REPO / "sample_data" / "chat.jsonl").read_text(encoding="utf-8").splitlines()[0])
    choice = record["generate_response"]["choices"][0]
    assert choice["finish_reason"] == "stop" and record["generate_response"]["request_id"] == "chat-tool-call"
    choice["token_ids"] = choice["token_ids"][:-8]
    choice["finish_reason"] = "length"
    path = tmp_path_factory.mktemp("cut") / "cut.jsonl"
    path.write_text(json.dumps(record) + "\n", encoding="utf-8")
    return path


def stderr_of(*args: str) -> tuple[int, str]:
    done = run_cli(*args, env={"DERENDER_NO_SERVER": "1"})
    return done.returncode, done.stderr.decode()


def test_quiet_parity_prints_no_traceback_and_no_finding(cut_tool_call: Path) -> None:
    status, stderr = stderr_of("parity", str(cut_tool_call), *FLAGS, "--quiet")
    assert status == 1  # the cut call diverges between the paths
    assert stderr == ""


def test_parity_counts_the_tracebacks_as_chat_does(cut_tool_call: Path) -> None:
    status, stderr = stderr_of("parity", str(cut_tool_call), *FLAGS)
    assert status == 1, stderr
    assert "Traceback" not in stderr and "JSONDecodeError\n" not in stderr
    # Three paths parse the cut call one-shot (oneshot, reference,
    # serve-oneshot); the streams parse it chunk by chunk and never fail.
    assert "derender: vLLM logged 3 messages while the paths ran:\n" in stderr
    assert f"  3 x {COUNTED} (first at request 'chat-tool-call')\n" in stderr
    # The serve paths' finding is reported once, as the table's row.
    assert "serve finding" not in stderr
    assert stderr.count("record vs serve: stop_logic (1)") == 1

    status, chat = stderr_of("chat", str(cut_tool_call), *FLAGS, "-o", str(cut_tool_call.with_name("out.jsonl")))
    assert status == 0, chat
    assert f"  1 x {COUNTED} (first at record 1)\n" in chat
