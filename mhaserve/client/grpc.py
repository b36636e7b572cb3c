"""The mhaserve client: numpy in, numpy out, raw bytes on the wire. Sync ``Client`` and asyncio ``AsyncClient``.

    with Client("127.0.0.1:8001") as client:
        result = client.infer(query)              # self-attention
        result.output, result.attn_weights        # numpy arrays

Against a server with TLS and a bearer token:

    Client("host:8001", tls=TLS(ca="ca.pem"), token="...")              # verify the server
    Client("host:8001", tls=TLS(ca="ca.pem", cert="me.pem", key="me.key"))  # mutual TLS

Works against any Open Inference Protocol server serving the same model signature; behind Ray Serve's proxy,
name the application (``Client("head:9000", application="mha")``).

Calls refused with UNAVAILABLE (a replica or node went away, a server draining) are sent again, at most
``RetryPolicy.max_attempts`` times in all, with exponential backoff and within the call's timeout: inference
is idempotent, the same inputs give the same answer. ``retry=NO_RETRIES`` turns that off.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from dataclasses import dataclass

import grpc
import numpy as np

from mhaserve.contract.datatypes import DATATYPES, datatype_of
from mhaserve.contract.ring import SEQUENCE_HEADER, sequence_header
from mhaserve.protos.generated import grpc_service_pb2 as pb
from mhaserve.protos.generated import grpc_service_pb2_grpc as pb_grpc

from .common import (
    TLS,
    AsyncSequence,
    InferResult,
    RepositoryEntry,
    RequestFailed,
    Sequence,
    SequenceStep,
    WeightsOptions,
    checked_timeout,
    config_text,
    request_inputs,
    request_parameters,
    requested_outputs,
    with_remedy,
)
from .servers import ServerSet
from .shared_memory import SharedMemoryRegions

# Large enough for any response of the server's default limits (32 x 512 x 512 with weights);
# gRPC's own default of 4 MiB fails at [1, 512, 512] with weights.
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30


def open_channel(
    url: str,
    tls: TLS | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    aio: bool = False,
    own_connection: bool = False,
):
    """A channel to ``url``: TLS when ``tls`` is given, plain text otherwise. ``own_connection``: a connection of
    its own, where gRPC would share one among a process's channels to the same address and with the same options."""
    options = _channel_options(max_message_bytes)
    if own_connection:
        options.append(("grpc.use_local_subchannel_pool", 1))
    if tls is not None and tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    grpc_module = grpc.aio if aio else grpc
    if tls is None:
        return grpc_module.insecure_channel(url, options=options)
    return grpc_module.secure_channel(url, tls.credentials(), options=options)


def call_metadata(token: str | None = None, application: str | None = None) -> tuple[tuple[str, str], ...] | None:
    """The metadata every call carries: the bearer token, and the Ray Serve application that serves the model
    (with several applications deployed, Ray's proxy routes by it)."""
    metadata = []
    if token:
        metadata.append(("authorization", f"Bearer {token}"))
    if application:
        metadata.append(("application", application))
    return tuple(metadata) or None


@dataclass(frozen=True)
class RetryPolicy:
    """When a refused call is sent again: on a status that says the next try may succeed, with exponential
    backoff (full jitter, so that clients refused together do not return together), never past the call's
    timeout; and, with ``attempt_timeout_s``, when an attempt has gone unanswered that long (a server lost or frozen
    under it), except a sequence's step or a registration, which the attempt given up may have applied."""

    max_attempts: int = 5  # in all, the first included
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 2.0
    multiplier: float = 2.0
    retryable: frozenset[str] = frozenset({"UNAVAILABLE"})
    # An attempt unanswered this long is given up and sent again, within the call's timeout (Envoy's
    # per_try_timeout): a call in flight on a node that was lost gets no answer until the cluster notices, seconds
    # later. None: each attempt may take the call's whole timeout. Never for a sequence's step, which a given-up
    # attempt may still have applied.
    attempt_timeout_s: float | None = None

    def attempt_timeout(self, deadline: float | None) -> float | None:
        """The next attempt's timeout: what is left of the call's, or ``attempt_timeout_s`` where that is sooner."""
        left = _remaining(deadline)
        if self.attempt_timeout_s is None:
            return left
        return self.attempt_timeout_s if left is None else min(left, self.attempt_timeout_s)

    def backoff_s(self, retry: int) -> float:
        """How long to wait before retry number ``retry`` (0 for the first)."""
        return random.uniform(0, min(self.max_backoff_s, self.initial_backoff_s * self.multiplier**retry))

    def next_wait(self, error: grpc.RpcError, attempt: int, deadline: float | None) -> float | None:
        """Seconds to wait before sending again after ``attempt`` (1 for the first) failed with ``error``; None:
        do not, the error stands. A server's retry pushback (a draining server's: once its port has closed)
        replaces the backoff, and a negative one says not to retry, as in gRPC's own retries."""
        given_up = self.attempt_timeout_s is not None and error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        if attempt >= self.max_attempts or not (given_up or error.code().name in self.retryable):
            return None
        pushback = _pushback_s(error)
        if pushback is not None and pushback < 0:
            return None
        wait = self.backoff_s(attempt - 1) if pushback is None else pushback
        if deadline is not None and time.monotonic() + wait >= deadline:
            return None
        return wait


