"""`derender parity --repro DIR`: per minimal divergence, a report ready to
paste into a vLLM issue, and a script that reproduces it on vLLM's own
render server.

For each `Minimal` (`minimize`), ``DIR/<name>.md`` holds the versions, the `vllm launch render` flags (`RenderConfig.to_vllm_argv`),
the minimal record, what each path answered with the divergent part
marked, and how to reproduce it; ``DIR/<name>.jsonl`` holds the record
itself. Where both paths are vLLM endpoints of the render server (the
one-shot derender endpoint on one side, the streaming one on the other),
``DIR/<name>.sh`` starts ``vllm launch render`` with the same flags, sends
the one-shot body and the stream's calls with ``curl`` (threading each
answer's ``stream_state`` into the next call of its choice, with
``python3``), prints the field from both and exits 1 while they differ.
The serve side has no such script: derender's serve path is vLLM's own
``OpenAIServingChat`` over an ``AsyncLLM`` whose engine core replays the
record's token ids, which a real ``vllm serve`` gives only for a model
that samples the same ids; the report says how to get them.

``<name>`` is the minimal record's id as `naming.Names` gives it: a
readable prefix and a digest of the exact id, so no two records share a
file and none is a file the run reads. A record's text reaches a file only
escaped (see the Markdown report's section) or as JSON.

Pure: no vLLM.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import stat
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from .compare import Divergence, Observed
from .config import RenderConfig
from .errors import InputError, StreamFailure
from .minimize import Minimal
from .naming import Names
from .parity import RECORD
from .protocol import Endpoint
from .resume import installed_versions
from .streams import ChunkFacts

ONE_SHOT_PATHS = ("oneshot", "reference")
STREAM_PATHS = ("replay", "live")
SERVE_PATHS = ("serve", "serve-oneshot")
PATH_WORDS = {
    "oneshot": "the one-shot derender endpoint on derender's fast decode",
    "reference": "the one-shot derender endpoint on vLLM's own per-token decode",
    "replay": "the streaming derender endpoint, vLLM's own per-call replay, assembled",
    "live": "derender's live streaming derender (parser state kept between calls), assembled",
    "serve": "`vllm serve`'s streaming chat/completions handler, assembled",
    "serve-oneshot": "`vllm serve`'s non-stream handler",
    "record": "the record itself",
    "render": "the render endpoint's prompt for the record's request",
}


def prepare_repro(directory: str) -> None:
    """Make the report directory, before anything runs.

    Raises:
        InputError: when it cannot be made.

    """
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"--repro {directory}: {exc.strerror or exc}") from None


def scriptable(divergence: Divergence) -> bool:
    """Both sides are vLLM render server endpoints that answer differently:
    one-shot on one side, streaming on the other."""
    sides = {divergence.left, divergence.right}
    return bool(sides & set(ONE_SHOT_PATHS)) and bool(sides & set(STREAM_PATHS))


REPORT_SUFFIXES = (".md", ".sh", ".jsonl")


def write_repro(
    directory: str,
    minimized: Iterable[Minimal],
    config: RenderConfig,
    endpoint: Endpoint,
    flags: list[str],
    claimed: Callable[[str], object] | None = None,
) -> list[Path]:
    """Each minimal divergence's report (and record, and script where one
    applies) in `directory`; the reports' paths.

    Each minimal record's files share one stem (`naming.Names`): distinct
    ids never share a file, and a stem whose file `claimed` names (one the
    run reads or writes elsewhere, `outputs.RunPaths.claimed`) is passed
    over for the next (``-2``).

    Raises:
        StreamFailure: a file cannot be written (a full disk), naming it.

    """
    written = []
    versions = installed_versions()
    names = Names(directory, REPORT_SUFFIXES, claimed)
    for minimal in minimized:
        stem = names.take(minimal.minimal_id if minimal.problem is None else f"{minimal.minimal_id}~{minimal.kind}")
        base = Path(directory)
        record_path = base / f"{stem}.jsonl"
        _write(record_path, "".join(printable_json(record) + "\n" for record in minimal.records))
        script = None
        if scriptable(minimal.divergence) and minimal.request is not None:
            script = base / f"{stem}.sh"
            _write(script, repro_script(minimal, config, endpoint), executable=True)
        report = base / f"{stem}.md"
        _write(report, markdown(minimal, config, endpoint, flags, versions, script, str(record_path)))
        written.append(report)
    return written


def _write(path: Path, text: str, *, executable: bool = False) -> None:
    """`text` into `path`; a file left torn by a failed write is removed.
    Paths and flags from the command line may hold bytes that are not
    UTF-8 (`surrogateescape`); text from a record reaches here escaped.

    Raises:
        StreamFailure: naming the file and why.

    """
    opened = False
    try:
        with open(path, "w", encoding="utf-8", errors="surrogateescape") as out:
            opened = True
            out.write(text)
        if executable:
            path.chmod(0o755)
    except OSError as exc:
        if opened:
            with contextlib.suppress(OSError):
                if stat.S_ISREG(os.lstat(path).st_mode):
                    path.unlink()
        raise StreamFailure(f"--repro: cannot write {path}: {exc.strerror or exc}") from None


# --- the Markdown report ------------------------------------------------------------------
#
# Everything a record carries reaches the report escaped: JSON with every
# character that is not printable as a \u escape (`printable_json`), ids in
# code spans (`code`), blocks fenced longer than any run of backticks in them
# (`fenced`), and shell lines through `shlex.quote`. So no id ends a line,
# a code span or a block early, and a pasted line runs only its command.

def _escaped(char: str) -> str:
    """`char` as JSON escapes (a pair of them past U+FFFF)."""
    code_point = ord(char)
    if code_point <= 0xFFFF:
        return f"\\u{code_point:04x}"
    code_point -= 0x10000
    return f"\\u{0xD800 + (code_point >> 10):04x}\\u{0xDC00 + (code_point & 0x3FF):04x}"


def printable_json(value: Any, *, indent: int | None = None, sort_keys: bool = False) -> str:
    """`value` as JSON, readable (non-ASCII letters kept), with every
    character that is not printable (controls, line and paragraph
    separators, bidirectional overrides, lone surrogates) escaped. Outside
    its strings JSON holds only printable ASCII and the indent's newlines,
    so the escapes are all inside strings and the value is unchanged."""
    text = json.dumps(value, ensure_ascii=False, indent=indent, sort_keys=sort_keys)
    return "".join(char if char.isprintable() or char == "\n" else _escaped(char) for char in text)


def visible(text: str) -> str:
    """`text` as it can be shown on one line: itself when every character
    is printable, else as a JSON string (quoted, escaped)."""
    return text if text and text.isprintable() else printable_json(text)


def code(text: str) -> str:
    """`text` (`visible`) as a Markdown code span that no backtick in it
    closes early."""
    shown = visible(text)
    ticks = "`" * (_longest_backtick_run(shown) + 1)
    pad = " " if shown[:1] in ("`", " ") or shown[-1:] in ("`", " ") else ""
    return f"{ticks}{pad}{shown}{pad}{ticks}"


def fenced(language: str, lines: Iterable[str]) -> list[str]:
    """A fenced code block holding `lines`, its fence longer than any run
    of backticks in them, so none closes it early."""
    body = list(lines)
    fence = "`" * max(3, max((_longest_backtick_run(line) for line in body), default=0) + 1)
    return [f"{fence}{language}", *body, fence]


def _longest_backtick_run(text: str) -> int:
    return max((len(run) for run in re.findall(r"`+", text)), default=0)


def marked(left: Any, right: Any) -> tuple[str, str]:
    """Both values as JSON (`printable_json`) with the part where they
    differ between ⟦ ⟧ (what lies between their common start and common
    end)."""
    texts = [printable_json(value, sort_keys=True) for value in (left, right)]
    a, b = texts
    start = 0
    while start < min(len(a), len(b)) and a[start] == b[start]:
        start += 1
    end = 0
    while end < min(len(a), len(b)) - start and a[len(a) - 1 - end] == b[len(b) - 1 - end]:
        end += 1
    return tuple(f"{t[:start]}⟦{t[start:len(t) - end]}⟧{t[len(t) - end:]}" for t in texts)  # type: ignore[return-value]


def _size_line(minimal: Minimal) -> str:
    before, after = minimal.before, minimal.after
    return (
        f"output ids {before.output_ids} → {after.output_ids}, calls {before.calls} → {after.calls}, "
        f"request {before.request_bytes} → {after.request_bytes} bytes, prompt ids {before.prompt_ids} → "
        f"{after.prompt_ids} ({minimal.runs} runs, {minimal.seconds:.1f} s"
        + (", step budget spent" if minimal.exhausted else "")
        + ")"
    )


def _answer(observed: Observed) -> str:
    if observed.error is not None:
        return printable_json({"error": observed.error}, indent=1)
    shown: dict[str, Any] = {"response": observed.response}
    if observed.chunks is not None:
        shown["chunks"] = observed.chunks
    return printable_json(shown, indent=1)


def markdown(
    minimal: Minimal,
    config: RenderConfig,
    endpoint: Endpoint,
    flags: list[str],
    versions: Mapping[str, str],
    script: Path | None,
    record_path: str,
) -> str:
    divergence = minimal.found[0] if minimal.found else minimal.divergence
    left, right = divergence.left, divergence.right
    server = shlex.join(["vllm", "launch", "render", *config.to_vllm_argv()])
    rerun = shlex.join(["derender", "parity", record_path, *config.to_vllm_argv(repeated=True), *flags])
    lines = [
        f"# {code(divergence.kind)} (request {code(minimal.request_id)})",
        "",
        f"`{left}` ({PATH_WORDS.get(left, left)}) and `{right}` ({PATH_WORDS.get(right, right)}) "
        f"disagree on {code(divergence.field)}"
        + (f" of choice {divergence.index}" if divergence.index is not None else "")
        + (f", the one-shot ids cut into a stream by chunking `{divergence.chunking}`" if divergence.chunking else "")
        + ".",
        "",
        "## Versions and flags",
        "",
        f"derender {code(versions.get('derender', 'unknown'))}, vLLM {code(versions.get('vllm', 'unknown'))}. "
        "The render server:",
        "",
        *fenced("bash", [server]),
        "",
        "derender finds it again with:",
        "",
        *fenced("bash", [rerun]),
        "",
        "## The minimal record",
        "",
    ]
    if minimal.problem is not None:
        lines += [f"Not minimized: {code(minimal.problem)}.", ""]
    else:
        lines += [f"Shrunk from the request's record: {_size_line(minimal)}.", ""]
    lines += [
        f"{'Stream bodies, one streaming derender call each' if minimal.stream else 'One one-shot derender body'} "
        f"(`{endpoint.path}`), also in {code(Path(record_path).name)}:",
        "",
        *fenced("json", (printable_json(record) for record in minimal.records)),
        "",
        "## What each path answered",
        "",
    ]
    for found in minimal.found or [minimal.divergence]:
        shown_left, shown_right = marked(found.left_value, found.right_value)
        where = f"choice {found.index}, " if found.index is not None else ""
        lines += [
            f"{code(found.field)} ({where}⟦ ⟧ marks where they differ"
            + (f"; chunking `{found.chunking}`" if found.chunking else "")
            + "):",
            "",
            *fenced("text", [f"{found.left}: {shown_left}", f"{found.right}: {shown_right}"]),
            "",
        ]
    for (path, chunking), observed in minimal.observed.items():
        if path in (left, right) and (chunking is None or chunking == divergence.chunking):
            lines += [
                f"<details><summary>{path}{f' (chunking {chunking})' if chunking else ''}: the whole answer</summary>",
                "",
                *fenced("json", [_answer(observed)]),
                "",
                "</details>",
                "",
            ]
    lines += ["## Reproduce it", ""]
    if script is not None:
        lines += [
            f"{code(script.name)} starts the render server above on `$PORT` (default 8000; or set "
            "`VLLM_RENDER_URL` to a running one), with `VLLM_TARGET_DEVICE=cpu` (and, with no GPU, an empty "
            "`CUDA_VISIBLE_DEVICES`) unless they are set, so it runs with or without a GPU. It sends the "
            "one-shot body and the stream's calls with `curl` (threading each answer's `stream_state` into "
            "the next call, with `python3`), prints the field from both, and exits 1 while they differ. "
            "Needs `vllm`, `curl` and `python3`; run it from the directory the flags' paths are relative to.",
            "",
            *fenced("bash", [shlex.join(["bash", str(script)])]),
            "",
        ]
    elif {left, right} <= set(ONE_SHOT_PATHS) or {left, right} <= set(STREAM_PATHS):
        lines += [
            "Both sides are the same vLLM endpoint: one of them is derender's own implementation "
            f"(`{'oneshot' if 'oneshot' in (left, right) else 'live'}`), so this is derender's to fix, "
            "not vLLM's. Rerun it with the command above.",
            "",
        ]
    elif left == RECORD and right == "render":
        lines += [
            "The record's prompt ids are not what `/v1/chat/completions/render` (`/v1/completions/render`) "
            "renders for its request: send the request to the render server started as above to see its prompt.",
            "",
        ]
    if {left, right} & set(SERVE_PATHS):
        lines += _serve_notes(minimal, endpoint)
    return "\n".join(lines)


def header_safe(text: str) -> bool:
    """Whether `text` can travel as an HTTP header value as it is: visible
    ASCII and inner spaces, no line break or other control character."""
    return bool(text) and text.isascii() and text.isprintable() and text == text.strip()


def _serve_notes(minimal: Minimal, endpoint: Endpoint) -> list[str]:
    request = dict(_request_of(minimal, endpoint) or {})
    # Greedy, as the notes recommend, so a repeat gives the same ids.
    request = {**request, "return_token_ids": True, "seed": request.get("seed", 0), "temperature": 0}
    path = "/v1/chat/completions" if endpoint is Endpoint.CHAT else "/v1/completions"
    command = ["curl", "-sS", f"http://127.0.0.1:8000{path}", "-H", "content-type: application/json"]
    if header_safe(minimal.minimal_id):
        command += ["-H", f"X-Request-Id: {minimal.minimal_id}"]
    command += ["-d", printable_json(request)]
    return [
        "### The serve side",
        "",
        "derender's serve path is vLLM's own `OpenAIServingChat` (`OpenAIServingCompletion`) over an "
        "`AsyncLLM` whose engine core replays the record's token ids, so its answer is what `vllm serve` "
        "sends for a model that samples those ids. To see it from `vllm serve` itself, serve the real model "
        "with the same flags (`vllm serve MODEL` and the flags above) and send the request with "
        '`"return_token_ids": true`, greedy sampling (`"temperature": 0`) and a fixed `seed`, so a repeat '
        "gives the same ids, as the line below does; when the answer's `token_ids` equal the record's, its "
        "frames are the ones above. "
        + ("" if header_safe(minimal.minimal_id) else "(The request id holds characters an HTTP header cannot "
           "carry, so the line sends none.) ")
        + "Record such answers and `derender parity requests.jsonl --from-serve recorded.jsonl` compares "
        "every path with them.",
        "",
        *fenced("bash", [shlex.join(command)]),
        "",
    ]


def _request_of(minimal: Minimal, endpoint: Endpoint) -> Mapping[str, Any] | None:
    first = minimal.records[0] if minimal.records else {}
    request = first.get(endpoint.request_key)
    return request if isinstance(request, Mapping) else None


# --- the script ----------------------------------------------------------------------------

_STREAM_CALL = r"""stream_call() {  # a streaming call's body, and the choice index whose state it carries
  python3 -c 'import json, os, sys
body = json.load(open(sys.argv[1]))
if os.path.exists(sys.argv[2]):
    body["stream_state"] = json.load(open(sys.argv[2]))
json.dump(body, open(sys.argv[3], "w"))' "$1" "$WORK/state.$2.json" "$WORK/sent.json"
  post "$WORK/sent.json" "$STREAM_PATH" >"$WORK/answer.json"
  python3 -c 'import json, sys
answer = json.load(open(sys.argv[1]))
if "stream_state" in answer:
    json.dump(answer["stream_state"], open(sys.argv[2], "w"))
with open(sys.argv[3], "a") as out:
    out.write(json.dumps(answer) + "\n")' "$WORK/answer.json" "$WORK/state.$2.json" "$WORK/stream.jsonl"
}
"""

_CHECK = r'''import json, re, sys

sys.stdout.reconfigure(errors="backslashreplace")  # a lone surrogate in an answer is shown, not fatal

field, index, one_shot_name, stream_name = json.loads(sys.argv[3]), json.loads(sys.argv[4]), sys.argv[5], sys.argv[6]
one_shot = json.load(open(sys.argv[1]))
answers = [json.loads(line) for line in open(sys.argv[2])]


def assembled(answers):
    """The stream as a client assembles it (an error answer: that error)."""
    response, choices = {}, {}
    for answer in answers:
        if "chunk" not in answer:
            return answer
        chunk = answer["chunk"]
        for key in ("model", "object", "system_fingerprint", "usage"):
            if chunk.get(key) is not None:
                response[key] = chunk[key]
        for choice in chunk.get("choices") or []:
            parts = choices.setdefault(choice["index"], {"index": choice["index"]})
            delta = choice.get("delta") or {}
            message = parts.setdefault("message", {}) if "delta" in choice else parts
            for key in ("role", "content", "reasoning"):
                if delta.get(key):
                    message[key] = delta[key] if key == "role" else message.get(key, "") + delta[key]
            for call in delta.get("tool_calls") or []:
                calls = message.setdefault("tool_calls", {})
                merged = calls.setdefault(call["index"], {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
                merged["id"] = merged["id"] or call.get("id")
                merged["function"]["name"] += (call.get("function") or {}).get("name") or ""
                merged["function"]["arguments"] += (call.get("function") or {}).get("arguments") or ""
            if choice.get("text"):
                parts["text"] = parts.get("text", "") + choice["text"]
            if choice.get("token_ids") is not None:
                parts["token_ids"] = parts.get("token_ids", []) + choice["token_ids"]
            logprobs = choice.get("logprobs")
            if logprobs is not None:
                joined = parts.setdefault("logprobs", {})
                for key, value in logprobs.items():
                    joined[key] = (joined.get(key) or []) + (value or [])
            if choice.get("finish_reason") is not None:
                parts["finish_reason"], parts["stop_reason"] = choice["finish_reason"], choice.get("stop_reason")
    for parts in choices.values():
        calls = (parts.get("message") or {}).get("tool_calls")
        if calls is not None:
            parts["message"]["tool_calls"] = [calls[i] for i in sorted(calls)]
    response["choices"] = [choices[i] for i in sorted(choices)]
    return response


def value(response):
    """The field as derender parity compares it: null and absent alike,
    tool-call ids not compared."""
    if "error" in response:
        return {"error": response["error"]} if field == "error" else "<error: %s>" % json.dumps(response["error"])
    if index is None:
        found = response.get(field)
    else:
        choice = next((c for c in response.get("choices") or [] if c.get("index", 0) == index), None)
        fields = dict(choice or {})
        fields.update(fields.pop("message", None) or {})
        found = fields.get(field)
    text = json.dumps(found, ensure_ascii=False, sort_keys=True)
    text = re.sub(r'"id": "[^"]*"', '"id": "<id>"', text)
    return None if found in (None, []) else json.loads(text)


shown = [value(one_shot), value(assembled(answers))]
print("%s: %s" % (one_shot_name, json.dumps(shown[0], ensure_ascii=False)))
print("%s: %s" % (stream_name, json.dumps(shown[1], ensure_ascii=False)))
if shown[0] != shown[1]:
    print("reproduced: the one-shot and streaming derender endpoints differ on %s" % field)
    sys.exit(1)
print("not reproduced: both endpoints agree on %s" % field)
'''


def repro_script(minimal: Minimal, config: RenderConfig, endpoint: Endpoint) -> str:
    """A bash script that shows the divergence on a real render server."""
    request = minimal.request
    assert request is not None
    divergence = minimal.found[0] if minimal.found else minimal.divergence
    one_shot_side = divergence.left if divergence.left in ONE_SHOT_PATHS else divergence.right
    stream_side = divergence.right if one_shot_side == divergence.left else divergence.left
    bodies = next(
        (bodies for chunking, bodies in request.streams if chunking == divergence.chunking),
        request.streams[0][1] if request.streams else [],
    )
    server = shlex.join(config.to_vllm_argv())
    # No comment line holds text from the record: an id with a line break
    # would end the comment. What it reproduces is data, quoted, as JSON.
    lines = [
        "#!/usr/bin/env bash",
        "# Shows a divergence between vLLM's one-shot and streaming derender endpoints (KIND, on the",
        "# minimal record REQUEST_ID, below as JSON strings).",
        "# Starts `vllm launch render` with derender's flags on $PORT (default 8000), or uses the server at",
        "# $VLLM_RENDER_URL; $VLLM is the vllm command (default: vllm). Needs curl and python3. Run it from",
        "# the directory the flags' paths are relative to. Exit 1: the endpoints still differ (reproduced).",
        "set -euo pipefail",
        f"KIND={shlex.quote(json.dumps(divergence.kind))}",
        f"REQUEST_ID={shlex.quote(json.dumps(minimal.minimal_id))}",
        'echo "reproducing $KIND on request $REQUEST_ID" >&2',
        'PORT="${PORT:-8000}"',
        'URL="${VLLM_RENDER_URL:-http://127.0.0.1:$PORT}"',
        f"ONE_SHOT_PATH={shlex.quote(endpoint.path)}",
        f"STREAM_PATH={shlex.quote(endpoint.path)}",
        'WORK="$(mktemp -d)"',
        'SERVER=""',
        "cleanup() {",
        '  if [ -n "$SERVER" ]; then kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true; fi',
        '  rm -rf "$WORK"',
        "}",
        "trap cleanup EXIT",
        'if [ -z "${VLLM_RENDER_URL:-}" ]; then',
        "  # The render server needs no GPU: vLLM's CPU platform unless told otherwise. vLLM 0.34 on an x86",
        "  # CPU also refuses to start without a GPU unless CUDA_VISIBLE_DEVICES is set, and empty.",
        '  export VLLM_TARGET_DEVICE="${VLLM_TARGET_DEVICE:-cpu}"',
        '  if [ -z "${CUDA_VISIBLE_DEVICES+set}" ] && ! nvidia-smi -L >/dev/null 2>&1; then export CUDA_VISIBLE_DEVICES=""; fi',
        f'  ${{VLLM:-vllm}} launch render {server} --host 127.0.0.1 --port "$PORT" >"$WORK/server.log" 2>&1 &',
        "  SERVER=$!",
        "  for _ in $(seq 600); do",
        '    curl -sf "$URL/health" >/dev/null 2>&1 && break',
        '    kill -0 "$SERVER" 2>/dev/null || { cat "$WORK/server.log" >&2; echo "vllm launch render exited" >&2; exit 3; }',
        "    sleep 1",
        "  done",
        "fi",
        "post() { curl -sS -H 'content-type: application/json' --data-binary @\"$1\" \"$URL$2\"; }",
        _STREAM_CALL,
        "# The one-shot call.",
        "cat >\"$WORK/one_shot.json\" <<'JSON'",
        json.dumps(request.one_shot),  # ASCII, one line: never the word that ends the here-document
        "JSON",
        'post "$WORK/one_shot.json" "$ONE_SHOT_PATH" >"$WORK/one_shot.answer.json"',
        f"# The stream: {len(bodies)} calls, each with the stream_state of its choice's previous answer.",
    ]
    last_index: int | None = None
    for number, body in enumerate(bodies, 1):
        facts = ChunkFacts.of(body, endpoint)
        index = facts.index if facts.index is not None else last_index
        last_index = index
        lines += [
            f"cat >\"$WORK/call_{number}.json\" <<'JSON'",
            json.dumps(body),
            "JSON",
            f'stream_call "$WORK/call_{number}.json" {0 if index is None else index}',
        ]
    lines += [
        "set +e",
        "python3 - \"$WORK/one_shot.answer.json\" \"$WORK/stream.jsonl\" "
        + shlex.join([json.dumps(divergence.field), json.dumps(divergence.index), f"one-shot ({one_shot_side})", f"stream ({stream_side})"])
        + " <<'PY'",
        _CHECK.rstrip("\n"),
        "PY",
        "status=$?",
        "exit $status",
        "",
    ]
    return "\n".join(lines)

