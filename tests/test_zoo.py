"""Every architecture of the zoo (tests/zoo/models.py) compiles into 2 stages that reproduce it.

Each model is compiled once (default method, 2 stages) and the package is shared by the tests:

- ``test_zoo_matches_model``: ``verify`` on the example microbatch and on a fresh one (the graph
  is specialised to the example; other routing or values must still match). Outputs and buffers
  within rtol 1e-4 / atol 1e-5; gradients within that or below 1e-5 x the model's largest gradient
  magnitude (gradients that are zero in exact arithmetic differ by float noise).
- ``test_zoo_runs_standalone``: the stages run forward and backward in a fresh process that imports
  only torch, autopipe and the package, as train.py does.

A subset also trains through train.py against PyTorch, another goes through every partitioning
method. ``python tests/zoo/survey.py`` reports the same checks one architecture per process,
with timings.
"""

from __future__ import annotations

import pytest

from autopipe.compiler import CompileOptions, compile_spec
from autopipe.spec import load_example
from autopipe.verify import verify

from pipelines import STEPS, assert_same_training, reference_training, run_pipeline
from zoo.models import BATCHES, ZOO
from zoo.survey import (
    ATOL,
    RTOL,
    fresh_example,
    judge,
    largest_grad,
    spec,
)

# The slower half (encoder-decoders, vision, multi-modal, audio, MoE, state space): -m "not slow"
# leaves the faster half (decoder LLMs and encoders).
SLOW = {
    "t5",
    "mt5",
    "bart",
    "pegasus",
    "whisper",
    "vit",
    "swin",
    "convnext",
    "clip",
    "llava",
    "wav2vec2",
    "mixtral",
    "qwen2_moe",
    "mamba",
}


def _params():
    return [
        pytest.param(name, marks=[pytest.mark.slow] if name in SLOW else [], id=name)
        for name in ZOO
    ]


@pytest.fixture(scope="session")
def packages(zoo_packages):
    """Each architecture compiled once per session (shared with test_device_consistency)."""
    return zoo_packages


def _assert_matches(package, example, what):
    report = verify(package, example, rtol=RTOL, atol=ATOL)
    judged = judge(report, largest_grad(example.model))
    assert judged["compared"]["output"] and judged["compared"]["grad"], report.summary()
    assert judged["ok"], f"{what}: {judged['bad'][:10]}\n{report.summary()}"


@pytest.mark.parametrize("name", _params())
def test_zoo_matches_model(packages, name):
    package = packages.get(name)
    _assert_matches(package, load_example(spec(name)), "example microbatch")
    _assert_matches(
        package, fresh_example(name, load_example(spec(name)).model), "fresh microbatch"
    )


@pytest.mark.parametrize("name", _params())
def test_zoo_runs_standalone(packages, name):
    assert packages.standalone_result(name) == "ok"


# A subset trains through train.py on gloo against plain PyTorch: a decoder LLM, ALBERT (one
# layer shared by every position), a mixture of experts (an operator registered by transformers,
# imported by the generated stages), LLaVA (a check on tensor values, kept as a run-time check)
# and an LSTM over packed sequences (kept whole).
TRAINED = ["llama", "albert", "mixtral", "llava", "packed_lstm"]


@pytest.mark.slow
@pytest.mark.parametrize("name", TRAINED)
def test_zoo_trains_like_pytorch(tmp_path, name):
    # without dropout: the ranks draw other dropout masks than one process does
    plain = spec(f"{name}_no_dropout")
    pipe = run_pipeline(tmp_path, plain, 2, f"tests/zoo/models.py:{name}_batch", "--lr", "1e-3")
    ref = reference_training(load_example(plain), BATCHES[name], STEPS, "adamw", 1e-3)
    assert_same_training(pipe, ref)


# A subset goes through every partitioning method, on 2 and on fewer devices than stages.
@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2", "bart", "vit"])
@pytest.mark.parametrize(
    "method,stages,devices", [("metis", 3, 3), ("acyclic", 3, 3), ("mpipe", 4, 2)]
)
def test_zoo_every_method_matches(tmp_path, name, method, stages, devices):
    out = tmp_path / "pipe"
    compile_spec(
        spec(name), out, CompileOptions(stages=stages, devices=devices, method=method), report=False
    )
    example = load_example(spec(name))
    _assert_matches(out, example, f"{method} {stages} stages on {devices} devices")


@pytest.mark.slow
def test_zoo_compiled_on_meta_takes_the_cpu_branch(tmp_path):
    """Mixtral built on meta is traced as if on the CPU, so its device-dependent router code
    runs on the gloo ranks (traced on meta it took the GPU branch: histc on integers, which the
    CPU does not implement), and trains from --load weights like PyTorch."""
    zoo = "tests/zoo/models.py"
    pipe = run_pipeline(
        tmp_path,
        f"{zoo}:mixtral",
        2,
        f"{zoo}:mixtral_batch",
        compile_spec=f"{zoo}:mixtral_meta",
    )
    ref = reference_training(
        load_example(spec("mixtral_no_dropout")), BATCHES["mixtral"], STEPS, "adamw", 1e-3
    )
    assert_same_training(pipe, ref)
