"""Hugging Face in and out (issue 27, item 3): a transformers model's configuration is recorded
at compile time; ``train.py --save DIR --save-format hf`` and ``autopipe merge CKPT --hf DIR``
write a directory ``from_pretrained`` loads as is (config.json, safetensors shards with an
index, tied weights once, dtype as trained or ``--dtype``). The round trip: pretrained-style
weights -> ``--load`` -> train -> ``--hf`` -> ``from_pretrained`` -> the trained pipeline's
logits, for GPT-2 (tied embeddings) and Llama."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pickle
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from autopipe.cli import main as autopipe_main
from autopipe.runtime import huggingface, train_state
from autopipe.runtime.checkpoint import SafeFileSystemReader, SafeLoadPlanner, read_dcp_metadata
from autopipe.runtime.core.errors import PipelineRunError
from autopipe.runtime.core.pipeline import Pipeline
from autopipe.runtime.guards import output_problems
from autopipe.runtime.options import parse_config
from autopipe.runtime.huggingface import INDEX, shards, untied, write_pretrained
from autopipe.runtime.train_state import TrainingCheckpoints
from autopipe.spec import load_example
from autopipe.verify import load_pipeline

from conftest import ONE_PROCESS, compile_model, run_ranks, torchrun_failing, training_state

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
    run_ranks(
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


@pytest.fixture(scope="module")
def gpt2_package(tmp_path_factory) -> tuple[Path, Pipeline]:
    """The test GPT-2 compiled into 2 stages, and its pipeline."""
    package = tmp_path_factory.mktemp("hf-gpt2-package") / "pipe"
    compile_model("gpt2", package, 2)
    pipeline = Pipeline.from_json(load_pipeline(package).PIPELINE)
    assert pipeline.huggingface is not None
    return package, pipeline


def test_sharded_directories_load_with_their_index(gpt2_package, tmp_path):
    """Shards of at most the size asked for, an index naming every tensor once, and a model
    directory from_pretrained reads back to the same logits."""
    model, ids = original("gpt2")
    _, pipeline = gpt2_package
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


def test_a_model_directory_under_other_names_says_how_to_load_it(gpt2_package, tmp_path):
    """A save_pretrained directory whose tensors are not under the model's names (transformers
    saves some models under older ones and converts them in from_pretrained, which a package
    does not): --load names the way through from_pretrained, not --load-partial; a directory
    missing a tensor says the same."""
    package, pipeline = gpt2_package
    assert pipeline.huggingface is not None
    model, _ = original("gpt2")
    state = {name.replace(".attn.", ".attention."): t for name, t in model.state_dict().items()}
    write_pretrained(state, pipeline.huggingface, pipeline.aliases, tmp_path / "hf")
    stages = {0: load_pipeline(package).build_stage(0)}
    with pytest.raises(PipelineRunError) as refused:
        train_state.load_weights(stages, str(tmp_path / "hf"), pipeline, torch.device("cpu"))
    said = str(refused.value)
    assert "is a Hugging Face model directory whose tensors are not all under the names" in said
    assert "from_pretrained, save torch.save(model.state_dict()" in said
    assert "--load-partial" not in said
    with pytest.raises(PipelineRunError, match="has no entry .*from_pretrained"):
        train_state.load_weights(
            stages, str(tmp_path / "hf"), pipeline, torch.device("cpu"), partial=True
        )
    # another kind of model's directory: a checkpoint of another model, as before
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config | {"model_type": "llama"}))
    with pytest.raises(PipelineRunError, match="checkpoint of another model.*--load-partial"):
        train_state.load_weights(stages, str(tmp_path / "hf"), pipeline, torch.device("cpu"))


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


# -- nothing lost (issue 41): only autopipe's own files are ever replaced ----------------------
def checksums(root: Path) -> dict[str, str]:
    """Every entry under ``root``: a file's digest, a directory's mark."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "/"
        for p in sorted(root.rglob("*"))
    }


