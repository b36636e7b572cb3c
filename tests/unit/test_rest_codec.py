"""The REST binding in process: the codec on its own, then the transport's routes on a real aiohttp test server
over a data plane in the test's own event loop (body limits, compression, binary tensors, refusals as JSON)."""

from __future__ import annotations

import asyncio
import gzip

import aiohttp
import numpy as np
import orjson
import pytest

from mhaserve.contract.signature import ModelSignature
from mhaserve.server.config import ServerSettings
from mhaserve.server.dataplane import DataPlane
from mhaserve.server.errors import ErrorKind, RequestError
from mhaserve.server.inference import InferenceResponse
from mhaserve.server.rest.codec import HEADER_LENGTH, decode_rest_request, encode_rest_response, header_length_of
from mhaserve.server.rest.routes import RestTransport
from mhaserve.server.rest.site import start_site
from tests.support import SMALL_D_MODEL, eager, rand

BODY_LIMIT = 200_000


def json_input(array: np.ndarray, name: str = "query") -> dict:
    return {"name": name, "shape": list(array.shape), "datatype": "FP32", "data": array.ravel().tolist()}


def test_json_and_binary_inputs_decode_to_the_same_arrays():
    query, key = rand(1, 3, 8, seed=1), rand(1, 4, 8, seed=2)
    as_json = orjson.dumps({"id": "a", "inputs": [json_input(query), json_input(key, "key")]})
    header = orjson.dumps({"inputs": [
        {"name": "query", "shape": [1, 3, 8], "datatype": "FP32", "parameters": {"binary_data_size": query.nbytes}},
        json_input(key, "key"),
    ]})  # fmt: skip
    for body, length in ((as_json, None), (header + query.tobytes(), len(header))):
        decoded = decode_rest_request("mha", "", body, length)
        np.testing.assert_array_equal(decoded.inputs["query"], query)
        np.testing.assert_array_equal(decoded.inputs["key"], key)


@pytest.mark.parametrize(
    "body, length, words",
    [
        (b"[1, 2]", None, "the request body is a JSON array, expected an object with 'inputs'"),
        (b"null", None, "the request body is a JSON null, expected an object with 'inputs'"),
        (b"{", None, "not valid JSON"),
        (b'{"inputs": []}', 99, f"{HEADER_LENGTH} 99 is longer than the body"),
        (b'{"inputs": [{"name": "query", "shape": [2], "datatype": "FP32", "data": [1, [2]]}]}', None, "ragged"),
        (b'{"inputs": [], "id": {"a": 1}}', None, "the request's 'id' must be a string"),
        (
            b'{"inputs": [{"name": "query", "shape": [2], "datatype": "FP32", "data": ["1", "2"]}]}',
            None,
            "input 'query': 'data' holds strings, not FP32 numbers",
        ),
        (
            b'{"inputs": [{"name": "query", "shape": [2], "datatype": "FP32", "data": [1, null]}]}',
            None,
            "input 'query': 'data' holds values that are not all numbers",
        ),
        (
            b'{"inputs": [{"name": "query", "shape": [2], "datatype": "FP32", "data": [true, false]}]}',
            None,
            "input 'query': FP32 data must be numbers, not true or false",
        ),
        (
            b'{"inputs": [{"name": "mask", "shape": [2], "datatype": "INT64", "data": [true, false]}]}',
            None,
            "input 'mask': INT64 data must be numbers, not true or false",
        ),
        # 1.0 is shown as written; an integer past 64 bits, which JSON decoders read as a float, as too large
        (
            b'{"inputs": [{"name": "query", "shape": [1, 1.0], "datatype": "FP32", "data": [1]}]}',
            None,
            "'shape' is [1, 1.0], expected a list of integers",
        ),
        (
            b'{"inputs": [{"name": "query", "shape": [1, 99999999999999999999], "datatype": "FP32", "data": [1]}]}',
            None,
            "input 'query': 'shape' has a dimension of 2^63 or more",
        ),
        (
            b'{"inputs": [{"name": "query", "shape": [1], "datatype": "FP32", "data": [1.0], '
            b'"parameters": {"binary_data_size": 4}}]}\x00\x00\x80\x3f',
            119,
            "input 'query': has both 'data' and a binary_data_size parameter; give one",
        ),
    ],
)
def test_a_body_that_is_no_request_is_refused_saying_why(body, length, words):
    with pytest.raises(RequestError) as refused:
        decode_rest_request("mha", "", body, length)
    assert words in refused.value.message


