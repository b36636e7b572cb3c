"""gRPC transport for the Open Inference Protocol: protobuf in, codec + data plane, protobuf out."""

from __future__ import annotations

import asyncio
import functools
import logging
import traceback

import grpc
from google.protobuf import json_format
from google.protobuf.message import DecodeError

from mhaserve.protos.generated import grpc_service_pb2 as pb
from mhaserve.protos.generated import grpc_service_pb2_grpc as pb_grpc
from mhaserve.protos.generated import model_config_pb2 as mc

from . import describe
from .codec import decode_infer_request, encode_infer_response
from .dataplane import OFF_LOOP_BYTES, DataPlane
from .errors import ErrorKind, RequestError, inference_failed
from .registry import ServedModel

log = logging.getLogger("mhaserve.server")

# The data plane's refusals as gRPC statuses (the kinds are named after them).
GRPC_STATUS = {kind: grpc.StatusCode[kind.name] for kind in ErrorKind}


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
        return json_format.ParseDict(describe.server_metadata(), pb.ServerMetadataResponse())

    async def ModelMetadata(self, request, context):
        served = await self._resolve(request.name, request.version, context)
        metadata = describe.model_metadata(served, self.dataplane.registry.ready_versions(served.signature.name))
        return json_format.ParseDict(metadata, pb.ModelMetadataResponse())

    async def ModelConfig(self, request, context):
        served = await self._resolve(request.name, request.version, context)
        return pb.ModelConfigResponse(config=json_format.ParseDict(describe.model_config(served), mc.ModelConfig()))

    async def ModelStatistics(self, request, context):
        try:
            served = self.dataplane.statistics_of(request.name, request.version)
        except RequestError as error:
            await context.abort(GRPC_STATUS[error.kind], error.message)
        stats = {"model_stats": [describe.model_statistics(m) for m in served]}
        return json_format.ParseDict(stats, pb.ModelStatisticsResponse())

    async def RepositoryIndex(self, request, context):
        await self._check_repository_name(request.repository_name, context)
        rows = describe.repository_index(self.dataplane.registry.index(ready_only=request.ready))
        return json_format.ParseDict({"models": rows}, pb.RepositoryIndexResponse())

    async def RepositoryModelLoad(self, request, context):
        await self._check_repository_name(request.repository_name, context)
        try:
            await self.dataplane.load_model(request.model_name, list(request.parameters))
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

    async def _infer(self, request: pb.ModelInferRequest, context, until_sent, streamed: bool = False) -> bytes:
        return await self.dataplane.serve_inference(
            request.model_name,
            request.model_version,
            functools.partial(decode_infer_request, request),
            functools.partial(encode_infer_response, streamed=streamed),
            context.time_remaining(),
            decode_off_loop=decodes_slowly(request),
            until_sent=until_sent,
        )

    async def ModelInfer(self, request, context):
        settlements = []
        try:
            answer = await self._infer(request, context, settlements.append)
        except RequestError as error:
            await context.abort(GRPC_STATUS[error.kind], error.message)
        except Exception as error:  # a bug or a runtime failure: say so, keep serving
            log.exception("inference failed")
            await context.abort(grpc.StatusCode.INTERNAL, inference_failed(error).message)
        written = asyncio.get_running_loop().create_future()  # gRPC writes a unary answer after the handler
        context.add_done_callback(lambda call: written.done() or written.set_result(None))
        self._settle_when_written(settlements[0], written, len(answer))
        return answer

    def _settle_when_written(self, settle, written: asyncio.Future, size: int) -> None:
        """The answer stays in the budget until ``written`` is done (gRPC wrote it, or gave up); one not taken
        within write_timeout_s counts CANCELLED then.

        grpcio gives a handler no way to cancel its call: an answer not taken stays in gRPC's buffers until
        the client reads it or its connection closes (keepalive closes a dead one), so it stays in the budget
        until then. The budget bounds what slow readers hold, and max_concurrent_streams what one connection
        holds. (Writing a unary answer from the handler, as a one-answer stream, cost 0.1 ms per call at
        [1,16,512]: the call's done callback tells instead.)"""
        timeout = self.dataplane.settings.write_timeout_s
        gave_up = []

        def give_up() -> None:
            log.info(
                "a gRPC client did not read its %d-byte answer within %g s: counted CANCELLED, held until taken "
                "or its connection closes",
                size,
                timeout,
            )
            gave_up.append(settle(False, freed=False))

        timer = asyncio.get_running_loop().call_later(timeout, give_up)

        def ended(future: asyncio.Future) -> None:
            if gave_up:
                if gave_up[0] is not None:
                    gave_up[0]()
                return
            timer.cancel()
            settle(not future.cancelled() and future.exception() is None)

        written.add_done_callback(ended)

    async def ModelStreamInfer(self, request_iterator, context):
        # Answers in request order; a refused request answers with error_message and the stream goes on,
        # an undecodable one too (it arrives here as the RequestError that says so).
        async for request in request_iterator:
            settlements = []
            try:
                if isinstance(request, RequestError):
                    raise request
                answer = await self._infer(request, context, settlements.append, streamed=True)
            except RequestError as error:
                answer = pb.ModelStreamInferResponse(error_message=f"{error.kind.name}: {error.message}")
            except Exception as error:  # as in ModelInfer: say so, and the stream goes on
                log.exception("inference failed")
                answer = pb.ModelStreamInferResponse(error_message=f"INTERNAL: {inference_failed(error).message}")
            # The next request is not read before this answer is written.
            write = asyncio.ensure_future(context.write(answer))
            size = len(answer) if isinstance(answer, bytes) else answer.ByteSize()
            self._settle_when_written(settlements[0] if settlements else _nothing_held, write, size)
            await write


