"""Checks on tensor values (issue 25): a branch whose other side only raises, an ``assert`` and
``torch._check_tensor_all`` compile to the example's path plus a run-time check in the stage
that raises the model's own message, with its file and line, when a batch fails it. Branches
doing work on both sides stay refused (tests/test_errors.py). LLaVA, which checks that its image
tokens number its image features, is in the zoo (tests/test_zoo.py)."""

from __future__ import annotations

import inspect
import re

import pytest
import torch

import models
from autopipe.errors import TraceError
from autopipe.spec import Example, load_example
from autopipe.tracing import trace
from autopipe.verify import load_pipeline, verify

from conftest import compile_model, spec, torchrun_failing
from pipelines import assert_trains_like_pytorch_with_mse, run_stages

_WORDS = "the model's own check failed for this batch; the example passed it"


def _line(text: str) -> str:
    """``tests/models.py:N`` of the line of ValueChecked.forward holding ``text``."""
    lines, first = inspect.getsourcelines(models.ValueChecked.forward)
    return f"tests/models.py:{first + next(i for i, l in enumerate(lines) if text in l)}"


MESSAGES = {
    "if": f"{_line('raise ValueError')}: ValueError: 3 of every 4 rows must be marked, got "
    "{int(marked.sum())}",
    "assert": f"{_line('assert')}: AssertionError: tanh left its range",
    "torch._check": f"{_line('_check_tensor_all')}: RuntimeError: the input holds inf or nan",
}


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    out = tmp_path_factory.mktemp("value_checked") / "pipe"
    compile_model("value_checked", out, 2)
    return out


def _run_stages(package, x):
    return run_stages(package, load_example(spec("value_checked")).model.state_dict(), {"x": x})


def test_each_kind_of_check_is_a_run_time_check_with_the_models_message(checked):
    source = "".join(p.read_text() for p in sorted(checked.glob("stage*.py")))
    assert source.count("aten._assert_async.msg(") == 3
    for kind, message in MESSAGES.items():
        assert f"{message} ({_WORDS})" in source, kind


def test_the_checked_model_matches_pytorch_on_other_values(checked):
    example = load_example(spec("value_checked"))
    report = verify(checked, example, rtol=0, atol=0)
    assert report.ok, report.summary()
    (x,), _, _ = models.value_checked_batch(5, 1)  # another microbatch that passes the checks
    other = Example(load_example(spec("value_checked")).model, (x,))
    report = verify(checked, other, rtol=0, atol=0)
    assert report.ok, report.summary()


@pytest.mark.parametrize(
    "kind,violate",
    [
        ("if", lambda x: x[:, 0].abs_()),  # every row marked
        ("torch._check", lambda x: x[3, 1].fill_(float("inf"))),  # row 3 is not marked
    ],
)
def test_a_batch_failing_a_check_raises_the_models_message(checked, kind, violate):
    package = load_pipeline(checked)
    (x,) = load_example(spec("value_checked")).args
    _run_stages(package, x.clone())  # the example passes every check
    bad = x.clone()
    violate(bad)
    with pytest.raises(ValueError if kind == "if" else RuntimeError) as raised:
        load_example(spec("value_checked")).model(bad)  # the model refuses it
    assert kind != "if" or str(raised.value).startswith("3 of every 4 rows must be marked")
    with pytest.raises(RuntimeError, match=re.escape(MESSAGES[kind])):
        _run_stages(package, bad)


def test_checks_through_a_wrapper_and_in_an_else():
    """A wrapper's check takes its caller's message and the wrapper's default exception; an
    if whose else alone raises is a check too, with the message the else composes."""
    graph = trace(load_example(spec("checked_through_helpers")))
    messages = [n.args[1] for n in graph.calls if n.target == "aten._assert_async.msg"]
    lines, first = inspect.getsourcelines(models.CheckedThroughHelpers.forward)
    at = {text: first + next(i for i, l in enumerate(lines) if text in l) for text in lines}
    wrapper = next(n for t, n in at.items() if "expect_rows(" in t)
    given = next(n for t, n in at.items() if "require(" in t)
    raised = next(n for t, n in at.items() if "raise ValueError" in t)
    assert messages == [
        f"tests/models.py:{wrapper}: KeyError: {{marked.sum()}} rows marked ({_WORDS})",
        f"tests/models.py:{given}: RuntimeError: the input holds inf or nan ({_WORDS})",
        f"tests/models.py:{raised}: ValueError: no row is marked ({_WORDS})",
    ]


@pytest.mark.parametrize(
    "name, refusal",
    [
        ("not_a_check_and", "reads more than one value from tensors and combines them"),
        ("not_a_check_caught", "the model has data-dependent control flow"),
    ],
)
def test_what_only_looks_like_a_check_stays_refused(name, refusal):
    """Two values in one condition that one can change without raising (pinning both would
    refuse batches the model takes), and a raise the forward catches, are not checks."""
    with pytest.raises(TraceError, match=refusal):
        trace(load_example(spec(name)))


def test_llava_checks_its_image_tokens_with_its_own_message(zoo_packages):
    source = "".join(p.read_text() for p in sorted(zoo_packages.get("llava").glob("stage*.py")))
    assert re.search(
        r"transformers/models/llava/modeling_llava\.py:\d+: ValueError: Image features and "
        r"image tokens do not match, tokens: \{n_image_tokens\}, features: "
        r"\{n_image_features\} \(" + re.escape(_WORDS),
        source,
    ), "the check of LLaVA's get_placeholder_mask, through transformers' torch_compilable_check"


@pytest.mark.slow
def test_a_checked_model_trains_like_pytorch(tmp_path):
    assert_trains_like_pytorch_with_mse(
        tmp_path, "value_checked_with_target", "value_checked_batch"
    )


@pytest.mark.slow
def test_a_failed_check_stops_every_rank_with_the_models_message(tmp_path):
    compile_model("value_checked_with_target", tmp_path / "pipe", 2, loss="tests/models.py:mse")
    result = torchrun_failing(
        tmp_path / "pipe" / "train.py",
        2,
        "--steps",
        "3",
        "--microbatches",
        "4",
        "--data",
        "tests/models.py:value_checked_batch_unlike_the_example",
    )
    assert "step 0 loss" in result.stdout and "step 1 loss" not in result.stdout
    said = result.stderr[-3000:]
    assert f"train.py: error: rank 0: {MESSAGES['if']} ({_WORDS})" in result.stderr, said
    assert "train.py: rank 1 stopped because rank 0 failed" in result.stderr, said


@pytest.fixture
def uninitialised_memory_filled():
    """torch fills every tensor it allocates uninitialised with NaN (and restores it after)."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    filled = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(deterministic)
        torch.utils.deterministic.fill_uninitialized_memory = filled


def test_the_checks_read_the_weights_not_uninitialised_memory(uninitialised_memory_filled):
    """The example's values through the model's checks are computed with its real weights:
    torch 2.13 left an nn.Parameter's real tensor uninitialised in that export, so the checks
    read whatever memory held (here NaN: "tanh left its range" every time; before, by chance,
    after a few other exports in the process: tracing/export.py, parameters_given_values)."""
    graph = trace(load_example(spec("value_checked")))
    messages = [n.args[1] for n in graph.calls if n.target == "aten._assert_async.msg"]
    assert sorted(messages) == sorted(f"{message} ({_WORDS})" for message in MESSAGES.values())
