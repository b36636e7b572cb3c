"""The usual set-up mistakes end in one line that says what to do, before any slow work, never a traceback: an
extra that is not installed (torch and onnx for export, matplotlib for plots), a folder that is not a model."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest


def mhaserve(*args: str, tmp_path, without: tuple[str, ...] = ()) -> tuple[subprocess.CompletedProcess, float]:
    """The command in a process where the ``without`` modules cannot be imported, as when an extra is missing."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text("import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in without))
    env = {"PYTHONPATH": str(site), "HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path / "cache"), "PATH": "/bin"}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "mhaserve.cli", *args], capture_output=True, text=True,
                          timeout=120, env=env)  # fmt: skip
    return done, time.monotonic() - started


def assert_one_line(done: subprocess.CompletedProcess, *words: str) -> None:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    for word in words:
        assert word in lines[0], lines[0]


@pytest.mark.parametrize(
    "args",
    [["export", "--out", "OUT"], ["serve", "--port", "0", "--http-port", "0", "--metrics-port", "0"]],
    ids=["export", "serve's first export"],
)
def test_a_missing_export_extra_is_one_line_with_the_install_command(tmp_path, args):
    args = [str(tmp_path / "out") if a == "OUT" else a for a in args]
    done, took = mhaserve(*args, tmp_path=tmp_path, without=("torch", "onnx"))
    assert_one_line(done, "'export' extra", "pip install -e '.[export]'", "pip install 'mhaserve[export]'")
    assert took < 15 and not (tmp_path / "out").exists()


def test_a_missing_plot_extra_is_said_before_the_sweep(tmp_path):
    # No server is listening: the refusal comes before bench connects, let alone runs its sweep.
    done, took = mhaserve("bench", "--url", "127.0.0.1:1", "--plot-dir", str(tmp_path / "plots"), tmp_path=tmp_path,
                          without=("matplotlib",))  # fmt: skip
    assert_one_line(done, "--plot-dir", "'plot' extra", "pip install -e '.[plot]'")
    assert took < 15


def test_validate_of_a_folder_that_is_not_a_model_is_one_line(tmp_path):
    done, _ = mhaserve("validate", str(tmp_path / "nope"), tmp_path=tmp_path)
    assert_one_line(done, "nope: no such folder", "'mhaserve export'")
    (tmp_path / "empty").mkdir()
    done, _ = mhaserve("validate", str(tmp_path / "empty"), tmp_path=tmp_path)
    assert_one_line(done, "no manifest.json")


def test_a_port_of_the_other_protocol_is_named_as_such(server, tmp_path):
    grpc_address, http_address = server.url, server.http_url.removeprefix("http://")
    done, _ = mhaserve("infer", "--protocol", "http", "--url", grpc_address, tmp_path=tmp_path)
    assert f"{grpc_address} speaks gRPC, not HTTP/REST: drop --protocol http" in done.stderr, done.stderr
    done, _ = mhaserve("infer", "--url", http_address, tmp_path=tmp_path)
    assert f"{http_address} speaks HTTP/REST, not gRPC: add --protocol http" in done.stderr, done.stderr
    assert "BadStatusLine" not in done.stderr and "Traceback" not in done.stderr


def test_a_length_over_the_limit_names_the_flag_that_raises_it(server, tmp_path):
    done, _ = mhaserve("infer", "--url", server.url, "--q-len", "65", tmp_path=tmp_path)  # the test server's 64
    assert "exceeds the limit max_q_len=64 (the server's --max-q-len raises it)" in done.stderr, done.stderr
