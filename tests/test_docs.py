"""The README and the pages under docs/ stay true.

Docs rot in two ways: a link or an anchor stops resolving when a page or a
heading moves, and a command stops working (or stops printing what the page
says) when the code changes. So every relative link must name a file that
exists and, with an anchor, a heading of that file; and every ```console
block runs as written, in a scratch directory holding a copy of the sample,
and must exit and print as shown. The conventions are documented in
docs/development.md ("Docs that run").
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

import pytest

from derender_core.vllm_seam import versions
from tests.helpers import REPO, SAMPLE, offline_env

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
CI_SCRIPT = REPO / ".ci" / "run"
BIN = Path(sys.executable).parent  # the installed `derender`, and the `python` blocks call
SHELL_LANGUAGES = {"", "bash", "sh", "shell"}
COMMAND_TIMEOUT = 300


# --- reading Markdown ---------------------------------------------------------


@dataclass(frozen=True)
class Block:
    """A fenced code block: its language and text, and where it starts."""

    page: Path
    line: int
    language: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO) if self.page.is_relative_to(REPO) else self.page.name}:{self.line}"


_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([^\s`]*)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")


def split_markdown(markdown: str, page: Path = Path("page.md")) -> tuple[str, list[Block]]:
    """The prose, with every fenced block's lines left empty (so line numbers
    hold), and the fenced blocks themselves. Code is not prose: a ``# exit 1``
    in a shell block is no heading, a ``[x](y)`` in one no link."""
    prose: list[str] = []
    blocks: list[Block] = []
    lines = markdown.split("\n")
    index = 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if not opening:
            prose.append(lines[index])
            index += 1
            continue
        fence, language, start = opening[1], opening[2].lower(), index
        closing = re.compile(rf"^ {{0,3}}{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        body: list[str] = []
        index += 1
        while index < len(lines) and not closing.match(lines[index]):
            body.append(lines[index])
            index += 1
        blocks.append(Block(page, start + 1, language, "\n".join(body)))
        prose.extend([""] * (len(body) + 2))
        index += 1
    return "\n".join(prose[: len(lines)]), blocks


def _blank(text: str) -> str:
    """The same length and line breaks, no content."""
    return re.sub(r"[^\n]", " ", text)


def without_inline_code(prose: str) -> str:
    """Prose with code spans and HTML comments blanked: a backtick run opens
    a span that the next run of the same length closes, within a paragraph
    (CommonMark's rule); an unclosed run is literal text."""
    prose = re.sub(r"<!--.*?-->", lambda found: _blank(found[0]), prose, flags=re.S)
    out: list[str] = []
    index = 0
    while index < len(prose):
        if prose[index] != "`":
            out.append(prose[index])
            index += 1
            continue
        end = index
        while end < len(prose) and prose[end] == "`":
            end += 1
        run = prose[index:end]
        closing = re.compile(rf"(?<!`){run}(?!`)").search(prose, end)
        if closing and not re.search(r"\n[ \t]*\n", prose[end : closing.start()]):
            out.append(_blank(prose[index : closing.end()]))
            index = closing.end()
        else:
            out.append(run)
            index = end
    return "".join(out)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its text as rendered (link text,
    no tags), lowercased, punctuation other than ``-`` and ``_`` dropped,
    each space a ``-``."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """Every heading's anchor; a repeated one is numbered as GitHub numbers
    it (``x``, ``x-1``, ``x-2``)."""
    prose, _ = split_markdown(markdown)
    seen: dict[str, int] = {}
    found = set()
    for line in prose.split("\n"):
        heading = _HEADING.match(line)
        if not heading:
            continue
        slug = github_slug(heading[2])
        found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return found


_INLINE_LINK = re.compile(r"\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE_LINK = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
_EXTERNAL = re.compile(r"^(?:[a-zA-Z][a-zA-Z0-9+.-]*:|//)")


def links(markdown: str) -> list[tuple[int, str]]:
    """Every link target outside code, with its line: inline links and
    images (their text may span lines) and reference definitions."""
    prose = without_inline_code(split_markdown(markdown)[0])
    found = [(found.start(), found[1]) for found in _INLINE_LINK.finditer(prose)]
    found += [(found.start(), found[1]) for found in _REFERENCE_LINK.finditer(prose)]
    return sorted((prose.count("\n", 0, offset) + 1, target) for offset, target in found)


def broken_links(page: Path, root: Path = REPO) -> list[str]:
    """Each relative link of `page` that does not resolve, and why: a file
    that is not there (or lies outside `root`), or an anchor that is no
    heading of the Markdown file it names."""
    problems = []
    for line, target in links(page.read_text(encoding="utf-8")):
        if _EXTERNAL.match(target):
            continue
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / unquote(path_part)).resolve() if path_part else page.resolve()
        where = f"{page.name}:{line}: {target}"
        if not resolved.is_relative_to(root.resolve()):
            problems.append(f"{where}: outside the repository")
        elif not resolved.exists():
            problems.append(f"{where}: no such file")
        elif anchor and resolved.suffix != ".md":
            problems.append(f"{where}: an anchor into a file that is not Markdown")
        elif anchor and unquote(anchor) not in anchors(resolved.read_text(encoding="utf-8")):
            problems.append(f"{where}: no heading with this anchor")
    return problems


# --- console blocks -------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    """One ``$ `` command of a console block: what it runs, the status it
    must exit with, and the output shown after it (None: not compared)."""

    text: str
    exit: int
    output: str | None


_EXIT = re.compile(r"#\s*exit\s+(\d+)\s*$")


def console_commands(block: str) -> list[Command]:
    """The commands of a console block. ``$ `` starts a command; a line
    ending in ``\\``, or the ``> `` lines right after a command, continue
    it; the lines after it, up to the next ``$ ``, are its output."""
    commands: list[tuple[list[str], list[str]]] = []
    continued = False
    for line in block.split("\n"):
        if line.startswith("$ "):
            commands.append(([line[2:]], []))
        elif not commands:
            raise ValueError(f"a console block must start with a `$ ` command, not {line!r}")
        elif continued or (line.startswith("> ") and not commands[-1][1]):
            commands[-1][0].append(line if continued else line[2:])
        else:
            commands[-1][1].append(line)
        continued = commands[-1][0][-1].endswith("\\") and not commands[-1][1]
    parsed = []
    for text_lines, output_lines in commands:
        status = _EXIT.search(text_lines[-1])
        output = "\n".join(output_lines)
        shown = output if output.strip() else None
        parsed.append(Command("\n".join(text_lines), int(status[1]) if status else 0, shown))
    if not parsed:
        raise ValueError("an empty console block")
    return parsed


def _normalized(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.split("\n")).rstrip("\n")


def output_matches(shown: str, printed: str) -> bool:
    """Whether `printed` is what the page shows: equal, but for `...`,
    which stands for any text (within a line or across lines), and trailing
    spaces and blank lines."""
    pattern = ".*?".join(re.escape(part) for part in _normalized(shown).split("..."))
    return re.fullmatch(pattern, _normalized(printed), flags=re.S) is not None


def starts_a_server(block: Block) -> bool:
    return any(re.match(r"derender server start\b", command.text) for command in console_commands(block.text))


def block_env(server_directory: Path, *, server: bool) -> dict[str, str]:
    """Offline, the installed tools first on PATH, and a server directory of
    the block's own, so it never reaches a server the user runs; fresh calls
    unless the block starts a server itself."""
    env = offline_env(
        PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        DERENDER_SERVER_DIR=str(server_directory),
        DERENDER_NO_SERVER="1",
    )
    if server:
        del env["DERENDER_NO_SERVER"]
    return env


def _without_fast_paths_notice(printed: str, shown: str | None) -> str:
    """The pages show what derender prints with every fast path on. Where
    one is off (a vLLM release they were not proven on), each run adds the
    one line that says so: left out, unless the page shows it."""
    notice = versions.notice()
    if notice is None or (shown is not None and "fast paths off" in shown):
        return printed
    return printed.replace(f"derender: {notice}\n", "")


def run_console_block(block: Block, workdir: Path, env: dict[str, str]) -> list[str]:
    """Run the block's commands in turn in `workdir`; the first command that
    exits or prints otherwise than shown ends it. Returns what went wrong."""
    for number, command in enumerate(console_commands(block.text), 1):
        done = subprocess.run(
            ["bash", "-o", "pipefail", "-c", command.text],
            cwd=workdir,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=COMMAND_TIMEOUT,
        )
        printed = _without_fast_paths_notice(done.stdout.decode("utf-8", errors="replace"), command.output)
        about = f"{block.where}, command {number}: {command.text}"
        if done.returncode != command.exit:
            return [f"{about}\nexited {done.returncode}, not {command.exit}; it printed:\n{printed[-4000:]}"]
        if command.output is not None and not output_matches(command.output, printed):
            return [f"{about}\nprinted:\n{printed[-4000:]}\nwhere the page shows:\n{command.output}"]
    return []


# --- what the pages hold ------------------------------------------------------


def blocks_of(pages: list[Path]) -> list[Block]:
    return [block for page in pages for block in split_markdown(page.read_text(encoding="utf-8"), page)[1]]


CONSOLE_BLOCKS = [block for block in blocks_of(PAGES) if block.language == "console"]


def ci_quick_start() -> list[str]:
    """The commands `.ci/run` runs as the README's quick start, less the
    redirect it adds to check the output and the status it keeps to run
    its later passes."""
    script = CI_SCRIPT.read_text(encoding="utf-8").split("\n")
    commands = []
    for number in (1, 2):
        comment = next(i for i, line in enumerate(script) if line.startswith(f"# README quick start, command {number}"))
        command = re.sub(r'\s*>\s*"\$venv/[^"]*"$', "", script[comment + 1])
        commands.append(re.sub(r"\s*\|\|\s*status=\$\?$", "", command))
    return commands


def readme_quick_start() -> Block:
    readme = REPO / "README.md"
    text = readme.read_text(encoding="utf-8")
    start = text.index("\n## Quick start\n")
    line = text.count("\n", 0, start) + 2
    return next(block for block in blocks_of([readme]) if block.line > line)


# --- the checkers themselves ---------------------------------------------------


@pytest.mark.parametrize(
    ("heading", "slug"),
    [
        ("Quick start", "quick-start"),
        ("Bare generate output with `--requests`", "bare-generate-output-with---requests"),
        ("What `vllm serve` sends (`--flavor serve`)", "what-vllm-serve-sends---flavor-serve"),
        ("Scale: workers, shards, Parquet, resume", "scale-workers-shards-parquet-resume"),
        ("Modes: live and replay", "modes-live-and-replay"),
        ("The [library](docs/library.md) & its_layout", "the-library--its_layout"),
    ],
)
def test_github_slug(heading: str, slug: str) -> None:
    assert github_slug(heading) == slug


def test_link_checker_reports_each_broken_link(tmp_path: Path) -> None:
    """Only the links that do not resolve are reported; code is neither
    links nor headings."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text(
        "# Other page\n\n## Bare generate output with `--requests`\n\n## Twice\n\n## Twice\n",
        encoding="utf-8",
    )
    (tmp_path / "data.txt").write_text("not markdown\n", encoding="utf-8")
    page = tmp_path / "README.md"
    page.write_text(
        "# Title\n\n"
        "## A section\n\n"
        "[fine](docs/other.md) [fine](docs/other.md#bare-generate-output-with---requests)\n"
        "[fine](docs/other.md#twice-1) [fine](#a-section) [fine](https://example.com/x.md)\n"
        "[a link over\ntwo lines](docs/other.md#twice)\n"
        "[missing](docs/gone.md)\n"
        "[bad anchor](docs/other.md#twice-2)\n"
        "[bad anchor here](#not-a-section)\n"
        "[anchor into text](data.txt#L1)\n"
        "[escaping](../elsewhere.md)\n"
        "`[in code](docs/gone.md)` and <!-- [in a comment](docs/gone.md) -->\n\n"
        "```bash\n"
        "# exit 1\n"
        "echo '[in a block](docs/gone.md)'\n"
        "```\n\n"
        "[heading in a block](#exit-1)\n"
        "[ref]: docs/also-gone.md\n",
        encoding="utf-8",
    )
    assert broken_links(page, root=tmp_path) == [
        "README.md:9: docs/gone.md: no such file",
        "README.md:10: docs/other.md#twice-2: no heading with this anchor",
        "README.md:11: #not-a-section: no heading with this anchor",
        "README.md:12: data.txt#L1: an anchor into a file that is not Markdown",
        "README.md:13: ../elsewhere.md: outside the repository",
        "README.md:21: #exit-1: no heading with this anchor",
        "README.md:22: docs/also-gone.md: no such file",
    ]


