"""Survey the architecture zoo: which models autopipe compiles and reproduces today.

    OMP_NUM_THREADS=1 python tests/zoo/survey.py [NAME ...] [--timeout S] [--stages K]
                                                  [--json FILE] [--log-dir DIR]

For each architecture (all of ``tests/zoo/models.py:ZOO`` by default), in a fresh subprocess with
a timeout:

(a) builds the model and runs forward and backward of its loss in plain PyTorch;
(b) compiles it with ``compile_spec("tests/zoo/models.py:NAME", out, CompileOptions(stages=K))``
    and runs ``verify(out, load_example(spec), rtol=1e-4, atol=1e-5)``, then ``verify`` again on
    a fresh microbatch (``NAME_batch(7, microbatches=1)``: the graph is specialised to the example);
(c) runs the package's stages forward and backward in a fresh process that imports only torch,
    autopipe and the package, as train.py does (custom operators must still resolve).

It prints one line per architecture: the times of (a), compile and verify, and either ``ok`` or
the phase and first line of the error, or the comparisons that failed with their max |diff|, for
gradients also relative to the model's largest gradient magnitude (gradients that are zero in exact
arithmetic, e.g. of a bias right before a normalisation, differ by float noise). The full traceback
of each failure is written to ``--log-dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODELS = "tests/zoo/models.py"
MARKER = "SURVEY-RESULT "
RTOL, ATOL = 1e-4, 1e-5
GRAD_FLOOR = 1e-5  # of the largest gradient magnitude: a gradient diff below it is float noise


def spec(name: str) -> str:
    return f"{MODELS}:{name}"


def largest_grad(model) -> float:
    """The largest gradient magnitude of the model's parameters (after a backward)."""
    return max(
        (float(p.grad.abs().max()) for p in model.parameters() if p.grad is not None),
        default=0.0,
    )


def judge(report, gmax: float) -> dict:
    """verify's comparisons judged as the zoo does: outputs and buffers within rtol/atol,
    gradients within rtol/atol or below GRAD_FLOOR x the largest gradient."""
    floor = GRAD_FLOOR * gmax
    bad = []
    for c in report.comparisons:
        ok = c.ok or (c.kind == "grad" and c.max_abs <= floor)
        if not ok:
            rel = c.max_abs / gmax if c.kind == "grad" and gmax else None
            bad.append({"kind": c.kind, "name": c.name, "max_abs": c.max_abs, "rel": rel})
    worst_grad = report.worst("grad")
    return {
        "ok": not bad and not report.edited,
        "edited": report.edited,
        "bad": bad,
        "strict_failures": sum(not c.ok for c in report.comparisons),
        "compared": {
            k: sum(c.kind == k for c in report.comparisons) for k in ("output", "grad", "buffer")
        },
        "worst_output": report.worst("output"),
        "worst_grad": worst_grad,
        "worst_grad_rel": worst_grad / gmax if gmax else None,
        "max_grad": gmax,
    }


def fresh_example(name: str, model):
    """The model on a microbatch its example was not: ``NAME_batch(7, microbatches=1)``."""
    from autopipe.spec import Example, load_function

    args, kwargs = load_function(f"{MODELS}:{name}_batch", "data spec")(7, microbatches=1)
    return Example(model, tuple(args), dict(kwargs))


