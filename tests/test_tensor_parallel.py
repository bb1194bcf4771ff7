"""Tensor-parallel regions found in the graph (autopipe/tensor_parallel, issue 45 item 1):
Megatron's attention and MLP regions of GPT-2 (a fused query-key-value projection), a GQA
Llama and BERT, the vocabulary-parallel embedding and head, the degrees each allows, and the
regions refused with their reasons; the artefact's strict reader."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from torch import nn

from autopipe.compiler import CompileOptions, load_graph, trace_step
from autopipe.errors import ArtifactError
from autopipe.spec import Example, load_example
from autopipe.partitioning.network import Network
from autopipe.partitioning.tensor_parallel import sharded_profile
from autopipe.profiling import device_spec, profile
from autopipe.tensor_parallel import TensorParallelRegions, find_regions, sharding_plan


def _traced(model: nn.Module, *args, **kwargs):
    return trace_step(Example(model, args, kwargs), CompileOptions(stages=1))


def _llama(heads: int, kv_heads: int, ffn: int = 344, bias: bool = False):
    config = tf.LlamaConfig(
        hidden_size=16 * heads,
        intermediate_size=ffn,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=1024,
        use_cache=False,
        attention_bias=bias,
    )
    torch.manual_seed(0)
    ids = torch.randint(0, 1024, (2, 32))
    return _traced(tf.LlamaForCausalLM(config), ids, labels=ids)


def test_gpt2s_fused_attention_mlp_embedding_and_head():
    """The gallery's GPT-2: each block's ``c_attn`` is one projection whose output splits into
    query, key and value (three sections, each split by whole heads), ``c_proj`` its row; the
    MLP's ``c_fc`` / ``c_proj``; the token embedding and the tied head over the vocabulary
    (the position embedding stays replicated). 4 heads: degrees 2 and 4."""
    graph = load_graph("generated/gpt2_4/artifacts/graph.json")
    found = find_regions(graph)
    kinds = [r.kind for r in found.regions]
    assert kinds.count("attention") == 4 and kinds.count("mlp") == 4
    assert kinds[0] == "embedding" and kinds[-1] == "head"
    attention = next(r for r in found.regions if r.kind == "attention")
    assert [c.weight for c in attention.columns] == ["transformer.h.0.attn.c_attn.weight"]
    assert attention.columns[0].sections == (128, 128, 128) and attention.columns[0].dim == 1
    assert attention.row == "transformer.h.0.attn.c_proj.weight"
    # the split into query, key and value gives each section its size: a rank's is its share
    splits = [name for name, _ in attention.reshapes if graph[name].target == "aten.split.Tensor"]
    assert len(splits) == 1
    assert (attention.heads, attention.kv_heads, attention.degrees) == (4, 4, (2, 4))
    mlp = next(r for r in found.regions if r.kind == "mlp")
    assert mlp.row == "transformer.h.0.mlp.c_proj.weight" and 64 in mlp.degrees
    embedding, head = found.regions[0], found.regions[-1]
    assert embedding.columns[0].weight == head.columns[0].weight == "transformer.wte.weight"
    assert found.degrees() == (2, 4)
    assert found.summary().startswith(
        "tensor-parallel regions: 1 embedding, 4 attention, 4 mlp, 1 head; degrees 2, 4"
    )
    # the package carries the same regions as an artefact of its own
    saved = TensorParallelRegions.load("generated/gpt2_4/artifacts/tp_regions.json")
    assert saved == found


def test_grouped_query_llama_splits_whole_key_value_heads():
    """8 query heads reading 2 key/value heads: degree 2 splits both; 4 and 8 split the query
    heads and replicate the key and value projections (each rank computes the one key/value
    head its query heads read), marked ``key_value`` in the artefact; the gated MLP's gate and
    up projections are its columns."""
    graph = _llama(8, 2)
    found = find_regions(graph)
    attention = [r for r in found.regions if r.kind == "attention"]
    assert len(attention) == 2
    first = attention[0]
    assert [c.weight.rsplit(".", 2)[-2] for c in first.columns] == ["q_proj", "k_proj", "v_proj"]
    assert [c.key_value for c in first.columns] == [False, True, True]
    assert first.row.endswith("o_proj.weight") and (first.heads, first.kv_heads) == (8, 2)
    assert first.degrees == (2, 4, 8)
    assert not first.replicates_heads(2) and first.replicates_heads(4)
    assert first.why_not(16) == "16 does not divide 2 key/value heads, 8 heads"
    mlp = next(r for r in found.regions if r.kind == "mlp")
    assert [c.weight.rsplit(".", 2)[-2] for c in mlp.columns] == ["gate_proj", "up_proj"]
    assert mlp.degrees == (2, 4, 8)
    assert TensorParallelRegions.from_json(found.to_json()) == found
    # the plan: split at 2, key and value replicated at 4 with their parameters listed
    assert {m.heads for m in sharding_plan(graph, found, 2).modules} == {0}
    plan = sharding_plan(graph, found, 4)
    grouped = [m for m in plan.modules if m.heads]
    assert [m.module.rsplit(".", 1)[-1] for m in grouped] == ["k_proj", "v_proj"] * 2
    assert grouped[0].style_source().startswith("ReplicatedHeadsParallel(heads=2")
    assert grouped[0].parameters == ("model.layers.0.self_attn.k_proj.weight",)
    assert grouped[0].rank_share(4) == 0.5 and plan.modules[0].rank_share(4) == 0.25
    assert "key/value heads replicated: 4 projections of 2 head(s)" in plan.summary()


def test_replicated_key_value_biases_are_held_whole_in_the_cost_model():
    """With biased projections at degree 4 (2 key/value heads replicated), each rank holds a
    quarter of the query projection's bias and the key and value projections' biases whole (the
    output projection's, a row's, whole as ever): 2 layers x 128 query biases x 3/4 more
    parameter bytes saved than without biases."""
    saved = []
    for bias in (False, True):
        graph = _llama(8, 2, bias=bias)
        base = profile(graph, "analytic", device_spec("H100"))
        plan = sharding_plan(graph, find_regions(graph), 4)
        saved.append(
            sharded_profile(graph, base, plan, Network(base.device, 8))[1].parameters_saved
        )
    assert saved[1] - saved[0] == 2 * 128 * 4 * 3 / 4


def test_multi_query_attention_replicates_its_one_key_value_head():
    """One key/value head (multi-query attention): its view into one head is the heads'
    dimension, so attention is a region, split at every degree the query heads allow with the
    key and value replicated."""
    found = find_regions(_llama(8, 1))
    attention = next(r for r in found.regions if r.kind == "attention")
    assert (attention.heads, attention.kv_heads, attention.degrees) == (8, 1, (2, 4, 8))
    assert all(attention.replicates_heads(d) for d in (2, 4, 8))


def test_heads_that_do_not_divide_leave_attention_replicated():
    """6 heads: degrees 2 only (4 and 8 leave each attention replicated, naming the heads)."""
    found = find_regions(_llama(6, 6, ffn=384))
    attention = next(r for r in found.regions if r.kind == "attention")
    assert attention.degrees == (2,) and attention.why_not(4) == "4 does not divide 6 heads"


class _SharedMlp(nn.Module):
    """One MLP applied twice (ALBERT-style sharing): one weight, two regions."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def mlp(self, x):
        return self.down(torch.relu(self.up(x)))

    def forward(self, x):
        x = x + self.mlp(x)
        return (x + self.mlp(x)).sum()


