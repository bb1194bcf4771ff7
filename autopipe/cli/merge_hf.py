"""A merged checkpoint written as the Hugging Face model directory of ``autopipe merge --hf``:
the model's own, or its adapter as PEFT saves it, or with ``--merge-adapters`` the base model's
with the adapter merged in."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ..errors import AutopipeError
from ..runtime.core.errors import PipelineRunError
from ..runtime.core.pipeline import HuggingFaceModel
from .adapters import merged_adapter

__all__ = ["write_model"]


def write_model(
    state: dict[str, torch.Tensor],
    hf: HuggingFaceModel,
    aliases: list[list[str]],
    out: Path,
    dtype: torch.dtype | None,
    args: argparse.Namespace,
    step: str,
) -> None:
    """Write the merged ``state`` of ``step`` as the Hugging Face model directory ``out``."""
    from ..runtime.huggingface import write_pretrained  # deferred, as in cmd_merge

    if args.merge_adapters:
        state, hf, aliases = merged_adapter(state, hf, aliases)
    try:
        count = write_pretrained(state, hf, aliases, out, dtype=dtype, replace=args.force)
    except (OSError, RuntimeError, PipelineRunError) as exc:
        raise AutopipeError(f"could not write {out} ({exc}); nothing was written") from None
    architecture = hf.config.get("architectures", ["AutoModel"])[0]
    if hf.adapter is not None:
        print(
            f"wrote the adapter of {step} ({count} tensors) to {out}; load it with "
            f"PeftModel.from_pretrained({architecture}.from_pretrained(BASE), {str(out)!r})"
        )
    else:
        print(
            f"wrote {step} ({count} tensors, tied ones once) to {out}; load it with "
            f"{architecture}.from_pretrained"
        )
