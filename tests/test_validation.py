"""Validation at every boundary: output directories, options, device specs, artefacts, package
manifests and untraceable models give one clear error, and nothing on disk is lost."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import pytest

import autopipe
from autopipe.cli import main as autopipe_cli
from autopipe.compiler import CompileOptions, partition_step, profile_step, trace_step
from autopipe.errors import AutopipeError, PartitionError, TraceError, WriteError
from autopipe.ir import Graph
from autopipe.partitioning import Partition
from autopipe.profiling.devices import KNOWN_DEVICES
from autopipe.spec import load_example
from autopipe.verify import verify

from conftest import ROOT, compile_model

INJECTION = "__import__('os').system('touch PWNED')"


@pytest.fixture(scope="module")
def artefacts(tmp_path_factory) -> dict:
    """graph.json and partition.json of the 2-stage MLP, as JSON data."""
    spec = f"{ROOT}/tests/models.py:mlp"
    options = CompileOptions(stages=2)
    graph = trace_step(load_example(spec), options, source=spec)
    prof = profile_step(graph, options)
    part = partition_step(graph, prof, options)
    folder = tmp_path_factory.mktemp("artefacts")
    graph.save(folder / "graph.json")
    part.save(folder / "partition.json")
    return {
        name: json.loads((folder / f"{name}.json").read_text()) for name in ("graph", "partition")
    }


def run(capfd, *argv: str) -> tuple[int, str]:
    """``autopipe ARGV`` in process: its exit code and what it printed to stderr."""
    try:
        code = autopipe_cli(list(map(str, argv)))
    except SystemExit as exc:  # argparse
        code = exc.code
    err = capfd.readouterr().err
    assert "Traceback" not in err
    return code, err


def generate(tmp_path, capfd, graph: dict, part: dict, *extra: str) -> tuple[int, str]:
    (tmp_path / "g.json").write_text(json.dumps(graph))
    (tmp_path / "p.json").write_text(json.dumps(part))
    out = tmp_path / "out"
    return run(capfd, "generate", tmp_path / "g.json", tmp_path / "p.json", "--out", out, *extra)


def files(directory) -> dict:
    return {p: p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


# -- output: --force replaces only what autopipe generated; a full disk loses nothing ---------
@pytest.mark.parametrize("command", ["compile", "generate"])
def test_force_refuses_a_directory_autopipe_did_not_write(tmp_path, capfd, artefacts, command):
    out = tmp_path / "out"
    (out / "data").mkdir(parents=True)
    (out / "thesis.tex").write_text("years of work")
    (out / "data" / "results.csv").write_text("1,2,3")
    before = files(out)
    if command == "compile":
        code, err = run(
            capfd, "compile", "tests/models.py:mlp", "--stages", 2, "--out", out, "--force"
        )
    else:
        code, err = generate(tmp_path, capfd, artefacts["graph"], artefacts["partition"], "--force")
    assert code == 1
    assert "not a pipeline autopipe generated" in err and "even with --force" in err
    assert files(out) == before


def test_force_refuses_a_file_and_a_foreign_manifest(tmp_path, capfd):
    target = tmp_path / "notes.txt"
    target.write_text("mine")
    code, err = run(
        capfd, "compile", "tests/models.py:mlp", "--stages", 2, "--out", target, "--force"
    )
    assert code == 1 and "is not a directory" in err and target.read_text() == "mine"
    out = tmp_path / "other"
    out.mkdir()
    (out / "manifest.json").write_text(json.dumps({"format": "npm.manifest", "files": {}}))
    (out / "index.js").write_text("mine")
    code, err = run(capfd, "compile", "tests/models.py:mlp", "--stages", 2, "--out", out, "--force")
    assert code == 1 and "not a pipeline autopipe generated" in err
    assert (out / "index.js").read_text() == "mine"


def test_force_keeps_files_added_to_a_generated_package(tmp_path, capfd):
    out = tmp_path / "pipe"
    compile_model("mlp", out, 2)
    (out / "ckpt").mkdir()
    (out / "ckpt" / "step-10.pt").write_text("weights")
    before = files(out)
    code, err = run(capfd, "compile", "tests/models.py:mlp", "--stages", 3, "--out", out, "--force")
    assert code == 1 and "holds files autopipe did not write (ckpt/step-10.pt)" in err
    assert files(out) == before
    (out / "ckpt" / "step-10.pt").unlink()
    (out / "ckpt").rmdir()
    code, _ = run(capfd, "compile", "tests/models.py:mlp", "--stages", 3, "--out", out, "--force")
    assert (
        code == 0 and (out / "stage2.py").is_file() and (out / "report" / "report.html").is_file()
    )


def test_empty_existing_directory_is_used(tmp_path, capfd):
    out = tmp_path / "empty"
    out.mkdir()
    code, _ = run(
        capfd, "compile", "tests/models.py:mlp", "--stages", 2, "--out", out, "--no-report"
    )
    assert code == 0 and (out / "train.py").is_file()


@pytest.mark.parametrize("existing", [False, True])
def test_full_disk_while_writing_leaves_nothing_partial(tmp_path, capfd, monkeypatch, existing):
    from autopipe.codegen import package

    out = tmp_path / "pipe"
    if existing:
        compile_model("mlp", out, 2)
    before = files(out) if existing else None
    original, calls = package.Path.write_text, []

    def write_text(self, *args, **kwargs):
        calls.append(self)
        if len(calls) == 5:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(package.Path, "write_text", write_text)
    code, err = run(capfd, "compile", "tests/models.py:mlp", "--stages", 3, "--out", out, "--force")
    assert code == 1 and f"no space left on device while writing {out}" in err
    assert ("is unchanged" if existing else "was not created") in err
    assert (files(out) == before) if existing else not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == (["pipe"] if existing else [])


def test_failed_swap_puts_the_previous_package_back(tmp_path, monkeypatch):
    from autopipe.codegen import package

    out = tmp_path / "pipe"
    compile_model("mlp", out, 2)
    before = files(out)
    original, calls = os.replace, []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) == 2:  # moving the new package into place
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return original(src, dst)

    monkeypatch.setattr(package.os, "replace", replace)
    with pytest.raises(WriteError, match="no space left on device"):
        compile_model("mlp", out, 3, force=True)
    monkeypatch.undo()
    assert files(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]


def test_full_disk_while_writing_an_artefact(tmp_path, capfd, monkeypatch):
    from autopipe import artifacts

    target = tmp_path / "graph.json"
    assert run(capfd, "trace", "tests/models.py:mlp", "-o", target)[0] == 0
    before = target.read_bytes()

    def fsync(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(artifacts.os, "fsync", fsync)
    code, err = run(capfd, "trace", "tests/models.py:mlp", "--depth", 1, "-o", target)
    assert code == 1 and f"no space left on device while writing {target}" in err
    assert target.read_bytes() == before and os.listdir(tmp_path) == ["graph.json"]


def test_artefact_output_replaces_only_an_artefact(tmp_path, capfd):
    source = tmp_path / "model.py"
    source.write_text("# my model\n")
    code, err = run(capfd, "trace", "tests/models.py:mlp", "-o", source)
    assert code == 1 and "is not an autopipe.graph artefact; autopipe will not overwrite it" in err
    assert source.read_text() == "# my model\n"


# -- device specs and numeric options --------------------------------------------------------
@pytest.mark.parametrize(
    "change, message",
    [
        ({"flops": {"float32": 0, "default": 0}}, "flops['float32'] must be a finite number"),
        ({"memory": 0}, "memory must be a finite number of bytes > 0, got 0"),
        ({"link_bandwidth": -5e9}, "link_bandwidth must be a finite number of bytes/s > 0"),
        ({"memory_bandwidth": "fast"}, "memory_bandwidth must be a finite number"),
        ({"compute_efficiency": 1.5}, "compute_efficiency must be a fraction in (0, 1]"),
        ({"flops": {"bfloat16": 1e15}}, 'flops needs a "default" or "float32" entry'),
        ({"kernel_overhead": None}, "kernel_overhead must be a finite number of seconds >= 0"),
    ],
)
def test_invalid_device_spec_file(tmp_path, capfd, change, message):
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(KNOWN_DEVICES["h100"].to_json() | change))
    out = tmp_path / "out"
    code, err = run(
        capfd, "compile", "tests/models.py:mlp", "--stages", 2, "--out", out, "--device-spec", path
    )
    assert code == 1 and f"device spec file {path}: {message}" in err
    assert not out.exists()


def test_unknown_device_lists_the_known_ones(capfd, tmp_path):
    """An unknown --device-spec names the closest known one, the table's devices and this
    machine's own (cpu, cuda), before anything is written."""
    out = tmp_path / "out"
    for given, closest in (("h1", "H100"), ("cpuu", "cpu")):
        code, err = run(
            capfd, "compile", "tests/models.py:mlp", "--stages", 2, "--out", out,
            "--device-spec", given,
        )  # fmt: skip
        assert code == 1 and (
            f"unknown device '{given}' (did you mean {closest}?); known devices: H100, "
            "H100-PCIe, " in err
        )
        assert "cpu or cuda for this machine's own (calibrated on first use)" in err
        assert not out.exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--stages", "0"], "argument --stages: must be an integer of at least 1, got '0'"),
        (["--stages", "x"], "argument --stages: must be an integer of at least 1, got 'x'"),
        (["--stages", "2", "--devices", "0"], "argument --devices: must be an integer of at"),
        (["--stages", "2", "--microbatches", "-1"], "argument --microbatches: must be an"),
        (["--stages", "2", "--depth", "-1"], "argument --depth: must be an integer of at least 0"),
        (["--stages", "2", "--link", "0"], "argument --link: '0' is neither a known link"),
        (["--stages", "2", "--link", "-100"], "argument --link: '-100' is neither a known link"),
    ],
)
def test_invalid_numeric_flags_are_usage_errors(tmp_path, capfd, flags, message):
    out = tmp_path / "out"
    code, err = run(capfd, "compile", "tests/models.py:mlp", "--out", out, *flags)
    assert code == 2 and err.startswith("usage: autopipe compile") and message in err
    assert not out.exists()


