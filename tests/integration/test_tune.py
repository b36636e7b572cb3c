"""``mhaserve tune`` as a user runs it: real server processes started and stopped per candidate, bench's load,
the reports and the chosen setting written, a candidate that cannot start named and passed over, Ctrl-C keeping
what was measured, and mistakes refused before any server starts."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from mhaserve.server.config import ServerSettings
from mhaserve.server.model_config import model_settings
from tests.support.browser import assert_shows_whole

SHORT = ("--duration", "0.6", "--warmup", "0.2", "--repeats", "1", "--concurrency", "2", "--processes", "1")
# Long enough that every candidate answers within its window on a machine busy with other tests.
STEADY = ("--duration", "1.2", "--warmup", "0.5", "--repeats", "1", "--concurrency", "2", "--processes", "1")


def tune(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mhaserve.cli", "tune", *args], capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def servers_of(model_dir) -> list[str]:
    """The `mhaserve serve` processes serving this folder (other tests' servers, in parallel, serve others)."""
    found = subprocess.run(["pgrep", "-af", "mhaserve.cli serve"], capture_output=True, text=True).stdout
    return [line for line in found.splitlines() if "pgrep" not in line and f"--model-dir {model_dir} " in line]


def test_tune_serves_each_candidate_and_writes_the_best_setting_under_the_slo(small_model_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(small_model_dir, model)
    done = tune(str(model), "--slo", "p99<5s", "--knobs", "max_batch_size", *STEADY, "--write-model-config",
                "--env-file", str(tmp_path / "tuned.env"), "--json", str(tmp_path / "tune.json"),
                "--report", str(tmp_path / "tune.html"))  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    page = (tmp_path / "tune.html").read_text()
    assert "data:image/png;base64," in page and "serve it:" in page and "--max-batch-size 16" in page
    assert "http://" not in page and "https://" not in page  # nothing fetched when it opens
    assert_shows_whole((tmp_path / "tune.html").as_uri(), name="tune-report")  # as a person sees it, at 1280 px
    run = json.loads((tmp_path / "tune.json").read_text())
    # the defaults (a cap of 32), then the three other caps: each served and measured once
    assert [c["flags"] for c in run["candidates"]] == [
        [], ["--max-batch-size", "4"], ["--max-batch-size", "8"], ["--max-batch-size", "16"]
    ]  # fmt: skip
    for candidate in run["candidates"]:
        assert candidate["failed"] is None and candidate["peak_rss_mib"] > 0
        assert candidate["points"][0]["requests"] > 0 and candidate["points"][0]["errors"] == 0
        assert candidate["held"], candidate["points"][0]
    assert "[4/4]" in done.stderr and "best so far" in done.stderr
    chosen = run["chosen"]
    assert chosen is not None
    # a leader other than the defaults is measured again beside them, three alternating rounds, before it is kept
    assert len(run["confirmation"]) in (0, 3)
    assert ("side by side with the defaults, 3 alternating rounds" in done.stdout) == bool(run["confirmation"])
    env = [line for line in (tmp_path / "tuned.env").read_text().splitlines() if not line.startswith("#")]
    assert env == [f"MHASERVE_{name.upper()}={str(value).lower()}" for name, value in chosen.items()]
    assert f"serve it: mhaserve serve --model-dir {model}" in done.stdout
    # the model's own configuration says the same, and a server reads it so
    written = model_settings(ServerSettings(), model)
    assert written.source == model / "config.pbtxt"
    assert {k: v for k, v in written.as_text().items() if k in chosen} == {k: str(v) for k, v in chosen.items()}
    assert servers_of(model) == []  # every candidate's server stopped
    (model / "config.pbtxt").write_text("max_batch_size: 8\n")  # a config that sets something: it would override
    again = tune(str(model), "--slo", "p99<5s", timeout=60)  # every candidate's flags
    assert again.returncode == 2 and "config.pbtxt sets how the model is served" in again.stderr


def test_a_candidate_that_cannot_start_is_named_and_the_search_goes_on(small_model_dir, tmp_path):
    # every candidate is given a flag the server refuses: each says why, and the run ends without a choice
    done = tune(str(small_model_dir), "--slo", "p99<5s", "--knobs", "dynamic_batching", *SHORT,
                "--server-flags", "--max-q-len 0", "--env-file", str(tmp_path / "tuned.env"))  # fmt: skip
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr.count("failed to start") == 2
    assert "max-q-len" in done.stderr or "max_q_len" in done.stderr
    assert "no candidate held every SLO" in done.stdout


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    return not state.startswith("Z")  # a zombie has ended


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="signals a process group")
@pytest.mark.parametrize("stop", ["ctrl-c", "sigterm"])
def test_ctrl_c_or_sigterm_stops_the_search_and_keeps_what_was_measured(small_model_dir, tmp_path, stop):
    model = tmp_path / "model"  # a folder of its own: its servers told apart from other tests'
    shutil.copytree(small_model_dir, model)
    process = subprocess.Popen(
        [sys.executable, "-m", "mhaserve.cli", "tune", str(model), "--slo", "p99<5s", *SHORT,
         "--json", str(tmp_path / "tune.json"), "--env-file", str(tmp_path / "tuned.env")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    progress = []
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        line = process.stderr.readline()
        progress.append(line)
        if line.startswith("[2/"):
            break
    children = [int(pid) for pid in subprocess.run(["pgrep", "-P", str(process.pid)], capture_output=True,
                                                    text=True).stdout.split()]  # fmt: skip
    if stop == "ctrl-c":
        os.killpg(process.pid, signal.SIGINT)  # as a terminal's Ctrl-C reaches the whole foreground group
    else:
        process.send_signal(signal.SIGTERM)  # as a supervisor stops it: the command alone
    out, err = process.communicate(timeout=120)
    left = children  # its server, client processes and their resource tracker end (the tracker once it sees EOF)
    deadline = time.monotonic() + 10
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [pid for pid in left if alive(pid)]
    assert children and not left, subprocess.run(["ps", "-o", "pid,stat,args", "-p", ",".join(map(str, left))],
                                                 capture_output=True, text=True).stdout  # fmt: skip
    assert process.returncode == 130, "".join(progress) + err
    assert "stopped after 2 candidates" in err
    run = json.loads((tmp_path / "tune.json").read_text())
    assert run["stopped_early"] and len(run["candidates"]) == 2
    assert "(quick search, stopped early)" in out
    assert servers_of(model) == []


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ((), "give at least one --slo"),
        (("--slo", "p99<<1"), "expected p50, p90"),
        (("--slo", "p99<1s", "--knobs", "warp_drive"), "expected names among max_queue_delay_us"),
        (("--slo", "p99<1s", "--env-file", "/no/such/folder/tuned.env"), "the folder /no/such/folder does not exist"),
        (("--slo", "p99<1s", "--repeats", "0"), "argument --repeats: expected a whole number of at least 1, got '0'"),
        (("/no/such/model", "--slo", "p99<1s"), "no such folder"),
    ],
)
def test_mistakes_are_one_line_and_exit_2_before_any_server_starts(args, says):
    started = time.monotonic()
    done = tune(*args, timeout=60)
    assert done.returncode == 2, done.stderr
    said, *rest = done.stderr.strip().splitlines()
    assert says in said and rest in ([], ["(the flags: mhaserve tune --help)"]), done.stderr  # argparse adds the help
    assert time.monotonic() - started < 30


def test_other_exports_of_the_model_are_a_knob_and_another_model_s_is_left_out(exported, small_module,
                                                                              small_model_dir, tmp_path):  # fmt: skip
    from mhaserve.model import seeded_module

    fp16 = exported.folder("fp16", small_module, precision="fp16")
    wider = exported.folder("wide", seeded_module(96, 6, seed=3))
    done = tune(str(small_model_dir), "--also-model", str(fp16), "--also-model", str(wider), "--slo", "p99<5s",
                "--knobs", "model_dir", *SHORT, "--json", str(tmp_path / "tune.json"),
                "--env-file", str(tmp_path / "tuned.env"))  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"{wider}: not an export of the same model and shape" in done.stderr
    run = json.loads((tmp_path / "tune.json").read_text())
    assert [c["flags"] for c in run["candidates"]] == [[], ["--model-dir", str(fp16)]]
    assert all(c["held"] and c["points"][0]["errors"] == 0 for c in run["candidates"])


@pytest.mark.perf
def test_tune_says_what_it_will_do_within_two_seconds(small_model_dir, tmp_path):
    started = time.monotonic()
    process = subprocess.Popen([sys.executable, "-m", "mhaserve.cli", "tune", "--model-dir", str(small_model_dir),
                                "--slo", "p99<5s", *SHORT, "--env-file", str(tmp_path / "tuned.env")],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        first = process.stderr.readline()
        took = time.monotonic() - started
    finally:
        process.send_signal(signal.SIGINT)  # stops the search and reports what was measured
        process.communicate(timeout=60)
    assert first.startswith("mhaserve tune: quick search over") and "about" in first, first
    assert took < 2, f"the first line came {took:.1f} s after the command"
