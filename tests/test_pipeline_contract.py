"""The typed pipeline contract (runtime/core/pipeline.py): ``from_json`` / ``to_json`` give back every
generated description exactly, malformed descriptions are refused naming the field, and the facts
derived from a description are the ones the runtime acts on."""

from __future__ import annotations

import ast
import copy
import dataclasses
import hashlib
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from autopipe.artifacts import ARTIFACT_VERSION, dumps
from autopipe.runtime import driver
from autopipe.runtime.core import pipeline as contract
from autopipe.runtime.data import Batches
from autopipe.runtime.options import parse_config, schedule_problem
from autopipe.runtime.core.pipeline import Pipeline, PipelineFormatError, as_pipeline
from autopipe.runtime.train_state import fingerprint
from autopipe.verify import load_pipeline

from conftest import ROOT, compile_model

GALLERY = sorted((ROOT / "generated").glob("*/pipeline.json"))


def _gallery(name: str) -> dict:
    return json.loads((ROOT / "generated" / name / "pipeline.json").read_text())


@pytest.mark.parametrize("path", GALLERY, ids=lambda p: p.parent.name)
def test_round_trip_of_the_gallery(path):
    text = path.read_text()
    pipeline = Pipeline.from_json(json.loads(text))
    assert pipeline.to_json() == json.loads(text)
    assert dumps(pipeline.to_json()) == text  # key order and number types too


@pytest.mark.parametrize(
    "name, stages, options", [("gpt2", 3, {}), ("mlp_with_target", 2, {"loss": "mse"})]
)
def test_round_trip_of_compiled_packages(tmp_path, name, stages, options):
    if "loss" in options:
        options = {"loss": f"tests/models.py:{options['loss']}"}
    compile_model(name, tmp_path / "pipe", stages, **options)
    package = load_pipeline(tmp_path / "pipe")
    pipeline = Pipeline.from_json(package.PIPELINE)
    assert pipeline.to_json() == package.PIPELINE
    assert dumps(pipeline.to_json()) == (tmp_path / "pipe" / "pipeline.json").read_text()
    assert pipeline.loss.needs_target == ("loss" in options)
    if pipeline.loss.needs_target:
        assert pipeline.loss.target.name == "target" and pipeline.loss.module == "loss"
    else:
        assert pipeline.loss.output in pipeline.outputs
    assert (tmp_path / "pipe" / "runtime" / "core" / "pipeline.py").read_text() == Path(
        contract.__file__
    ).read_text()


def test_format_and_version_are_the_artifacts():
    assert contract.FORMAT == "autopipe.pipeline" and contract.VERSION == ARTIFACT_VERSION


