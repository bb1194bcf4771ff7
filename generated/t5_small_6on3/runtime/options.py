"""Command line of a generated ``train.py``: one argparse group per concern (run, optimisation,
data and weights, checkpoints, evaluation, metrics, observability, dry run), each option declared
once with its help text, and one validation of the parsed options against each other and the
pipeline.

Copied into every generated pipeline as ``runtime/options.py``; it needs only torch. The schedules
it offers, and whether one fits the pipeline, come from the catalogue in ``core/schedules.py``.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import torch

from .core.pipeline import Pipeline
from .core.schedules import SCHEDULES, SPLIT_BACKWARD, schedule_problem_for
from .hangs import DIAGNOSIS_MARGIN
from .huggingface import file_name_problem
from .sinks import SINK_PACKAGES, missing_package
from .timeline import parse_steps


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
    tokenizer: str | None  # tokenizes --data / --eval-data dataset files
    pad_to_multiple: int  # dynamic dimensions rounded up to a multiple of this (1: as given)
    load: str | None
    load_partial: bool  # --load may hold tensors this model has not: they are left out
    save: str | None
    save_format: str | None  # torch, safetensors or hf; None: by --save's suffix
    force: bool  # --save may replace a model directory autopipe wrote before
    # checkpoints
    checkpoint_dir: str | None
    checkpoint_every: int
    keep_checkpoints: int
    resume: bool
    resume_from: str | None
    save_trainable_only: bool  # checkpoints and --save hold no frozen parameters
    # evaluation
    eval_data: str | None
    eval_every: int  # evaluate after every N optimizer steps (0: at the end only)
    eval_batches: int  # held-out batches per evaluation
    eval_only: bool  # evaluate the loaded or resumed weights, train nothing
    eval_split: str | None  # the split of a --eval-data DatasetDict evaluated (None: validation)
    # metrics
    log_json: str | None
    tensorboard: str | None  # TensorBoard event files' directory
    wandb: str | None  # Weights & Biases project
    log_every: int
    track_memory: bool
    # observability
    trace: str | None  # the directory of the measured timeline
    trace_steps: tuple[int, int] | None  # the traced steps [A, B); None: timeline.default_steps
    # dry run
    dry_run: bool  # play ranks of the job in this process, on fake tensors (dry_run.py)
    world_size: int | None  # the job's processes (--dry-run; torchrun's otherwise)
    rank: int | None  # the one rank --dry-run plays (None: every rank in turn)

    @property
    def gathers_per_block(self) -> bool:
        """Whether sharded parameters are gathered per block call and gradients reduce-scattered
        every microbatch (``--gather block`` with ``--dp-shard`` above 1)."""
        return self.dp_shard > 1 and self.gather == "block"

    @property
    def data_parallel(self) -> int:
        """Data-parallel ranks per stage (replicas x shards): each trains on its own slice."""
        return self.dp * self.dp_shard


#: seconds a rank other than the job's first waits, on a bad option, before it says it: every rank
#: finds the same problem, rank 0 says it, and torchrun ends the others once rank 0 has exited (a
#: rank that exited first would have torchrun end rank 0 before it said anything); a rank still
#: running after the wait found what rank 0 did not (a package missing on its node) and says it
OTHER_RANKS_WAIT = 30.0


class _OptionParser(argparse.ArgumentParser):
    """train.py's parser: every rank reads the same command line and finds the same problem
    with it, and the job's first rank alone says it (each rank exits with argparse's status)."""

    def error(self, message: str) -> NoReturn:
        rank, world = os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")
        if rank != "0" and world not in ("", "1"):
            time.sleep(OTHER_RANKS_WAIT)  # torchrun ends this rank once rank 0 has said it
        super().error(message)


def parse_config(argv: list[str], pipeline: Pipeline, package: Path | None = None) -> TrainConfig:
    """train.py's command line: the options of every concern's group (:data:`OPTION_GROUPS`),
    parsed and then checked once by :func:`validate` (a bad option exits with argparse's usage
    and message). ``package``: the package's directory, which no output may overwrite."""
    parser = _OptionParser(
        prog="train.py",
        description=f"Train {pipeline.model_class} as a {pipeline.num_stages}-stage pipeline "
        f"(torchrun --nproc-per-node={pipeline.num_ranks * pipeline.dp_shard * pipeline.tp} "
        f"train.py; with --dp M --dp-shard N, {pipeline.num_ranks} x M x N"
        + (f" x tp {pipeline.tp}" if pipeline.tp > 1 else "")
        + " processes).",
    )
    for add_options in OPTION_GROUPS:
        add_options(parser, pipeline)
    args = parser.parse_args(argv)
    validate(parser, args, pipeline, package)
    return TrainConfig(**vars(args))


