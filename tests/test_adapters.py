"""Adapters and frozen weights (issue 27, item 4): parameters that do not require gradients (a
PEFT LoRA over a frozen Llama, frozen tied embeddings, a frozen tower) compile with their flag,
get no gradients, optimizer state or reduction in train.py, and the memory model counts their
weights only; ``--save-trainable-only`` checkpoints and ``--save`` hold the adapters alone, and
a resume from them (with the ``--load`` the run started from) continues exactly.

One LoRA package and three short gloo runs serve every multi-process check: an uninterrupted
run, its resume from the middle, and a resume refused for want of ``--load``."""

from __future__ import annotations

import copy
import json
import math
import re
import shutil
import subprocess

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import LlamaForCausalLM
from torch.distributed.checkpoint import FileSystemReader

from autopipe.cli.adapters import merged_adapter
from autopipe.cli import main as autopipe_main
from autopipe.partitioning import CostModel
from autopipe.runtime.core.errors import PipelineRunError
from autopipe.runtime.core.pipeline import Pipeline, PipelineFormatError
from autopipe.runtime.driver import make_optimizer
from autopipe.runtime.huggingface import write_pretrained
from autopipe.runtime.options import parse_config
from autopipe.runtime.parallel import GradientSync
from autopipe.runtime.train_state import FrozenSource, read_manifest
from autopipe.verify import load_pipeline

from conftest import ONE_PROCESS, ROOT, compile_model, run_ranks, torchrun_command, torchrun_env
from lora_models import frozen_tower, gpt2_frozen_embeddings, lora_batch, lora_llama

MICROBATCHES, STEPS, LR = 4, 4, 0.01
LORA = "tests/lora_models.py:lora_llama"
DATA = ["--data", "tests/lora_models.py:lora_batch", "--microbatches", str(MICROBATCHES)]


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def pipeline_of(package) -> Pipeline:
    return Pipeline.from_json(package.PIPELINE)


# -- the LoRA package, its base weights and the reference ---------------------------------------
@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    """The PEFT model compiled into 2 stages (the compile result and the loaded package)."""
    out = tmp_path_factory.mktemp("lora") / "pipe"
    result = compile_model(LORA, out, 2)
    return result, load_pipeline(out)


@pytest.fixture(scope="module")
def base_weights(tmp_path_factory):
    """The PEFT model's initial state_dict (base and adapters), for --load."""
    path = tmp_path_factory.mktemp("lora") / "initial.pt"
    torch.save(lora_llama()[0].state_dict(), path)
    return path


@pytest.fixture(scope="module")
def reference(base_weights):
    """PEFT in plain PyTorch on the same batches: per step the mean microbatch loss (each
    microbatch's gradient averaged, as train.py's schedule does), AdamW on the adapters."""
    model = lora_llama()[0]
    model.load_state_dict(torch.load(base_weights))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=LR, weight_decay=0.0)
    losses = []
    for step in range(STEPS):
        (ids,), kwargs = lora_batch(step, MICROBATCHES)
        optimizer.zero_grad()
        total = 0.0
        for part, labels in zip(ids.chunk(MICROBATCHES), kwargs["labels"].chunk(MICROBATCHES)):
            loss = model(part, labels=labels).loss
            (loss / MICROBATCHES).backward()
            total += float(loss.detach())
        optimizer.step()
        losses.append(total / MICROBATCHES)
    adapters = {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}
    return losses, adapters


