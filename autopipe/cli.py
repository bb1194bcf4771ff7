"""The ``autopipe`` command line: one subcommand per compiler step, ``compile`` for all of them."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

from . import __version__
from .compiler import (
    CompileOptions,
    compile_spec,
    generate_step,
    load_graph,
    partition_step,
    plan_step,
    profile_step,
    trace_step,
)
from .checks import is_number
from .tracing.dynamic import DynamicDim, parse_dynamic
from .errors import AutopipeError
from .partitioning import DEFAULT_METHOD, METHODS, Partition
from .partitioning.search import plan_table
from .partitioning.simulator import SCHEDULES
from .progress import NORMAL, QUIET, VERBOSE, Phases
from .profiling import PROFILE_MODES, Profile
from .profiling.devices import link_bandwidth
from .spec import load_example
from .summary import format_partition, format_plans
from .verify import VerifyReport, check_files, verify


def _count(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``minimum``."""

    def count(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(
                f"must be an integer of at least {minimum}, got {text!r}"
            )
        return value

    return count


def _tolerance(text: str) -> float:
    """An argparse type: a finite number of at least 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not is_number(value, 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of at least 0, got {text!r}")
    return value


def _dynamic(text: str) -> DynamicDim:
    """An argparse type: a ``--dynamic`` declaration."""
    try:
        return parse_dynamic(text)
    except AutopipeError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix(f"--dynamic {text!r} ")) from None


def _expected(text: str) -> dict[str, int]:
    """An argparse type: ``NAME=SIZE[,NAME=SIZE]``."""
    sizes = {}
    for item in text.split(","):
        name, _, size = item.partition("=")
        if not name.strip().isidentifier() or not size.strip().isdigit():
            raise argparse.ArgumentTypeError(f"{item!r} must be NAME=SIZE, e.g. seq=512")
        sizes[name.strip()] = int(size)
    return sizes


def _link(text: str) -> str:
    """An argparse type: a known link name or a bandwidth in GB/s greater than 0."""
    try:
        link_bandwidth(text)
    except AutopipeError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--link ")) from None
    return text


def _trace_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("tracing")
    group.add_argument(
        "--depth",
        type=_count(0),
        help="group operators by module scope down to this depth (default: every module)",
    )
    group.add_argument(
        "--basic-blocks",
        type=lambda s: tuple(c for c in s.split(",") if c),
        default=(),
        metavar="CLASS,...",
        help="module classes kept whole in one unit (e.g. GPT2Block)",
    )
    group.add_argument(
        "--inline-blocks",
        action="store_true",
        default=None,
        help="generate every operator inline in the stages' forward, with no block submodules",
    )
    group.add_argument(
        "--dynamic",
        action="append",
        type=_dynamic,
        metavar="NAME[MIN:MAX]=INPUT:DIM,...",
        help="a dimension that changes from batch to batch, traced as such: seq=input_ids:1,"
        "labels:1 (repeatable; from 2 and unbounded by default: planned at the example's size)",
    )
    group.add_argument(
        "--loss",
        metavar="FILE.py:FN",
        help="loss FN(output, target) to train with; the model function then returns (model, args, kwargs, target)",
    )


def _profile_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("profiling")
    group.add_argument(
        "--profile",
        choices=PROFILE_MODES,
        default="analytic",
        help="analytic (default, deterministic) or measured on this machine",
    )
    group.add_argument(
        "--expected",
        type=_expected,
        metavar="NAME=SIZE[,NAME=SIZE]",
        help="with --dynamic: the sizes to predict time at, e.g. seq=512 (default: the upper "
        "bounds, else the example's sizes; memory is always predicted at those)",
    )
    group.add_argument(
        "--device-spec",
        metavar="NAME|FILE.json",
        help="target device for the cost model (default h100); a table name or a JSON spec",
    )
    group.add_argument(
        "--link",
        type=_link,
        metavar="NAME|GBPS",
        help="stage-to-stage link: nvlink4, pcie4, ib-ndr, ... or a bandwidth in GB/s",
    )


def _partition_options(parser: argparse.ArgumentParser, *, stages_required: bool = True) -> None:
    group = parser.add_argument_group("partitioning")
    group.add_argument(
        "--stages", type=_count(1), required=stages_required, help="number of pipeline stages"
    )
    group.add_argument(
        "--devices",
        type=_count(1),
        help="number of devices (ranks); fewer than --stages puts several stages on a device (default: one stage per device)",
    )
    _method_options(group)
    group.add_argument(
        "--schedule",
        choices=SCHEDULES,
        help="schedule the partition is made for and train.py runs by default (default: 1f1b for one stage per device, auto otherwise)",
    )
    group.add_argument(
        "--microbatches",
        type=_count(1),
        help="microbatches per step the cost model assumes (default 2 x stages)",
    )
    group.add_argument(
        "--dp-shard",
        type=_count(1),
        default=1,
        metavar="N",
        help="plan for each stage's parameters, gradients and optimizer state sharded over N "
        "data-parallel ranks (train.py --dp-shard N): 1/N of them per rank, plus the largest "
        "block gathered at a time (default 1)",
    )


def _method_options(group: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--method",
        choices=sorted(METHODS),
        default=DEFAULT_METHOD,
        help=f"partitioning method (default {DEFAULT_METHOD})",
    )
    group.add_argument(
        "--optimizer",
        choices=["sgd", "adamw"],
        default="adamw",
        help="optimizer whose state the memory model counts (default adamw)",
    )


def _search_options(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    group = parser.add_argument_group("plan search")
    group.add_argument(
        "--global-batch",
        type=_count(1),
        metavar="B",
        help="example microbatches per optimizer step, over all data-parallel ranks: the "
        "search splits them into microbatches, accumulation and shards (default 2 x --devices)",
    )
    group.add_argument(
        "--memory-margin",
        type=_fraction,
        default=0.1,
        metavar="F",
        help="fraction of each device's memory a plan leaves free (default 0.1)",
    )
    group.add_argument(
        "--max-stages-per-device",
        type=_count(1),
        default=2,
        metavar="K",
        help="stages per device the search tries: 1 .. K (default 2)",
    )
    return group


def _fraction(text: str) -> float:
    """An argparse type: a number in [0, 1)."""
    value = _tolerance(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"must be less than 1, got {text!r}")
    return value


def _options(args: argparse.Namespace, **overrides) -> CompileOptions:
    fields = {}
    for name in CompileOptions.__dataclass_fields__:
        if getattr(args, name, None) is not None:
            fields[name] = getattr(args, name)
    fields.update(overrides)
    fields.setdefault("stages", 1)
    return CompileOptions(**fields)


def cmd_trace(args: argparse.Namespace) -> None:
    example = load_example(args.spec)
    graph = trace_step(example, _options(args), source=args.spec, loss=args.loss)
    graph.save(args.output)
    print(f"traced {len(graph.calls)} operators in {len(graph.units)} units -> {args.output}")


def cmd_profile(args: argparse.Namespace) -> None:
    graph = load_graph(args.graph)
    spec = args.spec or graph.model.get("source")
    example = load_example(spec) if (args.profile == "measured" and spec) else None
    prof = profile_step(graph, _options(args), example)
    prof.save(args.output)
    total = sum(u.time for u in prof.units)
    print(
        f"profiled {len(prof.units)} units ({prof.source}): {total * 1e3:.3f} ms forward + "
        f"backward -> {args.output}"
    )


def cmd_partition(args: argparse.Namespace) -> None:
    graph = load_graph(args.graph)
    prof = Profile.load(args.profile_file)
    part = partition_step(graph, prof, _options(args))
    part.save(args.output)
    print(format_partition(graph, part))
    print(f"-> {args.output}")


def cmd_generate(args: argparse.Namespace) -> None:
    graph = load_graph(args.graph)
    part = Partition.load(args.partition)
    prof = Profile.load(args.profile_file) if args.profile_file else None
    out = generate_step(graph, part, args.out, prof=prof, force=args.force)
    print(f"wrote {part.num_stages}-stage pipeline to {out}")


def cmd_compile(args: argparse.Namespace) -> None:
    if args.search and args.devices is None:
        raise AutopipeError("--search needs --devices: the number of devices to plan for")
    if not args.search and args.stages is None:
        raise AutopipeError("--stages is required (or --search with --devices)")
    level = QUIET if args.quiet else VERBOSE if args.verbose else NORMAL
    result = compile_spec(
        args.spec,
        args.out,
        _options(args),
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
    part = result.partition
    processes = len(set(part.device_of_stage)) * part.settings.get("dp_shard", 1)
    print(f"train it: torchrun --nproc-per-node={processes} {result.out / 'train.py'} --steps 100")


def cmd_plan(args: argparse.Namespace) -> None:
    example = load_example(args.spec)
    options = _options(args, search=True)
    graph = trace_step(example, options, source=args.spec, loss=args.loss)
    prof = profile_step(graph, options, example)
    plans = plan_step(graph, prof, options)
    print(
        f"{len(plans)} plans for {args.devices} devices ({prof.source}), global batch "
        f"{plans[0].global_batch} example microbatches, best first:"
    )
    print(plan_table([plan.to_json() for plan in plans[: args.top]]))
    best = plans[0]
    if not best.fits:
        raise AutopipeError(
            "no plan fits: use more devices, a smaller --global-batch or --memory-margin, or a "
            "device with more memory (--device-spec)"
        )
    c = best.candidate
    print(
        f"best: autopipe compile {args.spec} --out DIR --search --devices {args.devices}"
        f"{f' --global-batch {args.global_batch}' if args.global_batch else ''}"
        f"{f' --max-stages-per-device {args.max_stages_per_device}' if args.max_stages_per_device != 2 else ''}"
        f"  (= --stages "
        f"{c.stages} --devices {c.ranks} --schedule {c.schedule} --microbatches {c.microbatches} "
        f"--accumulate {c.accumulate} --dp-shard {c.dp_shard})"
    )


def cmd_verify(args: argparse.Namespace) -> None:
    if args.spec is None:  # the files alone
        report = VerifyReport(edited=check_files(args.dir))
    else:
        report = verify(args.dir, load_example(args.spec), rtol=args.rtol, atol=args.atol)
    print(report.summary())
    if not report.ok:
        raise SystemExit(1)
    print("the pipeline matches the model" if args.spec else "the pipeline is as generated")


def cmd_calibrate(args: argparse.Namespace) -> None:
    import json

    import torch

    from .artifacts import atomic_write_text
    from .profiling.calibrate import calibrate

    device = torch.device(args.device) if args.device else None
    spec = calibrate(device, args.name, log=lambda message: print(message, file=sys.stderr))
    atomic_write_text(args.output, json.dumps(spec.to_json(), indent=1) + "\n")
    print(
        f"wrote device spec {spec.name!r} to {args.output}; use it with --device-spec {args.output}"
    )


def cmd_report(args: argparse.Namespace) -> None:
    from .report import write_report

    print(f"wrote {write_report(args.dir)}")


def cmd_show(args: argparse.Namespace) -> None:
    from .report import show_table

    print(show_table(args.dir))


def cmd_merge(args: argparse.Namespace) -> None:
    from .runtime.data import PipelineRunError
    from .runtime.train_state import STEP_NAME, merge_checkpoint, save_weights

    source = Path(args.checkpoint)
    root = source.parent if STEP_NAME.fullmatch(source.name) else source
    out = Path(args.output) if args.output else root / "merged.pt"
    target, home = out.resolve(), root.resolve()
    parts = target.relative_to(home).parts if target.is_relative_to(home) else ()
    if out.is_dir() or (
        parts and (STEP_NAME.fullmatch(parts[0]) or parts[0] in ("latest", ".lock"))
    ):
        raise AutopipeError(
            f"-o {out} would overwrite part of the checkpoint directory {root}; write the merged "
            "state_dict to a file outside its step-N directories"
        )
    if out.exists() and not args.force:
        raise AutopipeError(f"-o {out} already exists; pass --force to replace it")
    try:
        state, manifest = merge_checkpoint(source)
    except PipelineRunError as exc:
        raise AutopipeError(str(exc)) from None
    try:
        save_weights(state, out)
    except (OSError, RuntimeError) as exc:
        raise AutopipeError(f"could not write {out} ({exc}); nothing was written") from None
    print(
        f"wrote {manifest['model']} after step {manifest['step']} ({len(state)} tensors, original "
        f"names) to {out}; load it with model.load_state_dict"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autopipe",
        description="Compile a PyTorch model into a pipeline-parallel training program: "
        "trace -> profile -> partition -> generate.",
    )
    parser.add_argument("--version", action="version", version=f"autopipe {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    spec_help = (
        "model spec FILE.py:FUNCTION or package.module:FUNCTION returning (model, args[, kwargs])"
    )

    p = sub.add_parser(
        "compile",
        help="trace, profile, partition and generate in one go",
        description="Compile a model into a pipeline package.",
    )
    p.add_argument("spec", help=spec_help)
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
    _trace_options(p)
    _profile_options(p)
    _partition_options(p, stages_required=False)
    p.add_argument(
        "--accumulate",
        type=_count(1),
        metavar="K",
        help="pipeline runs per optimizer step train.py defaults to (default 1)",
    )
    search = _search_options(p)
    search.add_argument(
        "--search",
        action="store_true",
        help="search the plan for --devices devices (stages, placement, schedule, microbatches, "
        "accumulation, recomputation, --dp-shard) and generate the best; see `autopipe plan`",
    )
    p.set_defaults(func=cmd_compile)

    p = sub.add_parser(
        "plan",
        help="print the candidate plans for a number of devices, best first",
        description="Search every plan for --devices devices: --dp-shard degree, stages per "
        "device, schedule, microbatches and accumulation for --global-batch, and the "
        "recomputation that makes each fit; partition and simulate each, and print them "
        "side by side. `autopipe compile --search` generates the best.",
    )
    p.add_argument("spec", help=spec_help)
    p.add_argument(
        "--devices", type=_count(1), required=True, help="devices to plan for (all of them)"
    )
    _method_options(p)
    p.add_argument("--top", type=_count(1), default=15, help="plans to print (default 15)")
    _search_options(p)
    _trace_options(p)
    _profile_options(p)
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser(
        "trace",
        help="capture the model into a graph (graph.json)",
        description="Trace a model with torch.export into the graph IR.",
    )
    p.add_argument("spec", help=spec_help)
    p.add_argument(
        "-o",
        "--output",
        default="graph.json",
        type=Path,
        help="graph artefact to write (default graph.json)",
    )
    _trace_options(p)
    p.set_defaults(func=cmd_trace)

    p = sub.add_parser(
        "profile",
        help="cost every unit of a graph (profile.json)",
        description="Profile the units of a traced graph.",
    )
    p.add_argument("graph", type=Path, help="graph.json from `autopipe trace`")
    p.add_argument(
        "-o",
        "--output",
        default="profile.json",
        type=Path,
        help="profile artefact to write (default profile.json)",
    )
    p.add_argument(
        "--spec",
        help="model spec for --profile measured (default: the spec the graph was traced from)",
    )
    _profile_options(p)
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser(
        "partition",
        help="split a profiled graph into stages (partition.json)",
        description="Partition a graph into pipeline stages.",
    )
    p.add_argument("graph", type=Path, help="graph.json from `autopipe trace`")
    p.add_argument(
        "profile_file", metavar="profile", type=Path, help="profile.json from `autopipe profile`"
    )
    p.add_argument(
        "-o",
        "--output",
        default="partition.json",
        type=Path,
        help="partition artefact to write (default partition.json)",
    )
    _partition_options(p)
    p.set_defaults(func=cmd_partition)

    p = sub.add_parser(
        "generate",
        help="write the pipeline package",
        description="Generate the pipeline package from a graph and a partition.",
    )
    p.add_argument("graph", type=Path, help="graph.json from `autopipe trace`")
    p.add_argument("partition", type=Path, help="partition.json from `autopipe partition`")
    p.add_argument(
        "--out", required=True, type=Path, help="directory of the generated pipeline package"
    )
    p.add_argument(
        "--profile-file", type=Path, help="profile.json to keep beside the package (optional)"
    )
    p.add_argument(
        "--force", action="store_true", help="replace --out if it is a pipeline autopipe generated"
    )
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser(
        "verify",
        help="check a generated pipeline against the original model",
        description="Run the stages in one process against the original model and compare outputs, gradients and buffers.",
    )
    p.add_argument("dir", type=Path, help="generated pipeline directory")
    p.add_argument(
        "--spec",
        help=spec_help + " (with real weights); without it, only check the files against the "
        "manifest written at generation",
    )
    p.add_argument(
        "--rtol", type=_tolerance, default=1e-4, help="relative tolerance (default 1e-4)"
    )
    p.add_argument(
        "--atol", type=_tolerance, default=1e-5, help="absolute tolerance (default 1e-5)"
    )
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser(
        "calibrate",
        help="measure this machine's device into a device spec",
        description="Measure matmul FLOP/s, memory and link bandwidth of the local device and write a device spec JSON for --device-spec.",
    )
    p.add_argument(
        "-o",
        "--output",
        default="device.json",
        type=Path,
        help="spec file to write (default device.json)",
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        help="device to measure (default: cuda when present, else cpu)",
    )
    p.add_argument("--name", help="name of the spec (default: the device's name)")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser(
        "merge",
        help="write a training checkpoint as one original-model state_dict",
        description="Merge the stages of a train.py checkpoint (--checkpoint-dir) into the "
        "original model's state_dict, tied names included, for model.load_state_dict.",
    )
    p.add_argument(
        "checkpoint",
        type=Path,
        help="a --checkpoint-dir (its latest checkpoint) or one of its step-N directories",
    )
    p.add_argument(
        "-o",
        "--output",
        type=Path,
        help="file to write: .safetensors, or anything else for torch.save (default "
        "merged.pt in the checkpoint directory)",
    )
    p.add_argument("--force", action="store_true", help="replace the output file if it exists")
    p.set_defaults(func=cmd_merge)

    p = sub.add_parser(
        "report",
        help="write the HTML report of a compiled pipeline",
        description="Write DIR/report/report.html (stage times, simulated timeline, memory per "
        "device, model graph by stage) and its figures as SVG and PNG.",
    )
    p.add_argument("dir", type=Path, help="generated pipeline directory")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser(
        "show",
        help="print the stages of a compiled pipeline",
        description="Print a table of the stages: device, units, parameters, predicted times, "
        "memory, inputs and outputs.",
    )
    p.add_argument("dir", type=Path, help="generated pipeline directory")
    p.set_defaults(func=cmd_show)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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