RAY_ROUTING_ID = "multiplexed_model_id"  # the gRPC metadata Ray Serve's proxy gives a deployment's request router


def _elsewhere(retry: RetryPolicy) -> RetryPolicy:
    """The policy for one of several servers: UNAVAILABLE is tried on the next server at once, not again here."""
    return dataclasses.replace(retry, retryable=retry.retryable - {"UNAVAILABLE"})


def _applied_once(retry: RetryPolicy) -> RetryPolicy:
    """The policy for a call that changes what the server holds (a sequence's step, a registration): never given
    up for its attempt timeout, since the attempt given up may have been applied."""
    return dataclasses.replace(retry, attempt_timeout_s=None)


class _Refusal(grpc.RpcError):
    """A refusal the client itself makes (a sequence lost with its server), read as a server's would be."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def initial_metadata(self):
        return grpc.aio.Metadata()

    def trailing_metadata(self):
        return grpc.aio.Metadata()

    def debug_error_string(self) -> str:
        return self._details


def _pushback_s(error: grpc.RpcError) -> float | None:
    """The call's ``grpc-retry-pushback-ms`` trailer in seconds (negative: do not retry), or None."""
    for key, value in _trailing_metadata(error):
        if key == "grpc-retry-pushback-ms":
            try:
                return int(value) / 1000
            except ValueError:  # gRPC reads a pushback it cannot parse as "do not retry"
                return -1.0
    return None


def _trailing_metadata(error: grpc.RpcError):
    """The call's trailers: () for an error that carries none (a grpc.RpcError need not be a call)."""
    return (error.trailing_metadata() if hasattr(error, "trailing_metadata") else None) or ()


DEFAULT_RETRY = RetryPolicy()
NO_RETRIES = RetryPolicy(max_attempts=1)


class GrpcRequestFailed(RequestFailed, grpc.RpcError):
    """A refused call over gRPC: the shared RequestFailed, and still the grpc.RpcError it was (``code()``,
    ``details()``)."""

    def __init__(self, error: grpc.RpcError, address: str = ""):
        super().__init__(f"{error.code().name}: {error.details()}")
        self._code, self._details = error.code(), error.details() or ""
        self._trailing_metadata = _trailing_metadata(error)
        self.status_name, self.message = self._code.name, with_remedy(self._details, "grpc", address)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self):
        return self._trailing_metadata