def save_standalone_inputs(example, path: Path) -> Path:
    """The model's state, the example microbatch and the model's outputs on it, for
    :func:`standalone_checks`."""
    import torch
    from torch.utils import _pytree as pytree

    torch.manual_seed(0)
    output = example.model(*example.args, **example.kwargs)
    expected = [t.detach() for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
    state = {k: v.detach().clone() for k, v in example.model.state_dict().items()}
    torch.save((state, example.args, example.kwargs, expected), path)
    return path


def standalone_checks(cases: list[tuple[Path, Path]]) -> list[str]:
    """Run each package's stages forward and backward on its saved inputs
    (:func:`save_standalone_inputs`) in one fresh process that imports only torch, autopipe and
    the packages, as train.py does: ``ok`` or the error's last line, for each."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    command = [sys.executable, __file__, "--standalone", *[str(p) for case in cases for p in case]]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(MARKER):
            return json.loads(line[len(MARKER) :])
    tail = proc.stderr.strip().splitlines()
    return [f"exit {proc.returncode}: {tail[-1] if tail else ''}"] * len(cases)


def _run_standalone(package_dir: str, inputs: str) -> str:
    """In the --standalone process: one package's stages forward and backward."""
    import torch

    from autopipe.runtime.core.pipeline import Pipeline
    from autopipe.runtime.support import stage_state
    from autopipe.verify import load_pipeline

    try:
        package = load_pipeline(package_dir)
        pipeline = Pipeline.from_json(package.PIPELINE)
        state, args, kwargs, expected = torch.load(inputs, weights_only=True)
        env = dict(zip(pipeline.signature, args)) | dict(kwargs)
        torch.manual_seed(0)  # the dropout masks of save_standalone_inputs' forward
        for spec in pipeline.stages:
            stage = package.build_stage(spec.index, device="cpu", init=False)
            stage.load_state_dict(stage_state(stage, state, pipeline.aliases))
            stage.train()
            values = [env[n].detach() for n in spec.inputs]
            for meta, value in zip(pipeline.taken(spec), values):
                value.requires_grad_(meta.requires_grad and value.is_floating_point())
            env.update(zip(spec.outputs, stage(*values)))
        actual = [env[n] for n in pipeline.outputs]
        for i, (a, e) in enumerate(zip(actual, expected)):
            if not torch.allclose(a.detach().double(), e.double(), rtol=RTOL, atol=ATOL):
                return f"output {pipeline.outputs[i]} differs from the model's"
        sum(a.float().sum() for a in actual if a.requires_grad).backward()
        return "ok"
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        return _error(exc)


def _location(exc: BaseException) -> str:
    """Where an exception comes from: the deepest autopipe frame and the deepest frame."""
    frames = traceback.extract_tb(exc.__traceback__)
    inner = exc
    while inner.__cause__ is not None or inner.__context__ is not None:
        inner = inner.__cause__ or inner.__context__
        frames += traceback.extract_tb(inner.__traceback__)
    ours = [f for f in frames if "/autopipe/" in f.filename]
    parts = []
    for label, group in (("autopipe", ours), ("raised", frames)):
        if group:
            f = group[-1]
            path = f.filename
            for anchor in ("/autopipe/", "/site-packages/"):
                if anchor in path:
                    path = path[path.index(anchor) + 1 :]
                    break
            parts.append(f"{label} {path}:{f.lineno} in {f.name}")
    return "; ".join(parts)


def _error(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def survey_one(name: str, stages: int, log_dir: Path) -> dict:
    """Both checks of one architecture, in this process."""
    import torch

    from autopipe.compiler import CompileOptions, compile_spec
    from autopipe.report.progress import QUIET, Phases
    from autopipe.spec import load_example
    from autopipe.verify import verify

    torch.set_num_threads(1)
    result: dict = {"name": name}
    phase = "build"

    class Tracked(Phases):
        def phase(self, which):
            nonlocal phase
            phase = which
            return super().phase(which)

    try:
        start = time.perf_counter()
        example = load_example(spec(name))
        phase = "plain forward"
        out = example.model(*example.args, **example.kwargs)
        loss = out.loss if getattr(out, "loss", None) is not None else None
        if loss is None:
            raise RuntimeError(f"{type(out).__name__} has no loss")
        phase = "plain backward"
        loss.backward()
        result["plain_s"] = time.perf_counter() - start
        result["loss"] = float(loss)
        result["params"] = sum(p.numel() for p in example.model.parameters())

        with tempfile.TemporaryDirectory() as tmp:
            pipe = Path(tmp) / "pipe"
            start = time.perf_counter()
            phases = Tracked(QUIET)
            compiled = compile_spec(
                spec(name), pipe, CompileOptions(stages=stages), report=False, phases=phases
            )
            result["compile_s"] = time.perf_counter() - start
            result["phases_s"] = dict(compiled.timings)
            result["operators"] = len(compiled.graph.calls)
            result["units"] = len(compiled.graph.units)
            phase = "verify"
            start = time.perf_counter()
            example = load_example(spec(name))
            report = verify(pipe, example, rtol=RTOL, atol=ATOL)
            result["verify_s"] = time.perf_counter() - start
            result.update(judge(report, largest_grad(example.model)))
            # the graph is specialised to the example: a fresh microbatch (other routing, other
            # values) must still match, or the pipeline would train on a frozen branch
            phase = "verify (fresh microbatch)"
            fresh = fresh_example(name, load_example(spec(name)).model)
            report = verify(pipe, fresh, rtol=RTOL, atol=ATOL)
            result["fresh"] = judge(report, largest_grad(fresh.model))
            result["ok"] = result["ok"] and result["fresh"]["ok"]
            result["status"] = "ok" if result["ok"] else "mismatch"
            # train.py imports only the package (and the data module): its stages must run
            # without the model's libraries, which register custom operators, imported
            phase = "standalone stages"
            start = time.perf_counter()
            inputs = save_standalone_inputs(load_example(spec(name)), Path(tmp) / "inputs.pt")
            [result["standalone"]] = standalone_checks([(pipe, inputs)])
            result["standalone_s"] = time.perf_counter() - start
            if result["standalone"] != "ok" and result["status"] == "ok":
                result["status"] = "standalone"
    except Exception as exc:  # noqa: BLE001 - the survey reports every failure
        result["status"] = "error"
        result["phase"] = phase
        result["error"] = _error(exc)
        result["where"] = _location(exc)
        log_dir.mkdir(parents=True, exist_ok=True)
        (log_dir / f"{name}.txt").write_text("".join(traceback.format_exception(exc)))
    return result


def describe(r: dict) -> str:
    status = r["status"]
    if status == "ok":
        fresh = r["fresh"]
        rel = max(r.get("worst_grad_rel") or 0.0, fresh.get("worst_grad_rel") or 0.0)
        text = (
            f"ok (worst output diff {max(r['worst_output'], fresh['worst_output']):.2g}, "
            f"grad {max(r['worst_grad'], fresh['worst_grad']):.2g} = {rel:.2g} of max|grad|)"
        )
        strict = r["strict_failures"] + fresh["strict_failures"]
        if strict:
            text += f"; {strict} grads only within the {GRAD_FLOOR:g} x max|grad| floor"
        return text
    if status == "mismatch":
        text = _mismatch(r, "example") if r["bad"] or r["edited"] else ""
        if r.get("fresh") and not r["fresh"]["ok"]:
            text += ("; " if text else "") + _mismatch(r["fresh"], "fresh microbatch")
        return text
    if status == "standalone":
        return f"STANDALONE stages fail (verify ok): {r['standalone']}"
    if status == "timeout":
        return f"TIMEOUT after {r['wall_s']:.0f} s"
    if status == "error":
        return f"FAIL in {r['phase']}: {r['error']} [{r.get('where', '')}]"
    return f"CRASH: {r.get('error', '')}"


def _mismatch(r: dict, what: str) -> str:
    if r["edited"]:
        return f"{what}: files edited since generation: {r['edited']}"
    items = []
    for b in r["bad"][:6]:
        rel = f" = {b['rel']:.2g} of max|grad|" if b["rel"] is not None else ""
        items.append(f"{b['kind']} {b['name']} {b['max_abs']:.3g}{rel}")
    more = f" (+{len(r['bad']) - 6} more)" if len(r["bad"]) > 6 else ""
    return (
        f"MISMATCH on the {what}, {len(r['bad'])} of {sum(r['compared'].values())} "
        f"(max|grad| {r['max_grad']:.3g}): " + "; ".join(items) + more
    )


def run_child(name: str, args) -> dict:
    command = [
        sys.executable,
        __file__,
        "--child",
        name,
        "--stages",
        str(args.stages),
        "--log-dir",
        str(args.log_dir),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout
        )
    except subprocess.TimeoutExpired:
        return {"name": name, "status": "timeout", "wall_s": time.perf_counter() - start}
    wall = time.perf_counter() - start
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(MARKER):
            result = json.loads(line[len(MARKER) :])
            result["wall_s"] = wall
            return result
    tail = (proc.stderr or proc.stdout).strip().splitlines()
    return {
        "name": name,
        "status": "crash",
        "wall_s": wall,
        "error": f"exit {proc.returncode}: {tail[-1] if tail else ''}",
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="architectures (default: all of ZOO)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per architecture")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    parser.add_argument(
        "--log-dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "autopipe-zoo-survey",
        help="full tracebacks of failures",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--standalone", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.standalone:
        pairs = zip(args.names[0::2], args.names[1::2])
        print(MARKER + json.dumps([_run_standalone(p, i) for p, i in pairs]), flush=True)
        return 0

    if args.child:
        os.chdir(ROOT)
        result = survey_one(args.child, args.stages, args.log_dir)
        print(MARKER + json.dumps(result), flush=True)
        return 0

    sys.path.insert(0, str(ROOT / "tests"))
    from zoo.models import FAMILIES, ZOO

    names = args.names or list(ZOO)
    unknown = [n for n in names if n not in ZOO]
    if unknown:
        parser.error(f"unknown architectures {unknown}; known: {', '.join(ZOO)}")
    print(
        f"{'architecture':<12} {'family':<15} {'plain':>6} {'compile':>8} {'verify':>7} {'wall':>6}  result"
    )
    results = []
    for name in names:
        r = run_child(name, args)
        results.append(r)

        def secs(key):
            return f"{r[key]:.1f}" if key in r else "-"

        print(
            f"{name:<12} {FAMILIES[name]:<15} {secs('plain_s'):>6} {secs('compile_s'):>8} "
            f"{secs('verify_s'):>7} {secs('wall_s'):>6}  {describe(r)}",
            flush=True,
        )
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
    ok = sum(r["status"] == "ok" for r in results)
    print(f"{ok} of {len(results)} ok; tracebacks in {args.log_dir}")
    return 0 if ok == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
