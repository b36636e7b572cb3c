"""A real Prometheus (Debian's, installed by tests/tools/install_prometheus.sh) scraping a real server under load:
the counters it stores and the rate PromQL computes agree with the requests sent, every query of the Grafana
dashboard evaluates on it to data, and the alerts of deploy/prometheus/alerts.yml stay quiet on a healthy server
and fire on one whose answers drift."""

from __future__ import annotations

import concurrent.futures
import json
import re
import time
import urllib.parse
import urllib.request

import pytest

from mhaserve.client.grpc import Client
from mhaserve.testing.prometheus import PROMETHEUS, Prometheus, dashboard_queries
from tests.support import SMALL_D_MODEL, TEST_SERVER_ARGS, parity_checks, rand
from tests.support.exports import drifted_copy

SCRAPE_MS = 500
SCRAPE_S = SCRAPE_MS / 1000

pytestmark = pytest.mark.skipif(
    PROMETHEUS is None, reason="no prometheus binary: tests/tools/install_prometheus.sh could not install it"
)


def scraping(server, folder) -> Prometheus:
    target = server.metrics_url.removeprefix("http://").removesuffix("/metrics")
    prometheus = Prometheus(target, folder, SCRAPE_MS)
    prometheus.wait_until('up{job="mhaserve"}', 1)
    return prometheus


@pytest.fixture
def scraped_server(start_server, small_model_dir, tmp_path):
    # Every answer checked for parity, so that the dashboard's parity panel has data too.
    server = start_server(small_model_dir, *TEST_SERVER_ARGS, "--parity-share", "1")
    prometheus = scraping(server, tmp_path)
    yield server, prometheus
    prometheus.stop()


def wait_for_scrapes(count: int = 3) -> None:
    time.sleep(count * SCRAPE_S + 0.2)


@pytest.mark.perf
def test_prometheus_counts_and_rates_match_the_requests_sent(scraped_server):
    server, prometheus = scraped_server
    ok = 'sum(mhaserve_inference_request_total{model="mha", status="OK"})'
    with Client(server.url) as client:
        client.infer(rand(1, 4, SMALL_D_MODEL))  # the series exists (at 1) before the load begins
    prometheus.wait_until(ok, 1)
    wait_for_scrapes()  # samples at 1 before the load
    began = time.time()

    def caller(index: int) -> int:
        sent = 0
        with Client(server.url) as client:
            while time.time() < began + 4:
                client.infer(rand(1, 4 + index, SMALL_D_MODEL, seed=index), attn_weights=False)
                sent += 1
        return sent

    with concurrent.futures.ThreadPoolExecutor(4) as callers:
        sent = sum(callers.map(caller, range(4)))
    ended = time.time()
    prometheus.wait_until(ok, 1 + sent)  # every request counted, none twice
    wait_for_scrapes()
    assert prometheus.value(ok) == 1 + sent
    window = round(ended - began + 4 * SCRAPE_S)
    now = time.time()
    increase = prometheus.value(f'sum(increase(mhaserve_inference_request_total{{status="OK"}}[{window}s]))', now)
    rate = prometheus.value(f'sum(rate(mhaserve_inference_request_total{{status="OK"}}[{window}s]))', now)
    print(
        f"\n{sent} requests in {ended - began:.1f} s; PromQL increase {increase:.1f}, rate {rate:.1f}/s over {window} s"
    )
    assert abs(increase - sent) <= 0.2 * sent  # PromQL extrapolates to the window's edges
    assert rate == pytest.approx(increase / window, rel=1e-6)
    latency_p50 = prometheus.value(
        f"histogram_quantile(0.5, sum by (le) (rate(mhaserve_inference_request_duration_seconds_bucket[{window}s])))"
    )
    assert 0 < latency_p50 < 5


def test_every_dashboard_query_evaluates_to_data_on_a_real_prometheus(scraped_server):
    server, prometheus = scraped_server
    with Client(server.url) as client:
        for _ in range(3):
            deadline = time.time() + 1.2
            while time.time() < deadline:
                client.infer(rand(2, 8, SMALL_D_MODEL))
            wait_for_scrapes(1)
    wait_for_scrapes()
    for panel, targets in dashboard_queries():
        for _, expression in targets:
            result = prometheus.query(expression)
            if "unauthenticated" in expression:
                continue  # nothing was refused: no series, and that is right
            assert result, f"panel {panel['title']!r}: {expression} gave no data"
            assert all(sample["value"][1] not in ("NaN", "+Inf") for sample in result), (panel["title"], result)
    with urllib.request.urlopen(f"{prometheus.url}/api/v1/label/model/values") as answer:
        assert json.loads(answer.read())["data"] == ["mha"]  # what the dashboard's model variable lists
    # Every answer held, none refused: no alert fires. Every answer was chosen for a check, and on a busy host most
    # checks may drop: the alert for that is on its way (it waits 10 minutes) where over half of them did.
    counted = parity_checks(server)
    assert counted["breached"] == 0 and prometheus.alerts("firing") == []
    pending = [alert["labels"]["alertname"] for alert in prometheus.alerts("pending")]
    dropped = counted["dropped"] / sum(counted.values())
    if dropped > 0.6:
        assert pending == ["MhaserveParityChecksDropped"], (counted, pending)
    else:
        assert set(pending) <= ({"MhaserveParityChecksDropped"} if dropped > 0.4 else set()), (counted, pending)


def test_answers_that_drift_from_the_module_fire_the_parity_alert(start_server, small_model_dir, tmp_path):
    """A graph whose scaling is 1% off, its weights those of the export: its checked answers breach, and the
    parity alert fires for its model and version, and it alone."""
    server = start_server(drifted_copy(small_model_dir, tmp_path / "drifted"), *TEST_SERVER_ARGS, "--parity-share", "1")
    prometheus = scraping(server, tmp_path)
    try:
        wait_for_scrapes()  # the breach counter seen at 0 first, so that its increase counts the first breaches
        with Client(server.url) as client:
            for seed in range(4):
                client.infer(rand(2, 9, SMALL_D_MODEL, seed=seed))
        deadline = time.monotonic() + 30
        while not (firing := prometheus.alerts("firing")) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        prometheus.stop()
    assert parity_checks(server)["breached"] == 4
    assert [alert["labels"]["alertname"] for alert in firing] == ["MhaserveParityBreached"], firing
    (alert,) = firing
    labels = alert["labels"]
    assert (labels["model"], labels["version"], labels["severity"]) == ("mha", "1", "critical")
    assert alert["annotations"]["summary"] == "Model mha version 1 answered outside the export's tolerance"
    # how many, as PromQL's increase() extrapolates them over the window
    assert re.match(r"[1-9]\d* checked answers in the last 10 minutes", alert["annotations"]["description"]), alert
