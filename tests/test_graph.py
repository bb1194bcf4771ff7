"""The graph IR: what the tracer records, and its JSON round trip."""

from __future__ import annotations

import json

import torch

from autopipe.artifacts import dumps
from autopipe.compiler import CompileOptions, trace_step
from autopipe.ir import Graph, TensorMeta
from autopipe.spec import load_example

from conftest import spec


def test_round_trip_is_exact():
    graph = trace_step(load_example(spec("t5")), CompileOptions(stages=1))
    text = dumps(graph.to_json())
    again = Graph.from_json(json.loads(text))
    assert dumps(again.to_json()) == text
    assert list(again.dag.edges) == list(graph.dag.edges)


def test_nodes_carry_scopes_shapes_and_autograd_flags():
    graph = trace_step(load_example(spec("gpt2")), CompileOptions(stages=1))
    assert graph.inputs == ["input_ids", "labels"]
    assert graph.outputs == ["loss", "logits"]
    attn = [n for n in graph.calls if n.scope and n.scope[-1].class_name == "GPT2Attention"]
    assert attn and attn[0].scope[0].fqn == "transformer"
    sdpa = next(n for n in graph.calls if n.target == "aten.scaled_dot_product_attention.default")
    assert isinstance(sdpa.meta, TensorMeta) and sdpa.meta.dtype == torch.float32
    assert sdpa.meta.requires_grad
    assert sdpa.args[3] is None and sdpa.args[5] is True  # its causal mask recognised
    positions = next(
        n for n in graph.calls if isinstance(n.meta, TensorMeta) and n.meta.dtype == torch.int64
    )
    assert not positions.meta.requires_grad
    assert graph["loss"].meta.shape == ()
    assert graph.param_of("lm_head.weight").names == ("transformer.wte.weight", "lm_head.weight")
    # a networkx DiGraph of data dependencies
    assert graph.dag.has_edge("input_ids", graph.users("input_ids")[0])


def test_units_follow_depth_and_basic_blocks():
    example = load_example(spec("gpt2"))
    fine = trace_step(example, CompileOptions(stages=1))
    blocks = trace_step(example, CompileOptions(stages=1, basic_blocks=("GPT2Block",)))
    shallow = trace_step(example, CompileOptions(stages=1, depth=1))
    labels = [u.label for u in blocks.units]
    assert labels.count("transformer.h.0 (GPT2Block)") == 1
    assert len(shallow.units) < len(blocks.units) < len(fine.units)
    # every unit is a contiguous run of operators in program order
    for graph in (fine, blocks, shallow):
        order = [n.unit for n in graph.calls]
        assert order == sorted(order)


def test_module_called_twice_gives_two_units():
    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 4)
            self.mid = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.layer(self.mid(self.layer(x)))

    from autopipe.spec import Example

    graph = trace_step(Example(Twice(), (torch.randn(2, 4),)), CompileOptions(stages=1))
    assert [u.label for u in graph.units] == ["layer (Linear)", "mid (Linear)", "layer (Linear)"]


def test_meta_models_trace_without_weights():
    from transformers import GPT2Config, GPT2LMHeadModel

    from autopipe.spec import Example

    with torch.device("meta"):
        model = GPT2LMHeadModel(
            GPT2Config(
                n_layer=2, n_embd=32, n_head=4, vocab_size=50, n_positions=16, use_cache=False
            )
        )
    ids = torch.randint(0, 50, (2, 16))
    graph = trace_step(Example(model, (ids,), {"labels": ids}), CompileOptions(stages=1))
    assert graph.model.on_meta and graph.model.input_ranges["input_ids"] == int(ids.max())
