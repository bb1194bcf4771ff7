"""Render the generated pipeline package: stage modules, pipeline description, train.py."""

from __future__ import annotations

import gc
import hashlib
import importlib.resources
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import black
import jinja2
import torch

from ..artifacts import ARTIFACT_VERSION, dumps, write_error
from ..errors import ArtifactError, OutputExistsError
from ..ir import COND, BufferInfo, Graph, Node, ParamInfo, Ref
from ..ir.types import dtype_name
from ..partitioning import Partition, default_schedule
from ..partitioning.cost import iteration_time
from ..partitioning.partition import PredictedStep, costs_to_json
from ..runtime.core.pipeline import Pipeline, default_microbatches
from ..runtime.core.manifest import changed_files
from ..runtime.core.sharded_layers import (
    ReplicatedHeadsParallel,
    SectionedColwiseParallel,
    TransposedRowwiseParallel,
)
from ..tensor_parallel import SEQUENCE_DIM, ShardingPlan, find_regions, sharding_plan
from . import emit
from .sizes import size_lines, used_symbols
from ..ir.analysis import block_calls
from .blocks import (
    Submodule,
    call_statement,
    class_definition,
    class_source,
    name_classes,
    stage_submodules,
)
from .cond import branch_functions
from .context import LaunchContext, PackageContext, StageContext
from .autograd_function import function_classes
from .kept_module import kept_constructors, support_names
from .names import value_names
from .output_lock import check_unlocked, output_lock
from .plan import StagePlan, plan_stages

TEMPLATES = Path(str(importlib.resources.files("autopipe.templates")))
RUNTIME = Path(__file__).resolve().parent.parent / "runtime"
#: autopipe.runtime, copied verbatim into each package as its runtime/ subpackage: every module
#: under it (core/ included), by path relative to it, sorted
RUNTIME_MODULES = tuple(
    sorted(path.relative_to(RUNTIME).as_posix() for path in RUNTIME.rglob("*.py"))
)
BLACK_MODE = emit.BLACK_MODE
#: the tensor-parallel styles generated code imports from the package's runtime (torch's others)
RUNTIME_STYLES = frozenset(
    style.__name__
    for style in (ReplicatedHeadsParallel, SectionedColwiseParallel, TransposedRowwiseParallel)
)
#: stands for a forward body in a rendered file until the (already formatted) body is spliced in
BODY_MARKER = "# autopipe: forward body"


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined,
    )
    env.filters["pytuple"] = python_tuple
    env.filters["tojson"] = json.dumps
    return env


def python_tuple(items: list[str], quote: bool = True) -> str:
    """``("a", "b")`` / ``("a",)``: a tuple without a trailing comma, so black keeps it on one line."""
    parts = [json.dumps(i) if quote else i for i in items]
    return f"({parts[0]},)" if len(parts) == 1 else f"({', '.join(parts)})"


def render(template: str, **context: Any) -> str:
    """A template rendered (not yet formatted)."""
    return _environment().get_template(template).render(**context)


