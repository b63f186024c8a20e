"""Ray Data on a local cluster: two nodes simulated on this machine.

`ray.cluster_utils.Cluster` starts a head and a worker node of one CPU
each; the CLI spreads its actors over both nodes. The model directory the actors use is shipped (`ModelBundle`): the
library test deletes the original before the actors start. Answers are
compared with the in-process run of the same lines, which the parity
tests compare with the render server. One cluster serves the module; each
run starts two actors of about 1.7 GB (fractional CPUs, as the 2-core CI
machine needs).
"""

from __future__ import annotations

import dataclasses
import io
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pyarrow.parquet as pq
import pytest

from derender_core import Endpoint
from derender_core.batch import Job, run
from derender_core.records import iter_records
from derender_core.writers import JsonlWriter, SseWriter
from tests.conftest import Stack
from tests.helpers import REPO, normalized_bytes, offline_env
from tests.sample_inputs import (
    chat_bodies,
    chat_error_bodies,
    stream_bodies,
    stream_plans,
    write_jsonl,
)

ray = pytest.importorskip("ray")



USAGE_POLLER = "data-usage-metrics-poller"
"""Ray Data's usage collection polls Prometheus from a daemon thread of the
driver every 10 s, for the life of the process, and logs each failed query;
after the cluster is gone its log handler fails too (``--- Logging
error ---`` after the suite's summary). The suite collects no usage."""


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_worker_niceness", "0")
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("RAY_DATA_USAGE_DISABLED", "1")
    two_nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    two_nodes.add_node(num_cpus=1)
    two_nodes.wait_for_nodes()
    ray.init(address=two_nodes.address, log_to_driver=False, logging_level="ERROR")
    try:
        yield two_nodes
    finally:
        ray.shutdown()
        two_nodes.shutdown()
        monkeypatch.undo()


def local_answers(stack: Stack, job: Job, lines: list[bytes], sse: bool = False) -> bytes:
    out = io.BytesIO()
    writer = SseWriter(target=out) if sse else JsonlWriter(out)
    engine = stack.engine.in_mode(live=True)
    run(engine, iter_records(io.BytesIO(b"\n".join(lines) + b"\n")), job, writer)
    return out.getvalue()


def test_cli_ray_streams_stay_on_one_actor_in_order(qwen3_stack: Stack, tmp_path: Path) -> None:
    """``stream --ray`` on the local cluster the CLI starts itself (it runs
    before the module's two-node cluster exists): interleaved streams,
    grouped by request_id so each stays on one actor in input order, give
    the local run's SSE transcripts. (Grouping shuffles; on the simulated
    two-node cluster Ray 2.60's shuffle beside an actor pool stalled here.)"""
    stack = qwen3_stack
    stream_in = write_jsonl(tmp_path / "stream.jsonl", stream_bodies(stack.builder, stream_plans(stack.builder)))
    flags = ["--config", "sample_data/qwen3.yaml", "--ray", "--ray-actors", "2"]
    done = cli("stream", str(stream_in), "--format", "sse", "-o", str(tmp_path / "out.sse"), *flags)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert_only_derender_lines(done.stderr)
    stream_lines = stream_in.read_bytes().splitlines()
    expected = local_answers(stack, Job(Endpoint.CHAT, stream=True), stream_lines, sse=True)
    assert normalized_bytes((tmp_path / "out.sse").read_bytes()) == normalized_bytes(expected)


