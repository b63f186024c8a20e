"""`derender parity --repro DIR` is safe to hand over: whatever a record's
request id holds, its report and script run nothing but the reproduction,
no two reports share a file, no report replaces a file the run reads, no
name is too long for the file system, and a full disk ends the run with a
message that names the file.

The scripts are run for real with bash: against the real `vllm launch
render` (the session's server, `VLLM_RENDER_URL`), and, for ids drawn by
hypothesis from the whole of Unicode and control characters, against a
stub server that records what it is sent (`tests.repro_stub`), so each run
also proves the script sent the record's exact bodies. The Markdown
report's shell lines are run by bash with `curl`, `derender` and `vllm`
stubs that record their arguments. A canary file that an injected command
would create must never appear.
"""

from __future__ import annotations

import io
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from derender_core.compare import Divergence
from derender_core.config import RenderConfig
from derender_core.minimize import Minimal, Size
from derender_core.naming import NAME_MAX, Names, file_name, file_stem
from derender_core.parity import Chunking, requests_of
from derender_core.protocol import Endpoint
from derender_core.records import iter_records
from derender_core.repro import header_safe, markdown, repro_script
from tests import repro_stub
from tests.conftest import Stack
from tests.helpers import REPO, SAMPLE, free_port, run_cli
from tests.test_docs import split_markdown

FLAGS = ["--config", "sample_data/qwen3.yaml", "--paths", "oneshot,replay", "--chunking", "tail"]
KIND = "oneshot-replay-error"
"""The one divergence the sample's stop-string record shows with FLAGS
(one-shot answers, the tail-cut stream refuses)."""
ISSUE_IDS = ["a/b", "a_b", "a?b", "req.1", "req.2", "北京", "東京", "..", ""]
"""The ids of the issue that shared four reports between nine records."""


def stop_string_record(request_id: str) -> dict[str, Any]:
    """The sample's `chat-stop-string` record under another id."""
    for line in (SAMPLE / "chat.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["generate_response"]["request_id"] == "chat-stop-string":
            record["generate_response"]["request_id"] = request_id
            return record
    raise AssertionError("the sample lost chat-stop-string")


def injections(canary: Path) -> list[str]:
    """Ids that would run ``touch CANARY`` if they reached a shell line
    unquoted, a comment line, or a Markdown block they could close."""
    touch = f"touch {canary}"
    return [
        f"x\n{touch}\n#",
        f"x\r\n{touch}\r\n#",
        f"x' ; {touch} ; echo '",
        f'x" ; {touch} ; echo "',
        f"$({touch})",
        f"`{touch}`",
        f"```\n{touch}\n```",
        f"x\n```\n{touch}\n```bash\n#",
        f"JSON\n{touch}\nJSON",
    ]


# --- names -------------------------------------------------------------------------------


def assert_names_apart(ids: list[str], directory: Path) -> None:
    """Each id's files are its own: distinct names (and distinct when case
    is folded), within NAME_MAX, creatable as files in `directory`."""
    names = [file_name(key, ".jsonl") for key in ids]
    assert len(set(names)) == len(set(ids))
    assert len({name.casefold() for name in names}) == len(set(ids))
    for name in names:
        assert len(name.encode()) <= NAME_MAX and "/" not in name and name[0] not in ".-~"
        (directory / name).write_text("x")
    assert len(list(directory.iterdir())) == len(set(ids))


def test_names_of_the_issue_ids_are_apart_and_bounded(tmp_path: Path) -> None:
    """The issue's nine ids, a 300-character and a 1 MB id, ids that differ
    only in case or in a lone surrogate: a file each."""
    ids = [*ISSUE_IDS, "chat.1", "chat.2", "A", "a", "y" * 300, "y" * 1_000_000, "\ud800", "\udc00", "\x00", "/", "."]
    assert_names_apart(ids, tmp_path)
    # Readable: the sanitised id, whole where it is short, then the digest.
    assert file_name("req.1", ".md").startswith("req.1-") and file_name("req.1", ".md").endswith(".md")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.text(st.characters(exclude_categories=())), min_size=1, max_size=20, unique=True))
def test_drawn_ids_never_share_a_file(ids: list[str], tmp_path_factory: pytest.TempPathFactory) -> None:
    assert_names_apart(ids, tmp_path_factory.mktemp("names"))


def test_names_pass_over_a_claimed_file_and_a_taken_stem(tmp_path: Path) -> None:
    """One run's `Names`: the same id twice gets two stems, and a stem one
    of whose files the run reads (`claimed`) is passed over."""
    claimed = {str(tmp_path / f"{file_stem('b')}.sh")}
    names = Names(tmp_path, [".md", ".sh"], claimed.__contains__)
    first, second, other = names.take("a"), names.take("a"), names.take("b")
    assert first == file_stem("a") and second == f"{file_stem('a')}-2"
    assert other == f"{file_stem('b')}-2"


