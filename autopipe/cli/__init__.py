"""The ``autopipe`` command line: one subcommand per compiler step, ``compile`` for all of them.

Each subcommand is a module of this package: its ``add_parser`` adds the subcommand's parser
(its arguments, and its handler as ``func``); the options several share are in :mod:`.arguments`.
"""

from __future__ import annotations

import argparse
import os
import sys

from ..artifacts import AUTOPIPE_VERSION as __version__
from ..errors import AutopipeError
from . import (
    calibrate,
    compile,
    generate,
    merge,
    partition,
    plan,
    profile,
    replan,
    report,
    show,
    trace,
    verify,
)

__all__ = ["COMMANDS", "build_parser", "main", "run"]

#: the subcommands' modules, in the order --help lists them
COMMANDS = (
    compile,
    plan,
    trace,
    profile,
    partition,
    generate,
    verify,
    calibrate,
    merge,
    report,
    show,
    replan,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autopipe",
        description="Compile a PyTorch model into a pipeline-parallel training program: "
        "trace -> profile -> partition -> generate.",
    )
    parser.add_argument("--version", action="version", version=f"autopipe {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # the arguments as given, for a command that prints the command to run next (plan's best)
    args.given = list(sys.argv[1:] if argv is None else argv)
    try:
        args.func(args)
    except AutopipeError as exc:
        print(f"autopipe {args.command}: error: {exc}", file=sys.stderr)
        return 1
    return 0


def run() -> None:
    """The ``autopipe`` console script: :func:`main`, then exit without tearing the interpreter
    down (after tracing a big model that teardown alone takes seconds; every file autopipe
    writes is complete and synced by then)."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