def test_more_devices_than_stages(tmp_path, capfd):
    out = tmp_path / "out"
    code, err = run(
        capfd, "compile", "tests/models.py:mlp", "--out", out, "--stages", 2, "--devices", 3
    )
    assert code == 1 and "--devices 3 is more than --stages 2" in err and not out.exists()


def test_verify_tolerances(tmp_path, capfd):
    code, err = run(capfd, "verify", tmp_path, "--rtol", "-1")
    assert code == 2 and "argument --rtol: must be a finite number of at least 0" in err
    with pytest.raises(AutopipeError, match="--atol must be a finite number of at least 0"):
        verify(tmp_path, load_example("tests/models.py:mlp"), atol=float("nan"))


@pytest.mark.parametrize(
    "options, message",
    [
        ({"stages": 0}, "--stages must be an integer of at least 1, got 0"),
        ({"stages": 2, "devices": 0}, "--devices must be an integer of at least 1, got 0"),
        ({"stages": 2, "microbatches": 0}, "--microbatches must be an integer of at least 1"),
        ({"stages": 2, "link": 0}, "--link 0 is neither a known link"),
        ({"stages": 2, "method": "magic"}, "--method 'magic' is unknown; choose one of acyclic"),
    ],
)
def test_python_api_validates_options(tmp_path, options, message):
    example = load_example("tests/models.py:mlp")
    with pytest.raises(AutopipeError, match=message):
        autopipe.pipe_model(example.model, example.args, out=tmp_path / "out", **options)
    assert not (tmp_path / "out").exists()


