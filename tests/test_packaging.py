"""The built wheel holds every package of the source tree: pyproject's package list is kept by hand, and a
subpackage missing from it imports fine in the editable install yet is absent from `pip install .` (what
the Dockerfile runs)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_holds_every_package_folder_and_module(tmp_path):
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {package: ROOT / folder for package, folder in setuptools["package-dir"].items()}
    expected = set()
    for package, folder in folders.items():
        for init in folder.rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            relative = init.parent.relative_to(folder)
            subpackage = ".".join([package, *relative.parts]) if relative.parts else package
            for module in init.parent.glob("*.py"):
                expected.add(f"{subpackage.replace('.', '/')}/{module.name}")
    # From a clean copy: setuptools reuses a build/ folder left in the tree, whose stale modules would hide
    # a package missing from the list.
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".*", "build", "*.egg-info", "__pycache__", "docker", "benchmarks", "tests"))  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path),
         str(source)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    (wheel,) = tmp_path.glob("mhaserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(expected - names)
    assert not missing, f"modules missing from the wheel (add their packages to pyproject.toml): {missing}"
    assert "mhaserve/server/rest.py" in names and "mhaserve/protos/grpc_service.proto" in names