def run_options(parser: argparse.ArgumentParser, pipeline: Pipeline) -> None:
    """The run's shape: steps, microbatches, schedule, data parallelism, device."""
    group = parser.add_argument_group("run")
    group.add_argument("--steps", type=int, default=10, help="optimizer steps to run (default 10)")
    group.add_argument(
        "--microbatches",
        type=int,
        default=pipeline.default_microbatches,
        help="microbatches per pipeline run; a step's batch is microbatches x accumulate x dp x dp-shard "
        f"example microbatches (default {pipeline.default_microbatches}, the plan's)",
    )
    default_schedule = pipeline.schedule.name
    group.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default=default_schedule,
        help=f"pipeline schedule (default {default_schedule}, the one the partition was made for)",
    )
    group.add_argument(
        "--dp",
        type=int,
        default=1,
        metavar="N",
        help="data-parallel replicas of each stage, gradients all-reduced while backward runs "
        "(default 1)",
    )
    group.add_argument(
        "--dp-shard",
        type=int,
        default=pipeline.dp_shard,
        metavar="N",
        help="shard each stage's parameters, gradients and optimizer state over N ranks (FSDP2); "
        f"with --dp M the world size is {pipeline.num_ranks} x M x N (default "
        f"{pipeline.dp_shard}, what the partition planned memory for)",
    )
    group.add_argument(
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
    group.add_argument(
        "--dp-overlap",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reduce each block's gradients as soon as its last backward ends, while the rest "
        "of the backward runs; --no-dp-overlap reduces them all after it (default: overlap)",
    )
    group.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda runs NCCL with one GPU per rank, cpu runs gloo (default: cuda when available)",
    )
    group.add_argument(
        "--seed", type=int, default=0, help="seed of initialisation, dropout and synthetic data"
    )
    group.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="how long a rank waits for the others before the ranks explain the hang: every rank "
        "that can answer reports its current action and Python stack, and one prints the "
        f"wait-for chain and the likely cause; the ranks give up {DIAGNOSIS_MARGIN:g} s later "
        "(default 300). SIGUSR1 to any rank prints the same diagnosis at any time, and the run "
        "goes on",
    )