def test_console_commands_are_read_with_their_status_and_output() -> None:
    block = (
        "$ derender chat in.jsonl \\\n"
        "    -o out.jsonl  # exit 1\n"
        "derender: 5 records, 5 errors in ...\n"
        "$ for n in 1 2; do\n"
        ">   echo $n\n"
        "> done\n"
        "1\n"
        "2\n"
        "$ touch quiet"
    )
    assert console_commands(block) == [
        Command("derender chat in.jsonl \\\n    -o out.jsonl  # exit 1", 1, "derender: 5 records, 5 errors in ..."),
        Command("for n in 1 2; do\n  echo $n\ndone", 0, "1\n2"),
        Command("touch quiet", 0, None),
    ]
    with pytest.raises(ValueError):
        console_commands("output with no command")


@pytest.mark.parametrize(
    ("shown", "printed", "matches"),
    [
        ("4\n", "4\n\n", True),
        ("derender: 4 records in ... s", "derender: 4 records in 0.02 s   ", True),
        ("...\nlast line", "a table\nof rows\nlast line\n", True),
        ("4", "5", False),
        ("first\n...", "second\nthird", False),
        ("a (b) [c]", "a (b) [c]", True),
        ("a (b)", "a  b", False),
    ],
)
def test_output_matching(shown: str, printed: str, matches: bool) -> None:
    assert output_matches(shown, printed) is matches


