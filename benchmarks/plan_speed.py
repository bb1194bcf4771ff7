"""How fast ``autopipe plan`` finds a plan for the models that need a pipeline, and how good it is.

    python benchmarks/plan_speed.py                  # every case below
    python benchmarks/plan_speed.py --quick          # Llama-3-8B on 8 devices, with the reference
    python benchmarks/plan_speed.py --case 70b-64    # one case
    python benchmarks/plan_speed.py --reference 8b-8,8b-64   # also search with the reference
    python benchmarks/plan_speed.py --workers 1      # every search in one process

Each case runs the work of ``autopipe plan`` (trace the model, profile it analytically for the
H100, search every plan for the devices and the global batch) in a child process of its own,
timed, with its peak resident memory as the operating system counts it. The search partitions
candidates in worker processes forked from it (``--search-workers``; by default one per CPU,
here 2). The models are Llama-3-8B, -70B and Llama-3.1-405B from benchmarks/llama.py: empty
weights, bf16, sequence 4096, microbatch 1. Printed per case: seconds (tracing and profiling,
then the search), the workers, peak memory (of the searching process; and of it with its
workers, sampled: their proportional set sizes summed, so pages they share count once),
the best plan (stages x data-parallel shards, schedule, microbatches x accumulation, what it
recomputes), its bottleneck against the lower bound (one microbatch's compute on the busiest
device against the model's compute over the devices of one pipeline), bubble and predicted MFU
(model FLOPs per step over the step time and the devices' bf16 peak; bubble, recomputation and
the FSDP2 traffic no compute hides all count).

``--reference`` also searches with every simulation walking the events (the reference the fast
path must equal, :func:`autopipe.partitioning.simulator.reference_simulation`) and compares: the
same best plan and step, and how much slower the reference is. It is skipped where it would not
finish within ``--reference-seconds``.

Targets (issue 23, on the 2 cores of this machine): Llama-3-70B on 64 devices, global batch 256,
planned in under 60 s and 2 GB with a predicted MFU of at least 35%; Llama-3.1-405B on 512 devices
in under 5 minutes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Case:
    name: str
    model: str  # FUNCTION of benchmarks/llama.py
    devices: int
    global_batch: int


CASES = [
    Case("8b-8", "llama_8b", 8, 16),
    Case("8b-64", "llama_8b", 64, 256),
    Case("70b-64", "llama_70b", 64, 256),
    Case("70b-512", "llama_70b", 512, 1024),
    Case("405b-512", "llama_405b", 512, 1024),
]
#: the cases --reference covers by default (the others would not finish in reasonable time)
REFERENCE_CASES = ("8b-8",)


class ProportionalPeak:
    """The most memory this process and its children (the search's workers) held together,
    sampled every ``interval`` seconds: the sum of their proportional set sizes (Linux's Pss:
    a page shared by n processes counts 1/n in each), so pages the forked workers share with
    their parent count once. 0 where /proc has no smaps_rollup."""

    def __init__(self, interval: float = 0.5) -> None:
        self.peak, self.interval = 0, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> ProportionalPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            pids = [os.getpid()]
            for task in Path(f"/proc/{os.getpid()}/task").glob("*/children"):
                pids += [int(pid) for pid in task.read_text().split()]
            total = 0
            for pid in pids:
                try:
                    rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
                except OSError:  # gone, or no smaps_rollup here
                    continue
                for line in rollup.splitlines():
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
            self.peak = max(self.peak, total)


def child(case: Case, reference: bool, workers: int | None) -> dict[str, object]:
    """The work of ``autopipe plan`` for ``case``, in this process (its search's workers
    forked from it): its figures."""
    from autopipe.compiler import CompileOptions, plan_step, profile_step, trace_step
    from autopipe.partitioning.search import default_workers
    from autopipe.partitioning.simulator import reference_simulation
    from autopipe.spec import load_example

    spec = f"{REPO / 'benchmarks' / 'llama.py'}:{case.model}"
    started = time.perf_counter()
    example = load_example(spec)
    workers = workers or default_workers()
    options = CompileOptions(
        stages=1,
        devices=case.devices,
        global_batch=case.global_batch,
        search=True,
        search_workers=workers,
    )
    graph = trace_step(example, options, source=spec)
    prof = profile_step(graph, options, example)
    traced = time.perf_counter()
    with ProportionalPeak() as together:
        if reference:
            with reference_simulation():
                plans = plan_step(graph, prof, options)
        else:
            plans = plan_step(graph, prof, options)
    searched = time.perf_counter()
    best = plans[0]
    figures: dict[str, object] = {
        "trace_seconds": traced - started,
        "search_seconds": searched - traced,
        # the process's peak resident memory (Linux: kilobytes), and its largest worker's
        "peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "worker_peak_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
        "together_bytes": together.peak,
        "workers": workers,
        "candidates": len(plans),
        "fits": best.fits,
        # the best plan of each tensor-parallel degree: its step, or why none runs
        "degrees": _best_by_degree(plans),
    }
    if best.fits and best.prediction is not None and best.partition is not None:
        c, predicted = best.candidate, best.prediction
        assert predicted.flops is not None and predicted.peak_flops is not None
        mfu = (
            predicted.flops
            * best.global_batch
            / (best.step_time * case.devices * predicted.peak_flops)
        )
        figures |= {
            "plan": f"{c.stages}st/{c.ranks}r x {c.dp_shard}sh"
            + (f" x tp{c.tp}" if c.tp > 1 else "")
            + f" {c.schedule} {c.microbatches}mb x{c.accumulate}",
            "recompute": best.recompute,
            "step_time": best.step_time,
            "bottleneck": predicted.bottleneck,
            "lower_bound": predicted.lower_bound,
            "bubble": predicted.bubble,
            "mfu": mfu,
        }
    return figures


def _best_by_degree(plans: list) -> dict[str, str]:
    """The best plan of each tensor-parallel degree searched, in words (plans best first)."""
    found: dict[str, str] = {}
    for plan in plans:
        degree = str(plan.candidate.tp)
        if degree in found:
            continue
        if plan.fits:
            c = plan.candidate
            tokens = plan.global_batch * 4096 / plan.step_time / (c.ranks * c.dp_shard * c.tp)
            found[degree] = (
                f"{plan.step_time:.2f} s ({c.stages}st/{c.ranks}r x {c.dp_shard}sh, "
                f"{c.schedule}, {tokens:.0f} tokens/s/GPU)"
            )
        else:
            found[degree] = plan.problem.split(",")[0]
    return dict(sorted(found.items(), key=lambda item: int(item[0])))


def run_case(
    case: Case, reference: bool, timeout: float | None, workers: int | None
) -> dict[str, object] | None:
    """``child`` in a process of its own: its figures and wall seconds (None if it ran past
    ``timeout``)."""
    command = [sys.executable, __file__, "--child", case.name]
    if workers:
        command += ["--workers", str(workers)]
    if reference:
        command.append("--as-reference")
    started = time.perf_counter()
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, cwd=REPO, env=dict(os.environ, PYTHONWARNINGS="ignore")
    )
    try:
        out, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        return None
    wall = time.perf_counter() - started
    if process.returncode:
        raise SystemExit(f"{case.name}: the plan search failed (exit {process.returncode})")
    figures: dict[str, object] = json.loads(out.decode().strip().splitlines()[-1])
    figures["wall_seconds"] = wall
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="Llama-3-8B on 8 devices only")
    parser.add_argument("--case", action="append", help="a case to run (repeatable)")
    parser.add_argument(
        "--reference",
        default=",".join(REFERENCE_CASES),
        help="cases also searched with the reference simulation, comma-separated ('' for none)",
    )
    parser.add_argument(
        "--reference-seconds",
        type=float,
        default=1200.0,
        help="the longest a reference search may run before it is given up",
    )
    parser.add_argument(
        "--workers",
        type=int,
        help="processes each search partitions candidates in (autopipe's --search-workers; "
        "default: its default, the CPUs it may use)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--as-reference", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    by_name = {case.name: case for case in CASES}
    if args.child:
        print(json.dumps(child(by_name[args.child], args.as_reference, args.workers)))
        return
    names = ["8b-8"] if args.quick else (args.case or list(by_name))
    reference = {name for name in args.reference.split(",") if name}
    print(f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs; H100 analytic")
    header = (
        f"{'case':<9} {'trace s':>7} {'search s':>8} {'workers':>7} {'peak GB':>7} "
        f"{'all GB':>6}  {'best plan':<30} "
        f"{'recompute':<10} {'step s':>7} {'bneck/bound':>11} {'bubble':>6} {'MFU':>5}"
    )
    rows, comparisons = [header], []
    for name in names:
        case = by_name[name]
        figures = run_case(case, reference=False, timeout=None, workers=args.workers)
        assert figures is not None  # no timeout
        rows.append(_row(name, figures))
        print(rows[-1], flush=True)
        degrees = figures.get("degrees") or {}
        print(
            f"{name}: best plan of each tensor-parallel degree: "
            + "; ".join(f"tp {d}: {text}" for d, text in degrees.items()),  # type: ignore[union-attr]
            flush=True,
        )
        if name in reference:
            checked = run_case(
                case, reference=True, timeout=args.reference_seconds, workers=args.workers
            )
            comparisons.append(_comparison(name, figures, checked, args.reference_seconds))
    print()
    print("\n".join(rows))
    if comparisons:
        print()
        print("\n".join(comparisons))


def _row(name: str, f: dict[str, object]) -> str:
    peak = float(f["peak_bytes"]) / 1e9  # type: ignore[arg-type]
    workers = int(f["workers"])  # type: ignore[call-overload]
    # the search with its workers, their shared pages counted once (the sampled proportional
    # sizes); where /proc cannot say, at most each worker at the largest one's peak
    every = float(f["together_bytes"]) / 1e9  # type: ignore[arg-type]
    if not every:
        every = peak + workers * float(f["worker_peak_bytes"]) / 1e9  # type: ignore[arg-type]
    head = (
        f"{name:<9} {float(f['trace_seconds']):>7.1f} {float(f['search_seconds']):>8.1f} "  # type: ignore[arg-type]
        f"{workers:>7} {peak:>7.2f} {every:>6.2f}  "
    )
    if not f["fits"]:
        return head + "no plan fits"
    over = float(f["bottleneck"]) / float(f["lower_bound"])  # type: ignore[arg-type]
    return head + (
        f"{f['plan']!s:<30} {f['recompute']!s:<10} {float(f['step_time']):>7.2f} "  # type: ignore[arg-type]
        f"{over:>10.3f}x {float(f['bubble']) * 100:>5.1f}% {float(f['mfu']) * 100:>4.1f}%"  # type: ignore[arg-type]
    )


def _comparison(
    name: str, fast: dict[str, object], reference: dict[str, object] | None, limit: float
) -> str:
    if reference is None:
        return f"{name}: the reference search did not finish within {limit:.0f} s"
    same = fast.get("plan") == reference.get("plan") and math.isclose(
        float(fast.get("step_time", 0.0)), float(reference.get("step_time", 0.0)), rel_tol=1e-12  # type: ignore[arg-type]
    )
    speedup = float(reference["search_seconds"]) / float(fast["search_seconds"])  # type: ignore[arg-type]
    verdict = "the same best plan and step" if same else "A DIFFERENT BEST PLAN"
    return (
        f"{name}: reference search {float(reference['search_seconds']):.1f} s against "  # type: ignore[arg-type]
        f"{float(fast['search_seconds']):.1f} s (x{speedup:.1f}); {verdict}"  # type: ignore[arg-type]
    )


if __name__ == "__main__":
    main()
