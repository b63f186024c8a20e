"""Shared fixtures: model directories, engines and real render servers.

Every fixture here is real: tokenizers built from package-shipped
vocabularies, vLLM's own derender stack, and `vllm launch render` processes.
They are session-scoped because each costs seconds to build.
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib.metadata
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from derender_core import DerenderEngine, RenderConfig, ServeEngine
from tests.helpers import REPO, SAMPLE, TOKENIZER_CACHE_VARIABLES, RenderServer, ServeOracle

# The suite runs with empty tokenizer caches, so a model that would need a
# downloaded file fails here instead of finding it in ~/.cache. Set before
# anything imports huggingface_hub, which reads them at import; the render
# servers inherit them.
EMPTY_TOKENIZER_CACHE = Path(tempfile.mkdtemp(prefix="derender-tests-empty-cache-"))
os.environ.update(dict.fromkeys(TOKENIZER_CACHE_VARIABLES, str(EMPTY_TOKENIZER_CACHE)))
atexit.register(shutil.rmtree, EMPTY_TOKENIZER_CACHE, ignore_errors=True)
# vLLM keeps what it learns of a model class (``modelinfos``) in one file per
# class, keyed by its module's hash: the suite run on 0.33 and on 0.34 in
# turn (as CI does) made each overwrite the other's, and every render
# server's first start of an architecture then inspected it again in a
# second vLLM process, 12 s of CPU. Each release keeps a cache of its own,
# under the root vLLM would use; the suite's processes inherit it (the test
# workers too, whose root is then the release's already).
VLLM_CACHE_OF_RELEASE = Path("derender-tests", importlib.metadata.version("vllm"))
_vllm_cache_root = Path(
    os.environ.get("VLLM_CACHE_ROOT") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vllm"
).expanduser()
if _vllm_cache_root.parts[-2:] != VLLM_CACHE_OF_RELEASE.parts:
    os.environ["VLLM_CACHE_ROOT"] = str(_vllm_cache_root / VLLM_CACHE_OF_RELEASE)
# No test reaches a `derender server` the user runs: every `derender` the
# suite starts runs fresh, and any client looks for a server in a directory
# of the suite's own. tests/test_server.py starts its own server, in a
# directory of its own, and lifts the bypass for its calls only.
SERVER_DIRECTORY = Path(tempfile.mkdtemp(prefix="derender-tests-server-"))
os.environ["DERENDER_NO_SERVER"] = "1"
os.environ["DERENDER_SERVER_DIR"] = str(SERVER_DIRECTORY)
atexit.register(shutil.rmtree, SERVER_DIRECTORY, ignore_errors=True)
# A suite started in the background of a script (`pytest &`) starts with
# SIGINT ignored, and every `derender` it starts would inherit that and
# rightly keep ignoring it; the tests that stop a run with Ctrl-C's signal
# need the ordinary disposition (those about an ignored one set it).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
from tests.model_factory import build_deepseek_v4, build_llama3
from tests.sample_inputs import (
    Family,
    SampleBuilder,
    deepseek_v4_family,
    llama3_family,
    qwen3_family,
)


WORKER_MEMORY = 11 << 30
"""Memory a test worker may take at its peak: the suite in two workers
peaked at 20.1 GiB in use (one process: 14.5)."""


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (pyproject's addopts): two workers, as proven, where the
    cores and the memory (`WORKER_MEMORY` each) allow; else one."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(1, min(2, os.cpu_count() or 1, memory // WORKER_MEMORY))


@dataclass
class Stack:
    """One model family: its settings, its engine and a real server."""

    name: str
    config: RenderConfig
    builder: SampleBuilder
    engine: DerenderEngine
    server: RenderServer


def sample_config() -> RenderConfig:
    """The bundled sample's config, with the model path made absolute so
    tests do not depend on the current directory."""
    config = RenderConfig.from_yaml(SAMPLE / "qwen3.yaml")
    return dataclasses.replace(config, model=str(SAMPLE.parent / config.model))


def _deepseek_config(model_dir: Path) -> RenderConfig:
    return RenderConfig(
        model=str(model_dir),
        served_model_name=("deepseek-v4-test",),
        tool_call_parser="deepseek_v4",
        reasoning_parser="deepseek_v4",
        enable_auto_tool_choice=True,
    )


def _start(name: str, config: RenderConfig, family: Family, logs: Path) -> Iterator[Stack]:
    server = RenderServer(config, logs / f"{name}-server.log")
    engine = DerenderEngine.build(config)
    try:
        yield Stack(name, config, SampleBuilder(family), engine, server)
    finally:
        engine.close()
        server.stop()


@pytest.fixture(scope="module")
def sample_engine() -> Iterator[DerenderEngine]:
    """The sample's engine, built once for the module that asks for it."""
    engine = DerenderEngine.build(sample_config())
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def deepseek_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_deepseek_v4(tmp_path_factory.mktemp("models") / "deepseek_v4")