def optimisation_options(parser: argparse.ArgumentParser, pipeline: Pipeline) -> None:
    """The optimizer, its learning-rate schedule, precision, recomputation."""
    group = parser.add_argument_group("optimisation")
    group.add_argument(
        "--optimizer", choices=["sgd", "adamw"], default="adamw", help="optimizer (default adamw)"
    )
    group.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    group.add_argument("--weight-decay", type=float, default=0.0, help="weight decay (default 0)")
    group.add_argument("--momentum", type=float, default=0.0, help="SGD momentum (default 0)")
    group.add_argument(
        "--warmup-steps",
        type=int,
        default=0,
        metavar="N",
        help="linear learning-rate warm-up from 0 over N steps (default 0)",
    )
    group.add_argument(
        "--lr-decay",
        choices=["constant", "linear", "cosine"],
        default="constant",
        help="learning-rate decay after warm-up, down to --min-lr at --steps (default constant)",
    )
    group.add_argument("--min-lr", type=float, default=0.0, help="final learning rate of decay")
    group.add_argument(
        "--clip-grad-norm",
        type=float,
        metavar="MAX",
        help="clip gradients to this global norm over all stages (tied parameters counted once)",
    )
    group.add_argument(
        "--accumulate",
        type=int,
        default=pipeline.default_accumulate,
        metavar="K",
        help="gradient accumulation: K pipeline runs per optimizer step (default "
        f"{pipeline.default_accumulate}, the plan's)",
    )
    group.add_argument(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        default=pipeline.default_bf16,
        help="run the stages under bfloat16 autocast (values between stages stay in their "
        "dtype); --no-bf16 in the model's dtype (default: the plan's precision)",
    )
    group.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile each stage, its blocks as nested compile regions (one compilation "
        "per block class, reused by identical blocks); a stage with blocks recomputed one by one "
        "compiles block by block",
    )
    group.add_argument(
        "--skip-nonfinite",
        action="store_true",
        help="skip a step whose loss or gradient norm is not finite (default: stop the run there; "
        "either way such a step never reaches the weights or a checkpoint)",
    )
    group.add_argument(
        "--recompute",
        default="auto",
        metavar="auto|all|none|S,S|blocks[:S,S|/K]",
        help="recompute activations in backward (torch.utils.checkpoint): of whole stages (all, "
        "or stage numbers), or of blocks one by one (blocks: every block; blocks:S,S: the blocks "
        "of those stages; blocks/K: every K-th block); auto: the stages and blocks the "
        "partitioner chose to fit device memory (default auto)",
    )


def data_options(parser: argparse.ArgumentParser, pipeline: Pipeline) -> None:
    """Where batches and weights come from, and where trained weights go."""
    group = parser.add_argument_group("data and weights")
    group.add_argument(
        "--data",
        metavar="FILE.py:FN|DATASET",
        help="FN(step) returns (args, kwargs) or (args, kwargs, target), the step's whole batch "
        "(each input's batch along its batch dimension: 0, or as pipeline.json's batch_dims "
        "records it); or FN() returns a torch.utils.data.Dataset of dicts of tensors "
        "(input names, and 'target' for a --loss), read in a seeded order; or a dataset on "
        "disk (.jsonl, .json, .parquet, .arrow or a datasets save_to_disk directory; needs pip "
        "install datasets) whose 'text' column --tokenizer tokenizes (or whose 'input_ids' are "
        "tokens), packed into rows of the sequence length, or batched by length for a --dynamic "
        "sequence (default: synthetic batches of the example's shapes)",
    )
    group.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="the tokenizer of a --data / --eval-data dataset file's text: a local directory "
        "transformers' AutoTokenizer.from_pretrained loads (nothing is downloaded); its "
        "end-of-sequence token separates documents, its pad token pads",
    )
    group.add_argument(
        "--pad-to-multiple",
        type=int,
        default=1,
        metavar="K",
        help="pipelines compiled with --dynamic: pad each batch's dynamic dimensions (not the "
        "batch dimension) up to a multiple of K within their bounds, so that fewer distinct shapes "
        "occur; inputs named *labels* are padded with -100 (ignored by the loss), others with 0 "
        "(attention masks: masked out). Default 1: no padding",
    )
    group.add_argument(
        "--load",
        metavar="PATH",
        help="original-model weights: a torch.save state_dict, a .safetensors file or a Hugging "
        "Face checkpoint directory (sharded with an index JSON); each rank reads only its tensors. "
        "It must hold this model's tensors and no others (see --load-partial)",
    )
    group.add_argument(
        "--load-partial",
        action="store_true",
        help="--load from a checkpoint holding more than this model's tensors (a larger model, "
        "extra heads): this model's are loaded, the others left out and counted",
    )
    group.add_argument(
        "--save",
        metavar="PATH",
        help="write the trained original-model state_dict here (.safetensors or torch.save, by "
        "suffix; see --save-format)",
    )
    group.add_argument(
        "--save-format",
        choices=["torch", "safetensors", "hf"],
        help="how --save writes: torch.save, one .safetensors file, or hf: a Hugging Face model "
        "directory that from_pretrained loads (config.json and generation_config.json recorded "
        "at compile time, safetensors shards with an index, tied weights once); hf needs a "
        "transformers model (default: by --save's suffix)",
    )
    group.add_argument(
        "--force",
        action="store_true",
        help="let --save replace the file there, or the model directory autopipe wrote there "
        "before (--save-format hf: only its own files are removed; a directory holding anything "
        "else, a tokenizer or a README, is refused with or without --force), and --log-json a "
        "file that is not a run's log (without it, each is refused before the first step)",
    )


