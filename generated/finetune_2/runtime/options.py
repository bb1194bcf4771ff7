"""Command line of a generated ``train.py``, and which torch schedules fit the pipeline.

Copied into every generated pipeline as ``runtime/options.py``; it needs only torch.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import torch

from .pipeline import Pipeline

#: --schedule names -> torch.distributed.pipelining classes running one stage per rank, in order
SINGLE_STAGE = {"gpipe": "GPipe", "1f1b": "1F1B"}
#: ... and running several stages per rank: looped placements (stage s on rank s mod ranks) or V
MULTI_STAGE = {
    "interleaved-1f1b": "Interleaved1F1B",
    "looped-bfs": "LoopedBFS",
    "interleaved-zero-bubble": "InterleavedZeroBubble",
    "zbv": "ZBVZeroBubble",
    "dualpipev": "DualPipeV",
}
#: "auto": autopipe's order for any placement (runtime/schedule.py), run by torch's schedule runtime
SCHEDULES = (*SINGLE_STAGE, *MULTI_STAGE, "auto")
#: schedules that split each backward into an input part and a weight part (zero bubble)
SPLIT_BACKWARD = ("interleaved-zero-bubble", "zbv", "dualpipev")
V_SHAPED = ("zbv", "dualpipev")


@dataclass(frozen=True)
class TrainConfig:
    """train.py's command line, parsed and checked once (see ``parse_config``)."""

    # run
    steps: int
    microbatches: int
    schedule: str
    dp: int  # replicas of each stage
    dp_shard: int  # ranks each stage's state is sharded over (FSDP2)
    gather: str  # sharded parameters gathered per "block" call or once per "step" (never "auto")
    dp_overlap: bool  # reduce gradients while the step's last backward runs
    device: str
    seed: int
    timeout: float
    # optimisation
    optimizer: str
    lr: float
    weight_decay: float
    momentum: float
    warmup_steps: int
    lr_decay: str
    min_lr: float
    clip_grad_norm: float | None
    accumulate: int
    bf16: bool
    compile: bool  # torch.compile each stage, one compilation per block class
    skip_nonfinite: bool
    recompute: frozenset[int]  # the stages whose activations are recomputed in backward
    recompute_blocks: frozenset[str]  # blocks (original names) recomputed one by one
    # data and weights
    data: str | None
    pad_to_multiple: int  # dynamic dimensions rounded up to a multiple of this (1: as given)
    load: str | None
    save: str | None
    # checkpoints
    checkpoint_dir: str | None
    checkpoint_every: int
    keep_checkpoints: int
    resume: bool
    resume_from: str | None
    # metrics
    log_json: str | None
    log_every: int
    track_memory: bool

    @property
    def gathers_per_block(self) -> bool:
        """Whether sharded parameters are gathered per block call and gradients reduce-scattered
        every microbatch (``--gather block`` with ``--dp-shard`` above 1)."""
        return self.dp_shard > 1 and self.gather == "block"

    @property
    def data_parallel(self) -> int:
        """Data-parallel ranks per stage (replicas x shards): each trains on its own slice."""
        return self.dp * self.dp_shard


