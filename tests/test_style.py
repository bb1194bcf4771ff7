"""The project's own source is black-formatted, like the code it generates."""

from __future__ import annotations

import black

from conftest import ROOT


def test_source_is_black_formatted():
    mode = black.Mode(line_length=100)
    unformatted = []
    for folder in ("autopipe", "tests", "benchmarks", "examples"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text()
            if black.format_str(text, mode=mode) != text:
                unformatted.append(str(path.relative_to(ROOT)))
    assert not unformatted, f"run black on: {', '.join(unformatted)}"
