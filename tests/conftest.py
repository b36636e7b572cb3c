"""Fixtures: small seeded models and their exports, made once per test session (per worker under -n), and
real servers: in the test's process (``start_server``), or in a process of their own where the process is the
point (``start_server_process``: signals, exit codes, memory as RSS, environment variables).

Tests sit by scope: ``unit`` runs in process and fast, ``export`` exports real modules and validates them against
eager PyTorch, ``project`` checks the project itself (the docs site builds, the wheel's contents, lint),
``integration`` talks to real servers on 127.0.0.1, ``e2e`` drives engines beside them (Docker Compose, a Ray
cluster, Kubernetes manifests, perf_analyzer, a GPU). Each test gets its folder's marker: ``pytest -m unit`` runs
the fast ones; ``perf`` marks the thresholds that need a quiet machine, run alone after the rest.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support import SMALL_D_MODEL, SMALL_HEADS, TEST_SERVER_ARGS

SCOPES = ("unit", "export", "project", "integration", "e2e")


def pytest_collection_modifyitems(items):
    for item in items:
        scope = Path(item.fspath).parent.name
        if scope in SCOPES:
            item.add_marker(scope)


def pytest_report_header(config):
    """The CPU the suite runs on, so that a red run says which machine it was: int8 (and its tests) depends on
    8-bit dot-product instructions."""
    from mhaserve.contract.cpu import INT8_DOT_PRODUCT_FLAGS, cpu_flags, cpu_model, int8_support

    flags = cpu_flags() or set()
    shown = [f for f in ("avx2", "avx512f", *INT8_DOT_PRODUCT_FLAGS) if f in flags]
    support = int8_support()
    int8 = "int8 served here" if support.usable else "int8 refused here (its products would saturate)"
    return f"cpu: {cpu_model()}; flags: {' '.join(shown) or 'none of interest'}; {int8}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


@pytest.fixture(scope="session")
def small_module():
    from mhaserve.model import seeded_module

    return seeded_module(SMALL_D_MODEL, SMALL_HEADS, seed=1)


@pytest.fixture(scope="session")
def exported(request, tmp_path_factory):
    """``exported.folder(name, module, **options)``: a validated export of ``module``, made once and kept while the
    code, libraries, weights and options that decide it are the same (tests/support/exports.py). With pytest's
    cache off (-p no:cacheprovider), kept for this run only, in the folder its workers share."""
    from tests.support.exports import ExportCache

    if getattr(request.config, "cache", None) is not None:
        return ExportCache(Path(request.config.cache.mkdir("exports")))
    run = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        run = run.parent  # each worker's folder lies in the run's
    (run / "exports").mkdir(exist_ok=True)
    return ExportCache(run / "exports")


@pytest.fixture(scope="session")
def small_model_dir(exported, small_module):
    """A validated export of the small module, shared by every test that serves it. Tests copy it before changing
    anything in it."""
    return exported.folder("small", small_module, source={"kind": "seed", "seed": 1})


# A stopped test server closes its port at once, unless the test asks for a drain (a later flag wins): the second
# the default drain holds would be paid at every stop.
NO_DRAIN = ("--drain-seconds", "0")


@pytest.fixture(scope="session")
def server(small_model_dir):
    """One real server process on a free 127.0.0.1 port, shared by the tests that only talk to it."""
    from mhaserve.server.process import ServerProcess

    with ServerProcess(small_model_dir, *NO_DRAIN, *TEST_SERVER_ARGS) as process:
        yield process


@pytest.fixture
def start_server_process(request):
    """Starts a real server process for this test, where the process is the point (signals, exit codes, memory
    as RSS, environment variables): ``start_server_process(model_dir, *flags, env=..., port=..., wait=True)``.
    Every one it started is stopped when the test ends, and a failed test shows their logs."""
    from mhaserve.server.process import ServerProcess

    def start(model_dir, *args, wait: bool = True, **options):
        return ServerProcess(model_dir, *NO_DRAIN, *args, **options), {"wait": wait}

    yield from _started_for_test(request, start)


@pytest.fixture
def start_server(request):
    """Starts a real server in this process for this test (tests/support/in_process.py): ``start_server(
    model_dir, *flags, port=...)``, the flags of ``mhaserve serve``. Stopped when the test ends; a failed test
    shows their logs."""
    from tests.support.in_process import InProcessServer

    def start(model_dir, *args, **options):
        return InProcessServer(model_dir, *args, **options), {}

    yield from _started_for_test(request, start)


def _started_for_test(request, start):
    started = []

    def starting(*args, **options):
        server, start_options = start(*args, **options)
        started.append(server)  # stopped, and its log shown, even if its start fails
        return server.start(**start_options)

    yield starting
    for server in started:
        server.stop()
    report = getattr(request.node, "report_call", None)
    if report is not None and report.failed:
        for number, server in enumerate(started):
            report.sections.append((f"server {number} log", server.log[-20000:]))