@pytest.fixture(scope="module")
def runs(lora, base_weights, tmp_path_factory):
    """An uninterrupted run (checkpoints at steps 2 and 4, trainable only) and its resume from
    step 2 with the same --load: each one's JSON log, --save'd file and checkpoint directory."""
    package = lora[0].out
    root = tmp_path_factory.mktemp("runs")
    common = [*DATA, "--steps", str(STEPS), "--lr", str(LR), "--load", str(base_weights)]
    common += ["--save-trainable-only", "--keep-checkpoints", "0"]
    found = {}
    for name in ("whole", "resumed"):
        ckpt = root / f"{name}-ckpt"
        if name == "resumed":  # the whole run's checkpoint of step 2, alone
            ckpt.mkdir()
            shutil.copytree(root / "whole-ckpt" / "step-00000002", ckpt / "step-00000002")
            (ckpt / "latest").write_text("step-00000002\n")
        log, saved = root / f"{name}.jsonl", root / f"{name}.safetensors"
        run_ranks(
            package / "train.py", 2, *common, "--checkpoint-dir", str(ckpt), "--checkpoint-every",
            "2", "--log-json", str(log), "--save", str(saved),
            *(["--resume"] if name == "resumed" else []),
        )  # fmt: skip
        entries = [json.loads(line) for line in log.read_text().splitlines()]
        found[name] = ([e for e in entries if "loss" in e], load_file(saved), ckpt)
    return found


def adapter_names(model) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


# -- compiling ----------------------------------------------------------------------------------
def test_a_peft_model_compiles_with_its_frozen_base(lora):
    """pipeline.json names the frozen parameters; the stages recreate every parameter with the
    original's requires_grad; PEFT's forward(*args, **kwargs) takes the ids by position."""
    _, package = lora
    pipeline = pipeline_of(package)
    original = lora_llama()[0]
    frozen = {n for n, p in original.named_parameters() if not p.requires_grad}
    assert set(pipeline.frozen) == frozen and len(frozen) > len(adapter_names(original))
    assert pipeline.signature == ("args_0",) and "args_0" in pipeline.input_ranges
    flags = {}
    for index in range(pipeline.num_stages):
        stage = package.build_stage(index, meta_state=True)
        flags |= {n: p.requires_grad for n, p in stage.named_parameters()}
    assert flags == {n: p.requires_grad for n, p in original.named_parameters()}
    assert Pipeline.from_json(pipeline.to_json()) == pipeline


def test_frozen_tied_embeddings_get_no_gradient_sum_or_norm(tmp_path, single_process_group):
    """GPT-2 with its tied embedding frozen, both stages on one rank: the tie is not summed (no
    zero gradients appear on the frozen copies), the norm counts the trained parameters only,
    and the optimizers hold only those."""
    compile_model("tests/lora_models.py:gpt2_frozen_embeddings", tmp_path / "pipe", 2, devices=1)
    package = load_pipeline(tmp_path / "pipe")
    pipeline = pipeline_of(package)
    assert pipeline.tied and pipeline.tied[0].names[0] in pipeline.frozen
    stages = {i: package.build_stage(i) for i in range(pipeline.num_stages)}
    model, (ids,), kwargs = gpt2_frozen_embeddings()
    assert pipeline.inputs == ("input_ids", "labels")
    values = {"input_ids": ids, "labels": kwargs["labels"]}
    for spec in pipeline.stages:
        outputs = stages[spec.index](*[values[name] for name in spec.inputs])
        values.update(zip(spec.outputs, outputs))
    values[pipeline.loss.output].backward()
    sync = GradientSync(pipeline, ONE_PROCESS, stages)
    assert sync.ties == []
    sync.reduce()
    params = [p for m in stages.values() for p in m.parameters()]
    frozen = [p for p in params if not p.requires_grad]
    assert len(frozen) == 3 and all(p.grad is None for p in frozen)  # wte and wpe; lm_head
    trained = [p for p in params if p.requires_grad]
    assert trained and all(p.grad is not None for p in trained)
    expected = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in trained))
    assert sync.clip(None) == pytest.approx(expected, rel=1e-6)
    config = parse_config([], pipeline)
    for stage in stages.values():
        held = {id(p) for g in make_optimizer(config, stage).param_groups for p in g["params"]}
        assert held == {id(p) for p in stage.parameters() if p.requires_grad}