def black_format(sources: dict[str, str]) -> dict[str, str]:
    """Sources formatted with black (forward bodies are spliced in afterwards: black would spend
    most of its time re-parsing them). The cyclic garbage collector pauses meanwhile: black's
    garbage goes with reference counting, and after tracing a big model each collection would
    walk hundreds of thousands of live objects (it doubled the time on GPT2-XL)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return {name: black.format_str(text, mode=BLACK_MODE) for name, text in sources.items()}
    finally:
        if enabled:
            gc.enable()


def package_files(graph: Graph, part: Partition, gpus_per_node: int = 8) -> dict[str, str]:
    """The files of a generated pipeline package, by relative path; its SLURM script asks for
    nodes of ``gpus_per_node`` GPUs."""
    plans = plan_stages(graph, part.stage_of_unit, part.device_of_stage, part.recomputed_values)
    device_of_stage = part.device_of_stage
    model_class = graph.model.cls.rsplit(".", 1)[-1]
    tp = part.settings.tp or 1
    sequence = bool(part.settings.sequence_parallel)
    sharding = sharding_plan(graph, find_regions(graph), tp, sequence) if tp > 1 else None
    if sharding is not None:
        sharding = sharding.on_stages(part.stage_of_nodes(graph))
    package = PackageContext(
        model_class=model_class,
        num_stages=len(plans),
        num_processes=len(set(device_of_stage)) * (part.settings.dp_shard or 1) * tp,
        stage_classes=[f"Stage{plan.index}" for plan in plans],
    )
    common = package.variables()
    calls = block_calls(graph)
    submodules = {
        plan.index: stage_submodules(graph, plan.nodes, plan.state_names, calls) for plan in plans
    }
    every = [sub for plan in plans for sub in submodules[plan.index]]
    boundary = [name for plan in plans for name in plan.inputs + plan.outputs]
    names = value_names(graph, [(sub.fqn, sub.outputs) for sub in every], boundary)
    # stage -> its own (parameter rows, buffer rows); its blocks hold the rest
    rows: dict[int, tuple[list[dict[str, Any]], list[dict[str, Any]]]] = {}
    for plan in plans:
        parameters, buffers = _parameter_rows(graph, plan), _buffer_rows(graph, plan)
        for sub in submodules[plan.index]:
            sub.source = class_source(
                graph,
                sub,
                plan.state_names,
                _rows_of(parameters, sub),
                _rows_of(buffers, sub),
                sharding,
            )
        prefixes = tuple(f"{sub.fqn}." for sub in submodules[plan.index])
        own_parameters, own_buffers = (
            [row for row in table if not row["name"].startswith(prefixes)]
            for table in (parameters, buffers)
        )
        rows[plan.index] = (own_parameters, own_buffers)
    classes = name_classes(every)
    bodies: dict[str, list[str]] = {}
    sources: dict[str, str] = {}
    for plan in plans:
        context = _stage_context(
            graph, plan, package, submodules[plan.index], names, rows[plan.index], sharding
        )
        bodies[f"stage{plan.index}.py"] = context.body
        sources[f"stage{plan.index}.py"] = render(
            "stage.py.j2", **context.variables(body=[BODY_MARKER])
        )
    if classes:
        definitions = [
            class_definition(name, first, [s.fqn for s in every if s.class_name == name])
            for name, first in classes
        ]
        sources["blocks.py"] = render(
            "blocks.py.j2",
            **common,
            classes=definitions,
            example=every[0].fqn,
            keeps=any("keep_whole(" in definition for definition in definitions),
            support=sorted(
                {"Block"}
                | {
                    name
                    for name in ("keep_whole", "TransposedLinear", emit.RANK_STREAM_CALL)
                    if any(f"{name}(" in definition for definition in definitions)
                }
            ),
        )
    sources["__init__.py"] = render(
        "__init__.py.j2", **common, modules=sorted(set(graph.model.operators.values()))
    )
    sources["train.py"] = render("train.py.j2", **common)
    ranks = len(set(device_of_stage))
    launch = LaunchContext.for_plan(
        package,
        ranks,
        part.settings.dp_shard or 1,
        gpus_per_node,
        tp,
        cpu=part.settings.device_type == "cpu",
    )
    launch_script = render("slurm.sbatch.j2", **launch.variables())
    if graph.loss is not None:
        loss_context = _loss_context(graph.loss, model_class)
        loss_context["functions"] = [
            *function_classes(graph.loss, graph.loss.calls),
            *loss_context.get("functions", []),
        ]
        bodies["loss.py"] = loss_context.pop("body")
        sources["loss.py"] = render("loss.py.j2", **common, **loss_context, body=[BODY_MARKER])
    files = black_format(sources)
    for name, body in bodies.items():  # emitted in black's layout already (emit.assignment)
        files[name] = files[name].replace(
            f"        {BODY_MARKER}\n",
            "".join(f"        {line}\n" if line else "\n" for line in body),
        )
    blocks_of_stage = {i: [sub.fqn for sub in subs] for i, subs in submodules.items()}
    files["launch/slurm.sbatch"] = launch_script
    sliced = sharding.sequence_values if sharding else frozenset()
    files["pipeline.json"] = dumps(
        pipeline_description(
            graph,
            plans,
            part,
            names,
            blocks_of_stage,
            sliced,
            loss_parallel=sharding is not None and sharding.loss_parallel,
        )
    )
    for module in RUNTIME_MODULES:
        files[f"runtime/{module}"] = (RUNTIME / module).read_text(encoding="utf-8")
    return files


def _loss_context(loss: Graph, model_class: str) -> dict[str, Any]:
    calls = loss.calls
    constant_lines = [
        line
        for name, value in loss.constants.items()
        for line in emit.assignment(name, f"{emit.tensor_expression(value)}.to(device)", None, 8)
    ]
    return {
        "inputs": loss.inputs,
        "body": constant_lines
        + emit.forward_body(
            loss, calls, lambda r: r.name, lambda node: emit.scope_label(node, "loss function")
        ),
        "output": loss.outputs[0],
        "uses_device": emit.uses_device(calls) or bool(constant_lines),
    }


def _stage_context(
    graph: Graph,
    plan: StagePlan,
    package: PackageContext,
    submodules: list[Submodule],
    names: dict[str, str],
    rows: tuple[list[dict[str, Any]], list[dict[str, Any]]],
    sharding: ShardingPlan | None = None,
) -> StageContext:
    """Everything ``stage.py.j2`` renders one stage with; ``rows``: its own parameter and
    buffer rows; ``sharding``: the package's tensor-parallel plan."""
    model_class = package.model_class
    state_refs = {name: emit.attribute_path(held) for name, held in plan.state_names.items()}

    def rename(name: str) -> str:
        return names.get(name, name)

    def ref(r: Ref) -> str:
        return state_refs.get(r.name) or rename(r.name)

    used_constants = dict.fromkeys(
        src for node in plan.nodes for src in node.inputs if graph[src].kind == "constant"
    )
    constant_lines = [
        line
        for name in used_constants
        for line in emit.assignment(
            name, f"{emit.tensor_expression(graph.constants[name])}.to(device)", None, 8
        )
    ]
    calls = {sub.call.nodes[0]: sub for sub in submodules}
    inside = {name for sub in submodules for name in sub.call.nodes}
    items: list[Node | emit.ModuleCall] = []
    for node in plan.nodes:
        if node.name in calls:
            items.append(call_statement(calls[node.name], lambda n: ref(Ref(n)), rename))
        elif node.name not in inside:
            items.append(node)
    label = lambda node: emit.scope_label(node, model_class)  # noqa: E731
    own = [node for node in plan.nodes if node.name not in inside]
    sizes = size_lines(
        used_symbols(graph, own),
        [(rename(n), graph[n].meta) for n in plan.inputs],
        f"stage {plan.index}",
    )
    body = constant_lines + emit.forward_body(
        graph, items, ref, label, target=rename, sharding=sharding
    )
    produced = {n.name for n in plan.nodes}
    held = {n.name for n in plan.nodes}
    outside = sharding.within(held - inside) if sharding else []  # not in its blocks
    own_modules = [(m.module, m.constructor()) for m in outside]
    styles = [(m.module, m.style_source()) for m in (sharding.within(held) if sharding else [])]
    state = set(plan.state_names.values())
    operators = _operators(graph, plan.nodes)
    first, final = plan.nodes[0], plan.nodes[-1]
    summary = (
        f"{len(plan.nodes)} operators, from {first.scope_label or model_class} "
        f"to {final.scope_label or model_class}"
    )
    branches = branch_functions(graph, plan.nodes, model_class)  # of torch.cond
    return StageContext(
        package=package,
        stage=plan,
        summary=summary,
        inputs=[rename(n) for n in plan.inputs],
        outputs=[rename(n) for n in plan.outputs],
        cloned_inputs=[rename(n) for n in plan.cloned_inputs],
        sizes=sizes,
        returns=[f"{rename(n)}.contiguous()" if n in produced else rename(n) for n in plan.outputs],
        operators=operators,
        functions=[*function_classes(graph, plan.nodes), *branches],
        formats={rename(n): f for n, f in _memory_formats(graph, plan.inputs).items()},
        uses_device=emit.uses_device(plan.nodes) or bool(constant_lines),
        blocks=[(sub.fqn, sub.class_name) for sub in submodules],
        kept=kept_constructors(plan.nodes),
        tensor_parallel_modules=own_modules,
        tensor_parallel=styles,
        tensor_parallel_imports=_style_imports([style for _, style in styles]),
        sequence_parallel_parameters=[
            name
            for name in (sharding.sequence.parameters if sharding and sharding.sequence else ())
            if name in state
        ],
        replicated_heads_parameters=[
            name
            for module in (sharding.modules if sharding else ())
            if module.heads and module.node in held
            for name in module.parameters
            if name in state
        ],
        support=sorted(
            set(
                ["build_state", "init_state"]
                + (["add_submodule"] if submodules else [])
                + (["require_operators"] if operators else [])
                + (["keep_whole"] if own_modules else [])
                + (
                    ["TransposedLinear"]
                    if any("TransposedLinear(" in c for _, c in own_modules)
                    else []
                )
                + sorted({style.split("(")[0] for _, style in styles} & RUNTIME_STYLES)
                + (
                    [emit.RANK_STREAM_CALL]
                    if any(f"{emit.RANK_STREAM_CALL}(" in line for line in body)
                    else []
                )
                + support_names(plan.nodes)
            )
        ),
        parameters=rows[0],
        buffers=rows[1],
        body=body,
    )


