"""``autopipe report DIR --run trace_dir``: a traced run beside its prediction, byte-stable.

The trace in tests/data/trace_gpt2_4 is a real run of the 4-stage GPT-2 package that
``compile_model("gpt2", out, 4)`` writes (compiling is deterministic)::

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node=4 \\
        PKG/train.py --device cpu --steps 3 --microbatches 4 --schedule 1f1b --trace DIR

(its rankR.json files; the Chrome trace.json is left out).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest

from autopipe.cli import main
from autopipe.errors import ArtifactError
from autopipe.report import ReportData, RunComparison, run_report, write_report
from autopipe.report.figures import run_timeline_figure, save_figure
from autopipe.report.run import DEVIATIONS, FAR, StageComparison
from autopipe.report.run_trace import RunTrace
from autopipe.runtime.core.pipeline import Pipeline
from autopipe.runtime.core.timeline_format import RankTimeline, Record

from conftest import ROOT, compile_model

FIXTURE = ROOT / "tests" / "data" / "trace_gpt2_4"
RUN_FIGURES = ("run_timeline", "run_stages")


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    """The 4-stage GPT-2 package the trace ran."""
    out = tmp_path_factory.mktemp("report-run") / "gpt2"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)
        compile_model("gpt2", out, 4)
    return out


@pytest.fixture(scope="module")
def trace_dir(package, tmp_path_factory):
    """The committed trace, as a run of ``package``: its timelines record the digest of the
    package's pipeline.json, rewritten here to this compile's, so that a change of the
    compiler's output (another cost model, say) does not orphan the fixture; the check itself
    is tested by test_refusals."""
    digest = Pipeline.from_json(json.loads((package / "pipeline.json").read_text())).digest()
    out = tmp_path_factory.mktemp("trace") / "trace"
    out.mkdir()
    for path in sorted(FIXTURE.glob("rank*.json")):
        timeline = RankTimeline.from_json(path.read_text())
        run = dataclasses.replace(timeline.run, pipeline=digest)
        (out / path.name).write_text(dataclasses.replace(timeline, run=run).to_json())
    return out


@pytest.fixture(scope="module")
def written(package, trace_dir):
    """The report with the run's section, and the summary printed with it."""
    return run_report(package, trace_dir)


def _rewritten(tmp_path, change, trace_dir):
    """A copy of the trace with every rank's timeline passed through ``change``."""
    out = tmp_path / "trace"
    out.mkdir()
    for path in sorted(trace_dir.glob("rank*.json")):
        timeline = change(RankTimeline.from_json(path.read_text()))
        (out / path.name).write_text(timeline.to_json())
    return out


def test_run_section_shows_the_trace(package, written, trace_dir):
    page, _ = written
    html = page.read_text()
    trace = RunTrace.load(trace_dir)
    # the section, its two figures inlined and written beside the page
    assert '<h2 id="run">Measured run</h2>' in html
    assert html.count("<svg ") == 4 + len(RUN_FIGURES)
    for name in RUN_FIGURES:
        assert f'<h2 id="{name}">' in html
        assert (page.parent / f"{name}.svg").read_text().lstrip().startswith("<?xml")
        assert (page.parent / f"{name}.png").read_bytes().startswith(b"\x89PNG")
    ids = re.findall(r'\bid="([^"]+)"', html)
    assert len(ids) == len(set(ids))
    # the run's numbers are RunTrace's
    assert f"measured {trace.run_time * 1e3:.3f} ms" in html
    assert f"measured {trace.bubble * 100:.1f}% idle" in html
    assert f"measured {trace.step_time * 1e3:.3f} ms" in html
    for times in trace.stage_times:
        row = re.search(rf'<tr id="run-stage-{times.stage}"[^>]*>(.*?)</tr>', html, re.S)
        assert row, f"no row for stage {times.stage}"
        cells = re.findall(r"<td[^>]*>(.*?)</td>", row.group(1))
        assert cells[2] == f"{times.forward * 1e3:.3f}"
        assert cells[5] == f"{times.backward * 1e3:.3f}"
        assert cells[8] == str(times.count)
    # and the prediction's, for the run as it ran (4 microbatches; the package's default is 8)
    data = ReportData.load(package)
    comparison = RunComparison.load(data, trace_dir)
    assert data.microbatches == 8 and trace.run.microbatches == 4
    assert f"predicted {comparison.simulation.step_time * 1e3:.3f} ms" in html
    assert f"predicted {comparison.simulation.bubble * 100:.1f}% idle" in html
    assert f"<td>{comparison.stages[0].verdict}</td>" in html
    # and what the plan puts outside the pipeline runs: its gradients and optimizer step (the
    # run had the plan's data parallelism: none)
    assert trace.run.dp_size == 1 and data.partition.predicted is not None
    once = data.partition.predicted.once_per_step
    assert comparison.predicted_outside_runs == once > 0
    assert f"(gradients, optimizer: predicted {once * 1e3:.3f} ms)" in html
    section = html[html.index('id="run-deviations"') :]
    assert section.count("<tr>") == 1 + DEVIATIONS