def test_map_batches_with_a_shipped_model_answers_as_one_process(
    cluster: Any, qwen3_stack: Stack, tmp_path: Path
) -> None:
    """The documented API: text lines in, key/status/response out, one row
    per input row and in order, a bad line answered, not failing its block;
    the actors build their engines from the shipped model directory."""
    from ray.data import ActorPoolStrategy, DataContext

    from derender_core.ray_data import Derender, ModelBundle

    stack = qwen3_stack
    lines = [orjson.dumps(b) for b in [*chat_bodies(stack.builder), *chat_error_bodies(stack.builder)]]
    lines = (lines + [b'{"generate_response": [1, 2']) * 4
    model_copy = tmp_path / "model"
    shutil.copytree(stack.config.model or "", model_copy)
    config = dataclasses.replace(stack.config, model=str(model_copy))
    bundle = ModelBundle.of(config)
    shutil.rmtree(model_copy)  # only the bundle has it now

    DataContext.get_current().execution_options.preserve_order = True
    rows = [{"key": number, "text": line} for number, line in enumerate(lines, start=1)]
    answered = (
        # Four blocks from the start: a repartition (all-to-all) before an
        # actor pool hangs on a multi-node cluster in Ray 2.60.
        ray.data.from_items(rows, override_num_blocks=4)
        .map_batches(
            Derender,
            fn_constructor_kwargs={"config": config, "endpoint": "chat", "model": bundle},
            batch_format="pyarrow",
            compute=ActorPoolStrategy(size=2),
            num_cpus=0.5,
        )
        .take_all()
    )
    assert [row["key"] for row in answered] == list(range(1, len(lines) + 1))
    got = b"".join(row["response"].encode() + b"\n" for row in answered)
    assert normalized_bytes(got) == normalized_bytes(local_answers(stack, Job(Endpoint.CHAT), lines))
    assert {row["status"] for row in answered} >= {200, 400, 404}
    # Nothing of Ray Data lives on in this process to log after the suite.
    assert USAGE_POLLER not in {thread.name for thread in threading.enumerate()}


def test_map_batches_renders_requests_and_the_prompts_records_lack(cluster: Any, qwen3_stack: Stack) -> None:
    """Ray Data on the render endpoint (requests in, GenerateRequests out)
    and with ``render_prompts`` (records without prompt ids): one process's
    answers, row for row."""
    from ray.data import ActorPoolStrategy, DataContext

    from derender_core.ray_data import Derender

    stack = qwen3_stack
    sample = [orjson.loads(line) for line in (REPO / "sample_data" / "chat.jsonl").read_bytes().splitlines()]
    requests = [orjson.dumps({**b["chat_request"], "request_id": b["generate_response"]["request_id"]}) for b in sample]
    bare = [orjson.dumps({k: v for k, v in b.items() if k != "prompt_token_ids"}) for b in sample]
    DataContext.get_current().execution_options.preserve_order = True
    runs = (
        ("render-chat", requests, {}, Job(Endpoint.RENDER_CHAT)),
        ("chat", bare, {"render_prompts": True}, Job(Endpoint.CHAT, render_prompts=True)),
    )
    for endpoint, lines, extra, job in runs:
        rows = [{"key": number, "text": line} for number, line in enumerate(lines, start=1)]
        answered = (
            ray.data.from_items(rows, override_num_blocks=2)
            .map_batches(
                Derender,
                fn_constructor_kwargs={"config": stack.config, "endpoint": endpoint, **extra},
                batch_format="pyarrow",
                compute=ActorPoolStrategy(size=1),
                num_cpus=0.5,
            )
            .take_all()
        )
        got = b"".join(row["response"].encode() + b"\n" for row in answered)
        assert normalized_bytes(got) == normalized_bytes(local_answers(stack, job, lines)), endpoint
        assert {row["status"] for row in answered} == {200}


def cli(*args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [str(Path(sys.executable).with_name("derender")), *args],
        capture_output=True, cwd=REPO, env=offline_env(), timeout=900,
    )  # fmt: skip


def ray_flags(cluster: Any) -> list[str]:
    return ["--config", "sample_data/qwen3.yaml", "--ray", "--ray-address", cluster.address, "--ray-actors", "2"]


