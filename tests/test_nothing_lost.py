"""Nothing lost, nothing mixed (issue 15): truncated zstd, two roles naming
one file, resume checks and the errors file, blank lines, empty shards,
Parquet body types, worker bounds, workers outliving their parent, odd
request ids, ``diff`` on files without answers.

Every test runs the real `derender` command as a subprocess (real kills for
resume and workers); usage errors are caught before the model loads, so
those runs cost no start-up. The one in-process test (the hypothesis test
of line alignment) reuses one real engine across its examples.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from derender_core import DerenderEngine, RenderConfig
from tests.helpers import (
    REPO,
    SAMPLE,
    invoke,
    normalize,
    offline_env,
    read_jsonl,
    run_cli,
    transcript_name,
)

FLAGS = ["--config", "sample_data/qwen3.yaml"]
CHAT = read_jsonl(SAMPLE / "chat.jsonl")
CHAT_ERRORS = read_jsonl(SAMPLE / "chat_errors.jsonl")
DERENDER = str(Path(sys.executable).with_name("derender"))


def jsonl(rows: list[Any]) -> bytes:
    return b"".join(orjson.dumps(row) + b"\n" for row in rows)


def lines_of(data: bytes) -> list[Any]:
    return [json.loads(line) for line in data.splitlines()]


def request_id(body: dict[str, Any]) -> str:
    return str(body["generate_response"]["request_id"])


def stderr_of(done: subprocess.CompletedProcess[bytes]) -> str:
    return done.stderr.decode(errors="replace")


# --- 1. truncated zstd ------------------------------------------------------------


@pytest.mark.parametrize("frames", ["one", "many"])
def test_a_truncated_zstd_input_is_a_run_that_could_not_finish(tmp_path: Path, frames: str) -> None:
    """As for gzip: exit 3, the input named, the records answered counted;
    a cut frame never passes as the end of the input."""
    records = jsonl(CHAT) * 20
    compressor = zstandard.ZstdCompressor()
    if frames == "one":
        packed = compressor.compress(records)
        packed = packed[: len(packed) * 55 // 100]
    else:
        lines = records.splitlines(keepends=True)
        packed = b"".join(compressor.compress(b"".join(lines[i : i + 4])) for i in range(0, len(lines), 4))
        packed = packed[:-9]  # the last frame cut short
    source = tmp_path / "in.jsonl.zst"
    source.write_bytes(packed)
    out = tmp_path / "out.jsonl"
    done = run_cli("chat", str(source), "-o", str(out), "-j", "1", *FLAGS)
    stderr = stderr_of(done)
    assert done.returncode == 3, stderr
    written = out.read_bytes().count(b"\n")
    assert written < len(records.splitlines())
    assert f"the run could not finish: cannot read {source}: it ends early (the last zstd frame is cut short)" in stderr
    assert f"{written} records were answered; {written} written in full to {out}." in stderr
    if frames == "many":
        assert written >= len(records.splitlines()) - 8  # every whole frame was answered


# --- 2. two roles naming one file ----------------------------------------------------


def test_two_roles_naming_one_file_are_refused_before_anything_is_opened(tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    shutil.copy(SAMPLE / "chat.jsonl", source)
    out = tmp_path / "out.jsonl"
    # -o F --errors F, F not there yet: nothing may create it.
    done = run_cli("chat", str(source), "-o", str(out), "--errors", str(out), *FLAGS)
    assert done.returncode == 2 and f"--errors {out} is the same file as -o {out}" in stderr_of(done)
    assert not out.exists()
    # A symlink to the future output, and a hard link to an existing one.
    (tmp_path / "link.jsonl").symlink_to(out)
    done = run_cli("chat", str(source), "-o", str(out), "--errors", str(tmp_path / "link.jsonl"), *FLAGS)
    assert done.returncode == 2 and "is the same file as -o" in stderr_of(done)
    out.write_bytes(b"kept\n")
    os.link(out, tmp_path / "hard.jsonl")
    done = run_cli("chat", str(source), "-o", str(tmp_path / "hard.jsonl"), "--errors", str(out), *FLAGS)
    assert done.returncode == 2 and "both would write it" in stderr_of(done)
    assert out.read_bytes() == b"kept\n"
    # A shard's output, and an input that is also --requests.
    shards = [tmp_path / "part-0.jsonl", tmp_path / "part-1.jsonl"]
    for shard in shards:
        shutil.copy(source, shard)
    done = run_cli("chat", *map(str, shards), "-o", f"{tmp_path}/out/", "--errors", f"{tmp_path}/out/./part-1.jsonl", *FLAGS)
    assert done.returncode == 2 and f"is the same file as -o {tmp_path}/out/part-1.jsonl" in stderr_of(done)
    done = run_cli("chat", str(source), "--requests", str(tmp_path / "in.jsonl"), *FLAGS)
    assert done.returncode == 2 and "name each file in one role only" in stderr_of(done)
    assert source.read_bytes() == (SAMPLE / "chat.jsonl").read_bytes()
    assert "Traceback" not in stderr_of(done)


# --- 3 and 4. resume: only what it continues, errors file included -------------------


@dataclasses.dataclass
class CleanRun:
    source: Path
    output: Path
    errors: Path
    records: int


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory: pytest.TempPathFactory) -> CleanRun:
    """An uninterrupted run over many good and failing records, with --errors.

    Enough of them that a `-j 2` run outlasts the kill test's wait after its
    first output by seconds, on a fast machine too: 2,251 records once ended
    inside that 0.3 s on CI, and the kill missed the run."""
    directory = tmp_path_factory.mktemp("resume")
    rows = [*CHAT, *CHAT_ERRORS] * 1000
    source = directory / "in.jsonl"
    source.write_bytes(jsonl(rows) + b"not json\n")
    output, errors = directory / "clean.jsonl", directory / "clean-errors.jsonl"
    done = run_cli("chat", str(source), "-o", str(output), "--errors", str(errors), "-j", "1", *FLAGS)
    assert done.returncode == 1, stderr_of(done)
    assert output.read_bytes().count(b"\n") == len(rows) + 1
    return CleanRun(source, output, errors, len(rows) + 1)


def normalized_lines(path: Path) -> list[Any]:
    return normalize(lines_of(path.read_bytes()))


def test_kill_9_then_resume_continues_the_output_and_the_errors_file(clean_run: CleanRun, tmp_path: Path) -> None:
    """Killed with SIGKILL mid-run, then resumed: the output and the
    --errors file both equal the clean run's, no line lost or repeated."""
    output, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    args = ["chat", str(clean_run.source), "-o", str(output), "--errors", str(errors), *FLAGS]
    process = subprocess.Popen([DERENDER, *args, "-j", "2"], cwd=REPO, env=offline_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while (not output.exists() or output.stat().st_size == 0) and process.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    time.sleep(random.uniform(0, 0.3))
    process.kill()
    process.communicate(timeout=60)
    kept = output.read_bytes().count(b"\n")
    assert 0 < kept < clean_run.records, "the kill must land mid-run"

    done = run_cli(*args, "--resume", "-j", "1")
    assert done.returncode == 1, stderr_of(done)
    assert normalized_lines(output) == normalized_lines(clean_run.output)
    assert errors.read_bytes() == clean_run.errors.read_bytes()
    assert f"resumed: {kept} records" in stderr_of(done)
    assert json.loads((tmp_path / ".out.jsonl.derender.json").read_bytes())["records"] == clean_run.records


def test_resume_refuses_another_input_other_settings_or_no_manifest(clean_run: CleanRun, tmp_path: Path) -> None:
    """Each refusal is a usage error before the model loads, says what
    differs, and leaves the output as it was."""
    output = tmp_path / "out.jsonl"
    shutil.copy(clean_run.output, output)
    shutil.copy(clean_run.output.with_name(".clean.jsonl.derender.json"), tmp_path / ".out.jsonl.derender.json")
    before = output.read_bytes()

    def refused(source: Path, *flags: str) -> str:
        done = run_cli("chat", str(source), "-o", str(output), "--resume", *flags)
        assert done.returncode == 2, stderr_of(done)
        assert output.read_bytes() == before
        return stderr_of(done)

    other = tmp_path / "other.jsonl"
    other.write_bytes(jsonl(CHAT) * 300)
    message = refused(other, *FLAGS)
    assert f"cannot resume {output}: it answers another run: the input was {clean_run.source}" in message
    assert f"now {other} ({other.stat().st_size:,} bytes)" in message
    # Same size, one byte changed inside the records already answered.
    same_size = tmp_path / "same-size.jsonl"
    data = bytearray(clean_run.source.read_bytes())
    data[data.index(b"Paris")] = ord(b"p")
    same_size.write_bytes(bytes(data))
    assert "is not the one it answers: its first" in refused(same_size, *FLAGS)
    # The same input without the reasoning parser, or with --lenient.
    no_reasoning = ["--model", "sample_data/qwen3", "--served-model-name", "qwen3-sample",
                    "--tool-call-parser", "hermes", "--enable-auto-tool-choice"]  # fmt: skip
    assert '--reasoning-parser was "qwen3", now not set' in refused(clean_run.source, *no_reasoning)
    assert "--lenient was false, now true" in refused(clean_run.source, *FLAGS, "--lenient")
    # An output with no manifest says nothing of what it answers.
    (tmp_path / ".out.jsonl.derender.json").unlink()
    assert "it has no manifest" in refused(clean_run.source, *FLAGS)


# --- 5. output line i answers input line i --------------------------------------------


def test_blank_lines_get_their_own_error_records_and_errors_lines_agree(tmp_path: Path) -> None:
    """Blank and whitespace-only lines among records are records (not
    JSON); blank lines after the last record are not. Also: the
    missing-request message names the real --requests file."""
    requests = tmp_path / "requests.jsonl"
    shutil.copy(SAMPLE / "requests.jsonl", requests)
    bare = {"request_id": "nope", "choices": [{"index": 0, "token_ids": [1, 2], "finish_reason": "stop"}]}
    lines = [orjson.dumps(CHAT[0]), b"", b"not json", b"  \t", orjson.dumps(bare), orjson.dumps(CHAT[2])]
    source = tmp_path / "in.jsonl"
    source.write_bytes(b"\r\n".join(lines) + b"\r\n\n \n")
    out, errors = tmp_path / "new" / "out.jsonl", tmp_path / "errors.jsonl"  # its directory made, manifest too
    done = run_cli("chat", str(source), "-o", str(out), "--requests", str(requests), "--errors", str(errors), "-j", "1", *FLAGS)
    assert done.returncode == 1, stderr_of(done)
    answers = lines_of(out.read_bytes())
    assert len(answers) == len(lines)
    assert answers[0]["id"] == request_id(CHAT[0]) and answers[5]["id"] == request_id(CHAT[2])
    assert [a["error"]["code"] for a in answers[1:5]] == [400] * 4
    assert f"no request with request_id 'nope' in {requests}" in answers[4]["error"]["message"]
    logged = lines_of(errors.read_bytes())
    assert [(e["line"], e["record"]) for e in logged] == [(2, 2), (3, 3), (4, 4), (5, 5)]
    assert f"record 5 (line 5): 400 no request with request_id 'nope' in {requests}" in stderr_of(done)


@pytest.fixture
def in_process(sample_engine: DerenderEngine, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    """The CLI in this process on the module's real engine (no start-up per run)."""
    monkeypatch.chdir(REPO)

    def reuse(
        cls: type[DerenderEngine], config: RenderConfig, *, live: bool = False, decode: str = "fast", replay: str = "fast"
    ) -> DerenderEngine:
        return sample_engine.in_mode(live=live, decode=decode, replay=replay)

    monkeypatch.setattr(DerenderEngine, "build", classmethod(reuse))
    return CliRunner()


_REFERENCE: dict[int, Any] = {}


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    kinds=st.lists(st.sampled_from(["good", "bad", "blank"]), min_size=1, max_size=24),
    picks=st.lists(st.integers(0, len(CHAT) - 1), min_size=24, max_size=24),
    endings=st.lists(st.sampled_from([b"\n", b"\r\n", b"\r"]), min_size=25, max_size=25),
    blanks=st.lists(st.sampled_from([b"", b" ", b"\t ", b"  "]), min_size=24, max_size=24),
)
def test_any_mix_of_lines_gives_one_output_line_per_input_line(
    in_process: CliRunner, kinds: list[str], picks: list[int], endings: list[bytes], blanks: list[bytes]
) -> None:
    """Good, bad and blank lines with any line endings: output line i
    answers input line i, with -j 1 and -j 2 (trailing blank lines are not
    records)."""
    if not _REFERENCE:
        result = invoke(in_process, "chat", "-", "-j", "1", "-q", *FLAGS, stdin=jsonl(CHAT))
        _REFERENCE.update(enumerate(normalize(lines_of(result.stdout_bytes))))
    raw = []
    for position, kind in enumerate(kinds):
        raw.append({"good": orjson.dumps(CHAT[picks[position]]), "bad": b'{"generate_response": [', "blank": blanks[position]}[kind])
    endings = endings[: len(raw)]
    for position in range(len(raw) - 1):
        # A lone CR then a blank line ended by LF is one CRLF: not two lines.
        if endings[position] == b"\r" and raw[position + 1] == b"" and endings[position + 1].startswith(b"\n"):
            endings[position] = b"\r\n"
    data = b"".join(line + ending for line, ending in zip(raw, endings, strict=True)) + endings[-1] * 2
    last = max((n for n, kind in enumerate(kinds) if kind != "blank"), default=-1)
    for workers in ("1", "2"):
        result = invoke(in_process, "chat", "-", "-j", workers, "-q", *FLAGS, stdin=data)
        assert result.exit_code in (0, 1), result.stderr
        answers = normalize(lines_of(result.stdout_bytes))
        assert len(answers) == last + 1, workers
        for position, answer in enumerate(answers):
            if kinds[position] == "good":
                assert answer == _REFERENCE[picks[position]], (workers, position)
            else:
                assert answer["error"]["code"] == 400, (workers, position)


# --- 6. empty and tiny inputs ----------------------------------------------------------


def test_empty_and_tiny_shards_give_empty_outputs_and_the_others_are_answered(tmp_path: Path) -> None:
    """Shards of 0 to 3 bytes: empty outputs, exit 0, every other shard
    answered. Also: outputs an earlier run left in -o DIR/ are replaced,
    and the run says so."""
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "a-empty.jsonl").write_bytes(b"")
    (shards / "b-newline.jsonl").write_bytes(b"\n")
    (shards / "c-blank.jsonl").write_bytes(b" \r\n")
    (shards / "d-empty.jsonl.gz").write_bytes(gzip.compress(b""))
    (shards / "e-good.jsonl").write_bytes(jsonl(CHAT))
    out = tmp_path / "out"
    out.mkdir()
    (out / "e-good.jsonl").write_bytes(b"stale\n")
    done = run_cli("chat", *sorted(str(p) for p in shards.iterdir()), "-o", f"{out}/", "-j", "2", *FLAGS)
    assert done.returncode == 0, stderr_of(done)
    for name in ("a-empty.jsonl", "b-newline.jsonl", "c-blank.jsonl"):
        assert (out / name).read_bytes() == b""
    assert gzip.decompress((out / "d-empty.jsonl.gz").read_bytes()) == b""
    assert [a["id"] for a in lines_of((out / "e-good.jsonl").read_bytes())] == [request_id(b) for b in CHAT]
    assert f"replacing 1 output(s) in {out}/ that an earlier run left" in stderr_of(done)