def _style_imports(styles: list[str]) -> list[str]:
    """The import lines of torch's tensor-parallel styles (and placements) ``styles`` (as
    generated code writes them) use."""
    names = sorted({style.split("(")[0] for style in styles} - RUNTIME_STYLES)
    lines = [f"from torch.distributed.tensor.parallel import {', '.join(names)}"] if names else []
    placements = sorted({p for p in ("Replicate", "Shard") if any(f"{p}(" in s for s in styles)})
    if placements:
        lines.insert(0, f"from torch.distributed.tensor import {', '.join(placements)}")
    return lines


def _memory_formats(graph: Graph, names: list[str]) -> dict[str, str]:
    """Stage inputs the model held in a channels-last layout -> that memory format. Values
    cross a stage boundary contiguous; the receiving stage restores the model's layout, since
    kernels (convolutions, normalisations) round differently in another one."""
    formats = {}
    for name in names:
        meta = graph[name].tensor_meta
        if meta is None or len(meta.shape) not in (4, 5):
            continue
        dense = torch.empty(meta.shape, device="meta")
        if tuple(meta.stride) == dense.stride():
            continue
        fmt = "channels_last" if len(meta.shape) == 4 else "channels_last_3d"
        if tuple(meta.stride) == dense.contiguous(memory_format=getattr(torch, fmt)).stride():
            formats[name] = fmt
    return formats


