"""The Grafana dashboard under deploy/grafana and the alerts under deploy/prometheus ask only for what a live server
exports: every metric their queries name, with the labels they match on and group by, so that neither can drift
from the metrics; and the alerts fire as their promtool unit tests say."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
import yaml

from mhaserve.client.grpc import Client
from tests.support import SMALL_D_MODEL, TEST_SERVER_ARGS, rand, scrape

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "mhaserve.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
METRIC = re.compile(r"\b(mhaserve_[a-z_]+)(\{[^}]*\})?")
LABEL = re.compile(r"([a-z_]+)\s*=~?")


def queries() -> list[str]:
    """The dashboard's panels' and variables' queries, and the alerts' expressions."""
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    variables = [v["query"]["query"] for v in dashboard["templating"]["list"] if isinstance(v.get("query"), dict)]
    alerts = [rule["expr"] for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]
    assert len(alerts) >= 6
    return panels + variables + alerts


def test_every_dashboard_and_alert_query_names_a_metric_the_server_exports(start_server, small_model_dir):
    server = start_server(small_model_dir, *TEST_SERVER_ARGS)
    with Client(server.url) as client:
        client.infer(rand(2, 8, SMALL_D_MODEL))  # a run: the histograms have buckets
        with pytest.raises(grpc.RpcError):
            client.infer(rand(1, 8, SMALL_D_MODEL + 1))
    samples = scrape(server.metrics_url)
    labels_of: dict[str, set[str]] = {}
    for name, labels in samples:
        labels_of.setdefault(name, set()).update(key for key, _ in labels)
    named = [(m.group(1), m.group(2) or "") for query in queries() for m in METRIC.finditer(query)]
    assert len({name for name, _ in named}) >= 10
    for name, matchers in named:
        assert name in labels_of, f"a query asks for {name}, which the server does not export"
        for label in LABEL.findall(matchers):
            assert label in labels_of[name], f"{name} has no label {label!r}"
    grouped = re.findall(r"by \(([^)]*)\) \(\w*\(?(mhaserve_[a-z_]+)", " ".join(queries()))
    for by, name in grouped:
        for label in (part.strip() for part in by.split(",")):
            assert label in labels_of[name], f"{name} is grouped by {label!r}, which it does not have"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="no promtool (install_prometheus.sh installs it)")
def test_the_alerts_fire_as_their_unit_tests_say():
    """promtool feeds each alert the series a server would export and checks when it fires, with which labels and
    annotations, and that it stays quiet otherwise (deploy/prometheus/alerts_test.yml)."""
    checked = subprocess.run(["promtool", "test", "rules", "alerts_test.yml"], cwd=ALERTS.parent,
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr
