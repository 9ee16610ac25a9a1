"""The docs speak to users: no development diary in any tracked file, a README whose first screen gets a new
operator going, and a docs index (docs/README.md) from which every doc is reachable through links that resolve."""

import re
import subprocess
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
INDEX = DOCS / "README.md"

# A work session or a tracker item by number ("<session> 19", "<issue> #36"), or "this <session>": words that name the
# project's own history, not the product.
DIARY = re.compile(r"\b(?:sessions?|issues?)\s*#?\s*\d+|\bthis\s+session\b", re.I)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def tracked_files():
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / p for p in out.decode().split("\0") if p]


def text_of(path):
    """A tracked file's text, or None for a binary one (NUL bytes) or one the working tree no longer has."""
    try:
        data = path.read_bytes()
    except (FileNotFoundError, IsADirectoryError):
        return None
    if b"\0" in data:
        return None
    return data.decode("utf-8", errors="replace")


def diary_lines(text):
    return [(n, m.group(0)) for n, line in enumerate(text.splitlines(), 1) for m in DIARY.finditer(line)]


def test_no_tracked_file_names_a_session_or_an_issue():
    found = []
    for path in tracked_files():
        text = text_of(path)
        if text is not None:
            found += [f"{path.relative_to(ROOT)}:{n}: {word!r}" for n, word in diary_lines(text)]
    assert found == [], "development history in the product; say what changed for users instead:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "line",
    ["Until {S} 17 this ran", "see {i} #36", "{i} 13, groundwork", "new this {s}", "({i}s 12 and 13)", "{I}#5"],
)
def test_the_diary_pattern_catches_the_forms_seen(line):
    # Spelt with placeholders so that this file does not hold the words it forbids.
    assert diary_lines(line.format(S="Session", s="session", i="issue", I="Issue"))


@pytest.mark.parametrize("line", ["MaxSessions 200", "an SSH session per node", "the issue is the clock", "tissue 5"])
def test_the_diary_pattern_leaves_ordinary_words(line):
    assert not diary_lines(line)


def test_readme_lines_are_readable():
    long = [
        (n, len(line)) for n, line in enumerate((ROOT / "README.md").read_text().splitlines(), 1) if len(line) > 400
    ]
    assert long == [], f"README.md lines over 400 characters (line, length): {long}"


def test_readme_quickstart_is_on_the_first_screen():
    lines = (ROOT / "README.md").read_text().splitlines()
    headings = [n for n, line in enumerate(lines, 1) if re.match(r"#+\s.*quick\s*start", line, re.I)]
    assert headings, "README.md has no quickstart heading"
    assert headings[0] <= 80, f"README.md's quickstart heading is on line {headings[0]}, not within the first 80"


def slug(heading):
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path):
    seen, out = {}, set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path):
    """Relative link targets of a markdown file (code blocks and inline code are not links)."""
    text = INLINE_CODE.sub("", FENCE.sub("", path.read_text()))
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        yield target


def resolve(source, target):
    """(path, anchor) a relative link names; the path is the source itself for '#anchor'."""
    ref, _, anchor = target.partition("#")
    path = (source.parent / unquote(ref)).resolve() if ref else source
    return path, anchor


def markdown_docs():
    """Every tracked markdown file: the docs, the README and CHANGELOG, the roles' and fixtures' READMEs."""
    return [p for p in tracked_files() if p.suffix == ".md"]


def test_relative_links_resolve():
    broken = []
    for source in markdown_docs():
        if not source.exists():
            continue
        for target in links(source):
            path, anchor = resolve(source, target)
            where = f"{source.relative_to(ROOT)} -> {target}"
            if not path.exists():
                broken.append(f"{where}: no such file")
            elif anchor and path.suffix == ".md" and path.is_file() and anchor.lower() not in anchors(path):
                broken.append(f"{where}: no heading with that anchor")
    assert broken == [], "\n".join(broken)


def test_every_doc_is_reachable_from_the_index():
    assert INDEX.is_file(), "docs/README.md, the index of the docs, is missing"
    seen, todo = set(), [INDEX]
    while todo:
        doc = todo.pop()
        if doc in seen or not doc.is_file():
            continue
        seen.add(doc)
        for target in links(doc):
            path, _ = resolve(doc, target)
            if path.is_dir() and (path / "README.md").is_file():
                path = path / "README.md"
            if path.suffix == ".md":
                todo.append(path)
    docs = {p.resolve() for p in tracked_files() if p.suffix == ".md" and p.is_relative_to(DOCS) and p.exists()}
    orphans = sorted(str(p.relative_to(ROOT)) for p in docs - seen)
    assert orphans == [], (
        "docs no link from docs/README.md leads to (link them from the index or a doc it links):\n"
        + ("\n".join(orphans))
    )


def test_the_readme_points_at_the_docs_index():
    assert any(resolve(ROOT / "README.md", t)[0] == INDEX for t in links(ROOT / "README.md"))
