"""gRPC transport for the Open Inference Protocol: protobuf in, codec + data plane, protobuf out."""

from __future__ import annotations

import functools
import logging

import grpc
from google.protobuf.message import DecodeError

import mhaserve
from mhaserve.protos.generated import grpc_service_pb2 as pb
from mhaserve.protos.generated import grpc_service_pb2_grpc as pb_grpc
from mhaserve.protos.generated import model_config_pb2 as mc
from mhaserve.signature import input_specs, output_specs

from .codec import decode_infer_request, encode_infer_response
from .dataplane import DataPlane
from .errors import ErrorKind, RequestError
from .registry import ServedModel

log = logging.getLogger("mhaserve.server")

PLATFORM = "onnxruntime_onnx"

# The data plane's refusals as gRPC statuses (the kinds are named after them).
GRPC_STATUS = {kind: grpc.StatusCode[kind.name] for kind in ErrorKind}
EXTENSIONS = ["model_configuration", "model_repository", "statistics"]


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    """Protobuf to and from the data plane; every decision (which version, whether to refuse) is the data
    plane's, and its RequestErrors become statuses through GRPC_STATUS."""

    def __init__(self, dataplane: DataPlane):
        self.dataplane = dataplane

    async def _resolve(self, name: str, version: str, context) -> ServedModel:
        try:
            return self.dataplane.resolve(name, version)
        except RequestError as error:
            await context.abort(GRPC_STATUS[error.kind], error.message)

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.dataplane.reports_ready)

    async def ModelReady(self, request, context):
        try:
            return pb.ModelReadyResponse(ready=self.dataplane.model_ready(request.name, request.version))
        except RequestError as error:
            await context.abort(GRPC_STATUS[error.kind], error.message)

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name="mhaserve", version=mhaserve.__version__, extensions=EXTENSIONS)

    async def ModelMetadata(self, request, context):
        s = (await self._resolve(request.name, request.version, context)).signature
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=s.name,
            versions=[str(v) for v in self.dataplane.registry.ready_versions(s.name)],
            platform=PLATFORM,
            inputs=[tensor(name=t.name, datatype=t.datatype, shape=t.shape) for t in input_specs(s.d_model)],
            outputs=[
                tensor(name=t.name, datatype=t.datatype, shape=t.shape) for t in output_specs(s.d_model, s.num_heads)
            ],
        )

    async def ModelConfig(self, request, context):
        s = (await self._resolve(request.name, request.version, context)).signature
        data_type = {"FP32": mc.TYPE_FP32, "BOOL": mc.TYPE_BOOL}
        config = mc.ModelConfig(
            name=s.name,
            platform=PLATFORM,
            backend="onnxruntime",
            # 0: the batch dim is part of every shape, as in the metadata (no implicit batching).
            max_batch_size=0,
            input=[
                mc.ModelInput(name=t.name, data_type=data_type[t.datatype], dims=t.shape, optional=t.optional)
                for t in input_specs(s.d_model)
            ],
            output=[
                mc.ModelOutput(name=t.name, data_type=data_type[t.datatype], dims=t.shape)
                for t in output_specs(s.d_model, s.num_heads)
            ],
            default_model_filename="model.onnx",
        )
        return pb.ModelConfigResponse(config=config)

    async def ModelStatistics(self, request, context):
        if request.name and request.version:
            served = [await self._resolve(request.name, request.version, context)]
        elif request.name:
            await self._resolve(request.name, "", context)  # NOT_FOUND for a model this server lacks
            served = [m for m in self.dataplane.registry.served_models() if m.signature.name == request.name]
        else:
            served = self.dataplane.registry.served_models()
        return pb.ModelStatisticsResponse(model_stats=[_statistics(m) for m in served])

    async def RepositoryIndex(self, request, context):
        await self._check_repository_name(request.repository_name, context)
        entry = pb.RepositoryIndexResponse.ModelIndex
        rows = self.dataplane.registry.index(ready_only=request.ready)
        return pb.RepositoryIndexResponse(
            models=[entry(name=n, version=v, state=state, reason=reason) for n, v, state, reason in rows]
        )

    async def RepositoryModelLoad(self, request, context):
        await self._check_repository_name(request.repository_name, context)
        overrides = sorted(request.parameters)
        if overrides:  # tritonclient's load_model(config=..., files=...): the folder is the model here
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"load parameters {overrides} are not supported: a version is loaded as 'mhaserve export' wrote it",
            )
        try:
            await self.dataplane.load_model(request.model_name)
        except RequestError as error:
            await context.abort(GRPC_STATUS[error.kind], error.message)
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request, context):
        await self._check_repository_name(request.repository_name, context)
        try:
            await self.dataplane.unload_model(request.model_name)
        except RequestError as error:
            await context.abort(GRPC_STATUS[error.kind], error.message)
        return pb.RepositoryModelUnloadResponse()

    async def _check_repository_name(self, name: str, context) -> None:
        if name:  # Triton's clients leave it empty: "every repository"
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"unknown repository '{name}': this server has one; leave the name empty"
            )

    async def _infer(self, request: pb.ModelInferRequest, context, streamed: bool = False) -> bytes:
        return await self.dataplane.serve_inference(
            request.model_name,
            request.model_version,
            functools.partial(decode_infer_request, request),
            functools.partial(encode_infer_response, streamed=streamed),
            context.time_remaining(),
        )

    async def ModelInfer(self, request, context):
        try:
            return await self._infer(request, context)
        except RequestError as error:
            await context.abort(GRPC_STATUS[error.kind], error.message)
        except Exception as error:  # a bug or a runtime failure: say so, keep serving
            log.exception("inference failed")
            await context.abort(grpc.StatusCode.INTERNAL, _internal_error(error))

    async def ModelStreamInfer(self, request_iterator, context):
        # Answers in request order; a refused request answers with error_message and the stream goes on,
        # an undecodable one too (it arrives here as the RequestError that says so).
        async for request in request_iterator:
            try:
                if isinstance(request, RequestError):
                    raise request
                yield await self._infer(request, context, streamed=True)
            except RequestError as error:
                yield pb.ModelStreamInferResponse(error_message=f"{error.kind.name}: {error.message}")
            except Exception as error:  # as in ModelInfer: say so, and the stream goes on
                log.exception("inference failed")
                yield pb.ModelStreamInferResponse(error_message=f"INTERNAL: {_internal_error(error)}")


