"""The usual set-up mistakes end in one line that says what to do, before any slow work, never a traceback: an
extra that is not installed (torch and onnx for export, matplotlib for plots), a folder that is not a model."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import numpy as np
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
    assert_one_line(done, "empty/manifest.json: no manifest")


def test_a_port_of_the_other_protocol_is_named_as_such(server, tmp_path):
    grpc_address, http_address = server.url, server.http_url.removeprefix("http://")
    done, _ = mhaserve("infer", "--protocol", "http", "--url", grpc_address, tmp_path=tmp_path)
    assert f"{grpc_address} speaks gRPC, not HTTP/REST: give the HTTP port" in done.stderr, done.stderr
    assert "drop --protocol http" in done.stderr
    done, _ = mhaserve("infer", "--url", http_address, tmp_path=tmp_path)
    assert f"{http_address} speaks HTTP/REST, not gRPC: give the gRPC port" in done.stderr, done.stderr
    assert "--protocol http" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_python_clients_say_what_to_do_about_a_call_they_could_not_make(server):
    from mhaserve.client import AsyncClient, Client, RequestFailed
    from mhaserve.client.http import HttpClient
    from mhaserve.server.process import free_port

    grpc_address, http_address = server.url, server.http_url.removeprefix("http://")
    nowhere = f"127.0.0.1:{free_port()}"
    query = np.zeros((1, 2, 64), np.float32)

    def refusal(call) -> str:
        with pytest.raises(RequestFailed) as refused:
            call()
        return str(refused.value)

    async def async_infer(url):
        async with AsyncClient(url) as client:
            await client.infer(query, timeout=10)

    assert f"{http_address} speaks HTTP/REST, not gRPC: give the gRPC port (default 8001), or call it over HTTP " \
        "(HttpClient" in refusal(lambda: Client(http_address).infer(query, timeout=10))  # fmt: skip
    said = refusal(lambda: HttpClient(grpc_address).infer(query, timeout=10))
    assert f"{grpc_address} speaks gRPC, not HTTP/REST: give the HTTP port (default 8000)" in said, said
    assert said.isprintable(), said  # not the HTTP/2 frame read as a status line
    for call in (lambda: Client(nowhere).infer(query, timeout=10), lambda: asyncio.run(async_infer(nowhere)),
                 lambda: HttpClient(nowhere).infer(query, timeout=10)):  # fmt: skip
        said = refusal(call)
        assert f"nothing listens at {nowhere}: start the server (mhaserve serve) or give its address" in said, said


def test_a_length_over_the_limit_names_the_flag_that_raises_it(server, tmp_path):
    done, _ = mhaserve("infer", "--url", server.url, "--q-len", "65", tmp_path=tmp_path)  # the test server's 64
    assert "exceeds the limit max_q_len=64 (the server's --max-q-len raises it)" in done.stderr, done.stderr


def test_a_bad_setting_is_refused_before_the_first_export(tmp_path):
    # No default model in this HOME's cache: a refusal after the export would take a minute, and export it.
    for args, said in [
        (["--log-level", "verbose"], "--log-level must be DEBUG, INFO, WARNING or ERROR, got 'verbose'"),
        (["--dynamic-batching", "yes"], "--dynamic-batching: expected true or false, got 'yes'"),
    ]:
        done, took = mhaserve("serve", *args, tmp_path=tmp_path)
        first, *rest = done.stderr.strip().splitlines()
        assert done.returncode == 2 and said in first and rest in ([], ["(the flags: mhaserve serve --help)"]), done
        assert took < 15 and not (tmp_path / "cache" / "mhaserve").exists()


def test_an_argument_error_is_two_lines_not_the_usage(tmp_path):
    done, _ = mhaserve("bench", "--concurrency", "1,four", tmp_path=tmp_path)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 2, done.stderr
    assert lines == [
        "mhaserve bench: error: argument --concurrency: expected whole numbers of at least 1 separated by commas "
        "(e.g. 1,4,16), got '1,four'",
        "(the flags: mhaserve bench --help)",
    ]
    done, _ = mhaserve("serve", "--no-such-flag", tmp_path=tmp_path)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 2 and "--no-such-flag" in done.stderr


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--connections", "-1"], "argument --connections: expected a whole number of 0 or more, got '-1'"),
        (["--connections", "4", "--protocol", "http"], "--connections is for gRPC: over HTTP/REST each request"),
    ],
)
def test_connections_bench_cannot_open_are_refused_in_one_line_before_connecting(tmp_path, args, said):
    done, _ = mhaserve("bench", "--url", "127.0.0.1:1", *args, tmp_path=tmp_path)
    said_first, *rest = done.stderr.strip().splitlines()
    assert done.returncode == 2 and said in said_first, done.stderr
    assert rest in ([], ["(the flags: mhaserve bench --help)"]), done.stderr  # argparse's: where to look


def start_failure(tmp_path, *args: str) -> subprocess.CompletedProcess:
    done, _ = mhaserve("serve", "--port", "0", "--http-port", "0", "--metrics-port", "0", *args, tmp_path=tmp_path)
    assert "Traceback" not in done.stderr, done.stderr
    return done


def test_a_repository_where_nothing_loads_ends_the_start_with_each_reason(tmp_path, small_model_dir):
    repository = tmp_path / "repo"
    (repository / "mha" / "1").mkdir(parents=True)
    (repository / "mha" / "1" / "model.onnx").write_text("not a model")
    done = start_failure(tmp_path, "--model-repository", str(repository))
    assert done.returncode == 3, done.stderr
    assert f"no model of --model-repository {repository} loaded: mha version 1: " in done.stderr
    assert "manifest.json: no manifest" in done.stderr

    (tmp_path / "empty").mkdir()
    done = start_failure(tmp_path, "--model-repository", str(tmp_path / "empty"))
    assert done.returncode == 3 and "it holds no model folders" in done.stderr, done.stderr


def test_a_model_folder_given_as_a_repository_is_named_as_such(tmp_path, small_model_dir):
    done = start_failure(tmp_path, "--model-repository", str(small_model_dir))
    assert done.returncode == 3, done.stderr
    assert f"{small_model_dir} is a model folder (it holds manifest.json), not a repository" in done.stderr
    assert f"--model-dir {small_model_dir}" in done.stderr

    model = tmp_path / "repo" / "mha"
    model.mkdir(parents=True)
    (model / "1").symlink_to(small_model_dir, target_is_directory=True)
    done = start_failure(tmp_path, "--model-repository", str(model))
    assert done.returncode == 3 and "holds version folders (1): it is one model's folder" in done.stderr


def test_a_repository_or_a_file_given_as_a_model_folder_is_named_as_such(tmp_path, small_model_dir):
    repository = tmp_path / "repo"
    (repository / "mha").mkdir(parents=True)
    (repository / "mha" / "1").symlink_to(small_model_dir, target_is_directory=True)
    done = start_failure(tmp_path, "--model-dir", str(repository))
    assert done.returncode == 3, done.stderr
    assert f"{repository}: a model repository, not a model folder (its versions are folders like " in done.stderr
    assert f"serve it with --model-repository {repository}" in done.stderr
    done = start_failure(tmp_path, "--model-dir", str(small_model_dir / "model.onnx"))
    assert done.returncode == 3 and "model.onnx: a file, not a model folder" in done.stderr, done.stderr


def test_exit_on_error_false_starts_with_nothing_loaded(start_server_process, tmp_path):
    (tmp_path / "repo" / "mha" / "1").mkdir(parents=True)
    server = start_server_process(None, "--model-repository", str(tmp_path / "repo"), "--exit-on-error", "false")
    assert any("serving model=none" in line for line in server.lines)


def test_a_client_sent_to_the_metrics_port_is_told_where_it_is(server, tmp_path):
    metrics = server.metrics_url.removeprefix("http://").removesuffix("/metrics")
    done, _ = mhaserve("infer", "--protocol", "http", "--url", metrics, tmp_path=tmp_path)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "this is the metrics port, which serves /metrics only; the HTTP/REST API is on --http-port" in done.stderr
