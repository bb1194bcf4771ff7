"""Grouped-query attention is called as eager calls it (issue 43, item 2): an attention call
without a mask over keys and values repeated per query head (Hugging Face's ``repeat_kv``) takes
them unrepeated with ``enable_gqa=True`` (repeated by ``expand`` + ``reshape`` or by
``repeat_interleave``), and the copies are gone; a call with a mask, and repeats that are not
``enable_gqa``'s heads, keep them. Every rewrite verifies against the
model. Mirrors ``autopipe/tracing/grouped_query.py``; models in tests/causal_models.py."""

from __future__ import annotations

import pytest

from autopipe.ir import Graph
from autopipe.report.summary import attention_lines
from autopipe.spec import load_example
from autopipe.tracing.dynamic import dynamic_dims
from autopipe.tracing.export import trace
from autopipe.tracing.grouped_query import grouped_query
from autopipe.verify import verify

from conftest import compile_model

MODELS = "tests/causal_models.py"
REPEATS = ("aten.expand.default", "aten.repeat_interleave.self_int")


def spec(name: str) -> str:
    return f"{MODELS}:{name}"


def grouped(graph: Graph) -> list[bool]:
    """Per attention call, whether it takes enable_gqa=True."""
    return [grouped_query(n) for n in graph.calls if "attention" in n.target]


def repeats(graph: Graph) -> list[str]:
    return [n.name for n in graph.calls if n.target in REPEATS]


def assert_verifies(package, name: str) -> None:
    report = verify(package, load_example(spec(name)))
    assert {"output", "grad", "eval"} <= {c.kind for c in report.comparisons}
    assert report.ok, report.summary()


@pytest.mark.parametrize(
    "name,calls", [("llama", 2), ("grouped_expand", 1), ("grouped_interleave", 1)]
)
def test_repeated_keys_and_values_become_enable_gqa(tmp_path, name, calls):
    result = compile_model(spec(name), tmp_path / name, 2)
    graph = result.graph
    graph.lint()
    assert Graph.from_json(graph.to_json()).to_json() == graph.to_json()
    assert grouped(graph) == [True] * calls
    assert not repeats(graph)  # the copies are gone, not only unread
    source = "".join(p.read_text() for p in sorted(result.out.glob("*.py")))
    assert source.count("enable_gqa=True") >= 1
    assert "aten.expand" not in source and "repeat_interleave" not in source
    assert attention_lines(graph) == [
        f"attention: {calls} call{'s' if calls > 1 else ''} causal (no mask built or sent "
        f"between stages), 0 with an explicit mask, {calls} with enable_gqa (keys and values "
        "not repeated per query head)"
    ]
    assert_verifies(result.out, name)


def test_heads_tiled_instead_of_repeated_stay(tmp_path):
    """ "tiled" gives query head h the key/value head h % 2, which enable_gqa does not compute."""
    name = "grouped_tiled"
    result = compile_model(spec(name), tmp_path / name, 2)
    assert grouped(result.graph) == [False]
    assert repeats(result.graph)
    assert_verifies(result.out, name)


def test_a_call_with_an_explicit_mask_keeps_its_repeats():
    graph = trace(load_example(spec("llama_padded")))
    assert grouped(graph) == [False, False]
    assert len(repeats(graph)) >= 4  # a key and a value per layer


def test_under_dynamic_sizes_the_repeat_is_recognised():
    graph = trace(load_example(spec("grouped_expand")), dynamic=dynamic_dims(["seq[4:24]=x:1"]))
    graph.lint()
    assert grouped(graph) == [True] and not repeats(graph)
