"""Attention summaries on a real server: per head and query row the entropy of its weights, its weight on the first
key, its largest weight and that key, over every key; equal to the same summaries of the float64 module's weights,
for the chosen heads and rows, through gRPC, HTTP, the Python clients, tritonclient, a sequence's steps and `mhaserve
infer`; a row that may attend no key summarised as zeros and key -1."""

from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from mhaserve.client import Client, HttpClient, WeightsOptions
from mhaserve.export.summaries import exact_summaries as summaries_of_weights
from tests.support import SMALL_D_MODEL, rand
from tests.support.triton import triton_http, triton_infer

SUMMARIES = ("attn_weights_entropy", "attn_weights_sink", "attn_weights_max", "attn_weights_max_index")
# float32 arithmetic against float64: the weights are within 1e-6 of it, so are their summaries
WITHIN = 1e-5


def exact_summaries(module, query, mask):
    """The summaries of the module's weights computed in float64 (-sum p ln p, p[0], max p, argmax p; -1 where the
    row's weights are all zero), by short name, as the export states them."""
    with torch.no_grad():
        _, weights = module.double()(torch.from_numpy(query.astype(np.float64)), mask=torch.from_numpy(mask))
        module.float()
    exact = summaries_of_weights(weights.numpy())
    return {name.removeprefix("attn_weights_"): value for name, value in exact.items()}


def inputs():
    """Two sequences; the second padded past 7 keys, its row 3 attending no key; a peaked row and flat ones."""
    query = rand(2, 12, SMALL_D_MODEL, seed=31) * np.float32(3)
    mask = np.ones((2, 12, 12), bool)
    mask[1, :, 7:] = False
    mask[1, 3] = False
    return query, mask


def assert_summarised(got: dict, want: dict, heads=slice(None), rows=slice(None)) -> None:
    for name in ("entropy", "sink", "max"):
        np.testing.assert_allclose(got[name], want[name][:, heads, rows], atol=WITHIN, err_msg=name)
    assert got["entropy"].dtype == np.float32 and got["max_index"].dtype == np.int64
    np.testing.assert_array_equal(got["max_index"], want["max_index"][:, heads, rows])


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_summaries_equal_the_float64_module_s_and_cost_no_weights_on_the_wire(server, small_module, transport):
    query, mask = inputs()
    want = exact_summaries(small_module, query, mask)
    client = Client(server.url) if transport == "grpc" else HttpClient(server.http_url[len("http://") :])
    with client:
        result = client.infer(query, mask=mask, attn_weights=False, weights=WeightsOptions(summaries=True))
        chosen = client.infer(query, mask=mask, attn_weights=False,
                              weights=WeightsOptions(heads=[3, 1], rows="2:6", keys="0:4", summaries=True))  # fmt: skip
    assert set(result.outputs) == {"output", *SUMMARIES}  # the weights themselves never sent
    assert result.summaries["entropy"].shape == (2, 4, 12)
    assert_summarised(result.summaries, want)
    assert (
        result.summaries["max_index"][1, :, 3].tolist() == [-1] * 4 and not result.summaries["entropy"][1, :, 3].any()
    )
    # the heads and rows chosen; a key window does not cut what a row is summarised over
    assert_summarised(chosen.summaries, want, heads=[3, 1], rows=slice(2, 6))


def test_summaries_alone_take_the_summaries_graph_and_beside_weights_come_from_them(server, small_module):
    from mhaserve.contract.signature import graph_outputs_for

    with Client(server.url) as client:  # the version runs its summaries graph (export/summaries.py)
        assert client.config().parameters["summaries_graph"].string_value == "true"
        query, mask = inputs()
        both = client.infer(query, mask=mask, weights=WeightsOptions(summaries=True))  # weights asked too
    assert_summarised(both.summaries, exact_summaries(small_module, query, mask))
    # a run asking for summaries alone fetches them from the graph; one with weights, the weights
    assert graph_outputs_for(("output", *SUMMARIES), summaries_graph=True) == ("output", *SUMMARIES)
    assert graph_outputs_for(("attn_weights_max_index",), summaries_graph=True) == (  # the overflow check reads it
        "attn_weights_entropy",
        "attn_weights_max_index",
    )
    assert graph_outputs_for(("attn_weights", *SUMMARIES), summaries_graph=True) == ("attn_weights",)
    assert graph_outputs_for(("output", *SUMMARIES), summaries_graph=False) == ("output", "attn_weights")


@pytest.mark.parametrize("name", SUMMARIES)
def test_each_summary_can_be_asked_for_alone(server, small_module, name):
    query, mask = inputs()
    want = exact_summaries(small_module, query, mask)[name.removeprefix("attn_weights_")]
    result = triton_infer(triton_http(server), query, mask, False, outputs=(name,))
    np.testing.assert_allclose(result.as_numpy(name), want, atol=WITHIN)


def test_tritonclient_asks_for_summaries_by_name(server, small_module):
    query, mask = inputs()
    want = exact_summaries(small_module, query, mask)
    result = triton_infer(triton_http(server), query, mask, True, outputs=SUMMARIES)
    got = {name.removeprefix("attn_weights_"): result.as_numpy(name) for name in SUMMARIES}
    assert_summarised(got, want)


def test_a_sequence_s_steps_are_summarised_over_every_key_so_far(server, small_module):
    x = rand(1, 5, SMALL_D_MODEL, seed=32)
    with Client(server.url) as client, client.sequence() as sequence:
        sequence.step(x[:, :3])
        last = sequence.step(x[:, 3:], attn_weights=False, weights=WeightsOptions(summaries=True), end=True)
    causal = np.tril(np.ones((1, 5, 5), bool))
    want = exact_summaries(small_module, x, causal)
    assert_summarised(last.summaries, want, rows=slice(3, 5))


def test_the_cli_prints_each_head_s_summary_and_the_metadata_lists_the_outputs(server):
    command = [sys.executable, "-m", "mhaserve.cli", "infer", "--url", server.url, "--q-len", "6", "--no-weights",
               "--summaries"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "attn_weights_entropy: [1, 4, 6]" in done.stdout and "attn_weights_max_index: [1, 4, 6]" in done.stdout
    assert "summaries of item 0, last query row" in done.stdout and "  head 3: entropy " in done.stdout, done.stdout
    with Client(server.url) as client:
        outputs = {o.name: (o.datatype, list(o.shape)) for o in client.metadata().outputs}
    assert outputs["attn_weights_entropy"] == ("FP32", [-1, -1, -1])
    assert outputs["attn_weights_max_index"] == ("INT64", [-1, -1, -1])


def test_a_model_may_go_without_the_summaries_graph_and_still_answer_them(start_server, small_model_dir, small_module,
                                                                            tmp_path):  # fmt: skip
    # its config.pbtxt turns the graph off (one copy of the projection weights fewer): the summaries come from the
    # full graph's weights, the same within float32
    folder = tmp_path / "mha"
    shutil.copytree(small_model_dir, folder)
    with (folder / "config.pbtxt").open("a") as config:
        config.write('parameters { key: "summaries_graph" value { string_value: "false" } }\n')
    server = start_server(folder, "--warmup-runs", "0")
    assert "summaries_graph=no" in server.log
    query, mask = inputs()
    with Client(server.url) as client:
        assert client.config().parameters["summaries_graph"].string_value == "false"
        result = client.infer(query, mask=mask, attn_weights=False, weights=WeightsOptions(summaries=True))
    assert set(result.outputs) == {"output", *SUMMARIES}
    assert_summarised(result.summaries, exact_summaries(small_module, query, mask))