def test_a_projection_shared_by_two_regions_is_refused():
    found = find_regions(_traced(_SharedMlp(), torch.randn(4, 32)))
    assert len(found.regions) == 2
    for region in found.regions:
        assert region.degrees == () and "read twice" in region.reason


class _Normalised(nn.Module):
    """A projection followed by a normalisation over its features (BERT's MLM transform):
    no region (the features must be whole)."""

    def __init__(self) -> None:
        super().__init__()
        self.dense, self.norm, self.out = nn.Linear(32, 64), nn.LayerNorm(64), nn.Linear(64, 8)

    def forward(self, x):
        return self.out(self.norm(self.dense(x))).sum()


def test_a_normalisation_over_the_features_is_no_region():
    assert find_regions(_traced(_Normalised(), torch.randn(4, 32))).regions == ()


def test_the_artefact_reads_strictly():
    found = find_regions(load_graph("generated/gpt2_4/artifacts/graph.json"))
    data = found.to_json()
    assert TensorParallelRegions.from_json(data) == found
    with pytest.raises(ArtifactError, match=r"regions\[0\]\.kind"):
        TensorParallelRegions.from_json(data | {"regions": [data["regions"][0] | {"kind": "conv"}]})
    with pytest.raises(ArtifactError, match="not a field"):
        TensorParallelRegions.from_json(data | {"extra": 1})


class _Prefixed(nn.Module):
    """A learned full-width prefix concatenated to the MLP's hidden features along the
    sequence: the prefix is whole on every rank, so no split of ``up`` is exact."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)
        self.prefix = nn.Parameter(torch.randn(1, 3, 64))

    def forward(self, x):
        hidden = torch.cat([self.prefix.expand(x.shape[0], 3, 64), self.up(x)], dim=1)
        return (x[:, :1] + self.down(torch.relu(hidden))[:, :1]).sum()


class _HeadBias(nn.Module):
    """Attention with a learned bias per head ([heads, L, S], broadcast over the batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(32, 32) for _ in range(4))
        self.bias = nn.Parameter(torch.randn(4, 5, 5))

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, 4, 8).transpose(1, 2) for p in (self.q, self.k, self.v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.bias)
        return (x + self.o(out.transpose(1, 2).reshape(b, n, 32))).sum()


