"""autopipe/partitioning/handed_values.py: the values the generated code hands between units
and no unit keeps (its locals), found by storage, and how a stage's forward counts them."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from autopipe.ir import Graph
from autopipe.partitioning.cost import CostModel
from autopipe.partitioning.handed_values import HandedValue, handed_values
from autopipe.partitioning.stage_sums import StageSums
from autopipe.profiling.profile import Profile

from conftest import ROOT

GPT2 = ROOT / "generated" / "gpt2_4" / "artifacts"


@pytest.fixture(scope="module")
def gpt2():
    """The gallery's GPT-2 (4 blocks, dropout 0.1), profiled for an H100."""
    return CostModel(Graph.load(GPT2 / "graph.json"), Profile.load(GPT2 / "profile.json"))


def test_the_gallery_gpt2_hands_on_its_embeddings_and_projections(gpt2):
    """Handed on and kept by none: the two embeddings and their sum (the stage's locals), and in
    each block the attention's and the MLP's projections (read by a dropout, which keeps its
    mask alone) and the dropouts' outputs (read by a residual sum, which keeps nothing). Not
    handed: the final norm's output and its flattening view, whose storage the head keeps
    (under another name), and the head's output, whose storage is the model's logits."""
    name_of = {(e.producer, e.readers): e.name for e in gpt2.exchanges}
    handed = {name_of[(v.producer, v.readers)]: v for v in gpt2.handed}
    blocks = list(gpt2.blocks)
    assert {n for n, v in handed.items() if v.block < 0} == {"embedding", "embedding_1", "add_1"}
    for b, fqn in enumerate(blocks):
        own = {
            gpt2.graph.units[v.producer].label.split(" ")[0]
            for v in handed.values()
            if v.block == b
        }
        assert own == {
            f"{fqn}.{m}" for m in ("attn.c_proj", "attn.resid_dropout", "mlp.c_proj", "mlp.dropout")
        }
        assert gpt2.block_locals[fqn] == 4 * 2 * 64 * 128 * 4  # four [2, 64, 128] fp32 values
    head = [u.index for u in gpt2.graph.units if u.label.startswith("lm_head")]
    final = [u.index for u in gpt2.graph.units if u.label.startswith("transformer.ln_f")]
    assert head and final
    assert not [v for v in gpt2.handed if v.producer in head + final]
    assert "logits" in gpt2.graph.outputs


def test_storages_saved_or_returned_under_another_name_are_not_handed():
    exchanges = [
        ("norm", 0, (1,), 400.0),  # a view of it is read and saved by unit 2
        ("flat", 1, (2,), 400.0),
        ("out", 2, (3,), 800.0),  # its storage is the model's output, under another name
        ("logits", 3, (4,), 800.0),
        ("x", 0, (2,), 100.0),  # handed on, kept by none: made by 0, read by 2
        ("x_view", 1, (3,), 100.0),  # a view of x made by unit 1, read by 3
    ]
    storage_of = {"flat": "norm", "logits": "out", "x_view": "x"}
    savers = [[], [2], [], [], [], []]  # unit 2 saves flat
    handed = handed_values(exchanges, savers, storage_of, blocks=[(0, 1, 2)], num_units=4)
    # x and its view: one storage, made by unit 0, read by 1 (which made the view), 2 and 3; not
    # a block's own local (unit 3 is outside the block)
    assert handed == [HandedValue(producer=0, readers=(2, 3), nbytes=100.0, block=-1)]


def test_a_profile_that_records_nothing_saved_hands_nothing_on(gpt2):
    """What is kept cannot be told without the profile's ``saved_values``: no value counts as
    a local (rather than every one)."""
    profile = Profile.load(GPT2 / "profile.json")
    blind = replace(profile, units=[replace(u, saved_values=[]) for u in profile.units])
    assert gpt2.handed and CostModel(gpt2.graph, blind).handed == []


def _sums(stages_blocks, handed):
    """Three units; unit 0 makes 100 bytes unit 1 reads (handed); unit 2 saves 10."""
    n = 3
    return StageSums(
        num_units=n,
        forward=[0.0] * n,
        backward=[0.0] * n,
        activations=[0.0, 0.0, 10.0],
        temporaries=[0.0] * n,
        backward_memory=[0.0] * n,
        trainable_bytes=[0] * n,
        dp_shard=1,
        unit_params=[{} for _ in range(n)],
        frozen=frozenset(),
        step_time=lambda nbytes: 0.0,
        exchanges=[(0, 1, 100, 0), (1, 2, 10, 0)],
        savers=[[], [2]],
        blocks=stages_blocks,
        handed=handed,
    )


def test_a_block_counts_its_own_locals_while_whole_and_a_stage_its_own():
    value = HandedValue(producer=0, readers=(1,), nbytes=100.0, block=0)
    sums = _sums([(0, 1)], [value])
    # the block {0, 1} whole in stage 0: its local while it runs, when unit 2 has not saved its
    # 10 bytes yet (its input exists: the block's output)
    forward, _ = sums.transients(np.array([0, 0, 0]), 1)
    assert forward.tolist() == [100.0]
    forward, _ = sums.transients(np.array([0, 0, 1]), 2)
    assert forward.tolist() == [100.0, 0.0]
    # the block cut between its units: the value crosses to stage 1, a local of neither
    forward, _ = sums.transients(np.array([0, 1, 1]), 2)
    assert forward.tolist() == [0.0, 0.0]
    # not a block's: a local of the stage until it returns, where one stage makes and reads it
    sums = _sums([], [HandedValue(producer=0, readers=(1,), nbytes=100.0)])
    assert sums.transients(np.array([0, 0, 1]), 2)[0].tolist() == [100.0, 0.0]
    assert sums.transients(np.array([0, 1, 1]), 2)[0].tolist() == [0.0, 0.0]
