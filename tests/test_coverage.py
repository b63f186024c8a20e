"""The coverage data is true and current.

Every registered parser is built into the stack on the bundled Qwen3
sample and derenders a plain answer; what it does must be what the installed
release's probe file (``derender_core/coverage_probe_0_33.py`` for vLLM
0.33.x) records. The tables in ``docs/families.md``, one per recorded
release, must be what the generator writes from that data, the family
matrix must match the fixtures that test it and the releases it was proven
on, and every known misbehaviour must name a test that exists. ``python -m
tests.update_coverage``, run under each supported vLLM, regenerates the data
and the tables.
"""

from __future__ import annotations

import importlib
import json

import pytest

from derender_core.coverage import (
    FAMILIES,
    KNOWN_ISSUES,
    TABLE_BEGIN,
    UNTESTED,
    probe_for,
    probe_note,
    recorded_probes,
    table_rows,
    table_section,
)
from derender_core.vllm_seam.stack import registered_parsers
from derender_core.vllm_seam.versions import installed
from tests.families import SPECS
from tests.helpers import REPO, run_cli
from tests.parser_probe import ParserProbe
from tests.update_coverage import TABLE_PAGE, coverage_section

REGENERATE = "regenerate with `python -m tests.update_coverage`"


def _installed_probes() -> dict[tuple[str, str], str]:
    """The installed release's recorded outcomes ({} when none is
    recorded: the first test says so)."""
    probe = probe_for(installed())
    return probe.outcomes if probe is not None else {}


PROBES = _installed_probes()


@pytest.fixture(scope="module")
def probe() -> ParserProbe:
    return ParserProbe()


def test_every_registered_parser_is_recorded() -> None:
    import vllm

    assert probe_note(vllm.__version__) is None, REGENERATE
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
    """Each family in the matrix has a fixture, and was proven only on
    releases that register its parsers."""
    assert sorted(SPECS) == sorted(case.key for case in FAMILIES)
    assert len({case.key for case in FAMILIES}) == len(FAMILIES)
    for case in FAMILIES:
        assert case.proven_on, case.key
        for version in case.proven_on:
            recorded = probe_for(version)
            assert recorded is not None and recorded.vllm == version, (case.key, version)
            for parser in case.parsers:
                assert parser in recorded.outcomes, (case.key, version, parser)


def test_untested_reasons_name_parsers_without_a_family() -> None:
    """A reason for no family is given only for a parser some recorded
    release registers and no family runs."""
    registered = {parser for probe in recorded_probes().values() for parser in probe.outcomes}
    run = {parser for case in FAMILIES for parser in case.parsers}
    for parser in UNTESTED:
        assert parser in registered and parser not in run, parser


def test_each_release_table_shows_its_own_parsers() -> None:
    """A release's table lists what it registers, and counts a check only
    for families proven on it: 0.34's new parsers are in 0.34's table and
    not in 0.33's, 0.33's musespark1x only in 0.33's."""
    tables = {}
    for recorded in recorded_probes().values():
        version, rows = recorded.vllm, table_rows(version=recorded.vllm)
        tables[version] = rows
        assert [(row["kind"], row["parser"]) for row in rows] == sorted(recorded.outcomes)
        for row in rows:
            proven_here = [
                case for case in FAMILIES
                if (row["kind"], row["parser"]) in case.parsers and version in case.proven_on
            ]  # fmt: skip
            assert bool(row["one-shot"]) == bool(proven_here), (version, row["parser"])
            if row["family"].startswith("untested"):
                assert not row["tests passed on vLLM"]
    if {"0.33.0", "0.34.0"} <= set(tables):
        parsers = {version: {(row["kind"], row["parser"]) for row in rows} for version, rows in tables.items()}
        assert ("tool", "musespark1x") in parsers["0.33.0"] and ("tool", "musespark1x") not in parsers["0.34.0"]
        for new in [("tool", "granite_toolcall_parser"), ("tool", "ripple"), ("reasoning", "zaya"), ("tool", "musespark")]:
            assert new in parsers["0.34.0"] and new not in parsers["0.33.0"], new
        granite = {row["parser"]: row for row in tables["0.34.0"]}["granite_toolcall_parser"]
        assert (granite["family"], granite["one-shot"], granite["stream"], granite["live"]) == ("Granite 4.2", "yes", "yes", "yes")
        assert {row["parser"]: row for row in tables["0.34.0"]}["ripple"]["family"].startswith("untested: no ")
        # llama3_json's one-shot no longer extracts a call after text on 0.34.
        llama = {version: {row["parser"]: row for row in rows}["llama3_json"] for version, rows in tables.items()}
        assert "one-shot extracts the call" in llama["0.33.0"]["known vLLM misbehaviour"]
        assert "one-shot extracts the call" not in llama["0.34.0"]["known vLLM misbehaviour"]


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
    tested = {row["parser"] for row in rows if not row["family"].startswith("untested")}
    assert tested == {name for case in FAMILIES for _, name in case.parsers if set(case.parsers) <= set(PROBES)}
    for row in rows:
        if row["family"].startswith("untested"):
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
    assert done.stderr.decode().count("coverage data") == 0, done.stderr.decode()


def test_parsers_command_writes_one_json_object_per_parser() -> None:
    from derender_cli.main import app
    from typer.testing import CliRunner

    done = CliRunner().invoke(app, ["parsers", "--format", "jsonl"], catch_exceptions=False)
    assert done.exit_code == 0
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert rows == table_rows(registered_parsers())
    assert {row["on the Qwen3 sample"] for row in rows} != {"not probed"}


def test_a_release_without_recorded_data_is_named_and_shows_nothing_proven() -> None:
    """On a vLLM no probe was recorded for, the parsers it registers are
    listed as not probed, no family counts as proven, and the note says
    why; on another version of a recorded release the note names the one
    recorded."""
    registered = [("tool", "hermes"), ("reasoning", "qwen3"), ("tool", "brand_new")]
    rows = table_rows(registered, version="0.99.0")
    assert [(row["kind"], row["parser"]) for row in rows] == sorted(registered)
    assert {row["on the Qwen3 sample"] for row in rows} == {"not probed"}
    assert not any(row[check] for row in rows for check in ("one-shot", "stream", "live", "decode"))
    assert {row["parser"]: row["family"] for row in rows}["hermes"] == "Qwen3"
    note = probe_note("0.99.0")
    assert note is not None and note.startswith("no coverage data recorded for vLLM 0.99.0 (recorded: ")
    assert "python -m tests.update_coverage" in note
    first = next(iter(recorded_probes().values())).vllm
    later = first.rsplit(".", 1)[0] + ".99"
    assert probe_note(later) == f"coverage data recorded on vLLM {first}; this is vLLM {later}"
    assert probe_note(first) is None
