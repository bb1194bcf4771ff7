"""How fast autopipe compiles big models, against PiPPy merely splitting them, in the same run.

    python benchmarks/compile_speed.py            # GPT2-XL, T5-3B, 25-200 layer transformers
    python benchmarks/compile_speed.py --quick    # GPT2-XL and the 25- and 50-layer ones

Every measurement is a fresh Python process, timed from its start to its exit (imports included),
with its CPU time and peak resident memory from the kernel (``os.wait4``; on a busy machine compare
the CPU seconds). autopipe runs ``autopipe compile
SPEC --stages 8 --no-report`` (analytic profile, Mixed-Pipe, full code generation) on a model built without
weights; PiPPy runs ``torch.distributed.pipelining.pipeline()`` on the same model on the meta
device with 8 hand-given split points (no profiling, no balancing, no code). Phase times come
from autopipe's own log; "per 1k nodes" shows how each phase grows with the graph.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODELS = """
import torch, autopipe
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, T5Config, T5ForConditionalGeneration
from transformers.utils import logging
logging.set_verbosity_error()

def gpt2_xl(meta=torch.device("meta")):
    with meta:
        model = GPT2LMHeadModel(GPT2Config(n_layer=48, n_embd=1600, n_head=25, use_cache=False))
    ids = torch.randint(0, 50257, (1, 1024))
    return model, (ids,), {"labels": ids}

def t5_3b(meta=torch.device("meta")):
    with meta:
        model = T5ForConditionalGeneration(T5Config(
            d_model=1024, d_kv=128, d_ff=16384, num_layers=24, num_heads=32, use_cache=False,
            decoder_start_token_id=0, pad_token_id=0))
    ids = torch.randint(0, 32128, (1, 512))
    return model, (ids,), {"labels": torch.randint(0, 32128, (1, 128))}

def transformer(layers, meta=None):
    with meta or autopipe.empty_weights():  # rotary inv_freq is a buffer the pipeline needs
        model = LlamaForCausalLM(LlamaConfig(
            hidden_size=256, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1000, use_cache=False))
    ids = torch.randint(0, 1000, (1, 128))
    return model, (ids,), {"labels": ids}
""" + "\n".join(
    f"def transformer_{n}(meta=None):\n    return transformer({n}, meta)\n"
    for n in (25, 50, 100, 200)
)

PIPPY = """
import sys, torch
sys.path.insert(0, {folder!r})
from torch.distributed.pipelining import SplitPoint, pipeline
import models
model, args, kwargs = models.{function}(meta=torch.device("meta"))
layers = {layers!r}
split = {{name: SplitPoint.BEGINNING for name in layers[len(layers) // 8 :: len(layers) // 8][:7]}}
meta = lambda t: t.to("meta")
pipe = pipeline(model, mb_args=tuple(map(meta, args)), mb_kwargs={{k: meta(v) for k, v in kwargs.items()}}, split_spec=split)
print("stages", pipe.num_stages)
"""

CASES = [
    ("GPT2-XL", "gpt2_xl", [f"transformer.h.{i}" for i in range(48)]),
    (
        "T5-3B",
        "t5_3b",
        [f"encoder.block.{i}" for i in range(24)] + [f"decoder.block.{i}" for i in range(24)],
    ),
] + [
    (f"{n}-layer transformer", f"transformer_{n}", [f"model.layers.{i}" for i in range(n)])
    for n in (25, 50, 100, 200)
]


def run(command: list[str], cwd: Path) -> tuple[float, float, int, str]:
    """Wall seconds, CPU seconds (user + system: what a busy machine does not inflate), peak RSS
    bytes and output of a fresh process."""
    start = time.perf_counter()
    process = subprocess.Popen(
        command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    output = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{output[-3000:]}")
    return seconds, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024, output


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="GPT2-XL and the two smallest transformers only"
    )
    args = parser.parse_args()
    cases = [
        c
        for c in CASES
        if not args.quick or c[1] in ("gpt2_xl", "transformer_25", "transformer_50")
    ]
    autopipe = str(Path(sys.executable).with_name("autopipe"))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "models.py").write_text(MODELS)
        for label, function, layers in cases:
            seconds, cpu, rss, log = run(
                [
                    autopipe,
                    "compile",
                    f"models.py:{function}",
                    "--stages",
                    "8",
                    "--out",
                    "out",
                    "--force",
                    "--no-report",  # what is timed is compiling; the report is extra
                ],
                folder,
            )
            phases = {
                name: float(value)
                for name, value in re.findall(
                    r"^(trace|profile|partition|generate)\s+([\d.]+) s", log, re.M
                )
            }
            graph = (folder / "out" / "artifacts" / "graph.json").read_text()
            nodes = graph.count('"kind":')
            code = PIPPY.format(folder=str(folder), function=function, layers=layers)
            pippy_seconds, pippy_cpu, pippy_rss, _ = run([sys.executable, "-c", code], folder)
            rows.append(
                (label, nodes, seconds, cpu, rss, phases, pippy_seconds, pippy_cpu, pippy_rss)
            )
            print(
                f"# {label}: autopipe {seconds:.1f} s ({cpu:.1f} s CPU), "
                f"PiPPy {pippy_seconds:.1f} s ({pippy_cpu:.1f} s CPU)",
                file=sys.stderr,
            )
    print("Whole process, from start to exit; 8 stages")
    print(
        "| model | graph nodes | autopipe s | CPU s | autopipe peak RSS MB | trace | profile | partition | generate | PiPPy pipeline() s | CPU s | PiPPy peak RSS MB | autopipe / PiPPy (CPU) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for label, nodes, seconds, cpu, rss, phases, pippy_seconds, pippy_cpu, pippy_rss in rows:
        cells = " | ".join(
            f"{phases.get(p, float('nan')):.2f}"
            for p in ("trace", "profile", "partition", "generate")
        )
        print(
            f"| {label} | {nodes} | {seconds:.1f} | {cpu:.1f} | {rss / 2**20:.0f} | {cells} "
            f"| {pippy_seconds:.1f} | {pippy_cpu:.1f} | {pippy_rss / 2**20:.0f} | {cpu / pippy_cpu:.2f}x |"
        )
    print()
    print(
        "Seconds per 1000 graph nodes (the transformers): growth close to linear keeps these flat"
    )
    print("| model | graph nodes | trace | profile | partition | generate | PiPPy |")
    print("|---|---|---|---|---|---|---|")
    for label, nodes, _seconds, _cpu, _rss, phases, pippy_seconds, _pippy_cpu, _ in rows:
        if "transformer" in label:
            per = " | ".join(
                f"{phases.get(p, float('nan')) / nodes * 1000:.2f}"
                for p in ("trace", "profile", "partition", "generate")
            )
            print(f"| {label} | {nodes} | {per} | {pippy_seconds / nodes * 1000:.2f} |")


if __name__ == "__main__":
    main()
