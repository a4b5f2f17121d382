"""The documentation's relative links resolve: every ``[text](path)``, ``[label]: path`` and ``<a href>``
in the README, eval/README.md and recipes/README.md names a file or folder of the repository, and a
``#anchor`` names a heading of the Markdown file it points into (GitHub's heading ids). Links inside
code (fenced blocks, inline spans) are not links; absolute URLs are not checked (no network)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "eval/README.md", "recipes/README.md"]

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
INLINE_LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]\n]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
HTML_HREF = re.compile(r"<a\s[^>]*?href\s*=\s*[\"']([^\"']+)[\"']", re.I)
HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.+?)\s*#*\s*$", re.M)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # https:, mailto:, ...


def without_code(text: str) -> str:
    return INLINE_CODE.sub("", FENCE.sub("", text))


def links(text: str) -> list[str]:
    prose = without_code(text)
    return [m.group(1) for pattern in (INLINE_LINK, REFERENCE_LINK, HTML_HREF) for m in pattern.finditer(prose)]


def heading_ids(text: str) -> set[str]:
    """GitHub's ids for a Markdown file's headings: lower case, punctuation but '-' and '_' dropped,
    spaces as '-', and -1, -2, ... after a repeated id."""
    ids, seen = set(), {}
    for match in HEADING.finditer(FENCE.sub("", text)):
        title = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", match.group(1))  # a link in a heading: its text
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        ids.add(slug if n == 0 else f"{slug}-{n}")
    return ids


def broken_links(doc: Path, root: Path) -> list[str]:
    """Each relative link of ``doc`` that names no file or folder under ``root``, or no heading there."""
    broken = []
    for link in links(doc.read_text()):
        if EXTERNAL.match(link) or link.startswith("//"):
            continue
        path_part, _, anchor = link.partition("#")
        target = (doc.parent / path_part).resolve() if path_part else doc.resolve()
        if not target.exists():
            broken.append(f"{link}: no such file or folder")
        elif root.resolve() not in target.parents and target != root.resolve():
            broken.append(f"{link}: outside the repository")
        elif anchor and target.suffix == ".md" and anchor not in heading_ids(target.read_text()):
            broken.append(f"{link}: {target.name} has no heading #{anchor}")
    return broken


@pytest.mark.parametrize("name", DOCS)
def test_every_relative_link_resolves(name):
    doc = ROOT / name
    assert doc.is_file(), f"{name} is missing"
    assert links(doc.read_text()), f"{name} has no links: the pattern no longer matches them"
    assert broken_links(doc, ROOT) == [], f"broken links in {name}"


def test_the_checker_reports_broken_links(tmp_path):
    """The check itself: good links of each kind pass, and each kind of broken one is reported."""
    repo = tmp_path / "repo"
    (repo / "sub").mkdir(parents=True)
    (tmp_path / "outside.md").write_text("")
    (repo / "sub" / "page.md").write_text("# A title, with `code`\n\n## Run folders: resume\n")
    (repo / "README.md").write_text(
        "[ok](sub/page.md) [ok](sub/page.md#a-title-with-code) [ok](sub/page.md#run-folders-resume) [ok](sub)\n"
        '[ok](#local) [web](https://example.com/x) <a href="sub/page.md">ok</a>\n'
        "`[not a link](nowhere.md)`\n```\n[not a link](nowhere.md)\n```\n\n## Local\n"
        "[gone](missing.md) [bad anchor](sub/page.md#no-such-heading) [up](../outside.md) [bad local](#nope)\n"
        '<a href="sub/gone.html">gone</a>\n'
        "[ref]: sub/nothing.md\n"
    )
    assert broken_links(repo / "README.md", repo) == [
        "missing.md: no such file or folder",
        "sub/page.md#no-such-heading: page.md has no heading #no-such-heading",
        "../outside.md: outside the repository",
        "#nope: README.md has no heading #nope",
        "sub/nothing.md: no such file or folder",
        "sub/gone.html: no such file or folder",
    ]


def test_every_shipped_recipe_and_family_is_where_the_docs_list_them():
    """recipes/README.md's table links every shipped recipe, its drafter.family list names every registered family,
    and pyproject's description names every family (DFlash was missing from all three)."""
    import yaml

    shipped = {yaml.safe_load(p.read_text())["drafter"]["family"] for p in (ROOT / "recipes").glob("*.yaml")}
    recipes_doc = (ROOT / "recipes" / "README.md").read_text()
    missing = [p.stem for p in sorted((ROOT / "recipes").glob("*.yaml")) if f"]({p.name})" not in recipes_doc]
    assert not missing, missing
    listed = re.search(r"`family` \(([^)]*)\)", recipes_doc).group(1)
    assert {name.strip("` ") for name in listed.split(",")} == shipped  # (the tests' own probe family is not one)
    description = re.search(r'^description = "(.*)"$', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    for paper_name in ("EAGLE-1/3", "Medusa", "MLP speculator", "DistillSpec", "DFlash"):
        assert paper_name in description, paper_name
