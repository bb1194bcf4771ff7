"""The one-GPU kit: autopipe's CUDA path checked and measured on one GPU, in a few minutes.

    python benchmarks/gpu.py --quick    # one command on a lent GPU: within 7 minutes (--budget)
    python benchmarks/gpu.py            # every case, both ladders: about 20 minutes on an H100
    python benchmarks/gpu.py --parts speed,prediction --json results.json --work DIR

On this project's lent GPU machine (``benchmarks/gpu_device.sh``: the packages it lacks, carried
as wheels, and the command line) the figures land in ``$OUT``. The parts, in the order the kit
runs them, each case in fresh processes (a failure is reported in its row and the kit goes on):

(a) **Exactness on CUDA** (``exactness``). GPT-2 and a Llama (tiny configs, fp32, dropout off)
    compiled into 2 and 4 stages on one device (``--devices 1``: every stage on the one GPU,
    torch's looped interleaved 1F1B) and trained by ``train.py --device cuda`` on one rank,
    against the original model trained on the same GPU from the same weights on the same
    batches (benchmarks/gpu_worker.py reference): fp32 per-step losses and the trained weights
    must agree (losses to 1e-5 relative, each parameter's update to 1e-3 of its norm); with
    ``--bf16`` (autocast in each stage, as autocast around the original model) the loss curves
    must agree to 1e-2 relative at every step. ``--quick``: 2 stages, GPT-2 in fp32, the Llama
    in both.
(b) **Calibration** (``calibration``). ``autopipe calibrate`` measures this GPU (products,
    attention and copies by size, the launch floor, the optimizer step) into
    ``calibrated.json`` beside ``--json``: commit it as ``autopipe/profiling/specs/<gpu>.json``
    (``h100.json``, ``h200.json``), where it replaces the datasheet spec of that name.
(c) **Speed** (``speed``). A Llama in bf16 weights (1.1 B parameters, 8 microbatches of 1 x
    2048 tokens; with ``--quick`` 0.2 B and 1 x 1024): training tokens/s and MFU of the original
    model eager and of the compiled two-stage package run by ``train.py`` on the one GPU, torch's
    ``pipeline()`` splitting the model at the same layer into two stages on the same GPU under
    the same schedule (not with ``--quick``); after (d), the original under ``torch.compile``
    and the package under ``--compile``. Every variant trains the same batches with the same
    AdamW step; MFU counts the model's FLOPs (no recomputation) over the GPU's bf16 peak in its
    device spec.
(d) **Prediction** (``prediction``). The speed model's analytic profile (the device spec
    matching this GPU) against ``--profile measured`` on it, unit by unit (forward and backward
    time, bytes saved for backward); the plan's predicted step time and peak memory against the
    eager train.py run's median step and ``torch.cuda.max_memory_allocated`` (issue 44: within 5
    %), the step predicted again from the measured profile, and from the analytic profile under
    (b)'s spec (issue 44: within 10 %).
(e) **Parity** (``parity``). The parity ladder (benchmarks/parity.py) on this device: the
    original model against the generated stages without the runtime and ``train.py`` with one
    and two stages, each rung's tokens/s over the original's against issue 43's targets
    (``--quick``: the Llama alone, its short sequence, no profiled step; otherwise GPT-2 and the
    Llama with the ladder's profiler diffs), its own figures in ``parity.json`` beside ``--json``.
(f) **CUDA paths** (``paths``). GPT-2 of (a): a DCP checkpoint and ``--resume``, a ``--trace``
    of CUDA events read back by ``autopipe report --run``.

``--budget SECONDS`` (420 with ``--quick``) bounds the whole kit: every process gets at most what
is left, and a case that would start with too little left is skipped with a row that says so.
It prints one table and writes every figure to ``--json`` after every row (a kit cut short keeps
what it measured). Without a CUDA device it exits with a message; ``--device cpu`` rehearses
every step on this machine's CPU (gloo, the smallest speed model) to check the kit itself, and
its figures mean nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from kit_processes import (
    REPO,
    Budget,
    Failed,
    OutOfTime,
    run,
)  # noqa: E402  (benchmarks/, the script's folder)

from autopipe.compiler import CompileOptions, compile_spec, load_graph  # noqa: E402
from autopipe.partitioning import Partition  # noqa: E402
from autopipe.partitioning.cost import CostModel  # noqa: E402
from autopipe.profiling import Profile, device_spec, profile  # noqa: E402
from autopipe.profiling.calibrate import known_gpu  # noqa: E402
from autopipe.runtime.core.pipeline import Pipeline  # noqa: E402
from autopipe.spec import load_example  # noqa: E402

MODELS = "benchmarks/gpu_models.py"
WORKER = HERE / "gpu_worker.py"
MICROBATCHES = 8  # gpu_models.MICROBATCHES
SCHEDULE = "interleaved-1f1b"  # every stage on one rank: torch's looped 1F1B
#: the kit's parts, in the order it runs them: what no earlier GPU run measured first
PARTS = ("exactness", "calibration", "speed", "prediction", "parity", "paths")
#: seconds --quick runs for: 8 minutes of device time, less the machine's start and the wheels
QUICK_BUDGET = 420

#: fp32: per-step losses, relative; and each parameter's training update (trained - initial),
#: the norm of the difference over the norm of the reference's update. Element-wise closeness is
#: no test after AdamW steps: AdamW turns a gradient element near zero, where a different but
#: equally exact order of additions (autograd accumulating a value's gradients in the order the
#: generated code reads it) changes its sign, into a step of the full learning rate
LOSS_RTOL, UPDATE_RTOL = 1e-5, 1e-3
#: bf16: the loss curves, relative, at every step
BF16_LOSS_RTOL = 1e-2


@dataclass
class Row:
    """One line of the table: a case, what was measured, against what, and the verdict."""

    part: str
    case: str
    measured: str
    against: str = ""
    #: "ok", "FAIL", "miss" (a target not met), "error", "skipped" (the budget spent or a
    #: case --quick leaves out), or "" for a figure without a pass mark
    verdict: str = ""
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class Kit:
    device: str
    quick: bool
    work: Path
    spec: str  # the device spec (a name autopipe knows, or a calibrated JSON file)
    output: Path  # the JSON file, rewritten after every row (a kit cut short keeps its figures)
    facts: dict[str, Any]
    rows: list[Row] = field(default_factory=list)
    budget: Budget = Budget()  # --budget

    def timeout(self, seconds: float, least: float = 20.0) -> float:
        """``seconds`` for a step of a case, cut to what the budget has left."""
        return self.budget.timeout(seconds, least)

    def skip(self, part: str, case: str, why: object) -> None:
        """A case not run, and why."""
        self.add(Row(part, case, f"skipped: {why}", verdict="skipped"))

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        mark = f"  [{row.verdict}]" if row.verdict else ""
        print(f"  {row.part:<11} {row.case:<34} {row.measured}{mark}", flush=True)
        self.write()
        return row

    def write(self) -> None:
        results = {"facts": self.facts, "rows": [r.__dict__ for r in self.rows]}
        self.output.write_text(json.dumps(results, indent=1, default=str))


# -- running things --------------------------------------------------------------------------------
def train(kit: Kit, package: Path, log: Path, *options: str, timeout: float = 600) -> list[dict]:
    """train.py of ``package`` on one rank of this machine; its --log-json records."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=1",
        str(package / "train.py"),
        "--device",
        kit.device,
        "--microbatches",
        str(MICROBATCHES),
        "--schedule",
        SCHEDULE,
        "--log-json",
        str(log),
        *options,
    ]
    run(command, kit.timeout(timeout))
    return [json.loads(line) for line in log.read_text().splitlines() if '"loss"' in line]


