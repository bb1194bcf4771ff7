"""torch's fused operators stay fused in generated code (issue 43, item 2): layer norm, RMS norm
(when the model calls it), attention and cross entropy are traced as the operators the model
calls and emitted as such, never as the arithmetic they decompose into, so that each stage takes
eager's kernels; the package verifies against the model. Model: tests/models.py."""

from __future__ import annotations

from autopipe.spec import load_example
from autopipe.verify import verify

from conftest import compile_model

FUSED = (
    "aten.layer_norm.default",
    "aten.rms_norm.default",
    "aten.scaled_dot_product_attention.default",
    "aten.cross_entropy_loss.default",
)
#: what they decompose into
DECOMPOSED = (
    "aten.native_layer_norm",
    "aten.var_mean",
    "aten.rsqrt",
    "aten.pow",
    "aten._softmax",
    "aten.softmax",
    "aten.log_softmax",
    "aten._log_softmax",
    "aten.nll_loss",
    "aten.bmm",
    "aten.baddbmm",
)


def test_fused_operators_are_never_decomposed(tmp_path):
    result = compile_model("fused_operators", tmp_path / "pipe", 2)
    targets = [n.target for n in result.graph.calls]
    assert all(targets.count(op) == 1 for op in FUSED), targets
    assert not [t for t in targets if t.startswith(DECOMPOSED)], targets
    source = "".join(p.read_text() for p in sorted(result.out.glob("*.py")))
    for op in FUSED:
        assert op in source, op
    assert not [op for op in DECOMPOSED if op + "." in source or op + "(" in source]
    report = verify(result.out, load_example("tests/models.py:fused_operators"))
    assert {"output", "grad", "eval"} <= {c.kind for c in report.comparisons}
    assert report.ok, report.summary()
