"""Settings that mirror `vllm launch render`'s flags, and their YAML file.

Names, meanings and precedence follow `vllm serve`: a ``--config`` YAML file
holds flag names as keys (``tool-call-parser: hermes``), flags given on the
command line override it, and vLLM's defaults fill the rest. Relative paths
are resolved against the current directory, as ``vllm serve --config`` does,
so one YAML file drives both this tool and a real render server.

Nothing here imports vLLM: values whose valid choices only vLLM knows
(parser names, tokenizer modes) are checked when the engine is built.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError


@dataclass(frozen=True)
class RenderConfig:
    """The render server settings that shape its answers: derendered
    responses and rendered prompts."""

    model: str | None = None
    tokenizer: str | None = None
    revision: str | None = None
    tokenizer_revision: str | None = None
    served_model_name: tuple[str, ...] = ()
    tokenizer_mode: str | None = None
    trust_remote_code: bool = False
    max_model_len: str | None = None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    enable_auto_tool_choice: bool = False
    exclude_tools_when_tool_choice_none: bool = False
    chat_template: str | None = None
    chat_template_content_format: str | None = None
    default_chat_template_kwargs: Mapping[str, Any] | None = field(default=None)
    trust_request_chat_template: bool = False
    reasoning_effort_map: Mapping[str, str] | None = field(default=None)
    generation_config: str | None = None
    override_generation_config: Mapping[str, Any] | None = field(default=None)

    @classmethod
    def flag_names(cls) -> list[str]:
        """The vLLM flag spelling of every setting, e.g. ``tool-call-parser``."""
        return [f.name.replace("_", "-") for f in dataclasses.fields(cls)]

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], origin: str) -> RenderConfig:
        """Build from flag-named keys (dashes or underscores), checking types.

        `origin` names where the values came from, for error messages.
        """
        return cls(**_checked_settings(values, origin))

    @classmethod
    def from_yaml(cls, path: str | Path) -> RenderConfig:
        """Read a ``vllm serve --config`` style YAML file."""
        import yaml

        path = Path(path)
        if path.suffix not in (".yaml", ".yml"):
            raise ConfigError(f"config file must be .yaml or .yml: {path}")
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"config file {path} is not UTF-8 text: {exc.reason} at byte {exc.start}") from None
        except RecursionError:
            raise ConfigError(f"config file {path} is nested too deeply to read") from None
        except (OSError, ValueError, yaml.YAMLError) as exc:
            # ValueError: an integer longer than Python reads (4,300 digits).
            raise ConfigError(f"cannot read config file {path}: {exc}") from None
        if loaded is None:
            return cls()
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: expected a mapping of flag names to values")
        config = cls.from_mapping(loaded, origin=str(path))
        _CONFIG_DIRS[:] = [path.resolve().parent, *_CONFIG_DIRS[: _CONFIG_DIRS_KEPT - 1]]
        return config

    def overridden_by(self, overrides: Mapping[str, Any]) -> RenderConfig:
        """Apply command-line values; None means the flag was not given."""
        given = {k: v for k, v in overrides.items() if v is not None and v != ()}
        return dataclasses.replace(self, **_checked_settings(given, "command line"))

    def given(self) -> dict[str, Any]:
        """The settings that differ from the defaults."""
        defaults = RenderConfig()
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(defaults, f.name)
        }

    def check_paths(self) -> None:
        """Fail early on a model or tokenizer that is neither a local
        directory nor a Hub id in the local Hugging Face cache: the Hub is
        never contacted."""
        if not self.model:
            raise ConfigError("no model given: pass --model DIR or set `model` in --config")
        self.local_dirs()

    def local_dirs(self) -> dict[str, Path]:
        """The local directory of each given role (``model``, ``tokenizer``):
        the directory itself, or a Hub id's snapshot in the local cache, as
        `vllm serve` resolves it offline (the revision's snapshot)."""
        dirs = {}
        for role, value, revision in (
            ("model", self.model, self.revision),
            ("tokenizer", self.tokenizer, self.tokenizer_revision or self.revision),
        ):
            if value is not None:
                dirs[role] = _local_dir(f"--{role}", value, revision)
        return dirs

    def to_vllm_argv(self, *, repeated: bool = False) -> list[str]:
        """The same settings as `vllm launch render` command-line arguments;
        with `repeated`, a list as its flag once per value, as derender's
        own command line takes it."""
        argv: list[str] = []
        for name, value in self.given().items():
            flag = "--" + name.replace("_", "-")
            if isinstance(value, bool):
                argv.append(flag)
            elif isinstance(value, tuple):
                argv += [part for item in value for part in (flag, item)] if repeated else [flag, *value]
            elif isinstance(value, Mapping):
                argv += [flag, json.dumps(dict(value))]
            else:
                argv += [flag, str(value)]
        return argv


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
"""``owner/name``, as Hub repository ids are spelled."""


_CONFIG_DIRS: list[Path] = []
"""The directories of the last config files read, newest first: where a
relative model path that is not found may have been meant to start
(`_where_meant`)."""
_CONFIG_DIRS_KEPT = 4


def _where_meant(value: str) -> Path | None:
    """The directory a relative `value` names from a config file's folder
    or one above it, the way a path written beside a YAML file reads."""
    if Path(value).is_absolute():
        return None
    for directory in _CONFIG_DIRS:
        for base in (directory, *directory.parents):
            if (base / value).is_dir():
                return base / value
    return None


def _not_here(flag: str, value: str) -> str:
    """What happened to a path that is not a directory: where it was
    looked for, and why there."""
    if Path(value).is_absolute():
        return f"{flag} {value}: no such directory"
    return (
        f"{flag} {value}: no such directory: {Path.cwd() / value} (relative paths, a --config "
        "file's too, are resolved against the current directory, as `vllm serve` resolves them)"
    )


def _local_dir(flag: str, value: str, revision: str | None) -> Path:
    if Path(value).is_dir():
        return Path(value)
    meant = _where_meant(value)
    if meant is not None:
        base = meant.parents[len(Path(value).parts) - 1]
        raise ConfigError(
            f"{_not_here(flag, value)}. It names {meant} from {base}: run there, or give the path as {meant}."
        )
    if not _HUB_ID.fullmatch(value) or ".." in value:
        raise ConfigError(
            f"{_not_here(flag, value)}. The model must be a local directory holding the tokenizer, "
            "config.json and generation_config.json, or a Hub id (owner/name) in the local Hugging "
            "Face cache."
        )
    # derender is offline: huggingface_hub reads this once, at import.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id=value, revision=revision, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError):
        at = f" at revision {revision}" if revision else ""
        fetch = f"huggingface-cli download {value}" + (f" --revision {revision}" if revision else "")
        raise ConfigError(
            f"{_not_here(flag, value)}, and the Hub id {value}{at} is not in the local "
            f"Hugging Face cache ({constants.HF_HUB_CACHE}); derender never downloads. If it is "
            f"a Hub id, fetch it first with `{fetch}` (or set HF_HOME / HF_HUB_CACHE to the cache that has it)."
        ) from None


def _checked_settings(values: Mapping[str, Any], origin: str) -> dict[str, Any]:
    known = {f.name for f in dataclasses.fields(RenderConfig)}
    settings: dict[str, Any] = {}
    for key, value in values.items():
        name = str(key).replace("-", "_")
        if name not in known:
            raise ConfigError(
                f"{origin}: unknown setting {key!r}. "
                f"Supported: {', '.join(RenderConfig.flag_names())}."
            )
        if value is not None:
            settings[name] = _coerce(name, value, origin)
    return settings


_BOOLEAN = {
    "trust_remote_code",
    "enable_auto_tool_choice",
    "exclude_tools_when_tool_choice_none",
    "trust_request_chat_template",
}
_JSON_OBJECTS = {"default_chat_template_kwargs", "reasoning_effort_map", "override_generation_config"}


def _coerce(name: str, value: Any, origin: str) -> Any:
    flag = name.replace("_", "-")
    if name in _BOOLEAN:
        if not isinstance(value, bool):
            raise ConfigError(f"{origin}: {flag} must be true or false, got {value!r}")
        return value
    if name == "served_model_name":
        names = [value] if isinstance(value, str) else value
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
            raise ConfigError(f"{origin}: {flag} must be a name or a list of names")
        return tuple(names)
    if name in _JSON_OBJECTS:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{origin}: {flag} is not valid JSON: {exc}") from None
        if not isinstance(value, Mapping):
            raise ConfigError(f"{origin}: {flag} must be a JSON object, got {value!r}")
        return dict(value)
    if name == "max_model_len":
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ConfigError(f"{origin}: {flag} must be a number such as 4096 or 32k")
        return str(value)
    if not isinstance(value, str):
        raise ConfigError(f"{origin}: {flag} must be a string, got {value!r}")
    return value