# --- the reports of a real run -----------------------------------------------------------


def test_hostile_ids_through_the_cli_and_the_real_render_server(tmp_path: Path, qwen3_stack: Stack) -> None:
    """`--repro .` run beside its input, with the issue's ids, injections,
    a 300-character id and a lone surrogate, and with files of the run
    (the input itself, a hard link and a symlink to it, the `--report`)
    sitting where four reports would go: every record gets its own report, each report names the
    record file it wrote, no input changes, and every script, run against
    the real `vllm launch render`, reproduces and runs nothing else."""
    canary = tmp_path / "canary"
    ids = [*ISSUE_IDS, "chat.1", "chat.2", *injections(canary), "y" * 300, "\ud800z"]
    work = tmp_path / "work"
    work.mkdir()
    (work / "sample_data").symlink_to(SAMPLE)
    # The input under the name chat.1's record would get, a hard link to it
    # where chat.2's report would go, a symlink to it where req.1's script would.
    given_input = work / f"{file_stem(f'chat.1~{KIND}')}.jsonl"
    given_input.write_text("".join(json.dumps(stop_string_record(i)) + "\n" for i in ids))
    original = given_input.read_bytes()
    os.link(given_input, work / f"{file_stem(f'chat.2~{KIND}')}.md")
    (work / f"{file_stem(f'req.1~{KIND}')}.sh").symlink_to(given_input.name)
    # And the run's --report where req.2's report would go.
    table = work / f"{file_stem(f'req.2~{KIND}')}.md"
    done = run_cli(
        "parity", given_input.name, *FLAGS, "--repro", ".", "--report", table.name, "--minimize", "minimal.json",
        "--minimize-all", cwd=work,  # every record its own report, not one per class
    )  # fmt: skip
    assert done.returncode == 1, done.stderr.decode()
    assert given_input.read_bytes() == original
    assert (work / f"{file_stem(f'chat.2~{KIND}')}.md").read_bytes() == original
    assert os.readlink(work / f"{file_stem(f'req.1~{KIND}')}.sh") == given_input.name
    reports = sorted(work.glob("*-*.md"))
    reports = [r for r in reports if r.stat().st_ino != given_input.stat().st_ino and r != table]
    assert {line["request_id"] for line in map(json.loads, table.read_text().splitlines())} == set(ids)
    minimal_ids = [line["generate_response"]["request_id"] for line in map(json.loads, (work / "minimal.json").read_text().splitlines())]
    assert sorted(minimal_ids) == sorted(f"{i}~{KIND}" for i in ids)
    assert len(reports) == len(ids)
    seen = set()
    for report in reports:
        text = report.read_text()
        jsonl = report.with_name(report.name[: -len(".md")] + ".jsonl")
        assert f"also in `{jsonl.name}`" in text  # the record file the report names, which exists
        (record,) = [json.loads(line) for line in jsonl.read_text().splitlines()]
        seen.add(record["generate_response"]["request_id"])
        script = jsonl.with_name(jsonl.name[: -len(".jsonl")] + ".sh")
        ran = subprocess.run(
            ["bash", str(script)], capture_output=True, text=True, cwd=work, timeout=120,
            env={**os.environ, "VLLM_RENDER_URL": qwen3_stack.server.url},
        )  # fmt: skip
        assert ran.returncode == 1, ran.stdout + ran.stderr
        assert ran.stdout.splitlines()[-1] == "reproduced: the one-shot and streaming derender endpoints differ on error"
    assert seen == {f"{i}~{KIND}" for i in ids}
    # Where a file of the run sat, the reports took the next name.
    assert (work / f"{file_stem(f'chat.1~{KIND}')}-2.md").exists()
    assert (work / f"{file_stem(f'chat.2~{KIND}')}-2.md").exists()
    assert (work / f"{file_stem(f'req.1~{KIND}')}-2.sh").exists()
    assert (work / f"{file_stem(f'req.2~{KIND}')}-2.md").exists()
    assert not canary.exists()


def test_repro_on_a_full_disk_names_the_file(tmp_path: Path) -> None:
    """A report that cannot be written (its name a link to /dev/full) ends
    the run with exit 3 and a message naming it, not an internal error."""
    given_input, reports = tmp_path / "chat.jsonl", tmp_path / "reports"
    given_input.write_text(json.dumps(stop_string_record("full")) + "\n")
    reports.mkdir()
    full = reports / f"{file_stem(f'full~{KIND}')}.md"
    full.symlink_to("/dev/full")
    done = run_cli("parity", str(given_input), *FLAGS, "--repro", str(reports))
    stderr = done.stderr.decode()
    assert done.returncode == 3, stderr
    assert f"cannot write {full}: No space left on device" in stderr
    assert "internal error" not in stderr and "Traceback" not in stderr


