"""What both clients share, whatever the wire: TLS settings, the token, the inputs a request carries, the
outputs it asks for, and the result it gets back."""

from __future__ import annotations

import math
import os
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from mhaserve.contract.signature import (
    ATTN_TOP_K_INDICES,
    ATTN_TOP_K_VALUES,
    ATTN_WEIGHTS,
    ATTN_WEIGHTS_MEAN,
    OUTPUT,
    SUMMARY_OUTPUT_NAMES,
)

TOKEN_ENV = "MHASERVE_TOKEN"  # the bearer token the CLI sends when --token-file is not given


@dataclass(frozen=True)
class TLS:
    """How the client checks the server, and proves itself when the server asks (mutual TLS)."""

    ca: str | Path | None = None  # PEM roots that signed the server's certificate (None: the system's roots)
    cert: str | Path | None = None  # the client's certificate chain, for servers that verify clients
    key: str | Path | None = None  # its private key
    server_name: str | None = None  # the name to check the certificate against, when the URL's host differs

    def credentials(self) -> grpc.ChannelCredentials:
        if (self.cert is None) != (self.key is None):
            raise ValueError("a client certificate needs both cert and key")

        def read(path):
            return Path(path).read_bytes() if path is not None else None

        return grpc.ssl_channel_credentials(read(self.ca), read(self.key), read(self.cert))


def checked_timeout(timeout: float | None) -> float | None:
    """A call's timeout in seconds, None for no deadline; anything else but a finite number more than 0 is refused
    (gRPC took a negative one as no deadline at all)."""
    if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
        raise ValueError(f"timeout must be a number of seconds more than 0 (None: no deadline), got {timeout!r}")
    return timeout


def read_token(token_file: str | Path | None = None) -> str | None:
    """The bearer token from a file, else from $MHASERVE_TOKEN, else None (whitespace around it dropped)."""
    if token_file is not None:
        return Path(token_file).read_text().strip()
    return os.environ.get(TOKEN_ENV, "").strip() or None


_GRPC_ADDRESS = re.compile(r"ipv[46]:(\[[^\]]+\]:\d+|[^\s:\[]+:\d+)")


def with_remedy(message: str, protocol: str, address: str) -> str:
    """A call that could not be made, led by what to do about it: a port of the other protocol, or nothing
    listening there. Other messages are returned as they are."""
    address = (_GRPC_ADDRESS.search(message) or [None, address])[1]
    if protocol == "grpc" and ("http1.x server" in message or "Expected SETTINGS frame" in message):
        remedy = (f"{address} speaks HTTP/REST, not gRPC: give the gRPC port (default 8001), or call it over HTTP "
                  "(HttpClient; on the command line --protocol http)")  # fmt: skip
    elif protocol == "http" and "BadStatusLine" in message:  # an HTTP/1.1 client at a gRPC (HTTP/2) port
        remedy = (f"{address} speaks gRPC, not HTTP/REST: give the HTTP port (default 8000), or call it over gRPC "
                  "(Client; on the command line drop --protocol http)")  # fmt: skip
    elif "Connection refused" in message:
        remedy = (f"nothing listens at {address}: start the server (mhaserve serve) or give its address (gRPC "
                  "port 8001, HTTP 8000 by default)")  # fmt: skip
    else:
        return message
    said = " ".join("".join(c if c.isprintable() else " " for c in message).split())  # a gRPC frame read as HTTP
    return f"{remedy} ({said})"


class RequestFailed(Exception):
    """A call the server refused, or that could not be made, whichever transport carried it: ``status_name``
    as gRPC names the status, ``message`` the server's words. The gRPC clients raise it as a grpc.RpcError too
    (``code()``, ``details()``), the HTTP client as HttpRequestFailed (``http_status``)."""

    status_name: str = "UNKNOWN"
    message: str = ""

    def __str__(self) -> str:
        return f"{self.status_name}: {self.message}"


