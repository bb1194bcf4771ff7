"""``torch.cond``: one node of the graph, both branches compiled into the stage that holds it,
outputs and gradients of whichever branch the input takes, training included."""

from __future__ import annotations

import json
import re

import pytest
import torch
from torch._subclasses import FakeTensorMode

import cond_models
from autopipe.artifacts import read_artifact
from autopipe.compiler import CompileOptions, compile_spec, load_graph
from autopipe.ir.cond import COND, forced_branch
from autopipe.errors import ArtifactError, TraceError
from autopipe.ir import Graph
from autopipe.profiling.analytic import _unit_cost, profile_analytic
from autopipe.profiling.devices import device_spec
from autopipe.spec import load_example
from autopipe.ir.analysis import unit_workloads
from autopipe.verify import load_pipeline, verify

from conftest import assert_black_formatted, compile_model
from pipelines import STEPS, assert_same_training, reference_training, run_pipeline

SPECS = "tests/cond_models.py"
LOSS = f"{SPECS}:mse"


def compile_cond(out, stages: int, name: str = "cond_true", **options):
    return compile_model(f"{SPECS}:{name}", out, stages, loss=LOSS, **options)


def stage_sources(out) -> str:
    return "".join(path.read_text() for path in sorted(out.glob("stage*.py")))


@pytest.mark.parametrize("stages", [2, 3])
def test_cond_matches_the_model_on_both_branches(tmp_path, stages):
    out = tmp_path / "pipe"
    result = compile_cond(out, stages)
    conds = [n for n in result.graph.calls if n.target == COND]
    assert len(conds) == 1  # one node, so never split across stages
    source = stage_sources(out)
    assert source.count("torch.cond(") == 1
    assert "def _cond_true_0(" in source and "def _cond_false_0(" in source
    assert "# true branch of torch.cond at tests/cond_models.py:" in source
    for name, taken in (("cond_true", True), ("cond_false", False)):
        example = load_example(f"{SPECS}:{name}")
        assert bool(example.args[0].sum() > 0) is taken
        report = verify(out, example)
        assert report.ok, report.summary()
        grads = {c.name for c in report.comparisons if c.kind == "grad"}
        assert {"pos.lin.weight", "neg.lin.weight", "pos.norm.bias"} <= grads
    # the branches' parameters keep their original names, each held by exactly one stage
    package = load_pipeline(out)
    held = [name for i in range(stages) for name in package.build_stage(i).state_dict()]
    assert sorted(held) == sorted(load_example(f"{SPECS}:cond_true").model.state_dict())


def test_branch_gradients_reach_the_stage_parameters(tmp_path):
    """Gradients flow through torch.cond into the stage's own parameters: the branch taken gets
    them, the other zeros (as torch.cond gives the model itself)."""
    out = tmp_path / "pipe"
    compile_cond(out, 1)
    package = load_pipeline(out)
    for name, used, unused in (("cond_true", "pos", "neg"), ("cond_false", "neg", "pos")):
        example = load_example(f"{SPECS}:{name}")
        stage = package.build_stage(0, init=False)
        stage.load_state_dict(example.model.state_dict())
        (output,) = stage(*example.args)
        output.sum().backward()
        params = dict(stage.named_parameters())
        assert params[f"{used}.lin.weight"].grad.abs().sum() > 0
        assert not params[f"{unused}.lin.weight"].grad.any()
        expected = example.model(*example.args)
        expected.sum().backward()
        for key, param in params.items():
            want = dict(example.model.named_parameters())[key].grad
            assert torch.allclose(param.grad, want, atol=1e-6), key


def test_regeneration_is_byte_identical(tmp_path):
    first, second, other = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    compile_cond(first, 2)
    compile_cond(second, 2)
    files = sorted(p.relative_to(first) for p in first.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(second) for p in second.rglob("*") if p.is_file())
    for rel in files:
        assert (first / rel).read_bytes() == (second / rel).read_bytes(), rel
    # an example taking the other branch traces the same two branches: the same stages
    compile_cond(other, 2, name="cond_false")
    assert stage_sources(other) == stage_sources(first)


