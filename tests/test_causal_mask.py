"""Generated graphs keep eager's causal fast path (issue 43, item 2): a mask computed from sizes
and constants only that is causal becomes ``is_causal=True`` with nothing built or shipped
between stages (one that masks nothing is dropped); a mask that reads input values (padding) or
is not causal (a sliding window shorter than the sequence, a mask over the future) stays
explicit and exact. Mirrors ``autopipe/tracing/causal_mask.py``; models in
tests/causal_models.py."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from autopipe.ir import Graph
from autopipe.report.summary import attention_lines
from autopipe.spec import load_example
from autopipe.tracing.causal_mask import CAUSAL, FULL, attention_masking, mask_kind
from autopipe.tracing.dynamic import dynamic_dims
from autopipe.tracing.export import trace
from autopipe.verify import verify

from causal_models import SEQ
from conftest import compile_model

MODELS = "tests/causal_models.py"


def spec(name: str) -> str:
    return f"{MODELS}:{name}"


def masking(graph: Graph) -> list[str]:
    return [m for m in map(attention_masking, graph.calls) if m is not None]


def square_bool_nodes(graph: Graph, seq: int = SEQ) -> list[str]:
    """Boolean values of shape [..., seq, seq]: a mask built in the graph."""
    return [
        n.name
        for n in graph.calls
        if n.tensor_meta is not None
        and n.tensor_meta.dtype == torch.bool
        and n.tensor_meta.shape[-2:] == (seq, seq)
    ]


def source_of(package) -> str:
    return "".join(p.read_text() for p in sorted(package.glob("*.py")))


def attention_calls(source: str) -> list[str]:
    """The arguments of each attention call in generated code."""
    return re.findall(r"scaled_dot_product_attention\.default\((.*?)\n\s*\)", source, re.S)


def sent_masks(package) -> list[str]:
    """Boolean values the package's stages exchange."""
    values = json.loads((package / "pipeline.json").read_text())["values"]
    return [name for name, value in values.items() if value["dtype"] == "bool"]


def compiled(tmp_path, name: str):
    result = compile_model(spec(name), tmp_path / name, 2)
    result.graph.lint()
    again = Graph.from_json(result.graph.to_json())  # lints it too
    assert again.to_json() == result.graph.to_json()
    return result


def assert_verifies(package, name: str) -> None:
    report = verify(package, load_example(spec(name)))
    kinds = {c.kind for c in report.comparisons}
    assert {"output", "grad", "eval"} <= kinds, kinds
    assert report.ok, report.summary()


# -- recognised -------------------------------------------------------------------------------
@pytest.mark.parametrize("name,calls", [("llama", 2), ("gpt2", 2)])
def test_a_causal_mask_built_from_sizes_becomes_is_causal(tmp_path, name, calls):
    result = compiled(tmp_path, name)
    graph = result.graph
    assert masking(graph) == ["causal"] * calls
    assert not square_bool_nodes(graph)
    source = source_of(result.out)
    written = attention_calls(source)  # the layers' calls, written once in blocks.py
    assert written and all(
        re.search(r"\bNone,\s+0\.1 if self\.training else 0\.0,\s+True,", call) for call in written
    ), written
    assert not sent_masks(result.out)
    for mask_op in ("aten.le.Tensor", "aten.__and__.Tensor", "aten.new_ones", "aten.cumsum"):
        assert mask_op not in source, mask_op
    grouped = f", {calls} with enable_gqa (keys and values not repeated per query head)"
    assert attention_lines(graph) == [
        f"attention: {calls} calls causal (no mask built or sent between stages), "
        "0 with an explicit mask" + (grouped if name == "llama" else "")
    ]
    assert_verifies(result.out, name)


@pytest.mark.parametrize("name", ["hand_causal", "hand_float"])
def test_hand_written_causal_masks_are_recognised(tmp_path, name):
    result = compiled(tmp_path, name)
    assert masking(result.graph) == ["causal"]
    assert "aten.tril" not in source_of(result.out) and "aten.triu" not in source_of(result.out)
    assert_verifies(result.out, name)


