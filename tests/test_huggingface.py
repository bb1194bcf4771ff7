"""Hugging Face in and out (issue 27, item 3): a transformers model's configuration is recorded
at compile time; ``train.py --save DIR --save-format hf`` and ``autopipe merge CKPT --hf DIR``
write a directory ``from_pretrained`` loads as is (config.json, safetensors shards with an
index, tied weights once, dtype as trained or ``--dtype``). The round trip: pretrained-style
weights -> ``--load`` -> train -> ``--hf`` -> ``from_pretrained`` -> the trained pipeline's
logits, for GPT-2 (tied embeddings) and Llama."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from autopipe.cli import main as autopipe_main
from autopipe.runtime.core.pipeline import Pipeline
from autopipe.runtime.options import parse_config
from autopipe.runtime.huggingface import INDEX, shards, untied, write_pretrained
from autopipe.spec import load_example
from autopipe.verify import load_pipeline

from conftest import compile_model, torchrun

MODELS = {  # name -> (spec, --data, the name from_pretrained does not find in the files)
    "gpt2": ("tests/models.py:gpt2", "tests/models.py:gpt2_batch", "lm_head.weight"),
    "llama": ("tests/zoo/models.py:llama", "tests/zoo/models.py:llama_batch", None),
}


def original(name: str) -> tuple[torch.nn.Module, torch.Tensor]:
    """The model of a spec and its example's token ids."""
    example = load_example(MODELS[name][0])
    return example.model, example.args[0]


def pretrained(name: str, directory: Path) -> torch.nn.Module:
    """``save_pretrained`` of the spec's model with weights of its own (not the package's
    initialisation), as a user's pretrained checkpoint would be."""
    model, _ = original(name)
    torch.manual_seed(7)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    model.save_pretrained(directory)
    return model


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(ids).logits


@pytest.fixture(scope="module", params=sorted(MODELS))
def trained(request, tmp_path_factory):
    """A 2-stage package of the model, trained 2 steps from pretrained weights on 2 ranks, its
    trained weights saved with --save-format hf and checkpointed."""
    name = request.param
    root = tmp_path_factory.mktemp(f"hf-{name}")
    package = root / "pipe"
    compile_model(MODELS[name][0], package, 2)
    start = pretrained(name, root / "pretrained")
    torchrun(
        package / "train.py", 2, "--load", str(root / "pretrained"), "--steps", "2",
        "--data", MODELS[name][1], "--lr", "1e-2", "--checkpoint-dir", str(root / "ckpt"),
        "--save", str(root / "saved"), "--save-format", "hf",
    )  # fmt: skip
    return name, root, package, start


@pytest.mark.slow
def test_trained_weights_round_trip_through_from_pretrained(trained):
    name, root, package, start = trained
    model, ids = original(name)
    cls = type(model)
    # the trained pipeline's weights, as the checkpoint holds them under the original names
    assert autopipe_main(["merge", str(root / "ckpt"), "-o", str(root / "merged.pt")]) == 0
    model.load_state_dict(torch.load(root / "merged.pt", weights_only=True))
    expected = logits(model, ids)
    assert not torch.allclose(expected, logits(start, ids), atol=1e-3)  # it did train

    assert autopipe_main(["merge", str(root / "ckpt"), "--hf", str(root / "merged-hf")]) == 0
    for directory in (root / "saved", root / "merged-hf"):
        loaded, info = cls.from_pretrained(directory, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        assert loaded.dtype == torch.float32
        torch.testing.assert_close(logits(loaded, ids), expected, rtol=0, atol=1e-5)

    config = json.loads((root / "saved" / "config.json").read_text())
    pipeline = Pipeline.from_json(load_pipeline(package).PIPELINE)
    assert config["architectures"] == [cls.__name__] and config["dtype"] == "float32"
    assert config == json.loads((root / "merged-hf" / "config.json").read_text())
    assert pipeline.huggingface is not None
    assert config["model_type"] == pipeline.huggingface.config["model_type"]
    assert (root / "saved" / "generation_config.json").is_file()
    tied_name = MODELS[name][2]
    if tied_name:  # written once, under the embedding's name
        header = (root / "saved" / "model.safetensors").read_bytes()
        assert tied_name.encode() not in header[:4096]


@pytest.mark.slow
def test_merge_writes_the_dtype_asked_for(trained):
    name, root, _, _ = trained
    out = root / "bf16"
    assert (
        autopipe_main(["merge", str(root / "ckpt"), "--hf", str(out), "--dtype", "bfloat16"]) == 0
    )
    model, info = type(original(name)[0]).from_pretrained(out, output_loading_info=True)
    assert (
        not info["missing_keys"]
        and json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    )
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    # an existing directory is replaced only with --force
    assert autopipe_main(["merge", str(root / "ckpt"), "--hf", str(out)]) != 0
    assert autopipe_main(["merge", str(root / "ckpt"), "--hf", str(out), "--force"]) == 0
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"


def test_sharded_directories_load_with_their_index(tmp_path):
    """Shards of at most the size asked for, an index naming every tensor once, and a model
    directory from_pretrained reads back to the same logits."""
    model, ids = original("gpt2")
    package = tmp_path / "pipe"
    compile_model("gpt2", package, 2)
    pipeline = Pipeline.from_json(load_pipeline(package).PIPELINE)
    assert pipeline.huggingface is not None
    state = model.state_dict()
    count = write_pretrained(state, pipeline.huggingface, pipeline.aliases, tmp_path / "hf",
                             max_shard_bytes=20_000)  # fmt: skip
    index = json.loads((tmp_path / "hf" / INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(index["weight_map"]) == sorted(untied(state, pipeline.aliases))
    assert count == len(index["weight_map"]) == len(state) - 1  # the LM head is tied
    loaded = type(model).from_pretrained(tmp_path / "hf")
    torch.testing.assert_close(logits(loaded, ids), logits(model, ids), rtol=0, atol=0)


def test_shards_keep_order_and_size():
    state = {f"t{i}": torch.zeros(10) for i in range(5)}  # 40 bytes each
    parts = shards(state, max_bytes=100)
    assert [list(p) for p in parts] == [["t0", "t1"], ["t2", "t3"], ["t4"]]
    assert [list(p) for p in shards({"big": torch.zeros(100), **state}, 100)][0] == ["big"]


def test_hf_output_needs_a_transformers_model(tmp_path, capsys):
    package = tmp_path / "pipe"
    compile_model("mlp", package, 2)
    pipeline = Pipeline.from_json(load_pipeline(package).PIPELINE)
    assert pipeline.huggingface is None
    with pytest.raises(SystemExit):
        parse_config(["--save", str(tmp_path / "out"), "--save-format", "hf"], pipeline)
    assert "was not compiled from a transformers PreTrainedModel" in capsys.readouterr().err