def test_run_report_is_byte_stable(package, trace_dir):
    """Writing again, in another process with another hash seed, gives the same bytes."""
    out = package / "report"
    run_report(package, trace_dir)
    first = {p.name: p.read_bytes() for p in sorted(out.iterdir())}
    code = (
        "from autopipe.report import run_report; "
        f"run_report({str(package)!r}, {str(trace_dir)!r})"
    )
    env = dict(os.environ, PYTHONHASHSEED="4321")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=env, timeout=300)
    second = {p.name: p.read_bytes() for p in sorted(out.iterdir())}
    names = ("times", "timeline", "memory", "graph", *RUN_FIGURES)
    assert sorted(first) == sorted(
        [f"{n}.{e}" for n in names for e in ("png", "svg")] + ["report.html"]
    )
    assert first == second


def test_comparison_against_the_prediction(package, trace_dir):
    data = ReportData.load(package)
    comparison = RunComparison.load(data, trace_dir)
    trace = comparison.trace
    # one pipeline run of the run's 4 microbatches, forward and backward of each on each stage
    assert len(comparison.simulation.events) == 4 * 4 * 2
    assert len(data.simulation.events) == 4 * 8 * 2
    # the scale: measured over predicted compute, every stage together
    measured = sum(t.forward + t.backward for t in trace.stage_times)
    predicted = sum(data.costs.forward) + sum(data.costs.backward)
    assert comparison.scale == pytest.approx(measured / predicted)
    for row in comparison.stages:
        assert row.predicted_forward == data.costs.forward[row.stage]
        assert row.forward_ratio == pytest.approx(row.measured_forward / row.predicted_forward)
    # every measured compute action, and the most deviating first, against the scale
    assert len(comparison.actions) == sum(len(trace.compute(r)) for r in range(4))
    distance = [abs(math.log(d.relative)) for d in comparison.deviations]
    assert distance == sorted(distance, reverse=True)
    assert distance[-1] >= max(
        abs(math.log(d.relative)) for d in comparison.actions if d not in comparison.deviations
    )
    top = comparison.deviations[0]
    assert top.ratio == pytest.approx(top.measured / top.predicted)
    # the measured timeline: the first traced step's run, from its first action's start
    events = comparison.measured_events
    assert comparison.shown_run.step == trace.steps[0]
    assert min(e[2] for e in events) == 0 and len(events) == 4 * 4 * 2
    assert {(e[0], e[1].stage) for e in events} == {(s, s) for s in range(4)}


def test_actions_are_compared_without_their_receive_waits(package, trace_dir):
    """A spec's receive wait (a calibrated CPU's) is part of a simulated action but not of its
    span in a trace, which begins once the received tensors are there: each action is compared
    with its compute alone, so the actions that receive are not all called fast."""
    data = ReportData.load(package)
    wait = 3e-3
    data.__dict__["costs"] = dataclasses.replace(  # the cached costs, with the spec's waits
        data.costs,
        receive_forward=[0.0, wait, wait, wait],
        receive_backward=[wait, wait, wait, 0.0],
    )
    comparison = RunComparison.load(data, trace_dir)
    spans = {
        (a.stage, a.kind, a.microbatch): end - start
        for _, a, start, end in comparison.simulation.events
    }
    for deviation in comparison.actions:
        action = deviation.action
        key = (action.stage, action.kind, action.microbatch)
        receives = (action.kind == "F" and action.stage > 0) or (
            action.kind == "B" and action.stage < 3
        )
        assert deviation.predicted == pytest.approx(data.costs.compute(action))
        assert spans[key] == pytest.approx(deviation.predicted + (wait if receives else 0.0))


