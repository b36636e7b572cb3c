"""gRPC transport for the Open Inference Protocol: protobuf in, codec + data plane, protobuf out."""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import traceback

from google.protobuf import json_format

from mhaserve.protos.generated import grpc_service_pb2 as pb
from mhaserve.protos.generated import grpc_service_pb2_grpc as pb_grpc
from mhaserve.protos.generated import model_config_pb2 as mc

from .. import describe
from ..dataplane import DataPlane, InferenceCall
from ..errors import ErrorKind, RequestError
from ..security import Callers, certificate_identity
from .protobuf import (
    as_infer_parameters,
    decode_grpc_request,
    encode_grpc_response,
    grpc_decodes_slowly,
    parameter_values,
)
from .receipt import abort_refused

log = logging.getLogger("mhaserve.server")

SHARED_MEMORY_RPCS = (
    "SystemSharedMemoryStatus", "SystemSharedMemoryRegister", "SystemSharedMemoryUnregister",
    "CudaSharedMemoryStatus", "CudaSharedMemoryUnregister",
)  # fmt: skip


def answering_errors(method):
    """A servicer method whose RequestErrors become the call's gRPC status (abort_refused): the one place the
    gRPC transport maps the data plane's refusals."""

    @functools.wraps(method)
    async def answer(self, request, context):
        try:
            return await method(self, request, context)
        except RequestError as error:
            await abort_refused(context, error)

    return answer


# A log setting's value in LogSettings' SettingValue, by its type.
_LOG_SETTING_FIELDS = {bool: "bool_param", int: "uint32_param", str: "string_param"}


def _log_setting_value(setting) -> bool | int | str | None:
    """What a LogSettings request's SettingValue holds (None: nothing)."""
    field = setting.WhichOneof("parameter_choice")
    return None if field is None else getattr(setting, field)


