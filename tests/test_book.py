"""The book in book/ builds strictly, and every listing in it comes from a real section of a script.

The strict build already fails on a missing page, a broken link, or a snippet
file or section that does not exist. The other tests say *which* page and marker
are wrong, and check what the build cannot: every numbered script is in the book.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
BOOK = REPO_ROOT / "book"

# --8<-- "file"  or  --8<-- "file:section"  (pymdownx.snippets, one include per line)
SNIPPET = re.compile(r'^\s*--8<--\s+"(?P<file>[^":]+)(?::(?P<section>[^"]+))?"\s*$', re.MULTILINE)


def includes() -> list[tuple[Path, str, str | None]]:
    """(page, included file, section or None) for every snippet line of every page."""
    found = []
    for page in sorted(BOOK.rglob("*.md")):
        for m in SNIPPET.finditer(page.read_text()):
            found.append((page, m.group("file"), m.group("section")))
    return found


def test_pages_include_snippets():
    # Guards the parser below: if this finds nothing, the other checks would pass vacuously.
    sections = [inc for inc in includes() if inc[2]]
    assert len(sections) >= 20, sections


def test_every_included_section_exists():
    problems = []
    for page, file, section in includes():
        path = REPO_ROOT / file
        where = f"{page.relative_to(REPO_ROOT)}: {file}" + (f":{section}" if section else "")
        if not path.is_file():
            problems.append(f"{where}: no such file")
            continue
        if section:
            text = path.read_text()
            for kind in ("start", "end"):
                if not re.search(rf"--8<--\s*\[{kind}:{re.escape(section)}\]", text):
                    problems.append(f"{where}: no [{kind}:{section}] marker")
    assert not problems, "\n".join(problems)


def shown(page: Path) -> set[str]:
    """The numbered scripts a page shows: a section of one included, or one run (`python NN_x.py`).
    A script whose code moved to the package is its chapter's demonstration: the page runs it."""
    names = {Path(file).name for p, file, section in includes() if section and p == page}
    return names | set(re.findall(r"python (\d\d_\w+\.py)", page.read_text()))


def test_every_numbered_script_is_in_the_book():
    scripts = sorted(p.name for p in REPO_ROOT.glob("[0-9][0-9]_*.py"))
    assert scripts, "no numbered scripts found"
    seen = set().union(*(shown(page) for page in BOOK.rglob("*.md")))
    missing = [s for s in scripts if s not in seen]
    assert not missing, f"scripts no page includes or runs: {missing}"


def test_every_numbered_script_is_in_its_chapter():
    """The chapter table of tests/test_layout.py (`book_chapter`) is the book's: each script is
    included or run by a page of its chapter's folder."""
    from test_layout import book_chapter

    homes: dict[str, set[int]] = {}
    for page in BOOK.rglob("*.md"):
        folder = page.relative_to(BOOK).parts[0]
        if folder.startswith("chapter"):
            for name in shown(page):
                homes.setdefault(name, set()).add(int(folder.removeprefix("chapter")))
    wrong = [f"{s}: Chapter {book_chapter(s[:-3])}, but included only from chapters {sorted(homes.get(s, ()))}"
             for s in sorted(p.name for p in REPO_ROOT.glob("[0-9][0-9]_*.py"))
             if book_chapter(s[:-3]) not in homes.get(s, set())]
    assert not wrong, "\n".join(wrong)


CHAPTER_ROW = re.compile(r"^\|\s*(\d+)\s+—")
NAV_CHAPTER = re.compile(r'^\s*- "Chapter (\d+) —.*":\s*$', re.MULTILINE)


def test_index_table_and_nav_list_the_chapters_in_order():
    """The home page's table says which chapter each script belongs to, and agrees with
    `book_chapter`; the table and the site's navigation list chapters in rising order."""
    from test_layout import book_chapter

    chapter, seen, wrong = None, [], []
    for line in (BOOK / "index.md").read_text().splitlines():
        if not line.startswith("|"):
            continue
        if m := CHAPTER_ROW.match(line):
            chapter = int(m.group(1))
            seen.append(chapter)
        for script in re.findall(r"`(\d\d_\w+)\.py`", line):
            if chapter is not None and book_chapter(script) != chapter:
                wrong.append(f"{script}.py listed under Chapter {chapter}, but it is Chapter {book_chapter(script)}")
        for folder in re.findall(r"\]\(chapter(\d+)/", line):
            if chapter is not None and int(folder) != chapter:
                wrong.append(f"a link to chapter{folder}/ in the row of Chapter {chapter}")
    assert seen == sorted(set(seen)) and seen[:4] == [1, 2, 3, 4], seen
    assert not wrong, "\n".join(wrong)
    nav = [int(n) for n in NAV_CHAPTER.findall((REPO_ROOT / "mkdocs.yml").read_text())]
    assert nav == sorted(set(nav)) and nav == seen, (nav, seen)


def test_snippet_parser_reads_both_forms():
    text = '```python\n--8<-- "04_engine.py:interface"\n```\n```text\n--8<-- "book/outputs/04_engine.txt"\n```\n'
    assert [(m["file"], m["section"]) for m in SNIPPET.finditer(text)] == [
        ("04_engine.py", "interface"), ("book/outputs/04_engine.txt", None)]


def test_mkdocs_build_strict(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})  # silence Material's banner
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert (tmp_path / "site" / "chapter1" / "04-engine.html").exists()
