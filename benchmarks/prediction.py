"""How well autopipe predicts real training runs, on this CPU.

    python benchmarks/prediction.py            # about 15 minutes on 2 cores

``autopipe calibrate`` measures this machine (one thread, as each torchrun rank has) into a
device spec. Each of 4 models is compiled with the *analytic* profile for that spec into 4
plans for 2 ranks and a step of 4 example microbatches, 2 partitions x 2 schedules: 2 stages
(1f1b, 4 microbatches; gpipe, 2 microbatches x 2 accumulated) and 4 stages looped
(interleaved-1f1b, 4 microbatches; looped-bfs, 2 x 2); every package's train.py then runs
with its plan's defaults under torchrun (gloo, 2 processes, one thread each, AdamW):

- peak memory per rank: predicted (``device_memory``: parameters, gradients and AdamW state,
  receive buffers, the activations and outputs of the microbatches the schedule keeps in
  flight, gradients of received inputs, the largest transient) against train.py
  ``--track-memory``: the most bytes of live tensors, counted operator by operator from the
  stages' allocation through the first two steps,
- step time: predicted (the simulated step of the schedule's own action order, plus the
  optimizer step, times the accumulation) against the median of steps 3 to 10 of the same run
  (after the tracked ones),
- plan order: for each model, whether the 4 plans rank by measured step time as they rank by
  predicted step time (Spearman over the 4, averaged over the models).

Reported: Spearman rank correlation and mean absolute percentage error over all runs.

The CPU is calibrated before each model's four plans, which then compile and run within
about two minutes of it, and again after them: each plan's stages are then predicted with the
second calibration too (``repredicted``: the split kept, profiled and simulated again), which
shows how far the machine moved while they ran. On a shared machine the same stage run alone
took 52.6 ms at one moment and 75.0 ms forty minutes later (2026-11-30), and a fixed
one-thread workload timed beside each run did not follow that drift (it ranged 0.87-1.12x while
the runs ranged -1 to -40 % against one calibration made at the start).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from autopipe.compiler import CompileOptions, load_graph, profile_step
from autopipe.partitioning import Partition, partition
from autopipe.partitioning.cost import iteration_time
from commands import run

STEPS = 10
TRACKED = 2  # the first steps run under the memory tracker (slower); timed after them
PLANS = [  # (stages, schedule, microbatches, accumulate) on 2 ranks: 4 microbatches a step
    (2, "1f1b", 4, 1),
    (2, "gpipe", 2, 2),
    (4, "interleaved-1f1b", 4, 1),
    (4, "looped-bfs", 2, 2),
]

MODELS = '''
import torch
import transformers as tf
from transformers.utils import logging

logging.set_verbosity_error()


def _ids(vocab, batch=4, length=128):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(0))


def gpt2():
    torch.manual_seed(0)
    config = tf.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=2048, n_positions=128,
                           use_cache=False, bos_token_id=0, eos_token_id=0)
    ids = _ids(2048)
    return tf.GPT2LMHeadModel(config), (ids,), {"labels": ids.clone()}


def bert():
    torch.manual_seed(0)
    config = tf.BertConfig(num_hidden_layers=4, hidden_size=256, num_attention_heads=4,
                           intermediate_size=1024, vocab_size=2048, max_position_embeddings=128)
    ids = _ids(2048)
    return tf.BertForMaskedLM(config), (ids,), {"labels": ids.clone()}


def t5():
    torch.manual_seed(0)
    config = tf.T5Config(num_layers=2, d_model=256, d_kv=32, num_heads=8, d_ff=1024,
                         vocab_size=2048, use_cache=False, decoder_start_token_id=0,
                         pad_token_id=0)
    ids = _ids(2048)
    return tf.T5ForConditionalGeneration(config), (ids,), {"labels": ids[:, :32].clone()}


class CNN(torch.nn.Module):
    """Six convolutions with BatchNorm, then a classifier and its loss."""

    def __init__(self):
        super().__init__()
        layers, channels = [], 3
        for width in (32, 64, 64, 128, 128, 128):
            layers += [torch.nn.Conv2d(channels, width, 3, padding=1),
                       torch.nn.BatchNorm2d(width), torch.nn.ReLU()]
            channels = width
        self.features = torch.nn.Sequential(*layers)
        self.head = torch.nn.Linear(channels, 10)

    def forward(self, images, labels):
        logits = self.head(self.features(images).mean((2, 3)))
        return {"loss": torch.nn.functional.cross_entropy(logits, labels)}


def cnn():
    torch.manual_seed(0)
    return CNN(), (torch.randn(16, 3, 32, 32),), {"labels": torch.randint(0, 10, (16,))}
'''
NAMES = {"gpt2": "GPT-2 (4 x 256)", "bert": "BERT (4 x 256)", "t5": "T5 (2+2 x 256)"}
NAMES["cnn"] = "CNN (6 conv, BatchNorm)"


def repredicted(package: Path, spec_file: Path, accumulate: int) -> float:
    """The step a compiled package's stages predict under the device spec ``spec_file``: its
    split kept, profiled, placed and simulated again as ``autopipe compile`` does."""
    graph = load_graph(package / "artifacts" / "graph.json")
    old = Partition.load(package / "artifacts" / "partition.json")
    options = CompileOptions(stages=old.num_stages, device_spec=str(spec_file))
    again = partition(
        graph,
        profile_step(graph, options),
        old.num_stages,
        num_devices=len(set(old.device_of_stage)),
        schedule=old.settings.schedule,
        microbatches=old.settings.microbatches,
        split=old.stage_of_unit,
    )
    assert again.predicted is not None  # partition() predicts every partition it makes
    return iteration_time(again.predicted, accumulate)


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (ties broken by position)."""

    def ranks(xs: list[float]) -> list[int]:
        order = sorted(range(len(xs)), key=xs.__getitem__)
        rank = [0] * len(xs)
        for r, i in enumerate(order):
            rank[i] = r
        return rank

    ra, rb, n = ranks(a), ranks(b), len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def mape(predicted: list[float], measured: list[float]) -> float:
    return statistics.mean(abs(p - m) / m for p, m in zip(predicted, measured)) * 100


