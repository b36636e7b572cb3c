"""The inference service's method handlers as gRPC registers them: each request read when the receipt gives it
its turn (unary calls are request-streaming on the server's side, the wire the same; a stream reads its next
request in a receiving turn), an inference message counted in the memory budget before it is parsed, and bytes
that are no request message refused INVALID_ARGUMENT rather than gRPC's UNKNOWN. What each RPC does is the
servicer's (servicer.py); when a request may be read, the receipt's (receipt.py)."""

from __future__ import annotations

import asyncio

import grpc
from google.protobuf.message import DecodeError

from mhaserve.protos.generated import grpc_service_pb2 as pb

from ..dataplane import InferenceCall
from ..errors import ErrorKind, RequestError
from .receipt import AlreadyAnswered, ReceivingTurns, RequestReader, StreamEnded, StreamIdle, StreamSlots, abort_refused
from .servicer import InferenceServicer, forget_locals

# What a received request of n bytes takes until it is decoded: its bytes, then the parsed message and the
# arrays decoded from it.
PARSE_COPIES = 2


class ReceivedMessage:
    """An inference request message as gRPC received it, parsed on demand: its bytes count in the memory
    budget before the parse copies them, so a request the budget cannot hold is refused unparsed."""

    def __init__(self, raw: bytes, request_class, off_loop_if_large):
        self._raw, self._request_class, self._off_loop_if_large = raw, request_class, off_loop_if_large

    async def counted_and_parsed(self, call: InferenceCall):
        call.bytes_in = len(self._raw)
        try:  # refused by the budget or parsed, the bytes go now: a stream holds its message while it reads on
            call.receipt.add_received(PARSE_COPIES * len(self._raw))
            return await _parsed(self._request_class, self._raw, self._off_loop_if_large)
        except DecodeError:
            raise RequestError(ErrorKind.INVALID_ARGUMENT, _undecodable(self._request_class, self._raw)) from None
        finally:
            self._raw = None  # the parsed message holds what the request needs


async def _parsed(request_class, raw: bytes, off_loop_if_large):
    """The message; a large one is parsed on the decode thread (typed contents parse in one long call)."""
    return await off_loop_if_large(request_class.FromString, len(raw), raw)


def _reading_unary(behavior, request_class, off_loop_if_large, reader: RequestReader, arrivals=None):
    """``arrivals`` (an inference method's: the request accounting) counts the requests being read, which the
    server is not quiet while."""

    async def handle(request_iterator, context):
        try:
            try:
                if arrivals is None:
                    raw = await reader.read(context)
                else:
                    arrivals.requests_being_read += 1
                    try:
                        raw = await reader.read(context)
                    finally:
                        arrivals.requests_being_read -= 1
            except RequestError as error:
                if arrivals is not None:
                    arrivals.refused_while_arriving(error)
                await abort_refused(context, error)
            except AlreadyAnswered as answered:
                if arrivals is not None:
                    arrivals.refused_while_arriving(answered.refusal)
                return None
            if arrivals is not None:  # parsed in the call, once counted
                request = ReceivedMessage(raw, request_class, off_loop_if_large)
                raw = None  # the message alone holds it, and lets go once parsed
            else:
                try:
                    request = await _parsed(request_class, raw, off_loop_if_large)
                except DecodeError:  # the method refuses it
                    request = RequestError(ErrorKind.INVALID_ARGUMENT, _undecodable(request_class, raw))
            return await behavior(request, context)
        except BaseException as error:
            forget_locals(error)
            raw = request = None  # this frame is in the traceback too, and still running
            raise

    return handle


def _parsing_stream(
    behavior,
    request_class,
    off_loop_if_large,
    slots: StreamSlots,
    turns: ReceivingTurns,
    idle_timeout_s: float,
    caller_of,
):
    """A stream reads its next request only once the last one is answered, and in a receiving turn: each stream
    reading may be receiving a request, so the turns bound what streams take while receiving. A stream whose next
    request has not come within ``idle_timeout_s`` of its read is ended DEADLINE_EXCEEDED, its slot freed."""

    async def handle(_, context):
        client = caller_of(context) or context.peer()  # a connection, where callers are not told apart
        refusal = slots.refusal(client)
        if refusal is not None:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)

        async def requests():  # one bad message is that message's error, not the stream's end
            while True:
                try:
                    # idle only once in its turn: till then its request may be waiting
                    async with turns.for_stream(context.peer(), context, client):
                        # context.read(), not the request iterator: grpcio's iterator keeps each message in its
                        # frame until the next one comes, so every open stream would hold its last request.
                        raw = await asyncio.wait_for(context.read(), idle_timeout_s)
                except asyncio.TimeoutError:  # not yet the built-in TimeoutError on Python 3.10
                    raise StreamIdle from None
                if raw is grpc.aio.EOF:
                    return
                yield ReceivedMessage(raw, request_class, off_loop_if_large)
                raw = None

        with slots.held(client):
            try:
                await behavior(requests(), context)  # it writes its answers itself
            except StreamEnded:  # its refusal is sent
                return
            except StreamIdle:
                pass
            else:
                return
        await context.abort(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"no request on this stream for {idle_timeout_s:g} s (--stream-idle-timeout-s): ended",
        )

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
    dataplane = servicer.dataplane
    parse = dataplane.off_loop_if_large  # a large message is parsed off the event loop
    settings, (receive_limit, _) = dataplane.settings, dataplane.versions.message_limits
    turns = ReceivingTurns(settings.max_receiving_bytes, receive_limit, settings.stream_read_hold_s)
    reader = RequestReader(
        turns,
        receive_limit,
        settings.grpc_read_timeout_s,
        settings.grpc_first_read_ms / 1000,
        abandoned=dataplane.accounting.received_dropped,
    )
    streams = StreamSlots(settings.max_inference_streams, settings.max_inference_streams_per_client)
    handlers = {}
    for method in service.methods:
        request_class = getattr(pb, method.input_type.name)
        serialize = _serializer(getattr(pb, method.output_type.name))
        behavior = getattr(servicer, method.name)
        if method.client_streaming and method.server_streaming:
            handler = grpc.stream_stream_rpc_method_handler(
                _parsing_stream(
                    behavior,
                    request_class,
                    parse,
                    streams,
                    turns,
                    settings.stream_idle_timeout_s,
                    servicer.caller,
                ),
                response_serializer=serialize,
            )
        elif not (method.client_streaming or method.server_streaming):
            # Request-streaming on the server's side (the wire is the same), so that the request is read when
            # the reader gives it its turn rather than by grpcio as soon as the call opens.
            arrivals = dataplane.accounting if method.name == "ModelInfer" else None
            reading = _reading_unary(behavior, request_class, parse, reader, arrivals)
            handler = grpc.stream_unary_rpc_method_handler(reading, response_serializer=serialize)
        else:  # the protocol has no such RPC; refuse to guess
            raise TypeError(f"{method.full_name}: half-streaming RPCs are not handled")
        handlers[method.name] = handler
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)
