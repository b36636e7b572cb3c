"""Every Python block of the README, the tutorials and the how-to guides runs as written against a live server of
the default model (512/8, the one the docs call), each in its own process, and prints what its comments say it
prints: a line ``print(...)  # (2, 16, 512) ...`` must print exactly what follows the ``#``. So does every shell
block that only calls a running server (``mhaserve infer``/``health``, curl). Only the ports differ: the docs'
127.0.0.1:8001 and :8000 become the test server's. (Blocks that start servers, engines or clusters are run by
the tests of those: compose, Ray, perf_analyzer.)"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT
from tests.support.in_process import InProcessServer

DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs" / "tutorials").glob("*.md")),
             *sorted((ROOT / "docs" / "how-to").glob("*.md"))]  # fmt: skip
CALLS_A_SERVER = re.compile(r"^(\.venv/bin/mhaserve (infer|health) |curl -s |\.venv/bin/python -c )")
EXPECTED = re.compile(r"^\s*print\(.*\)\s+#\s*(.+)$")


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(info string, content) of each fenced block, fences paired in order."""
    blocks, info, lines = [], None, []
    for line in text.splitlines():
        if line.startswith("```"):
            if info is None:
                info, lines = line[3:].strip(), []
            else:
                blocks.append((info, "\n".join(lines) + "\n"))
                info = None
        elif info is not None:
            lines.append(line)
    return blocks


def python_blocks() -> list[tuple[str, str]]:
    blocks = []
    for document in DOCUMENTS:
        python = [code for info, code in fenced_blocks(document.read_text()) if info == "python"]
        blocks += [(f"{document.relative_to(ROOT)}#{number}", code) for number, code in enumerate(python, 1)]
    return blocks


def shell_blocks() -> list[tuple[str, str]]:
    """The shell blocks whose every command calls a running server (a line ending in \\ goes on)."""
    blocks = []
    for document in DOCUMENTS:
        shell = [code for info, code in fenced_blocks(document.read_text()) if info == ""]
        for number, code in enumerate(shell, 1):
            commands = re.sub(r"(\\)?\n[ \t]+", " ", code).strip().splitlines()  # continued lines joined
            if commands and all(CALLS_A_SERVER.match(command) for command in commands):
                blocks.append((f"{document.relative_to(ROOT)}#shell{number}", code))
    return blocks


BLOCKS = python_blocks()
SHELL_BLOCKS = shell_blocks()


def test_the_docs_have_python_blocks_to_run():
    assert len(BLOCKS) >= 6, [name for name, _ in BLOCKS]


@pytest.fixture(scope="module")
def docs_server():
    from mhaserve.export.default_model import ensure_default_model

    with InProcessServer(ensure_default_model(), "--allow-client-shm", "true", "--warmup-runs", "0") as server:
        yield server


@pytest.mark.parametrize("name,code", BLOCKS, ids=[name for name, _ in BLOCKS])
def test_a_python_block_runs_as_written_and_prints_what_it_says(docs_server, tmp_path, name, code):
    http = docs_server.http_url.removeprefix("http://")
    code = code.replace("127.0.0.1:8001", docs_server.url).replace("127.0.0.1:8000", http)
    expected = [m.group(1).strip() for line in code.splitlines() if (m := EXPECTED.match(line))]
    script = tmp_path / "block.py"
    script.write_text(code)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{name}:\n{code}\n{done.stderr[-3000:]}"
    printed = [line.strip() for line in done.stdout.splitlines()]
    assert printed == expected, f"{name} printed {printed}, its comments say {expected}"


def test_the_docs_have_shell_blocks_to_run():
    assert len(SHELL_BLOCKS) >= 3, [name for name, _ in SHELL_BLOCKS]


@pytest.mark.parametrize("name,code", SHELL_BLOCKS, ids=[name for name, _ in SHELL_BLOCKS])
def test_a_shell_block_that_calls_the_server_runs_as_written(docs_server, tmp_path, name, code):
    http = docs_server.http_url.removeprefix("http://")
    code = code.replace("127.0.0.1:8001", docs_server.url).replace("127.0.0.1:8000", http)
    code = code.replace(".venv/bin/", f"{Path(sys.executable).parent}/")
    if "--url" not in code:  # a command that relies on the default address: the test server's
        code = code.replace("mhaserve infer ", f"mhaserve infer --url {docs_server.url} ")
    done = subprocess.run(["bash", "-e", "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0 and "Traceback" not in done.stderr, f"{name}:\n{code}\n{done.stderr[-3000:]}"
    assert "error" not in done.stdout.lower(), f"{name}: {done.stdout[-2000:]}"
