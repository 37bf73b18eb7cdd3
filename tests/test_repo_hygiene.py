"""Repository hygiene: docs and comments describe the product.

The docs, the CHANGELOG and the code's comments say what the product does,
in the present tense; the history of how it got there lives in git. Two
checks keep it so:

* no text file under the checked paths names a work log: a numbered work
  session, an issue number, a named helper or a numbered contracts file;
* every repository path a doc names in the form ``docs/X.md`` or
  ``native/X.c`` (and ``.h``) exists.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHECKED = ("xllm_vmm", "docs", "tests", "CHANGELOG.md", "README.md")
TEXT_SUFFIXES = {".py", ".md", ".toml", ".c", ".h", ".sh", ".json", ".txt", ".cfg", ".ini", ".yaml", ".yml"}
SKIP_DIRS = {"__pycache__", ".pytest_cache", ".hypothesis", "build", ".git"}

# "session" and "issue" match in any case; a helper's name only with a capital
# letter (a named person, not a helper function); a numbered contracts file
# in any case.
NARRATION = re.compile(
    r"(?i:session [0-9]|this sessio[n]|issue [0-9]+)|helper [A-Z]\b|(?i:contracts[0-9])"
)

def _text_files():
    for name in CHECKED:
        path = ROOT / name
        if path.is_file():
            yield path
            continue
        if not path.is_dir():
            continue
        for p in sorted(path.rglob("*")):
            if not p.is_file() or p.suffix not in TEXT_SUFFIXES:
                continue
            if SKIP_DIRS.intersection(p.relative_to(ROOT).parts):
                continue
            yield p


def _lines(path: Path):
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return
    yield from enumerate(text.splitlines(), 1)


# The same words broken across a line (a wrapped docstring or paragraph).
WRAPPED = re.compile(r"(?i:session\s*\n\s*(?:#\s*)?[0-9]|this\s*\n\s*(?:#\s*)?sessio[n]|issue\s*\n\s*(?:#\s*)?[0-9])")


def test_no_work_log_narration_across_lines():
    hits = []
    for path in _text_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for m in WRAPPED.finditer(text):
            n = text.count("\n", 0, m.start()) + 1
            hits.append(f"{path.relative_to(ROOT)}:{n}: {m.group(0)!r}")
    assert not hits, "work-log narration across a line break:\n" + "\n".join(hits)


def test_no_work_log_narration():
    hits = []
    for path in _text_files():
        for n, line in _lines(path):
            m = NARRATION.search(line)
            if m:
                hits.append(f"{path.relative_to(ROOT)}:{n}: {m.group(0)!r}: {line.strip()[:120]}")
    assert not hits, "work-log narration (history belongs in git):\n" + "\n".join(hits)


FILE_REF = re.compile(r"\b((?:docs/[A-Za-z0-9_.-]+\.md)|(?:native/[A-Za-z0-9_./-]+\.[ch]))\b")


def test_doc_file_references_exist():
    docs = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
    missing = []
    for path in docs:
        if not path.is_file():
            continue
        for n, line in _lines(path):
            for ref in FILE_REF.findall(line):
                if not (ROOT / ref).is_file():
                    missing.append(f"{path.relative_to(ROOT)}:{n}: {ref}")
    assert not missing, "references to files that do not exist:\n" + "\n".join(missing)


def test_no_references_to_absent_design_files():
    names = re.compile(r"\b(DESIGN\.md|RULES\.md|contracts\.md)\b")
    hits = []
    for path in _text_files():
        for n, line in _lines(path):
            m = names.search(line)
            if m and not (ROOT / m.group(1)).exists():
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:120]}")
    assert not hits, "references to files this repository does not contain:\n" + "\n".join(hits)
