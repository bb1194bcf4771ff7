"""Training driver of generated pipelines, started by ``torchrun ... train.py``.

Copied into every generated pipeline as ``runtime/driver.py``; it needs only torch. Each
rank builds the stages the pipeline places on it, wraps them in
``torch.distributed.pipelining.PipelineStage`` and runs one of torch's schedules; gradients of
parameters tied across stages are all-reduced before each optimizer step.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    _Action,
    _ComputationType,
    _PipelineSchedule,
    _PipelineScheduleRuntime,
    get_schedule_class,
)

from .checkpoint import Checkpoint, CheckpointError
from .schedule import PipelineCosts, greedy_orders
from .support import stage_state

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
_KINDS = {"F": _ComputationType.FORWARD, "B": _ComputationType.FULL_BACKWARD}

_DTYPES = {
    name: getattr(torch, name)
    for name in [
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
    ]
}


class PipelineRunError(RuntimeError):
    """A problem with how the pipeline was started or fed; printed without a traceback."""


# -- command line -----------------------------------------------------------------------------
def parse_args(argv: list[str], pipeline: dict) -> argparse.Namespace:
    num_stages = len(pipeline["stages"])
    parser = argparse.ArgumentParser(
        prog="train.py",
        description=f"Train {pipeline['model'].rsplit('.', 1)[-1]} as a {num_stages}-stage pipeline "
        f"(run with torchrun --nproc-per-node={num_devices(pipeline)}).",
    )
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps to run (default 10)")
    parser.add_argument(
        "--microbatches",
        type=int,
        default=2 * num_stages,
        help=f"microbatches per step; a step's batch is this many example microbatches (default {2 * num_stages})",
    )
    default_schedule = pipeline["schedule"]["name"]
    parser.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default=default_schedule,
        help=f"pipeline schedule (default {default_schedule}, the one the partition was made for)",
    )
    parser.add_argument(
        "--optimizer", choices=["sgd", "adamw"], default="adamw", help="optimizer (default adamw)"
    )
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    parser.add_argument("--weight-decay", type=float, default=0.0, help="weight decay (default 0)")
    parser.add_argument("--momentum", type=float, default=0.0, help="SGD momentum (default 0)")
    parser.add_argument(
        "--data",
        metavar="FILE.py:FN",
        help="FN(step) returns (args, kwargs) or (args, kwargs, target): the step's whole batch, "
        "batch dimension 0 (default: synthetic batches of the example's shapes)",
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda runs NCCL with one GPU per rank, cpu runs gloo (default: cuda when available)",
    )
    parser.add_argument(
        "--load",
        metavar="PATH",
        help="original-model weights: a torch.save state_dict, a .safetensors file or a Hugging "
        "Face checkpoint directory (sharded with an index JSON); each rank reads only its tensors",
    )
    parser.add_argument(
        "--save", metavar="PATH", help="write the trained original-model state_dict here"
    )
    parser.add_argument(
        "--log-json", metavar="PATH", help="append one JSON object per step (step, loss, time)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of initialisation and synthetic data"
    )
    args = parser.parse_args(argv)
    if args.steps < 0 or args.microbatches < 1:
        parser.error("--steps must be >= 0 and --microbatches >= 1")
    problem = schedule_problem(args.schedule, pipeline, args.microbatches)
    if problem:
        parser.error(problem)
    return args


def schedule_problem(name: str, pipeline: dict, microbatches: int) -> str | None:
    """Why schedule ``name`` cannot run this pipeline, naming what would; None if it can."""
    devices = [stage["device"] for stage in pipeline["stages"]]
    num_stages, ranks = len(devices), num_devices(pipeline)
    if name in SINGLE_STAGE:
        if devices != list(range(num_stages)):
            return (
                f"--schedule {name} runs one stage per rank, in order, but this pipeline places its "
                f"{num_stages} stages on ranks {devices}; use --schedule auto"
                + (" or interleaved-1f1b" if devices == _looped(num_stages, ranks) else "")
            )
        if name == "1f1b" and microbatches < num_stages:
            return (
                f"--schedule 1f1b needs at least as many microbatches as stages ({num_stages}); got "
                f"--microbatches {microbatches}. Use --microbatches {num_stages} or more, or --schedule gpipe."
            )
    elif name in MULTI_STAGE:
        expected = (
            _v_shape(num_stages, ranks)
            if name in ("zbv", "dualpipev")
            else _looped(num_stages, ranks)
        )
        if num_stages % ranks or devices != expected:
            return (
                f"--schedule {name} needs stage s on rank {expected} ({'V-shaped' if name in ('zbv', 'dualpipev') else 'looped'}), "
                f"but this pipeline places its stages on ranks {devices}; use --schedule auto"
            )
    return None


def _looped(num_stages: int, ranks: int) -> list[int]:
    return [s % ranks for s in range(num_stages)]


def _v_shape(num_stages: int, ranks: int) -> list[int]:
    return [s if s < ranks else 2 * ranks - 1 - s for s in range(num_stages)]


def num_devices(pipeline: dict) -> int:
    return len({stage["device"] for stage in pipeline["stages"]})


# -- data -------------------------------------------------------------------------------------
def load_function(spec: str) -> Callable:
    """Import ``FILE.py:FN`` or ``package.module:FN``."""
    location, _, name = spec.rpartition(":")
    if not location or not name:
        raise PipelineRunError(
            f"--data {spec!r} must have the form FILE.py:FN or package.module:FN"
        )
    if location.endswith(".py"):
        path = Path(location).resolve()
        if not path.is_file():
            raise PipelineRunError(f"--data: file {location} does not exist")
        module_spec = importlib.util.spec_from_file_location(f"_autopipe_data_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        sys.path.insert(0, str(path.parent))
        try:
            module_spec.loader.exec_module(module)
        finally:
            sys.path.remove(str(path.parent))
    else:
        module = importlib.import_module(location)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise PipelineRunError(f"--data: {location} has no function {name!r}")
    return fn


class Batches:
    """The whole batch of each step: from ``--data`` or synthetic, checked against the pipeline."""

    def __init__(self, pipeline: dict, microbatches: int, data: str | None, seed: int):
        self.pipeline = pipeline
        self.microbatches = microbatches
        self.fn = load_function(data) if data else None
        self.seed = seed

    def __call__(self, step: int) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """``(inputs in PIPELINE["inputs"] order, target or None)``."""
        if self.fn is None:
            return self._synthetic(step)
        result = self.fn(step)
        if not isinstance(result, (tuple, list)) or len(result) not in (2, 3):
            raise PipelineRunError(
                f"--data function returned {type(result).__name__}; expected (args, kwargs) or (args, kwargs, target)"
            )
        args, kwargs, *rest = result
        args = (args,) if isinstance(args, torch.Tensor) else tuple(args)
        bound = self._bind(args, dict(kwargs or {}))
        inputs = []
        for name in self.pipeline["inputs"]:
            if name not in bound or not isinstance(bound[name], torch.Tensor):
                raise PipelineRunError(
                    f"--data batch of step {step} has no tensor for input {name!r}"
                )
            inputs.append(self._check(name, bound[name], self.pipeline["values"][name]))
        target = rest[0] if rest else None
        loss = self.pipeline["loss"]
        if "module" in loss:
            if not isinstance(target, torch.Tensor):
                raise PipelineRunError(
                    "this pipeline's loss needs a target: the --data function must return (args, kwargs, target)"
                )
            target = self._check("target", target, loss["target"])
        return inputs, target

    def _bind(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        signature = self.pipeline["signature"]
        if len(args) > len(signature):
            raise PipelineRunError(
                f"--data gave {len(args)} positional inputs; forward takes {len(signature)}"
            )
        bound = dict(zip(signature, args))
        bound.update(kwargs)
        return bound

    def _check(self, name: str, tensor: torch.Tensor, meta: dict) -> torch.Tensor:
        micro = meta["shape"]
        expected = [micro[0] * self.microbatches, *micro[1:]] if micro else []
        if list(tensor.shape) != expected or tensor.dtype != _DTYPES[meta["dtype"]]:
            raise PipelineRunError(
                f"input {name!r} has shape {list(tensor.shape)} and dtype {str(tensor.dtype).removeprefix('torch.')}; "
                f"this pipeline expects shape {expected} and dtype {meta['dtype']} "
                f"({self.microbatches} microbatches of shape {micro}). The pipeline was compiled for "
                "that example microbatch: pass --microbatches to match your batch, or compile again."
            )
        return tensor

    def _synthetic(self, step: int) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        ranges = self.pipeline.get("input_ranges", {})
        inputs = [
            self._random(self.pipeline["values"][n], ranges.get(n, 1), generator)
            for n in self.pipeline["inputs"]
        ]
        loss = self.pipeline["loss"]
        target = (
            self._random(loss["target"], ranges.get("target", 1), generator)
            if "module" in loss
            else None
        )
        return inputs, target

    def _random(self, meta: dict, high: int, generator: torch.Generator) -> torch.Tensor:
        micro = meta["shape"]
        shape = [micro[0] * self.microbatches, *micro[1:]]
        dtype = _DTYPES[meta["dtype"]]
        if dtype.is_floating_point:
            return torch.randn(shape, generator=generator).to(dtype)
        if dtype == torch.bool:
            return torch.rand(shape, generator=generator) < 0.5
        return torch.randint(0, max(high, 0) + 1, shape, generator=generator, dtype=dtype)


# -- state ------------------------------------------------------------------------------------
def load_state(
    stages: dict[int, nn.Module], path: str, pipeline: dict, device: torch.device
) -> None:
    """Fill each local stage (built with ``meta_state``) with its own tensors from an
    original-model checkpoint, reading nothing else: a rank holds about its stages' size."""
    try:
        checkpoint = Checkpoint(path)
    except CheckpointError as exc:
        raise PipelineRunError(f"--load: {exc}") from None
    mapped: set[str] = set()
    for index, stage in stages.items():
        wanted = stage.state_dict()
        try:
            names = stage_state(stage, {name: name for name in checkpoint}, pipeline["aliases"])
        except KeyError as exc:
            raise PipelineRunError(
                f"--load: {path} has no entry {exc} (needed by stage {index}); is it a checkpoint of {pipeline['model']}?"
            ) from None
        own = {}
        for key, source in names.items():
            tensor = checkpoint[source]
            if tuple(tensor.shape) != tuple(wanted[key].shape):
                raise PipelineRunError(
                    f"--load: {source} in {path} has shape {list(tensor.shape)}, stage {index} expects {list(wanted[key].shape)}"
                )
            # on CPU with the right dtype the first user gets the mapped tensor itself (private,
            # copy-on-write); a tied tensor held by several local stages is copied for the others
            own[key] = tensor.to(device=device, dtype=wanted[key].dtype, copy=source in mapped)
            mapped.add(source)
        stage.load_state_dict(own, assign=True)


