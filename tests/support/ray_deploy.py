"""`mhaserve ray-deploy` run as a user runs it, against a cluster a test started."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from mhaserve.server.process import free_port


def ray_deployed(model_dir: Path, address: str, app: str, *args: str) -> tuple[int, str]:
    """``model_dir`` deployed on the cluster at ``address`` as the application ``app``, with ``args``: the proxies'
    gRPC port and what the command printed. It must succeed."""
    grpc_port = free_port()
    deployed = subprocess.run(
        [sys.executable, "-m", "mhaserve.cli", "ray-deploy", "--model-dir", str(model_dir), "--address", address,
         "--name", app, "--grpc-port", str(grpc_port), "--http-port", str(free_port()), *args],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert deployed.returncode == 0, deployed.stderr[-3000:]
    return grpc_port, deployed.stdout