def test_prediction_follows_the_runs_schedule(package, tmp_path, trace_dir):
    """A run under another schedule than traced here is predicted under that schedule."""

    def gpipe(timeline):
        return dataclasses.replace(
            timeline, run=dataclasses.replace(timeline.run, schedule="gpipe")
        )

    comparison = RunComparison.load(
        ReportData.load(package), _rewritten(tmp_path, gpipe, trace_dir)
    )
    for device in range(4):
        kinds = [a.kind for d, a, _, _ in comparison.simulation.events if d == device]
        assert kinds == ["F"] * 4 + ["B"] * 4  # all forwards first: GPipe, not 1F1B


def test_prediction_for_another_device_is_drawn_to_scale(package, tmp_path, trace_dir):
    """A run at its prediction's scale is drawn as predicted; one 30x slower (another
    device): deviations are judged against that scale, and the predicted timeline is drawn
    multiplied by it. (The committed trace ran on this machine's CPU against an H100 plan: it
    is rescaled to its prediction first.)"""

    def scaled(factor):
        def change(timeline):
            records = tuple(
                dataclasses.replace(
                    r, start_ns=round(r.start_ns * factor), end_ns=round(r.end_ns * factor)
                )
                for r in timeline.records
            )
            return dataclasses.replace(timeline, records=records)

        return change

    data = ReportData.load(package)
    unit = 1 / RunComparison.load(data, trace_dir).scale
    runs = []
    for name, factor in (("at-scale", unit), ("slower", 30 * unit)):
        (tmp_path / name).mkdir()
        runs.append(
            RunComparison.load(data, _rewritten(tmp_path / name, scaled(factor), trace_dir))
        )
    base, comparison = runs
    assert base.scale == pytest.approx(1.0, rel=1e-4)
    assert comparison.scale == pytest.approx(base.scale * 30, rel=1e-4)
    assert base.drawn_scale == 1.0 and comparison.drawn_scale == comparison.scale
    assert [d.relative for d in comparison.deviations] == pytest.approx(
        [d.relative for d in base.deviations], rel=1e-3
    )
    drawn = comparison.predicted_events[-1][3]
    assert drawn == pytest.approx(comparison.simulation.step_time * comparison.scale)
    fig = run_timeline_figure(comparison)
    assert f"drawn x{comparison.scale:.2f}" in fig.axes[1].get_title(loc="left")
    assert fig.axes[0].get_xlim() == fig.axes[1].get_xlim()
    save_figure(fig)


def test_stage_verdicts():
    def stage(forward, backward, others):
        return StageComparison(0, 0, forward, backward, 1.0, 1.0, 8, others)

    assert stage(1.0, 1.0, 1.0).verdict == "in line with the other stages"
    assert not stage(1.4, 1.0, 1.0).deviates
    slow = stage(3.0, 1.0, 1.0)
    assert slow.deviates and slow.relative == 2.0 >= FAR
    assert slow.verdict == (
        "2.0x slower than the other stages against the prediction (its forward: 3.0x slower)"
    )
    fast = stage(0.5, 0.1, 2.0)
    assert fast.verdict.startswith("6.7x faster than the other stages")
    assert fast.verdict.endswith("(its backward: 20.0x faster)")
    # a stage with no measured time (a trace without its backwards), or no predicted time
    assert stage(0.0, 0.0, 1.0).verdict == "no time measured for it, unlike the other stages"
    assert stage(3.0, 0.0, 1.0).verdict.endswith("(its backward: no time measured)")
    unpredicted = StageComparison(0, 0, 1.0, 1.0, 0.0, 0.0, 8, 1.0)
    assert unpredicted.verdict == "no time predicted for it, unlike the other stages"