def checkpoint_options(parser: argparse.ArgumentParser, pipeline: Pipeline) -> None:
    """Training checkpoints: where, how often, how many, resuming."""
    group = parser.add_argument_group("checkpoints")
    group.add_argument(
        "--checkpoint-dir", metavar="DIR", help="write training checkpoints into DIR/step-N"
    )
    group.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        metavar="N",
        help="checkpoint every N steps (and after the last); default: only after the last",
    )
    group.add_argument(
        "--keep-checkpoints",
        type=int,
        default=3,
        metavar="N",
        help="keep the newest N checkpoints (default 3; 0 keeps all)",
    )
    group.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest checkpoint in --checkpoint-dir (weights, optimizer, "
        "learning rate, RNG and data position), if there is one",
    )
    group.add_argument(
        "--resume-from",
        metavar="step-N",
        help="continue from this checkpoint of --checkpoint-dir instead of the latest (e.g. when "
        "the latest is damaged)",
    )
    group.add_argument(
        "--save-trainable-only",
        action="store_true",
        help="training checkpoints and --save hold only the parameters that train (LoRA "
        "adapters, an unfrozen head) with their optimizer state, and the buffers; the frozen "
        "parameters are left out (resuming from such a checkpoint takes them from the --load it "
        "started from, or from --seed's initialisation)",
    )


def evaluation_options(parser: argparse.ArgumentParser, pipeline: Pipeline) -> None:
    """Held-out evaluation: forward-only pipeline passes, no gradients, dropout off."""
    group = parser.add_argument_group("evaluation")
    group.add_argument(
        "--eval-data",
        metavar="FILE.py:FN|DATASET",
        help="held-out batches, in --data's forms: FN(index) returning a batch of a step's size "
        "(index 0, 1, ... of --eval-batches), FN() returning a Dataset, or a dataset file (read "
        "in order, with --tokenizer). Evaluated at the end of "
        "the run, every --eval-every steps, or alone with --eval-only: the mean loss (weighted by "
        "the tokens whose labels are not the ignore index -100, where the model takes labels) "
        "and its perplexity",
    )
    group.add_argument(
        "--eval-every",
        type=int,
        default=0,
        metavar="N",
        help="evaluate after every N optimizer steps, and at the end (default 0: at the end only)",
    )
    group.add_argument(
        "--eval-batches",
        type=int,
        metavar="K",
        help="held-out batches per evaluation, each of a step's size (default 1)",
    )
    group.add_argument(
        "--eval-only",
        action="store_true",
        help="evaluate the weights --load or --resume gives (or the initial ones) and stop, "
        "training nothing",
    )


def eval_split_options(parser: argparse.ArgumentParser, pipeline: Pipeline) -> None:
    """Which split of a held-out DatasetDict an evaluation reads."""
    group = parser.add_argument_group("evaluation split")
    group.add_argument(
        "--eval-split",
        metavar="SPLIT",
        help="the split of a --eval-data directory that datasets' save_to_disk wrote of a "
        "DatasetDict to evaluate on (default: validation, else test; a DatasetDict without "
        "either is refused, naming its splits)",
    )


