"""``autopipe replan PKG --from-trace TRACE_DIR --out NEWPKG`` (issue 28, item 4): the profile
rebuilt from a traced run's stage times, the package partitioned again under it, both splits'
predicted steps printed, and a new package written only for a shorter one, whose checkpoints
continue the old run's.

The slow tests run one model end to end on local gloo ranks, with rank 1's stage forwards made
ten times slower on purpose (``tests/slowed_train.py``): replanning from that run's trace moves
units off rank 1, predicts a shorter step, and measures one; the replanned package resumes the
old run's checkpoint with the losses the old package gets. The fast tests build traces of their
own (``rankR.json`` files) for the same compiled package.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import shutil
import statistics
from dataclasses import dataclass
from pathlib import Path

import pytest

from autopipe.cli import main
from autopipe.compiler import load_graph
from autopipe.errors import ArtifactError, OutputExistsError
from autopipe.partitioning import Partition
from autopipe.profiling import Profile
from autopipe.replan import NoGainError, replan, replan_text, traced_profile, write_replan
from autopipe.report.run_trace import RunTrace
from autopipe.runtime.core.pipeline import Pipeline
from autopipe.runtime.core.timeline_format import RankTimeline, Record, RunLayout
from autopipe.verify import check_files

from conftest import ROOT, compile_model, run_ranks, run_ranks_together

MODEL = "block_stack_with_target"  # 16 identical blocks: boundaries move block by block
SLOWED = {"SLOWED_RANK": "1", "SLOWED_FACTOR": "10"}  # rank 1's forwards 10x slower
STEPS = 4  # steps of the traced run (checkpoints after steps 2 and 4)
MORE = 3  # steps each package adds when resuming its checkpoint
#: microbatches of the runs (the old package's default is 4; the new one's, the traced run's)
MICROBATCHES = 8


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> Path:
    """The model compiled into 2 stages (analytic profile: the same split on every machine)."""
    out = tmp_path_factory.mktemp("replan") / "old"
    compile_model(MODEL, out, 2, loss="tests/models.py:mse", basic_blocks=("Residual",))
    return out


def _slowed_run(package: Path, *args: str) -> None:
    """The package's train.py on 2 gloo ranks, rank 1 slowed."""
    env = {**SLOWED, "SLOWED_PACKAGE": str(package)}
    run_ranks(ROOT / "tests" / "slowed_train.py", 2, *args, env=env)


@dataclass(frozen=True)
class Runs:
    old: Path
    new: Path
    printed: str  # what autopipe replan printed
    trace: Path  # the old package's traced run, which replan read
    #: (step, loss) of each package's run resumed from that run's last checkpoint (not slowed)
    old_losses: list[tuple[int, float]]
    new_losses: list[tuple[int, float]]


def _losses(path: Path) -> list[tuple[int, float]]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [(line["step"], line["loss"]) for line in lines if "loss" in line]


@pytest.fixture(scope="module")
def runs(package: Path, tmp_path_factory) -> Runs:
    """The slowed run of the old package (traced, checkpointed), ``autopipe replan`` from its
    trace, and both packages resumed from copies of its checkpoint directory."""
    root = tmp_path_factory.mktemp("runs")
    trace, checkpoints = root / "trace", root / "checkpoints"
    _slowed_run(
        package,
        *("--steps", str(STEPS), "--microbatches", str(MICROBATCHES)),
        *("--trace", str(trace), "--trace-steps", f"1:{STEPS}"),
        *("--checkpoint-dir", str(checkpoints), "--checkpoint-every", "2"),
    )
    new = root / "new"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["replan", str(package), "--from-trace", str(trace), "--out", str(new)])
    assert code == 0, printed.getvalue()
    resumes = []
    for name, pipeline, options in (
        ("old", package, ("--microbatches", str(MICROBATCHES))),
        ("new", new, ()),  # the traced run's microbatches are the new package's default
    ):
        copy = root / f"checkpoints-{name}"
        shutil.copytree(checkpoints, copy)
        resumes.append((pipeline / "train.py", 2, [
            *options, "--steps", str(STEPS + MORE), "--checkpoint-dir", str(copy), "--resume",
            "--log-json", str(root / f"{name}.jsonl"),
        ]))  # fmt: skip
    run_ranks_together(*resumes)  # both resumed at once: neither is slowed
    resumed = {name: _losses(root / f"{name}.jsonl") for name in ("old", "new")}
    return Runs(package, new, printed.getvalue(), trace, resumed["old"], resumed["new"])


