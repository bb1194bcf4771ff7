"""Custom ``torch.autograd.Function``s: the pipeline runs each function's own forward and
backward, traced into torch operators, as a generated ``torch.autograd.Function`` class.

The models (tests/function_models.py) use functions whose backward is not autograd's derivative
of their forward, so a pipeline that lost the custom backward would not match.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

import function_models
from autopipe.compiler import load_graph
from autopipe.errors import ArtifactError, TraceError
from autopipe.ir.autograd_function import FUNCTION_TARGET
from autopipe.ir import Graph, Ref
from autopipe.spec import load_example
from autopipe.tracing.export import trace
from autopipe.verify import verify

from conftest import compile_model
from pipelines import STEPS, assert_same_training, reference_training, run_pipeline

MODELS = "tests/function_models.py"


def _compile(name: str, out, stages: int = 2, **options):
    return compile_model(f"{MODELS}:{name}", out, stages, **options)


def _gradients(model, args):
    model.zero_grad()
    model(*args).square().sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_custom_gradients_differ_from_autograd():
    """The test models are meaningful: their custom backwards change every layer's gradient
    but the last one's (which is applied after the functions)."""
    custom, args, _, _ = function_models.function_mlp()
    plain, _, _, _ = function_models.plain_mlp()
    torch.testing.assert_close(custom(*args), plain(*args))
    got, want = _gradients(custom, args), _gradients(plain, args)
    differing = [n for n in got if not torch.allclose(got[n], want[n])]
    assert set(differing) == {f"layers.{i}.{k}" for i in range(3) for k in ("weight", "bias")}


def test_functions_compile_into_classes_and_verify(tmp_path):
    result = _compile("function_mlp", tmp_path / "pipe")
    graph = result.graph
    assert list(graph.functions) == ["RoundSTE", "ScaledSquare", "GatedProduct"]
    calls = [n for n in graph.calls if n.target == FUNCTION_TARGET]
    assert [n.args[0] for n in calls] == list(graph.functions)
    gated = graph.functions["GatedProduct"]
    assert (gated.outputs, gated.grads, gated.non_differentiable) == (2, [True, True], [1])
    mask = next(n for n in graph.calls if n.args == (Ref(calls[2].name), 1))
    assert mask.tensor_meta.requires_grad is False  # marked non-differentiable

    report = verify(tmp_path / "pipe", load_example(f"{MODELS}:function_mlp"))
    assert report.ok, report.summary()
    assert len([c for c in report.comparisons if c.kind == "grad"]) == 8

    sources = {p.name: p.read_text() for p in (tmp_path / "pipe").glob("stage*.py")}
    text = "\n".join(sources.values())
    for name in graph.functions:
        assert f"class {name}(torch.autograd.Function):" in text
        assert re.search(rf"= {name}\.apply\(", text)
    square = re.search(r"class ScaledSquare\(.*?\n\n\n", text, re.S).group(0)
    assert "function_models.ScaledSquare (function_models.py:" in square
    assert "ctx.save_for_backward(x)" in square and "(x,) = ctx.saved_tensors" in square
    assert "return (mul_1,)" in square  # the scale is baked in, not an argument
    assert "ctx.mark_non_differentiable(" in text
    # each stage defines the classes it calls, and the package needs only torch
    for stage_text in sources.values():
        for name in re.findall(r"= (\w+)\.apply\(", stage_text):
            assert f"class {name}(torch.autograd.Function):" in stage_text
    for path in (tmp_path / "pipe").rglob("*.py"):
        assert not re.search(r"^\s*(from|import) autopipe\b", path.read_text(), re.M), path


