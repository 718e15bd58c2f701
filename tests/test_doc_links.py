"""Every relative link in the README and under docs/ leads somewhere: the file exists, and a
``#fragment`` into a Markdown file names one of its headings (as GitHub makes anchors)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but ``-`` and ``_`` dropped,
    spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in FENCE.sub("", page.read_text()).splitlines():
        heading = re.match(r"#{1,6} (.+)", line)
        if heading:
            name = slug(heading.group(1))
            found.add(name if name not in seen else f"{name}-{seen[name]}")
            seen[name] = seen.get(name, 0) + 1
    return found


def broken_links(page: Path) -> list[str]:
    broken = []
    for link in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", link):  # http:, https:, mailto:
            continue
        path, _, fragment = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link}: no such file")
        elif fragment and target.suffix == ".md" and fragment not in anchors(target):
            broken.append(f"{link}: no heading with that anchor")
    return broken


def test_every_relative_link_resolves() -> None:
    broken = {str(page.relative_to(ROOT)): found for page in PAGES if (found := broken_links(page))}
    assert not broken, broken


def test_the_checker_finds_a_missing_file_and_a_missing_heading(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## What it is, in `code`\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[ok](other.md#what-it-is-in-code) [self](#page) [web](https://x.org/a.md)\n"
        "[gone](missing.md) [wrong](other.md#what-it-is) [up](#nowhere)\n"
        "```text\n[in a fence](missing.md)\n```\n"
    )
    assert broken_links(page) == [
        "missing.md: no such file",
        "other.md#what-it-is: no heading with that anchor",
        "#nowhere: no heading with that anchor",
    ]