def _units(part: Partition, stage: int) -> list[int]:
    return [u for u, s in enumerate(part.stage_of_unit) if s == stage]


# -- a real run, slowed on rank 1 ---------------------------------------------------------------
@pytest.mark.slow
def test_replan_moves_work_off_the_slowed_rank_and_predicts_a_shorter_step(runs):
    old = Partition.load(runs.old / "artifacts" / "partition.json")
    new = Partition.load(runs.new / "artifacts" / "partition.json")
    assert len(_units(new, 1)) < len(_units(old, 1))  # units moved off rank 1's stage
    assert new.device_of_stage == old.device_of_stage == [0, 1]
    assert (new.settings.schedule, new.settings.microbatches) == ("1f1b", MICROBATCHES)
    plan = replan(runs.old, runs.trace)  # what the command printed, in figures
    assert plan.new.stage_of_unit == new.stage_of_unit
    assert plan.new_step < 0.9 * plan.old_step and plan.moved
    assert f"{plan.gain:.1%} shorter" in runs.printed
    assert f"wrote 2-stage pipeline to {runs.new}" in runs.printed
    # the measured profile: rank 1's forward measured ~10x what rank 0's units take per unit
    prof = Profile.load(runs.new / "artifacts" / "profile.json")
    assert prof.mode == "traced" and str(runs.trace) in prof.source
    stage0, stage1 = (_units(old, s) for s in (0, 1))
    package_profile = Profile.load(runs.old / "artifacts" / "profile.json")
    rate = [
        sum(prof.units[u].forward for u in units)
        / sum(package_profile.units[u].forward for u in units)
        for units in (stage0, stage1)
    ]
    assert rate[1] > 4 * rate[0]
    assert (runs.new / "report" / "report.html").is_file()  # written as compile writes it
    assert check_files(runs.new) == []


# How much shorter the replanned package's step measures is benchmarks/replan.py's to say: a
# timing, not a test's assertion.


@pytest.mark.slow
def test_replanned_package_resumes_the_old_checkpoint_with_equal_losses(runs):
    steps = list(range(STEPS, STEPS + MORE))
    assert [step for step, _ in runs.old_losses] == steps
    # bitwise: the same operators on the same weights and batches, in other stages
    assert runs.new_losses == runs.old_losses


# -- traces written here ------------------------------------------------------------------------
def _trace(
    directory: Path,
    part: Partition,
    prof: Profile,
    forward: tuple[float, ...],
    backward: tuple[float, ...],
    microbatches: int = 4,
    package: Path | None = None,
    bf16: bool = False,
) -> Path:
    """A 2-step trace of ``part`` whose stages take ``forward`` / ``backward`` times the
    profile's stage sums per microbatch (one stage per rank, 1F1B's actions in turn), as a run
    of ``package`` (of another package without one)."""
    directory.mkdir(parents=True)
    digest = _digest(package) if package else "another package"
    run = RunLayout(digest, "1f1b", microbatches, 1, part.num_stages, part.num_stages, 1, bf16=bf16)
    for stage in range(part.num_stages):
        units = _units(part, stage)
        times = [
            round(scale * sum(getattr(prof.units[u], kind) for u in units) * 1e9)
            for kind, scale in (("forward", forward[stage]), ("backward", backward[stage]))
        ]
        records, now = [], 0
        for step in (1, 2):
            start = now
            for m in range(microbatches):
                for kind, took in zip(("forward", "backward"), times):
                    records.append(Record(step, kind, stage, m, now, now + took))
                    now += took
            records.insert(
                len(records) - 2 * microbatches, Record(step, "step", None, None, start, now)
            )
        timeline = RankTimeline(stage, stage, 0, (stage,), "cpu", run, 0, (1, 3), tuple(records))
        (directory / f"rank{stage}.json").write_text(timeline.to_json())
    return directory