def worker(kit: Kit, *arguments: str, timeout: float = 600) -> None:
    run([sys.executable, str(WORKER), *arguments, "--device", kit.device], kit.timeout(timeout))


def compiled(kit: Kit, model: str, stages: int) -> Path:
    """``model`` of gpu_models.py compiled into ``stages`` stages on one device (in this
    process: started only with a minute of the budget left)."""
    kit.timeout(60, least=60)
    out = kit.work / f"{model}_{stages}"
    options = CompileOptions(
        stages=stages,
        devices=1,
        schedule=SCHEDULE,
        microbatches=MICROBATCHES,
        device_spec=kit.spec,
    )
    compile_spec(f"{MODELS}:{model}", out, options, force=True, report=False)
    return out


def attempt(kit: Kit, part: str, case: str, measure) -> None:
    """Run one case; a failure becomes an error row instead of ending the kit."""
    try:
        measure()
    except OutOfTime as exc:
        kit.skip(part, case, exc)
    except Exception as exc:  # the kit reports every failure and goes on
        message = str(exc) if isinstance(exc, Failed) else traceback.format_exc(limit=6)
        first = message.strip().splitlines()[0] if message.strip() else type(exc).__name__
        kit.add(Row(part, case, f"failed: {first[:90]}", verdict="error", data={"error": message}))
        print("    " + "\n    ".join(message.strip().splitlines()[-25:]), flush=True)