# -- artefacts are data, never code ----------------------------------------------------------
def _first(nodes: list[dict], kind: str) -> dict:
    return next(n for n in nodes if n["kind"] == kind)


def _renamed(graph: dict, old: str, new: str) -> dict:
    """The graph with node ``old`` renamed to ``new`` everywhere it is referenced."""
    text = json.dumps(graph).replace(f'"{old}"', json.dumps(new))
    return json.loads(text)


@pytest.mark.parametrize(
    "corrupt, field",
    [
        (lambda g: _renamed(g, "tanh", f"x; {INJECTION}"), 'nodes[16] ("x; __import__'),
        (lambda g: _renamed(g, "x", INJECTION), "signature is [\"__import__('os')"),
        (lambda g: _renamed(g, "tanh", "self"), "nodes[16] ('self').name"),
        (lambda g: _first(g["nodes"], "call").update(target=f"aten.linear.{INJECTION}"), ".target"),
        (lambda g: _first(g["nodes"], "call").update(target="os.system.default"), ".target"),
        (lambda g: g["params"][0].update(requires_grad=INJECTION), "requires_grad"),
        (lambda g: g["params"][0].update(names=[f'w"); {INJECTION}; ("']), "names"),
        (lambda g: g["params"][0].update(shape=[f"16); {INJECTION}; ("]), "shape"),
        (lambda g: g["model"].update({"class": f'M"""\n{INJECTION}\n"""'}), "model.class"),
        (lambda g: g["scopes"][0][0].__setitem__(2, f"Linear\n{INJECTION}"), "scope"),
        (lambda g: g["scopes"][0][0].__setitem__(1, "layers.0\nimport os"), "scope"),
        (lambda g: _first(g["nodes"], "call").update(kwargs={f"x={INJECTION}, y": 1}), "kwargs"),
        (lambda g: _first(g["nodes"], "call").update(args=[]), "the arguments of aten.linear"),
        (lambda g: g["units"][0].update(label="Linear\nimport os"), "units[0].label"),
        (lambda g: g["nodes"][-1].update(unit=99), ".unit is 99"),
        (lambda g: g["outputs"].append("nowhere"), "outputs is 'nowhere'"),
    ],
)
def test_crafted_graph_is_rejected(tmp_path, capfd, artefacts, corrupt, field):
    graph = json.loads(json.dumps(artefacts["graph"]))
    graph = corrupt(graph) or graph
    code, err = generate(tmp_path, capfd, graph, artefacts["partition"])
    assert code == 1 and "the graph artefact is invalid" in err and field in err, err
    assert "write it again with `autopipe trace`" in err
    assert not (tmp_path / "out").exists() and not (ROOT / "PWNED").exists()


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (
            lambda g: _first(g["nodes"], "call")["args"].__setitem__(0, 1.5),
            "node linear (aten.linear.default) cannot run on the values the graph records",
        ),
        (
            lambda g: g["nodes"][0]["meta"].update(shape=[16, 17], stride=[17, 1]),
            "node linear (aten.linear.default) cannot run",
        ),
        (
            lambda g: _first(g["nodes"], "call")["meta"].update(requires_grad=False),
            "node linear (aten.linear.default) produces ([4, 16], 'float32', True), but the graph "
            "records ([4, 16], 'float32', False)",
        ),
    ],
)
@pytest.mark.parametrize("command", ["profile", "partition", "generate"])
def test_inconsistent_graph_is_rejected(tmp_path, capfd, artefacts, corrupt, message, command):
    """A graph whose operators would fail, or compute other shapes or autograd flags than it
    records, is refused by every step that reads it (and never trains silently wrong)."""
    graph = json.loads(json.dumps(artefacts["graph"]))
    corrupt(graph)
    g, p, out = tmp_path / "g.json", tmp_path / "p.json", tmp_path / "out"
    g.write_text(json.dumps(graph))
    p.write_text(json.dumps(artefacts["partition"]))
    argv = {
        "profile": [g, "-o", out],
        "partition": [g, p, "--stages", 2, "-o", out],  # the graph is read first
        "generate": [g, p, "--out", out],
    }[command]
    code, err = run(capfd, command, *argv)
    assert code == 1 and message in err and "write it again with `autopipe trace`" in err, err
    assert not out.exists()