def test_cli_prints_the_summary(package, capsys, trace_dir):
    assert main(["report", str(package), "--run", str(trace_dir)]) == 0
    out = capsys.readouterr().out.splitlines()
    trace = RunTrace.load(trace_dir)
    assert out[0] == f"wrote {package / 'report' / 'report.html'}"
    assert out[1].startswith("run: 1f1b, 4 microbatches; 4 pipeline ranks")
    assert any(
        line.startswith(f"bubble: measured {trace.bubble * 100:.1f}% idle, predicted ")
        for line in out
    )
    assert any(f"measured {trace.run_time * 1e3:.3f} ms" in line for line in out)
    deviating = out.index("most deviating actions, against the scale:")
    assert len(out) == deviating + 2 + DEVIATIONS
    # a report written again without --run drops the section and its figures
    assert main(["report", str(package)]) == 0
    html = (package / "report" / "report.html").read_text()
    assert "Measured run" not in html
    assert not any((package / "report" / f"{name}.svg").exists() for name in RUN_FIGURES)


def test_summary_of_fsdp2_actions(package, tmp_path, trace_dir):
    """A run that recorded FSDP2's actions (data parallelism) says what they took per rank and
    step: each forward here given an unshard of a tenth of it."""

    def unsharded(timeline):
        added = [
            Record(r.step, "unshard", r.stage, r.microbatch, r.start_ns,
                   r.start_ns + (r.end_ns - r.start_ns) // 10, unit="transformer.h.0")
            for r in timeline.records
            if r.kind == "forward"
        ]  # fmt: skip
        records = tuple(sorted(timeline.records + tuple(added), key=lambda r: r.start_ns))
        return dataclasses.replace(timeline, records=records)

    traced = _rewritten(tmp_path, unsharded, trace_dir)
    trace = RunTrace.load(traced)
    forwards = sum(
        (r.end_ns - r.start_ns) // 10 for t in trace.timelines for r in t.records
        if r.kind == "forward"
    )  # fmt: skip
    assert trace.unit_times == {
        "unshard": pytest.approx(forwards / len(trace.timelines) / len(trace.steps) / 1e9)
    }
    comparison = RunComparison.load(ReportData.load(package), traced)
    assert "FSDP2: per rank and step: unshard " in comparison.summary()
    assert "FSDP2" not in RunComparison.load(ReportData.load(package), trace_dir).summary()


def test_refusals(package, tmp_path, capsys, trace_dir):
    other = tmp_path / "mlp"
    compile_model("mlp", other, 2)
    with pytest.raises(ArtifactError, match=r"another package .*it ran 4 stages, .* has 2"):
        write_report(other, trace_dir)
    regenerated = tmp_path / "gpt2"  # the same model in another split: another package
    compile_model("gpt2", regenerated, 4, microbatches=6)
    with pytest.raises(ArtifactError, match=r"another split or build of it, or another model"):
        write_report(regenerated, trace_dir)
    missing = tmp_path / "missing"
    shutil.copytree(trace_dir, missing)
    (missing / "rank2.json").unlink()
    with pytest.raises(ArtifactError, match=r"the timelines of rank\(s\) 2 are missing"):
        write_report(package, missing)
    leftover = tmp_path / "leftover"  # a rank file of an earlier, larger run
    shutil.copytree(trace_dir, leftover)
    rank3 = RankTimeline.from_json((leftover / "rank3.json").read_text())
    (leftover / "rank4.json").write_text(dataclasses.replace(rank3, rank=4).to_json())
    with pytest.raises(ArtifactError, match=r"holds rank 4's too, of another run"):
        RunTrace.load(leftover)
    with pytest.raises(ArtifactError, match="has no rankR.json timelines"):
        write_report(package, tmp_path / "mlp" / "artifacts")
    # through the CLI: the message, no traceback, exit status 1
    assert main(["report", str(package), "--run", str(package / "pipeline.json")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("autopipe report: error: ") and "is not a directory" in err
