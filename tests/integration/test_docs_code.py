"""Every Python block of the README, the tutorials and the how-to guides runs as written against a live server of
the default model (512/8, the one the docs call), each in its own process, and prints what its comments say it
prints: a line ``print(...)  # (2, 16, 512) ...`` must print exactly what follows the ``#``. So does every shell
block that only calls a running server (``mhaserve infer``/``health``/``bench``, curl) or tunes one
(``mhaserve tune``). Only the ports differ: the docs' 127.0.0.1:8001 and :8000 become the test server's, and a
load test's points run for a fraction of a second (a tune's, one knob's).
(Blocks that start servers, engines or clusters are run by the tests of those: compose, Ray, perf_analyzer.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mhaserve.export.default_model import default_model_dir
from tests.support import ROOT
from tests.support.in_process import InProcessServer

DOCUMENTS = [ROOT / "README.md", ROOT / "docs" / "index.md", *sorted((ROOT / "docs" / "tutorials").glob("*.md")),
             *sorted((ROOT / "docs" / "how-to").glob("*.md"))]  # fmt: skip
# The tutorials' commands run with the checkout's environment on PATH (bare `mhaserve`); the how-tos' from the checkout.
CALLS_A_SERVER = re.compile(r"^((\.venv/bin/)?mhaserve (infer|health|bench|tune) |curl -s |(\.venv/bin/)?python -c )")
ELSEWHERE = re.compile(r"--url (?!127\.0\.0\.1)")  # a block for another host (a cluster's head, say)
# A load test's points cut short (the block's own flags still parse and apply); its SLOs may then miss on a busy
# machine, which `bench` reports with exit code 1 and "SLO missed", never a traceback or a usage error.
SHORT_LOAD = "--duration 0.5 --warmup 0.2 "
# A tune (which starts its own servers of the default model) cut to one knob's values, each measured once.
SHORT_TUNE = "--duration 0.3 --warmup 0.1 --repeats 1 --confirm 1 --knobs max_batch_size --processes 1 "
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
            commands = [command for command in commands if not command.startswith("#")]  # a comment between
            calls = commands and all(CALLS_A_SERVER.match(command) for command in commands)
            if calls and not ELSEWHERE.search(code):
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
        for command in ("mhaserve infer ", "mhaserve bench "):  # bare or under .venv/bin/ alike
            code = re.sub(f"{command}(?!compare)", f"{command}--url {docs_server.url} ", code)
    code = re.sub("mhaserve bench (?!compare)", f"mhaserve bench {SHORT_LOAD}", code)
    code = code.replace("mhaserve tune ", f"mhaserve tune {SHORT_TUNE}")
    # In a folder of its own, with the environment on PATH (`source .venv/bin/activate`), and a HOME of its own
    # (the default model's cache kept: a tune serves it).
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "HOME": str(tmp_path),
           "MHASERVE_CACHE": str(default_model_dir().parents[1])}  # fmt: skip
    done = subprocess.run(["bash", "-e", "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=env)  # fmt: skip
    missed_slo = (
        done.returncode == 1
        and "--slo" in code
        and ("SLO missed" in done.stdout or "no candidate held every SLO" in done.stdout)
    )
    assert done.returncode == 0 or missed_slo, f"{name}:\n{code}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    assert "Traceback" not in done.stderr, f"{name}:\n{code}\n{done.stderr[-3000:]}"
    assert not re.search(r"\berror\b", done.stdout, re.I), (
        f"{name}: {done.stdout[-2000:]}"
    )  # (an "errors" column is no error)