def _statistics(served: ServedModel) -> pb.ModelStatistics:
    s = served.stats

    def duration(d):
        return pb.StatisticDuration(count=d.count, ns=d.ns)

    with s.lock:
        return pb.ModelStatistics(
            name=served.signature.name,
            version=served.signature.version,
            last_inference=s.last_inference_ms,
            inference_count=s.inference_count,
            execution_count=s.execution_count,
            inference_stats=pb.InferStatistics(
                success=duration(s.success),
                fail=duration(s.fail),
                queue=duration(s.queue),
                compute_input=duration(s.compute_input),
                compute_infer=duration(s.compute_infer),
                compute_output=duration(s.compute_output),
            ),
            batch_stats=[
                pb.InferBatchStatistics(
                    batch_size=b,
                    compute_input=duration(d.compute_input),
                    compute_infer=duration(d.compute_infer),
                    compute_output=duration(d.compute_output),
                )
                for b, d in sorted(s.batch_sizes.items())
            ],
        )


def _internal_error(error: Exception) -> str:
    return f"inference failed: {type(error).__name__}: {error}"


def _parsing_unary(behavior, request_class):
    async def handle(raw: bytes, context):
        try:
            request = request_class.FromString(raw)
        except DecodeError:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _undecodable(request_class, raw))
        return await behavior(request, context)

    return handle


def _parsing_stream(behavior, request_class):
    async def handle(raw_iterator, context):
        async def requests():
            async for raw in raw_iterator:
                try:
                    yield request_class.FromString(raw)
                except DecodeError:  # one bad message is that message's error, not the stream's end
                    yield RequestError(ErrorKind.INVALID_ARGUMENT, _undecodable(request_class, raw))

        async for response in behavior(requests(), context):
            yield response

    return handle


def _serializer(response_class):
    """Messages are serialised; bytes (inference answers, encoded by the codec in one copy) pass as they are."""

    def serialize(response) -> bytes:
        return response if isinstance(response, bytes) else response_class.SerializeToString(response)

    return serialize


def _undecodable(request_class, raw: bytes) -> str:
    return f"the request ({len(raw)} bytes) is not a valid {request_class.DESCRIPTOR.full_name} protobuf message"


def add_inference_service(servicer: InferenceServicer, server) -> None:
    """Register the service as the generated ``add_..._to_server`` does, but parse requests here.

    gRPC answers UNKNOWN ("Exception deserializing request") for bytes that are no protobuf message
    of the method's type; parsing in the handler gives such a request INVALID_ARGUMENT, like any
    other malformed request.
    """
    service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    handlers = {}
    for method in service.methods:
        request_class = getattr(pb, method.input_type.name)
        serialize = _serializer(getattr(pb, method.output_type.name))
        behavior = getattr(servicer, method.name)
        if method.client_streaming and method.server_streaming:
            handler = grpc.stream_stream_rpc_method_handler(
                _parsing_stream(behavior, request_class), response_serializer=serialize
            )
        elif not (method.client_streaming or method.server_streaming):
            handler = grpc.unary_unary_rpc_method_handler(
                _parsing_unary(behavior, request_class), response_serializer=serialize
            )
        else:  # the protocol has no such RPC; refuse to guess
            raise TypeError(f"{method.full_name}: half-streaming RPCs are not handled")
        handlers[method.name] = handler
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)
