"""Generated stages in eval mode (issue 41, item 2): every operator whose result depends on the
module's mode (dropout and its variants, batch norm and instance norm over running statistics,
RReLU, attention dropout, batch norm's batch count) reads the stage's ``self.training``, so that
``stage.eval()`` evaluates as ``model.eval()`` does and leaves the running statistics as they
are. Mirrors ``autopipe/ir/eval_mode.py`` and ``autopipe/tracing/eval_mode.py``."""

from __future__ import annotations

import json
import re

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from autopipe.errors import ArtifactError
from autopipe.ir import Graph
from autopipe.ir.eval_mode import random_in_eval
from autopipe.runtime.core.pipeline import Pipeline
from autopipe.runtime.support import stage_state
from autopipe.spec import Example, load_example
from autopipe.report.summary import random_in_eval_lines
from autopipe.tracing.export import trace
from autopipe.verify import load_pipeline, verify

from conftest import compile_model, run_ranks_together
from models import cnn_batch, mode_net

SPEC = "tests/models.py:mode_net"


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    out = tmp_path_factory.mktemp("mode") / "pipe"
    compile_model("mode_net", out, 2)
    return out


def stages_of(package, model):
    """The package's stages holding ``model``'s state, chained by :func:`run`."""
    module = load_pipeline(package)
    pipeline = Pipeline.from_json(module.PIPELINE)
    state = model.state_dict()
    stages = []
    for index in range(pipeline.num_stages):
        stage = module.build_stage(index, device="cpu", init=False)
        stage.load_state_dict(stage_state(stage, state, pipeline.aliases))
        stages.append(stage)
    return pipeline, stages


def run(pipeline, stages, x):
    env = {pipeline.signature[0]: x}
    for spec, stage in zip(pipeline.stages, stages):
        env.update(zip(spec.outputs, stage(*[env[n] for n in spec.inputs])))
    return env[pipeline.outputs[0]]


def test_every_mode_dependent_operator_reads_the_module_mode(package):
    source = "".join(p.read_text() for p in sorted(package.glob("stage*.py")))
    # each call by its operator and arguments, its input under whatever name the stage gives it
    # (a stage boundary renames the value it receives)
    for written in [
        r"aten\.add_\.Tensor\(self\.bn\.num_batches_tracked, 1 if self\.training else 0\)",
        r"aten\.rrelu\.default\(\w+, 0\.125, 0\.3333333333333333, self\.training\)",
        r"aten\.feature_dropout\.default\(\w+, 0\.2, self\.training\)",
        r"aten\.alpha_dropout\.default\(\w+, 0\.1, self\.training\)",
        r"aten\.feature_alpha_dropout\.default\(\s*\w+, 0\.1, self\.training\s*\)",
        r"None, 0\.1 if self\.training else 0\.0",  # attention dropout
        r"aten\.dropout\.default\(\w+, 0\.1, self\.training\)",  # F.dropout(training=...)
    ]:
        assert re.search(written, source), written
    # batch norm without running statistics uses the batch's in both modes, as torch's does
    assert "None,\n            None,\n            True," in source
    assert source.count("            self.training,\n") == 2  # batch norm, instance norm


def test_verify_compares_eval_mode(package):
    report = verify(package, load_example(SPEC))
    evaluated = [c for c in report.comparisons if c.kind == "eval"]
    after = [c for c in report.comparisons if c.name.endswith("(after eval)")]
    assert evaluated and after and report.ok, report.summary()
    assert "eval outs" in report.summary()


@pytest.mark.parametrize("seed", [0, 7])
def test_stages_in_eval_mode_are_the_model_in_eval_mode(package, seed):
    model, (x,) = mode_net()
    model(x)  # one training step's statistics, so that running and batch statistics differ
    pipeline, stages = stages_of(package, model)
    model.eval()
    for stage in stages:
        stage.eval()
    buffers = {k: v.clone() for k, v in model.state_dict().items() if "running" in k or "num" in k}
    with torch.no_grad():
        expected = model(x)
        torch.manual_seed(seed)
        got = run(pipeline, stages, x)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    for stage in stages:  # eval mode keeps the running statistics and the batch count
        for name, buffer in stage.named_buffers():
            torch.testing.assert_close(buffer, buffers[name], rtol=0, atol=0)
    # and training mode is not eval mode: the stages do train as they did
    for stage in stages:
        stage.train()
    torch.manual_seed(seed)
    assert not torch.allclose(run(pipeline, stages, x), expected)
    assert int(stages[0].bn.num_batches_tracked) == int(buffers["bn.num_batches_tracked"]) + 1


