"""``autopipe verify``: check a generated pipeline against the original model."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..options import TOLERANCE
from ..spec import load_example
from ..verify import VerifyReport, check_files, verify
from .arguments import SPEC_HELP, Subparsers

__all__ = ["add_parser", "cmd_verify"]


def add_parser(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "verify",
        help="check a generated pipeline against the original model",
        description="Run the stages in one process against the original model and compare outputs, gradients and buffers.",
    )
    p.add_argument("dir", type=Path, help="generated pipeline directory")
    p.add_argument(
        "--spec",
        help=SPEC_HELP + " (with real weights); without it, only check the files against the "
        "manifest written at generation",
    )
    p.add_argument(
        "--rtol", type=TOLERANCE.parse, default=1e-4, help="relative tolerance (default 1e-4)"
    )
    p.add_argument(
        "--atol", type=TOLERANCE.parse, default=1e-5, help="absolute tolerance (default 1e-5)"
    )
    p.set_defaults(func=cmd_verify)


def cmd_verify(args: argparse.Namespace) -> None:
    if args.spec is None:  # the files alone
        report = VerifyReport(edited=check_files(args.dir))
    else:
        report = verify(args.dir, load_example(args.spec), rtol=args.rtol, atol=args.atol)
    print(report.summary())
    if not report.ok:
        raise SystemExit(1)
    print("the pipeline matches the model" if args.spec else "the pipeline is as generated")