def _operators(graph: Graph, nodes: list) -> dict[str, str]:
    """Operators from outside torch the nodes call, in torch.cond branches too ("ns::name") ->
    the module registering them."""
    providers = graph.model.operators
    used = {n.target.rsplit(".", 1)[0].replace(".", "::") for n in _calls(nodes)}
    return {name: providers[name] for name in sorted(used) if name in providers}


def _calls(nodes: list) -> Iterator:
    for node in nodes:
        if node.kind != "call":
            continue
        yield node
        if node.target == COND:
            for branch in node.args[1:3]:
                yield from _calls(branch.nodes)


def _rows_of(rows: list[dict[str, Any]], block: Submodule) -> list[dict[str, Any]]:
    """The state rows of a block, named within it."""
    prefix = f"{block.fqn}."
    return [
        {**row, "name": row["name"].removeprefix(prefix)}
        for row in rows
        if row["name"].startswith(prefix)
    ]


def _parameter_rows(graph: Graph, plan: StagePlan) -> list[dict[str, Any]]:
    held = {
        graph[p].target: name for p, name in plan.state_names.items() if graph[p].kind == "param"
    }
    names = sorted(set(held.values()) | set(plan.extra_params))
    rows = []
    for name in names:
        info = graph.param_of(name)
        rows.append(
            {
                "name": name,
                "shape": tuple(info.shape),
                "dtype": f"torch.{dtype_name(info.dtype)}",
                "requires_grad": info.requires_grad,
                "init": _init_rule(name, info),
            }
        )
    return rows


