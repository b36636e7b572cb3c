"""The mhaserve client: numpy in, numpy out, raw bytes on the wire. Sync ``Client`` and asyncio ``AsyncClient``.

    with Client("127.0.0.1:8001") as client:
        result = client.infer(query)              # self-attention
        result.output, result.attn_weights        # numpy arrays

Works against any Open Inference Protocol server serving the same model signature.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import numpy as np

from mhaserve.protos.generated import grpc_service_pb2 as pb
from mhaserve.protos.generated import grpc_service_pb2_grpc as pb_grpc
from mhaserve.server.codec import DATATYPES, datatype_of

# Large enough for any response of the server's default limits (32 x 512 x 512 with weights);
# gRPC's own default of 4 MiB fails at [1, 512, 512] with weights.
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30


@dataclass
class InferResult:
    output: np.ndarray | None
    attn_weights: np.ndarray | None
    id: str = ""


def _channel_options(max_message_bytes: int):
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        # A name with several addresses (replicas behind one DNS name, e.g. dns:///server:8001 in a
        # compose network) gets a connection to each and calls spread over them; one address: no change.
        ("grpc.lb_policy_name", "round_robin"),
    ]


def build_infer_request(
    model: str,
    query: np.ndarray,
    key: np.ndarray | None = None,
    value: np.ndarray | None = None,
    mask: np.ndarray | None = None,
    attn_weights: bool = True,
    request_id: str = "",
) -> pb.ModelInferRequest:
    """One ModelInferRequest with every input as raw bytes (query, key, value FP32; mask as given)."""
    request = pb.ModelInferRequest(model_name=model, id=request_id)
    tensors = {"query": query, "key": key, "value": value, "mask": mask}
    for name, array in tensors.items():
        if array is None:
            continue
        array = np.ascontiguousarray(array, dtype=np.float32 if name != "mask" else None)
        request.inputs.add(name=name, datatype=datatype_of(array), shape=array.shape)
        request.raw_input_contents.append(array.tobytes())
    request.outputs.add(name="output")
    if attn_weights:
        request.outputs.add(name="attn_weights")
    return request


def parse_infer_response(response: pb.ModelInferResponse) -> InferResult:
    arrays = {}
    for index, tensor in enumerate(response.outputs):
        dtype, _ = DATATYPES[tensor.datatype]
        arrays[tensor.name] = np.frombuffer(response.raw_output_contents[index], dtype=dtype).reshape(tensor.shape)
    return InferResult(arrays.get("output"), arrays.get("attn_weights"), response.id)


class Client:
    """Blocking client. ``infer`` raises grpc.RpcError with the server's status on refusal."""

    def __init__(
        self,
        url: str = "127.0.0.1:8001",
        model: str = "mha",
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ):
        self.model = model
        self._channel = grpc.insecure_channel(url, options=_channel_options(max_message_bytes))
        self._stub = pb_grpc.GRPCInferenceServiceStub(self._channel)

    def infer(
        self, query, key=None, value=None, mask=None, attn_weights=True, timeout=None, request_id=""
    ) -> InferResult:
        request = build_infer_request(self.model, query, key, value, mask, attn_weights, request_id)
        return parse_infer_response(self._stub.ModelInfer(request, timeout=timeout))

    def ready(self, timeout=None) -> bool:
        return self._stub.ModelReady(pb.ModelReadyRequest(name=self.model), timeout=timeout).ready

    def wait_ready(self, timeout: float = 60.0) -> None:
        grpc.channel_ready_future(self._channel).result(timeout=timeout)

    def metadata(self, timeout=None) -> pb.ModelMetadataResponse:
        return self._stub.ModelMetadata(pb.ModelMetadataRequest(name=self.model), timeout=timeout)

    def statistics(self, timeout=None) -> pb.ModelStatistics:
        """The server's counters for this model (Triton's statistics extension)."""
        request = pb.ModelStatisticsRequest(name=self.model)
        return self._stub.ModelStatistics(request, timeout=timeout).model_stats[0]

    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncClient:
    """asyncio client with the same calls as Client."""

    def __init__(
        self,
        url: str = "127.0.0.1:8001",
        model: str = "mha",
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ):
        self.model = model
        self._channel = grpc.aio.insecure_channel(url, options=_channel_options(max_message_bytes))
        self._stub = pb_grpc.GRPCInferenceServiceStub(self._channel)

    async def infer(
        self, query, key=None, value=None, mask=None, attn_weights=True, timeout=None, request_id=""
    ) -> InferResult:
        request = build_infer_request(self.model, query, key, value, mask, attn_weights, request_id)
        return parse_infer_response(await self._stub.ModelInfer(request, timeout=timeout))

    async def ready(self, timeout=None) -> bool:
        return (await self._stub.ModelReady(pb.ModelReadyRequest(name=self.model), timeout=timeout)).ready

    async def metadata(self, timeout=None) -> pb.ModelMetadataResponse:
        return await self._stub.ModelMetadata(pb.ModelMetadataRequest(name=self.model), timeout=timeout)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
