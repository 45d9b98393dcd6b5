"""The project documents itself: every `docs/method.md §N` citation names a section that exists, and nothing
refers to a directory beside the checkout or to an absolute machine path (results JSON included): a clone alone
reproduces it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("train", "data_prep", "conf", "launch", "models", "eval", "bench", "tests", "docs")
# "../<dir>/<sub>" with a <dir> that is not one of the repository's own (launch/'s "../conf" is inside it)
BESIDE_THE_CHECKOUT = re.compile(r"\.\./(\w+)/(\w+)")
# the machine this project was measured on: its checkout's parent, its users' homes
MACHINE_PATH = re.compile(r"(?<![\w.])/(?:work|home)/\w")


def project_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "Makefile", ROOT / "pyproject.toml"]
    for top in SOURCES:
        files += [p for p in (ROOT / top).rglob("*") if p.suffix in (".py", ".md", ".yaml", ".json") and p.is_file()]
    return files


def method_sections() -> set[str]:
    text = (ROOT / "docs/method.md").read_text()
    return set(re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", text, flags=re.M))


def test_every_method_citation_names_an_existing_section():
    sections = method_sections()
    assert {"1", "4.3", "6"} <= sections
    cited = 0
    for f in project_files():
        for ref in re.findall(r"docs/method\.md((?:[\s§/,]+\d+(?:\.\d+)?)+)", f.read_text()):
            for number in re.findall(r"\d+(?:\.\d+)?", ref):
                cited += 1
                assert number in sections, f"{f.relative_to(ROOT)} cites docs/method.md §{number}, which is missing"
    assert cited >= 30


def test_nothing_refers_beyond_the_checkout():
    for f in project_files():
        rel = str(f.relative_to(ROOT))
        text = f.read_text()
        for top, sub in BESIDE_THE_CHECKOUT.findall(text):
            assert (ROOT / top).is_dir(), f"{rel} refers to ../{top}/{sub}, a directory beside the checkout"
        assert not MACHINE_PATH.search(text), f"{rel} names a machine path: {MACHINE_PATH.search(text).group()}"
        # a Markdown link's target inside docs/ is relative ("](method.md"); its text names docs/method.md
        assert not re.search(r"(?<![\w/])(?<!\]\()method\.md", text), \
            f"{rel} cites the method reference without its docs/ path"


# The reader's documents: the README, docs/ and the folder guides beside the code.
README_MAX_LINES = 300
# A link's target: [text](target) or [text](target "title").
LINK = re.compile(r"\[[^\]]*\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^```.*?^```", flags=re.S | re.M)
# Words of a diary, not of a reference: who worked on it when, and which ticket asked for it.
HISTORY = re.compile(r"\bsessions?\b|\bissues?\s*#?\s*\d+|\bthe issue\b|\bissue's\b|(?<![\w&/])#\d+\b|\bdiary\b",
                     flags=re.I)


def reader_docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(ROOT.glob("*/README.md"))]


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation dropped, spaces as hyphens, a
    repeated heading numbered -1, -2, ..."""
    anchors: set[str] = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", FENCE.sub("", path.read_text()), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in anchors:
            n += 1
            anchor = f"{slug}-{n}"
        anchors.add(anchor)
    return anchors


def test_readme_is_short():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail to docs/"


def test_every_relative_link_resolves():
    checked = 0
    for doc in reader_docs():
        rel = doc.relative_to(ROOT)
        for target in LINK.findall(FENCE.sub("", doc.read_text())):
            if re.match(r"[a-z][a-z0-9+.-]*:", target, flags=re.I):
                continue  # http(s):, mailto:
            path, _, anchor = target.partition("#")
            dest = doc if not path else (ROOT / path.lstrip("/") if path.startswith("/") else doc.parent / path)
            assert dest.exists(), f"{rel} links to {target}, which does not exist"
            if anchor and dest.suffix == ".md":
                assert anchor in heading_anchors(dest), f"{rel} links to {target}: no such heading in {dest.name}"
            checked += 1
    assert checked >= 20


def test_docs_hold_no_history():
    for doc in reader_docs():
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            found = HISTORY.search(line)
            assert not found, f"{doc.relative_to(ROOT)}:{n} reads like history ({found.group()!r}): state the fact"
