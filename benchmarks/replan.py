"""What ``autopipe replan`` gains on a run with one slow rank: the step of the package before
and after re-partitioning from the run's own trace.

    python benchmarks/replan.py            # 3 rounds of 8 steps per package
    python benchmarks/replan.py --quick    # 1 round

The tests' GPT-2 (tests/models.py:gpt2) is compiled into 2 stages and trained on 2 gloo ranks
with rank 1 made ``--factor`` times slower (tests/slowed_train.py: each of its stage forwards
sleeps that many times its own duration, as a slower device would), traced; ``autopipe replan``
re-partitions it from that trace (synthetic data, the package's own). Each round then trains both packages, alternately, with the
same slowed rank: the old package is the baseline of the same run. Step time: the median of
train.py's own step times (``--log-json``) after the first 2 steps, pooled over the rounds.
Timings on a shared CPU are noisy: compare the rows of one run.
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
MICROBATCHES = 8


def train(package: Path, factor: float, steps: int, *extra: str) -> list[float]:
    """Step times of ``package`` trained on 2 ranks, rank 1 slowed ``factor`` times."""
    os.environ.update(SLOWED_PACKAGE=str(package), SLOWED_RANK="1", SLOWED_FACTOR=str(factor))
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "log.jsonl"
        run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
             str(REPO / "tests" / "slowed_train.py"), "--steps", str(steps),
             "--log-json", str(log), *extra]
        )  # fmt: skip
        entries = [json.loads(line) for line in log.read_text().splitlines()]
        return [e["time"] for e in entries if "loss" in e][WARMUP:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--factor", type=float, default=10.0, help="how much slower rank 1 is")
    args = parser.parse_args()
    rounds = 1 if args.quick else args.rounds
    print(f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs, rank 1 {args.factor:g}x")
    with tempfile.TemporaryDirectory() as tmp:
        old, new, trace = Path(tmp) / "old", Path(tmp) / "new", Path(tmp) / "trace"
        run([sys.executable, "-m", "autopipe", "compile", "tests/models.py:gpt2", "--stages", "2",
             "--out", str(old), "--no-report", "--quiet"])  # fmt: skip
        train(old, args.factor, 4, "--microbatches", str(MICROBATCHES),
              "--trace", str(trace), "--trace-steps", "1:4")  # fmt: skip
        printed = run([sys.executable, "-m", "autopipe", "replan", str(old),
                       "--from-trace", str(trace), "--out", str(new), "--no-report"])  # fmt: skip
        predicted = next((line for line in printed.splitlines() if "shorter" in line), "")
        times: dict[str, list[float]] = {"old": [], "new": []}
        for _ in range(rounds):
            times["old"] += train(old, args.factor, args.steps, "--microbatches", str(MICROBATCHES))
            times["new"] += train(new, args.factor, args.steps)  # its default: the traced run's
    base = statistics.median(times["old"])
    print(f"replan predicted: {predicted.strip() or '(no gain printed)'}")
    print(f"\n{'package':<26} {'steps':>6} {'s/step':>9} {'vs before':>10}")
    for name, label in (("old", "compiled (before replan)"), ("new", "replanned from the trace")):
        step = statistics.median(times[name])
        print(f"{label:<26} {len(times[name]):>6} {step:>9.4f} {(step / base - 1) * 100:>+9.1f}%")


if __name__ == "__main__":
    main()
