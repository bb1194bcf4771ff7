"""Generated stages compute what the original model computes: outputs, gradients, buffers."""

from __future__ import annotations

import pytest
import torch

from autopipe.compiler import CompileOptions, generate_step, trace_step
from autopipe.partitioning import Partition
from autopipe.profiling.profile import graph_digest
from autopipe.spec import load_example
from autopipe.verify import verify

from conftest import compile_model, spec

# (model, stage counts): Hugging Face GPT-2 (tied embedding), BERT (attention mask), T5 (encoder
# output read by every decoder layer), a CNN (BatchNorm, in-place ReLU), an MLP with long skips, and
# a model with several inputs, a keyword argument and a dict of outputs.
CASES = [
    ("gpt2", 2),
    ("gpt2", 3),
    ("gpt2", 4),
    ("bert", 2),
    ("bert", 3),
    ("t5", 2),
    ("t5", 4),
    ("cnn", 2),
    ("cnn", 3),
    ("mlp", 2),
    ("mlp", 3),
    ("multi_io", 2),
    ("multi_io", 3),
]


@pytest.mark.parametrize("name,stages", CASES, ids=[f"{n}-{k}" for n, k in CASES])
def test_stages_match_model(tmp_path, name, stages):
    result = compile_model(name, tmp_path / "pipe", stages)
    assert result.partition.num_stages == stages
    # fp32 gradients summed in another order (a value read by several stages) differ by ~1e-6
    report = verify(tmp_path / "pipe", load_example(spec(name)), rtol=1e-4, atol=1e-5)
    assert report.ok, report.summary()
    kinds = {c.kind for c in report.comparisons}
    assert {"output", "grad"} <= kinds
    if name == "cnn":  # BatchNorm running statistics were updated and compared
        assert any(c.kind == "buffer" and "running_mean" in c.name for c in report.comparisons)


@pytest.mark.parametrize("name", ["cnn", "mlp", "multi_io"])
def test_every_two_stage_cut(tmp_path, name):
    """Cut between every pair of adjacent units: in-place ops on received values, relayed skips,
    BatchNorm buffers and multi-output operators all survive any boundary."""
    graph = trace_step(load_example(spec(name)), CompileOptions(stages=2))
    n = len(graph.units)
    for cut in range(1, n):
        out = tmp_path / f"cut{cut}"
        generate_step(
            graph,
            Partition("manual", [0] * cut + [1] * (n - cut), [0, 1], graph_digest(graph)),
            out,
        )
        report = verify(out, load_example(spec(name)), rtol=1e-5, atol=1e-6)
        assert report.ok, f"cut before {graph.units[cut].label}:\n{report.summary()}"


def test_inplace_on_received_value_is_cloned(tmp_path):
    graph = trace_step(load_example(spec("cnn")), CompileOptions(stages=2))
    cut = next(i for i, u in enumerate(graph.units) if "ReLU" in u.label)
    n = len(graph.units)
    generate_step(
        graph,
        Partition("manual", [0] * cut + [1] * (n - cut), [0, 1], graph_digest(graph)),
        tmp_path / "p",
    )
    stage1 = (tmp_path / "p" / "stage1.py").read_text()
    assert "# written in place below: keep the sender's tensor intact" in stage1
    assert ".clone()" in stage1
    assert "aten.relu_.default" in stage1


def test_verify_catches_a_wrong_stage(tmp_path):
    compile_model("mlp", tmp_path / "pipe", 2)
    stage = tmp_path / "pipe" / "stage1.py"
    source = stage.read_text()
    assert "aten.tanh.default(" in source
    stage.write_text(source.replace("aten.tanh.default(", "aten.sigmoid.default(", 1))
    report = verify(tmp_path / "pipe", load_example(spec("mlp")))
    assert not report.ok
    assert report.worst("output") > 1e-3


def test_dropout_masks_match_in_process(tmp_path):
    """With the same seed, the stages draw the same dropout masks as the original."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from autopipe import pipe_model
    from autopipe.spec import Example

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=4,
        vocab_size=50,
        n_positions=16,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)  # dropout 0.1 everywhere
    ids = torch.randint(0, 50, (2, 16))
    pipe_model(model, (ids,), {"labels": ids}, stages=2, out=tmp_path / "pipe")
    report = verify(
        tmp_path / "pipe", Example(model, (ids,), {"labels": ids}), rtol=1e-5, atol=1e-6
    )
    assert report.ok, report.summary()


METHOD_CASES = [
    (name, method, stages, devices)
    for name in ("gpt2", "t5", "mlp")  # tied weights, encoder-decoder fan-out, long skips
    for method in ("metis", "acyclic", "mpipe")
    for stages, devices in ((3, 3), (4, 2))
]


@pytest.mark.parametrize(
    "name,method,stages,devices",
    METHOD_CASES,
    ids=[f"{n}-{m}-{k}on{d}" for n, m, k, d in METHOD_CASES],
)
def test_every_method_matches_model(tmp_path, name, method, stages, devices):
    result = compile_model(name, tmp_path / "pipe", stages, method=method, devices=devices)
    assert result.partition.num_stages == stages
    assert len(set(result.partition.device_of_stage)) == devices
    report = verify(tmp_path / "pipe", load_example(spec(name)), rtol=1e-4, atol=1e-5)
    assert report.ok, report.summary()


def test_channels_last_activations_keep_their_layout_across_stages(tmp_path):
    """Convolutions and group norms in channels-last layout, cut into 3 stages: every value
    crosses a boundary contiguous and the next stage restores the layout, so outputs and
    gradients are bit-identical to the model (another layout rounds differently)."""
    compile_model("channels_last", tmp_path / "pipe", 3)
    stage = (tmp_path / "pipe" / "stage1.py").read_text()
    assert "memory_format=torch.channels_last" in stage
    report = verify(tmp_path / "pipe", load_example(spec("channels_last")), rtol=0, atol=0)
    assert report.ok, report.summary()
