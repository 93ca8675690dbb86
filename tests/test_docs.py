"""The documents the code cites are in the repository and every citation resolves.

A citation is a document name followed by section numbers: ``checkpoint-format.md §7.1``, ``vllm.md sec. 2, 3``,
``ruler.md section 8 row 7``, ``training-recipe.md §2.3, §3.3``, ``kernels.md 9.3``, ``docs/ruler.md §8``, also
across a line break of a docstring or comment. It resolves when the file exists (a bare name in ``docs/``, next
to the citing file or at the repository root; a path from the root or the citing file) and has a Markdown heading
numbered with each section cited (``## 7. Initialisation``, ``### 7.1 MLA from ...``). Mentions without a section
(``see kernels.md``) and relative Markdown links (``[x](docs/ruler.md#anchor)``) must name existing files (and
headings); a path whose first folder is not in the repository (``Zebra-Llama/README.md``) is another project's.
No file of the package and no document points outside the repository (``/work/...``, ``shared/reference``).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CITING = ("hylo_bench", "benchmarks", "scripts", "tests", "docs", "README.md", "recipes")
MENTIONING = ("hylo_bench", "benchmarks", "scripts", "docs", "README.md", "recipes")
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".sh", ".toml", ".txt", ".json", ".cfg", ".ini"}
OUTPUT_NAMES = {"out.md"}  # file names that a command writes (README: `--md out.md`), not documents

_DOC = r"(?P<doc>(?:[\w.-]+/)*[\w-]+\.md)"
_CLOSE = r"[`*'\"]*"
_BREAK = r"[ \t]*(?:\n[ \t]*(?:#|//)?[ \t]*)?"  # a space, or a line break inside a docstring or comment
_MARK = r"(?:§§?|secs?\.|[Ss]ections?)"
_NUM = r"\d{1,2}(?:\.\d{1,2})*(?![\d%])"
_ITEM = rf"(?:{_MARK}\s*)?{_NUM}"
_NEXT = rf"(?:\s*(?:[-–]|,|;|\band\b|\bor\b|\bto\b)\s*{_ITEM}|\s*\([^()]{{0,120}}\)\s*[,;]\s*{_ITEM})"
# ``§3.3`` / ``sec. 3`` / ``section 3`` (also after a line break), or a bare ``3.3`` after one space on the same line
CITATION = re.compile(
    rf"(?<![\w/.-]){_DOC}{_CLOSE}(?P<secs>(?:{_BREAK}{_MARK}\s*{_NUM}|[ \t]{_NUM}(?![\w.]*\w)){_NEXT}*)")
SECTION_NUMBER = re.compile(_NUM)
HEADING = re.compile(r"^#{1,6}[ \t]+(?:§\s*)?(\d+(?:\.\d+)*)\.?(?:[ \t]|$)", re.MULTILINE)
MENTION = re.compile(r"(?<![\w/.-])((?:\.\.?/)*(?:[\w.-]+/)*[\w-]+\.md)\b")
LINK = re.compile(r"\]\((?!https?:|mailto:|#)([^)\s#]+\.md)(?:#([^)\s]+))?\)")
OUTSIDE = ("/work/", "shared/reference", "shared/paper")


def _files(root: Path, tops: tuple[str, ...]) -> list[Path]:
    out = []
    for top in tops:
        p = root / top
        if p.is_file():
            out.append(p)
        elif p.is_dir():
            out += [f for f in sorted(p.rglob("*")) if f.is_file() and f.suffix in TEXT_SUFFIXES
                    and ".venv" not in f.parts and "__pycache__" not in f.parts]
    return [f for f in out if f.resolve() != Path(__file__).resolve()]


def _resolve(root: Path, citing: Path, doc: str) -> Path | None:
    """The cited file: a path from the root or the citing file's folder; a bare name in docs/, beside, or root."""
    if "/" in doc:
        candidates = [root / doc, citing.parent / doc]
    else:
        candidates = [root / "docs" / doc, citing.parent / doc, root / doc]
    return next((c for c in candidates if c.is_file()), None)


