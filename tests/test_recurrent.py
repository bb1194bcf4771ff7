"""Recurrent modules (issue 25, item 2).

nn.GRU, nn.RNN and nn.LSTM over padded tensors are traced as torch operators; over packed
sequences (pack_padded_sequence / pad_packed_sequence, enforce_sorted either way, initial states
given or not) they are kept whole: one call of the torch module in the generated stage, which
holds it at its original name with its parameters. Each compiles into 2 stages matching the
model on the example and on other values and lengths; a packed sequence crosses a stage boundary
as its tensors. ``--keep-whole`` keeps any torch.nn module so. The GRU encoder-decoder and the
stacked RNN train through train.py like PyTorch, and so does the zoo's packed LSTM language model
(tests/zoo/models.py, tests/test_zoo.py)."""

from __future__ import annotations

import inspect
import json
import re

import pytest
import torch

import models
from autopipe.artifacts import read_artifact
from autopipe.compiler import load_graph
from autopipe.errors import ArtifactError, AutopipeError, TraceError
from autopipe.ir import MODULE_TARGET, Graph
from autopipe.ir.kept_module import rnn_results_like
from autopipe.runtime.core.kept_modules import tensors_of
from autopipe.spec import Example, load_example
from autopipe.report.summary import kept_whole_lines
from autopipe.tracing import trace
from autopipe.verify import load_pipeline, verify

from conftest import compile_model, spec
from pipelines import (
    STEPS,
    assert_same_training,
    reference_training,
    run_pipeline,
    run_stages,
)

PACKED = ["packed_lstm_lm", "packed_gru_seq2seq", "packed_stacked_rnn", "pack_unpack"]


def _source(package) -> str:
    return "".join(p.read_text() for p in sorted(package.glob("stage*.py")))


def _flat(text: str) -> str:
    """``text`` without white space: generated calls as black may wrap them."""
    return re.sub(r"\s+", "", text)


def _assert_matches(package, example) -> None:
    report = verify(package, example, rtol=1e-5, atol=1e-6)
    assert report.ok, report.summary()


@pytest.mark.parametrize("name", ["gru_seq2seq", "stacked_rnn", "lstm_lm"])
def test_recurrent_modules_over_tensors_match_the_model(tmp_path, name):
    out = tmp_path / "pipe"
    compile_model(name, out, 2)
    source = _source(out)
    assert any(
        op in source for op in ("aten.gru.input(", "aten.rnn_relu.input(", "aten.lstm.input(")
    )
    assert "keep_whole(" not in source  # export traces them: nothing kept whole
    _assert_matches(out, load_example(spec(name)))
    model, args = getattr(models, name)(seed=1)  # the same weights (fresh), other values
    _assert_matches(out, Example(model, args))


@pytest.mark.parametrize(
    "name,dynamic,rnn",
    [
        ("lstm_lm", "seq[2:64]=ids:1", "lstm"),
        ("stacked_rnn", "steps[2:32]=x:0", "rnn"),
        ("lstm_from_state", "steps[2:32]=x:1", "lstm"),
    ],
)
def test_rnns_over_a_dynamic_length_are_kept_whole_and_match_on_other_lengths(
    tmp_path, name, dynamic, rnn
):
    """torch's RNN kernels walk the sequence step by step, which fixed a dynamic length to the
    example's (the compile was refused): an RNN given a dynamic length is kept whole, its
    results shaped from its input, and the stages match the model on lengths other than the
    example's (outputs and gradients)."""
    out = tmp_path / "pipe"
    result = compile_model(name, out, 2, dynamic=(dynamic,))
    source = _source(out)
    assert f'keep_whole(self,"{rnn}",nn.' in _flat(source)
    assert "aten.lstm" not in source and "aten.rnn_relu" not in source
    line = kept_whole_lines(result.graph, result.partition)[0]
    assert f"{rnn} (nn.{'LSTM' if rnn == 'lstm' else 'RNN'}, over a dynamic size)" in line
    model, args = getattr(models, name)()
    if name == "lstm_from_state":  # the state passed as a pair, as the model passes it
        assert "tensors_of(self.lstm(x,(h0,c0)))" in _flat(source)
    for steps in (3, 11):
        g = torch.Generator().manual_seed(steps)
        if name == "lstm_lm":
            inputs: tuple = (torch.randint(0, 40, (3, steps), generator=g),)
        elif name == "stacked_rnn":
            inputs = (torch.randn(steps, 2, 8, generator=g), args[1])
        else:
            inputs = models.lstm_from_state(seed=steps, steps=steps)[1]
        _assert_matches(out, Example(getattr(models, name)()[0], inputs))


