"""``autopipe merge``: write a training checkpoint as one original-model state_dict, or as a
Hugging Face model directory (its checks: :mod:`.merge_checks`; the directory: :mod:`.merge_hf`)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ..errors import AutopipeError
from ..runtime.core.errors import PipelineRunError
from .arguments import Subparsers
from .merge_checks import checked_output, merged_model
from .merge_hf import write_model
from .output_file import output_file

__all__ = ["add_parser", "cmd_merge"]


def add_parser(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "merge",
        help="write a training checkpoint as one original-model state_dict",
        description="Merge the stages of a train.py checkpoint (--checkpoint-dir) into the "
        "original model's state_dict, tied names included, for model.load_state_dict.",
    )
    p.add_argument(
        "checkpoint",
        type=Path,
        help="a --checkpoint-dir (its latest checkpoint) or one of its step-N directories",
    )
    p.add_argument(
        "-o",
        "--output",
        type=output_file("merged.pt"),
        help="file to write: .safetensors, or anything else for torch.save (default "
        "merged-step-N.pt in the checkpoint directory, N the step merged)",
    )
    p.add_argument(
        "--hf",
        type=Path,
        metavar="DIR",
        help="write a Hugging Face model directory instead, which from_pretrained loads as is: "
        "config.json and generation_config.json as recorded at compile time, safetensors "
        "shards with an index, tied weights once (a transformers model's packages only)",
    )
    p.add_argument(
        "--merge-adapters",
        action="store_true",
        help="with --hf, for a PEFT model: merge the trained adapter into the base model's "
        "weights (with PEFT's merge_and_unload) and write the base model's directory; by default "
        "the adapter is written as PEFT saves it (adapter_config.json, "
        "adapter_model.safetensors), for PeftModel.from_pretrained over the base model",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="convert floating-point tensors to this dtype (default: as trained)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace the output file, or the model directory autopipe wrote at --hf DIR (only "
        "its own files are removed; a directory holding anything else is refused with or "
        "without --force)",
    )
    p.set_defaults(func=cmd_merge)


def cmd_merge(args: argparse.Namespace) -> None:
    # imported here, not above: train_state brings torch.distributed.pipelining, torch._dynamo and
    # torch.distributed.checkpoint, which would slow every other command's start-up
    from ..runtime.train_state import (
        checked_checkpoint,
        merged_state,
        save_weights,
        trainable_only_note,
    )

    source = Path(args.checkpoint)
    out = checked_output(args, source)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    try:  # the manifest first: what it refuses is refused before any tensor is read
        checkpoint, manifest = checked_checkpoint(source)
    except PipelineRunError as exc:
        raise AutopipeError(str(exc)) from None
    step = f"{manifest['model']} after step {manifest['step']}"
    partial = trainable_only_note(manifest, source)
    hf = merged_model(manifest, source, partial, args.merge_adapters) if args.hf else None
    try:
        state = merged_state(checkpoint, manifest)
    except PipelineRunError as exc:
        raise AutopipeError(str(exc)) from None
    if hf is not None:
        write_model(state, hf, manifest["aliases"], out, dtype, args, step)
        return
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    try:
        save_weights(state, out)
    except (OSError, RuntimeError) as exc:
        raise AutopipeError(f"could not write {out} ({exc}); nothing was written") from None
    print(
        f"wrote {step} ({len(state)} tensors, original names) to {out}; load it with "
        "model.load_state_dict"
    )
    if partial:
        print(f"note: {partial}")
