"""The design doc stays a design doc, and every measured figure says where it comes from: the rule
of docs/PERFORMANCE.md ("How to read a figure") checked on the files."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

DOCS = Path(__file__).resolve().parents[2] / "docs"
TIMING = re.compile(r"\b\d+(\.\d+)? ?(ms|us|µs|tok/s|tokens/s|GB/s|MB/s|s/token)\b")
UNMEASURED = {"Machines", "Contents", "Not measured"}


def timing_figures(text: str) -> list[str]:
    """Lines of ``text`` that quote a timing or a rate."""
    return [line for line in text.splitlines() if TIMING.search(line)]


def _complete(paragraph: str) -> bool:
    return bool(re.search(r"\bDates? 20\d\d-", paragraph)) and all(k in paragraph for k in ("CPU", "ommand", "ommit"))


def undated_sections(text: str) -> list[str]:
    """The ``## `` sections of a PERFORMANCE.md text that lack, for some figure, its date, CPU,
    command or commit: a paragraph giving a date must give the other three; a table must have
    date and commit columns, its section naming the CPU and the command; a section with neither
    has no dated figure. A table after a complete dated paragraph of its section is that paragraph's."""
    bad = []
    for section in re.split(r"^## ", text, flags=re.M)[1:]:
        title, _, body = section.partition("\n")
        title = title.strip()
        if title in UNMEASURED:
            continue
        ok, figures, dated_before = True, 0, False
        for p in body.split("\n\n"):
            p = p.strip()
            if p.startswith("|"):   # a table: its own date and commit columns, or a dated paragraph before it
                header = p.splitlines()[0].lower()
                own = "date" in header and "commit" in header and all(k in body.lower() for k in ("cpu", "command"))
                ok &= own or dated_before
                figures += 1
            elif re.search(r"\bDates? 20\d\d-", p):
                ok &= _complete(p)
                dated_before |= _complete(p)
                figures += 1
        if not figures or not ok:
            bad.append(title)
    return bad


def test_the_architecture_doc_is_short_and_quotes_no_timing():
    text = (DOCS / "ARCHITECTURE.md").read_text()
    assert len(text.splitlines()) <= 300
    assert timing_figures(text) == []


def test_every_performance_section_dates_its_figures():
    assert undated_sections((DOCS / "PERFORMANCE.md").read_text()) == []


def test_the_checks_can_fail():
    assert timing_figures("a pass takes 12 ms\nno figure here") == ["a pass takes 12 ms"]
    doc = ("## Machines\nx\n\n## Good\n**A.** Date 2026-11-25 · CPU: EPYC · command: `x` · commit abc.\n\n"
           "## No commit\n**B.** Date 2026-11-25 · CPU: EPYC · command: `x`.\n\n## Nothing dated\ntext\n\n"
           "## Table\nCPU: EPYC, command `y`.\n\n| figure | date | commit |\n|---|---|---|\n| 1 | d | c |\n\n"
           "## Bare table\n| figure | value |\n|---|---|\n| 1 | 2 |\n\n"
           "## Table under a dated paragraph\nDate 2026-11-25 · CPU: x · command: `y` · commit z.\n\ntext\n\n"
           "| a | b |\n|---|---|\n| 1 | 2 |\n")
    assert undated_sections(doc) == ["No commit", "Nothing dated", "Bare table"]