def _markdown(path: Path) -> str:
    """The file's text without fenced code blocks (a ``# 1. step`` comment in a block is no heading)."""
    return re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.MULTILINE | re.DOTALL)


def _headings(path: Path) -> set[str]:
    return set(HEADING.findall(_markdown(path)))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (hyphens and underscores kept), spaces -> -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(h) for h in re.findall(r"^#{1,6}[ \t]+(.+?)[ \t]*$", _markdown(path), re.MULTILINE)}


def _where(root: Path, f: Path, text: str, pos: int) -> str:
    return f"{f.relative_to(root)}:{text.count(chr(10), 0, pos) + 1}"


def citations(root: Path, tops: tuple[str, ...] = CITING) -> list[tuple[str, str, str]]:
    """Every (where, document, section) cited under ``tops`` of ``root``."""
    found = []
    for f in _files(root, tops):
        text = f.read_text(encoding="utf-8", errors="replace")
        for m in CITATION.finditer(text):
            for sec in SECTION_NUMBER.findall(m["secs"]):
                found.append((_where(root, f, text, m.start()), m["doc"], sec))
    return found


def unresolved_citations(root: Path, tops: tuple[str, ...] = CITING) -> list[str]:
    """One line per citation whose document or section does not exist."""
    bad, headings = [], {}
    for where, doc, sec in citations(root, tops):
        path = _resolve(root, root / where.rsplit(":", 1)[0], doc)
        if path is None:
            bad.append(f"{where}: {doc} §{sec}: no such document in docs/ or the repository root")
            continue
        if path not in headings:
            headings[path] = _headings(path)
        if sec not in headings[path]:
            bad.append(f"{where}: {doc} §{sec}: {path.relative_to(root)} has no heading numbered {sec}")
    return bad


def unresolved_mentions(root: Path, tops: tuple[str, ...] = MENTIONING) -> list[str]:
    """Documents named without a section, and relative Markdown links (with their #anchor), that do not exist."""
    bad = []
    for f in _files(root, tops):
        text = f.read_text(encoding="utf-8", errors="replace")
        for m in MENTION.finditer(text):
            name = m[1]
            first = name.split("/", 1)[0]
            if "/" in name and first not in (".", "..") and not (root / first).exists():
                continue  # a file of another repository (``Zebra-Llama/README.md``)
            if Path(name).name in OUTPUT_NAMES or _resolve(root, f, name.removeprefix("./")) is not None:
                continue
            if f.suffix == ".md" and (f.parent / name).is_file():
                continue
            bad.append(f"{_where(root, f, text, m.start())}: {name} does not exist")
        if f.suffix != ".md":
            continue
        for m in LINK.finditer(text):
            target = (f.parent / m[1]).resolve()
            if not target.is_file():
                bad.append(f"{_where(root, f, text, m.start())}: link to {m[1]}: no such file")
            elif m[2] and m[2] not in _anchors(target):
                bad.append(f"{_where(root, f, text, m.start())}: link to {m[1]}#{m[2]}: no such heading")
    return bad


def paths_outside(root: Path, tops: tuple[str, ...] = ("hylo_bench", "docs")) -> list[str]:
    """Lines that point at folders outside the repository (``/work/...``, ``../shared/reference``)."""
    bad = []
    for top in tops:
        for f in sorted((root / top).rglob("*")):
            if not f.is_file() or "__pycache__" in f.parts:
                continue
            data = f.read_bytes()
            if b"\0" in data[:8192]:
                continue  # binary (weights)
            text = data.decode("utf-8", errors="replace")
            for needle in OUTSIDE:
                for m in re.finditer(re.escape(needle), text):
                    bad.append(f"{_where(root, f, text, m.start())}: {needle!r}")
    return bad


