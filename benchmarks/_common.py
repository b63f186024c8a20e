"""Shared set-up for the benchmark scripts: the bundled sample's engine."""

from __future__ import annotations

import dataclasses
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from derender_core import DerenderEngine, RenderConfig  # noqa: E402


def sample_config() -> RenderConfig:
    """The sample's settings, the model path made absolute."""
    config = RenderConfig.from_yaml(REPO / "sample_data" / "qwen3.yaml")
    return dataclasses.replace(config, model=str(REPO / (config.model or "")))


def sample_engine() -> tuple[DerenderEngine, float]:
    """The sample's engine and how long building it took, in seconds."""
    config = sample_config()
    started = time.perf_counter()
    engine = DerenderEngine.build(config)
    return engine, time.perf_counter() - started


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
