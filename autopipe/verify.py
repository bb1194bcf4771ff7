"""``autopipe verify``: run a generated pipeline's stages in one process against the original model.

Both start from the same weights and RNG state; the stages are chained in order (autograd flows
through them as through the original), then forward outputs, parameter gradients (summed over the
copies of tied parameters) and buffers after the step are compared; then both run forward again
in eval mode (dropout off, batch norm on its running statistics), and their outputs and buffers
are compared once more.
"""

from __future__ import annotations

import importlib.util
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .codegen import edited_files
from .codegen.package import MANIFEST
from .errors import ArtifactError, AutopipeError, VerificationError
from .options import TOLERANCE
from .runtime.core.dimensions import dimension_sizes
from .runtime.core.errors import PipelineRunError
from .runtime.core.fixed_inputs import check_fixed_inputs
from .runtime.core.pipeline import Pipeline, PipelineFormatError, Stage
from .runtime.support import stage_state
from .spec import Example


def load_pipeline(path: str | Path) -> ModuleType:
    """Import a generated pipeline package from its directory (any name, any location)."""
    path = Path(path).resolve()
    if not (path / "__init__.py").is_file() or not (path / "pipeline.json").is_file():
        raise AutopipeError(
            f"{path} is not a generated pipeline (no __init__.py and pipeline.json)"
        )
    name = f"_autopipe_pipeline_{zlib.crc32(str(path).encode()):08x}"
    for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[module]
    spec = importlib.util.spec_from_file_location(
        name, path / "__init__.py", submodule_search_locations=[str(path)]
    )
    assert spec is not None and spec.loader is not None  # a .py file: a source loader
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package
    spec.loader.exec_module(package)
    return package


@dataclass
class Comparison:
    kind: str  # "output" | "grad" | "buffer" | "eval" (an output in eval mode)
    name: str
    max_abs: float
    ok: bool


@dataclass
class VerifyReport:
    comparisons: list[Comparison] = field(default_factory=list)
    #: files changed since generation (None: the package has no manifest to check against)
    edited: list[str] | None = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.edited and all(c.ok for c in self.comparisons)

    def worst(self, kind: str) -> float:
        return max((c.max_abs for c in self.comparisons if c.kind == kind), default=0.0)

    def summary(self) -> str:
        if self.edited is None:
            lines = ["no manifest.json: cannot tell whether files were edited since generation"]
        elif self.edited:
            lines = [
                f"edited since generation ({len(self.edited)} files; regenerate with "
                "`autopipe compile ... --force` or keep the edits at your own risk):",
                *[f"  {rel}" for rel in self.edited],
            ]
        else:
            lines = ["files     unchanged since generation (manifest.json)"]
        for kind in ("output", "grad", "buffer", "eval"):
            items = [c for c in self.comparisons if c.kind == kind]
            bad = [c for c in items if not c.ok]
            label = "eval outs" if kind == "eval" else kind + "s"
            lines.append(
                f"{label:<9} {len(items):4d} compared, max |diff| {self.worst(kind):.3g}, {len(bad)} mismatched"
            )
            lines += [f"  mismatch: {c.name} (max |diff| {c.max_abs:.3g})" for c in bad[:10]]
        return "\n".join(lines)


def check_files(path: str | Path) -> list[str] | None:
    """Files of a generated package edited since generation; None if it has no manifest.
    Raises :class:`ArtifactError` for a manifest autopipe did not write."""
    if not Path(path).is_dir():
        raise AutopipeError(f"{path} is not a directory; give the --out of `autopipe compile`")
    if not (Path(path) / MANIFEST).exists():
        return None
    return edited_files(path)


