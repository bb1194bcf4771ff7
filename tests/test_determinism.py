"""Compiling is deterministic: the same model and flags give the same bytes."""

from __future__ import annotations

import sys

from autopipe.cli import main as autopipe

from conftest import ROOT, compile_model, spec

sys.path.insert(0, str(ROOT / "examples"))
import gallery  # noqa: E402


def test_compile_twice_identical(tmp_path):
    compile_model("bert", tmp_path / "a", 3, share=False)
    compile_model("bert", tmp_path / "b", 3, share=False)
    assert gallery.differences(tmp_path / "a", tmp_path / "b") == []


def test_step_by_step_equals_compile(tmp_path):
    """trace -> profile -> partition -> generate from the saved artefacts gives what compile gives."""
    assert (
        autopipe(
            [
                "compile",
                spec("t5"),
                "--stages",
                "3",
                "--out",
                str(tmp_path / "compiled"),
                "--quiet",
                "--no-report",  # generate writes no report; `autopipe report` does
            ]
        )
        == 0
    )
    assert autopipe(["trace", spec("t5"), "-o", str(tmp_path / "graph.json")]) == 0
    assert (
        autopipe(["profile", str(tmp_path / "graph.json"), "-o", str(tmp_path / "profile.json")])
        == 0
    )
    assert (
        autopipe(
            [
                "partition",
                str(tmp_path / "graph.json"),
                str(tmp_path / "profile.json"),
                "--stages",
                "3",
                "-o",
                str(tmp_path / "partition.json"),
            ]
        )
        == 0
    )
    assert (
        autopipe(
            [
                "generate",
                str(tmp_path / "graph.json"),
                str(tmp_path / "partition.json"),
                "--profile-file",
                str(tmp_path / "profile.json"),
                "--out",
                str(tmp_path / "stepwise"),
            ]
        )
        == 0
    )
    assert gallery.differences(tmp_path / "compiled", tmp_path / "stepwise") == []


def test_generate_from_measured_profile_is_deterministic(tmp_path):
    """A measured profile is noisy, but generating from a saved one always gives the same bytes."""
    assert autopipe(["trace", spec("mlp"), "-o", str(tmp_path / "graph.json")]) == 0
    assert (
        autopipe(
            [
                "profile",
                str(tmp_path / "graph.json"),
                "--profile",
                "measured",
                "-o",
                str(tmp_path / "profile.json"),
            ]
        )
        == 0
    )
    for out in ("a", "b"):
        assert (
            autopipe(
                [
                    "partition",
                    str(tmp_path / "graph.json"),
                    str(tmp_path / "profile.json"),
                    "--stages",
                    "2",
                    "-o",
                    str(tmp_path / f"{out}.json"),
                ]
            )
            == 0
        )
        assert (
            autopipe(
                [
                    "generate",
                    str(tmp_path / "graph.json"),
                    str(tmp_path / f"{out}.json"),
                    "--out",
                    str(tmp_path / out),
                ]
            )
            == 0
        )
    assert gallery.differences(tmp_path / "a", tmp_path / "b") == []


def test_committed_gallery_regenerates_byte_identical(tmp_path):
    gallery.regenerate(tmp_path)
    for name in gallery.GALLERY:
        assert (
            ROOT / "generated" / name
        ).is_dir(), f"generated/{name} is missing: run python examples/gallery.py"
        assert gallery.differences(ROOT / "generated" / name, tmp_path / name) == []
