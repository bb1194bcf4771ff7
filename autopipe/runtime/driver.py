"""Training driver of generated pipelines, started by ``torchrun ... train.py``.

Copied into every generated pipeline as ``runtime/driver.py``; it needs only torch. Each rank
builds the stages the pipeline places on it (parameters materialised only there), shards them
with FSDP2 over its data-parallel ranks (``--dp``, ``--dp-shard``), wraps them in
``torch.distributed.pipelining`` stages and runs one of torch's schedules; gradients are
averaged over the data-parallel ranks (``parallel.DataParallelStage`` says when), summed over
tied copies, clipped by the global norm, and each stage's optimizer steps. ``options`` holds the
command line, ``data`` the batches, ``parallel`` the process groups, ``train_state`` weights and
checkpoints, ``metrics`` the logs.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import math
import os
import shlex
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining.microbatch import TensorChunkSpec, split_args_kwargs_into_chunks
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.distributed.pipelining.schedules import (
    _Action,
    _ComputationType,
    _PipelineSchedule,
    _PipelineScheduleRuntime,
    get_schedule_class,
)
from torch.utils.checkpoint import checkpoint

from .activity import ACTIVITY, BusyTimes, CudaBusyTimes, doing, recorded
from .core.errors import RUN_TIME_CHECKS, PipelineRunError, UserCodeError, first_line
from .core.host_memory import retain_freed_host_memory
from .core.memory import LiveTensorBytes
from .core.mixed_precision import bf16_autocast
from .core.mesh import RankMesh
from .core.pipeline import Pipeline, PipelineFormatError
from .core.region_rng import set_tensor_parallel_rank
from .core.schedules import MULTI_STAGE, SINGLE_STAGE, SPLIT_BACKWARD, greedy_orders
from .data import Batches
from .dry_run import run_dry
from .evaluation import (
    EVAL_SEED,
    EvalResult,
    LossSums,
    label_tokens,
    no_label_tokens,
    random_states_kept,
    weighs_by_tokens,
)
from .failures import FailureBoard, agent_store, attempt_prefix, write_error_log
from .guards import (
    RankFailedError,
    RunLock,
    agree,
    describe_write_error,
    edited_files,
    fallback_paths,
    nonfinite_problem,
    output_problems,
)
from .hangs import DIAGNOSIS_MARGIN, HangWatch
from .huggingface import write_pretrained
from .metrics import (
    Metrics,
    gather_per_rank,
    plan_device_problem,
    peak_memory,
    run_configuration,
    state_bytes,
)
from .options import TrainConfig, parse_config
from .parallel import (
    DataParallelStage,
    GradientSync,
    Layout,
    group_ranks,
    init_distributed,
    parallelize_stage,
    shard_stage,
)
from .sinks import open_sinks
from .stragglers import StepTimes, Stragglers, cores_shared
from .support import MissingOperatorError
from .core.timeline_format import RunLayout
from .timeline import Timeline, default_steps
from .train_state import (
    FrozenSource,
    TrainingCheckpoints,
    gather_weights,
    has_checkpoint,
    latest_checkpoint,
    load_weights,
    materialise,
    read_manifest,
    save_weights,
)

_KINDS = {"F": _ComputationType.FORWARD, "B": _ComputationType.FULL_BACKWARD}
#: the lowered actions an evaluation runs: forwards, their transfers, FSDP2's gathers
_FORWARD_ACTIONS = frozenset(
    {
        _ComputationType.FORWARD,
        _ComputationType.SEND_F,
        _ComputationType.RECV_F,
        _ComputationType.UNSHARD,
        _ComputationType.RESHARD,
    }
)
#: microbatches x stages from which building the schedule takes long enough to say so
LARGE_SCHEDULE = 4096
#: seconds between a waiting rank's looks at whether the dataset files are prepared
PREPARED_POLL = 0.2
#: seconds a rank whose data preparation failed waits for lower ranks to say whether they failed
#: alike (then the lowest says it alone); a lower rank still preparing is not waited for longer
SAME_FAILURE_WAIT = 5.0
#: this rank's pipeline stages and a schedule over them, for some sizes of dynamic dimensions
Shaped = tuple[list[DataParallelStage], _PipelineSchedule]


# -- stages -----------------------------------------------------------------------------------
class KeepBuffers:
    """Restores a module's buffers on exit: a recomputed forward must not update BatchNorm's
    running statistics a second time."""

    def __init__(self, module: nn.Module):
        self.module = module

    def __enter__(self) -> None:
        self.saved = [(b, b.clone()) for b in self.module.buffers()]

    def __exit__(self, *exc: object) -> None:
        with torch.no_grad():
            for buffer, value in self.saved:
                buffer.copy_(value)


def checkpointed(module: nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` keeping only its inputs for backward, which recomputes the rest; ``module``'s
    buffers (BatchNorm's running statistics) are left as the first forward set them."""

    def run(*inputs: torch.Tensor) -> Any:
        return checkpoint(
            forward,
            *inputs,
            use_reentrant=False,
            context_fn=lambda: (contextlib.nullcontext(), KeepBuffers(module)),
        )

    return run


def recompute_blocks(stage: nn.Module, blocks: frozenset[str]) -> int:
    """Make the ``blocks`` a stage holds recompute their activations in backward (their forward
    hooks, and FSDP's, still fire once per call). Returns how many it holds."""
    held = 0
    for fqn, module in stage.named_modules():
        if fqn in blocks:
            module.forward = checkpointed(module, module.forward)
            held += 1
    return held


def compile_stage(stage: nn.Module, blocks: tuple[str, ...], recomputed: frozenset[str]) -> None:
    """``torch.compile`` a stage's forward, its blocks as nested compile regions: each generated
    block class compiles once and identical blocks reuse it. A stage with blocks recomputed one
    by one compiles block by block instead (recomputation wraps each compiled block; the code
    between blocks stays eager), since ``checkpoint`` cannot be traced with its buffer guard."""
    modules = [stage.get_submodule(fqn) for fqn in blocks]
    if recomputed.intersection(blocks):
        for module in modules:
            module.forward = torch.compile(module.forward)
        return
    for cls in {type(module) for module in modules} - _NESTED_REGIONS:
        cls.forward = torch.compiler.nested_compile_region(cls.forward)
        _NESTED_REGIONS.add(cls)
    stage.forward = torch.compile(stage.forward)


#: block classes whose forward is a nested compile region (once per process)
_NESTED_REGIONS: set[type] = set()


class StageRunner(nn.Module):
    """One stage as the schedule runs it: under bf16 autocast, with its activations recomputed
    in backward, and returning fresh tensors of the pipeline's dtypes (split-backward schedules
    detach stage outputs in place, which must not reach tensors the stage saved). A stage that
    reads inputs from the batch (``data_slots``: their positions among its inputs) takes them
    from ``batch_inputs``, the run's microbatches of them, at the microbatch :meth:`select`
    chose; the schedule gives it the others."""

    #: the stage's path in its runner
    STAGE = "stage"

    def __init__(
        self,
        stage: nn.Module,
        output_dtypes: list[torch.dtype],
        *,
        autocast: str | None,
        recompute: bool,
        fresh_outputs: bool,
    ):
        super().__init__()
        self.stage = stage  # at STAGE
        self.output_dtypes = output_dtypes
        self.autocast = autocast
        self.recompute = recompute
        self.fresh_outputs = fresh_outputs
        self.data_slots: tuple[int, ...] = ()
        #: per microbatch of the current pipeline run, the inputs at ``data_slots``
        self.batch_inputs: list[tuple[torch.Tensor, ...]] = []
        self.microbatch = 0

    def select(self, microbatch: int) -> None:
        """The microbatch whose batch inputs the next forward takes."""
        self.microbatch = microbatch

    def forward(self, *received: torch.Tensor) -> tuple[torch.Tensor, ...]:
        inputs = list(received)
        if self.data_slots:
            for slot, tensor in zip(self.data_slots, self.batch_inputs[self.microbatch]):
                inputs.insert(slot, tensor)
        with bf16_autocast(self.autocast):
            if self.recompute:
                outputs = checkpointed(self.stage, self.stage)(*inputs)
            else:
                outputs = self.stage(*inputs)
        fixed = []
        for tensor, dtype in zip(outputs, self.output_dtypes):
            if tensor.dtype != dtype:
                tensor = tensor.to(dtype)
            elif self.fresh_outputs:
                tensor = tensor.clone()
            fixed.append(tensor)
        return tuple(fixed)


#: what the schedule calls on the last stage's output and the target: the microbatch's loss
LossFn = Callable[[Any, Any], torch.Tensor]