def test_the_runner_fails_a_block_that_is_wrong(tmp_path: Path) -> None:
    """A command that exits otherwise than shown, or prints otherwise, fails
    its block; one that does as shown passes."""
    env = block_env(tmp_path, server=False)

    def problems(text: str) -> list[str]:
        return run_console_block(Block(tmp_path / "page.md", 1, "console", text), tmp_path, env)

    assert problems("$ echo hi > f\n$ cat f\nhi\n$ false  # exit 1\n$ exit 3  # exit 3") == []
    assert "exited 1, not 0" in problems("$ false")[0]
    assert "exited 0, not 1" in problems("$ true  # exit 1")[0]
    assert "where the page shows:\nbye" in problems("$ echo hi\nbye")[0]
    assert "exited 1, not 0" in problems("$ false | cat")[0], "a pipeline fails when any part of it does"
    assert problems("$ command -v derender\n...derender") == [], "the installed derender is on PATH"


# --- the pages ------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(REPO).as_posix())
def test_links_resolve(page: Path) -> None:
    assert broken_links(page) == []


def linked_files(page: Path) -> set[Path]:
    return {(page.parent / target.partition("#")[0]).resolve() for _, target in links(page.read_text(encoding="utf-8"))}


def test_readme_links_every_page_and_every_page_links_back() -> None:
    readme = REPO / "README.md"
    for page in PAGES[1:]:
        assert page.resolve() in linked_files(readme), f"README.md does not link {page.relative_to(REPO)}"
        assert readme.resolve() in linked_files(page), f"{page.relative_to(REPO)} does not link back to README.md"