# -- the memory model ---------------------------------------------------------------------------
def test_the_memory_model_counts_only_the_adapters_state(lora):
    """Gradients and AdamW's two moments of the adapters only: the LoRA model's training state
    is its weights plus 3x its adapters, not 4x everything; per stage the same, as train.py's
    stage modules hold them."""
    result, package = lora
    original = lora_llama()[0]
    weights = sum(nbytes(p) for p in original.parameters())
    adapters = sum(nbytes(p) for p in original.parameters() if p.requires_grad)
    model = CostModel(result.graph, result.profile, optimizer="adamw")
    assert model.training_state_bytes == weights + 3 * adapters
    assert CostModel(result.graph, result.profile, optimizer="sgd").training_state_bytes == (
        weights + adapters
    )
    everything = copy.deepcopy(result.graph)
    for info in everything.params.values():
        info.requires_grad = True
    assert CostModel(everything, result.profile).training_state_bytes == 4 * weights
    assert model.training_state_bytes < 0.4 * 4 * weights
    pipeline = pipeline_of(package)
    for index in range(pipeline.num_stages):
        stage = package.build_stage(index, meta_state=True)
        held = sum(nbytes(p) + 3 * nbytes(p) * p.requires_grad for p in stage.parameters())
        assert pipeline.schedule.costs.static_memory[index] == held
        assert pipeline.schedule.costs.detail["gradients"][index] == sum(
            nbytes(p) for p in stage.parameters() if p.requires_grad
        )


def test_a_frozen_tower_is_a_stage_of_weights_only(tmp_path):
    """A frozen embedding and tower, one whole stage: no gradients, optimizer state, backward
    or optimizer step counted for it."""
    result = compile_model("tests/lora_models.py:frozen_tower", tmp_path / "pipe", 2)
    package = load_pipeline(tmp_path / "pipe")
    pipeline = pipeline_of(package)
    first = package.build_stage(0, meta_state=True)
    assert not any(p.requires_grad for p in first.parameters())
    assert set(dict(first.named_parameters())) <= set(pipeline.frozen)
    costs = pipeline.schedule.costs
    assert costs.static_memory[0] == sum(nbytes(p) for p in first.parameters())
    assert costs.detail["gradients"][0] == 0
    assert costs.detail["transient_optimizer"][0] == 0
    assert costs.backward[0] == 0 and costs.backward[1] > 0
    assert CostModel(result.graph, result.profile).training_state_bytes < 2 * sum(
        nbytes(p) for p in frozen_tower()[0].parameters()
    )


# -- training -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_lora_trains_like_peft(runs, reference):
    """The same losses and trained adapters as PEFT in PyTorch on the same batches; --save
    with --save-trainable-only holds the adapters alone."""
    entries, saved, _ = runs["whole"]
    losses, adapters = reference
    assert [e["step"] for e in entries] == list(range(STEPS))
    assert [e["loss"] for e in entries] == pytest.approx(losses, abs=1e-5)
    assert set(saved) == set(adapters)
    for name, value in adapters.items():
        torch.testing.assert_close(saved[name], value, atol=1e-5, rtol=1e-5)
    # the adapters moved: lora_B starts at zero
    assert any(float(v.abs().max()) > 1e-3 for k, v in saved.items() if "lora_B" in k)


@pytest.mark.slow
def test_only_the_adapters_get_gradients_and_optimizer_state_per_rank(runs, lora):
    """Each rank's state_bytes (its parameters, the gradients and optimizer state it holds) is
    its stage's weights plus a gradient, two AdamW moments and a step count per adapter: the
    memory model's prediction of the stage, plus AdamW's 4-byte step per adapter tensor."""
    entries, _, _ = runs["whole"]
    _, package = lora
    pipeline = pipeline_of(package)
    measured = entries[-1]["state_bytes"]
    for rank in range(pipeline.num_ranks):
        (spec,) = pipeline.stages_on(rank)
        stage = package.build_stage(spec.index, meta_state=True)
        weights = sum(nbytes(p) for p in stage.parameters())
        adapters = [p for p in stage.parameters() if p.requires_grad]
        expected = weights + sum(3 * nbytes(p) + 4 for p in adapters)
        assert measured[rank] == expected
        assert measured[rank] == pipeline.schedule.costs.static_memory[spec.index] + 4 * len(
            adapters
        )
        assert expected < 2 * weights  # all trainable, it would be 4 x the weights and more