def _buffer_rows(graph: Graph, plan: StagePlan) -> list[dict[str, Any]]:
    held = {name for p, name in plan.state_names.items() if graph[p].kind == "buffer"}
    rows = []
    for name in sorted(held | set(plan.extra_buffers)):
        info = next(b for b in graph.buffers.values() if name in b.names)
        if info.persistent:
            init = json.dumps("ones" if name.endswith("running_var") else "zeros")
        else:
            init = emit.tensor_expression(info.value)
        rows.append(
            {
                "name": name,
                "shape": tuple(info.shape),
                "dtype": f"torch.{dtype_name(info.dtype)}",
                "persistent": info.persistent,
                "init": init,
            }
        )
    return rows


def _init_rule(name: str, info: ParamInfo) -> str:
    """autopipe's generic initialisation; random draws are seeded by the canonical name, so tied
    copies of a parameter start equal."""
    local = name.rpartition(".")[2]
    if "bias" in local:
        return "zeros"
    if len(info.shape) <= 1 or "norm" in info.owner.rsplit(".", 1)[-1].lower():
        return "ones"
    canonical = info.names[0]
    return "normal:0.02" if name == canonical else f"normal:0.02:{canonical}"


def pipeline_description(
    graph: Graph,
    plans: list[StagePlan],
    part: Partition,
    names: dict[str, str],
    blocks_of_stage: dict[int, list[str]],
    sliced: frozenset[str] = frozenset(),
    loss_parallel: bool = False,
) -> dict[str, Any]:
    """The JSON-compatible ``PIPELINE`` dict of a generated package (values under their
    generated ``names``; those of ``sliced`` sliced along the sequence over the tensor-parallel
    ranks, ``"tp_dim"``; ``loss_parallel``: its loss computed vocabulary-parallel)."""
    exchanged = dict.fromkeys(
        graph.inputs + [n for p in plans for n in p.inputs + p.outputs] + graph.outputs
    )
    values = {}
    for name in exchanged:
        meta = graph[name].tensor_meta
        assert meta is not None  # lint: model inputs and outputs; plan_stages: stage boundaries
        values[names.get(name, name)] = {
            "shape": list(meta.shape),
            "dtype": dtype_name(meta.dtype),
            "requires_grad": meta.requires_grad,
        } | ({"sizes": list(meta.formulas)} if meta.sizes else {})
        if name in sliced:
            values[names.get(name, name)]["tp_dim"] = SEQUENCE_DIM
    holders: dict[str, dict[str, str]] = {}
    for plan in plans:
        for name in plan.held_names:
            canonical = _canonical(graph, name)
            holders.setdefault(canonical, {})[str(plan.index)] = name
    tied = [
        {"names": list(graph.params[c].names), "holders": h}
        for c, h in holders.items()
        if c in graph.params and len(h) > 1
    ]
    state: list[ParamInfo | BufferInfo] = [*graph.params.values(), *graph.buffers.values()]
    aliases = [list(info.names) for info in state if len(info.names) > 1]
    description: dict[str, Any] = {
        "format": "autopipe.pipeline",
        "version": ARTIFACT_VERSION,
        "model": graph.model.cls,
        "signature": graph.signature,
        "inputs": graph.inputs,
        "outputs": graph.outputs,
        "stages": [
            {
                "inputs": [names.get(n, n) for n in p.inputs],
                "outputs": [names.get(n, n) for n in p.outputs],
                "device": p.device,
                "module": f"stage{p.index}",
                "recompute": p.index in part.recompute,
                "blocks": blocks_of_stage[p.index],
                "recompute_blocks": [
                    b for b in blocks_of_stage[p.index] if b in part.recompute_blocks
                ],
            }
            | ({"data_inputs": [names.get(n, n) for n in p.data_inputs]} if p.data_inputs else {})
            | ({"recomputes": [names.get(n, n) for n in p.recomputed]} if p.recomputed else {})
            for p in plans
        ],
        "values": values,
        "loss": _loss_description(graph),
        "schedule": _schedule_description(part),
        "tied": tied,
        "aliases": aliases,
        "input_ranges": dict(graph.model.input_ranges)
        | (dict(graph.loss.model.input_ranges) if graph.loss is not None else {}),
        "dp_shard": part.settings.dp_shard or 1,
    }
    if (part.settings.tp or 1) > 1:  # train.py's tensor-parallel degree; to_json leaves 1 out
        description["tp"] = part.settings.tp
        if part.settings.sequence_parallel:
            description["sequence_parallel"] = True
        if loss_parallel:
            description["loss_parallel"] = True
    if part.settings.mesh is not None:  # train.py's mesh order; to_json leaves the default out
        description["mesh"] = list(part.settings.mesh)
    if graph.model.fixed_inputs:
        description["fixed_inputs"] = {
            name: fixed.to_json() for name, fixed in graph.model.fixed_inputs.items()
        }
    if part.predicted is not None:
        description["plan"] = _plan_description(part, part.predicted, graph)
    if graph.model.symbols:
        description["dimensions"] = graph.model.symbols_json()
    description["identity"] = model_identity(graph)
    frozen = [info.names[0] for info in graph.params.values() if not info.requires_grad]
    if frozen:  # parameters that take no gradient: no gradients, optimizer state or reduction
        description["frozen"] = frozen
    if graph.model.huggingface is not None:
        description["huggingface"] = dict(graph.model.huggingface)
    if graph.model.batch_dims:  # inputs whose batch is not along dimension 0
        description["batch_dims"] = dict(graph.model.batch_dims)
    return Pipeline.from_json(description).to_json()  # the runtime's contract, checked here