def test_inconsistent_graph_prints_no_traceback(tmp_path, artefacts):
    """torch logs a traceback when an operator fails on fake tensors; the command line shows
    only autopipe's message (a separate process, as a user runs it)."""
    graph = json.loads(json.dumps(artefacts["graph"]))
    graph["nodes"][0]["meta"].update(shape=[16, 17], stride=[17, 1])
    (tmp_path / "g.json").write_text(json.dumps(graph))
    command = [sys.executable, "-m", "autopipe", "profile", "g.json", "-o", "p.json"]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith(
        "autopipe profile: error: g.json: the graph artefact is invalid"
    )
    assert os.listdir(tmp_path) == ["g.json"]


def _manifest(package) -> dict:
    return json.loads((package / "manifest.json").read_text())


@pytest.mark.parametrize("path", ["../outside.txt", "/etc/hostname", "runtime/../../outside.txt"])
def test_manifest_paths_stay_inside_the_package(tmp_path, capfd, path):
    package = tmp_path / "pipe"
    compile_model("mlp", package, 2)
    (tmp_path / "outside.txt").write_text("not yours")
    manifest = _manifest(package)
    manifest["files"][path] = "0" * 64
    (package / "manifest.json").write_text(json.dumps(manifest))
    code, err = run(capfd, "verify", package)
    assert code == 1 and f"lists {path!r}, which is not a file inside" in err


