"""One-shot throughput over the bundled sample, repeated.

    python benchmarks/throughput.py [--repeat 250] [--lenient]

Runs the library pipeline (records, engine, JSONL writer) in process, so the
figures exclude start-up (see startup.py).
"""

from __future__ import annotations

import argparse
import io

from _common import REPO, peak_rss_mib, sample_engine

from derender_core import Endpoint
from derender_core.batch import Job, run
from derender_core.records import iter_records
from derender_core.writers import JsonlWriter


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=250)
    parser.add_argument("--lenient", action="store_true", help="skip the pre-call checks")
    args = parser.parse_args()
    engine, _ = sample_engine()
    for endpoint, name in ((Endpoint.CHAT, "chat.jsonl"), (Endpoint.COMPLETION, "completion.jsonl")):
        data = (REPO / "sample_data" / name).read_bytes() * args.repeat
        job = Job(endpoint, lenient=args.lenient)
        run(engine, iter_records(io.BytesIO(data)), job, JsonlWriter(io.BytesIO()))  # warm-up
        out = io.BytesIO()
        report = run(engine, iter_records(io.BytesIO(data)), job, JsonlWriter(out))
        assert report.errors == 0
        print(
            f"{endpoint.value:10} {report.records:6d} records in {report.elapsed:6.2f} s = "
            f"{report.records_per_second:7.1f} records/s, {len(out.getvalue()) / report.elapsed / 2**20:5.1f} MiB/s out"
        )
    print(f"peak RSS {peak_rss_mib():.0f} MiB")
    engine.close()


if __name__ == "__main__":
    main()
