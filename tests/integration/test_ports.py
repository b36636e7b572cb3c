"""A port the server would listen on that is already taken is said at once, in one line that names the address,
what holds it and the flag that picks another, before a first run's export: not after it, not as a traceback; so
is an address that is not this machine's."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest


@pytest.mark.parametrize("flag", ["--port", "--http-port", "--metrics-port"])
def test_a_busy_port_is_one_line_naming_the_flag_before_the_first_export(tmp_path, flag):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    taken = holder.getsockname()[1]
    others = {"--port": "0", "--http-port": "0", "--metrics-port": "0"}
    others[flag] = str(taken)
    env = {"HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    try:
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "mhaserve.cli", "serve", *(a for f, p in others.items() for a in (f, p))],
            capture_output=True, text=True, timeout=120, env=env,
        )  # fmt: skip
        took = time.monotonic() - started
    finally:
        holder.close()
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert f"127.0.0.1:{taken} is already in use" in lines[0] and flag in lines[0], lines[0]
    assert "pid " in lines[0] and "python" in lines[0]  # what holds it: this test's own process
    assert took < 15, f"{took:.1f} s: the port was checked after something slow"
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("model.onnx"))  # no export


def test_every_busy_port_is_named_in_the_one_line(tmp_path):
    holders = [socket.socket() for _ in range(3)]
    for holder in holders:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
    taken = [holder.getsockname()[1] for holder in holders]
    env = {"HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    flags = ["--port", "--http-port", "--metrics-port"]
    arguments = [a for flag, port in zip(flags, taken, strict=True) for a in (flag, str(port))]
    try:
        done = subprocess.run(
            [sys.executable, "-m", "mhaserve.cli", "serve", *arguments],
            capture_output=True, text=True, timeout=120, env=env,
        )  # fmt: skip
    finally:
        for holder in holders:
            holder.close()
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert all(f"127.0.0.1:{port} (held by python" in lines[0] for port in taken), lines[0]
    assert "are already in use" in lines[0] and "--port and --http-port and --metrics-port" in lines[0], lines[0]


@pytest.mark.parametrize("host", ["::", "[::]", "::1"])
def test_an_ipv6_host_serves_grpc_and_http(start_server, small_model_dir, host):
    # '--host ::' failed as ":::0 is already in use" (gRPC takes an IPv6 address in brackets) and '[::]' when HTTP
    # started (a socket takes it bare).
    import urllib.request

    import grpc

    from mhaserve.protos.generated import grpc_service_pb2 as pb
    from mhaserve.protos.generated import grpc_service_pb2_grpc as pb_grpc

    server = start_server(small_model_dir, "--host", host)
    assert server.http_url.startswith("http://[")
    with grpc.insecure_channel(f"[::1]:{server.port}") as channel:
        assert pb_grpc.GRPCInferenceServiceStub(channel).ServerLive(pb.ServerLiveRequest(), timeout=10).live
    http_port = server.http_url.rsplit(":", 1)[1]
    with urllib.request.urlopen(f"http://[::1]:{http_port}/v2/health/ready", timeout=10) as response:
        assert response.status == 200
    if host != "::1":  # the any address serves IPv4 too, on both ports, as gRPC's [::] does
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            assert pb_grpc.GRPCInferenceServiceStub(channel).ServerLive(pb.ServerLiveRequest(), timeout=10).live
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/health/ready", timeout=10) as response:
            assert response.status == 200
        metrics_port = server.metrics_url.rsplit(":", 1)[1].split("/")[0]
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
            assert response.status == 200


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--host", "192.0.2.1"], "--host 192.0.2.1: not an address of this machine (0.0.0.0 listens on all of them)"),
        (["--metrics-host", "192.0.2.1"], "--metrics-host 192.0.2.1: not an address of this machine"),
        (["--host", "fe80::1%nosuchif"], "--host fe80::1%nosuchif: no such address"),
    ],
)
def test_an_address_that_is_not_this_machine_s_is_named_as_such_not_as_a_busy_port(tmp_path, flags, said):
    env = {"HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-m", "mhaserve.cli", "serve", "--port", "0", "--http-port", "0", "--metrics-port", "0",
         *flags],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    (line,) = done.stderr.strip().splitlines()
    assert done.returncode == 2 and line.startswith(f"mhaserve serve: error: {said}"), line  # "already in use" before
    assert not any((tmp_path / "cache").rglob("model.onnx"))  # refused before the first run's export
