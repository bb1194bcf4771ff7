"""Plan search: the candidate space, determinism, a plan that fits a device the default plan
does not, generated with `autopipe compile --search` and trained by train.py with the plan's
defaults exactly like PyTorch; and `autopipe plan` printing the table."""

from __future__ import annotations

import dataclasses
import json
import os
import pty
import re
import subprocess
import sys
import time
import types

import pytest
import torch

import models
from autopipe.cli import main as autopipe_main
from autopipe.compiler import CompileOptions, profile_step, trace_step
from autopipe.errors import PartitionError
from autopipe.partitioning import partition
from autopipe.partitioning.bounds import run_floor
from autopipe.partitioning.cost import unit_passes
import autopipe.partitioning.search as search_module
from autopipe.partitioning.search import (
    NOT_SEARCHED,
    PRUNED,
    Candidate,
    SearchProgress,
    candidates,
    forward_share,
    search,
    step_lower_bound,
    unsearched_note,
)
from autopipe.profiling import device_spec
from autopipe.runtime.core.schedules import placement, schedule_problem_for
from autopipe.runtime.core.pipeline import Pipeline
from autopipe.spec import load_example
from autopipe.verify import load_pipeline

from conftest import ROOT, compile_model, run_ranks, spec
from pipelines import STEPS, assert_same_training, reference_training

DEFAULT = dict(dp_shard=1, stages=2, ranks=2, schedule="1f1b", microbatches=4, accumulate=1, tp=1)


def test_candidates_cover_the_plan_space():
    """4 devices, 8 microbatches a step: every sharding degree dividing both, 1 or 2 stages
    per rank, each schedule that runs the placement, microbatch counts (at least one per rank)
    that with accumulation and shards make up the global batch."""
    found = candidates(4, 8, num_units=40)
    assert len(set(found)) == len(found)
    for c in found:
        assert c.microbatches * c.accumulate * c.dp_shard == 8
        assert c.ranks * c.dp_shard == 4 and c.stages in (c.ranks, 2 * c.ranks)
        assert c.microbatches >= c.ranks
        rank_of_stage = placement(c.schedule, c.stages, c.ranks)
        assert schedule_problem_for(c.schedule, rank_of_stage, c.ranks, c.microbatches) is None
    shapes = {(c.dp_shard, c.stages, c.schedule) for c in found}
    assert {(1, 4, "1f1b"), (1, 4, "gpipe"), (2, 2, "1f1b"), (4, 1, "gpipe")} <= shapes
    assert {(1, 8, "interleaved-1f1b"), (1, 8, "zbv"), (2, 4, "dualpipev")} <= shapes
    assert not any(c.schedule == "1f1b" and c.microbatches < c.stages for c in found)


@pytest.fixture(scope="module")
def gpt2_graph():
    example = load_example(spec("gpt2"))
    options = CompileOptions(stages=2)
    graph = trace_step(example, options)
    return graph, profile_step(graph, options, example)


def with_memory(profile, memory: float):
    return dataclasses.replace(profile, device=dataclasses.replace(profile.device, memory=memory))


def test_search_is_deterministic_and_best_first(gpt2_graph):
    graph, profile = gpt2_graph
    first = [p.to_json() for p in search(graph, profile, 2, global_batch=4, method="mpipe")]
    again = [p.to_json() for p in search(graph, profile, 2, global_batch=4, method="mpipe")]
    assert first == again
    fitting = [p for p in first if p["step_time"] is not None]
    assert fitting == first[: len(fitting)]
    rates = [p["throughput"] for p in fitting]
    assert all(a >= b * (1 - 5e-3) for a, b in zip(rates, rates[1:]))  # 3 digits tie


def small_device(graph, profile) -> float:
    """The smallest memory (in steps of 1/50 of the default plan's peak) at which some plan
    fits but the default one (2 stages, 1F1B, 4 microbatches) does not, with no margin (every
    candidate partitioned: none pruned)."""
    roomy = next(
        p for p in search(graph, profile, 2, global_batch=4, method="mpipe", prune=False)
        if dataclasses.asdict(p.candidate) == DEFAULT
    )  # fmt: skip
    for fifty in range(30, 50):
        memory = roomy.peak_memory * fifty / 50
        plans = search(
            graph, with_memory(profile, memory), 2, global_batch=4, method="mpipe", margin=0.0,
            prune=False,
        )  # fmt: skip
        default = next(p for p in plans if dataclasses.asdict(p.candidate) == DEFAULT)
        if plans[0].fits and not default.fits:
            return memory
    raise AssertionError("no memory where the search fits and the default plan does not")


@pytest.mark.slow
def test_search_fits_a_device_the_default_plan_does_not_and_trains_exactly(tmp_path, gpt2_graph):
    graph, profile = gpt2_graph
    memory = small_device(graph, profile)
    small = device_spec("h100").to_json() | {"name": "small", "memory": memory}
    spec_file = tmp_path / "small.json"
    spec_file.write_text(json.dumps(small))
    with pytest.raises(PartitionError):
        partition(graph, with_memory(profile, memory), 2)  # the default plan
    out = tmp_path / "pipe"
    result = compile_model(
        "gpt2", out, 1, devices=2, search=True, global_batch=4, memory_margin=0.0,
        device_spec=str(spec_file),
    )  # fmt: skip
    settings = result.partition.settings
    chosen = settings.plans[0]
    assert max(result.partition.predicted.device_memory) <= memory
    assert (chosen["stages"], chosen["schedule"]) == (
        result.partition.num_stages,
        settings.schedule,
    )
    assert chosen["microbatches"] * chosen["accumulate"] * chosen["dp_shard"] == 4
    pipeline = Pipeline.from_json(load_pipeline(out).PIPELINE)
    assert pipeline.plan.microbatches == chosen["microbatches"]
    assert pipeline.default_accumulate == chosen["accumulate"]
    assert pipeline.dp_shard == chosen["dp_shard"]
    assert pipeline.plan.step_time == pytest.approx(chosen["step_time"])

    # train.py with no plan flags runs the plan: its schedule, microbatches, accumulation, shards
    example = load_example(spec("gpt2"))
    torch.save(example.model.state_dict(), tmp_path / "init.pt")
    log, saved = tmp_path / "log.jsonl", tmp_path / "trained.pt"
    run = run_ranks(
        out / "train.py", 2, "--steps", str(STEPS), "--data", "tests/models.py:gpt2_batch",
        "--load", str(tmp_path / "init.pt"), "--save", str(saved), "--log-json", str(log),
    )  # fmt: skip
    records = [json.loads(line) for line in log.read_text().splitlines()]
    pipe = [r["loss"] for r in records], torch.load(saved, weights_only=True)
    reference = reference_training(example, models.gpt2_batch, STEPS, "adamw", 1e-3)
    assert_same_training(pipe, reference)
    # the plan is the "small" H100's, and this run is on the CPU: said once, at the start, and
    # no MFU, no step compared with the plan (issue 42)
    assert not any("mfu" in r for r in records)
    assert run.stdout.count("the plan was made for small, this run is on the cpu: ") == 1
    assert "its plan" not in run.stdout and "s of compute per step" in run.stdout


def test_plan_command_prints_the_plans(capsys):
    """The plan table on stdout; no progress on a stderr that is not a terminal (a pipe, a
    log file: test_plan_progress_on_a_terminal draws it on a pseudo-terminal)."""
    given = ["plan", spec("gpt2"), "--devices", "2", "--top", "5", "--memory-margin", "0.05"]
    assert autopipe_main(given) == 0
    out, err = capsys.readouterr()
    assert "candidates" not in err and "plan search" not in err
    assert "plans for 2 devices" in out and "dp-shard" in out and "step ms" in out
    assert len([line for line in out.splitlines() if re.match(r" *\d+ +\d+ +\d+ ", line)]) == 5
    # the command that compiles the best plan repeats every option of the search but plan's own
    best = next(line for line in out.splitlines() if line.startswith("best: "))
    assert best.startswith(
        f"best: autopipe compile {spec('gpt2')} --out DIR --search --devices 2 --memory-margin 0.05  "
    )


def test_search_needs_devices():
    with pytest.raises(Exception, match="--search needs --devices"):
        CompileOptions(stages=1, search=True)


# -- a budget and progress (issue 23, item 4) ---------------------------------------------------
def test_search_seconds_is_honoured(gpt2_graph, monkeypatch):
    """A clock that moves 1 s at each reading: with a 2.5 s budget the search partitions the
    candidates it starts within 2.5 s and marks the rest not searched; the best of those leads."""
    graph, profile = gpt2_graph
    every = search(graph, profile, 2, global_batch=8, method="mpipe")
    ticks = iter(range(10_000))
    monkeypatch.setattr(search_module, "monotonic", lambda: float(next(ticks)))
    told: list[SearchProgress] = []
    plans = search(
        graph, profile, 2, global_batch=8, method="mpipe", seconds=2.5, progress=told.append
    )
    done = [p for p in plans if p.problem != NOT_SEARCHED]
    # readings: 0 at the start, then per candidate one before it (from the 2nd) and one after
    assert len(done) == 2 and len(plans) == len(every) > 2
    assert [(t.done, t.total) for t in told] == [(1, len(every)), (2, len(every))]
    assert plans[0].fits and all(not p.fits for p in plans if p.problem == NOT_SEARCHED)
    assert [p.candidate for p in done] == [p.candidate for p in every if p.candidate in {
        d.candidate for d in done
    }]  # the first candidates, in their order  # fmt: skip
    message = unsearched_note(plans)
    assert message is not None and message.startswith(
        f"--search-seconds ran out after 2 of {len(every)} candidates"
    )
    assert unsearched_note(every) is None
    best = told[-1].best
    assert best is not None and str(told[-1]).startswith(f"2/{len(every)} candidates, ")
    assert "best so far: " in str(told[-1])


@pytest.mark.parametrize("devices, global_batch", [(2, 8), (4, 16)])
def test_pruning_never_drops_the_best_plan(gpt2_graph, devices, global_batch):
    """Against the unpruned search (every candidate partitioned), with room and on a device
    small enough to need recomputation: the same best plan, step and peak; every plan's step
    is at least its lower bound; and (with room) the bound prunes candidates."""
    graph, profile = gpt2_graph
    compute = sum(unit.forward + unit.backward for unit in profile.units)
    lead = forward_share(*unit_passes(profile))
    for prof in (profile, with_memory(profile, small_device(graph, profile))):
        every = search(
            graph, prof, devices, global_batch=global_batch, method="mpipe", margin=0.0,
            prune=False,
        )  # fmt: skip
        pruned = search(graph, prof, devices, global_batch=global_batch, method="mpipe", margin=0.0)
        assert every[0].fits and not any(p.problem.startswith(PRUNED) for p in every)
        assert pruned[0].to_json() == every[0].to_json()
        for plan in every:
            if plan.fits:
                assert plan.step_time >= step_lower_bound(plan.candidate, compute, lead)
        assert [p.candidate for p in pruned if p.fits] == [
            p.candidate for p in every if p.fits and p.candidate in {q.candidate for q in pruned if q.fits}
        ]  # fmt: skip
        if prof is profile:  # with room, the bound prunes
            assert any(p.problem.startswith(PRUNED) for p in pruned)


def test_a_sharded_bf16_plan_is_bounded_without_its_weight_casts(gpt2_graph):
    """Under --bf16 FSDP2 takes autocast's casts of the weights off a sharded stage's forward:
    the search bounds those plans by the compute without them, so that none costs less than
    its bound (a bound with the casts would prune plans that are better than it)."""
    graph, _ = gpt2_graph
    options = CompileOptions(stages=2, bf16=True, device_spec="h100")
    bf16 = profile_step(graph, options, load_example(spec("gpt2")))
    whole, sharded = unit_passes(bf16), unit_passes(bf16, fsdp=True)
    assert sum(sharded[0]) < sum(whole[0]) and sharded[1] == whole[1]
    compute = sum(sharded[0]) + sum(sharded[1])
    lead = forward_share(*sharded)
    plans = search(graph, bf16, 4, global_batch=16, method="mpipe", margin=0.0, prune=False)
    shards = [plan for plan in plans if plan.fits and plan.candidate.dp_shard > 1]
    assert shards
    for plan in shards:
        assert plan.step_time >= step_lower_bound(plan.candidate, compute, lead)


@pytest.mark.parametrize("devices, global_batch", [(4, 16)])
def test_workers_find_the_plans_of_one_process(gpt2_graph, devices, global_batch):
    """Two forked workers partitioning candidates at once: every plan as one process finds it
    (the same table, pruned candidates included), with room and short of memory; progress is
    told once per candidate, the last time for all of them."""
    graph, profile = gpt2_graph
    for prof in (profile, with_memory(profile, small_device(graph, profile))):
        alone = search(graph, prof, devices, global_batch=global_batch, method="mpipe")
        told: list[SearchProgress] = []
        forked = search(
            graph, prof, devices, global_batch=global_batch, method="mpipe", workers=2,
            progress=told.append,
        )  # fmt: skip
        assert [p.to_json() for p in forked] == [p.to_json() for p in alone]
        assert [p.partition for p in forked] == [p.partition for p in alone]
        assert [t.done for t in told] == list(range(1, len(alone) + 1))
        assert told[-1].total == len(alone) and told[-1].best is not None
        # the fastest plan, as the ranking counts it (ties to 3 digits rank by memory)
        assert f"{told[-1].best.throughput:.3g}" == f"{alone[0].throughput:.3g}"


def test_workers_partition_a_placement_together(gpt2_graph, monkeypatch):
    """With workers, the candidates sharing a multi-stage placement (shards, ranks, stages,
    microbatches: their schedules differ) go to one worker together, where the partitioner
    solves the placement once; every other candidate alone; and the table is one process's."""
    graph, profile = gpt2_graph
    groups: list[list[Candidate]] = []
    submit = search_module._Workers.submit

    def spy(self, group, plans):
        groups.append([plan.candidate for plan in plans])
        submit(self, group, plans)

    monkeypatch.setattr(search_module._Workers, "submit", spy)
    alone = search(graph, profile, 4, global_batch=16, method="mpipe")
    forked = search(graph, profile, 4, global_batch=16, method="mpipe", workers=2)
    assert [p.to_json() for p in forked] == [p.to_json() for p in alone]
    assert any(len(group) > 1 for group in groups)
    for group in groups:
        shapes = {(c.tp, c.dp_shard, c.stages, c.ranks, c.microbatches) for c in group}
        placements = {tuple(placement(c.schedule, c.stages, c.ranks)) for c in group}
        assert len(shapes) == len(placements) == 1, group
        assert len(group) == 1 or group[0].stages > group[0].ranks
    submitted = [c for group in groups for c in group]
    assert len(submitted) == len(set(submitted))  # none partitioned twice


def _fake_partitions(graph, profile, devices, global_batch, steps_and_seconds):
    """A stand-in for partitioning: each candidate (in search order) gets the step and takes
    the seconds ``steps_and_seconds(index, bound)`` gives, so that workers finish out of order."""
    listed = candidates(devices, global_batch, len(graph.units))
    compute = sum(unit.forward + unit.backward for unit in profile.units)
    bounds = [step_lower_bound(c, compute, forward_share(*unit_passes(profile))) for c in listed]
    order = sorted(range(len(listed)), key=lambda c: (bounds[c], c))
    fake = {
        listed[c]: steps_and_seconds(index, bounds[c], bounds[order[0]])
        for index, c in enumerate(order)
    }

    def partitioned(plan, *_):
        step, seconds = fake[plan.candidate]
        time.sleep(seconds)
        plan.partition = types.SimpleNamespace(
            recompute=[], recompute_blocks=[], settings=types.SimpleNamespace(mesh=None)
        )
        plan.prediction = types.SimpleNamespace(device_memory=[1.0], bubble=0.0)
        plan.step_time = step

    return partitioned


def test_workers_cite_the_best_plan_one_process_knew(gpt2_graph, monkeypatch):
    """The first candidate is the best and slow to partition, the second quick and slower:
    while the first runs, the main process prunes with the second's step; the table still
    cites the first's, as one process does (issue found in review)."""
    graph, profile = gpt2_graph

    def steps(index, bound, first):
        if index == 0:
            return first, 2.0
        return (first * 1.3, 0.05) if index == 1 else (bound * 10, 0.01)

    monkeypatch.setattr(
        search_module, "_partitioned", _fake_partitions(graph, profile, 4, 16, steps)
    )
    alone = search(graph, profile, 4, global_batch=16, method="mpipe")
    forked = search(graph, profile, 4, global_batch=16, method="mpipe", workers=2)
    assert [p.to_json() for p in forked] == [p.to_json() for p in alone]
    assert any(p.problem.startswith(PRUNED) for p in alone)


def test_workers_count_only_searched_candidates_as_done(gpt2_graph, monkeypatch):
    """With --search-seconds, the candidates left out are not counted as done when the last
    running ones finish."""
    graph, profile = gpt2_graph
    monkeypatch.setattr(
        search_module,
        "_partitioned",
        _fake_partitions(graph, profile, 4, 16, lambda index, bound, first: (bound * 2, 0.4)),
    )
    told: list[SearchProgress] = []
    plans = search(
        graph, profile, 4, global_batch=16, method="mpipe", workers=2, seconds=0.5,
        progress=told.append, prune=False,
    )  # fmt: skip
    searched = [p for p in plans if p.problem != NOT_SEARCHED]
    assert [t.done for t in told] == list(range(1, len(searched) + 1))
    assert len(searched) < len(plans)


