"""What training at each batch's own length (``--dynamic``) buys over padding every batch to the
longest length a static pipeline was compiled for.

    python benchmarks/dynamic_lengths.py                 # CPU, gloo (about 3 minutes here)
    python benchmarks/dynamic_lengths.py --device cuda   # NCCL, one GPU per rank (2 GPUs)

examples/finetune.py's GPT-2 (4 layers, n_embd 128, bytes as tokens) learns from paragraphs of
Python's reference documentation, 16 per step grouped by length (2 stages, 4 microbatches):

- static (the baseline): compiled for 4 x 256, every batch padded to 256 tokens,
- ``--dynamic`` seq and batch: each step at its own length (its longest paragraph),
- ``--dynamic`` with ``--pad-to-multiple 32``: at most 8 distinct lengths.

Padding never changes the loss (masked out of attention, ignored by the loss), so the runs' losses
agree up to dropout's random draws (the example trains with dropout, whose masks depend on the
shapes); the table compares step time and real (unpadded) tokens per second. Step times
are medians after the first 2 steps; compare rows of one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from commands import REPO, run

WARMUP = 2
DYNAMIC = [
    "--dynamic",
    "seq[16:256]=input_ids:1,attention_mask:1,labels:1",
    "--dynamic",
    "batch[2:8]=input_ids:0,attention_mask:0,labels:0",
]
SPECS = f"""
import sys
sys.path.insert(0, {str(REPO / "examples")!r})
import finetune


def build_static():
    model, args, kwargs = finetune.build()
    return model, args, padded_to_max(kwargs)


def padded_to_max(batch):
    missing = finetune.MAX_LENGTH - batch["input_ids"].shape[1]
    fill = {{"input_ids": 0, "attention_mask": 0, "labels": finetune.IGNORE}}
    pad = lambda name, t: __import__("torch").nn.functional.pad(t, (0, missing), value=fill[name])
    return {{name: pad(name, t) for name, t in batch.items()}}


def batches_padded_to_max(step):
    args, kwargs = finetune.batches(step)
    return args, padded_to_max(kwargs)


def real_tokens(step):
    return int(finetune.batches(step)[1]["attention_mask"].sum())
"""


def train(package: Path, data: str, flags: list[str], args: argparse.Namespace) -> list[dict]:
    log = package.parent / f"{package.name}-{len(flags)}.jsonl"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    run(
        [
            *torchrun, "--nproc-per-node=2", str(package / "train.py"), "--device", args.device,
            "--steps", str(args.steps), "--microbatches", "4", "--data", data,
            "--log-json", str(log), *flags,
        ]
    )  # fmt: skip
    return [json.loads(line) for line in log.read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--steps", type=int, default=12, help="steps per run (12)")
    args = parser.parse_args()
    if args.steps <= WARMUP:
        parser.error(f"--steps must be more than the {WARMUP} warm-up steps")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        specs = root / "specs.py"
        specs.write_text(SPECS)
        sys.path.insert(0, str(root))
        import specs as loaded  # noqa: E402 - written just above

        compile_ = [sys.executable, "-m", "autopipe", "compile", "--stages", "2", "--no-report"]
        run([*compile_, f"{specs}:build_static", "--out", str(root / "static")])
        run([*compile_, "examples/finetune.py:build", "--out", str(root / "dynamic"), *DYNAMIC])
        runs = [
            ("static, padded to 256 (baseline)", root / "static", "batches_padded_to_max", []),
            ("--dynamic", root / "dynamic", None, []),
            ("--dynamic --pad-to-multiple 32", root / "dynamic", None, ["--pad-to-multiple", "32"]),
        ]
        tokens = [loaded.real_tokens(step) for step in range(args.steps)]
        print(f"device {args.device}, {args.steps} steps, {sum(tokens) / args.steps:.0f} real "
              "tokens per step on average\n")  # fmt: skip
        print("| run | step s | vs baseline | real tokens/s | last loss |")
        print("|---|---|---|---|---|")
        baseline = None
        for label, package, data_fn, flags in runs:
            data = f"{specs}:{data_fn}" if data_fn else "examples/finetune.py:batches"
            records = train(package, data, flags, args)
            seconds = statistics.median(r["time"] for r in records[WARMUP:])
            rate = sum(tokens[WARMUP:]) / sum(r["time"] for r in records[WARMUP:])
            baseline = baseline or seconds
            print(f"| {label} | {seconds:.3f} | {baseline / seconds:.2f}x | {rate:,.0f} | "
                  f"{records[-1]['loss']:.6f} |")  # fmt: skip


if __name__ == "__main__":
    main()
