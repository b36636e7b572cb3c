"""Every command names a model folder one way, `--model-dir DIR` (the folder alone, the older spelling, still read),
a usage error points to the subcommand's own help, and a number out of its range is such an error."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from mhaserve.cli.main import build_parser
from mhaserve.cli.main import main as cli
from mhaserve.contract.errors import UsageError
from mhaserve.server.config import SETTING_FIELDS, finite_float, flag_of, reader_of, settings_from_args


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


# Each was taken before: a traceback (a negative batch or seed, no callers, a rate of 0), a hang (a negative rate),
# or another command than the one typed (one call for --repeat 0, self-attention for --kv-len 0, 8 heads for
# --heads 0, a server on port 65535 for --port -1, an opset-18 graph for --opset 3).
NUMBERS_OUT_OF_RANGE = [
    (["infer", "--batch", "-1"], "argument --batch: expected a whole number of at least 1, got '-1'"),
    (["infer", "--seed", "-1"], "argument --seed: expected a whole number of 0 or more, got '-1'"),
    (["infer", "--repeat", "0"], "argument --repeat: expected a whole number of at least 1, got '0'"),
    (["infer", "--kv-len", "0"], "argument --kv-len: expected a whole number of at least 1, got '0'"),
    (["infer", "--timeout", "nan"], "argument --timeout: expected a number more than 0, got 'nan'"),
    (["infer", "--top-p", "1.5"], "argument --top-p: expected a number more than 0 and at most 1, got '1.5'"),
    (
        ["infer", "--heads", "0,-1"],
        "argument --heads: expected head numbers from 0 separated by commas (e.g. 0,3), got '0,-1'",
    ),
    (["bench", "--duration", "0"], "argument --duration: expected a number more than 0, got '0'"),
    (["bench", "--warmup", "-1"], "argument --warmup: expected a number of 0 or more, got '-1'"),
    (
        ["bench", "--concurrency", "4,0"],
        "argument --concurrency: expected whole numbers of at least 1 separated by commas (e.g. 1,4,16), got '4,0'",
    ),
    (
        ["bench", "--rate", "-5"],
        "argument --rate: expected numbers more than 0 separated by commas (e.g. 100,200.5), got '-5'",
    ),
    (
        ["bench", "--rate", "inf"],
        "argument --rate: expected numbers more than 0 separated by commas (e.g. 100,200.5), got 'inf'",
    ),
    (["tune", "--repeats", "0"], "argument --repeats: expected a whole number of at least 1, got '0'"),
    (["export", "--heads", "0"], "argument --heads: expected a whole number of at least 1, got '0'"),
    (["health", "--timeout", "-1"], "argument --timeout: expected a number more than 0, got '-1'"),
    (["ray-deploy", "m", "--grpc-port", "0"], "argument --grpc-port: expected a whole number from 1 to 65535, got '0'"),
]


@pytest.mark.parametrize(("argv", "said"), NUMBERS_OUT_OF_RANGE, ids=[" ".join(a) for a, _ in NUMBERS_OUT_OF_RANGE])
def test_a_number_out_of_its_range_is_refused_in_one_line_before_the_command_runs(argv, said, capsys):
    with pytest.raises(SystemExit) as exit:
        cli(argv)
    assert exit.value.code == 2
    assert capsys.readouterr().err.splitlines() == [f"mhaserve {argv[0]}: error: {said}",
                                                    f"(the flags: mhaserve {argv[0]} --help)"]  # fmt: skip


SETTINGS_OUT_OF_RANGE = [
    (["--port", "-1"], "--port must be between 0 and 65535 (a TCP port; 0: any free one)"),
    (["--http-port", "70000"], "--http-port must be between -1 and 65535 (a TCP port; 0: any free one; -1: no HTTP)"),
    (
        ["--max-message-bytes", "-5"],
        "--max-message-bytes must be between 0 and 2147483647 (0: derived; gRPC takes no larger limit)",
    ),
    (["--warmup-runs", "-1"], "--warmup-runs must be 0 or more"),
    (["--max-concurrent-streams", "0"], "--max-concurrent-streams must be at least 1"),
    (["--grace-seconds", "inf"], "argument --grace-seconds: expected a finite number, got 'inf'"),
]


@pytest.mark.parametrize(("argv", "said"), SETTINGS_OUT_OF_RANGE, ids=[" ".join(a) for a, _ in SETTINGS_OUT_OF_RANGE])
def test_a_server_setting_out_of_its_range_is_refused_before_the_server_starts(argv, said, capsys):
    try:
        settings_from_args(build_parser().parse_args(["serve", *argv]))
    except UsageError as error:  # the settings' rules: serve prints it as its one line
        assert str(error) == said
    except SystemExit as exit:  # what no rule can read: argparse's line
        assert exit.code == 2 and capsys.readouterr().err.splitlines()[0] == f"mhaserve serve: error: {said}"
    else:
        pytest.fail(f"serve {' '.join(argv)} was accepted")


def test_every_number_a_command_or_setting_takes_is_bounded():
    """A bare int or float type takes any number, infinity and NaN among them: each command's numbers are read by
    a bounded type, and each of the server's by its setting's rule."""
    (commands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    bare = [f"mhaserve {name} {action.option_strings[0]}" for name, parser in commands.choices.items()
            if name != "serve" for action in parser._actions if action.type in (int, float)]  # fmt: skip
    unruled = [flag_of(name) for name, f in SETTING_FIELDS.items()
               if reader_of(f) in (int, finite_float) and f.metadata["rule"] is None]  # fmt: skip
    assert bare == [] and unruled == []


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--out", "/proc/self/model"], "--out /proc/self/model: cannot be made"),  # was a traceback after the export
        (["--repository", "/proc/self/models"], "--repository /proc/self/models/mha/1: cannot be made"),
        (["--out", __file__], f"--out {__file__}: is a file; give a folder"),
        (["--triton-repo", "/proc/self/triton"], "--triton-repo /proc/self/triton: cannot be made"),
    ],
)
def test_an_export_folder_that_cannot_be_written_is_refused_before_the_export(argv, said, tmp_path, capsys):
    # /proc/self exists and its permission bits say root may write; it takes no new file or folder
    argv = ["export", *argv] if "--triton-repo" not in argv else ["export", "--out", str(tmp_path / "m"), *argv]
    assert cli(argv) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"mhaserve export: error: {said}"), line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--url", "http://127.0.0.1:8001/"], "--url: a server's address is host:port, got 'http://127.0.0.1:8001/'"),
        (["--url", "https://models.example:443"], "give models.example:443 with TLS"),
        (["--tls-ca", "/no/ca.pem"], "cannot read --tls-ca /no/ca.pem: No such file or directory"),  # a traceback
        (["--tls-cert", "/no/such/cert.pem"], "--tls-cert and --tls-key go together"),  # exit code 1
        (["--token-file", "/"], "cannot read --token-file /: Is a directory"),  # exit code 1
    ],
)
@pytest.mark.parametrize("command", ["infer", "bench", "health"])
def test_connection_flags_that_cannot_work_are_refused_in_one_line_before_connecting(command, flags, said, capsys):
    assert cli([command, *flags]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"mhaserve {command}: error: ") and said in line, line


@pytest.mark.parametrize("flag", ["--rows", "--keys"])
@pytest.mark.parametrize("given", ["a:b", "5", "1:2:3"])
def test_a_range_of_another_form_is_refused_before_connecting(flag, given, capsys):
    with pytest.raises(SystemExit) as exit:
        cli(["infer", "--url", "127.0.0.1:9", flag, given])  # it was the server's refusal, after a call: exit 1
    assert exit.value.code == 2
    said = capsys.readouterr().err.splitlines()[0]
    assert said == f"mhaserve infer: error: argument {flag}: expected a range like \"0:32\" (start:stop), got '{given}'"


def test_steps_refuse_the_flags_that_shape_a_single_call_before_connecting(capsys):
    assert cli(["infer", "--url", "127.0.0.1:9", "--steps", "4", "--rows", "0:4", "--summaries"]) == 2  # were ignored
    assert capsys.readouterr().err.splitlines() == [
        "mhaserve infer: error: --steps prints each step's strongest keys (--top-k of them); --rows, --summaries are "
        "for a single call: leave out --steps"
    ]
