"""Plan search: the whole training plan for a number of devices, chosen by simulation.

A plan is a sharding degree (``--dp-shard N``: N data-parallel ranks per stage, so the pipeline
runs on devices / N ranks), a number of stages per rank, a schedule that runs that placement, a
microbatch count with the gradient accumulation that makes up the global batch, and the
recomputation the partitioner chooses to make each rank fit. Every candidate is partitioned and
simulated; the plan with the best throughput whose every rank fits its memory less a safety
margin wins (ties: the simpler plan, in the order the candidates are listed, so the search is
deterministic).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import multiprocessing
import os
import sys
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from time import monotonic
from typing import Any

import torch

from .byte_units import format_bytes
from ..errors import DeviceMemoryError, PartitionError
from ..ir import Graph
from ..profiling.profile import Profile
from ..runtime.core.schedules import (
    MULTI_STAGE,
    INPUT_GRADIENTS_FREED,
    SPLIT_BACKWARD,
    V_SHAPED,
    placement,
    schedule_problem_for,
)
from . import partition
from .bounds import Crossings, crossings, memory_floor, run_floor
from .cost import CostModel, graph_facts, iteration_time, unit_passes
from .network import Network
from .partition import Partition, PredictedStep
from .tensor_parallel import sharded_profile
from ..tensor_parallel import find_regions, sharding_plan
from ..runtime.core.pipeline import PIPELINE_INNERMOST


@dataclass(frozen=True)
class Candidate:
    """One point of the search space."""

    dp_shard: int
    stages: int
    ranks: int  # pipeline ranks: devices / dp_shard
    schedule: str
    microbatches: int
    accumulate: int
    tp: int = 1  # tensor-parallel ranks per pipeline rank and shard (devices = ranks x shards x tp)

    @property
    def stages_per_rank(self) -> int:
        return self.stages // self.ranks


@dataclass
class Plan:
    """A candidate, partitioned and simulated (or why it cannot run)."""

    candidate: Candidate
    global_batch: int  # example microbatches per optimizer step, over all data-parallel ranks
    capacity: float  # bytes per device
    partition: Partition | None = None
    prediction: PredictedStep | None = None  # of one pipeline run
    step_time: float = float("inf")  # seconds per optimizer step
    problem: str = ""  # why it does not fit or run

    @property
    def fits(self) -> bool:
        return self.partition is not None and not self.problem

    @property
    def throughput(self) -> float:
        """Example microbatches per second over all devices."""
        return self.global_batch / self.step_time if self.fits else 0.0

    @property
    def peak_memory(self) -> float:
        return max(self.prediction.device_memory) if self.prediction else float("nan")

    @property
    def bubble(self) -> float:
        return self.prediction.bubble if self.prediction else float("nan")

    @property
    def recompute(self) -> str:
        """What the plan recomputes, in words."""
        if self.partition is None:
            return "-"
        parts = []
        if self.partition.recompute:
            parts.append("stages " + ",".join(map(str, self.partition.recompute)))
        if self.partition.recompute_blocks:
            parts.append(f"{len(self.partition.recompute_blocks)} blocks")
        return " + ".join(parts) or "none"

    def to_json(self) -> dict[str, Any]:
        """The plan as the package and the report record it."""
        return dataclasses.asdict(self.candidate) | {
            "global_batch": self.global_batch,
            "step_time": self.step_time if self.fits else None,
            "throughput": self.throughput,
            "bubble": self.bubble if self.prediction else None,
            "peak_memory": self.peak_memory if self.prediction else None,
            "capacity": self.capacity,
            "recompute": self.recompute,
            "problem": self.problem,
            "mesh": list(self.mesh),
        }

    @property
    def mesh(self) -> tuple[str, ...]:
        """The device mesh's order the plan is costed in (outermost first)."""
        if self.partition is None or self.partition.settings.mesh is None:
            return PIPELINE_INNERMOST
        return self.partition.settings.mesh


