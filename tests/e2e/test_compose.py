"""The docker compose deployment, for real: a Docker engine this test starts, images built from the project's
Dockerfile, `up` until healthy, answers through the published port equal to eager PyTorch, metrics, the
loadtest profile, a draining stop, and `down -v` leaving nothing behind.

No registry can be reached from here, so the base image is made with debootstrap (and cached in the
test's own Docker data root between runs); it trusts the host's CA certificates so builds reach PyPI
through this machine's proxy. The project's Dockerfile knows nothing of this: it only takes BASE_IMAGE.

Users run Compose v2 (`docker compose`); Debian ships v1.29 (`docker-compose`). The newest present builds the
images and runs every test; the other reads the GPU and TLS variants alike, and with MHASERVE_TEST_COMPOSE_V1_UP=1
also brings the same images up, serves, drains and leaves nothing.
Needs root, dockerd, compose and debootstrap (tests/tools/install_docker.sh); skipped without them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections import Counter
from pathlib import Path

import grpc
import numpy as np
import pytest

from mhaserve.server.process import free_port
from tests.support import (
    ROOT,  # noqa: E402
    eager,
    rand,
    scrape,
)

DOCKER_ROOT = Path(os.environ.get("MHASERVE_TEST_DOCKER_ROOT", Path.home() / ".cache" / "mhaserve-test-docker"))
BASE_IMAGE = "mhaserve-test-base:bookworm"
# The default model (512/8) is exported where the first-run experience is under test; elsewhere a 64/4 model,
# which the export service writes and validates in seconds rather than half a minute.
SMALL_MODEL = {"MHASERVE_D_MODEL": "64", "MHASERVE_HEADS": "4"}
DEBIAN_MIRROR = os.environ.get("MHASERVE_TEST_DEBIAN_MIRROR", "http://deb.debian.org/debian")
COMPOSE_V2 = ROOT / ".tools" / "compose-v2" / "docker-compose"  # where tests/tools/install_docker.sh puts it
TLS_OVERRIDE = ("-f", str(ROOT / "docker" / "compose.tls.yml"))  # compose arguments adding the TLS override

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not (shutil.which("dockerd") and shutil.which("debootstrap")),
    reason="needs root, dockerd and debootstrap (bash tests/tools/install_docker.sh)",
)


class Docker:
    def __init__(self, env: dict, composes: dict[str, list[str]]):
        self.env = env
        self.composes = composes  # command by Compose major version, newest first
        self.newest_compose = next(iter(composes))

    def run(self, *args, timeout=120, check=True, env=None, input=None) -> subprocess.CompletedProcess:
        done = subprocess.run(
            args, env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=timeout, input=input
        )
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(map(str, args))} exited {done.returncode}:\n{done.stdout[-4000:]}"
                                 f"\n{done.stderr[-4000:]}")  # fmt: skip
        return done

    def docker(self, *args, **kw):
        return self.run("docker", *args, **kw)


def _compose_implementations(env) -> dict[str, list[str]]:
    """Every Compose here by major version, newest first: {"v2": ["docker", "compose"], "v1": ["docker-compose"]}."""
    found = {}
    for command in (["docker", "compose"], [str(COMPOSE_V2)], ["docker-compose"]):
        try:
            done = subprocess.run([*command, "version", "--short"], env=env, capture_output=True, text=True)
        except OSError:  # not installed
            continue
        if done.returncode == 0:
            found.setdefault("v" + done.stdout.strip().lstrip("v").split(".")[0], command)
    if not found:
        pytest.skip("neither Compose v2 nor docker-compose is installed (bash tests/tools/install_docker.sh)")
    return dict(sorted(found.items(), reverse=True))


@pytest.fixture(scope="module")
def docker_engine():
    """A dockerd of the test's own (own socket and data root), stopped at the end."""
    DOCKER_ROOT.mkdir(parents=True, exist_ok=True)
    socket = DOCKER_ROOT / "docker.sock"
    env = {**os.environ, "DOCKER_HOST": f"unix://{socket}"}
    log = (DOCKER_ROOT / "dockerd.log").open("w")
    daemon = subprocess.Popen(
        ["dockerd", "--host", f"unix://{socket}", "--data-root", str(DOCKER_ROOT / "data"),
         "--exec-root", str(DOCKER_ROOT / "exec"), "--pidfile", str(DOCKER_ROOT / "dockerd.pid")],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while subprocess.run(["docker", "info"], env=env, capture_output=True).returncode != 0:
            if daemon.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"dockerd did not start:\n{(DOCKER_ROOT / 'dockerd.log').read_text()[-3000:]}")
            time.sleep(0.2)
        yield Docker(env, _compose_implementations(env))
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(60)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
        log.close()