class ProtocolRpcs:
    """The protocol's RPCs other than inference, as plain functions of the request: protobuf in, the data
    plane's answer as protobuf out, refusals raised as RequestErrors. The native servicer and each Ray replica
    answer them alike, each mapping the refusals to its own call's status."""

    def __init__(self, dataplane: DataPlane, rpcs: frozenset[str] | None = None):
        self.dataplane = dataplane
        self.rpcs = rpcs  # the calls answered, where not every one is: ServerMetadata lists their extensions alone

    async def ServerLive(self, request):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request):
        return pb.ServerReadyResponse(ready=self.dataplane.reports_ready)

    async def ModelReady(self, request):
        return pb.ModelReadyResponse(ready=self.dataplane.model_ready(request.name, request.version))

    async def ServerMetadata(self, request):
        metadata = describe.server_metadata(self.dataplane.shared_memory.allowed, self.rpcs)
        return json_format.ParseDict(metadata, pb.ServerMetadataResponse())

    async def ModelMetadata(self, request):
        served = self.dataplane.resolve(request.name, request.version)
        metadata = describe.model_metadata(served, self.dataplane.ready_versions(served.signature.name))
        if "parameters" in metadata:
            metadata["parameters"] = as_infer_parameters(metadata["parameters"])
        return json_format.ParseDict(metadata, pb.ModelMetadataResponse())

    async def ModelConfig(self, request):
        served = self.dataplane.resolve(request.name, request.version)
        return pb.ModelConfigResponse(config=json_format.ParseDict(describe.model_config(served), mc.ModelConfig()))

    async def TraceSetting(self, request):
        changes = {name: list(setting.value) for name, setting in request.settings.items()}
        settings = self.dataplane.trace_settings(request.model_name, changes)
        value = pb.TraceSettingResponse.SettingValue
        return pb.TraceSettingResponse(settings={name: value(value=values) for name, values in settings.items()})

    async def LogSettings(self, request):
        changes = {name: _log_setting_value(setting) for name, setting in request.settings.items()}
        settings = await self.dataplane.log_settings(changes)
        value = pb.LogSettingsResponse.SettingValue
        return pb.LogSettingsResponse(settings={name: value(**{_LOG_SETTING_FIELDS[type(given)]: given})
                                                for name, given in settings.items()})  # fmt: skip

    async def SystemSharedMemoryStatus(self, request, peer: str = "", caller: str = ""):
        rows = describe.shared_memory_status(self.dataplane.shared_memory.status(peer, caller, request.name))
        regions = {"regions": {row["name"]: row for row in rows}}
        return json_format.ParseDict(regions, pb.SystemSharedMemoryStatusResponse())

    async def SystemSharedMemoryRegister(self, request, peer: str = "", caller: str = ""):
        await self.dataplane.register_region(peer, caller, request.name, request.key, request.offset, request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(self, request, peer: str = "", caller: str = ""):
        await self.dataplane.unregister_region(peer, caller, request.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    async def CudaSharedMemoryStatus(self, request, peer: str = "", caller: str = ""):
        self.dataplane.shared_memory.cuda_status(peer, request.name)
        return pb.CudaSharedMemoryStatusResponse()

    async def CudaSharedMemoryRegister(self, request):
        raise self.dataplane.shared_memory.cuda_refused()

    async def CudaSharedMemoryUnregister(self, request, peer: str = "", caller: str = ""):
        self.dataplane.shared_memory.cuda_status(peer)  # nothing to unregister, if allowed at all
        return pb.CudaSharedMemoryUnregisterResponse()

    async def ModelStatistics(self, request):
        stats = {"model_stats": await self.dataplane.statistics(request.name, request.version)}
        return json_format.ParseDict(stats, pb.ModelStatisticsResponse())

    async def RepositoryIndex(self, request):
        _check_repository_name(request.repository_name)
        rows = describe.repository_index(self.dataplane.index(ready_only=request.ready))
        return json_format.ParseDict({"models": rows}, pb.RepositoryIndexResponse())

    async def RepositoryModelLoad(self, request):
        _check_repository_name(request.repository_name)
        await self.dataplane.load_model(request.model_name, parameter_values(request.parameters))
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request):
        _check_repository_name(request.repository_name)
        await self.dataplane.unload_model(request.model_name, parameter_values(request.parameters))
        return pb.RepositoryModelUnloadResponse()


PLAIN_RPCS = tuple(name for name in vars(ProtocolRpcs) if name[0].isupper())


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    """Protobuf to and from the data plane; every decision (which version, whether to refuse) is the data
    plane's, and its RequestErrors become statuses through ``answering_errors``."""

    def __init__(self, dataplane: DataPlane, protocol: str = "grpc", callers: Callers | None = None):
        self.dataplane = dataplane
        self.answers = ProtocolRpcs(dataplane)
        self.protocol = protocol  # what inference calls are counted as
        self.callers = callers or Callers()
        self._answers = PendingWrites(dataplane.settings.write_timeout_s)

    def caller(self, context) -> str:
        """Who the call comes from (security.Callers): "" unless the server tells callers apart."""
        if not self.callers.told_apart:
            return ""
        presented = [value for key, value in (context.invocation_metadata() or ()) if key == "authorization"]
        pem = (context.auth_context() or {}).get("x509_pem_cert") or (b"",)
        return self.callers.identify(presented, certificate_identity(pem[0]))

    @answering_errors
    async def ModelInfer(self, message, context):  # a handlers.ReceivedMessage: counted, then parsed
        metadata = lambda: dict(context.invocation_metadata() or ())  # noqa: E731
        async with self.dataplane.inference(
            self.protocol, context.time_remaining(), "ModelInfer", metadata, context.peer(), self.caller(context)
        ) as call:
            answer = await infer_grpc(call, await message.counted_and_parsed(call))
            call.deliver_later()
        # gRPC writes a unary answer after the handler
        delivery = self._answers.on_its_way(call.record_delivery, len(answer))
        context.add_done_callback(delivery.call_ended)
        return answer

    async def ModelStreamInfer(self, request_iterator, context):
        # Answers in request order; a refused request answers with error_message and the stream goes on,
        # an undecodable one too.
        caller = self.caller(context)
        async for message in request_iterator:
            call = None
            try:
                async with self.dataplane.inference(
                    self.protocol, context.time_remaining(), "ModelStreamInfer",
                    lambda: dict(context.invocation_metadata() or ()), context.peer(), caller,
                ) as call:  # fmt: skip
                    answer = await infer_grpc(call, await message.counted_and_parsed(call), streamed=True)
                    call.deliver_later()
            except RequestError as error:
                answer = streamed_refusal(error)
                forget_locals(error)  # the refused request's bytes and arrays go now, not at a collection
            # The next request is not read before this answer is written.
            write = asyncio.ensure_future(context.write(answer))
            size = len(answer) if isinstance(answer, bytes) else answer.ByteSize()
            delivery = self._answers.on_its_way(call.record_delivery, size)
            write.add_done_callback(delivery.write_ended)
            await write


class PendingWrites:
    """Answers handed to gRPC to write (a unary call's after its handler, a stream's as it goes): each stays in the
    budget until written (or gRPC gave up on it); one not taken within ``timeout_s`` counts CANCELLED then, its memory
    released only once gRPC lets go of it.

    grpcio gives a handler no way to cancel its call: an answer not taken stays in gRPC's buffers until the client
    reads it or its connection closes (keepalive closes a dead one), so it stays in the budget until then. The budget
    bounds what slow readers hold, and max_concurrent_streams what one connection holds. (Writing a unary answer
    from the handler, as a one-answer stream, cost more per call than being told by the call's done callback:
    the figures of that choice are in git's history of BENCHMARKS.md.) One timer watches every answer on its way, armed
    for the oldest (all share one timeout, so they fall due in the order sent): a timer armed and cancelled for
    each answer cost the event loop more (measured when it was chosen). Event loop only."""

    def __init__(self, timeout_s: float):
        self._timeout_s = timeout_s
        self._on_their_way: collections.OrderedDict[_Delivery, None] = collections.OrderedDict()  # oldest first
        self._watch: asyncio.TimerHandle | None = None

    def on_its_way(self, sent, size: int) -> _Delivery:
        """An answer of ``size`` bytes handed to gRPC; ``sent`` (the call's record_delivery) is told when it is
        written or given up on. The returned delivery is to be told when gRPC has written it: a unary call's end, or
        a stream's write."""
        loop = asyncio.get_running_loop()
        delivery = _Delivery(self, sent, size, loop.time() + self._timeout_s)
        self._on_their_way[delivery] = None
        if self._watch is None:
            self._watch = loop.call_at(delivery.due, self._oldest_due)
        return delivery

    def settled(self, delivery: _Delivery) -> None:
        self._on_their_way.pop(delivery, None)

    def _oldest_due(self) -> None:
        self._watch = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        while self._on_their_way:
            oldest = next(iter(self._on_their_way))
            if oldest.due > now:
                self._watch = loop.call_at(oldest.due, self._oldest_due)
                return
            del self._on_their_way[oldest]
            oldest.give_up(self._timeout_s)


class _Delivery:
    """One answer on its way (PendingWrites): recorded as sent when gRPC has written it (or gave up on it), or,
    not taken by its ``due`` time, counted CANCELLED then, its memory released only once gRPC lets go of it."""

    __slots__ = ("_answers", "_sent", "_size", "due", "_given_up", "_release")

    def __init__(self, answers: PendingWrites, sent, size: int, due: float):
        self._answers, self._sent, self._size, self.due = answers, sent, size, due
        self._given_up = False
        self._release = None  # what releases a given-up answer's memory, once gRPC drops it

    def give_up(self, timeout_s: float) -> None:
        log.info(
            "a gRPC client did not read its %d-byte answer within %g s: counted CANCELLED, held until taken or its "
            "connection closes",
            self._size,
            timeout_s,
        )
        self._given_up = True
        self._release = self._sent(False, freed=False)

    def call_ended(self, _call) -> None:
        """A unary call's done callback: its answer was written or the call ended without it."""
        self._written(True)

    def write_ended(self, write: asyncio.Future) -> None:
        self._written(not write.cancelled() and write.exception() is None)

    def _written(self, delivered: bool) -> None:
        if self._given_up:
            if self._release is not None:
                self._release()
            return
        self._answers.settled(self)
        self._sent(delivered, self._size)


def _plain_rpc(name: str):
    @answering_errors
    async def rpc(self, request, context):
        if isinstance(request, RequestError):  # bytes that were no request message
            raise request
        answer = getattr(self.answers, name)
        # The shared-memory RPCs ask where the caller is (only one on this host shares its memory) and who (a
        # region is its registrant's).
        if name in SHARED_MEMORY_RPCS:
            return await answer(request, context.peer(), self.caller(context))
        return await answer(request)

    rpc.__name__ = rpc.__qualname__ = name
    return rpc


for _name in PLAIN_RPCS:
    setattr(InferenceServicer, _name, _plain_rpc(_name))


async def infer_grpc(call: InferenceCall, request: pb.ModelInferRequest, streamed: bool = False) -> bytes:
    """One ModelInferRequest through the data plane, as the native server and each Ray replica answer it."""
    if grpc_decodes_slowly(request):
        decoded = await call.off_loop(decode_grpc_request, request)
    else:
        decoded = decode_grpc_request(request)
    request = None  # the arrays hold the contents now; the parsed message's copy goes
    response = await call.infer(decoded)
    with call.encoding():
        return encode_grpc_response(response, streamed=streamed)


def streamed_refusal(error: RequestError) -> pb.ModelStreamInferResponse:
    """A refused request's answer on a stream, which goes on: the status's name and the message."""
    return pb.ModelStreamInferResponse(error_message=f"{error.kind.name}: {error.message}")


def _check_repository_name(name: str) -> None:
    if name:  # Triton's clients leave it empty: "every repository"
        raise RequestError(
            ErrorKind.NOT_FOUND, f"unknown repository '{name}': this server has one; leave the name empty"
        )


def forget_locals(error: BaseException | None) -> None:
    """Clear the locals of the finished frames in ``error``'s traceback and in those of the errors it chained.

    grpc.aio keeps an aborted call's exception in a reference cycle, so without this the request's bytes and
    arrays those frames hold stay until a full garbage collection; under a flood of refused requests that
    pushed the peak past the memory budget (BENCHMARKS.md, "Hostile clients").
    """
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__context__
