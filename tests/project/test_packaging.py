"""The built wheel holds every package of the source tree: a subpackage that setup.py fails to find imports
fine in the editable install yet is absent from `pip install .` (what the Dockerfile runs)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile

from tests.support import ROOT  # noqa: E402


def test_the_wheel_holds_every_package_folder_and_module_but_the_checkouts_own(tmp_path):
    folders = {package: ROOT / folder for package, folder in _setup_parts().items()}
    checkout_only = _setup_value("CHECKOUT_ONLY")
    expected = set()
    for package, folder in folders.items():
        for init in folder.rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            relative = init.parent.relative_to(folder)
            subpackage = ".".join([package, *relative.parts]) if relative.parts else package
            if subpackage in checkout_only:
                continue
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
    assert not missing, f"modules missing from the wheel: {missing}"
    assert "mhaserve/server/rest/routes.py" in names and "mhaserve/protos/grpc_service.proto" in names
    assert not [name for name in names if name.startswith("mhaserve/testing/")], "test helpers went into the wheel"


def _setup_parts() -> dict[str, str]:
    """setup.py's PARTS (package -> folder)."""
    return _setup_value("PARTS")


def _setup_value(name: str):
    """A constant of setup.py, read without running setup()."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    (value,) = [node.value for node in tree.body if isinstance(node, ast.Assign) and node.targets[0].id == name]
    return ast.literal_eval(value)