def _make_base_image(docker: Docker, work: Path) -> None:
    """debootstrap a minimal bookworm with python3, trusting the host's CA certificates, and import it."""
    rootfs = work / "rootfs"
    include = "python3,python3-venv,python3-pip,ca-certificates"
    subprocess.run(["debootstrap", "--variant=minbase", f"--include={include}", "bookworm", str(rootfs),
                    DEBIAN_MIRROR], check=True, capture_output=True, timeout=900)  # fmt: skip
    for cert in Path("/usr/local/share/ca-certificates").glob("*.crt"):
        shutil.copy(cert, rootfs / "usr/local/share/ca-certificates" / cert.name)
    subprocess.run(["chroot", str(rootfs), "update-ca-certificates"], check=True, capture_output=True)
    (rootfs / "etc/pip.conf").write_text("[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n")
    shutil.rmtree(rootfs / "var/cache/apt/archives", ignore_errors=True)
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    subprocess.run(["docker", "import", "-", BASE_IMAGE], stdin=tar.stdout, env=docker.env, check=True,
                   capture_output=True, timeout=600)  # fmt: skip
    tar.wait()
    shutil.rmtree(rootfs, ignore_errors=True)


@pytest.fixture(scope="module")
def base_image(docker_engine, tmp_path_factory):
    if docker_engine.docker("image", "inspect", BASE_IMAGE, check=False).returncode != 0:
        _make_base_image(docker_engine, tmp_path_factory.mktemp("debootstrap"))
    return BASE_IMAGE


@pytest.fixture(scope="module")
def torch_wheel_in_context():
    """The local CPU torch wheel, handed to the export image's build through docker/wheels/."""
    wheels = ROOT / "docker" / "wheels"
    if not list(wheels.glob("torch-2.13.0*.whl")):
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels),
                        "torch==2.13.0"], check=True, timeout=600)  # fmt: skip
    return wheels


@pytest.fixture(scope="module")
def stack(docker_engine, base_image, torch_wheel_in_context):
    """Compose settings for this run: its own project name and free loopback ports."""
    project = f"mhaserve-test-{os.getpid()}"
    settings = {
        "MHASERVE_BASE_IMAGE": base_image,
        "MHASERVE_TAG": "test",
        "MHASERVE_GRPC_PORT": str(free_port()),
        "MHASERVE_METRICS_HOST_PORT": str(free_port()),
        "MHASERVE_HTTP_HOST_PORT": str(free_port()),
        "MHASERVE_TORCH_INDEX_URL": "https://pypi.org/simple",  # the wheel in docker/wheels is used
        "MHASERVE_HEALTH_INTERVAL": "1s",
        "MHASERVE_LOADTEST_CONCURRENCY": "1,4",
        "MHASERVE_LOADTEST_SECONDS": "2",
        "MHASERVE_LOADTEST_WARMUP_SECONDS": "0.5",
        "MHASERVE_LOADTEST_LENGTHS": "8..64",
    }

    def compose(*args, timeout=300, check=True, env=None, version=None):
        """Compose on this run's project, by default the newest Compose here. A host port picked free can be taken
        by another test before Docker binds it: `up` then picks fresh ones (in the settings the tests read) and
        tries again."""
        implementation = docker_engine.composes[version or docker_engine.newest_compose]
        command = [*implementation, "-p", project, "-f", str(ROOT / "docker-compose.yml"), *args]
        for _ in range(3):
            done = docker_engine.run(*command, timeout=timeout, check=False, env={**settings, **(env or {})})
            if "up" not in args or "address already in use" not in done.stderr:
                break
            for ports in (settings, env or {}):
                taken = [name for name, port in ports.items() if port and name.endswith("_PORT")]
                ports.update({name: str(free_port()) for name in taken})
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(command)} exited {done.returncode}:\n{done.stdout[-4000:]}"
                                 f"\n{done.stderr[-4000:]}")  # fmt: skip
        return done

    yield compose, settings, project
    compose("--profile", "loadtest", "--profile", "gpu", "--profile", "monitoring", "down", "-v", "--remove-orphans",
            check=False)  # fmt: skip
    # The cached data root keeps the base image, this run's images and a bounded build cache, so that the next
    # run rebuilds only the layers its change touches: removing the images made every build import the torch
    # layers into the image store again. The images a rebuild replaces are pruned (left, they piled up).
    docker_engine.docker("image", "prune", "--force", check=False)
    docker_engine.docker("builder", "prune", "--force", "--keep-storage", "4GB", check=False)