def parse_config(argv: list[str], pipeline: Pipeline) -> TrainConfig:
    num_stages, ranks = pipeline.num_stages, pipeline.num_ranks
    microbatches = pipeline.default_microbatches
    parser = argparse.ArgumentParser(
        prog="train.py",
        description=f"Train {pipeline.model_class} as a {num_stages}-stage pipeline "
        f"(torchrun --nproc-per-node={ranks * pipeline.dp_shard} train.py; with --dp M --dp-shard "
        f"N, {ranks} x M x N processes).",
    )
    run = parser.add_argument_group("run")
    run.add_argument("--steps", type=int, default=10, help="optimizer steps to run (default 10)")
    run.add_argument(
        "--microbatches",
        type=int,
        default=microbatches,
        help="microbatches per pipeline run; a step's batch is microbatches x accumulate x dp x dp-shard "
        f"example microbatches (default {microbatches}, the plan's)",
    )
    default_schedule = pipeline.schedule.name
    run.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default=default_schedule,
        help=f"pipeline schedule (default {default_schedule}, the one the partition was made for)",
    )
    run.add_argument(
        "--dp",
        type=int,
        default=1,
        metavar="N",
        help="data-parallel replicas of each stage, gradients all-reduced while backward runs "
        "(default 1)",
    )
    run.add_argument(
        "--dp-shard",
        type=int,
        default=pipeline.dp_shard,
        metavar="N",
        help="shard each stage's parameters, gradients and optimizer state over N ranks (FSDP2); "
        f"with --dp M the world size is {ranks} x M x N (default {pipeline.dp_shard}, what the "
        "partition planned memory for)",
    )
    run.add_argument(
        "--gather",
        choices=["auto", "block", "step"],
        default="auto",
        help="with --dp-shard: block gathers each block's parameters for its forward and again "
        "for its backward and reduce-scatters its gradients after every microbatch (parameters, "
        "gradients and optimizer state all take 1/N; what autopipe compile --dp-shard plans "
        "for); step gathers a stage's parameters once per step and reduces its gradients once "
        "(fewer collectives, but the whole stage's parameters and gradients are held during the "
        "step); auto: block, or step under the split-backward schedules (default auto)",
    )
    run.add_argument(
        "--dp-overlap",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reduce each block's gradients as soon as its last backward ends, while the rest "
        "of the backward runs; --no-dp-overlap reduces them all after it (default: overlap)",
    )
    run.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda runs NCCL with one GPU per rank, cpu runs gloo (default: cuda when available)",
    )
    run.add_argument(
        "--seed", type=int, default=0, help="seed of initialisation, dropout and synthetic data"
    )
    run.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="how long a rank waits for the others before giving up (default 300)",
    )

    optim = parser.add_argument_group("optimisation")
    optim.add_argument(
        "--optimizer", choices=["sgd", "adamw"], default="adamw", help="optimizer (default adamw)"
    )
    optim.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    optim.add_argument("--weight-decay", type=float, default=0.0, help="weight decay (default 0)")
    optim.add_argument("--momentum", type=float, default=0.0, help="SGD momentum (default 0)")
    optim.add_argument(
        "--warmup-steps",
        type=int,
        default=0,
        metavar="N",
        help="linear learning-rate warm-up from 0 over N steps (default 0)",
    )
    optim.add_argument(
        "--lr-decay",
        choices=["constant", "linear", "cosine"],
        default="constant",
        help="learning-rate decay after warm-up, down to --min-lr at --steps (default constant)",
    )
    optim.add_argument("--min-lr", type=float, default=0.0, help="final learning rate of decay")
    optim.add_argument(
        "--clip-grad-norm",
        type=float,
        metavar="MAX",
        help="clip gradients to this global norm over all stages (tied parameters counted once)",
    )
    optim.add_argument(
        "--accumulate",
        type=int,
        default=pipeline.default_accumulate,
        metavar="K",
        help="gradient accumulation: K pipeline runs per optimizer step (default "
        f"{pipeline.default_accumulate}, the plan's)",
    )
    optim.add_argument(
        "--bf16",
        action="store_true",
        help="run the stages under bfloat16 autocast (values between stages stay in their dtype)",
    )
    optim.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile each stage, its blocks as nested compile regions (one compilation "
        "per block class, reused by identical blocks); a stage with blocks recomputed one by one "
        "compiles block by block",
    )
    optim.add_argument(
        "--skip-nonfinite",
        action="store_true",
        help="skip a step whose loss or gradient norm is not finite (default: stop the run there; "
        "either way such a step never reaches the weights or a checkpoint)",
    )
    optim.add_argument(
        "--recompute",
        default="auto",
        metavar="auto|all|none|S,S|blocks[:S,S|/K]",
        help="recompute activations in backward (torch.utils.checkpoint): of whole stages (all, "
        "or stage numbers), or of blocks one by one (blocks: every block; blocks:S,S: the blocks "
        "of those stages; blocks/K: every K-th block); auto: the stages and blocks the "
        "partitioner chose to fit device memory (default auto)",
    )

    data = parser.add_argument_group("data and weights")
    data.add_argument(
        "--data",
        metavar="FILE.py:FN",
        help="FN(step) returns (args, kwargs) or (args, kwargs, target), the step's whole batch "
        "(batch dimension 0); or FN() returns a torch.utils.data.Dataset of dicts of tensors "
        "(input names, and 'target' for a --loss), read in a seeded order "
        "(default: synthetic batches of the example's shapes)",
    )
    data.add_argument(
        "--pad-to-multiple",
        type=int,
        default=1,
        metavar="K",
        help="pipelines compiled with --dynamic: pad each batch's dynamic dimensions (not the "
        "batch dimension) up to a multiple of K within their bounds, so that fewer distinct shapes "
        "occur; inputs named *labels* are padded with -100 (ignored by the loss), others with 0 "
        "(attention masks: masked out). Default 1: no padding",
    )
    data.add_argument(
        "--load",
        metavar="PATH",
        help="original-model weights: a torch.save state_dict, a .safetensors file or a Hugging "
        "Face checkpoint directory (sharded with an index JSON); each rank reads only its tensors",
    )
    data.add_argument(
        "--save",
        metavar="PATH",
        help="write the trained original-model state_dict here (.safetensors or torch.save)",
    )

    ckpt = parser.add_argument_group("checkpoints")
    ckpt.add_argument(
        "--checkpoint-dir", metavar="DIR", help="write training checkpoints into DIR/step-N"
    )
    ckpt.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        metavar="N",
        help="checkpoint every N steps (and after the last); default: only after the last",
    )
    ckpt.add_argument(
        "--keep-checkpoints",
        type=int,
        default=3,
        metavar="N",
        help="keep the newest N checkpoints (default 3; 0 keeps all)",
    )
    ckpt.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest checkpoint in --checkpoint-dir (weights, optimizer, "
        "learning rate, RNG and data position), if there is one",
    )
    ckpt.add_argument(
        "--resume-from",
        metavar="step-N",
        help="continue from this checkpoint of --checkpoint-dir instead of the latest (e.g. when "
        "the latest is damaged)",
    )

    logs = parser.add_argument_group("metrics")
    logs.add_argument(
        "--log-json",
        metavar="PATH",
        help="write one JSON object per step: step, loss, time, samples_per_s, tokens_per_s, lr, "
        "grad_norm, peak_memory and state_bytes (bytes per rank: the peak, and the parameters, "
        "gradients and optimizer state held)",
    )
    logs.add_argument(
        "--track-memory",
        action="store_true",
        help="on CPU, report peak memory as the most bytes of live tensors (counted operator by "
        "operator through setup and the first two steps, which run slower) instead of the "
        "process's resident size; CUDA always reports the allocator's peak",
    )
    logs.add_argument(
        "--log-every", type=int, default=1, metavar="N", help="print every N steps (default 1)"
    )
    args = parser.parse_args(argv)
    for name in ("steps", "checkpoint_every", "warmup_steps", "keep_checkpoints"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0")
    for name in ("microbatches", "dp", "dp_shard", "accumulate", "log_every", "pad_to_multiple"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.pad_to_multiple > 1 and not pipeline.dimensions:
        parser.error(
            "--pad-to-multiple pads dynamic dimensions; this pipeline has none (compile with "
            "--dynamic)"
        )
    if args.resume_from:
        args.resume = True
    if args.resume and not args.checkpoint_dir:
        parser.error("--resume needs --checkpoint-dir, the directory the checkpoints are in")
    for name in ("lr", "min_lr", "weight_decay", "momentum", "clip_grad_norm", "timeout"):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value >= 0):
            parser.error(f"--{name.replace('_', '-')} must be a finite number >= 0, got {value}")
    if args.timeout == 0:
        parser.error("--timeout must be > 0 seconds")
    args.recompute, args.recompute_blocks = recompute_choice(parser, args.recompute, pipeline)
    problem = schedule_problem(args.schedule, pipeline, args.microbatches)
    if problem:
        parser.error(problem)
    if args.gather == "auto":
        args.gather = "step" if args.schedule in SPLIT_BACKWARD else "block"
    elif args.gather == "block" and args.schedule in SPLIT_BACKWARD:
        parser.error(
            f"--gather block does not work with --schedule {args.schedule}: its weight passes "
            "need each stage's parameters gathered from the input backward on; use --gather step"
        )
    return TrainConfig(**vars(args))


def recompute_choice(
    parser: argparse.ArgumentParser, value: str, pipeline: Pipeline
) -> tuple[frozenset[int], frozenset[str]]:
    """The stages recomputed whole and the blocks recomputed one by one that ``--recompute``
    names: ``auto`` (the partitioner's choice), ``all``, ``none``, stage numbers ``0,2``, ``blocks`` (every block),
    ``blocks:0,2`` (the blocks of those stages) or ``blocks/K`` (every K-th block along the
    pipeline: the first, the K+1-th, ...)."""
    blocks = [fqn for stage in pipeline.stages for fqn in stage.blocks]
    kind, _, rest = value.partition(":") if ":" in value else value.partition("/")
    if kind == "blocks":
        if not blocks:
            parser.error(
                f"--recompute {value!r}: this pipeline's stages hold no blocks (compiled with "
                "--inline-blocks, or the model repeats no module); give stage numbers"
            )
        if not rest:
            return frozenset(), frozenset(blocks)
        if "/" in value:
            every = _integer(parser, value, rest)
            if every < 1:
                parser.error(f"--recompute {value!r}: K in blocks/K must be at least 1")
            return frozenset(), frozenset(blocks[::every])
        stages = _stage_numbers(parser, value, rest, pipeline.num_stages)
        return frozenset(), frozenset(b for s in stages for b in pipeline.stages[s].blocks)
    if value == "auto":
        return pipeline.recomputed, pipeline.recomputed_blocks
    if value == "all":
        return frozenset(range(pipeline.num_stages)), frozenset()
    if value == "none":
        return frozenset(), frozenset()
    return _stage_numbers(parser, value, value, pipeline.num_stages), frozenset()


def _integer(parser: argparse.ArgumentParser, value: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        parser.error(
            f"--recompute {value!r}: give auto, all, none, stage numbers like 0,1, blocks, "
            "blocks:0,1 or blocks/2"
        )


def _stage_numbers(
    parser: argparse.ArgumentParser, value: str, text: str, num_stages: int
) -> frozenset[int]:
    stages = {_integer(parser, value, s) for s in text.split(",")}
    if not stages <= set(range(num_stages)):
        parser.error(f"--recompute {value!r}: this pipeline has stages 0 to {num_stages - 1}")
    return frozenset(stages)


def schedule_problem(name: str, pipeline: Pipeline, microbatches: int) -> str | None:
    """Why schedule ``name`` cannot run this pipeline, naming what would; None if it can."""
    return schedule_problem_for(name, pipeline.rank_of_stage, pipeline.num_ranks, microbatches)


def schedule_problem_for(name: str, placed: list[int], ranks: int, microbatches: int) -> str | None:
    """Why schedule ``name`` cannot run stages placed on ``placed`` ranks (of ``ranks``) with
    ``microbatches`` microbatches, naming what would; None if it can."""
    num_stages = len(placed)
    if name in SINGLE_STAGE:
        if placed != list(range(num_stages)):
            fits = [s for s in MULTI_STAGE if placed == placement(s, num_stages, ranks)]
            return (
                f"--schedule {name} runs one stage per rank, in order, but this pipeline places its "
                f"{num_stages} stages on ranks {placed}; use --schedule {' or '.join(['auto', *fits])}"
            )
        if name == "1f1b" and microbatches < num_stages:
            return (
                f"--schedule 1f1b needs at least as many microbatches as stages ({num_stages}); got "
                f"--microbatches {microbatches}. Use --microbatches {num_stages} or more, or --schedule gpipe."
            )
    elif name in MULTI_STAGE:
        expected = placement(name, num_stages, ranks)
        if num_stages % ranks or placed != expected:
            shape = "V-shaped" if name in V_SHAPED else "looped"
            fits = [
                s
                for s in (*SINGLE_STAGE, *MULTI_STAGE)
                if s != name and placed == placement(s, num_stages, ranks)
            ]
            return (
                f"--schedule {name} needs stage s on rank {expected} ({shape}), but this pipeline "
                f"places its stages on ranks {placed}; use --schedule {' or '.join(['auto', *fits])}, "
                f"or compile with --schedule {name}"
            )
        if name in V_SHAPED and num_stages != 2 * ranks:
            return f"--schedule {name} runs exactly two stages per rank; this pipeline has {num_stages} stages on {ranks} ranks"
        rounds = max(1, microbatches // ranks)
        if name in ("interleaved-1f1b", "interleaved-zero-bubble") and microbatches % rounds:
            fits = [
                m
                for m in range(microbatches, 2 * microbatches + ranks)
                if m % max(1, m // ranks) == 0
            ]
            return (
                f"--schedule {name} runs microbatches in rounds of the {ranks} ranks and needs a "
                f"multiple of the rounds; --microbatches {microbatches} is not. Use --microbatches {fits[0]}"
            )
        if name == "dualpipev" and microbatches < num_stages:
            return (
                f"--schedule dualpipev needs at least as many microbatches as stages ({num_stages}); "
                f"use --microbatches {num_stages} or more"
            )
    return None


def placement(schedule: str, num_stages: int, ranks: int) -> list[int]:
    """The stage -> rank placement a torch schedule runs: in order, looped, or V-shaped."""
    if schedule in V_SHAPED:
        return [s if s < ranks else 2 * ranks - 1 - s for s in range(num_stages)]
    return [s % ranks for s in range(num_stages)]
