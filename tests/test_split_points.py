"""Stage boundaries asked for as torch.distributed.pipelining users ask for them (issue 25, item
1): a model's pipe_split() markers and a split_spec, compiled where they say (--split-points)
or compared with autopipe's own split in the summary and the report; the marker never reaches
generated code; the pipelines match PyTorch in one process and train like it under torchrun."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch.distributed.pipelining import SplitPoint, pipe_split

import models
from autopipe.compiler import CompileOptions, trace_step
from autopipe.errors import ArtifactError, AutopipeError, PartitionError
from autopipe.ir import Graph
from autopipe.partitioning.partition import Partition
from autopipe.partitioning.split_points import SplitPoints, requested_split, split_spec_text
from autopipe.spec import Example, load_example
from autopipe.report.summary import format_partition
from autopipe.tracing.operators import operator_provider
from autopipe.verify import verify

from conftest import compile_model, spec
from pipelines import STEPS, assert_same_training, reference_training, run_pipeline


class CalledTwice(torch.nn.Module):
    """A block called twice, and pipe_split() before the first operator and after the last
    (neither asks for a stage)."""

    def __init__(self):
        super().__init__()
        self.first, self.block, self.last = (torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        pipe_split()
        x = self.block(self.first(x))
        pipe_split()
        x = self.last(self.block(x))
        pipe_split()
        return x


def _graph(name: str, **options) -> Graph:
    return trace_step(load_example(spec(name)), CompileOptions(stages=1, **options))


def _layers_of(result) -> list[list[str]]:
    """Each stage's modules (two levels deep), in order (the model's own operators left out)."""
    stages: list[list[str]] = [[] for _ in result.partition.device_of_stage]
    for unit, stage in zip(result.graph.units, result.partition.stage_of_unit):
        if unit.label.startswith("<"):
            continue
        top = ".".join(unit.label.split(" ")[0].split(".")[:2])
        if top not in stages[stage]:
            stages[stage].append(top)
    return stages


def _same_as_the_model(out, name: str) -> None:
    report = verify(out, load_example(spec(name)), rtol=1e-6, atol=1e-6)
    assert report.ok, report.summary()
    generated = "".join(p.read_text() for p in out.glob("*.py"))
    assert "pippy" not in generated and "pipe_split" not in generated


def test_markers_are_recorded_where_the_stages_begin(tmp_path):
    graph = _graph("pipe_split_marked")
    calls = [node.name for node in graph.calls]
    # the first operator of layers.1 and of layers.4
    firsts = [graph[name].scope[0].fqn for name in graph.model.split_markers]
    assert firsts == ["layers.1", "layers.4"]
    assert all(name in calls for name in graph.model.split_markers)
    # markers before the first operator and after the last ask for no stage
    ends = trace_step(Example(CalledTwice(), (torch.randn(2, 8),)), CompileOptions(stages=1))
    assert [ends[name].scope[0].fqn for name in ends.model.split_markers] == ["block"]
    graph.save(tmp_path / "graph.json")
    assert Graph.load(tmp_path / "graph.json").model.split_markers == graph.model.split_markers
    # a model without markers records none (its graph artefact has no such key)
    plain = _graph("split_spec_model")
    assert plain.model.split_markers == ()
    assert "split_markers" not in json.loads(plain.json_text())["model"]
    # reading a graph refuses a marker that names no call, or markers out of order
    for wrong in (("nothing",), tuple(reversed(graph.model.split_markers))):
        bad = dataclasses.replace(graph.model, split_markers=wrong)
        with pytest.raises(ArtifactError, match="model.split_markers"):
            Graph.from_json(json.loads(graph.json_text()) | {"model": bad.to_json()})


def test_torch_pipelining_operators_are_torch_s_own():
    """torch registers the pippy namespace itself: never called an operator from outside
    torch (the refusal users of torch's pipeline() met before)."""
    assert operator_provider(torch.ops.pippy._pipe_split.default) is None


def test_compiled_at_the_markers_matches_pytorch(tmp_path):
    result = compile_model(
        "pipe_split_marked", tmp_path / "pipe", 3, split_points="markers", report=True
    )
    part = result.partition
    assert part.method == "split-points" and part.requested is None
    assert _layers_of(result) == [
        ["layers.0"],
        ["layers.1", "layers.2", "layers.3"],
        ["layers.4", "layers.5", "norm", "head"],
    ]
    _same_as_the_model(tmp_path / "pipe", "pipe_split_marked")


def test_without_split_points_the_markers_are_compared_with_the_method(tmp_path):
    result = compile_model("pipe_split_marked", tmp_path / "pipe", 2, report=True)
    part = result.partition
    assert part.method == "mpipe" and part.requested is not None
    theirs = part.requested
    assert theirs.stages == 3 and theirs.asked == "the model's pipe_split() markers"
    # their prediction is the partition of their stages, for the same microbatches
    alone = compile_model(
        "pipe_split_marked",
        tmp_path / "theirs",
        3,
        split_points="markers",
        microbatches=part.settings.microbatches,
    ).partition
    assert alone.predicted is not None
    assert theirs.step_time == pytest.approx(alone.predicted.step_time, rel=1e-12)
    assert theirs.bottleneck == pytest.approx(alone.predicted.bottleneck, rel=1e-12)
    summary = format_partition(result.graph, part)
    assert (
        "the model's pipe_split() markers ask for 3 stages: on 3 devices (one stage each)"
        in summary
    )
    assert "ms on 2 devices; compile with" in summary
    assert "--split-points markers --stages 3" in summary
    saved = Partition.load(tmp_path / "pipe" / "artifacts" / "partition.json")
    assert saved.requested == theirs
    report = (tmp_path / "pipe" / "report" / "report.html").read_text()
    assert "split asked for" in report and "pipe_split() markers ask for 3 stages" in report
    _same_as_the_model(tmp_path / "pipe", "pipe_split_marked")


def test_a_split_spec_names_where_stages_begin_and_end(tmp_path):
    text = split_spec_text({"layers.2": SplitPoint.BEGINNING, "layers.4": SplitPoint.END})
    assert text == "layers.2,layers.4:end"
    result = compile_model("split_spec_model", tmp_path / "pipe", 3, split_points=text)
    assert _layers_of(result) == [
        ["layers.0", "layers.1"],
        ["layers.2", "layers.3", "layers.4"],
        ["layers.5", "norm", "head"],
    ]
    assert result.partition.method == "split-points"
    _same_as_the_model(tmp_path / "pipe", "split_spec_model")


def test_split_points_that_cannot_be_kept_are_refused_clearly(tmp_path):
    plain = _graph("split_spec_model")
    with pytest.raises(PartitionError, match="calls no pipe_split"):
        requested_split(plain, SplitPoints.parse("markers"))
    with pytest.raises(PartitionError, match="runs no module 'layers.9'"):
        requested_split(plain, SplitPoints.parse("layers.9"))
    with pytest.raises(PartitionError, match="leaves a stage with no operator"):
        requested_split(plain, SplitPoints.parse("layers.0"))
    # a module called twice: torch's split_spec would split at both calls
    shared = trace_step(Example(CalledTwice(), (torch.randn(2, 8),)), CompileOptions(stages=1))
    with pytest.raises(PartitionError, match="calls 'block' 2 times"):
        requested_split(shared, SplitPoints.parse("block:end"))
    # whole layers as units (depth 1): a boundary inside one is refused, naming it
    coarse = _graph("split_spec_model", depth=1)
    with pytest.raises(PartitionError, match=r"layers.2.1 falls inside the unit layers.2"):
        requested_split(coarse, SplitPoints.parse("layers.2.1"))
    with pytest.raises(PartitionError, match="the split points make 3 stages; pass --stages 3"):
        compile_model("pipe_split_marked", tmp_path / "p", 2, split_points="markers")
    with pytest.raises(AutopipeError, match="--split-points must be 'markers' or module names"):
        CompileOptions(stages=2, split_points="layers.1:middle")
    with pytest.raises(AutopipeError, match="--split-points fixes the stages and --search"):
        CompileOptions(stages=2, split_points="markers", search=True, devices=2)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, stages, split_points",
    [
        ("pipe_split_marked", 3, "markers"),
        ("pipe_split_marked", 2, None),
        ("split_spec_model", 3, "layers.2,layers.4:end"),
    ],
)
def test_split_points_train_like_pytorch(tmp_path, name, stages, split_points):
    """torchrun trains each package (3 and 2 processes, gloo) exactly like plain PyTorch."""
    options = {} if split_points is None else {"split_points": split_points}
    pipe = run_pipeline(
        tmp_path, name, stages, "pipe_split_batch", "--optimizer", "sgd", "--lr", "0.05",
        loss="tests/models.py:mse", **options,
    )  # fmt: skip
    ref = reference_training(
        load_example(spec(name)), models.pipe_split_batch, STEPS, "sgd", 0.05, models.mse
    )
    assert_same_training(pipe, ref)
    assert torch.isfinite(torch.tensor(pipe[0])).all()