@pytest.fixture(params=["v2", "v1"])
def compose_version(request, docker_engine) -> str:
    if request.param not in docker_engine.composes:
        pytest.skip(f"Compose {request.param} is not installed (bash tests/tools/install_docker.sh)")
    return request.param


def _container(docker: Docker, project: str, service: str) -> str:
    ids = docker.docker("ps", "-aq", "--filter", f"label=com.docker.compose.project={project}",
                        "--filter", f"label=com.docker.compose.service={service}").stdout.split()  # fmt: skip
    assert len(ids) == 1, f"{service}: {ids}"
    return ids[0]


def _wait_healthy(docker: Docker, container: str, timeout: float = 240) -> float:
    started = time.monotonic()
    while True:
        state = json.loads(docker.docker("inspect", "--format", "{{json .State}}", container).stdout)
        if state.get("Health", {}).get("Status") == "healthy":
            return time.monotonic() - started
        assert state["Status"] == "running", state
        assert time.monotonic() - started < timeout, f"not healthy after {timeout} s: {state.get('Health')}"
        time.sleep(0.5)


def _readable_by_the_image(path: Path) -> None:
    """The images run as a non-root user (uid 10001): what is bind-mounted into them must be readable by it."""
    subprocess.run(["chmod", "-R", "a+rX", str(path)], check=True)


def _assert_loadtest_points_without_errors(loadtest: subprocess.CompletedProcess, points: int = 2) -> None:
    """``mhaserve bench``'s table from the loadtest profile: one row per concurrency, none with errors."""
    rows = [line for line in loadtest.stdout.splitlines() if line.strip().startswith("concurrency")]
    from mhaserve.loadtest.report import COLUMNS

    errors_column = COLUMNS.index("errors") + 1  # the load's label is two words: "concurrency 4"
    assert len(rows) == points and all(row.split()[errors_column] == "0" for row in rows), (
        loadtest.stdout + loadtest.stderr
    )


def test_gpu_profile_config_reserves_an_nvidia_device(stack, compose_version):
    compose, _, _ = stack
    config = compose("--profile", "gpu", "config", version=compose_version).stdout
    assert "server-gpu:" in config and "driver: nvidia" in config and "gpu" in config
    assert "MHASERVE_DEVICE: cuda" in config
    assert "condition: service_completed_successfully" in config
    # gRPC, HTTP and metrics of server and server-gpu (and Compose v1 prints the monitoring profile's too)
    addresses = _published_port_addresses(config)
    assert set(addresses) == {"127.0.0.1"} and len(addresses) >= 6, addresses


def _published_port_addresses(config: str) -> list[str]:
    """The host address of each published port in `compose config`: v1 writes `- 127.0.0.1:8001:8001/tcp`
    (no address: `- 8001:8001/tcp`), v2 `host_ip: 127.0.0.1` (no address: no such line)."""
    return re.findall(r"^\s*- ([\d.]+):\d+:\d+", config, re.M) + re.findall(r"^\s*host_ip: (\S+)", config, re.M)


