"""``autopipe replan``: re-partition a pipeline from the measured times of a traced run."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..codegen import check_output_dir
from ..errors import AutopipeError
from ..options import Fraction
from ..replan import MIN_GAIN, replan, replan_text, write_replan
from .arguments import Subparsers, add_option, package_options
from .generate import node_size
from .launch import torchrun

__all__ = ["add_parser", "cmd_replan"]


def add_parser(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "replan",
        help="re-partition a pipeline from the measured times of a traced run",
        description="Rebuild the profile of a compiled pipeline from the stage times a run of "
        "its train.py --trace measured (each stage's forward and backward spread over its units "
        "as the package's profile weighs them; memory and transfers as profiled), partition "
        "again with the package's settings and the run's schedule and microbatches, print both "
        "splits' predicted steps under the measured profile, and write the new package when "
        "it predicts a shorter step. Its checkpoints continue the old run's (train.py --resume "
        "with the old --checkpoint-dir).",
    )
    p.add_argument("package", type=Path, help="generated pipeline directory the run trained")
    p.add_argument(
        "--from-trace",
        required=True,
        type=Path,
        metavar="TRACE_DIR",
        help="the --trace directory of a train.py run of the package",
    )
    p.add_argument(
        "--out", type=Path, metavar="NEWPKG", help="directory of the new pipeline package"
    )
    p.add_argument("--dry-run", action="store_true", help="print the comparison, write nothing")
    package_options(p)
    p.add_argument(
        "--min-gain",
        type=Fraction("the old split's predicted step").parse,
        default=MIN_GAIN,
        metavar="FRACTION",
        help="write the new package only when its predicted step is at least this fraction "
        f"shorter than the old split's (default {MIN_GAIN}; 0: whenever it is not longer)",
    )
    add_option(p, "method", default=None, help="partitioning method (default: the package's)")
    p.add_argument(
        "--no-report", action="store_true", help="skip NEWPKG/report/report.html and its figures"
    )
    p.set_defaults(func=cmd_replan)


def cmd_replan(args: argparse.Namespace) -> None:
    if args.out is None and not args.dry_run:
        raise AutopipeError("give --out NEWPKG for the new package, or --dry-run to print only")
    if args.out is not None and not args.dry_run:
        check_output_dir(args.out, args.force)  # before the work, as compile does
    plan = replan(args.package, args.from_trace, method=args.method)
    print(replan_text(plan))
    if args.dry_run:
        print("dry run: nothing written")
        return
    out = write_replan(
        plan,
        args.out,
        force=args.force,
        report=not args.no_report,
        min_gain=args.min_gain,
        gpus_per_node=node_size(args.gpus_per_node, plan.new),
    )
    print(
        f"wrote {plan.new.num_stages}-stage pipeline to {out}; it continues the old run's "
        f"checkpoints: {torchrun(plan.new, out)} --checkpoint-dir DIR --resume --steps N"
    )
