"""Every output path checked before the run starts (issue 31, cases 4, 9
and 10): no output replaces an input or another output of the same run, by
any name (symlink, hard link, ``./``); an output that cannot be created is
refused before anything runs; after a full disk the summary counts the
records the file holds whole.

The command-line tests run the real `derender` command as a user would;
refusals come before vLLM is imported, so they cost no start-up.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from derender_core import InputError, RenderConfig
from derender_core.jobs import config_files
from derender_core.outputs import RunPaths
from tests.helpers import REPO, SAMPLE, run_cli, transcript_name

FLAGS = ["--config", "sample_data/qwen3.yaml"]
DERENDER = str(Path(sys.executable).with_name("derender"))
NO_SERVER = {"DERENDER_NO_SERVER": "1"}


def derender(*args: str) -> subprocess.CompletedProcess[bytes]:
    return run_cli(*args, env=NO_SERVER)


def files_in(directory: Path) -> dict[str, bytes]:
    """Every file under `directory` (links as what they point to), by relative path."""
    found = {}
    for path in sorted(directory.rglob("*")):
        if path.is_symlink():
            found[str(path.relative_to(directory))] = b"-> " + os.readlink(path).encode()
        elif path.is_file():
            found[str(path.relative_to(directory))] = path.read_bytes()
        else:
            found[str(path.relative_to(directory))] = b"<dir>"
    return found


def refused(done: subprocess.CompletedProcess[bytes], message: str) -> None:
    """Exit status 2 with `message`, and nothing processed: no data on
    stdout, no summary, no traceback."""
    stderr = done.stderr.decode(errors="replace")
    assert done.returncode == 2, stderr
    assert message in stderr, stderr
    assert done.stdout == b""
    assert "records" not in stderr and "Traceback" not in stderr and "divergences" not in stderr, stderr


# --- the check itself -----------------------------------------------------------------


def test_an_output_that_is_an_input_by_any_name_is_refused(tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_bytes(b"{}\n")
    (tmp_path / "link.jsonl").symlink_to(source)
    os.link(source, tmp_path / "hard.jsonl")
    (tmp_path / "sub").mkdir()
    for alias in ("in.jsonl", "link.jsonl", "hard.jsonl", "./in.jsonl", "sub/../in.jsonl"):
        for flag in ("-o", "--report", "--html", "--minimize", "--errors"):
            with pytest.raises(InputError, match=f"^{flag} .* is the same file as INPUT .*writing it would destroy it"):
                RunPaths({"INPUT": str(source)}, {flag: str(tmp_path / alias)})
    # A directory input (transcripts, a model) counts its files.
    with pytest.raises(InputError, match="is the same file as EXPECTED"):
        RunPaths((), {"--html": str(tmp_path / "hard.jsonl")}, read={"EXPECTED": str(tmp_path)})
    RunPaths({"INPUT": str(source), "--requests": None}, {"-o": str(tmp_path / "new.jsonl"), "--errors": None})
    # Two input roles naming one file; two sides read alike may.
    with pytest.raises(InputError, match="--requests .*hard.jsonl is the same file as INPUT .*; name each file in one role only"):
        RunPaths({"INPUT": str(source), "--requests": str(tmp_path / "hard.jsonl")}, {})
    RunPaths((), {}, read=[("EXPECTED", str(source)), ("ACTUAL", str(source))])
    assert source.read_bytes() == b"{}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hard.jsonl", "in.jsonl", "link.jsonl", "sub"]


def test_two_outputs_naming_one_file_are_refused(tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_bytes(b"{}\n")
    out = tmp_path / "out"
    # Not there yet: the paths they resolve to.
    with pytest.raises(InputError, match=f"--html {out} is the same file as --report {out}; both would write it"):
        RunPaths({"INPUT": str(source)}, [("--report", str(out)), ("--html", str(out))])
    (tmp_path / "future").symlink_to(out)
    with pytest.raises(InputError, match="is the same file as --minimize"):
        RunPaths({"INPUT": str(source)}, [("--minimize", str(out)), ("--report", str(tmp_path / "future"))])
    # There: a hard link.
    out.write_bytes(b"kept\n")
    os.link(out, tmp_path / "hard")
    with pytest.raises(InputError, match="both would write it"):
        RunPaths({"INPUT": str(source)}, [("--minimize", str(out)), ("--report", str(tmp_path / "hard"))])
    # A file and a directory output by one name.
    with pytest.raises(InputError, match="--repro .* is the same file as --minimize"):
        RunPaths({"INPUT": str(source)}, [("--minimize", str(tmp_path / "r"))], [("--repro", str(tmp_path / "r"))])
    # stdout is not a path, but only one output can go there.
    with pytest.raises(InputError, match="--report - and --html -: only one of them can go to stdout"):
        RunPaths({"INPUT": str(source)}, [("--report", "-"), ("--html", "-")])
    RunPaths({"INPUT": "-"}, [("--report", "-"), ("--html", str(tmp_path / "page.html"))])
    assert out.read_bytes() == b"kept\n" and not (tmp_path / "r").exists() and not (tmp_path / "page.html").exists()


def test_an_output_that_cannot_be_created_is_refused_and_nothing_is_left_behind(tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_bytes(b"{}\n")
    inputs = {"INPUT": str(source)}
    for path, reason in [
        ("/proc/nope/x.html", "cannot write --html /proc/nope/x.html: No such file or directory"),
        (f"{source}/x.html", f"cannot write --html {source}/x.html: Not a directory"),
        (str(tmp_path), f"cannot write --html {tmp_path}: it is a directory"),
    ]:
        with pytest.raises(InputError, match=re.escape(reason)):
            RunPaths(inputs, {"--html": path})
    with pytest.raises(InputError, match=re.escape(f"cannot write into --repro {source}: it is not a directory")):
        RunPaths(inputs, {}, {"--repro": str(source)})
    with pytest.raises(InputError, match=re.escape("cannot write --repro /proc/nope/r: No such file or directory")):
        RunPaths(inputs, {}, {"--repro": "/proc/nope/r"})
    # What can be created is, for the check, and then removed again;
    # what is there is kept as it was.
    kept = tmp_path / "kept.html"
    kept.write_bytes(b"an earlier page\n")
    before = kept.stat()
    RunPaths(inputs, {"--html": str(kept), "--report": str(tmp_path / "a/b/c/r.jsonl")}, {"--repro": str(tmp_path / "d/e")})
    assert kept.read_bytes() == b"an earlier page\n" and kept.stat().st_mtime_ns == before.st_mtime_ns
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "kept.html"]
    (tmp_path / "d").mkdir()
    RunPaths(inputs, {}, {"--repro": str(tmp_path / "d")})
    assert list((tmp_path / "d").iterdir()) == []


def test_the_settings_files_are_inputs(tmp_path: Path) -> None:
    """The model directory and a chat template file are read by the run: no output replaces them."""
    model = tmp_path / "model"
    shutil.copytree(SAMPLE / "qwen3", model)
    template = tmp_path / "template.jinja"
    template.write_text("{{ messages }}")
    config = RenderConfig(model=str(model), chat_template=str(template))
    for output in (model / "tokenizer.json", template):
        with pytest.raises(InputError, match="is the same file as --(model|chat-template)"):
            RunPaths([("INPUT", "-")], {"-o": str(output)}, read=config_files(config))
    # A Hub id and an inline template name no file.
    RunPaths((), {"-o": str(tmp_path / "o")}, read=config_files(RenderConfig(model="Qwen/Qwen3-0.6B", chat_template="{{ x }}")))


def test_claimed_and_is_input_name_the_runs_files(tmp_path: Path) -> None:
    """What code that names files at run time (--repro reports,
    per-request transcripts) asks."""
    source = tmp_path / "in.jsonl"
    source.write_bytes(b"{}\n")
    os.link(source, tmp_path / "hard.jsonl")
    (tmp_path / "link").symlink_to(source)
    paths = RunPaths({"INPUT": str(source)}, {"--minimize": str(tmp_path / "m.jsonl")}, {"--repro": str(tmp_path)})
    for name in ("in.jsonl", "hard.jsonl", "link"):
        assert paths.is_input(tmp_path / name) and paths.claimed(tmp_path / name) == f"INPUT {source}"
    assert not paths.is_input(tmp_path / "m.jsonl") and paths.claimed(tmp_path / "m.jsonl") == f"--minimize {tmp_path / 'm.jsonl'}"
    assert not paths.is_input(tmp_path / "other.md") and paths.claimed(tmp_path / "other.md") is None


ALIASES = ("same", "dot", "symlink", "hardlink", "other")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    name=st.text(st.characters(exclude_characters="/\x00", exclude_categories=("Cs",)), min_size=1, max_size=40).filter(
        lambda n: n not in (".", "..") and len(n.encode()) < 200
    ),
    aliases=st.lists(st.sampled_from(ALIASES), min_size=1, max_size=4),
)
def test_refused_exactly_when_an_output_is_the_input(tmp_path_factory: pytest.TempPathFactory, name: str, aliases: list[str]) -> None:
    """Drawn file names from the whole of Unicode, and drawn ways of naming
    the input again: refused exactly when one output is the input (or two
    outputs one file), and the input's bytes kept either way."""
    directory, elsewhere = tmp_path_factory.mktemp("inputs"), tmp_path_factory.mktemp("outputs")
    source = directory / name
    source.write_bytes(b"input\n")
    outputs = []
    for number, alias in enumerate(aliases):
        path = elsewhere / f"out{number}"
        if alias == "same":
            path = source
        elif alias == "dot":
            path = Path(f"{directory}/./{name}")
        elif alias == "symlink":
            path.symlink_to(source)
        elif alias == "hardlink":
            os.link(source, path)
        outputs.append((f"--out{number}", str(path)))
    if any(alias != "other" for alias in aliases):
        with pytest.raises(InputError, match="is the same file as INPUT"):
            RunPaths({"INPUT": str(source)}, outputs)
    else:
        RunPaths({"INPUT": str(source)}, outputs)
    assert source.read_bytes() == b"input\n"