def metrics_options(parser: argparse.ArgumentParser, pipeline: Pipeline) -> None:
    """What each step reports, and where."""
    group = parser.add_argument_group("metrics")
    group.add_argument(
        "--log-json",
        metavar="PATH",
        help="write one JSON object per step: step, loss, time, samples_per_s, tokens_per_s, lr, "
        "grad_norm, peak_memory and state_bytes (bytes per rank: the peak, and the parameters, "
        "gradients and optimizer state held); and one per evaluation: step, eval_loss, "
        "eval_perplexity, eval_batches, eval_time",
    )
    group.add_argument(
        "--tensorboard",
        metavar="DIR",
        help="also write the metrics as TensorBoard event files into DIR (torch.utils.tensorboard; "
        "needs the tensorboard package): train/ loss, lr, grad_norm, step_time, samples_per_s, "
        "tokens_per_s, mfu; eval/ loss, perplexity; memory/ peak and state MiB per rank; the "
        "options and the plan as hyperparameters",
    )
    group.add_argument(
        "--wandb",
        metavar="PROJECT",
        help="also log the same metrics and configuration to a Weights & Biases run of PROJECT "
        "(needs the wandb package; WANDB_MODE=offline writes the run under WANDB_DIR without a "
        "network, for wandb sync later)",
    )
    group.add_argument(
        "--track-memory",
        action="store_true",
        help="on CPU, report peak memory as the most bytes of live tensors (counted operator by "
        "operator through setup and the first two steps, which run slower) instead of the "
        "process's resident size; CUDA always reports the allocator's peak",
    )
    group.add_argument(
        "--log-every", type=int, default=1, metavar="N", help="print every N steps (default 1)"
    )


def observability_options(parser: argparse.ArgumentParser, pipeline: Pipeline) -> None:
    """What the run records of itself beyond the metrics: the measured timeline."""
    group = parser.add_argument_group("observability")
    group.add_argument(
        "--trace",
        metavar="DIR",
        help="record when every schedule action of the traced steps starts and ends on every "
        "rank (forward, backward, input and weight backward of each microbatch and stage, the "
        "gradient reductions, the optimizer step; sends and receives as instants), CUDA events "
        "on GPU and the monotonic clock on CPU, aligned across ranks; writes DIR/rankR.json per "
        "rank and DIR/trace.json, a Chrome / Perfetto trace with one process per rank",
    )
    group.add_argument(
        "--trace-steps",
        metavar="A:B",
        help="the steps --trace records, A included, B not (default 1:3, leaving out the "
        "warm-up step 0; after a resume at step N, N+1:N+3; 0:1 in a one-step run); clamped to "
        "the steps this run runs",
    )


def dry_run_options(parser: argparse.ArgumentParser, pipeline: Pipeline) -> None:
    """Checking a launch without its devices: ranks played one process at a time."""
    group = parser.add_argument_group("dry run")
    group.add_argument(
        "--dry-run",
        action="store_true",
        help="check the launch without running it, in this one process (no torchrun, no GPU): "
        "play each rank of the job in turn (or --rank R) on fake tensors of --device with a "
        "fake process group (collectives return at once): the device mesh, the rank's stages "
        "(sharded by FSDP2 as they would be), the schedule and the optimizer are built and 2 "
        "steps run (forward, backward, optimizer); prints each rank's peak of live tensor bytes "
        "against the plan's prediction, the collectives it issued and any error with the "
        "action it happened in, and what torch could not pretend and was faked. --load is "
        "checked for names and shapes; nothing is written",
    )
    group.add_argument(
        "--world-size",
        type=int,
        metavar="W",
        help="with --dry-run: the processes of the job, torchrun's nodes x processes per node "
        f"(default: {pipeline.num_ranks} ranks per pipeline x --dp x --dp-shard)",
    )
    group.add_argument(
        "--rank",
        type=int,
        metavar="R",
        help="with --dry-run: the one rank to play, 0 to W-1 (default: every rank in turn)",
    )


#: train.py's option groups, in the order ``--help`` shows them
OPTION_GROUPS: tuple[Callable[[argparse.ArgumentParser, Pipeline], None], ...] = (
    run_options,
    optimisation_options,
    data_options,
    checkpoint_options,
    evaluation_options,
    eval_split_options,
    metrics_options,
    observability_options,
    dry_run_options,
)