def test_a_mask_built_from_sizes_that_masks_nothing_is_dropped(tmp_path):
    result = compiled(tmp_path, "hand_full")
    assert masking(result.graph) == ["none"] and not square_bool_nodes(result.graph)
    (call,) = attention_calls(source_of(result.out))
    assert re.search(r"\bNone,\s+0\.1 if self\.training else 0\.0,?$", call.strip()), call
    assert attention_lines(result.graph) == [
        "attention: 0 calls causal (no mask built or sent between stages), "
        "0 with an explicit mask, 1 without a mask"
    ]
    assert_verifies(result.out, "hand_full")


# -- kept explicit ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["llama_padded", "mistral_window", "hand_future"])
def test_masks_from_input_values_or_not_causal_stay_explicit(tmp_path, name):
    result = compiled(tmp_path, name)
    graph = result.graph
    assert set(masking(graph)) == {"mask"}
    assert square_bool_nodes(graph)
    assert all("None" not in call.split(",")[3] for call in attention_calls(source_of(result.out)))
    assert attention_lines(graph)[0].startswith("attention: 0 calls causal")
    assert_verifies(result.out, name)


@pytest.mark.parametrize("name", ["qwen2_window", "hand_window"])
def test_sliding_windows_shorter_than_the_sequence_stay_explicit(name):
    graph = trace(load_example(spec(name)))
    assert set(masking(graph)) == {"mask"} and square_bool_nodes(graph)


# -- dynamic sizes ----------------------------------------------------------------------------
def test_under_dynamic_sizes_a_mask_causal_at_every_size_within_the_bounds_is_recognised():
    graph = trace(load_example(spec("hand_causal")), dynamic=dynamic_dims(["seq[4:24]=x:1"]))
    graph.lint()
    assert masking(graph) == ["causal"]
    assert not [n for n in graph.calls if n.target.startswith(("aten.tril", "aten.ones"))]


@pytest.mark.parametrize(
    "name,declaration",
    [
        ("hand_causal", "seq=x:1"),  # unbounded: no size can be left unchecked
        ("hand_window", "seq[2:16]=x:1"),  # causal at 2 and 3 only
    ],
)
def test_under_dynamic_sizes_other_masks_stay_explicit(name, declaration):
    graph = trace(load_example(spec(name)), dynamic=dynamic_dims([declaration]))
    assert masking(graph) == ["mask"]


# -- the comparison ---------------------------------------------------------------------------
def test_what_counts_as_causal_or_as_masking_nothing():
    ones = torch.ones(4, 4, dtype=torch.bool)
    scores = (2, 3, 4, 4)
    assert mask_kind(ones.tril(), scores) == CAUSAL
    assert mask_kind(ones.tril().expand(2, 1, 4, 4), scores) == CAUSAL
    assert mask_kind(ones.tril().expand(3, 1, 4, 4), scores) is None  # does not broadcast
    assert mask_kind(ones.triu(), scores) is None
    assert mask_kind(ones.tril()[1], scores) is None  # one row for every query
    assert mask_kind(torch.ones(4, 5, dtype=torch.bool).tril(), (2, 3, 4, 5)) is None
    blocked = torch.full((4, 4), -math.inf).triu(1)
    assert mask_kind(blocked, scores) == CAUSAL
    lowest = torch.full((4, 4), torch.finfo(torch.bfloat16).min, dtype=torch.bfloat16).triu(1)
    assert mask_kind(lowest, scores) == CAUSAL
    assert mask_kind(torch.full((4, 4), -1e4).triu(1), scores) is None  # a bias, not a mask
    assert mask_kind(ones.tril().long(), scores) is None
    assert mask_kind(ones, scores) == FULL
    assert mask_kind(torch.ones(2, 1, 1, 5, dtype=torch.bool), (2, 3, 4, 5)) == FULL
    assert mask_kind(torch.zeros(4, 4), scores) == FULL
    assert mask_kind(torch.ones(4, 4), scores) is None  # a bias of 1 everywhere
    assert mask_kind(torch.ones(3, 1, 4, 4, dtype=torch.bool), scores) is None