def make_loss_fn(package: ModuleType, pipeline: Pipeline, device: torch.device) -> LossFn:
    loss = pipeline.loss
    if loss.module is not None:
        imported = importlib.import_module(f"{package.__name__}.{loss.module}")
        module = imported.Loss().to(device)
        where = f"{imported.__file__} (traced from the loss function given at compile time)"

        def user_loss(
            output: torch.Tensor | tuple[torch.Tensor, ...], target: torch.Tensor
        ) -> torch.Tensor:
            outputs = output if isinstance(output, tuple) else (output,)
            try:
                loss: torch.Tensor = module(*outputs, target)
            except Exception as exc:  # noqa: BLE001 - named as the user's code failing
                raise UserCodeError("--loss", where, exc) from exc
            return _plain(loss)

        return user_loss
    if loss.output is None:
        raise PipelineRunError(
            "the model has no loss output; compile it with --loss FILE.py:FN or give it labels "
            "so that it returns a loss (Hugging Face style)"
        )
    index = pipeline.outputs.index(loss.output)

    def output_loss(
        output: torch.Tensor | tuple[torch.Tensor, ...], _target: torch.Tensor
    ) -> torch.Tensor:
        outputs = output if isinstance(output, tuple) else (output,)
        return _plain(outputs[index])

    return output_loss


def _plain(loss: torch.Tensor) -> torch.Tensor:
    """A loss computed vocabulary-parallel (a DTensor, the same on every tensor-parallel rank)
    as the plain tensor the schedule sums and backpropagates from (its gradient handed back to
    the DTensor)."""
    return loss.to_local() if isinstance(loss, DTensor) else loss


def chunk_spec(pipeline: Pipeline) -> tuple[TensorChunkSpec, ...] | None:
    """How torch's schedules split a pipeline run's first-stage inputs into microbatches: each
    along its batch dimension; None (torch's default, dimension 0 for all) where every input
    holds its batch along dimension 0. A loss's target is split along dimension 0."""
    dims = [pipeline.batch_dim(value.name) for value in pipeline.first_inputs]
    if not any(dims):
        return None
    return tuple(TensorChunkSpec(dim) for dim in dims)  # type: ignore[no-untyped-call]  # torch


def build_schedule(
    name: str,
    stages: list[DataParallelStage],
    pipeline: Pipeline,
    microbatches: int,
    loss_fn: LossFn,
    forward_only: bool = False,
) -> _PipelineSchedule:
    """A torch.distributed.pipelining schedule over this rank's stages. Gradients are left
    unscaled (sums over microbatches): the driver scales them once per optimizer step.
    ``forward_only``: a schedule that only ever runs ``eval`` (``auto``'s orders, which torch
    runs as given, then hold the forwards alone; torch's own schedules skip the backwards).
    Microbatches are split along each input's batch dimension (:func:`chunk_spec`)."""
    split: dict[str, Any] = {"scale_grads": False}
    spec = chunk_spec(pipeline)
    if spec is not None:  # not every schedule class takes one (torch 2.13's looped BFS)
        split["args_chunk_spec"] = spec
        if (
            name in MULTI_STAGE
            and "args_chunk_spec"
            not in inspect.signature(get_schedule_class(MULTI_STAGE[name]).__init__).parameters
        ):
            raise PipelineRunError(
                f"--schedule {name}: torch's {MULTI_STAGE[name]} cannot split microbatches "
                "along a batch dimension other than 0, which this pipeline's inputs have "
                "(pipeline.json batch_dims); use another schedule (interleaved-1f1b, ...)"
            )
    if name in SINGLE_STAGE:
        # torch leaves get_schedule_class's return unannotated
        return get_schedule_class(SINGLE_STAGE[name])(  # type: ignore[no-any-return]
            stages[0], n_microbatches=microbatches, loss_fn=loss_fn, **split
        )
    if name in MULTI_STAGE:
        try:
            return get_schedule_class(MULTI_STAGE[name])(  # type: ignore[no-any-return]  # torch
                stages, n_microbatches=microbatches, loss_fn=loss_fn, **split
            )
        except (ValueError, AssertionError) as exc:
            raise PipelineRunError(f"--schedule {name} does not fit: {exc}") from None
    orders = greedy_orders(pipeline.pipeline_costs(), microbatches)
    schedule = _PipelineScheduleRuntime(  # type: ignore[no-untyped-call]  # torch: unannotated
        stages, n_microbatches=microbatches, loss_fn=loss_fn, **split
    )
    actions: dict[int, list[_Action | None]] = {
        rank: [_Action(a.stage, _KINDS[a.kind], a.microbatch) for a in order]
        for rank, order in orders.items()
    }
    schedule._prepare_schedule_with_comms(actions)
    if forward_only:
        # torch checks that the orders hold every backward, and its runtime would run them in
        # an evaluation too: its lowered orders keep the forwards and their transfers alone
        schedule.pipeline_order_with_comms = {
            rank: [a for a in lowered if a.computation_type in _FORWARD_ACTIONS]
            for rank, lowered in schedule.pipeline_order_with_comms.items()
        }
    return schedule


# -- optimisation -----------------------------------------------------------------------------
def make_optimizer(config: TrainConfig, module: nn.Module) -> torch.optim.Optimizer:
    # one group, empty for a stage without trainable parameters (torch refuses an empty list)
    params = [{"params": [p for p in module.parameters() if p.requires_grad]}]
    if config.optimizer == "sgd":
        return torch.optim.SGD(
            params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
        )
    return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)


def make_scheduler(
    config: TrainConfig, optimizer: torch.optim.Optimizer, done: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """The learning-rate schedule, positioned after ``done`` optimizer steps."""
    for group in optimizer.param_groups:
        group["initial_lr"] = config.lr
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(config), last_epoch=done - 1)


