"""Dynamic dimensions (--dynamic): declared, traced as torch.export Dims, written as formulas
in the generated code and pipeline.json, and trained on batches of another length each step
exactly as plain PyTorch trains on them."""

from __future__ import annotations

import json
import subprocess

import pytest
import sympy
import torch

import models
from autopipe.tracing.dynamic import DynamicDim, dynamic_dims, formula, parse_dynamic
from autopipe.errors import ArtifactError, AutopipeError, TraceError
from autopipe.ir import Graph, Size
from autopipe.ir.codec import decode, encode
from autopipe.ir.types import sizes_in
from autopipe.profiling import Profile, profile
from autopipe.runtime.data import Batches
from autopipe.runtime.options import parse_config
from autopipe.runtime.core.pipeline import Pipeline, PipelineFormatError
from autopipe.runtime.core.shapes import FormulaError, evaluate
from autopipe.spec import Example, load_example
from autopipe.tracing import trace
from autopipe.verify import verify

from conftest import ROOT, compile_model, spec, torchrun_command, torchrun_env
from pipelines import STEPS, assert_same_training, reference_training, run_pipeline

SEQ = "seq[4:32]=input_ids:1,labels:1"
BATCH = "batch[2:4]=input_ids:0,labels:0"


# -- declarations -----------------------------------------------------------------------------
def test_declarations_parse_with_and_without_bounds():
    assert parse_dynamic("seq=input_ids:1,labels:1") == DynamicDim(
        "seq", (("input_ids", 1), ("labels", 1))
    )
    assert parse_dynamic("seq[8:2048]=input_ids:1") == DynamicDim(
        "seq", (("input_ids", 1),), 8, 2048
    )
    assert parse_dynamic("seq[:64]=x:1").max == 64 and parse_dynamic("seq[:64]=x:1").min is None
    api = dynamic_dims({"seq": [("input_ids", 1), ("labels", 1)], "batch[2:8]": ("input_ids", 0)})
    assert [d.declaration() for d in api] == ["seq=input_ids:1,labels:1", "batch[2:8]=input_ids:0"]
    assert dynamic_dims(None) == dynamic_dims([]) == ()


@pytest.mark.parametrize(
    "text,message",
    [
        ("seq", "must have the form NAME=INPUT:DIM"),
        ("seq=input_ids", "must be INPUT:DIM"),
        ("seq[1:64]=input_ids:1", "lower bound must be at least 2"),
        ("seq[64:8]=input_ids:1", "upper bound is below the lower"),
        ("self=input_ids:1", "cannot name a dimension"),
    ],
)
def test_bad_declarations_are_refused_clearly(text, message):
    with pytest.raises(AutopipeError, match=message):
        parse_dynamic(text)


def test_a_dimension_or_input_declared_twice_is_refused():
    with pytest.raises(AutopipeError, match="declares the name seq twice"):
        dynamic_dims(["seq=a:1", "seq=b:1"])
    with pytest.raises(AutopipeError, match=r"input dimension \('a', 1\) twice"):
        dynamic_dims(["seq=a:1", "length=a:1"])


# -- formulas ---------------------------------------------------------------------------------
def test_formulas_print_as_python_and_evaluate_like_sympy():
    from torch.utils._sympy.functions import FloorDiv, PythonMod

    s, b = sympy.symbols("s0 s1", integer=True)
    names = {s: "seq", b: "batch"}
    cases = {
        2 * s: "2 * seq",
        s - 1: "seq - 1",
        sympy.Max(32, 32 * s): "max(32, 32 * seq)",
        (s + 1) * b: "batch * (seq + 1)",
        FloorDiv(s, 2): "seq // 2",
        PythonMod(s, 3): "seq % 3",
        b * s**2 - 2 * s: "batch * seq ** 2 - 2 * seq",
    }
    for expr, text in cases.items():
        assert formula(expr, names) == text
        for seq, batch in [(2, 3), (7, 2), (64, 5)]:
            expected = int(expr.xreplace({s: seq, b: batch}))
            assert evaluate(text, {"seq": seq, "batch": batch}) == expected, text


