"""docker-compose.yml lists the server's settings as they are declared: a new setting cannot be missed."""

from __future__ import annotations

import subprocess
import sys

from tests.support import ROOT


def test_the_compose_file_lists_every_server_setting_as_declared():
    done = subprocess.run([sys.executable, str(ROOT / "docker" / "compose_env.py"), "--check"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