def model_identity(graph: Graph) -> dict[str, Any]:
    """The identity checkpoints are keyed by (``pipeline.json``'s ``identity``): every tensor of
    the model's ``state_dict`` under its first name, and a digest of the model's class, module
    tree and tensors. It leaves out what another compile of the same model may change (the
    example's sizes, dynamic dimensions, the operators a trace records), so that a checkpoint
    resumes under any package of the same model."""
    state: list[ParamInfo | BufferInfo] = [*graph.params.values()]
    state += [info for info in graph.buffers.values() if info.persistent]
    tensors = {
        info.names[0]: {"shape": list(info.shape), "dtype": dtype_name(info.dtype)}
        for info in state
    }
    modules = sorted({(s.fqn, s.cls) for node in graph.nodes for s in node.scope})
    identity = {"class": graph.model.cls, "modules": modules, "tensors": tensors}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return {"digest": digest, "tensors": tensors}


def _plan_description(part: Partition, predicted: PredictedStep, graph: Graph) -> dict[str, Any]:
    """The plan train.py defaults to, and the step time and FLOPs its metrics compare with
    (with dynamic dimensions: at the ``sizes`` they were predicted for)."""
    settings = part.settings
    accumulate = settings.accumulate or 1
    symbols, timed_at = graph.model.symbols, settings.timed_at or {}
    sizes = {name: timed_at.get(name, symbol.planned) for name, symbol in symbols.items()}
    return (
        ({"sizes": sizes} if sizes else {})
        | {
            "microbatches": settings.microbatches or default_microbatches(part.num_stages),
            "accumulate": accumulate,
            "step_time": iteration_time(predicted, accumulate),
            "flops_per_microbatch": 0.0 if predicted.flops is None else predicted.flops,
            "peak_flops": 0.0 if predicted.peak_flops is None else predicted.peak_flops,
            "device": "" if settings.device is None else settings.device,
        }
        | ({"bf16": True} if settings.bf16 else {})
    )