#: the problem of a candidate the search did not partition: its --search-seconds ran out first
NOT_SEARCHED = "not searched: --search-seconds ran out"
#: the start of the problem of a candidate whose lower bound shows it cannot beat the best plan
PRUNED = "pruned"
#: a candidate is pruned when its lower bound exceeds the best step found by more than this
#: share (plans whose throughputs agree to 3 significant digits tie in the ranking)
PRUNE_MARGIN = 0.01


def step_lower_bound(candidate: Candidate, compute: float, forward_share: float = 0.0) -> float:
    """Seconds per step no partition of this candidate can beat, ``compute`` being one
    microbatch's forward and backward over the whole model (transfers, recomputation, FSDP2
    traffic and the optimizer only add to it): ``accumulate`` pipeline runs, each at least
    :func:`.bounds.run_floor` of ``compute`` for the candidate's placement of stages. A
    schedule that splits off weight gradients (which may run last) delays the stages after one
    by its forward alone, at least ``forward_share`` of its compute (the least share of any
    unit); a whole backward by all of it. Each rank computes its share, and with one stage per
    rank (1F1B, GPipe: whole backwards) a run takes at least ``compute / (1 - (1 - 1/m)^p)``."""
    lead = forward_share if candidate.schedule in SPLIT_BACKWARD else 1.0
    c = candidate
    per_run = max(
        c.microbatches * compute / c.ranks,
        compute * _run_floor(c.schedule, c.stages, c.ranks, c.microbatches, lead),
    )
    return c.accumulate * per_run


@functools.lru_cache(maxsize=1024)
def _run_floor(schedule: str, stages: int, ranks: int, microbatches: int, lead: float) -> float:
    """:func:`.bounds.run_floor` of a schedule's placement (candidates share them): its closed
    form with one stage per rank and whole backwards; each rank's share alone beyond
    :data:`FLOOR_MOST_STAGES` stages (a dense solve of that size takes a second)."""
    if stages == ranks and lead == 1.0:
        return 1 / (1 - (1 - 1 / microbatches) ** ranks)
    if stages > FLOOR_MOST_STAGES:
        return microbatches / ranks
    return run_floor(placement(schedule, stages, ranks), microbatches, lead)


#: the most stages whose run floor the search solves for (more: each rank's share)
FLOOR_MOST_STAGES = 1024