def lr_factor(config: TrainConfig) -> Callable[[int], float]:
    """Multiplier of --lr after ``step`` optimizer steps: linear warm-up, then decay."""
    floor = config.min_lr / config.lr if config.lr else 0.0

    def factor(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        if config.lr_decay == "constant":
            return 1.0
        progress = min(
            1.0, (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
        )
        shape = (
            1 - progress
            if config.lr_decay == "linear"
            else 0.5 * (1 + math.cos(math.pi * progress))
        )
        return floor + (1 - floor) * shape

    return factor


# -- the run ---------------------------------------------------------------------------------
def say(message: str) -> None:
    """A line from global rank 0, for phases that take a while."""
    if dist.get_rank() == 0:
        print(message, flush=True)


def check_outputs(config: TrainConfig, reporting: bool) -> None:
    """Every output path this run will write is checked on the ranks that write it, before
    any training: a run never learns at its end that its work cannot be kept."""
    problems = output_problems(
        save=config.save if dist.get_rank() == 0 else None,
        log_json=config.log_json if reporting else None,
        checkpoint_dir=config.checkpoint_dir,
        tensorboard=config.tensorboard if reporting else None,
        save_directory=config.save_format == "hf",
        trace=config.trace,  # every rank writes its timeline there
        replace=config.force,
        # continuing from a checkpoint there: the run's own --save file may be replaced
        resuming=bool(config.resume or config.resume_from)
        and has_checkpoint(config.checkpoint_dir),
    )
    problem = agree("; ".join(problems) or None)
    if problem:
        raise PipelineRunError(f"{problem}. Nothing was trained.", every_rank=True)


def lock_checkpoints(config: TrainConfig) -> RunLock | None:
    """Global rank 0 takes ``--checkpoint-dir``'s lock; every rank stops if it cannot."""
    if not config.checkpoint_dir:
        return None
    lock = RunLock(config.checkpoint_dir)
    problem = None
    if dist.get_rank() == 0:
        try:
            note = lock.acquire()
            if note:
                print(f"{config.checkpoint_dir}: {note}", flush=True)
        except (PipelineRunError, OSError) as exc:
            problem = str(exc)
    problem = agree(problem)
    if problem:
        raise PipelineRunError(problem, every_rank=True)
    return lock


def resume_point(checkpoints: TrainingCheckpoints | None, config: TrainConfig) -> Path | None:
    """The checkpoint to resume from; refuses to mix a new run into old checkpoints."""
    if checkpoints is None:
        return None
    if dist.get_rank() == 0:
        for stale in checkpoints.root.glob(".step-*.partial"):  # a save that never finished
            shutil.rmtree(stale, ignore_errors=True)
    dist.barrier()
    checkpoints.refuse_other_models()  # before resuming from, or writing beside, another's
    if config.resume_from:
        return checkpoints.named(config.resume_from)
    latest = checkpoints.latest()
    if latest is not None and not config.resume:
        raise PipelineRunError(
            f"{checkpoints.root} already holds checkpoints (latest: {latest.name}); pass --resume "
            "to continue from it, or give another --checkpoint-dir",
            every_rank=True,
        )
    return latest


def evaluated_checkpoint_problem(config: TrainConfig) -> str | None:
    """Why ``--eval-only --checkpoint-dir DIR`` has no checkpoint to evaluate (no such
    directory, or none in it), or None: an evaluation never falls back to the initial
    weights when it was given a checkpoint directory."""
    if not (config.eval_only and config.checkpoint_dir):
        return None
    root = Path(config.checkpoint_dir)
    fix = (
        "give the --checkpoint-dir a training run wrote its checkpoints (step-N) into, or leave "
        "it out and --load a model's weights"
    )
    if not root.is_dir():
        return f"--eval-only --checkpoint-dir {root}: there is no such directory; {fix}"
    if config.resume_from is None and latest_checkpoint(root) is None:
        return (
            f"--eval-only --checkpoint-dir {root}: no checkpoint found there (no step-N "
            f"checkpoint), so there are no trained weights to evaluate; {fix}"
        )
    return None


def prepare_together(
    prepare: Callable[[], None] | None, rank: int, world: int, store: dist.Store | None
) -> None:
    """``prepare()`` (the dataset files' first reading and tokenizing) on the ranks that read
    data (``prepare`` None elsewhere); then rank ``rank`` of ``world`` waits until every rank
    is done, through ``store`` (torchrun's agent's): polled, that wait has no timeout, as a
    collective's would, so that preparing takes as long as it takes (without a store, a barrier
    waits, within the process group's timeout). A rank whose preparation fails raises its
    error, unless a lower rank failed with the same within :data:`SAME_FAILURE_WAIT` (the ranks
    reading the same files find the same problem: it is said once); the others stop, naming
    it."""
    problem: Exception | None = None
    if prepare is not None:
        with doing("prepare_data"):
            try:
                prepare()
            except Exception as exc:  # noqa: BLE001 - posted for the others, then raised
                problem = exc
    if store is None:
        if problem is not None:
            raise problem
        if world > 1:
            dist.barrier()
        return
    keys = [f"{attempt_prefix()}prepared/{r}" for r in range(world)]
    said = "" if problem is None else first_line(problem) or "failed"
    store.set(keys[rank], said)
    if problem is not None:  # the ranks reading the same data fail alike: the lowest says it
        waited = time.monotonic() + SAME_FAILURE_WAIT  # a lower rank still preparing: not long
        while rank and not store.check(keys[:rank]) and time.monotonic() < waited:
            time.sleep(PREPARED_POLL)
        for other, key in enumerate(keys[:rank]):
            if store.check([key]) and store.get(key).decode("utf-8", "replace") == said:
                raise RankFailedError(other, f"it could not prepare its data: {said}") from problem
        raise problem
    with doing("wait_data", ranks=tuple(range(world))):
        while not store.check(keys):
            time.sleep(PREPARED_POLL)
    for other, key in enumerate(keys):
        failure = store.get(key).decode("utf-8", "replace")
        if failure:
            raise RankFailedError(other, f"it could not prepare its data: {failure}")


def save_trained(
    state: dict[str, torch.Tensor],
    pipeline: Pipeline,
    config: TrainConfig,
    step: int,
    checkpoint: Path | None,
) -> None:
    """Rank 0: ``--save`` in ``--save-format``; if that fails after all, the next place that
    takes the state, and an error saying where it went: trained weights are never dropped."""
    assert config.save is not None  # called only with --save
    failures = []
    hf = pipeline.huggingface if config.save_format == "hf" else None
    what = "Hugging Face model directory" if hf else "state_dict"

    save = config.save

    def places() -> Iterator[Path]:  # the fallbacks (one made in advance) only when needed
        yield Path(save)
        yield from fallback_paths(save, config.checkpoint_dir, step, hf is not None)

    for path in places():
        try:
            if hf is not None:
                replace = config.force and path == Path(config.save)  # never a fallback's
                write_pretrained(state, hf, pipeline.aliases, path, replace=replace)
            else:
                save_weights(state, path, config.save_format)
        except (OSError, RuntimeError, PipelineRunError) as exc:
            failures.append(f"{path}: {describe_write_error(exc, path)}")
            continue
        if not failures:
            loads = "from_pretrained" if hf else "load_state_dict"
            print(f"saved the trained model's {what} to {path} (for {loads})", flush=True)
            return
        raise PipelineRunError(
            f"could not write --save {config.save} ({failures[0].split(': ', 1)[1]}); the trained "
            f"{what} was written to {path} instead"
        )
    kept = f"; the last checkpoint is {checkpoint}" if checkpoint else ""
    raise PipelineRunError(
        f"could not write the trained {what} anywhere ({'; '.join(failures)}){kept}"
    )


def build_stages(
    package: ModuleType,
    pipeline: Pipeline,
    config: TrainConfig,
    layout: Layout,
    resume: Path | None,
) -> tuple[dict[int, nn.Module], dict[int, StageRunner]]:
    """This rank's stages and the runners the schedule calls: built (on meta while a checkpoint
    or sharding is to come), compiled and recomputed as asked, FSDP2-managed with data
    parallelism, and filled by initialisation or ``--load``, or allocated for the checkpoint
    ``resume`` to fill (filled first when that checkpoint holds only the trainable
    parameters: see :func:`resumed_weights`)."""
    device = layout.device
    local = pipeline.stages_on(layout.pp_rank)
    filled, load = resumed_weights(config, resume, pipeline)
    # parameters stay on meta until a checkpoint fills them, or until they are sharded: a rank
    # never holds a whole stage it shards
    split = layout.sharded or layout.tensor_parallel  # parameters held in parts (DTensors)
    meta = filled or load is not None or split
    modules = {
        s.index: package.build_stage(s.index, device=device, seed=config.seed, meta_state=meta)
        for s in local
    }
    # the random operators of sharded regions draw from this rank's own stream (degree 1: none)
    set_tensor_parallel_rank(layout.tp_rank, layout.tp_size)
    if layout.tensor_parallel:
        styles = [name for s in local for name in parallelize_stage(modules[s.index], layout)]
        sliced = (
            ", the values between regions sliced along the sequence (sequence parallel)"
            if pipeline.sequence_parallel
            else ""
        )
        say(
            f"tensor parallelism: {len(styles)} module(s) of this rank's stages sharded over "
            f"{layout.tp_size} ranks ({' / '.join(sorted(set(styles)))}){sliced}"
        )
    if config.compile:
        for s in local:
            compile_stage(modules[s.index], s.blocks, config.recompute_blocks)
        say("torch.compile: each stage, one compilation per block class (on first use)")
    if config.recompute_blocks:
        held = sum(recompute_blocks(m, config.recompute_blocks) for m in modules.values())
        say(f"recomputing {held} block(s) of this rank's stages in backward")
    if load and not split:
        say(f"loading weights from {load}")
        loaded(load_weights(modules, load, pipeline, device, config.load_partial), load)
    autocast = device.type if config.bf16 else None
    runners = {
        s.index: StageRunner(
            modules[s.index],
            [value.torch_dtype for value in pipeline.returned(s)],
            autocast=autocast,
            recompute=s.index in config.recompute,
            fresh_outputs=config.schedule in SPLIT_BACKWARD,
        )
        for s in local
    }
    for s in local:  # the inputs it reads from the batch, by their positions among its inputs
        runners[s.index].data_slots = tuple(
            i for i, name in enumerate(s.inputs) if name in s.data_inputs
        )
    if layout.sharded:
        for s in local:
            blocks = [modules[s.index].get_submodule(fqn) for fqn in s.blocks]
            shard_stage(runners[s.index], blocks, layout, config.gathers_per_block, config.bf16)
        say(
            f"FSDP2: each stage over {layout.dp_size} data-parallel ranks "
            f"(--dp {config.dp} replicas x --dp-shard {config.dp_shard} shards"
            + (f", gathered per {config.gather})" if config.dp_shard > 1 else ")")
            + f"; ranks on the {layout.rank_mesh.describe()}"
        )
    if filled or split:  # allocated (only its shards, if sharded)
        for runner in runners.values():
            materialise(runner, device)
    if split and not filled:
        if load:
            say(f"loading weights from {load} (each rank its shards)")
            loaded(load_weights(modules, load, pipeline, device, config.load_partial), load)
        else:
            for module in modules.values():
                module.initialise(config.seed)
    return modules, runners


def frozen_source(config: TrainConfig, pipeline: Pipeline) -> FrozenSource | None:
    """With ``--save-trainable-only`` and frozen parameters: where they come from (``--load``
    or ``--seed``'s initialisation), for the checkpoints that leave them out to record."""
    if not (config.save_trainable_only and pipeline.frozen):
        return None
    return FrozenSource(str(Path(config.load).resolve()) if config.load else None, config.seed)


def resumed_weights(
    config: TrainConfig, resume: Path | None, pipeline: Pipeline
) -> tuple[bool, str | None]:
    """Whether the checkpoint ``resume`` fills every tensor of the stages, and the ``--load``
    checkpoint to fill them from first: when starting, and when resuming from a checkpoint of
    the trainable parameters only (``--save-trainable-only``), whose frozen ones come from the
    ``--load`` the run started from (or from ``--seed``'s initialisation). A resume that would
    change the frozen weights is refused."""
    if resume is None:
        return False, config.load
    source = FrozenSource.of_manifest(read_manifest(resume), resume)
    if source is None:
        declared = frozen_source(config, pipeline)
        if declared is not None:  # the frozen weights come from the checkpoint: say what is kept
            say(
                f"note: {resume} holds every tensor; this run's checkpoints leave the frozen ones "
                f"out (--save-trainable-only) and record that they come from "
                f"{declared.describe()}, which a resume from them takes again"
            )
        return True, None
    problem = source.resume_problem(resume, config.load, config.seed)
    if problem:
        raise PipelineRunError(problem, every_rank=True)
    if config.load and source.load and Path(config.load).resolve() != Path(source.load):
        say(
            f"note: {resume} holds only the trainable parameters; the run that wrote it took the "
            f"frozen ones from --load {source.load}, this one from --load {config.load}"
        )
    return False, config.load


def loaded(left_out: int, path: str) -> None:
    """Say how many tensors of a --load checkpoint --load-partial left out."""
    if left_out:
        say(f"--load-partial: left out {left_out} tensor(s) of {path} that this model has not")


def train(package: ModuleType, pipeline: Pipeline, config: TrainConfig) -> None:
    """One training run on this rank. Its process group gives up on a peer
    ``hangs.DIAGNOSIS_MARGIN`` seconds after ``--timeout``: at ``--timeout`` the rank's hang
    watch has the waiting explained first."""
    timeout = config.timeout + DIAGNOSIS_MARGIN
    layout = init_distributed(pipeline, config.device, config.dp, config.dp_shard, timeout)
    if layout.device.type == "cpu":  # each microbatch's activations in pages already mapped
        retain_freed_host_memory()
    stages = tuple(s.index for s in pipeline.stages_on(layout.pp_rank))
    ACTIVITY.reset(busy_times(layout.device))
    watch = HangWatch(layout.rank, dist.get_world_size(), stages, config.timeout)
    watch.start()
    try:
        run_training(package, pipeline, config, layout)
    finally:
        watch.stop()


def busy_times(device: torch.device) -> BusyTimes:
    """How this rank times its stages' compute: CUDA events, or the host's clock."""
    return CudaBusyTimes(device) if device.type == "cuda" else BusyTimes()


def rehearse(
    package: ModuleType, pipeline: Pipeline, config: TrainConfig, layout: Layout
) -> _PipelineSchedule:
    """``--dry-run``'s play of this rank (``dry_run.py`` runs it under fake tensors and a fake
    process group): the phases of a training run as :func:`train` runs them, setup then each
    step and its checkpoint (none: the played options have no ``--checkpoint-dir``), nothing
    reported. Every rank of a dynamic pipeline reads the step's batch (in a real run the ranks
    that read it send its sizes, which a fake process group does not carry). Returns the
    schedule of the last step."""
    ACTIVITY.reset(busy_times(layout.device))
    torch.manual_seed(config.seed * 1_000_003 + layout.place)
    run = TrainingRun(package, pipeline, config, layout, reporting=False)
    run.reads_every_batch = bool(pipeline.dimensions)
    run.setup()
    try:
        for step in range(config.steps):
            run.step(step)
            run.checkpoint(step + 1)
    finally:
        run.metrics.close()
    return next(reversed(run.schedules.built.values()))[1]


def run_training(
    package: ModuleType, pipeline: Pipeline, config: TrainConfig, layout: Layout
) -> None:
    """:func:`train`'s work, once the process group runs."""
    # dropout streams differ per rank, and follow its place whatever the mesh order
    torch.manual_seed(config.seed * 1_000_003 + layout.place)
    reporting = layout.pp_rank == pipeline.last_rank and layout.dp_rank == 0 and layout.reports
    problem = evaluated_checkpoint_problem(config)
    if problem:
        raise PipelineRunError(problem, every_rank=True)
    if config.dp_shard != pipeline.dp_shard:
        say(
            f"warning: the partition planned each device's memory for --dp-shard "
            f"{pipeline.dp_shard}, this run shards over {config.dp_shard}"
            + (
                f": it may not fit; recompile with autopipe compile --dp-shard {config.dp_shard}"
                if config.dp_shard < pipeline.dp_shard
                else ""
            )
        )
    check_outputs(config, reporting)
    lock = lock_checkpoints(config)
    try:
        TrainingRun(package, pipeline, config, layout, reporting).run()
    finally:
        if lock is not None:
            lock.release()


class TrainingRun:
    """This rank's part of one training run, in named phases: :meth:`setup` (the checkpoint to
    resume from, stages, optimizers, schedules, data and metrics), :meth:`step` (one optimizer
    step), :meth:`checkpoint` (after a step, when one is due) and :meth:`finish` (``--save``);
    :meth:`run` runs them in that order. What a phase builds for the later ones is kept as
    attributes."""

    # built by setup
    modules: dict[int, nn.Module]  # this rank's stages, by index
    runners: dict[int, StageRunner]  # ... as the schedule runs them
    optimizers: dict[int, torch.optim.Optimizer]
    schedulers: dict[int, torch.optim.lr_scheduler.LambdaLR]
    is_first: bool  # this rank holds the first stage (it reads the inputs)
    is_last: bool  # ... the last stage (it computes the loss)
    needs_target: bool  # ... and the loss takes a target from the data
    loss_fn: LossFn
    sync: GradientSync
    batches: Batches
    metrics: Metrics
    step_times: StepTimes  # this rank's step and compute times, gathered at the log steps

    def __init__(
        self,
        package: ModuleType,
        pipeline: Pipeline,
        config: TrainConfig,
        layout: Layout,
        reporting: bool,
    ) -> None:
        self.package = package
        self.pipeline = pipeline
        self.config = config
        self.layout = layout
        self.reporting = reporting  # this rank prints and logs the steps
        self.device = layout.device
        self.checkpoints = (
            TrainingCheckpoints(
                config.checkpoint_dir,
                pipeline,
                layout,
                config.keep_checkpoints,
                frozen_source(config, pipeline),
            )
            if config.checkpoint_dir
            else None
        )
        self.tracker: LiveTensorBytes | None = None  # --track-memory on CPU
        self.resume: Path | None = None  # the checkpoint this run continues from
        self.last_checkpoint: Path | None = None  # the newest checkpoint of the run
        self.start = 0  # the first step to run
        self.flops_scale = 1.0  # this step's FLOPs relative to the plan's (dynamic dimensions)
        self.schedules = ShapedSchedules(self.shaped)
        self.eval_schedules = ShapedSchedules(lambda sizes: self.shaped(sizes, forward_only=True))
        self.eval_batches: Batches | None = None  # --eval-data
        self.timeline: Timeline | None = None  # --trace
        # the ranks of the collectives the hang diagnosis names
        self.world_ranks = tuple(range(dist.get_world_size()))
        #: every rank reads each step's batch, not only the ones that feed the pipeline
        self.reads_every_batch = False
        self.dp_ranks = group_ranks(layout.dp_group) if layout.dp_size > 1 else (layout.rank,)
        self.data_ranks = group_ranks(layout.pp_group) if pipeline.dimensions else ()

    def run(self) -> None:
        """Every phase in order; live tensors are counted (``--track-memory`` on CPU) from the
        stages' allocation to the end of the second step, or of the run."""
        try:
            self.setup()
            config = self.config
            try:
                self.prepare_data()
                if config.eval_only:
                    self.evaluate(self.start)
                    return
                for step in range(self.start, config.steps):
                    try:
                        self.step(step)
                    except Exception as exc:  # noqa: BLE001 - user code is named with its step
                        failure = _user_code_error(exc)
                        if failure is None:
                            raise
                        raise failure.at_step(step) from exc
                    self.checkpoint(step + 1)
                    last = step + 1 == config.steps  # evaluated after --save, below
                    if config.eval_every and (step + 1) % config.eval_every == 0 and not last:
                        self.evaluate(step + 1)
                self.finish()  # before the last evaluation, which may fail on its data
                if self.eval_batches is not None:
                    self.evaluate(max(self.start, config.steps))  # at the end
                if self.timeline is not None and not self.timeline.written:
                    self.timeline.write()  # no traced step ran (all collective)
            finally:
                self.metrics.close()
        finally:
            if self.tracker is not None and self.tracker.active:
                self.tracker.__exit__(None, None, None)

    # -- setup ---------------------------------------------------------------------------------
    def setup(self) -> None:
        """The checkpoint to resume from; this rank's stages, filled by initialisation,
        ``--load`` or the checkpoint; their optimizers and learning-rate schedules; the
        schedule of a static pipeline; gradient synchronisation, the batches and the metrics."""
        config, pipeline = self.config, self.pipeline
        self.resume = self.last_checkpoint = resume_point(self.checkpoints, config)
        if config.track_memory and self.device.type == "cpu":  # from the stages' allocation on
            self.tracker = LiveTensorBytes()
            self.tracker.__enter__()
        self.modules, self.runners = build_stages(
            self.package, pipeline, config, self.layout, self.resume
        )
        self.optimizers = {i: make_optimizer(config, m) for i, m in self.modules.items()}
        if self.resume is not None:
            say(f"loading the checkpoint {self.resume}")
            assert self.checkpoints is not None  # a run resumes only from its checkpoints
            self.start = self.checkpoints.restore(self.resume, self.modules, self.optimizers)
        self.schedulers = {
            i: make_scheduler(config, o, self.start) for i, o in self.optimizers.items()
        }
        self.is_first = 0 in self.modules
        self.is_last = pipeline.num_stages - 1 in self.modules
        self.loss_fn = make_loss_fn(self.package, pipeline, self.device)
        if not pipeline.dimensions:
            self.schedules.get(None)  # built before the first step, as its errors are the options'
        self.sync = GradientSync(pipeline, self.layout, self.modules)
        self.batches = Batches(pipeline, config)
        if config.eval_data:
            self.eval_batches = Batches(pipeline, config, held_out=True)
        self.needs_target = self.is_last and pipeline.loss.needs_target
        assert ACTIVITY.busy is not None  # set by train()
        plan = pipeline.plan
        #: why the run is not compared with its plan (made for another device), if it is not
        self.off_plan = plan_device_problem(plan.device, self.device) if plan else None
        shared = cores_shared(self.device)
        self.shared_cores = (
            f"{shared[0]} ranks share {shared[1]} CPU cores here: each computes on about "
            f"{shared[1] / shared[0]:.2g} of a core, where the plan gives it one; its stage "
            f"times are compared with the plan's times {shared[0] / shared[1]:.2g}"
            if shared and self.off_plan is None
            else None
        )
        self.step_times = StepTimes(
            pipeline,
            ACTIVITY.busy,
            self.layout.rank_mesh,
            config.microbatches * config.accumulate,
            self.device,
            with_plan=self.off_plan is None,
            plan_scale=shared[0] / shared[1] if shared else 1.0,
        )
        self.metrics = self.make_metrics()
        if config.trace:
            self.timeline = self.make_timeline(config.trace)

    @property
    def reads_batches(self) -> bool:
        """Whether this rank reads each step's batch: for the first stage's inputs, the loss's
        target, the inputs a later stage reads from the batch, or (a dynamic pipeline's dry
        run) every batch."""
        reads_inputs = any(runner.data_slots for runner in self.runners.values())
        return self.is_first or self.needs_target or reads_inputs or self.reads_every_batch

    def prepare_data(self) -> None:
        """The dataset files' rows, read and tokenized before the first step by the ranks that
        read batches, without a timeout (:func:`prepare_together`; the held-out ones alone
        with ``--eval-only``); then what the evaluations' batches read of their data, where
        they read some of it more than once."""
        config = self.config
        used = [self.eval_batches] if config.eval_only else [self.batches, self.eval_batches]
        preparing = [batches for batches in used if batches is not None and batches.prepares]
        if preparing:
            reads = self.reads_batches

            def prepare() -> None:
                for batches in preparing:
                    batches.prepare()

            world = dist.get_world_size()
            store = agent_store(world)  # None in a run of one process
            prepare_together(prepare if reads else None, dist.get_rank(), world, store)
        if self.eval_batches is not None:
            note = self.eval_batches.coverage(config.eval_batches)
            if note:
                say(f"note: {note}")  # rank 0 reads batches: it knows

    def make_timeline(self, directory: str) -> Timeline:
        """The recorder of ``--trace``, its clock aligned with the other ranks' (collective),
        for ``--trace-steps`` clamped to the steps this run runs."""
        config, layout = self.config, self.layout
        asked = config.trace_steps or default_steps(self.start, config.steps)
        begin, end = max(asked[0], self.start), min(asked[1], config.steps)
        steps = (begin, max(begin, end))
        if steps[0] == steps[1]:
            say(
                f"--trace: no step of --trace-steps {asked[0]}:{asked[1]} runs (this run runs "
                f"steps {self.start} to {config.steps - 1}); {directory} gets empty timelines"
            )
        timeline = Timeline(
            Path(directory),
            steps,
            rank=layout.rank,
            pp_rank=layout.pp_rank,
            dp_rank=layout.dp_rank,
            stages=tuple(sorted(self.modules)),
            device=self.device,
            run=RunLayout(
                pipeline=self.pipeline.digest(),
                schedule=config.schedule,
                microbatches=config.microbatches,
                accumulate=config.accumulate,
                num_stages=self.pipeline.num_stages,
                pp_size=layout.pp_size,
                dp_size=layout.dp_size,
                recompute=tuple(sorted(config.recompute)),
                recompute_blocks=tuple(sorted(config.recompute_blocks)),
                bf16=config.bf16,
            ),
            fsdp_root=StageRunner.STAGE if layout.sharded else None,
            tensor_parallel=layout.tensor_parallel,
        )
        timeline.align()
        return timeline

    def make_metrics(self) -> Metrics:
        """The per-step metrics, with what the plan predicts and where the run starts noted."""
        config, pipeline, plan = self.config, self.pipeline, self.pipeline.plan
        samples, tokens = self.batches.samples, pipeline.tokens_per_sample
        per_step = config.microbatches * config.accumulate * self.layout.dp_size  # example ones
        # an evaluation alone trains no step again: it truncates and purges nothing
        resumed = self.resume is not None and not config.eval_only
        resumed_at = self.start if resumed else None
        run_name = f"{pipeline.model_class} in {pipeline.num_stages} stages"
        if config.eval_only:
            run_name += f" (evaluation after {self.start} steps)"
        sinks = (
            open_sinks(
                tensorboard=config.tensorboard,
                wandb=config.wandb,
                run_name=run_name,
                configuration=run_configuration(pipeline, config, dist.get_world_size()),
                resumed_at=resumed_at,
            )
            if self.reporting
            else []
        )
        # MFU against the device that runs, not another's peak: see metrics.plan_device_problem
        no_mfu = self.off_plan if plan and plan.peak_flops else None
        metrics = Metrics(
            reporting=self.reporting,
            steps=config.steps,
            samples_per_step=samples,
            tokens_per_step=samples * tokens if tokens else None,
            log_json=config.log_json,
            log_every=config.log_every,
            resumed_at=resumed_at,
            utilisation=lambda seconds: (
                plan.utilisation(seconds / self.flops_scale, per_step, dist.get_world_size())
                if plan and not no_mfu
                else None
            ),
            sinks=sinks,
            stragglers=Stragglers(self.layout.rank_mesh),
            appends=config.eval_only,
            perplexity=pipeline.loss_over_tokens,
        )
        if plan and plan.step_time:
            metrics.note(plan_note(pipeline, config, dist.get_world_size()))
        if self.off_plan:
            metrics.note(self.off_plan)
        if self.shared_cores:
            metrics.note(self.shared_cores)
        if self.resume is not None:
            metrics.note(f"resumed from {self.resume} at step {self.start}")
            if self.start >= config.steps and not config.eval_only:
                metrics.note(
                    f"the checkpoint is at step {self.start}, at or past --steps "
                    f"{config.steps}: nothing is left to train (give a larger --steps to train on)"
                )
        elif config.resume:
            metrics.note(f"no checkpoint in {config.checkpoint_dir} yet: starting at step 0")
        return metrics

    def shaped(self, sizes: dict[str, int] | None, forward_only: bool = False) -> Shaped:
        """This rank's pipeline stages, with buffers of the sizes ``sizes`` of the dynamic
        dimensions, and a schedule over them. ``forward_only``: an evaluation's, stages and
        schedule of their own (torch's schedules keep their stages' buffers per mode) that
        only ever run ``eval``, which skips every backward action and its transfers."""
        config, pipeline = self.config, self.pipeline
        tp = self.layout.tp_size
        stages = [
            DataParallelStage(
                self.runners[s.index],
                s.index,
                pipeline.num_stages,
                self.device,
                input_args=tuple(value.meta_tensor(sizes, tp) for value in pipeline.received(s)),
                output_args=tuple(value.meta_tensor(sizes, tp) for value in pipeline.returned(s)),
                group=self.layout.pp_group,
            )
            for s in pipeline.stages_on(self.layout.pp_rank)
        ]
        for stage, s in zip(stages, pipeline.stages_on(self.layout.pp_rank)):
            stage.reduce_every_microbatch = config.gathers_per_block
            stage.overlap = config.dp_overlap
            stage.dp_ranks = self.dp_ranks
            stage.whole_backward_in_input = not any(
                value.requires_grad for value in pipeline.received(s)
            )
            runner = self.runners[s.index]
            if runner.data_slots:
                stage.feed = runner.select
            if s.index != pipeline.num_stages - 1:  # its outputs are sent on: checked first
                stage.planned_outputs = tuple(
                    (value.name, value.local_shape(sizes, tp), value.torch_dtype)
                    for value in pipeline.returned(s)
                )
        if config.microbatches * pipeline.num_stages >= LARGE_SCHEDULE and not forward_only:
            say(
                f"building the {config.schedule} schedule of {config.microbatches} microbatches ..."
            )
        schedule = build_schedule(
            config.schedule, stages, pipeline, config.microbatches, self.loss_fn, forward_only
        )
        return stages, schedule

    # -- step ----------------------------------------------------------------------------------
    def step(self, step: int) -> None:
        """One optimizer step: the step's batch through ``--accumulate`` pipeline runs, the
        gradients averaged, reduced and clipped, the optimizers and learning rates stepped
        (unless the loss or gradient norm is not finite), and the step's metrics recorded."""
        began = time.perf_counter()
        timeline = self.timeline if self.timeline and self.timeline.traces(step) else None
        if timeline is not None:
            timeline.begin_step(step)
        ACTIVITY.begin_step(step)
        with recorded(timeline, "step"):
            self.train_step(step, began)
        if timeline is not None:
            timeline.end_step()
            if step == timeline.last_step:
                timeline.write()  # collective: every rank traces the same steps

    def train_step(self, step: int, began: float) -> None:
        """:meth:`step`'s work, which ``--trace`` records as the step."""
        config, layout, metrics = self.config, self.layout, self.metrics
        for optimizer in self.optimizers.values():
            optimizer.zero_grad(set_to_none=True)
        with doing("data", ranks=self.data_ranks):
            batch, sizes = self.read_batch(step)
        stages, schedule = self.schedules.get(sizes)
        if self.timeline is not None:  # recorded during the traced steps only
            for stage in stages:
                stage.timeline = self.timeline if self.timeline.step is not None else None
        with doing("pipeline"):
            losses = self.run_pipeline(batch, stages, schedule)
        runs = config.microbatches * config.accumulate
        with recorded(self.timeline, "reduce"):
            self.sync.scale(1.0 / runs)  # the mean over this rank's microbatches
            self.sync.reduce()
            grad_norm = self.sync.clip(config.clip_grad_norm)
        loss = None
        if self.is_last:
            mean = torch.stack([l.detach().float() for l in losses]).mean().to(self.device)
            if layout.dp_size > 1:
                with doing("loss_mean", ranks=self.dp_ranks):
                    dist.all_reduce(mean, group=layout.dp_group)
                mean /= layout.dp_size
            loss = mean.item()
        with doing("finite_check", ranks=self.world_ranks):
            problem = nonfinite_problem(step, loss, grad_norm, self.device)
        if problem and not config.skip_nonfinite:
            raise PipelineRunError(problem, every_rank=True)
        # this step's; a float, as --lr is (torch's annotation allows a tensor)
        lr = cast(float, next(iter(self.schedulers.values())).get_last_lr()[0])
        for index, optimizer in self.optimizers.items():
            with recorded(self.timeline, "optimizer", index):
                if not problem:
                    optimizer.step()
                self.schedulers[index].step()
        tracker = self.tracker
        if tracker is not None and tracker.active and step == self.start + 1:
            tracker.__exit__(None, None, None)  # the second step reached the steady peak
        with doing("metrics", ranks=self.world_ranks):
            memory = gather_per_rank(peak_memory(self.device, tracker), self.device)
            state = gather_per_rank(
                state_bytes(self.modules.values(), self.optimizers.values()), self.device
            )
            seconds = time.perf_counter() - began
            self.step_times.add_step(seconds, self.flops_scale)
            logged = metrics.logs(step)
            times = self.step_times.gather() if logged else []  # the same steps on every rank
        loss = float("nan") if loss is None else loss
        metrics.record(
            step, loss, seconds, lr, grad_norm, memory, state, skipped=bool(problem), times=times
        )

    def read_batch(
        self, step: int, batches: Batches | None = None
    ) -> tuple[Any, dict[str, int] | None]:
        """The step's batch on the ranks that read data (else None), and the sizes of the
        dynamic dimensions, which every rank learns (None for a static pipeline).
        ``batches``: held-out ones, by index (the training batches by default)."""
        pipeline, metrics = self.pipeline, self.metrics
        held_out = batches is not None
        batches = batches or self.batches
        reads = self.reads_batches
        if not pipeline.dimensions:
            if not reads:
                return None, None
            try:
                with doing("read_batch"):
                    return batches(step), None
            except PipelineRunError as exc:  # the first stage's rank refuses the batch too
                if not self.is_first and self.layout.pp_size > 1:
                    first = self.pipeline.stages[0].rank
                    exc.also_on = self.layout.global_rank(first, self.layout.dp_rank)
                raise
        batch, sizes = agree_dimensions(batches, step, reads, self.layout)
        if held_out:
            return batch, sizes
        self.flops_scale = pipeline.flops_scale(sizes)
        metrics.samples_per_step = batches.rows * pipeline.samples_in_microbatch(sizes)
        if pipeline.tokens_per_sample:
            per_sample = pipeline.tokens_in_sample(sizes)
            assert per_sample is not None  # the pipeline has tokens per sample
            metrics.tokens_per_step = metrics.samples_per_step * per_sample
        return batch, sizes

    def run_pipeline(
        self, batch: Any, stages: list[DataParallelStage], schedule: _PipelineSchedule
    ) -> list[torch.Tensor]:
        """The step's ``--accumulate`` pipeline runs, gradients reduced in the last: the losses
        of this rank's microbatches (on the last stage's rank; none elsewhere)."""
        config, layout = self.config, self.layout
        losses: list[torch.Tensor] = []
        for round_ in range(config.accumulate):
            for stage in stages:  # gradients are reduced in the last round only
                stage.final_round = round_ == config.accumulate - 1
            ACTIVITY.round = round_
            if self.timeline is not None:
                self.timeline.round = round_
            inputs, target = (
                self.batches.part(batch, round_ * layout.dp_size + layout.dp_rank)
                if batch
                else ([], None)
            )
            losses += self.run_schedule(schedule.step, inputs, target)
        return losses

    def run_schedule(
        self,
        call: Callable[..., Any],
        inputs: list[torch.Tensor],
        target: torch.Tensor | None,
    ) -> list[torch.Tensor]:
        """One pipeline run through a schedule's ``step`` or ``eval`` (``call``): the inputs
        given on the first stage's rank, the target and a list for the losses on the last's.
        Returns the losses of this rank's microbatches (none but on the last stage's rank)."""
        losses: list[torch.Tensor] = []  # the schedule fills it
        kwargs: dict[str, Any] = {}
        if self.is_last:
            if target is None:  # the loss is a model output
                target = torch.zeros(self.config.microbatches)
            kwargs = {"target": target.to(self.device), "losses": losses, "return_outputs": False}
        given = {value.name: t for value, t in zip(self.pipeline.data_inputs, inputs)}
        for index, runner in self.runners.items():
            if runner.data_slots:
                runner.batch_inputs = self.batch_microbatches(index, given)
        first = self.pipeline.first_inputs if self.is_first else []
        # a head split over the vocabulary hands its logits to the loss split: torch computes
        # the cross-entropy (and its backward, in the schedule's backward actions) on the splits
        split_loss = self.pipeline.loss_parallel and self.layout.tensor_parallel
        with loss_parallel() if split_loss else contextlib.nullcontext():
            call(*[given[value.name].to(self.device) for value in first], **kwargs)
        return losses

    def batch_microbatches(
        self, stage: int, given: dict[str, torch.Tensor]
    ) -> list[tuple[torch.Tensor, ...]]:
        """The inputs stage ``stage`` reads from the batch, split into the run's microbatches
        as the schedule splits the first stage's (torch's ``split_args_kwargs_into_chunks``,
        each along its batch dimension)."""
        names = self.pipeline.stages[stage].data_inputs
        tensors = tuple(given[name].to(self.device) for name in names)
        dtypes = [self.pipeline.values[name].torch_dtype for name in names]
        if self.config.bf16 and self.layout.sharded:  # FSDP2 casts a stage's float arguments
            dtypes = [torch.bfloat16 if d.is_floating_point else d for d in dtypes]
        spec = tuple(
            TensorChunkSpec(self.pipeline.batch_dim(name))  # type: ignore[no-untyped-call]
            for name in names
        )
        chunks, _ = split_args_kwargs_into_chunks(tensors, None, self.config.microbatches, spec)
        # contiguous, as the schedule gives the first stage's (a split along a dimension other
        # than 0 is a strided view, which cuDNN's RNNs and aten.view refuse), in the dtypes the
        # stage's received arguments have (FSDP2's bf16 cast of them does not reach these)
        return [
            tuple(t.to(dtype).contiguous() for t, dtype in zip(chunk, dtypes)) for chunk in chunks
        ]

    # -- evaluate ------------------------------------------------------------------------------
    def evaluate(self, done: int) -> None:
        """After ``done`` steps: the mean loss over ``--eval-batches`` held-out batches, each
        through forward-only pipeline runs without gradients, dropout off and nothing
        recomputed; recorded by the reporting rank (collective). Every random number generator
        is as it was before (``evaluation.random_states_kept``): training with evaluations is
        training without. Held-out batches without any label token are refused."""
        assert self.eval_batches is not None  # called only with --eval-data
        config, layout, batches = self.config, self.layout, self.eval_batches
        began = time.perf_counter()
        sums = LossSums()
        ACTIVITY.round = 0  # its runs are no accumulation rounds of the step before
        recompute = {index: runner.recompute for index, runner in self.runners.items()}
        for index, runner in self.runners.items():
            runner.recompute = False
            runner.train(False)
        seed = config.seed * 1_000_003 + layout.place + EVAL_SEED  # as training's, apart
        try:
            with torch.no_grad(), doing("evaluation"), random_states_kept(self.device, seed):
                for number in range(config.eval_batches):
                    try:
                        batch, sizes = self.read_batch(number, batches)
                    except UserCodeError as exc:
                        raise exc.at_step(done) from exc
                    _, schedule = self.eval_schedules.get(sizes)
                    for part in range(config.accumulate):
                        run = part * layout.dp_size + layout.dp_rank
                        inputs, target = batches.part(batch, run) if batch else ([], None)
                        self.evaluate_run(inputs, target, schedule, sums)
                    self.metrics.progress("eval", number + 1, config.eval_batches)
        finally:
            for index, runner in self.runners.items():
                runner.recompute = recompute[index]
                runner.train(True)
        sums.reduce(dist.group.WORLD, self.device)  # the last stages' sums, on every rank
        if sums.weight == 0:
            problem = no_label_tokens(self.pipeline, config.eval_batches, batches.spec, done)
            raise PipelineRunError(problem, every_rank=True)
        seconds = time.perf_counter() - began
        result = EvalResult(sums.mean, config.eval_batches, seconds, sums.empty)
        self.metrics.record_eval(done, result)

    def evaluate_run(
        self,
        inputs: list[torch.Tensor],
        target: torch.Tensor | None,
        schedule: _PipelineSchedule,
        sums: LossSums,
    ) -> None:
        """One forward-only pipeline run of a held-out batch's part: its microbatch losses,
        weighted by their label tokens (learnt from the first stage's rank), added to ``sums``
        on the last stage's rank."""
        microbatches = self.config.microbatches
        weights = None
        if weighs_by_tokens(self.pipeline):  # the first stage's rank counts, the last's weighs
            weights = torch.zeros(microbatches, dtype=torch.float64, device=self.device)
            if self.is_first:
                weights += label_tokens(self.pipeline, inputs, microbatches).to(self.device)
            if self.layout.pp_size > 1:
                dist.all_reduce(weights, group=self.layout.pp_group)
        losses = self.run_schedule(schedule.eval, inputs, target)
        if self.is_last:
            sums.add(losses, weights)

    # -- checkpoint ----------------------------------------------------------------------------
    def checkpoint(self, done: int) -> None:
        """After ``done`` steps: a training checkpoint every ``--checkpoint-every`` steps and
        after the last, when there is a ``--checkpoint-dir``."""
        config = self.config
        if self.checkpoints and (
            done == config.steps
            or (config.checkpoint_every and done % config.checkpoint_every == 0)
        ):
            with doing("checkpoint"):
                self.last_checkpoint = self.checkpoints.save(done, self.modules, self.optimizers)
            self.metrics.note(f"checkpoint {self.last_checkpoint}")

    # -- finish --------------------------------------------------------------------------------
    def finish(self) -> None:
        """``--save``: the trained original-model state_dict, gathered to global rank 0."""
        config = self.config
        if config.save:
            state = gather_weights(
                self.modules, self.pipeline, self.layout, config.save_trainable_only
            )
            if state is not None:
                save_trained(state, self.pipeline, config, config.steps, self.last_checkpoint)


# -- dynamic dimensions -----------------------------------------------------------------------
class ShapedSchedules:
    """This rank's stages and schedule for each step's sizes of the dynamic dimensions: built
    on first use by ``build`` and kept for the ``keep`` sizes used last, so that recurring
    lengths cost nothing (a static pipeline has one entry, for ``None``). Each kept entry holds
    its stages' receive buffers (``--pad-to-multiple`` limits how many sizes occur)."""

    def __init__(self, build: Callable[[dict[str, int] | None], Shaped], keep: int = 4):
        self.build = build
        self.keep = keep
        #: sizes -> (stages, schedule), least recent first
        self.built: dict[tuple[tuple[str, int], ...], Shaped] = {}

    def get(self, sizes: dict[str, int] | None) -> Shaped:
        key = tuple(sorted(sizes.items())) if sizes is not None else ()
        entry = self.built.pop(key, None) or self.build(sizes)
        self.built[key] = entry
        while len(self.built) > self.keep:
            self.built.pop(next(iter(self.built)))
        return entry


def agree_dimensions(
    batches: Batches, step: int, reads: bool, layout: Layout
) -> tuple[Any, dict[str, int]]:
    """The step's batch (on the ranks that read data, else None) and the sizes of the dynamic
    dimensions, which every rank of the pipeline learns from one all-reduce (the maximum of
    what the reading ranks found; the others give zeros). A batch a reading rank refuses stops
    every rank, with its reason."""
    names = list(batches.pipeline.dimensions)
    batch, problem, found = None, None, [0] * len(names)
    if reads:
        try:
            with doing("read_batch"):
                batch = batches(step)
            sizes = batches.dimensions(batch[0], step) if batch[0] else {}
            assert sizes is not None  # the pipeline has dynamic dimensions
            found = [sizes.get(name, 0) for name in names]
        except Exception as exc:  # noqa: BLE001 - every rank must reach the all-reduce
            problem = exc
    # the lowest refusing rank says why (every rank reading the batch refuses the same one)
    past = dist.get_world_size() + 1
    refused_by = past - layout.rank if problem is not None else 0
    agreed = torch.tensor([refused_by, *found], device=layout.device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=layout.pp_group)
    if problem is not None and past - int(agreed[0]) == layout.rank:  # printed by this rank
        raise problem
    if agreed[0]:
        raise RankFailedError(past - int(agreed[0]), f"it refused the batch of step {step}")
    sizes = dict(zip(names, (int(v) for v in agreed[1:])))
    missing = [name for name, size in sizes.items() if size == 0]
    if missing:
        raise PipelineRunError(
            f"step {step}: no input of the batch sizes the dynamic dimension(s) {missing}",
            every_rank=True,
        )
    return batch, sizes


def plan_note(pipeline: Pipeline, config: TrainConfig, world: int) -> str:
    """What the compiled plan predicts, for the metrics to be read against."""
    plan = pipeline.plan
    assert plan is not None  # noted only for a pipeline with a plan
    planned = pipeline.num_ranks * pipeline.dp_shard * pipeline.tp
    per_step = plan.microbatches * plan.accumulate * pipeline.dp_shard
    mfu = plan.utilisation(plan.step_time, per_step, planned)
    differs = [
        f"{flag} {mine}"
        for flag, mine, planned_value in (
            ("--microbatches", config.microbatches, plan.microbatches),
            ("--accumulate", config.accumulate, plan.accumulate),
            ("--dp", config.dp, 1),
            ("--dp-shard", config.dp_shard, pipeline.dp_shard),
        )
        if mine != planned_value
    ]
    return (
        f"plan: {plan.step_time:.3f} s per step of {plan.microbatches} microbatches x "
        f"{plan.accumulate} accumulation x {pipeline.dp_shard} shard"
        f"{'s' if pipeline.dp_shard > 1 else ''}"
        + (f" x tensor parallel {pipeline.tp}" if pipeline.tp > 1 else "")
        + f" on {planned} device{'s' if planned > 1 else ''}"
        + (f", MFU {mfu * 100:.3g}% of {plan.device}" if mfu is not None else "")
        + (f" (this run: {', '.join(differs)} on {world} processes)" if differs else "")
    )


def _stop(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(
        f"{signal.Signals(signum).name}: torchrun stops every rank when one fails or the job is cancelled"
    )


def _user_code_error(exc: BaseException | None) -> UserCodeError | None:
    """The failure of user code found along an exception's causes (torch's pipeline stages
    wrap what a stage raises), or None."""
    while exc is not None:
        if isinstance(exc, UserCodeError):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def _failed_check(exc: BaseException | None) -> str | None:
    """The message of a generated run-time check that failed (a specialised size, the model's
    own check on tensor values), found along the exception's causes (torch's pipeline stages
    wrap what a stage raises), or None."""
    while exc is not None:
        for line in str(exc).splitlines():
            if any(words in line for words in RUN_TIME_CHECKS):
                return line.strip()
        exc = exc.__cause__ or exc.__context__
    return None


def _lost_peer(exc: BaseException) -> bool:
    """Whether an error means another rank died or stopped answering."""
    text = str(exc)
    return isinstance(exc, dist.DistError) or any(
        marker in text
        for marker in ("Connection closed by peer", "Connection reset", "gloo", "NCCL")
    )


def main(package: ModuleType, argv: list[str]) -> int:
    """train.py's entry point: the exit status. A run that started its process groups ends its
    process here once they are destroyed: gloo's worker threads can abort the interpreter's
    own teardown (SIGABRT after a successful run), which torchrun would report as a failure."""
    code = 1
    try:
        code = _main(package, argv)
    finally:
        # this rank is done: torchrun's SIGTERM (another rank ended first) ends it quietly
        signal.signal(signal.SIGTERM, lambda _signum, _frame: os._exit(code))
        started = dist.is_initialized()
        if started:
            dist.destroy_process_group()
    if started:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _main(package: ModuleType, argv: list[str]) -> int:
    try:
        pipeline = Pipeline.from_json(package.PIPELINE)
    except PipelineFormatError as exc:
        print(f"train.py: error: pipeline.json breaks the contract: {exc}", file=sys.stderr)
        return 2
    config = parse_config(argv, pipeline, Path(package.__file__ or ".").resolve().parent)
    if config.dry_run:
        warn_if_edited(package)
        try:
            return run_dry(
                package,
                pipeline,
                config,
                lambda played, layout: rehearse(package, pipeline, played, layout),
            )
        except PipelineRunError as exc:
            _error(f"train.py: error: {exc}")
            return 2
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1") or 1)
    board = FailureBoard(rank, world)
    where = _where(pipeline, RankMesh.of(pipeline, config.dp, config.dp_shard), rank, world)
    resume_hint = ResumeHint(config.checkpoint_dir)
    signal.signal(signal.SIGTERM, _stop)  # torchrun stops every rank with SIGTERM
    if rank == 0:
        warn_if_edited(package)
    try:
        train(package, pipeline, config)
    except RankFailedError as exc:
        _error(
            f"train.py: rank {rank} stopped because rank {exc.failed} failed: {exc} (its error "
            "is printed above)"
        )
        return 2
    except PipelineRunError as exc:
        _ending()
        if exc.also_on is not None and board.posted(exc.also_on, wait=5.0):
            _error(
                f"train.py: rank {rank} stopped because rank {exc.also_on} failed: it refused "
                "the same batch (its error is printed above)"
            )
            return 2
        if exc.every_rank:  # found by every rank alike: rank 0 says it
            if rank == 0:
                _error(f"train.py: error: {exc}")
            return 2
        board.post(str(exc))
        _error(f"train.py: error: {exc}{where}")
        if isinstance(exc, UserCodeError):
            log = _write_traceback(exc.original, rank)
            if log:
                _error(f"train.py: the full traceback{where} is in {log}")
        return 2
    except MissingOperatorError as exc:
        _ending()
        board.post(str(exc))
        _error(f"train.py: error: rank {rank}: {exc}")
        return 2
    except KeyboardInterrupt as exc:
        _ending()
        if _said_who_failed(board, rank, resume_hint):
            return 2
        _error(f"train.py: rank {rank} stopped ({str(exc) or 'SIGINT'}).{resume_hint}")
        return 130
    except Exception as exc:  # noqa: BLE001 - lost peers and failed checks are explained
        _ending()
        unlike = _failed_check(exc)
        if unlike:  # a batch unlike the example, caught by a stage's check
            board.post(unlike)
            _error(f"train.py: error: rank {rank}: {unlike}")
            return 2
        if not _lost_peer(exc):
            board.post(f"{type(exc).__name__}: {first_line(exc)}")
            raise
        if _said_who_failed(board, rank, resume_hint):
            return 2
        _error(  # the process group waits DIAGNOSIS_MARGIN past --timeout: see train()
            f"train.py: error: rank {rank} lost contact with another rank, which died or did not "
            f"answer within --timeout {config.timeout:g} s + {DIAGNOSIS_MARGIN:g} s for the hang "
            f"diagnosis ({first_line(exc)[:200]}).{resume_hint}"
        )
        return 3
    return 0


def _ending() -> None:
    """From here on the rank only says how it ended, which takes moments (at most a read of
    the store, within its timeout): torchrun's SIGTERM, sent to every rank once one ends, is
    ignored so that it neither raises inside that report nor cuts it short (a rank killed
    while it read the board said nothing); torchrun's SIGKILL after its grace period still ends
    a rank that lingers."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class ResumeHint:
    """What a failed run says about resuming, read when it fails: where the last complete
    checkpoint is, if the run's ``--checkpoint-dir`` holds one by then; nothing otherwise."""

    def __init__(self, checkpoint_dir: str | None):
        self.checkpoint_dir = checkpoint_dir

    def __str__(self) -> str:
        if not has_checkpoint(self.checkpoint_dir):
            return ""
        return (
            " Checkpoints written so far are complete: rerun with --resume to continue from "
            f"{self.checkpoint_dir}/latest."
        )


def _said_who_failed(board: FailureBoard, rank: int, resume_hint: ResumeHint) -> bool:
    """Whether another rank posted a failure, which this rank then names as why it stopped."""
    failed = board.first_failed()
    if failed is None:
        return False
    _error(
        f"train.py: rank {rank} stopped because rank {failed} failed (its error is printed "
        f"above).{resume_hint}"
    )
    return True


def _error(line: str) -> None:
    """``line`` on stderr in one write, its newline included: ranks write to one stream, and
    ``print``'s two writes (text, then newline) interleave with another rank's unbuffered."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _where(pipeline: Pipeline, ranks: RankMesh, rank: int, world: int) -> str:
    """`` (rank R, stage S)``: where an error was found, for a message's end (nothing in a run
    of one process; the rank alone in a job of another size than the mesh ``ranks``)."""
    if world == 1:
        return ""
    if world != ranks.world:
        return f" (rank {rank})"
    stages = [str(s.index) for s in pipeline.stages_on(ranks.pp_rank_of(rank))]
    return f" (rank {rank}, stage{'s' if len(stages) > 1 else ''} {', '.join(stages)})"


def _write_traceback(exc: BaseException, rank: int) -> Path | None:
    """The full traceback of user code's failure, in a log file of its own; its path (None
    if it cannot be written)."""
    return write_error_log("".join(traceback.format_exception(exc)), rank)


def warn_if_edited(package: ModuleType) -> None:
    """A warning when the package's files differ from what autopipe generated."""
    directory = Path(package.__file__ or ".").parent
    edited = edited_files(directory)
    if edited:
        shown = ", ".join(edited[:3]) + (f" and {len(edited) - 3} more" if len(edited) > 3 else "")
        _error(
            f"train.py: warning: {shown} differ{'s' if len(edited) == 1 else ''} from what autopipe "
            f"generated (manifest.json): this run trains the edited code; autopipe verify "
            f"{shlex.quote(str(directory))} says more, autopipe compile regenerates it"
        )
