"""What `docker compose config` makes of the compose file, with each Compose installed (no engine needed): every
server setting passes through from the environment, and the docs' replicas command frees every host port."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import fields

import pytest
import yaml

from mhaserve.server.config import ServerSettings
from tests.e2e.test_compose import _compose_implementations
from tests.support import ROOT

sys.path.insert(0, str(ROOT / "docker"))
from compose_env import FIXED  # noqa: E402


@pytest.fixture(params=["v2", "v1"])
def compose_config(request):
    composes = _compose_implementations(os.environ)
    if request.param not in composes:
        pytest.skip(f"Compose {request.param} is not installed (bash tests/tools/install_docker.sh)")
    command = composes[request.param]

    def config(env: dict[str, str]) -> dict:
        done = subprocess.run([*command, "-f", str(ROOT / "docker-compose.yml"), "config"], cwd=ROOT,
                              env={"PATH": "/usr/local/bin:/usr/bin:/bin", **env}, capture_output=True, text=True,
                              timeout=60)  # fmt: skip
        assert done.returncode == 0, done.stderr
        return yaml.safe_load(done.stdout)

    return config


def test_every_server_setting_set_in_the_environment_reaches_the_server(compose_config):
    passed = {f"MHASERVE_{setting.name.upper()}": f"set-{setting.name}"
              for setting in fields(ServerSettings) if setting.name not in FIXED}  # fmt: skip
    environment = compose_config(passed)["services"]["server"]["environment"]
    missing = {name: environment.get(name) for name, value in passed.items() if environment.get(name) != value}
    assert not missing, f"settings the compose file does not pass to the server: {missing}"
    assert "MHASERVE_WORKERS" in passed  # what tune's env file sets


def test_the_docs_replicas_command_publishes_no_fixed_host_port(compose_config):
    guide = (ROOT / "docs" / "how-to" / "compose.md").read_text()
    (command,) = [line for line in guide.splitlines() if "--scale server=" in line]
    env = dict(word.split("=", 1) for word in shlex.split(command) if re.match(r"MHASERVE_\w+=", word))
    ports = compose_config(env)["services"]["server"]["ports"]
    published = [port for port in ports if (port.split(":")[-2] if isinstance(port, str) else port.get("published"))]
    assert len(ports) == 3 and not published, f"{command!r} leaves host ports fixed: {published}"
