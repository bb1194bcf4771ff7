"""Training step time of autopipe's generated pipelines, against torch's pipeline() and one process.

    python benchmarks/runtime.py                 # both GPT-2s, 2 and 4 stages, GPipe and 1F1B
    python benchmarks/runtime.py --quick         # 2 stages only, 7 steps a run (3-4 minutes here)
    python benchmarks/runtime.py --device cuda   # the same on GPUs (NCCL, one GPU per rank)
    python benchmarks/runtime.py --stage-code    # generated code: blocks vs inline, eager vs compiled

For each model, stage count and schedule, the same global batch (8 microbatches) trains with

- autopipe: ``autopipe compile SPEC --stages K --method dp --schedule S --microbatches 8`` (analytic
  H100 profile), then ``torchrun --standalone --nproc-per-node=K DIR/train.py --device cpu --steps N
  --microbatches 8 --schedule S --log-json FILE``; the step time is train.py's own (zero_grad,
  ``schedule.step``, tied-gradient all-reduce, AdamW step, loss read back on the last rank),
- pipeline(): ``torch.distributed.pipelining.pipeline()`` (PiPPy's tracer frontend) splitting the
  same model at the same points (``SplitPoint.BEGINNING`` at the module call each generated stage
  starts with, from DIR/artifacts; where autopipe cuts inside a module's own code, the nearest
  module start), ``pipe.build_stage(rank, device)``, the same torch schedule class (ScheduleGPipe /
  Schedule1F1B) and microbatch count, timed the same way on the last rank (zero_grad,
  ``schedule.step``, the same tied-gradient all-reduce, AdamW step, loss read back). The loss is the
  model's own output (labels given, Hugging Face style), which the loss_fn picks as autopipe's
  driver does. pipeline() cannot feed a model input to a later stage directly
  (``_retrieve_recv_activations`` rejects root args there), so the model is wrapped to take labels
  positionally and clone them in the first stage, from where they travel down the pipeline as in
  autopipe's stages. pipeline()'s stages run their submodules through ``torch.fx.Interpreter``, node
  by node (torch.export.unflatten's default); ``--pipeline-codegen`` turns that off,
- unpartitioned: the original model in one process, the batch as 8 microbatches with gradient
  accumulation, AdamW step; ``torch.set_num_threads`` to the pipeline's total thread count (one per
  rank: every torchrun worker runs with OMP_NUM_THREADS=1), at most the CPU count, with
  OMP_WAIT_POLICY=PASSIVE (``--omp-wait-policy``: spinning threads lose several times over on a
  busy CPU). On CUDA: one GPU.

Every run is a fresh torchrun (or Python) process; the step time is the median over the steps after
the warm-up ones (``--rounds R`` runs the three R times in turn and pools their steps). Models: the
GPT-2 of examples/gpt2.py (4 layers, n_embd 128, microbatch 2 x 64) and an 8-layer GPT-2 (n_embd
256, vocab 2048, microbatch 1 x 128), where compute outweighs the stage-to-stage transfers more.
Timings on a shared CPU are noisy (the load average is printed): compare rows of one run.

``--stage-code`` measures the generated code itself instead: each model compiled into 2 stages with
block submodules (the default) and with ``--inline-blocks`` (every operator in the stage's forward,
the first versions' code) as the baseline; every stage's forward + backward (of the sum of squares
of its outputs) timed alone, in a fresh process with one thread, eager and with train.py's
``--compile`` (``torch.compile`` of the stage, one compilation per block class, inductor); then train.py's step time without and
with ``--compile``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

MODELS = '''
import importlib.util
import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging
logging.set_verbosity_error()

def gpt2_4l():
    """examples/gpt2.py:build, unchanged."""
    spec = importlib.util.spec_from_file_location("_gpt2_example", {example!r})
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build()

def gpt2_8l():
    torch.manual_seed(0)
    config = GPT2Config(n_layer=8, n_embd=256, n_head=4, vocab_size=2048, n_positions=128,
                        use_cache=False, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    input_ids = torch.randint(0, config.vocab_size, (1, 128))
    return model, (input_ids,), {{"labels": input_ids.clone()}}
'''

#: benchmark name -> (function in MODELS, description)
CASES = {
    "GPT-2 4L": ("gpt2_4l", "examples/gpt2.py: 4 layers, n_embd 128, vocab 1024, microbatch 2x64"),
    "GPT-2 8L": ("gpt2_8l", "8 layers, n_embd 256, vocab 2048, microbatch 1x128"),
}

COMMON = '''
import argparse, json, os, sys, time
import torch
import torch.distributed as dist

def arguments():
    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--microbatches", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--log-json", required=True)
    parser.add_argument("--splits", default="")
    parser.add_argument("--pipeline-json", default="")
    parser.add_argument("--schedule", default="gpipe")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--codegen", action="store_true")
    args = parser.parse_args()
    sys.path.insert(0, args.folder)
    import models
    return args, getattr(models, args.model)

def batch(example, microbatches, step, device):
    """A fresh random batch of `microbatches` example microbatches: (input_ids, labels)."""
    shape = example[1][0].shape
    generator = torch.Generator().manual_seed(step)
    high = example[0].config.vocab_size
    ids = torch.randint(0, high, (shape[0] * microbatches, *shape[1:]), generator=generator)
    return ids.to(device), ids.clone().to(device)
'''

PIPELINE_WORKER = COMMON + '''
import contextlib
import importlib
from torch import nn
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, SplitPoint, pipeline


class WithLabels(nn.Module):
    """The model taking labels positionally; the clone keeps them in the first stage."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        return self.model(input_ids, labels=labels.clone())


