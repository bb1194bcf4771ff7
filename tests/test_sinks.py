"""Metrics where users read them (issue 27, item 2): ``--tensorboard DIR`` writes TensorBoard
event files and ``--wandb PROJECT`` a Weights & Biases run (offline here: no network) holding the
same scalars as ``--log-json`` (loss, eval loss, learning rate, gradient norm, throughput, memory
per rank) and the options and plan as the run's configuration; written by the reporting rank
only; a missing package is refused before anything runs."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from wandb.proto import wandb_internal_pb2

from autopipe.runtime import sinks
from autopipe.runtime.core.pipeline import Pipeline
from autopipe.runtime.metrics import Metrics
from autopipe.runtime.options import parse_config
from autopipe.runtime.sinks import TensorBoardSink
from autopipe.verify import load_pipeline

from conftest import compile_model, run_ranks

STEPS = 3


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sinks") / "pipe"
    compile_model("gpt2", out, 2)
    return out


def tensorboard_scalars(directory: Path) -> dict[str, dict[int, float]]:
    """Every scalar of a TensorBoard run directory: name -> step -> value."""
    events = EventAccumulator(str(directory))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def wandb_records(directory: Path) -> list[wandb_internal_pb2.Record]:
    """The records of the one offline W&B run under ``directory``: its ``.wandb`` file is a
    LevelDB-style log (7-byte header, then 32 KiB blocks of checksummed, typed chunks) of
    protobuf records."""
    (path,) = directory.glob("wandb/offline-run-*/run-*.wandb")
    data, pos, block = path.read_bytes(), 7, 32768
    records, pending = [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            break
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 2):  # whole, first
            pending = chunk
        else:  # middle, last
            pending += chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def wandb_history(records) -> dict[str, dict[int, float]]:
    history: dict[str, dict[int, float]] = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {
                "/".join(i.nested_key) or i.key: json.loads(i.value_json)
                for i in record.history.item
            }
            for name, value in items.items():
                if not name.startswith("_"):
                    history.setdefault(name, {})[items["_step"]] = value
    return history


def wandb_config(records) -> dict[str, object]:
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    return {i.key: json.loads(i.value_json) for i in run.config.update}


@pytest.mark.slow
def test_tensorboard_and_wandb_hold_what_the_json_log_holds(package, tmp_path):
    log, board, wandb_dir = tmp_path / "log.jsonl", tmp_path / "tb", tmp_path / "wb"
    wandb_dir.mkdir()
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir), "WANDB_SILENT": "true"}
    run_ranks(
        package / "train.py", 2, "--steps", str(STEPS), "--log-json", str(log),
        "--eval-data", "tests/models.py:gpt2_eval_batch", "--eval-every", "2",
        "--tensorboard", str(board), "--wandb", "autopipe-test", env=env,
    )  # fmt: skip
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [e for e in entries if "loss" in e]
    evals = [e for e in entries if "eval_loss" in e]
    assert [e["step"] for e in steps] == list(range(STEPS)) and len(evals) == 2

    scalars = tensorboard_scalars(board)
    history = wandb_history(wandb_records(wandb_dir))
    for name, where in (("TensorBoard", scalars), ("W&B", history)):
        for key, tag in (
            ("loss", "train/loss"),
            ("lr", "train/lr"),
            ("grad_norm", "train/grad_norm"),
        ):
            assert where[tag] == pytest.approx({e["step"]: e[key] for e in steps}, rel=1e-6), name
        assert where["eval/loss"] == pytest.approx(
            {e["step"]: e["eval_loss"] for e in evals}, rel=1e-6
        ), name
        assert set(where["train/tokens_per_s"]) == set(range(STEPS)), name
        for rank in range(2):  # every rank's memory, reported by one
            peaks = {e["step"]: e["peak_memory"][rank] / 2**20 for e in steps}
            assert where[f"memory/peak_mib/rank{rank}"] == pytest.approx(peaks, rel=1e-6), name
            held = {e["step"]: e["state_bytes"][rank] / 2**20 for e in steps}
            assert where[f"memory/state_mib/rank{rank}"] == pytest.approx(held, rel=1e-6), name

    config = wandb_config(wandb_records(wandb_dir))
    assert config["plan/stages"] == 2 and config["world_size"] == 2
    assert config["option/steps"] == STEPS and config["option/eval_every"] == 2
    events = EventAccumulator(str(board))
    events.Reload()
    (text,) = events.Tensors("run configuration/text_summary")
    table = text.tensor_proto.string_val[0].decode()
    assert "| plan/stages | 2 |" in table and "| option/tensorboard |" in table


def test_a_resumed_runs_events_replace_the_crashed_attempts(tmp_path):
    """TensorBoard draws each step once after a resume: the events the first attempt wrote
    after the checkpoint (step 2) are purged by the resumed attempt's."""
    first = TensorBoardSink(str(tmp_path), {"plan/stages": 2}, resumed_at=None)
    for step in range(4):
        first.log(step, {"train/loss": float(step)})
    first.close()
    resumed = TensorBoardSink(str(tmp_path), {"plan/stages": 2}, resumed_at=2)
    for step in range(2, 5):
        resumed.log(step, {"train/loss": 10.0 + step})
    resumed.close()
    assert tensorboard_scalars(tmp_path)["train/loss"] == {
        0: 0.0, 1: 1.0, 2: 12.0, 3: 13.0, 4: 14.0
    }  # fmt: skip


def test_a_missing_sink_package_is_refused_before_the_run(package, monkeypatch, capsys):
    pipeline = Pipeline.from_json(load_pipeline(package).PIPELINE)
    real = sinks.importlib.util.find_spec
    monkeypatch.setattr(
        sinks.importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name)
    )
    assert parse_config(["--tensorboard", "tb"], pipeline).tensorboard == "tb"
    with pytest.raises(SystemExit):
        parse_config(["--wandb", "project"], pipeline)
    assert "--wandb needs the wandb package, which is not installed: pip install wandb" in (
        capsys.readouterr().err
    )


def test_sinks_get_the_reporting_ranks_scalars_only(tmp_path):
    """A rank that does not report writes nothing to a sink; the reporting one writes every
    scalar of the step, throughput from the step's tokens, memory per rank in MiB."""
    sink = TensorBoardSink(str(tmp_path), {"plan/stages": 2}, resumed_at=None)
    silent = Metrics(False, 2, 4, None, None, 1, None, sinks=[sink])
    silent.record(1, 1.0, 0.1, 1e-3, 0.5, [1], [1])
    reporting = Metrics(True, 2, 4, 64, None, 1, None, sinks=[sink])
    reporting.record(0, 2.5, 0.1, 1e-3, 0.5, [2**20, 2**21], [2**20, 0])
    reporting.close()
    scalars = tensorboard_scalars(tmp_path)
    assert scalars["train/loss"] == {0: 2.5} and scalars["train/tokens_per_s"] == {0: 640.0}
    assert scalars["memory/peak_mib/rank1"] == {0: 2.0}
    assert torch.isfinite(torch.tensor(scalars["train/step_time"][0]))