def test_workers_honour_the_search_seconds(gpt2_graph):
    """With two workers and a budget spent at once, the first candidate is partitioned (by a
    worker) and every other is not searched."""
    graph, profile = gpt2_graph
    plans = search(graph, profile, 4, global_batch=8, method="mpipe", workers=2, seconds=1e-9)
    done = [p for p in plans if p.problem != NOT_SEARCHED]
    assert len(done) == 1 and done[0].fits and len(plans) > 2
    assert unsearched_note(plans) is not None


def test_lower_bound_counts_the_pipeline_fill():
    """p ranks, m microbatches: each rank's share, and with one stage per rank the least a
    pipeline run can take over any split, compute / (1 - (1 - 1/m)^p): m x compute for one
    rank, compute for one microbatch; with several stages per rank, the run floor of their
    placement (autopipe/partitioning/bounds.py)."""
    one = Candidate(dp_shard=1, stages=1, ranks=1, schedule="1f1b", microbatches=4, accumulate=2)
    assert step_lower_bound(one, 3.0) == pytest.approx(2 * 4 * 3.0)
    single = Candidate(1, 4, 4, "1f1b", 1, 1)
    assert step_lower_bound(single, 3.0) == pytest.approx(3.0)
    piped = Candidate(1, 4, 4, "1f1b", 8, 1)
    assert step_lower_bound(piped, 1.0) == pytest.approx(1 / (1 - (7 / 8) ** 4))
    assert step_lower_bound(piped, 1.0) > 8 / 4  # more than the ranks' share: the fill
    looped = Candidate(1, 8, 4, "interleaved-1f1b", 8, 1)
    assert step_lower_bound(looped, 1.0) == pytest.approx(
        run_floor(placement("interleaved-1f1b", 8, 4), 8, 1.0)
    )
    assert step_lower_bound(looped, 1.0) > 8 / 4  # the fill, smaller than one stage per rank's
    assert step_lower_bound(looped, 1.0) < step_lower_bound(piped, 1.0)
    # splitting off the weight gradients, the stages ahead delay the others by the forward
    zero_bubble = Candidate(1, 8, 4, "interleaved-zero-bubble", 8, 1)
    assert step_lower_bound(zero_bubble, 1.0, 0.3) == pytest.approx(
        run_floor(placement("interleaved-zero-bubble", 8, 4), 8, 0.3)
    )
    assert 8 / 4 <= step_lower_bound(zero_bubble, 1.0) < step_lower_bound(zero_bubble, 1.0, 0.3)


def test_lower_bound_of_very_deep_placements_is_the_ranks_share():
    """Beyond FLOOR_MOST_STAGES stages the search does not solve the run floor's program (a
    dense solve of that size takes seconds per shape): each rank's share, still a bound."""
    ranks = search_module.FLOOR_MOST_STAGES
    deep = Candidate(1, 2 * ranks, ranks, "interleaved-1f1b", 2 * ranks, 3)
    assert step_lower_bound(deep, 1.0) == pytest.approx(3 * 2.0)
    shallow = Candidate(1, ranks, ranks // 2, "interleaved-1f1b", ranks, 3)
    assert step_lower_bound(shallow, 1.0) > 3 * 2.0  # solved: the fill counts


def test_search_seconds_option_is_checked():
    for bad in (0, -1.0, float("nan"), "1"):
        with pytest.raises(Exception, match="--search-seconds must be a number of seconds"):
            CompileOptions(stages=1, search=True, devices=2, search_seconds=bad)


PLAN_COMMAND = [
    sys.executable,
    "-m",
    "autopipe",
    "plan",
    spec("gpt2"),
    "--devices",
    "2",
    "--global-batch",
    "4",
    "--top",
    "3",
]


def test_plan_progress_on_a_terminal(tmp_path):
    """The search's progress is drawn on a terminal's stderr (a pseudo-terminal here; left out
    of one that is not: test_plan_command_prints_the_plans)."""
    leader, follower = pty.openpty()
    env = dict(os.environ, COLUMNS="160", TERM="xterm")
    with subprocess.Popen(
        PLAN_COMMAND, stdout=subprocess.PIPE, stderr=follower, cwd=ROOT, env=env
    ) as process:
        os.close(follower)
        drawn = b""
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the terminal closed with the process
                break
            if not chunk:
                break
            drawn += chunk
        process.wait(timeout=300)
    os.close(leader)
    assert process.returncode == 0
    text = drawn.decode(errors="replace")
    assert re.search(r"plan search \.\.\. \d+/\d+ candidates", text), text[-2000:]
    assert "best so far: " in text and re.search(r"plan search +\d+\.\d+ s", text)