@dataclass(frozen=True)
class RepositoryEntry:
    """One row of a server's repository index (Triton's model repository extension): a model's version (empty
    where the model has none the server could read), its state (READY, UNAVAILABLE, LOADING or UNLOADING) and
    why."""

    name: str
    version: str
    state: str
    reason: str = ""


def config_text(config: str | dict) -> str:
    """A load's model configuration as the protocol carries it: Triton's ModelConfig as JSON text."""
    import json

    return config if isinstance(config, str) else json.dumps(config)


@dataclass
class InferResult:
    output: np.ndarray | None
    attn_weights: np.ndarray | None
    id: str = ""
    attn_weights_mean: np.ndarray | None = None  # [B, Lq, Lk], when asked for
    model_version: str = ""  # the version that answered (the newest ready one unless a version was asked for)
    outputs: dict[str, np.ndarray] = field(default_factory=dict)  # every output returned, by name

    @classmethod
    def from_outputs(cls, outputs: dict[str, np.ndarray], id: str = "", model_version: str = "") -> InferResult:
        return cls(
            outputs.get(OUTPUT), outputs.get(ATTN_WEIGHTS), id, outputs.get(ATTN_WEIGHTS_MEAN), model_version, outputs
        )

    @property
    def top_k(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(values, key positions) [B, h', Lq', k] of a top-k or top-p answer."""
        if ATTN_TOP_K_VALUES not in self.outputs:
            return None
        return self.outputs[ATTN_TOP_K_VALUES], self.outputs.get(ATTN_TOP_K_INDICES)

    @property
    def summaries(self) -> dict[str, np.ndarray] | None:
        """Per head and query row [B, h', Lq'] (``WeightsOptions(summaries=True)``): ``entropy`` of its weights in
        nats, ``sink`` (its weight on the first key), ``max`` (its largest weight) and ``max_index`` (that key's
        position, -1 on a row that attends no key)."""
        if not any(name in self.outputs for name in SUMMARY_OUTPUT_NAMES):
            return None
        return {name.removeprefix("attn_weights_"): self.outputs[name] for name in SUMMARY_OUTPUT_NAMES
                if name in self.outputs}  # fmt: skip


def _range_text(window) -> str | None:
    if window is None or isinstance(window, str):
        return window
    if isinstance(window, slice):
        start, stop = window.start, window.stop
    else:
        start, stop = window
    return f"{'' if start is None else start}:{'' if stop is None else stop}"


@dataclass(frozen=True)
class WeightsOptions:
    """What a request asks of the attention weights (the server's ``attn_*`` request parameters): chosen
    ``heads``, query ``rows`` and a key window ``keys`` (``"0:32"``, ``slice(0, 32)`` or ``(0, 32)``), the
    ``top_k`` keys of each row or the fewest holding a fraction ``top_p`` of its mass, ``precision``
    (``"fp32"`` or ``"fp16"``), and ``summaries``: each head's query row summarised over every key (its entropy,
    weight on the first key, largest weight and that key: InferResult.summaries) rather than its weights."""

    heads: tuple[int, ...] | list[int] | None = None
    rows: str | slice | tuple | None = None
    keys: str | slice | tuple | None = None
    top_k: int | None = None
    top_p: float | None = None
    precision: str | None = None
    summaries: bool = False

    @property
    def ranked(self) -> bool:
        return self.top_k is not None or self.top_p is not None

    def parameters(self) -> dict[str, str | int | float]:
        values = {
            "attn_heads": ",".join(map(str, self.heads)) if self.heads is not None else None,
            "attn_rows": _range_text(self.rows),
            "attn_keys": _range_text(self.keys),
            "attn_top_k": self.top_k,
            "attn_top_p": self.top_p,
            "attn_weights_precision": self.precision.upper() if self.precision else None,
        }
        return {name: value for name, value in values.items() if value is not None}


@dataclass(frozen=True)
class SequenceStep:
    """A request's place in a sequence the server keeps (Triton's sequence parameters), and where it goes: the rows
    of keys and values the sequence holds before it (``position``; None: not said)."""

    id: int | str
    start: bool = False
    end: bool = False
    position: int | None = None

    def parameters(self) -> dict[str, int | str | bool]:
        said = {"sequence_id": self.id, "sequence_start": self.start, "sequence_end": self.end}
        return said if self.position is None else {**said, "sequence_position": self.position}


def sequence_lost(error: RequestFailed) -> bool:
    """Whether the server says the sequence is gone (its worker or replica exited, or it was dropped idle)."""
    return error.status_name in ("UNAVAILABLE", "INVALID_ARGUMENT") and (
        "were lost" in error.message or "is not live" in error.message
    )


class Sequence:
    """A sequence kept on the server, stepped with its new rows: ``with client.sequence() as s: s.step(rows)``.
    The first step starts it (``sequence_start``), ``step(rows, end=True)`` answers and ends it; one left without
    an end is dropped by the server after its idle timeout. ``step`` takes ``infer``'s other arguments.

    Each step says where it goes (``sequence_position``, the rows the server holds before it), so a step sent again
    after its answer was lost is refused (ALREADY_EXISTS) rather than applied twice. With ``resume``, the sequence
    keeps every row (and key and value) it sent, and when the server says the sequence was lost (its worker or
    replica exited, or it was dropped idle), it starts it again with all of them and the step's own in one step,
    and answers with that step's rows: its memory grows with the sequence."""

    def __init__(self, client, sequence_id: int | str | None = None, *, resume: bool = False):
        self.client = client
        self.id = sequence_id if sequence_id is not None else f"seq-{uuid.uuid4().hex}"
        self.steps = 0  # answered
        self.position = 0  # the rows of keys and values the server holds for it
        self.ended = False
        self.cross = False  # its first step gave keys: a cross-attention sequence
        self.resume = resume
        self.restarts = 0  # times it was started again after the server lost it (``resume``)
        self._kept: list[tuple[np.ndarray, np.ndarray | None, np.ndarray | None]] = []  # (rows, key, value) sent

    def _next(self, end: bool) -> SequenceStep:
        if self.ended:
            raise ValueError(f"sequence {self.id!r} has ended; start another with client.sequence()")
        return SequenceStep(self.id, start=self.steps == 0, end=end, position=self.position)

    def _answered(self, rows, end: bool, infer: dict) -> None:
        key, value = infer.get("key"), infer.get("value")
        if self.steps == 0:
            self.cross = key is not None
        self.position += key.shape[1] if key is not None else 0 if self.cross else rows.shape[1]
        self.steps += 1
        self.ended = end
        if self.resume:
            self._kept.append((rows, key, value))

    def _restart(self, rows, end: bool, infer: dict) -> tuple[SequenceStep, np.ndarray, dict, int]:
        """The step that starts the sequence again, its query, its other arguments and the query rows before this
        step's: every kept row and this step's (a self-attention sequence), or this step's rows over every kept
        key and value and its own (a cross-attention one)."""
        self.restarts += 1
        again = SequenceStep(self.id, start=True, end=end, position=0)
        if not self.cross:
            kept = [r for r, _, _ in self._kept]
            return again, np.concatenate([*kept, rows], axis=1), infer, sum(r.shape[1] for r in kept)
        given = [(k, v) for _, k, v in self._kept if k is not None]
        if infer.get("key") is not None:
            given.append((infer["key"], infer["value"]))
        keys, values = (np.concatenate(part, axis=1) for part in zip(*given, strict=True))
        return again, rows, {**infer, "key": keys, "value": values}, 0

    def _resumed(self, result: InferResult, query, end: bool, infer: dict, cut: int) -> InferResult:
        """The sequence as after its restart (one step, of everything), and the answer cut to this step's query rows
        (axis 1 of the output and the heads' mean, axis 2 of the other weights' outputs)."""
        self.steps, self.position, self._kept = 0, 0, []
        self._answered(query, end, infer)
        if not cut:
            return result
        first_axis = (OUTPUT, ATTN_WEIGHTS_MEAN)
        outputs = {
            name: array[:, cut:] if name in first_axis else array[:, :, cut:] for name, array in result.outputs.items()
        }
        return InferResult.from_outputs(outputs, result.id, result.model_version)

    def step(self, rows, *, end: bool = False, **infer) -> InferResult:
        step = self._next(end)
        try:
            result = self.client.infer(rows, sequence=step, **infer)
        except RequestFailed as error:
            if not (self.resume and not step.start and sequence_lost(error)):
                raise
            again, query, infer_again, cut = self._restart(rows, end, infer)
            result = self.client.infer(query, sequence=again, **infer_again)
            return self._resumed(result, query, end, infer_again, cut)
        self._answered(rows, end, infer)
        return result

    def __enter__(self) -> Sequence:
        return self

    def __exit__(self, *exc) -> None:
        pass