def format_row(row: tuple) -> str:
    model, plan, p_time, m_time, memory, after = row
    p_mem = ", ".join(f"{p / 2**20:.1f}" for p, _ in memory)
    m_mem = ", ".join(f"{m / 2**20:.1f}" for _, m in memory)
    again = (
        "" if after is None else f" | {after * 1e3:.1f} | {100 * (after - m_time) / m_time:+.0f} %"
    )
    return (
        f"| {NAMES[model]} | {plan} | {p_time * 1e3:.1f} | {m_time * 1e3:.1f} "
        f"| {100 * (p_time - m_time) / m_time:+.0f} %{again} | {p_mem} | {m_mem} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--models", nargs="+", choices=list(NAMES), default=list(NAMES), help="(default: all)"
    )
    models = parser.parse_args().models
    autopipe = [sys.executable, "-m", "autopipe"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    # (model, plan, predicted s, measured s, [(predicted B, measured B)], predicted s after)
    runs: list[tuple] = []
    packages: list[tuple[Path, int]] = []  # each run's package and accumulation
    calibrations = {}  # model -> the spec its plans were made for
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "models.py").write_text(MODELS)
        for model in models:
            spec_file = root / f"cpu-{model}.json"  # this machine now, for this model's plans
            run([*autopipe, "calibrate", "--device", "cpu", "-o", str(spec_file)])
            calibrations[model] = json.loads(spec_file.read_text())
            for stages, schedule, microbatches, accumulate in PLANS:
                package = root / f"{model}-{stages}-{schedule}"
                run(
                    [
                        *autopipe, "compile", f"{root / 'models.py'}:{model}", "--out",
                        str(package), "--stages", str(stages), "--devices", "2", "--schedule",
                        schedule, "--microbatches", str(microbatches), "--accumulate",
                        str(accumulate), "--method", "dp", "--device-spec", str(spec_file),
                        "--no-report",
                    ]
                )  # fmt: skip
                pipeline = json.loads((package / "pipeline.json").read_text())
                partition = json.loads((package / "artifacts" / "partition.json").read_text())
                log = package / "log.jsonl"
                run(
                    [
                        *torchrun, "--nproc-per-node=2", str(package / "train.py"), "--device",
                        "cpu", "--steps", str(STEPS), "--track-memory", "--log-json", str(log),
                    ]
                )  # fmt: skip
                records = [json.loads(line) for line in log.read_text().splitlines()]
                seconds = statistics.median(r["time"] for r in records[TRACKED:])
                memory = zip(partition["predicted"]["device_memory"], records[-1]["peak_memory"])
                plan = f"{stages} stages, {schedule}, {microbatches} x {accumulate}"
                predicted = pipeline["plan"]["step_time"]
                again = repredicted(package, spec_file, accumulate)
                assert abs(again - predicted) <= 1e-6 * predicted, (again, predicted)
                runs.append((model, plan, predicted, seconds, list(memory), None))
                packages.append((package, accumulate))
                print(f"# {format_row(runs[-1])}", file=sys.stderr)
            # the machine again, after the model's runs: the same stages predicted with it
            after_file = root / f"cpu-{model}-after.json"
            run([*autopipe, "calibrate", "--device", "cpu", "-o", str(after_file)])
            for index, (package, accumulate) in enumerate(packages):
                if runs[index][0] == model:
                    again = repredicted(package, after_file, accumulate)
                    runs[index] = (*runs[index][:5], again)
    for model, spec in calibrations.items():
        print(
            f"CPU calibrated by `autopipe calibrate` (1 thread) before {NAMES[model]}: "
            f"{spec['flops']['float32'] / 1e9:.1f} GFLOP/s fp32 matmul, "
            f"{spec['memory_bandwidth'] / 1e9:.1f} GB/s memory, "
            f"{spec['kernel_overhead'] * 1e6:.1f} us per operator, "
            f"{spec['receive_overhead'] * 1e3:.1f} ms a receive waits while its sender computes"
        )
    print(f"load average {os.getloadavg()[0]:.1f}")
    print(
        "| model | plan on 2 ranks (microbatches x accumulation) | predicted step ms | "
        "measured step ms | error | predicted after the runs, ms | error | "
        "predicted peak MiB (rank 0, 1) | measured peak MiB (rank 0, 1) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for row in runs:
        print(format_row(row))
    times_p, times_m = [r[2] for r in runs], [r[3] for r in runs]
    mem_p = [p for r in runs for p, _ in r[4]]
    mem_m = [m for r in runs for _, m in r[4]]
    orders = [
        spearman([r[2] for r in runs if r[0] == model], [r[3] for r in runs if r[0] == model])
        for model in models
    ]
    print()
    print(
        f"Plan order: Spearman {statistics.mean(orders):.2f} between predicted and measured "
        f"step times of each model's {len(PLANS)} plans (mean over {len(models)} models; "
        f"{', '.join(f'{o:.2f}' for o in orders)})"
    )
    print(
        f"Stage time: Spearman {spearman(times_p, times_m):.2f}, mean absolute error "
        f"{mape(times_p, times_m):.0f}% over {len(runs)} runs (step time of 2 ranks)"
    )
    after = [r[5] for r in runs]
    middle = [(p + a) / 2 for p, a in zip(times_p, after)]
    moved = [a / p - 1 for p, a in zip(times_p, after)]
    print(
        f"Calibrated again after each model's runs: mean absolute error "
        f"{mape(after, times_m):.0f}%; the two calibrations' mean {mape(middle, times_m):.0f}%;"
        f" the second predicted "
        f"{min(moved):+.0%} to {max(moved):+.0%} against the first (the machine between them)"
    )
    print(
        f"Stage peak memory: Spearman {spearman(mem_p, mem_m):.2f}, mean absolute error "
        f"{mape(mem_p, mem_m):.0f}%"
    )


if __name__ == "__main__":
    main()