def _schedule_description(part: Partition) -> dict[str, Any]:
    """The default schedule, and the stage costs the ``auto`` schedule orders actions by."""
    costs = costs_to_json(part.costs) or {
        "forward": [1.0] * part.num_stages,
        "backward": [2.0] * part.num_stages,
        "activations": [0.0] * part.num_stages,
        "static_memory": [0.0] * part.num_stages,
        "send_forward": [0.0] * (part.num_stages - 1),
        "send_backward": [0.0] * (part.num_stages - 1),
    }
    return {
        "name": part.settings.schedule or default_schedule(part.device_of_stage),
        "costs": costs,
    }


def _loss_description(graph: Graph) -> dict[str, Any]:
    """How train.py gets the loss: a model output (Hugging Face style) or the generated loss.py."""
    if graph.loss is not None:
        target = graph.loss[graph.loss.inputs[-1]].tensor_meta
        assert target is not None  # lint: a graph's inputs have tensor metadata
        return {
            "module": "loss",
            "target": {
                "shape": list(target.shape),
                "dtype": dtype_name(target.dtype),
                "requires_grad": False,
            },
        }
    return {"output": _loss_output(graph)}


def _loss_output(graph: Graph) -> str | None:
    """The model output that is its loss: the one named ``loss`` (a Hugging Face model given
    labels), or the model's only output when it is a scalar that needs a gradient (a forward
    returning its loss as a plain tensor)."""
    if "loss" in graph.outputs:
        return "loss"
    if len(graph.outputs) == 1:
        meta = graph[graph.outputs[0]].tensor_meta
        if meta is not None and meta.shape == () and meta.requires_grad:
            return graph.outputs[0]
    return None


def _canonical(graph: Graph, name: str) -> str:
    for table in (graph.params, graph.buffers):
        for canonical, info in table.items():
            if name in info.names:
                return canonical
    raise KeyError(name)


MANIFEST = "manifest.json"
#: suffixes of the files `autopipe report` writes under report/
_REPORT = (".html", ".svg", ".png")


def with_manifest(files: dict[str, str]) -> dict[str, str]:
    """``files`` plus ``manifest.json``: the SHA-256 of every file, so that edits are found."""
    digests = {
        rel: hashlib.sha256(text.encode("utf-8")).hexdigest() for rel, text in sorted(files.items())
    }
    manifest = {"format": "autopipe.manifest", "version": ARTIFACT_VERSION, "files": digests}
    return {**files, MANIFEST: json.dumps(manifest, indent=1) + "\n"}


def read_manifest(directory: str | os.PathLike) -> dict[str, str]:
    """The file digests of the manifest autopipe wrote in a generated package, by relative path.
    Raises :class:`ArtifactError` unless it is autopipe's and every path stays inside
    ``directory`` (no ``..``, no absolute path, no symbolic link leading out)."""
    directory = Path(directory)
    path = directory / MANIFEST
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"{path} is missing or unreadable ({exc})") from None
    if (
        not isinstance(data, dict)
        or data.get("format") != "autopipe.manifest"
        or data.get("version") != ARTIFACT_VERSION
        or not isinstance(data.get("files"), dict)
    ):
        raise ArtifactError(f"{path} is not a manifest of this autopipe version")
    root = directory.resolve()
    for rel, digest in data["files"].items():
        inside = _is_plain_relative(rel) and (directory / rel).resolve().is_relative_to(root)
        if not inside or not _is_digest(digest):
            raise ArtifactError(
                f"{path} lists {rel!r}, which is not a file inside {directory} with its SHA-256; "
                "the manifest was not written by autopipe"
            )
    return data["files"]


def _is_plain_relative(rel: Any) -> bool:
    """``rel`` is a normalised relative POSIX path without ``..``: ``runtime/driver.py``."""
    if not isinstance(rel, str) or not rel.isprintable() or "\\" in rel:
        return False
    pure = PurePosixPath(rel)
    return not pure.is_absolute() and pure.as_posix() == rel and ".." not in pure.parts


def _is_digest(value: Any) -> bool:
    return (
        isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)
    )