def verify(
    path: str | Path, example: Example, *, rtol: float = 1e-4, atol: float = 1e-5, seed: int = 0
) -> VerifyReport:
    """Compare the pipeline in ``path`` with ``example.model`` on the example microbatch, and
    its files with the manifest written when it was generated."""
    TOLERANCE.check(rtol, "--rtol")
    TOLERANCE.check(atol, "--atol")
    package = load_pipeline(path)
    try:
        pipeline = Pipeline.from_json(package.PIPELINE)
    except PipelineFormatError as exc:
        raise ArtifactError(f"{Path(path) / 'pipeline.json'}: {exc}") from None
    model = example.model
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        raise AutopipeError(
            "verify needs the model's real weights, but the model spec builds it on the meta device"
        )
    env = dict(zip(pipeline.signature, example.args)) | dict(example.kwargs)
    try:
        check_fixed_inputs(pipeline.fixed_inputs, env, "the example")
        dimension_sizes(pipeline, env, 1, "the example")
    except PipelineRunError as exc:
        raise AutopipeError(str(exc)) from None
    model.train()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    stages = []
    for i in range(pipeline.num_stages):
        stage = package.build_stage(i, device="cpu", init=False)
        try:
            stage.load_state_dict(stage_state(stage, state, pipeline.aliases))
        except KeyError as exc:
            raise AutopipeError(
                f"the model's state_dict has no entry {exc}; is this the model the pipeline was compiled from?"
            ) from None
        stage.train()
        stages.append(stage)

    torch.manual_seed(seed)
    expected = [
        leaf
        for leaf in pytree.tree_leaves(model(*example.args, **example.kwargs))
        if isinstance(leaf, torch.Tensor)
    ]
    torch.manual_seed(seed)
    records = _forward_stages(pipeline, stages, env)
    actual = [env[name] for name in pipeline.outputs]
    if len(actual) != len(expected):
        raise VerificationError(
            f"the pipeline returns {len(actual)} outputs, the model {len(expected)}"
        )
    report = VerifyReport(edited=check_files(path))
    for name, a, e in zip(pipeline.outputs, actual, expected):
        report.comparisons.append(_compare("output", name, a, e, rtol, atol))
    # back-propagate the same random projection of the outputs through both
    weights = _projection_weights(expected, seed)
    terms = [(e * w).sum() for e, w in zip(expected, weights) if w is not None]
    if terms:
        torch.stack(terms).sum().backward()
    output_grads: dict[str, torch.Tensor] = {}
    for name, w in zip(pipeline.outputs, weights):
        if w is not None:
            output_grads[name] = output_grads.get(name, 0) + w
    _backward_stages(records, output_grads)
    reference_grads = {name: p.grad for name, p in model.named_parameters(remove_duplicate=False)}
    aliases = {name: group for group in pipeline.aliases for name in group}
    pipeline_grads: dict[str, torch.Tensor] = {}
    for stage in stages:
        for name, param in stage.named_parameters():
            if param.grad is not None:
                canonical = aliases.get(name, [name])[0]
                pipeline_grads[canonical] = pipeline_grads.get(canonical, 0) + param.grad
    for name, param in model.named_parameters():
        got = pipeline_grads.get(name)
        want = reference_grads[name]
        if want is None and got is None:
            continue
        want = torch.zeros_like(param) if want is None else want
        got = torch.zeros_like(param) if got is None else got
        report.comparisons.append(_compare("grad", name, got, want, rtol, atol))
    _compare_buffers(report, model, stages, "", rtol, atol)
    # eval mode: dropout off, batch norm on its running statistics, which stay as they are
    model.eval()
    for stage in stages:
        stage.eval()
    with torch.no_grad():
        torch.manual_seed(seed)
        expected = [
            leaf
            for leaf in pytree.tree_leaves(model(*example.args, **example.kwargs))
            if isinstance(leaf, torch.Tensor)
        ]
        torch.manual_seed(seed)
        _forward_stages(pipeline, stages, env)
    for name, e in zip(pipeline.outputs, expected):
        report.comparisons.append(_compare("eval", name, env[name], e, rtol, atol))
    _compare_buffers(report, model, stages, " (after eval)", rtol, atol)
    model.train()
    return report


def _compare_buffers(
    report: VerifyReport,
    model: torch.nn.Module,
    stages: list,
    suffix: str,
    rtol: float,
    atol: float,
) -> None:
    reference_buffers = dict(model.named_buffers())
    for stage in stages:
        for name, buffer in stage.named_buffers():
            if name in reference_buffers:
                report.comparisons.append(
                    _compare("buffer", name + suffix, buffer, reference_buffers[name], rtol, atol)
                )


def _projection_weights(outputs: list[torch.Tensor], seed: int) -> list[torch.Tensor | None]:
    """Fixed random weights: the outputs are back-propagated as ``sum((output * weight).sum())``."""
    generator = torch.Generator().manual_seed(seed + 1)
    weights: list[torch.Tensor | None] = []
    for out in outputs:
        if out.requires_grad and out.is_floating_point():
            weights.append(
                torch.randn(out.shape, generator=generator, dtype=torch.float32).to(out.dtype)
            )
        else:
            weights.append(None)
    return weights


def _forward_stages(
    pipeline: Pipeline, stages: list, env: dict[str, Any]
) -> list[tuple[Stage, list, tuple]]:
    """Run the stages as the pipeline runtime does: each on fresh leaf tensors carrying the
    autograd flags of the pipeline description. Adds the outputs to ``env``."""
    records = []
    for spec, stage in zip(pipeline.stages, stages):
        inputs = []
        for value in pipeline.taken(spec):
            tensor = env[value.name].detach()
            inputs.append(tensor.requires_grad_(value.requires_grad and tensor.is_floating_point()))
        outputs = stage(*inputs)
        if not isinstance(outputs, tuple) or len(outputs) != len(spec.outputs):
            raise VerificationError(
                f"a stage returned {type(outputs).__name__}; expected a tuple of {len(spec.outputs)} tensors"
            )
        env.update(zip(spec.outputs, outputs))
        records.append((spec, inputs, outputs))
    return records


def _backward_stages(
    records: list[tuple[Stage, list, tuple]], grads: dict[str, torch.Tensor]
) -> None:
    """Backward from the last stage to the first, handing input gradients to the stage before.
    A value a stage returns twice (a model returning one tensor in two places) gets its
    gradient, the sum of both places', once."""
    for spec, inputs, outputs in reversed(records):
        returned = dict(zip(spec.outputs, outputs))
        pairs = [(o, grads[n]) for n, o in returned.items() if n in grads and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grads = {n: i.grad for n, i in zip(spec.inputs, inputs) if i.grad is not None}


def _compare(
    kind: str, name: str, actual: Any, expected: torch.Tensor, rtol: float, atol: float
) -> Comparison:
    if (
        not isinstance(actual, torch.Tensor)
        or actual.shape != expected.shape
        or actual.dtype != expected.dtype
    ):
        return Comparison(
            kind,
            f"{name} (shape/dtype {getattr(actual, 'shape', None)} vs {tuple(expected.shape)})",
            float("inf"),
            False,
        )
    a, e = actual.detach(), expected.detach()
    if not a.is_floating_point():
        diff = float((a != e).sum())
        return Comparison(kind, name, diff, diff == 0)
    diff = float((a.double() - e.double()).abs().max()) if a.numel() else 0.0
    ok = bool(torch.allclose(a.double(), e.double(), rtol=rtol, atol=atol, equal_nan=True))
    return Comparison(kind, name, diff, ok)