# -- (a) exactness ---------------------------------------------------------------------------------
def exactness(kit: Kit) -> None:
    """Every case of (a); with --quick 2 stages only, GPT-2 in fp32 and the Llama in both."""
    steps = {"fp32": 6, "bf16": 10}
    cases = (
        [("gpt2", 2), ("llama", 2)]
        if kit.quick
        else [("gpt2", 2), ("gpt2", 4), ("llama", 2), ("llama", 4)]
    )
    references: dict[tuple[str, str], Path] = {}
    for model, stages in cases:
        precisions = ["fp32"] if kit.quick and model == "gpt2" else ["fp32", "bf16"]
        for precision in precisions:
            case = f"{model}, {stages} stages, {precision}"
            attempt(
                kit,
                "exactness",
                case,
                lambda: exact_case(kit, model, stages, precision, steps[precision], references),
            )


def exact_case(
    kit: Kit,
    model: str,
    stages: int,
    precision: str,
    steps: int,
    references: dict[tuple[str, str], Path],
) -> None:
    init = kit.work / f"{model}_init.pt"
    if not init.exists():
        torch.save(load_example(f"{MODELS}:{model}").model.state_dict(), init)
    bf16 = ["--bf16"] if precision == "bf16" else []
    reference = references.get((model, precision))
    if reference is None:
        reference = kit.work / f"{model}_reference_{precision}"
        worker(kit, "reference", model, "--steps", str(steps), "--init", str(init),
               "--out", str(reference), *bf16)  # fmt: skip
        references[(model, precision)] = reference
    package = kit.work / f"{model}_{stages}"
    if not package.exists():
        compiled(kit, model, stages)
    trained = kit.work / f"{model}_{stages}_{precision}.pt"
    trained.unlink(missing_ok=True)  # an earlier kit's in a --work used again
    records = train(
        kit,
        package,
        kit.work / f"{model}_{stages}_{precision}.jsonl",
        "--steps", str(steps), "--data", f"{MODELS}:{model}_batches", "--load", str(init),
        "--save", str(trained), *bf16,
    )  # fmt: skip
    losses = [r["loss"] for r in records]
    ref_losses = json.loads((reference / "losses.json").read_text())
    loss_error = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    mine = torch.load(trained, weights_only=True)
    theirs = torch.load(reference / "trained.pt", weights_only=True)
    if set(mine) != set(theirs):
        raise Failed(f"trained state names differ: {sorted(set(mine) ^ set(theirs))[:5]}")
    start = torch.load(init, weights_only=True)
    weight_error = max((mine[k].float() - theirs[k].float()).abs().max().item() for k in theirs)
    update_error = max(
        (mine[k].float() - theirs[k].float()).norm().item()
        / max((theirs[k].float() - start[k].float()).norm().item(), 1e-30)
        for k in theirs
        if not torch.equal(theirs[k], start[k])
    )
    if precision == "fp32":
        ok = len(losses) == steps and loss_error <= LOSS_RTOL and update_error <= UPDATE_RTOL
        against = f"losses {LOSS_RTOL:g}, updates {UPDATE_RTOL:g} rel"
    else:
        ok = len(losses) == steps and loss_error <= BF16_LOSS_RTOL
        against = f"loss curve {BF16_LOSS_RTOL:g} rel"
    kit.add(
        Row(
            "exactness",
            f"{model}, {stages} stages, {precision}",
            f"{steps} steps: loss err {loss_error:.1e}, update err {update_error:.1e}, "
            f"weights max {weight_error:.1e}",
            against,
            "ok" if ok else "FAIL",
            {
                "losses": losses,
                "reference_losses": ref_losses,
                "loss_rel_error": loss_error,
                "weight_max_error": weight_error,
                "update_rel_error": update_error,
            },
        )
    )


