"""The docs site builds with `mkdocs build --strict` (a broken link or a page missing from the nav fails), and
its reference pages hold every command, flag, setting and metric the code has today."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from dataclasses import fields

from mhaserve.cli.main import build_parser
from mhaserve.server.config import ServerSettings
from mhaserve.server.metrics import Metrics
from mhaserve.server.rest.openapi import document
from tests.support import ROOT


def test_the_docs_site_builds_strict_with_every_command_setting_and_metric(tmp_path):
    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr

    def page(path: str) -> str:
        return (site / path / "index.html").read_text()

    settings = page("reference/settings")
    for setting in fields(ServerSettings):
        assert setting.metadata.get("help"), f"the setting {setting.name} has no help text"
        assert f"MHASERVE_{setting.name.upper()}" in settings and "--" + setting.name.replace("_", "-") in settings

    cli = page("reference/cli")
    (commands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    for name, command in commands.choices.items():
        assert f"mhaserve {name}" in cli
        for action in command._actions:
            assert action.help, f"mhaserve {name} {action.option_strings or action.dest} has no help text"
            for flag in action.option_strings:
                if flag.startswith("--") and (name != "serve" or action.dest not in settings):
                    assert flag in cli or flag in settings, f"{name} {flag}"

    metrics = page("reference/metrics")
    for family in Metrics().registry.collect():
        assert family.name in metrics, family.name
    assert "mhaserve_inference_request_total" in metrics

    rest = page("reference/rest")
    for path in document()["paths"]:
        assert path.replace("{", "").replace("}", "") in rest.replace("{", "").replace("}", ""), path

    client = page("reference/client")  # the client API, from its docstrings
    assert "traceparent" in client and "WeightsOptions" in client and "HttpClient" in client
    client_text = re.sub(r"<[^>]+>", "", client)
    for constructor in ('Client(\n    url: str = "127.0.0.1:8001"', 'HttpClient(\n    url: str = "127.0.0.1:8000"'):
        assert constructor in client_text.replace("&quot;", '"'), constructor

    # Placeholders shown as written (not eaten as HTML tags), no table without rows, defaults where they exist.
    assert "DIR/&lt;model&gt;/&lt;version&gt;/" in settings and "DIR///" not in settings
    assert not re.search(r"<tbody>\s*</tbody>", cli) and "DIR/NAME/&lt;n+1&gt;/" in cli
    assert re.search(r"<code>--d-model</code></td>\s*<td>512</td>", cli), "the export's --d-model default"

    # Pictures: the architecture drawn by Mermaid, and images from real runs that the pages show.
    assert 'class="mermaid"' in page("explanation/architecture")
    assert 'src="../../images/heatmap.png"' in page("tutorials/first-model")
    assert 'src="../../images/latency_percentiles.png"' in page("how-to/load-test")
    for image in ("heatmap.png", "latency_percentiles.png"):
        assert (site / "images" / image).stat().st_size > 10_000, image

    grpc_page = page("reference/grpc")
    for method in ("ModelInfer", "ModelStreamInfer", "TraceSetting", "RepositoryModelLoad"):
        assert method in grpc_page

    assert "Monitor it" in page("how-to/monitoring") and "trace_rate" in page("how-to/monitoring")