def test_tls_override_config_mounts_the_certificates_and_checks_health_over_tls(stack, compose_version, tmp_path):
    compose, _, _ = stack
    config = compose(*TLS_OVERRIDE, "--profile", "loadtest", "config", version=compose_version,
                     env={"MHASERVE_CERTS_DIR": str(tmp_path)}).stdout  # fmt: skip
    assert str(tmp_path) in config and "/certs" in config
    assert "MHASERVE_TLS_CERT_FILE: /certs/server.pem" in config
    assert config.count("--tls-ca") == 2  # the healthcheck and the load test


@pytest.mark.skipif(
    os.environ.get("MHASERVE_TEST_GPU_IMAGE") != "1",
    reason="builds the server-gpu image (2.9 GB of CUDA and cuDNN wheels); set MHASERVE_TEST_GPU_IMAGE=1",
)
def test_gpu_image_loads_every_cuda_library_but_the_driver(docker_engine, stack, small_model_dir, tmp_path):
    """Without a GPU, the server-gpu image must fail on the driver alone: pip's CUDA and cuDNN libraries
    all load, so on a GPU host (which supplies libcuda.so.1) the CUDA provider comes up."""
    compose, _, _ = stack
    compose("--profile", "gpu", "build", "server-gpu", timeout=1800)
    models = tmp_path / "models"
    shutil.copytree(small_model_dir, models / "mha")
    _readable_by_the_image(models)
    served = docker_engine.docker("run", "--rm", "-v", f"{models}:/models:ro", "mhaserve-server-gpu:test", "serve",
                                  check=False, timeout=300)  # fmt: skip
    log = served.stdout + served.stderr
    assert served.returncode != 0, log  # --device cuda, the image's default, refuses without a GPU
    assert "the CUDA provider did not load: libcuda.so.1" in log, log


