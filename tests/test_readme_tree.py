"""README's "What is inside" matches the tree: every package, sub-package and module of ``hylo_bench`` down to
``hylo_bench/<package>/<module>.py`` is named there (deeper modules by their sub-package), and every ``*.py`` file it
names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _inside_block() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    m = re.search(r"^## What is inside\n.*?^```\n(.*?)^```", text, re.S | re.M)
    assert m, "README.md: no code block under '## What is inside'"
    return m.group(1)


def test_every_package_and_module_is_listed():
    block = _inside_block()
    missing = []
    for path in sorted((ROOT / "hylo_bench").rglob("*.py")):
        rel = path.relative_to(ROOT / "hylo_bench")
        if path.stem.startswith("_") or "__pycache__" in rel.parts:
            continue
        if len(rel.parts) > 2:  # hylo_bench/kernels/gated_delta/chunk.py: the sub-package is what is listed
            if f"{rel.parts[1]}/" not in block:
                missing.append(f"{rel.parts[0]}/{rel.parts[1]}/")
        elif not re.search(rf"(?<![\w.]){re.escape(path.stem)}(?:\.py)?(?![\w])", block):
            missing.append(str(rel))
    for d in sorted(p for p in (ROOT / "hylo_bench").iterdir() if (p / "__init__.py").is_file()):
        if f"{d.name}/" not in block:
            missing.append(f"{d.name}/")
    assert not missing, f"README.md 'What is inside' does not name: {missing}"


def test_every_named_file_exists():
    names = set(re.findall(r"(?<![\w/])(\w+\.py)\b", _inside_block()))
    present = {p.name for top in ("hylo_bench", "benchmarks", "scripts") for p in (ROOT / top).rglob("*.py")}
    assert names and not names - present, f"README.md 'What is inside' names missing files: {sorted(names - present)}"