def test_graph_artefact_round_trips_and_replays(tmp_path):
    out = tmp_path / "pipe"
    result = compile_cond(out, 2)
    loaded = load_graph(out / "artifacts" / "graph.json")  # lint + fake-tensor replay
    assert loaded.json_text() == result.graph.json_text()
    (cond,) = [n for n in loaded.calls if n.target == COND]
    true_branch, false_branch = cond.args[1], cond.args[2]
    assert isinstance(true_branch, Graph) and isinstance(false_branch, Graph)
    assert len(true_branch.inputs) == len(cond.args[3]) == len(false_branch.inputs)
    assert [m.requires_grad for m in cond.meta] == [True, True]


def _graph_payload(out) -> dict:
    return read_artifact(out / "artifacts" / "graph.json", "graph")


def _cond_record(payload: dict) -> dict:
    return next(n for n in payload["nodes"] if n.get("target") == COND)


def _branch_call(payload: dict, side: int = 1) -> dict:
    branch = _cond_record(payload)["args"][side]["graph"]
    return next(n for n in branch["nodes"] if n["kind"] == "call")


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda g: _branch_call(g).update(target="os.system.default"), "branch.nodes["),
        (
            lambda g: _cond_record(g)["args"][1]["graph"]["model"].update(source="x\nimport os"),
            "branch.model.source",
        ),
        (lambda g: _cond_record(g)["args"][2]["graph"]["outputs"].pop(), "(false branch).outputs"),
        (lambda g: _cond_record(g)["args"][3].pop(), "(true branch).inputs"),
        (lambda g: _cond_record(g)["args"].pop(), "the arguments of higher_order.cond"),
        (lambda g: _cond_record(g)["args"].__setitem__(0, {"ref": "x"}), "the predicate"),
        (
            lambda g: json.loads(json.dumps(g).replace('"linear_1"', '"_cond_true_0"')),
            "_cond_true_K",
        ),
    ],
)
def test_crafted_cond_is_rejected(tmp_path, corrupt, message):
    """Branches are checked like the model's graph: operators, names, and that they take the
    operands and return the cond's outputs."""
    out = tmp_path / "pipe"
    compile_cond(out, 1)
    payload = _graph_payload(out)
    changed = corrupt(payload)
    payload = changed if isinstance(changed, dict) and "nodes" in changed else payload
    with pytest.raises(ArtifactError, match="invalid") as info:
        Graph.from_json(payload)
    assert message in str(info.value)


def test_analytic_cost_is_the_more_expensive_branch(tmp_path):
    out = tmp_path / "pipe"
    graph = compile_cond(out, 1).graph
    spec = device_spec("H100")
    (unit,) = [w for w in unit_workloads(graph) if any(n.target == COND for n in w.nodes)]
    cost = profile_analytic(graph, spec).units[unit.nodes[0].unit]
    with FakeTensorMode(allow_non_fake_inputs=True):
        branch_costs = []
        for taken in (True, False):
            with forced_branch(taken):
                branch_costs.append(_unit_cost(graph, unit, spec, torch.device("cpu")))
    assert branch_costs[0].forward != branch_costs[1].forward
    for field in ("forward", "backward", "activations", "bytes_forward"):
        assert getattr(cost, field) == max(getattr(c, field) for c in branch_costs), field


