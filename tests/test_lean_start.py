"""The lean fresh start (`vllm_seam.stack`): each step changes how fast
the stack starts, never what it answers.

The answers themselves are pinned by the parity tests, which run on the
engines built this way; here each step is checked to have happened, and
the one value computed differently (the leading-space marker) is checked
against vLLM's own computation on real tokenizers.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from derender_core import DerenderEngine
from tests.families import SPECS
from tests.helpers import REPO, offline_env, requires_fast


@requires_fast("startup")
def test_the_renderer_is_built_without_the_tokenizer_pool(sample_engine: DerenderEngine) -> None:
    from vllm.tokenizers.hf import ThreadSafeHFTokenizerMixin

    tokenizer = sample_engine.tokenizer
    assert not isinstance(tokenizer, ThreadSafeHFTokenizerMixin), type(tokenizer).__mro__


def test_the_heap_is_frozen_after_the_build_and_the_collector_back_on(sample_engine: DerenderEngine) -> None:
    assert gc.isenabled()
    # The stack's objects are in the permanent generation, which the
    # collector's own object lists leave out: the tokenizer and its state
    # are not among them.
    tracked = {id(thing) for thing in gc.get_objects()}
    tokenizer = sample_engine.tokenizer
    assert gc.is_tracked(tokenizer) and gc.is_tracked(vars(tokenizer))
    assert id(tokenizer) not in tracked and id(vars(tokenizer)) not in tracked
    assert gc.get_freeze_count() > 100_000


@requires_fast("startup")
def test_the_leading_space_marker_is_cached_at_build(sample_engine: DerenderEngine) -> None:
    from vllm.tokenizers.detokenizer_utils import _CACHED_MARKER_KEY

    assert _CACHED_MARKER_KEY in vars(sample_engine.tokenizer)


# Pre-tokenizers vLLM's marker logic tells apart: none, ByteLevel,
# Metaspace (SentencePiece-style, with its own replacement character), and
# a Metaspace inside a Sequence.
PRE_TOKENIZERS = {
    "none": None,
    "byte_level": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    "metaspace": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": True},
    "sequence": {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "Metaspace", "replacement": "_", "prepend_scheme": "always", "split": False},
        ],
    },
}


@requires_fast("startup")
@pytest.mark.parametrize("pre_tokenizer", PRE_TOKENIZERS)
def test_the_cached_marker_is_the_one_vllm_computes(pre_tokenizer: str, tmp_path: Path) -> None:
    """On a real tokenizer (the sample's) with each kind of pre-tokenizer:
    the marker read from the pre-tokenizer alone is the one vLLM reads from
    the whole serialised tokenizer."""
    model_dir = tmp_path / "model"
    shutil.copytree(REPO / "sample_data" / "qwen3", model_dir)
    tokenizer_json = json.loads((model_dir / "tokenizer.json").read_text())
    tokenizer_json["pre_tokenizer"] = PRE_TOKENIZERS[pre_tokenizer]
    (model_dir / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    # The generic class loads tokenizer.json as it is (Qwen2's own class
    # rebuilds its pre-tokenizer).
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    marker = assert_marker_as_vllms(model_dir, "auto")
    assert marker == {"metaspace": "\u2581", "sequence": "_"}.get(pre_tokenizer)


@requires_fast("startup")
@pytest.mark.parametrize("family", ["mistral"])
def test_the_marker_of_a_tokenizer_without_a_backend(family: str, tmp_path: Path) -> None:
    """mistral_common's tekken tokenizer has no HF backend: nothing to cache."""
    assert_marker_as_vllms(SPECS[family].build(tmp_path / family), "mistral" if family == "mistral" else "auto")


def assert_marker_as_vllms(model_dir: Path, mode: str) -> str | None:
    from vllm.tokenizers import get_tokenizer
    from vllm.tokenizers.detokenizer_utils import _CACHED_MARKER_KEY, get_leading_space_marker

    from derender_core.vllm_seam.stack import _cache_leading_space_marker

    ours = get_tokenizer(str(model_dir), tokenizer_mode=mode)
    theirs = get_tokenizer(str(model_dir), tokenizer_mode=mode)
    assert ours is not theirs
    _cache_leading_space_marker(ours)
    expected = get_leading_space_marker(theirs)
    if getattr(ours, "backend_tokenizer", None) is not None:
        assert vars(ours)[_CACHED_MARKER_KEY] == expected
    else:  # nothing to read: vLLM's answer is None, computed for free
        assert expected is None
    return expected


@requires_fast("startup")
def test_model_info_is_inspected_in_process_and_cached(tmp_path: Path) -> None:
    """With an empty vLLM cache (the first run after install), the build
    starts no subprocess to inspect the model class, and leaves vLLM's
    model-info cache filled for the next run."""
    probe = textwrap.dedent(
        f"""
        import json, subprocess, sys
        sys.path.insert(0, {str(REPO)!r})
        spawned = []
        original = subprocess.run
        def run(args, *rest, **kwargs):
            spawned.append(list(map(str, args)))
            return original(args, *rest, **kwargs)
        subprocess.run = run
        import dataclasses
        from derender_core import DerenderEngine, RenderConfig
        config = RenderConfig.from_yaml("sample_data/qwen3.yaml")
        DerenderEngine.build(config).close()
        print(json.dumps(spawned))
        """
    )
    env = offline_env(VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"))
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, env=env, cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    spawned = json.loads(done.stdout.decode().splitlines()[-1])
    assert not [args for args in spawned if "vllm.model_executor.models.registry" in args], spawned
    cached = list((tmp_path / "vllm-cache" / "modelinfos").glob("*Qwen3ForCausalLM.json"))
    assert cached, os.listdir(tmp_path / "vllm-cache")
    assert json.loads(cached[0].read_text())["modelinfo"]["architecture"] == "Qwen3ForCausalLM"