def _broken(edit) -> dict:
    data = copy.deepcopy(_gallery("t5_small_6on3"))
    edit(data)
    return data


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda d: d.update(format="autopipe.graph"),
            "pipeline.format must be 'autopipe.pipeline'",
        ),
        (lambda d: d.update(version=99), "pipeline.version must be 1"),
        (lambda d: d.pop("values"), "pipeline.values is missing"),
        (lambda d: d.update(extra=1), "pipeline.extra is not a field"),
        (lambda d: d["stages"][1].pop("device"), "pipeline.stages[1].device is missing"),
        (lambda d: d["stages"][2].update(device="0"), "pipeline.stages[2].device must be a rank"),
        (
            lambda d: d["stages"][0].update(recompute=1),
            "pipeline.stages[0].recompute must be a bool",
        ),
        (lambda d: d["stages"][0]["inputs"].insert(1, 3), "pipeline.stages[0].inputs[1] must be"),
        (
            lambda d: d["stages"][0]["inputs"].insert(1, "nope"),
            "pipeline.stages[0].inputs[1] = 'nope'",
        ),
        (
            lambda d: d["stages"][0].update(data_inputs=["input_ids"]),
            "pipeline.stages[0].data_inputs must be names among the stage's inputs (none for the "
            "first stage)",
        ),
        (
            lambda d: d["stages"][5].update(data_inputs=["input_ids"]),
            "pipeline.stages[5].data_inputs must be names among the stage's inputs",
        ),
        (
            lambda d: d["stages"][5].update(inputs=["labels"], data_inputs=["labels"]),
            "pipeline.stages[5]: receives nothing",
        ),
        (lambda d: d["stages"][1].update(recomputes=[3]), "pipeline.stages[1].recomputes[0]"),
        (lambda d: d.update(stages=[]), "pipeline.stages must be a list of stages"),
        (lambda d: d["values"]["labels"].update(dtype="int65"), "pipeline.values.labels.dtype"),
        (lambda d: d["values"]["labels"].update(shape=[8, -1]), "pipeline.values.labels.shape[1]"),
        (lambda d: d.update(loss={"output": "nope"}), "pipeline.loss.output must be one of"),
        (lambda d: d.update(loss={"module": "loss"}), "pipeline.loss.target is missing"),
        (lambda d: d["schedule"].update(name=1), "pipeline.schedule.name must be a string"),
        (
            lambda d: d["schedule"]["costs"]["forward"].pop(),
            "pipeline.schedule.costs.forward must be a list of 6 numbers",
        ),
        (
            lambda d: d["schedule"]["costs"]["send_forward"].append(0.0),
            "pipeline.schedule.costs.send_forward must be a list of 5 numbers",
        ),
        (
            lambda d: d["schedule"]["costs"].update(memory_capacity=0),
            "pipeline.schedule.costs.memory_capacity must be > 0",
        ),
        (lambda d: d["tied"][0]["holders"].update({"9": "x"}), "pipeline.tied[0].holders"),
        (lambda d: d["aliases"].append("a"), "pipeline.aliases[1] must be a list of strings"),
        (lambda d: d.update(input_ranges={"labels": 1.5}), "pipeline.input_ranges must be"),
        (lambda d: d["stages"][5].update(device=4), "pipeline.stages[*].device must be ranks"),
    ],
)
def test_a_broken_description_is_refused_naming_the_field(edit, message):
    with pytest.raises(PipelineFormatError) as caught:
        Pipeline.from_json(_broken(edit))
    assert message in str(caught.value)


def test_not_an_object():
    with pytest.raises(PipelineFormatError, match="pipeline must be an object, got"):
        Pipeline.from_json([])