def test_no_issue_numbers() -> None:
    """The pages describe the tool, not its tracker: no `#12`, no "issue 12"."""
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        found = re.findall(r"(?<![\w&/])#\d+\b|\bissues?\s+#?\d+", text, flags=re.I)
        assert found == [], f"{page.relative_to(REPO)}: {found}"


def test_quick_start_is_what_ci_runs() -> None:
    """`.ci/run` installs and tests exactly as the README tells a new user."""
    block = readme_quick_start()
    assert block.language == "bash"
    assert block.text.split("\n") == ci_quick_start()


def test_every_command_over_the_sample_is_run() -> None:
    """A shell block that names the bundled sample is a console block, so
    this test runs it; only the quick start is not (CI runs that)."""
    quick_start = readme_quick_start()
    unrun = [
        block.where
        for block in blocks_of(PAGES)
        if block.language in SHELL_LANGUAGES and "sample_data/" in block.text and block != quick_start
    ]
    assert unrun == []
    assert {block.page.name for block in CONSOLE_BLOCKS} >= {"README.md", "parity.md", "formats.md"}


@pytest.fixture
def sample_copy(tmp_path: Path) -> Path:
    """A scratch directory with its own copy of the sample: blocks write
    their outputs there, and nothing they do reaches the repository."""
    shutil.copytree(SAMPLE, tmp_path / "sample_data")
    return tmp_path


@pytest.fixture
def server_directory() -> Iterator[Path]:
    """A private `derender server` directory (mode 0700, a short path for
    the socket)."""
    directory = Path(tempfile.mkdtemp(prefix="derender-docs-"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.parametrize("block", CONSOLE_BLOCKS, ids=lambda block: block.where)
def test_console_block_runs_as_shown(block: Block, sample_copy: Path, server_directory: Path) -> None:
    assert shutil.which("jq"), "the docs' console blocks need jq"
    server = starts_a_server(block)
    env = block_env(server_directory, server=server)
    derender = str(BIN / "derender")
    try:
        assert run_console_block(block, sample_copy, env) == []
        if server:
            still = subprocess.run([derender, "server", "status"], env=env, capture_output=True, timeout=60)
            assert still.returncode != 0, f"{block.where} starts a server and leaves it running"
    finally:
        if server:
            subprocess.run([derender, "server", "stop"], env=env, capture_output=True, timeout=120)