def test_compose_up_serves_eager_answers_then_drains_and_leaves_nothing(docker_engine, stack, compose_version):
    from mhaserve.client.grpc import Client
    from mhaserve.model import seeded_module

    _, env, project = stack
    docker = docker_engine
    default_model = compose_version == docker.newest_compose
    if not default_model and os.environ.get("MHASERVE_TEST_COMPOSE_V1_UP") != "1":
        pytest.skip("Compose v1 reads the file in the config tests; set MHASERVE_TEST_COMPOSE_V1_UP=1 to bring it up")
    width, heads = (512, 8) if default_model else (64, 4)

    def compose(*args, **kw):
        return stack[0](*args, version=compose_version, env=None if default_model else SMALL_MODEL, **kw)

    if default_model:  # the others run the images it built
        compose("build", "export", "server", timeout=1500)
        user = docker.docker("image", "inspect", "--format", "{{.Config.User}}", "mhaserve-server:test").stdout
        assert user.strip() == "mhaserve"  # not root
        has_torch = "import importlib.util as u; print(u.find_spec('torch') is not None)"
        torch_in_server = docker.docker("run", "--rm", "--entrypoint", "python", "mhaserve-server:test", "-c",
                                        has_torch)  # fmt: skip
        assert torch_in_server.stdout.strip() == "False"

    compose("up", "-d", "server", timeout=600)
    export = _container(docker, project, "export")
    export_state = json.loads(docker.docker("inspect", "--format", "{{json .State}}", export).stdout)
    assert export_state["Status"] == "exited" and export_state["ExitCode"] == 0
    server = _container(docker, project, "server")
    _wait_healthy(docker, server)

    url = f"127.0.0.1:{env['MHASERVE_GRPC_PORT']}"
    module = seeded_module(width, heads, seed=0)  # the model the export service writes
    query, key = rand(2, 7, width, seed=1), rand(2, 11, width, seed=2)
    with Client(url) as client:
        result = client.infer(query, key, key)
    want_out, want_attn = eager(module, query, key, key)
    np.testing.assert_allclose(result.output, want_out, rtol=0, atol=1e-5)
    np.testing.assert_allclose(result.attn_weights, want_attn, rtol=0, atol=1e-5)

    # the same model over HTTP/REST on its published port, as curl would call it
    http = f"http://127.0.0.1:{env['MHASERVE_HTTP_HOST_PORT']}/v2/models/mha"
    document = {"inputs": [{"name": "query", "shape": [2, 7, width], "datatype": "FP32", "data": query.tolist()}],
                "outputs": [{"name": "output"}]}  # fmt: skip
    with urllib.request.urlopen(urllib.request.Request(http + "/infer", json.dumps(document).encode())) as reply:
        over_http = json.loads(reply.read())["outputs"][0]
    np.testing.assert_allclose(np.reshape(over_http["data"], over_http["shape"]), eager(module, query)[0], atol=1e-5)

    # A call is counted once its answer is written, which the server learns a moment after the client has it.
    metrics_url = f"http://127.0.0.1:{env['MHASERVE_METRICS_HOST_PORT']}/metrics"
    counted = [("mhaserve_inference_request_total", (("model", "mha"), ("protocol", protocol), ("status", "OK"),
                                                      ("version", "1"))) for protocol in ("grpc", "http")]  # fmt: skip
    deadline = time.monotonic() + 10
    samples = scrape(metrics_url)
    while not all(sample in samples for sample in counted) and time.monotonic() < deadline:
        time.sleep(0.1)
        samples = scrape(metrics_url)
    for sample in counted:
        assert samples.get(sample) == 1, samples

    loadtest = compose("--profile", "loadtest", "run", "--rm", "loadtest", timeout=300)
    assert "concurrency 4" in loadtest.stdout, loadtest.stdout + loadtest.stderr
    _assert_loadtest_points_without_errors(loadtest)

    compose("stop", "server", timeout=120)
    stopped = json.loads(docker.docker("inspect", "--format", "{{json .State}}", server).stdout)
    assert stopped["ExitCode"] == 0, stopped
    logs = docker.docker("logs", server).stderr
    assert "shutting down" in logs and "stopped" in logs

    # A later `up` keeps the export the volume holds rather than exporting it again.
    compose("up", "-d", "server", timeout=600)
    export_state = json.loads(docker.docker("inspect", "--format", "{{json .State}}", export).stdout)
    assert export_state["ExitCode"] == 0, export_state
    assert "/models/mha/1 already holds this export, valid and intact: kept" in docker.docker("logs", export).stderr

    compose("--profile", "loadtest", "down", "-v", timeout=120)
    leftovers = docker.docker("ps", "-aq", "--filter", f"label=com.docker.compose.project={project}").stdout.split()
    assert leftovers == []
    volumes = docker.docker("volume", "ls", "-q", "--filter", f"label=com.docker.compose.project={project}").stdout
    assert volumes.split() == []


