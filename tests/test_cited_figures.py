"""Figures quoted in README, the docs and the notebooks match the recorded results they cite (tests/citations.py
says how a figure is cited, docs/dev/citing-figures.md how to write one); in the prose listed in STRICT a figure
without a citation fails too."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests import citations

REPO = Path(__file__).resolve().parents[1]

#: Prose where every figure must cite its record (README's demo table is generated from its record and checked by
#: the report's own test, so its block is not read here).
STRICT = ["README.md", "docs/facilitator.md", "docs/troubleshooting.md", "docs/glossary.md",
          "docs/further-reading.md"]
#: Everything else a learner reads: a figure that cites a record must match it (uncited ones are not yet errors
#: here; a file moves to STRICT once all its figures cite their records).
CITED = sorted({str(p.relative_to(REPO)) for p in [*(REPO / "docs").glob("*.md"),
                                                    *(REPO / "notebooks").glob("[0-9][0-9]-*.py"),
                                                    *(REPO / "notebooks" / "answers").glob("[0-9][0-9]-*.py")]}
                - set(STRICT))


@pytest.mark.parametrize("name", STRICT)
def test_every_quoted_figure_cites_its_recorded_result_and_matches_it(name: str) -> None:
    found, _ = citations.problems([REPO / name], REPO)
    assert not found, "figures that do not match what they cite, or cite nothing:\n" + "\n".join(found)


def test_readmes_demo_table_is_what_its_record_gives() -> None:
    """README's demo table is generated (pdlab.report.readme): regenerated from the record its marker names, it is
    unchanged."""
    from pdlab.report import readme

    text = (REPO / "README.md").read_text()
    if not readme.MARKER.search(text):
        pytest.skip("README's demo table has no <!-- headline: RECORD --> marker yet")
    assert readme.render(text, REPO) == text, ("README's demo table differs from its record: "
                                               "`python -m pdlab.report.readme` regenerates it")


def test_readmes_course_total_is_the_sum_of_its_rows() -> None:
    """README's course table ends with the total minutes: the sum of the notebooks' recorded times, at the precision
    written."""
    readme = (REPO / "README.md").read_text()
    rows = re.findall(r"^\| \[(\d\d-[\w-]+)\]\(notebooks/.*<!-- cite (\S+): -, (\S+) / 60", readme, re.M)
    assert len(rows) == len(list((REPO / "notebooks").glob("[0-9][0-9]-*.py"))), rows
    total = sum(citations.evaluate(expr, citations.load_data(REPO / path)) / 60 for _, path, expr in rows)
    written = re.search(r"^\| \*\*all nine\*\* \| ([\d.]+) \|", readme, re.M)
    assert written, "README's course table has no total row"
    assert round(total) == float(written.group(1)), \
        f"the notebooks' minutes add up to {total:.1f}, README says {written.group(1)}"


def test_cited_figures_in_the_other_docs_and_the_notebooks_match() -> None:
    found, _ = citations.problems([REPO / name for name in CITED], REPO, uncited=False)
    assert not found, "figures that do not match what they cite:\n" + "\n".join(found)


@pytest.fixture
def tiny_repo(tmp_path: Path) -> Path:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "run.json").write_text(json.dumps(
        {"summary": {"idle": {"xfer_ms": 12.35}, "busy": {"xfer_ms": 1052.7}}, "trials": [{"bytes": 50331648}]}))
    return tmp_path


def check(repo: Path, text: str) -> tuple[list[str], int]:
    (repo / "doc.md").write_text(text)
    return citations.problems([repo / "doc.md"], repo)


def test_a_matching_citation_passes(tiny_repo: Path) -> None:
    found, checked = check(tiny_repo, "Idle it took 12.4 ms, busy ~1 s and 50.3 MB moved "
                                      "<!-- cite data/run.json: summary.idle.xfer_ms, summary.busy.xfer_ms / 1000, "
                                      "trials.0.bytes / 1e6 -->.\n")
    assert found == [] and checked == 3


def test_a_figure_that_differs_from_the_record_fails(tiny_repo: Path) -> None:
    found, _ = check(tiny_repo, "Idle it took 12.5 ms <!-- cite data/run.json: summary.idle.xfer_ms -->.\n")
    assert len(found) == 1 and "12.35" in found[0] and "doc.md:1" in found[0]


def test_an_uncited_figure_fails_and_a_stated_one_passes(tiny_repo: Path) -> None:
    found, _ = check(tiny_repo, "It took 12 ms.\n\nThe course needs 2 cores and 6 GiB "
                                "<!-- stated: the pre-flight's thresholds -->.\n")
    assert len(found) == 1 and "uncited figure" in found[0] and "12 ms" in found[0]


def test_table_rows_braces_wildcards_and_skips(tiny_repo: Path) -> None:
    table = ("| what | idle | busy |\n| --- | --- | --- |\n"
             "| transfer (5x faster idle) | 12.35 | 1,053 <!-- cite data/run.json: -, "
             "summary.{idle,busy}.xfer_ms --> |\n"
             "| worst | 1,053 <!-- cite data/run.json: max(summary.*.xfer_ms) --> |\n")
    found, checked = check(tiny_repo, table)
    assert found == [] and checked == 3


def test_a_miscounted_or_broken_citation_fails(tiny_repo: Path) -> None:
    found, _ = check(tiny_repo, "12.35 and 1,053 ms <!-- cite data/run.json: summary.idle.xfer_ms -->.\n\n"
                                "12.35 ms <!-- cite data/run.json: summary.nothing -->.\n\n"
                                "12.35 ms <!-- cite data/missing.json: summary.idle.xfer_ms -->.\n")
    assert len(found) == 3, found
    assert "1 expressions for 2 numbers" in found[0] and "no key 'nothing'" in found[1] and "does not exist" in found[2]


def test_a_generated_block_is_left_to_its_own_test(tiny_repo: Path) -> None:
    found, checked = check(tiny_repo, "<!-- headline: data/run.json -->\n| | a |\n| --- | --- |\n| x (ms) | 9.9 |\n"
                                      "<!-- /headline -->\n\nIt took 12 ms.\n")
    assert checked == 0 and len(found) == 1 and "12 ms" in found[0], found


def test_code_names_and_exercises_are_not_figures(tiny_repo: Path) -> None:
    found, _ = check(tiny_repo, "Run `sleep 5s` on 1P1D with Llama-3.1-70B (p99, H200, vllm 0.32.0).\n\n"
                                "## Exercises\n\n1. Set the SLO to 20 ms.\n")
    assert found == []