@pytest.mark.parametrize(
    "rnn",
    [
        torch.nn.LSTM(8, 16, batch_first=True, bidirectional=True, proj_size=4),
        torch.nn.LSTM(8, 16, num_layers=2),
        torch.nn.GRU(8, 16, batch_first=True),
        torch.nn.RNN(8, 16, num_layers=3, bidirectional=True),
    ],
    ids=["lstm-batch-first-bidirectional-proj", "lstm-time-first", "gru-batch-first", "rnn"],
)
@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")
def test_results_shaped_from_the_input_are_those_of_torch_s_kernels(rnn, batched):
    """What a kept RNN call over a dynamic length says it returns (shapes and strides: a
    batch-first output is a transposed time-first one, which a model's ``.contiguous()`` before
    a ``view`` relies on) is what torch's kernels return."""
    x = torch.randn(*((3, 5) if batched else (5,)), 8)
    real = tensors_of(rnn(x))
    shaped = rnn_results_like(rnn, x)
    assert [(t.shape, t.stride()) for t in shaped] == [(t.shape, t.stride()) for t in real]


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """Each packed model compiled into 2 stages once."""
    root = tmp_path_factory.mktemp("packed")
    for name in PACKED:
        compile_model(name, root / name, 2)
    return root


@pytest.mark.parametrize("name", PACKED)
def test_rnns_over_packed_sequences_are_kept_whole_and_match_the_model(packed, name):
    out = packed / name
    source = _source(out)
    model, _ = getattr(models, name)()
    rnns = [n for n, m in model.named_modules() if isinstance(m, torch.nn.RNNBase)]
    for path in rnns:  # each held at its original name, called over the packed sequence
        assert re.search(rf'keep_whole\(self,"{path}",nn\.(LSTM|GRU|RNN)\(', _flat(source)), path
        assert f"run_over_packed(self.{path}," in _flat(source), path
    assert source.count("run_over_packed(") == len(rnns)
    assert ("keep_whole(" in source) == bool(rnns)
    assert "PackedSequence" not in source and "_pack_padded_sequence" not in source
    _assert_matches(out, load_example(spec(name)))
    for seed in (1, 2):  # the same weights, other values and lengths
        model, args = getattr(models, name)(seed=seed)
        _assert_matches(out, Example(model, args))
    stages = load_pipeline(out)
    state = {
        key
        for index in range(len(stages.PIPELINE["stages"]))
        for key in stages.build_stage(index).state_dict()
    }
    assert state == set(model.state_dict())  # parameters under their original names


def test_a_packed_sequence_crosses_a_stage_boundary_as_its_tensors(packed):
    """The GRU encoder-decoder's second stage receives the encoder's padded output, lengths and
    sorting permutation and unpacks them; the first stage packs and runs the encoder."""
    out = packed / "packed_gru_seq2seq"
    stage0, stage1 = (_flat((out / f"stage{i}.py").read_text()) for i in (0, 1))
    assert 'keep_whole(self,"encoder",nn.GRU(' in stage0 and "decoder" not in stage0
    assert 'keep_whole(self,"decoder",nn.GRU(' in stage1 and '"encoder"' not in stage1
    received = load_pipeline(out).build_stage(1).inputs
    # the encoder's padded output and final states, the source lengths' sorting permutation
    assert {"encoder_out_0", "encoder_out_1"} <= set(received), received


