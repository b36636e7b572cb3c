"""gRPC transport for the Open Inference Protocol: protobuf in, codec + data plane, protobuf out."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
from google.protobuf.message import DecodeError

import mhaserve
from mhaserve.protos.generated import grpc_service_pb2 as pb
from mhaserve.protos.generated import grpc_service_pb2_grpc as pb_grpc
from mhaserve.protos.generated import model_config_pb2 as mc
from mhaserve.signature import input_specs, output_specs

from .codec import RequestError, check_model, decode_infer_request, encode_infer_response
from .dataplane import DataPlane, RequestTiming

log = logging.getLogger("mhaserve.server")

PLATFORM = "onnxruntime_onnx"
EXTENSIONS = ["model_configuration", "statistics"]


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, dataplane: DataPlane):
        self.dataplane = dataplane

    async def _check_model(self, name: str, version: str, context) -> None:
        signature = self.dataplane.signature
        if signature is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        try:
            check_model(name, version, signature)
        except RequestError as error:
            await context.abort(error.code, error.message)

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.dataplane.reports_ready)

    async def ModelReady(self, request, context):
        await self._check_model(request.name, request.version, context)
        return pb.ModelReadyResponse(ready=self.dataplane.reports_ready)

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name="mhaserve", version=mhaserve.__version__, extensions=EXTENSIONS)

    async def ModelMetadata(self, request, context):
        await self._check_model(request.name, request.version, context)
        s = self.dataplane.signature
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=s.name,
            versions=[s.version],
            platform=PLATFORM,
            inputs=[tensor(name=t.name, datatype=t.datatype, shape=t.shape) for t in input_specs(s.d_model)],
            outputs=[
                tensor(name=t.name, datatype=t.datatype, shape=t.shape) for t in output_specs(s.d_model, s.num_heads)
            ],
        )

    async def ModelConfig(self, request, context):
        await self._check_model(request.name, request.version, context)
        s = self.dataplane.signature
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
        signature = self.dataplane.signature
        if request.name:
            await self._check_model(request.name, request.version, context)
        if signature is None:
            return pb.ModelStatisticsResponse()
        s = self.dataplane.stats

        def duration(d):
            return pb.StatisticDuration(count=d.count, ns=d.ns)

        with s.lock:
            stats = pb.ModelStatistics(
                name=signature.name,
                version=signature.version,
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
        return pb.ModelStatisticsResponse(model_stats=[stats])

    async def _infer(self, request: pb.ModelInferRequest, context, streamed: bool = False) -> bytes:
        started = time.perf_counter_ns()
        timing = RequestTiming()
        rows = 0
        status = "UNKNOWN"
        self.dataplane.requests_in_flight += 1
        try:
            signature = self.dataplane.require_ready()
            attention_request = decode_infer_request(request, signature, self.dataplane.limits)
            rows = attention_request.batch_size
            timing.input_ns = time.perf_counter_ns() - started
            outputs = await self.dataplane.infer(attention_request, timing, context.time_remaining())
            encode_started = time.perf_counter_ns()
            response = encode_infer_response(attention_request, signature, outputs, streamed=streamed)
            timing.output_ns = time.perf_counter_ns() - encode_started
            status = "OK"
            return response
        except RequestError as error:
            status = error.code.name
            raise
        except asyncio.CancelledError:
            status = grpc.StatusCode.CANCELLED.name  # the client went away or its deadline passed
            raise
        except Exception:
            status = grpc.StatusCode.INTERNAL.name  # a bug or a runtime failure; the caller says which
            raise
        finally:
            self.dataplane.requests_in_flight -= 1
            if status != "OK":
                timing.input_ns = time.perf_counter_ns() - started - timing.queue_ns - timing.infer_ns
            self.dataplane.record(status, rows, timing)

    async def ModelInfer(self, request, context):
        try:
            return await self._infer(request, context)
        except RequestError as error:
            await context.abort(error.code, error.message)
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
                yield pb.ModelStreamInferResponse(error_message=f"{error.code.name}: {error.message}")
            except Exception as error:  # as in ModelInfer: say so, and the stream goes on
                log.exception("inference failed")
                yield pb.ModelStreamInferResponse(error_message=f"INTERNAL: {_internal_error(error)}")


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
                    yield RequestError(grpc.StatusCode.INVALID_ARGUMENT, _undecodable(request_class, raw))

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
