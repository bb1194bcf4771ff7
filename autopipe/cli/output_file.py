"""The ``type`` of an option naming a file a command writes."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path

__all__ = ["output_file"]


def output_file(example: str) -> Callable[[str], Path]:
    """The ``type`` of an option naming a file to write: a value that names a directory (one
    that exists, or any ending with a path separator, which argparse's ``Path`` would drop) is
    refused before any work is done, with ``DIR/example`` as the file to give instead."""

    def file(value: str) -> Path:
        path = Path(value)
        separators = tuple(sep for sep in (os.sep, os.altsep) if sep)
        if value.endswith(separators) or path.is_dir():
            raise argparse.ArgumentTypeError(
                f"{value} is a directory; give the file to write, e.g. {path / example}"
            )
        return path

    return file
