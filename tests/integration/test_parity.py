"""Live parity against real servers: with --parity-share 1 every answer is recomputed in float64 from the served
graph's weights, off the request path; a faithful export holds at any input scale, and a graph whose computation
drifts while its weights stay (its 1/sqrt(d_k) scaling 1% off) is caught, counted and logged with the request."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import requests

from mhaserve.client.grpc import Client
from tests.support import SMALL_D_MODEL, parity_checks, rand, scrape
from tests.support.exports import drifted_copy

pytest.importorskip("onnx")  # the export extra: the drifted graph is written with it


def asked(server, requests: int, scale: float = 1.0) -> None:
    with Client(server.url) as client:
        for seed in range(requests):
            client.infer(rand(2, 9, SMALL_D_MODEL, seed=seed) * np.float32(scale))


def checks_until(server, reached) -> dict[str, float]:
    """The server's checks by outcome, once ``reached(counted)`` (or 30 s on)."""
    deadline = time.monotonic() + 30
    while not reached(counted := parity_checks(server)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return counted


def test_a_faithful_export_holds_at_every_input_scale(start_server, small_model_dir):
    server = start_server(small_model_dir, "--parity-share", "1")
    for scale in (0.01, 1.0, 30.0, 1000.0):
        asked(server, 4, scale)
    counted = checks_until(server, lambda counted: counted.get("held", 0) >= 16)
    assert counted == {"held": 16, "breached": 0, "dropped": 0}, counted
    with Client(server.url) as client:  # the version's statistics and metadata say so too
        parity = client.statistics().parity
        parameters = client.metadata().parameters
    assert (parity.share, parity.checked, parity.held, parity.breached, parity.dropped) == (1.0, 16, 16, 0, 0)
    assert 0 < parity.worst_error["output"] < 1e-3 and 0 < parity.worst_error["attn_weights"] < 1e-3, parity
    assert {name: value.WhichOneof("parameter_choice") for name, value in parameters.items()} == {
        "parity_share": "double_param",
        "parity_checked": "int64_param",
        "parity_breached": "int64_param",
    }
    assert parameters["parity_checked"].int64_param == 16
    http = requests.get(f"{server.http_url}/v2/models/mha/stats", timeout=5).json()["model_stats"][0]["parity"]
    assert (http["checked"], http["breached"]) == (16, 0)


def test_a_graph_that_drifts_from_its_weights_is_caught_counted_and_logged(start_server, small_model_dir, tmp_path):
    server = start_server(drifted_copy(small_model_dir, tmp_path / "drifted"), "--parity-share", "1",
                          "--output-only-graph", "false")  # fmt: skip
    with Client(server.url) as client:
        client.infer(rand(2, 9, SMALL_D_MODEL, seed=3), request_id="drift-3")
    counted = checks_until(server, lambda counted: counted.get("breached"))
    assert counted["breached"] == 1 and counted["held"] == 0, counted
    breach = [line for line in server.log.splitlines() if "parity breached by request 'drift-3'" in line]
    assert breach and "output" in breach[0] and "attn_weights" in breach[0] and "exactly" in breach[0], server.log


def test_the_reference_is_the_module_in_float64_read_from_the_served_file(small_model_dir, small_module):
    import torch

    from mhaserve.server.parity import ReferenceWeights, exact_attention

    weights = ReferenceWeights.from_onnx(small_model_dir / "model.onnx")  # protobuf alone: no onnx, no torch
    for projection in ("q", "k", "v", "o"):
        linear = getattr(small_module, f"W_{projection}")
        np.testing.assert_array_equal(weights.weight(projection), linear.weight.detach().numpy().astype(np.float64))
    rng = np.random.default_rng(5)
    query, key = rng.standard_normal((2, 5, SMALL_D_MODEL)), rng.standard_normal((2, 7, SMALL_D_MODEL))
    mask = np.ones((2, 1, 5, 7), bool)
    mask[0, 0, 2, :] = False  # a row that may attend nothing: zeros
    mask[1, 0, :, 4:] = False  # padding keys
    output, attn = exact_attention(weights, small_module.num_heads, query, key, key, mask)
    with torch.no_grad():
        module = small_module.double()
        want_output, want_attn = module(*(torch.tensor(a) for a in (query, key, key, mask)))
        small_module.float()
    np.testing.assert_allclose(output, want_output.numpy(), atol=1e-12)
    np.testing.assert_allclose(attn, want_attn.numpy(), atol=1e-12)
    assert not output[0, 2].any() and not attn[0, :, 2].any()


def stepped(server, rng) -> None:
    """A self-attention sequence of three steps and a cross-attention one of two (keys given with each)."""
    x = rng.standard_normal((1, 9, SMALL_D_MODEL)).astype(np.float32)
    keys = rng.standard_normal((1, 6, SMALL_D_MODEL)).astype(np.float32)
    with Client(server.url) as client:
        with client.sequence("self") as sequence:
            for rows in (x[:, :4], x[:, 4:5], x[:, 5:]):
                sequence.step(rows, request_id="self-step")
        with client.sequence("cross") as sequence:
            sequence.step(x[:, :3], key=keys[:, :4], value=keys[:, :4])
            sequence.step(x[:, 3:4], key=keys[:, 4:], value=keys[:, 4:], end=True)


def test_sequence_steps_are_checked_over_the_keys_and_values_the_server_holds(start_server, small_model_dir):
    server = start_server(small_model_dir, "--parity-share", "1")
    stepped(server, np.random.default_rng(8))
    counted = checks_until(server, lambda counted: counted.get("held", 0) >= 5)
    assert counted == {"held": 5, "breached": 0, "dropped": 0}, counted


def test_a_step_graph_that_drifts_is_caught_and_its_sequence_named(start_server, small_model_dir, tmp_path):
    server = start_server(drifted_copy(small_model_dir, tmp_path / "drifted", "model_step.onnx"), "--parity-share", "1")
    stepped(server, np.random.default_rng(9))
    counted = checks_until(server, lambda counted: counted.get("held", 0) + counted.get("breached", 0) >= 5)
    # The self-attention steps ran on the drifted graph; the cross-attention ones on their own, untouched.
    assert counted == {"held": 2, "breached": 3, "dropped": 0}, counted
    assert "parity breached by request 'self-step' (a step of sequence 'self')" in server.log, server.log


def error_buckets(server, output: str) -> dict[float, float]:
    """The parity error histogram of ``output``: its cumulative count at each bucket's upper bound."""
    return {float(dict(labels)["le"]): value for (name, labels), value in scrape(server.metrics_url).items()
            if name == "mhaserve_parity_error_bucket" and dict(labels)["output"] == output}  # fmt: skip


def test_a_float16_model_near_the_edge_of_its_range_shows_its_errors_in_the_histogram(start_server, exported,
                                                                                      small_module):  # fmt: skip
    from mhaserve.contract.model_dir import read_manifest

    fp16_dir = exported.folder("fp16", small_module, precision="fp16")
    edge = read_manifest(fp16_dir)["validation"]["input_scales"]["max_abs_input"]  # the server refuses past it
    server = start_server(fp16_dir, "--parity-share", "1")
    with Client(server.url) as client:
        for seed in range(4):  # inputs whose largest magnitude is the edge the export was validated to
            x = rand(2, 9, SMALL_D_MODEL, seed=seed)
            client.infer(x * np.float32(0.999 * edge / np.abs(x).max()))
    counted = checks_until(server, lambda counted: counted.get("held", 0) + counted.get("breached", 0) >= 4)
    assert counted == {"held": 4, "breached": 0, "dropped": 0}, counted  # within float16's stated tolerance
    buckets = error_buckets(server, "output")
    # float16's rounding shows: every error above 1e-4 (float32's sit near 1e-7), none past its tolerance (4e-3).
    # (The weights are one-hot at this scale, as exact in float16 as in float64.)
    assert buckets[1e-4] == 0 and buckets[4e-3] == 4, buckets


def test_an_int8_graph_is_checked_with_its_own_weights(small_model_dir, small_module, tmp_path):
    """The reference of an int8 graph: the file's int8 values times their column scales, within half a step of
    the module's float weights."""
    import onnx

    from mhaserve.export.int8 import LEVELS, int8_projections
    from mhaserve.server.parity import ReferenceWeights

    path = tmp_path / "int8.onnx"
    onnx.save(int8_projections(onnx.load(small_model_dir / "model.onnx")), path)
    weights = ReferenceWeights.from_onnx(path)  # protobuf alone, as the server reads it
    for projection in ("q", "k", "v", "o"):
        linear = getattr(small_module, f"W_{projection}")
        exact = linear.weight.detach().numpy().astype(np.float64)
        step = np.abs(exact).max(axis=1, keepdims=True) / LEVELS  # one scale per output column of the int8 weight
        assert np.all(np.abs(weights.weight(projection) - exact) <= step / 2 * (1 + 1e-6)), projection
        assert not np.array_equal(weights.weight(projection), exact)  # the quantized ones, not the float ones
        np.testing.assert_array_equal(weights.bias[projection], linear.bias.detach().numpy().astype(np.float64))


def check_processes(server_pid: int) -> set[int]:
    """The server's children that make its checks (alive, not yet reaped)."""
    found = set()
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, IndexError):
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(stat[1]) == server_pid and stat[0] != "Z" and b"serve_checks" in (entry / "cmdline").read_bytes():
                found.add(int(entry.name))
    return found