@dataclass(frozen=True)
class SearchProgress:
    """How far a search is: candidates partitioned (``done``) of ``total``, the seconds spent,
    and the best plan that fits so far (None while none does)."""

    done: int
    total: int
    seconds: float
    best: Plan | None

    def __str__(self) -> str:
        """``12/140 candidates, 8.1 s; best so far: ...``."""
        text = f"{self.done}/{self.total} candidates, {self.seconds:.1f} s"
        if self.best is None:
            return text + "; none fits yet"
        c = self.best.candidate
        return (
            f"{text}; best so far: {c.stages} stages on {c.ranks} ranks x {c.dp_shard} shards, "
            f"{c.schedule}, {c.microbatches} microbatches x {c.accumulate}: "
            f"{self.best.step_time * 1e3:.1f} ms per step"
        )


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(
    devices: int,
    global_batch: int,
    num_units: int,
    max_stages_per_rank: int = 2,
    tp_degrees: tuple[int, ...] = (1,),
) -> list[Candidate]:
    """Every plan shape for ``devices`` devices and a step of ``global_batch`` microbatches:
    the tensor-parallel degrees of ``tp_degrees`` dividing the devices, sharding degrees
    dividing both the rest and the batch, 1 .. ``max_stages_per_rank`` stages per rank, the
    schedules of each placement, and the microbatch counts (at least one per rank) that divide
    a data-parallel rank's share of the batch."""
    found = []
    for tp in tp_degrees:
        if devices % tp == 0:
            found += _shapes(devices // tp, global_batch, num_units, max_stages_per_rank, tp)
    return found


def _shapes(
    devices: int, global_batch: int, num_units: int, max_stages_per_rank: int, tp: int
) -> list[Candidate]:
    """:func:`candidates` of one tensor-parallel degree, ``devices`` its places."""
    found = []
    for shard in divisors(devices):
        if global_batch % shard:
            continue
        ranks, share = devices // shard, global_batch // shard
        for per_rank in range(1, max_stages_per_rank + 1):
            stages = ranks * per_rank
            if stages > num_units or (per_rank > 1 and stages < 2):
                continue
            schedules = ["1f1b", "gpipe"] if per_rank == 1 else list(MULTI_STAGE)
            for schedule in schedules:
                if schedule in V_SHAPED and per_rank != 2:
                    continue
                rank_of_stage = placement(schedule, stages, ranks)
                for microbatches in divisors(share):
                    if microbatches < ranks:
                        continue
                    if schedule_problem_for(schedule, rank_of_stage, ranks, microbatches):
                        continue
                    found.append(
                        Candidate(
                            shard, stages, ranks, schedule, microbatches, share // microbatches, tp
                        )
                    )
    return found


def search(
    graph: Graph,
    profile: Profile,
    devices: int,
    *,
    global_batch: int,
    method: str,
    optimizer: str = "adamw",
    margin: float = 0.1,
    max_stages_per_rank: int = 2,
    seconds: float | None = None,
    progress: Callable[[SearchProgress], None] | None = None,
    prune: bool = True,
    workers: int = 1,
    gpus_per_node: int = 8,
    tp_degrees: tuple[int, ...] = (1,),
    sequence_parallel: bool | None = None,
) -> list[Plan]:
    """Every candidate plan, partitioned and simulated, best first: those that fit by
    throughput, then those that do not. Candidates are searched in the order of their lower
    bound (:func:`step_lower_bound`; candidates of equal bounds in their listed order); with
    ``prune``, one whose bound exceeds the best step found (by :data:`PRUNE_MARGIN`) is not
    partitioned, and neither are those after it (their problem says so); neither is one whose
    fullest device needs more than the device's memory whatever the split
    (:func:`.bounds.memory_floor`). With ``seconds``, the candidates left when that many seconds
    have passed are not partitioned (their problem is :data:`NOT_SEARCHED`; the first candidate
    always is); ``progress`` is told after each other candidate.

    With ``workers`` > 1 (on Linux), that many forked processes partition candidates at once,
    the next ones in the same order, a multi-stage placement's candidates (its schedules) in
    one worker together, where the partitioner solves the placement once; the plans are those
    of one process (a candidate the one process would have pruned is listed as pruned, though
    a worker partitioned it while the best plan was still being found), so the result does not
    depend on ``workers``.

    Each degree of ``tp_degrees`` (tensor parallelism, within a node) is searched on the
    profile each of its ranks runs (:func:`.tensor_parallel.sharded_profile`), its places on
    nodes of ``gpus_per_node / tp`` of them, sequence parallel as ``sequence_parallel`` asks
    (:func:`~autopipe.tensor_parallel.sharding_plan`)."""
    capacity = profile.device.memory
    usable = dataclasses.replace(
        profile, device=dataclasses.replace(profile.device, memory=capacity * (1 - margin))
    )
    regions = find_regions(graph) if any(t > 1 for t in tp_degrees) else None
    network = Network(usable.device, gpus_per_node)
    profiles = {
        t: (
            usable
            if t == 1 or regions is None
            else sharded_profile(
                graph, usable, sharding_plan(graph, regions, t, sequence_parallel), network
            )[0]
        )
        for t in tp_degrees
    }
    listed = candidates(devices, global_batch, len(graph.units), max_stages_per_rank, tp_degrees)
    # a unit's passes as a stage runs them, by tensor-parallel degree and sharding (FSDP2
    # takes a bf16 forward's casts of the parameters off it: :func:`.cost.unit_passes`)
    passes = {
        (t, fsdp): unit_passes(p, fsdp) for t, p in profiles.items() for fsdp in (False, True)
    }
    compute = {key: sum(f) + sum(b) for key, (f, b) in passes.items()}
    forward = {key: forward_share(f, b) for key, (f, b) in passes.items()}

    def passes_of(candidate: Candidate) -> tuple[int, bool]:
        return candidate.tp, candidate.dp_shard > 1

    bounds = [
        step_lower_bound(candidate, compute[passes_of(candidate)], forward[passes_of(candidate)])
        for candidate in listed
    ]
    every = sorted(range(len(listed)), key=lambda c: (bounds[c], c))
    # with workers, the candidates of one placement (their schedules and microbatch counts
    # aside) go to one worker together, in search order: a partitioner solves a placement once
    # for every schedule running it (:func:`.partition`), and split among workers each would
    # solve it again. Not where seconds are counted: each candidate is started on its own time.
    family = {c: _placement_family(listed[c]) for c in every}
    began, best = monotonic(), None
    settled: dict[int, Plan] = {}
    searched = 0  # candidates settled but those --search-seconds left out

    def settle(c: int, plan: Plan) -> None:
        nonlocal best, searched
        settled[c] = plan
        if plan.fits and (best is None or plan.throughput > best.throughput):
            best = plan
        if plan.problem != NOT_SEARCHED:
            searched += 1
            if progress is not None:
                progress(SearchProgress(searched, len(every), monotonic() - began, best))

    def outrun(c: int) -> bool:
        """Pruning, is the best plan so far faster than ``c`` can be?"""
        return prune and best is not None and bounds[c] > best.step_time * (1 + PRUNE_MARGIN)

    def worth(c: int) -> bool:
        """Not ruled out by its memory floor or (pruning) by the best plan so far."""
        return floors[c] <= usable.device.memory and not outrun(c)

    workers_or_none = (
        _Workers(workers, graph, profiles, method, optimizer, gpus_per_node)
        if workers > 1
        else contextlib.nullcontext()
    )
    with workers_or_none as pool:
        floors = (
            _memory_floors(graph, profiles, optimizer, listed, pool)
            if prune
            else [0.0] * len(listed)
        )
        for c in every:
            if c in settled or pool is not None and pool.took(c):
                continue  # partitioned with an earlier candidate of its family
            plan = Plan(listed[c], global_batch, capacity)
            if pool is not None:
                pool.wait_for_room(settle)
            if (
                (settled or pool and pool.busy)
                and seconds is not None
                and (monotonic() - began >= seconds)
            ):
                plan.problem = NOT_SEARCHED
            elif floors[c] > usable.device.memory:
                plan.problem = _short_of_memory(plan.candidate, floors[c])
            elif outrun(c):
                assert best is not None  # outrun
                plan.problem = _pruned(bounds[c], best)
            elif pool is not None:
                group = [c]
                if seconds is None and family[c] is not None:
                    group += [
                        d
                        for d in every
                        if d != c
                        and family[d] == family[c]
                        and d not in settled
                        and not pool.took(d)
                        and worth(d)
                    ]
                pool.submit(group, [Plan(listed[d], global_batch, capacity) for d in group])
                continue
            else:
                _partitioned(plan, graph, profiles, method, optimizer, gpus_per_node)
            settle(c, plan)
        if pool is not None:
            pool.finish(settle)
    plans = [settled[c] for c in every]
    if pool is not None and prune:
        _as_one_process(plans, [bounds[c] for c in every], [pool.took(c) for c in every])
    listing = {id(plan): c for plan, c in zip(plans, every)}
    # throughputs equal to 3 significant digits tie: then the plan needing the least memory
    return sorted(
        plans,
        key=lambda p: (
            not p.fits,
            -float(f"{p.throughput:.3g}"),
            p.peak_memory if p.fits else 0.0,
            listing[id(p)],
        ),
    )


def forward_share(forward: list[float], backward: list[float]) -> float:
    """The least share of its compute any unit spends on its forward, of units with those
    ``forward`` and ``backward`` seconds (0 if none computes)."""
    shares = [f / (f + b) for f, b in zip(forward, backward) if f + b > 0]
    return min(shares, default=0.0)


def _short_of_memory(shape: Candidate, floor: float) -> str:
    """The problem of a candidate whose fullest device needs more than it has, whatever the
    split (``floor`` bytes)."""
    held = "its share of the training state"
    if shape.dp_shard > 1 and shape.schedule in SPLIT_BACKWARD:
        held += ", its stages' parameters and gradients, gathered for the step"
    if shape.stages > 1:
        held += (
            f", and of the receive buffers of {shape.microbatches} microbatches at "
            f"{shape.stages - 1} stage boundaries"
        )
    return f"a device needs at least {format_bytes(floor)} whatever the split ({held})"


def _pruned(bound: float, best: Plan) -> str:
    return (
        f"{PRUNED}: at least {bound * 1e3:.1f} ms per step, slower than the best "
        f"plan's {best.step_time * 1e3:.1f} ms"
    )


def _as_one_process(plans: list[Plan], bounds: list[float], partitioned: list[bool]) -> None:
    """Mark pruned, in place, the plans (in search order, with their lower ``bounds``, those
    ``partitioned`` by a worker) that one process would have pruned: workers partition
    candidates before the best plan of the earlier ones is known, so they may partition more;
    and say of every pruned plan the best step one process knew when it pruned it."""
    best: Plan | None = None
    for index, (plan, bound) in enumerate(zip(plans, bounds)):
        if plan.problem.startswith(PRUNED):  # pruned as it was listed: cite one process's best
            assert best is not None, "a candidate is pruned after a plan that fits"
            plan.problem = _pruned(bound, best)
        elif not partitioned[index]:
            continue
        elif best is not None and bound > best.step_time * (1 + PRUNE_MARGIN):
            plans[index] = Plan(plan.candidate, plan.global_batch, plan.capacity)
            plans[index].problem = _pruned(bound, best)
        elif plan.fits and (best is None or plan.throughput > best.throughput):
            best = plan


class _Workers:
    """Forked processes partitioning candidates, at most one each at a time (what
    :func:`search` runs with ``workers`` > 1). The graph, the profile and the graph's facts
    are the parent's, inherited when the processes fork; each runs torch on one thread."""

    def __init__(
        self,
        workers: int,
        graph: Graph,
        profiles: dict[int, Profile],
        method: str,
        optimizer: str,
        gpus_per_node: int,
    ) -> None:
        graph_facts(graph)  # computed once, before the fork, for every worker
        self.workers = workers
        self.executor = ProcessPoolExecutor(
            workers,
            mp_context=multiprocessing.get_context("fork"),
            initializer=_start_worker,
            initargs=(graph, profiles, method, optimizer, gpus_per_node),
        )
        self.running: dict[Future[list[Plan]], list[int]] = {}
        self.submitted: set[int] = set()

    def __enter__(self) -> _Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def busy(self) -> bool:
        return bool(self.running)

    def took(self, c: int) -> bool:
        """Did a worker partition candidate ``c``?"""
        return c in self.submitted

    def submit(self, group: list[int], plans: list[Plan]) -> None:
        """Partition candidates ``group`` (their ``plans``) one after the other in a worker."""
        self.submitted.update(group)
        self.running[self.executor.submit(_partition_in_worker, plans)] = group

    def wait_for_room(self, settle: Callable[[int, Plan], None]) -> None:
        """Settle finished candidates, waiting for one while every worker is busy."""
        self._settle(settle, most_running=self.workers - 1)

    def finish(self, settle: Callable[[int, Plan], None]) -> None:
        """Settle every candidate still running."""
        self._settle(settle, most_running=0)

    def _settle(self, settle: Callable[[int, Plan], None], most_running: int) -> None:
        """Settle the finished candidates (in search order), waiting while more than
        ``most_running`` run."""
        while self.running:
            waiting = len(self.running) > most_running
            done, _ = wait(
                self.running, timeout=None if waiting else 0, return_when=FIRST_COMPLETED
            )
            if not done:
                return
            for future in sorted(done, key=self.running.__getitem__):
                for c, plan in zip(self.running.pop(future), future.result()):
                    settle(c, plan)

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)