# --- 7 and 8. a Parquet body that is not text; too many workers -------------------------


def test_a_parquet_body_column_that_is_not_text_is_a_usage_error(tmp_path: Path) -> None:
    source = tmp_path / "in.parquet"
    pq.write_table(pa.table({"body": pa.array([1, 2], type=pa.int64())}), source)
    done = run_cli("chat", str(source), "--model", str(tmp_path / "no-model"))
    assert done.returncode == 2, stderr_of(done)
    assert f"{source}: column 'body' is int64, not text" in stderr_of(done)


def test_workers_beyond_the_machine_are_a_usage_error_before_the_model_loads(tmp_path: Path) -> None:
    # A model that does not exist: the workers are refused first, so nothing loaded.
    done = run_cli("chat", "sample_data/chat.jsonl", "-j", "10000", "--model", str(tmp_path / "no-model"))
    assert done.returncode == 2, stderr_of(done)
    assert "--workers 10000: at most " in stderr_of(done) and "on this machine (" in stderr_of(done)
    done = run_cli("chat", "sample_data/chat.jsonl", "-j", "10000", *FLAGS)
    assert done.returncode == 2 and "--workers 10000: at most" in stderr_of(done)
    assert done.stdout == b""


# --- 9. the smaller items -----------------------------------------------------------------


