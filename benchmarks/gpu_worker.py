"""The one-GPU kit's measurements that run outside train.py, each in a fresh process of its own
(benchmarks/gpu.py starts them; a failure or a CUDA out-of-memory stays in its process).

    python benchmarks/gpu_worker.py reference MODEL --steps S --init INIT.pt --out DIR [--bf16]
    python benchmarks/gpu_worker.py original MODEL --steps S --warmup W --out FILE [--compile]
    python benchmarks/gpu_worker.py pipeline MODEL --split NAME --steps S --warmup W --out FILE

``reference``: the original model trained on the GPU from ``INIT.pt`` with train.py's arithmetic
(each step's batch in MICROBATCHES microbatches, each one's loss back-propagated, the summed
gradients scaled once by 1 / MICROBATCHES, one AdamW step at lr 1e-3: train.py's defaults; the
same sums in the same order, so that AdamW, which turns a gradient near zero into a full step,
does not amplify a rounding difference); writes ``losses.json`` and ``trained.pt``. ``--bf16``:
the forward under bf16 autocast, as ``train.py --bf16`` runs each stage.

``original``: the original model's training step time on the GPU, eager or ``torch.compile``-d,
the same step (microbatches, AdamW) as train.py. ``pipeline``: torch's ``pipeline()`` splitting the
model before module NAME into two stages, both on this one GPU under torch's interleaved 1F1B (the
looped schedule train.py runs the compiled two-stage package with on one rank), the same step.
Both write the median step time over the steps after the warm-up, the losses and the peak of
``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
LR = 1e-3  # train.py's default --lr


def models():
    spec = importlib.util.spec_from_file_location("gpu_models", HERE / "gpu_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def microbatches_of(batch, count):
    (ids,), kwargs = batch
    return [
        ((i,), {k: v for k, v in zip(kwargs, parts)})
        for i, *parts in zip(ids.chunk(count), *(v.chunk(count) for v in kwargs.values()))
    ]


def reference(args) -> None:
    kit = models()
    device = torch.device(args.device)
    model = getattr(kit, args.model)()[0]
    model.load_state_dict(torch.load(args.init, weights_only=True))
    model.to(device).train()
    batches = getattr(kit, f"{args.model}_batches")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for step in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        chunks = []
        for (ids,), kwargs in microbatches_of(batches(step), kit.MICROBATCHES):
            with torch.autocast(device.type, torch.bfloat16, enabled=args.bf16):
                out = model(ids.to(device), **{k: v.to(device) for k, v in kwargs.items()})
            out.loss.backward()
            chunks.append(out.loss.detach())
        for p in model.parameters():  # the mean's gradient, scaled once as train.py does
            if p.grad is not None:
                p.grad.mul_(1.0 / kit.MICROBATCHES)
        optimizer.step()
        losses.append(torch.stack(chunks).float().mean().item())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "losses.json").write_text(json.dumps(losses))
    torch.save({k: v.cpu() for k, v in model.state_dict().items()}, out / "trained.pt")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(step, steps: int, warmup: int, device: torch.device) -> tuple[float, list[float]]:
    """Run ``step()`` ``steps`` times; the median seconds of those after ``warmup``, and every
    step's loss."""
    times, losses = [], []
    for i in range(steps):
        synchronize(device)
        start = time.perf_counter()
        loss = step(i)
        synchronize(device)
        times.append(time.perf_counter() - start)
        losses.append(loss)
    return statistics.median(times[warmup:]), losses


def write_speed(
    path: str, device: torch.device, seconds: float, losses: list[float], **more
) -> None:
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    Path(path).write_text(
        json.dumps({"step_time": seconds, "losses": losses, "peak_memory": peak, **more})
    )


def original(args) -> None:
    kit = models()
    device = torch.device(args.device)
    model = getattr(kit, args.model)()[0].to(device).train()
    batches = getattr(kit, args.batches)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    forward = torch.compile(model) if args.compile else model

    def step(index: int) -> float:
        optimizer.zero_grad(set_to_none=True)
        losses = []
        for (ids,), kwargs in microbatches_of(batches(index), kit.MICROBATCHES):
            loss = forward(ids.to(device), **{k: v.to(device) for k, v in kwargs.items()}).loss
            (loss / kit.MICROBATCHES).backward()
            losses.append(loss.detach())
        optimizer.step()
        return torch.stack(losses).float().mean().item()

    seconds, losses = timed_steps(step, args.steps, args.warmup, device)
    write_speed(args.out, device, seconds, losses)


class WithLabels(nn.Module):
    """The model taking labels positionally (pipeline() feeds only the first stage inputs);
    the clone keeps them a value of the first stage, which sends them on."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        return self.model(input_ids, labels=labels.clone())


def pipelined(args) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import ScheduleInterleaved1F1B, SplitPoint, pipeline

    kit = models()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29600 + os.getpid() % 1000))
    if args.device == "cuda":
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=0, world_size=1)
    example = getattr(kit, args.model)()
    model = WithLabels(example[0]).train()
    ids = example[1][0]
    pipe = pipeline(
        model,
        mb_args=(ids, example[2]["labels"]),
        split_spec={f"model.{args.split}": SplitPoint.BEGINNING},
    )
    stages = [pipe.build_stage(i, device) for i in range(pipe.num_stages)]
    del pipe, model
    modules = [stage.submod for stage in stages]
    schedule = ScheduleInterleaved1F1B(
        stages,
        n_microbatches=kit.MICROBATCHES,
        loss_fn=lambda output, _target: output[0],
        scale_grads=True,
    )
    params = [p for m in modules for p in m.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    batches = getattr(kit, args.batches)
    target = torch.zeros(kit.MICROBATCHES, device=device)  # the loss is the model's output

    def step(index: int) -> float:
        (batch_ids,), kwargs = batches(index)
        optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        schedule.step(
            batch_ids.to(device),
            kwargs["labels"].to(device),
            target=target,
            losses=losses,
            return_outputs=False,
        )
        optimizer.step()
        return torch.stack([l.detach().float() for l in losses]).mean().item()

    seconds, losses = timed_steps(step, args.steps, args.warmup, device)
    write_speed(args.out, device, seconds, losses, stages=len(stages))
    dist.destroy_process_group()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    ref = commands.add_parser("reference")
    ref.add_argument("model")
    ref.add_argument("--steps", type=int, required=True)
    ref.add_argument("--init", required=True)
    ref.add_argument("--out", required=True)
    ref.add_argument("--bf16", action="store_true")
    ref.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    for name in ("original", "pipeline"):
        speed = commands.add_parser(name)
        speed.add_argument("model")
        speed.add_argument("--batches", required=True)
        speed.add_argument("--steps", type=int, required=True)
        speed.add_argument("--warmup", type=int, required=True)
        speed.add_argument("--out", required=True)
        speed.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
        if name == "original":
            speed.add_argument("--compile", action="store_true")
        else:
            speed.add_argument("--split", required=True)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_worker.py: no CUDA device (--device cpu rehearses on the CPU)")
    {"reference": reference, "original": original, "pipeline": pipelined}[args.command](args)


if __name__ == "__main__":
    main(sys.argv[1:])