# -- (f) CUDA paths beyond a plain run -------------------------------------------------------------
def paths(kit: Kit) -> None:
    """The two-stage GPT-2 of (a), fp32: a run of 3 steps that records a timeline (CUDA events)
    and writes a DCP checkpoint, resumed to 6 steps; the resumed losses against (a)'s
    uninterrupted run, the timeline read back by ``autopipe report --run``."""
    package, init = kit.work / "gpt2_2", kit.work / "gpt2_init.pt"
    if not package.exists():
        compiled(kit, "gpt2", 2)
    if not init.exists():
        torch.save(load_example(f"{MODELS}:gpt2").model.state_dict(), init)
    log, checkpoints, trace = (kit.work / f"paths_{n}" for n in ("log.jsonl", "ckpt", "trace"))
    common = ["--data", f"{MODELS}:gpt2_batches", "--load", str(init),
              "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "3"]  # fmt: skip
    train(kit, package, log, "--steps", "3", "--trace", str(trace), *common)
    records = train(kit, package, log, "--steps", "6", "--resume", *common)
    losses = [r["loss"] for r in records]
    uninterrupted = kit.work / "gpt2_2_fp32.jsonl"
    if uninterrupted.exists():
        reference = [json.loads(line)["loss"] for line in uninterrupted.read_text().splitlines()]
        error = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
        same = len(losses) == 6 and error <= LOSS_RTOL
        kit.add(
            Row(
                "paths",
                "DCP checkpoint at 3, resumed to 6",
                f"losses of the resumed run vs uninterrupted: rel err {error:.1e}",
                f"{LOSS_RTOL:g}",
                "ok" if same else "FAIL",
                {"losses": losses, "uninterrupted": reference},
            )
        )
    report = run(
        [sys.executable, "-m", "autopipe", "report", str(package), "--run", str(trace)],
        kit.timeout(300),
    )
    files = sorted(p.name for p in trace.iterdir())
    said = [line for line in report.splitlines() if line.startswith("pipeline run:")]
    kit.add(
        Row(
            "paths",
            "--trace (CUDA events), report --run",
            f"{', '.join(files)}; " + (said[0] if said else "report: no pipeline run line"),
            verdict="ok" if "trace.json" in files else "FAIL",
            data={"files": files, "report": report[-3000:]},
        )
    )


# -- (c) speed -------------------------------------------------------------------------------------
def speed_model(kit: Kit) -> tuple[str, str, int]:
    """The speed Llama for this run: model function, batch function, sequence length."""
    size = "rehearsal" if kit.device == "cpu" else "quick" if kit.quick else ""
    suffix = f"_{size}" if size else ""
    sequence = {"": 2048, "quick": 1024, "rehearsal": 128}[size]
    return f"speed_llama{suffix}", f"speed_batches{suffix}", sequence


@dataclass
class Speed:
    """Part (c): the speed Llama's two-stage package and the runs measured against it."""

    kit: Kit
    package: Path
    model: str
    batches: str
    sequence: int
    warmup: int
    steps: int
    plan: Any  # the package's plan (pipeline.json)

    def eager(self) -> None:
        """The original model and the package without ``torch.compile``, then torch's
        ``pipeline()`` on the same split (left out by --quick)."""
        attempt(self.kit, "speed", "original, eager", lambda: self.original(False))
        attempt(self.kit, "speed", "autopipe 2 stages, eager", lambda: self.autopipe(False))
        if self.kit.quick:
            self.kit.skip("speed", "pipeline() 2 stages", "--quick")
        else:
            attempt(self.kit, "speed", "pipeline() 2 stages", self.torch_pipeline)

    def compiled(self) -> None:
        """The original under ``torch.compile`` and the package under ``--compile``."""
        attempt(self.kit, "speed", "original, torch.compile", lambda: self.original(True))
        attempt(self.kit, "speed", "autopipe 2 stages, --compile", lambda: self.autopipe(True))

    def figure(
        self, case: str, seconds: float, peak: int | None, losses: list[float], **data
    ) -> None:
        tokens = MICROBATCHES * self.sequence
        mfu = self.plan.utilisation(seconds, MICROBATCHES, 1)
        peak_text = f", peak {peak / 2**30:.1f} GiB" if peak else ""
        self.kit.add(
            Row(
                "speed",
                case,
                f"{tokens / seconds:,.0f} tokens/s, {seconds * 1e3:.1f} ms/step"
                + (f", MFU {mfu * 100:.1f}%" if mfu is not None else "")
                + peak_text,
                data={
                    "step_time": seconds,
                    "tokens_per_s": tokens / seconds,
                    "mfu": mfu,
                    "peak_memory": peak,
                    "losses": losses,
                    **data,
                },
            )
        )

    def original(self, compiled_model: bool) -> None:
        kit = self.kit
        out = kit.work / f"original{'_compiled' if compiled_model else ''}.json"
        flag = ["--compile"] if compiled_model else []
        worker(kit, "original", self.model, "--batches", self.batches, "--steps", str(self.steps),
               "--warmup", str(self.warmup), "--out", str(out), *flag)  # fmt: skip
        result = json.loads(out.read_text())
        name = "original, torch.compile" if compiled_model else "original, eager"
        self.figure(name, result["step_time"], result["peak_memory"], result["losses"])

    def autopipe(self, compile_stages: bool) -> None:
        kit = self.kit
        tag = "compiled" if compile_stages else "eager"
        flag = ["--compile"] if compile_stages else []
        records = train(kit, self.package, kit.work / f"autopipe_{tag}.jsonl", "--steps",
                        str(self.steps), "--data", f"{MODELS}:{self.batches}", *flag)  # fmt: skip
        seconds = statistics.median(r["time"] for r in records[self.warmup :])
        peak = max(records[-1]["peak_memory"])
        case = f"autopipe 2 stages, {'--compile' if compile_stages else 'eager'}"
        losses = [r["loss"] for r in records]
        self.figure(case, seconds, peak, losses, predicted_step=self.plan.step_time)

    def torch_pipeline(self) -> None:
        kit = self.kit
        runtime = load_module("benchmarks_runtime", HERE / "runtime.py")
        points, moved = runtime.split_points(self.package)
        out = kit.work / "pipeline.json"
        worker(kit, "pipeline", self.model, "--batches", self.batches, "--steps", str(self.steps),
               "--warmup", str(self.warmup), "--split", points[0], "--out", str(out))  # fmt: skip
        result = json.loads(out.read_text())
        self.figure(f"pipeline() 2 stages at {points[0]}", result["step_time"],
                    result["peak_memory"], result["losses"], moved=moved[0])  # fmt: skip


def speed(kit: Kit) -> Speed | None:
    """Part (c)'s package compiled; None (and an error row) when it cannot be."""
    model, batches, sequence = speed_model(kit)
    warmup, timed = (2, 4) if kit.quick or kit.device == "cpu" else (3, 10)
    built: list[Path] = []
    attempt(kit, "speed", f"compile {model}", lambda: built.append(compiled(kit, model, 2)))
    if not built:
        return None
    plan = Pipeline.from_json(json.loads((built[0] / "pipeline.json").read_text())).plan
    assert plan is not None
    return Speed(kit, built[0], model, batches, sequence, warmup, warmup + timed, plan)


# -- (d) prediction --------------------------------------------------------------------------------
def prediction(kit: Kit, package: Path) -> None:
    kit.timeout(60, least=60)  # the measured profile runs in this process
    model, _, _ = speed_model(kit)
    graph = load_graph(package / "artifacts" / "graph.json")
    analytic = Profile.load(package / "artifacts" / "profile.json")
    partition = Partition.load(package / "artifacts" / "partition.json")
    example = load_example(f"{MODELS}:{model}")
    started = time.perf_counter()
    measured = profile(graph, "measured", analytic.device, example)
    measuring = time.perf_counter() - started
    del example
    units = []
    for label, a, m in zip((u.label for u in graph.units), analytic.units, measured.units):
        units.append(
            {
                "unit": label,
                "forward": [a.forward, m.forward],
                "backward": [a.backward, m.backward],
                "activations": [a.activations, m.activations],
                "flops": [a.flops_forward + a.flops_backward, m.flops_forward + m.flops_backward],
            }
        )
    for kind in ("forward", "backward"):
        total_a = sum(u[kind][0] for u in units)
        total_m = sum(u[kind][1] for u in units)
        ratios = [u[kind][1] / u[kind][0] for u in units if u[kind][0] > 0]
        worst = max(units, key=lambda u: abs(_log_ratio(u[kind])))
        kit.add(
            Row(
                "prediction",
                f"unit {kind} time, measured/analytic",
                f"total {total_m * 1e3:.1f} ms vs {total_a * 1e3:.1f} ms "
                f"({total_m / total_a:.2f}x); per unit median {statistics.median(ratios):.2f}x, "
                f"range {min(ratios):.2f}-{max(ratios):.2f}x",
                f"worst: {worst['unit']} {worst[kind][1] / max(worst[kind][0], 1e-12):.2f}x",
                data={"total": [total_a, total_m], "ratios": ratios},
            )
        )
    saved_a = sum(u["activations"][0] for u in units)
    saved_m = sum(u["activations"][1] for u in units)
    kit.add(
        Row(
            "prediction",
            "unit bytes saved for backward",
            f"measured {saved_m / 2**20:,.0f} MiB vs analytic {saved_a / 2**20:,.0f} MiB "
            f"({saved_m / max(saved_a, 1):.3f}x)",
            data={"total": [saved_a, saved_m], "measuring_seconds": measuring, "units": units},
        )
    )
    runs = {r.case: r for r in kit.rows if r.part == "speed"}
    run = runs.get("autopipe 2 stages, eager")
    if run is None or "step_time" not in run.data:
        why = "no eager autopipe run to predict (speed's row above says why)"
        kit.skip("prediction", "step time: plan vs train.py", why)
        return
    predicted, settings = partition.predicted, partition.settings

    def step_time(under: Profile) -> float:
        """The step the cost model predicts for the package's partition under a profile."""
        return (
            CostModel(graph, under, schedule=settings.schedule, microbatches=settings.microbatches)
            .evaluate(
                partition.stage_of_unit,
                partition.device_of_stage,
                recompute=frozenset(partition.recompute),
                recompute_blocks=frozenset(partition.recompute_blocks),
            )
            .step_time
        )

    step, remodelled = run.data["step_time"], step_time(measured)
    kit.add(
        Row(
            "prediction",
            "step time: plan vs train.py",
            f"analytic plan {predicted.step_time * 1e3:.1f} ms, from measured units "
            f"{remodelled * 1e3:.1f} ms, run {step * 1e3:.1f} ms",
            f"run/plan {step / predicted.step_time:.2f}x, "
            f"run/measured-units {step / remodelled:.2f}x",
            data={"plan": predicted.step_time, "measured_units": remodelled, "run": step},
        )
    )
    peak = run.data.get("peak_memory")
    if peak:
        planned = max(predicted.device_memory)
        kit.add(
            Row(
                "prediction",
                "peak memory: plan vs train.py",
                f"plan {planned / 2**30:.2f} GiB, run {peak / 2**30:.2f} GiB "
                "(torch.cuda.max_memory_allocated)",
                f"run/plan {peak / planned:.2f}x (target within 5%)",
                verdict="ok" if abs(peak / planned - 1) <= 0.05 else "miss",
                data={"plan": planned, "run": peak},
            )
        )
    attempt(kit, "prediction", "step time: calibrated plan vs run",
            lambda: calibrated_prediction(kit, graph, step, step_time))  # fmt: skip


def calibrated_prediction(
    kit: Kit, graph: Any, step: float, step_time: Callable[[Profile], float]
) -> None:
    """The run's step predicted from the analytic profile under the spec the calibration part
    wrote (issue 44's target: within 10 %)."""
    calibrated_file = kit.output.parent / "calibrated.json"
    case = "step time: calibrated plan vs run"
    if not calibrated_file.is_file():
        why = (
            f"no {calibrated_file.name} beside {kit.output.name} (the calibration part did not "
            "run, or failed)"
        )
        kit.skip("prediction", case, why)
        return
    predicted = step_time(profile(graph, "analytic", device_spec(str(calibrated_file))))
    error = predicted / step - 1
    kit.add(
        Row(
            "prediction",
            case,
            f"calibrated analytic {predicted * 1e3:.1f} ms, run {step * 1e3:.1f} ms",
            f"error {error:+.1%} (target within 10%)",
            verdict="ok" if abs(error) <= 0.10 else "miss",
            data={"calibrated": predicted, "run": step},
        )
    )


def calibration(kit: Kit) -> None:
    """``autopipe calibrate`` of this device, written beside the kit's JSON."""
    target = kit.output.parent / "calibrated.json"
    started = time.perf_counter()
    run([sys.executable, "-m", "autopipe", "calibrate", "--device", kit.device, "-o",
         str(target)], kit.timeout(900, least=60))  # fmt: skip
    spec = device_spec(str(target))
    seconds = time.perf_counter() - started
    dtype = "bfloat16" if "matmul.bfloat16" in spec.tables else "float32"
    products = spec.tables[f"matmul.{dtype}"].points
    copies = spec.tables["memory"].points
    kit.add(
        Row(
            "calibration",
            f"{spec.name}: products, attention, copies",
            f"matmul {dtype} {products[0][1] / 1e12:.3g}..{products[-1][1] / 1e12:.3g} "
            f"TFLOP/s, copies up to {max(r for _, r in copies) / 1e9:.0f} GB/s, launch "
            f"{spec.kernel_overhead * 1e6:.1f} us",
            f"{seconds:.0f} s; written to {target}",
            data={"spec": spec.to_json(), "seconds": seconds},
        )
    )


def parity(kit: Kit) -> None:
    """The parity ladder on this device, one kit row per rung (its ratio to the original), its
    own figures in ``parity.json`` beside the kit's JSON (written after every rung: a ladder
    cut short keeps the rungs it measured). The ladder gets what is left of the budget."""
    output = kit.output.parent / "parity.json"
    output.unlink(missing_ok=True)  # a figure of an earlier run is no figure of this one
    command = [sys.executable, str(HERE / "parity.py"), "--device", kit.device]
    command += ["--json", str(output), "--work", str(kit.work / "parity")]
    if kit.quick:
        command += ["--quick", "--model", "llama", "--no-profile"]
    timeout = kit.timeout(1800, least=90)
    # the ladder stops itself in time, ratios and all (its start, imports and CUDA, is not on
    # its clock: 45 s of margin)
    if kit.budget.deadline is not None:
        command += ["--budget", f"{timeout - 45:.0f}"]
    failure = None
    try:
        run(command, timeout)
    except Failed as exc:
        if not output.is_file():
            raise
        failure = str(exc)  # a rung failed (its row says so) or the ladder ran out of time
    for row in json.loads(output.read_text())["rows"]:
        case = f"{row['model']} {row['rung']}: {row['what']}"
        if row.get("error"):
            verdict = "skipped" if row["error"].startswith("skipped") else "error"
            kit.add(Row("parity", case, row["error"].splitlines()[0][:120], verdict=verdict))
            continue
        ratio = row.get("ratio")
        measured = f"{row['tokens_per_s']:,.0f} tokens/s" + (
            f", {ratio:.3f}x the original" if ratio is not None else ""
        )
        target = row.get("target", "")
        verdict = "FAIL" if "MISSED" in target else ("ok" if target.startswith(">=") else "")
        kit.add(Row("parity", case, measured, target, verdict, data=row))
    if failure is not None:  # a ladder the budget stopped is cut short, not failed
        first = failure.strip().splitlines()[0]
        verdict = "skipped" if first.startswith("timed out") else "error"
        kit.add(Row("parity", "the ladder", f"stopped: {first[:90]}", verdict=verdict,
                    data={"error": failure}))  # fmt: skip


def _log_ratio(pair: list[float]) -> float:
    a, m = pair
    return math.log(max(m, 1e-12) / max(a, 1e-12))


# -- the whole kit ---------------------------------------------------------------------------------
def load_module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def matching_spec(device: str, work: Path) -> str:
    """The device spec of this machine's accelerator: a known one by its name, else measured
    with ``autopipe calibrate``."""
    if device == "cuda":
        known = known_gpu(torch.cuda.get_device_name(0))
        if known is not None:
            return known.name.lower()
    calibrated = work / "device.json"
    run([sys.executable, "-m", "autopipe", "calibrate", "-o", str(calibrated)], 900)
    return str(calibrated)


def table(rows: list[Row]) -> str:
    headers = ("part", "case", "measured", "against", "verdict")
    cells = [(r.part, r.case, r.measured, r.against, r.verdict) for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |"
    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in cells]
    return "\n".join([line, rule, *body])


def describe(device: str) -> dict[str, Any]:
    facts: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": device,
    }
    if device == "cuda":
        facts["gpu"] = torch.cuda.get_device_name(0)
        facts["cuda"] = torch.version.cuda
        facts["memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return facts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="autopipe on one GPU: exactness, speed and prediction (see the module text)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"the smaller speed model, fewer cases, a budget of {QUICK_BUDGET} s",
    )
    parser.add_argument(
        "--budget",
        type=float,
        help="seconds the kit may take: a case that would start with too little left is "
        f"skipped, and says so (default: {QUICK_BUDGET} with --quick, none without)",
    )
    parser.add_argument(
        "--json",
        default=str(Path(os.environ.get("OUT", "."), "gpu.json")),
        help="where to write every figure; calibrated.json and parity.json go beside it "
        "(default: gpu.json in $OUT where the device tool sets it, else here)",
    )
    parser.add_argument("--work", help="a directory for packages and logs (default: temporary)")
    parser.add_argument(
        "--parts",
        default=",".join(PARTS),
        help="which parts to run, comma-separated, in the kit's order "
        f"({', '.join(PARTS)}): prediction needs speed's package and reads calibration's spec",
    )
    parser.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cpu rehearses the kit itself on this machine's CPU (figures meaningless)",
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        built = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA (a CPU build)"
        print(
            "benchmarks/gpu.py measures autopipe on a CUDA GPU, and this machine has none that "
            f"torch can use (torch {torch.__version__}, built with {built}). Run it on a machine "
            "with an NVIDIA GPU and a CUDA build of torch; `--device cpu` rehearses the kit on "
            "this CPU instead.",
            file=sys.stderr,
        )
        return 2
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"--parts: unknown {', '.join(sorted(unknown))}")
    budget = args.budget if args.budget is not None else QUICK_BUDGET if args.quick else None
    if budget is not None and budget <= 0:
        parser.error(f"--budget must be a number of seconds above 0, not {budget:g}")
    started = time.perf_counter()
    output = Path(args.json).resolve()  # the kit's processes run in the repository
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="autopipe-gpu-") as scratch:
        work = Path(args.work).resolve() if args.work else Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        facts = describe(args.device) | {"budget": budget}
        spec = matching_spec(args.device, work)
        facts["device_spec"] = spec
        print(f"autopipe GPU kit: {json.dumps(facts)}", flush=True)
        kit = Kit(args.device, args.quick, work, spec, output, facts, budget=Budget.of(budget))
        if "exactness" in parts:
            exactness(kit)
        if "calibration" in parts:
            attempt(kit, "calibration", "autopipe calibrate", lambda: calibration(kit))
        measured = speed(kit) if "speed" in parts or "prediction" in parts else None
        if measured is not None:  # eager first: prediction predicts the eager run
            measured.eager()
            if "prediction" in parts:
                attempt(kit, "prediction", "measured profile",
                        lambda: prediction(kit, measured.package))  # fmt: skip
            if "speed" in parts:
                measured.compiled()
        if "parity" in parts:
            attempt(kit, "parity", "the ladder", lambda: parity(kit))
        if "paths" in parts:
            attempt(kit, "paths", "checkpoint, resume, trace", lambda: paths(kit))
        facts["seconds"] = round(time.perf_counter() - started, 1)
        kit.write()
    print()
    print(table(kit.rows))
    print(f"\n{len(kit.rows)} rows in {facts['seconds']:.0f} s; figures in {output}")
    failed = [r for r in kit.rows if r.verdict in ("FAIL", "error")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