def main():
    args, build = arguments()
    if args.device == "cuda":
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    example = build()
    model = WithLabels(example[0]).train()
    splits = [name for name in args.splits.split(",") if name]
    for name in splits:
        model.model.get_submodule(name)  # a clear error for a split point that is no module
    # --codegen: the split submodules run their generated forward rather than torch.fx.Interpreter
    # node by node (torch.export.unflatten's default, which pipeline() inherits)
    unflatten = importlib.import_module("torch.export.unflatten")
    with unflatten._disable_interpreter() if args.codegen else contextlib.nullcontext():
        pipe = pipeline(
            model,
            mb_args=(example[1][0], example[2]["labels"]),
            split_spec={f"model.{name}": SplitPoint.BEGINNING for name in splits},
        )
    if pipe.num_stages != world:
        raise SystemExit(f"pipeline() made {pipe.num_stages} stages for {world} ranks")
    stage = pipe.build_stage(rank, device)
    module = stage.submod
    del pipe, model
    is_first, is_last = rank == 0, rank == world - 1

    # tied parameters (GPT-2's wte / lm_head): pipeline() copies them into every stage that reads
    # them and never syncs them; all-reduce their gradients like autopipe's driver, for equal work
    tied = json.loads(open(args.pipeline_json).read())["tied"]
    ties = []
    for tie in tied:
        names = {f"model.{n}" for n in tie["names"]}
        local = [p for n, p in module.named_parameters(remove_duplicate=False) if n in names]
        held = [None] * world
        dist.all_gather_object(held, bool(local))
        ranks = [r for r, h in enumerate(held) if h]
        group = dist.new_group(ranks) if len(ranks) > 1 else None  # every rank calls new_group
        if local:
            ties.append((group, local))

    def sync_tied_grads():
        for group, params in ties:
            grads = [p.grad for p in params if p.grad is not None]
            if len(grads) == 1:
                total = grads[0]  # a rank's one copy, summed where it lies
            else:
                total = torch.stack(grads).sum(0) if grads else torch.zeros_like(params[0])
            if group is not None:
                dist.all_reduce(total, group=group)
            for p in params:
                if p.grad is not None and p.grad is not total:
                    p.grad = total.clone()

    def loss_fn(output, _target):
        return output[0]  # the model's own loss (Hugging Face models return it first)

    schedules = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
    schedule = schedules[args.schedule](
        stage, n_microbatches=args.microbatches, loss_fn=loss_fn, scale_grads=True
    )
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-3)
    log = open(args.log_json, "w") if is_last else None
    for step in range(args.steps):
        ids, labels = batch(example, args.microbatches, step, device)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        losses = []
        if is_first:
            schedule.step(input_ids=ids, labels=labels)
        elif is_last:
            target = torch.zeros(args.microbatches, device=device)  # the loss is a model output
            schedule.step(target=target, losses=losses, return_outputs=False)
        else:
            schedule.step()
        sync_tied_grads()
        optimizer.step()
        if is_last:
            loss = torch.stack([l.detach().float() for l in losses]).mean().item()
            elapsed = time.perf_counter() - start
            log.write(json.dumps({"step": step, "loss": loss, "time": elapsed}) + "\\n")
            log.flush()
    dist.destroy_process_group()


