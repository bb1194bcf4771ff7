"""``autopipe plan``: print the candidate plans for a number of devices, best first."""

from __future__ import annotations

import argparse
import shlex
import sys

from ..compiler import plan_step, profile_step, rank_profile, trace_step
from ..errors import AutopipeError
from ..options import COUNT
from ..partitioning.search import plan_table, state_floor, unsearched_note
from ..report.progress import NORMAL, QUIET, Phases
from ..report.summary import network_lines
from ..spec import load_example
from .arguments import (
    SPEC_HELP,
    Subparsers,
    add_option,
    add_options,
    compile_options,
    profile_options,
    search_options,
    trace_options,
)

__all__ = ["add_parser", "cmd_plan"]


def add_parser(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "plan",
        help="print the candidate plans for a number of devices, best first",
        description="Search every plan for --devices devices: tensor-parallel and --dp-shard "
        "degrees, stages per "
        "device, schedule, microbatches and accumulation for --global-batch, and the "
        "recomputation that makes each fit; partition and simulate each, and print them "
        "side by side. `autopipe compile --search` generates the best.",
    )
    p.add_argument("spec", help=SPEC_HELP)
    add_option(p, "devices", required=True, help="devices to plan for (all of them)")
    add_options(p, ("method", "optimizer"))
    p.add_argument("--top", type=COUNT.parse, default=15, help="plans to print (default 15)")
    add_option(search_options(p), "gpus_per_node")
    add_options(p, ("tp", "sequence_parallel"))
    trace_options(p)
    profile_options(p)
    p.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> None:
    example = load_example(args.spec)
    options = compile_options(args, search=True)
    graph = trace_step(example, options, source=args.spec, loss=args.loss)
    prof = profile_step(graph, options, example)
    phases = Phases(NORMAL if sys.stderr.isatty() else QUIET)  # progress on a terminal only
    with phases.phase("plan search"):
        plans = plan_step(graph, prof, options, progress=lambda done: phases.progress(str(done)))
    print(
        f"{len(plans)} plans for {args.devices} devices ({prof.source}), global batch "
        f"{plans[0].global_batch} example microbatches, best first:"
    )
    print(plan_table([plan.to_json() for plan in plans[: args.top]]))
    stopped = unsearched_note(plans)
    if stopped:
        print(stopped)
    best = plans[0]
    if not best.fits:
        shared = rank_profile(prof, options)  # each rank's memory, as the search planned it
        floor = state_floor(
            graph, shared, optimizer=options.optimizer, margin=options.memory_margin
        )
        raise AutopipeError(
            f"no plan fits: {floor}. Use more devices, a smaller --global-batch or "
            "--memory-margin, or a device with more memory (--device-spec)"
        )
    c = best.candidate
    print(
        f"best: autopipe compile {shlex.quote(args.spec)} --out DIR --search "
        f"{shlex.join(_compile_options(args.given, args.spec))}  (= --stages "
        f"{c.stages} --devices {c.ranks} --schedule {c.schedule} --microbatches {c.microbatches} "
        f"--accumulate {c.accumulate} --dp-shard {c.dp_shard}"
        f"{f' --tp {c.tp}' if c.tp > 1 else ''})"
    )
    assert best.partition is not None  # a plan that fits has its partition
    for line in network_lines(best.partition):
        print(f"best plan's {line}")


def _compile_options(given: list[str], spec: str) -> list[str]:
    """The options of ``autopipe plan``'s command line as given (every one is compile's too),
    less the command, the spec and ``--top`` (plan's alone): what ``compile --search`` needs to
    search the same plans (device spec, link, profile, tracing, search bounds)."""
    rest = given[given.index("plan") + 1 :]
    if spec in rest:
        rest.remove(spec)
    kept, skip = [], False
    for token in rest:
        if skip:
            skip = False
        elif token == "--top":
            skip = True
        elif not token.startswith("--top="):
            kept.append(token)
    return kept