def _nothing_held(delivered: bool, freed: bool = True) -> None:
    """A refusal's answer: no budget to release, its status already recorded."""


def decodes_slowly(request: pb.ModelInferRequest) -> bool:
    """Whether decoding ``request`` would hold the event loop for long: values in the typed ``contents``
    fields (converted element by element), or megabytes of raw contents."""
    if request.inputs and not request.raw_input_contents:
        return True
    return sum(len(contents) for contents in request.raw_input_contents) > OFF_LOOP_BYTES


async def _parsed(request_class, raw: bytes, off_loop):
    """The message; a large one is parsed on the decode thread (typed contents parse at ~3 ms/MiB, in one call)."""
    if len(raw) > OFF_LOOP_BYTES:
        return await off_loop(request_class.FromString, raw)
    return request_class.FromString(raw)


def _parsing_unary(behavior, request_class, off_loop):
    async def handle(raw: bytes, context):
        try:
            try:
                request = await _parsed(request_class, raw, off_loop)
            except DecodeError:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _undecodable(request_class, raw))
            return await behavior(request, context)
        except BaseException as error:
            _forget_locals(error)
            raw = request = None  # this frame is in the traceback too, and still running
            raise

    return handle


def _forget_locals(error: BaseException | None) -> None:
    """Clear the locals of the finished frames in ``error``'s traceback and in those of the errors it chained.

    grpc.aio keeps an aborted call's exception in a reference cycle, so without this the request's bytes and
    arrays those frames hold stay until a full garbage collection: a flood of refused [8,256,512] requests held
    about 700 MiB that way, and pushed the peak past the memory budget (BENCHMARKS.md, "Memory per request").
    """
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__context__


def _parsing_stream(behavior, request_class, off_loop):
    async def handle(raw_iterator, context):
        async def requests():
            async for raw in raw_iterator:
                try:
                    yield await _parsed(request_class, raw, off_loop)
                except DecodeError:  # one bad message is that message's error, not the stream's end
                    yield RequestError(ErrorKind.INVALID_ARGUMENT, _undecodable(request_class, raw))

        await behavior(requests(), context)  # it writes its answers itself

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
                _parsing_stream(behavior, request_class, servicer.dataplane.off_loop), response_serializer=serialize
            )
        elif not (method.client_streaming or method.server_streaming):
            handler = grpc.unary_unary_rpc_method_handler(
                _parsing_unary(behavior, request_class, servicer.dataplane.off_loop), response_serializer=serialize
            )
        else:  # the protocol has no such RPC; refuse to guess
            raise TypeError(f"{method.full_name}: half-streaming RPCs are not handled")
        handlers[method.name] = handler
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)