def test_manifest_symlink_out_of_the_package(tmp_path, capfd):
    package = tmp_path / "pipe"
    compile_model("mlp", package, 2)
    (tmp_path / "secret.txt").write_text("not yours")
    (package / "stage1.py").unlink()
    (package / "stage1.py").symlink_to(tmp_path / "secret.txt")
    code, err = run(capfd, "verify", package)
    assert code == 1 and "lists 'stage1.py', which is not a file inside" in err
    code, err = run(
        capfd, "compile", "tests/models.py:mlp", "--stages", 2, "--out", package, "--force"
    )
    assert code == 1 and (tmp_path / "secret.txt").read_text() == "not yours"


# -- partitions name only stages and devices that exist --------------------------------------
@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"device_of_stage": [0, 5]},
            "device_of_stage[1] is 5, which is not one of the partition's 2 device ranks",
        ),
        (
            {"device_of_stage": [0, -1]},
            "device_of_stage is [0, -1], which is not a list of integers",
        ),
        ({"device_of_stage": [0, 1.5]}, "device_of_stage is [0, 1.5]"),
        ({"device_of_stage": [0, "1"]}, "device_of_stage is [0, '1']"),
        ({"device_of_stage": [0, True]}, "device_of_stage is [0, True]"),
        ({"device_of_stage": []}, "device_of_stage is [], which is not a list of 1 or more ranks"),
        (
            {"stage_of_unit": [0] * 13 + [7]},
            "stage_of_unit[13] is 7, which is not a stage of the partition's 2",
        ),
        ({"stage_of_unit": [0] * 14}, "stage_of_unit leaves stage(s) [1] without units"),
        ({"recompute": [3]}, "recompute is [3]"),
        (
            {"settings": {"schedule": "1f1b"}, "device_of_stage": [1, 0]},
            "a placement the 1f1b schedule runs",
        ),
        ({"settings": {"microbatches": 0}}, "settings.microbatches is 0"),
        ({"costs": {"forward": [1.0]}}, "the per-stage costs"),
    ],
)
def test_invalid_partition_is_rejected(tmp_path, capfd, artefacts, change, message):
    part = artefacts["partition"] | change
    code, err = generate(tmp_path, capfd, artefacts["graph"], part)
    assert code == 1 and "the partition artefact is invalid" in err and message in err, err
    assert not (tmp_path / "out").exists()


def test_partition_with_a_stage_cycle_is_rejected(tmp_path, capfd, artefacts):
    stages = artefacts["partition"]["stage_of_unit"]
    part = artefacts["partition"] | {"stage_of_unit": [1 - s for s in stages]}
    code, err = generate(tmp_path, capfd, artefacts["graph"], part)
    assert code == 1 and "the stages would form a cycle" in err
    assert not (tmp_path / "out").exists()
    with pytest.raises(PartitionError, match="would form a cycle"):
        Partition.from_json(part).check_graph(Graph.from_json(artefacts["graph"]))


# -- data-dependent operators name the user's line -------------------------------------------
@pytest.mark.parametrize(
    "body, code",
    [
        ("return h.sum() + h.nonzero().sum()", "return h.sum() + h.nonzero().sum()"),
        ("return h[h > 0].sum()", "return h[h > 0].sum()"),
        (
            "n = int((h > 0).sum().item())\n        return h[:n].sum()",
            "n = int((h > 0).sum().item())",
        ),
    ],
)
def test_data_dependent_operators_name_the_line(tmp_path, capfd, body, code):
    """Built on meta there are no values to specialise a size to: the error names the line
    (with real weights the model compiles, tests/test_specialised.py)."""
    module = tmp_path / "dynamic.py"
    module.write_text(
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.a = torch.nn.Linear(4, 4)\n"
        "    def forward(self, x):\n"
        "        h = self.a(x)\n"
        f"        {body}\n"
        "def build():\n"
        "    with torch.device('meta'):\n"
        "        return M(), (torch.randn(3, 4),)\n"
    )
    exit_code, err = run(
        capfd, "compile", f"{module}:build", "--stages", 1, "--out", tmp_path / "o"
    )
    assert exit_code == 1 and f"dynamic.py:8:\n    {code}" in err and "data-dependent" in err
    assert "torch.where" in err and "def forward" not in err  # no partial graph dump
    assert not (tmp_path / "o").exists()
    with pytest.raises(TraceError, match="dynamic.py:8"):
        trace_step(load_example(f"{module}:build"), CompileOptions(stages=1))