# --- the commands, run as a user runs them ------------------------------------------------


@pytest.fixture(scope="module")
def responses(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """One-shot responses of the sample, as `derender chat` writes them."""
    out = tmp_path_factory.mktemp("responses") / "out.jsonl"
    done = derender("chat", "sample_data/chat.jsonl", *FLAGS, "-j", "1", "-q", "-o", str(out))
    assert done.returncode == 0, done.stderr.decode()
    return out.read_bytes()


@pytest.fixture
def answers(tmp_path: Path, responses: bytes) -> tuple[Path, Path]:
    """Two files of answers `diff` compares."""
    expected, actual = tmp_path / "A.jsonl", tmp_path / "B.jsonl"
    expected.write_bytes(responses)
    actual.write_bytes(responses)
    return expected, actual


COMPARE_CASES = [
    # diff EXPECTED ACTUAL: A and B.
    ("diff", ["--html", "{A}"], "--html {A} is the same file as EXPECTED {A}"),
    ("diff", ["--report", "{B}"], "--report {B} is the same file as ACTUAL {B}"),
    ("diff", ["--html", "{dir}/link-to-A"], "--html {dir}/link-to-A is the same file as EXPECTED {A}"),
    ("diff", ["--report", "{dir}/hard-to-B"], "--report {dir}/hard-to-B is the same file as ACTUAL {B}"),
    ("diff", ["--report", "{dir}/F", "--html", "{dir}/F"], "--html {dir}/F is the same file as --report {dir}/F"),
    ("diff", ["--report", "-", "--html", "-"], "only one of them can go to stdout"),
    ("diff", ["--html", "/proc/nope/x.html"], "cannot write --html /proc/nope/x.html: No such file or directory"),
    ("diff", ["--report", "{A}/r.jsonl"], "cannot write --report {A}/r.jsonl: Not a directory"),
    # parity INPUT: S.
    ("parity", ["--report", "{S}"], "--report {S} is the same file as INPUT {S}"),
    ("parity", ["--html", "{S}"], "--html {S} is the same file as INPUT {S}"),
    ("parity", ["--html", "{dir}/link-to-S"], "--html {dir}/link-to-S is the same file as INPUT {S}"),
    ("parity", ["--report", "{dir}/hard-to-S"], "--report {dir}/hard-to-S is the same file as INPUT {S}"),
    ("parity", ["--minimize", "{dir}/link-to-S"], "--minimize {dir}/link-to-S is the same file as INPUT {S}"),
    ("parity", ["--report", "{dir}/F", "--html", "{dir}/F"], "--html {dir}/F is the same file as --report {dir}/F"),
    ("parity", ["--minimize", "{dir}/F", "--report", "{dir}/F"], "--report {dir}/F is the same file as --minimize {dir}/F"),
    ("parity", ["--minimize", "{dir}/F", "--html", "{dir}/./F"], "--html {dir}/./F is the same file as --minimize {dir}/F"),
    ("parity", ["--minimize", "{dir}/F", "--repro", "{dir}/F"], "--repro {dir}/F is the same file as --minimize {dir}/F"),
    ("parity", ["--report", "-", "--html", "-"], "only one of them can go to stdout"),
    ("parity", ["--html", "/proc/nope/x.html"], "cannot write --html /proc/nope/x.html: No such file or directory"),
    ("parity", ["--report", "/proc/nope/r.jsonl"], "cannot write --report /proc/nope/r.jsonl: No such file or directory"),
    ("parity", ["--minimize", "/proc/nope/m.jsonl"], "cannot write --minimize /proc/nope/m.jsonl: No such file or directory"),
    ("parity", ["--repro", "/proc/nope/r"], "cannot write --repro /proc/nope/r: No such file or directory"),
    ("parity", ["--repro", "{S}"], "cannot write into --repro {S}: it is not a directory"),
    ("parity", ["--html", "{S}/x.html"], "cannot write --html {S}/x.html: Not a directory"),
    ("parity", ["--html", "{dir}"], "cannot write --html {dir}: it is a directory"),
]


@pytest.mark.parametrize(
    ("command", "flags", "message"), COMPARE_CASES, ids=[f"{c} {' '.join(f)}" for c, f, _ in COMPARE_CASES]
)
def test_parity_and_diff_refuse_an_output_before_the_run(
    answers: tuple[Path, Path], command: str, flags: list[str], message: str
) -> None:
    """Exit status 2 before anything is read or run, every file in the
    directory (inputs, links) as it was."""
    expected, actual = answers
    directory = expected.parent
    source = directory / "S.jsonl"
    shutil.copy(SAMPLE / "chat.jsonl", source)
    for link, target in (("link-to-A", expected), ("link-to-S", source)):
        (directory / link).symlink_to(target)
    for link, target in (("hard-to-B", actual), ("hard-to-S", source)):
        os.link(target, directory / link)
    before = files_in(directory)
    names = {"A": expected, "B": actual, "S": source, "dir": directory}
    given = ["diff", str(expected), str(actual)] if command == "diff" else ["parity", str(source), *FLAGS]
    refused(derender(*given, *(flag.format(**names) for flag in flags)), message.format(**names))
    assert files_in(directory) == before


def test_outputs_a_shell_hands_over_are_written(answers: tuple[Path, Path]) -> None:
    """/dev/stdout on a pipe and a process substitution (/dev/fd/N) name
    pipes, which resolve to no path: they are written, not refused."""
    expected, actual = answers
    done = derender("diff", str(expected), str(actual), "--html", "/dev/stdout")
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.startswith(b"<!DOCTYPE html>")
    page = expected.parent / "page.html"
    script = f'"{DERENDER}" diff "{expected}" "{actual}" --html >(cat > "{page}") --report /dev/null; status=$?; wait; exit $status'
    done = subprocess.run(["bash", "-c", script], capture_output=True, env={**os.environ, **NO_SERVER}, timeout=600)
    assert done.returncode == 0, done.stderr.decode()
    assert page.read_bytes().startswith(b"<!DOCTYPE html>")


def test_parity_from_serve_keeps_the_recording_and_the_requests(tmp_path: Path) -> None:
    requests, recorded = tmp_path / "requests.jsonl", tmp_path / "recorded.jsonl"
    shutil.copy(SAMPLE / "requests.jsonl", requests)
    recorded.write_bytes(b"{}\n")
    before = files_in(tmp_path)
    for flag, target, role in [("--html", recorded, "--from-serve"), ("--report", requests, "INPUT")]:
        done = derender("parity", str(requests), "--from-serve", str(recorded), *FLAGS, flag, str(target))
        refused(done, f"{flag} {target} is the same file as {role} {target}")
    assert files_in(tmp_path) == before


def test_the_derender_commands_refuse_an_output_before_the_model_loads(tmp_path: Path) -> None:
    """chat, completion, stream and render: -o and --errors, through
    links, into a directory that cannot be made, onto the model's files."""
    chat, stream, completion = tmp_path / "chat.jsonl", tmp_path / "stream.jsonl", tmp_path / "completion.jsonl"
    for source in (chat, stream, completion):
        shutil.copy(SAMPLE / source.name, source)
    (tmp_path / "link-to-chat").symlink_to(chat)
    os.link(completion, tmp_path / "hard-to-completion")
    model = tmp_path / "model"
    shutil.copytree(SAMPLE / "qwen3", model)
    config = tmp_path / "qwen3.yaml"
    config.write_text((SAMPLE / "qwen3.yaml").read_text().replace("sample_data/qwen3", str(model)))
    flags = ["--config", str(config)]
    before = files_in(tmp_path)
    cases = [
        (["chat", str(chat), "-o", str(tmp_path / "link-to-chat")], f"-o {tmp_path}/link-to-chat is the same file as INPUT {chat}"),
        (["chat", str(chat), "--errors", str(tmp_path / "link-to-chat")], "is the same file as INPUT"),
        (["chat", str(chat), "-o", str(model / "tokenizer.json")], f"is the same file as --model {model}"),
        (["chat", str(chat), "--errors", "/proc/nope/e.jsonl"], "cannot write --errors /proc/nope/e.jsonl: No such file or directory"),
        (["completion", str(completion), "-o", str(tmp_path / "hard-to-completion")], "is the same file as INPUT"),
        (["completion", str(completion), "-o", "/proc/nope/o.jsonl"], "cannot write -o /proc/nope/o.jsonl: No such file or directory"),
        (["stream", str(stream), "--format", "sse", "-o", str(stream)], f"-o {stream} is the same file as INPUT {stream}"),
        (["stream", str(stream), "--format", "sse", "-o", "/proc/nope/sse/"], "cannot write -o /proc/nope/sse: No such file or directory"),
        (["render", "chat", str(chat), "-o", str(chat)], "is the same file as INPUT"),
        (["render", "completion", str(completion), "--errors", str(tmp_path / "e"), "-o", str(tmp_path / "e")], "is the same file as -o"),
    ]
    for args, message in cases:
        refused(derender(*args, *flags), message)
    assert files_in(tmp_path) == before


def test_per_request_transcripts_never_replace_an_input(tmp_path: Path) -> None:
    """``stream --format sse -o DIR/`` names a file per request; an input
    in DIR with a request's name keeps its bytes, the transcript takes
    another name."""
    out = tmp_path / "out"
    out.mkdir()
    source = out / transcript_name("stream-n2")  # request "stream-n2"'s transcript
    shutil.copy(SAMPLE / "stream.jsonl", source)
    done = derender("stream", str(source), *FLAGS, "-j", "1", "--format", "sse", "-o", f"{out}/")
    assert done.returncode == 0, done.stderr.decode()
    assert source.read_bytes() == (SAMPLE / "stream.jsonl").read_bytes()
    names = sorted(path.name for path in out.iterdir())
    second = transcript_name("stream-n2").removesuffix(".sse") + "-2.sse"
    assert names == sorted([second, source.name, transcript_name("stream-speculative-unicode"), transcript_name("stream-tool-call")])
    assert (out / second).read_bytes().endswith(b"data: [DONE]\n\n")


# --- after a full disk: the count of records written in full -------------------------------


@pytest.mark.parametrize(("redirect", "unbuffered"), [("-o", ""), (">>", ""), (">>", "1")], ids=["-o", ">>", ">> python -u"])
def test_the_summary_counts_the_whole_lines_the_file_holds(tmp_path: Path, redirect: str, unbuffered: str) -> None:
    """``ulimit -f`` as a user sets it: the output is cut mid-line (exit 3),
    and the summary's "N written in full" is the number of whole lines the
    file holds, whether derender opened it (-o) or the shell did, to append
    (``>>``), stdout buffered or not (``PYTHONUNBUFFERED``: a raw file that
    takes part of a write without an error)."""
    source = tmp_path / "in.jsonl"
    source.write_bytes((SAMPLE / "chat.jsonl").read_bytes() * 60)
    out = tmp_path / "out.jsonl"
    earlier = b'{"an earlier line": 1}\n' * 3
    if redirect == ">>":
        out.write_bytes(earlier)
        target = f'>> "{out}"'
    else:
        target = f'-o "{out}"'
    script = f'ulimit -f 100; "{DERENDER}" chat "{source}" {" ".join(FLAGS)} -j 1 {target}'
    env = {**os.environ, **NO_SERVER, "VLLM_TARGET_DEVICE": "cpu", "PYTHONUNBUFFERED": unbuffered}
    done = subprocess.run(["bash", "-c", script], capture_output=True, cwd=REPO, env=env, timeout=600)
    stderr = done.stderr.decode()
    assert done.returncode == 3, stderr
    data = out.read_bytes()
    assert len(data) == 100 * 1024 and not data.endswith(b"\n")  # cut mid-line by the limit
    found = re.search(r"(\d+) records were answered; (\d+) written in full to (\S+)\.", stderr)
    assert found is not None, stderr
    whole = data.count(b"\n") - (earlier.count(b"\n") if redirect == ">>" else 0)
    assert int(found.group(2)) == whole
    assert int(found.group(1)) >= whole > 0
