"""Recurrent modules traced as torch operators (issue 25, item 2, the part export can trace):
nn.GRU, nn.RNN and nn.LSTM over padded tensors, bidirectional and stacked, with initial states
given or not and a tied output layer, compile into 2 stages that match the model on the
example and on other values. Packed sequences (pack_padded_sequence) are not compiled yet."""

from __future__ import annotations

import pytest

import models
from autopipe.spec import Example, load_example
from autopipe.verify import verify

from conftest import compile_model, spec


@pytest.mark.parametrize("name", ["gru_seq2seq", "stacked_rnn", "lstm_lm"])
def test_recurrent_modules_over_tensors_match_the_model(tmp_path, name):
    out = tmp_path / "pipe"
    compile_model(name, out, 2)
    source = "".join(p.read_text() for p in sorted(out.glob("stage*.py")))
    assert any(
        op in source for op in ("aten.gru.input(", "aten.rnn_relu.input(", "aten.lstm.input(")
    )
    example = load_example(spec(name))
    report = verify(out, example, rtol=1e-5, atol=1e-6)
    assert report.ok, report.summary()
    model, args = getattr(models, name)(seed=1)  # the same weights (fresh), other values
    report = verify(out, Example(model, args), rtol=1e-5, atol=1e-6)
    assert report.ok, report.summary()