def test_cli_ray_on_two_nodes_matches_a_local_run(cluster: Any, qwen3_stack: Stack, tmp_path: Path) -> None:
    """``--ray`` on the cluster: chat bodies in, Parquet rows out, equal to
    a local run, record by record."""
    stack = qwen3_stack
    chat_lines = [orjson.dumps(b) for b in chat_bodies(stack.builder)] * 3
    chat_in = tmp_path / "chat.jsonl"
    chat_in.write_bytes(b"\n".join(chat_lines) + b"\n")
    flags = ray_flags(cluster)

    done = cli("chat", str(chat_in), "-o", str(tmp_path / "chat.parquet"), *flags)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    table = pq.read_table(tmp_path / "chat.parquet")
    got = b"".join(response.encode() + b"\n" for response in table.column("response").to_pylist())
    assert normalized_bytes(got) == normalized_bytes(local_answers(stack, Job(Endpoint.CHAT), chat_lines))
    assert table.column("record").to_pylist() == list(range(1, len(chat_lines) + 1))
    assert b"start-up: ray" in done.stderr
    assert_only_derender_lines(done.stderr)


def assert_only_derender_lines(stderr: bytes) -> None:
    """stderr holds derender's own lines only: none of Ray's, its C++
    core's error line for each actor created (``core_worker.cc``:
    "constructor arguments in the object store") among them."""
    foreign = [line for line in stderr.decode().splitlines() if line and not line.startswith(("derender", "  "))]
    assert foreign == []


def test_stderr_without_drops_only_the_matching_lines() -> None:
    """Lines written to file descriptor 2 from outside Python (as Ray's C++
    core writes them) pass through in order, less the matching ones;
    Python's own writes and a last line without its newline pass too."""
    script = (
        "import os, re, sys\n"
        "from derender_core.ray_data import _ACTOR_ARGUMENTS_LINE, _stderr_without\n"
        "with _stderr_without(_ACTOR_ARGUMENTS_LINE):\n"
        "    os.write(2, b'[2026-12-05 01:15:19,194 E 1 1] core_worker.cc:2465: Actor with class name: "
        "\\'MapWorker(MapBatches(Derender))\\' and ID: \\'22\\' has constructor arguments in the object store "
        "and max_restarts > 0. If the arguments are lost, restarts fail.\\n[kept] core_worker.cc:1: other\\n')\n"
        "    print('derender: from Python', file=sys.stderr)\n"
        "    os.write(2, b'[2026-12-05 01:15:20,000 E 1 1] core_worker.cc:9: Actor with class name: '"
        "b'\\'A\\' and ID: \\'1\\' has constructor arguments in the object store and max_restarts > 0.\\n')\n"
        "    os.write(2, b'cut')\n"
        "print('after', file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stderr == b"[kept] core_worker.cc:1: other\nderender: from Python\ncutafter\n"


def test_ray_flag_without_ray_says_how_to_install(tmp_path: Path) -> None:
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "__init__.py").write_text("raise ImportError('no ray here')\n")
    env = offline_env(PYTHONPATH=str(tmp_path))
    done = subprocess.run(
        [str(Path(sys.executable).with_name("derender")), "chat", "sample_data/chat.jsonl",
         "--config", "sample_data/qwen3.yaml", "--ray"],
        capture_output=True, cwd=REPO, env=env, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert b"pip install 'derender[ray]'" in done.stderr
    assert b"Traceback" not in done.stderr


def test_ray_line_reader_numbers_records_as_iter_records_and_fails_on_a_cut_zstd_frame(tmp_path: Path) -> None:
    """The Ray line reader follows `iter_records`: a blank line among
    records is a record, trailing blank lines are not; a cut zstd frame is
    an error, not the end of the input."""
    import pyarrow as pa
    import zstandard

    from derender_core.ray_data import _lines_datasource

    data = b'{"a": 1}\n\n  \r\n{"b": 2}\n\n \n'
    plain = tmp_path / "in.jsonl"
    plain.write_bytes(data)
    datasource = _lines_datasource([str(plain)])
    rows = [row for table in datasource._read_stream(pa.OSFile(str(plain)), str(plain)) for row in table.to_pylist()]
    assert [(row["record"], row["key"]) for row in rows] == [(r.number, r.line) for r in iter_records(io.BytesIO(data))]
    assert len(rows) == 4
    cut = tmp_path / "in.jsonl.zst"
    cut.write_bytes(zstandard.ZstdCompressor().compress(data * 50)[:-5])
    with pytest.raises(EOFError, match="the last zstd frame is cut short"):
        list(datasource._read_stream(pa.OSFile(str(cut)), str(cut)))
