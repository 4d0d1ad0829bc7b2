"""Every spec citation in code and docs points at something that exists.

A citation is a section sign with a number ("DESIGN §1.4", "`docs/design.md` §1-2", "RFC 8439 §2.3"),
a design anchor ("design.md#6-attacks") or a path under ``docs/``. The document a section sign cites is
the nearest document named before it on the same line (in ``docs/design.md`` a bare one cites
design.md itself): DESIGN / design.md must have a heading with that number, another Markdown file must
exist in the repository and have it, an RFC is an external standard. A section sign that names no
document, or a number that parses as none, is broken. Nothing may cite ``shared/reference/``: it is not
part of the repository.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("python", "aegis_kernels", "benchmarks", "docs", "tests", "proofs")
SUFFIXES = {".py", ".md", ".toml", ".lean", ".txt"}
SKIPPED = {"__pycache__", ".lake", "build"}
DESIGN = "docs/design.md"

_HEADING = re.compile(r"^#{1,6}\s+(\d+(?:\.\d+)*)\.?\s", re.M)
_SECTION = re.compile(r"§\s*(\d+(?:\.\d+)*)?(?:\s*[-–]\s*(\d+(?:\.\d+)*))?")
# what a section sign can cite, nearest first: the spec, an RFC, or another Markdown file
_DOCUMENT = re.compile(r"\bDESIGN\b|\bdesign\b(?!\.md)|\bRFC\s*\d+|[\w./-]*\.md\b")
_ANCHOR = re.compile(r"design\.md#([\w-]+)")
_DOCS_PATH = re.compile(r"(?<![\w./-])docs/[\w./-]*\w")


def scanned_files() -> list[Path]:
    me = Path(__file__).resolve()
    files = [ROOT / "README.md", ROOT / "pyproject.toml"]
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*")):
            parts = set(path.relative_to(ROOT).parts)
            if (path.suffix in SUFFIXES and path.is_file() and path.resolve() != me and not parts & SKIPPED
                    and not any(p.endswith(".egg-info") for p in parts)):
                files.append(path)
    return files


def numbered_sections(markdown: str) -> set[str]:
    return set(_HEADING.findall(markdown))


def anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in markdown.splitlines():
        if line.startswith("#"):
            text = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return out


def _markdown(name: str, cited_from: str) -> str | None:
    """The text of a Markdown file cited by name: a repository path, a path beside the citing file, or
    the one file of that name in the repository."""
    for candidate in (ROOT / name, (ROOT / cited_from).parent / name):
        if candidate.is_file():
            return candidate.read_text(encoding="utf-8")
    same = [p for p in ROOT.rglob(Path(name).name) if ".git" not in p.parts and not set(p.parts) & SKIPPED]
    return same[0].read_text(encoding="utf-8") if len(same) == 1 else None


def broken_references(text: str, where: str, design: str) -> list[str]:
    """What ``text`` (the file ``where``, relative to the repository) cites that does not exist."""
    broken: list[str] = []
    design_sections, design_anchors = numbered_sections(design), anchors(design)
    for n, line in enumerate(text.splitlines(), 1):
        at = f"{where}:{n}"
        if "shared/reference" in line:
            broken.append(f"{at}: cites shared/reference/, which is outside the repository")
        for match in _SECTION.finditer(line):
            first, last = match.group(1), match.group(2)
            if first is None:
                broken.append(f"{at}: '§' without a section number")
                continue
            named = list(_DOCUMENT.finditer(line, 0, match.start()))
            document = named[-1].group(0) if named else (DESIGN if where == DESIGN else None)
            if document is None:
                broken.append(f"{at}: §{first} names no document (write 'DESIGN §{first}')")
            elif document.startswith("RFC"):
                continue  # an external standard
            elif document in ("DESIGN", "design") or document.endswith("design.md"):
                broken += [f"{at}: DESIGN §{s} is not a section of {DESIGN}"
                           for s in (first, last) if s is not None and s not in design_sections]
            else:
                cited = _markdown(document, where)
                if cited is None:
                    broken.append(f"{at}: {document} (cited for §{first}) is not a file of the repository")
                else:
                    broken += [f"{at}: §{s} is not a section of {document}"
                               for s in (first, last) if s is not None and s not in numbered_sections(cited)]
        for anchor in _ANCHOR.findall(line):
            if anchor not in design_anchors:
                broken.append(f"{at}: design.md#{anchor} is not a heading of {DESIGN}")
        for path in _DOCS_PATH.findall(line):
            if not (ROOT / path).exists():
                broken.append(f"{at}: {path} does not exist")
    return broken


def test_every_spec_reference_in_code_and_docs_exists():
    design = (ROOT / DESIGN).read_text(encoding="utf-8")
    files = scanned_files()
    assert len(files) > 100  # the scan reached the package, the kernels, the tests and the docs
    broken, citations = [], 0
    for path in files:
        text = path.read_text(encoding="utf-8")
        citations += len(_SECTION.findall(text)) + len(_DOCS_PATH.findall(text))
        broken += broken_references(text, path.relative_to(ROOT).as_posix(), design)
    assert citations > 40  # the scan read the citations (about 90 today)
    assert not broken, "broken spec references:\n" + "\n".join(broken)


def test_the_design_has_the_sections_code_cites():
    sections = numbered_sections((ROOT / DESIGN).read_text(encoding="utf-8"))
    assert {"0", "1", "1.1", "1.2", "1.3", "1.4", "2", "3", "4", "5", "6", "6.1", "6.2", "7"} <= sections


_DESIGN_FIXTURE = "# x\n## 1. A\n### 1.2 B\n## 6. Attacks\n"


@pytest.mark.parametrize(
    "text,problem",
    [
        ("see DESIGN §9", "DESIGN §9 is not a section"),
        ("(DESIGN §1.3)", "DESIGN §1.3 is not a section"),
        ("docs/design.md §1-7", "DESIGN §7 is not a section"),
        ("spec in attacks.md §1.2", "attacks.md (cited for §1.2) is not a file"),
        ("Spec: ``shared/reference/attacks.md``", "outside the repository"),
        ("the lemma (§1.2)", "names no document"),
        ("a stray § sign", "without a section number"),
        ("see design.md#7-models", "design.md#7-models is not a heading"),
        ("see docs/missing.md", "docs/missing.md does not exist"),
        ("proofs/README.md §99", "§99 is not a section of proofs/README.md"),
    ],
)
def test_a_broken_reference_is_reported(text, problem):
    found = broken_references(text, "python/aegis/example.py", _DESIGN_FIXTURE)
    assert len(found) == 1 and problem in found[0], found


@pytest.mark.parametrize(
    "text",
    ["DESIGN §1.2 and §6", "`docs/design.md` §1-6", "RFC 8439 §2.3", "design.md#6-attacks", "see docs/design.md",
     "no citation here"],
)
def test_a_good_reference_passes(text):
    assert broken_references(text, "python/aegis/example.py", _DESIGN_FIXTURE) == []


def test_a_bare_section_sign_in_the_design_cites_the_design():
    assert broken_references("as §1.2 says", DESIGN, _DESIGN_FIXTURE) == []
    expected = [f"{DESIGN}:1: DESIGN §3 is not a section of {DESIGN}"]
    assert broken_references("as §3 says", DESIGN, _DESIGN_FIXTURE) == expected
