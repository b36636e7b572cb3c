"""The code passes the project's linter and formatter (configured in pyproject.toml)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT  # noqa: E402


@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]])
def test_ruff(args):
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (it comes with the test extra)")
    done = subprocess.run([ruff, *args], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