def test_floor_division_and_remainders_in_products_keep_their_grouping():
    from torch.utils._sympy.functions import CeilDiv, FloorDiv, PythonMod

    s, b = sympy.symbols("s0 s1", integer=True)
    names = {s: "seq", b: "batch"}
    for expr in (b * FloorDiv(s, 2), 2 * FloorDiv(s, 2), b * PythonMod(s, 4), CeilDiv(s, 3) * b):
        text = formula(expr, names)
        for seq, batch in [(7, 3), (9, 2), (16, 5)]:
            expected = int(expr.xreplace({s: seq, b: batch}))
            assert evaluate(text, {"seq": seq, "batch": batch}) == expected, text
    with pytest.raises(ValueError, match="fractional factor"):
        formula(s / 2, names)


def test_dimension_names_the_generated_code_needs_are_refused():
    with pytest.raises(AutopipeError, match="cannot name a dimension"):
        parse_dynamic("max=input_ids:1")
    with pytest.raises(AutopipeError, match="'labels' is a parameter of the model's forward"):
        trace(load_example(spec("gpt2")), dynamic=dynamic_dims(["labels=input_ids:1"]))


def test_a_negative_size_round_trips():
    assert (
        decode(encode([Size(-32, "-seq")])) == [-32]
        and decode(encode(Size(-3, "-seq"))).formula == "-seq"
    )


@pytest.mark.parametrize("text", ["__import__('os')", "seq.real", "seq / 2", "lambda: 1", "len"])
def test_the_runtime_evaluates_nothing_but_size_arithmetic(text):
    with pytest.raises(FormulaError):
        evaluate(text, {"seq": 4, "len": 1} if text != "len" else {})


# -- tracing ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpt2_graph() -> Graph:
    return trace(load_example(spec("gpt2")), dynamic=dynamic_dims([SEQ, BATCH]))


def test_every_traced_size_is_a_formula_planned_at_the_upper_bounds(gpt2_graph):
    graph = gpt2_graph
    assert graph.model.symbols_json() == {
        "seq": {"min": 4, "max": 32, "planned": 32, "sources": [["input_ids", 1], ["labels", 1]]},
        "batch": {"min": 2, "max": 4, "planned": 4, "sources": [["input_ids", 0], ["labels", 0]]},
    }
    assert graph["input_ids"].meta.shape == (4, 32)  # planned: the upper bounds
    assert graph["input_ids"].meta.sizes == ("batch", "seq")
    sizes = [s for node in graph.calls for s in sizes_in((node.args, node.kwargs))]
    assert {s.formula for s in sizes} == {"seq", "batch"}
    assert all(evaluate(s.formula, {"seq": 32, "batch": 4}) == int(s) for s in sizes)
    # no literal of the example's sizes (batch 2, sequence 16) is left in a view's shape
    for node in graph.calls:
        if node.target == "aten.view.default":
            assert not any(type(v) is int and v in (2, 16) for v in node.args[1]), node.args
    assert Graph.from_json(json.loads(json.dumps(graph.to_json()))).to_json() == graph.to_json()


def test_without_an_upper_bound_the_graph_is_planned_at_the_examples_size():
    graph = trace(load_example(spec("gpt2")), dynamic=dynamic_dims(["seq=input_ids:1,labels:1"]))
    assert graph.model.symbols_json()["seq"] == {
        "min": 2,
        "max": None,
        "planned": 16,
        "sources": [["input_ids", 1], ["labels", 1]],
    }
    assert graph["input_ids"].meta.shape == (2, 16) and graph["input_ids"].meta.sizes == (
        "2",
        "seq",
    )


def test_a_formula_that_does_not_give_its_planned_size_is_caught_by_lint(gpt2_graph):
    data = json.loads(json.dumps(gpt2_graph.to_json()))
    text = json.dumps(data).replace('{"size": [32, "seq"]}', '{"size": [32, "seq + 1"]}', 1)
    with pytest.raises(ArtifactError, match="whose formula gives it"):
        Graph.from_json(json.loads(text))


