"""The docs site builds with `mkdocs build --strict` (a broken link or a page missing from the nav fails), and
its reference pages hold every command, flag, setting and metric the code has today."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from dataclasses import fields

from mhaserve.cli.main import build_parser
from mhaserve.server.config import ServerSettings
from mhaserve.server.errors import ErrorKind
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

    errors = page("reference/errors")  # every kind, once in the table and with its messages
    for kind in ErrorKind:
        assert errors.count(f"<code>{kind.name}</code></a>") == 1 and f'id="{kind.name.lower()}"' in errors, kind
    assert "unknown model &lt;name&gt;" in errors or "unknown model '&lt;name&gt;'" in errors

    rest = page("reference/rest")
    for path in document()["paths"]:
        assert path.replace("{", "").replace("}", "") in rest.replace("{", "").replace("}", ""), path

    client = page("reference/client")  # the client API, from its docstrings
    assert "traceparent" in client and "WeightsOptions" in client and "HttpClient" in client
    client_text = re.sub(r"<[^>]+>", "", client)
    constructors = (
        'Client(\n    url: str | list[str] = "127.0.0.1:8001"',  # one server, or several
        'HttpClient(\n    url: str = "127.0.0.1:8000"',
    )
    for constructor in constructors:
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


COMMAND_BLOCKS = ("", "bash", "sh", "shell")  # fenced blocks read as commands; output is fenced as ```text


def test_every_command_block_pastes_into_bash_as_it_is():
    # An unquoted '<' or '>' is a redirection: `--slo throughput>100` pasted writes a file named 100.
    from tests.integration.test_docs_code import fenced_blocks

    pasted_wrong = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for info, code in fenced_blocks(page.read_text()):
            if info not in COMMAND_BLOCKS:
                continue
            where = f"{page.relative_to(ROOT)}: {code.splitlines()[0][:80]}"
            words = shlex.shlex(code, posix=True, punctuation_chars=True)
            words.whitespace_split = True
            try:
                redirections = [w for w in words if set(w) & set("<>") and set(w) <= set("<>&|;0123456789")]
            except ValueError as error:  # an unclosed quote: not something bash runs
                pasted_wrong.append(f"{where} ({error}; fence output as ```text)")
                continue
            if redirections:
                pasted_wrong.append(f"{where} (redirects with {' '.join(redirections)}; quote it)")
    assert not pasted_wrong, "\n".join(pasted_wrong)


def test_the_client_reference_is_complete():
    # The reference is made from the docstrings: a public call without one is missing from it.
    from mhaserve.client import AsyncClient, Client, HttpClient

    undocumented = [
        f"{cls.__name__}.{name}"
        for cls in (Client, AsyncClient, HttpClient)
        for name, member in vars(cls).items()
        if not name.startswith("_")
        and callable(getattr(member, "fget", member))
        and not getattr(getattr(member, "fget", member), "__doc__", None)
    ]
    assert not undocumented, undocumented


def test_every_environment_variable_the_code_reads_is_in_the_reference():
    import sys

    sys.path.insert(0, str(ROOT / "docs" / "hooks"))
    try:
        from reference import OTHER_ENVIRONMENT, settings_page
    finally:
        sys.path.pop(0)
    read = set()
    for folder in ("mhaserve", "server", "export", "model"):
        for source in (ROOT / folder).rglob("*.py"):
            text = source.read_text()
            read |= set(re.findall(r"""os\.environ(?:\.get\(|\[)\s*["']([A-Z_]+)["']""", text))
            read |= set(re.findall(r"""^[A-Z_]*_ENV = ["']([A-Z_]+)["']""", text, flags=re.M))
    assert read, "the scan finds what the code reads"
    page = settings_page()
    missing = sorted(name for name in read if f"`{name}`" not in page)
    assert not missing, missing
    assert {name for name, _, _ in OTHER_ENVIRONMENT} >= {"MHASERVE_CACHE", "MHASERVE_TOKEN", "MHASERVE_AUTH_TOKEN"}


def _prose(page) -> str:
    """A page's text outside its fenced blocks (sample output keeps its timestamps)."""
    from tests.integration.test_docs_code import fenced_blocks

    text = page.read_text()
    for _, code in fenced_blocks(text):
        text = text.replace(code, "")
    return text


MACHINE_CHATTER = re.compile(r"\b20\d\d-\d\d-\d\d\b|EPYC|Xeon|this project's (?:\d|machine|two)|\blent\b")


def test_the_readme_is_a_first_page_without_dates_machines_or_timings():
    readme = ROOT / "README.md"
    assert len(readme.read_text().splitlines()) <= 100
    timings = re.compile(r"\d(?:\.\d+)?\s?(?:ms|us|s)\b|\d(?:\.\d+)?x\b|requests/s|req/s")
    prose = _prose(readme)
    assert not MACHINE_CHATTER.findall(prose) and not timings.findall(prose), MACHINE_CHATTER.findall(
        prose
    ) + timings.findall(prose)
    assert "BENCHMARKS.md" in prose


def test_the_docs_pages_carry_no_dates_or_machine_names():
    said = {str(page.relative_to(ROOT)): MACHINE_CHATTER.findall(_prose(page))
            for page in sorted((ROOT / "docs").rglob("*.md"))}  # fmt: skip
    assert not any(said.values()), {page: found for page, found in said.items() if found}


def test_benchmarks_is_a_reference_whose_sections_the_code_and_docs_name():
    benchmarks = (ROOT / "BENCHMARKS.md").read_text()
    assert len(benchmarks.splitlines()) <= 800
    sections = {line[3:].strip() for line in benchmarks.splitlines() if line.startswith("## ")}
    named = []
    for path in [*ROOT.glob("*.md"), *(ROOT / "docs").rglob("*.md"), *ROOT.glob("[a-z]*/**/*.py")]:
        if ".venv" in path.parts or path.name == "BENCHMARKS.md":
            continue
        text = " ".join(path.read_text().replace("#", " ").split())  # a name may wrap over comment lines
        named += [(path.name, name) for name in re.findall(r'BENCHMARKS(?:\.md)?,? "([^"]+)"', text)]
    missing = [(where, name) for where, name in named if name not in sections]
    assert named and not missing, missing
