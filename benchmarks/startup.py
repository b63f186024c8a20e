"""Start-up costs: `derender --help`, and building vLLM's derender stack.

    python benchmarks/startup.py [--runs 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import peak_rss_mib, sample_engine

DERENDER = Path(sys.executable).with_name("derender")


def time_command(argv: list[str], runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True)
        times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()

    help_times = time_command([str(DERENDER), "--help"], args.runs)
    chat_help_times = time_command([str(DERENDER), "chat", "--help"], args.runs)
    print(f"derender --help       median {statistics.median(help_times):.3f} s  max {max(help_times):.3f} s")
    print(f"derender chat --help  median {statistics.median(chat_help_times):.3f} s  max {max(chat_help_times):.3f} s")

    started = time.perf_counter()
    engine, build_seconds = sample_engine()
    print(f"import vLLM + build derender stack: {time.perf_counter() - started:.1f} s "
          f"(DerenderEngine.build {build_seconds:.1f} s), peak RSS {peak_rss_mib():.0f} MiB")
    engine.close()


if __name__ == "__main__":
    main()