def gather_state(stages: dict[int, nn.Module], pipeline: dict) -> dict[str, torch.Tensor] | None:
    """The whole original-model ``state_dict`` on rank 0 (``None`` elsewhere)."""
    local = {
        k: v.detach().cpu() for stage in stages.values() for k, v in stage.state_dict().items()
    }
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(local, gathered, dst=0)
    if dist.get_rank() != 0:
        return None
    merged: dict[str, torch.Tensor] = {}
    for part in gathered:
        merged.update(part)
    for group in pipeline["aliases"]:
        held = next((name for name in group if name in merged), None)
        if held is not None:
            for name in group:
                merged.setdefault(name, merged[held])
    return merged


def save_atomic(state: dict[str, torch.Tensor], path: str) -> None:
    """``torch.save`` to a temporary file, then rename: an interrupted save never leaves a broken file."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    try:
        torch.save(state, tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


# -- the pipeline -----------------------------------------------------------------------------
def meta_tensors(pipeline: dict, names: list[str]) -> tuple[torch.Tensor, ...]:
    tensors = []
    for name in names:
        value = pipeline["values"][name]
        tensor = torch.empty(value["shape"], dtype=_DTYPES[value["dtype"]], device="meta")
        tensors.append(tensor.requires_grad_(value["requires_grad"]))
    return tuple(tensors)


def make_loss_fn(package: ModuleType, pipeline: dict, device: torch.device) -> Callable:
    loss = pipeline["loss"]
    if "module" in loss:
        module = importlib.import_module(f"{package.__name__}.{loss['module']}").Loss().to(device)

        def user_loss(output, target):
            outputs = output if isinstance(output, tuple) else (output,)
            return module(*outputs, target)

        return user_loss
    if loss.get("output") is None:
        raise PipelineRunError(
            "the model has no loss output; compile it with --loss FILE.py:FN or give it labels "
            "so that it returns a loss (Hugging Face style)"
        )
    index = pipeline["outputs"].index(loss["output"])

    def output_loss(output, _target):
        outputs = output if isinstance(output, tuple) else (output,)
        return outputs[index]

    return output_loss


def tied_groups(
    pipeline: dict, stages: dict[int, nn.Module]
) -> list[tuple[Any, list[nn.Parameter]]]:
    """For each parameter tied across ranks: its process group and this rank's copies."""
    groups = []
    for tie in pipeline["tied"]:
        ranks = sorted({pipeline["stages"][int(s)]["device"] for s in tie["holders"]})
        group = (
            dist.new_group(ranks) if len(ranks) > 1 else None
        )  # every rank takes part in new_group
        local = [
            stages[int(s)].get_parameter(n)
            for s, n in sorted(tie["holders"].items())
            if int(s) in stages
        ]
        if local:
            groups.append((group, local))
    return groups


