"""The parity ladder: how fast autopipe's generated pipeline trains against the original model
trained the same way, rung by rung, with a profiler diff against the original at each rung.

    python benchmarks/parity.py --device cpu --quick        # the ladder itself checked, 4-7 min
    python benchmarks/parity.py --device cpu                # GPT-2 and Llama, seq 1024, 10-15 min
    python benchmarks/parity.py --device cuda --quick       # one GPU, bf16 (fits 15 minutes)
    python benchmarks/parity.py --device cuda               # one GPU, bf16, seq 2048
    python benchmarks/parity.py --device cpu --model llama --compile --json parity.json

**Models** (benchmarks/parity_models.py): Hugging Face GPT-2 and a grouped-query-attention
Llama, built from configs (nothing downloaded, ``use_cache`` at its default, dropout off),
microbatches of 1 x ``--seq`` random tokens with their labels. CPU: 4 layers, hidden 256, vocab
8192, seq 1024, fp32, 4 microbatches a step; CUDA: a 0.35 B GPT-2 and benchmarks/gpu.py's 1.1 B
Llama in bf16 weights, seq 2048, 8 microbatches (``--quick``: smaller models, shorter sequences,
fewer steps). With ``use_cache`` at its default (True) transformers builds a ``DynamicCache`` in
training too and concatenates every layer's keys and values into it; the traced stages leave
that out, and the diffs show it (``aten::cat``, ``CatBackward0``, ``lift_fresh`` only in the
original).

**The baseline** is the original model trained as a user would train it without autopipe, in a
process of its own: each step's batch (``--microbatches`` microbatches, the same batches
train.py reads) one microbatch at a time, each loss back-propagated (gradient accumulation), the
summed gradients scaled once by 1 / microbatches, one AdamW step (lr 1e-3, no weight decay: what
train.py does). It runs first and again after the rungs (the machine's load drifts); its
reference figure is the mean of the two. With ``--compile`` the ladder is climbed a second time
against ``torch.compile`` of the original (the stages compiled as ``train.py --compile`` compiles
them); where torch.compile does not work (a CPU without a C++ compiler) it says why and skips.

**The rungs**, each from the same initial weights on the same batches, its tokens/s and its ratio
to the baseline (the first step's loss is printed too: it must equal the baseline's):

- (a1) the generated stages of a 1-stage package, (a2) of a 2-stage package, called in one
  process without the runtime (as ``autopipe verify`` chains them): forward, backward from the
  loss through the stages (each stage's inputs fresh leaves, their gradients handed to the stage
  before), tied copies' gradients summed, one AdamW per stage: the generated code's own cost;
- (b) ``train.py`` on one rank running the 1-stage package (torchrun, one process, 1F1B);
- (c) ``train.py`` on one rank running both stages of a 2-stage package compiled with
  ``--devices 1`` (torch's looped interleaved 1F1B): the runtime's cost for several stages;
- (d) CPU only: ``train.py`` on two ranks over gloo, one stage each (1F1B), against the
  bubble-limited ideal ``baseline x ranks x (1 - bubble)``, where 1F1B's (and GPipe's) bubble on
  ``p`` ranks with ``m`` microbatches is ``(p - 1) / (m + p - 1)``: so ``baseline x p x m / (m +
  p - 1)``, 1.6x the baseline for 2 ranks and 4 microbatches. It assumes perfectly balanced
  stages and free transfers; the per-rank busy fraction (stage compute / step, from train.py's
  ``rank_times``) tells imbalance and waiting apart from overhead.

Targets (issue 43): on a CPU (a) >= 1.00x, (b) >= 0.97x, (c) >= 0.95x the baseline; on a GPU (a)
>= 1.00x eager and >= 0.97x ``torch.compile`` (``--compile``), (c) >= 0.95x eager.

**Fairness.** Every measurement is a fresh process; one intra-op thread per process on CPU
(``OMP_NUM_THREADS=1`` and ``torch.set_num_threads(1)``, as torchrun gives each rank); on CPU every
process keeps the host memory it frees, as train.py does (``retain_freed_host_memory``: without it
each microbatch's large tensors fault fresh pages in, a cost of the allocator, not of anyone's
code); the same tokens per step everywhere; tokens/s is the tokens of a step over the median step
time of the steps after the warm-up (``--warmup``). train.py's figures are its own ``--log-json``
step times (which include reading the batch, the gradient norm it logs and the metrics it gathers;
the baseline's include making the batch too). train.py runs under torchrun with a user's arguments,
started through this script's wrapper (``--wrap-train``), which calls train.py's own ``main`` and
only reads two clocks around each step (and profiles one extra step after the timed ones). On CUDA
every timed step ends synchronised (the loss is read back).

**Noise.** On a shared machine other processes stretch the wall time: compare rows of one run
only. The load average at the end of each measurement is printed beside it, the baseline runs
before and after the rungs (their spread is the run's noise), and on CPU each row also gives
tokens per CPU second (``time.process_time`` per step, summed over a run's processes: a 2-rank
run's waiting costs no CPU, so for (d) it measures the work, not the bubble) and its ratio to
the baseline's, which contention disturbs less, though not at all (2 vCPUs share caches and
memory bandwidth with whatever else runs). The notes under the table give each run's minor page
faults per step (memory first touched: a process whose allocator unmaps and maps its large
tensors anew every step pays for it in ``fill_``, ``mm`` and the like, whoever's code it is),
train.py's own tokens/s, each rank's stage compute over its step time (``rank_times``), and the
first step's loss against the baseline's (equal: the same weights, batches and arithmetic).

**The profiler diff.** After the timed steps each measurement profiles one more step
(``torch.profiler``, shapes recorded; on CUDA also the kernels; on every rank, added up).
Against the original's profiled step, of the same tokens, each rung prints

- the attention calls: which SDPA kernel ran (``_scaled_dot_product_flash_attention_for_cpu``,
  efficient, math...), with the query/key shapes, whether an explicit ``attn_mask`` was passed
  (its shape) and ``is_causal`` (an explicit causal mask costs the kernel its causal tile
  skipping; without ``enable_gqa`` a GQA model's keys are repeated first),
- the copies: ``aten::copy_`` calls and elements, by the operator that caused them
  (``contiguous`` and ``reshape`` materialising a view, ``to``, a clone, an autograd node),
- the operators whose self time (CPU; on CUDA also kernels' device time) differs most, and the
  ones whose call counts differ most,
- for a 2-stage package, what crosses the stage boundary per microbatch: every value with its
  shape, dtype and bytes forward (and gradient bytes back), from pipeline.json and as measured on
  the chained stages' outputs.

How to read it: a rung below its target has its cause in the first rung where the ratio drops.
(a) below 1.00x is the generated code (its diff against the original's operators says which:
a mask where the original passed ``is_causal``, copies the original does not make); (b) below
(a1) is train.py's runtime on one stage (schedule, metrics, gradient norm: operators absent from
(a)'s profile); (c) below (b) the cost of a second stage (transfers, boundary copies); (d)
against its ideal the pipeline itself (bubble, imbalance, gloo transfers).

``--json PATH`` writes every figure, each profile summary included.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
import traceback
import zlib
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from autopipe.profiling.calibrate import known_gpu
from autopipe.runtime.core.host_memory import retain_freed_host_memory
from kit_processes import (
    REPO,
    Budget,
    Failed,
    OutOfTime,
    run,
)  # noqa: E402  (benchmarks/, the script's folder)

HERE = REPO / "benchmarks"

LR = 1e-3  # train.py's default --lr (AdamW, no weight decay)
#: issue 43's targets by device and ladder (compiled or eager), by rung letter: tokens/s over the
#: baseline's (on a GPU: the generated stages at eager's speed and within 3 % of torch.compile's,
#: two stages on one rank within 5 % of eager)
TARGETS = {
    ("cpu", False): {"a": 1.00, "b": 0.97, "c": 0.95},
    ("cpu", True): {"a": 1.00, "b": 0.97, "c": 0.95},
    ("cuda", False): {"a": 1.00, "c": 0.95},
    ("cuda", True): {"a": 0.97},
}
#: the schedule train.py runs each package with
SCHEDULE_ONE_RANK = "interleaved-1f1b"  # both stages on one rank: torch's looped 1F1B
SCHEDULE = "1f1b"  # one stage per rank
#: attention kernels by name -> the positions of their mask (None: takes none) and is_causal
SDPA_KERNELS = {
    "aten::_scaled_dot_product_flash_attention_for_cpu": (5, 4),
    "aten::_scaled_dot_product_flash_attention": (None, 4),
    "aten::_scaled_dot_product_efficient_attention": (3, 6),
    "aten::_scaled_dot_product_cudnn_attention": (3, 6),
    "aten::_scaled_dot_product_attention_math": (3, 5),
    "aten::_scaled_dot_product_fused_attention_overrideable": (3, 5),
}
#: operators a copy passes through on its way from the operator that caused it
COPY_CARRIERS = {
    "aten::copy_",
    "aten::clone",
    "aten::_to_copy",
    "aten::empty_like",
    "aten::empty_strided",
    "aten::empty",
    "aten::_unsafe_view",
}


# -- profiles -----------------------------------------------------------------------------------
def summarise(prof: Any, cuda: bool) -> dict[str, Any]:
    """What the diff needs of one profiled step, as JSON: per operator name its calls, self CPU
    time and self device time (us); per kernel its calls and device time; the SDPA calls; the
    copies by the operator that caused them."""
    ops: dict[str, list[float]] = {}
    kernels: dict[str, list[float]] = {}
    for avg in prof.key_averages():
        device_type = str(getattr(avg, "device_type", "CPU"))
        device_time = float(getattr(avg, "self_device_time_total", 0.0) or 0.0)
        if cuda and device_type.endswith("CUDA"):
            kernels[avg.key] = [avg.count, device_time]
        else:
            ops[avg.key] = [avg.count, float(avg.self_cpu_time_total), device_time]
    sdpa: Counter[str] = Counter()
    copies: dict[str, list[float]] = defaultdict(lambda: [0, 0])
    events = list(prof.events())
    for event in events:
        if event.name == "aten::scaled_dot_product_attention":
            sdpa[_sdpa_signature(event)] += 1
        elif event.name in SDPA_KERNELS and not (
            event.cpu_parent is not None
            and event.cpu_parent.name == "aten::scaled_dot_product_attention"
        ):
            sdpa[_kernel_signature(event)] += 1  # called directly: torch.compile's code
        elif event.name == "aten::copy_":
            origin = _copy_origin(event)
            shapes = event.input_shapes or [[]]
            copies[origin][0] += 1
            copies[origin][1] += math.prod(shapes[0]) if shapes[0] else 1
    return {
        "ops": ops,
        "kernels": kernels,
        "sdpa": dict(sdpa),
        "copies": {k: list(v) for k, v in copies.items()},
    }


def _sdpa_signature(event: Any) -> str:
    """The kernel an SDPA call took and what it was given: query and key shapes, the mask's
    shape or none, is_causal, dropout and enable_gqa."""
    kernel = next(
        (c.name for c in event.cpu_children if c.name != event.name and "attention" in c.name),
        ",".join(c.name for c in event.cpu_children) or "?",
    )
    shapes = list(event.input_shapes or [])
    concrete = list(getattr(event, "concrete_inputs", None) or [])

    def arg(i: int, default: Any = None) -> Any:
        return concrete[i] if i < len(concrete) and concrete[i] not in (None, "") else default

    mask = shapes[3] if len(shapes) > 3 and shapes[3] else None
    parts = [
        kernel.replace("aten::", ""),
        f"q {_shape(shapes[0]) if shapes else '?'}",
        f"k {_shape(shapes[1]) if len(shapes) > 1 else '?'}",
        f"mask {_shape(mask) if mask else 'none'}",
        f"is_causal={arg(5, False)}",
    ]
    if arg(4, 0.0) not in (0, 0.0, "0", "0.0", None):
        parts.append(f"dropout={arg(4)}")
    if str(arg(7, False)) == "True":
        parts.append("enable_gqa")
    return " ".join(parts)


def _kernel_signature(event: Any) -> str:
    """An attention kernel called without ``scaled_dot_product_attention`` around it (as
    inductor's code calls it), with its query and key shapes, mask and is_causal."""
    mask_at, causal_at = SDPA_KERNELS[event.name]
    shapes = list(event.input_shapes or [])
    concrete = list(getattr(event, "concrete_inputs", None) or [])
    mask = shapes[mask_at] if mask_at is not None and len(shapes) > mask_at else None
    causal = concrete[causal_at] if len(concrete) > causal_at else "?"
    return " ".join(
        [
            event.name.replace("aten::", "") + " (called directly)",
            f"q {_shape(shapes[0]) if shapes else '?'}",
            f"k {_shape(shapes[1]) if len(shapes) > 1 else '?'}",
            f"mask {_shape(mask) if mask else 'none'}",
            f"is_causal={causal}",
        ]
    )


def _shape(shape: Any) -> str:
    return "[" + ",".join(str(s) for s in shape) + "]"


def _copy_origin(event: Any) -> str:
    """The operator a copy happened for: the nearest enclosing operator that is not itself a
    step of copying (``contiguous``, ``reshape``, ``to``, an autograd node); a copy made by
    nothing else is named by its outermost carrier (``aten::clone (direct)``: a tied gradient's
    sum copied into each copy's ``.grad``, say)."""
    outermost, parent = event.name, event.cpu_parent
    while parent is not None:
        if parent.name not in COPY_CARRIERS:
            return parent.name
        outermost, parent = parent.name, parent.cpu_parent
    return f"{outermost} (direct)"


def merge_summaries(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """The summaries of several ranks' profiled steps, added up."""
    merged: dict[str, Any] = {"ops": {}, "kernels": {}, "sdpa": Counter(), "copies": {}}
    for summary in summaries:
        for table in ("ops", "kernels", "copies"):
            for name, figures in summary[table].items():
                held = merged[table].setdefault(name, [0] * len(figures))
                merged[table][name] = [a + b for a, b in zip(held, figures)]
        merged["sdpa"].update(summary["sdpa"])
    merged["sdpa"] = dict(merged["sdpa"])
    if all("wall" in s for s in summaries):
        merged["wall"] = [s["wall"] for s in summaries]
    return merged


def profiled(step: Any, index: int, device: torch.device) -> dict[str, Any]:
    """Run ``step(index)`` under torch.profiler; the summary, with the step's wall time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    synchronize(device)
    with profile(activities=activities, record_shapes=True) as prof:
        began = time.perf_counter()
        step(index)
        synchronize(device)
        wall = time.perf_counter() - began
    summary = summarise(prof, cuda)
    summary["wall"] = wall
    return summary


# -- workers: the measurements that run in a process of their own --------------------------------
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def load_file(name: str, path: str | Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_package(path: str | Path) -> Any:
    """A generated package, imported from its directory (as autopipe.verify.load_pipeline)."""
    path = Path(path).resolve()
    name = f"_parity_pipeline_{zlib.crc32(str(path).encode()):08x}"
    spec = importlib.util.spec_from_file_location(
        name, path / "__init__.py", submodule_search_locations=[str(path)]
    )
    assert spec is not None and spec.loader is not None
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package
    spec.loader.exec_module(package)
    return package


def microbatches_of(batch: Any, count: int) -> list[tuple[tuple, dict]]:
    """A step's batch ``(args, kwargs)`` as ``count`` microbatches along dimension 0."""
    args, kwargs = batch
    names = list(kwargs)
    parts = [t.chunk(count) for t in (*args, *kwargs.values())]
    return [
        (
            tuple(p[i] for p in parts[: len(args)]),
            dict(zip(names, (p[i] for p in parts[len(args) :]))),
        )
        for i in range(count)
    ]


def timed_steps(step: Any, config: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """``config["steps"]`` steps timed, then one profiled: step times, losses, the profile."""
    times, cpu, faults, losses = [], [], [], []
    for index in range(config["steps"]):
        synchronize(device)
        began, began_cpu, began_faults = time.perf_counter(), time.process_time(), minor_faults()
        loss = step(index)
        synchronize(device)
        times.append(time.perf_counter() - began)
        cpu.append(time.process_time() - began_cpu)
        faults.append(minor_faults() - began_faults)
        losses.append(loss)
    result: dict[str, Any] = {"times": times, "cpu": cpu, "faults": faults, "losses": losses}
    if device.type == "cuda":
        result["peak_memory"] = torch.cuda.max_memory_allocated(device)
    else:
        result["peak_memory"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if config.get("profile", True):
        result["profile"] = profiled(step, config["steps"], device)
    return result


def minor_faults() -> int:
    """This process's minor page faults so far: memory first touched (fresh pages the
    allocator mapped), which a step that frees and maps its large tensors anew pays each time."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def worker_device(config: dict[str, Any]) -> torch.device:
    if config["device"] == "cuda":
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    torch.set_num_threads(1)
    retain_freed_host_memory()  # as train.py's ranks do on a CPU: the same allocator for all
    return torch.device("cpu")


def original_worker(config: dict[str, Any]) -> dict[str, Any]:
    """The baseline: the original model, eager or torch.compile-d, trained step by step."""
    device = worker_device(config)
    spec = load_file("_parity_spec", config["spec"])
    model = spec.model()[0]
    model.load_state_dict(torch.load(config["init"], weights_only=True))
    model.to(device).train()
    forward = torch.compile(model) if config["compile"] else model
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    count = config["microbatches"]

    def step(index: int) -> float:
        optimizer.zero_grad(set_to_none=True)
        losses = []
        for args, kwargs in microbatches_of(spec.batches(index), count):
            args = tuple(t.to(device) for t in args)
            loss = forward(*args, **{k: v.to(device) for k, v in kwargs.items()}).loss
            loss.backward()
            losses.append(loss.detach())
        for p in params:  # the mean's gradient, scaled once as train.py does
            if p.grad is not None:
                p.grad.mul_(1.0 / count)
        optimizer.step()
        return torch.stack(losses).float().mean().item()

    return timed_steps(step, config, device)


def stages_worker(config: dict[str, Any]) -> dict[str, Any]:
    """Rung (a): a package's generated stages chained in this process, without the runtime."""
    device = worker_device(config)
    spec = load_file("_parity_spec", config["spec"])
    package = load_package(config["package"])
    core = importlib.import_module(f"{package.__name__}.runtime.core.pipeline")
    support = importlib.import_module(f"{package.__name__}.runtime.support")
    pipeline = core.Pipeline.from_json(package.PIPELINE)
    state = torch.load(config["init"], weights_only=True)
    stages = []
    for described in pipeline.stages:
        stage = package.build_stage(described.index, device=device, init=False)
        stage.load_state_dict(support.stage_state(stage, state, pipeline.aliases))
        stages.append(stage.train())
    del state
    if config["compile"]:
        driver = importlib.import_module(f"{package.__name__}.runtime.driver")
        for described, stage in zip(pipeline.stages, stages):
            driver.compile_stage(stage, described.blocks, frozenset())
    optimizers = [
        torch.optim.AdamW(
            [{"params": [p for p in stage.parameters() if p.requires_grad]}],
            lr=LR,
            weight_decay=0.0,
        )
        for stage in stages
    ]
    ties = [
        [stages[s].get_parameter(name) for s, name in tie.holders.items()]
        for tie in pipeline.tied
        if len(tie.holders) > 1
    ]
    count = config["microbatches"]
    loss_name = pipeline.loss.output
    boundaries: list[dict[str, Any]] = []

    def forward_backward(env: dict[str, Any], record: bool) -> torch.Tensor:
        records = []
        for described, stage in zip(pipeline.stages, stages):
            inputs = []
            for value in pipeline.taken(described):
                tensor = env[value.name].detach()
                grad = value.requires_grad and tensor.is_floating_point()
                inputs.append(tensor.requires_grad_(grad))
            outputs = stage(*inputs)
            env.update(zip(described.outputs, outputs))
            records.append((described, inputs, outputs))
        if record:  # what each stage hands to the next, as measured
            for (described, _, outputs), (after, _, _) in zip(records, records[1:]):
                for name, tensor in zip(described.outputs, outputs):
                    if name in after.inputs:
                        boundaries.append(_measured_value(described.index, name, tensor))
        loss = env[loss_name]
        grads: dict[str, torch.Tensor] = {loss_name: torch.ones_like(loss)}
        for described, inputs, outputs in reversed(records):
            pairs = [
                (o, grads[n])
                for n, o in zip(described.outputs, outputs)
                if n in grads and o.requires_grad
            ]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            grads = {n: i.grad for n, i in zip(described.inputs, inputs) if i.grad is not None}
        return loss

    def step(index: int) -> float:
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        losses = []
        for m, (args, kwargs) in enumerate(microbatches_of(spec.batches(index), count)):
            env = dict(zip(pipeline.signature, (t.to(device) for t in args)))
            env.update({k: v.to(device) for k, v in kwargs.items()})
            losses.append(forward_backward(env, record=index == 0 and m == 0).detach())
        for stage in stages:  # the mean's gradient, scaled once as train.py does
            for p in stage.parameters():
                if p.grad is not None:
                    p.grad.mul_(1.0 / count)
        for copies in ties:  # tied copies train on the sum of their gradients
            present = [p.grad for p in copies if p.grad is not None]
            if present:
                total = torch.stack(present).sum(0)
                for p in copies:
                    p.grad = total.clone()
        for optimizer in optimizers:
            optimizer.step()
        return torch.stack(losses).float().mean().item()

    result = timed_steps(step, config, device)
    result["boundaries"] = boundaries
    return result


def _measured_value(stage: int, name: str, tensor: torch.Tensor) -> dict[str, Any]:
    return {
        "from_stage": stage,
        "name": name,
        "shape": list(tensor.shape),
        "dtype": str(tensor.dtype).replace("torch.", ""),
        "bytes": tensor.numel() * tensor.element_size(),
        "storage_bytes": tensor.untyped_storage().nbytes(),
        "contiguous": tensor.is_contiguous(),
        "requires_grad": tensor.requires_grad,
    }


def wrapped_train(package: str, profile_step: int, out: str, argv: list[str]) -> int:
    """train.py of ``package`` with ``argv`` (under torchrun) as it is, but for a clock: each
    rank writes its steps' CPU seconds into ``out/rankR.cpu.json``, and profiles its step
    ``profile_step`` (-1: none) into ``out/rankR.json``."""
    train = load_file("_parity_train", Path(package) / "train.py")
    pipeline = train.load_pipeline_package()
    driver = importlib.import_module("autopipe_pipeline.runtime.driver")
    original = driver.TrainingRun.step
    rank = os.environ.get("RANK", "0")
    cpu: list[float] = []
    faults: list[int] = []

    def step(self: Any, index: int) -> None:
        if index == profile_step:
            summary = profiled(lambda i: original(self, i), index, self.device)
            (Path(out) / f"rank{rank}.json").write_text(json.dumps(summary))
            return
        began, began_faults = time.process_time(), minor_faults()
        original(self, index)
        cpu.append(time.process_time() - began)
        faults.append(minor_faults() - began_faults)
        clocks = {"cpu": cpu, "faults": faults}
        (Path(out) / f"rank{rank}.cpu.json").write_text(json.dumps(clocks))

    driver.TrainingRun.step = step
    return int(driver.main(pipeline, argv) or 0)


def worker_main(kind: str, config_path: str) -> int:
    config = json.loads(Path(config_path).read_text())
    result = {"original": original_worker, "stages": stages_worker}[kind](config)
    Path(config["out"]).write_text(json.dumps(result))
    return 0


# -- the ladder ---------------------------------------------------------------------------------
@dataclass
class Row:
    """One line of the table: a rung of one model, its throughput against the baseline."""

    model: str
    rung: str
    what: str
    tokens_per_s: float | None = None
    ratio: float | None = None  # tokens/s over the baseline's
    #: tokens per CPU second (over every rank's process): insensitive to the machine's load
    cpu_tokens_per_s: float | None = None
    cpu_ratio: float | None = None
    target: str = ""
    step_s: float | None = None
    first_loss: float | None = None
    peak: int | None = None
    load: float | None = None  # the 1-minute load average at the end of the measurement
    error: str | None = None
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class Ladder:
    args: argparse.Namespace
    work: Path
    device_spec: str
    facts: dict[str, Any]
    rows: list[Row] = field(default_factory=list)
    diffs: list[str] = field(default_factory=list)
    boundaries: dict[str, Any] = field(default_factory=dict)
    budget: Budget = Budget()  # --budget

    def timeout(self, least: float = 20.0) -> float:
        """Seconds a measurement may take: ``--timeout``, cut to what ``--budget`` has left."""
        return self.budget.timeout(self.args.timeout, least)

    @property
    def tokens_per_step(self) -> int:
        return self.args.microbatches * self.args.seq

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        if row.error:
            said = row.error if row.error.startswith("skipped") else f"failed: {row.error}"
            print(f"  {row.model:<6} {row.rung:<9} {said.splitlines()[0][:108]}")
        else:
            print(
                f"  {row.model:<6} {row.rung:<9} {row.tokens_per_s:>10,.0f} tokens/s"
                f"  step {row.step_s:.3f} s  first loss {row.first_loss:.6f}"
                f"  load {row.load:.2f}",
                flush=True,
            )
        self.write()
        return row

    def write(self) -> None:
        if not self.args.json:
            return
        results = {
            "facts": self.facts,
            "rows": [r.__dict__ for r in self.rows],
            "boundaries": self.boundaries,
            "diffs": self.diffs,
        }
        Path(self.args.json).write_text(json.dumps(results, indent=1, default=str))


def spec_file(ladder: Ladder, model: str) -> Path:
    """A model spec for ``model`` at this run's shape: ``model()`` and ``batches(step)``."""
    import parity_models

    size = f"{ladder.args.device}{'-quick' if ladder.args.quick else ''}"
    shape = dict(parity_models.SHAPES[model][size], seq=ladder.args.seq, dtype=ladder.args.dtype)
    path = ladder.work / f"spec_{model}.py"
    path.write_text(
        f'"""{parity_models.describe(model, shape)}"""\n'
        "import sys\n"
        f"sys.path.insert(0, {str(HERE)!r})\n"
        "import parity_models\n\n"
        f"SHAPE = {shape!r}\n\n\n"
        "def model():\n"
        f"    return parity_models.build({model!r}, **SHAPE)\n\n\n"
        "def batches(step):\n"
        f"    return parity_models.batches(step, rows={ladder.args.microbatches}, "
        f"seq={ladder.args.seq}, vocab={shape['vocab']})\n"
    )
    return path


def initial_weights(spec: Path) -> Path:
    """The model's initial state_dict, saved once for every rung to start from."""
    init = spec.with_suffix(".init.pt")
    model = load_file(f"_parity_{spec.stem}", spec).model()[0]
    torch.save(model.state_dict(), init)
    parameters = sum(p.numel() for p in model.parameters())
    del model
    print(f"  {parameters / 1e6:.1f} M parameters; initial weights in {init}", flush=True)
    return init


def compiled(ladder: Ladder, spec: Path, name: str, stages: int, devices: int) -> Path:
    """The model compiled into ``stages`` stages on ``devices`` devices (its schedule: 1F1B with
    one stage per device, torch's looped 1F1B otherwise)."""
    from autopipe.compiler import CompileOptions, compile_spec

    out = ladder.work / name
    options = CompileOptions(
        stages=stages,
        devices=devices,
        schedule=SCHEDULE if stages == devices else SCHEDULE_ONE_RANK,
        microbatches=ladder.args.microbatches,
        device_spec=ladder.device_spec,
    )
    began = time.perf_counter()
    compile_spec(f"{spec}:model", out, options, force=True, report=False)
    print(f"  compiled {name} in {time.perf_counter() - began:.0f} s", flush=True)
    return out


def worker(ladder: Ladder, kind: str, name: str, **config: Any) -> dict[str, Any]:
    out = ladder.work / f"{name}.json"
    config_path = ladder.work / f"{name}.config.json"
    args = ladder.args
    config = dict(
        config,
        device=args.device,
        microbatches=args.microbatches,
        steps=args.steps,
        out=str(out),
    )
    config_path.write_text(json.dumps(config))
    run([sys.executable, str(Path(__file__)), "--worker", kind, str(config_path)], ladder.timeout())
    return json.loads(out.read_text())


def torchrun(ranks: int, script: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        *script,
    ]


def train_arguments(ladder: Ladder, spec: Path, init: Path, steps: int, log: Path) -> list[str]:
    options = [
        "--device", ladder.args.device,
        "--steps", str(steps),
        "--microbatches", str(ladder.args.microbatches),
        "--data", f"{spec}:batches",
        "--load", str(init),
        "--log-json", str(log),
    ]  # fmt: skip
    return options


def train_run(
    ladder: Ladder, package: Path, spec: Path, init: Path, ranks: int, name: str, compile_: bool
) -> tuple[list[dict[str, Any]], list[list[float]], list[list[int]], dict[str, Any] | None]:
    """train.py of ``package`` on ``ranks`` ranks, with a user's arguments, through the
    wrapper (:func:`wrapped_train`): ``--steps`` steps timed, then one more profiled. Returns
    the timed steps' records of train.py's own ``--log-json``, each rank's CPU seconds per
    step, and the profile (summed over the ranks; None with --no-profile)."""
    args = ladder.args
    flags = ["--compile"] if compile_ else []
    log = ladder.work / f"{name}.jsonl"
    folder = ladder.work / f"{name}.rank"
    folder.mkdir(exist_ok=True)
    steps = args.steps + (0 if args.no_profile else 1)
    profile_step = -1 if args.no_profile else args.steps
    options = train_arguments(ladder, spec, init, steps, log)
    wrapper = [str(Path(__file__)), "--wrap-train", str(package), str(profile_step), str(folder)]
    run(torchrun(ranks, [*wrapper, *options, *flags]), ladder.timeout())
    records = [json.loads(line) for line in log.read_text().splitlines() if '"loss"' in line]
    clocks = [json.loads(p.read_text()) for p in sorted(folder.glob("rank*.cpu.json"))]
    cpu = [c["cpu"] for c in clocks]
    faults = [c["faults"] for c in clocks]
    if args.no_profile:
        return records[: args.steps], cpu, faults, None
    summaries = [json.loads(p.read_text()) for p in sorted(folder.glob("rank[0-9].json"))]
    summaries += [json.loads(p.read_text()) for p in sorted(folder.glob("rank[0-9][0-9].json"))]
    return records[: args.steps], cpu, faults, merge_summaries(summaries)


def attempt(ladder: Ladder, model: str, rung: str, what: str, measure: Any) -> Row | None:
    """Run one rung; a failure becomes an error row instead of ending the ladder."""
    try:
        return measure()
    except OutOfTime as exc:
        ladder.add(Row(model, rung, what, error=f"skipped: {exc}"))
        return None
    except Exception as exc:  # the ladder reports every failure and goes on
        message = str(exc) if isinstance(exc, Failed) else traceback.format_exc(limit=8)
        ladder.add(Row(model, rung, what, error=message))
        print("    " + "\n    ".join(message.strip().splitlines()[-30:]), flush=True)
        return None


def median_after_warmup(times: list[float], warmup: int) -> float:
    return statistics.median(times[warmup:])


def climb(ladder: Ladder, model: str) -> None:
    """Every rung of the ladder for ``model``, eager, then (--compile) compiled."""
    args = ladder.args
    print(f"\n{model}", flush=True)
    spec = spec_file(ladder, model)
    print(f"  {spec.read_text().splitlines()[0].strip(chr(34))}", flush=True)
    init = initial_weights(spec)
    packages: dict[str, Path] = {}
    missing: dict[str, str] = {}  # a package not compiled: why, as its rungs' rows say it
    layouts = [("1stage", 1, 1), ("2stages_1rank", 2, 1)]
    if args.device == "cpu":
        layouts.append(("2stages_2ranks", 2, 2))
    for name, stages, devices in layouts:
        try:
            ladder.timeout(least=60)  # compiled in this process: started with a minute left
            packages[name] = compiled(ladder, spec, f"{model}_{name}", stages, devices)
        except OutOfTime as exc:
            print(f"  compiling {name} skipped: {exc}", flush=True)
            missing[name] = f"skipped: {exc} to compile {name}"
        except Exception:  # noqa: BLE001 - the rungs that need it say it failed
            missing[name] = f"no package: compiling {name} failed"
            print(f"  compiling {name} failed:\n{traceback.format_exc(limit=8)}", flush=True)
    for name, package in packages.items():
        if name != "1stage":
            ladder.boundaries[f"{model} {name}"] = boundary_values(package)
    modes = [False, True] if args.compile else [False]
    for compile_ in modes:
        if compile_ and args.device == "cpu" and not inductor_works():
            reason = (
                "torch.compile does not work on this CPU (no working C++ compiler for inductor)"
            )
            print(f"  --compile skipped: {reason}", flush=True)
            ladder.add(Row(model, "compiled", "torch.compile ladder", error=f"skipped: {reason}"))
            continue
        one_ladder(ladder, model, spec, init, packages, missing, compile_)


def one_ladder(
    ladder: Ladder,
    model: str,
    spec: Path,
    init: Path,
    packages: dict[str, Path],
    missing: dict[str, str],
    compile_: bool,
) -> None:
    args = ladder.args
    tag = "-c" if compile_ else ""
    mode = "torch.compile" if compile_ else "eager"
    rows: dict[str, Row] = {}
    profiles: dict[str, dict[str, Any]] = {}

    def row_from(
        rung: str, what: str, times: list[float], cpu: list[list[float]], losses: list[float]
    ) -> Row:
        """A measured row: ``times`` the wall seconds of every step, ``cpu`` each process's
        CPU seconds of every step."""
        seconds = median_after_warmup(times, args.warmup)
        cpu_seconds = sum(median_after_warmup(c, args.warmup) for c in cpu) if cpu else None
        if args.device == "cuda":
            cpu_seconds = None  # the host's CPU time says nothing of a GPU's work
        return Row(
            model,
            rung + tag,
            what,
            tokens_per_s=ladder.tokens_per_step / seconds,
            cpu_tokens_per_s=ladder.tokens_per_step / cpu_seconds if cpu_seconds else None,
            step_s=seconds,
            first_loss=losses[0],
            load=os.getloadavg()[0],
            data={"times": times, "cpu_times": cpu, "losses": losses},
        )

    def baseline(which: str) -> Row:
        result = worker(
            ladder,
            "original",
            f"{model}_original{tag}_{which}",
            spec=str(spec),
            init=str(init),
            compile=compile_,
            profile=which == "first" and not args.no_profile,
        )
        what = f"original model, {mode}" + (" (again, after the rungs)" if which == "last" else "")
        row = row_from("base", what, result["times"], [result["cpu"]], result["losses"])
        row.data["faults"] = [result["faults"]]
        row.peak = result.get("peak_memory")
        if "profile" in result:
            profiles["base"] = result["profile"]
        return ladder.add(row)

    def stages_rung(rung: str, package: str, what: str) -> Row:
        result = worker(
            ladder,
            "stages",
            f"{model}_{rung}{tag}",
            spec=str(spec),
            init=str(init),
            package=str(packages[package]),
            compile=compile_,
            profile=not args.no_profile,
        )
        row = row_from(rung, what, result["times"], [result["cpu"]], result["losses"])
        row.data["faults"] = [result["faults"]]
        row.peak = result.get("peak_memory")
        if result.get("boundaries"):
            row.data["measured_boundaries"] = result["boundaries"]
            ladder.boundaries.setdefault(f"{model} {package} (measured)", result["boundaries"])
        if "profile" in result:
            profiles[rung] = result["profile"]
        return ladder.add(row)

    def train_rung(rung: str, package: str, ranks: int, what: str) -> Row:
        records, cpu, faults, profile = train_run(
            ladder, packages[package], spec, init, ranks, f"{model}_{rung}{tag}", compile_
        )
        if len(records) < args.steps:
            raise Failed(f"train.py logged {len(records)} of {args.steps} steps")
        times = [r["time"] for r in records]
        row = row_from(rung, what, times, cpu, [r["loss"] for r in records])
        row.data["faults"] = faults
        logged = [r["tokens_per_s"] for r in records[args.warmup :] if r.get("tokens_per_s")]
        row.data["train_tokens_per_s_median"] = statistics.median(logged) if logged else None
        peaks = records[-1].get("peak_memory")
        row.peak = max(peaks) if isinstance(peaks, list) else peaks
        row.data["busy"] = busy_fractions(records[args.warmup :])
        if profile is not None:
            profiles[rung] = profile
        return ladder.add(row)

    first = attempt(ladder, model, "base" + tag, f"original, {mode}", lambda: baseline("first"))
    if first is None:
        return
    rungs = [
        ("a1", "1stage", "stages", 1, "generated stages, 1-stage package, no runtime"),
        ("a2", "2stages_1rank", "stages", 1, "generated stages, 2 stages chained, no runtime"),
        ("b", "1stage", "train", 1, "train.py, 1 rank, 1 stage (1f1b)"),
        ("c", "2stages_1rank", "train", 1, "train.py, 1 rank, 2 stages (interleaved-1f1b)"),
        ("d", "2stages_2ranks", "train", 2, "train.py, 2 ranks over gloo, 1 stage each (1f1b)"),
    ]
    for rung, package, kind, ranks, what in rungs:
        if package not in packages:
            if package == "2stages_2ranks" and args.device != "cpu":
                continue  # CPU only
            ladder.add(Row(model, rung + tag, what, error=missing[package]))
            continue
        if kind == "stages":
            measured = attempt(
                ladder, model, rung + tag, what, lambda: stages_rung(rung, package, what)
            )
        else:
            measured = attempt(
                ladder, model, rung + tag, what, lambda: train_rung(rung, package, ranks, what)
            )
        if measured is not None:
            rows[rung] = measured
    last = attempt(ladder, model, "base" + tag, f"original, {mode}", lambda: baseline("last"))
    runs = [r for r in (first, last) if r is not None and r.tokens_per_s]
    reference = statistics.mean(r.tokens_per_s for r in runs)
    cpu_runs = [r.cpu_tokens_per_s for r in runs if r.cpu_tokens_per_s]
    cpu_reference = statistics.mean(cpu_runs) if cpu_runs else None
    for row in runs + list(rows.values()):
        row.ratio = row.tokens_per_s / reference
        if cpu_reference and row.cpu_tokens_per_s:
            row.cpu_ratio = row.cpu_tokens_per_s / cpu_reference
    for row in runs:
        row.target = "reference: mean of both" if len(runs) > 1 else "reference"
    for rung, row in rows.items():
        letter = rung[0]
        if rung == "d":
            ranks, m = 2, args.microbatches
            ideal = reference * ranks * m / (m + ranks - 1)
            row.data["ideal_tokens_per_s"] = ideal
            row.target = (
                f"{row.tokens_per_s / ideal:.2f} of ideal {ideal:,.0f} "
                f"(= base x {ranks} x {m}/{m + ranks - 1})"
            )
        elif letter in TARGETS[args.device, compile_]:
            goal = TARGETS[args.device, compile_][letter]
            verdict = "ok" if row.ratio >= goal else "MISSED"
            if row.cpu_ratio is not None:
                verdict += f", CPU {'ok' if row.cpu_ratio >= goal else 'MISSED'}"
            row.target = f">= {goal:.2f}x: {verdict}"
        if first.first_loss is not None and row.first_loss is not None:
            row.data["first_loss_error"] = abs(row.first_loss - first.first_loss) / abs(
                first.first_loss
            )
    ladder.write()
    base_profile = profiles.get("base")
    if base_profile is None:
        return
    ladder.diffs.append(profile_alone(f"{model} original, {mode}", base_profile))
    for rung, row in rows.items():
        if rung in profiles:
            ladder.diffs.append(
                profile_diff(
                    f"{model} ({rung}{tag}) {row.what}", base_profile, profiles[rung], mode
                )
            )
    ladder.write()


def busy_fractions(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per rank, over the timed steps: its step time, its stages' compute and their ratio."""
    per_rank: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for record in records:
        for entry in record.get("rank_times") or []:
            per_rank[entry["rank"]].append((entry["step"], entry["busy"]))
    return [
        {
            "rank": rank,
            "step": statistics.mean(s for s, _ in pairs),
            "busy": statistics.mean(b for _, b in pairs),
        }
        for rank, pairs in sorted(per_rank.items())
    ]


def boundary_values(package: Path) -> list[dict[str, Any]]:
    """The values each stage of ``package`` receives from the stage before, per microbatch,
    from its pipeline.json: shape, dtype, bytes forward, gradient bytes back."""
    description = json.loads((package / "pipeline.json").read_text())
    values, stages = description["values"], description["stages"]
    found = []
    for index, stage in enumerate(stages[1:], start=1):
        for name in stage["inputs"]:
            value = values[name]
            size = torch.empty((), dtype=getattr(torch, value["dtype"])).element_size()
            forward = math.prod(value["shape"]) * size
            backward = forward if value["requires_grad"] else 0
            found.append(
                {
                    "to_stage": index,
                    "name": name,
                    "shape": value["shape"],
                    "dtype": value["dtype"],
                    "bytes": forward,
                    "grad_bytes": backward,
                }
            )
    return found


_INDUCTOR: bool | None = None


def inductor_works() -> bool:
    """Whether torch.compile (inductor) compiles a tiny function on this CPU."""
    global _INDUCTOR
    if _INDUCTOR is None:
        probe = (
            "import torch\n"
            "f = torch.compile(lambda x: torch.nn.functional.gelu(x) * 2)\n"
            "f(torch.randn(8, 8))\n"
        )
        try:
            run([sys.executable, "-c", probe], 600)
            _INDUCTOR = True
        except Failed:
            _INDUCTOR = False
    return _INDUCTOR


# -- printing ---------------------------------------------------------------------------------
def table(rows: list[Row]) -> str:
    headers = ("model", "rung", "what", "tokens/s", "vs baseline", "target")
    headers += ("CPU tokens/s", "vs baseline (CPU)", "step s", "first loss", "peak MiB", "load")
    cells = []
    for r in rows:
        if r.error:
            cells.append((r.model, r.rung, r.what, "-", "-", r.error.splitlines()[0][:60]))
            cells[-1] += ("-",) * (len(headers) - len(cells[-1]))
            continue
        cells.append(
            (
                r.model,
                r.rung,
                r.what,
                f"{r.tokens_per_s:,.0f}",
                f"{r.ratio:.3f}x" if r.ratio is not None else "-",
                r.target,
                f"{r.cpu_tokens_per_s:,.0f}" if r.cpu_tokens_per_s else "-",
                f"{r.cpu_ratio:.3f}x" if r.cpu_ratio is not None else "-",
                f"{r.step_s:.3f}",
                f"{r.first_loss:.6f}",
                f"{r.peak / 2**20:,.0f}" if r.peak else "-",
                f"{r.load:.2f}",
            )
        )
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |"
    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in cells]
    return "\n".join([line, rule, *body])


def notes(rows: list[Row], warmup: int) -> str:
    """Per measured rung: train.py's own tokens/s, each rank's busy fraction, the first loss."""
    lines = []

    def ladder_of(row: Row) -> tuple[str, bool]:  # the model, and compiled or not
        return row.model, row.rung.endswith("-c")

    reference: dict[tuple[str, bool], float | None] = {}
    for r in rows:
        if r.rung.startswith("base") and not r.error:
            reference.setdefault(ladder_of(r), r.first_loss)
    for r in rows:
        if r.error:
            continue
        parts = []
        faults = r.data.get("faults")
        if faults and all(len(f) > warmup for f in faults):
            per_step = sum(statistics.median(f[warmup:]) for f in faults)
            parts.append(f"{per_step:,.0f} minor page faults per step")
        logged = r.data.get("train_tokens_per_s_median")
        if logged:
            parts.append(f"train.py logged {logged:,.0f} tokens/s (median)")
        busy = r.data.get("busy")
        if busy:
            parts.append(
                "stage compute / step: "
                + ", ".join(f"rank {b['rank']} {b['busy'] / b['step']:.0%}" for b in busy)
            )
        first = reference.get(ladder_of(r))
        if first is not None and r.first_loss is not None and not r.rung.startswith("base"):
            parts.append(f"first loss vs baseline {abs(r.first_loss - first) / abs(first):.1e} rel")
        lines.append(f"  {r.model} ({r.rung}): " + "; ".join(parts))
    return "\n".join(lines)


def boundary_text(boundaries: dict[str, Any]) -> str:
    lines = []
    for name, values in boundaries.items():
        measured = "measured" in name
        total = sum(v["bytes"] for v in values)
        back = sum(v.get("grad_bytes", v["bytes"] if v.get("requires_grad") else 0) for v in values)
        lines.append(
            f"{name}: {total / 2**20:.2f} MiB forward, {back / 2**20:.2f} MiB of gradients back, "
            "per microbatch"
        )
        for v in values:
            extra = ""
            if measured:
                flags = [] if v["contiguous"] else ["not contiguous"]
                if v["storage_bytes"] != v["bytes"]:
                    flags.append(f"storage {v['storage_bytes']:,} bytes")
                if v["requires_grad"]:
                    flags.append("requires grad")
                extra = f" ({', '.join(flags)})" if flags else ""
            else:
                extra = " (gradient back)" if v["grad_bytes"] else ""
            stage = v.get("to_stage", v.get("from_stage", 0) + 1)
            lines.append(
                f"    -> stage {stage}: {v['name']:<28} {_shape(v['shape']):<22} "
                f"{v['dtype']:<9} {v['bytes']:>12,} bytes{extra}"
            )
    return "\n".join(lines)


def profile_alone(title: str, summary: dict[str, Any]) -> str:
    """The original's own profiled step: its attention calls, copies and heaviest operators."""
    lines = [f"== {title}: its profiled step (the reference of the diffs)"]
    lines += _attention_lines("", summary)
    lines += _copy_lines("", summary)
    heaviest = sorted(summary["ops"].items(), key=lambda kv: -kv[1][1])[:8]
    lines.append("  heaviest operators (self CPU ms): " + ", ".join(
        f"{n} {v[1] / 1e3:.1f}" for n, v in heaviest
    ))  # fmt: skip
    return "\n".join(lines)


def _attention_lines(label: str, summary: dict[str, Any]) -> list[str]:
    if not summary["sdpa"]:
        return [f"  attention{label}: no scaled_dot_product_attention call"]
    return [
        f"  attention{label}: {count} x {signature}"
        for signature, count in sorted(summary["sdpa"].items())
    ]


def _copy_lines(label: str, summary: dict[str, Any]) -> list[str]:
    copies = summary["copies"]
    count = sum(v[0] for v in copies.values())
    elements = sum(v[1] for v in copies.values())
    by = sorted(copies.items(), key=lambda kv: -kv[1][1])
    parts = ", ".join(f"{name} {int(c)} ({e / 1e6:.2f} M)" for name, (c, e) in by[:8])
    return [
        f"  copies{label}: {int(count)} aten::copy_, {elements / 1e6:.2f} M elements; by cause: {parts}"
    ]


def profile_diff(title: str, base: dict[str, Any], rung: dict[str, Any], mode: str) -> str:
    """The rung's profiled step against the original's: attention, copies, operators."""
    lines = [f"== {title}: profile vs original ({mode}), one step each, same tokens"]
    walls = rung.get("wall")
    wall = sum(walls) if isinstance(walls, list) else walls
    base_self = sum(v[1] for v in base["ops"].values())
    rung_self = sum(v[1] for v in rung["ops"].values())
    ranks = f" over {len(walls)} ranks" if isinstance(walls, list) and len(walls) > 1 else ""
    lines.append(
        f"  profiled step: original {base['wall'] * 1e3:.0f} ms wall, {base_self / 1e3:.0f} ms "
        f"self CPU in operators; this {wall * 1e3:.0f} ms wall{ranks}, "
        f"{rung_self / 1e3:.0f} ms self CPU"
    )
    if base["sdpa"] == rung["sdpa"]:
        lines += _attention_lines(" (same as the original)", rung)
    else:
        lines += _attention_lines(" original", base)
        lines += _attention_lines(" this    ", rung)
    lines += _copy_lines(" original", base)
    lines += _copy_lines(" this    ", rung)
    for table_name, column, unit in (("ops", 1, "self CPU"), ("kernels", 1, "device")):
        a, b = base[table_name], rung[table_name]
        if not a and not b:
            continue
        names = set(a) | set(b)
        zero = [0, 0.0, 0.0]

        def delta(name: str) -> float:
            return b.get(name, zero)[column] - a.get(name, zero)[column]

        by_time = sorted(names, key=lambda n: -abs(delta(n)))[:12]
        what = "operators" if table_name == "ops" else "kernels"
        lines.append(f"  {what} by {unit} time difference (ms), top {len(by_time)}:")
        lines.append(
            f"    {'name':<58} {'calls':>15} {'ms original':>12} {'ms this':>10} {'diff':>9}"
        )
        for name in by_time:
            x, y = a.get(name, zero), b.get(name, zero)
            lines.append(
                f"    {name[:58]:<58} {int(x[0]):>6} -> {int(y[0]):<6} {x[column] / 1e3:>12.1f} "
                f"{y[column] / 1e3:>10.1f} {(y[column] - x[column]) / 1e3:>+9.1f}"
            )
        by_count = [
            n
            for n in sorted(names, key=lambda n: -abs(b.get(n, zero)[0] - a.get(n, zero)[0]))
            if n not in by_time and b.get(n, zero)[0] != a.get(n, zero)[0]
        ][:10]
        if by_count:
            lines.append(
                f"  {what} by call-count difference: "
                + ", ".join(
                    f"{n} {int(a.get(n, zero)[0])}->{int(b.get(n, zero)[0])}" for n in by_count
                )
            )
    return "\n".join(lines)


# -- main -------------------------------------------------------------------------------------
def describe(args: argparse.Namespace, device_spec: str) -> dict[str, Any]:
    facts: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": args.device,
        "cpus": os.cpu_count(),
        "load_at_start": os.getloadavg()[0],
        "seq": args.seq,
        "microbatches": args.microbatches,
        "steps": args.steps,
        "warmup": args.warmup,
        "dtype": args.dtype,
        "device_spec": device_spec,
    }
    try:
        import transformers

        facts["transformers"] = transformers.__version__
    except ImportError:
        pass
    if args.device == "cuda":
        facts["gpu"] = torch.cuda.get_device_name(0)
        facts["cuda"] = torch.version.cuda
    return facts


def matching_spec(device: str) -> str:
    """The device spec to plan for: this machine's CPU (calibrated on first use, then cached),
    or the known spec of this GPU, as benchmarks/gpu.py picks it (else it is calibrated)."""
    if device == "cuda":
        known = known_gpu(torch.cuda.get_device_name(0))
        return "cuda" if known is None else known.name.lower()
    return "cpu"


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="autopipe's parity ladder: the generated pipeline's training speed against "
        "the original model's, rung by rung, with profiler diffs (see the module text)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="where to train (default cpu)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smaller models, shorter sequences, fewer steps: checks the ladder itself",
    )
    parser.add_argument(
        "--model", choices=["gpt2", "llama", "all"], default="all", help="which model (default all)"
    )
    parser.add_argument(
        "--seq", type=int, help="tokens per sequence (default 1024 on cpu, 2048 on cuda; "
        "--quick: 512, 1024)"
    )  # fmt: skip
    parser.add_argument(
        "--microbatches",
        type=int,
        help="microbatches of 1 sequence per step (default 4 on cpu, 8 on cuda; --quick 2, 8)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        help="steps per measurement, warm-up included (default 4 on cpu, 13 on cuda; --quick "
        "3, 8)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        help="warm-up steps left out of the timing (default 1 on cpu, 3 on cuda)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="also climb the ladder compiled: torch.compile of the original against the stages "
        "compiled as train.py --compile does",
    )
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        help="the models' weights (default float32 on cpu, bfloat16 on cuda)",
    )
    parser.add_argument("--json", help="write every figure and profile summary to this file")
    parser.add_argument(
        "--work", help="directory for specs, packages and logs (default: temporary)"
    )
    parser.add_argument(
        "--no-profile", action="store_true", help="time only: no profiled step, no diffs"
    )
    parser.add_argument(
        "--timeout", type=float, default=1800, help="seconds one measurement may take (1800)"
    )
    parser.add_argument(
        "--budget",
        type=float,
        help="seconds the whole ladder may take: a measurement that would start with too "
        "little left is skipped (its row says so) and the ratios are taken against the "
        "baselines measured (default: none)",
    )
    args = parser.parse_args(argv)
    cuda, quick = args.device == "cuda", args.quick
    defaults = {
        "seq": (2048 if cuda else 1024) // (2 if quick else 1),
        "microbatches": 8 if cuda else (2 if quick else 4),
        "steps": (8 if quick else 13) if cuda else (3 if quick else 4),
        "warmup": 3 if cuda else 1,
        "dtype": "bfloat16" if cuda else "float32",
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.steps <= args.warmup:
        parser.error(f"--steps must be more than the {args.warmup} warm-up steps")
    if args.microbatches < 2:
        parser.error("--microbatches must be at least 2 (1F1B on 2 ranks needs 2)")
    if cuda and not torch.cuda.is_available():
        built = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA (a CPU build)"
        parser.exit(
            2,
            "benchmarks/parity.py --device cuda needs a CUDA GPU, and this machine has none "
            f"that torch can use (torch {torch.__version__}, built with {built}); "
            "--device cpu climbs the ladder on the CPU.\n",
        )
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker_main(argv[1], argv[2])
    if argv[:1] == ["--wrap-train"]:
        return wrapped_train(argv[1], int(argv[2]), argv[3], argv[4:])
    args = parse(argv)
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(HERE))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="autopipe-parity-") as scratch:
        work = Path(args.work) if args.work else Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        device_spec = matching_spec(args.device)
        facts = describe(args, device_spec)
        print(f"autopipe parity ladder: {json.dumps(facts)}", flush=True)
        ladder = Ladder(args, work, device_spec, facts, budget=Budget.of(args.budget))
        models = ["gpt2", "llama"] if args.model == "all" else [args.model]
        for model in models:
            try:
                climb(ladder, model)
            except Exception:  # noqa: BLE001 - the next model still runs, this one has a row
                message = traceback.format_exc(limit=8)
                print(f"  {model} failed:\n{message}", flush=True)
                ladder.add(Row(model, "setup", "the model's spec, weights or packages",
                               error=message.strip().splitlines()[-1] + "\n" + message))  # fmt: skip
        facts["seconds"] = round(time.perf_counter() - started, 1)
        facts["load_at_end"] = os.getloadavg()[0]
        ladder.write()
    print()
    print(
        f"tokens/s: {args.microbatches} x 1 x {args.seq} tokens per step over the median step "
        f"of steps {args.warmup + 1}-{args.steps}; vs baseline: over the mean of the original's "
        "two runs (before and after the rungs)"
    )
    print(table(ladder.rows))
    print(notes(ladder.rows, args.warmup))
    if ladder.boundaries:
        print("\nwhat crosses the stage boundary, per microbatch")
        print(boundary_text(ladder.boundaries))
    for diff in ladder.diffs:
        print()
        print(diff)
    print(f"\n{len(ladder.rows)} rows in {facts['seconds']:.0f} s (load {facts['load_at_start']:.2f}"
          f" at start, {facts['load_at_end']:.2f} at end)"
          + (f"; figures in {args.json}" if args.json else ""))  # fmt: skip
    return 1 if any(r.error and not r.error.startswith("skipped") for r in ladder.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
