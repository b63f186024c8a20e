"""Start-up per model family: building vLLM's derender stack for each family
of the coverage matrix, each in a fresh process with empty tokenizer caches
and downloads failing, as the family tests run it.

    python benchmarks/families.py [--families glm45 gpt_oss ...] [--models DIR]

Model directories are built first from the package tokenizers
(`tests.families`, not timed) into DIR, kept there for the next run.
Per family: the import of vLLM (the same for all), the stack's build, and
the process's peak memory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO, peak_rss_mib


def child(key: str, model_dir: Path) -> None:
    """Runs in the fresh process: time the import, then the build."""
    started = time.perf_counter()
    from derender_core import DerenderEngine
    from derender_core.vllm_seam.stack import prepare_environment
    from tests.families import CASES, render_config

    prepare_environment()
    import vllm.config  # noqa: F401  (most of the import: torch, transformers)

    imported = time.perf_counter()
    engine = DerenderEngine.build(render_config(CASES[key], model_dir))
    built = time.perf_counter()
    engine.close()
    print(json.dumps({"import_s": imported - started, "build_s": built - imported, "peak_mib": peak_rss_mib()}))


def main() -> None:
    from derender_core.coverage import families_here

    parser = argparse.ArgumentParser()
    # Only the families whose parsers this vLLM registers can start.
    parser.add_argument("--families", nargs="*", default=[case.key for case in families_here()])
    parser.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()) / "derender-family-models")
    parser.add_argument("--child", nargs=2, metavar=("KEY", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], Path(args.child[1]))
        return

    from tests.families import SPECS
    from tests.helpers import empty_cache_env, no_network

    rows = []
    for key in args.families:
        model_dir = args.models / key
        if not (model_dir / "config.json").exists():
            SPECS[key].build(model_dir)
        with tempfile.TemporaryDirectory() as cache:
            env = {**empty_cache_env(Path(cache) / "cache"), **no_network()}
            done = subprocess.run(
                [sys.executable, __file__, "--child", key, str(model_dir)],
                env=env, cwd=REPO, capture_output=True, text=True,
            )  # fmt: skip
        if done.returncode != 0:
            print(f"{key:14} failed: {done.stderr.strip().splitlines()[-1:]}", flush=True)
            continue
        row = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(
            f"{key:14} import {row['import_s']:5.1f} s  build {row['build_s']:5.1f} s  peak {row['peak_mib']:6.0f} MiB",
            flush=True,
        )
    if rows:
        builds = [row["build_s"] for row in rows]
        print(
            f"{len(rows)} families: build median {statistics.median(builds):.1f} s, "
            f"max {max(builds):.1f} s; import median {statistics.median(r['import_s'] for r in rows):.1f} s"
        )


if __name__ == "__main__":
    main()
