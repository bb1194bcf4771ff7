"""Sizes computed from tensor values (nonzero, boolean masks, .item() used as a size): compiled
for the example's value, with a check in the generated code that fails loudly when a batch
disagrees (issue 12). Branches on tensor values are still refused (tests/test_errors.py)."""

from __future__ import annotations

import pytest

from autopipe.spec import load_example
from autopipe.verify import load_pipeline, verify

from conftest import compile_model, spec, torchrun_failing
from pipelines import assert_trains_like_pytorch_with_mse, run_stages


def _run_stages(package, x):
    return run_stages(package, load_example(spec("masked_sum")).model.state_dict(), {"x": x})


def test_sizes_from_tensor_values_are_specialised_and_checked(tmp_path):
    compile_model("masked_sum", tmp_path / "pipe", 2)
    source = "".join(p.read_text() for p in sorted((tmp_path / "pipe").glob("stage*.py")))
    assert source.count("aten._assert_async.msg(") == 2  # the mask's rows and the .item() count
    assert "computes a size from tensor values (3 on the example)" in source
    example = load_example(spec("masked_sum"))
    report = verify(tmp_path / "pipe", example, rtol=0, atol=0)
    assert report.ok, report.summary()

    package = load_pipeline(tmp_path / "pipe")
    (x,) = example.args
    _run_stages(package, x.clone())  # the example's sizes pass the checks
    other = x.clone()
    other[0] = -other[0].abs() - 1  # one row fewer is selected
    with pytest.raises(RuntimeError, match="computes a size from tensor values"):
        _run_stages(package, other)


@pytest.mark.slow
def test_specialised_sizes_train_like_pytorch(tmp_path):
    """Fresh batches whose values keep the sizes the model computes train exactly."""
    assert_trains_like_pytorch_with_mse(tmp_path, "masked_sum_with_target", "masked_sum_batch")


@pytest.mark.slow
def test_a_batch_unlike_the_example_stops_train_py_clearly(tmp_path):
    compile_model("masked_sum_with_target", tmp_path / "pipe", 2, loss="tests/models.py:mse")
    result = torchrun_failing(
        tmp_path / "pipe" / "train.py",
        2,
        "--steps",
        "3",
        "--microbatches",
        "4",
        "--data",
        "tests/models.py:masked_sum_batch_unlike_the_example",
    )
    assert "step 0 loss" in result.stdout and "step 1 loss" not in result.stdout
    assert f'File "{tmp_path / "pipe"}' not in result.stderr, result.stderr[-3000:]
    assert "train.py: error: rank 0: tests/models.py:" in result.stderr
    assert "the pipeline was compiled for that size" in result.stderr


def test_a_value_of_a_specialised_size_needs_gradients_as_its_operator_makes_it():
    """The rows a mask selects from a tensor that needs gradients need gradients too, though
    fake tensors cannot compute their number (the size is the example's): a stage receiving
    them must hand their gradients back."""
    from autopipe.tracing import trace

    graph = trace(load_example(spec("masked_sum")))
    selected = [n for n in graph.calls if n.target == "aten.index.Tensor"]
    assert selected and all(n.tensor_meta.requires_grad for n in selected)