main()
'''

SINGLE_WORKER = COMMON + """
def main():
    args, build = arguments()
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    torch.manual_seed(0)
    example = build()
    model = example[0].to(device).train()
    size = example[1][0].shape[0]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    with open(args.log_json, "w") as log:
        for step in range(args.steps):
            ids, labels = batch(example, args.microbatches, step, device)
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            losses = []
            for m in range(args.microbatches):
                part = slice(m * size, (m + 1) * size)
                loss = model(ids[part], labels=labels[part]).loss
                (loss / args.microbatches).backward()
                losses.append(loss.detach())
            optimizer.step()
            loss = torch.stack(losses).mean().item()
            elapsed = time.perf_counter() - start
            log.write(json.dumps({"step": step, "loss": loss, "time": elapsed}) + "\\n")


main()
"""


def split_points(out: Path) -> tuple[list[str], list[float]]:
    """Where pipeline() should split to match the generated pipeline in ``out``: for each stage
    after the first, the module path to split before, and the fraction of the model's (profiled)
    time that this moves across the stage boundary (0 when the stage starts at a module call).

    Units (artifacts/graph.json) are runs of operators of one module call, in program order. A
    module call starts at a unit whose module, and every module inside it, has not run before.
    autopipe may cut inside a module's own code (GPT2Attention's attention core, between its c_attn
    and c_proj), where SplitPoint cannot: then the nearest module start by profiled time is taken.
    """
    artifacts = out / "artifacts"
    units = [u["label"] for u in json.loads((artifacts / "graph.json").read_text())["units"]]
    costs = [
        u["forward"] + u["backward"]
        for u in json.loads((artifacts / "profile.json").read_text())["units"]
    ]
    stage_of_unit = json.loads((artifacts / "partition.json").read_text())["stage_of_unit"]
    if sorted(stage_of_unit) != stage_of_unit:
        raise RuntimeError(f"{out}: stages are not contiguous in program order")
    # module of each unit: "transformer.h.2.attn (GPT2Attention)" -> "transformer.h.2.attn";
    # root-level units ("<to>", "GPT2LMHeadModel (model)") name no submodule
    modules = [
        label.rsplit(" (", 1)[0] if " (" in label and not label.endswith("(model)") else None
        for label in units
    ]
    starts, ran = [], set()
    for index, module in enumerate(modules):
        if module and module not in ran and not any(r.startswith(module + ".") for r in ran):
            starts.append(index)
        if module:
            ran.add(module)
    total = sum(costs)
    points, moved, previous = [], [], 0
    for stage in range(1, max(stage_of_unit) + 1):
        boundary = stage_of_unit.index(stage)
        candidates = [p for p in starts if p > previous]
        best = min(candidates, key=lambda p: sum(costs[min(p, boundary) : max(p, boundary)]))
        points.append(modules[best])
        moved.append(sum(costs[min(best, boundary) : max(best, boundary)]) / total)
        previous = best
    return points, moved


STAGE_WORKER = """
import importlib.util, json, statistics, sys, time
import torch
spec = importlib.util.spec_from_file_location("pkg", sys.argv[1] + "/__init__.py",
                                              submodule_search_locations=[sys.argv[1]])
package = importlib.util.module_from_spec(spec); sys.modules["pkg"] = package
spec.loader.exec_module(package)
from pkg.runtime.driver import compile_stage
from pkg.runtime.core.pipeline import Pipeline
torch.manual_seed(0)
pipeline = Pipeline.from_json(package.PIPELINE)
index, reps, compiled = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "compiled"
stage = package.build_stage(index)
if compiled:
    compile_stage(stage, pipeline.stages[index].blocks, frozenset())
inputs = []
for value in pipeline.taken(pipeline.stages[index]):
    tensor = value.meta_tensor()
    if tensor.dtype.is_floating_point:
        inputs.append(torch.randn(tensor.shape, dtype=tensor.dtype, requires_grad=True))
    else:
        high = pipeline.input_ranges.get(value.name, 2)
        inputs.append(torch.randint(0, high, tuple(tensor.shape), dtype=tensor.dtype))
def step():
    outputs = stage(*inputs)
    sum(o.float().pow(2).mean() for o in outputs if o.requires_grad).backward()
for _ in range(3):
    step()
times = []
for _ in range(reps):
    begin = time.perf_counter(); step(); times.append(time.perf_counter() - begin)
print(json.dumps({"ms": statistics.median(times) * 1e3}))
"""


def stage_code(args: argparse.Namespace, cases: dict, steps: int, warmup: int) -> None:
    """The generated code's own speed: per-stage forward + backward with blocks and inline,
    eager and compiled, and train.py's step time without and with --compile."""
    import torch

    bindir = Path(sys.executable).parent
    autopipe, torchrun = str(bindir / "autopipe"), str(bindir / "torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    load_before = os.getloadavg()[0]
    stage_rows, step_rows = [], []
    with tempfile.TemporaryDirectory(prefix="autopipe-stage-code-") as tmp:
        folder = Path(tmp)
        (folder / "models.py").write_text(MODELS.format(example=str(REPO / "examples" / "gpt2.py")))
        (folder / "stage_worker.py").write_text(STAGE_WORKER)
        for label, (function, _) in cases.items():
            packages = {}
            for layout, flags in (("inline", ["--inline-blocks"]), ("blocks", [])):
                out = folder / f"{function}_{layout}"
                run(
                    [autopipe, "compile", f"models.py:{function}", "--stages", "2", "--method"]
                    + ["dp", "--out", str(out), "--force", "--quiet", *flags],
                    folder,
                )
                packages[layout] = out
            for index in range(2):
                cells = []
                for layout, mode in (
                    ("inline", "eager"),
                    ("blocks", "eager"),
                    ("blocks", "compiled"),
                ):
                    command = [sys.executable, str(folder / "stage_worker.py")]
                    command += [str(packages[layout]), str(index), str(args.reps), mode]
                    cells.append(json.loads(run(command, folder, env).splitlines()[-1])["ms"])
                stage_rows.append((label, str(index), *cells))
                print(f"# {label} stage {index}: {cells}", file=sys.stderr)
            # the two layouts may split at different points: their sums compare whatever the split
            sums = [sum(row[i] for row in stage_rows[-2:]) for i in (2, 3, 4)]
            stage_rows.append((label, "both", *sums))
            times = {}
            for mode, flags in (("eager", []), ("compiled", ["--compile"])):
                log = folder / f"{function}.{mode}.jsonl"
                run(
                    [torchrun, "--standalone", "--nproc-per-node=2"]
                    + [
                        str(packages["blocks"] / "train.py"),
                        "--device",
                        "cpu",
                        "--steps",
                        str(steps),
                    ]
                    + ["--microbatches", str(args.microbatches), "--log-json", str(log), *flags],
                    folder,
                    env,
                )
                times[mode] = statistics.median(step_times(log, steps, warmup)[0])
            step_rows.append((label, times["eager"], times["compiled"]))
    load_after = os.getloadavg()[0]
    print(
        f"CPU, {os.cpu_count()} cores, 1 thread per process, torch {torch.__version__}; "
        f"1-minute load average {load_before:.1f} before, {load_after:.1f} after"
    )
    print(
        f"Per-stage forward + backward, median of {args.reps} (2 stages, method dp; the layouts "
        "may split at different points, so compare the 'both' rows):"
    )
    print(
        "| model | stage | inline ms (baseline) | blocks ms | blocks / inline "
        "| blocks compiled ms | compiled / inline |"
    )
    print("|---|---|---|---|---|---|---|")
    for label, index, inline, blocks, compiled in stage_rows:
        print(
            f"| {label} | {index} | {inline:.2f} | {blocks:.2f} | {blocks / inline:.2f} "
            f"| {compiled:.2f} | {compiled / inline:.2f} |"
        )
    print()
    print(
        f"train.py step time, 2 gloo ranks, {args.microbatches} microbatches, median of "
        f"{steps - warmup} steps after {warmup} (compilation happens in the first steps):"
    )
    print("| model | eager step ms (baseline) | --compile step ms | compiled / eager |")
    print("|---|---|---|---|")
    for label, eager, compiled in step_rows:
        print(f"| {label} | {eager * 1e3:.1f} | {compiled * 1e3:.1f} | {compiled / eager:.2f} |")


def run(command: list[str], cwd: Path, env: dict | None = None, timeout: float = 1800) -> str:
    """Output of a command; raises with its tail when it fails."""
    result = subprocess.run(
        command,
        check=False,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stdout[-4000:]}")
    return result.stdout


def step_times(path: Path, steps: int, warmup: int) -> tuple[list[float], float]:
    """The step seconds after the warm-up steps, and the first step's loss, from a JSON log."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if len(records) != steps:
        raise RuntimeError(f"{path} has {len(records)} steps, expected {steps}")
    return [r["time"] for r in records[warmup:]], records[0]["loss"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="2 stages only, 7 steps per run")
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cpu: gloo, one thread per rank (default); cuda: NCCL, one GPU per rank",
    )
    parser.add_argument(
        "--steps", type=int, help="steps per run (default 7, or 20 without --quick)"
    )
    parser.add_argument(
        "--warmup",
        type=int,
        help="steps dropped before the median (default 2, or 5 without --quick)",
    )
    parser.add_argument("--microbatches", type=int, default=8, help="microbatches per step (8)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the three variants this many times in turn, pooling their steps (default 1)",
    )
    parser.add_argument(
        "--model", choices=[c[0] for c in CASES.values()], action="append", help="only these models"
    )
    parser.add_argument(
        "--stages", type=int, action="append", help="only these stage counts (default 2 and 4)"
    )
    parser.add_argument(
        "--schedule", choices=["gpipe", "1f1b"], action="append", help="only these schedules"
    )
    parser.add_argument(
        "--pipeline-codegen",
        action="store_true",
        help="build pipeline() under torch.export.unflatten._disable_interpreter() (private API), "
        "so its stages run generated code instead of torch.fx.Interpreter (the default)",
    )
    parser.add_argument(
        "--omp-wait-policy",
        choices=["passive", "active", "default"],
        default="passive",
        help="OMP_WAIT_POLICY of the multi-threaded unpartitioned run (default passive: spinning "
        "threads on a shared CPU slow it down several times over)",
    )
    parser.add_argument(
        "--stage-code",
        action="store_true",
        help="time the generated code instead: stages with blocks vs inline, eager vs compiled",
    )
    parser.add_argument(
        "--reps", type=int, default=30, help="--stage-code: timed forward+backward per stage (30)"
    )
    args = parser.parse_args()
    steps = args.steps or (7 if args.quick else 20)
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 5)
    if steps <= warmup or args.rounds < 1:
        parser.error("--steps must exceed --warmup, and --rounds be at least 1")
    stage_counts = args.stages or ([2] if args.quick else [2, 4])
    schedules = args.schedule or ["gpipe", "1f1b"]
    cases = {k: v for k, v in CASES.items() if not args.model or v[0] in args.model}
    microbatches = args.microbatches
    if args.stage_code:
        stage_code(args, cases, steps, warmup)
        return

    import torch  # the version and device only; every measurement runs in its own process

    if args.device == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device here")
        gpus = torch.cuda.device_count()
        device_line = f"{gpus} x {torch.cuda.get_device_name(0)} (NCCL)"
    else:
        gpus = 0
        device_line = f"CPU, {os.cpu_count()} cores (gloo, 1 thread per rank)"

    bindir = Path(sys.executable).parent
    autopipe, torchrun = str(bindir / "autopipe"), str(bindir / "torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    single_env = dict(env)
    if args.device == "cpu" and args.omp_wait_policy != "default":
        single_env["OMP_WAIT_POLICY"] = args.omp_wait_policy.upper()
    load_before = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory(prefix="autopipe-runtime-") as tmp:
        folder = Path(tmp)
        (folder / "models.py").write_text(MODELS.format(example=str(REPO / "examples" / "gpt2.py")))
        (folder / "pipeline_worker.py").write_text(PIPELINE_WORKER)
        (folder / "single_worker.py").write_text(SINGLE_WORKER)
        for label, (function, _) in cases.items():
            for stages in stage_counts:
                if args.device == "cuda" and stages > gpus:
                    print(f"# {label}, {stages} stages: skipped ({gpus} GPUs)", file=sys.stderr)
                    continue
                threads = 1 if args.device == "cuda" else min(stages, os.cpu_count() or 1)
                for schedule in schedules:
                    name = f"{function}_{stages}_{schedule}"
                    out = folder / name
                    begin = time.perf_counter()
                    run(
                        [autopipe, "compile", f"models.py:{function}", "--stages", str(stages)]
                        + ["--method", "dp", "--schedule", schedule]
                        + ["--microbatches", str(microbatches), "--out", str(out), "--force"]
                        + ["--quiet"],
                        folder,
                    )
                    splits, moved = split_points(out)
                    common = ["--steps", str(steps), "--microbatches", str(microbatches)]
                    common += ["--device", args.device]
                    launch = [torchrun, "--standalone", f"--nproc-per-node={stages}"]
                    model = ["--folder", str(folder), "--model", function]
                    commands = {
                        "autopipe": (
                            launch + [str(out / "train.py"), *common, "--schedule", schedule],
                            env,
                        ),
                        "pipeline()": (
                            launch
                            + [str(folder / "pipeline_worker.py"), *common, *model]
                            + ["--schedule", schedule, "--splits", ",".join(splits)]
                            + ["--pipeline-json", str(out / "pipeline.json")]
                            + ["--codegen"] * args.pipeline_codegen,
                            env,
                        ),
                        "unpartitioned": (
                            [sys.executable, str(folder / "single_worker.py"), *common, *model]
                            + ["--threads", str(threads)],
                            single_env,
                        ),
                    }
                    times = {kind: [] for kind in commands}
                    losses = {}
                    for round_ in range(args.rounds):
                        for kind, (command, kind_env) in commands.items():
                            log = folder / f"{name}.{round_}.{kind}.jsonl"
                            run([*command, "--log-json", str(log)], folder, kind_env)
                            seconds, losses[kind] = step_times(log, steps, warmup)
                            times[kind] += seconds
                    ap, pp, one = (statistics.median(times[k]) for k in commands)
                    rows.append((label, stages, schedule, ap, pp, one, threads, splits, moved))
                    print(
                        f"# {label}, {stages} stages, {schedule}: autopipe {ap * 1e3:.1f} ms, "
                        f"pipeline() {pp * 1e3:.1f} ms, unpartitioned {one * 1e3:.1f} ms; "
                        f"first-step losses {' / '.join(f'{v:.3f}' for v in losses.values())}; "
                        f"split before {', '.join(splits)} ({time.perf_counter() - begin:.0f} s)",
                        file=sys.stderr,
                    )
    load_after = os.getloadavg()[0]
    policy = "" if args.device == "cuda" else f", OMP_WAIT_POLICY {args.omp_wait_policy}"
    print(
        f"{device_line}, torch {torch.__version__}; median step time over {args.rounds} x "
        f"{steps - warmup} steps (first {warmup} of each run dropped), AdamW, method dp; "
        f"1-minute load average {load_before:.1f} before, {load_after:.1f} after"
        + ("; pipeline() stages without torch.fx.Interpreter" if args.pipeline_codegen else "")
    )
    print(
        "| model | stages | schedule | microbatches | autopipe step ms | pipeline() step ms "
        "| unpartitioned step ms | autopipe / pipeline() |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for label, stages, schedule, ap, pp, one, threads, _splits, _moved in rows:
        where = "1 GPU" if args.device == "cuda" else f"{threads} thread{'s' * (threads > 1)}"
        print(
            f"| {label} | {stages} | {schedule} | {microbatches} | {ap * 1e3:.1f} | {pp * 1e3:.1f} "
            f"| {one * 1e3:.1f} ({where}{policy if threads > 1 else ''}) | {ap / pp:.2f} |"
        )
    print()
    for label, (_, description) in cases.items():
        print(f"- {label}: {description}")
    seen = set()
    for label, stages, _schedule, *_, splits, moved in rows:
        if (label, stages, tuple(splits)) in seen:
            continue
        seen.add((label, stages, tuple(splits)))
        cells = [
            name
            + (
                f" ({share:.1%} of the profiled time moved to match a module start)"
                if share
                else ""
            )
            for name, share in zip(splits, moved)
        ]
        print(f"- {label}, {stages} stages: pipeline() splits before {', '.join(cells)}")


if __name__ == "__main__":
    main()
