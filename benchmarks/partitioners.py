"""Partitioners against the baselines users have today, by simulated training step.

    python benchmarks/partitioners.py                  # the full table (a few minutes)
    python benchmarks/partitioners.py --quick          # small models only
    python benchmarks/partitioners.py --cpu-check      # also time real stages on this CPU

Models are built from transformers configs on the meta device (no weights), traced, and profiled
analytically for one GPU (--gpu, default A100). For 2, 4 and 8 devices each method's partition is
simulated for one training step (1F1B, 4 x devices microbatches) and compared with

- uniform: the same number of transformer blocks per stage (DeepSpeed partition_method="uniform"),
- params: contiguous blocks balancing parameter counts (DeepSpeed partition_method="parameters"),
- time: contiguous blocks balancing block time (what torchgpipe's balance_by_time aims at),
- bound: max(total compute / devices, heaviest unit), a lower bound on the busiest device.

Baselines cut only between blocks (embeddings go with the first block, the head with the last),
as those tools do; autopipe's methods cut anywhere between units. "mpipe 2x" runs Mixed-Pipe with
twice as many stages as devices.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.utils import logging

from autopipe import empty_weights
from autopipe.compiler import CompileOptions, generate_step, trace_step
from autopipe.partitioning import Partition, partition
from autopipe.partitioning.cost import CostModel
from autopipe.profiling import device_spec, profile
from autopipe.profiling.profile import graph_digest
from autopipe.runtime.core.pipeline import Pipeline
from autopipe.spec import Example

logging.set_verbosity_error()

METHODS = ("dp", "metis", "acyclic", "mpipe")
BLOCKS = ("GPT2Block", "BertLayer", "T5Block")


def build(name: str) -> tuple[Example, str]:
    """A model (on meta) and an example microbatch, by benchmark name."""
    import transformers as tf

    with empty_weights():  # parameters on meta, buffers (BERT's position_ids) real
        if name.startswith("gpt2"):
            sizes = {"gpt2-small": (12, 768, 12), "gpt2-xl": (48, 1600, 25)}[name]
            config = tf.GPT2Config(
                n_layer=sizes[0], n_embd=sizes[1], n_head=sizes[2], use_cache=False
            )
            model, batch, seq = tf.GPT2LMHeadModel(config), (4 if name == "gpt2-small" else 1), 1024
        elif name.startswith("bert"):
            sizes = {"bert-base": (12, 768, 12, 3072), "bert-large": (24, 1024, 16, 4096)}[name]
            config = tf.BertConfig(
                num_hidden_layers=sizes[0],
                hidden_size=sizes[1],
                num_attention_heads=sizes[2],
                intermediate_size=sizes[3],
            )
            model, batch, seq = tf.BertForMaskedLM(config), 8, 512
        else:
            sizes = {"t5-small": (6, 512, 8, 64, 2048), "t5-3b": (24, 1024, 32, 128, 16384)}[name]
            config = tf.T5Config(
                num_layers=sizes[0],
                d_model=sizes[1],
                num_heads=sizes[2],
                d_kv=sizes[3],
                d_ff=sizes[4],
                use_cache=False,
                decoder_start_token_id=0,
                pad_token_id=0,
            )
            model, batch, seq = (
                tf.T5ForConditionalGeneration(config),
                (8 if name == "t5-small" else 4),
                512,
            )
    ids = torch.randint(0, 1000, (batch, seq))
    kwargs = {"labels": torch.randint(0, 1000, (batch, seq // 4 if name.startswith("t5") else seq))}
    return Example(model, (ids,), kwargs), f"{batch}x{seq}"


# -- baselines ----------------------------------------------------------------------------------
def layers(graph) -> list[list[int]]:
    """Units grouped like an nn.Sequential of transformer blocks: each block is a layer; units
    outside blocks join the next block (the ones after the last block join it)."""
    result: list[list[int]] = []
    pending: list[int] = []
    current = None
    for unit in graph.units:
        node = graph[unit.nodes[0]]
        block = next((s.key for s in node.scope if s.class_name in BLOCKS), None)
        if block is None:
            pending.append(unit.index)
            continue
        if block != current:
            result.append(pending + [unit.index])
            pending, current = [], block
        else:
            result[-1].append(unit.index)
    if pending:
        result[-1].extend(pending)
    return result


def min_max_split(weights: list[float], parts: int) -> list[int]:
    """Contiguous split of ``weights`` into ``parts`` minimising the largest sum: first index of
    each part (exact dynamic programme)."""
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], prefix[j] - prefix[i])
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    starts, j = [], n
    for k in range(parts, 0, -1):
        j = cut[k][j]
        starts.append(j)
    return sorted(starts)


def baseline(graph, model: CostModel, kind: str, num_stages: int) -> list[int]:
    blocks = layers(graph)
    if kind == "uniform":
        starts = [round(i * len(blocks) / num_stages) for i in range(num_stages)]
    else:
        weights = []
        for block in blocks:
            if kind == "params":
                weights.append(sum(model.param_bytes[u] for u in block))
            else:
                weights.append(sum(model.compute[u] for u in block))
        starts = min_max_split(weights, num_stages)
    stage_of_unit = [0] * model.num_units
    for stage, start in enumerate(starts):
        end = starts[stage + 1] if stage + 1 < len(starts) else len(blocks)
        for block in blocks[start:end]:
            for unit in block:
                stage_of_unit[unit] = stage
    return stage_of_unit


# -- the table ----------------------------------------------------------------------------------
@dataclass
class Row:
    model: str
    devices: int
    results: dict[str, tuple[float, float]]  # name -> (step time, busiest device), seconds
    bound: float
    seconds: dict[str, float]


def run_model(name: str, devices_list: list[int], gpu: str) -> list[Row]:
    example, shape = build(name)
    start = time.perf_counter()
    graph = trace_step(example, CompileOptions(stages=1))
    prof = profile(graph, "analytic", device_spec(gpu))
    print(
        f"# {name} ({shape}, {len(graph.calls)} operators, {len(graph.units)} units): traced and profiled in {time.perf_counter() - start:.1f} s",
        file=sys.stderr,
    )
    rows = []
    for devices in devices_list:
        microbatches = 4 * devices
        model = CostModel(graph, prof, microbatches=microbatches)
        results, seconds = {}, {}
        for kind in ("uniform", "params", "time"):
            prediction = model.evaluate(
                baseline(graph, model, kind, devices), list(range(devices)), "1f1b"
            )
            results[kind] = (prediction.step_time, prediction.bottleneck)
        for method, stages in [(m, devices) for m in METHODS] + [("mpipe 2x", 2 * devices)]:
            begin = time.perf_counter()
            part = partition(
                graph,
                prof,
                stages,
                num_devices=devices,
                method=method.split()[0],
                microbatches=microbatches,
            )
            seconds[method] = time.perf_counter() - begin
            results[method] = (part.predicted.step_time, part.predicted.bottleneck)
        rows.append(Row(name, devices, results, model.lower_bound(devices), seconds))
    return rows


def print_table(rows: list[Row]) -> None:
    names = ["uniform", "params", "time", *METHODS, "mpipe 2x"]
    print(
        "Simulated step time in ms (busiest device per microbatch in ms); bound = lower bound on the busiest device"
    )
    print(
        f"| model | devices | {' | '.join(names)} | bound | default vs bound | mpipe vs best baseline |"
    )
    print("|" + "---|" * (len(names) + 5))
    for row in rows:
        cells = [f"{row.results[n][0] * 1e3:.1f} ({row.results[n][1] * 1e3:.1f})" for n in names]
        best_baseline = min(row.results[k][0] for k in ("uniform", "params", "time"))
        best_mpipe = min(row.results["mpipe"][0], row.results["mpipe 2x"][0])
        default = row.results[DEFAULT][1]
        print(
            f"| {row.model} | {row.devices} | {' | '.join(cells)} | {row.bound * 1e3:.1f} | "
            f"+{(default / row.bound - 1) * 100:.1f}% | {(1 - best_mpipe / best_baseline) * 100:+.1f}% |"
        )
    print()
    print(
        "Partitioning time in seconds:",
        ", ".join(
            f"{n} {statistics.mean(r.seconds[n] for r in rows):.2f}" for n in rows[0].seconds
        ),
    )


# -- real stages on CPU -------------------------------------------------------------------------
def cpu_check(devices: int = 4, rounds: int = 15) -> None:
    """Time each generated stage of a small GPT-2 for real on this CPU, for every method and
    baseline, and compare the measured busiest stage with the simulator's ranking. Partitions are
    timed in interleaved rounds (one thread), so background noise spreads over all of them."""
    import transformers as tf

    from autopipe.runtime.support import stage_state
    from autopipe.verify import load_pipeline

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = tf.GPT2Config(
        n_layer=8,
        n_embd=256,
        n_head=4,
        vocab_size=4096,
        n_positions=128,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = tf.GPT2LMHeadModel(config)
    ids = torch.randint(0, 4096, (4, 128))
    example = Example(model, (ids,), {"labels": ids})
    graph = trace_step(example, CompileOptions(stages=1))
    prof = profile(graph, "measured", device_spec("a100"), example)
    cost = CostModel(graph, prof, microbatches=4 * devices)
    candidates = {
        kind: baseline(graph, cost, kind, devices) for kind in ("uniform", "params", "time")
    }
    for method in METHODS:
        candidates[method] = partition(graph, prof, devices, method=method).stage_of_unit
    unique: dict[tuple, list[str]] = {}
    for name, stage_of_unit in candidates.items():
        unique.setdefault(tuple(stage_of_unit), []).append(name)
    state = model.state_dict()
    with tempfile.TemporaryDirectory() as tmp:
        runs = []
        for i, (stage_of_unit, names) in enumerate(unique.items()):
            out = Path(tmp) / f"p{i}"
            generate_step(
                graph,
                Partition(names[0], list(stage_of_unit), list(range(devices)), graph_digest(graph)),
                out,
            )
            package = load_pipeline(out)
            pipeline = Pipeline.from_json(package.PIPELINE)
            stages = []
            for k in range(devices):
                stage = package.build_stage(k, init=False)
                stage.load_state_dict(stage_state(stage, state, pipeline.aliases))
                stages.append(stage)
            runs.append((names, pipeline, stages, [[] for _ in range(devices)]))
        for _ in range(rounds + 2):
            for _names, pipeline, stages, samples in runs:
                for k, seconds in enumerate(_time_stages(pipeline, stages, example)):
                    samples[k].append(seconds)
    print(
        f"\nReal stage times on this CPU (1 thread): GPT-2 {config.n_layer} layers, {devices} stages, measured profile, median of {rounds}"
    )
    print("| partition | predicted busiest stage ms | measured busiest stage ms |")
    print("|---|---|---|")
    predicted, measured = {}, {}
    for names, _pipeline, _stages, samples in runs:
        label = " = ".join(names)
        stage_of_unit = candidates[names[0]]
        predicted[label] = cost.evaluate(stage_of_unit, list(range(devices)), "1f1b").bottleneck
        measured[label] = max(statistics.median(s[2:]) for s in samples)
        print(f"| {label} | {predicted[label] * 1e3:.2f} | {measured[label] * 1e3:.2f} |")
    rank_p = {n: i for i, n in enumerate(sorted(predicted, key=predicted.get))}
    rank_m = {n: i for i, n in enumerate(sorted(measured, key=measured.get))}
    n = len(rank_p)
    rho = (
        1 - 6 * sum((rank_p[k] - rank_m[k]) ** 2 for k in rank_p) / (n * (n * n - 1))
        if n > 1
        else 1.0
    )
    print(
        f"Spearman rank correlation over {n} distinct partitions, predicted vs measured busiest stage: {rho:.2f}"
    )


def _time_stages(pipeline: Pipeline, stages: list, example: Example) -> list[float]:
    """One forward + backward of every stage, chained on the example microbatch, in seconds."""
    env = dict(zip(pipeline.signature, example.args)) | example.kwargs
    times = []
    for spec, stage in zip(pipeline.stages, stages):
        inputs = [
            env[v.name].detach().requires_grad_(v.requires_grad) for v in pipeline.taken(spec)
        ]
        begin = time.perf_counter()
        outputs = stage(*inputs)
        grads = [(o, torch.ones_like(o)) for o in outputs if o.requires_grad]
        torch.autograd.backward([o for o, _ in grads], [g for _, g in grads])
        times.append(time.perf_counter() - begin)
        env.update(zip(spec.outputs, [o.detach() for o in outputs]))
    return times


DEFAULT = "mpipe"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small models only")
    parser.add_argument(
        "--gpu", default="a100", help="device spec of the analytic profile (default a100)"
    )
    parser.add_argument(
        "--cpu-check",
        action="store_true",
        help="also time real stages of a small GPT-2 on this CPU",
    )
    args = parser.parse_args()
    names = (
        ["gpt2-small", "bert-base", "t5-small"]
        if args.quick
        else ["gpt2-small", "gpt2-xl", "bert-base", "bert-large", "t5-small", "t5-3b"]
    )
    rows = [row for name in names for row in run_model(name, [2, 4, 8], args.gpu)]
    print(f"GPU {args.gpu}, analytic profile, 1F1B, microbatches = 4 x devices")
    print_table(rows)
    if args.cpu_check:
        cpu_check()


if __name__ == "__main__":
    main()