def _worker_pids(parent: int) -> list[int]:
    """The parent's forked children (its own command name; not, say,
    multiprocessing's resource tracker, which is a fresh python)."""
    found = []
    name = Path(f"/proc/{parent}/comm").read_text()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                comm = Path(f"/proc/{entry}/comm").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent and comm == name:
                found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def test_workers_die_with_their_parent_even_mid_batch(tmp_path: Path) -> None:
    """kill -9 of the parent while each worker is deep in a batch of long
    records: the workers are gone within about a second, not when the
    batch is done. vLLM's own per-token decode keeps each record busy for
    a good part of a second; the fast decode would finish the whole run
    before the kill."""
    body = json.loads(json.dumps(CHAT[2]))
    tokens = body["generate_response"]["choices"][0]["token_ids"]
    body["generate_response"]["choices"][0]["token_ids"] = (tokens[:-1] * 2000)[:38000] + tokens[-1:]
    source = tmp_path / "long.jsonl"
    source.write_bytes(jsonl([body]) * 80)
    process = subprocess.Popen(
        [DERENDER, "chat", str(source), "-o", str(tmp_path / "out.jsonl"), "-j", "2", "--decode", "reference", *FLAGS],
        cwd=REPO, env=offline_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while len(workers := _worker_pids(process.pid)) < 2:
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(2.5)  # into the first batch of 16 records, each a good part of a second
    assert all(_alive(pid) for pid in workers)
    process.kill()
    process.wait()
    killed = time.monotonic()
    while any(_alive(pid) for pid in workers) and time.monotonic() - killed < 10:
        time.sleep(0.05)
    assert time.monotonic() - killed < 2, "the workers outlived their parent"


def test_request_ids_that_would_make_odd_file_names_get_safe_distinct_names(tmp_path: Path) -> None:
    stream = read_jsonl(SAMPLE / "stream.jsonl")
    ids = sorted({body["generate_chunk"]["request_id"] for body in stream})
    odd = dict(zip(ids, [".hidden", "-rf", "a/b c%"], strict=True))
    for body in stream:
        body["generate_chunk"]["request_id"] = odd[body["generate_chunk"]["request_id"]]
    done = run_cli("stream", "-", "--format", "sse", "-o", f"{tmp_path}/sse/", *FLAGS, stdin=jsonl(stream))
    assert done.returncode == 0, stderr_of(done)
    names = sorted(p.name for p in (tmp_path / "sse").iterdir())
    assert names == sorted(transcript_name(rid) for rid in odd.values())
    # No hidden file, nothing that reads as an option, nothing outside DIR.
    assert [name[:2] for name in names] == ["a_", "hi", "rf"]


def test_diff_of_files_without_answers_says_so(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    for left, right in ((empty, empty), (SAMPLE / "chat.jsonl", SAMPLE / "chat.jsonl"), (SAMPLE / "requests.jsonl", empty)):
        done = run_cli("diff", str(left), str(right))
        assert done.returncode == 4, stderr_of(done)
        assert "nothing to compare" in stderr_of(done) and "0 divergences" not in stderr_of(done)


def test_parsers_prints_nothing_on_stderr() -> None:
    done = run_cli("parsers", "--format", "jsonl")
    assert done.returncode == 0 and done.stdout
    assert done.stderr == b"", stderr_of(done)
