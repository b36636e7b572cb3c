"""`mhaserve bench` against a real server: closed and open loop, errors counted by status, JSON, CSV, plots."""

from __future__ import annotations

import base64
import csv
import json
import re
import subprocess
import sys

import pytest

from tests.support import SMALL_D_MODEL, scrape
from tests.support.browser import assert_shows_whole

SHORT = ("--duration", "1", "--warmup", "0.3", "--processes", "2")


def bench(server, *args, timeout=120):
    command = [sys.executable, "-m", "mhaserve.cli", "bench", "--url", server.url, *SHORT, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def test_closed_loop_sweep_writes_table_json_csv_and_plots(server, tmp_path):
    done = bench(
        server, "--concurrency", "1,4", "--lengths", "4..32", "--json", str(tmp_path / "r.json"),
        "--csv", str(tmp_path / "r.csv"), "--plot-dir", str(tmp_path / "plots"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "concurrency 1" in done.stdout and "concurrency 4" in done.stdout and "p99 ms" in done.stdout
    assert "[2/2] concurrency 4" in done.stderr  # progress
    report = json.loads((tmp_path / "r.json").read_text())
    points = report["points"]
    assert [p["load"] for p in points] == [1, 4]
    for p in points:
        assert p["mode"] == "closed" and p["shape"] == "[1,4..32,64]" and p["errors"] == 0
        assert p["requests"] > 0 and p["throughput_per_s"] > 0
        assert 0 < p["p50_ms"] <= p["p90_ms"] <= p["p95_ms"] <= p["p99_ms"] <= p["max_ms"]
        assert p["client_cpu_cores"] > 0
    assert points[1]["processes"] == 2 and points[0]["processes"] == 1  # one caller needs one process
    rows = list(csv.DictReader((tmp_path / "r.csv").open()))
    assert [float(r["load"]) for r in rows] == [1, 4]
    for name in ("latency_percentiles.png", "latency_histogram.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_open_loop_holds_the_offered_rate(server, tmp_path):
    done = bench(server, "--rate", "50", "--no-weights", "--json", str(tmp_path / "r.json"))
    assert done.returncode == 0, done.stderr
    (point,) = json.loads((tmp_path / "r.json").read_text())["points"]
    assert point["mode"] == "open" and point["attn_weights"] is False and point["errors"] == 0
    # 50/s for 1 s: the schedule, not the server, sets the count (a few land outside the window).
    assert 40 <= point["requests"] <= 55, point


def test_refused_requests_are_counted_by_status(server, tmp_path):
    # The session server allows batch 8: every batch-9 request is RESOURCE_EXHAUSTED.
    done = bench(server, "--concurrency", "2", "--batch", "9", "--json", str(tmp_path / "r.json"))
    assert done.returncode == 0, done.stderr
    (point,) = json.loads((tmp_path / "r.json").read_text())["points"]
    assert point["requests"] == 0 and point["errors"] > 0
    assert set(point["errors_by_status"]) == {"RESOURCE_EXHAUSTED"}
    # said before the sweep, with the limit and the flag that raises it
    said = "note: --batch asks for up to 9, past the server's max_batch_size of 8 (serve --max-batch-size raises it)"
    assert said in done.stderr
    assert "RESOURCE_EXHAUSTED:" in done.stdout
    # How fast refusals come back is reported too: the figure behind "fast RESOURCE_EXHAUSTED".
    refused = point["error_latency_ms"]["RESOURCE_EXHAUSTED"]
    assert 0 < refused["p50"] <= refused["p99"] <= refused["max"]
    assert f"{point['errors']} RESOURCE_EXHAUSTED answered in p50" in done.stdout
    # and why, in the server's words, so that a run's errors can be acted on
    said = point["error_details"]["RESOURCE_EXHAUSTED"]
    assert "max_batch_size" in said and f"the first said: {said}" in done.stdout


def test_an_slo_that_cannot_hold_exits_1_naming_it_and_one_that_holds_exits_0(server, tmp_path):
    missed = bench(server, "--concurrency", "1", "--slo", "p50<0.001ms", "--slo", "errors<1%")
    assert missed.returncode == 1, missed.stderr
    assert "p50<0.001ms MISSED" in missed.stdout and "errors<1% held (0.00%)" in missed.stdout
    assert "SLO missed: p50<0.001ms at concurrency 1" in missed.stdout
    # As k6 ends a run: a line per SLO, PASS or FAIL with its worst point, then the run's.
    assert "FAIL  p50<0.001ms  (worst: " in missed.stdout and "PASS  errors<1%  (worst: 0.00% at concurrency 1)" in (
        missed.stdout
    )
    assert missed.stdout.rstrip().splitlines()[-2] == "FAIL: 1 of 2 SLOs held"
    held = bench(server, "--concurrency", "1,2", "--slo", "p99.9<60s", "--slo", "throughput>1",
                 "--json", str(tmp_path / "r.json"))  # fmt: skip
    assert held.returncode == 0 and "SLO held at every point: p99.9<60s, throughput>1" in held.stdout, held.stdout
    points = json.loads((tmp_path / "r.json").read_text())["points"]
    for point in points:
        assert [v["held"] for v in point["slo"]] == [True, True]
        # Goodput: every request answered within 60 s counts.
        assert point["goodput_per_s"] == point["requests"] / point["duration_s"]


def test_a_bad_slo_is_one_line_and_exit_code_2(server):
    done = bench(server, "--slo", "p42<3ms")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "expected p50, p90, p95, p99 or p99.9" in lines[0], done.stderr


def test_the_json_records_what_was_run_and_the_high_tail(server, tmp_path):
    done = bench(server, "--concurrency", "1", "--json", str(tmp_path / "r.json"))
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    meta, (point,) = report["meta"], report["points"]
    assert (
        meta["date_utc"].endswith("+00:00")
        and meta["mhaserve"]
        and meta["command"][-2:] == ["--json", str(tmp_path / "r.json")]
    )
    assert meta["client_host"]["cores"] >= 1 and meta["client_host"]["cpu"]
    assert meta["model"]["name"] == "mha" and meta["model"]["versions"] == ["1"]
    assert meta["model"]["precision"] == "fp32"
    # How the server runs the model, as its configuration says: the provider and the settings it was started with.
    served_with = meta["model"]["served_with"]
    assert served_with["provider"] == "CPUExecutionProvider" and served_with["max_batch_size"] == "8"
    assert served_with["dynamic_batching"] == "true" and int(served_with["intra_op_threads"]) >= 1
    assert point["p99_ms"] <= point["p99.9_ms"] <= point["max_ms"]
    assert "p99.9 ms" in done.stdout


def test_each_point_has_the_servers_queue_and_compute_within_the_clients_latency(server, tmp_path):
    http = server.http_url.removeprefix("http://")
    for protocol, url in (("grpc", server.url), ("http", http)):
        out = tmp_path / f"{protocol}.json"
        command = [sys.executable, "-m", "mhaserve.cli", "bench", "--url", url, "--protocol", protocol, *SHORT,
                   "--concurrency", "2", "--lengths", "8..32", "--json", str(out),
                   "--csv", str(tmp_path / "r.csv")]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        (point,) = json.loads(out.read_text())["points"]
        side = point["server"]
        # A run is counted when it ends, its requests once answered: at each edge of the window a run of each
        # caller's may be counted without its request.
        assert side["requests"] > 0 and side["rows_per_run"] >= side["requests"] / (side["requests"] + 2 * 2)
        stages = side["queue_ms"] + side["compute_input_ms"] + side["compute_infer_ms"] + side["compute_output_ms"]
        assert 0 < stages <= side["server_ms"] * 1.001 + 1e-3  # the stages are parts of the server's time
        assert stages < point["mean_ms"]  # queue and compute lie inside the client's latency
        assert side["transport_and_client_ms"] == pytest.approx(point["mean_ms"] - side["server_ms"], abs=1e-3)
        assert "server side at concurrency 2: " in done.stdout and " a request (" in done.stdout
        (row,) = csv.DictReader((tmp_path / "r.csv").open())
        assert float(row["server_compute_infer_ms"]) == pytest.approx(side["compute_infer_ms"], rel=1e-3)


def test_rounds_give_each_figure_its_spread_and_compare_says_what_differs_beyond_it(server, tmp_path):
    for name in ("a", "b"):
        done = bench(server, "--concurrency", "2", "--rounds", "2", "--json", str(tmp_path / f"{name}.json"))
        assert done.returncode == 0, done.stderr
        assert "mhaserve bench: " in done.stderr and "1 points x 2 rounds x (" in done.stderr  # the whole run's time
    (point,) = json.loads((tmp_path / "b.json").read_text())["points"]
    # The rounds line gives the table's figures (the median round's), each with its spread over the rounds.
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("rounds at concurrency 2: 2; ")]
    shown = {name: float(number) for name, number in re.findall(r"(req/s|p99) ([\d.]+) \[", line)}
    # the JSON keeps 2 and 4 decimals, the line 3: equal to the last digit either shows
    assert shown["req/s"] == pytest.approx(point["throughput_per_s"], abs=6e-3), line
    assert shown["p99"] == pytest.approx(point["p99_ms"], abs=6e-4), line
    rounds = point["rounds"]
    assert rounds["n"] == 2 and len(rounds["throughput_per_s"]["rounds"]) == 2
    low, high = rounds["p99_ms"]["interval"]
    assert low <= rounds["p99_ms"]["median"] <= high
    assert point["throughput_per_s"] == pytest.approx(min(rounds["throughput_per_s"]["rounds"]), rel=1e-2)
    compare = [
        sys.executable,
        "-m",
        "mhaserve.cli",
        "bench",
        "compare",
        str(tmp_path / "a.json"),
        str(tmp_path / "b.json"),
    ]
    done = subprocess.run(compare, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("concurrency 2 [1,16,64]")]
    assert "req/s " in line and "p50 " in line and "p99 " in line
    assert line.count("within noise") + line.count("beyond noise") == 3
    # The ratio is the two runs' figures, divided: b's throughput over a's.
    a, b = (json.loads((tmp_path / f"{n}.json").read_text())["points"][0]["rounds"] for n in "ab")
    ratio = float(re.search(r"req/s (\d+\.\d+) ", line).group(1))
    assert ratio == pytest.approx(b["throughput_per_s"]["median"] / a["throughput_per_s"]["median"], abs=0.006)
    # Several runs against the first: b, then a against itself (every ratio 1.00, within noise).
    several = subprocess.run([*compare, str(tmp_path / "a.json")], capture_output=True, text=True, timeout=60)
    assert several.returncode == 0, several.stderr
    assert f"{tmp_path / 'b.json'} against {tmp_path / 'a.json'}" in several.stdout
    itself = several.stdout.split(f"{tmp_path / 'a.json'} against {tmp_path / 'a.json'}")[1]
    (line,) = [line for line in itself.splitlines() if line.startswith("concurrency 2 [1,16,64]")]
    assert line.count(" 1.00 (") == 3 and line.count("within noise") == 3, line
    wrong = subprocess.run([*compare[:5], str(tmp_path / "a.json")], capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 2 and wrong.stderr.strip().count("\n") == 0 and "Traceback" not in wrong.stderr


def test_the_html_report_holds_the_run_the_verdicts_the_server_side_and_the_plots_and_loads_nothing(server, tmp_path):
    report = tmp_path / "report.html"
    done = bench(server, "--concurrency", "1,2", "--slo", "p99<60s", "--slo", "p50<0.001ms", "--report", str(report))
    assert done.returncode == 1, done.stderr  # the impossible p50 target is missed: the gate still writes the report
    page = report.read_text()
    assert page.startswith("<!DOCTYPE html>") and f"wrote {report}" in done.stderr
    assert "provider=CPUExecutionProvider" in page and "max_batch_size=8" in page  # how the server ran it
    for label in ("concurrency 1", "concurrency 2"):
        assert page.count(f">{label}</td>") == 3  # in the table, the SLO verdicts and the server's side
    assert page.count("p99&lt;60s held") == 2 and page.count("p50&lt;0.001ms MISSED") == 2
    # The verdict first: the run's, then each SLO's with its worst point.
    assert page.index('<div class="verdict fail">FAIL: 1 of 2 SLOs held at every point') < page.index("<h2>The run")
    assert "<li>PASS p99&lt;60s (worst: " in page and "<li>FAIL p50&lt;0.001ms (worst: " in page
    assert "compute infer ms" in page and "transport and client ms" in page
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(images) == 2 and all(base64.b64decode(i)[:8] == b"\x89PNG\r\n\x1a\n" for i in images)
    # Self-contained: nothing a browser would fetch.
    assert not re.search(r"""(src|href)\s*=\s*["'](?!data:)""", page)
    assert not re.search(r"<script|<link|@import|url\(", page)
    assert_shows_whole(report.as_uri(), name="bench-report")  # as a person sees it, at 1280 px


def test_sequences_are_grown_a_row_a_step_with_each_steps_latency_by_position_and_ended(server, tmp_path):
    live, steps = ("mhaserve_sequences_live", ()), ("mhaserve_sequence_steps_total", ())
    before = scrape(server.metrics_url)
    done = bench(server, "--sequence", "40", "--concurrency", "2", "--no-weights", "--json", str(tmp_path / "r.json"),
                 "--csv", str(tmp_path / "r.csv"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    (point,) = json.loads((tmp_path / "r.json").read_text())["points"]
    assert point["shape"] == "[1,1,64] steps to 40" and point["errors"] == 0
    by_position = point["by_position"]
    assert list(by_position) == ["1-16", "17-40"]
    assert sum(f["steps"] for f in by_position.values()) == point["requests"]  # every step has its position
    for figures in by_position.values():
        assert figures["steps"] > 0 and 0 < figures["p50"] <= figures["p99"]
    assert "steps at concurrency 2 by position: 1-16 p50 " in done.stdout
    (row,) = csv.DictReader((tmp_path / "r.csv").open())
    assert json.loads(row["by_position"]) == by_position
    # Each caller ended the sequence it was growing when the run ended: none is left holding memory.
    after = scrape(server.metrics_url)
    assert after[live] == before[live]
    assert after[steps] - before[steps] >= point["requests"]


def test_a_sequence_run_is_closed_loop_only():
    done = subprocess.run([sys.executable, "-m", "mhaserve.cli", "bench", "--sequence", "40", "--rate", "10"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2 and "give --concurrency, not --rate" in done.stderr
    assert done.stderr.strip().count("\n") == 0


def test_the_server_side_covers_the_window_when_its_first_read_comes_after_the_window_would_have_ended(server):
    """On a loaded machine the read of the server's counters at the window's start can come late: the client
    processes warm up until it is done, so the window is measured whole between the two reads."""
    import time

    from mhaserve.client.grpc import Client
    from mhaserve.loadtest.loadgen import LoadGenerator, Point, Workload
    from mhaserve.loadtest.server_side import counters_of

    with Client(server.url) as client:
        read = counters_of(client)
        reads = []

        def late_read() -> dict:
            if not reads:
                time.sleep(1.5)  # longer than the whole window
            answer = read()
            reads.append((time.monotonic(), answer["inference_stats"]["success"]))
            return answer

        with LoadGenerator(server.url, 2, counters=late_read) as load:
            result = load.measure(Workload(SMALL_D_MODEL, 1, 4, 4), Point("closed", 2, 1.0, 0.2))
    assert result.server is not None, (result.server_unread, reads, result.count)
    assert result.server["requests"] >= result.count > 0  # every request measured was between the reads


def test_a_server_side_that_could_not_be_read_is_said_not_dropped(server):
    from mhaserve.loadtest.loadgen import LoadGenerator, Point, Workload
    from mhaserve.loadtest.report import notes

    def unreachable() -> dict:
        raise ConnectionError("the statistics endpoint is gone")

    with LoadGenerator(server.url, 1, counters=unreachable) as load:
        result = load.measure(Workload(SMALL_D_MODEL, 1, 4, 4), Point("closed", 1, 0.5, 0.1))
    assert result.count > 0 and result.server is None  # the point stands without the server's side
    said = "server side at concurrency 1: not read, its statistics could not be read: ConnectionError: the statistics"
    assert said + " endpoint is gone" in notes([result])


@pytest.mark.parametrize("faithful", [True, False], ids=["faithful", "drifted"])
def test_the_server_s_live_parity_is_reported_beside_latency_and_gated(start_server, small_model_dir, tmp_path,
                                                                        faithful):  # fmt: skip
    from tests.support.exports import drifted_copy

    model_dir = small_model_dir if faithful else drifted_copy(small_model_dir, tmp_path / "drifted")
    server = start_server(model_dir, "--parity-share", "1", "--output-only-graph", "false")
    done = bench(server, "--concurrency", "1", "--slo", "breaches=0", "--json", str(tmp_path / "r.json"))
    run = json.loads((tmp_path / "r.json").read_text())
    parity, (point,) = run["meta"]["parity"], run["points"]
    assert parity["checked"] > 0 and parity["dropped"] >= 0, parity
    assert f"Live parity over the run: {parity['checked']} answers checked against float64" in done.stdout
    if faithful:
        assert done.returncode == 0 and parity["breached"] == 0 and 0 < parity["worst_error"]["output"] < 1e-5
        assert "breaches=0 held (0 breached)" in done.stdout and "PASS  breaches=0" in done.stdout
    else:
        assert done.returncode == 1 and parity["breached"] == parity["checked"], done.stdout
        assert f"breaches=0 MISSED ({point['server']['parity']['breached']} breached)" in done.stdout


def test_a_parity_gate_on_a_server_that_checks_nothing_is_missed_saying_why(server):
    done = bench(server, "--concurrency", "1", "--slo", "breaches=0")
    assert done.returncode == 1, done.stdout
    assert "breaches=0 MISSED (no answer checked (serve with --parity-share))" in done.stdout
    assert "Live parity: the server checked none of these answers" in done.stdout
    bad = bench(server, "--slo", "breaches<0")
    assert bad.returncode == 2 and "a parity target reads like breaches=0" in bad.stderr, bad.stderr


def test_bench_and_infer_send_the_priority_level_they_are_given(start_server, small_model_dir, tmp_path):
    # Level 1 may wait 1 ms, the default level (2) without bound: a request reaches level 1 only by its priority.
    server = start_server(small_model_dir, "--max-queue-delay-us", "1000000", "--priority-levels", "2",
                          "--default-priority-level", "2", "--priority-queue-policy",
                          "1:default_timeout_microseconds=1000", "--warmup-runs", "0")  # fmt: skip
    done = bench(server, "--protocol", "http", "--url", server.http_url.removeprefix("http://"), "--concurrency", "1",
                 "--priority", "1", "--json", str(tmp_path / "r.json"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    (point,) = json.loads((tmp_path / "r.json").read_text())["points"]
    assert point["shape"] == "[1,16,64] at priority 1" and point["requests"] == 0
    assert "(priority level 1's, --priority-queue-policy)" in point["error_details"]["UNAVAILABLE"]
    infer = [sys.executable, "-m", "mhaserve.cli", "infer", "--url", server.url, "--q-len", "2"]
    refused = subprocess.run([*infer, "--priority", "1"], capture_output=True, text=True, timeout=60)
    served = subprocess.run(infer, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "(priority level 1's, --priority-queue-policy)" in refused.stderr
    assert served.returncode == 0, served.stderr
