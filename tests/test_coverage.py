"""The coverage data is true and current.

Every registered parser is built into the stack on the bundled Qwen3
sample and derenders a plain answer; what it does must be what
``derender_core/coverage_probe.py`` records. The table in
``docs/families.md`` must be what the generator writes from that data, the
family matrix must match the fixtures that test it, and every known
misbehaviour must name a test that exists. ``python -m tests.update_coverage`` regenerates the data and
the table.
"""

from __future__ import annotations

import importlib
import json

import pytest

from derender_core.coverage import (
    FAMILIES,
    KNOWN_ISSUES,
    TABLE_BEGIN,
    table_rows,
    table_section,
)
from derender_core.coverage_probe import PROBED_VLLM, PROBES
from derender_core.vllm_seam.stack import registered_parsers
from tests.families import SPECS
from tests.helpers import REPO, run_cli
from tests.parser_probe import ParserProbe
from tests.update_coverage import TABLE_PAGE, coverage_section

REGENERATE = "regenerate with `python -m tests.update_coverage`"


@pytest.fixture(scope="module")
def probe() -> ParserProbe:
    return ParserProbe()


def test_every_registered_parser_is_recorded() -> None:
    import vllm

    assert vllm.__version__ == PROBED_VLLM, REGENERATE
    assert sorted(PROBES) == registered_parsers(), REGENERATE


@pytest.mark.parametrize(("kind", "name"), sorted(PROBES), ids=[f"{k}-{n}" for k, n in sorted(PROBES)])
def test_parser_on_the_qwen3_sample(probe: ParserProbe, kind: str, name: str) -> None:
    """Built into the stack on the Qwen3 sample, the parser does with a
    plain answer what the table says."""
    assert probe.outcome(kind, name) == PROBES[(kind, name)], REGENERATE


def test_families_page_table_is_current() -> None:
    assert coverage_section(TABLE_PAGE.read_text(encoding="utf-8")) == table_section(), REGENERATE


def test_the_table_lives_on_one_page() -> None:
    """No other page keeps a copy of the table that the generator would
    leave to go stale."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    holding = [page.relative_to(REPO).as_posix() for page in pages if TABLE_BEGIN in page.read_text(encoding="utf-8")]
    assert holding == [TABLE_PAGE.relative_to(REPO).as_posix()]


def test_family_matrix_matches_the_fixtures() -> None:
    """Each family in the matrix has a fixture, and runs registered parsers."""
    assert sorted(SPECS) == sorted(case.key for case in FAMILIES)
    assert len({case.key for case in FAMILIES}) == len(FAMILIES)
    for case in FAMILIES:
        for parser in case.parsers:
            assert parser in PROBES, (case.key, parser)


def test_every_known_issue_names_a_test_that_exists() -> None:
    keys = {case.key for case in FAMILIES}
    for issue in KNOWN_ISSUES:
        assert issue.case in keys
        assert issue.parser in next(case.parsers for case in FAMILIES if case.key == issue.case)
        path, function = issue.test.split("::")
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        assert callable(getattr(module, function, None)), issue.test


def test_table_lists_every_parser_once_and_tested_families_as_tested() -> None:
    rows = table_rows()
    assert [(row["kind"], row["parser"]) for row in rows] == sorted(PROBES)
    tested = {row["parser"] for row in rows if row["family"] != "untested"}
    assert tested == {name for case in FAMILIES for _, name in case.parsers}
    for row in rows:
        if row["family"] == "untested":
            assert not any(row[check] for check in ("one-shot", "stream", "live"))


def test_parsers_command_prints_the_coverage_table() -> None:
    """``derender parsers`` prints the table docs/families.md holds, for the
    parsers this vLLM registers."""
    done = run_cli("parsers")
    assert done.returncode == 0, done.stderr.decode()
    table = coverage_section(TABLE_PAGE.read_text(encoding="utf-8"))
    printed = done.stdout.decode()
    assert printed.startswith("| kind | parser |")
    assert printed.strip() in table


def test_parsers_command_writes_one_json_object_per_parser() -> None:
    from derender_cli.main import app
    from typer.testing import CliRunner

    done = CliRunner().invoke(app, ["parsers", "--format", "jsonl"], catch_exceptions=False)
    assert done.exit_code == 0
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert rows == table_rows(registered_parsers())
    assert {row["on the Qwen3 sample"] for row in rows} != {"not probed"}
