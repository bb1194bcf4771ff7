"""The ``autopipe`` command line: one subcommand per compiler step, ``compile`` for all of them."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import torch

from .adapters import merged_adapter
from ..artifacts import atomic_write_text
from ..artifacts import AUTOPIPE_VERSION as __version__
from ..codegen import check_output_dir
from ..compiler import (
    CompileOptions,
    compile_spec,
    generate_step,
    load_graph,
    partition_step,
    plan_step,
    profile_step,
    trace_step,
)
from ..errors import AutopipeError
from ..options import COUNT, OPTIONS, TOLERANCE, Fraction, flag_of
from ..partitioning import Partition
from ..partitioning.search import plan_table, state_floor, unsearched_note
from ..report.progress import NORMAL, QUIET, VERBOSE, Phases
from ..profiling import Profile
from ..profiling.calibrate import calibrate
from ..replan import MIN_GAIN, replan, replan_text, write_replan
from ..report import run_report, show_table, write_report
from ..runtime.core.errors import PipelineRunError
from ..runtime.core.pipeline import HuggingFaceModel, PipelineFormatError
from ..spec import load_example
from ..report.summary import format_partition, format_plans
from ..verify import VerifyReport, check_files, verify

#: where ``add_argument`` adds an argument: a parser or one of its argument groups
ArgumentContainer = argparse.ArgumentParser | argparse._ArgumentGroup

#: the compile options of each argument group, in the order --help lists them
TRACING = ("depth", "basic_blocks", "keep_whole", "inline_blocks", "dynamic", "batch_dims")
PROFILING = ("profile", "expected", "device_spec", "link")
PARTITIONING = (
    "stages",
    "devices",
    "method",
    "split_points",
    "optimizer",
    "schedule",
    "microbatches",
    "dp_shard",
)
PLAN_SEARCH = (
    "global_batch",
    "memory_margin",
    "max_stages_per_device",
    "search_seconds",
    "search_workers",
)


def _add_option(container: ArgumentContainer, name: str, **overrides: Any) -> None:
    """Add compile option ``name`` as :class:`CompileOptions` declares it (``overrides``
    replacing some of ``add_argument``'s keywords)."""
    container.add_argument(flag_of(name), **(OPTIONS[name].arguments() | overrides))


def _add_options(container: ArgumentContainer, names: tuple[str, ...]) -> None:
    for name in names:
        _add_option(container, name)


def _trace_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("tracing")
    _add_options(group, TRACING)
    group.add_argument(
        "--loss",
        metavar="FILE.py:FN",
        help="loss FN(output, target) to train with; the model function then returns (model, args, kwargs, target)",
    )


def _profile_options(parser: argparse.ArgumentParser) -> None:
    _add_options(parser.add_argument_group("profiling"), PROFILING)


def _partition_options(parser: argparse.ArgumentParser, *, stages_required: bool = True) -> None:
    group = parser.add_argument_group("partitioning")
    _add_option(group, "stages", required=stages_required)
    _add_options(group, PARTITIONING[1:])


def _search_options(parser: argparse.ArgumentParser) -> ArgumentContainer:
    group = parser.add_argument_group("plan search")
    _add_options(group, PLAN_SEARCH)
    return group


def _options(args: argparse.Namespace, **overrides: Any) -> CompileOptions:
    """The compile options given on the command line (the defaults for those not given)."""
    given = {name: getattr(args, name) for name in OPTIONS if getattr(args, name, None) is not None}
    given.update(overrides)
    given.setdefault("stages", 1)
    return CompileOptions(**given)


def cmd_trace(args: argparse.Namespace) -> None:
    example = load_example(args.spec)
    graph = trace_step(example, _options(args), source=args.spec, loss=args.loss)
    graph.save(args.output)
    print(f"traced {len(graph.calls)} operators in {len(graph.units)} units -> {args.output}")


def cmd_profile(args: argparse.Namespace) -> None:
    graph = load_graph(args.graph)
    spec = args.spec or graph.model.source
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
    out = generate_step(
        graph, part, args.out, prof=prof, force=args.force, gpus_per_node=args.gpus_per_node
    )
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
    print(f"train it: {_torchrun(result.partition, result.out)} --steps 100")


def cmd_plan(args: argparse.Namespace) -> None:
    example = load_example(args.spec)
    options = _options(args, search=True)
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
        floor = state_floor(graph, prof, optimizer=options.optimizer, margin=options.memory_margin)
        raise AutopipeError(
            f"no plan fits: {floor}. Use more devices, a smaller --global-batch or "
            "--memory-margin, or a device with more memory (--device-spec)"
        )
    c = best.candidate
    print(
        f"best: autopipe compile {shlex.quote(args.spec)} --out DIR --search "
        f"--devices {args.devices}"
        f"{f' --global-batch {args.global_batch}' if args.global_batch else ''}"
        f"{f' --max-stages-per-device {options.max_stages_per_device}' if options.max_stages_per_device != 2 else ''}"
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
    device = torch.device(args.device) if args.device else None
    spec = calibrate(device, args.name, log=lambda message: print(message, file=sys.stderr))
    atomic_write_text(args.output, json.dumps(spec.to_json(), indent=1) + "\n")
    print(
        f"wrote device spec {spec.name!r} to {args.output}; use it with --device-spec "
        f"{shlex.quote(str(args.output))}"
    )


def cmd_report(args: argparse.Namespace) -> None:
    if args.run is None:
        print(f"wrote {write_report(args.dir)}")
        return
    page, summary = run_report(args.dir, args.run)
    print(f"wrote {page}")
    print(summary)


def cmd_show(args: argparse.Namespace) -> None:
    print(show_table(args.dir))


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
        gpus_per_node=args.gpus_per_node,
    )
    print(
        f"wrote {plan.new.num_stages}-stage pipeline to {out}; it continues the old run's "
        f"checkpoints: {_torchrun(plan.new, out)} --checkpoint-dir DIR --resume --steps N"
    )


def _torchrun(part: Partition, package: Path) -> str:
    """The torchrun command of one node running the package's pipeline on its devices."""
    processes = len(set(part.device_of_stage)) * (part.settings.dp_shard or 1)
    return f"torchrun --nproc-per-node={processes} {shlex.quote(str(package / 'train.py'))}"


def cmd_merge(args: argparse.Namespace) -> None:
    # imported here, not above: train_state brings torch.distributed.pipelining, torch._dynamo and
    # torch.distributed.checkpoint, which would slow every other command's start-up
    from ..runtime.huggingface import directory_problem, write_pretrained
    from ..runtime.train_state import (
        STEP_NAME,
        checked_checkpoint,
        merged_state,
        save_weights,
        trainable_only_note,
    )

    source = Path(args.checkpoint)
    root = source.parent if STEP_NAME.fullmatch(source.name) else source
    if args.merge_adapters and not args.hf:
        raise AutopipeError("--merge-adapters says how --hf DIR is written; give --hf DIR")
    if args.hf and args.output:
        raise AutopipeError("give -o FILE (a state_dict) or --hf DIR (a model directory), not both")
    out = args.hf or (Path(args.output) if args.output else root / "merged.pt")
    target, home = out.resolve(), root.resolve()
    parts = target.relative_to(home).parts if target.is_relative_to(home) else ()
    option = "--hf" if args.hf else "-o"
    if (
        (out.is_dir() and not args.hf)
        or (parts and (STEP_NAME.fullmatch(parts[0]) or parts[0] in ("latest", ".lock")))
        or target == home
    ):
        raise AutopipeError(
            f"{option} {out} would overwrite part of the checkpoint directory {root}; write the "
            f"merged {'model' if args.hf else 'state_dict'} outside its step-N directories"
        )
    if home.is_relative_to(target):
        raise AutopipeError(
            f"{option} {out} holds the checkpoint directory {root}; a model directory is written "
            f"only where nothing else lies: write it beside the checkpoints instead, e.g. --hf "
            f"{home.parent / (home.name + '-hf')}"
        )
    if args.hf:  # a model directory: only one autopipe wrote is replaced, and only its files
        problem = directory_problem(target, "--hf", replace=args.force, file_option="-o FILE")
        if problem:
            raise AutopipeError(problem)
    elif out.exists() and not args.force:
        raise AutopipeError(f"{option} {out} already exists; pass --force to replace it")
    dtype = getattr(torch, args.dtype) if args.dtype else None
    try:  # the manifest first: what it refuses is refused before any tensor is read
        checkpoint, manifest = checked_checkpoint(source)
    except PipelineRunError as exc:
        raise AutopipeError(str(exc)) from None
    step = f"{manifest['model']} after step {manifest['step']}"
    partial = trainable_only_note(manifest, source)
    hf = _merged_model(manifest, source, partial, args.merge_adapters) if args.hf else None
    try:
        state = merged_state(checkpoint, manifest)
    except PipelineRunError as exc:
        raise AutopipeError(str(exc)) from None
    if hf is not None:
        aliases = manifest["aliases"]
        if args.merge_adapters:
            state, hf, aliases = merged_adapter(state, hf, aliases)
        try:
            count = write_pretrained(state, hf, aliases, out, dtype=dtype, replace=args.force)
        except (OSError, RuntimeError, PipelineRunError) as exc:
            raise AutopipeError(f"could not write {out} ({exc}); nothing was written") from None
        architecture = hf.config.get("architectures", ["AutoModel"])[0]
        if hf.adapter is not None:
            print(
                f"wrote the adapter of {step} ({count} tensors) to {out}; load it with "
                f"PeftModel.from_pretrained({architecture}.from_pretrained(BASE), {str(out)!r})"
            )
        else:
            print(
                f"wrote {step} ({count} tensors, tied ones once) to {out}; load it with "
                f"{architecture}.from_pretrained"
            )
        return
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    try:
        save_weights(state, out)
    except (OSError, RuntimeError) as exc:
        raise AutopipeError(f"could not write {out} ({exc}); nothing was written") from None
    print(
        f"wrote {step} ({len(state)} tensors, original names) to {out}; load it with "
        "model.load_state_dict"
    )
    if partial:
        print(f"note: {partial}")


def _merged_model(
    manifest: dict[str, Any], source: Path, partial: str | None, merge_adapters: bool
) -> HuggingFaceModel:
    """What ``merge --hf`` writes the checkpoint as (its recorded Hugging Face description), or
    the reason it cannot: no description recorded, only the trainable tensors of a model that
    is not an adapter (or of one whose adapter is to be merged), ``--merge-adapters`` for a
    model without an adapter. ``partial``: the note of a trainable-only checkpoint."""
    if "huggingface" not in manifest:
        raise AutopipeError(
            f"--hf writes a Hugging Face model directory, and {source} holds no Hugging Face "
            f"configuration: {manifest['model']} is not a transformers PreTrainedModel, or its "
            "package was compiled before autopipe recorded configurations (recompile it, then "
            "merge a checkpoint it writes); use -o FILE for a state_dict"
        )
    try:
        hf = HuggingFaceModel.from_json(manifest["huggingface"], "checkpoint.json: huggingface")
    except PipelineFormatError as exc:
        raise AutopipeError(f"{source} is damaged ({exc})") from None
    if partial and (hf.adapter is None or merge_adapters):
        raise AutopipeError(
            f"{source} holds only the trainable tensors (--save-trainable-only), and "
            + (
                "--merge-adapters needs the base weights too; merge without "
                "--merge-adapters to write the adapter, for PeftModel.from_pretrained over "
                "the base model"
                if hf.adapter is not None
                else "a from_pretrained directory needs every weight; -o FILE writes the "
                "trainable ones"
            )
        )
    if merge_adapters and hf.adapter is None:
        raise AutopipeError(
            f"--merge-adapters merges a PEFT model's adapter into its base weights, and "
            f"{manifest['model']} is not a PEFT model; leave --merge-adapters out"
        )
    return hf


def _package_options(p: argparse.ArgumentParser) -> None:
    """The options of a command that writes a package: replacing it, the launch script's nodes."""
    p.add_argument(
        "--force", action="store_true", help="replace --out if it is a pipeline autopipe generated"
    )
    p.add_argument(
        "--gpus-per-node",
        type=COUNT.parse,
        default=8,
        metavar="G",
        help="GPUs per node the package's launch/slurm.sbatch asks for (default 8)",
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
    _add_option(p, "accumulate")
    _add_option(_search_options(p), "search")
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
    _add_option(p, "devices", required=True, help="devices to plan for (all of them)")
    _add_options(p, ("method", "optimizer"))
    p.add_argument("--top", type=COUNT.parse, default=15, help="plans to print (default 15)")
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
    _package_options(p)
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
        "--rtol", type=TOLERANCE.parse, default=1e-4, help="relative tolerance (default 1e-4)"
    )
    p.add_argument(
        "--atol", type=TOLERANCE.parse, default=1e-5, help="absolute tolerance (default 1e-5)"
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
    p.add_argument(
        "--hf",
        type=Path,
        metavar="DIR",
        help="write a Hugging Face model directory instead, which from_pretrained loads as is: "
        "config.json and generation_config.json as recorded at compile time, safetensors "
        "shards with an index, tied weights once (a transformers model's packages only)",
    )
    p.add_argument(
        "--merge-adapters",
        action="store_true",
        help="with --hf, for a PEFT model: merge the trained adapter into the base model's "
        "weights (with PEFT's merge_and_unload) and write the base model's directory; by default "
        "the adapter is written as PEFT saves it (adapter_config.json, "
        "adapter_model.safetensors), for PeftModel.from_pretrained over the base model",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="convert floating-point tensors to this dtype (default: as trained)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace the output file, or the model directory autopipe wrote at --hf DIR (only "
        "its own files are removed; a directory holding anything else is refused with or "
        "without --force)",
    )
    p.set_defaults(func=cmd_merge)

    p = sub.add_parser(
        "report",
        help="write the HTML report of a compiled pipeline",
        description="Write DIR/report/report.html (stage times, simulated timeline, memory per "
        "device, model graph by stage) and its figures as SVG and PNG. With --run, add the "
        "measured run beside its prediction and print a summary of it.",
    )
    p.add_argument("dir", type=Path, help="generated pipeline directory")
    p.add_argument(
        "--run",
        type=Path,
        metavar="TRACE_DIR",
        help="the --trace directory of a train.py run of this pipeline: compare its measured "
        "timeline, stage times and bubble with the prediction of that run",
    )
    p.set_defaults(func=cmd_report)

    p = sub.add_parser(
        "show",
        help="print the stages of a compiled pipeline",
        description="Print a table of the stages: device, units, parameters, predicted times, "
        "memory, inputs and outputs.",
    )
    p.add_argument("dir", type=Path, help="generated pipeline directory")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser(
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
    _package_options(p)
    p.add_argument(
        "--min-gain",
        type=Fraction("the old split's predicted step").parse,
        default=MIN_GAIN,
        metavar="FRACTION",
        help="write the new package only when its predicted step is at least this fraction "
        f"shorter than the old split's (default {MIN_GAIN}; 0: whenever it is not longer)",
    )
    _add_option(p, "method", default=None, help="partitioning method (default: the package's)")
    p.add_argument(
        "--no-report", action="store_true", help="skip NEWPKG/report/report.html and its figures"
    )
    p.set_defaults(func=cmd_replan)
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