def test_every_cited_section_exists():
    found = citations(ROOT)
    # The specifications are cited a few hundred times (checkpoint format, training recipe, RULER, vLLM, kernels).
    docs = {doc.rsplit("/", 1)[-1] for _, doc, _ in found}
    assert {"checkpoint-format.md", "training-recipe.md", "ruler.md", "vllm.md", "kernels.md", "eval.md"} <= docs
    assert len(found) > 300
    bad = unresolved_citations(ROOT)
    assert not bad, "\n".join(bad)


def test_every_named_document_and_link_exists():
    bad = unresolved_mentions(ROOT)
    assert not bad, "\n".join(bad)


def test_nothing_points_outside_the_repository():
    bad = paths_outside(ROOT)
    assert not bad, "\n".join(bad)


def test_a_missing_section_or_document_is_caught(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "spec.md").write_text("# Spec\n\n## 1. One\n\n### 1.2 One point two\n\n## 3. Three\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(
        '"""Follows spec.md §1.2 and §3; spec.md sec. 1, 2 (the second is missing).\n\n'
        "Also (spec.md\n    section 4), docs/spec.md §1, other.md §1 and spec.md 1.3.\n"
        '"""\n# spec.md §3.1-3 in a comment\n'
    )
    secs = [(doc, sec) for _, doc, sec in citations(tmp_path, ("pkg",))]
    assert secs == [("spec.md", "1.2"), ("spec.md", "3"), ("spec.md", "1"), ("spec.md", "2"), ("spec.md", "4"),
                    ("docs/spec.md", "1"), ("other.md", "1"), ("spec.md", "1.3"), ("spec.md", "3.1"), ("spec.md", "3")]
    bad = unresolved_citations(tmp_path, ("pkg",))
    assert [b.split(": ", 1)[1] for b in bad] == [
        "spec.md §2: docs/spec.md has no heading numbered 2",
        "spec.md §4: docs/spec.md has no heading numbered 4",
        "other.md §1: no such document in docs/ or the repository root",
        "spec.md §1.3: docs/spec.md has no heading numbered 1.3",
        "spec.md §3.1: docs/spec.md has no heading numbered 3.1",
    ]
    assert [b.split(": ", 1)[0] for b in bad] == ["pkg/mod.py:1", "pkg/mod.py:3", "pkg/mod.py:4", "pkg/mod.py:4",
                                                 "pkg/mod.py:6"]


def test_the_real_documents_would_fail_without_a_cited_heading(tmp_path):
    """Drop heading 7.1 from a copy of docs/checkpoint-format.md: the code's citations of §7.1 are reported."""
    (tmp_path / "docs").mkdir()
    for doc in (ROOT / "docs").glob("*.md"):
        (tmp_path / "docs" / doc.name).write_text(doc.read_text(encoding="utf-8"))
    text = (ROOT / "docs" / "checkpoint-format.md").read_text(encoding="utf-8")
    assert re.search(r"^### 7\.1 ", text, re.MULTILINE)
    (tmp_path / "docs" / "checkpoint-format.md").write_text(re.sub(r"^### 7\.1 ", "### ", text, flags=re.MULTILINE))
    (tmp_path / "hylo_bench").symlink_to(ROOT / "hylo_bench")
    assert not unresolved_citations(ROOT, ("hylo_bench",))
    bad = unresolved_citations(tmp_path, ("hylo_bench",))
    assert bad and all("checkpoint-format.md §7.1: docs/checkpoint-format.md has no heading numbered 7.1" in b
                       for b in bad), bad


def test_a_path_outside_the_repository_is_caught(tmp_path):
    (tmp_path / "hylo_bench").mkdir()
    (tmp_path / "hylo_bench" / "a.yaml").write_text("# ok\n# Source: /work/shared/reference/ruler.md section 2\n")
    (tmp_path / "hylo_bench" / "w.bin").write_bytes(b"\0/work/")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "d.md").write_text("see ../shared/reference/lm-eval.md\n")
    assert paths_outside(tmp_path) == ["hylo_bench/a.yaml:2: '/work/'", "hylo_bench/a.yaml:2: 'shared/reference'",
                                       "docs/d.md:1: 'shared/reference'"]