def sync_tied_grads(groups: list[tuple[Any, list[nn.Parameter]]]) -> None:
    """Sum the gradients of every copy of a tied parameter, so all copies take the same step."""
    for group, params in groups:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        total = torch.stack(grads).sum(0) if len(grads) > 1 else grads[0].clone()
        if group is not None:
            dist.all_reduce(total, group=group)
        for p in params:
            p.grad = total.clone()


def make_optimizer(args: argparse.Namespace, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if args.optimizer == "sgd":
        return torch.optim.SGD(
            params, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay
        )
    return torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)


def init_distributed(pipeline: dict, device_kind: str) -> torch.device:
    world = int(os.environ.get("WORLD_SIZE", "0"))
    expected = num_devices(pipeline)
    if world == 0:
        raise PipelineRunError(
            f"start train.py with torchrun: torchrun --nproc-per-node={expected} train.py ..."
        )
    if world != expected:
        raise PipelineRunError(
            f"this pipeline runs on {expected} ranks (one per device), but torchrun started {world}; "
            f"use torchrun --nproc-per-node={expected}"
        )
    if device_kind == "cuda":
        if not torch.cuda.is_available():
            raise PipelineRunError("--device cuda: no CUDA device is available; use --device cpu")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


def build_schedule(
    name: str, stages: list[PipelineStage], pipeline: dict, microbatches: int, loss_fn: Callable
) -> _PipelineSchedule:
    """A torch.distributed.pipelining schedule over this rank's stages."""
    if name in SINGLE_STAGE:
        return get_schedule_class(SINGLE_STAGE[name])(
            stages[0], n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=True
        )
    if name in MULTI_STAGE:
        try:
            return get_schedule_class(MULTI_STAGE[name])(
                stages, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=True
            )
        except (ValueError, AssertionError) as exc:
            raise PipelineRunError(f"--schedule {name} does not fit: {exc}") from None
    costs = PipelineCosts(
        **pipeline["schedule"]["costs"], device_of_stage=[s["device"] for s in pipeline["stages"]]
    )
    orders = greedy_orders(costs, microbatches)
    schedule = _PipelineScheduleRuntime(
        stages, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=True
    )
    actions = {
        rank: [_Action(a.stage, _KINDS[a.kind], a.microbatch) for a in order]
        for rank, order in orders.items()
    }
    schedule._prepare_schedule_with_comms(actions)
    return schedule


