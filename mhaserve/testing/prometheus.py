"""A real Prometheus (the ``prometheus`` binary on PATH) scraping one target on a free local port and evaluating the
project's alerts, and the Grafana dashboard's queries with its variables filled in: for the tests that check the
dashboard and the alerts against real data, and for the script that draws the dashboard."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

from mhaserve.server.process import free_port

PROMETHEUS = shutil.which("prometheus")
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "mhaserve.json"
ALERT_RULES = DEPLOY / "prometheus" / "alerts.yml"


def dashboard_queries(rate_interval: str = "5s") -> list[tuple[dict, list[tuple[dict, str]]]]:
    """Each panel of the dashboard with its targets' PromQL, its variables set to every model and version."""
    grafana = {"$model": ".*", "$version": ".*", "$__rate_interval": rate_interval}
    panels = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        targets = []
        for target in panel["targets"]:
            expression = target["expr"]
            for variable, value in grafana.items():
                expression = expression.replace(variable, value)
            targets.append((target, expression))
        panels.append((panel, targets))
    return panels


class Prometheus:
    def __init__(self, target: str, folder: Path, scrape_ms: int = 500):
        if PROMETHEUS is None:
            raise RuntimeError("no prometheus binary on PATH (tests/tools/install_prometheus.sh installs it)")
        config = folder / "prometheus.yml"
        config.write_text(
            f"global:\n  scrape_interval: {scrape_ms}ms\n  evaluation_interval: {scrape_ms}ms\n"
            f"rule_files: ['{ALERT_RULES}']\n"
            f"scrape_configs:\n  - job_name: mhaserve\n    static_configs:\n      - targets: ['{target}']\n"
        )
        self.url = f"http://127.0.0.1:{free_port()}"
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}",
             f"--web.listen-address={self.url.removeprefix('http://')}", "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while not self._ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.proc.stderr.read()}")
            if time.monotonic() > deadline:
                raise RuntimeError("prometheus was not ready within 30 s")
            time.sleep(0.1)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as answer:
                return answer.status == 200
        except OSError:
            return False

    def _get(self, api: str, parameters: dict) -> dict:
        with urllib.request.urlopen(f"{self.url}/api/v1/{api}?{urllib.parse.urlencode(parameters)}") as answer:
            body = json.loads(answer.read())
        if body["status"] != "success":
            raise RuntimeError(f"{parameters}: {body}")
        return body["data"]

    def query(self, expression: str, at: float | None = None) -> list[dict]:
        """The instant query's result vector."""
        return self._get("query", {"query": expression, **({"time": f"{at:.3f}"} if at is not None else {})})["result"]

    def query_range(self, expression: str, start: float, end: float, step_s: float) -> list[dict]:
        """The range query's series, each {"metric": labels, "values": [[time, "value"], ...]}."""
        parameters = {"query": expression, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step_s:g}"}
        return self._get("query_range", parameters)["result"]

    def value(self, expression: str, at: float | None = None) -> float:
        result = self.query(expression, at)
        if len(result) != 1:
            raise AssertionError((expression, result))
        return float(result[0]["value"][1])

    def wait_until(self, expression: str, expected: float, timeout: float = 20.0) -> None:
        """Until the query gives ``expected``: a scrape has seen what was sent."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expression)
            if result and float(result[0]["value"][1]) == expected:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"{expression} gave {result}, expected {expected}")
            time.sleep(0.1)

    def alerts(self, state: str = "firing") -> list[dict]:
        """The alerts of ALERT_RULES in ``state`` (firing or pending), each {"labels", "annotations", ...}."""
        with urllib.request.urlopen(f"{self.url}/api/v1/alerts") as answer:
            alerts = json.loads(answer.read())["data"]["alerts"]
        return [alert for alert in alerts if alert["state"] == state]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(20)