def test_context_attributes_and_flags(tmp_path):
    """Tensors kept as ctx attributes, a non-tensor argument read in backward, needs_input_grad
    False for an argument that needs no gradient (backward returns None for it), and
    set_materialize_grads(False) with an unused result (the generated backward gets zeros)."""
    result = _compile("context_mlp", tmp_path / "pipe")
    fdef = result.graph.functions["AttributeContext"]
    assert (fdef.outputs, fdef.grads, len(fdef.saved)) == (2, [True, False], 2)
    report = verify(tmp_path / "pipe", load_example(f"{MODELS}:context_mlp"))
    assert report.ok, report.summary()
    text = "\n".join(p.read_text() for p in (tmp_path / "pipe").glob("stage*.py"))
    assert re.search(r"def backward\(ctx, grad_product, grad_sum\):", text)
    assert re.search(r"return \(\w+, None\)", text)


def test_torch_amp_decorators_are_kept(tmp_path):
    """Functions with torch.amp.custom_fwd / custom_bwd called in an autocast region: the
    generated classes carry the same decorators, and the pipeline matches exactly (a float32
    matmul stays float32, a backward runs under the forward's autocast state)."""
    result = _compile("autocast_mlp", tmp_path / "pipe")
    amp = {name: f.amp for name, f in result.graph.functions.items()}
    assert amp == {
        "Float32Matmul": {"forward": ["cpu", "float32"], "backward": "cpu"},
        "AutocastSquare": {"forward": ["cpu", None], "backward": "cpu"},
    }
    report = verify(tmp_path / "pipe", load_example(f"{MODELS}:autocast_mlp"), rtol=0, atol=0)
    assert report.ok, report.summary()
    text = "\n".join(p.read_text() for p in (tmp_path / "pipe").glob("stage*.py"))
    assert '@torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)' in text
    assert '@torch.amp.custom_bwd(device_type="cpu")' in text


def test_regeneration_is_byte_identical(tmp_path):
    _compile("function_mlp", tmp_path / "a")
    _compile("function_mlp", tmp_path / "b")
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*.*"))
    assert files
    for rel in files:
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes(), rel


def test_one_class_per_traced_shape():
    """A function called on the same shapes and arguments twice is one class; a call that
    traces differently (another shape, another scale) gets a class of its own."""
    graph = trace(load_example(f"{MODELS}:two_shapes"))
    calls = [n.args[0] for n in graph.calls if n.target == FUNCTION_TARGET]
    assert calls == ["ScaledSquare", "ScaledSquare", "ScaledSquare_1"]
    assert list(graph.functions) == ["ScaledSquare", "ScaledSquare_1"]


def test_function_artefact_round_trips_and_is_checked(tmp_path):
    example = load_example(f"{MODELS}:function_mlp")
    graph = trace(example)
    path = tmp_path / "graph.json"
    graph.save(path)
    loaded = load_graph(path)  # lint, and every operator replayed on fake tensors
    assert loaded.json_text() == graph.json_text()
    data = json.loads(path.read_text())
    functions = {f["name"]: f for f in data["functions"]}

    def refused(edit, match):
        edited = json.loads(json.dumps(data))
        edit(edited, {f["name"]: f for f in edited["functions"]})
        with pytest.raises(ArtifactError, match=match):
            Graph.from_json({k: v for k, v in edited.items() if k not in ("format", "version")})

    assert functions["ScaledSquare"]["grads"] == [True]
    refused(lambda d, f: f["ScaledSquare"].update(grads=[False]), r"grads")
    refused(lambda d, f: f["RoundSTE"].update(name="Stage0"), r"name")
    refused(lambda d, f: f["RoundSTE"].update(qualname="os.system(1)"), r"qualname")
    refused(lambda d, f: f["GatedProduct"].update(non_differentiable=[5]), r"non_differentiable")
    refused(
        lambda d, f: f["RoundSTE"]["forward"]["nodes"][1].update(target="os.system.default"),
        r"forward.*target",
    )
    refused(
        lambda d, f: f["ScaledSquare"]["backward"].update(inputs=["x"]),
        r"backward.inputs",
    )

    def call_unknown(d, f):
        node = next(n for n in d["nodes"] if n.get("target") == FUNCTION_TARGET)
        node["args"][0] = "Missing"

    refused(call_unknown, r"args")