def test_checks_run_in_a_process_of_their_own_at_the_lowest_priority_and_one_that_dies_is_replaced(
    start_server, small_model_dir
):
    """Recomputing an answer holds Python's lock between numpy calls; in a thread of the server's at the lowest
    priority, the kernel kept it off a busy host's cores while it held the lock, and the event loop waited for it.
    So the checks are a child process's, niced to 19; killed, the next check starts another, and the checks go
    on."""
    earlier = set(check_processes(os.getpid()))  # earlier tests' servers in this process: theirs end as they stop
    server = start_server(small_model_dir, "--parity-share", "1")

    def checks_reach(held: int) -> dict[str, float]:
        return checks_until(server, lambda counted: counted.get("held", 0) >= held)

    asked(server, 2)
    assert checks_reach(2)["held"] == 2
    (checker,) = check_processes(server.pid) - earlier
    niceness = int((Path("/proc") / str(checker) / "stat").read_text().rsplit(")", 1)[1].split()[16])
    assert niceness == 19
    os.kill(checker, signal.SIGKILL)
    asked(server, 4)  # the first check finds it gone (or going): it is lost, and the next starts another
    counted = checks_reach(5)
    assert counted["held"] >= 5 and counted["held"] + counted["dropped"] == 6 and not counted["breached"], counted
    (replacement,) = check_processes(server.pid) - earlier
    assert replacement != checker
    assert re.search(r"the parity check process stopped \((exit code -9|its connection lost: .*)\); starting another",
                     server.log), server.log  # fmt: skip
