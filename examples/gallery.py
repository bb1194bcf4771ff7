"""The committed pipelines under generated/: how each was compiled.

    python examples/gallery.py            # regenerate them all
    python examples/gallery.py --check    # regenerate into a temporary directory and compare bytes

Run from the repository root; specs are relative to it.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

from autopipe.cli import main as autopipe

#: directory under generated/ -> arguments of `autopipe compile`
GALLERY = {
    "gpt2_4": ["examples/gpt2.py:build", "--stages", "4"],
    "bert_base_2": ["examples/bert.py:build", "--stages", "2"],
    "bert_base_4": ["examples/bert.py:build", "--stages", "4"],
    # Mixed-Pipe: 6 stages on 3 devices, two non-adjacent stages per device
    "t5_small_6on3": ["examples/t5.py:build", "--stages", "6", "--devices", "3"],
    # variable lengths: sequence and batch dimensions traced as dynamic (examples/finetune.py)
    "finetune_2": [
        "examples/finetune.py:build",
        "--stages",
        "2",
        "--dynamic",
        "seq[16:256]=input_ids:1,attention_mask:1,labels:1",
        "--dynamic",
        "batch[2:8]=input_ids:0,attention_mask:0,labels:0",
    ],
}


def regenerate(root: Path) -> None:
    for name, arguments in GALLERY.items():
        code = autopipe(["compile", *arguments, "--out", str(root / name), "--force", "--quiet"])
        if code:
            raise SystemExit(f"compiling {name} failed")


def differences(left: Path, right: Path) -> list[str]:
    """Relative paths whose bytes differ (or that exist on one side only)."""
    left_files = {
        p.relative_to(left) for p in left.rglob("*") if p.is_file() and "__pycache__" not in p.parts
    }
    right_files = {
        p.relative_to(right)
        for p in right.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    changed = [
        str(p)
        for p in sorted(left_files & right_files)
        if not filecmp.cmp(left / p, right / p, shallow=False)
    ]
    return changed + [f"{p} (only on one side)" for p in sorted(left_files ^ right_files)]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--check", action="store_true", help="compare a fresh build with generated/"
    )
    args = parser.parse_args()
    committed = Path("generated")
    if not args.check:
        regenerate(committed)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        regenerate(Path(tmp))
        bad = [
            f"{name}/{d}"
            for name in GALLERY
            for d in differences(committed / name, Path(tmp) / name)
        ]
    for line in bad:
        print(f"differs: {line}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
