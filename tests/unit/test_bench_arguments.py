"""`mhaserve bench` refuses what it cannot use before it measures anything: one line and exit code 2, never a
traceback, and never after a sweep whose results it would then lose."""

from __future__ import annotations

import json
import time

import pytest

from mhaserve.cli import main as cli

# Nothing listens here: a check that came after the connection would fail differently (exit 1, "cannot reach").
NOWHERE = ("bench", "--url", "127.0.0.1:9", "--duration", "1", "--warmup", "0")


def one_line_refusal(capsys, argv) -> str:
    assert cli(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("flag", ["--json", "--csv", "--report"])
def test_an_output_path_that_cannot_be_written_is_refused_before_the_sweep(tmp_path, capsys, flag):
    err = one_line_refusal(capsys, [*NOWHERE, flag, str(tmp_path / "missing" / "results.out")])
    assert f"{flag} {tmp_path / 'missing' / 'results.out'}: the folder {tmp_path / 'missing'} does not exist" in err
    err = one_line_refusal(capsys, [*NOWHERE, flag, str(tmp_path)])
    assert "is a folder" in err


@pytest.mark.parametrize("flag", ["--json", "--csv", "--report", "--plot-dir"])
def test_an_output_in_a_folder_that_refuses_files_is_refused_before_the_sweep(capsys, flag):
    # /proc/self exists and its permission bits say root may write; it takes no new file
    target = "/proc/self" if flag == "--plot-dir" else "/proc/self/results.out"
    err = one_line_refusal(capsys, [*NOWHERE, flag, target])
    assert f"{flag} {target}" in err and "cannot be" in err, err


def test_a_20000_digit_slo_is_refused_at_once(capsys):
    started = time.perf_counter()
    err = one_line_refusal(capsys, [*NOWHERE, "--slo", "p99<" + "9" * 20000 + "x"])
    assert time.perf_counter() - started < 1.0 and "expected p50" in err  # it took 28 s
    assert "too large" in one_line_refusal(capsys, [*NOWHERE, "--slo", "p99<" + "9" * 400 + "ms"])


GOOD_POINT = {"mode": "closed", "load": 1, "duration_s": 1.0, "shape": "[1,16,64]", "outputs": "output",
              "throughput_per_s": 10.0, "p50_ms": 1.0, "p99_ms": 2.0}  # fmt: skip
MALFORMED = {
    "not json": "{",
    "a list": [],
    "points not a list": {"points": 3},
    "a point not an object": {"points": [1]},
    "a point without its load": {"points": [{k: v for k, v in GOOD_POINT.items() if k != "load"}]},
    "a figure that is text": {"points": [{**GOOD_POINT, "p50_ms": "fast"}]},
    "a figure that is null": {"points": [{**GOOD_POINT, "throughput_per_s": None}]},
    "rounds that are not an object": {"points": [{**GOOD_POINT, "rounds": [1]}]},
    "nested past the parser's depth": "[" * 200_000 + "]" * 200_000,
}


@pytest.mark.parametrize("case", MALFORMED)
def test_compare_refuses_a_file_that_is_not_a_bench_run_in_one_line(tmp_path, capsys, case):
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps({"points": [GOOD_POINT]}))
    content = MALFORMED[case]
    bad.write_text(content if isinstance(content, str) else json.dumps(content))
    for order in ([good, bad], [bad, good]):
        err = one_line_refusal(capsys, ["bench", "compare", *map(str, order)])
        assert f"{bad}: not a 'mhaserve bench --json' file" in err