def users_directory(path: Path) -> Path:
    """A directory as a user keeps it: a model directory's files beside a tokenizer, a README,
    code and the checkpoints of a run (HF Trainer's layout)."""
    (path / "src").mkdir(parents=True)
    (path / "ckpt" / "step-00000001").mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"weights of mine")
    (path / "tokenizer.json").write_text("{}")
    (path / "README.md").write_text("# my model")
    (path / "src" / "train.py").write_text("print('mine')")
    (path / "ckpt" / "step-00000001" / ".metadata").write_bytes(b"mine")
    return path


def test_a_directory_holding_other_files_is_refused_and_left_as_it_was(gpt2_package, tmp_path):
    """A directory holding a config.json beside anything else is no model directory to
    replace: refused with what it holds, --force (``replace``) or not, and nothing in it (or
    beside it) changes."""
    _, pipeline = gpt2_package
    state = original("gpt2")[0].state_dict()
    mine = users_directory(tmp_path / "mine")
    before = checksums(tmp_path)
    for replace in (False, True):
        with pytest.raises(PipelineRunError) as refused:
            write_pretrained(state, pipeline.huggingface, pipeline.aliases, mine, replace=replace)
        message = str(refused.value)
        assert "4 entries that autopipe did not write: README.md, ckpt/, src/, tokenizer.json" in (
            message
        ), message
        assert "--force or not" in message
        assert checksums(tmp_path) == before


def test_a_model_directory_is_replaced_file_by_file_only_with_force(gpt2_package, tmp_path):
    """An earlier model directory (sharded) is replaced only when asked: the new files moved
    into the same directory, the earlier shards and index removed, nothing else; the stale
    temporary of a write whose process is gone is removed on the way, a live one's kept."""
    _, pipeline = gpt2_package
    hf, aliases = pipeline.huggingface, pipeline.aliases
    state = original("gpt2")[0].state_dict()
    out = tmp_path / "out"
    write_pretrained(state, hf, aliases, out, max_shard_bytes=20_000)
    assert (out / INDEX).is_file() and len(list(out.glob("model-*-of-*.safetensors"))) > 2
    inode = out.stat().st_ino
    with pytest.raises(PipelineRunError, match="already holds a model directory .*pass --force"):
        write_pretrained(state, hf, aliases, out)
    gone = _dead_pid()
    stale = huggingface.temporary_of(out).with_name(
        huggingface.temporary_of(out).name.rsplit("-", 1)[0] + f"-{gone}"
    )
    live = stale.with_name(stale.name.rsplit("-", 1)[0] + f"-{os.getppid()}")
    for temporary in (stale, live):
        temporary.mkdir()
        (temporary / "model.safetensors").write_bytes(b"half a model")
    write_pretrained(state, hf, aliases, out, replace=True)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors",
    ]  # fmt: skip
    assert out.stat().st_ino == inode  # the same directory, its files replaced
    assert not stale.exists() and (live / "model.safetensors").is_file()
    problem = huggingface.directory_problem(
        tmp_path / "x.safetensors", "--hf", file_option="-o FILE"
    )
    assert problem is not None and "a Hugging Face model is a directory" in problem
    assert f"drop the suffix (e.g. {tmp_path / 'x'}), or write one file with -o FILE" in problem


