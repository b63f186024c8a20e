"""The bundled sample is what its builders make, and its tokenizer is the
real Qwen3 one: same ids as quicktok-v1's own encoder, Qwen3's flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import quicktok
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from tests.helpers import SAMPLE
from tests.model_factory import QWEN3_NON_SPECIAL, build_qwen3, read_quicktok_specials
from tests.sample_inputs import write_sample

QWEN3_DIR = SAMPLE / "qwen3"


@pytest.fixture(scope="module")
def sample_tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(QWEN3_DIR / "tokenizer.json"))


@pytest.fixture(scope="module")
def reference() -> object:
    return quicktok.get_encoding("qwen3")


SPECIAL_TEXTS = [content for _, content in read_quicktok_specials("qwen3")]


@given(st.text(max_size=200).filter(lambda text: not any(s in text for s in SPECIAL_TEXTS)))
@settings(max_examples=300, deadline=None)
def test_ids_match_quicktoks_encoder(sample_tokenizer: Tokenizer, reference: object, text: str) -> None:
    ids = sample_tokenizer.encode(text, add_special_tokens=False).ids
    assert ids == reference.encode_ordinary(text)  # type: ignore[attr-defined]
    assert sample_tokenizer.decode(ids, skip_special_tokens=False) == reference.decode(ids)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "text",
    ["Hello, world!", "café résumé naïve — Zürich", "cafe\u0301 (NFC)", "emoji 🚀🔥👍", "北京多云。𝟏𝟐°C",
     "def f(x):\n    return [i**2 for i in range(100)]", "   \r\n\t  1234567890"],
)  # fmt: skip
def test_stress_texts_match_quicktok(sample_tokenizer: Tokenizer, reference: object, text: str) -> None:
    assert sample_tokenizer.encode(text, add_special_tokens=False).ids == reference.encode_ordinary(text)  # type: ignore[attr-defined]


def test_special_tokens_have_qwen3_ids_and_flags(sample_tokenizer: Tokenizer) -> None:
    added = json.loads((QWEN3_DIR / "tokenizer.json").read_text(encoding="utf-8"))["added_tokens"]
    assert [(t["id"], t["content"]) for t in added] == sorted(read_quicktok_specials("qwen3"))
    flags = {t["content"]: t["special"] for t in added}
    assert {c for c, special in flags.items() if not special} == QWEN3_NON_SPECIAL
    assert flags["<|im_end|>"] and flags["<|endoftext|>"]
    # The flags change decoding: non-special markers survive skip_special_tokens.
    ids = sample_tokenizer.encode("<think>x</think><|im_end|>", add_special_tokens=False).ids
    assert sample_tokenizer.decode(ids, skip_special_tokens=True) == "<think>x</think>"


def test_committed_model_is_a_fresh_build(tmp_path: Path) -> None:
    fresh = build_qwen3(tmp_path / "qwen3")
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"):
        assert (fresh / name).read_bytes() == (QWEN3_DIR / name).read_bytes(), name


def test_committed_inputs_are_a_fresh_build(tmp_path: Path) -> None:
    (tmp_path / "qwen3").symlink_to(QWEN3_DIR)
    write_sample(tmp_path)
    for path in sorted(SAMPLE.glob("*.jsonl")) + [SAMPLE / "generate_capture.sse"]:
        assert (tmp_path / path.name).read_bytes() == path.read_bytes(), path.name