@pytest.fixture(scope="session")
def qwen3_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    config = sample_config()
    family = qwen3_family(Path(config.model or ""))
    yield from _start("qwen3", config, family, tmp_path_factory.mktemp("logs"))


@pytest.fixture(scope="session")
def deepseek_v4_stack(deepseek_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    config = _deepseek_config(deepseek_dir)
    yield from _start("deepseek_v4", config, deepseek_v4_family(deepseek_dir), tmp_path_factory.mktemp("logs"))


@pytest.fixture(scope="session")
def llama3_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    model_dir = build_llama3(tmp_path_factory.mktemp("models") / "llama3")
    config = RenderConfig(
        model=str(model_dir),
        served_model_name=("llama3-test",),
        tool_call_parser="llama3_json",
        enable_auto_tool_choice=True,
    )
    yield from _start("llama3", config, llama3_family(model_dir), tmp_path_factory.mktemp("logs"))


@pytest.fixture(scope="session", params=["qwen3", "deepseek_v4", "llama3"])
def stack(request: pytest.FixtureRequest) -> Stack:
    """Each model family in turn."""
    return request.getfixturevalue(f"{request.param}_stack")


@pytest.fixture
def cli(qwen3_stack: Stack, monkeypatch: pytest.MonkeyPatch) -> Iterator[CliRunner]:
    """CliRunner in the repository root; the sample config's engine is the
    session's real one, so a CLI run costs no start-up."""
    monkeypatch.chdir(REPO)
    build = DerenderEngine.build.__func__  # type: ignore[attr-defined]

    def reuse(
        cls: type[DerenderEngine], config: RenderConfig, *, live: bool = False, decode: str = "fast", replay: str = "fast"
    ) -> DerenderEngine:
        absolute = dataclasses.replace(config, model=str(REPO / (config.model or "")))
        if absolute == sample_config():
            return qwen3_stack.engine.in_mode(live=live, decode=decode, replay=replay)
        return build(cls, config, live=live, decode=decode, replay=replay)

    monkeypatch.setattr(DerenderEngine, "build", classmethod(reuse))
    yield CliRunner()


@dataclass
class ServeStack:
    """The bundled Qwen3 sample behind the serve path, and its oracle: the
    same flags given to `vllm serve` over HTTP with a taped engine core."""

    config: RenderConfig
    builder: SampleBuilder
    engine: ServeEngine
    oracle: ServeOracle


@pytest.fixture(scope="session")
def qwen3_serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeStack]:
    config = sample_config()
    tapes = tmp_path_factory.mktemp("tapes")
    oracle = ServeOracle(config, tmp_path_factory.mktemp("logs") / "serve-oracle.log", tapes)
    engine = ServeEngine.build(config)
    try:
        yield ServeStack(config, SampleBuilder(qwen3_family(Path(config.model or ""))), engine, oracle)
    finally:
        engine.close()
        oracle.stop()