class _FusedKeyValue(nn.Module):
    """Grouped-query attention whose key and value are one projection (``kv``) split in two:
    8 query heads, 2 key/value heads, with biases."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.kv, self.o = nn.Linear(32, 32), nn.Linear(32, 16), nn.Linear(32, 32)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, 8, 4).transpose(1, 2)
        k, v = (t.view(b, n, 2, 4).transpose(1, 2) for t in self.kv(x).split(8, dim=-1))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return (x + self.o(out.transpose(1, 2).reshape(b, n, 32))).sum()


def test_a_fused_key_value_projection_is_not_replicated_by_heads():
    """Split at 2 (each rank a key/value head of each section); at 4 a rank would need one head
    of each of its sections, which no style gives: left replicated, saying so."""
    graph = _traced(_FusedKeyValue(), torch.randn(2, 5, 32))
    found = find_regions(graph)
    (attention,) = [r for r in found.regions if r.kind == "attention"]
    assert attention.kv_heads == 2 and attention.replicates_heads(4)
    assert sharding_plan(graph, found, 2).modules
    plan = sharding_plan(graph, found, 4)
    assert not plan.modules
    assert "fused key/value projection of 2 head(s)" in plan.replicated[0][1]


class _Classifier(nn.Module):
    """RoBERTa's classification head: dense, tanh, out, cross-entropy over 4 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.dense, self.out = nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.out(torch.tanh(self.dense(x[:, 0]))), y)


def test_what_no_split_makes_exact_is_refused():
    """Found in review: a full-width value concatenated to a shard, and a bias per head that
    nothing splits, leave their regions unsplit; a projection feeding a loss through another
    projection is no vocabulary head."""
    prefixed = find_regions(_traced(_Prefixed(), torch.randn(2, 5, 32)))
    assert all(not r.splits for r in prefixed.regions)
    (attention,) = find_regions(_traced(_HeadBias(), torch.randn(2, 5, 32))).regions
    assert attention.kind == "attention" and not attention.splits
    assert "a mask per head ([4, 5, 5]) is not split" in attention.reason
    classifier = find_regions(_traced(_Classifier(), torch.randn(2, 5, 32), torch.tensor([1, 2])))
    assert [(r.kind, r.row) for r in classifier.regions] == [("mlp", "out.weight")]


def test_a_batch_of_one_keeps_the_heads_sharded():
    """Views of a batch of one (``[1, -1, S, D]`` after attention) have a leading dimension of
    1 that is not the shard's: the attention region of a Llama fed one sequence splits."""
    config = tf.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        use_cache=False,
    )
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (1, 16))
    found = find_regions(_traced(tf.LlamaForCausalLM(config), ids, labels=ids))
    (attention,) = [r for r in found.regions if r.kind == "attention"]
    assert attention.degrees == (2, 4) and not attention.reason  # 4: key/value replicated


def test_a_weight_another_operator_reads_stays_replicated():
    """An embedding whose table also computes the logits (``h @ table.T``): sharding it would
    hand a DTensor to the product, so the plan keeps it whole, saying why."""

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(64, 16)
            self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

        def forward(self, ids, labels):
            h = self.tok(ids)
            h = h + self.down(torch.relu(self.up(h)))
            logits = h @ self.tok.weight.T
            return nn.functional.cross_entropy(logits.view(-1, 64), labels.view(-1))

    ids = torch.randint(0, 64, (2, 8))
    graph = _traced(Tied(), ids, ids.clone())
    plan = sharding_plan(graph, find_regions(graph), 2)
    assert [m.module for m in plan.modules] == ["up", "down"]
    assert any(scope == "tok" and "read by more than one operator" in why
               for scope, why in plan.replicated)  # fmt: skip


def test_the_token_embedding_is_the_table_that_looks_up_the_input():
    """examples/finetune.py's GPT-2 has as many positions as tokens (256): the position table,
    which looks up computed positions, is not the vocabulary's."""
    graph = load_graph("generated/finetune_2/artifacts/graph.json")
    tables = [r.scope for r in find_regions(graph).regions if r.kind == "embedding"]
    assert tables == ["transformer.wte"]


def test_a_flattening_view_of_dynamic_rows_keeps_its_region_replicated():
    """GPT-2's row projections read ``view(x, [-1, features])``: at a fixed shape generated code
    writes the row count and frees the features (``[24, -1]``); with a dynamic sequence the row
    count is computed at run time, which that writing would freeze, so the regions stay
    replicated, saying why."""
    example = load_example("tests/causal_models.py:gpt2_plain")
    graph = trace_step(example, CompileOptions(stages=1, dynamic=["seq=input_ids:1,labels:1"]))
    plan = sharding_plan(graph, find_regions(graph), 2)
    assert not plan.modules
    why = dict(plan.replicated)["transformer.h.0.attn.c_attn"]
    assert why.endswith(
        "fixes the sharded size 32 and leaves another one, computed at run time, to -1"
    )