def _dead_pid() -> int:
    """The pid of a process that has ended."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_a_stopped_write_leaves_no_temporary(gpt2_package, tmp_path, monkeypatch, request):
    """A write stopped by Ctrl-C, or by SIGTERM (as ``kill`` stops ``autopipe merge``),
    removes its temporary directory (named for what it is) and leaves no model behind."""
    _, pipeline = gpt2_package
    assert pipeline.huggingface is not None
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as in `autopipe merge`
    request.addfinalizer(lambda: signal.signal(signal.SIGTERM, previous))
    seen = []

    def interrupted(_state, path, **_kwargs):
        seen.append(Path(path).parent.name)
        Path(path).write_bytes(b"part of a model")
        raise KeyboardInterrupt

    def terminated(_state, path, **_kwargs):
        Path(path).write_bytes(b"part of a model")
        # never SIGTERM this process unless the write has taken the signal over
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)

    for write in (interrupted, terminated):
        monkeypatch.setattr(huggingface, "save_safetensors", write)
        with pytest.raises(KeyboardInterrupt):
            write_pretrained({"w": torch.zeros(2)}, pipeline.huggingface, [], tmp_path / "a")
        assert list(tmp_path.iterdir()) == []
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    assert seen[0].startswith(".a.autopipe-tmp-") and seen[0].endswith(f"-{os.getpid()}")


@pytest.fixture(scope="module")
def gpt2_checkpoint(gpt2_package, tmp_path_factory) -> Path:
    """A training checkpoint directory of the GPT-2 package (step 1), written in this
    process."""
    package, _ = gpt2_package
    root = tmp_path_factory.mktemp("hf-gpt2-checkpoint")
    dist.init_process_group("gloo", init_method=f"file://{root / 'store'}", rank=0, world_size=1)
    try:
        stages, optimizers = training_state(load_pipeline(package), 2)
        TrainingCheckpoints(root / "ckpt", load_pipeline(package).PIPELINE, ONE_PROCESS, 0).save(
            1, stages, optimizers
        )
    finally:
        dist.destroy_process_group()
    return root / "ckpt"


def test_merge_writes_into_dot_and_never_over_its_checkpoint(gpt2_checkpoint, tmp_path,
                                                             monkeypatch, capsys):  # fmt: skip
    """``merge --hf .`` writes into the working directory; a --hf DIR holding the checkpoint
    (a model directory's config.json beside it) is refused, --force or not, the checkpoint
    intact; a --hf named like a file is refused with the option that writes one."""
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    assert autopipe_main(["merge", str(gpt2_checkpoint), "--hf", "."]) == 0
    assert {"config.json", "model.safetensors"} <= {p.name for p in here.iterdir()}
    monkeypatch.chdir(gpt2_checkpoint.parent)
    (gpt2_checkpoint.parent / "config.json").write_text("{}")
    before = checksums(gpt2_checkpoint)
    capsys.readouterr()
    assert autopipe_main(["merge", "ckpt", "--hf", ".", "--force"]) == 1
    assert "--hf . holds the checkpoint directory ckpt" in capsys.readouterr().err
    assert checksums(gpt2_checkpoint) == before
    assert autopipe_main(["merge", "ckpt", "--hf", str(tmp_path / "model.safetensors")]) == 1
    assert "a Hugging Face model is a directory" in capsys.readouterr().err
    (gpt2_checkpoint.parent / "config.json").unlink()


class Planted:
    """Unpickled, it creates a file: what a crafted checkpoint could do."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _with_sizes(checkpoint: Path) -> None:
    """checkpoint.json's file sizes made those of the files now there (as a forger would)."""
    manifest = json.loads((checkpoint / "checkpoint.json").read_text())
    manifest["files"] = {name: (checkpoint / name).stat().st_size for name in manifest["files"]}
    (checkpoint / "checkpoint.json").write_text(json.dumps(manifest))


def test_a_checkpoint_runs_no_code(gpt2_checkpoint, gpt2_package, tmp_path, capsys,
                                   single_process_group):  # fmt: skip
    """A crafted ``.metadata`` runs nothing in ``autopipe merge`` nor in train.py's resume,
    refused naming the file and the class; nor does a crafted non-tensor entry in a
    ``.distcp`` file, which DCP's planner would unpickle as it is."""
    package, _ = gpt2_package
    planted = tmp_path / "PWNED"
    step = sorted(gpt2_checkpoint.glob("step-*"))[0].name
    crafted = tmp_path / "crafted"
    shutil.copytree(gpt2_checkpoint, crafted)
    (crafted / step / ".metadata").write_bytes(pickle.dumps(Planted(planted)))
    _with_sizes(crafted / step)
    assert autopipe_main(["merge", str(crafted), "-o", str(tmp_path / "merged.pt")]) == 1
    error = capsys.readouterr().err
    assert f"{crafted / step / '.metadata'} names io.open" in error and "not loaded" in error
    assert not planted.exists() and not (tmp_path / "merged.pt").exists()

    pipe = load_pipeline(package)
    stages, optimizers = training_state(pipe, 2)
    checkpoints = TrainingCheckpoints(crafted, pipe.PIPELINE, ONE_PROCESS, 0)
    with pytest.raises(PipelineRunError, match=r"\.metadata names io\.open"):
        checkpoints.restore(crafted / step, stages, optimizers)
    assert not planted.exists()

    restored = TrainingCheckpoints(gpt2_checkpoint, pipe.PIPELINE, ONE_PROCESS, 0)
    assert restored.restore(gpt2_checkpoint / step, stages, optimizers) == 1  # a real one loads

    # a value that is not a tensor (none in autopipe's own checkpoints) is read weights-only
    dcp.save({"lr": 0.5, "w": torch.ones(2)}, checkpoint_id=tmp_path / "values", no_dist=True)
    metadata = read_dcp_metadata(tmp_path / "values" / ".metadata")
    index = next(i for i in metadata.storage_data if i.fqn == "lr")
    payload = io.BytesIO()
    torch.save(Planted(planted), payload)
    data = tmp_path / "values" / metadata.storage_data[index].relative_path
    metadata.storage_data[index] = dataclasses.replace(
        metadata.storage_data[index], offset=data.stat().st_size, length=len(payload.getvalue())
    )
    data.write_bytes(data.read_bytes() + payload.getvalue())
    (tmp_path / "values" / ".metadata").write_bytes(pickle.dumps(metadata))
    reader = SafeFileSystemReader(tmp_path / "values")
    with pytest.raises(CheckpointException, match="lr holds more than plain values .*io.open"):
        dcp.load({"lr": 0.0}, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    assert not planted.exists()


@pytest.mark.slow
def test_train_py_keeps_a_save_directory_holding_other_files(gpt2_package, tmp_path):
    """``train.py --save DIR --save-format hf`` on a directory holding a config.json beside a
    tokenizer, a README, code and checkpoints stops before training, listing them, and
    leaves every file as it was (it used to train, then delete the whole tree)."""
    package, _ = gpt2_package
    mine = users_directory(tmp_path / "mine")
    before = checksums(mine)
    result = torchrun_failing(
        package / "train.py", 2, "--steps", "1", "--microbatches", "4",
        "--data", "tests/models.py:gpt2_batch", "--save", str(mine), "--save-format", "hf",
        "--force",
    )  # fmt: skip
    assert "4 entries that autopipe did not write: README.md, ckpt/, src/" in result.stderr
    assert "Nothing was trained" in result.stderr and "step 0" not in result.stdout
    assert checksums(mine) == before


def test_save_options_refuse_a_file_name_and_ask_for_force(gpt2_package, tmp_path, capsys):
    """train.py's options, checked before anything runs: --save-format hf into a name like a
    file's, --force without anything to replace; an earlier model directory at
    --save is replaced only with --force (train.py's output check)."""
    _, pipeline = gpt2_package
    for argv, message in (
        (["--save", "x.safetensors", "--save-format", "hf"], "drop the suffix (e.g. x)"),
        (["--force"], "--force lets --save replace a file or model directory"),
    ):
        with pytest.raises(SystemExit):
            parse_config(argv, pipeline)
        assert message in capsys.readouterr().err
    out = tmp_path / "out"
    write_pretrained({"w": torch.zeros(2)}, pipeline.huggingface, [], out)
    argv = ["--save", str(out), "--save-format", "hf"]
    assert (
        not parse_config(argv, pipeline).force and parse_config([*argv, "--force"], pipeline).force
    )
    (problem,) = output_problems(save=str(out), log_json=None, checkpoint_dir=None,
                                 save_directory=True)  # fmt: skip
    assert f"--save {out} already holds a model directory" in problem and "--force" in problem
    assert output_problems(save=str(out), log_json=None, checkpoint_dir=None,
                           save_directory=True, replace=True) == []  # fmt: skip
