"""Pipeline x data parallelism with FSDP2: stages sharded over --dp-shard ranks, replicated over
--dp ranks (gradients reduced while the last backward runs), both at once (HSDP); each against
plain PyTorch on the whole batch, tied GPT-2 embeddings, accumulation and clipping included."""

from __future__ import annotations

import json

import pytest
import torch

import models
from autopipe.spec import load_example

from conftest import spec
from pipelines import STEPS, assert_same_training, reference_training, run_pipeline

CLIPPED = (
    "--accumulate",
    "2",
    "--microbatches",
    "1",
    "--schedule",
    "gpipe",
    "--clip-grad-norm",
    "0.3",
)


def gpt2_reference(**options):
    return reference_training(
        load_example(spec("gpt2")), models.gpt2_batch, STEPS, "adamw", 1e-3, **options
    )


def clip_was_active(log):
    return all(json.loads(line)["grad_norm"] > 0.3 for line in log.read_text().splitlines())


@pytest.mark.slow
def test_two_stages_sharded_over_two_ranks(tmp_path):
    """--dp-shard 2 on 4 processes: each stage's parameters, gradients and AdamW state in two
    halves; each shard rank trains on its own 2 of the step's 4 microbatches."""
    pipe = run_pipeline(
        tmp_path, "gpt2", 2, "gpt2_batch", "--dp-shard", "2", "--microbatches", "2", nproc=4
    )
    assert_same_training(pipe, gpt2_reference())


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["--dp-shard", "--dp"])
def test_accumulation_and_clipping_across_data_parallel_ranks(tmp_path, flag):
    """2 accumulated runs of 1 microbatch on each of 2 data-parallel ranks (gradients reduced
    once, in the second run), the global norm over both stages and every shard, clipped."""
    pipe = run_pipeline(tmp_path, "gpt2", 2, "gpt2_batch", flag, "2", *CLIPPED, nproc=4)
    assert_same_training(pipe, gpt2_reference(clip=0.3))
    assert clip_was_active(tmp_path / "log.jsonl")


@pytest.mark.slow
def test_hybrid_sharding_on_eight_processes(tmp_path):
    """--dp 2 --dp-shard 2 on 2 stages: 8 processes, each stage sharded in two and replicated
    twice (HSDP), 1F1B with one microbatch per data-parallel rank."""
    pipe = run_pipeline(
        tmp_path,
        "gpt2",
        2,
        "gpt2_batch",
        "--dp",
        "2",
        "--dp-shard",
        "2",
        "--microbatches",
        "1",
        "--schedule",
        "gpipe",
        nproc=8,
    )
    assert_same_training(pipe, gpt2_reference())


@pytest.mark.slow
def test_bf16_sharded_with_recomputed_blocks(tmp_path):
    """--bf16 with --dp-shard 2: FSDP2's mixed precision (bf16 compute, fp32 reduction and
    stored weights), every block recomputed in backward: losses close to fp32's, weights fp32."""
    pipe = run_pipeline(
        tmp_path, "gpt2", 2, "gpt2_batch", "--dp-shard", "2", "--microbatches", "2",
        "--bf16", "--recompute", "blocks", nproc=4,
    )  # fmt: skip
    assert pipe[0] == pytest.approx(gpt2_reference()[0], rel=2e-2)
    assert all(t.dtype == torch.float32 for t in pipe[1].values() if t.is_floating_point())