def test_a_dimension_the_model_fixes_is_named_at_the_users_line():
    example = load_example(spec("fixed_positions"))
    with pytest.raises(TraceError) as caught:
        trace(example, dynamic=dynamic_dims(["seq=x:1"]))
    message = str(caught.value)
    assert "the model fixes seq to 16" in message
    assert "tests/models.py:" in message and "x + self.positions" in message


@pytest.mark.parametrize(
    "declaration,message",
    [
        ("seq[4:8]=input_ids:1", "example's size 16 is outside the bounds"),
        ("seq=ids:1", "has no tensor input 'ids'"),
        ("seq=input_ids:2", "has no dimension 2"),
        ("seq=input_ids:1,labels:0", "the example's sizes differ"),
    ],
)
def test_declarations_that_do_not_fit_the_example_are_refused(declaration, message):
    with pytest.raises(AutopipeError, match=message):
        trace(load_example(spec("gpt2")), dynamic=dynamic_dims([declaration]))


def test_torch_cond_under_dynamic_dimensions_is_refused_at_its_line():
    with pytest.raises(TraceError, match="does not compile torch.cond with --dynamic") as caught:
        trace(load_example("tests/cond_models.py:cond_true"), dynamic=dynamic_dims(["rows=x:0"]))
    assert "tests/cond_models.py:" in str(caught.value)


def test_dynamic_with_a_loss_function_is_refused(tmp_path):
    with pytest.raises(AutopipeError, match="--dynamic with --loss is not supported"):
        compile_model(
            "mlp_with_target",
            tmp_path / "p",
            2,
            loss="tests/models.py:mse",
            dynamic=["batch=x:0"],
        )


# -- profiles ---------------------------------------------------------------------------------
def test_expected_sizes_time_the_units_and_memory_stays_at_the_upper_bounds(gpt2_graph):
    upper = profile(gpt2_graph, "analytic")
    expected = profile(gpt2_graph, "analytic", expected={"seq": 8, "batch": 2})
    assert expected.timed_at == {"seq": 8, "batch": 2} and upper.timed_at == {}
    # 2 x 8 tokens instead of 4 x 32: the FLOPs shrink (the tiny model's time is mostly launches)
    flops = [sum(u.flops_forward + u.flops_backward for u in p.units) for p in (expected, upper)]
    assert flops[0] < flops[1] / 6
    assert sum(u.time for u in expected.units) < sum(u.time for u in upper.units)
    for unit, at_upper in zip(expected.units, upper.units):
        assert (unit.activations, unit.temporaries, unit.outputs, unit.parameters) == (
            at_upper.activations,
            at_upper.temporaries,
            at_upper.outputs,
            at_upper.parameters,
        )
    assert Profile.from_json(expected.to_json()).to_json() == expected.to_json()
    with pytest.raises(AutopipeError, match="length is not a dynamic dimension"):
        profile(gpt2_graph, "analytic", expected={"length": 8})
    with pytest.raises(AutopipeError, match=r"seq=64 is outside the bounds \[4:32\]"):
        profile(gpt2_graph, "analytic", expected={"seq": 64})


def test_a_measured_profile_runs_at_the_upper_bounds_not_the_examples_sizes(gpt2_graph):
    example = load_example(spec("gpt2"))  # batch 2 x 16, the graph planned at 4 x 32
    measured = profile(gpt2_graph, "measured", example=example)
    assert len(measured.units) == len(gpt2_graph.units)
    assert all(unit.forward > 0 for unit in measured.units)


# -- generated code ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpt2_package(tmp_path_factory):
    out = tmp_path_factory.mktemp("dynamic") / "pipe"
    compile_model("gpt2", out, 2, dynamic=[SEQ, BATCH])
    return out


