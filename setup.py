"""The wheel's packages are found, not listed: each top-level part below is one subpackage of ``mhaserve``,
and every folder with an ``__init__.py`` inside it is packaged, but for what only a checkout uses (the test
and benchmark helpers, importable from the editable install)."""

from setuptools import find_packages, setup

PARTS = {
    "mhaserve": "mhaserve",
    "mhaserve.model": "model",
    "mhaserve.export": "export",
    "mhaserve.server": "server",
    "mhaserve.protos": "protos",
}

CHECKOUT_ONLY = {"mhaserve.testing"}

setup(
    package_dir=PARTS,
    packages=sorted(
        {*PARTS, *(f"{package}.{sub}" for package, folder in PARTS.items() for sub in find_packages(folder))}
        - CHECKOUT_ONLY
    ),
)
