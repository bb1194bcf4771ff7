"""What each rank holds with --dp-shard against replicated stages, and what overlapping the
gradient reduction with the backward buys.

    python benchmarks/data_parallel.py                 # CPU, gloo (about 7 minutes here)
    python benchmarks/data_parallel.py --device cuda   # NCCL, one GPU per rank (8 GPUs)

A GPT-2 (8 layers, n_embd 1024, vocab 4096, microbatch 1 x 128; 105 M parameters) is compiled into
2 stages (``autopipe compile --method dp --schedule 1f1b --dp-shard 2``), then trained by its train.py under
torchrun, 2 microbatches per data-parallel rank, AdamW, for ``--steps`` steps:

- memory: replicated stages (``--dp 2``, the baseline) against ``--dp-shard 2`` and
  ``--dp-shard 4`` (each stage's parameters, gradients and AdamW state in N shards, a block
  gathered at a time) and ``--dp-shard 2 --gather step`` (gathered once per step). Per rank:
  ``state_bytes`` from train.py's log (parameters + gradients + optimizer state it holds) and the
  peak memory (CUDA: the most allocated; CPU: the process's peak resident size, which includes
  the Python and torch runtime, about 0.6 GiB here),
- time: ``--dp 2`` with the gradient reduction during the last backward (default) against
  ``--no-dp-overlap`` (after it, the previous runtime's behaviour). On CPU, gloo runs collectives
  on the calling thread: there is nothing to overlap with, so expect equal times there.

Every run is a fresh torchrun; step times are medians after the first 2 steps. On a shared CPU
timings are noisy: compare rows of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from commands import REPO, run

WARMUP = 2

MODEL = """
import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging
logging.set_verbosity_error()

def gpt2():
    torch.manual_seed(0)
    config = GPT2Config(n_layer=8, n_embd=1024, n_head=16, vocab_size=4096, n_positions=128,
                        use_cache=False, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, config.vocab_size, (1, 128))
    return model, (ids,), {"labels": ids.clone()}
"""

MEMORY_RUNS = [  # label, world size per stage pair, train.py flags
    ("replicated --dp 2 (baseline)", 2, ["--dp", "2"]),
    ("--dp-shard 2", 2, ["--dp-shard", "2"]),
    ("--dp-shard 4", 4, ["--dp-shard", "4"]),
    ("--dp-shard 2 --gather step", 2, ["--dp-shard", "2", "--gather", "step"]),
]
OVERLAP_RUNS = [
    ("--dp 2 --no-dp-overlap (baseline)", 2, ["--dp", "2", "--no-dp-overlap"]),
    ("--dp 2 (overlapped)", 2, ["--dp", "2"]),
]


def train(package: Path, ranks: int, flags: list[str], args: argparse.Namespace) -> list[dict]:
    """The JSON log of one train.py run on ``ranks`` data-parallel ranks per stage."""
    log = package.parent / f"log-{abs(hash(tuple(flags)))}.jsonl"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    run(
        [
            *torchrun,
            f"--nproc-per-node={2 * ranks}",
            str(package / "train.py"),
            "--device",
            args.device,
            "--steps",
            str(args.steps),
            "--microbatches",
            "2",
            "--log-json",
            str(log),
            *flags,
        ],
        REPO,
    )
    return [json.loads(line) for line in log.read_text().splitlines()]


def median_step(records: list[dict]) -> float:
    return statistics.median(r["time"] for r in records[WARMUP:])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--steps", type=int, default=6, help="steps per run (6)")
    args = parser.parse_args()
    if args.steps <= WARMUP:
        parser.error(f"--steps must be more than the {WARMUP} warm-up steps")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "model.py").write_text(MODEL)
        package = root / "pipe"
        run(
            [
                sys.executable, "-m", "autopipe", "compile", f"{root / 'model.py'}:gpt2",
                "--stages", "2", "--method", "dp", "--schedule", "1f1b", "--out", str(package),
                "--dp-shard", "2", "--no-report",
            ],
            REPO,
        )  # fmt: skip
        print(f"load average {os.getloadavg()[0]:.1f}, device {args.device}\n")
        print("| run | ranks | state per rank MiB | vs baseline | peak per rank MiB | vs baseline "
              "| step s |")  # fmt: skip
        print("|---|---|---|---|---|---|---|")
        base_state = base_peak = None
        for label, ranks, flags in MEMORY_RUNS:
            records = train(package, ranks, flags, args)
            state = max(records[-1]["state_bytes"]) / 2**20
            peak = max(records[-1]["peak_memory"]) / 2**20
            base_state, base_peak = base_state or state, base_peak or peak
            print(
                f"| {label} | {2 * ranks} | {state:.1f} | {state / base_state:.2f} | {peak:.0f} | "
                f"{peak / base_peak:.2f} | {median_step(records):.3f} |"
            )
        print("\n| run | step s | vs baseline |")
        print("|---|---|---|")
        base_time = None
        for label, ranks, flags in OVERLAP_RUNS:
            seconds = median_step(train(package, ranks, flags, args))
            base_time = base_time or seconds
            print(f"| {label} | {seconds:.3f} | {seconds / base_time:.2f} |")


if __name__ == "__main__":
    main()
