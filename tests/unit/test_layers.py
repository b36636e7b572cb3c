"""Which part of mhaserve may import which: the served contract is a leaf that client and server both read,
the clients never import the server, the server never imports torch's parts (model, export) or the clients,
and only the CLI, at the top, reaches everything."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support import ROOT

FOLDERS = {
    "mhaserve.model": "model",
    "mhaserve.export": "export",
    "mhaserve.server": "server",
    "mhaserve.protos": "protos",
}
MAY_IMPORT = {
    "contract": {"contract"},
    "protos": {"protos"},
    "model": {"model", "contract"},
    "export": {"export", "model", "contract", "protos"},
    "server": {"server", "contract", "protos"},
    "client": {"client", "contract", "protos"},
    # the checked load computes each answer's reference by running the model file as the server does
    "loadtest": {"loadtest", "client", "contract", "protos", "server"},
    "testing": {"testing", "loadtest", "server"},  # the test helpers start real servers as tune does (server.process)
    "cli": {"cli", "client", "contract", "export", "model", "server", "loadtest", "protos"},
}


def part_of(module: str) -> str:
    """'mhaserve.server.grpc.servicer' -> 'server'; 'mhaserve' itself (the version) -> 'contract'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "contract"


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in {"mhaserve": "mhaserve", **FOLDERS}.items():
        for path in (ROOT / folder).rglob("*.py"):
            if "generated" in path.parts:
                continue
            relative = path.relative_to(ROOT / folder).with_suffix("").parts
            relative = relative[:-1] if relative[-1] == "__init__" else relative
            found[".".join([package, *relative])] = path
    return found


def imports_of(module: str, path: Path) -> set[str]:
    """Every mhaserve module the file imports, at the top or inside a function, relative imports resolved."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("mhaserve"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                found.add(".".join(base + ([node.module] if node.module else [])))
            elif node.module and node.module.startswith("mhaserve"):
                found.add(node.module)
    return found


def test_each_part_imports_only_the_parts_below_it():
    crossings = []
    for module, path in sorted(modules().items()):
        part = part_of(module)
        if module == "mhaserve":
            continue
        for imported in sorted(imports_of(module, path)):
            if imported != "mhaserve" and part_of(imported) not in MAY_IMPORT[part]:
                crossings.append(f"{module} imports {imported}")
    assert not crossings, "\n".join(crossings)


def test_every_part_is_known():
    assert {part_of(module) for module in modules() if module != "mhaserve"} <= set(MAY_IMPORT)
