"""The command line: --help everywhere, the console script, the python -m entry point."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from autopipe.cli import build_parser, main

COMMANDS = [
    "compile",
    "trace",
    "profile",
    "partition",
    "generate",
    "verify",
    "calibrate",
    "merge",
    "report",
    "show",
]


@pytest.mark.parametrize("command", COMMANDS)
def test_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert "usage: autopipe " + command in capsys.readouterr().out


def test_top_level_help_lists_every_command():
    text = build_parser().format_help()
    for command in COMMANDS:
        assert command in text


@pytest.mark.parametrize(
    "command",
    [
        ["trace", "tests/models.py:mlp", "-o"],
        ["profile", "graph.json", "-o"],
        ["partition", "graph.json", "profile.json", "--stages", "2", "-o"],
        ["calibrate", "-o"],
        ["merge", "ckpt", "-o"],
    ],
)
def test_a_file_to_write_is_no_directory(command, tmp_path, capsys):
    """Every option naming a file to write refuses a directory, one that exists or any name
    ending with a slash (argparse's Path would drop it and write a file of that name), before
    any work is done."""
    for folder in (str(tmp_path), f"{tmp_path}/new/"):
        with pytest.raises(SystemExit) as exit_info:
            main([*command, folder])
        assert exit_info.value.code == 2
        assert f"{folder} is a directory; give the file to write, e.g. " in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_console_script_and_module():
    script = str(Path(sys.executable).with_name("autopipe"))  # installed beside this interpreter
    for command in ([script, "--version"], [sys.executable, "-m", "autopipe", "--version"]):
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("autopipe ")


def test_generated_train_help(tmp_path):
    from conftest import compile_model

    compile_model("mlp", tmp_path / "pipe", 2)
    result = subprocess.run(
        [sys.executable, str(tmp_path / "pipe" / "train.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0
    for flag in [
        "--steps",
        "--microbatches",
        "--schedule",
        "--optimizer",
        "--lr",
        "--data",
        "--device",
        "--load",
        "--save",
        "--log-json",
    ]:
        assert flag in result.stdout


def test_compile_verbosity_report_and_show(tmp_path, capsys):
    """Phase lines by default, details with --verbose, nothing but the result with --quiet;
    the report is written unless --no-report; `autopipe show` prints the stage table."""
    spec = "tests/models.py:mlp"
    assert main(["compile", spec, "--stages", "2", "--out", str(tmp_path / "a"), "--verbose"]) == 0
    verbose = capsys.readouterr()
    assert "partition" in verbose.err and "method mpipe, bottleneck" in verbose.err
    assert (tmp_path / "a" / "report" / "report.html").is_file()
    args = ["compile", spec, "--stages", "2", "--out", str(tmp_path / "b"), "--no-report"]
    assert main([*args, "--quiet"]) == 0
    quiet = capsys.readouterr()
    assert quiet.err == "" and "wrote 2-stage pipeline" in quiet.out
    assert not (tmp_path / "b" / "report").exists()
    assert main(["show", str(tmp_path / "b")]) == 0
    table = capsys.readouterr().out
    assert "stage" in table and "device" in table and len(table.splitlines()) >= 3
    assert main(["report", str(tmp_path / "b")]) == 0
    assert (tmp_path / "b" / "report" / "report.html").is_file()
