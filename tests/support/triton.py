"""Triton's own clients against mhaserve: tritonclient.grpc in its own process (its protobuf messages would
clash with mhaserve's in this one), tritonclient.http in process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

from . import CLIENT_SCRIPTS, SMALL_D_MODEL

D = SMALL_D_MODEL
SCRIPT = CLIENT_SCRIPTS / "triton_infer.py"
INPUTS = ("query", "key", "value", "mask")


def cases():
    rng = np.random.default_rng(3)
    padding = np.array([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=bool)
    return {
        "batch1len1": {"query": rng.standard_normal((1, 1, D), dtype=np.float32)},
        "self": {"query": rng.standard_normal((2, 7, D), dtype=np.float32)},
        "cross": {
            "query": rng.standard_normal((2, 3, D), dtype=np.float32),
            "key": rng.standard_normal((2, 5, D), dtype=np.float32),
            "value": rng.standard_normal((2, 5, D), dtype=np.float32),
            "mask": padding,
        },
    }


def run_triton_client(
    server, tmp_path, mode, all_cases=None, outputs="output,attn_weights", application=None, parameters=None
):
    """Each case's answers from tritonclient in its own process: {case_output: array} for each output asked;
    ``application``: the Ray Serve application behind the proxy at server.url; ``parameters``: the request
    parameters every inference sends."""
    path_in, path_out = tmp_path / "in.npz", tmp_path / f"out-{mode}.npz"
    all_cases = cases() if all_cases is None else all_cases
    np.savez(path_in, **{f"{case}_{name}": a for case, arrays in all_cases.items() for name, a in arrays.items()})
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            server.url,
            str(path_in),
            str(path_out),
            mode,
            outputs,
            *[application] * bool(application),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TRITON_PARAMETERS": json.dumps(parameters)},
    )
    assert done.returncode == 0, done.stderr
    return np.load(path_out)


def triton_http(server):
    import tritonclient.http as httpclient

    return httpclient.InferenceServerClient(server.http_url.removeprefix("http://"))


def triton_infer(client, query, mask=None, binary=True, outputs=("output", "attn_weights"), parameters=None):
    import tritonclient.http as httpclient

    tensors = []
    for name, array in (("query", query), ("mask", mask)):
        if array is not None:
            tensor = httpclient.InferInput(name, list(array.shape), "FP32" if name == "query" else "BOOL")
            tensor.set_data_from_numpy(array, binary_data=binary)
            tensors.append(tensor)
    wanted = [httpclient.InferRequestedOutput(name, binary_data=binary) for name in outputs]
    return client.infer("mha", tensors, outputs=wanted, parameters=parameters)