@pytest.mark.slow
def test_trainable_only_checkpoints_hold_the_adapters_and_resume_exactly(runs, lora, capsys):
    """The checkpoints hold the adapters and their AdamW state only, say so in checkpoint.json
    (with the --load the frozen weights came from), and a resume from step 2 with that --load
    gives the uninterrupted run's losses and adapters, bit for bit; merge writes the adapters
    and says that they are all there is."""
    whole, saved, ckpt = runs["whole"]
    resumed, saved_again, _ = runs["resumed"]
    adapters = adapter_names(lora_llama()[0])
    step = ckpt / "step-00000002"
    keys = FileSystemReader(step).read_metadata().state_dict_metadata
    assert {k[len("model.") :] for k in keys if k.startswith("model.")} == adapters
    optimized = {k.split(".", 1)[1].rsplit(".", 1)[0] for k in keys if k.startswith("optimizer.")}
    assert optimized == adapters
    manifest = json.loads((step / "checkpoint.json").read_text())
    assert set(manifest["trainable_only"]["frozen"]) == set(pipeline_of(lora[1]).frozen)
    assert manifest["trainable_only"]["load"].endswith("initial.pt")

    assert [e["step"] for e in resumed] == [2, 3]
    assert [e["loss"] for e in resumed] == [e["loss"] for e in whole[2:]]
    assert saved_again.keys() == saved.keys()
    assert all(torch.equal(saved_again[k], saved[k]) for k in saved)

    merged = ckpt.parent / "merged.safetensors"
    assert autopipe_main(["merge", str(ckpt), "-o", str(merged)]) == 0
    out = capsys.readouterr().out
    assert f"({len(adapters)} tensors" in out and "holds only the trainable tensors" in out
    assert set(load_file(merged)) == adapters


@pytest.mark.slow
def test_resuming_without_the_load_it_needs_is_refused(runs, lora):
    """A trainable-only checkpoint resumed without the --load its frozen weights came from
    stops before training, saying which --load to give."""
    _, _, ckpt = runs["resumed"]
    command = torchrun_command(
        lora[0].out / "train.py", 2, *DATA, "--steps", str(STEPS + 1), "--checkpoint-dir",
        str(ckpt), "--resume", "--save-trainable-only",
    )  # fmt: skip
    result = subprocess.run(
        command, cwd=ROOT, env=torchrun_env(), capture_output=True, text=True, timeout=300
    )
    assert result.returncode != 0
    assert "holds only the trainable parameters (written with --save-trainable-only)" in (
        result.stderr
    )
    assert "resume with --load" in result.stderr and "initial.pt" in result.stderr
    assert "step 4" not in result.stdout


# -- the contract -------------------------------------------------------------------------------
def test_pipeline_json_frozen_is_optional_and_checked(lora):
    """``frozen`` is optional (pipelines compiled before it have none) and checked: a list of
    names of the model's tensors."""
    data = copy.deepcopy(lora[1].PIPELINE)
    assert Pipeline.from_json({k: v for k, v in data.items() if k != "frozen"}).frozen == ()
    for value, message in (
        ("x", "pipeline.frozen must be a list of strings"),
        (["nope"], "pipeline.frozen[0] = 'nope' is not a tensor of the model"),
    ):
        with pytest.raises(PipelineFormatError, match=re.escape(message)):
            Pipeline.from_json(data | {"frozen": value})


def test_save_trainable_only_needs_something_to_save(lora, capsys):
    pipeline = pipeline_of(lora[1])
    with pytest.raises(SystemExit):
        parse_config(["--save-trainable-only"], pipeline)
    assert "--save-trainable-only says what --save and --checkpoint-dir hold" in (
        capsys.readouterr().err
    )
    assert parse_config(["--save-trainable-only", "--save", "x.pt"], pipeline).save_trainable_only


