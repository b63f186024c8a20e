"""Hub model ids, resolved from the local Hugging Face cache as `vllm serve`
resolves them offline: one YAML names the model for both.

The cache is laid out at test time as ``huggingface_hub`` lays out a
download (blobs, a snapshot per commit, refs), from the bundled sample.
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
import yaml

from derender_core import Endpoint, RenderConfig
from derender_core.batch import Job
from derender_core.errors import ConfigError
from tests.conftest import Stack
from tests.helpers import REPO, SAMPLE, hub_cache, jsonl_answers, normalize, run_cli

REPO_ID = "acme/qwen3-fixture"


def _cache_env(root: Path) -> dict[str, str]:
    return {"HF_HOME": str(root), "HF_HUB_CACHE": str(root / "hub")}


def test_a_yaml_naming_a_cached_hub_id_answers_as_the_directory(tmp_path: Path, qwen3_stack: Stack) -> None:
    hub_cache(tmp_path / "hf" / "hub", REPO_ID, SAMPLE / "qwen3")
    settings = yaml.safe_load((SAMPLE / "qwen3.yaml").read_text())
    settings["model"] = REPO_ID
    config = tmp_path / "deployment.yaml"
    config.write_text(yaml.safe_dump(settings))

    done = run_cli("chat", "sample_data/chat.jsonl", "--config", str(config), env=_cache_env(tmp_path / "hf"))

    assert done.returncode == 0, done.stderr.decode()
    lines = (REPO / "sample_data" / "chat.jsonl").read_bytes().splitlines()
    expected, _ = jsonl_answers(qwen3_stack.engine, Job(Endpoint.CHAT), lines)
    assert [normalize(orjson.loads(line)) for line in done.stdout.splitlines()] == normalize(expected)


def test_an_id_not_in_the_cache_is_a_usage_error_naming_how_to_fetch_it(tmp_path: Path) -> None:
    (tmp_path / "hf" / "hub").mkdir(parents=True)
    done = run_cli("chat", "sample_data/chat.jsonl", "--model", "acme/absent", env=_cache_env(tmp_path / "hf"))

    assert done.returncode == 2
    message = done.stderr.decode()
    assert "acme/absent" in message and str(tmp_path / "hf" / "hub") in message
    assert "huggingface-cli download acme/absent" in message
    assert "Traceback" not in message


def test_revisions_resolve_to_their_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    hub = tmp_path / "hub"
    commit = hub_cache(hub, REPO_ID, SAMPLE / "qwen3", revision="v1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))

    snapshot = hub / "models--acme--qwen3-fixture" / "snapshots" / commit
    assert RenderConfig(model=REPO_ID, revision="v1").local_dirs() == {"model": snapshot}
    assert RenderConfig(model=REPO_ID, revision=commit).local_dirs() == {"model": snapshot}
    assert RenderConfig(model="sample_data/qwen3", tokenizer=REPO_ID, tokenizer_revision="v1").local_dirs()["tokenizer"] == snapshot
    # No ref "main" was downloaded.
    with pytest.raises(ConfigError, match=r"acme/qwen3-fixture is not in the local Hugging Face cache .*huggingface-cli download acme/qwen3-fixture`"):
        RenderConfig(model=REPO_ID).check_paths()
    with pytest.raises(ConfigError, match=r"at revision v2 .*--revision v2"):
        RenderConfig(model=REPO_ID, revision="v2").check_paths()
    # A path that is no id stays a missing directory.
    with pytest.raises(ConfigError, match=r"no/such/dir: no such directory: .*no/such/dir \(relative paths.*\)\. The model must be"):
        RenderConfig(model="no/such/dir").check_paths()