def validate(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    pipeline: Pipeline,
    package: Path | None = None,
) -> None:
    """Check the parsed options against each other and the pipeline, exiting through
    ``parser.error`` at the first problem, and resolve what they leave to the pipeline
    (``--resume-from`` implies ``--resume``; ``--recompute`` becomes stage and block sets,
    ``--gather auto`` block or step). ``package``: the package's directory, which ``--save``
    must stay out of."""
    for name in ("steps", "checkpoint_every", "warmup_steps", "keep_checkpoints", "eval_every"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0")
    for name in (
        "microbatches",
        "dp",
        "dp_shard",
        "accumulate",
        "log_every",
        "pad_to_multiple",
        "eval_batches",
    ):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.pad_to_multiple > 1 and not pipeline.dimensions:
        parser.error(
            "--pad-to-multiple pads dynamic dimensions; this pipeline has none (compile with "
            "--dynamic)"
        )
    if args.checkpoint_every and not args.checkpoint_dir:
        parser.error(
            f"--checkpoint-every {args.checkpoint_every} writes checkpoints into --checkpoint-dir "
            "DIR; give it (without, a run writes no checkpoint)"
        )
    if (args.eval_every or args.eval_only) and not args.eval_data:
        flag = "--eval-only" if args.eval_only else "--eval-every"
        parser.error(f"{flag} evaluates --eval-data FILE.py:FN; give the held-out batches")
    if args.eval_batches is not None and not args.eval_data:
        parser.error(
            f"--eval-batches {args.eval_batches} counts the held-out batches of --eval-data "
            "FILE.py:FN; give them (without, nothing is evaluated)"
        )
    args.eval_batches = args.eval_batches or 1
    if args.eval_split is not None and not args.eval_data:
        parser.error(
            f"--eval-split {args.eval_split} chooses the split --eval-data DIR reads; give it"
        )
    if args.eval_only and args.save:
        parser.error(
            f"--eval-only trains nothing, so --save {args.save} would hold the weights it "
            "evaluates unchanged (those of --load or the checkpoint): leave --save out, or "
            "train with --steps N to save trained weights"
        )
    for option in SINK_PACKAGES:
        if getattr(args, option[2:]) and missing_package(option):
            parser.error(f"{missing_package(option)} (or leave {option} out)")
    if args.save_format and not args.save:
        parser.error(f"--save-format {args.save_format} says how --save PATH writes; give --save")
    if args.save_format == "hf" and pipeline.huggingface is None:
        parser.error(
            f"--save-format hf writes a Hugging Face model directory, and {pipeline.model_class} "
            "was not compiled from a transformers PreTrainedModel (no config.json was recorded); "
            "use --save-format safetensors or torch"
        )
    if args.force and not (args.save or args.log_json):
        parser.error(
            "--force lets --save replace a file or model directory written before, and "
            "--log-json a file that is not a run's log; give one of them, or leave --force out"
        )
    if args.save:
        problem = save_path_problem(args.save, args.save_format, args.checkpoint_dir, package)
        if problem:
            parser.error(problem)
    if args.load_partial and not args.load:
        parser.error("--load-partial says how to read --load PATH; give --load too")
    if (
        args.save_format == "hf"
        and args.save_trainable_only
        and pipeline.frozen
        and pipeline.huggingface is not None
        and pipeline.huggingface.adapter is None
    ):
        parser.error(
            "--save-format hf writes a model directory for from_pretrained, which needs every "
            "weight, and --save-trainable-only leaves out the frozen ones; save the trainable "
            "ones with --save-format safetensors, or leave --save-trainable-only out"
        )
    if args.save_trainable_only and not (args.save or args.checkpoint_dir):
        parser.error(
            "--save-trainable-only says what --save and --checkpoint-dir hold; give one of them"
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
    if args.trace_steps is not None:
        if not args.trace:
            parser.error("--trace-steps says which steps --trace DIR records; give --trace")
        steps = parse_steps(args.trace_steps)
        if steps is None:
            parser.error(
                f"--trace-steps {args.trace_steps!r}: give A:B, the steps A (included) to B "
                "(excluded), 0 <= A < B"
            )
        args.trace_steps = steps
    args.recompute, args.recompute_blocks = recompute_choice(parser, args.recompute, pipeline)
    problem = schedule_problem(args.schedule, pipeline, args.microbatches)
    if problem:
        parser.error(problem)
    dry_run_problem(parser, args, pipeline)
    if args.gather == "auto":
        args.gather = "step" if args.schedule in SPLIT_BACKWARD else "block"
    elif args.gather == "block" and args.schedule in SPLIT_BACKWARD:
        parser.error(
            f"--gather block does not work with --schedule {args.schedule}: its weight passes "
            "need each stage's parameters gathered from the input backward on; use --gather step"
        )


def save_path_problem(
    save: str, save_format: str | None, checkpoint_dir: str | None, package: Path | None
) -> str | None:
    """Why ``--save`` cannot be written where it points, known from the paths alone: a model
    directory named like a file, or a path that is, lies inside or holds ``--checkpoint-dir``
    or the package (the trained model and the run's checkpoints or the package's files would
    be written over each other, or removed together); None if it can."""
    if save_format == "hf":
        problem = file_name_problem(Path(save), "--save", "--save-format safetensors")
        if problem:
            return problem
    if checkpoint_dir:
        relation = _relation(save, checkpoint_dir)
        if relation:
            return (
                f"--save {save} {relation} --checkpoint-dir {checkpoint_dir}: the trained model "
                "and the run's checkpoints would be written over each other; give them paths "
                "apart, e.g. --save out/model --checkpoint-dir out/checkpoints"
            )
    if package is not None:
        relation = _relation(save, package)
        if relation:
            return (
                f"--save {save} {relation} this package ({package}): a package holds only the "
                "files autopipe generated (compiling it again replaces them, and refuses a "
                "package holding others); write the trained model outside the package"
            )
    return None


def _relation(path: str | Path, other: str | Path) -> str | None:
    """How ``path`` lies against ``other``, both made absolute and their links resolved: "is",
    "is inside" or "holds"; None when neither holds the other."""
    mine, theirs = Path(os.path.realpath(path)), Path(os.path.realpath(other))
    if mine == theirs:
        return "is"
    if mine.is_relative_to(theirs):
        return "is inside"
    if theirs.is_relative_to(mine):
        return "holds"
    return None


def dry_run_problem(
    parser: argparse.ArgumentParser, args: argparse.Namespace, pipeline: Pipeline
) -> None:
    """``--world-size`` and ``--rank`` describe the job a ``--dry-run`` plays (torchrun gives a
    real run's): the world must be the layout's and the rank inside it. Resolves the world size
    a dry run leaves out."""
    given = [flag for flag in ("world_size", "rank") if getattr(args, flag) is not None]
    if given and not args.dry_run:
        flags = " and ".join(f"--{flag.replace('_', '-')}" for flag in given)
        parser.error(
            f"{flags} describe{'s' if len(given) == 1 else ''} the job a --dry-run plays; "
            "torchrun sets them for a real run (add --dry-run, or leave them out)"
        )
    if not args.dry_run:
        return
    pp, tp = pipeline.num_ranks, pipeline.tp
    wanted = pp * args.dp * args.dp_shard * tp
    world = args.world_size if args.world_size is not None else wanted
    if world < 1:
        parser.error(f"--world-size must be >= 1, got {world}")
    if world != wanted:
        fix = (
            f", or choose --dp x --dp-shard = {world // (pp * tp)}"
            if world % (pp * tp) == 0
            else f" (a job runs whole pipelines of {pp * tp} ranks)"
        )
        tensor = f" x tp {tp}" if tp > 1 else ""
        parser.error(
            f"--world-size {world}: this pipeline runs on {pp} ranks per pipeline x --dp "
            f"{args.dp} x --dp-shard {args.dp_shard}{tensor} = {wanted} processes; give "
            f"--world-size {wanted}{fix}"
        )
    args.world_size = world
    if args.rank is not None and not 0 <= args.rank < world:
        parser.error(
            f"--rank {args.rank} is outside the job: its {world} rank{'s are' if world > 1 else ' is'} "
            f"0{f' to {world - 1}' if world > 1 else ''}"
        )


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