class AsyncRequestFailed(RequestFailed, grpc.aio.AioRpcError):
    """The same from the asyncio client, still the grpc.aio.AioRpcError it was."""

    def __init__(self, error: grpc.aio.AioRpcError, address: str = ""):
        grpc.aio.AioRpcError.__init__(
            self, error.code(), error.initial_metadata(), error.trailing_metadata(), error.details(),
            error.debug_error_string(),
        )  # fmt: skip
        self.status_name, self.message = error.code().name, with_remedy(error.details() or "", "grpc", address)


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


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
    attn_weights_mean: bool = False,
    version: str = "",
    weights: WeightsOptions | None = None,
    shared_memory: SharedMemoryRegions | None = None,
    num_heads: int = 0,
    sequence: SequenceStep | None = None,
    priority: int = 0,
) -> pb.ModelInferRequest:
    """One ModelInferRequest with every input as raw bytes (query, key, value FP32; mask as given), or written
    into ``shared_memory``'s input region, the outputs then asked into its output region (sized for a model of
    ``num_heads`` heads).

    It asks for the output, the weights of every head unless ``attn_weights`` is false, their mean over heads
    when ``attn_weights_mean`` is true, shaped as ``weights`` says; ``version`` empty: the newest ready version.
    """
    request = pb.ModelInferRequest(model_name=model, model_version=version, id=request_id)
    inputs = request_inputs(query, key, value, mask)
    outputs = requested_outputs(attn_weights, attn_weights_mean, weights)
    if shared_memory is None:
        for name, array in inputs:
            request.inputs.add(name=name, datatype=datatype_of(array), shape=array.shape)
            request.raw_input_contents.append(array.tobytes())
        for name in outputs:
            request.outputs.add(name=name)
    else:
        in_region, placed, out_region, windows = shared_memory.place_request(inputs, outputs, num_heads)
        for name, array, offset in placed:
            tensor = request.inputs.add(name=name, datatype=datatype_of(array), shape=array.shape)
            _in_shared_memory(tensor.parameters, in_region, offset, array.nbytes)
        for name in outputs:
            _in_shared_memory(request.outputs.add(name=name).parameters, out_region, *windows[name])
    for name, value in request_parameters(weights, sequence, priority).items():
        parameter = request.parameters[name]
        if isinstance(value, bool):
            parameter.bool_param = value
        elif isinstance(value, str):
            parameter.string_param = value
        elif isinstance(value, int):
            parameter.int64_param = value
        else:
            parameter.double_param = value
    return request


def _in_shared_memory(parameters, region: str, offset: int, size: int) -> None:
    parameters["shared_memory_region"].string_param = region
    parameters["shared_memory_offset"].int64_param = offset
    parameters["shared_memory_byte_size"].int64_param = size


def parse_infer_response(
    response: pb.ModelInferResponse, shared_memory: SharedMemoryRegions | None = None
) -> InferResult:
    """The outputs, from the answer or, for a request placed in ``shared_memory``, from its output region."""
    if shared_memory is not None:
        described = [(t.name, t.datatype, tuple(t.shape)) for t in response.outputs]
        return InferResult.from_outputs(shared_memory.read_outputs(described), response.id, response.model_version)
    arrays = {}
    for index, tensor in enumerate(response.outputs):
        dtype = DATATYPES[tensor.datatype]
        arrays[tensor.name] = np.frombuffer(response.raw_output_contents[index], dtype=dtype).reshape(tensor.shape)
    return InferResult.from_outputs(arrays, response.id, response.model_version)


