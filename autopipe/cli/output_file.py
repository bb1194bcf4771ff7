"""The ``type`` of an option naming a file a command writes."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from ..runtime.core.paths import names_a_directory

__all__ = ["output_file"]


def output_file(example: str) -> Callable[[str], Path]:
    """The ``type`` of an option naming a file to write: a value that names a directory (one
    that exists, or any ending with a path separator, which argparse's ``Path`` would drop) is
    refused before any work is done, with ``DIR/example`` as the file to give instead."""

    def file(value: str) -> Path:
        path = Path(value)
        if names_a_directory(value):
            raise argparse.ArgumentTypeError(
                f"{value} is a directory; give the file to write, e.g. {path / example}"
            )
        return path

    return file