def _digest(package: Path) -> str:
    return Pipeline.from_json(json.loads((package / "pipeline.json").read_text())).digest()


def _loaded(package: Path) -> tuple[Partition, Profile]:
    artifacts = package / "artifacts"
    return Partition.load(artifacts / "partition.json"), Profile.load(artifacts / "profile.json")


def test_traced_profile_scales_each_stage_forward_and_backward_apart(package, tmp_path):
    part, prof = _loaded(package)
    # whole nanoseconds: times agree to 1e-4 of the profile's
    trace = RunTrace.load(
        _trace(tmp_path / "trace", part, prof, (2.0, 1.5), (3.0, 4.0), package=package)
    )
    graph = load_graph(package / "artifacts" / "graph.json")
    traced = traced_profile(graph, part, prof, trace)
    for stage, (forward, backward) in enumerate(((2.0, 3.0), (1.5, 4.0))):
        for u in _units(part, stage):
            assert traced.units[u].forward == pytest.approx(
                prof.units[u].forward * forward, rel=1e-4
            )
            assert traced.units[u].backward == pytest.approx(
                prof.units[u].backward * backward, rel=1e-4
            )
            same = {
                k: v for k, v in vars(prof.units[u]).items() if k not in ("forward", "backward")
            }
            assert same == {k: vars(traced.units[u])[k] for k in same}  # memory, FLOPs as they were
    assert traced.mode == "traced" and traced.device == prof.device
    assert traced.source == (
        f"measured in the run traced in {trace.directory} (steps 1-2 on 2 cpu ranks), memory and "
        f"link of {prof.device.name}"
    )
    traced.save(tmp_path / "profile.json")  # the artefact's strict reading takes it back
    assert Profile.load(tmp_path / "profile.json") == traced
    # a stage the run recomputed (train.py --recompute 1): its measured backward holds its
    # forward again, and that part is left out
    recomputed = dataclasses.replace(
        trace,
        timelines=tuple(
            dataclasses.replace(t, run=dataclasses.replace(t.run, recompute=(1,)))
            for t in trace.timelines
        ),
    )
    rerun = traced_profile(graph, part, prof, recomputed)
    stage1 = _units(part, 1)
    measured = trace.stage_times[1]
    assert sum(rerun.units[u].backward for u in stage1) == pytest.approx(
        measured.backward - measured.forward
    )
    # what the run's backwards spent adding gradients into the step's is taken off them (the
    # cost model adds it back for the layout it plans)
    added = [1e-6 * (u % 3) for u in range(len(prof.units))]
    less = traced_profile(graph, part, prof, trace, added=added)
    for stage in range(part.num_stages):
        mine = _units(part, stage)
        assert sum(less.units[u].backward for u in mine) == pytest.approx(
            trace.stage_times[stage].backward - sum(added[u] for u in mine)
        )
    # a bf16 run under FSDP2 cast no weights in its stages' forwards: the measured forward is
    # spread over the units' forwards without their casts, which then go back on (the cost
    # model takes them off again for a sharded layout); the backwards as without
    casts = [0.2 * unit.forward * (u % 2) for u, unit in enumerate(prof.units)]
    casting = dataclasses.replace(
        prof,
        units=[dataclasses.replace(unit, cast_time=c) for unit, c in zip(prof.units, casts)],
        bf16=True,
    )
    sharded = traced_profile(graph, part, casting, trace, fsdp=True)
    for stage in range(part.num_stages):
        mine = _units(part, stage)
        ran = [prof.units[u].forward - casts[u] for u in mine]
        for u, share in zip(mine, ran):
            assert sharded.units[u].forward - casts[u] == pytest.approx(
                trace.stage_times[stage].forward * share / sum(ran), rel=1e-4
            )
            assert sharded.units[u].backward == traced.units[u].backward