# --- drawn ids, scripts and reports run by bash ------------------------------------------


def sample_minimal(request_id: str, right: str = "replay", field: str = "content") -> Minimal:
    """A minimal record as `Minimizer` gives it, for the sample's stop-string
    record under `request_id`: the record, read back as parity reads it
    (its one-shot body and its tail-cut stream). The stub server answers
    `content` differently on the two endpoints."""
    record = stop_string_record(request_id)
    choice = record["generate_response"]["choices"][0]
    choice["token_ids"] = choice["token_ids"][:1]  # as minimal records mostly are: two stream calls
    source = io.BytesIO(json.dumps(record).encode() + b"\n")
    (request,) = requests_of(iter_records(source), Endpoint.CHAT, stream=False, requests=None, chunkings=[Chunking(1, True)])
    divergence = Divergence(request_id, 0, "oneshot", right, field, "one", "two", "tail")
    size = Size.of([record], Endpoint.CHAT)
    return Minimal(
        request_id, divergence, [record], request_id, size, size, 1, 0.0, found=[divergence], request=request,
    )  # fmt: skip


DRAWN_IDS = st.one_of(
    st.text(st.characters(exclude_categories=()), max_size=30),
    st.tuples(st.text(max_size=5), st.sampled_from(range(9)), st.text(max_size=5)),
)
"""Any text (control characters and lone surrogates included), or one of
`injections` between drawn text (a tuple: the canary's path is the test's)."""


def drawn_id(drawn: str | tuple[str, int, str], canary: Path) -> str:
    if isinstance(drawn, str):
        return drawn
    before, which, after = drawn
    return before + injections(canary)[which] + after


@pytest.fixture(scope="module")
def stub(tmp_path_factory: pytest.TempPathFactory) -> Any:
    bodies = tmp_path_factory.mktemp("stub") / "bodies.jsonl"
    server = repro_stub.start(bodies)
    yield server, bodies
    server.shutdown()


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(drawn=DRAWN_IDS)
def test_drawn_ids_scripts_send_the_record_and_run_nothing_else(
    drawn: str | tuple[str, int, str], stub: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    server, bodies = stub
    work = tmp_path_factory.mktemp("script")
    canary = work / "canary"
    request_id = drawn_id(drawn, canary)
    minimal = sample_minimal(request_id)
    assert minimal.request is not None
    script = work / "repro.sh"
    script.write_text(repro_script(minimal, RenderConfig.from_yaml(SAMPLE / "qwen3.yaml"), Endpoint.CHAT))
    bodies.write_bytes(b"")
    url = f"http://127.0.0.1:{server.server_address[1]}"
    ran = subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, cwd=work, timeout=120, env={**os.environ, "VLLM_RENDER_URL": url}
    )  # fmt: skip
    assert ran.returncode == 1, ran.stdout + ran.stderr
    assert ran.stdout.splitlines() == [
        'one-shot (oneshot): "one"', f'stream (replay): "{"two" * len(minimal.request.streams[0][1])}"',
        "reproduced: the one-shot and streaming derender endpoints differ on content",
    ]  # fmt: skip
    assert not canary.exists()
    # The script sent the record's one-shot body and its stream's calls, the id exact.
    sent = [json.loads(line) for line in bodies.read_text().splitlines()]
    calls = minimal.request.streams[0][1]
    assert sent[0] == minimal.request.one_shot
    assert [{k: v for k, v in body.items() if k != "stream_state"} for body in sent[1:]] == calls
    assert sent[0]["generate_response"]["request_id"] == request_id


