"""``autopipe compile``: trace, profile, partition and generate in one go."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..compiler import compile_spec
from ..errors import AutopipeError
from ..report.progress import NORMAL, QUIET, VERBOSE, Phases
from ..report.summary import format_partition, format_plans
from .arguments import (
    SPEC_HELP,
    Subparsers,
    add_option,
    compile_options,
    partition_options,
    profile_options,
    search_options,
    trace_options,
)
from .launch import torchrun

__all__ = ["add_parser", "cmd_compile"]


def add_parser(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "compile",
        help="trace, profile, partition and generate in one go",
        description="Compile a model into a pipeline package.",
    )
    p.add_argument("spec", help=SPEC_HELP)
    p.add_argument(
        "--out", required=True, type=Path, help="directory of the generated pipeline package"
    )
    p.add_argument(
        "--force", action="store_true", help="replace --out if it is a pipeline autopipe generated"
    )
    verbosity = p.add_mutually_exclusive_group()
    verbosity.add_argument("--quiet", action="store_true", help="print only the result")
    verbosity.add_argument(
        "--verbose", action="store_true", help="say what each phase produced, besides its time"
    )
    p.add_argument(
        "--no-report", action="store_true", help="skip DIR/report/report.html and its figures"
    )
    trace_options(p)
    profile_options(p)
    partition_options(p, stages_required=False)
    add_option(p, "accumulate")
    add_option(search_options(p), "search")
    p.set_defaults(func=cmd_compile)


def cmd_compile(args: argparse.Namespace) -> None:
    if args.search and args.devices is None:
        raise AutopipeError("--search needs --devices: the number of devices to plan for")
    if not args.search and args.stages is None:
        raise AutopipeError("--stages is required (or --search with --devices)")
    level = QUIET if args.quiet else VERBOSE if args.verbose else NORMAL
    result = compile_spec(
        args.spec,
        args.out,
        compile_options(args),
        loss=args.loss,
        force=args.force,
        report=not args.no_report,
        phases=Phases(level),
    )
    if not args.quiet:
        if args.search:
            print(format_plans(result.partition))
        print(format_partition(result.graph, result.partition))
    print(f"wrote {result.partition.num_stages}-stage pipeline to {result.out}")
    print(f"train it: {torchrun(result.partition, result.out)} --steps 100")
