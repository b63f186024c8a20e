"""Following vLLM: the fast paths run only on the releases they were proven
on; anywhere else (or with ``DERENDER_FAST_PATHS=off``) derender runs vLLM's
own code, says so once, and answers the same bytes.

The oracle for "the same bytes" is the installed vLLM: these tests compare
the run with the fast paths off against the installed vLLM's own
`OnlineDerenderer` class (no subclass of derender's in the stack), and the
whole-run bytes against the fast run where the fast paths are proven, and
against a real `vllm launch render` in tests/test_parity_oneshot.py and
tests/test_parity_stream.py (which CI also runs with the fast paths off).
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from importlib import metadata

import pytest

from derender_core.vllm_seam import versions
from tests.helpers import REPO, SAMPLE, normalized_bytes, run_cli

OFF = {versions.OFF_ENV: "off", "DERENDER_NO_SERVER": "1"}
FRESH = {versions.OFF_ENV: "", "DERENDER_NO_SERVER": "1"}
"""The default: the fast paths wherever they are proven (CI also runs this
file with ``DERENDER_FAST_PATHS=off`` set around it)."""


def proven_here(path: str) -> bool:
    """Whether `path` is proven on the installed vLLM, the switch aside."""
    return versions.installed() in versions.PROVEN[path]


def test_the_installed_version_is_read_from_metadata() -> None:
    assert versions.installed() == metadata.version("vllm")
    # The pin in pyproject.toml is the one versions.SUPPORTED states.
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pin = next(r for r in project["dependencies"] if r.startswith("vllm"))
    low, high = versions.SUPPORTED
    assert pin.startswith(f"vllm{low}") and pin.endswith(high)
    assert versions.installed() in {v for releases in versions.PROVEN.values() for v in releases} | {"0.34.0"}


def test_off_switch_and_unknown_releases(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(versions.OFF_ENV, raising=False)
    for path, releases in versions.PROVEN.items():
        assert versions.proven(path) == (versions.installed() in releases)
    monkeypatch.setenv(versions.OFF_ENV, "off")
    assert not any(versions.proven(path) for path in versions.PROVEN)
    message = versions.notice()
    assert message is not None and f"{versions.OFF_ENV}=off" in message
    # One path off, to tell which one a difference comes from.
    monkeypatch.setenv(versions.OFF_ENV, "off:serve_bulk, bogus")
    assert versions.switched_off() == {"serve_bulk"}
    assert [path for path in versions.PROVEN if not versions.proven(path)] == (
        ["serve_bulk"] if versions.installed() in versions.PROVEN["serve_bulk"] else list(versions.PROVEN)
    )
    message = versions.notice()
    assert message is not None and "fast paths off (serve_bulk" in message and "=off:serve_bulk" in message
    monkeypatch.delenv(versions.OFF_ENV)
    # A release never seen: every path off, and the notice names it.
    monkeypatch.setattr(versions, "installed", lambda: "9.99.0")
    assert not any(versions.proven(path) for path in versions.PROVEN)
    message = versions.notice()
    assert message is not None and "this is 9.99.0" in message and "exact but slower" in message
    assert "fast path decode     off" in versions.describe()
    # Proving a release: the named paths on where unproven, the rest off.
    monkeypatch.setenv(versions.OFF_ENV, "prove:decode, live,bogus")
    assert versions.proving() == {"decode", "live"}
    assert [path for path in versions.PROVEN if versions.proven(path)] == ["decode", "live"]
    described = versions.describe()
    assert "fast path decode     on, being proven (proven on vLLM " in described
    # Every state column as wide as the longest, so the brackets line up.
    assert len({line.index("(proven on") for line in described.splitlines()[1:]}) == 1
    message = versions.notice()
    assert message is not None and "requests" in message and "decode" not in message.split(":")[0]
    monkeypatch.setenv(versions.OFF_ENV, "prove:" + ",".join(versions.PROVEN))
    message = versions.notice()
    assert message is not None and "on unproven, on vLLM 9.99.0" in message


def test_version_flag_names_vllm_and_each_path() -> None:
    done = run_cli("--version", env=FRESH)
    assert done.returncode == 0, done.stderr.decode()
    text = done.stdout.decode()
    assert f"vLLM {metadata.version('vllm')} " in text
    for path in versions.PROVEN:
        state = "on" if proven_here(path) else "off"
        assert f"fast path {path:<10} {state}" in text
    off = run_cli("--version", env=OFF)
    assert all(f"fast path {path:<10} off" in off.stdout.decode() for path in versions.PROVEN)


def test_fast_paths_off_build_vllms_own_derenderer() -> None:
    """With the fast paths off the stack holds vLLM's ``OnlineDerenderer``
    itself, and derender's fast decode is never imported."""
    probe = (
        "import sys\n"
        "from derender_core import RenderConfig\n"
        "from derender_core.vllm_seam.render import DerenderEngine\n"
        "from vllm.renderers.online_derenderer import OnlineDerenderer\n"
        "engine = DerenderEngine.build(RenderConfig.from_yaml('sample_data/qwen3.yaml'), live=True, decode='fast')\n"
        "print(type(engine._serving.online_derenderer) is OnlineDerenderer, engine.live, engine.decode,\n"
        "      engine.in_mode(live=True, decode='fast').decode, 'derender_core.vllm_seam.fast' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, cwd=REPO, timeout=600,
        env={**__import__("os").environ, **OFF},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert done.stdout.decode().split() == ["True", "False", "reference", "reference", "False"]


@pytest.mark.parametrize("command", ["chat", "completion", "stream"])
def test_a_run_with_the_fast_paths_off_says_so_once_and_answers_the_same(command: str) -> None:
    off = run_cli(command, str(SAMPLE / f"{command}.jsonl"), "--config", "sample_data/qwen3.yaml", env=OFF)
    assert off.returncode == 0, off.stderr.decode()
    assert off.stderr.decode().count("fast paths off") == 1
    assert f"{versions.OFF_ENV}=off" in off.stderr.decode()
    fresh = run_cli(command, str(SAMPLE / f"{command}.jsonl"), "--config", "sample_data/qwen3.yaml", env=FRESH)
    assert fresh.returncode == 0, fresh.stderr.decode()
    assert fresh.stderr.decode().count("fast paths off") == (0 if all(map(proven_here, versions.PROVEN)) else 1)
    assert normalized_bytes(off.stdout) == normalized_bytes(fresh.stdout)
    assert off.stdout.count(b"\n") == sum(1 for _ in (SAMPLE / f"{command}.jsonl").open())


def test_flavor_serve_refuses_where_it_is_not_proven() -> None:
    done = run_cli("chat", str(SAMPLE / "chat.jsonl"), "--config", "sample_data/qwen3.yaml", "--flavor", "serve", env=OFF)
    assert done.returncode == 2 and done.stdout == b""
    assert b"--flavor serve drives vllm serve's private handlers" in done.stderr
    assert b"Traceback" not in done.stderr