class AsyncSequence(Sequence):
    """As Sequence, for AsyncClient: ``async with client.sequence() as s: await s.step(rows)``."""

    async def step(self, rows, *, end: bool = False, **infer) -> InferResult:
        step = self._next(end)
        try:
            result = await self.client.infer(rows, sequence=step, **infer)
        except RequestFailed as error:
            if not (self.resume and not step.start and sequence_lost(error)):
                raise
            again, query, infer_again, cut = self._restart(rows, end, infer)
            result = await self.client.infer(query, sequence=again, **infer_again)
            return self._resumed(result, query, end, infer_again, cut)
        self._answered(rows, end, infer)
        return result

    async def __aenter__(self) -> AsyncSequence:
        return self

    async def __aexit__(self, *exc) -> None:
        pass


def request_inputs(query, key=None, value=None, mask=None) -> list[tuple[str, np.ndarray]]:
    """The inputs a request carries, whatever the wire: the given ones, contiguous, FP32 but the mask (as given).
    Each may be a NumPy array, anything NumPy reads as one, or a torch.Tensor as a model leaves it (needing grad, on
    a GPU, bfloat16)."""
    tensors = {"query": query, "key": key, "value": value, "mask": mask}
    return [
        (name, np.ascontiguousarray(_values_of(array), dtype=np.float32 if name != "mask" else None))
        for name, array in tensors.items()
        if array is not None
    ]


