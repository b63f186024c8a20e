"""What an answer or a record holds cannot run on the page, end a `diff`, or
blow the page up (issue 31: cases 3, 7, 8, 9 and the rule that HTML is
escaped at one place).

The page is loaded where a user opens it, in headless Chromium from a file,
with hostile markup in every field: a handler that ran would have marked
the body (`data-pwned`), which the DOM dump would show. `derender diff` runs
as a user runs it, on malformed answer files drawn by hypothesis: it
answers with an exit status and a message, never a traceback.
"""

from __future__ import annotations

import ast
import json
import time
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import derender_core.html_report as html_report
from derender_core.compare import Examination, Observed, compare
from derender_core.html_report import build_page
from tests.helpers import run_cli
from tests.test_html_report import CHROMIUM, _Dom, _dump_dom

PWN = "document.body.setAttribute('data-pwned','yes')"
PAYLOADS = (
    f'<img src=x onerror="{PWN}">',
    f"<script>{PWN}</script>",
    f'"><svg onload="{PWN}">',
    f"'><img src=x onerror={PWN}>",
    f"</pre></td></tr></table><img src=x onerror={PWN}>",
    f"<a href=\"javascript:{PWN}\">x</a>",
    f"--><style onload={PWN}>",
)
"""Markup that runs `PWN` wherever it is not escaped."""
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (.ci/run installs Debian's)")

_TAGS = frozenset(
    "html head meta title style body header h1 h3 div section p b i table thead tbody tr th td a span pre code "
    "details summary form label select option input button ul li main script".split()
)
"""Every element the builder writes."""


class _Tags(HTMLParser):
    """Every element and attribute of a page, as a browser's parser reads it."""

    def __init__(self, page: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[str] = []
        self.attributes: list[tuple[str, str]] = []
        self.feed(page)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self.attributes += [(name, value or "") for name, value in attrs]


def _runs_nothing(page: str) -> None:
    """The page holds only the builder's own markup: its elements, no event
    handler attribute, links only to its own anchors, one script."""
    page.encode()  # no lone surrogate reaches the file
    parsed = _Tags(page)
    assert set(parsed.tags) <= _TAGS, set(parsed.tags) - _TAGS
    assert parsed.tags.count("script") == 1
    handlers = [(name, value) for name, value in parsed.attributes if name.startswith("on")]
    assert set(handlers) <= {("onsubmit", "return false")}, handlers  # the filters' form, the builder's own
    assert all(value.startswith("#") for name, value in parsed.attributes if name in ("href", "src", "action"))


def _hostile_stream(value: str, index: Any, path: str | None = None) -> Examination:
    """Two streams whose every field, key and choice index is `value` (the
    index `index`), the calls' token ids keyed by it too; the left path is
    named `path` (`value` unless given)."""
    path = value if path is None else path
    key = json.dumps(index) if isinstance(index, list) else index  # as the page keys a choice

    def frame(text: str, finish: str | None = None) -> dict[str, Any]:
        return {"id": value, "object": value, "model": value, value: value,
                "choices": [{"index": index, "delta": {"role": value, "content": text, value: value},
                             "finish_reason": finish, "token_ids": [1, value]}]}  # fmt: skip

    left = Observed(response={"choices": [{"index": index, "message": {"content": value}}], "model": value},
                    chunks=[frame(value), frame("a", value)], calls=[1, 1])  # fmt: skip
    right = Observed(response={"choices": [{"index": index, "message": {"content": "b"}}], "model": "m"},
                     chunks=[frame("b"), frame("c", "stop")], calls=[1, 1])  # fmt: skip
    found = compare(path, left, "serve", right, request_id=value)
    return Examination(value, {(path, None): left, ("serve", None): right}, found, calls={None: [{key: [1, 2]}, {key: [3]}]})


def _hostile_one_shot(value: str, index: Any, path: str | None = None) -> Examination:
    path = value if path is None else path
    left = Observed(response={"model": value, value: value, "choices": [{"index": index, "message": {"content": value, value: value}}]})
    right = Observed(response={"model": "m", "choices": [{"index": 0, "message": {"content": "x"}}]})
    found = compare("oneshot", left, path, right, request_id=value)
    return Examination(value, {("oneshot", None): left, (path, None): right}, found, token_ids={0: [5, 6]})


# --- HTML is escaped at one place ------------------------------------------------------

_INTERNAL = frozenset(
    {
        *"count number requests with_divergences requests_hit k row cls unit label _CSS _JS TOKENS_SHOWN".split(),
        *"item.number frame.number m[0].number self.frame_ids row_ids[k] row_ids[key] 'lr'[s]".split(),
        "' · '.join(items)",
        "' · '.join(extra)",
    }
)
"""Values the builder makes itself: numbers, its own ids, classes and markup."""
_TEXT_HELPERS = frozenset({"_esc", "_cut", "_tail", "_name", "_kind", "_chunkings"})
"""Functions whose f-strings make text that their callers escape."""


def _allowed(node: ast.expr) -> bool:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("_esc", "len", "sum"):
        return True
    if isinstance(node, ast.Constant) or ast.unparse(node) in _INTERNAL:
        return True
    if isinstance(node, ast.IfExp):
        return _allowed(node.body) and _allowed(node.orelse)
    if isinstance(node, ast.BinOp):
        return _allowed(node.left) and _allowed(node.right)
    if isinstance(node, ast.BoolOp):
        return all(_allowed(value) for value in node.values)
    return False


def test_every_value_reaches_the_page_through_one_escaping_function() -> None:
    """Every value an f-string of the builder writes is `_esc`'s output, or
    one the builder made itself (a number, its own ids and markup); text
    made for a caller to escape is made inside `_esc` or in `_TEXT_HELPERS`."""
    tree = ast.parse(Path(html_report.__file__).read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

    def escaped_later(node: ast.AST) -> bool:
        while node in parents:
            node = parents[node]
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "_esc":
                return True
            if isinstance(node, ast.FunctionDef) and node.name in _TEXT_HELPERS:
                return True
        return False

    offenders = [
        f"line {node.lineno}: {ast.unparse(node.value)}"
        for node in ast.walk(tree)
        if isinstance(node, ast.FormattedValue) and not _allowed(node.value) and not escaped_later(node)
    ]
    assert not offenders, offenders
    # The one escaping function escapes what a browser would read as markup.
    assert html_report._esc("<a href=\"x\" onclick='y'>&") == "&lt;a href=&quot;x&quot; onclick=&#x27;y&#x27;&gt;&amp;"


@pytest.mark.parametrize("payload", PAYLOADS)
def test_a_hostile_index_and_every_field_stay_text(payload: str) -> None:
    """Case 3 without a browser: a one-shot choice's index and a stream
    choice's index (its frames and the token-ids line ``[index]``), and
    every other field, are text on the page."""
    page = build_page([_hostile_stream(payload, payload), _hostile_one_shot(payload, payload)], title=payload,
                      subtitle=payload, pieces={1: payload, 3: payload}, skipped=[(payload, payload)])  # fmt: skip
    _runs_nothing(page)
    assert payload not in page
    assert "[" + html_report._esc(payload) + "]" in page  # the token-ids line and the frames' choice


@needs_chromium
def test_diff_page_with_a_hostile_index_runs_nothing_in_a_browser(tmp_path: Path) -> None:
    """Case 3 as a user meets it: `derender diff A B --html p.html` on
    one-shot answers whose choice index and every other field hold markup,
    opened in Chromium: the page's own script runs, nothing else does."""
    payload = " ".join(PAYLOADS)
    expected, actual = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    expected.write_text(json.dumps({"id": "r", "object": "chat.completion", "choices": [{"index": 0, "message": {"content": "x"}}]}) + "\n")
    answer = {"id": payload, "object": payload, "model": payload, payload: payload,
              "choices": [{"index": payload, "message": {"content": payload, payload: payload}, "finish_reason": payload}]}  # fmt: skip
    actual.write_text(json.dumps(answer) + "\n")
    page = tmp_path / "p.html"
    done = run_cli("diff", str(expected), str(actual), "--html", str(page), "--report", str(tmp_path / "r.jsonl"))
    assert done.returncode == 1, done.stderr[-2000:]
    assert b"Traceback" not in done.stderr
    _runs_nothing(page.read_text())
    for stream in (False, True):
        if stream:  # the stream's index in its frames and token-ids line, from the builder
            page.write_text(build_page([_hostile_stream(payload, payload)], title="t", pieces={1: payload}))
        dumped = _dump_dom(page)
        assert 'data-pwned="yes"' not in dumped
        assert "data-ready=" in dumped and 'data-ready="0"' not in dumped  # the page's own script ran
        assert "&lt;img src=x onerror=" in dumped  # the markup is there, as text


# --- case 9: a malformed fragment -----------------------------------------------------


@needs_chromium
def test_a_page_opened_at_a_malformed_fragment_becomes_ready(tmp_path: Path) -> None:
    """``#%E0%A4%A`` cannot be URI-decoded; the page still runs its script
    (filters, counts) and says it is ready. A fragment naming a divergence
    still opens its section."""
    page = tmp_path / "p.html"
    examinations = [_hostile_one_shot(f"r{n}", 0) for n in range(3)]
    page.write_text(build_page(examinations, title="t"))
    total = sum(len(e.divergences) for e in examinations)
    for fragment in ("#%E0%A4%A", "#%", "#d-%"):
        dumped = _dump_dom(page, fragment)
        assert f'data-ready="{total}"' in dumped and f">{total} of {total} shown<" in dumped, fragment
    assert _Dom(_dump_dom(page, f"#d-{total}")).cards[f"d-{total}"]["open"]


# --- case 8: a long request id -------------------------------------------------------


def test_a_megabyte_request_id_is_cut_on_the_page() -> None:
    """A 1 MB id in the request and in every frame: the page is cut as its
    cells are, a few tens of kilobytes, built in well under a second."""
    long_id = "i" * 1_000_000
    start = time.perf_counter()
    page = build_page([_hostile_stream(long_id, 0, "replay"), _hostile_one_shot(long_id, 0, "serve")], title="t")
    seconds = time.perf_counter() - start
    small = build_page([_hostile_stream("i", 0, "replay"), _hostile_one_shot("i", 0, "serve")], title="t")
    assert len(page) < len(small) + 150_000, len(page)
    assert seconds < 2.0
    assert "i" * (html_report.VALUE_CHARS + 1) not in page


def test_diff_of_streams_with_a_megabyte_id(tmp_path: Path) -> None:
    """The same through `derender diff --html`: SSE transcripts whose every
    frame carries a 1 MB id; the page stays small, the table on stderr too,
    the report keeps the id whole."""
    long_id = "chatcmpl-" + "i" * 1_000_000
    for name, texts in (("a", ["Hel", "lo"]), ("b", ["Hel", "p"])):
        events = [{"id": long_id, "object": "chat.completion.chunk", "created": 1, "model": "m",
                   "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]} for text in texts]  # fmt: skip
        (tmp_path / f"{name}.sse").write_text("".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n")
    page, report = tmp_path / "p.html", tmp_path / "r.jsonl"
    start = time.perf_counter()
    done = run_cli("diff", str(tmp_path / "a.sse"), str(tmp_path / "b.sse"), "--html", str(page), "--report", str(report))
    assert done.returncode == 1, done.stderr[-2000:]
    assert time.perf_counter() - start < 30
    assert page.stat().st_size < 100_000, page.stat().st_size
    assert len(done.stderr) < 20_000
    assert json.loads(report.read_text().splitlines()[0])["request_id"] == long_id


# --- case 7: diff on malformed answer files -----------------------------------------------

_CHAT = {"id": "r", "object": "chat.completion", "choices": [{"index": 0, "message": {"content": "x"}, "finish_reason": "stop"}]}
_FRAME = {"id": "s", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": None}]}


def _with(base: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    """`base` (copied) with the value at `path` set, or removed for `...`."""
    copy = json.loads(json.dumps(base))
    target = copy
    for key in path[:-1]:
        target = target[key]
    if value is ...:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return copy


def _stream_line(chunk: Any) -> str:
    return json.dumps({"chunk": chunk, "stream_state": None}) + "\n"


def _diff(tmp_path: Path, expected: str, actual: str, *flags: str) -> tuple[Any, Path]:
    left, right = tmp_path / "expected.jsonl", tmp_path / "actual.jsonl"
    left.write_text(expected)
    right.write_text(actual)
    return run_cli("diff", str(left), str(right), *flags), right


@pytest.mark.parametrize(
    ("path", "value", "says"),
    [
        (("choices", 0, "index"), [0], "choices[0].index is a list, not an integer"),
        (("choices", 0, "index"), "0", "choices[0].index is a string ('0'), not an integer"),
        (("choices", 0, "index"), 0.5, "choices[0].index is a number (0.5), not an integer"),
        (("choices", 0, "index"), ..., "choices[0] has no index"),
        (("choices", 0, "delta"), "a", "choices[0].delta is a string ('a'), not an object"),
        (("choices", 0, "delta", "content"), 7, "choices[0].delta.content is an integer, not a string"),
        (("choices",), {"index": 0}, "choices is an object, not a list"),
        (("choices", 0), None, "choices[0] is null, not an object"),
        (("choices", 0, "delta", "tool_calls"), [None], "choices[0].delta.tool_calls[0] is null, not an object"),
    ],
)
def test_diff_refuses_a_stream_frame_no_client_can_read(tmp_path: Path, path: tuple[Any, ...], value: Any, says: str) -> None:
    """Case 7, streams: exit 2 and the file, line and field, as `parity`
    answers an unreadable input; no traceback, nothing written."""
    good = _stream_line(_FRAME)
    done, actual = _diff(tmp_path, good, good + _stream_line(_with(_FRAME, path, value)), "--report", str(tmp_path / "r.jsonl"))
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"derender: error: {actual}:2: not a stream frame a client can read: {says}".encode() in done.stderr
    assert b"Traceback" not in done.stderr and not (tmp_path / "r.jsonl").exists()


@pytest.mark.parametrize(("value", "status"), [([1], 1), ("<b>0</b>", 1), ("[/x] [bold]", 1), (0.5, 1), (..., 0), (0, 0)])
def test_diff_compares_a_one_shot_choice_whatever_its_index(tmp_path: Path, value: Any, status: int) -> None:
    """Case 7, one-shot answers: a choice whose index is not an integer is
    a choice of its own (the expected choice 0 is missing beside it; Rich
    markup in it is text in the table), one without an index is its place
    in the list."""
    done, _ = _diff(tmp_path, json.dumps(_CHAT) + "\n", json.dumps(_with(_CHAT, ("choices", 0, "index"), value)) + "\n",
                    "--report", str(tmp_path / "r.jsonl"))  # fmt: skip
    assert done.returncode == status, done.stderr[-2000:]
    assert b"Traceback" not in done.stderr
    lines = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    if status:
        assert any({"index": 0, "field": "choice", "left_value": "present", "right_value": None}.items() <= line.items() for line in lines)
        assert any(line["index"] == (json.dumps(value, separators=(",", ":")) if isinstance(value, list) else value) for line in lines)
    else:
        assert lines == []


def test_diff_reports_big_integers_and_lone_surrogates(tmp_path: Path) -> None:
    """Case 7, values no JSON library of ours wrote before: integers past 64
    bits and lone surrogates reach the table on stderr (escaped) and the
    report (valid UTF-8 JSON that reads back as the values)."""
    big = 2**70 + 1
    answer = _with(_with(_CHAT, ("choices", 0, "message", "content"), "x\udc80\ud800"), ("usage",), {"total_tokens": big})
    frame = _with(_FRAME, ("choices", 0, "delta", "content"), "a\udc80")
    frame = _with(frame, ("choices", 0, "index"), big)
    for left, right, values in (
        (json.dumps(_CHAT), json.dumps(answer), {("content", "x\udc80\ud800"), ("usage", json.dumps({"total_tokens": big}))}),
        (_stream_line(_FRAME), _stream_line(frame), {("choice", "present")}),
    ):
        report = tmp_path / "r.jsonl"
        done, _ = _diff(tmp_path, left.strip() + "\n", right.strip() + "\n", "--report", str(report))
        assert done.returncode == 1, done.stderr[-2000:]
        assert b"Traceback" not in done.stderr
        lines = [json.loads(line) for line in report.read_bytes().decode("utf-8").splitlines()]
        found = {(line["field"], line["right_value"] if isinstance(line["right_value"], str) else json.dumps(line["right_value"])) for line in lines}
        assert values <= found, found
    assert b"\\udc80" in done.stderr or b"udc80" in done.stderr  # the table shows the escape


@pytest.mark.parametrize("flags", [("--html", "/dev/full"), ("--report", "/dev/full")])
def test_diff_that_cannot_write_is_exit_3(tmp_path: Path, flags: tuple[str, str]) -> None:
    done, _ = _diff(tmp_path, json.dumps(_CHAT) + "\n", json.dumps(_with(_CHAT, ("model",), "m")) + "\n", *flags)
    assert done.returncode == 3, done.stderr[-2000:]
    assert done.stderr.strip().endswith(b"derender: the run could not finish: cannot write /dev/full: No space left on device")


def test_diff_report_to_a_full_stdout_is_exit_3(tmp_path: Path) -> None:
    left, right = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    left.write_text(json.dumps(_CHAT) + "\n")
    right.write_text(json.dumps(_with(_CHAT, ("model",), "m")) + "\n")
    import subprocess
    import sys

    with open("/dev/full", "wb") as full:
        done = subprocess.run([str(Path(sys.executable).with_name("derender")), "diff", str(left), str(right), "--report", "-"],
                              stdout=full, stderr=subprocess.PIPE, timeout=120)  # fmt: skip
    assert done.returncode == 3, done.stderr[-2000:]
    assert b"derender: the run could not finish: cannot write stdout: No space left on device" in done.stderr
    assert b"Traceback" not in done.stderr


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**80), max_value=2**80) | st.floats(allow_nan=False)
    | st.text(st.characters(blacklist_categories=()), max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
"""Any JSON value, lone surrogates and integers past 64 bits included."""
_PLACES = st.sampled_from(
    [("choices", 0, "index"), ("choices", 0, "delta"), ("choices", 0, "delta", "content"), ("choices", 0, "delta", "role"),
     ("choices", 0, "delta", "tool_calls"), ("choices", 0, "logprobs"), ("choices", 0, "token_ids"), ("choices", 0, "text"),
     ("choices", 0, "finish_reason"), ("choices",), ("choices", 0), ("id",), ("usage",), ("object",), ("error",)]
)  # fmt: skip


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(one_shot=st.booleans(), place=_PLACES, value=_JSON | st.just(...))
def test_diff_answers_any_malformed_line_without_a_traceback(tmp_path: Path, one_shot: bool, place: tuple[Any, ...], value: Any) -> None:
    """Case 7, drawn: one field of a one-shot answer or a stream frame set
    to any JSON value (or left out). `derender diff` exits 0, 1 or 2 (or 4
    for a file left without an answer), with a message naming the file and
    line for 2, and writes its report and page."""
    base = _CHAT if one_shot else _FRAME
    try:
        changed = _with(base, place, value)
    except (KeyError, IndexError, TypeError):
        changed = base
    line = (json.dumps(changed) if one_shot else _stream_line(changed).strip()) + "\n"
    good = json.dumps(base) + "\n" if one_shot else _stream_line(base)
    report, page = tmp_path / "r.jsonl", tmp_path / "p.html"
    report.unlink(missing_ok=True)
    done, actual = _diff(tmp_path, good, line, "--report", str(report), "--html", str(page))
    assert b"Traceback" not in done.stderr and b"internal error" not in done.stderr, done.stderr[-3000:]
    assert done.returncode in (0, 1, 2, 4), done.stderr[-2000:]
    if done.returncode == 2:
        assert f"{actual}:1: ".encode() in done.stderr
    elif done.returncode == 4:  # no answer left in the file (an answer's choices taken away)
        assert f"no answers in {actual}: nothing to compare".encode() in done.stderr
    else:
        [json.loads(line) for line in report.read_bytes().decode("utf-8").splitlines()]
        _runs_nothing(page.read_text())


# --- the page built from anything ------------------------------------------------------

_TEXT = st.text(st.characters(blacklist_categories=()), max_size=12)
"""The whole of Unicode: controls, lone surrogates, markup characters."""
_HOSTILE = _TEXT | st.sampled_from(PAYLOADS) | st.builds(lambda a, b, c: a + b + c, _TEXT, st.sampled_from(PAYLOADS), _TEXT)
_INDEX = st.integers(0, 3) | _HOSTILE | st.lists(st.integers(), max_size=2) | st.floats(allow_nan=False) | st.none()


@settings(max_examples=300, deadline=None)
@given(value=_HOSTILE, index=_INDEX, other=_HOSTILE)
def test_a_page_from_any_values_holds_only_its_own_markup(value: str, index: Any, other: str) -> None:
    """Drawn values in every field, key, index and id (streams and one-shot
    answers): the page's elements are the builder's, with no handler, and
    a drawn `<` is never markup."""
    page = build_page([_hostile_stream(value, index), _hostile_one_shot(other, index)], title=value, subtitle=other,
                      pieces={1: value, 3: other}, skipped=[(value, other)])  # fmt: skip
    _runs_nothing(page)


@needs_chromium
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=_HOSTILE, index=_INDEX)
def test_a_page_from_drawn_values_runs_nothing_in_a_browser(tmp_path: Path, value: str, index: Any) -> None:
    page = tmp_path / "p.html"
    payload = value + " " + " ".join(PAYLOADS)
    page.write_text(build_page([_hostile_stream(payload, index), _hostile_one_shot(payload, index)], title=payload), encoding="utf-8")
    dumped = _dump_dom(page)
    assert 'data-pwned="yes"' not in dumped and "data-ready=" in dumped and 'data-ready="0"' not in dumped
