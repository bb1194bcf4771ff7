"""How well the analytic profile predicts real stages, on this CPU.

    python benchmarks/prediction.py

``autopipe calibrate`` measures this machine (one thread) into a device spec; each model is then
compiled into 4 stages with the *analytic* profile for that spec, and every generated stage is run
for real, forward and backward on the example microbatch:

- time: predicted (sum of the stage's unit costs) against measured (median of 9 runs),
- memory: predicted (parameters, their gradients, and the activations autograd saves) against the
  peak bytes of live tensors measured while the stage runs (parameters included), tracked by a
  dispatch mode that sees every tensor allocated and notices when its storage is freed.

Reported: Spearman rank correlation and mean absolute percentage error over all stages.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from autopipe.compiler import CompileOptions, compile_example
from autopipe.profiling.calibrate import calibrate
from autopipe.runtime.pipeline import Pipeline
from autopipe.runtime.support import stage_state
from autopipe.spec import as_example
from autopipe.verify import load_pipeline

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

STAGES = 4


class LiveBytes(TorchDispatchMode):
    """Peak bytes of tensor storages alive at once while it is active (plus ``base``)."""

    def __init__(self, base: int = 0):
        super().__init__()
        self.live: dict[StorageWeakRef, int] = {}
        self.base = base
        self.peak = base

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for ref in [r for r in self.live if r.expired()]:
            del self.live[ref]
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                self.live.setdefault(StorageWeakRef(storage), storage.nbytes())
        self.peak = max(self.peak, self.base + sum(self.live.values()))
        return out


def models():
    import models as test_models
    import transformers as tf

    torch.manual_seed(0)
    gpt2 = tf.GPT2LMHeadModel(
        tf.GPT2Config(
            n_layer=4,
            n_embd=256,
            n_head=4,
            vocab_size=2048,
            n_positions=128,
            use_cache=False,
            bos_token_id=0,
            eos_token_id=0,
        )
    )
    ids = torch.randint(0, 2048, (4, 128))
    bert = tf.BertForMaskedLM(
        tf.BertConfig(
            num_hidden_layers=4,
            hidden_size=256,
            num_attention_heads=4,
            intermediate_size=1024,
            vocab_size=2048,
            max_position_embeddings=128,
        )
    )
    t5 = tf.T5ForConditionalGeneration(
        tf.T5Config(
            num_layers=2,
            d_model=256,
            d_kv=32,
            num_heads=8,
            d_ff=1024,
            vocab_size=2048,
            use_cache=False,
            decoder_start_token_id=0,
            pad_token_id=0,
        )
    )
    cnn = test_models.ConvNet()
    return {
        "GPT-2 (4 x 256)": (gpt2, (ids,), {"labels": ids}),
        "BERT (4 x 256)": (bert, (ids,), {"labels": ids}),
        "T5 (2+2 x 256)": (t5, (ids,), {"labels": ids[:, :32].clone()}),
        "CNN (BatchNorm)": (cnn, (torch.randn(64, 3, 32, 32),), {}),
    }


def measure(package, model, example, repeats: int = 9) -> list[tuple[float, int]]:
    """(median seconds, peak live bytes) of each stage's forward + backward, chained."""
    pipeline = Pipeline.from_json(package.PIPELINE)
    state = model.state_dict()
    env = dict(zip(pipeline.signature, example.args)) | example.kwargs
    results = []
    for spec in pipeline.stages:
        stage = package.build_stage(spec.index, init=False)
        stage.load_state_dict(stage_state(stage, state, pipeline.aliases))
        params = sum(p.numel() * p.element_size() for p in stage.parameters())
        samples, peak = [], 0
        for run in range(repeats + 1):
            inputs = [
                env[v.name].detach().requires_grad_(v.requires_grad)
                for v in pipeline.received(spec)
            ]
            stage.zero_grad(set_to_none=True)
            tracker = LiveBytes(params) if run == 0 else None
            start = time.perf_counter()
            with tracker or torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                outputs = stage(*inputs)
                pairs = [(o, torch.ones_like(o)) for o in outputs if o.requires_grad]
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            if tracker:
                peak = tracker.peak
            else:
                samples.append(time.perf_counter() - start)
        env.update(zip(spec.outputs, [o.detach() for o in outputs]))
        results.append((statistics.median(samples), peak))
    return results


def spearman(a: list[float], b: list[float]) -> float:
    rank = lambda xs: {
        i: r for r, i in enumerate(sorted(range(len(xs)), key=xs.__getitem__))
    }  # noqa: E731
    ra, rb = rank(a), rank(b)
    n = len(a)
    return 1 - 6 * sum((ra[i] - rb[i]) ** 2 for i in range(n)) / (n * (n * n - 1))


def main() -> None:
    torch.set_num_threads(1)
    spec = calibrate(
        torch.device("cpu"), "this-cpu", log=lambda m: print(f"# {m}", file=sys.stderr)
    )
    with tempfile.TemporaryDirectory() as tmp:
        spec_file = Path(tmp) / "cpu.json"
        import json

        spec_file.write_text(json.dumps(spec.to_json()))
        rows = []
        for name, (model, args, kwargs) in models().items():
            example = as_example((model, args, kwargs))
            out = Path(tmp) / name.split()[0]
            result = compile_example(
                example, out, CompileOptions(stages=STAGES, device_spec=str(spec_file))
            )
            predicted = result.partition.predicted["stages"]
            measured = measure(load_pipeline(out), model, example)
            for index, (cost, (seconds, peak)) in enumerate(zip(predicted, measured)):
                memory = 2 * cost["parameters"] + _activations(result, index)
                rows.append(
                    (name, index, cost["forward"] + cost["backward"], seconds, memory, peak)
                )
    print(
        f"CPU calibrated by `autopipe calibrate` (1 thread): {spec.flops['float32'] / 1e9:.1f} GFLOP/s fp32 matmul, "
        f"{spec.memory_bandwidth / 1e9:.1f} GB/s memory, {spec.kernel_overhead * 1e6:.1f} us per operator"
    )
    print("| model | stage | predicted ms | measured ms | predicted peak MB | measured peak MB |")
    print("|---|---|---|---|---|---|")
    for name, index, p_time, m_time, p_mem, m_mem in rows:
        print(
            f"| {name} | {index} | {p_time * 1e3:.2f} | {m_time * 1e3:.2f} | {p_mem / 2**20:.1f} | {m_mem / 2**20:.1f} |"
        )
    times_p, times_m = [r[2] for r in rows], [r[3] for r in rows]
    mem_p, mem_m = [r[4] for r in rows], [r[5] for r in rows]
    mape = lambda p, m: statistics.mean(abs(x - y) / y for x, y in zip(p, m)) * 100  # noqa: E731
    print()
    print(
        f"Stage time: Spearman {spearman(times_p, times_m):.2f}, mean absolute error {mape(times_p, times_m):.0f}% over {len(rows)} stages"
    )
    print(
        f"Stage peak memory: Spearman {spearman(mem_p, mem_m):.2f}, mean absolute error {mape(mem_p, mem_m):.0f}%"
    )


def _activations(result, stage: int) -> int:
    return sum(
        c.activations
        for c, s in zip(result.profile.units, result.partition.stage_of_unit)
        if s == stage
    )


if __name__ == "__main__":
    main()