def test_unpacking_to_the_longest_sequence_is_checked_at_run_time(packed):
    """pad_packed_sequence without total_length pads to the batch's longest sequence, a size
    from tensor values: specialised to the example's (7) and checked in the stage."""
    out = packed / "packed_gru_seq2seq"
    example = load_example(spec("packed_gru_seq2seq"))
    src, src_lengths, tgt, tgt_lengths = example.args
    names = ("src", "src_lengths", "tgt", "tgt_lengths")
    state = example.model.state_dict()
    package = load_pipeline(out)
    run_stages(package, state, dict(zip(names, example.args)))
    shorter = src_lengths.clamp(max=5)  # every source shorter than the example's longest
    assert example.model(src, shorter, tgt, tgt_lengths).shape[1] == 5  # the model takes it
    with pytest.raises(RuntimeError, match=r"pad_packed_sequence\(encoded, batch_first=True\)"):
        run_stages(package, state, dict(zip(names, (src, shorter, tgt, tgt_lengths))))


@pytest.mark.slow
def test_a_gru_encoder_decoder_over_packed_sequences_trains_like_pytorch(tmp_path):
    pipe = run_pipeline(
        tmp_path, "packed_gru_seq2seq_with_target", 2, "packed_gru_seq2seq_batch",
        "--optimizer", "sgd", "--lr", "0.1", loss="tests/models.py:sequence_cross_entropy",
    )  # fmt: skip
    ref = reference_training(
        load_example(spec("packed_gru_seq2seq_with_target")),
        models.packed_gru_seq2seq_batch,
        STEPS,
        "sgd",
        0.1,
        models.sequence_cross_entropy,
    )
    assert_same_training(pipe, ref)


@pytest.mark.slow
def test_a_stacked_rnn_with_initial_states_trains_like_pytorch(tmp_path):
    """The 3-layer RNN over sorted packed sequences, from given initial states: its inputs
    batch first (train.py splits microbatches along dimension 0; the model transposes them)."""
    name, batches = "packed_stacked_rnn_with_target", "packed_stacked_rnn_batch"
    pipe = run_pipeline(
        tmp_path, name, 2, batches, "--optimizer", "sgd", "--lr", "0.001",
        loss="tests/models.py:mse",
    )  # fmt: skip
    ref = reference_training(
        load_example(spec(name)), models.packed_stacked_rnn_batch, STEPS, "sgd", 0.001, models.mse
    )
    assert ref[0][-1] < ref[0][0]  # it learns
    assert_same_training(pipe, ref)


@pytest.mark.parametrize(
    "name,line",
    [
        ("packed_data_changed", "y, _ = self.rnn(packed)"),
        ("packed_data_read", "self.head(y.data)"),
        ("packed_token_count", "return y.data.sum() / tokens"),
    ],
)
def test_a_model_computing_on_packed_data_itself_is_refused_at_that_line(name, line):
    with pytest.raises(TraceError) as raised:
        trace(load_example(spec(name)))
    message = str(raised.value)
    cls = getattr(models, "".join(w.title() for w in name.split("_")))
    lines, first = inspect.getsourcelines(cls.forward)
    number = first + next(i for i, text in enumerate(lines) if line in text)
    assert message.startswith(f"tests/models.py:{number}: "), message
    assert line in message and "padded tensor" in message


def test_keep_whole_calls_the_named_torch_modules(tmp_path):
    out = tmp_path / "pipe"
    compile_model("kept_whole", out, 2, keep_whole=("lstm", "norm"))
    source = _source(out)
    assert "tensors_of(self.lstm(" in _flat(source) and "tensors_of(self.norm(" in _flat(source)
    assert 'nn.LSTM(8,16,batch_first=True,bidirectional=True,device="meta")' in _flat(source)
    assert 'nn.LayerNorm((32,),elementwise_affine=False,bias=False,device="meta")' in _flat(source)
    assert "aten.lstm" not in source and "aten.layer_norm" not in source
    graph = Graph.load(out / "artifacts" / "graph.json")
    assert [n.args[0] for n in graph.calls if n.target == MODULE_TARGET] == ["lstm", "norm"]
    _assert_matches(out, load_example(spec("kept_whole")))
    model, _ = models.kept_whole()
    g = torch.Generator().manual_seed(7)
    _assert_matches(out, Example(model, (torch.randn(3, 5, 8, generator=g),)))