def test_two_replicas_both_serve_a_round_robin_client(docker_engine, stack):
    compose, _, project = stack
    docker = docker_engine
    # Empty host ports: each replica publishes on its own ephemeral loopback port (no clash).
    scale_env = {"MHASERVE_GRPC_PORT": "", "MHASERVE_METRICS_HOST_PORT": "", "MHASERVE_HTTP_HOST_PORT": "",
                 **SMALL_MODEL}  # fmt: skip
    compose("build", "export", "server", timeout=1500)  # cached by the test above
    compose("up", "-d", "--scale", "server=2", "server", timeout=600, env=scale_env)
    replicas = docker.docker("ps", "-q", "--filter", f"label=com.docker.compose.project={project}",
                             "--filter", "label=com.docker.compose.service=server").stdout.split()  # fmt: skip
    assert len(replicas) == 2
    for replica in replicas:
        _wait_healthy(docker, replica)

    # The project's client inside the compose network: one DNS name, two addresses, round robin. --no-deps:
    # Compose v2's `run` would otherwise bring the server back to its one configured replica.
    bench = compose("--profile", "loadtest", "run", "--rm", "--no-deps", "loadtest", "bench", "--url", "dns:///server:8001",
                    "--concurrency", "4", "--duration", "2", "--warmup", "0.5", "--processes", "1",
                    timeout=300, env=scale_env)  # fmt: skip
    assert "concurrency 4" in bench.stdout, bench.stdout + bench.stderr
    count = "from mhaserve.client.grpc import Client; print(Client('127.0.0.1:8001').statistics().inference_count)"
    served = [int(docker.docker("exec", replica, "python", "-c", count).stdout) for replica in replicas]
    assert all(n > 0 for n in served), served
    assert min(served) > 0.25 * sum(served), served  # spread, not one replica taking nearly all

    # The monitoring profile's Prometheus finds both replicas by DNS and stores what each served.
    monitoring_env = {**scale_env, "MHASERVE_PROMETHEUS_PORT": str(free_port())}
    compose("--profile", "monitoring", "up", "-d", "--no-deps", "prometheus", timeout=900, env=monitoring_env)
    prometheus = f"http://127.0.0.1:{monitoring_env['MHASERVE_PROMETHEUS_PORT']}/api/v1/query?query="
    query = urllib.parse.quote('sum(mhaserve_inference_count_total{model="mha"})')
    deadline, stored = time.monotonic() + 120, None
    while stored != sum(served):
        assert time.monotonic() < deadline, f"Prometheus stored {stored} rows, the replicas served {served}"
        time.sleep(1)
        try:
            with urllib.request.urlopen(prometheus + query, timeout=5) as answer:
                result = json.loads(answer.read())["data"]["result"]
        except OSError:
            continue  # not listening yet
        stored = int(float(result[0]["value"][1])) if result else None
    with urllib.request.urlopen(prometheus + urllib.parse.quote('count(up{job="mhaserve"} == 1)')) as answer:
        assert json.loads(answer.read())["data"]["result"][0]["value"][1] == "2"
    # It evaluates the alerts of deploy/prometheus/alerts.yml, and none fires on healthy replicas.
    rules_url = prometheus.replace("/query?query=", "/rules?type=alert")
    with urllib.request.urlopen(rules_url, timeout=5) as answer:
        (group,) = json.loads(answer.read())["data"]["groups"]
    assert group["name"] == "mhaserve" and all(rule["health"] == "ok" for rule in group["rules"]), group
    assert [rule["name"] for rule in group["rules"] if rule["state"] == "firing"] == [], group
    # The models volume stays: the next tests' export service keeps what it holds (the stack's end drops it).
    compose("--profile", "loadtest", "--profile", "monitoring", "down", timeout=120, env=monitoring_env)


def test_tls_override_serves_only_tls_clients_with_the_token(docker_engine, stack, tmp_path):
    """docker/compose.tls.yml: TLS and a token on the server, a TLS healthcheck, a TLS load test."""
    import grpc

    from mhaserve.client import TLS, Client
    from mhaserve.model import seeded_module
    from tests.support.certs import CertificateAuthority

    compose, env, project = stack
    authority = CertificateAuthority(tmp_path, "deploy")
    issued = authority.issue("server", "server", server=True, dns_names=("localhost", "server"))
    certs = tmp_path / "certs"
    certs.mkdir()
    for source, name in ((issued.cert, "server.pem"), (issued.key, "server.key"), (authority.bundle, "ca.pem")):
        shutil.copy(source, certs / name)
    (certs / "token").write_text("compose-test-token\n")
    _readable_by_the_image(certs)
    tls_env = {"MHASERVE_CERTS_DIR": str(certs), "MHASERVE_LOADTEST_CONCURRENCY": "4", **SMALL_MODEL}

    compose("build", "export", "server", timeout=1500)  # cached by the tests above
    compose(*TLS_OVERRIDE, "up", "-d", "server", timeout=600, env=tls_env)
    _wait_healthy(docker_engine, _container(docker_engine, project, "server"))  # through the TLS healthcheck

    url = f"127.0.0.1:{env['MHASERVE_GRPC_PORT']}"
    trusting = TLS(ca=str(certs / "ca.pem"))
    query = rand(1, 9, 64, seed=5)
    with Client(url, tls=trusting, token="compose-test-token") as client:
        result = client.infer(query, timeout=30)
    want_out, want_attn = eager(seeded_module(64, 4, seed=0), query)
    np.testing.assert_allclose(result.output, want_out, rtol=0, atol=1e-5)
    np.testing.assert_allclose(result.attn_weights, want_attn, rtol=0, atol=1e-5)
    for client_settings, refused_with in (
        ({}, grpc.StatusCode.UNAVAILABLE),  # plain text against TLS: no connection
        ({"tls": trusting}, grpc.StatusCode.UNAUTHENTICATED),  # no token
    ):
        with pytest.raises(grpc.RpcError) as refused, Client(url, **client_settings) as client:
            client.infer(query, timeout=30)
        assert refused.value.code() == refused_with

    loadtest = compose(*TLS_OVERRIDE, "--profile", "loadtest", "run", "--rm", "loadtest", timeout=300, env=tls_env)
    _assert_loadtest_points_without_errors(loadtest, points=1)
    compose(*TLS_OVERRIDE, "--profile", "loadtest", "down", timeout=120, env=tls_env)  # the volume stays


