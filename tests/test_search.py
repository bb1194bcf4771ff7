"""Plan search: the candidate space, determinism, a plan that fits a device the default plan
does not, generated with `autopipe compile --search` and trained by train.py with the plan's
defaults exactly like PyTorch; and `autopipe plan` printing the table."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

import models
from autopipe.cli import main as autopipe_main
from autopipe.compiler import CompileOptions, profile_step, trace_step
from autopipe.errors import PartitionError
from autopipe.partitioning import partition
from autopipe.partitioning.search import candidates, search
from autopipe.profiling import device_spec
from autopipe.runtime.core.schedules import placement, schedule_problem_for
from autopipe.runtime.core.pipeline import Pipeline
from autopipe.spec import load_example
from autopipe.verify import load_pipeline

from conftest import compile_model, spec, torchrun
from pipelines import STEPS, assert_same_training, reference_training

DEFAULT = dict(dp_shard=1, stages=2, ranks=2, schedule="1f1b", microbatches=4, accumulate=1)


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
    fits but the default one (2 stages, 1F1B, 4 microbatches) does not, with no margin."""
    roomy = next(
        p for p in search(graph, profile, 2, global_batch=4, method="mpipe")
        if dataclasses.asdict(p.candidate) == DEFAULT
    )  # fmt: skip
    for fifty in range(30, 50):
        memory = roomy.peak_memory * fifty / 50
        plans = search(
            graph, with_memory(profile, memory), 2, global_batch=4, method="mpipe", margin=0.0
        )
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
    torchrun(
        out / "train.py", 2, "--steps", str(STEPS), "--data", "tests/models.py:gpt2_batch",
        "--load", str(tmp_path / "init.pt"), "--save", str(saved), "--log-json", str(log),
    )  # fmt: skip
    records = [json.loads(line) for line in log.read_text().splitlines()]
    pipe = [r["loss"] for r in records], torch.load(saved, weights_only=True)
    reference = reference_training(example, models.gpt2_batch, STEPS, "adamw", 1e-3)
    assert_same_training(pipe, reference)
    assert all("mfu" in r for r in records)


def test_plan_command_prints_the_plans(capsys):
    assert autopipe_main(["plan", spec("gpt2"), "--devices", "2", "--top", "5"]) == 0
    out = capsys.readouterr().out
    assert "plans for 2 devices" in out and "dp-shard" in out and "step ms" in out
    assert len([line for line in out.splitlines() if re.match(r" *\d+ +\d+ +\d+ ", line)]) == 5
    assert "best: autopipe compile" in out and "--search --devices 2" in out


def test_search_needs_devices():
    with pytest.raises(Exception, match="--search needs --devices"):
        CompileOptions(stages=1, search=True)