def train(package: ModuleType, args: argparse.Namespace) -> None:
    pipeline = package.PIPELINE
    device = init_distributed(pipeline, args.device)
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    specs = pipeline["stages"]
    num_stages = len(specs)
    local = [i for i, spec in enumerate(specs) if spec["device"] == rank]
    loading = args.load is not None  # parameters stay on meta until the checkpoint fills them
    modules = {
        i: package.build_stage(i, device=device, seed=args.seed, meta_state=loading) for i in local
    }
    if loading:
        load_state(modules, args.load, pipeline, device)
    stages = [
        PipelineStage(
            modules[i],
            i,
            num_stages,
            device,
            input_args=meta_tensors(pipeline, specs[i]["inputs"]),
            output_args=meta_tensors(pipeline, specs[i]["outputs"]),
        )
        for i in local
    ]
    is_first, is_last = 0 in modules, num_stages - 1 in modules
    loss_fn = make_loss_fn(package, pipeline, device)
    schedule = build_schedule(args.schedule, stages, pipeline, args.microbatches, loss_fn)
    ties = tied_groups(pipeline, modules)
    optimizer = make_optimizer(
        args, [p for m in modules.values() for p in m.parameters() if p.requires_grad]
    )
    batches = Batches(pipeline, args.microbatches, args.data, args.seed)
    log = (
        open(args.log_json, "w", encoding="utf-8")
        if (args.log_json and is_last)
        else contextlib.nullcontext()
    )
    with log:
        for step in range(args.steps):
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            losses: list[torch.Tensor] = []
            inputs, target = batches(step) if (is_first or is_last) else ([], None)
            kwargs: dict[str, Any] = {}
            if is_last:
                if target is None:
                    target = torch.zeros(args.microbatches)  # the loss is a model output
                kwargs = {"target": target.to(device), "losses": losses, "return_outputs": False}
            step_inputs = [t.to(device) for t in inputs] if is_first else []
            schedule.step(*step_inputs, **kwargs)
            sync_tied_grads(ties)
            optimizer.step()
            if is_last:
                loss = torch.stack([l.detach().float() for l in losses]).mean().item()
                elapsed = time.perf_counter() - start
                print(f"step {step} loss {loss:.6f} ({elapsed:.3f} s)", flush=True)
                if args.log_json:
                    log.write(json.dumps({"step": step, "loss": loss, "time": elapsed}) + "\n")
                    log.flush()
    if args.save:
        state = gather_state(modules, pipeline)
        if state is not None:
            save_atomic(state, args.save)
            print(f"saved the trained model state_dict to {args.save}", flush=True)


def main(package: ModuleType, argv: list[str]) -> int:
    args = parse_args(argv, package.PIPELINE)
    try:
        train(package, args)
    except PipelineRunError as exc:
        print(f"train.py: error: {exc}", file=sys.stderr, flush=True)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
