"""What the hardening costs per record, without vLLM: the pre-call checks
and the line reader (LF, CRLF, lone CR; SSE sniffing).

    python benchmarks/checks.py [--repeat 2000]

Compare the per-record figures with the engine's own per-record time
(benchmarks/throughput.py: a few ms per chat record).
"""

from __future__ import annotations

import argparse
import io
import time

import orjson
from _common import REPO

from derender_core import Endpoint
from derender_core.checks import check_body
from derender_core.records import iter_records, parse_line

VOCAB = 151669


def per_record_us(bodies: list[dict], endpoint: Endpoint, stream: bool, repeat: int) -> float:
    started = time.perf_counter()
    for _ in range(repeat):
        for body in bodies:
            assert check_body(body, endpoint, stream=stream, vocab_size=VOCAB) is None
    return (time.perf_counter() - started) / (repeat * len(bodies)) * 1e6


def read_mib_per_s(data: bytes, reader) -> tuple[float, int]:
    started = time.perf_counter()
    count = reader(io.BytesIO(data))
    return len(data) / (time.perf_counter() - started) / 2**20, count


def plain_lf_reader(stream: io.BytesIO) -> int:
    """The reader before hardening: file iteration (LF only), parse_line."""
    return sum(1 for line in stream if parse_line(line) is not None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=2000)
    args = parser.parse_args()
    sample = REPO / "sample_data"
    for name, endpoint, stream in (
        ("chat.jsonl", Endpoint.CHAT, False),
        ("completion.jsonl", Endpoint.COMPLETION, False),
        ("stream.jsonl", Endpoint.CHAT, True),
    ):
        bodies = [orjson.loads(line) for line in (sample / name).read_bytes().splitlines()]
        ids = sum(len(orjson.dumps(b)) for b in bodies) // len(bodies)
        repeat = max(1, args.repeat * 4 // len(bodies))
        print(f"check_body  {name:17} {per_record_us(bodies, endpoint, stream, repeat):7.1f} us/record (~{ids:,} bytes/record)")

    lines = (sample / "chat.jsonl").read_bytes().splitlines()
    for ending in (b"\n", b"\r\n", b"\r"):
        data = ending.join(lines * (args.repeat // 4)) + ending
        speed, count = read_mib_per_s(data, lambda s: sum(1 for _ in iter_records(s)))
        label = {b"\n": "LF", b"\r\n": "CRLF", b"\r": "CR"}[ending]
        print(f"iter_records {label:4} {speed:7.1f} MiB/s ({count} records)")
    data = b"\n".join(lines * (args.repeat // 4)) + b"\n"
    speed, count = read_mib_per_s(data, plain_lf_reader)
    print(f"before (file iteration, LF only) {speed:7.1f} MiB/s ({count} records)")


if __name__ == "__main__":
    main()