def test_keep_whole_of_an_lstm_given_its_state_as_a_pair(tmp_path):
    out = tmp_path / "pipe"
    compile_model("lstm_from_state", out, 2, keep_whole=("lstm",))
    assert "tensors_of(self.lstm(x,(h0,c0)))" in _flat(_source(out))
    path = out / "artifacts" / "graph.json"
    assert load_graph(path).json_text() == path.read_text()  # lint, replayed on fake tensors
    (call,) = [json.loads(n.args[2]) for n in Graph.load(path).calls if n.target == MODULE_TARGET]
    assert call == {"form": "rnn", "hidden": 2, "results": 3}
    _assert_matches(out, load_example(spec("lstm_from_state")))
    _assert_matches(out, Example(models.lstm_from_state()[0], models.lstm_from_state(seed=3)[1]))


@pytest.mark.parametrize(
    "names,message",
    [
        (("nope",), "--keep-whole nope: the model has no submodule of that name"),
        (("bn",), "bn (BatchNorm1d) has buffers"),
    ],
)
def test_keep_whole_refuses_what_it_cannot_keep(tmp_path, names, message):
    with pytest.raises(AutopipeError, match=re.escape(message)):
        compile_model("kept_whole", tmp_path / "pipe", 2, keep_whole=names)
    assert not (tmp_path / "pipe").exists()


def test_keep_whole_refuses_a_module_held_under_two_names(tmp_path):
    with pytest.raises(TraceError, match=r"enc \(GRU\) is kept whole, but the model holds it "
                       r"under 2 names \(enc, dec\)"):  # fmt: skip
        compile_model("aliased_gru", tmp_path / "pipe", 2, keep_whole=("dec",))


def test_keep_whole_refuses_a_class_from_outside_torch(tmp_path):
    with pytest.raises(TraceError, match="keeps only torch.nn's own module classes whole"):
        compile_model("kept_whole", tmp_path / "pipe", 2, keep_whole=("halve",))


def _kept_call(payload: dict) -> dict:
    return next(n for n in payload["nodes"] if n.get("target") == MODULE_TARGET)


def _edit_json_text(record: dict, index: int, **changes) -> None:
    data = json.loads(record["args"][index])
    data.update(changes)
    record["args"][index] = json.dumps(data)


@pytest.mark.parametrize(
    "corrupt,field",
    [
        (lambda n: _edit_json_text(n, 1, **{"class": "Nope"}), ".args[1] does not build a module"),
        (lambda n: _edit_json_text(n, 1, params=["weight_hh_l0"]), ".args[1].params"),
        (lambda n: _edit_json_text(n, 2, hidden=1), ".args[2].hidden"),
        (lambda n: _edit_json_text(n, 2, form="unrolled"), ".args[2].form"),
        (lambda n: n["args"][3].pop(), ".args[3]"),
        (lambda n: n["args"].__setitem__(1, "{"), ".args[1]"),
    ],
)
def test_a_kept_module_in_a_graph_artefact_is_checked(packed, corrupt, field):
    path = packed / "packed_lstm_lm" / "artifacts" / "graph.json"
    loaded = load_graph(path)  # lint, and every node replayed on fake tensors
    assert loaded.json_text() == path.read_text()
    payload = read_artifact(path, "graph")
    corrupt(_kept_call(payload))
    with pytest.raises(ArtifactError, match="invalid") as raised:
        Graph.from_json(payload)
    assert field in str(raised.value)
