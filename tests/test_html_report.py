"""``--html``: the page of divergences of `derender parity` and `derender diff`.

The builder (`derender_core.html_report`) is checked on examinations made
here, compared by the real `compare`: escaping, an anchor and a highlight
for every divergence, the call a stream diverges at, and a size linear in
the divergences. The page the sample's parity run writes is then loaded in
a real browser (headless Chromium, from ``file://``, network off) and its
DOM, after the page's script ran, must show every divergence of the run's
report, highlighted.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from derender_core.compare import Examination, Observed, compare
from derender_core.html_report import build_page
from tests.helpers import run_cli

SAMPLE_FLAGS = ["--config", "sample_data/qwen3.yaml"]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
_VOID = frozenset({"meta", "input", "br", "hr", "img", "link", "wbr", "col", "source"})


class _Dom(HTMLParser):
    """What the tests read from a page: every element with an id, each
    divergence card's attributes, whether it holds a highlighted element,
    the links it holds, its text; the highlighted rows; every URL."""

    def __init__(self, page: str) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: dict[str, dict[str, str]] = {}
        self.cards: dict[str, dict[str, Any]] = {}
        self.urls: list[str] = []
        self.scripts = 0
        self._stack: list[tuple[str, dict[str, str]]] = []
        self._card: str | None = None
        self._card_depth = 0
        self.feed(page)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = {k: v or "" for k, v in attrs}
        classes = found.get("class", "").split()
        self.urls += [found[k] for k in ("href", "src", "action") if k in found]
        self.scripts += tag == "script"
        if "id" in found:
            self.ids[found["id"]] = {"tag": tag, **found}
        if self._card is None and "div" in classes and tag == "div":
            self._card = found["id"]
            self._card_depth = len(self._stack)
            section = next((a for t, a in reversed(self._stack) if t == "details" and "request" in a.get("class", "")), {})
            self.cards[self._card] = {**found, "highlighted": False, "links": [], "text": [], "open": "open" in section}
        elif self._card is not None:
            card = self.cards[self._card]
            card["highlighted"] |= "hl" in classes
            if tag == "a":
                card["links"].append(found.get("href", ""))
        if tag not in _VOID:
            self._stack.append((tag, found))

    def handle_endtag(self, tag: str) -> None:
        if tag in _VOID:
            return
        while self._stack:
            open_tag, _ = self._stack.pop()
            if open_tag == tag:
                break
        if self._card is not None and len(self._stack) == self._card_depth:
            self._card = None

    def handle_data(self, data: str) -> None:
        if self._card is not None:
            self.cards[self._card]["text"].append(data)

    def card_text(self, anchor: str) -> str:
        return "".join(self.cards[anchor]["text"])


@dataclass
class _Section:
    """One pair's section: its request, title and transcript rows, each
    row whether it is highlighted and per cell the JSON of its frames."""

    request: str
    title: str
    rows: list[tuple[bool, list[list[str]]]] = field(default_factory=list)


class _Transcripts(HTMLParser):
    """Every pair's transcript on a page, frame by frame (the frames' JSON view)."""

    def __init__(self, page: str) -> None:
        super().__init__(convert_charrefs=True)
        self.sections: list[_Section] = []
        self._request = ""
        self._table = False
        self._reading: str | None = None
        self._text: list[str] = []
        self.feed(page)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = {k: v or "" for k, v in attrs}
        classes = found.get("class", "").split()
        if tag == "details" and "request" in classes:
            self._request = found.get("data-request", "")
        elif tag in ("h3", "pre") and (tag == "h3" or "json" in classes):
            self._reading, self._text = tag, []
        elif tag == "table" and "tx" in classes:
            self._table = True
        elif self._table and tag == "tr" and "id" in found:
            self.sections[-1].rows.append(("hl" in classes, []))
        elif self._table and tag == "td" and self.sections[-1].rows:
            self.sections[-1].rows[-1][1].append([])

    def handle_endtag(self, tag: str) -> None:
        if tag == "h3" and self._reading == "h3":
            self.sections.append(_Section(self._request, "".join(self._text)))
        elif tag == "pre" and self._reading == "pre":
            self.sections[-1].rows[-1][1][-1].append("".join(self._text))
        elif tag == "table":
            self._table = False
        if tag == self._reading:
            self._reading = None

    def handle_data(self, data: str) -> None:
        if self._reading is not None:
            self._text.append(data)


def _emitted(frames: list[str]) -> dict[int, str]:
    """The text a cell's frames emit, per choice (content, reasoning and
    tool-call arguments, in order)."""
    found: dict[int, str] = {}
    for text in frames:
        for choice in json.loads(text).get("choices") or []:
            delta = choice.get("delta") or {}
            parts = [delta.get("content"), delta.get("reasoning")]
            parts += [(call.get("function") or {}).get("arguments") for call in delta.get("tool_calls") or []]
            found[choice["index"]] = found.get(choice["index"], "") + "".join(p for p in parts if p)
    return {index: text for index, text in found.items() if text}


def _stream_examination(request_id: str = "req-1") -> Examination:
    """Two streams of the same three calls: the left puts the role on its
    first token's frame and emits "Hel", "lo", "!"; the right sends a role
    frame of its own, then "Hel", "p", "!". Their text parts at call 2."""

    def frame(index: int = 0, finish: str | None = None, **delta: Any) -> dict[str, Any]:
        return {"object": "chat.completion.chunk", "choices": [{"index": index, "delta": delta, "finish_reason": finish}]}

    left = Observed(
        response={"choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello!"}, "finish_reason": "stop"}]},
        chunks=[frame(role="assistant", content="Hel"), frame(content="lo"), frame(content="!", finish="stop")],
        calls=[1, 1, 1],
    )
    right = Observed(
        response={"choices": [{"index": 0, "message": {"role": "assistant", "content": "Help!"}, "finish_reason": "stop"}]},
        chunks=[frame(role="assistant", content=""), frame(content="Hel"), frame(content="p"), frame(content="!", finish="stop")],
        calls=[2, 1, 1],
    )
    found = compare("replay", left, "serve", right, request_id=request_id)
    return Examination(
        request_id, {("replay", None): left, ("serve", None): right}, found,
        calls={None: [{0: [10, 11]}, {0: [12]}, {0: [13]}]},
    )  # fmt: skip


def _one_shot_examination(request_id: str, left_text: str, right_text: str) -> Examination:
    left = Observed(response={"model": "m", "choices": [{"index": 0, "message": {"content": left_text}, "finish_reason": "stop"}]})
    right = Observed(response={"model": "n", "choices": [{"index": 0, "message": {"content": right_text}, "finish_reason": "length"}]})
    found = compare("oneshot", left, "serve-oneshot", right, request_id=request_id)
    return Examination(request_id, {("oneshot", None): left, ("serve-oneshot", None): right}, found, token_ids={0: [7, 8]})


def test_every_divergence_has_an_anchor_and_a_highlight() -> None:
    examinations = [_stream_examination(), _one_shot_examination("req-2", "a", "b")]
    divergences = [d for e in examinations for d in e.divergences]
    assert {d.field for d in divergences} >= {"content", "role_frame", "finish_reason", "model"}
    dom = _Dom(build_page(examinations, title="t", pieces={10: "Hel", 12: "p"}))
    assert sorted(dom.cards) == sorted(f"d-{n}" for n in range(1, len(divergences) + 1))
    for number, divergence in enumerate(divergences, 1):
        card = dom.cards[f"d-{number}"]
        assert (card["data-left"], card["data-right"], card["data-field"]) == (divergence.left, divergence.right, divergence.field)
        assert card["highlighted"], number
        # The frame or field it points at is highlighted in the transcript.
        targets = [link[1:] for link in card["links"] if link.startswith("#f-")]
        assert targets, f"{divergence.field}: no frame or field linked"
        assert all("hl" in dom.ids[t].get("class", "").split() for t in targets)


def test_a_stream_divergence_is_shown_at_the_call_it_starts() -> None:
    examination = _stream_examination()
    dom = _Dom(build_page([examination], title="t", pieces={10: "Hel", 12: "p"}))
    number = next(n for n, d in enumerate(examination.divergences, 1) if d.field == "content")
    text = dom.card_text(f"d-{number}")
    assert "token ids in call 2" in text and "12" in text and "p" in text
    assert '"Hello"' in text and '"Help"' in text  # the text emitted so far, each side
    rows = [dom.ids[link[1:]] for link in dom.cards[f"d-{number}"]["links"] if link.startswith("#f-")]
    assert len(rows) == 1 and rows[0]["tag"] == "tr"
    role = next(n for n, d in enumerate(examination.divergences, 1) if d.field == "role_frame")
    assert "token ids in call 1" in dom.card_text(f"d-{role}")


def test_values_are_escaped() -> None:
    hostile = '</script><script>alert(1)</script><b>&amp; é🙂 \udc80 \x00'
    examination = _one_shot_examination(hostile, hostile, "plain")
    page = build_page([examination], title=hostile, subtitle=hostile, skipped=[(hostile, hostile)])
    page.encode()  # no lone surrogate reaches the file
    dom = _Dom(page)
    assert dom.scripts == 1
    text = dom.card_text("d-1")
    assert "</script><script>alert(1)</script><b>&amp; é🙂" in text
    assert "\\udc80" in text and "\\u0000" in text
    assert dom.cards["d-1"]["data-request"] == hostile.replace("\udc80", "\\udc80").replace("\x00", "\\u0000")


def test_a_timestamp_in_one_second_counts_no_field_equal() -> None:
    """Both answers' ``created`` in one second or not (which hangs on how
    long the paths between took: a window of requests, a worker's chunk),
    the page is the same but for the values: a drawn field is never counted
    equal on both sides, nor hidden with the equal ones."""

    def page(left_created: int, right_created: int) -> str:
        left = Observed(response={"id": "a", "created": left_created, "model": "m", "choices": [{"index": 0, "message": {"content": "x"}}]})
        right = Observed(response={"id": "a", "created": right_created, "model": "m", "choices": [{"index": 0, "message": {"content": "y"}}]})
        found = compare("oneshot", left, "serve-oneshot", right, request_id="r")
        return build_page([Examination("r", {("oneshot", None): left, ("serve-oneshot", None): right}, found)], title="t")

    apart, together = page(1000, 1001), page(1000, 1000)
    assert together == apart.replace("1001", "1000")
    assert "response fields (3 shown, 1 equal on both sides" in together  # content, id, created; model


def test_the_page_grows_linearly() -> None:
    """10,000 divergences: ten times the page of 1,000, one section each."""

    def examinations(requests: int) -> list[Examination]:
        found = [_stream_examination(f"s-{n}") for n in range(requests)]
        return [*found, *(_one_shot_examination(f"o-{n}", "x" * n, "y") for n in range(requests))]

    per_pair = sum(len(e.divergences) for e in examinations(1))
    small, large = (build_page(examinations(n), title="t") for n in (1000 // per_pair, 10000 // per_pair))
    assert 9 < len(large) / len(small) < 11.5
    assert large.count('class="div"') == 10 * small.count('class="div"')
    assert large.count("<details class=\"request\"") == 10 * small.count("<details class=\"request\"")


def test_no_divergences() -> None:
    dom = _Dom(build_page([Examination("r", divergences=[])], title="t"))
    assert not dom.cards


# --- the command line -------------------------------------------------------------------


def _frames_sse(path: Path, texts: list[str], token_ids: list[list[int]]) -> None:
    """A stream's SSE transcript: one frame per text, with its token ids."""
    events = []
    for number, (text, ids) in enumerate(zip(texts, token_ids, strict=True)):
        finish = "stop" if number == len(texts) - 1 else None
        chunk = {"id": "chatcmpl-r", "object": "chat.completion.chunk", "created": 1, "model": "m",
                 "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish, "token_ids": ids}]}  # fmt: skip
        events.append(f"data: {json.dumps(chunk)}\n\n")
    path.write_text("".join(events) + "data: [DONE]\n\n")


def test_diff_html(tmp_path: Path) -> None:
    """`derender diff --html`: the stream's frames side by side, the frame
    the text parts at highlighted, with the token ids the frames carry."""
    _frames_sse(tmp_path / "a.sse", ["Hel", "lo", "!"], [[1], [2], [3]])
    _frames_sse(tmp_path / "b.sse", ["Hel", "p<x>", "!"], [[1], [4], [3]])
    page, report = tmp_path / "diff.html", tmp_path / "diff.jsonl"
    done = run_cli("diff", str(tmp_path / "a.sse"), str(tmp_path / "b.sse"), "--html", str(page), "--report", str(report))
    assert done.returncode == 1, done.stderr
    lines = [json.loads(line) for line in report.read_text().splitlines()]
    assert [line["field"] for line in lines] == ["content", "token_ids"]
    dom = _Dom(page.read_text())
    for number, line in enumerate(lines, 1):
        card = dom.cards[f"d-{number}"]
        assert card["highlighted"] and card["data-field"] == line["field"]
        text = dom.card_text(f"d-{number}")
        assert "frame 2" in text and '"Hello"' in text and '"Help<x>"' in text
        assert "token ids in expected’s frame 2" in text and "token ids in actual’s frame 2" in text

    stdout = run_cli("diff", str(tmp_path / "a.sse"), str(tmp_path / "b.sse"), "--html", "-", "-q")
    assert stdout.returncode == 1 and stdout.stdout.startswith(b"<!DOCTYPE html>")
    both = run_cli("diff", str(tmp_path / "a.sse"), str(tmp_path / "b.sse"), "--html", "-", "--report", "-")
    assert both.returncode == 2 and b"only one of them" in both.stderr and not both.stdout


def _dump_dom(page: Path, anchor: str = "") -> str:
    """The page's DOM after its script ran, from headless Chromium with the
    network off (a closed proxy, no name resolution), opened at `anchor`."""
    assert CHROMIUM is not None
    with tempfile.TemporaryDirectory() as profile:
        done = subprocess.run(
            [
                CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                f"--user-data-dir={profile}", "--proxy-server=127.0.0.1:9", "--host-resolver-rules=MAP * ~NOTFOUND",
                "--virtual-time-budget=5000", "--dump-dom", page.as_uri() + anchor,
            ],
            capture_output=True, timeout=180,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.decode()


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (.ci/run installs Debian's)")
def test_the_sample_page_in_a_browser(tmp_path: Path) -> None:
    """The sample's 22 divergences, each shown at its anchor and highlighted
    in the page as Chromium builds it, from a file, loading nothing."""
    page, report = tmp_path / "parity.html", tmp_path / "parity.jsonl"
    done = run_cli("parity", "sample_data/stream.jsonl", *SAMPLE_FLAGS, "--html", str(page), "--report", str(report))
    assert done.returncode == 1, done.stderr[-2000:]
    lines = [json.loads(line) for line in report.read_text().splitlines()]
    assert len(lines) == 22
    source = page.read_text()
    assert "http://" not in source and "https://" not in source
    dumped = _dump_dom(page)
    assert 'data-ready="22"' in dumped and ">22 of 22 shown<" in dumped  # the script ran
    dom = _Dom(dumped)
    assert all(url.startswith("#") for url in dom.urls), [u for u in dom.urls if not u.startswith("#")]
    assert sorted(dom.cards, key=lambda a: int(a[2:])) == [f"d-{n}" for n in range(1, 23)]
    for number, line in enumerate(lines, 1):
        card = dom.cards[f"d-{number}"]
        assert (card["data-request"], card["data-left"], card["data-right"], card["data-field"]) == (
            line["request_id"], line["left"], line["right"], line["field"]
        ), number
        assert card["highlighted"], number
    # A request's section is collapsed (the first one aside); a link to a
    # divergence in it opens it.
    assert dom.cards["d-1"]["open"] and not dom.cards["d-22"]["open"]
    assert _Dom(_dump_dom(page, "#d-22")).cards["d-22"]["open"]
    # Every divergence between two transcripts points at highlighted frames.
    for number, line in enumerate(lines, 1):
        if line["left"] != "record":
            targets = [link[1:] for link in dom.cards[f"d-{number}"]["links"] if link.startswith("#f-")]
            assert targets and all("hl" in dom.ids[t].get("class", "").split() for t in targets), (number, line)
    # Each row pairs the frames of one call: serve's frame for a call sits on
    # that call's row (serve sends it once the next call has come), so both
    # sides emit the same text on every row, and only the rows a divergence
    # is at are highlighted (not every row, as a row late would make them).
    serve_pairs = [section for section in _Transcripts(dumped).sections if section.title == "replay vs serve"]
    assert [section.request for section in serve_pairs] == ["stream-speculative-unicode", "stream-n2", "stream-tool-call"]
    for section in serve_pairs:
        texts = [(_emitted(cells[-2]), _emitted(cells[-1])) for _, cells in section.rows]
        assert all(left == right for left, right in texts), (section.request, texts)
        assert sum(1 for left, _ in texts if left) >= 4
        highlighted = [k + 1 for k, (marked, _) in enumerate(section.rows) if marked]
        assert 0 < len(highlighted) < len(section.rows) * 0.6, (section.request, highlighted)
        assert 1 in highlighted  # the role frame, every stream's first divergence
    # The header says how the streams ran: each with the input's own chunking.
    header = dumped[: dumped.index("</header>")]
    assert "stream chunking: the input's own" in header.replace("&#x27;", "'") and "chunking 1" not in header