class EagerReference:
    """The compose stack's default model in eager PyTorch, shaped like checked_load.Reference."""

    rtol = 0.0  # float32: no float16 steps to allow for

    def __init__(self, module):
        self.module = module

    def answer(self, call):
        return eager(self.module, call.query, call.key, call.value, call.mask)  # key None: self-attention


def test_sigterm_under_load_loses_nothing_and_sigkill_is_restarted(docker_engine, stack):
    import asyncio
    import threading

    from mhaserve.client.grpc import Client
    from mhaserve.loadtest.checked_load import Shapes, burst, make_call, mismatch
    from mhaserve.model import seeded_module

    compose, env, project = stack
    docker = docker_engine
    compose("build", "export", "server", timeout=1500)  # cached by the first test
    compose("up", "-d", "server", timeout=600, env=SMALL_MODEL)
    server = _container(docker, project, "server")
    _wait_healthy(docker, server)
    url = f"127.0.0.1:{env['MHASERVE_GRPC_PORT']}"

    # SIGTERM (compose stop) while an open-loop load runs through the published port.
    rng = np.random.default_rng(3)
    calls = [make_call(rng, Shapes(64, 8, 128)) for _ in range(600)]
    load = threading.Thread(target=lambda: asyncio.run(burst(url, calls, timeout_s=60, rate=150)))
    load.start()
    # SIGTERM once 100 calls are answered, however fast this machine serves them (not after a fixed wait)
    deadline = time.monotonic() + 60
    while sum(call.status == "OK" for call in calls) < 100 and time.monotonic() < deadline:
        time.sleep(0.05)
    compose("stop", "server", timeout=120, env=SMALL_MODEL)
    load.join(120)
    client_saw = Counter(call.status for call in calls)
    answered = [call for call in calls if call.status == "OK"]
    # The server's own account: every call its handler took was answered, none cut off; its refusals are
    # the "shutting down" UNAVAILABLEs of the drain, and RESOURCE_EXHAUSTED if the queue filled up.
    stopped = [line for line in docker.docker("logs", server).stderr.splitlines() if "stopped:" in line]
    assert len(stopped) == 1 and stopped[0].endswith("; 0 in flight at exit"), stopped
    by_status = dict(item.split() for item in stopped[0].split("by status: ")[1].split(";")[0].split(", "))
    assert set(by_status) <= {"OK", "UNAVAILABLE", "RESOURCE_EXHAUSTED"}, by_status
    assert int(by_status["OK"]) == len(answered) >= 100, (by_status, client_saw)
    # The client saw the same answers, and refusals: UNAVAILABLE, or CANCELLED for the few calls that had
    # reached gRPC but no handler at the instant the port closed (gRPC cancels those itself).
    assert set(client_saw) <= {"OK", "UNAVAILABLE", "RESOURCE_EXHAUSTED", "CANCELLED"}, client_saw
    assert client_saw["UNAVAILABLE"] > 0  # the stop really came under load
    reference = EagerReference(seeded_module(64, 4, seed=0))
    assert [p for call in answered[::10] if (p := mismatch(call, reference))] == []

    # SIGKILL of the server process (as the OOM killer or a crash would): the restart policy brings it back.
    compose("start", "server", timeout=120, env=SMALL_MODEL)
    _wait_healthy(docker, server)
    pid = int(docker.docker("inspect", "--format", "{{.State.Pid}}", server).stdout)
    restarts = int(docker.docker("inspect", "--format", "{{.RestartCount}}", server).stdout)
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    while json.loads(docker.docker("inspect", "--format", "{{json .State}}", server).stdout)["Pid"] in (0, pid):
        assert time.monotonic() - killed_at < 60, "not restarted"
        time.sleep(0.2)
    _wait_healthy(docker, server)
    recovery_s = time.monotonic() - killed_at
    assert int(docker.docker("inspect", "--format", "{{.RestartCount}}", server).stdout) == restarts + 1
    with Client(url) as client:
        assert client.infer(rand(1, 5, 64), timeout=30).output.shape == (1, 5, 64)
    print(f"\nSIGTERM under load: client saw {dict(client_saw)}, server {by_status}; "
          f"SIGKILL to healthy again: {recovery_s:.1f} s")  # fmt: skip
    compose("--profile", "loadtest", "down", timeout=120, env=SMALL_MODEL)  # the volume stays