def test_typed_objects_are_frozen_and_accepted_where_dicts_are():
    pipeline = Pipeline.from_json(_gallery("gpt2_4"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        pipeline.model = "x"
    with pytest.raises(dataclasses.FrozenInstanceError):
        pipeline.stages[0].rank = 1
    assert as_pipeline(pipeline) is pipeline
    assert as_pipeline(_gallery("gpt2_4")) == pipeline


def test_derived_facts_of_several_stages_per_rank():
    """t5_small_6on3: six stages on three ranks as Mixed-Pipe placed them (looped: stages 0 and
    3 on rank 0); tied embeddings in stages 0, 3 and 5. The same stages placed otherwise, as
    Mixed-Pipe may (stages 0 and 5 on rank 0: the last stage on the first rank), derive their
    ranks from the placement alone."""
    data = _gallery("t5_small_6on3")
    pipeline = Pipeline.from_json(data)
    assert pipeline.num_stages == 6 and pipeline.num_ranks == 3
    assert pipeline.rank_of_stage == [0, 1, 2, 0, 1, 2]
    assert [s.index for s in pipeline.stages_on(0)] == [0, 3]
    assert pipeline.last_rank == 2
    assert pipeline.default_microbatches == 12
    assert pipeline.model_class == "T5ForConditionalGeneration"
    assert pipeline.samples_per_microbatch == 8 and pipeline.tokens_per_sample == 128
    (tie,) = pipeline.tied
    assert list(tie.holders) == [0, 3, 5] and list(tie.later_holders) == [3, 5]
    assert pipeline.tie_ranks(tie) == [0, 2]
    placed = copy.deepcopy(data)
    for stage, rank in zip(placed["stages"], [0, 1, 2, 1, 2, 0]):
        stage["device"] = rank
    other = Pipeline.from_json(placed)
    assert [s.index for s in other.stages_on(0)] == [0, 5] and other.last_rank == 0
    assert other.tie_ranks(other.tied[0]) == [0, 1]
    stage = pipeline.stages[1]
    assert [v.name for v in pipeline.received(stage)] == list(stage.inputs)
    assert [v.name for v in pipeline.returned(stage)] == list(stage.outputs)
    # the first stage takes the ids from the batch; the decoder's first stage (3) reads the
    # labels there (shifted, the decoder's inputs) and the last stage for its loss, neither
    # from the stages before
    assert [v.name for v in pipeline.first_inputs] == ["input_ids"]
    assert pipeline.received(pipeline.stages[0]) == pipeline.first_inputs
    assert [v.name for v in pipeline.data_inputs] == ["input_ids", "labels"]
    readers = [s.index for s in pipeline.stages if s.data_inputs]
    assert readers == [3, 5]
    assert all(pipeline.stages[i].data_inputs == ("labels",) for i in readers)
    for i in readers:
        received = [v.name for v in pipeline.received(pipeline.stages[i])]
        assert "labels" not in received and "labels" in pipeline.stages[i].inputs
    costs = pipeline.pipeline_costs()
    assert costs.device_of_stage == pipeline.rank_of_stage and costs.num_devices == 3
    assert tuple(costs.forward) == pipeline.schedule.costs.forward
    assert costs.memory_capacity == pipeline.schedule.costs.memory_capacity


def test_train_config_defaults_come_from_the_pipeline():
    pipeline = Pipeline.from_json(_gallery("t5_small_6on3"))
    config = parse_config([], pipeline)
    assert config.microbatches == pipeline.default_microbatches
    assert config.schedule == pipeline.schedule.name
    assert config.recompute == pipeline.recomputed
    assert parse_config(["--recompute", "all"], pipeline).recompute == frozenset(range(6))
    assert "ranks [0, 1, 2, 0, 1, 2]" in schedule_problem("1f1b", pipeline, 12)
    batches = Batches(pipeline, parse_config(["--dp", "2", "--accumulate", "3"], pipeline))
    assert batches.samples == 12 * 2 * 3 * pipeline.samples_per_microbatch
    inputs, target = batches(0)
    assert [list(t.shape) for t in inputs] == [
        [12 * 6 * v.shape[0], *v.shape[1:]] for v in pipeline.data_inputs
    ]
    assert target is None  # the loss is a model output


def test_checkpoint_fingerprint_is_unchanged():
    """Checkpoints written before the typed contract still resume: same structure digest."""
    data = _gallery("gpt2_4")
    shape = {
        "inputs": data["inputs"],
        "outputs": data["outputs"],
        "values": data["values"],
        "stages": [{k: s[k] for k in ("inputs", "outputs", "device")} for s in data["stages"]],
    }
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]
    assert fingerprint(Pipeline.from_json(data)) == digest


def test_train_py_refuses_a_broken_description(capsys):
    package = SimpleNamespace(PIPELINE=_broken(lambda d: d["stages"][0].pop("inputs")))
    assert driver.main(package, []) == 2
    assert "pipeline.stages[0].inputs is missing" in capsys.readouterr().err


def test_the_contract_module_is_self_contained():
    """It is copied into packages: torch, the standard library and runtime siblings only."""
    tree = ast.parse(Path(contract.__file__).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            assert node.level == 1
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            for name in names:
                root = name.split(".")[0]
                assert root in ("torch", "__future__") or root in sys.stdlib_module_names