def stub_bin(directory: Path, record: Path) -> Path:
    """`curl`, `derender` and `vllm` that append their name and arguments
    to `record` as a JSON line."""
    directory.mkdir()
    for name in ("curl", "derender", "vllm"):
        path = directory / name
        path.write_text(
            f"#!{sys.executable}\nimport json, sys\n"
            f"open({str(record)!r}, 'a').write(json.dumps([{name!r}, *sys.argv[1:]]) + '\\n')\n"
        )
        path.chmod(0o755)
    return directory


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(drawn=DRAWN_IDS)
def test_drawn_ids_reports_shell_lines_run_only_their_command(
    drawn: str | tuple[str, int, str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Each ```bash block of a report (the server, the rerun, the script,
    the serve side's curl line), run by bash with stub commands, runs its
    one command with the exact arguments; the report has its own headings
    and blocks only, whatever the id; greedy decoding is sent as advised."""
    work = tmp_path_factory.mktemp("report")
    canary = work / "canary"
    request_id = drawn_id(drawn, canary)
    minimal = sample_minimal(request_id, right="serve")
    config = RenderConfig.from_yaml(SAMPLE / "qwen3.yaml")
    record_path = str(work / f"{file_stem(request_id)}.jsonl")
    text = markdown(minimal, config, Endpoint.CHAT, ["--paths", "oneshot,serve"], {}, work / "r.sh", record_path)
    prose, blocks = split_markdown(text)
    headings = [line for line in prose.splitlines() if line.startswith("#")]
    assert [h.split(" ", 1)[0] for h in headings] == ["#", "##", "##", "##", "##", "###"]
    assert [b.language for b in blocks] == ["bash", "bash", "json", "text", "bash", "bash"]
    assert [json.loads(line) for line in blocks[2].text.splitlines()] == minimal.records
    record = work / "argv.jsonl"
    path = f"{stub_bin(work / 'bin', record)}:{os.environ['PATH']}"
    (work / "r.sh").write_text(f"printf '%s\\n' '[\"r.sh\"]' >>{shlex.quote(str(record))}\n")
    for block in (b for b in blocks if b.language == "bash"):
        ran = subprocess.run(["bash", "-c", block.text], capture_output=True, cwd=work, env={**os.environ, "PATH": path}, timeout=60)
        assert ran.returncode == 0, ran.stderr
    assert not canary.exists()
    argvs = [json.loads(line) for line in record.read_text().splitlines()]
    assert [argv[0] for argv in argvs] == ["vllm", "derender", "r.sh", "curl"]
    assert argvs[0] == ["vllm", "launch", "render", *config.to_vllm_argv()]
    assert argvs[1][:3] == ["derender", "parity", record_path]
    curl = argvs[3]
    sent = json.loads(curl[curl.index("-d") + 1])
    assert sent == {**minimal.records[0]["chat_request"], "return_token_ids": True, "seed": 0, "temperature": 0}
    headers = [curl[i + 1] for i, word in enumerate(curl) if word == "-H"]
    if header_safe(request_id):
        assert f"X-Request-Id: {request_id}" in headers
    else:
        assert not any(h.startswith("X-Request-Id") for h in headers)


# --- the script starts the render server with or without a GPU ---------------------------


@pytest.mark.parametrize("gpu", [False, True])
def test_script_starts_the_server_without_settings(tmp_path: Path, gpu: bool) -> None:
    """With nothing set, the script runs `vllm launch render` on vLLM's CPU
    platform, and without a GPU (no working `nvidia-smi`) with an empty
    CUDA_VISIBLE_DEVICES, which vLLM 0.34 needs on an x86 CPU; with a GPU
    CUDA_VISIBLE_DEVICES is left alone. The stub `vllm` records how it ran."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    vllm = bin_dir / "vllm"
    vllm.write_text(f"#!/usr/bin/env bash\ncd {shlex.quote(str(REPO))} && exec {shlex.quote(sys.executable)} -m tests.repro_stub \"$@\"\n")
    vllm.chmod(0o755)
    if gpu:
        smi = bin_dir / "nvidia-smi"
        smi.write_text("#!/usr/bin/env bash\necho 'GPU 0: stub'\n")
        smi.chmod(0o755)
    script = tmp_path / "repro.sh"
    script.write_text(repro_script(sample_minimal("gpu"), RenderConfig.from_yaml(SAMPLE / "qwen3.yaml"), Endpoint.CHAT))
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_TARGET_DEVICE", "CUDA_VISIBLE_DEVICES", "VLLM_RENDER_URL")}
    env.update(
        PATH=f"{bin_dir}:/usr/bin:/bin", PORT=str(free_port()),
        STUB_RECORD=str(tmp_path / "record.json"), STUB_BODIES=str(tmp_path / "bodies.jsonl"),
    )  # fmt: skip
    ran = subprocess.run(["bash", str(script)], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert ran.returncode == 1, ran.stdout + ran.stderr
    started = json.loads((tmp_path / "record.json").read_text())
    assert started["argv"][:2] == ["launch", "render"]
    assert started["env"]["VLLM_TARGET_DEVICE"] == "cpu"
    if gpu:
        assert "CUDA_VISIBLE_DEVICES" not in started["env"]
    else:
        assert started["env"]["CUDA_VISIBLE_DEVICES"] == ""
    # What the user set is kept.
    env.update(VLLM_TARGET_DEVICE="cuda", CUDA_VISIBLE_DEVICES="0", PORT=str(free_port()))
    ran = subprocess.run(["bash", str(script)], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    started = json.loads((tmp_path / "record.json").read_text())
    assert (started["env"]["VLLM_TARGET_DEVICE"], started["env"]["CUDA_VISIBLE_DEVICES"]) == ("cuda", "0")
