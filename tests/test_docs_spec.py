"""docs/spec.md is the contract the code cites: every `SPEC §N` must name one of its sections.

Also: no file points outside the repository, and no doc or comment cites an internal issue
number. Plain text scans over the files git knows about (tracked, plus new files not ignored).
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SPEC_PAGE = ROOT / "docs" / "spec.md"
THIS_FILE = Path(__file__).resolve().relative_to(ROOT).as_posix()

CITING_SUFFIXES = (".py", ".md", ".yaml", ".toml", ".txt")

#: One section label: "3", "3b", "6d".
SECTION = r"\d+[a-z]?"
#: What may join two labels of one citation: a range dash (the second § optional), or a list
#: separator (the second § required, so "SPEC §6, 10 seeds" is not read as a list).
_NEXT = rf"(?:\s*[–—-]\s*§?{SECTION}|\s*(?:,|/|;|\band\b|\bor\b|&)\s*§{{1,2}}{SECTION})"
#: "SPEC §3b", "SPEC.md §2–5", "SPEC §§2–5", "SPEC §2–§6d", "SPEC §6, §6c, §6d", "SPEC §2/§8",
#: "SPEC's §6", and the §-less "SPEC 6c" of the YAML comments (one digit, so that "SPEC's 200"
#: is a number, not a section).
CITATION = re.compile(rf"\bSPEC(?:\.md)?(?:'s)?\s+(?:§{{1,2}}\s*({SECTION}{_NEXT}*)|(\d[a-z]?)(?!\w))")
#: A bare "§3b" — checked only inside docs/spec.md, where it is a cross-reference.
BARE = re.compile(rf"§\s*({SECTION})")
HEADING = re.compile(rf"^#{{2,3}} ({SECTION})\. ", re.M)

# spelled in pieces so that this file does not itself contain what it looks for
OUTSIDE = re.compile("|".join((r"\.\./" + "shared", "shared" + "/SPEC", "shared" + "/notes",
                               "beside this " + "repository", "shared " + "folder")))
ISSUE_NUMBER = re.compile(r"\b[Ii]ssues?[ -]#?\d+\b")


def repo_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return sorted({p for p in out.splitlines() if (ROOT / p).is_file()})


def read_text(rel: str) -> str | None:
    try:
        return (ROOT / rel).read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def spec_sections(text: str) -> set[str]:
    return set(HEADING.findall(text))


def cited_sections(citation: str) -> list[str]:
    """The labels a citation names: every list item, and both ends of a range."""
    return re.findall(SECTION, citation)


def missing_citations(text: str, sections: set[str], bare: bool = False):
    """(line, citation, missing label) for every SPEC citation naming no section of the page."""
    pattern = BARE if bare else CITATION
    found = []
    for m in pattern.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        for label in cited_sections(m.group(1) or m.group(2)):
            if label not in sections:
                found.append((line, m.group(0).strip(), label))
    return found


def scan(files, pattern, skip=()):
    hits = []
    for rel in files:
        if rel in skip:
            continue
        text = read_text(rel)
        if text is None:
            continue
        for i, line in enumerate(text.splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{rel}:{i}: {line.strip()}")
    return hits


@pytest.fixture(scope="module")
def files():
    return repo_files()


@pytest.fixture(scope="module")
def sections():
    return spec_sections(SPEC_PAGE.read_text(encoding="utf-8"))


def test_spec_page_keeps_the_cited_section_numbers(sections):
    assert {"1", "2", "3", "3b", "4", "4b", "5", "6", "6b", "6c", "6d", "7", "8"} <= sections
    assert "`SPEC §N` refers to section N of this page" in SPEC_PAGE.read_text(encoding="utf-8")


@pytest.mark.parametrize("line, labels", [
    ("(SPEC §3b)", ["3b"]),
    ("SPEC §6b's regime", ["6b"]),
    ("SPEC.md §2–5", ["2", "5"]),
    ("SPEC §§2–5", ["2", "5"]),
    ("SPEC §2–§6d", ["2", "6d"]),
    ("SPEC §2–3b.", ["2", "3b"]),
    ("SPEC §6, §6c, §6d", ["6", "6c", "6d"]),
    ("SPEC §6c and §6d", ["6c", "6d"]),
    ("SPEC §2/§8", ["2", "8"]),
    ("SPEC §6, 10 seeds", ["6"]),
    ("SPEC §6.", ["6"]),
    ("# audit on live batches (SPEC 6c) at delta", ["6c"]),
    ("SPEC's definitions at 50 digits", []),
    ("about SPEC's 200 disagreement tokens", []),
    ("SPEC §6.2", ["6"]),
    ("SPEC_LIKE = 3", []),
])
def test_the_parser_reads_every_citation_form(line, labels):
    got = [label for m in CITATION.finditer(line)
           for label in cited_sections(m.group(1) or m.group(2))]
    assert got == labels


def test_a_planted_missing_section_is_reported(sections):
    text = "ok: SPEC §3b\nplanted: the rule of SPEC §9z\nrange: SPEC §2–§12\n"
    assert missing_citations(text, sections) == [(2, "SPEC §9z", "9z"), (3, "SPEC §2–§12", "12")]


def test_every_spec_citation_names_a_section(files, sections):
    bad = []
    for rel in files:
        if rel == THIS_FILE or not (rel.endswith(CITING_SUFFIXES) or Path(rel).name == "Makefile"):
            continue
        text = read_text(rel)
        if text is None:
            continue
        for line, cite, label in missing_citations(text, sections, bare=rel == "docs/spec.md"):
            bad.append(f"{rel}:{line}: {cite!r} cites §{label}, which docs/spec.md does not have")
        if rel == "docs/spec.md":
            bad += [f"{rel}:{ln}: {c!r} cites §{lab}, missing" for ln, c, lab
                    in missing_citations(text, sections)]
    assert not bad, "\n".join(bad)


def test_no_file_points_outside_the_repository(files):
    assert OUTSIDE.search("see ../" + "shared" + "/SPEC.md")   # the check can fail
    hits = scan(files, OUTSIDE, skip={THIS_FILE})
    assert not hits, "files citing a location outside the repository:\n" + "\n".join(hits)


def test_no_internal_issue_numbers(files):
    assert ISSUE_NUMBER.search("as measured in " + "issue 28")   # the check can fail
    hits = scan([f for f in files if f.endswith((".py", ".md"))], ISSUE_NUMBER, skip={THIS_FILE})
    assert not hits, "internal issue numbers (say what or why instead):\n" + "\n".join(hits)