#: what a worker partitions with: the graph, the usable profile of each tensor-parallel degree,
#: the method, the optimizer and the node size
_WORK: tuple[Graph, dict[int, Profile], str, str, int] | None = None


def _start_worker(
    graph: Graph, profiles: dict[int, Profile], method: str, optimizer: str, gpus_per_node: int
) -> None:
    global _WORK
    _WORK = (graph, profiles, method, optimizer, gpus_per_node)
    torch.set_num_threads(1)  # the workers are the parallelism


def _partition_in_worker(plans: list[Plan]) -> list[Plan]:
    assert _WORK is not None, "a worker partitions after _start_worker"
    for plan in plans:
        _partitioned(plan, *_WORK)
    return plans


def _crossings_in_worker(needed: tuple[int, int, bool]) -> Crossings:
    """:func:`.bounds.crossings` of a degree's cost model (``(tp, dp_shard, kept)``)."""
    assert _WORK is not None, "a worker cuts after _start_worker"
    graph, profiles, _method, optimizer, _gpus = _WORK
    tp, shard, kept = needed
    model = CostModel(graph, profiles[tp], optimizer=optimizer, dp_shard=shard)
    return crossings(model, input_gradients_kept=kept)


def _placement_family(candidate: Candidate) -> tuple[object, ...] | None:
    """What candidates share a partitioner's solve by: the placement of a multi-stage
    schedule (looped or V-shaped) with its shards, ranks, stages, microbatches and degree;
    None for one stage per rank (each schedule solved on its own)."""
    if candidate.stages == candidate.ranks:
        return None
    c = candidate
    shape = tuple(placement(c.schedule, c.stages, c.ranks))
    return (c.tp, c.dp_shard, c.stages, c.ranks, c.microbatches, shape)


