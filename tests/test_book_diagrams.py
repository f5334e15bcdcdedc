"""The book's diagrams, maps and goals: what the strict build cannot check.

Every SVG in book/assets is a drawing a reader and a screen reader can both use: well-formed,
sized by a viewBox, titled and described, its words real <text>. Every image a page shows has
alt text and exists. From Chapter 6 on, each chapter maps its parts onto vLLM's and
nano-vllm's files, at a pinned nano-vllm commit; every chapter states its goal before it measures.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
BOOK = REPO_ROOT / "book"
SVG = "{http://www.w3.org/2000/svg}"
IMAGE = re.compile(r"!\[(?P<alt>[^\]]*)\]\((?P<src>[^)\s]+)\)")
MAPPED = [6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]
NANO_VLLM_COMMIT = "bb823b3e06983d71485a8e1f23715ebd87d98ef8"


def chapter(n: int) -> str:
    return (BOOK / f"chapter{n}" / "index.md").read_text()


def svg_problems(path: Path) -> list[str]:
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:
        return [f"{path.name}: not well-formed ({e})"]
    problems = []
    if root.tag != SVG + "svg":
        problems.append(f"{path.name}: the root is {root.tag}, not an svg element")
    if len((root.get("viewBox") or "").split()) != 4:
        problems.append(f"{path.name}: no viewBox")
    for tag in ("title", "desc"):
        node = root.find(SVG + tag)
        if node is None or not "".join(node.itertext()).strip():
            problems.append(f"{path.name}: no <{tag}>")
    if len(root.findall(f".//{SVG}text")) < 3:
        problems.append(f"{path.name}: fewer than 3 <text> elements (words drawn as paths?)")
    if root.findall(f".//{SVG}image"):
        problems.append(f"{path.name}: embeds a raster <image>")
    return problems


def test_every_svg_is_a_readable_drawing():
    svgs = sorted((BOOK / "assets").glob("*.svg"))
    assert len(svgs) >= 13, [p.name for p in svgs]
    problems = [msg for p in svgs for msg in svg_problems(p)]
    assert not problems, "\n".join(problems)


def test_svg_check_catches_a_bad_drawing(tmp_path):
    bad = tmp_path / "bad.svg"
    bad.write_text('<svg xmlns="http://www.w3.org/2000/svg" width="10"><path d="M0,0"/></svg>')
    assert len(svg_problems(bad)) == 4       # no viewBox, no title, no desc, no text
    (tmp_path / "broken.svg").write_text("<svg")
    assert "not well-formed" in svg_problems(tmp_path / "broken.svg")[0]


def test_every_image_has_alt_text_and_exists():
    problems, shown = [], 0
    for page in sorted(BOOK.rglob("*.md")):
        for m in IMAGE.finditer(page.read_text()):
            shown += 1
            where = f"{page.relative_to(BOOK)}: {m['src']}"
            if len(m["alt"].split()) < 3:
                problems.append(f"{where}: alt text {m['alt']!r} says too little")
            if not m["src"].startswith("http") and not (page.parent / m["src"]).resolve().is_file():
                problems.append(f"{where}: no such file")
    assert shown >= 20, shown
    assert not problems, "\n".join(problems)


def test_concept_diagrams_are_shown_with_a_caption():
    for n, name in [(7, "ch7-block-table"), (8, "ch8-prefix-hashes"), (9, "ch9-scheduler-step"),
                    (10, "ch10-speculative-round"), (11, "ch11-bitmask-logits"),
                    (12, "ch12-int4-group"), (14, "ch14-megatron-split"),
                    (15, "ch15-cuda-graph-bucket"), (16, "fork-copy-on-write"), (17, "ch17-shrink-expand")]:
        figure = re.search(rf'<figure markdown="span">\s*!\[[^\]]+\]\(\.\./assets/{name}\.svg\)\s*'
                           r"<figcaption>[^<]{20,}</figcaption>\s*</figure>", chapter(n))
        assert figure, f"Chapter {n} does not show {name}.svg in a captioned figure"


def test_each_chapter_from_6_maps_its_parts_onto_vllm_and_nano_vllm():
    for n in MAPPED:
        text = chapter(n)
        start = text.find("## Where this lives in vLLM")
        assert start >= 0, f"Chapter {n} has no map onto vLLM's files"
        end = text.find("\n## ", start + 1)
        section = text[start:end if end >= 0 else len(text)]
        rows = [r for r in section.splitlines() if r.startswith("| ") and not r.startswith("| Here")]
        assert len(rows) >= 3, f"Chapter {n}: {len(rows)} rows in its map"
        assert all("`vllm/" in r or r.startswith("| SGLang") for r in rows), f"Chapter {n}: a row without a vLLM file"
        assert all(r.rstrip().endswith("|") and len(r.split("|")[-2].strip()) > 20 for r in rows), \
            f"Chapter {n}: a row without a sentence on what differs"
        assert NANO_VLLM_COMMIT in section, f"Chapter {n}: nano-vllm's commit is not pinned"
        if n != 17:                          # nano-vllm serves no adapters
            assert "`nanovllm/" in section, f"Chapter {n}: no nano-vllm file"


def test_each_chapter_states_its_goal_before_it_measures():
    for n in [*range(1, 18)]:
        text = chapter(n)
        goal = text.find("**The goal.**")
        assert goal >= 0, f"Chapter {n} states no goal"
        first_output = text.find("book/outputs/")
        assert first_output < 0 or goal < first_output, f"Chapter {n} measures before its goal"
