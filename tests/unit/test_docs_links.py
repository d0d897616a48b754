"""Every relative link in README.md and docs/**/*.md leads somewhere: the file (or folder, or source
path such as `examples/rewards.py`) exists beside the linking file, and a `#anchor` names a heading of
the target, as GitHub slugs it. The README's sections moved into docs/ guides once, and every link into
them was rewritten by hand: this is what keeps a later move or rename from leaving a dead link."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+).*?\1")
# [text](target) and ![alt](target); the target ends at whitespace (a "title" may follow) or ')'.
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto:, ...


def markdown_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks: a `# comment` in a bash block is not a heading, and a
    `[x](y)` in a code sample is not a link."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lowercase, punctuation dropped (letters, digits,
    '_', '-' and spaces kept), each space a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = text.replace("`", "").replace("*", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor GitHub gives `path`'s headings: a repeated slug gets -1, -2, ... as GitHub numbers it."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose_lines(path.read_text()):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        s = slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def relative_links(path: Path) -> list[str]:
    found = []
    for line in prose_lines(path.read_text()):
        for target in LINK.findall(INLINE_CODE.sub("", line)):
            if not EXTERNAL.match(target):
                found.append(target)
    return found


def broken_links(path: Path, root: Path = REPO) -> list[str]:
    """`path`'s relative links that lead nowhere, each with the reason (paths shown from `root`)."""
    broken = []
    for target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            shown = dest.relative_to(root) if dest.is_relative_to(root) else dest
            broken.append(f"{target}: no file {shown}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with the anchor #{anchor} in {dest.name}")
    return broken


@pytest.mark.unit
def test_slugs_follow_github():
    assert slug("Deploy (Prefect UI, schedules)") == "deploy-prefect-ui-schedules"
    assert slug("A real model learns: `make demo-smollm2`") == "a-real-model-learns-make-demo-smollm2"
    assert slug("`data.dataset`") == "datadataset"
    assert slug("1. Layers") == "1-layers"
    assert slug("Who may do what (trust model)") == "who-may-do-what-trust-model"
    assert slug("`rewards[]`") == "rewards"


@pytest.mark.unit
def test_a_broken_link_is_found(tmp_path):
    (tmp_path / "guide.md").write_text(
        "# A guide\n\n## Its part\n\n```bash\n# not a heading\n```\n"
        "[ok](guide.md#its-part) [self](#a-guide) [web](https://example.com/x.md) `[code](nowhere.md)`\n"
        "[gone](missing.md) [bad anchor](guide.md#not-a-heading) [code anchor](#not-a-heading)\n"
        "![img](missing.png) [source](src/mod.py)\n"
    )
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "mod.py").write_text("")
    broken = broken_links(tmp_path / "guide.md", tmp_path)
    assert [b.split(":")[0] for b in broken] == [
        "missing.md", "guide.md#not-a-heading", "#not-a-heading", "missing.png",
    ]  # fmt: skip


@pytest.mark.unit
@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(path):
    assert broken_links(path) == []
