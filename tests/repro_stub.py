"""A stand-in for `vllm launch render` in the `--repro` scripts' safety
tests, where what matters is what the script runs and sends, not what a
server answers: it serves ``/health`` and answers every derender call with
a fixed answer (a one-shot response, or a stream chunk with a state),
after appending the body it was sent, as one JSON line, to a log.

Run as ``vllm``: ``python -m tests.repro_stub launch render FLAGS...
--port N``; it writes its argv and environment to ``$STUB_RECORD`` and its
bodies to ``$STUB_BODIES``. Tests that need the real server's answers run
the real one.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ONE_SHOT_ANSWER = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "one"}, "finish_reason": "stop"}]}
STREAM_ANSWER = {"chunk": {"choices": [{"index": 0, "delta": {"content": "two"}}]}, "stream_state": {"stub": True}}


def handler(bodies: Path) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            self._send(200, b"")

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            with bodies.open("ab") as log:
                log.write(body.replace(b"\n", b" ") + b"\n")
            sent = json.loads(body)
            answer = STREAM_ANSWER if "generate_chunk" in sent else ONE_SHOT_ANSWER
            self._send(200, json.dumps(answer).encode())

        def _send(self, status: int, data: bytes) -> None:
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


def start(bodies: Path, port: int = 0) -> ThreadingHTTPServer:
    """A stub server on 127.0.0.1 in a thread of this process."""
    server = ThreadingHTTPServer(("127.0.0.1", port), handler(bodies))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def main(argv: list[str]) -> None:
    Path(os.environ["STUB_RECORD"]).write_text(json.dumps({"argv": argv, "env": dict(os.environ)}))
    port = int(argv[argv.index("--port") + 1])
    server = ThreadingHTTPServer(("127.0.0.1", port), handler(Path(os.environ["STUB_BODIES"])))
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