def default_workers() -> int:
    """Worker processes a plan search uses by default: the CPUs this process may run on, at
    most 8, where processes fork (Linux); else 1."""
    if not sys.platform.startswith("linux"):
        return 1
    return max(1, min(8, len(os.sched_getaffinity(0))))


def _memory_floors(
    graph: Graph,
    profiles: dict[int, Profile],
    optimizer: str,
    listed: list[Candidate],
    pool: _Workers | None = None,
) -> list[float]:
    """Each candidate's :func:`.bounds.memory_floor`: the least its fullest device needs (the
    boundaries' least crossings cut in the ``pool``'s workers, where there is one)."""
    if not listed:
        return []
    models = {
        (shard, tp): CostModel(graph, profiles[tp], optimizer=optimizer, dp_shard=shard)
        for shard, tp in sorted({(c.dp_shard, c.tp) for c in listed})
    }
    # what crosses the boundaries is each degree's own (sequence parallel: a slice)
    first_of_degree = {tp: shard for shard, tp in reversed(sorted(models))}
    needed = [
        (tp, shard, kept)
        for tp, shard in first_of_degree.items()
        for kept in sorted({c.schedule not in INPUT_GRADIENTS_FREED for c in listed})
    ]
    if pool is not None:
        cut = list(pool.executor.map(_crossings_in_worker, needed))
    else:
        cut = [
            crossings(models[shard, tp], input_gradients_kept=kept) for tp, shard, kept in needed
        ]
    crossed = {(tp, kept): found for (tp, _shard, kept), found in zip(needed, cut)}
    return [
        memory_floor(
            models[c.dp_shard, c.tp],
            c.stages,
            c.ranks,
            c.microbatches,
            crossed[c.tp, c.schedule not in INPUT_GRADIENTS_FREED],
            c.schedule,
        )
        for c in listed
    ]