@pytest.mark.slow
def test_cond_trains_like_pytorch(tmp_path):
    """Microbatches of alternating sign take both branches in every step, with activations
    recomputed in backward: each cond runs forward, again in the recomputation, and backward."""
    pipe = run_pipeline(
        tmp_path,
        f"{SPECS}:cond_true",
        2,
        f"{SPECS}:cond_batch",
        "--schedule",
        "1f1b",
        "--recompute",
        "all",
        loss=LOSS,
    )
    example = load_example(f"{SPECS}:cond_true")
    reference = load_example(f"{SPECS}:cond_true")
    ref = reference_training(
        reference, cond_models.cond_batch, STEPS, "adamw", 1e-3, cond_models.mse
    )
    assert_same_training(pipe, ref)
    assert not torch.equal(pipe[1]["pos.lin.weight"], example.model.state_dict()["pos.lin.weight"])
    assert not torch.equal(pipe[1]["neg.lin.weight"], example.model.state_dict()["neg.lin.weight"])


def test_nested_cond_is_refused_clearly(tmp_path):
    with pytest.raises(TraceError, match="nests torch.cond") as info:
        compile_spec(f"{SPECS}:nested_cond", tmp_path / "out", CompileOptions(stages=1))
    assert "tests/cond_models.py:" in str(info.value)
    assert not (tmp_path / "out").exists()


def test_while_loop_is_refused_clearly(tmp_path):
    """Refused at the user's line, saying what to write instead; nothing is written."""
    with pytest.raises(TraceError) as info:
        compile_spec(f"{SPECS}:while_loop_model", tmp_path / "out", CompileOptions(stages=1))
    message = str(info.value)
    assert re.match(
        r"the model uses torch's higher-order operator while_loop at tests/cond_models.py:\d+:",
        message,
    )
    assert "return while_loop(lambda i, y: i < 3," in message
    assert (
        "autopipe compiles torch.cond, no_grad / set_grad_enabled and autocast regions" in message
    )
    assert "write the loop in Python with a fixed trip count (torch.export unrolls it)" in message
    assert not (tmp_path / "out").exists()


def test_cond_in_every_block_of_a_stack(tmp_path):
    """A torch.cond per layer, layers kept whole as basic blocks and spread over stages: each
    stage defines the branch functions of its own conds, numbered over the whole model."""
    out = tmp_path / "pipe"
    result = compile_spec(
        f"{SPECS}:gated_stack",
        out,
        CompileOptions(stages=3, basic_blocks=("GatedLayer",)),
        report=False,
    )
    assert_black_formatted(out)
    conds = [n for n in result.graph.calls if n.target == COND]
    assert len(conds) == 4 and len({n.unit for n in conds}) == 4
    sources = [path.read_text() for path in sorted(out.glob("stage*.py"))]
    defined = [f"_cond_true_{k}" for k in range(4)]
    assert all(sum(f"def {name}(" in s for s in sources) == 1 for name in defined)
    for source in sources:  # every branch function a stage calls is defined in that stage
        for name in defined:
            assert (f"{name}," in source) == (f"def {name}(" in source)
    for name in ("gated_stack", "gated_stack_negative"):
        report = verify(out, load_example(f"{SPECS}:{name}"))
        assert report.ok, report.summary()


def test_cond_under_no_grad_is_refused_clearly(tmp_path):
    """torch.export drops a no_grad region around torch.cond: refused, rather than a pipeline
    training the branch's parameters."""
    with pytest.raises(TraceError, match="torch.cond under torch.no_grad") as info:
        compile_spec(f"{SPECS}:no_grad_cond", tmp_path / "out", CompileOptions(stages=1))
    assert "cond_models.py:" in str(info.value) and "detach" in str(info.value)
    assert not (tmp_path / "out").exists()


def test_autograd_function_in_a_branch_is_refused_clearly(tmp_path):
    """Inside a branch torch.export keeps only a custom Function's forward: refused, rather than
    a pipeline training with autograd's gradient of that forward."""
    with pytest.raises(
        TraceError, match="custom autograd function inside a torch.cond branch"
    ) as info:
        compile_spec(f"{SPECS}:function_in_branch", tmp_path / "out", CompileOptions(stages=1))
    assert "tests/cond_models.py:" in str(info.value)
    assert not (tmp_path / "out").exists()
