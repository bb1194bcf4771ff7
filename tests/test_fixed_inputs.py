"""Arguments without tensors (runtime/core/fixed_inputs.py): torch.export fixes a list of
scales, a flag, a string or a None to the example's value, and the stages do not take them. The
pipeline contract records each one, and ``autopipe verify`` and train.py's batches refuse
another value, naming the input, both values and the fix, instead of computing with the
example's silently. Where the example passed another value than the forward's default (or one
without a default), the record holds the default, and a batch that leaves the argument out is
refused (issue 41): the model would compute with its default, the pipeline with the example's."""

from __future__ import annotations

import json
import math

import pytest
import torch

import models
from autopipe.artifacts import read_artifact
from autopipe.compiler import load_graph
from autopipe.errors import ArtifactError, AutopipeError
from autopipe.ir import Graph
from autopipe.runtime.core.errors import PipelineRunError
from autopipe.runtime.core.fixed_inputs import FixedInput, check_fixed_inputs
from autopipe.runtime.core.pipeline import Pipeline, PipelineFormatError
from autopipe.runtime.data import Batches
from autopipe.runtime.options import parse_config
from autopipe.spec import Example, load_example
from autopipe.tracing.model_tables import fixed_inputs
from autopipe.verify import load_pipeline, verify

from conftest import compile_model, spec

RECORDED = {
    "scales": {"value": [1.0, 2.0, 3.0, 4.0], "default": None},  # forward has no default
    "square": {"value": True, "default": "False"},  # the example's is not the default
    "activation": {"value": "relu"},  # passed as the default: a batch may leave it out
    "mask": {"value": None},
}


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    out = tmp_path_factory.mktemp("fixed") / "pipe"
    compile_model("list_scaled", out, 2)
    return out


def _example(*args, **kwargs) -> Example:
    """The model with the example's weights, given these inputs."""
    model, _, _ = models.list_scaled()
    return Example(model, args, kwargs)


def test_the_contract_and_the_graph_record_the_fixed_values(package):
    data = json.loads((package / "pipeline.json").read_text())
    assert data["fixed_inputs"] == RECORDED
    assert data["inputs"] == ["x"]  # the stages take the tensor alone
    pipeline = Pipeline.from_json(data)
    assert pipeline.to_json() == data
    assert pipeline.fixed_inputs["square"] == FixedInput("square", True, None, True, "False")
    graph_path = package / "artifacts" / "graph.json"
    graph = load_graph(graph_path)
    assert graph.json_text() == graph_path.read_text()
    assert {n: f.to_json() for n, f in graph.model.fixed_inputs.items()} == RECORDED


def test_verify_accepts_the_example_s_values_and_refuses_others(package):
    assert verify(package, load_example(spec("list_scaled")), rtol=0, atol=0).ok
    x = torch.randn(2, 4)
    same = _example(x, (1, 2.0, 3, 4), square=True, activation="relu")  # a tuple, ints: equal
    assert verify(package, same, rtol=1e-6, atol=1e-6).ok
    refused = [
        (_example(x, [4.0, 3.0, 2.0, 1.0]), "input 'scales' is [4.0, 3.0, 2.0, 1.0]"),
        (_example(x, [1.0, 2.0, 3.0, 4.0], square=1), "input 'square' is 1"),
        (
            _example(x, [1.0, 2.0, 3.0, 4.0], square=True, activation="tanh"),
            "input 'activation' is 'tanh'",
        ),
        (
            _example(x, [1.0, 2.0, 3.0, 4.0], square=True, mask=torch.ones(2, 4)),
            "input 'mask' is a tensor of shape [2, 4]",
        ),
    ]
    for example, start in refused:
        with pytest.raises(AutopipeError) as raised:
            verify(package, example)
        message = str(raised.value)
        assert message.startswith(
            f"the example: {start}, but the pipeline was compiled with "
        ), message
        assert "to vary it, pass it as a tensor" in message