def test_generated_stages_read_sizes_from_their_inputs(gpt2_package):
    stage0 = (gpt2_package / "stage0.py").read_text()
    blocks = (gpt2_package / "blocks.py").read_text()
    assert "seq = input_ids.size(1)\n" in stage0  # the batch size only the blocks read
    assert (
        "batch = x.size(0)" in blocks
        and "seq = x.size(1)" in blocks
        and "aten.view.default(addmm, [batch, seq, 96])" in blocks
    )
    description = json.loads((gpt2_package / "pipeline.json").read_text())
    assert description["dimensions"]["seq"] == {
        "min": 4,
        "max": 32,
        "planned": 32,
        "sources": [["input_ids", 1], ["labels", 1]],
    }
    values = description["values"]
    assert values["input_ids"]["sizes"] == ["batch", "seq"]
    assert values["logits"]["sizes"] == ["batch", "seq", 97]
    assert "sizes" not in values["loss"]  # a scalar: static
    # the plan's FLOPs are for the upper bounds: train.py scales them by each step's tokens
    assert description["plan"]["sizes"] == {"seq": 32, "batch": 4}
    assert Pipeline.from_json(description).flops_scale({"seq": 16, "batch": 2}) == 0.25


@pytest.mark.parametrize("batch,seq", [(2, 16), (3, 4), (4, 32), (2, 9)])
def test_the_pipeline_computes_what_the_model_does_at_every_size(gpt2_package, batch, seq):
    model, _, _ = models.gpt2()
    ids = torch.randint(0, 97, (batch, seq))
    report = verify(gpt2_package, Example(model, (ids,), {"labels": ids.clone()}))
    assert report.ok, report.summary()


def test_an_example_outside_the_bounds_is_refused_by_verify(gpt2_package):
    model, _, _ = models.gpt2()
    ids = torch.randint(0, 97, (2, 33))
    with pytest.raises(AutopipeError, match=r"'seq' is 33, outside the bounds \[4:32\]"):
        verify(gpt2_package, Example(model, (ids,), {"labels": ids.clone()}))


