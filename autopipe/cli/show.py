"""``autopipe show``: print the stages of a compiled pipeline."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..report import show_table
from .arguments import Subparsers

__all__ = ["add_parser", "cmd_show"]


def add_parser(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "show",
        help="print the stages of a compiled pipeline",
        description="Print a table of the stages: device, units, parameters, predicted times, "
        "memory, inputs and outputs.",
    )
    p.add_argument("dir", type=Path, help="generated pipeline directory")
    p.set_defaults(func=cmd_show)


def cmd_show(args: argparse.Namespace) -> None:
    print(show_table(args.dir))