class _Connection:
    """What both clients hold: the channel (plain or TLS), the stub and the token metadata."""

    _aio = False

    def __init__(
        self,
        url: str | list[str] = "127.0.0.1:8001",
        model: str = "mha",
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        *,
        tls: TLS | None = None,
        token: str | None = None,
        version: str = "",
        application: str | None = None,
        retry: RetryPolicy = DEFAULT_RETRY,
        own_connection: bool = False,
    ):
        """A channel to the server at ``url`` (host:port; a list: several servers of the model, stateless calls
        spread over them and each sequence kept on one, servers.ServerSet), for ``model`` (``version`` empty: its
        newest ready version). ``max_message_bytes`` bounds each message both ways; ``tls`` and ``token`` as the
        server asks; ``application`` names a Ray Serve application behind Ray's gRPC proxy; ``retry`` says which
        refusals are sent again and how often (``NO_RETRIES`` for none). ``own_connection``: a connection of its
        own, where gRPC would share one among a process's clients of the same server (a server with ``--workers``
        spreads connections, not calls, over its workers)."""
        self.model = model
        self.version = version  # empty: the newest ready version of the model
        self.retry = retry
        self.retries = 0  # calls sent again under the retry policy, since this client was made
        self.servers = ServerSet([url] if isinstance(url, str) else list(url))
        self._channels = [
            open_channel(each, tls, max_message_bytes, aio=self._aio, own_connection=own_connection)
            for each in self.servers.urls
        ]
        self._stubs = [pb_grpc.GRPCInferenceServiceStub(channel) for channel in self._channels]
        self._channel, self._stub = self._channels[0], self._stubs[0]  # the calls that describe the model
        self._metadata = call_metadata(token, application)
        self._num_heads: int | None = None

    def _infer_order(self, sequence: SequenceStep | None) -> list[int]:
        """The servers to send an inference request to, in order."""
        if len(self._stubs) == 1:
            return [0]
        return self.servers.for_stateless() if sequence is None else self.servers.for_sequence(sequence.id)

    def _retry_for(self, order: list[int], sequence: SequenceStep | None) -> RetryPolicy:
        """The retry policy of a call to one of ``order``: UNAVAILABLE tried on the next server, where there are
        several, rather than again on this one; a sequence's step never given up for its attempt timeout."""
        retry = self.retry if len(order) == 1 else _elsewhere(self.retry)
        return retry if sequence is None else _applied_once(retry)

    def _refusal_left(
        self, error: grpc.RpcError, order: list[int], attempt: int, sequence: SequenceStep | None
    ) -> grpc.RpcError | None:
        """What the call ends with after ``error`` from the ``attempt``-th server of ``order``: None to try the
        next one (a stateless request, a server UNAVAILABLE), else the refusal: the error itself, or for a step of
        a sequence that lived on a server now unreachable, that the sequence was lost."""
        if len(order) == 1 or error.code() != grpc.StatusCode.UNAVAILABLE:
            return error
        index = order[attempt - 1]
        self.servers.unreachable(index)
        if sequence is None or sequence.start:
            return error if attempt == len(order) else None
        return _Refusal(
            grpc.StatusCode.UNAVAILABLE,
            f"sequence {sequence.id!r} lived on {self.servers.urls[index]}, which cannot be reached "
            f"({error.details()}): its keys and values were lost with it; start the sequence again with "
            "sequence_start",
        )

    def _traced(self, traceparent: str, sequence: SequenceStep | None = None):
        """The call's metadata with a W3C trace context, if one is given, and a step's sequence id (which a
        balancer in front of several servers hashes to keep the sequence on one)."""
        added = [("traceparent", traceparent)] * bool(traceparent)
        if sequence is not None:  # and Ray Serve's proxy hands the same to its request router (server/ray/router.py)
            added += [(SEQUENCE_HEADER, sequence_header(sequence.id)), (RAY_ROUTING_ID, sequence_header(sequence.id))]
        return (*(self._metadata or ()), *added) if added else None

    # The calls both clients make, each defined once: Client answers them, AsyncClient gives awaitables of the answers
    # (``await client.config()``), by their ``_ask``.

    def _ask(self, rpc, request, timeout, answer=lambda reply: reply, retry: RetryPolicy | None = None):
        """``answer(reply)`` of one call under the retry policy: the value (Client) or an awaitable of it
        (AsyncClient)."""
        raise NotImplementedError

    def ready(self, timeout=None) -> bool:
        """Whether the server has a ready version of this client's model (and version, if one was named)."""
        request = pb.ModelReadyRequest(name=self.model, version=self.version)
        return self._ask(self._stub.ModelReady, request, timeout, lambda reply: reply.ready)

    def metadata(self, timeout=None) -> pb.ModelMetadataResponse:
        """The model's metadata (the protocol's ModelMetadataResponse): its versions, platform, and each input
        and output with datatype and shape (-1 for a dynamic axis)."""
        return self._ask(
            self._stub.ModelMetadata, pb.ModelMetadataRequest(name=self.model, version=self.version), timeout
        )

    def model_width(self, timeout=None) -> int:
        """The served model's d_model, from its metadata."""
        request = pb.ModelMetadataRequest(name=self.model, version=self.version)
        return self._ask(self._stub.ModelMetadata, request, timeout, lambda reply: reply.inputs[0].shape[-1])

    def config(self, timeout=None):
        """The model's configuration (Triton's ModelConfig): its tensors, and in ``parameters`` its d_model,
        heads, precision and how the server runs it (provider, batching, threads)."""
        request = pb.ModelConfigRequest(name=self.model, version=self.version)
        return self._ask(self._stub.ModelConfig, request, timeout, lambda reply: reply.config)

    def statistics(self, timeout=None) -> pb.ModelStatistics:
        """The server's counters for this model's version (Triton's statistics extension); with no version
        given, the newest served one's."""
        request = pb.ModelStatisticsRequest(name=self.model, version=self.version)
        return self._ask(self._stub.ModelStatistics, request, timeout, lambda reply: reply.model_stats[-1])

    def repository_index(self, ready: bool = False, timeout=None) -> list[RepositoryEntry]:
        """Every model and version the server's repository holds, each with its state and why (Triton's model
        repository extension); ``ready``: the versions ready for inference only."""
        return self._ask(
            self._stub.RepositoryIndex,
            pb.RepositoryIndexRequest(ready=ready),
            timeout,
            lambda reply: [RepositoryEntry(m.name, m.version, m.state, m.reason) for m in reply.models],
        )

    def load_model(self, name: str | None = None, config: str | dict | None = None, timeout=None) -> None:
        """Load model ``name`` (default: this client's), or load it again to read its folder anew, where the
        server runs with ``--model-control-mode explicit``. ``config``: Triton's ModelConfig as JSON (its text, or
        a dict), served in place of the model's config.pbtxt until a load without one."""
        request = pb.RepositoryModelLoadRequest(model_name=name or self.model)
        if config is not None:
            request.parameters["config"].string_param = config_text(config)
        return self._ask(self._stub.RepositoryModelLoad, request, timeout, _nothing, _applied_once(self.retry))

    def unload_model(self, name: str | None = None, unload_dependents: bool = False, timeout=None) -> None:
        """Unload model ``name`` (default: this client's) where the server runs with ``--model-control-mode
        explicit``: its versions finish what they hold, then stop serving."""
        request = pb.RepositoryModelUnloadRequest(model_name=name or self.model)
        if unload_dependents:
            request.parameters["unload_dependents"].bool_param = True
        return self._ask(self._stub.RepositoryModelUnload, request, timeout, _nothing, _applied_once(self.retry))


