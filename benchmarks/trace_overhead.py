"""What ``train.py --trace`` costs a step: the same run with and without recording every action.

    python benchmarks/trace_overhead.py            # 2 and 4 stages, 3 rounds of 12 steps each
    python benchmarks/trace_overhead.py --quick    # 2 stages, alone and sharded, 1 round
    python benchmarks/trace_overhead.py --device cuda

The GPT-2 of examples/gpt2.py is compiled into K stages (``autopipe compile --stages K``) and
trained by ``torchrun --nproc-per-node=K train.py --steps N --microbatches 8`` twice per round: as
is (the baseline) and with ``--trace DIR --trace-steps 0:N`` (every step recorded: each
forward/backward of each microbatch, sends and receives, reductions, optimizer; written once at
the end); and with each stage sharded over 2 FSDP2 ranks (``--dp-shard 2``, 4 microbatches per
shard), where ``--trace`` also runs torch's profiler to record each unit's unshard, reshard and
reduction. The runs of a round alternate, so drift of a shared machine hits both alike. Step time:
the median of train.py's own step times (``--log-json``) after the first 2 steps, pooled over the
rounds. Timings on a shared CPU are noisy: compare the rows of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from commands import REPO, run  # noqa: E402  (the benchmarks' shared helpers, beside this file)

WARMUP = 2


def step_times(log: Path) -> list[float]:
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    return [e["time"] for e in entries if "loss" in e][WARMUP:]


#: (name, stages, data-parallel shards): each rank holds one stage of one shard; the example's
#: batches are 16 rows, 8 microbatches of 2 split over the shards
LAYOUTS = [("2 stages", 2, 1), ("4 stages", 4, 1), ("2 stages x 2 FSDP2 shards", 2, 2)]


def train(
    package: Path, stages: int, shards: int, args: argparse.Namespace, extra: list[str]
) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "log.jsonl"
        run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             f"--nproc-per-node={stages * shards}", str(package / "train.py"), "--device",
             args.device, "--steps", str(args.steps), "--microbatches", str(8 // shards),
             "--dp-shard", str(shards), "--log-json", str(log),
             "--data", "examples/gpt2.py:batches", *extra]
        )  # fmt: skip
        if extra:  # the trace was really written
            assert (Path(extra[1]) / "trace.json").is_file(), "no trace.json written"
        return step_times(log)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 stages, alone and sharded, 1 round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    layouts = [LAYOUTS[0], LAYOUTS[2]] if args.quick else LAYOUTS
    rounds = 1 if args.quick else args.rounds
    print(f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs, device {args.device}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, stages, shards in layouts:
            package = Path(tmp) / f"gpt2_{stages}"
            if not package.exists():
                run([sys.executable, "-m", "autopipe", "compile", "examples/gpt2.py:build",
                     "--stages", str(stages), "--out", str(package), "--no-report", "--quiet"])  # fmt: skip
            plain: list[float] = []
            traced: list[float] = []
            for _ in range(rounds):
                plain += train(package, stages, shards, args, [])
                trace = Path(tmp) / f"trace_{stages}_{shards}"
                traced += train(package, stages, shards, args,
                                ["--trace", str(trace), "--trace-steps", f"0:{args.steps}"])  # fmt: skip
            base, with_trace = statistics.median(plain), statistics.median(traced)
            rows.append((name, base, with_trace, len(plain)))
    print(
        f"\n{'layout':<26} {'steps':>6} {'baseline s/step':>16} {'--trace s/step':>15} "
        f"{'overhead':>9}"
    )
    for name, base, with_trace, count in rows:
        overhead = (with_trace - base) / base * 100
        print(f"{name:<26} {count:>6} {base:>16.4f} {with_trace:>15.4f} {overhead:>8.1f}%")


if __name__ == "__main__":
    main()