def test_binary_outputs_follow_the_json_header_and_json_ones_are_inline():
    request = decode_rest_request("mha", "", orjson.dumps({
        "inputs": [json_input(rand(1, 2, 8))],
        "outputs": [{"name": "output", "parameters": {"binary_data": True}}, {"name": "attn_weights"}],
    }), None)  # fmt: skip
    output, weights = rand(1, 2, 8, seed=3), rand(1, 2, 2, 2, seed=4)
    response = InferenceResponse(ModelSignature("mha", "1", 8, 2), request, {"output": output, "attn_weights": weights})
    body, length = encode_rest_response(response)
    header = orjson.loads(body[:length])
    described = {o["name"]: o for o in header["outputs"]}
    assert described["output"]["parameters"]["binary_data_size"] == output.nbytes
    np.testing.assert_array_equal(np.frombuffer(body[length:], np.float32).reshape(output.shape), output)
    np.testing.assert_allclose(np.asarray(described["attn_weights"]["data"]).reshape(weights.shape), weights)


class Client:
    """Requests to the site on 127.0.0.1, by path."""

    def __init__(self, session: aiohttp.ClientSession, port: int):
        self._session, self._base = session, f"http://127.0.0.1:{port}"

    async def post(self, path: str, **options) -> aiohttp.ClientResponse:
        return await self._session.post(self._base + path, **options)


def serving(scenario, model_dir):
    """``scenario(client, dataplane)`` against the REST routes of a data plane serving ``model_dir``, on the
    server's own aiohttp site, in this test's event loop."""

    async def main():
        dataplane = DataPlane(ServerSettings(warmup_runs=0), model_dir)
        await dataplane.start()
        transport = RestTransport(dataplane, None, BODY_LIMIT, read_timeout_s=5, write_timeout_s=5)
        runner, port = await start_site(
            transport.application(), "127.0.0.1", 0, max_connections=8, idle_timeout_s=5, what="HTTP"
        )
        try:
            async with aiohttp.ClientSession(auto_decompress=False) as session:
                return await scenario(Client(session, port), dataplane)
        finally:
            await runner.cleanup()
            dataplane.shutdown()

    return asyncio.run(main())


def test_the_infer_route_answers_plain_and_gzipped_bodies_alike(small_model_dir, small_module):
    query = rand(1, 4, SMALL_D_MODEL, seed=5)
    body = orjson.dumps({"inputs": [json_input(query)], "outputs": [{"name": "output"}]})

    async def scenario(client, dataplane):
        plain = await client.post("/v2/models/mha/infer", data=body)
        packed = await client.post(
            "/v2/models/mha/infer", data=gzip.compress(body), headers={"Content-Encoding": "gzip"}
        )
        return plain.status, await plain.json(), packed.status, await packed.json()

    plain_status, plain, packed_status, packed = serving(scenario, small_model_dir)
    assert plain_status == packed_status == 200 and plain["outputs"] == packed["outputs"]
    want, _ = eager(small_module, query, query, query)
    np.testing.assert_allclose(np.asarray(plain["outputs"][0]["data"]).reshape(want.shape), want, atol=1e-5)


def test_bodies_past_the_limit_are_refused_before_they_are_held(small_model_dir):
    async def scenario(client, dataplane):
        over = await client.post("/v2/models/mha/infer", data=b"x" * (BODY_LIMIT + 1))
        bomb = gzip.compress(b" " * (BODY_LIMIT * 4))  # small on the wire, past the limit inflated
        inflated = await client.post("/v2/models/mha/infer", data=bomb, headers={"Content-Encoding": "gzip"})
        unknown = await client.post("/v2/models/mha/infer", data=b"{}", headers={"Content-Encoding": "br"})
        answers = [(r.status, (await r.json())["error"]) for r in (over, inflated, unknown)]
        return answers, dataplane.accounting.budget.request_bytes

    (over, inflated, unknown), held = serving(scenario, small_model_dir)
    assert over[0] == 413 and f"over the limit of {BODY_LIMIT} bytes" in over[1]
    assert inflated[0] == 413 and "inflates (gzip) past the limit" in inflated[1]
    assert unknown[0] == 415 and "Content-Encoding 'br' is not accepted" in unknown[1]
    assert held == 0


def test_refusals_are_json_with_the_http_status_of_their_kind(small_model_dir):
    async def scenario(client, dataplane):
        missing = await client.post("/v2/models/nope/infer", data=b'{"inputs": []}')
        wrong = await client.post("/v2/models/mha/infer", data=orjson.dumps({"inputs": [json_input(rand(1, 2, 3))]}))
        return [(r.status, (await r.json())["error"]) for r in (missing, wrong)]

    missing, wrong = serving(scenario, small_model_dir)
    assert missing[0] == 404 and "unknown model 'nope'" in missing[1]
    assert wrong[0] == 400 and "query" in wrong[1]


@pytest.mark.parametrize("given", ["-5", "12a", "²", "١٢"])  # "²" passed str.isdigit and failed int(): a 500
def test_a_header_length_that_is_not_a_count_of_bytes_is_refused(given):
    with pytest.raises(RequestError, match="expected the JSON header's length in bytes") as refused:
        header_length_of(given)
    assert refused.value.kind == ErrorKind.INVALID_ARGUMENT