def test_train_py_refuses_a_batch_with_another_value_at_its_step(package):
    pipeline = Pipeline.from_json(load_pipeline(package).PIPELINE)
    argv = ["--microbatches", "4", "--data", "tests/models.py:list_scaled_batch"]
    batches = Batches(pipeline, parse_config(argv, pipeline))
    inputs, _ = batches(0)  # the example's values: taken
    assert [list(t.shape) for t in inputs] == [[8, 4]]
    with pytest.raises(PipelineRunError) as raised:
        batches(1)
    assert str(raised.value).startswith(
        "step 1: input 'scales' is [4.0, 3.0, 2.0, 1.0], but the pipeline was compiled with "
        "scales=[1.0, 2.0, 3.0, 4.0]: torch.export fixes an argument that holds no tensor"
    )


@pytest.mark.parametrize(
    "record,field",
    [
        ({"scales": [1.0]}, "pipeline.fixed_inputs.scales must be"),
        ({"scales": {"value": 1, "repr": "1"}}, "pipeline.fixed_inputs.scales must be"),
        ({"dtype": {"repr": 3}}, "pipeline.fixed_inputs.dtype.repr must be a string"),
        ({"dtype": {"repr": "torch.float32"}}, None),  # read back as it was written
        ({"not a name": {"value": 1}}, "pipeline.fixed_inputs.not a name must be named"),
        ({"flag": {"value": 1, "default": 0}}, "pipeline.fixed_inputs.flag.default must be"),
        ({"flag": {"value": 1, "default": "0"}}, None),
        ({"flag": {"repr": "1.5", "default": None}}, None),
        ({"flag": {"default": "0"}}, "pipeline.fixed_inputs.flag must be"),
        ([], "pipeline.fixed_inputs must be an object"),
    ],
)
def test_a_bad_record_in_the_contract_is_refused_naming_the_field(package, record, field):
    data = json.loads((package / "pipeline.json").read_text())
    data["fixed_inputs"] = record
    if field is None:
        assert Pipeline.from_json(data).to_json() == data
        return
    with pytest.raises(PipelineFormatError, match="must be") as raised:
        Pipeline.from_json(data)
    assert str(raised.value).startswith(field), raised.value


def test_a_bad_record_in_the_graph_is_refused_naming_the_field(package):
    payload = read_artifact(package / "artifacts" / "graph.json", "graph")
    payload["model"]["fixed_inputs"]["square"] = {"value": True, "repr": "True"}
    with pytest.raises(ArtifactError) as raised:
        Graph.from_json(payload)
    assert "model.fixed_inputs.square must be" in str(raised.value)


def test_what_is_recorded_and_how_values_compare():
    dtype = FixedInput.of("dtype", torch.bfloat16)  # torch.export refuses one; a --data may not
    assert dtype == FixedInput("dtype", None, "torch.bfloat16")
    assert dtype.matches(torch.bfloat16) and not dtype.matches(torch.float16)
    nan = FixedInput.of("eps", math.nan)
    assert nan == FixedInput("eps", None, "nan") and nan.matches(math.nan)
    assert FixedInput.of("obj", object()) is None  # an object whose repr says nothing: left out
    nested = FixedInput.of("config", {"sizes": (1, 2), "name": "a", "flag": False})
    assert nested is not None and nested.value == {"sizes": [1, 2], "name": "a", "flag": False}
    assert nested.matches({"sizes": [1.0, 2], "name": "a", "flag": False})
    assert not nested.matches({"sizes": [1, 2], "name": "a", "flag": 0})
    assert not nested.matches({"sizes": [1, 2], "name": "a"})
    flag = FixedInput.of("flag", None)
    assert flag is not None and flag.matches(None) and not flag.matches(torch.zeros(1))


def test_arguments_left_at_their_defaults_are_recorded_too():
    """The example leaves ``activation`` and ``mask`` at their defaults: export fixes those
    values as well, so a batch passing another one is refused like a passed one."""
    model = models.ListScaled()
    bound = {"x": torch.zeros(2, 4), "scales": [1.0, 2.0, 3.0, 4.0], "square": True}
    fixed = fixed_inputs(model, bound)
    assert {n: f.to_json() for n, f in fixed.items()} == {
        "scales": {"value": [1.0, 2.0, 3.0, 4.0], "default": None},
        "square": {"value": True, "default": "False"},
        "activation": {"value": "relu"},
        "mask": {"value": None},
    }
    given = {"x": torch.zeros(2, 4), "scales": [1.0, 2.0, 3.0, 4.0], "square": True}
    with pytest.raises(PipelineRunError, match="input 'activation' is 'tanh'"):
        check_fixed_inputs(fixed, given | {"activation": "tanh"}, "step 3")
    check_fixed_inputs(fixed, given, "step 3")  # left out: the recorded value, the default


def test_containers_without_a_json_form_are_recorded_by_their_repr():
    by_position = FixedInput.of("weights", {0: 2.0, 1: 0.5})  # JSON keys are strings
    assert by_position == FixedInput("weights", None, "{0: 2.0, 1: 0.5}")
    assert by_position.matches({0: 2.0, 1: 0.5}) and not by_position.matches({0: 5.0, 1: 0.5})
    assert FixedInput.of("eps", [math.nan, 1.0]) == FixedInput("eps", None, "[nan, 1.0]")
    assert FixedInput.of("dtypes", (torch.float16,)) == FixedInput(
        "dtypes", None, "(torch.float16,)"
    )
    assert FixedInput.of("objects", [object()]) is None


def test_a_batch_leaving_out_a_value_other_than_the_default_is_refused(package):
    """The example passed ``square=True``, the forward's default is False: a batch that leaves
    ``square`` out would train with True where the model computes with False. Refused, naming
    both values and the fix; a batch leaving out ``activation`` (the example passed the
    default) is taken. A pipeline recorded before defaults were takes it, as it did."""
    pipeline = Pipeline.from_json(load_pipeline(package).PIPELINE)
    argv = ["--microbatches", "4", "--data", "tests/models.py:list_scaled_batch"]
    batches = Batches(pipeline, parse_config(argv, pipeline))
    x = torch.randn(8, 4)
    batches.fn = lambda step: ((x, models.LIST_SCALES), {"activation": "relu"})  # no square
    with pytest.raises(PipelineRunError) as raised:
        batches(0)
    assert str(raised.value) == (
        "step 0: input 'square' is left out, but the pipeline was compiled with "
        "square=True (the example's value) and the forward's default is square=False: the "
        "model would compute with square=False, the pipeline computes with square=True. Pass "
        "square=True in every batch, or compile again with an example that leaves square at "
        "its default"
    )
    with pytest.raises(PipelineRunError, match="the forward has no default for it"):
        check_fixed_inputs(pipeline.fixed_inputs, {"square": True}, "step 2")
    check_fixed_inputs(pipeline.fixed_inputs, {"scales": [1, 2, 3, 4], "square": True}, "step 2")

    data = pipeline.to_json()
    data["fixed_inputs"] = {n: {"value": f.value} for n, f in pipeline.fixed_inputs.items()}
    before = Pipeline.from_json(data)  # compiled before defaults were recorded
    assert not any(f.required for f in before.fixed_inputs.values())
    assert [list(t.shape) for t in Batches(before, parse_config(argv, before))(0)[0]] == [[8, 4]]


def test_the_default_is_recorded_by_what_it_computes():
    """A default equal to the example's value (an int for a float, a tuple for a list) adds
    nothing; a default without a JSON form is shown by its repr; arguments ``*args`` and
    ``**kwargs`` take have no default."""

    class Defaults(torch.nn.Module):
        def forward(self, x, eps=1.0, sizes=(1, 2), dtype=torch.float32, *rest, **options):
            return x

    bound = {"x": torch.zeros(1), "eps": 1, "sizes": [1, 2], "dtype": torch.float16}
    bound |= {"rest_0": 3, "flag": True}
    fixed = fixed_inputs(Defaults(), bound)
    assert {n: f.to_json() for n, f in fixed.items()} == {
        "eps": {"value": 1},
        "sizes": {"value": [1, 2]},
        "dtype": {"repr": "torch.float16", "default": "torch.float32"},
        "rest_0": {"value": 3, "default": None},
        "flag": {"value": True, "default": None},
    }
