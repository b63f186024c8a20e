"""Settings: vLLM's flag names, `vllm serve --config` YAML, precedence."""

from __future__ import annotations

from pathlib import Path

import pytest

from derender_core import ConfigError, RenderConfig
from tests.helpers import SAMPLE


def write_yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "render.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_sample_yaml_reads_as_vllm_flags() -> None:
    config = RenderConfig.from_yaml(SAMPLE / "qwen3.yaml")
    assert config.to_vllm_argv() == [
        "--model", "sample_data/qwen3",
        "--served-model-name", "qwen3-sample",
        "--tool-call-parser", "hermes",
        "--reasoning-parser", "qwen3",
        "--enable-auto-tool-choice",
    ]  # fmt: skip


def test_dashes_or_underscores_and_every_value_type(tmp_path: Path) -> None:
    config = RenderConfig.from_yaml(
        write_yaml(
            tmp_path,
            "model: m\nserved_model_name: [a, b]\nmax-model-len: 32k\n"
            "trust-remote-code: true\ndefault-chat-template-kwargs: {enable_thinking: false}\n",
        )
    )
    assert config.served_model_name == ("a", "b")
    assert config.to_vllm_argv() == [
        "--model", "m",
        "--served-model-name", "a", "b",
        "--trust-remote-code",
        "--max-model-len", "32k",
        "--default-chat-template-kwargs", '{"enable_thinking": false}',
    ]  # fmt: skip


def test_command_line_overrides_the_file_including_false(tmp_path: Path) -> None:
    config = RenderConfig.from_yaml(
        write_yaml(tmp_path, "model: m\nenable-auto-tool-choice: true\ntool-call-parser: hermes\n")
    )
    overridden = config.overridden_by(
        {"enable_auto_tool_choice": False, "tool_call_parser": None, "served_model_name": ["x"]}
    )
    assert overridden.enable_auto_tool_choice is False
    assert overridden.tool_call_parser == "hermes"
    assert overridden.served_model_name == ("x",)
    assert "--enable-auto-tool-choice" not in overridden.to_vllm_argv()


def test_json_flag_values_are_parsed() -> None:
    config = RenderConfig().overridden_by({"default_chat_template_kwargs": '{"thinking": true}'})
    assert config.default_chat_template_kwargs == {"thinking": True}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("port: 8000\n", "unknown setting 'port'. Supported: model, tokenizer"),
        ("enable-auto-tool-choice: yes please\n", "must be true or false"),
        ("served-model-name: [1, 2]\n", "a name or a list of names"),
        ("default-chat-template-kwargs: '{bad json'\n", "not valid JSON"),
        ("default-chat-template-kwargs: [1]\n", "must be a JSON object"),
        ("max-model-len: [4096]\n", "must be a number"),
        ("tool-call-parser: 3\n", "must be a string"),
        ("- just\n- a list\n", "expected a mapping"),
        ("model: [unclosed\n", "cannot read config file"),
    ],
)
def test_bad_yaml_is_a_config_error(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        RenderConfig.from_yaml(write_yaml(tmp_path, text))


def test_config_file_must_exist_and_be_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        RenderConfig.from_yaml(tmp_path / "absent.yaml")
    with pytest.raises(ConfigError, match=r"\.yaml or \.yml"):
        RenderConfig.from_yaml(tmp_path / "render.json")


def test_model_must_be_a_local_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no model given"):
        RenderConfig().check_paths()
    with pytest.raises(ConfigError, match=r"--model Qwen/Qwen3-8B: no such directory: .*, and the Hub id Qwen/Qwen3-8B is not in the local Hugging Face cache"):
        RenderConfig(model="Qwen/Qwen3-8B").check_paths()
    with pytest.raises(ConfigError, match="--tokenizer"):
        RenderConfig(model=str(tmp_path), tokenizer=str(tmp_path / "tok")).check_paths()
    RenderConfig(model=str(tmp_path)).check_paths()


def test_a_relative_model_path_from_elsewhere_says_where_it_was_looked_for(tmp_path: Path) -> None:
    """Run from another directory, the sample's `model: sample_data/qwen3`
    is looked for there, as `vllm serve --config` looks: the error says so,
    names the directory the path names from the config file's side, and
    suggests no download of a "Hub id" that is a path."""
    from tests.helpers import REPO, run_cli

    done = run_cli(
        "chat", str(REPO / "sample_data" / "chat.jsonl"), "--config", str(REPO / "sample_data" / "qwen3.yaml"),
        cwd=tmp_path, env={"DERENDER_NO_SERVER": "1"},
    )  # fmt: skip
    message = done.stderr.decode()
    assert done.returncode == 2, message
    assert message == (
        f"derender: error: --model sample_data/qwen3: no such directory: {tmp_path / 'sample_data' / 'qwen3'} "
        "(relative paths, a --config file's too, are resolved against the current directory, as `vllm serve` "
        f"resolves them). It names {REPO / 'sample_data' / 'qwen3'} from {REPO}: run there, or give the path "
        f"as {REPO / 'sample_data' / 'qwen3'}.\n"
    )
    assert "huggingface-cli" not in message