def _nothing(reply) -> None:
    return None


class Client(_Connection):
    """Blocking client. ``infer`` raises grpc.RpcError with the server's status on refusal."""

    def infer(
        self,
        query,
        key=None,
        value=None,
        mask=None,
        attn_weights=True,
        timeout=None,
        request_id="",
        attn_weights_mean=False,
        weights: WeightsOptions | None = None,
        traceparent: str = "",
        shared_memory: SharedMemoryRegions | None = None,
        sequence: SequenceStep | None = None,
        priority: int = 0,
    ) -> InferResult:
        """``timeout``: seconds the call may take, its retries included (None: no deadline; one that is not more
        than 0 is refused with ValueError); ``weights``: what to ask of the attention weights (heads, rows, keys,
        top-k or top-p, precision); ``traceparent``: a W3C trace context, so that the server's span of this call
        continues the caller's trace;
        ``shared_memory``: regions from ``shared_memory()`` the tensors go through instead of the socket;
        ``sequence``: the request is a step of a sequence the server keeps (``sequence()`` makes the steps);
        ``priority``: its level in the model's queue where the model has levels (1 first; 0: the default)."""
        heads = self.num_heads(timeout) if shared_memory is not None else 0
        request = build_infer_request(
            self.model, query, key, value, mask, attn_weights, request_id, attn_weights_mean, self.version, weights,
            shared_memory, heads, sequence, priority,
        )  # fmt: skip
        order, metadata = self._infer_order(sequence), self._traced(traceparent, sequence)
        for attempt, index in enumerate(order, 1):
            try:
                answer = self._call(
                    self._stubs[index].ModelInfer, request, timeout, metadata, self._retry_for(order, sequence)
                )
                return parse_infer_response(answer, shared_memory)
            except GrpcRequestFailed as error:
                refusal = self._refusal_left(error, order, attempt, sequence)
                if refusal is error:
                    raise
                if refusal is not None:  # a sequence lost with its server
                    raise GrpcRequestFailed(refusal) from None

    def sequence(self, sequence_id: int | str | None = None, *, resume: bool = False) -> Sequence:
        """A sequence kept on the server, stepped with its new rows (an id of its own unless given); ``resume``:
        started again from what it sent where the server lost it (common.Sequence)."""
        return Sequence(self, sequence_id, resume=resume)

    def num_heads(self, timeout=None) -> int:
        """The model's heads (from its config's parameters), asked once."""
        if self._num_heads is None:
            self._num_heads = int(self.config(timeout).parameters["num_heads"].string_value)
        return self._num_heads

    def shared_memory(self, name: str | None = None) -> SharedMemoryRegions:
        """Regions on this host for ``infer(..., shared_memory=...)``: registered with the server when first used,
        unregistered and removed by their ``close``."""

        def register(region: str, key: str, size: int) -> None:
            request = pb.SystemSharedMemoryRegisterRequest(name=region, key=key, byte_size=size)
            self._call(self._stub.SystemSharedMemoryRegister, request, None, retry=_applied_once(self.retry))

        def unregister(region: str) -> None:
            request = pb.SystemSharedMemoryUnregisterRequest(name=region)
            self._call(self._stub.SystemSharedMemoryUnregister, request, None, retry=_applied_once(self.retry))

        return SharedMemoryRegions(register, unregister, name)

    def _call(self, rpc, request, timeout, metadata=None, retry: RetryPolicy | None = None):
        """``rpc(request)`` under the retry policy, every attempt within ``timeout`` in all."""
        deadline = None if checked_timeout(timeout) is None else time.monotonic() + timeout
        attempt, policy = 1, retry or self.retry
        while True:
            try:
                return rpc(request, timeout=policy.attempt_timeout(deadline), metadata=metadata or self._metadata)
            except grpc.RpcError as error:
                wait = policy.next_wait(error, attempt, deadline)
                if wait is None:
                    raise GrpcRequestFailed(error, ", ".join(self.servers.urls)) from None
            time.sleep(wait)
            self.retries += 1
            attempt += 1

    def server_ready(self, timeout=None) -> bool:
        """Whether the server is ready for requests (the protocol's ServerReady), False where it cannot be reached."""
        try:
            return self._call(self._stub.ServerReady, pb.ServerReadyRequest(), timeout, retry=NO_RETRIES).ready
        except GrpcRequestFailed:
            return False

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Block until the channel to the server is connected, or raise ``grpc.FutureTimeoutError`` after
        ``timeout`` seconds (a server starting up: its port opens when it is ready to serve)."""
        grpc.channel_ready_future(self._channel).result(timeout=timeout)

    def _ask(self, rpc, request, timeout, answer=lambda reply: reply, retry: RetryPolicy | None = None):
        return answer(self._call(rpc, request, timeout, retry=retry))

    def close(self) -> None:
        """Close the channels; the ``with`` block does this on exit."""
        for channel in self._channels:
            channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncClient(_Connection):
    """asyncio client: ``infer``, ``sequence`` and the calls that describe and control models, as Client's,
    awaited (``await client.config()``); no shared memory."""

    _aio = True

    async def infer(
        self,
        query,
        key=None,
        value=None,
        mask=None,
        attn_weights=True,
        timeout=None,
        request_id="",
        attn_weights_mean=False,
        weights: WeightsOptions | None = None,
        traceparent: str = "",
        sequence: SequenceStep | None = None,
        priority: int = 0,
    ) -> InferResult:
        """As ``Client.infer`` (no shared memory)."""
        request = build_infer_request(
            self.model,
            query,
            key,
            value,
            mask,
            attn_weights,
            request_id,
            attn_weights_mean,
            self.version,
            weights,
            sequence=sequence,
            priority=priority,
        )
        order, metadata = self._infer_order(sequence), self._traced(traceparent, sequence)
        for attempt, index in enumerate(order, 1):
            try:
                answer = await self._call(
                    self._stubs[index].ModelInfer, request, timeout, metadata, self._retry_for(order, sequence)
                )
                return parse_infer_response(answer)
            except AsyncRequestFailed as error:
                refusal = self._refusal_left(error, order, attempt, sequence)
                if refusal is error:
                    raise
                if refusal is not None:  # a sequence lost with its server
                    raise AsyncRequestFailed(refusal) from None

    def sequence(self, sequence_id: int | str | None = None, *, resume: bool = False) -> AsyncSequence:
        """As Client.sequence: ``async with client.sequence() as s: await s.step(rows)``."""
        return AsyncSequence(self, sequence_id, resume=resume)

    async def _call(self, rpc, request, timeout, metadata=None, retry: RetryPolicy | None = None):
        """As Client._call, awaiting."""
        deadline = None if checked_timeout(timeout) is None else time.monotonic() + timeout
        attempt, policy = 1, retry or self.retry
        while True:
            try:
                return await rpc(request, timeout=policy.attempt_timeout(deadline), metadata=metadata or self._metadata)
            except grpc.RpcError as error:
                wait = policy.next_wait(error, attempt, deadline)
                if wait is None:
                    raise (
                        AsyncRequestFailed(error, ", ".join(self.servers.urls))
                        if isinstance(error, grpc.aio.AioRpcError)
                        else error
                    ) from None
            await asyncio.sleep(wait)
            self.retries += 1
            attempt += 1

    async def _ask(self, rpc, request, timeout, answer=lambda reply: reply, retry: RetryPolicy | None = None):
        return answer(await self._call(rpc, request, timeout, retry=retry))

    async def close(self) -> None:
        """Close the channels; the ``async with`` block does this on exit."""
        for channel in self._channels:
            await channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