def edited_files(directory: str | os.PathLike) -> list[str]:
    """Files of a generated package that differ from its manifest (changed, missing or added
    beside the generated ones), by relative path; raises if there is no valid manifest."""
    directory = Path(directory)
    digests = read_manifest(directory)
    edited = changed_files(directory, digests)
    generated_folders = {Path(rel).parent for rel in digests}
    for path in sorted(directory.rglob("*.py")):
        rel = path.relative_to(directory).as_posix()
        if rel not in digests and Path(rel).parent in generated_folders:
            edited.append(rel)
    return edited


def write_package(out: str | os.PathLike, files: dict[str, str], force: bool = False) -> Path:
    """Write ``files`` as directory ``out`` all at once: into a temporary sibling first, then
    moved into place, so a failure (a full disk, say) never leaves a half-written pipeline
    behind and keeps the one ``out`` held before. Holds ``out``'s lock meanwhile (taken again
    if this process holds it already), so another autopipe writing it is refused."""
    out = Path(out)
    with output_lock(out):
        check_output_dir(out, force)
        existed = out.exists()
        tmp: Path | None = None
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
            umask = os.umask(0)
            os.umask(umask)
            tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the package is to be shared
            for rel, text in sorted(files.items()):
                path = tmp / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text, encoding="utf-8")
            _move_into_place(tmp, out)
        except OSError as exc:
            kept = f"{out} is unchanged" if existed else f"{out} was not created"
            raise write_error(out, exc, kept) from exc
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)  # gone already once moved into place
    return out


def _move_into_place(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out``; a directory ``out`` is moved aside first and deleted only once
    ``tmp`` took its place (put back if that fails)."""
    if not out.exists():
        os.replace(tmp, out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
    try:
        os.replace(out, old / out.name)
    except BaseException:
        old.rmdir()
        raise
    try:
        os.replace(tmp, out)
    except BaseException:
        os.replace(old / out.name, out)
        old.rmdir()
        raise
    shutil.rmtree(old, ignore_errors=True)


def check_output_dir(out: Path, force: bool) -> None:
    """Refuse an ``out`` that writing a package there would lose something in. Allowed: a path
    that does not exist, an empty directory, and with ``force`` a package autopipe generated
    (a valid manifest) holding nothing but its files, its report and Python caches; and not
    while another autopipe process writes it (holds its lock)."""
    check_unlocked(out)
    if out.is_symlink():
        raise OutputExistsError(
            f"{out} is a symbolic link; give the directory it points to, or another path, as --out"
        )
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return
    if not out.is_dir():
        raise OutputExistsError(
            f"{out} exists and is not a directory; autopipe will not replace it, even with "
            "--force. Choose another --out"
        )
    try:
        digests = read_manifest(out)
    except ArtifactError:
        raise OutputExistsError(
            f"{out} already exists and is not a pipeline autopipe generated (no valid {MANIFEST}); "
            "autopipe will not replace it, even with --force. Choose another --out, or empty it "
            "yourself"
        ) from None
    if not force:
        raise OutputExistsError(
            f"{out} already exists; pass --force to replace it (it is replaced only once the new "
            "pipeline is complete)"
        )
    foreign = _foreign_files(out, digests)
    if foreign:
        shown = ", ".join(foreign[:5]) + (
            f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        )
        raise OutputExistsError(
            f"{out} holds files autopipe did not write ({shown}); --force replaces only a "
            f"generated pipeline. Move them out of {out} first"
        )


def _foreign_files(out: Path, digests: dict[str, str]) -> list[str]:
    """Files under ``out`` autopipe did not write: not in its manifest, not its report, not
    Python's caches (symbolic links count as files)."""
    foreign = []
    for folder, dirs, names in os.walk(out):
        here = Path(folder)
        links = [d for d in dirs if (here / d).is_symlink()]
        for name in sorted(names + links):
            rel = (here / name).relative_to(out)
            report = rel.parts[0] == "report" and len(rel.parts) == 2 and rel.suffix in _REPORT
            cache = "__pycache__" in rel.parts and rel.suffix == ".pyc"
            if rel.as_posix() not in digests and str(rel) != MANIFEST and not (report or cache):
                foreign.append(rel.as_posix())
    return sorted(foreign)
