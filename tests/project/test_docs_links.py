"""The README's and docs' relative links lead somewhere: each linked file exists, and each #anchor is a heading of
the file it names (GitHub's slugs: lower case, punctuation but '-' and '_' dropped, spaces to '-'). A section moved
or renamed without its links fails here."""

import re
from pathlib import Path

from helpers import REPO

PAGES = [Path(REPO, "README.md"), *sorted(Path(REPO, "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading):
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path):
    text = re.sub(r"(?ms)^```.*?^```", "", path.read_text())  # a '#' comment in a code block is no heading
    return {slug(m) for m in re.findall(r"(?m)^#+ (.+)$", text)}


def broken_links():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            linked = (page.parent / file).resolve() if file else page
            if not linked.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{page.name}: {target} (no such heading)")
    return broken


def test_every_relative_link_of_the_readme_and_docs_resolves():
    assert broken_links() == []


def test_the_slugs_are_githubs():
    assert slug("`--compile=auto` decided by measuring (issue 58)") == "--compileauto-decided-by-measuring-issue-58"
    assert slug("Compiled (`--compile`)") == "compiled---compile"
    assert slug("On a GPU") == "on-a-gpu"
