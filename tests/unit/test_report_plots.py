"""The plots of bench's and tune's reports draw what their legends name: each SLO on its own percentile's curve, in
a line style of its own and labelled; tune's candidates numbered as its table ranks them, and no legend entry for
what is not drawn."""

from __future__ import annotations

import numpy as np

from mhaserve.loadtest.loadgen import Point, PointResult, Workload
from mhaserve.loadtest.report import percentile_figure
from mhaserve.loadtest.slo import parse_slo
from mhaserve.loadtest.tune import Candidate, Measured
from mhaserve.loadtest.tune_report import TuneRun

WORKLOAD = Workload(512)


def point_result(load: int, p99_ms: float) -> PointResult:
    latencies = {"p50": p99_ms / 2, "p90": p99_ms * 0.8, "p95": p99_ms * 0.9, "p99": p99_ms, "p99.9": p99_ms * 1.2,
                 "max": p99_ms * 1.5, "mean": p99_ms / 2}  # fmt: skip
    return PointResult(Point("closed", load, 1.0, 0.0), WORKLOAD, 1, 100 * load, 100.0 * load, latencies, {}, {},
                       0.1, False, 0.0, 0, np.full(3, p99_ms))  # fmt: skip


def test_each_latency_slo_is_drawn_on_its_own_percentiles_curve_and_each_slo_reads_apart():
    slos = [parse_slo("p95<10ms"), parse_slo("p99<15ms")]
    figure = percentile_figure([point_result(1, 2.0), point_result(16, 20.0)], "title", slos)
    by_throughput = figure.axes[0]
    lines = {line.get_label(): line for line in by_throughput.get_lines()}
    assert "p95" in lines  # plotted because an SLO names it (the usual curves are p50, p90, p99, max)
    p95_slo, p99_slo = lines["SLO p95<10ms (the p95 curve)"], lines["SLO p99<15ms (the p99 curve)"]
    assert p95_slo.get_color() == lines["p95"].get_color() and p99_slo.get_color() == lines["p99"].get_color()
    assert p95_slo.get_linestyle() != p99_slo.get_linestyle()
    legend = [text.get_text() for text in by_throughput.get_legend().get_texts()]
    assert "SLO p95<10ms (the p95 curve)" in legend and "SLO p99<15ms (the p99 curve)" in legend


def test_a_latency_slo_far_above_every_point_is_named_not_drawn():
    figure = percentile_figure([point_result(1, 2.0), point_result(16, 20.0)], "title", [parse_slo("p99<60s")])
    by_throughput = figure.axes[0]
    assert by_throughput.get_ylim()[1] < 100  # the curves keep the plot's height
    legend = [text.get_text() for text in by_throughput.get_legend().get_texts()]
    assert "SLO p99<60s (the p99 curve, above the plot)" in legend


def measured(candidate: Candidate, throughput: float, p99_ms: float, slo) -> Measured:
    point = point_result(16, p99_ms)
    point.throughput = throughput
    return Measured(candidate, [point], [slo.held(point)], [slo.miss(point)], peak_rss_mib=200.0)


def test_tunes_plot_numbers_its_candidates_and_its_legend_names_only_what_is_drawn():
    slo = parse_slo("p99<20ms")
    searched = [measured(Candidate(()), 1000.0, 12.0, slo), measured(Candidate((("max_batch_size", 8),)), 900.0,
                                                                      10.0, slo)]  # fmt: skip
    run = TuneRun(searched, [slo], [Point("closed", 16, 1.0, 0.0)], WORKLOAD, "quick", "--model-dir m", False, [])
    axes = run.plot_figure().axes[0]
    legend = [text.get_text() for text in axes.get_legend().get_texts()]
    assert "SLO held" in legend and "SLO missed" not in legend  # every candidate held it: no red dots
    assert "throughput-p99 front" in legend  # two candidates on it: a line is drawn
    assert sorted(a.get_text() for a in axes.texts) == ["1", "2"]  # as the table ranks them
    alone = TuneRun(searched[:1], [slo], run.points, WORKLOAD, "quick", "--model-dir m", False, [])
    legend = [text.get_text() for text in alone.plot_figure().axes[0].get_legend().get_texts()]
    assert "throughput-p99 front" not in legend  # one point: no line to draw


def test_tunes_html_report_carries_the_commands_verdict_lines(tmp_path):
    slo = parse_slo("p99<20ms")
    missed = TuneRun([measured(Candidate(()), 1000.0, 30.0, slo)], [slo], [Point("closed", 16, 1.0, 0.0)], WORKLOAD,
                     "quick", "--model-dir m", False, ["mhaserve", "tune"])  # fmt: skip
    missed.write_html(tmp_path / "tune.html")
    page = (tmp_path / "tune.html").read_text()
    closest = [line for line in missed.lines() if line.startswith("no candidate held every SLO")]
    assert closest and "the closest, (defaults), 1.50 times its target" in closest[0]
    assert f"<li>{closest[0]}</li>" in page