def _partitioned(
    plan: Plan,
    graph: Graph,
    profiles: dict[int, Profile],
    method: str,
    optimizer: str,
    gpus_per_node: int,
) -> None:
    """``plan``'s candidate partitioned under the usable profile of its tensor-parallel degree
    (less the memory margin), its prediction and step time filled in, or its problem."""
    candidate = plan.candidate
    try:
        plan.partition = partition(
            graph,
            profiles[candidate.tp],
            candidate.stages,
            num_devices=candidate.ranks,
            method=method,
            schedule=candidate.schedule,
            microbatches=candidate.microbatches,
            optimizer=optimizer,
            dp_shard=candidate.dp_shard,
            advise=False,  # the table shows what each rank needs; advice comes once
            compare=False,  # the table compares the candidates
            gpus_per_node=max(1, gpus_per_node // candidate.tp),
        )
        if candidate.tp > 1:
            # the node size of the cluster, not of its places of tp ranks
            plan.partition = plan.partition.with_settings(
                tp=candidate.tp, gpus_per_node=gpus_per_node
            )
    except DeviceMemoryError as exc:
        plan.problem = f"a device needs at least {format_bytes(exc.peak)}, even recomputing"
        return
    except PartitionError as exc:
        plan.problem = str(exc).split(". ")[0]
        return
    plan.prediction = plan.partition.predicted
    assert plan.prediction is not None  # partition() predicts every partition it makes
    plan.step_time = iteration_time(plan.prediction, candidate.accumulate)


def unsearched_note(plans: list[Plan]) -> str | None:
    """What a search stopped by ``--search-seconds`` left out, in words (None if nothing)."""
    left = sum(1 for plan in plans if plan.problem == NOT_SEARCHED)
    if not left:
        return None
    return (
        f"--search-seconds ran out after {len(plans) - left} of {len(plans)} candidates: the "
        f"plan is the best of those searched ({left} not searched; give more seconds, or fewer "
        "candidates with --global-batch / --max-stages-per-device, to search them)"
    )


def plan_table(plans: list[dict[str, Any]]) -> str:
    """Plans (``Plan.to_json()``, best first) side by side, as a text table; ``tp``: the
    tensor-parallel degree (innermost, within a node); ``inner``: the ranks next to each other
    after it (within a node), ``pp`` a pipeline's, ``dp`` a stage's shards."""
    header = (
        f"{'#':>2} {'tp':>2} {'dp-shard':>8} {'stages':>6} {'per rank':>8} {'schedule':<23} "
        f"{'inner':>6} {'mb':>3} {'accum':>5} {'step ms':>9} {'mb/s':>8} {'bubble':>6} "
        f"{'peak':>10} {'of':>10}  recompute"
    )
    rows = [header]
    for i, plan in enumerate(plans):
        capacity = format_bytes(plan["capacity"])
        if plan["step_time"] is not None:
            figures = (
                f"{plan['step_time'] * 1e3:9.3f} {plan['throughput']:8.1f} {plan['bubble']:6.0%} "
                f"{format_bytes(plan['peak_memory']):>10} {capacity:>10}  {plan['recompute']}"
            )
        else:
            figures = f"{'-':>9} {'-':>8} {'-':>6} {'-':>10} {capacity:>10}  {plan['problem']}"
        per_rank = plan["stages"] // plan["ranks"]
        # which ranks sit next to each other (in a node): a pipeline's, or a stage's shards
        inner = "dp" if plan.get("mesh", ["pp"])[-1] != "pp" else "pp"
        rows.append(
            f"{i:>2} {plan.get('tp', 1):>2} {plan['dp_shard']:>8} {plan['stages']:>6} {per_rank:>8} "
            f"{plan['schedule']:<23} {inner:>6} {plan['microbatches']:>3} "
            f"{plan['accumulate']:>5} {figures}"
        )
    return "\n".join(rows)


def state_floor(graph: Graph, profile: Profile, *, optimizer: str, margin: float) -> str:
    """In words: the fewest devices any plan needs for the model's parameters, gradients and
    optimizer state alone, however they are split and sharded, on ``profile``'s device less the
    ``margin``."""
    model = CostModel(graph, profile, optimizer=optimizer)
    state = model.training_state_bytes
    usable = profile.device.memory * (1 - margin)
    return (
        f"the model's parameters, gradients and optimizer state alone take {format_bytes(state)}: "
        f"at least {math.ceil(state / usable)} devices of {format_bytes(usable)} whatever the plan"
    )