def test_a_damaged_trainable_only_record_is_named(tmp_path):
    manifest = {"format": "autopipe.checkpoint", "version": 3, "step": 2, "stages": 2}
    manifest |= {"world_size": 2, "aliases": [], "files": {}, "trainable_only": {"load": 1}}
    (tmp_path / "checkpoint.json").write_text(json.dumps(manifest))
    with pytest.raises(PipelineRunError, match="'trainable_only' must be an object"):
        read_manifest(tmp_path)
    manifest["trainable_only"] = {"load": None, "seed": 3, "frozen": ["w"]}
    (tmp_path / "checkpoint.json").write_text(json.dumps(manifest))
    source = FrozenSource.of_manifest(read_manifest(tmp_path), tmp_path)
    assert source == FrozenSource(None, 3)
    assert "resume with --seed 3" in source.resume_problem(tmp_path, None, 0)
    assert "resume without --load" in source.resume_problem(tmp_path, "base.pt", 3)
    assert source.resume_problem(tmp_path, None, 3) is None


# -- Hugging Face out: the adapter as PEFT saves it, or merged into the base ------------------
def trained_peft_model(base_weights, adapters):
    """PEFT's model with the initial weights and the reference run's trained adapters."""
    model = lora_llama()[0]
    model.load_state_dict(torch.load(base_weights))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name in adapters:
                parameter.copy_(adapters[name])
    return model.eval()


def peft_logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.slow
def test_the_trained_adapter_loads_with_peft(runs, reference, base_weights, tmp_path):
    """merge --hf of the run's (trainable-only) checkpoint writes the adapter directory PEFT
    writes (the same adapter_config.json, the same tensor names), and PeftModel.from_pretrained
    over the base model gives the trained model's logits; --merge-adapters needs the base
    weights the checkpoint left out, and says so."""
    _, _, ckpt = runs["whole"]
    out = tmp_path / "adapter"
    assert autopipe_main(["merge", str(ckpt), "--hf", str(out)]) == 0
    expected = trained_peft_model(base_weights, reference[1])
    peft_dir = tmp_path / "peft"
    expected.save_pretrained(peft_dir)
    assert sorted(p.name for p in out.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    ours = json.loads((out / "adapter_config.json").read_text())
    theirs = json.loads((peft_dir / "adapter_config.json").read_text())
    # PEFT lists the target modules (a set) in the order of its process's string hashes; the
    # package sorts them, so that it is the same from every process
    assert ours["target_modules"] == sorted(theirs["target_modules"])
    assert ours == theirs | {"target_modules": ours["target_modules"]}
    assert set(load_file(out / "adapter_model.safetensors")) == set(
        load_file(peft_dir / "adapter_model.safetensors")
    )

    base = trained_peft_model(base_weights, {}).unload()  # the base model, adapters removed
    loaded = PeftModel.from_pretrained(base, out).eval()
    ids = lora_batch(0, 1)[0][0]
    torch.testing.assert_close(
        peft_logits(loaded, ids), peft_logits(expected, ids), atol=1e-4, rtol=0
    )

    refused = tmp_path / "merged"
    assert autopipe_main(["merge", str(ckpt), "--hf", str(refused), "--merge-adapters"]) != 0
    assert not refused.exists()


def test_merge_adapters_writes_the_base_model_merged_as_peft_merges(lora, base_weights, tmp_path):
    """--merge-adapters' merge of a whole PEFT state: the base model's from_pretrained
    directory, with the logits of PEFT's own merge_and_unload."""
    _, package = lora
    pipeline = pipeline_of(package)
    generator = torch.Generator().manual_seed(5)
    model = lora_llama()[0]
    model.load_state_dict(torch.load(base_weights))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.requires_grad:  # trained adapters: lora_B no longer zero
                parameter.copy_(0.1 * torch.randn(parameter.shape, generator=generator))
    state = model.state_dict()
    assert pipeline.huggingface is not None and pipeline.huggingface.adapter is not None
    merged, base, aliases = merged_adapter(
        state, pipeline.huggingface, [list(g) for g in pipeline.aliases]
    )
    assert base.adapter is None and not any("lora_" in name for name in merged)
    write_pretrained(merged, base, aliases, tmp_path / "merged")
    loaded, info = LlamaForCausalLM.from_pretrained(tmp_path / "merged", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids = lora_batch(0, 1)[0][0]
    expected = peft_logits(model.eval(), ids)
    torch.testing.assert_close(peft_logits(loaded.eval(), ids), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(
        peft_logits(model.merge_and_unload(), ids), expected, atol=1e-5, rtol=0
    )