def _values_of(array):
    """A torch.Tensor's values on the host, in a dtype NumPy has (bfloat16 widened to float32); anything else as
    it is. Read by its methods: the client never imports torch."""
    if not (hasattr(array, "detach") and hasattr(array, "cpu") and hasattr(array, "numpy")):
        return array
    array = array.detach().cpu()
    if str(array.dtype) == "torch.bfloat16":
        array = array.float()
    return array.numpy()


def request_parameters(
    weights: WeightsOptions | None, sequence: SequenceStep | None, priority: int = 0
) -> dict[str, object]:
    """A request's parameters: how its weights are shaped, its sequence step, and its priority level where one is
    asked (Triton's ``priority``: 1 first, where the model has levels; 0 asks none, the model's default)."""
    if isinstance(priority, bool) or not isinstance(priority, int) or priority < 0:
        raise ValueError(f"priority must be a level, an integer of 0 or more; got {priority!r}")
    return {**(weights.parameters() if weights else {}), **(sequence.parameters() if sequence else {}),
            **({"priority": priority} if priority else {})}  # fmt: skip


def requested_outputs(attn_weights: bool, attn_weights_mean: bool, weights: WeightsOptions | None = None) -> list[str]:
    """The output, every head's weights unless not wanted, their mean over heads when asked for, and the top-k
    keys' weights and positions when ``weights`` ranks them."""
    ranked = [ATTN_TOP_K_VALUES, ATTN_TOP_K_INDICES] if weights is not None and weights.ranked else []
    summarised = list(SUMMARY_OUTPUT_NAMES) if weights is not None and weights.summaries else []
    return [OUTPUT] + [ATTN_WEIGHTS] * attn_weights + [ATTN_WEIGHTS_MEAN] * attn_weights_mean + ranked + summarised
