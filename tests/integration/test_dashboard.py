"""The Grafana dashboard under deploy/grafana asks only for what a live server exports: every metric its queries
name, with the labels they match on, so the dashboard cannot drift from the metrics."""

from __future__ import annotations

import json
import re
from pathlib import Path

import grpc
import pytest

from mhaserve.client.grpc import Client
from tests.support import SMALL_D_MODEL, TEST_SERVER_ARGS, rand, scrape

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "mhaserve.json"
METRIC = re.compile(r"\b(mhaserve_[a-z_]+)(\{[^}]*\})?")
LABEL = re.compile(r"([a-z_]+)\s*=~?")


def queries(dashboard: dict) -> list[str]:
    panels = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    variables = [v["query"]["query"] for v in dashboard["templating"]["list"] if isinstance(v.get("query"), dict)]
    return panels + variables


def test_every_dashboard_query_names_a_metric_the_server_exports(start_server, small_model_dir):
    server = start_server(small_model_dir, *TEST_SERVER_ARGS)
    with Client(server.url) as client:
        client.infer(rand(2, 8, SMALL_D_MODEL))  # a run: the histograms have buckets
        with pytest.raises(grpc.RpcError):
            client.infer(rand(1, 8, SMALL_D_MODEL + 1))
    samples = scrape(server.metrics_url)
    labels_of: dict[str, set[str]] = {}
    for name, labels in samples:
        labels_of.setdefault(name, set()).update(key for key, _ in labels)
    dashboard = json.loads(DASHBOARD.read_text())
    named = [(m.group(1), m.group(2) or "") for query in queries(dashboard) for m in METRIC.finditer(query)]
    assert len({name for name, _ in named}) >= 10
    for name, matchers in named:
        assert name in labels_of, f"the dashboard asks for {name}, which the server does not export"
        for label in LABEL.findall(matchers):
            assert label in labels_of[name], f"{name} has no label {label!r}"
    grouped = re.findall(r"by \(([^)]*)\) \(\w*\(?(mhaserve_[a-z_]+)", " ".join(queries(dashboard)))
    for by, name in grouped:
        for label in (part.strip() for part in by.split(",")):
            assert label in labels_of[name], f"{name} is grouped by {label!r}, which it does not have"