@pytest.mark.parametrize(
    "name,part,reason",
    [
        ("branching_backward", "backward", r"depends on tensor values .*function_models.py:\d+"),
        ("numpy_backward", "backward", r"\.numpy\(\) is not supported"),
        ("in_place", "forward", r"modifies its arguments in place \(ctx.mark_dirty\)"),
        ("with_statistic", "forward", r"returns Tensor, int; autopipe supports a tensor"),
    ],
)
def test_untraceable_function_is_refused(tmp_path, name, part, reason):
    """A function autopipe cannot reproduce exactly is refused with the function, the line
    calling it and the reason, and tracing leaves Function.apply as it was."""
    with pytest.raises(TraceError) as caught:
        _compile(name, tmp_path / "out")
    message = str(caught.value)
    function = {
        "branching_backward": "BranchingBackward",
        "numpy_backward": "NumpyBackward",
        "in_place": "InPlace",
        "with_statistic": "WithStatistic",
    }[name]
    assert re.search(rf"custom autograd function {function} at .*function_models.py:\d+", message)
    assert "self.function.apply(" in message
    assert f"cannot reproduce its {part}" in message, message
    assert re.search(reason, message), message
    assert not (tmp_path / "out").exists()
    assert torch.autograd.Function.apply.__func__.__module__ == "torch.autograd.function"


def test_function_in_cond_branch_is_refused(tmp_path):
    with pytest.raises(TraceError, match=r"custom autograd function inside a torch.cond branch"):
        _compile("cond_branch", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_function_of_a_model_on_meta(tmp_path):
    """BLOOM built on the meta device (no weights): GeLUFunction is traced on fake tensors and
    generated as in the real model."""
    result = _compile("bloom_on_meta", tmp_path / "pipe")
    assert list(result.graph.functions) == ["GeLUFunction"]
    fdef = result.graph.functions["GeLUFunction"]
    assert re.fullmatch(r"transformers/models/bloom/modeling_bloom.py:\d+", fdef.source)
    assert fdef.qualname == "transformers.models.bloom.modeling_bloom.GeLUFunction"
    text = "\n".join(p.read_text() for p in (tmp_path / "pipe").glob("stage*.py"))
    assert text.count("class GeLUFunction(torch.autograd.Function):") == 2  # one per stage


def test_profiles_run_the_custom_backward():
    """The profilers run a function's traced forward and backward (fake and real tensors)."""
    from autopipe.profiling.analytic import profile_analytic
    from autopipe.profiling.devices import device_spec
    from autopipe.profiling.measured import profile_measured

    example = load_example(f"{MODELS}:function_mlp")
    graph = trace(example)
    units = {n.unit for n in graph.calls if n.target == FUNCTION_TARGET}
    for prof in (
        profile_analytic(graph, device_spec("H100")),
        profile_measured(graph, device_spec("H100"), example, warmup=0, repeats=1),
    ):
        for unit in units:
            assert prof.units[unit].backward > 0


@pytest.mark.slow
def test_training_with_custom_functions_matches_pytorch(tmp_path):
    """train.py on 2 gloo ranks trains exactly as plain PyTorch does with the functions' own
    backwards (in the stages and in the loss): same losses, same weights."""
    pipe = run_pipeline(
        tmp_path,
        f"{MODELS}:function_mlp",
        2,
        f"{MODELS}:batch",
        "--optimizer",
        "sgd",
        "--lr",
        "0.1",
        loss=f"{MODELS}:rounded_mse",
    )
    assert "class RoundSTE(torch.autograd.Function):" in (tmp_path / "pipe" / "loss.py").read_text()
    ref = reference_training(
        load_example(f"{MODELS}:function_mlp"),
        function_models.batch,
        STEPS,
        "sgd",
        0.1,
        function_models.rounded_mse,
    )
    assert_same_training(pipe, ref)
