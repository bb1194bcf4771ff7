"""Train a generated pipeline on gloo ranks and the same model with plain PyTorch, to compare;
play its ranks in the dry run (``train.py --dry-run``) in this process."""

from __future__ import annotations

import importlib
import inspect
import json
import math

import pytest
import torch

import models
from autopipe.spec import load_example

from conftest import compile_model, run_ranks, spec

STEPS, MICROBATCHES = 4, 4


def reference_training(
    example,
    data,
    steps,
    optimizer,
    lr,
    loss_fn=None,
    clip=None,
    warmup=0,
    cosine=False,
    batch_dims=None,
):
    """Plain PyTorch on one process: each step's batch split into microbatches (each input
    along its dimension in ``batch_dims``, by name, else 0; the target along 0), the mean of
    their losses back-propagated (gradient accumulation), gradients clipped to the norm ``clip``,
    one optimizer step at a learning rate warmed up linearly over ``warmup`` steps, then
    (``cosine``) decayed to 0 at ``steps``."""
    model = example.model
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = (
        torch.optim.SGD(params, lr=lr)
        if optimizer == "sgd"
        else torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    )

    def lr_at(step):
        if step < warmup:
            return lr * (step + 1) / warmup
        if not cosine:
            return lr
        return lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (steps - warmup)))

    dims = batch_dims or {}
    names = list(inspect.signature(model.forward).parameters)
    losses = []
    for step in range(steps):
        args, kwargs, *target = data(step)
        opt.zero_grad()
        chunks = []
        for i in range(MICROBATCHES):
            # contiguous, as a model's own batch is (train.py gives its stages the same)
            mb_args = [
                a.chunk(MICROBATCHES, dims.get(n, 0))[i].contiguous() for n, a in zip(names, args)
            ]
            mb_kwargs = {
                k: v.chunk(MICROBATCHES, dims.get(k, 0))[i].contiguous() for k, v in kwargs.items()
            }
            out = model(*mb_args, **mb_kwargs)
            loss_of = out if isinstance(out, torch.Tensor) else out.loss  # a plain loss tensor
            chunks.append(loss_fn(out, target[0].chunk(MICROBATCHES)[i]) if loss_fn else loss_of)
        loss = torch.stack(chunks).mean()
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def run_pipeline(
    tmp_path,
    name,
    stages,
    data,
    *extra,
    loss=None,
    train_spec=None,
    compile_spec=None,
    devices=None,
    nproc=None,
    package=None,
    **options,
):
    out = package or tmp_path / "pipe"
    if package is None:
        compile_model(
            compile_spec or train_spec or name,
            out,
            stages,
            loss=loss,
            devices=devices,
            **options,
        )
    example = load_example(spec(train_spec or name))
    torch.save(example.model.state_dict(), tmp_path / "init.pt")
    log, saved = tmp_path / "log.jsonl", tmp_path / "trained.pt"
    result = run_ranks(
        out / "train.py",
        nproc or devices or stages,
        "--steps",
        str(STEPS),
        "--microbatches",
        str(MICROBATCHES),
        "--data",
        data if ":" in data else f"tests/models.py:{data}",
        "--load",
        str(tmp_path / "init.pt"),
        "--save",
        str(saved),
        "--log-json",
        str(log),
        *extra,
    )
    (tmp_path / "train.out").write_text(result.stdout)  # what train.py said, for a test to read
    records = [json.loads(line) for line in log.read_text().splitlines()]
    records = [r for r in records if "loss" in r]  # the steps' (not evaluations')
    assert [r["step"] for r in records] == list(range(STEPS))
    return [r["loss"] for r in records], torch.load(saved, weights_only=True)


def assert_same_training(pipe, ref, atol=2e-5):
    pipe_losses, pipe_state = pipe
    ref_losses, ref_state = ref
    assert pipe_losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    assert set(pipe_state) == set(ref_state)
    for key in ref_state:
        assert torch.allclose(
            pipe_state[key].float(), ref_state[key].float(), atol=atol, rtol=1e-4
        ), key


def assert_trains_like_pytorch_with_mse(tmp_path, name: str, batches: str) -> None:
    """tests/models.py's ``name`` (a model whose spec gives a target) compiled into 2 stages
    with the mean squared error as its loss trains through train.py (SGD, lr 0.1) on
    ``batches`` exactly as plain PyTorch does."""
    pipe = run_pipeline(
        tmp_path, name, 2, batches, "--optimizer", "sgd", "--lr", "0.1",
        loss="tests/models.py:mse",
    )  # fmt: skip
    ref = reference_training(
        load_example(spec(name)), getattr(models, batches), STEPS, "sgd", 0.1, models.mse
    )
    assert_same_training(pipe, ref)


def capacity_needing_recomputation(result, schedule: str, whole_stages: bool) -> float:
    """A device memory between the smallest peak any contiguous 2-stage split of a compiled
    model reaches without recomputation and with it (its blocks, or its stages whole), under
    ``schedule`` with MICROBATCHES microbatches: no split fits without recomputing, some with."""
    from autopipe.partitioning.cost import CostModel

    model = CostModel(result.graph, result.profile, schedule=schedule, microbatches=MICROBATCHES)
    plain, recomputed = [], []
    for cut in range(1, model.num_units):
        stage_of_unit = [0 if u < cut else 1 for u in range(model.num_units)]
        if any(stage_of_unit[u] > stage_of_unit[v] for u, v in model.dag.edges):
            continue
        plain.append(max(model.evaluate(stage_of_unit).device_memory))
        stages, blocks = (
            (frozenset({0, 1}), frozenset())
            if whole_stages
            else (frozenset(), frozenset(model.blocks))
        )
        recomputed.append(
            max(
                model.evaluate(
                    stage_of_unit, recompute=stages, recompute_blocks=blocks
                ).device_memory
            )
        )
    low, high = min(recomputed), min(plain)
    assert low < high, "recomputation does not lower this model's peak"
    return (low + high) / 2


def run_stages(package, state: dict, values: dict) -> dict:
    """The stages of a loaded package run one after another in this process on the model's
    ``state``, from the inputs in ``values`` (which gains every stage's outputs)."""
    for index in range(len(package.PIPELINE["stages"])):
        stage = package.build_stage(index)
        stage.load_state_dict(state, strict=False)
        outputs = stage(*[values[n] for n in stage.inputs])
        values.update(zip(stage.outputs, outputs))
    return values


def play(package, *argv: str) -> tuple[list, list[str]]:
    """``train.py --dry-run ARGV`` of ``package`` (imported) in this process: what each played
    rank did (the package runtime's RankResult), and the lines it said."""
    runtime = f"{package.__name__}.runtime"
    driver = importlib.import_module(f"{runtime}.driver")
    dry_run = importlib.import_module(f"{runtime}.dry_run")
    options = importlib.import_module(f"{runtime}.options")
    pipeline = importlib.import_module(f"{runtime}.core.pipeline").Pipeline.from_json(
        package.PIPELINE
    )
    config = options.parse_config(["--dry-run", *argv], pipeline)
    lines: list[str] = []
    results = dry_run.play_ranks(
        package,
        pipeline,
        config,
        lambda played, layout: driver.rehearse(package, pipeline, played, layout),
        say=lines.append,
    )
    return results, lines


def problems(results) -> list[str]:
    return [f"rank {r.rank}: {r.error} in {r.action} at {r.line}" for r in results if not r.ok]
