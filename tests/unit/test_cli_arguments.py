"""Every command names a model folder one way, `--model-dir DIR` (the folder alone, the older spelling, still read),
and a usage error points to the subcommand's own help."""

from __future__ import annotations

from pathlib import Path

import pytest

from mhaserve.cli.main import build_parser
from mhaserve.cli.main import main as cli


@pytest.mark.parametrize("command", ["validate", "tune", "ray-deploy"])
def test_a_model_folder_is_named_with_model_dir_or_alone(command):
    parser = build_parser()
    assert parser.parse_args([command, "--model-dir", "m"]).model_dir == Path("m")
    assert parser.parse_args([command, "m"]).model_dir == Path("m")


@pytest.mark.parametrize("command", ["validate", "ray-deploy"])
def test_a_command_that_needs_a_folder_asks_for_it_by_its_flag(command, capsys):
    with pytest.raises(SystemExit) as exit:
        build_parser().parse_args([command])
    assert exit.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"mhaserve {command}: error: give the model folder: --model-dir DIR",
        f"(the flags: mhaserve {command} --help)",
    ]


def test_a_folder_given_two_different_ways_is_refused(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["validate", "a", "--model-dir", "b"])
    assert "the model folder given twice: a and --model-dir b" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["tune", "--slo", "p99<5ms", "--no-such-flag"], ["serve", "--no-such-flag"]])
def test_an_unrecognized_argument_points_to_the_subcommand_help(argv, capsys):
    with pytest.raises(SystemExit) as exit:
        cli(argv)
    assert exit.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"mhaserve {argv[0]}: error: unrecognized arguments: --no-such-flag",
        f"(the flags: mhaserve {argv[0]} --help)",
    ]