def test_replan_from_a_slowed_trace_writes_a_package_for_the_traced_run(package, tmp_path):
    part, prof = _loaded(package)
    trace = _trace(
        tmp_path / "trace", part, prof, (1.0, 6.0), (1.0, 6.0), microbatches=6, package=package
    )
    plan = replan(package, trace)
    assert len(_units(plan.new, 1)) < len(_units(part, 1)) and plan.gain > 0.2
    text = replan_text(plan)
    assert "forward" in text and "(x6)" in text and f"{plan.gain:.1%} shorter" in text
    out = write_replan(plan, tmp_path / "new", report=False)
    new, traced = _loaded(out)
    assert new.stage_of_unit == plan.new.stage_of_unit and traced.mode == "traced"
    # the run's schedule and microbatches; the package's other settings
    assert (new.settings.schedule, new.settings.microbatches) == ("1f1b", 6)
    assert (new.settings.optimizer, new.settings.dp_shard) == (
        part.settings.optimizer,
        part.settings.dp_shard,
    )
    assert new.settings.profile == "traced" and check_files(out) == []
    identity = [json.loads((p / "pipeline.json").read_text())["identity"] for p in (package, out)]
    assert identity[0] == identity[1]  # checkpoints of one are the other's
    with pytest.raises(OutputExistsError, match="pass --force"):
        write_replan(plan, out, report=False)
    assert write_replan(plan, out, report=False, force=True) == out


def test_replan_predicting_no_gain_writes_nothing(package, tmp_path, capsys):
    part, prof = _loaded(package)
    trace = _trace(tmp_path / "trace", part, prof, (1.0, 1.0), (1.0, 1.0), package=package)
    plan = replan(package, trace)
    assert not plan.moved and plan.gain == pytest.approx(0.0, abs=1e-6)
    out = tmp_path / "new"
    with pytest.raises(NoGainError, match="it is the same split; nothing was written"):
        write_replan(plan, out)
    assert not out.exists()
    argv = ["replan", str(package), "--from-trace", str(trace), "--out", str(out)]
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert "new split (mpipe)" in captured.out and "pass --min-gain 0" in captured.err
    assert not out.exists()
    assert main([*argv, "--min-gain", "0", "--no-report"]) == 0  # asked for: written
    assert check_files(out) == []
    assert main(["replan", str(package), "--from-trace", str(trace), "--dry-run"]) == 0
    assert capsys.readouterr().out.endswith("dry run: nothing written\n")


def test_replan_refusals_name_what_is_wrong(package, tmp_path, capsys):
    part, prof = _loaded(package)
    trace = _trace(tmp_path / "trace", part, prof, (1.0, 3.0), (1.0, 3.0), package=package)
    assert main(["replan", str(package), "--from-trace", str(trace)]) == 1
    assert "give --out NEWPKG for the new package, or --dry-run" in capsys.readouterr().err
    # another pipeline's run: a trace of 3 stages
    three = dataclasses.replace(part, device_of_stage=[0, 1, 2])
    three = dataclasses.replace(
        three, stage_of_unit=[min(u // 3, 2) for u in range(len(prof.units))]
    )
    other = _trace(tmp_path / "other", three, prof, (1.0,) * 3, (1.0,) * 3)
    with pytest.raises(ArtifactError, match="another package .*it ran 3 stages.*give the package"):
        replan(package, other)
    with pytest.raises(ArtifactError, match="no rankR.json timelines"):
        replan(package, tmp_path)
    # a run of another precision than the plan's: its times are not the profile's units'
    mixed = _trace(
        tmp_path / "bf16", part, prof, (1.0, 3.0), (1.0, 3.0), package=package, bf16=True
    )
    with pytest.raises(ArtifactError, match="ran --bf16, .* planned without it.*--no-bf16"):
        replan(package, mixed)
    # a package generated without its profile
    bare = tmp_path / "bare"
    shutil.copytree(package, bare)
    (bare / "artifacts" / "profile.json").unlink()
    with pytest.raises(ArtifactError, match="no artifacts/profile.json.*--profile-file"):
        replan(bare, trace)
    # an --out that is not a package is refused before any work
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    argv = ["replan", str(package), "--from-trace", str(trace), "--out", str(tmp_path / "taken")]
    assert main([*argv, "--force"]) == 1
    captured = capsys.readouterr()
    assert "not a pipeline autopipe generated" in captured.err and captured.out == ""
