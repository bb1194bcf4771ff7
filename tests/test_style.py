"""The project's own source is black-formatted, like the code it generates."""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import black

from conftest import ROOT

MODE = black.Mode(line_length=100)


def _formatted(path: Path) -> bool:
    text = path.read_text()
    return black.format_str(text, mode=MODE) == text


def test_source_is_black_formatted():
    paths = [
        path
        for folder in ("autopipe", "tests", "benchmarks", "examples")
        for path in sorted((ROOT / folder).rglob("*.py"))
    ]
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # the CPUs pytest leaves
        formatted = list(pool.map(_formatted, paths, chunksize=8))
    unformatted = [str(p.relative_to(ROOT)) for p, ok in zip(paths, formatted) if not ok]
    assert not unformatted, f"run black on: {', '.join(unformatted)}"