def test_regeneration_is_byte_identical(gpt2_package, tmp_path):
    again = tmp_path / "again"
    compile_model("gpt2", again, 2, dynamic=[SEQ, BATCH])
    files = sorted(p.relative_to(gpt2_package) for p in gpt2_package.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    for name in files:
        assert (gpt2_package / name).read_bytes() == (again / name).read_bytes(), name


def test_a_formula_that_breaks_the_description_is_refused(gpt2_package):
    description = json.loads((gpt2_package / "pipeline.json").read_text())
    description["values"]["logits"]["sizes"] = ["batch", "seq + 1", 97]
    with pytest.raises(PipelineFormatError, match="formulas giving the shape"):
        Pipeline.from_json(description)
    description["values"]["logits"]["sizes"] = ["batch", "length", 97]
    with pytest.raises(PipelineFormatError, match="formulas of"):
        Pipeline.from_json(description)


def test_padding_to_a_multiple_rounds_lengths_up_without_changing_what_counts(gpt2_package):
    pipeline = Pipeline.from_json(json.loads((gpt2_package / "pipeline.json").read_text()))
    argv = ["--pad-to-multiple", "8", "--data", "tests/models.py:gpt2_lengths"]
    batches = Batches(pipeline, parse_config(argv, pipeline))
    for step, length in enumerate([16, 8, 32, 16]):  # from 16, 7, 32, 11
        (ids, labels), _ = batches(step)
        original = models.gpt2_lengths(step)[0][0]
        assert ids.shape == labels.shape == (8, length)
        given = original.shape[1]
        assert torch.equal(ids[:, :given], original) and torch.equal(labels[:, :given], original)
        assert (ids[:, given:] == 0).all() and (labels[:, given:] == -100).all()
    with pytest.raises(SystemExit):
        static = Pipeline.from_json(
            json.loads((ROOT / "generated/gpt2_4/pipeline.json").read_text())
        )
        parse_config(["--pad-to-multiple", "8"], static)


# -- training ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_gpt2_trains_like_pytorch_on_a_new_length_every_step_and_a_smaller_last_batch(tmp_path):
    """Tied embeddings, 1F1B; sequence lengths 16, 7, 32, 11 and 4, 4, 4, 2 samples per
    microbatch: every step's shapes are new to the pipeline."""
    data = "gpt2_lengths_smaller_last_batch"
    pipe = run_pipeline(tmp_path, "gpt2", 2, data, "--schedule", "1f1b", dynamic=[SEQ, BATCH])
    ref = reference_training(
        load_example(spec("gpt2")), getattr(models, data), STEPS, "adamw", 1e-3
    )
    assert_same_training(pipe, ref)
    assert torch.equal(pipe[1]["lm_head.weight"], pipe[1]["transformer.wte.weight"])


@pytest.mark.slow
def test_the_contracts_unbounded_declaration_trains_longer_and_shorter_than_the_example(tmp_path):
    """--dynamic seq=input_ids:1,labels:1 without bounds: lengths 16, 7, 32 and 11 around the
    example's 16 train as in PyTorch, with the default 1F1B schedule."""
    dynamic = ["seq=input_ids:1,labels:1"]
    pipe = run_pipeline(tmp_path, "gpt2", 2, "gpt2_lengths", dynamic=dynamic)
    ref = reference_training(load_example(spec("gpt2")), models.gpt2_lengths, STEPS, "adamw", 1e-3)
    assert_same_training(pipe, ref)


@pytest.mark.slow
def test_padded_lengths_train_like_pytorch_on_the_unpadded_batches(tmp_path):
    """--pad-to-multiple 8 pads with ignored labels: the loss and the update are the same."""
    extra = ("--pad-to-multiple", "8")
    pipe = run_pipeline(tmp_path, "gpt2", 2, "gpt2_lengths", *extra, dynamic=[SEQ])
    ref = reference_training(load_example(spec("gpt2")), models.gpt2_lengths, STEPS, "adamw", 1e-3)
    assert_same_training(pipe, ref)


@pytest.mark.slow
def test_sharded_stages_train_like_pytorch_on_new_lengths(tmp_path):
    """--dp-shard 2 (FSDP2, 4 processes): each rank's shards run every step's new length."""
    flags = ("--dp-shard", "2", "--microbatches", "2")
    pipe = run_pipeline(tmp_path, "gpt2", 2, "gpt2_lengths", *flags, nproc=4, dynamic=[SEQ])
    ref = reference_training(load_example(spec("gpt2")), models.gpt2_lengths, STEPS, "adamw", 1e-3)
    assert_same_training(pipe, ref)


@pytest.mark.slow
def test_t5_trains_like_pytorch_with_two_lengths_on_an_auto_schedule(tmp_path):
    """Encoder and decoder lengths vary independently; four Mixed-Pipe stages on two ranks
    run the cost-ordered ``auto`` schedule."""
    dynamic = ["src[3:16]=input_ids:1", "tgt[3:12]=labels:1"]
    pipe = run_pipeline(
        tmp_path, "t5", 4, "t5_lengths", "--schedule", "auto", devices=2, method="mpipe",
        dynamic=dynamic,
    )  # fmt: skip
    ref = reference_training(load_example(spec("t5")), models.t5_lengths, STEPS, "adamw", 1e-3)
    assert_same_training(pipe, ref)


@pytest.mark.slow
def test_bert_with_an_attention_mask_trains_like_pytorch_on_padded_lengths(tmp_path):
    dynamic = ["seq[4:32]=input_ids:1,attention_mask:1,labels:1"]
    pipe = run_pipeline(tmp_path, "bert", 2, "bert_lengths", dynamic=dynamic)
    ref = reference_training(load_example(spec("bert")), models.bert_lengths, STEPS, "adamw", 1e-3)
    assert_same_training(pipe, ref)


@pytest.mark.slow
def test_a_batch_outside_the_bounds_stops_every_rank_with_the_reason(gpt2_package):
    result = subprocess.run(
        torchrun_command(
            gpt2_package / "train.py", 2, "--steps", "3", "--data", "tests/models.py:gpt2_too_long"
        ),
        capture_output=True,
        text=True,
        timeout=300,
        env=torchrun_env(),
    )
    assert result.returncode != 0
    reason = "train.py: error: step 1: dimension 'seq' is 40, outside the bounds [4:32]"
    assert result.stderr.count(reason) == 1  # said once, by rank 0; the other rank stops too
    assert "driver.py" not in result.stderr  # no traceback of train.py (torchrun prints its own)
    assert "step 0 loss" in result.stdout and "step 1 loss" not in result.stdout