def test_eval_arguments_round_trip_and_are_checked():
    model, args = mode_net()
    graph = trace(Example(model, args, {}))
    marked = {n.target: n.eval_args for n in graph.calls if n.eval_args}
    assert marked["aten.dropout.default"] == {"train": False}
    assert marked["aten.batch_norm.default"] == {"training": False}
    assert marked["aten.instance_norm.default"] == {"use_input_stats": False}
    assert marked["aten.rrelu.default"] == {"training": False}
    assert marked["aten.scaled_dot_product_attention.default"] == {"dropout_p": 0.0}
    assert marked["aten.add_.Tensor"] == {"other": 0}
    assert not random_in_eval(graph.calls)  # every random operator is off in eval mode

    data = json.loads(graph.json_text())
    again = Graph.from_json(data)
    assert [n.eval_args for n in again.calls] == [n.eval_args for n in graph.calls]

    dropout = next(r for r in data["nodes"] if r.get("target") == "aten.dropout.default")
    for bad, rule in [
        ({"p": 0.0}, "the argument of aten.dropout.default that depends on the mode"),
        ({"train": True}, "other than it"),  # eval mode's value is training's
        ({"train": 0}, "a constant of the kind"),
        ({"train": None}, "a constant of the kind"),
    ]:
        dropout["eval_args"] = bad
        with pytest.raises(ArtifactError, match=rule):
            Graph.from_json(data)


class DropPath(nn.Module):
    """Stochastic depth as vision models write it: decided in Python by ``self.training``."""

    def forward(self, x):
        if not self.training:
            return x
        keep = torch.rand(x.shape[0], 1) > 0.1
        return x * keep / 0.9


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.drop_path = DropPath()

    def forward(self, x):
        return x + self.drop_path(F.dropout(self.lin(x), 0.1, self.training))


def test_randomness_no_argument_switches_off_is_named():
    torch.manual_seed(0)
    graph = trace(Example(Residual(), (torch.randn(3, 4),), {}))
    assert [n.target for n in random_in_eval(graph.calls)] == ["aten.rand.default"]
    (line,) = random_in_eval_lines(graph)
    assert "drop_path (DropPath): 1 operator" in line and "drop_path_rate=0" in line


def test_train_py_evaluates_like_the_model_in_eval_mode_under_any_seed(package, tmp_path):
    """--eval-only through torchrun: the held-out loss is the original model's in eval mode,
    whatever --seed draws (dropout is off), with batch norm on its running statistics."""
    out = tmp_path / "loss"
    compile_model("mode_net_with_target", out, 2, loss="tests/models.py:cross_entropy")
    model, (x,) = mode_net()
    model(cnn_batch(9)[0][0])  # running statistics of their own, not the initial ones
    weights = tmp_path / "weights.pt"
    torch.save(model.state_dict(), weights)
    model.eval()
    losses = []
    with torch.no_grad():
        for step in range(2):
            (inputs,), _, target = cnn_batch(step, 4)
            losses += [
                float(F.cross_entropy(model(part), label))
                for part, label in zip(inputs.chunk(4), target.chunk(4))
            ]
    expected = sum(losses) / len(losses)
    common = ["--load", str(weights), "--eval-only", "--eval-data", "tests/models.py:cnn_batch"]
    common += ["--eval-batches", "2", "--microbatches", "4"]
    logs = {seed: tmp_path / f"seed{seed}.jsonl" for seed in (0, 7)}
    run_ranks_together(
        *((out / "train.py", 2, [*common, "--seed", str(seed), "--log-json", str(log)])
          for seed, log in logs.items())
    )  # fmt: skip
    for log in logs.values():
        (entry,) = [json.loads(line) for line in log.read_text().splitlines()]
        assert entry["eval_loss"] == pytest.approx(expected, abs=1e-6)