def test_a_version_added_with_compose_run_is_served_under_load_without_a_restart(docker_engine, stack):
    """The documented way to ship new weights: `compose run --rm export ... --repository /models` while
    clients send; the polling server moves them to version 2 with no failed request and no restart."""
    import threading

    from mhaserve.client.grpc import Client
    from mhaserve.model import seeded_module

    compose, env, project = stack
    docker = docker_engine
    poll_env = {"MHASERVE_REPOSITORY_POLL_SECS": "1", **SMALL_MODEL}
    compose("build", "export", "server", timeout=1500)  # cached by the first test
    compose("up", "-d", "server", timeout=600, env=poll_env)
    server = _container(docker, project, "server")
    _wait_healthy(docker, server)
    pid = docker.docker("inspect", "--format", "{{.State.Pid}}", server).stdout
    url = f"127.0.0.1:{env['MHASERVE_GRPC_PORT']}"
    queries = [rand(1, 8 + 4 * i, 64, seed=20 + i) for i in range(4)]
    answers, errors, stop = [], [], threading.Event()

    def send(offset: int) -> None:
        with Client(url) as client:
            i = offset
            while not stop.is_set():
                try:
                    result = client.infer(queries[i % 4], attn_weights=False, timeout=30)
                    answers.append((i % 4, result.model_version, result.output))
                except grpc.RpcError as error:
                    errors.append(f"{error.code().name}: {error.details()}")
                i += 1
                time.sleep(0.01)

    threads = [threading.Thread(target=send, args=(n,)) for n in range(2)]
    for thread in threads:
        thread.start()
    try:
        compose("run", "--rm", "export", "export", "--repository", "/models", "--name", "mha", "--seed", "1",
                "--d-model", "64", "--heads", "4", "--validation-seed", "0", timeout=900, env=poll_env)  # fmt: skip
        deadline = time.monotonic() + 120
        while not any(version == "2" for _, version, _ in answers[-20:]):
            assert time.monotonic() < deadline and not errors, errors[:3]
            time.sleep(0.5)
        time.sleep(2)
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    assert errors == []
    versions = Counter(version for _, version, _ in answers)
    assert set(versions) == {"1", "2"}, versions
    eager_answers = {v: [eager(seeded_module(64, 4, seed=int(v) - 1), q)[0] for q in queries] for v in ("1", "2")}
    for query_index, version, output in answers[::5]:  # each answer is exactly its version's
        np.testing.assert_allclose(output, eager_answers[version][query_index], rtol=0, atol=1e-5)
    assert docker.docker("inspect", "--format", "{{.State.Pid}}", server).stdout == pid  # no restart
    logs = docker.docker("logs", server).stderr
    assert "model 'mha' version 2 ready" in logs and "model 'mha' version 1 unloaded" in logs
    print(f"\nversion added under load: answers by version {dict(versions)}, no errors, no restart")
    compose("--profile", "loadtest", "down", "-v", timeout=120, env=poll_env)  # version 2 goes with the volume
