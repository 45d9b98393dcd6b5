"""The project documents itself: every `docs/method.md §N` citation names a section that exists, and nothing
refers to a directory beside the checkout or to an absolute machine path: a clone alone reproduces it."""

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
        files += [p for p in (ROOT / top).rglob("*") if p.suffix in (".py", ".md", ".yaml") and p.is_file()]
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
        assert not re.search(r"(?<![\w/])method\.md", text), f"{rel} cites the method reference without its docs/ path"
